"""Numeric verification: every output tensor (linear_check.py), and the reference forward of every MTP
layer from the source and from the output, with every routed expert sent tokens and carrying probe rows.

Side A (the spec): one rank over the ORIGINAL checkpoint in DeepSeek's names, every linear
dequantized exactly in plain torch (:mod:`ckpt_tool.verify.quant`) and multiplied in float32.
Side B (what the engine holds): T ranks over the CONVERTED checkpoint in the engine's names, linears
run on the still-quantized weights through the fp8-block / MXFP4 GEMM kernels, ranks combined as a
TP engine does (:mod:`ckpt_tool.verify.reference`). Both run on the same seeded tokens and hidden states.

Both sides round activations the same way before each linear (bf16 by default, as the kernels feed
their dot products), so they compute the same math up to float32 summation order (per rank, per
kernel tile). bf16 rounding is discontinuous, though: a 1e-7 difference can flip one element's
rounding (a 2^-8 relative step), so the noise floor is set by bf16, not float32. Measured on the
fixtures at tp 1/2/4: torch backend max_rel <= 4e-7; Triton interpreter max_rel <= 1.3e-3 with
cosine >= 0.99999990 (a few tokens carry one flipped rounding). Without matching the rounding at
all, near-tied expert choices flip and max_rel reaches ~0.4 on a correct conversion. Defaults
(``TOLERANCES``): max_rel <= 2e-2 and cosine >= 0.9999 leave >10x headroom over that floor while
every corruption the self-tests inject (swapped fused halves, wrong rank slice, numeric E8M0) lands
far outside them. Structure and value checks run
first and catch byte-level corruption exactly; this level proves the layout means what the engine
will compute.

The vision model (DeepseekV4ForConditionalGeneration) serves the same draft, so the forward is the same: its
``bias_vl`` routes only the image sentinel tokens (vLLM's router, ``fused_moe/router/dsv4_topk.py``, 0.33.0/0.34.0),
which text tokens never are, so the forward does not read it; linear_check compares it, the tower and the aligner
by value and counts them in the coverage.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, cdiv
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo, read_shard_header
from ckpt_tool.checkpoint.reader import DropBehind, Scratch
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.mapping.profiles import PROFILES, EngineNames
from ckpt_tool.verify import tiled_matmul as quant  # the tiled matmuls (quant.py keeps the formats)
from ckpt_tool.verify.compute_pool import (
    ComputePool,
    ForkedTasks,
    can_fork_workers,
    compute_slot,
    fan_out,
    map_tasks,
)
from ckpt_tool.verify.one_pass import OnePass, Walk, places
from ckpt_tool.verify.reference import MTPOutput, compare_outputs, mtp_layer_forward
from ckpt_tool.verify.rows import RowReader, read_tile_rows, release_freed_memory, source_info
from ckpt_tool.verify.verdict import Check, Progress, VerifyReport, problems_check, skipped_check

if TYPE_CHECKING:
    from ckpt_tool.verify.linear_check import Coverage

log = logging.getLogger(__name__)

# key -> (comparison, bound). Justified in the module docstring; printed in every report.
TOLERANCES: dict[str, tuple[str, float]] = {
    "logits_cosine": (">=", 0.9999),
    "hidden_cosine": (">=", 0.9999),
    "logits_max_rel": ("<=", 2e-2),
    "hidden_max_rel": ("<=", 2e-2),
    "top1_agreement": (">=", 0.9),
    "top5_agreement": (">=", 1.0),
}

# Roles of the reference forward → tensor names. Source side: suffix after ``mtp.{i}.``.
SOURCE_TENSORS = {
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "norm": "norm.weight",
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "q_norm": "attn.q_norm.weight",
    "kv_norm": "attn.kv_norm.weight",
    "attn_sink": "attn.attn_sink",
    "gate.weight": "ffn.gate.weight",
    "gate.bias": "ffn.gate.bias",
    **{f"hc_{p}_{t}": f"hc_{p}_{t}" for p in ("attn", "ffn", "head") for t in ("fn", "base", "scale")},
}
SOURCE_LINEARS = {
    "e_proj": "e_proj",
    "h_proj": "h_proj",
    "wq_a": "attn.wq_a",
    "wkv": "attn.wkv",
    "wq_b": "attn.wq_b",
    "wo_a": "attn.wo_a",
    "wo_b": "attn.wo_b",
    "shared.w1": "ffn.shared_experts.w1",
    "shared.w2": "ffn.shared_experts.w2",
    "shared.w3": "ffn.shared_experts.w3",
}


def converted_tensor_names(engine: EngineNames) -> dict[str, str]:
    """Converted side: role -> engine name in one MTP layer ({S} = num_hidden_layers + i), from the profile's
    engine names (where the router, shared and routed experts live). Never read from the rule table, so a
    wrong rule cannot make both sides agree; tests/test_profile_consistency.py holds these names to the
    engine table of every profile."""
    blk, ffn = "model.layers.{S}.mtp_block", "model.layers.{S}.mtp_block.{part}"
    gate, shared = ffn.format(S="{S}", part=engine.gate), ffn.format(S="{S}", part=engine.shared)
    return {
        "enorm": "model.layers.{S}.enorm.weight",
        "hnorm": "model.layers.{S}.hnorm.weight",
        "norm": "model.layers.{S}.shared_head.norm.weight",
        "hc_head_fn": "model.layers.{S}.hc_head_fn",
        "hc_head_base": "model.layers.{S}.hc_head_base",
        "hc_head_scale": "model.layers.{S}.hc_head_scale",
        "attn_norm": f"{blk}.attn_norm.weight",
        "ffn_norm": f"{blk}.ffn_norm.weight",
        "q_norm": f"{blk}.attn.q_norm.weight",
        "kv_norm": f"{blk}.attn.kv_norm.weight",
        "attn_sink": f"{blk}.attn.attn_sink",
        "gate.weight": f"{gate}.weight",
        "gate.bias": f"{gate}.e_score_correction_bias",
        **{f"hc_{p}_{t}": f"{blk}.hc_{p}_{t}" for p in ("attn", "ffn") for t in ("fn", "base", "scale")},
        "embed": "model.embed_tokens.weight",
        "head": "model.layers.{S}.shared_head.head.weight",
        # linears: base names of (weight, scale)
        "e_proj": "model.layers.{S}.e_proj",
        "h_proj": "model.layers.{S}.h_proj",
        "fused_wqa_wkv": f"{blk}.attn.fused_wqa_wkv",
        "wq_b": f"{blk}.attn.wq_b",
        "wo_a": f"{blk}.attn.wo_a",
        "wo_b": f"{blk}.attn.wo_b",
        "gate_up_proj": f"{shared}.gate_up_proj",
        "down_proj": f"{shared}.down_proj",
        "experts": ffn.format(S="{S}", part=engine.routed),
    }


CONVERTED_TENSORS: dict[str, dict[str, str]] = {name: converted_tensor_names(p.engine) for name, p in PROFILES.items()}


_local = threading.local()


def _tile_buffers() -> tuple[Scratch, Scratch]:
    """This thread's buffers for a weight tile and its scales: :func:`_gemm_by_tiles` multiplies each tile
    before it reads the next, and the two sides of the forward are compared by their outputs only."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = (Scratch(), Scratch())
    return bufs


