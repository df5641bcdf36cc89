"""``convert``: source headers → plan → streamed, atomic, resumable output with index and manifest.

The OUT format is :mod:`ckpt_tool.output.layout`. The manifest is written last with ``"complete": true``;
until then, OUT/.ckpt-tool-journal.json records finished files (and the identity of the source files each
was made from) so a rerun with the same source and options skips them (after re-checking their checksum)
unless a source file they read has changed since. A source file that changes during the run fails it before
the file of OUT that read it is renamed into place, or before the manifest (:mod:`ckpt_tool.checkpoint.identity`).
OUT/ckpt-tool-source.json keeps the source's raw safetensors headers (named and hashed in the manifest) so
``unconvert`` can rebuild the original checkpoint from OUT alone.

Scale-out: ``ranks`` restricts the run to some TP ranks (it still finishes with a manifest, which
records the ranks); ``shard=(K, M)`` writes only the planned files ``i % M == K`` of the selection,
journals them in ``.ckpt-tool-journal-{K}-of-{M}.json`` under its own lock and writes no manifest,
so M machines can fill one shared OUT; ``finalize=True`` then checks every planned file against the
journals' checksums and writes the index files, config copies, source layout and manifest.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_tool.checkpoint.identity import FileIdentity, identity_of
from ckpt_tool.checkpoint.lockstep import Lockstep
from ckpt_tool.checkpoint.reader import sha256_file
from ckpt_tool.checkpoint.source import Checkpoint, open_checkpoint
from ckpt_tool.errors import CheckpointError, OutputError
from ckpt_tool.mapping.plan import Options, OutFile, Plan
from ckpt_tool.mapping.selection import PlannedRun, plan_run
from ckpt_tool.output.layout import (
    COMPONENTS,
    JOURNAL_RE,
    LOCK,
    MANIFEST,
    SHARD_LOCK_RE,
    SOURCE_LAYOUT,
    OutputLock,
    index_doc,
    journal_name,
    journals,
    lock_name,
    manifest_doc,
    read_journal,
    read_manifest,
    run_fingerprint,
    source_fingerprint,
    source_layout,
)  # fmt: skip
from ckpt_tool.output.twins import Twin, find_twins, twins_of
from ckpt_tool.output.writer import (
    MAX_DEFAULT_WORKERS,
    ProgressFn,
    SourceFiles,
    default_workers,
    file_size,
    files_fed,
    output_error,
    source_reads,
    write_output_file,
)
from ckpt_tool.processes import results_in_steps, settle_in_steps, stop_signals_to_main

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """The source as this run planned from it: the checkpoint, its fingerprint (the manifest's ``source``) and the
    run's, and each file's identity then (recorded in the manifest for a local source only: a hub source is pinned
    by its commit)."""

    ckpt: Checkpoint
    doc: dict
    fingerprint: str
    identities: dict[str, FileIdentity]
    record_identity: bool


@dataclass
class ConvertResult:
    plan: Plan  # the plan of the files this run is responsible for (the whole plan unless ranks/shard select)
    out: Path
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_written: int = 0
    warnings: list[str] = field(default_factory=list)
    partial: bool = False  # a --shard-count run: files and journal written, no manifest
    finalized: bool = False  # a manifest with "complete": true was written by this run
    fetched: tuple[int, int] | None = None  # a streamed hub source: (bytes fetched, range requests)


def check_paths(src_root: Path, out: Path) -> None:
    s, o = src_root.resolve(), out.resolve()
    if s == o:
        raise OutputError(f"{out}: OUT is the source folder; choose a new folder (the source is never written)")
    if s in o.parents:
        raise OutputError(f"{out}: OUT lies inside the source folder {src_root}; choose a folder outside it")
    if o in s.parents:
        raise OutputError(f"{out}: the source folder {src_root} lies inside OUT; choose another OUT")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder; give OUT a folder path, or one that does not exist yet")
    foreign = _foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(
            f"{out}: is a non-empty folder that is not a ckpt-tool OUT (it holds {shown}); choose a new or empty "
            "folder "
            "(--force only replaces an earlier ckpt-tool OUT, never other files)"
        )


def _foreign_entries(out: Path) -> list[str]:
    """What keeps ``out`` from being ours: its entries, unless it is empty or carries our manifest, lock or journal."""
    if not out.is_dir():
        return []
    names = sorted(p.name for p in out.iterdir())
    ours = {MANIFEST, LOCK, SOURCE_LAYOUT}
    if any(n in ours or JOURNAL_RE.match(n) or SHARD_LOCK_RE.match(n) for n in names):
        return []
    return [n for n in names if n not in COMPONENTS]


def _write_json_atomic(path: Path, doc: dict) -> None:
    _write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=False) + "\n")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise output_error(exc, path) from None
    except BaseException:  # a stop signal (KeyboardInterrupt, Preempted) mid-write: no temporary left behind
        tmp.unlink(missing_ok=True)
        raise


def _clear_previous(out: Path) -> None:
    """--force: remove what an earlier conversion wrote (only our own files). The manifest goes first,
    so an interrupted clear never leaves a complete manifest over missing files."""
    (out / MANIFEST).unlink(missing_ok=True)
    for j in journals(out):
        j.unlink(missing_ok=True)
    (out / SOURCE_LAYOUT).unlink(missing_ok=True)
    for comp in COMPONENTS:
        d = out / comp
        if d.is_dir():
            shutil.rmtree(d)


def _open(src: Path | Checkpoint) -> Checkpoint:
    return src if isinstance(src, Checkpoint) else open_checkpoint(src)


def convert(
    src: Path | Checkpoint,
    out: Path,
    opts: Options,
    *,
    force: bool = False,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    on_plan=None,
    ranks: Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
    finalize: bool = False,
) -> ConvertResult:
    """Convert ``src`` (a path, or an already opened :class:`Checkpoint`) into ``out``.

    Plans (and fails) before writing anything. ``ranks`` / ``shard`` / ``finalize``: see the module doc.
    """
    t0 = time.perf_counter()
    ckpt = _open(src)
    config = ckpt.require_config()
    check_paths(ckpt.root, out)
    shard_index, shard_count = shard or (0, 1)
    # the manifest/index cover the rank selection; a shard only writes its part of it (finalize: all of it)
    run = plan_run(config, ckpt.tensors, opts, ranks=ranks, shard=(0, 1) if finalize else (shard_index, shard_count))
    if on_plan and not finalize:  # finalize writes no tensor bytes: nothing to show progress for
        on_plan(run.part)
    doc = source_fingerprint(ckpt)
    fingerprint = run_fingerprint(doc, run.whole.options)  # the options as the plan settled them (vllm_series)
    identities = _identities(ckpt)
    source = _Source(ckpt, doc, fingerprint, identities, record_identity=not isinstance(src, Checkpoint))
    if finalize:
        result = _finalize(source, out, run.covered, ranks)
    else:
        result = _write_run(source, out, run, ranks, shard, force=force, workers=workers, progress=progress)
    fetched = getattr(ckpt.remote, "fetched", None)  # a streamed hub source: what crossed the network
    if fetched is not None:
        result.fetched = fetched()
    result.seconds = time.perf_counter() - t0
    return result


def _write_run(
    source: _Source,
    out: Path,
    run: PlannedRun,
    ranks: Sequence[int] | None,
    shard: tuple[int, int] | None,
    *,
    force: bool,
    workers: int | None,
    progress: ProgressFn | None,
) -> ConvertResult:
    """Write the files of ``run.part`` into ``out`` under its lock, skipping those an earlier run of the same
    conversion finished; then, unless a scale-out shard, the index, config, serving files and manifest."""
    ckpt, plan = source.ckpt, run.part
    partial = shard is not None and shard[1] > 1
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"{out}: cannot create the output folder ({exc.strerror or exc}); choose a folder you can write"
        ) from None
    result = ConvertResult(plan, out, partial=partial)
    with OutputLock(out, lock_name(shard)):
        journal_path = out / journal_name(shard)
        journal = _start_journal(out, journal_path, plan, source.fingerprint, force=force, partial=partial)
        todo = _unfinished(out, plan, journal, journal_path, source, result, progress)
        twins: dict[tuple[str, str], Twin] = {}
        if ckpt.remote is not None:  # the reads of the files this run writes: only chunks read again are spooled
            twins = find_twins(rank_groups(todo), plan.sources)  # (the draft's embedding and head: from the target's)
            ckpt.remote.spool_in(out, functools.partial(source_reads, todo, plan.sources, twins))
        watched = source.identities if ckpt.remote is None else {}  # a streamed source's bytes are its commit's
        with SourceFiles(ckpt.root, watched, ckpt.open_bytes(sequential=True)) as files:
            lockstep = ckpt.remote is not None  # every source byte crosses the network: each once, for all ranks
            _write_files(
                out,
                plan,
                todo,
                files,
                journal,
                journal_path,
                source.identities,
                result,
                progress,
                workers,
                lockstep,
                twins,
            )
        if partial:
            return result
        _write_final(source, out, run.covered, journal["files"], ranks)
        journal_path.unlink(missing_ok=True)
        _drop_journals(out, source.fingerprint)
        result.finalized = True
    return result


def _start_journal(out: Path, journal_path: Path, plan: Plan, fingerprint: str, *, force: bool, partial: bool) -> dict:
    """The run's journal: an earlier run's of the same conversion (resumed), else a new one. A finished OUT or one of
    another conversion is refused without ``force`` (with it: cleared; a shard clears only its own files). Then the
    component folders this run writes exist and hold none of its temporaries."""
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("complete"):
        if not force:
            raise OutputError(
                f"{out}: holds a finished conversion ({MANIFEST} is complete); pass --force to overwrite it, or "
                "choose a new OUT"
            )
        if partial:  # never delete what other shards wrote: drop the manifest, rewrite our own files
            (out / MANIFEST).unlink(missing_ok=True)
            for f in plan.files:
                (out / f.relpath).unlink(missing_ok=True)
        else:
            _clear_previous(out)
    journal = read_journal(journal_path)
    if journal and journal.get("fingerprint") != fingerprint:
        if not force:
            raise OutputError(
                f"{out}: holds an unfinished conversion of another source or with other options; rerun with the "
                "same SRC and options to resume it, or pass --force to start over"
            )
        if partial:
            for f in plan.files:
                (out / f.relpath).unlink(missing_ok=True)
        else:
            _clear_previous(out)
        journal = None
    if journal is None:
        journal = {"fingerprint": fingerprint, "files": {}}
        _write_json_atomic(journal_path, journal)
    for comp in COMPONENTS:
        if any(f.component == comp for f in plan.files):
            (out / comp).mkdir(exist_ok=True)
    for f in plan.files:  # only our own temporaries: other shards may be writing theirs
        (out / f.component / f".{f.name}.tmp").unlink(missing_ok=True)
    return journal


def _unfinished(
    out: Path,
    plan: Plan,
    journal: dict,
    journal_path: Path,
    source: _Source,
    result: ConvertResult,
    progress: ProgressFn | None,
) -> list[OutFile]:
    """The planned files still to write: not those any run of this same conversion (another shard, an earlier run)
    finished from the source files as they are now, whose size and checksum still hold (noted as skipped)."""
    known = _recorded_files(out, source.fingerprint)
    known.update(journal["files"])
    todo: list[OutFile] = []
    for f in plan.files:
        dest = out / f.relpath
        done = known.get(f.relpath)
        if (
            done
            and _made_from(done, files_fed(f, plan.sources), source.identities) is None
            and dest.is_file()
            and dest.stat().st_size == done["size"] == file_size(f)
            and sha256_file(dest) == done["sha256"]
        ):
            result.skipped.append(f.relpath)
            if f.relpath not in journal["files"]:
                journal["files"][f.relpath] = done
                _write_json_atomic(journal_path, journal)
            if progress:
                progress(done["size"])
            continue
        todo.append(f)
    return todo


def _write_files(
    out: Path,
    plan: Plan,
    todo: list[OutFile],
    files: SourceFiles,
    journal: dict,
    journal_path: Path,
    identities: dict[str, FileIdentity],
    result: ConvertResult,
    progress: ProgressFn | None,
    workers: int | None,
    lockstep: bool = False,
    twins: dict[tuple[str, str], Twin] | None = None,
) -> None:
    """Write ``todo``, each file journaled once it is in place: from a streamed source in rank groups kept in
    lockstep, else ``workers`` files at once. A failed file stops files not yet started. ``twins``: tensors copied
    from a file an earlier rank group wrote (``output.twins``; only in lockstep, where the groups go one by one)."""
    jlock = threading.Lock()
    failed = threading.Event()

    def work(f: OutFile, pace: Callable[[int], None] | None = None) -> None:
        if failed.is_set():
            return
        try:
            copies = {name: (out / twin.relpath, twin.offset) for name, twin in twins_of(f, twins or {}).items()}
            size, digest = write_output_file(
                f, out / f.relpath, files, plan.sources, progress, result.warnings, pace, lockstep, copies
            )
        except BaseException:
            failed.set()
            raise
        fed = {file: identities[file].as_dict() for file in files_fed(f, plan.sources)}
        with jlock:
            journal["files"][f.relpath] = {"size": size, "sha256": digest, "sources": fed}
            _write_json_atomic(journal_path, journal)
            result.written.append(f.relpath)
            result.bytes_written += size

    if workers is None:
        workers = default_workers(len(todo))
    if lockstep:
        _write_in_lockstep(todo, work, failed)
    elif workers <= 1:
        for f in todo:
            work(f)
    else:
        with ThreadPoolExecutor(max_workers=workers, initializer=stop_signals_to_main) as pool:
            futures = [pool.submit(work, f) for f in todo]
            try:
                results_in_steps(futures)  # waits in steps: a stop signal's handler runs meanwhile
            except BaseException:
                failed.set()  # (Ctrl-C lands here, not in a worker) files in flight finish, no new one starts
                settle_in_steps(futures)
                raise


LOCKSTEP_WINDOW = 32 * 1024 * 1024
"""How far (bytes of its own file) a rank's writer may run ahead of the slowest of its group: at tp 8 the group's
source reads then span about 8 x this, which a streamed source's memory cache and spool hold (``HubRangeReader``)."""


def rank_groups(files: Sequence[OutFile], size: int = MAX_DEFAULT_WORKERS) -> list[list[OutFile]]:
    """``files`` in groups cut from the same source tensors: the ranks of one component's part (at most ``size``
    together, each with its writer's ring buffers: ``MAX_BUFFERS``)."""
    by_part: dict[tuple[str, int], list[OutFile]] = {}
    for f in files:
        by_part.setdefault((f.component, f.part), []).append(f)
    return [group[i : i + size] for group in by_part.values() for i in range(0, len(group), size)]


def _write_in_lockstep(todo: list[OutFile], work: Callable, failed: threading.Event) -> None:
    """Each group of :func:`rank_groups` written at once, one thread a file, kept within ``LOCKSTEP_WINDOW`` of
    each other (:class:`Lockstep`): the ranks then ask for each source byte close together, and the first fetch
    of it serves them all."""
    for group in rank_groups(todo):
        step = Lockstep(len(group), LOCKSTEP_WINDOW)

        def member(i: int, f: OutFile, step: Lockstep = step) -> None:
            try:
                work(f, functools.partial(step.advance, i))
            finally:
                step.done(i)

        with ThreadPoolExecutor(max_workers=len(group), initializer=stop_signals_to_main) as pool:
            futures = [pool.submit(member, i, f) for i, f in enumerate(group)]
            try:
                results_in_steps(futures)
            except BaseException:
                failed.set()
                settle_in_steps(futures)
                raise


def _identities(ckpt: Checkpoint) -> dict[str, FileIdentity]:
    """Each source file as it was when its header was read (what the plan is made from); of a streamed source, its
    size at the commit (the commit is in the run's fingerprint)."""
    if ckpt.remote is not None:
        return {file: FileIdentity(header.file_size, 0, 0, 0) for file, header in ckpt.shards.items()}
    found = {}
    for file, header in ckpt.shards.items():
        identity = header.identity or identity_of(ckpt.root / file)  # a header not read from this file: now
        if identity is None:
            raise CheckpointError(
                f"{ckpt.root / file}: removed since its header was read; rerun once the source is whole again"
            )
        found[file] = identity
    return found


def _made_from(entry: dict, fed: list[str], identities: dict[str, FileIdentity]) -> str | None:
    """Why the journal ``entry`` of a finished file was not made from the source files ``fed`` as they are
    now (None: it was). Another run made it, maybe on another machine: size and mtime are compared."""
    recorded = entry.get("sources")
    if not isinstance(recorded, dict):
        return "its journal entry does not say which source files it was made from"
    for file in fed:
        was = FileIdentity.from_dict(recorded.get(file)) if isinstance(recorded.get(file), dict) else None
        if was is None:
            return f"its journal entry does not record {file}"
        said = was.changes_since(identities[file])
        if said:
            return f"{file} changed since it was made ({'; '.join(said)})"
    return None


def _recorded_files(out: Path, fingerprint: str) -> dict[str, dict]:
    """{relpath: {size, sha256, sources}} from every journal in OUT that belongs to this conversion."""
    files: dict[str, dict] = {}
    for path in journals(out):
        doc = read_journal(path)
        if doc and doc.get("fingerprint") == fingerprint:
            files.update(doc["files"])
    return files


# Weight files stay behind: what vLLM loads comes from our per-rank parts.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def serving_files(root: Path) -> list[str]:
    """The source's top-level non-weight files ``vllm serve OUT/model`` needs besides the weights.

    Tokenizer files, generation_config.json, chat template, README/LICENSE, ... : every regular file
    (a hub snapshot's symlinks followed) except weights, weight indexes, config.json (copied to both
    components) and hidden files. Sub-folders (e.g. DeepSeek's ``inference/`` code) are not needed.
    """
    names = []
    for p in sorted(root.iterdir()):
        n = p.name
        if n.startswith(".") or n == "config.json" or n.endswith(_WEIGHT_SUFFIXES) or n.endswith(".index.json"):
            continue
        if p.is_file():
            names.append(n)
    return names


def _write_final(source: _Source, out: Path, plan: Plan, outputs: dict, ranks: Sequence[int] | None) -> None:
    """Index files, config copies, serving files, the source layout, then the manifest (last: it says "complete").

    The manifest is written only while every source file OUT was made from is still the file the plan saw.
    """
    ckpt = source.ckpt
    copied: dict[str, dict] = {}
    for comp in COMPONENTS:
        if any(f.component == comp for f in plan.files):
            (out / comp).mkdir(exist_ok=True)
            _write_json_atomic(out / comp / "index.json", index_doc(plan, comp))
            shutil.copyfile(ckpt.root / "config.json", out / comp / "config.json")
            if sha256_file(out / comp / "config.json") != source.doc["config_sha256"]:
                raise CheckpointError(
                    f"{ckpt.root / 'config.json'}: changed while converting; OUT is not complete — rerun the same "
                    "command once the source is stable (pass --force if it now describes another model)"
                )
            if comp == "model":
                for name in serving_files(ckpt.root):
                    shutil.copyfile(ckpt.root / name, out / comp / name)
                    copied[f"{comp}/{name}"] = {
                        "size": (out / comp / name).stat().st_size,
                        "sha256": sha256_file(out / comp / name),
                    }
    layout = source_layout(ckpt)
    _write_text_atomic(out / SOURCE_LAYOUT, json.dumps(layout, separators=(",", ":")) + "\n")
    fed = sorted({file for f in plan.files for file in files_fed(f, plan.sources)})
    recorded = source.doc
    if source.record_identity:
        recorded = {**recorded, "identity": {file: source.identities[file].as_dict() for file in fed}}
    outputs = {relpath: {"size": o["size"], "sha256": o["sha256"]} for relpath, o in outputs.items()}
    doc = manifest_doc(plan, recorded, source.fingerprint, outputs)
    doc["source_layout"] = {"file": SOURCE_LAYOUT, "sha256": sha256_file(out / SOURCE_LAYOUT)}
    doc["serving_files"] = copied
    if ranks is not None:
        doc["ranks"] = sorted(set(ranks))
    doc["complete"] = doc.pop("complete")  # keep "complete" the last key
    with SourceFiles(ckpt.root, source.identities if ckpt.remote is None else {}) as files:
        files.check_unchanged(fed)  # the last word before "complete"
    _write_json_atomic(out / MANIFEST, doc)


def _finalize(source: _Source, out: Path, plan: Plan, ranks: Sequence[int] | None) -> ConvertResult:
    """Check every planned file against the shard journals and write the final index/config/manifest."""
    result = ConvertResult(plan, out)
    if not out.is_dir():
        raise OutputError(f"{out}: no such folder; run the convert shards (--shard-index K --shard-count M) first")
    with OutputLock(out):
        manifest = read_manifest(out)
        if manifest is not None and manifest.get("complete"):
            if manifest.get("fingerprint") == source.fingerprint and manifest.get("ranks") == (
                sorted(set(ranks)) if ranks is not None else None
            ):
                result.skipped = [f.relpath for f in plan.files]
                return result  # already finalized: nothing to do
            raise OutputError(
                f"{out}: holds a finished conversion of another source or with other options; choose a new OUT"
            )
        recorded = _recorded_files(out, source.fingerprint)
        problems: list[str] = []
        for f in plan.files:
            dest = out / f.relpath
            rec = recorded.get(f.relpath)
            if not dest.is_file():
                problems.append(f"{f.relpath}: missing part (planned file not in OUT); run the shard that writes it")
            elif rec is None:
                problems.append(
                    f"{f.relpath}: not recorded by any journal of this conversion (its shard did not finish); rerun "
                    "that shard"
                )
            elif dest.stat().st_size != rec["size"] or dest.stat().st_size != file_size(f):
                problems.append(
                    f"{f.relpath}: size {dest.stat().st_size} differs from the journal's {rec['size']}; rerun its shard"
                )
            elif (why := _made_from(rec, files_fed(f, plan.sources), source.identities)) is not None:
                problems.append(f"{f.relpath}: made from another state of the source: {why}; rerun its shard")
            elif sha256_file(dest) != rec["sha256"]:
                problems.append(
                    f"{f.relpath}: sha256 differs from the journal's; the file changed after it was written — rerun "
                    "its shard"
                )
            else:
                result.skipped.append(f.relpath)
        if problems:
            more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
            raise OutputError(f"{out}: cannot finalize: {problems[0]}{more}")
        outputs = {f.relpath: recorded[f.relpath] for f in plan.files}
        _write_final(source, out, plan, outputs, ranks)
        _drop_journals(out, source.fingerprint)
        result.finalized = True
    return result


def _drop_journals(out: Path, fingerprint: str) -> None:
    """After the manifest: the journals of this conversion and the shards' lock files are done with."""
    for j in journals(out):
        doc = read_journal(j)
        if doc is not None and doc.get("fingerprint") == fingerprint:
            j.unlink(missing_ok=True)
    for lock in out.iterdir():
        if SHARD_LOCK_RE.match(lock.name):
            lock.unlink(missing_ok=True)
