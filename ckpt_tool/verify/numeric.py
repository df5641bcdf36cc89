"""The numeric level: every output tensor against the source (:mod:`ckpt_tool.verify.linear_check`), then the
reference forward of every MTP layer from the source and from the output, with every routed expert sent tokens and
carrying probe rows, then the coverage; prepared, run on forked workers beside the values level, and reported.

Side A (the spec): one rank over the ORIGINAL checkpoint in DeepSeek's names, every linear
dequantized exactly in plain torch (:mod:`ckpt_tool.verify.quant`) and multiplied in float32.
Side B (what the engine holds): T ranks over the CONVERTED checkpoint in the engine's names, linears
run on the still-quantized weights through the fp8-block / MXFP4 GEMM kernels, ranks combined as a
TP engine does (:mod:`ckpt_tool.verify.reference`). Both run on the same seeded tokens and hidden states
(the sides: :mod:`ckpt_tool.verify.weight_sides`; the forward and its tolerances, justified there:
:mod:`ckpt_tool.verify.mtp_forward`; the probe rows: :mod:`ckpt_tool.verify.expert_probes`). Structure and value
checks run first and catch byte-level corruption exactly; this level proves the layout means what the engine
will compute.
"""

from __future__ import annotations

import queue
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import ShardHeader
from ckpt_tool.checkpoint.reader import DropBehind
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.plan import ZERO, Plan
from ckpt_tool.processes import signal_free
from ckpt_tool.verify.compute_pool import ComputePool, ForkedTasks, may_fan_out
from ckpt_tool.verify.coverage import Coverage
from ckpt_tool.verify.expert_probes import ProbedShard, compare_expert_probes
from ckpt_tool.verify.kernels import resolve_backend
from ckpt_tool.verify.linear_check import TensorCheck
from ckpt_tool.verify.mtp_forward import TOLERANCES, LayerForward, NumericInputs, make_inputs, within_tolerance
from ckpt_tool.verify.one_pass import OnePass, Walk, places
from ckpt_tool.verify.reference import compare_outputs
from ckpt_tool.verify.rows import RowReader, release_freed_memory
from ckpt_tool.verify.tensor_units import ExactUnit, unit_tensors
from ckpt_tool.verify.verdict import Check, Progress, VerifyReport, problems_check, skipped_check


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda requested but no CUDA device is available")
    return torch.device(device)


def check_numeric(
    out: Path, plan: Plan, ckpt: Checkpoint, headers: dict[str, ShardHeader], report: VerifyReport, **options: Any
) -> None:
    """The numeric level on its own: :class:`NumericLevel` (``options``: its keyword arguments) started and
    finished at once."""
    with NumericLevel(out, plan, ckpt, headers, **options) as level:
        level.start()
        level.finish(report)