def _gemm_by_tiles(
    x: torch.Tensor, rows: int, row_bytes: int, align: int, tile, gemm, pool: ComputePool | None
) -> torch.Tensor:
    """``x[..., in] @ W.T`` for a weight of ``rows`` output rows of ``row_bytes``, read ``tile(a, b) -> (w, s)`` a
    tile at a time; the tiles on ``pool`` when called outside it (the head), else in this thread (an expert)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    step = read_tile_rows(rows, row_bytes, align)

    def one(a: int) -> torch.Tensor:
        w, s = tile(a, min(a + step, rows))
        with compute_slot(pool):
            return gemm(x2, w, s)

    y = torch.cat(list(map_tasks(pool, one, range(0, rows, step))), dim=-1)
    return y.reshape(*lead, rows)


class SourceShard:
    """Side A: the original checkpoint, one rank, dequantized in plain torch a tile at a time."""

    def __init__(
        self,
        cfg: V4Config,
        ckpt: Checkpoint,
        mtp: int,
        device: torch.device,
        reader: RowReader,
        act: str = "bf16",
        pool: ComputePool | None = None,
    ) -> None:
        self.cfg, self.mtp, self.act, self.pool = cfg, mtp, act, pool
        self.rank, self.tp = 0, 1
        self.local_experts = list(range(cfg.n_routed_experts))
        self.ckpt, self.reader, self.device = ckpt, reader, device
        self.names = set(ckpt.tensors)
        p = f"mtp.{mtp}."
        # the draft model's one embedding is mtp.0's (seed loader), else the main one
        self.embed_name = "mtp.0.emb.tok_emb.weight" if "mtp.0.emb.tok_emb.weight" in self.names else "embed.weight"
        self.head_name = p + "head.weight" if p + "head.weight" in self.names else "head.weight"

    def _info(self, name: str) -> TensorInfo:
        return source_info(self.ckpt, name)

    def _rows(self, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        return self.reader.source_rows(self.ckpt, name, r0, r1, into).to(self.device)

    def tensor(self, role: str) -> torch.Tensor:
        info = self._info(f"mtp.{self.mtp}." + SOURCE_TENSORS[role])
        return self.reader.source_whole(self.ckpt, info).to(self.device).float()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._rows(self.embed_name, int(i), int(i) + 1) for i in ids.tolist()]).float()

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        from ckpt_tool.verify.kernels.fp8_gemm import prepare_activation

        p, cfg = f"mtp.{self.mtp}.", self.cfg
        if role == "head":
            return _gemm_by_tiles(
                x,
                cfg.vocab_size,
                2 * x.shape[-1],
                1,
                lambda a, b: (self._rows(self.head_name, a, b, _tile_buffers()[0]), None),
                lambda x2, w, s: quant.bf16_matmul(x2, w),
                self.pool,
            )
        r0 = 0
        if role.startswith("expert."):
            _, j, w = role.split(".")
            base = f"{p}ffn.experts.{j}.{w}"
        elif role.startswith("wo_a."):
            r0 = int(role.split(".")[1]) * cfg.o_lora_rank
            base = p + SOURCE_LINEARS["wo_a"]
        else:
            base = p + SOURCE_LINEARS[role]
        fp4 = role.startswith("expert.") and cfg.expert_dtype == "fp4"
        rows = cfg.o_lora_rank if role.startswith("wo_a.") else self._info(base + ".weight").shape[0]
        align = 1 if fp4 else FP8_BLOCK

        def tile(a: int, b: int):
            a, b = r0 + a, r0 + b
            s0, s1 = (a, b) if fp4 else (a // FP8_BLOCK, cdiv(b, FP8_BLOCK))
            w_buf, s_buf = _tile_buffers()
            return self._rows(base + ".weight", a, b, w_buf), self._rows(base + ".scale", s0, s1, s_buf)

        # Same activation rounding as the kernels (bf16, or per-token-group fp8; the MXFP4 GEMM always
        # takes bf16): both sides then compute identical math up to summation order, so routing
        # decisions cannot flip on rounding noise and the tolerances can stay tight.
        def gemm(x2, w, s):
            if fp4:
                return quant.mxfp4_matmul(prepare_activation(x2, "bf16"), w, s, what=base)
            return quant.fp8_block_matmul(prepare_activation(x2, self.act), w, s, what=base)

        return _gemm_by_tiles(x, rows, x.shape[-1] // 2 if fp4 else x.shape[-1], align, tile, gemm, self.pool)


class ConvertedShard:
    """Side B: one rank of the converted checkpoint, linears through the quantized GEMM kernels a tile at a time."""

    def __init__(
        self,
        cfg: V4Config,
        plan: Plan,
        out: Path,
        headers: dict[str, ShardHeader],
        rank: int,
        mtp: int,
        device: torch.device,
        reader: RowReader,
        kernels: str,
        act: str,
        pool: ComputePool | None = None,
    ) -> None:
        opts = plan.options
        self.cfg, self.rank, self.tp, self.pool = cfg, rank, opts.tp, pool
        self.kernels, self.act, self.reader, self.device = kernels, act, reader, device
        E = cfg.n_routed_experts
        self.local_experts = (
            list(range(E)) if opts.moe_parallel == "tp" else list(range(rank * E // opts.tp, (rank + 1) * E // opts.tp))
        )
        S = cfg.num_hidden_layers + mtp
        if opts.profile not in CONVERTED_TENSORS:
            raise CheckpointError(f"numeric verify has no name table for profile {opts.profile!r}")
        self.names = {k: v.format(S=S) for k, v in CONVERTED_TENSORS[opts.profile].items()}
        self.locate: dict[str, tuple[Path, TensorInfo]] = {}
        for f in plan.files:
            if f.component == "mtp" and f.rank == rank and f.relpath in headers:
                self.locate.update({n: (out / f.relpath, t) for n, t in headers[f.relpath].tensors.items()})
        self.fp4 = cfg.expert_dtype == "fp4"

    def _info(self, name: str) -> tuple[Path, TensorInfo]:
        hit = self.locate.get(name)
        if hit is None:
            raise CheckpointError(f"tensor {name!r} is not in rank {self.rank}'s files")
        return hit

    def _rows(self, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        path, info = self._info(name)
        return self.reader.rows(path, info, r0, r1, into).to(self.device)

    def tensor(self, role: str) -> torch.Tensor:
        path, info = self._info(self.names[role])
        return self.reader.whole(path, info).to(self.device).float()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        name = self.names["embed"]
        return torch.cat([self._rows(name, int(i), int(i) + 1) for i in ids.tolist()]).float()

    def _linear(
        self,
        x: torch.Tensor,
        weight: str,
        scale: str,
        r0: int,
        rows: int,
        *,
        mx: bool,
        slot: int | None = None,
        what: str,
    ) -> torch.Tensor:
        """Rows [r0, r0 + rows) of ``weight`` (of stacked expert ``slot``) through the kernel."""
        from ckpt_tool.verify.kernels import fp8_block_gemm, mxfp4_gemm

        wbase = sbase = 0
        if slot is not None:
            wbase = slot * self._info(weight)[1].shape[1]
            sbase = slot * self._info(scale)[1].shape[1]
        if not mx and (r0 % FP8_BLOCK or (rows % FP8_BLOCK and r0 + rows != self._info(weight)[1].shape[-2])):
            raise CheckpointError(f"{weight}: rows {r0}:{r0 + rows} do not fall on {FP8_BLOCK}-row scale blocks")

        def tile(a: int, b: int):
            a, b = r0 + a, r0 + b
            s0, s1 = (a, b) if mx else (a // FP8_BLOCK, cdiv(b, FP8_BLOCK))
            w_buf, s_buf = _tile_buffers()
            return self._rows(weight, wbase + a, wbase + b, w_buf), self._rows(scale, sbase + s0, sbase + s1, s_buf)

        def gemm(x2, w, s):
            if mx:
                return mxfp4_gemm(x2, w, s, backend=self.kernels, what=what)
            return fp8_block_gemm(x2, w, s, act=self.act, backend=self.kernels, what=what)

        return _gemm_by_tiles(
            x, rows, x.shape[-1] // 2 if mx else x.shape[-1], 1 if mx else FP8_BLOCK, tile, gemm, self.pool
        )

    def _fp8(self, x: torch.Tensor, base: str, r0: int = 0, rows: int | None = None) -> torch.Tensor:
        if rows is None:
            rows = self._info(base + ".weight")[1].shape[0] - r0
        return self._linear(x, base + ".weight", base + ".weight_scale_inv", r0, rows, mx=False, what=base)

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        n, cfg = self.names, self.cfg
        if role == "head":
            name = n["head"]
            rows = self._info(name)[1].shape[0]
            return _gemm_by_tiles(
                x,
                rows,
                2 * x.shape[-1],
                1,
                lambda a, b: (self._rows(name, a, b, _tile_buffers()[0]), None),
                lambda x2, w, s: quant.bf16_matmul(x2, w),
                self.pool,
            )
        if role in ("e_proj", "h_proj", "wq_b", "wo_b"):
            return self._fp8(x, n[role])
        if role in ("wq_a", "wkv"):
            Qr, Dh = cfg.q_lora_rank, cfg.head_dim
            r0, rows = (0, Qr) if role == "wq_a" else (Qr, Dh)
            return self._fp8(x, n["fused_wqa_wkv"], r0, rows)
        if role.startswith("wo_a."):
            g, Or = int(role.split(".")[1]), cfg.o_lora_rank
            return self._fp8(x, n["wo_a"], g * Or, Or)
        if role in (
            "shared.w1",
            "shared.w3",
        ):  # w1 rows then w3 rows, each the rank's share (zero-padded by the engine)
            half = self._info(n["gate_up_proj"] + ".weight")[1].shape[0] // 2
            return self._fp8(x, n["gate_up_proj"], 0 if role == "shared.w1" else half, half)
        if role == "shared.w2":
            return self._fp8(x, n["down_proj"])
        if role.startswith("expert."):
            _, j, which = role.split(".")
            slot = self.local_experts.index(int(j))
            base = n["experts"]
            sfx = "weight_scale" if self.fp4 else "weight_scale_inv"
            mx = self.fp4
            what = f"{base} expert {j} {which}"
            if which == "w2":
                rows = self._info(f"{base}.w2_weight")[1].shape[1]
                return self._linear(x, f"{base}.w2_weight", f"{base}.w2_{sfx}", 0, rows, mx=mx, slot=slot, what=what)
            half = self._info(f"{base}.w13_weight")[1].shape[1] // 2
            r0 = 0 if which == "w1" else half
            return self._linear(x, f"{base}.w13_weight", f"{base}.w13_{sfx}", r0, half, mx=mx, slot=slot, what=what)
        raise KeyError(f"unknown linear role {role!r}")


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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("--device cuda requested but no CUDA device is available")
    return torch.device(device)


class _ProbedShard:
    """A rank shard whose routed-expert linears also carry seeded probe rows (the per-linear check of
    every MTP expert, riding on the forward's GEMMs so each expert is dequantized once per side)."""

    def __init__(self, shard, seed: int, sliced: bool, device: torch.device) -> None:
        self.shard, self.seed, self.sliced, self.device = shard, seed, sliced, device
        self.rank, self.tp, self.local_experts = shard.rank, shard.tp, shard.local_experts
        self.outputs: dict[str, torch.Tensor] = {}

    def tensor(self, role: str) -> torch.Tensor:
        return self.shard.tensor(role)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shard.embedding(ids)

    def probe(self, role: str, width: int) -> torch.Tensor:
        """This rank's columns of the role's seeded ``[PROBE_ROWS, in]`` probe (w2 under tp: its input slice)."""
        from ckpt_tool.verify.linear_check import PROBE_ROWS

        full = width * (self.tp if self.sliced and role.endswith(".w2") else 1)
        g = torch.Generator().manual_seed(zlib.crc32(role.encode()) ^ (self.seed * 0x9E3779B1 & 0xFFFFFFFF))
        x = torch.randn(PROBE_ROWS, full, generator=g).to(self.device)
        if full != width:
            x = x[:, self.rank * width : (self.rank + 1) * width]
        return x

    def linear(self, role: str, x: torch.Tensor) -> torch.Tensor:
        if not role.startswith("expert."):
            return self.shard.linear(role, x)
        x2 = x.reshape(-1, x.shape[-1]).float()
        y = self.shard.linear(role, torch.cat([x2, self.probe(role, x2.shape[-1])]))
        n = x2.shape[0]
        self.outputs[role] = y[n:]
        return y[:n].reshape(*x.shape[:-1], y.shape[-1])


def compare_expert_probes(
    cfg: V4Config,
    plan: Plan,
    source: _ProbedShard,
    converted: list[_ProbedShard],
    mtp: int,
) -> tuple[list[tuple[str, str]], set[tuple[int, str]]]:
    """Each routed expert's probe outputs: the source linear against the ranks recombined (tp: w1/w3 rows
    concatenated, w2 partial sums added; ep: the owner's). Returns (message, tensor) failures and what was
    compared, for the coverage to credit: ``(rank, source part)`` for each part of each expert whose probe
    output every side computed, e.g. ``(1, "mtp.0.ffn.experts.5.w3")``."""
    from ckpt_tool.verify.linear_check import LINEAR_MAX_REL

    opts = plan.options
    S = cfg.num_hidden_layers + mtp
    base = CONVERTED_TENSORS[opts.profile]["experts"].format(S=S)
    sfx = "weight_scale" if cfg.expert_dtype == "fp4" else "weight_scale_inv"
    bad: list[tuple[str, str]] = []
    compared: set[tuple[int, str]] = set()
    for j in range(cfg.n_routed_experts):
        holders = [c for c in converted if j in c.local_experts]
        for which in ("w1", "w3", "w2"):
            role = f"expert.{j}.{which}"
            want = source.outputs.get(role)
            outs = [c.outputs.get(role) for c in holders]
            if want is None or any(o is None for o in outs):
                continue  # not computed: the coverage counts it missing
            compared.update((c.rank, f"mtp.{mtp}.ffn.experts.{j}.{which}") for c in holders)
            if which == "w2" or len(holders) == 1:  # row parallel: partial sums added; ep: the owner's
                pairs = [
                    ("ranks summed" if len(outs) > 1 else f"rank {holders[0].rank}", want, torch.stack(outs).sum(0))
                ]
            else:  # column parallel: each rank's output columns are its slice of the source rows
                n = want.shape[-1] // len(outs)
                pairs = [
                    (f"rank {c.rank}", want[:, i * n : (i + 1) * n], o) for i, (c, o) in enumerate(zip(holders, outs))
                ]
            for where, ref, got in pairs:
                rel = (ref - got).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                if rel <= LINEAR_MAX_REL:
                    continue
                w = f"{base}.{'w2' if which == 'w2' else 'w13'}_weight"
                bad.append(
                    (
                        f"tensor {w!r} (scale {w.replace('_weight', '_' + sfx)!r}) expert {j} ({where}): output of "
                        "part "
                        f"mtp.{mtp}.ffn.experts.{j}.{which} disagrees with the source linear: max_rel {rel:.3g} "
                        f"(needs <= {LINEAR_MAX_REL:g})",
                        w,
                    )
                )
                break
    return bad, compared


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
        probes: list[_ProbedShard] | None = None,
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
                [_ProbedShard(self.sides[0][0], seed, False, device)],
                [_ProbedShard(c, seed, tp_split, device) for c in self.sides[1]],
            ]
            probes.extend(self.sides[0] + self.sides[1])
        self.results: dict[int, MTPOutput] = {}
        # a child hands its side's outputs (the probe rows of every expert on every rank: 0.4 GB at V4-Pro widths)
        # back through a file in memory, written from the tensors and read into new ones, never copied in between
        self.files = [_TensorFile(), _TensorFile()]

    def forward(self, which: int, pool: ComputePool | None) -> MTPOutput:
        for shard in self.sides[which]:
            (shard.shard if isinstance(shard, _ProbedShard) else shard).pool = pool

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
        result, put = self.forward(which, pool), self.files[which].put
        return (
            put(result.hidden),
            put(result.logits),
            [{role: put(t) for role, t in getattr(s, "outputs", {}).items()} for s in self.sides[which]],
        )

    def absorb(self, which: int, answer: tuple) -> None:
        hidden, logits, outputs = answer
        get = self.files[which].get
        self.results[which] = MTPOutput(get(hidden), get(logits))
        for shard, got in zip(self.sides[which], outputs):
            if isinstance(shard, _ProbedShard):
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
    its own): the two sides at once in forked processes where :func:`_may_fork` allows, else one after the other
    here."""
    with RowReader(direct_root=out, source=ckpt.open_bytes(direct=True)) as reader:
        layer = LayerForward(cfg, plan, ckpt, out, mtp, inputs, reader, **options)
        if _may_fork(pool, options["device"]):
            for which, answer in fan_out(2, 2, layer.side_task, servers=1):
                layer.absorb(which, answer)
        return layer.finish(pool)


def _may_fork(pool: ComputePool | None, device: torch.device) -> bool:
    """Whether work goes to forked processes: more than one worker, CPU tensors, and a process that may fork."""
    return pool is not None and pool.workers > 1 and device.type == "cpu" and can_fork_workers()


class _TensorFile:
    """float32 tensors handed from a forked child to its parent through an anonymous file (memfd where there is
    one): :meth:`put` in the child writes one and returns ``(shape, offset)``, :meth:`get` in the parent reads it."""

    def __init__(self) -> None:
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("ckpt-tool-forward")
        else:
            import tempfile

            self.fd = os.dup(tempfile.TemporaryFile().fileno())
        self.end = 0

    def put(self, t: torch.Tensor) -> tuple[list[int], int]:
        arr = t.detach().to(torch.float32).contiguous().numpy()
        at, view = self.end, memoryview(arr).cast("B")
        while view:
            view = view[os.pwrite(self.fd, view, self.end) :]
            self.end = at + arr.nbytes - len(view)
        return list(t.shape), at

    def get(self, entry: tuple[list[int], int]) -> torch.Tensor:
        shape, at = entry
        t = torch.empty(shape, dtype=torch.float32)
        view = memoryview(t.numpy()).cast("B")
        while view:
            n = os.preadv(self.fd, [view], at)
            if n <= 0:
                raise CheckpointError("the MTP forward's worker process handed back a truncated result")
            view, at = view[n:], at + n
        return t

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _no_grad(fn):
    """``fn`` under ``torch.no_grad()`` (grad mode is per thread: a pool thread starts with it on)."""

    def run(item):
        with torch.no_grad():
            return fn(item)

    return run


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
    layer (one check each; skipped when OUT has no MTP draft), then coverage (linear_check.Coverage: units
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
        from ckpt_tool.verify.kernels import resolve_backend
        from ckpt_tool.verify.linear_check import TensorCheck

        self.cfg, self.plan, self.progress = plan.config, plan, progress
        self.out, self.headers, self.ckpt = out, headers, ckpt
        self._stack = ExitStack()
        try:
            self.pool = self._stack.enter_context(ComputePool(workers))
            self.device = resolve_device(device)
            # one pass (verify paces the workers by its values walk, start(walk)): every read goes through the page
            # cache, where the walk has just left the bytes; alone, the level reads each byte once, directly
            self.one_pass = one_pass and _may_fork(self.pool, self.device)
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
            self.layers: dict[int, tuple[LayerForward, list[_ProbedShard]] | str] = {}
            for i in range(self.cfg.num_nextn_predict_layers if self.has_mtp else 0):
                probes: list[_ProbedShard] = []
                try:
                    layer = LayerForward(
                        self.cfg,
                        plan,
                        ckpt,
                        out,
                        i,
                        inputs,
                        reader,
                        device=self.device,
                        kernels=kernels,
                        act=act,
                        headers=headers,
                        probes=probes,
                        seed=seed,
                    )
                except (CheckpointError, KeyError, ValueError, RuntimeError) as exc:
                    self.layers[i] = str(exc)
                    continue
                self.layers[i] = (layer, probes)
                self._stack.callback(layer.close)
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

    def __enter__(self) -> NumericLevel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, walk: Walk | None = None, window: int = 0) -> None:
        """Fork the workers, where allowed, and collect their answers on a thread.

        ``walk`` (the values level's walk, ``levels.values_walk``; with ``one_pass`` only): release each task to the
        workers once the walk has read its bytes, and hold the walk within ``window`` OUT bytes of the tasks
        released and not yet answered (:attr:`pace`, which the walk calls; ckpt_tool.verify.one_pass)."""
        if not _may_fork(self.pool, self.device):
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
        self._collector = threading.Thread(target=self._collect, name="numeric-answers", daemon=True)
        self._collector.start()

    def _unit_reads(self, comp: str, unit) -> tuple[list[tuple[Path, int, int]], list[tuple[Path, int, int]]]:
        """The byte ranges a per-tensor unit reads, ``(path, start, end)``: of OUT (a routed expert: its slot of each
        rank's stack) and of the source."""
        from ckpt_tool.verify.linear_check import ExactUnit, unit_tensors

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
        else:
            names = [f"{p.source}.{what}" for p in unit.parts for what in ("weight", "scale")]
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
        from ckpt_tool.mapping.plan import ZERO

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
    entry: tuple[LayerForward, list[_ProbedShard]] | str,
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
