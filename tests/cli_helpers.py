"""Helpers several test modules share: run the CLI in-process, fingerprint a folder tree, list what a rank of OUT
holds."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from safetensors import safe_open

from ckpt_tool.cli.entry import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``ckpt-tool ARGS`` in this process: (exit code, stdout, stderr) of just this call."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def snapshot(root: Path) -> dict[str, str]:
    """relpath -> sha256 (files), 'dir' (folders) or 'link:<target>' for everything under ``root``."""
    snap: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        for name in dirnames:
            p = d / name
            snap[str(p.relative_to(root))] = f"link:{os.readlink(p)}" if p.is_symlink() else "dir"
        for name in filenames:
            p = d / name
            if p.is_symlink():
                snap[str(p.relative_to(root))] = f"link:{os.readlink(p)}"
                continue
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
            snap[str(p.relative_to(root))] = h.hexdigest()
    return snap


def rank_keys(out: Path, component: str, rank: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every key in ``out/<component>``'s files for ``rank``: its dtype and shape, from the headers."""
    keys = {}
    for path in sorted((out / component).glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():  # noqa: SIM118
                sl = f.get_slice(k)
                keys[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return keys
