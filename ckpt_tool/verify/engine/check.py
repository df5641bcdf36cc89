"""``verify OUT --engine``: the vLLM a user serves with judges OUT, on a machine without a GPU.

For every rank of ``OUT/model`` and ``OUT/mtp`` that vLLM's own model classes are built for OUT's config, tp and
expert-parallel setting (``probe.py``, run in a subprocess by the interpreter of the environment with vLLM), and
the rank's files are held against the model's ``state_dict()`` after the loader's ``_filter_subtensors`` with the
loader's own rules (``judge.py``). Where a rank's files are small (the test fixtures), vLLM's own
``ShardedStateLoader.load_weights`` also loads them, and what it raises or warns is part of the verdict.

vLLM never runs in this process: importing it takes seconds and patches torch. Its absence, or a release whose
classes cannot be built this way, is an :class:`EngineError` (exit 2) naming the step that failed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import read_shard_header
from ckpt_tool.errors import CkptToolError
from ckpt_tool.mapping.engine_table import ENGINES, engine_params
from ckpt_tool.mapping.plan import selects
from ckpt_tool.mapping.profiles import canonical_name, series_of
from ckpt_tool.output.layout import COMPONENTS, MANIFEST
from ckpt_tool.verify.engine.judge import HeldTensor, judge_files, judge_load
from ckpt_tool.verify.verdict import Check, VerifyReport

log = logging.getLogger(__name__)

PROBE = Path(__file__).resolve().with_name("probe.py")
PROTOCOL = 1
# A rank whose files hold at most this much is also loaded for real by vLLM's loader (its model is then built
# on the CPU: memory about the files' size). Larger ranks are judged from the meta-device build alone.
REAL_LOAD_MAX_BYTES = 256 * 1024**2
MESSAGE_KEYS = 3  # problems named in a failed check's message (all are in its details)
NO_VLLM_HINT = (
    "pass --engine-python /path/to/serving-venv/bin/python, the interpreter of the environment you serve with "
    "(vLLM installed there; no GPU needed)"
)


class EngineError(CkptToolError):
    """No vLLM to judge with, or its classes cannot be built here (exit 2: nothing was judged)."""

    exit_code = 2


def check_with_vllm(
    out: Path, report: VerifyReport, python: str | None = None, *, real_load_max_bytes: int = REAL_LOAD_MAX_BYTES
) -> None:
    """Add one ``engine-vllm:{component}/rank-{r}`` check per written rank to ``report``, judged by the vLLM that
    ``python`` (default: this interpreter) imports. Raises :class:`EngineError` when there is no vLLM there or it
    cannot be built; a failed judgement is a failed check, never an exception."""
    manifest = _manifest(out, report)
    if manifest is None:
        return
    if report.target is None:  # an unverified target is repeated whichever checks run
        report.target = manifest.get("target")
    opts = manifest.get("options") or {}
    tp = int(opts.get("tp", 1))
    ep = opts.get("moe_parallel", "tp") == "ep"
    only = opts.get("only")
    # the folders the manifest lists files in: the target, the draft of either kind (OUT/mtp or OUT/dspark)
    written = {rel.split("/", 1)[0] for rel in manifest.get("outputs") or {}}
    components = [c for c in COMPONENTS if c in written and selects(only, c)]
    if not components:
        report.add(Check("engine-vllm", False, f"{out / MANIFEST}: lists no output file; rerun convert"))
        return
    ranks = [int(r) for r in manifest["ranks"]] if manifest.get("ranks") is not None else list(range(tp))
    config_dir = out / components[0]
    drafts = [c for c in components if c != "model"]
    draft_dir = out / drafts[0] if drafts else None  # vLLM's speculative config picks the method from its config.json

    rank_files = {
        (c, r): sorted((out / c).glob(f"model-rank-{r}-part-*.safetensors")) for c in components for r in ranks
    }
    jobs = [
        {
            "component": c,
            "rank": r,
            "folder": str(out / c),
            "real_load": bool(files) and sum(p.stat().st_size for p in files) <= real_load_max_bytes,
        }
        for (c, r), files in rank_files.items()
    ]
    request = {
        "protocol": PROTOCOL,
        "config_dir": str(config_dir),
        "draft_dir": str(draft_dir) if draft_dir else None,
        "tp": tp,
        "ep": ep,
        "jobs": jobs,
    }
    t0 = time.perf_counter()
    answer = run_probe(request, python)
    seconds = time.perf_counter() - t0
    versions = answer["versions"] or {}
    vllm = f"vLLM {versions.get('vllm_version', '?')}"
    allowed = _documented_prefix(out, manifest, components)
    hint = _series_hint(opts.get("vllm_series"), versions.get("vllm_version"))
    for res in answer["results"]:
        comp, rank = res["component"], res["rank"]
        check = _rank_check(out, comp, rank, rank_files[(comp, rank)], res, allowed.get(comp, set()), vllm)
        if not check.ok and hint:
            check = replace(check, message=check.message + hint)
        report.add(check)
    report.engine = {
        "vllm_version": versions.get("vllm_version"),
        "vllm_location": versions.get("vllm_location"),
        "python": versions.get("python"),  # the interpreter that ran vLLM (sys.executable there)
        "engine_python": python or sys.executable,  # as given to --engine-python
        "torch_version": versions.get("torch_version"),
        "stubbed_modules": versions.get("stubbed_modules", []),
        "profile": manifest.get("profile"),
        "tp": tp,
        "expert_parallel": ep,
        "ranks": len(answer["results"]),
        "real_loads": sum(1 for r in answer["results"] if r.get("load") is not None),
        "loads": _loads(answer["results"]),
        "seconds": round(seconds, 2),
    }


def _loads(results: list[dict]) -> list[dict]:
    """What each rank's real load cost, as the probe measured it around vLLM's ``load_weights``: seconds, the tensor
    bytes the loader read from the rank's files (``bytes``), how much of that came from the disk rather than the page
    cache (``disk_read_bytes``, null where /proc/self/io is not readable), CPU seconds, peak RSS."""
    loads = []
    for res in results:
        load = res.get("load")
        if load is None:
            continue
        cost = load.get("cost") or {}
        loads.append(
            {
                "component": res["component"],
                "rank": res["rank"],
                "seconds": load.get("seconds"),
                "bytes": cost.get("tensor_bytes"),
                "disk_read_bytes": cost.get("disk_read_bytes"),
                "cpu_seconds": cost.get("cpu_seconds"),
                "peak_rss_bytes": cost.get("peak_rss_bytes"),
            }
        )
    return loads


def load_text(load: dict) -> str:
    """``5.38 MiB in 0.017 s (0 B from disk)``: one rank's real load."""
    disk = load.get("disk_read_bytes")
    return (
        f"{_size(load.get('bytes'))} in {load.get('seconds')} s"
        f" ({'disk reads unknown' if disk is None else _size(disk) + ' from disk'})"
    )


