"""``verify``: prove a converted checkpoint right, level by level; this module runs the levels in order.

0. the source (``source_match``): ``--source`` is the checkpoint OUT was converted from, unchanged since.
1. structure (``structure``) — from headers and the manifest: the output files, tensor names, dtypes, shapes and
   rank sets are exactly what the rules give for the source and the recorded options; index.json agrees;
   every file's size and sha256 match the manifest; each rank against the target engine's parameter table.
2. values (``values``) — every output tensor re-derived from the source bytes and compared exactly: byte-equal for
   renames/slices/fusions/stacks, value-equal for E8M0 → float32; the engine's zero padding (shared
   experts at a tp their blocks do not divide) must hold the zero element.
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
from contextlib import closing
from pathlib import Path

from ckpt_tool.checkpoint.hub import parse_hub_ref
from ckpt_tool.checkpoint.source import Checkpoint, open_checkpoint
from ckpt_tool.errors import CkptToolError, UsageError
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.mapping.selection import plan_run
from ckpt_tool.output.layout import MANIFEST, options_from_manifest
from ckpt_tool.processes import usable_cpus
from ckpt_tool.verify.engine import check_with_vllm
from ckpt_tool.verify.source_match import changed_keys_note, hub_source_for_verify, same_identity, same_source
from ckpt_tool.verify.structure import check_engine, check_structure
from ckpt_tool.verify.values import check_values, values_walk
from ckpt_tool.verify.verdict import Check, NoProgress, Progress, VerifyReport

__all__ = ["LEVELS", "Check", "VerifyReport", "verify", "verify_out"]

LEVELS = ("structure", "values", "numeric")
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
    one part always together, see :func:`check_values`), and tiles computed at once by the numeric level (default:
    one per CPU)."""
    numeric_workers = workers
    workers = workers or min(4, usable_cpus())
    progress = progress or NoProgress()
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")
    report = VerifyReport(str(out), str(source.root if isinstance(source, Checkpoint) else source), level)
    manifest = _finished_manifest(out, report)
    if manifest is None:
        return report
    planned = _plan_from_source(manifest, source, report, same_files, out)
    if planned is None:
        return report
    (ckpt, plan), opts = planned, planned[1].options

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
        from ckpt_tool.verify.numeric import NumericLevel  # torch and the kernels: only for the numeric level

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
            # alone, this level reads each source block once (shared by the ranks cut from it): with O_DIRECT, no copy
            # through the page cache (what the cache holds already is copied from it, not read from the disk again);
            # in one pass with the numeric level, whose workers read the source again from it
            with closing(ckpt.open_bytes(direct=pace is None)) as source_bytes:
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


def _finished_manifest(out: Path, report: VerifyReport) -> dict | None:
    """OUT's manifest, if it says the conversion finished (one check either way; None: it does not)."""
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
        return None
    except (OSError, json.JSONDecodeError) as exc:
        report.add(Check("manifest", False, f"{manifest_path}: unreadable ({exc})", file=str(manifest_path)))
        return None
    if manifest.get("complete") is not True:
        report.add(
            Check(
                "manifest",
                False,
                f"{manifest_path}: conversion is not complete; rerun convert to finish it",
                file=str(manifest_path),
            )
        )
        return None
    report.add(Check("manifest", True))
    report.target = manifest.get("target")
    return manifest


def _plan_from_source(
    manifest: dict, source: Path | Checkpoint, report: VerifyReport, same_files: bool, out: Path
) -> tuple[Checkpoint, Plan] | None:
    """The source opened and checked to be the one OUT was made from, and the plan re-made from it and the recorded
    options and ranks (a check each); None where a check failed and every later one would only restate it."""
    try:
        ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    except CkptToolError as exc:
        # a config.json edited since the conversion into one the tool refuses: the keys that changed, then why
        changed = changed_keys_note(out, source) if isinstance(source, Path) and source.is_dir() else ""
        note = f"{source}/config.json changed since OUT was converted{changed}: " if changed else ""
        report.add(Check("source", False, note + str(exc)))
        return None
    if not same_source(manifest, ckpt, report, out):
        return None
    if same_files:
        same_identity(manifest, ckpt, report)  # the later checks still say whether the bytes differ
    try:
        config = ckpt.require_config()
        opts = options_from_manifest(manifest)
        ranks = manifest.get("ranks")  # a --ranks run: only those ranks were written
        plan = plan_run(config, ckpt.tensors, opts, ranks=None if ranks is None else [int(r) for r in ranks]).covered
    except CkptToolError as exc:
        report.add(Check("plan", False, str(exc)))
        return None
    report.add(Check("plan", True, details={"tensors": plan.tensor_count, "files": len(plan.files)}))
    return ckpt, plan


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


def verify_out(
    out: Path,
    source: str | None,
    *,
    engine: bool = False,
    engine_python: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    stream: bool = False,
    **levels: object,
) -> VerifyReport:
    """``ckpt-tool verify``: the levels (``levels``: :func:`verify`'s options) against ``source`` (a folder, or a hub
    repo id), and with ``engine`` the installed vLLM's judgement (``engine_python``'s) first, its checks after the
    levels'. Raises UsageError for a combination that cannot run (no source and no engine, no CUDA for
    ``device="cuda"``, a local source to ``stream``); failed checks are in the report."""
    if source is None and not engine:
        raise UsageError(
            "verify needs --source SRC (the checkpoint OUT was converted from), or --engine to let vLLM judge OUT"
        )
    if engine_python is not None and not engine:
        raise UsageError("--engine-python names the interpreter --engine runs vLLM with; add --engine")
    if levels.get("device") == "cuda" and source is not None:
        import torch  # only to ask for CUDA: the structure and values levels never need torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here; use --device cpu (or auto)")
    judged = None
    if engine:  # first: no vLLM (exit 2) is known before the levels spend their time
        judged = VerifyReport(str(out), source, "engine")
        check_with_vllm(out, judged, python=engine_python)
    if source is None:
        return judged
    ref = parse_hub_ref(source, revision=revision, token=token, cache_dir=cache_dir)
    if stream and ref is None:
        raise UsageError(f"--stream reads a hub repo; {source} is a local path (verify reads it directly)")
    src_path = hub_source_for_verify(ref, out, stream=stream) if ref is not None else Path(source)
    # a hub source is pinned by its commit, not by the files' identity
    report = verify(out, src_path, same_files=ref is None, **levels)
    if judged is not None:  # beside the level: the engine's checks follow the level's
        have = {c.name for c in report.checks}
        report.checks += [c for c in judged.checks if c.name not in have]
        report.engine = judged.engine
    return report