class NumericLevel:
    """The numeric level: every output tensor against the source (linear_check), then the forward of every MTP
    layer (one check each; skipped when OUT has no MTP draft), then coverage (coverage.Coverage: units
    computed / expected, per rank, expert and fused part). ``workers``: processes (or tiles) computing at once
    (:class:`~ckpt_tool.verify.compute_pool.ComputePool`; default one per CPU).

    In three steps, so that the level can compute while the values level reads (``verify`` runs both at once):
    the constructor prepares every check; :meth:`start` forks the workers and starts a thread collecting their
    answers (call it before any other thread starts: a fork copies no thread, see ``can_fork_workers``);
    :meth:`finish` takes the answers, computes here whatever no worker answered (everything, where no fork is
    allowed) and adds the checks to the report. Leaving the ``with`` block stops workers still running (the values
    level failed, or an error) and frees what the level holds.
    """

    def __init__(
        self,
        out: Path,
        plan: Plan,
        ckpt: Checkpoint,
        headers: dict[str, ShardHeader],
        *,
        kernels: str,
        device: str,
        tokens: int,
        seed: int,
        act: str = "bf16",
        progress: Progress | None = None,
        workers: int | None = None,
        one_pass: bool = False,
    ) -> None:
        self.cfg, self.plan, self.progress = plan.config, plan, progress
        self.out, self.headers, self.ckpt = out, headers, ckpt
        self._stack = ExitStack()
        try:
            self.pool = self._stack.enter_context(ComputePool(workers))
            self.device = resolve_device(device)
            # one pass (verify paces the workers by its values walk, start(walk)): every read goes through the page
            # cache, where the walk has just left the bytes; alone, the level reads each byte once, directly
            self.one_pass = one_pass and may_fan_out(self.pool, self.device)
            self.run = {
                "backend": resolve_backend(kernels, self.device),
                "device": str(self.device),
                "tokens": tokens,
                "seed": seed,
            }
            self.has_mtp = plan.options.only != "model" and any(f.component == "mtp" for f in plan.files)
            inputs = make_inputs(self.cfg, tokens, seed, self.device) if self.has_mtp else None
            reader = self._stack.enter_context(
                RowReader(direct_root=None, source=ckpt.open_bytes())
                if self.one_pass
                else RowReader(direct_root=out, source=ckpt.open_bytes(direct=True))
            )
            # MTP routed experts are checked by probe rows riding on the forward (every expert routed), so each is
            # dequantized once per side; everything else by the per-tensor check.
            self.check = TensorCheck(
                out,
                plan,
                ckpt,
                headers,
                reader,
                kernels=kernels,
                device=self.device,
                seed=seed,
                act=act,
                progress=progress,
                skip_mtp_experts=self.has_mtp,
                pool=self.pool,
            )
            # MTP layer -> its forward and probed shards, or why the forward could not be built
            self.layers = self._prepare_forwards(inputs, reader, kernels=kernels, act=act, seed=seed)
            self.forwards = [entry[0] for entry in self.layers.values() if not isinstance(entry, str)]
            # the work forked processes take from one queue: the forward's sides first (the largest tasks), then
            # the per-tensor units, each process taking the next task when done with one, so that no core waits for
            # another's last
            self.sides = [(layer, which) for layer in self.forwards for which in (0, 1)]
        except BaseException:
            self._stack.close()
            raise
        self._forked: ForkedTasks | None = None
        self._drop: DropBehind | None = None
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (task, answer) from the workers; None: no more
        self._collector: threading.Thread | None = None
        self.pace: OnePass | None = None

    def _prepare_forwards(
        self, inputs: NumericInputs | None, reader: RowReader, *, kernels: str, act: str, seed: int
    ) -> dict[int, tuple[LayerForward, list[ProbedShard]] | str]:
        """Each MTP layer's :class:`LayerForward` with its probed shards, or why it could not be built (none when OUT
        has no MTP draft); each forward is closed with the level."""
        layers: dict[int, tuple[LayerForward, list[ProbedShard]] | str] = {}
        for i in range(self.cfg.num_nextn_predict_layers if self.has_mtp else 0):
            probes: list[ProbedShard] = []
            try:
                layer = LayerForward(
                    self.cfg,
                    self.plan,
                    self.ckpt,
                    self.out,
                    i,
                    inputs,
                    reader,
                    device=self.device,
                    kernels=kernels,
                    act=act,
                    headers=self.headers,
                    probes=probes,
                    seed=seed,
                )
            except (CheckpointError, KeyError, ValueError, RuntimeError) as exc:
                layers[i] = str(exc)
                continue
            layers[i] = (layer, probes)
            self._stack.callback(layer.close)
        return layers

    def __enter__(self) -> NumericLevel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, walk: Walk | None = None, window: int = 0) -> None:
        """Fork the workers, where allowed, and collect their answers on a thread.

        ``walk`` (the values level's walk, ``values.values_walk``; with ``one_pass`` only): release each task to the
        workers once the walk has read its bytes, and hold the walk within ``window`` OUT bytes of the tasks
        released and not yet answered (:attr:`pace`, which the walk calls; ckpt_tool.verify.one_pass)."""
        if not may_fan_out(self.pool, self.device):
            return
        paced = walk is not None and self.one_pass
        if paced:  # tasks numbered in walk order, so that a batch of units (a V4-Pro's many) lies in one stretch
            where = places(walk)
            reads = [self._unit_reads(comp, unit) for comp, unit in self.check.jobs]
            unit_needs = [self._needs(out) for out, _ in reads]
            self.check.order = sorted(
                range(len(self.check.jobs)),
                key=lambda i: max(
                    ((where[r][0], where[r][2] + end) for r, end in unit_needs[i].items() if r in where),
                    default=(-1, 0),
                ),
            )

        def run(task: int, child_pool: ComputePool):  # in a forked child
            if task < len(self.sides):
                layer, which = self.sides[task]
                return layer.side_task(which, child_pool)
            return self.check.task(task - len(self.sides), child_pool)

        tasks = len(self.sides) + self.check.tasks
        self._forked = ForkedTasks(tasks, self.pool.workers, run, released=paced).start()
        if paced:
            self.pace = OnePass(walk, self._task_needs(unit_needs), self._forked.release, window)
            self._plan_drops(reads)
        self._collector = threading.Thread(target=signal_free(self._collect), name="numeric-answers", daemon=True)
        self._collector.start()

    def _unit_reads(self, comp: str, unit) -> tuple[list[tuple[Path, int, int]], list[tuple[Path, int, int]]]:
        """The byte ranges a per-tensor unit reads, ``(path, start, end)``: of OUT (a routed expert: its slot of each
        rank's stack) and of the source."""
        sides, out = self.check.runners[comp].sides, []
        slots = dict(zip(unit.ranks, unit.local)) if getattr(unit, "expert", None) is not None else {}
        for rank in unit.ranks:
            for name in unit_tensors(unit):
                try:
                    path, info = sides.engine_info(rank, name)
                except CheckpointError:
                    continue  # the unit fails on it; no byte of the walk to wait for
                start, end = info.start, info.end
                if rank in slots and info.shape:  # a stacked [experts, rows, cols] tensor: one expert's slot
                    per = (end - start) // info.shape[0]
                    start, end = start + slots[rank] * per, start + (slots[rank] + 1) * per
                out.append((path, start, end))
        if isinstance(unit, ExactUnit):
            names = [unit.source]
        elif unit.kind == "bf16":
            names = [p.source for p in unit.parts]
        else:  # NVIDIA's NVFP4 experts: their E4M3 block scale and F32 global scale (linear_check._SOURCE_SCALE)
            suffixes = ("weight", "weight_scale", "weight_scale_2") if unit.kind == "nvfp4" else ("weight", "scale")
            names = [f"{p.source}.{what}" for p in unit.parts for what in suffixes]
        tensors = self.ckpt.tensors
        src = [(self.ckpt.root / t.file, t.start, t.end) for t in (tensors.get(n) for n in names) if t is not None]
        return out, src

    def _needs(self, out: list[tuple[Path, int, int]]) -> dict[str, int]:
        """OUT relpath -> the end of the last byte read there."""
        needs: dict[Path, int] = {}
        for path, _, end in out:
            needs[path] = max(needs.get(path, 0), end)
        return {str(path.relative_to(self.out)): end for path, end in needs.items()}

    def _plan_drops(self, reads: list[tuple[list, list]]) -> None:
        """What leaves the page cache when a task is answered (ckpt_tool.checkpoint.reader.DropBehind): the OUT and
        source bytes its units read, which the walk has passed for good. Not a source tensor that more than one
        component's files are cut from (the embedding and head, read again by the other component's walk), and
        nothing the MTP forward reads until both its sides have answered (then the MTP files and the source of the
        MTP units, the routed experts' included)."""
        users: dict[tuple[str, int], set[str]] = {}
        for f in self.plan.files:
            for t in f.tensors:
                for seg in t.segments:
                    if seg.src != ZERO:
                        info = self.plan.sources[seg.src]
                        users.setdefault((info.file, info.start), set()).add(f.component)
        shared = {(self.ckpt.root / file, start) for (file, start), comps in users.items() if len(comps) > 1}
        self._drop = DropBehind()
        self._drops: list[list[tuple[Path, int, int]]] = [[] for _ in self.sides]
        forward: list[tuple[Path, int, int]] = []
        for task in range(self.check.tasks):
            mine = []
            for i in self.check.order[task * self.check.per : (task + 1) * self.check.per]:
                out, src = reads[i]
                ranges = out + [r for r in src if (r[0], r[1]) not in shared]
                (forward if self.sides and self.check.jobs[i][0] == "mtp" else mine).extend(ranges)
            self._drops.append(mine)
        if self.sides:
            forward += [(self.out / rel, 0, end) for rel, end in self._task_needs([])[0].items()]
            for unit in self.check.coverage.units.get("mtp", []):  # the routed experts: the forward's probes
                forward += [r for r in self._unit_reads("mtp", unit)[1] if (r[0], r[1]) not in shared]
        self._forward_drops, self._sides_left = forward, len(self.sides)

    def _dropped(self, task: int) -> None:
        """Task ``task`` answered: drop what it read, once nothing else will (:meth:`_plan_drops`)."""
        for path, start, end in self._drops[task]:
            self._drop.drop(path, start, end)
        if task < len(self.sides):
            self._sides_left -= 1
            if not self._sides_left:
                for path, start, end in self._forward_drops:
                    self._drop.drop(path, start, end)

    def _task_needs(self, unit_needs: list[dict[str, int]]) -> list[dict[str, int]]:
        """Per task (the forward's sides, then the per-tensor batches; ``unit_needs``: per unit): relpath -> end offset
        of what it reads. A side of the forward reads every MTP file (side A the source rows of the same tensors), so
        it waits for the walk to pass the whole component."""
        mtp = {
            f.relpath: self.headers[f.relpath].file_size
            for f in self.plan.files
            if f.component == "mtp" and f.relpath in self.headers
        }
        needs: list[dict[str, int]] = [dict(mtp) for _ in self.sides]
        check = self.check
        for task in range(check.tasks if unit_needs else 0):
            merged: dict[str, int] = {}
            for i in check.order[task * check.per : (task + 1) * check.per]:
                for rel, end in unit_needs[i].items():
                    merged[rel] = max(merged.get(rel, 0), end)
            needs.append(merged)
        return needs

    def _collect(self) -> None:
        pace = self.pace
        try:
            for task, answer in self._forked.results(ended=pace.worker_gone if pace is not None else None):
                self._answers.put((task, answer))
                if pace is not None:
                    pace.answered(task)
                    self._dropped(task)
        finally:
            if pace is not None:
                pace.give_up()
            self._answers.put(None)

    def _no_forward_reason(self) -> str:
        if self.cfg.is_v41:
            # the reference forward is DeepSeek-V4's MTP layer; V4.1's draft is DSpark, its blocks V4.1's
            return (
                "DeepSeek V4.1: the reference forward runs DeepSeek V4's classic MTP layers only, and V4.1's draft is "
                "DSpark; every V4.1 tensor (the MXFP8 linears through the kernels, the Engram tables by bucket, the "
                "draft's stages and heads) is checked per tensor, counted in the coverage"
            )
        if any(f.component == "dspark" for f in self.plan.files):
            # DeepSeek-V4's reference inference code has no DSpark forward to hold the stages against
            return (
                "OUT holds a DSpark draft: the reference forward runs classic MTP layers only; every DSpark tensor "
                "(main_proj, context_wkv_proj, each stage's attention and experts, the Markov and confidence heads) is "
                "checked per tensor through the kernels or by value, counted in the coverage"
            )
        return "OUT holds no MTP draft (converted with --only model): no MTP layer to run"

    def finish(self, report: VerifyReport) -> None:
        """Wait for the workers' answers, compute what none answered, and add the level's checks to ``report``."""
        self.check.stage()
        if self.pace is not None:  # the walk is over: whatever it did not release goes now, and the queue ends
            self.pace.release_all()
            self._forked.end()
        if not self.has_mtp:
            report.add(skipped_check("numeric:mtp-forward", self._no_forward_reason()))
        while self._collector is not None and (item := self._answers.get()) is not None:
            task, answer = item
            if task < len(self.sides):
                layer, which = self.sides[task]
                layer.absorb(which, answer)
            else:
                self.check.absorb(answer)
        release_freed_memory()  # what the values level's threads left in the heap, before computing here
        coverage = self.check.finish(report, self.pool)
        for i, entry in self.layers.items():
            _check_layer(self.cfg, self.plan, i, entry, coverage, report, self.pool, self.progress, self.run)
        summary, missed = coverage.summary()
        report.coverage = summary
        total, short = summary["total"], summary["total"] - summary["checked"]
        if not total:
            report.add(
                skipped_check(
                    "numeric:coverage",
                    "n/a: OUT holds nothing the numeric level computes (0 of 0 units)",
                    details=summary,
                )
            )
        elif short:
            report.add(
                Check(
                    "numeric:coverage",
                    False,
                    f"{short} of {total} units not computed numerically ({summary['percent']} % covered), "
                    f"e.g. {missed[0]}",
                    details={**summary, "not_computed": missed},
                )
            )
        else:
            report.add(Check("numeric:coverage", True, details=summary))

    def close(self) -> None:
        """Stop workers still computing, reap them, and free the readers and the forward's files."""
        if self._forked is not None:
            self._forked.stop()  # their pipes end, so the collecting thread returns
            self._collector.join()
            self._forked.close()
            self._forked = None
        if self._drop is not None:
            self._drop.close()
        self._stack.close()


