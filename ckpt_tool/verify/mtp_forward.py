"""One MTP layer's reference forward on both weight sides (:mod:`ckpt_tool.verify.weight_sides`), on the same seeded
inputs, and how far the two outputs may differ (``TOLERANCES``).

Both sides round activations the same way before each linear (bf16 by default, as the kernels feed
their dot products), so they compute the same math up to float32 summation order (per rank, per
kernel tile). bf16 rounding is discontinuous, though: a 1e-7 difference can flip one element's
rounding (a 2^-8 relative step), so the noise floor is set by bf16, not float32. Measured on the
fixtures at tp 1/2/4: torch backend max_rel <= 4e-7; Triton interpreter max_rel <= 1.3e-3 with
cosine >= 0.99999990 (a few tokens carry one flipped rounding). Without matching the rounding at
all, near-tied expert choices flip and max_rel reaches ~0.4 on a correct conversion. Defaults
(``TOLERANCES``): max_rel <= 2e-2 and cosine >= 0.9999 leave >10x headroom over that floor while
every corruption the self-tests inject (swapped fused halves, wrong rank slice, numeric E8M0) lands
far outside them.

The vision model (DeepseekV4ForConditionalGeneration) serves the same draft, so the forward is the same: its
``bias_vl`` routes only the image sentinel tokens (vLLM's router, ``fused_moe/router/dsv4_topk.py``, 0.33.0/0.34.0),
which text tokens never are, so the forward does not read it; linear_check compares it, the tower and the aligner
by value and counts them in the coverage.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import ShardHeader, read_shard_header
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.processes import HandBackFile
from ckpt_tool.verify.compute_pool import ComputePool, fan_out, map_tasks, may_fan_out
from ckpt_tool.verify.expert_probes import ProbedShard
from ckpt_tool.verify.reference import MTPOutput, mtp_layer_forward
from ckpt_tool.verify.rows import RowReader
from ckpt_tool.verify.weight_sides import ConvertedShard, SourceShard

# key -> (comparison, bound). Justified in the module docstring; printed in every report.
TOLERANCES: dict[str, tuple[str, float]] = {
    "logits_cosine": (">=", 0.9999),
    "hidden_cosine": (">=", 0.9999),
    "logits_max_rel": ("<=", 2e-2),
    "hidden_max_rel": ("<=", 2e-2),
    "top1_agreement": (">=", 0.9),
    "top5_agreement": (">=", 1.0),
}


@dataclass(frozen=True)
class NumericInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    prev_hidden: torch.Tensor


def make_inputs(cfg: V4Config, tokens: int, seed: int, device: torch.device) -> NumericInputs:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    hidden = torch.randn(tokens, cfg.hc_mult * cfg.hidden_size, generator=g)
    return NumericInputs(ids.to(device), torch.arange(tokens, device=device), hidden.to(device))


def within_tolerance(metrics: dict[str, float]) -> list[str]:
    """Names of the metrics outside ``TOLERANCES`` (with their values)."""
    bad = []
    for key, (op, bound) in TOLERANCES.items():
        v = metrics[key]
        ok = v >= bound if op == ">=" else v <= bound
        if not ok:
            bad.append(f"{key}={v:.6g} (needs {op} {bound})")
    return bad


class LayerForward:
    """Side A and side B of one MTP layer on the same inputs, prepared to run: :meth:`side_task` computes one
    side (in a forked child of ``compute_pool.fan_out``, whose result :meth:`absorb` takes back), and
    :meth:`finish` computes here whatever side no child answered and returns both.

    Side B reads every replicated role from rank 0; the other ranks' copies of replicated tensors are
    proven by the per-tensor check (linear_check), which compares each rank's copy with the source.
    ``route_all`` (the verify default) sends every routed expert tokens. With ``probes`` (a list to
    fill), the expert linears also carry probe rows: ``probes`` gets the source shard then the ranks. The
    pool a side runs on computes its experts (and the head's tiles).
    """

    def __init__(
        self,
        cfg: V4Config,
        plan: Plan,
        ckpt: Checkpoint,
        out: Path,
        mtp: int,
        inputs: NumericInputs,
        reader: RowReader,
        *,
        device: torch.device,
        kernels: str,
        act: str,
        headers: dict[str, ShardHeader] | None = None,
        route_all: bool = True,
        probes: list[ProbedShard] | None = None,
        seed: int = 0,
    ) -> None:
        if headers is None:
            headers = {
                f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files if f.component == "mtp"
            }
        self.cfg, self.inputs, self.route_all = cfg, inputs, route_all
        self.sides: list[list] = [
            [SourceShard(cfg, ckpt, mtp, device, reader, act, None)],
            [
                ConvertedShard(cfg, plan, out, headers, r, mtp, device, reader, kernels, act, None)
                for r in range(plan.options.tp)
            ],
        ]
        if probes is not None:
            tp_split = plan.options.moe_parallel == "tp"
            self.sides = [
                [ProbedShard(self.sides[0][0], seed, False, device)],
                [ProbedShard(c, seed, tp_split, device) for c in self.sides[1]],
            ]
            probes.extend(self.sides[0] + self.sides[1])
        self.results: dict[int, MTPOutput] = {}
        # a child hands its side's outputs (the probe rows of every expert on every rank: 0.4 GB at V4-Pro widths)
        # back through a file in memory, written from the tensors and read into new ones, never copied in between
        self.files = [HandBackFile("ckpt-tool-forward"), HandBackFile("ckpt-tool-forward")]

    def forward(self, which: int, pool: ComputePool | None) -> MTPOutput:
        for shard in self.sides[which]:
            (shard.shard if isinstance(shard, ProbedShard) else shard).pool = pool

        def map_fn(fn, items):
            return map_tasks(pool, _no_grad(fn), items)

        with torch.no_grad():
            return mtp_layer_forward(
                self.cfg,
                self.sides[which],
                self.inputs.input_ids,
                self.inputs.positions,
                self.inputs.prev_hidden,
                route_all=self.route_all,
                map_fn=map_fn,
            )

    def side_task(self, which: int, pool: ComputePool | None) -> tuple:
        """In a child: side ``which`` computed, its outputs written to this side's file; marshal-able."""
        result, put = self.forward(which, pool), partial(_put_tensor, self.files[which])
        return (
            put(result.hidden),
            put(result.logits),
            [{role: put(t) for role, t in getattr(s, "outputs", {}).items()} for s in self.sides[which]],
        )

    def absorb(self, which: int, answer: tuple) -> None:
        hidden, logits, outputs = answer
        get = partial(_get_tensor, self.files[which])
        self.results[which] = MTPOutput(get(hidden), get(logits))
        for shard, got in zip(self.sides[which], outputs):
            if isinstance(shard, ProbedShard):
                shard.outputs.update({role: get(t) for role, t in got.items()})
        self.files[which].close()

    def finish(self, pool: ComputePool | None) -> tuple[MTPOutput, MTPOutput]:
        """Both sides: a side no child answered is computed here, on ``pool``."""
        try:
            for which in (0, 1):
                if which not in self.results:
                    self.results[which] = self.forward(which, pool)
        finally:
            self.close()
        return self.results[0], self.results[1]

    def close(self) -> None:
        for f in self.files:
            f.close()


def run_layer(
    cfg: V4Config,
    plan: Plan,
    ckpt: Checkpoint,
    out: Path,
    mtp: int,
    inputs: NumericInputs,
    *,
    pool: ComputePool | None = None,
    **options: Any,
) -> tuple[MTPOutput, MTPOutput]:
    """One MTP layer's :class:`LayerForward` on its own (``options``: its keyword arguments; it gets a reader of
    its own): the two sides at once in forked processes where
    :func:`~ckpt_tool.verify.compute_pool.may_fan_out` allows, else one after the other here."""
    with RowReader(direct_root=out, source=ckpt.open_bytes(direct=True)) as reader:
        layer = LayerForward(cfg, plan, ckpt, out, mtp, inputs, reader, **options)
        if may_fan_out(pool, options["device"]):
            for which, answer in fan_out(2, 2, layer.side_task, servers=1):
                layer.absorb(which, answer)
        return layer.finish(pool)


def _no_grad(fn):
    """``fn`` under ``torch.no_grad()`` (grad mode is per thread: a pool thread starts with it on)."""

    def run(item):
        with torch.no_grad():
            return fn(item)

    return run


def _put_tensor(file: HandBackFile, t: torch.Tensor) -> tuple[list[int], int]:
    """In a child: ``t`` as float32 written to ``file``, from the tensor's memory (no copy in between); returns
    ``(shape, offset)``."""
    return list(t.shape), file.put(t.detach().to(torch.float32).contiguous().numpy())


def _get_tensor(file: HandBackFile, entry: tuple[list[int], int]) -> torch.Tensor:
    """In the parent: the float32 tensor :func:`_put_tensor` wrote, read into a new one."""
    shape, at = entry
    t = torch.empty(shape, dtype=torch.float32)
    if not file.read_into(memoryview(t.numpy()).cast("B"), at):
        raise CheckpointError("the MTP forward's worker process handed back a truncated result")
    return t
