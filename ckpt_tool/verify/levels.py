"""``verify``: prove a converted checkpoint right, level by level.

1. structure — from headers and the manifest: the output files, tensor names, dtypes, shapes and rank
   sets are exactly what the rules give for the source and the recorded options; index.json agrees;
   every file's size and sha256 match the manifest; the source is the one that was converted.
2. values — every output tensor re-derived from the source bytes and compared exactly: byte-equal for
   renames/slices/fusions/stacks, value-equal for E8M0 → float32; the engine's zero padding (shared
   experts at a tp their blocks do not divide) must hold the zero element. The source side is read through
   safetensors' own slicing (not the writer's gather code), in bounded row blocks.
3. numeric — every output tensor against the source by the engine's names (linear_check.py: each
   linear through the GEMM kernels, the rest by value), then a forward of every MTP layer with every
   expert routed (numeric.py); coverage (units computed / expected, per rank, expert and fused part) in
   the report. It recombines every rank, so on an OUT of some ranks (convert --ranks) it fails, saying
   what to run instead.

The levels stack: a level's checks join the report only when the ones before passed. The numeric level's forked
workers are started before the values level and run beside it, in one pass over the bytes (ckpt_tool.verify.one_pass):
the values walk reads OUT and the source through the page cache and releases each numeric task once it has read the
task's bytes, staying within ``ONE_PASS_WINDOW`` of the tasks not yet answered, so the workers read what the walk
just left in the cache and the disk serves each byte once; their answers are taken only once values passed, else the
workers are stopped. They share one record
(ckpt_tool.verify.verdict: Check, VerifyReport, Progress); numeric never imports this module.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from pathlib import Path

from ckpt_tool.checkpoint.headers import DTYPE_BITS, ShardHeader, TensorInfo, read_shard_header
from ckpt_tool.checkpoint.identity import FileIdentity, identity_of
from ckpt_tool.checkpoint.lockstep import Lockstep
from ckpt_tool.checkpoint.reader import ByteSource, SequentialRead, sha256_file
from ckpt_tool.checkpoint.source import Checkpoint, open_checkpoint
from ckpt_tool.errors import CkptToolError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.plan import ZERO, OutFile, OutTensor, Plan, Segment
from ckpt_tool.mapping.selection import plan_run
from ckpt_tool.output.layout import COMPONENTS, MANIFEST, index_doc, options_from_manifest, source_fingerprint
from ckpt_tool.processes import usable_cpus
from ckpt_tool.verify.one_pass import OnePass, Walk
from ckpt_tool.verify.verdict import Check, NoProgress, Progress, VerifyReport

__all__ = ["LEVELS", "Check", "VerifyReport", "verify"]

log = logging.getLogger(__name__)

LEVELS = ("structure", "values", "numeric")
VALUE_BLOCK_BYTES = 8 * 1024 * 1024  # bytes compared at once per worker (a few copies live at a time)
# how far (bytes of its own file) one rank's comparison may run ahead of the slowest rank of its group: the source
# rows the first rank reads must still be in the page cache when the last one asks. One OUT byte of a row-parallel
# weight is cut from tp source bytes, so at tp 8 up to ~1 GiB of source rows is held between the first and last
# read — far below the RAM of any machine that verifies (24 GiB here), while 16 blocks of slack let the ranks'
# threads take turns on the cores without waiting on each other's every block.
LOCKSTEP_WINDOW = 128 * 1024 * 1024
# verify --level numeric in one pass (ckpt_tool.verify.one_pass): how far, in OUT bytes, the values walk may run
# ahead of the numeric tasks it released and no worker answered yet. What a worker reads then was read by the walk at
# most this many OUT bytes, plus the source rows cut into them (about as many again) and one task (a vocab table, a
# tenth of this at most), ago: ~5 GiB of page cache at most, far below the RAM of any machine that verifies (24 GiB
# here) and its other use (the values threads and the workers hold well under 2 GiB), so the bytes are still cached.
# And far above one layer's stretch of a task (an expert across the ranks: ~13 MiB of V4-Flash OUT), so the workers
# always have released tasks to take while the walk moves.
ONE_PASS_WINDOW = 2 * 1024**3


def verify(
    out: Path,
    source: Path | Checkpoint,
    *,
    level: str = "numeric",
    kernels: str = "auto",
    device: str = "auto",
    tokens: int = 16,
    seed: int = 0,
    progress: Progress | None = None,
    workers: int | None = None,
    same_files: bool = True,
) -> VerifyReport:
    """Run the checks up to ``level``. Never raises for a failed check: failures are in the report.

    ``same_files``: ``source`` should be the very files OUT was converted from, unchanged since (their size and
    mtime_ns as the manifest records them); False for a hub source, which its commit pins.

    ``workers``: output files compared at once by the values level (default: one per CPU, at most 4; the ranks of
    one part always together, see :func:`check_values`), and
    tiles computed at once by the numeric level (default: one per CPU).
    """
    numeric_workers = workers
    workers = workers or min(4, usable_cpus())
    progress = progress or NoProgress()
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")
    report = VerifyReport(str(out), str(source.root if isinstance(source, Checkpoint) else source), level)
    manifest_path = out / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        report.add(
            Check(
                "manifest",
                False,
                f"{manifest_path}: missing; OUT is not a finished ckpt-tool conversion",
                file=str(manifest_path),
            )
        )
        return report
    except (OSError, json.JSONDecodeError) as exc:
        report.add(Check("manifest", False, f"{manifest_path}: unreadable ({exc})", file=str(manifest_path)))
        return report
    if manifest.get("complete") is not True:
        report.add(
            Check(
                "manifest",
                False,
                f"{manifest_path}: conversion is not complete; rerun convert to finish it",
                file=str(manifest_path),
            )
        )
        return report
    report.add(Check("manifest", True))
    report.target = manifest.get("target")

    try:
        ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    except CkptToolError as exc:
        report.add(Check("source", False, str(exc)))
        return report
    if not _same_source(manifest, ckpt, report):
        return report  # every later check would only restate it
    if same_files:
        _same_identity(manifest, ckpt, report)  # the later checks still say whether the bytes differ
    try:
        config = ckpt.require_config()
        opts = options_from_manifest(manifest)
        ranks = manifest.get("ranks")  # a --ranks run: only those ranks were written
        plan = plan_run(config, ckpt.tensors, opts, ranks=None if ranks is None else [int(r) for r in ranks]).covered
    except CkptToolError as exc:
        report.add(Check("plan", False, str(exc)))
        return report
    report.add(Check("plan", True, details={"tensors": plan.tensor_count, "files": len(plan.files)}))

    deep = level in ("values", "numeric")
    if ckpt.remote is not None:
        ckpt.remote.spool_in(out)
    headers = check_structure(out, plan, manifest, report, ckpt.root, hash_files=not deep, workers=workers)
    check_engine(plan, headers, report)
    held = manifest.get("ranks")
    every_rank = held is None or len(held) >= opts.tp
    numeric = None
    if level == "numeric" and report.ok and every_rank:
        # the numeric level's workers compute while the values level reads (forked now, before its threads start):
        # the two levels share the disk and the cores instead of taking turns; its checks join the report only
        # once the values level passed
        from ckpt_tool.verify.numeric import NumericLevel

        numeric = NumericLevel(
            out,
            plan,
            ckpt,
            headers,
            kernels=kernels,
            device=device,
            tokens=tokens,
            seed=seed,
            progress=progress,
            workers=numeric_workers,
            one_pass=True,
        )
    try:
        if numeric is not None:
            numeric.start(values_walk(plan, headers), ONE_PASS_WINDOW)
        if deep and report.ok:
            pace = numeric.pace if numeric is not None else None
            with closing(ckpt.open_bytes()) as source_bytes:
                check_values(
                    out, plan, source_bytes, headers, report, progress, workers=workers, manifest=manifest, pace=pace
                )
        if level == "numeric" and report.ok:
            if numeric is None:
                report.add(_numeric_needs_every_rank([int(r) for r in held], opts.tp))
            else:
                numeric.finish(report)
    finally:
        if numeric is not None:
            numeric.close()
    return report


def _numeric_needs_every_rank(ranks: list[int], tp: int) -> Check:
    """``--level numeric`` on an OUT of some ranks (``convert --ranks``): asked for, cannot run in full, so a
    failure that says what to run instead. The numeric level recombines the ranks as the engine does (row-
    parallel partial sums, the forward over all ranks), and an OUT with a manifest takes no more ranks."""
    held = ",".join(map(str, ranks))
    missing = ",".join(str(r) for r in range(tp) if r not in ranks)
    return Check(
        "numeric",
        False,
        f"--level numeric needs every rank: OUT holds rank(s) {held} of --tp {tp} (converted with --ranks {held}; "
        "rank(s) "
        f"{missing} missing) and the numeric level recombines all ranks as the engine does. Instead, verify this share "
        "with "
        "--level values (structure and exact values of every file it holds), and for the numeric level convert every "
        "rank "
        "into one OUT (on one machine, or --shard-index K --shard-count M per machine into a shared OUT, then "
        "--finalize) "
        f"and verify that OUT with --level numeric",
        details={"ranks": ranks, "tp": tp, "missing": [r for r in range(tp) if r not in ranks]},
    )


def _same_source(manifest: dict, ckpt: Checkpoint, report: VerifyReport) -> bool:
    """Is ``--source`` the checkpoint OUT was converted from (shard sizes and header hashes, config)? One check."""
    recorded_source = manifest.get("source") or {}
    recorded = recorded_source.get("files") or {}
    fingerprint = source_fingerprint(ckpt)
    current = fingerprint["files"]
    if recorded != current:
        changed = sorted(f for f in set(recorded) | set(current) if recorded.get(f) != current.get(f))
        report.add(
            Check(
                "source-fingerprint",
                False,
                f"{ckpt.root} is not the checkpoint OUT was converted from ({len(changed)} of "
                f"{len(set(recorded) | set(current))} "
                f"shard file(s) differ, e.g. {changed[0]}); pass the original checkpoint as --source, or reconvert",
                file=changed[0],
            )
        )
        return False
    if recorded_source.get("config_sha256") != fingerprint["config_sha256"]:
        report.add(
            Check(
                "source-fingerprint",
                False,
                f"{ckpt.root}/config.json differs from the one OUT was converted with; pass the original checkpoint as "
                "--source, or reconvert",
                file="config.json",
            )
        )
        return False
    report.add(Check("source-fingerprint", True))
    return True


def _same_identity(manifest: dict, ckpt: Checkpoint, report: VerifyReport) -> None:
    """Is each source file OUT was made from unchanged since (size and mtime_ns as the manifest records them)?

    One check, when the manifest records identities (a local source; a hub source is pinned by its commit).
    """
    recorded = (manifest.get("source") or {}).get("identity")
    if not isinstance(recorded, dict):
        return
    for file, doc in sorted(recorded.items()):
        was = FileIdentity.from_dict(doc) if isinstance(doc, dict) else None
        header = ckpt.shards.get(file)
        now = header.identity if header is not None and header.identity is not None else identity_of(ckpt.root / file)
        said = ["removed"] if now is None else ["unreadable record"] if was is None else was.changes_since(now)
        if said:
            report.add(
                Check(
                    "source-identity",
                    False,
                    f"{ckpt.root / file}: changed since OUT was converted ({'; '.join(said)}); OUT may no longer "
                    "agree with it — reconvert from the source as it is now (a copy that did not keep modification "
                    "times counts as changed too)",
                    file=file,
                )
            )
            return
    report.add(Check("source-identity", True, details={"files": len(recorded)}))


def check_engine(plan: Plan, headers: dict[str, ShardHeader], report: VerifyReport) -> None:
    """Each written rank against the target engine's parameter table (ckpt_tool.mapping.engine_table): the keys its
    loader expects, their shapes and dtypes. A rule table gone stale against the engine fails here."""
    from ckpt_tool.mapping.engine_table import ENGINES, compare_with_engine, engine_params

    opts = plan.options
    if opts.profile not in ENGINES:
        report.add(
            Check(
                "engine",
                False,
                f"profile {opts.profile!r} has no engine table; add one to its profile module in "
                "ckpt_tool/mapping/profiles/",
            )
        )
        return
    ranks = sorted({(f.component, f.rank) for f in plan.files})
    for comp, rank in ranks:
        written: dict[str, tuple[tuple[int, ...], str]] = {}
        files = [f.relpath for f in plan.files if (f.component, f.rank) == (comp, rank)]
        if not all(rel in headers for rel in files):
            continue  # a structure failure already names the unreadable or missing file
        for rel in files:
            written.update({n: (t.shape, t.dtype) for n, t in headers[rel].tensors.items()})
        expected = engine_params(plan.config, opts.profile, comp, opts.tp, opts.moe_parallel, rank, opts.vllm_series)
        problems = compare_with_engine(written, expected)
        name = f"engine:{comp}/rank-{rank}"
        where = f"{comp}/model-rank-{rank}-part-*.safetensors"
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            msg = f"{where} vs the {opts.profile} engine: {problems[0][0]}{more}"
            report.add(
                Check(
                    name, False, msg, file=where, tensor=problems[0][1], details={"problems": [p for p, _ in problems]}
                )
            )
        else:
            report.add(Check(name, True, file=where, details={"parameters": len(expected)}))


def check_structure(
    out: Path,
    plan: Plan,
    manifest: dict,
    report: VerifyReport,
    src_root: Path,
    *,
    hash_files: bool = True,
    workers: int = 1,
) -> dict[str, ShardHeader]:
    """Files, names, dtypes, shapes per rank; index.json; manifest checksums (``hash_files=False``: the
    values level hashes each file while it compares it, one read instead of two). Returns parsed headers."""
    planned = {f.relpath: f for f in plan.files}
    present = {
        f"{comp}/{p.name}" for comp in COMPONENTS if (out / comp).is_dir() for p in (out / comp).glob("*.safetensors")
    }
    for rel in sorted(set(planned) - present):
        report.add(Check(f"structure:{rel}", False, f"{rel}: planned output file is missing", file=rel))
    for rel in sorted(present - set(planned)):
        report.add(Check(f"structure:{rel}", False, f"{rel}: file is not part of the plan for these options", file=rel))

    outputs = manifest.get("outputs") or {}
    headers: dict[str, ShardHeader] = {}
    digests: dict[str, str] = {}
    if hash_files:  # files hashed in parallel (hashlib and reads release the GIL)
        from concurrent.futures import ThreadPoolExecutor

        todo = [rel for rel in planned if rel in present]
        with ThreadPoolExecutor(max(1, workers)) as pool:
            digests = dict(zip(todo, pool.map(lambda rel: sha256_file(out / rel), todo)))
    for rel, f in planned.items():
        if rel not in present:
            continue
        problems: list[tuple[str, str | None]] = []
        try:
            header = read_shard_header(out / rel, rel)
        except CkptToolError as exc:
            report.add(Check(f"structure:{rel}", False, str(exc), file=rel))
            continue
        headers[rel] = header
        want = {t.name: t for t in f.tensors}
        for name in sorted(set(want) - set(header.tensors)):
            problems.append((f"{rel}: tensor {name!r} missing (from {', '.join(want[name].sources[:2])})", name))
        for name in sorted(set(header.tensors) - set(want)):
            problems.append((f"{rel}: tensor {name!r} is not in the plan", name))
        for name in sorted(set(want) & set(header.tensors)):
            got, exp = header.tensors[name], want[name]
            if got.dtype != exp.dtype or tuple(got.shape) != tuple(exp.shape):
                problems.append(
                    (
                        f"{rel}: tensor {name!r} is {got.dtype}{list(got.shape)}, expected "
                        f"{exp.dtype}{list(exp.shape)}",
                        name,
                    )
                )
        rec = outputs.get(rel)
        if rec is None:
            problems.append((f"{rel}: not recorded in {MANIFEST}", None))
        elif rec.get("size") != header.file_size:
            problems.append((f"{rel}: size {header.file_size} differs from the manifest's {rec.get('size')}", None))
        elif hash_files and rec.get("sha256") != digests.get(rel):
            problems.append((f"{rel}: sha256 differs from the manifest; the file changed after conversion", None))
        if problems:
            msg = problems[0][0] + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else "")
            report.add(
                Check(
                    f"structure:{rel}",
                    False,
                    msg,
                    file=rel,
                    tensor=problems[0][1],
                    details={"problems": [p for p, _ in problems]},
                )
            )
        else:
            report.add(Check(f"structure:{rel}", True, file=rel))

    for comp in COMPONENTS:
        if not any(f.component == comp for f in plan.files):
            continue
        path = out / comp / "index.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            report.add(Check(f"index:{comp}", False, f"{path}: unreadable ({exc})", file=str(path)))
            continue
        ok = doc == index_doc(plan, comp)
        report.add(
            Check(
                f"index:{comp}",
                ok,
                "" if ok else f"{path}: does not match the plan (tensors, ranks or total_size)",
                file=f"{comp}/index.json",
            )
        )
        cfg_path = out / comp / "config.json"
        want = (src_root / "config.json").read_bytes()
        got = cfg_path.read_bytes() if cfg_path.is_file() else None
        msg = (
            ""
            if got == want
            else f"{cfg_path}: {'missing' if got is None else 'differs from the source config.json'}; reconvert"
        )
        report.add(Check(f"config:{comp}", got == want, msg, file=f"{comp}/config.json"))
    if any(f.component == "model" for f in plan.files):
        _check_serving_files(out, src_root, report)
    return headers


def _check_serving_files(out: Path, src_root: Path, report: VerifyReport) -> None:
    """OUT/model carries the source's tokenizer, generation config, chat template, ... byte for byte."""
    from ckpt_tool.output.convert import serving_files

    problems = []
    for name in serving_files(src_root):
        dest = out / "model" / name
        if not dest.is_file():
            problems.append(f"{dest}: missing (vllm serve OUT/model needs the source's {name})")
        elif dest.read_bytes() != (src_root / name).read_bytes():
            problems.append(f"{dest}: differs from the source's {name}")
    msg = (
        f"{problems[0]}; reconvert" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        if problems
        else ""
    )
    report.add(
        Check(
            "serving-files:model", not problems, msg, file="model", details={"problems": problems} if problems else {}
        )
    )


