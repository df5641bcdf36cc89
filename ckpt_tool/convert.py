"""``convert``: source headers → plan → streamed, atomic, resumable output with index and manifest.

Output layout (SPEC.md): OUT/model and OUT/mtp each hold ``model-rank-{r}-part-{p}.safetensors``,
``index.json`` and ``config.json``; OUT/ckpt-tool.json is the manifest, written last with
``"complete": true``. Until then, OUT/.ckpt-tool-journal.json records finished files so a rerun with
the same source and options skips them (after re-checking their checksum).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .errors import OutputError
from .plan import Options, OutFile, Plan, plan_conversion
from .source import Checkpoint, open_checkpoint
from .writer import ProgressFn, SourceFiles, file_size, sha256_file, write_output_file

log = logging.getLogger(__name__)

MANIFEST = "ckpt-tool.json"
JOURNAL = ".ckpt-tool-journal.json"
LOCK = ".ckpt-tool.lock"
COMPONENTS = ("model", "mtp")


@dataclass
class ConvertResult:
    plan: Plan
    out: Path
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_written: int = 0
    warnings: list[str] = field(default_factory=list)


def source_fingerprint(ckpt: Checkpoint) -> dict:
    files = {f: {"size": h.file_size, "header_sha256": h.header_sha256} for f, h in sorted(ckpt.shards.items())}
    cfg = (ckpt.root / "config.json").read_bytes()
    return {"root": str(ckpt.root), "files": files, "config_sha256": hashlib.sha256(cfg).hexdigest()}


def run_fingerprint(source: dict, opts: Options) -> str:
    doc = {"tool": __version__, "files": source["files"], "config": source["config_sha256"], "options": opts.as_dict()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def check_paths(src_root: Path, out: Path) -> None:
    s, o = src_root.resolve(), out.resolve()
    if s == o:
        raise OutputError(f"{out}: OUT is the source folder; choose a new folder (the source is never written)")
    if s in o.parents:
        raise OutputError(f"{out}: OUT lies inside the source folder {src_root}; choose a folder outside it")
    if o in s.parents:
        raise OutputError(f"{out}: the source folder {src_root} lies inside OUT; choose another OUT")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder")


def _write_json_atomic(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class OutputLock:
    """An exclusive lock on OUT, so two converts never interleave their writes."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        self.fh = None

    def __enter__(self) -> OutputLock:
        self.fh = open(self.path, "a+")
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.close()
            raise OutputError(f"{self.path.parent}: another ckpt-tool convert is writing this folder (lock {LOCK} is held); wait for it to finish") from None
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.fh is not None
        fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
        self.fh.close()


def read_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _clear_previous(out: Path) -> None:
    """--force: remove what an earlier conversion wrote (only our own files).

    The manifest goes first: a kill half-way must never leave "complete": true over missing files.
    """
    for name in (MANIFEST, JOURNAL):
        (out / name).unlink(missing_ok=True)
    for comp in COMPONENTS:
        d = out / comp
        if d.is_dir():
            shutil.rmtree(d)


def index_doc(plan: Plan, component: str) -> dict:
    ranks: dict[str, dict[str, str]] = {}
    total = 0
    for f in plan.files:
        if f.component != component:
            continue
        ranks.setdefault(str(f.rank), {})
        for t in f.tensors:
            ranks[str(f.rank)][t.name] = f.name
            total += t.nbytes
    return {"tp": plan.options.tp, "ranks": ranks, "total_size": total}


def convert(
    src: Path,
    out: Path,
    opts: Options,
    *,
    force: bool = False,
    workers: int = 1,
    progress: ProgressFn | None = None,
    on_plan=None,
) -> ConvertResult:
    """Convert ``src`` into ``out``. Plans (and fails) before writing anything."""
    t0 = time.perf_counter()
    ckpt = open_checkpoint(src)
    config = ckpt.require_config()
    check_paths(ckpt.root, out)
    plan = plan_conversion(config, ckpt.tensors, opts)
    if on_plan:
        on_plan(plan)
    source = source_fingerprint(ckpt)
    fingerprint = run_fingerprint(source, opts)

    out.mkdir(parents=True, exist_ok=True)
    result = ConvertResult(plan, out)
    with OutputLock(out):
        manifest = read_manifest(out)
        if manifest is not None and manifest.get("complete"):
            if not force:
                raise OutputError(
                    f"{out}: holds a finished conversion ({MANIFEST} is complete); pass --force to overwrite it, or choose a new OUT"
                )
            _clear_previous(out)
        journal_path = out / JOURNAL
        journal = _read_journal(journal_path)
        if journal and journal.get("fingerprint") != fingerprint:
            if not force:
                raise OutputError(
                    f"{out}: holds an unfinished conversion of another source or with other options; rerun with the "
                    "same SRC and options to resume it, or pass --force to start over"
                )
            _clear_previous(out)
            journal = None
        if journal is None:
            journal = {"fingerprint": fingerprint, "files": {}}
            _write_json_atomic(journal_path, journal)
        for comp in COMPONENTS:
            if any(f.component == comp for f in plan.files):
                (out / comp).mkdir(exist_ok=True)
                for stale in (out / comp).glob(".*.tmp"):
                    stale.unlink()

        todo: list[OutFile] = []
        for f in plan.files:
            dest = out / f.relpath
            done = journal["files"].get(f.relpath)
            if done and dest.is_file() and dest.stat().st_size == done["size"] == file_size(f) and sha256_file(dest) == done["sha256"]:
                result.skipped.append(f.relpath)
                if progress:
                    progress(done["size"])
                continue
            todo.append(f)

        files = SourceFiles(ckpt.root)
        import threading

        jlock = threading.Lock()

        def work(f: OutFile) -> None:
            size, digest = write_output_file(f, out / f.relpath, files, plan.sources, progress, result.warnings)
            with jlock:
                journal["files"][f.relpath] = {"size": size, "sha256": digest}
                _write_json_atomic(journal_path, journal)
                result.written.append(f.relpath)
                result.bytes_written += size

        try:
            if workers <= 1:
                for f in todo:
                    work(f)
            else:
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    for fut in [pool.submit(work, f) for f in todo]:
                        fut.result()
        finally:
            files.close()

        for comp in COMPONENTS:
            if any(f.component == comp for f in plan.files):
                _write_json_atomic(out / comp / "index.json", index_doc(plan, comp))
                shutil.copyfile(ckpt.root / "config.json", out / comp / "config.json")
        _write_json_atomic(out / MANIFEST, manifest_doc(plan, source, fingerprint, journal["files"]))
        journal_path.unlink(missing_ok=True)
    result.seconds = time.perf_counter() - t0
    return result


def _read_journal(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a torn journal: start over, files get rewritten
    return doc if isinstance(doc, dict) and "files" in doc else None


def manifest_doc(plan: Plan, source: dict, fingerprint: str, outputs: dict) -> dict:
    return {
        "tool": "ckpt-tool",
        "version": __version__,
        "profile": plan.options.profile,
        "options": plan.options.as_dict(),
        "fingerprint": fingerprint,
        "source": source,
        "outputs": {f.relpath: {**outputs[f.relpath], "rank": f.rank, "tensors": len(f.tensors)} for f in plan.files},
        "tensor_count": plan.tensor_count,
        "total_bytes": plan.total_bytes,
        "materialized": plan.materialized,
        "dropped": plan.dropped,
        "deviations": list(plan.deviations),
        "complete": True,
    }