def _check_layer(
    cfg: V4Config,
    plan: Plan,
    i: int,
    entry: tuple[LayerForward, list[ProbedShard]] | str,
    coverage: Coverage,
    report: VerifyReport,
    pool: ComputePool,
    progress: Progress | None,
    run: dict,
) -> None:
    """MTP layer ``i``'s checks: its forward's two sides compared, its routed experts' probe rows compared and
    credited to the coverage. ``entry``: the prepared forward, or why it could not be built."""
    S = cfg.num_hidden_layers + i
    name = f"numeric:mtp.{i}(layer {S})"

    def failed(why: object) -> None:
        report.add(Check(name, False, f"layer {S}: forward from the converted weights failed: {why}"))

    if isinstance(entry, str):
        failed(entry)
        return
    layer, probes = entry
    release_freed_memory()
    if progress is not None:
        progress.advance(0, f"mtp.{i} forward")
    try:
        a, b = layer.finish(pool)
    except (CheckpointError, KeyError, ValueError, RuntimeError) as exc:
        failed(exc)
        return
    bad, compared = compare_expert_probes(cfg, plan, probes[0], probes[1:], i)
    coverage.credit("mtp", compared)
    report.add(
        problems_check(
            f"numeric:mtp/mtp.{i} (layer {S}) routed experts",
            f"mtp/mtp.{i} (layer {S})",
            bad,
            {"experts": cfg.n_routed_experts, "parts_compared": len(compared)},
        )
    )
    metrics = compare_outputs(a, b)
    bad = within_tolerance(metrics)
    entry = {
        "layer": S,
        "mtp": i,
        **run,
        "route_all": True,
        **metrics,
        "tolerances": {k: f"{op} {v}" for k, (op, v) in TOLERANCES.items()},
        "ok": not bad,
    }
    report.numeric.append(entry)
    msg = "" if not bad else f"layer {S}: converted MTP layer disagrees with the source forward: " + ", ".join(bad)
    report.add(Check(name, not bad, msg, details=entry))