def _out_width(t: OutTensor) -> int:
    return t.segments[0].width


def check_values(
    out: Path,
    plan: Plan,
    source: ByteSource,
    headers: dict[str, ShardHeader],
    report: VerifyReport,
    progress: Progress,
    *,
    workers: int = 1,
    manifest: dict | None = None,
    window: int | None = None,
    pace: OnePass | None = None,
) -> None:
    """Re-derive every output tensor from the source and compare exactly.

    Each output file is read once, sequentially in 8 MiB blocks, and hashed while it is compared; with
    ``manifest`` the digest is checked against it here (check_structure then skipped hashing). The source
    is read with ``pread`` in row blocks and cut with numpy, independently of the writer's gather code.

    The ranks' files cut from the same source tensors (:func:`_lockstep_groups`) are compared at once, one thread
    each, kept within ``window`` (default ``LOCKSTEP_WINDOW``) bytes of their own files of each other
    (ckpt_tool.checkpoint.lockstep): each rank
    asks for the source rows it cuts its slice from, and the first rank's read leaves them in the page cache for
    the others, so the disk serves each source byte once for all the ranks checked. ``workers`` files are compared
    at once where a group has fewer files than that (pread, sha256 and the comparisons release the GIL).

    ``pace`` (verify --level numeric, ckpt_tool.verify.one_pass): every thread reports its progress to it before each
    block and may be held there, and OUT is read through the page cache (the numeric workers read it again from
    there); without it OUT is read with ``O_DIRECT``, as nothing reads it again.
    """
    from concurrent.futures import ThreadPoolExecutor

    jobs = [f for f in plan.files if f.relpath in headers]
    progress.stage("values", sum(f.data_bytes for f in jobs))
    outputs = (manifest or {}).get("outputs") or {}
    groups = _lockstep_groups(jobs)
    threads = max(1, workers, *(len(g) for g in groups))
    # each thread holds its file's read-ahead (SequentialRead.DEPTH + 1 blocks) and a few block-sized copies of
    # source rows and their cut: blocks shrink so that many ranks at once stay within what 8 threads hold
    block = max(min(VALUE_BLOCK_BYTES, 1 << 20), min(VALUE_BLOCK_BYTES, (8 * VALUE_BLOCK_BYTES // threads) >> 12 << 12))

    def member(files: list, group: Lockstep, g: int, m: int) -> list[tuple[list[str], str | None, str]]:
        def at(pos: int) -> None:
            if pace is not None:
                pace.advance(g, m, pos)
            group.advance(m, pos)

        try:
            done, results = 0, []
            for f in files:  # a rank's parts one after another: its position runs on across them
                results.append(
                    _values_of_file(
                        out,
                        f,
                        headers[f.relpath],
                        plan,
                        source,
                        progress,
                        block,
                        lambda pos, done=done: at(done + pos),
                        direct=pace is None,
                    )
                )
                done += headers[f.relpath].file_size
            return results
        finally:
            group.done(m)
            if pace is not None:
                pace.done(g, m)

    # one pool, the members of a group submitted together: the pool has a thread for every member of the largest
    # group and takes tasks in order, so a group's members all run once the groups before it are done (a member
    # waiting for one not yet started is never stuck: that one starts when an earlier group's thread frees)
    results: dict[str, tuple[list[str], str | None, str]] = {}
    with ThreadPoolExecutor(threads) as pool:
        futures = []
        for gi, g in enumerate(groups):
            lockstep = Lockstep(len(g), window or LOCKSTEP_WINDOW)
            futures += [(files, pool.submit(member, files, lockstep, gi, m)) for m, files in enumerate(g)]
        for files, fut in futures:
            results.update(zip((f.relpath for f in files), fut.result()))
    for f in jobs:
        bad, first_tensor, digest = results[f.relpath]
        if manifest is not None and (outputs.get(f.relpath) or {}).get("sha256") != digest:
            report.add(
                Check(
                    f"structure:{f.relpath}",
                    False,
                    f"{f.relpath}: sha256 differs from the manifest; the file changed after conversion",
                    file=f.relpath,
                )
            )
        if bad:
            more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
            report.add(
                Check(
                    f"values:{f.relpath}",
                    False,
                    bad[0] + more,
                    file=f.relpath,
                    tensor=first_tensor,
                    details={"problems": bad},
                )
            )
        else:
            report.add(Check(f"values:{f.relpath}", True, file=f.relpath))


def values_walk(plan: Plan, headers: dict[str, ShardHeader]) -> Walk:
    """The files :func:`check_values` walks, as its threads walk them: groups in order, each a list of members, each
    the ``(relpath, file size)`` of the files one thread reads in turn."""
    jobs = [f for f in plan.files if f.relpath in headers]
    return [
        [[(f.relpath, headers[f.relpath].file_size) for f in files] for files in group]
        for group in _lockstep_groups(jobs)
    ]


def _lockstep_groups(files: list[OutFile]) -> list[list[list[OutFile]]]:
    """The files to compare at once, in lockstep: groups of members, each member the files one thread walks.

    Under tensor parallelism part ``p`` of every rank of a component holds the same tensors in the same order with
    the same sizes (``plan._pack`` packs each rank's tensors by the position of their first source byte, and a split
    gives every rank the same shape): the ranks' part ``p`` form a group, one file a member, and their byte
    positions match. Where they do not (``--moe-parallel ep``: a rank's expert stack sorts by its own first expert,
    so parts can hold different tensors) the group is the component, a member one rank's parts in order, its
    position running on across them.

    The MTP component comes first: the numeric level's forward reads all of it again once the walk has passed it
    (ckpt_tool.verify.one_pass), and first, with little else read yet, it is still in the page cache then; last, it
    was partly pushed out by the main model's bytes, which the per-tensor checks had read twice.
    """
    by_comp: dict[str, dict[int, list[OutFile]]] = {}
    for f in sorted(files, key=lambda f: f.component != "mtp"):  # (a stable sort: the plan's order otherwise)
        by_comp.setdefault(f.component, {}).setdefault(f.rank, []).append(f)
    groups: list[list[list[OutFile]]] = []
    for ranks in by_comp.values():
        members = [sorted(fs, key=lambda f: f.part) for fs in ranks.values()]

        def layout(fs: list[OutFile]) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
            return [(f.part, tuple((t.name, t.nbytes) for t in f.tensors)) for f in fs]

        if all(layout(m) == layout(members[0]) for m in members):
            for k in range(len(members[0])):
                groups.append([[m[k]] for m in members])
        else:
            groups.append(members)
    return groups


def _values_of_file(
    out: Path,
    f: OutFile,
    header: ShardHeader,
    plan: Plan,
    src: ByteSource,
    progress: Progress,
    block: int = VALUE_BLOCK_BYTES,
    at: Callable[[int], None] = lambda pos: None,
    *,
    direct: bool = True,
) -> tuple[list[str], str | None, str]:
    """Compare one output file (``at(pos)``: called with the file position before each block is worked on; ``direct``:
    read it with ``O_DIRECT``, else through the page cache)."""
    reader = SequentialRead(out / f.relpath, header.file_size, block, direct=direct)
    try:
        found: list[tuple[int, str, str]] = []
        order = {t.name: i for i, t in enumerate(f.tensors)}
        for t in sorted(f.tensors, key=lambda t: header.tensors[t.name].start):  # read in file order
            msg = _compare_tensor(t, header.tensors[t.name], reader, plan, src, block, at)
            if msg:
                found.append((order[t.name], msg, t.name))
            progress.advance(t.nbytes, f.relpath)
        at(header.file_size)
        found.sort()  # report in plan order (a fused weight before its scale)
        return [m for _, m, _ in found], (found[0][2] if found else None), reader.hexdigest()
    finally:
        reader.close()


def _compare_tensor(
    t: OutTensor,
    got: TensorInfo,
    reader: SequentialRead,
    plan: Plan,
    src: ByteSource,
    block: int = VALUE_BLOCK_BYTES,
    at: Callable[[int], None] = lambda pos: None,
) -> str | None:
    import numpy as np

    width = _out_width(t)
    out_eb = DTYPE_BITS[t.dtype] // 8
    pos = got.start
    out_row = 0  # rows of the output tensor (seen as 2-D [rows, width]) before the segment
    for seg in t.segments:
        first_row, out_row = out_row, out_row + seg.rows
        zero = np.frombuffer(conversions.zero_element(seg.convert, t.dtype), np.uint8)
        if seg.src == ZERO:  # the engine's zero padding: nothing to read from the source
            rows_per_block = max(1, block // max(1, width * out_eb))
            for r in range(seg.row0, seg.row1, rows_per_block):
                n = min(rows_per_block, seg.row1 - r)
                at(pos)
                actual = reader.read(pos, n * width * out_eb)
                if len(actual) != n * width * out_eb:
                    return f"{t.name}: output file ended early"
                a = np.frombuffer(actual, np.uint8).reshape(-1, out_eb)
                bad = np.flatnonzero((a != zero).any(axis=1))
                if bad.size:
                    row, col = divmod(int(bad[0]), width)
                    return _pad_message(t, seg, first_row + r - seg.row0 + row, col)
                pos += len(actual)
            continue
        info = plan.sources[seg.src]  # a materialized alias carries the offsets of the tensor it aliases
        src_eb = DTYPE_BITS[info.dtype] // 8
        src_row = (info.numel // info.shape[0] if info.shape else 1) * src_eb
        rows_per_block = max(1, block // max(1, src_row, width * out_eb))
        whole_rows = seg.col0 == 0 and seg.col1 * src_eb == src_row
        r = seg.row0
        while r < seg.row1:
            n = min(rows_per_block, seg.row1 - r)
            at(pos)  # (held back here while more than the window ahead of the group's slowest file)
            raw = bytearray(n * src_row)
            src.read_into(info.file, memoryview(raw), info.start + r * src_row, what=f"tensor {info.name!r}")
            raw = bytes(raw)
            want = (
                raw
                if whole_rows
                else np.frombuffer(raw, np.uint8)
                .reshape(n, src_row)[:, seg.col0 * src_eb : seg.col1 * src_eb]
                .tobytes()
            )
            if seg.convert not in conversions.BYTEWISE:
                want = conversions.forward(seg.convert, want, info)
            if seg.pad:  # each row followed by the engine's zero padding
                padded = np.empty((n, width * out_eb), np.uint8)
                padded[:, : (width - seg.pad) * out_eb] = np.frombuffer(want, np.uint8).reshape(n, -1)
                padded[:, (width - seg.pad) * out_eb :] = np.tile(zero, seg.pad)
                want = padded.tobytes()
            if seg.repeat > 1:  # each source row written repeat times (an expanded MXFP8 scale)
                want = np.repeat(np.frombuffer(want, np.uint8).reshape(n, -1), seg.repeat, axis=0).tobytes()
            nbytes = n * seg.repeat * width * out_eb
            actual = reader.read(pos, nbytes)
            if len(actual) != nbytes:
                return f"{t.name}: output file ended early"
            if want != actual:
                a, b = np.frombuffer(want, np.uint8), np.frombuffer(actual, np.uint8)
                diff = int(np.flatnonzero(a != b)[0]) // out_eb
                row, col = divmod(diff, width)
                row //= seg.repeat
                if col >= width - seg.pad:
                    return _pad_message(t, seg, first_row + r - seg.row0 + row, col)
                what = "bytes" if seg.convert in conversions.BYTEWISE else "value"
                return (
                    f"tensor {t.name!r}: {what} differ from source {seg.src} "
                    f"(rows {seg.row0}:{seg.row1}, cols {seg.col0}:{seg.col1}) first at source element "
                    f"[{r + row}, {seg.col0 + col}]"
                )
            pos += nbytes
            r += n
    return None


def _pad_message(t: OutTensor, seg: Segment, row: int, col: int) -> str:
    """A byte of the engine's zero padding that is not the zero element, at ``[row, col]`` of the segment's output."""
    where = "after " + (
        f"source {seg.src} (rows {seg.row0}:{seg.row1}, cols {seg.col0}:{seg.col1})" if seg.pad else "the source rows"
    )
    zero = "0" if seg.convert != "e8m0_to_f32" else "2^-127 (the float32 value of E8M0 byte 0)"
    return (
        f"tensor {t.name!r}: the engine's zero padding ({seg.zeros} elements {where}) holds something other than "
        f"{zero}, "
        f"first at element [{row}, {col}] of the output seen as 2-D; reconvert"
    )


def hub_source_for_verify(ref, out: Path, *, stream: bool = False) -> Path | Checkpoint:
    """The checkpoint ``verify --source REF`` reads for a hub ``ref`` (``ckpt_tool.checkpoint.hub.HubRef``), fetched
    into the HF cache if absent (``stream``: never fetched, its bytes read with range requests).

    An ``--only mtp`` conversion made from part of a hub repo recorded just the shards it read: it is
    verified against that same partial checkpoint (no other shard is fetched). Otherwise the whole
    snapshot is resolved.
    """
    from ckpt_tool.checkpoint.hub import open_hub_source
    from ckpt_tool.errors import CheckpointError
    from ckpt_tool.mapping.plan import HubNeeds
    from ckpt_tool.output.layout import read_manifest

    manifest = read_manifest(out)
    if manifest is None:
        raise CheckpointError(f"{out / MANIFEST}: missing; OUT is not a finished ckpt-tool conversion")
    opts = options_from_manifest(manifest)
    recorded = set((manifest.get("source") or {}).get("files") or {})
    if stream:
        return open_hub_source(ref, HubNeeds(replace(opts, only=None)), stream=True)
    if opts.only == "mtp":
        part = open_hub_source(ref, HubNeeds(opts))  # the shards the conversion read (fetched if absent)
        if recorded == set(part.shards):
            return part  # verify the partial source it was converted from, without fetching the rest
    return open_hub_source(ref, HubNeeds(replace(opts, only=None))).root