def _size(n: int | None) -> str:
    if n is None:
        return "? B"
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _series_hint(written_for: str | None, judged: str | None) -> str:
    """What a failed judgement adds when OUT was written for another vLLM series than the one judging it (a draft
    whose parameters differ between the series its profile covers: DeepSeek V4.1's DSpark)."""
    if not written_for or not judged or series_of(judged) == series_of(written_for):
        return ""
    return (
        f" — OUT was converted for vLLM {written_for} (manifest options.vllm_series), not {judged}: convert again "
        f"with --vllm {judged} for this vLLM"
    )


def _manifest(out: Path, report: VerifyReport) -> dict | None:
    """OUT's manifest; a failed ``manifest`` check (added unless a level already checked it) when it is unusable."""
    path = out / MANIFEST
    checked = any(c.name == "manifest" for c in report.checks)
    try:
        manifest = json.loads(path.read_text())
        problem = None if manifest.get("complete") is True else "conversion is not complete; rerun convert to finish it"
    except FileNotFoundError:
        manifest, problem = None, "missing; OUT is not a finished ckpt-tool conversion"
    except (OSError, ValueError) as exc:
        manifest, problem = None, f"unreadable ({exc})"
    if problem is not None:
        if not checked:
            report.add(Check("manifest", False, f"{path}: {problem}", file=str(path)))
        return None
    if not checked:
        report.add(Check("manifest", True))
    return manifest


def _documented_prefix(out: Path, manifest: dict, components: list[str]) -> dict[str, set[str]]:
    """Per component, the keys OUT's profile documents as a smaller tensor the loader copies into a slice."""
    opts = manifest.get("options") or {}
    profile = canonical_name(str(opts.get("profile", manifest.get("profile"))))
    if profile not in ENGINES:
        return {}
    allowed = {}
    for comp in components:
        try:
            cfg = V4Config.load(out / comp / "config.json")
        except CkptToolError:
            continue  # nothing is documented for an unreadable config; the probe names the problem
        params = engine_params(
            cfg,
            profile,
            comp,
            int(opts.get("tp", 1)),
            opts.get("moe_parallel", "tp"),
            0,
            opts.get("vllm_series"),
            opts.get("nvfp4_input_scales"),
        )
        allowed[comp] = {k for k, p in params.items() if p.prefix}
    return allowed


def _held(files: list[Path]) -> tuple[dict[str, HeldTensor], list[tuple[str, str, str]], list[str]]:
    """(key -> tensor as the files hold it, keys held twice, unreadable files) of one rank's files."""
    held: dict[str, HeldTensor] = {}
    duplicates: list[tuple[str, str, str]] = []
    unreadable: list[str] = []
    for path in files:
        rel = path.name
        try:
            header = read_shard_header(path, rel)
        except CkptToolError as exc:
            unreadable.append(str(exc))
            continue
        for name, t in header.tensors.items():
            if name in held:
                duplicates.append((name, held[name].file, rel))
            else:
                held[name] = HeldTensor(t.dtype, tuple(t.shape), rel)
    return held, duplicates, unreadable


