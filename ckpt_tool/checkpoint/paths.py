"""Where a local source's parts are: its folder, index file, shard list and config."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram_vocab import engram_vocab_problem
from ckpt_tool.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"


# What a path that is there but is not a regular file is, in words (os.stat follows symlinks, as open would).
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def not_a_regular_file(path: Path) -> str | None:
    """None when ``path`` is a regular file (or a symlink to one); else what it is: "missing" when nothing is
    there (a dangling symlink included), or "a folder", "a named pipe", ... Only stats: opening a named pipe to
    look would block until a writer came."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def resolve_layout(src: Path) -> tuple[Path, Path | None, list[str] | None]:
    """Find (root folder, index path or None, explicit shard list or None) for a local source."""
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or folder")
    if src.is_dir():
        index = src / INDEX_NAME
        return src, (index if index.is_file() else None), None
    if src.name.endswith(".index.json") or src.suffix == ".json":
        return src.parent, src, None
    if src.suffix == ".safetensors":
        return src.parent, None, [src.name]
    raise CheckpointError(f"{src}: not a folder, an index .json or a .safetensors file")


def load_config(root: Path, *, need_config: bool = True) -> tuple[V4Config | None, str | None]:
    """(config, None), or with ``need_config=False`` (None, why not) when config.json is absent or bad."""
    try:
        config = V4Config.load(root / "config.json")
        problem = engram_vocab_problem(config, root)  # a size no tensor shows: the tokenizer's (engram_vocab)
        if problem is not None:
            raise CheckpointError(problem)
        return config, None
    except CheckpointError as exc:
        if need_config:
            raise
        return None, str(exc)