def _rank_check(out: Path, comp: str, rank: int, files: list[Path], res: dict, allowed: set[str], vllm: str) -> Check:
    name = f"engine-vllm:{comp}/rank-{rank}"
    where = f"{comp}/model-rank-{rank}-part-*.safetensors"
    cls = res["class"].rsplit(".", 1)[-1]
    table = {k: (d, s) for k, (d, s) in res["table"].items()}
    details: dict = {"vllm": vllm, "class": res["class"], "parameters": len(table), "files": [p.name for p in files]}
    if not files:
        problems = [(f"no {where} in {out / comp} (the loader raises 'Could not find checkpoint files')", None)]
        prefix: list[str] = []
    else:
        held, duplicates, unreadable = _held(files)
        problems = [(text, None) for text in unreadable]
        found, prefix = judge_files(table, held, duplicates, res.get("aliases", {}), allowed)
        problems += found
    load = res.get("load")
    if load is not None:
        load_problems, others = judge_load(load, res["table"], allowed)
        problems += load_problems
        cost = load.get("cost") or {}
        details["real_load"] = {
            "seconds": load.get("seconds"),
            "bytes": cost.get("tensor_bytes"),
            "disk_read_bytes": cost.get("disk_read_bytes"),
            "cpu_seconds": cost.get("cpu_seconds"),
            "peak_rss_bytes": cost.get("peak_rss_bytes"),
            "exception": load.get("exception"),
            "warnings": others,
        }
    else:
        details["real_load"] = None
    details["prefix_loads"] = prefix
    if problems:
        shown = "; ".join(m for m, _ in problems[:MESSAGE_KEYS])
        more = f" (and {len(problems) - MESSAGE_KEYS} more)" if len(problems) > MESSAGE_KEYS else ""
        details["problems"] = [m for m, _ in problems]
        return Check(
            name,
            False,
            f"{where} judged by {vllm} ({cls}): {len(problems)} problem(s): {shown}{more}",
            file=where,
            tensor=problems[0][1],
            details=details,
        )
    how = (
        f"ShardedStateLoader.load_weights loaded them ({load_text(details['real_load'])})"
        if load is not None
        else "parameter table only: files too large for a real load here"
    )
    sliced = f"; {len(prefix)} documented slice load(s) ({prefix[0].rsplit('.', 1)[-1]})" if prefix else ""
    others = (details["real_load"] or {}).get("warnings") or []
    warned = (
        f"; the loader also warned: {others[0]}" + (f" (and {len(others) - 1} more)" if len(others) > 1 else "")
        if others
        else ""
    )
    return Check(
        name,
        True,
        f"{where} judged by {vllm} ({cls}): {len(table)} parameters match; {how}{sliced}{warned}",
        file=where,
        details=details,
    )


def run_probe(request: dict, python: str | None = None) -> dict:
    """Run probe.py with ``python`` (default: this interpreter); its answer, or :class:`EngineError`."""
    python = python or sys.executable
    exe = Path(python)
    if os.sep in python and not exe.is_file():
        raise EngineError(f"--engine-python {python}: no such file; {NO_VLLM_HINT}")
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")  # the build computes nothing; threads only cost memory
    try:
        proc = subprocess.run([python, str(PROBE)], input=json.dumps(request), capture_output=True, text=True, env=env)
    except OSError as exc:
        raise EngineError(f"--engine-python {python}: cannot run it ({exc.strerror or exc}); {NO_VLLM_HINT}") from None
    log.debug("vLLM probe stderr:\n%s", proc.stderr)
    try:
        answer = json.loads(proc.stdout)
    except ValueError:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise EngineError(
            f"the vLLM probe run by {python} exited {proc.returncode} without an answer ({tail[0].strip()[:300]}); "
            "rerun with --debug to see its output"
        ) from None
    fatal = answer.get("fatal")
    if fatal:
        log.debug("vLLM probe traceback:\n%s", "".join(fatal.get("traceback") or []))
        if fatal["kind"] == "no-vllm":
            raise EngineError(f"no vLLM to judge with: {python} cannot import vllm; {NO_VLLM_HINT}")
        version = (answer.get("versions") or {}).get("vllm_version", "?")
        if fatal.get("hint"):  # a requirement of vLLM missing where it is installed: say what to install
            raise EngineError(
                f"vLLM {version} ({python}) cannot be built: {fatal['message']}; {fatal['hint']}; nothing was judged"
            )
        raise EngineError(
            f"vLLM {version} ({python}) cannot be built on this machine: {fatal['message']}; nothing was judged "
            "(the CPU stubs are ckpt_tool/verify/engine/vllm_stubs.py; --debug shows vLLM's traceback)"
        )
    return answer
