"""Numeric check of every output tensor: each converted linear against the source linear(s), by the engine's names.

The MTP forward (mtp_forward.py) proves one layer computes what the source computes, but on a handful
of tokens it reaches few routed experts and it never runs a main-model layer. This check covers the
rest: every linear of every layer, target model and MTP alike (each routed expert, each part of a
fused weight, each TP rank), runs through the fp8-block / MXFP4 GEMM kernels on seeded probe inputs,
ranks recombined as the engine does (column-parallel outputs concatenated, row-parallel partial sums
added, expert-parallel ranks each holding their own experts; where the engine zero-pads a split, the
padded rows must compute exactly zero and the padded inputs carry probe values that must add
nothing), and is compared with the source
linear dequantized in torch (:mod:`ckpt_tool.verify.quant`). Tensors no quantized kernel runs are compared
exactly by value, tile by tile: bf16 linears (embedding, heads, router, compressor, indexer
projections) and non-linear tensors (norms, ``hc_*``, sinks, biases, ``tid2eid``, ``ape``).

DeepSeek V4.1 (``DeepseekV41ForCausalLM`` and its DSpark draft): its MXFP8 linears run as kind ``mxfp8``, the
source with its checkpoint's 32x32 E8M0 blocks in torch and each rank through the kernel with the scale as vLLM
holds it, one row a weight row (1x32 blocks), so a scale row expanded to the wrong weight rows fails; its routed
experts as V4's MXFP4; each Engram table and its per-row scale byte for byte, each rank against the source rows of
its hash heads (``EngramLayout.rank_rows``: uneven), a tile of rows at a time.

Independence: the engine side is named from :mod:`ckpt_tool.mapping.engine_table` (the engine's parameter table,
tested against vLLM itself) and the source side from DeepSeek's names written out below; the rule
table is never consulted, so a rule that maps the wrong bytes (swapped fused parts, a wrong expert,
a wrong rank slice) makes the two sides disagree.

Work and memory: weights are read with ``pread`` a tile of rows at a time (``rows.read_tile_rows``,
4 MiB of weight bytes) on both sides and dequantized in smaller tiles that stay in cache
(``quant.dequant_matmul``), so the peak does not grow with hidden size or expert count. Each source tile is
multiplied once and compared with every rank's piece of it. Units run in ``verify --workers`` forked
processes (``verify.compute_pool.fan_out``; threads of one :class:`~ckpt_tool.verify.compute_pool.ComputePool` where
forking is not safe), each computing one tile at a time while a second thread reads its next.

Tolerance: both sides round the probe activation the same way and differ only by float32
summation order (row-parallel partial sums, kernel tiles): ``max|a - b| / max|a| <= 1e-3`` per part
and rank (measured <= 1e-6 on the torch path); a mapping bug moves it to O(1).
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, MX_BLOCK, cdiv
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import EngramLayout, engram_layout
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo
from ckpt_tool.checkpoint.reader import Scratch
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError, UsageError
from ckpt_tool.mapping.engine_table import ENGINES, EngineNames
from ckpt_tool.mapping.plan import Plan
from ckpt_tool.mapping.profiles import draft_kind_of, model_class_of
from ckpt_tool.verify import quant
from ckpt_tool.verify.compute_pool import ComputePool, compute_slot, map_tasks
from ckpt_tool.verify.rows import RowReader, read_tile_rows, row_count, source_info
from ckpt_tool.verify.verdict import NoProgress, Progress, VerifyReport, problems_check

log = logging.getLogger(__name__)

PROBE_ROWS = 4
LINEAR_MAX_REL = 1e-3


@dataclass(frozen=True)
class Part:
    """One source linear inside an engine linear: ``source`` is a DeepSeek base name (quantized:
    ``.weight`` + ``.scale``) or a full tensor name (bf16); ``rows`` its output features."""

    source: str
    rows: int
    row0: int = 0  # the part's first row in the source tensor (a section of a tensor fused on disk: q|k|v)
    section: str = ""  # that section's name, which tells its coverage unit apart

    @property
    def key(self) -> str:
        """What coverage counts this part as: the source, or one section of it."""
        return f"{self.source} ({self.section})" if self.section else self.source


@dataclass(frozen=True)
class LinearUnit:
    """An engine linear (or one routed expert's slot of a stacked one) and the source parts it holds.

    ``layout``: ``full`` — every rank in ``ranks`` holds all parts stacked by rows (replicated, or an
    expert-parallel expert on its owner); ``col`` — each part's rows split over the ranks, a rank
    holding its slice of every part in order (column parallel); ``row`` — the input features split
    over the ranks, partial outputs summed (row parallel).
    """

    group: str
    weight: str
    scale: str | None
    kind: str  # fp8 | mxfp8 | mxfp4 | bf16 (mxfp8: V4.1, 32x32 scale blocks in the source, 1x32 in OUT)
    parts: tuple[Part, ...]
    inp: int
    layout: str
    ranks: tuple[int, ...]
    expert: int | None = None  # global routed expert (the engine tensor is stacked)
    local: tuple[int, ...] = ()  # per entry of ranks: the expert's slot in that rank's stack
    # col/row: each part's rows (col) or the inputs (row) a rank holds when the engine zero-pads the split to
    # whole blocks (real ones first, a rank past the end all zeros); None: an even split
    per_rank: int | None = None

    def share(self, size: int) -> int:
        """What one rank holds of a split dim of ``size``."""
        return self.per_rank if self.per_rank is not None else size // len(self.ranks)

    @property
    def label(self) -> str:
        return self.weight if self.expert is None else f"{self.weight}[expert {self.expert}]"


@dataclass(frozen=True)
class ExactUnit:
    """A non-linear tensor compared by value: whole on every rank, split evenly by rows (``col``), or each rank its own
    row range (``rows``)."""

    group: str
    name: str
    source: str
    layout: str
    ranks: tuple[int, ...]
    sections: int = 1  # col: the source is this many equal sections, each split over the ranks (a q|k|v bias)
    # layout "rows": per entry of ranks, the [start, end) source rows the rank holds (an Engram table's hash heads),
    # compared byte for byte a tile of rows at a time
    rows: tuple[tuple[int, int], ...] = ()


Unit = LinearUnit | ExactUnit


class _Builder:
    """The unit table of one component: engine names (engine.py) against DeepSeek source names."""

    def __init__(self, cfg: V4Config, names: EngineNames, tp: int, ep: bool, source_names: set[str]) -> None:
        self.cfg, self.n, self.tp, self.ep = cfg, names, tp, ep
        self.source_names = source_names
        self.units: list[Unit] = []
        self.group = ""
        self.all_ranks = tuple(range(tp))

    def exact(self, name: str, source: str, layout: str = "full", sections: int = 1) -> None:
        self.units.append(ExactUnit(self.group, name, source, layout, self.all_ranks, sections))

    def fp8(self, base: str, parts: list[tuple[str, int]], inp: int, layout: str, per_rank: int | None = None) -> None:
        self.units.append(
            LinearUnit(
                self.group,
                f"{base}.weight",
                f"{base}.weight_scale_inv",
                "fp8",
                tuple(Part(s, r) for s, r in parts),
                inp,
                layout,
                self.all_ranks,
                per_rank=per_rank,
            )
        )

    def mxfp8(self, base: str, parts: list[tuple[str, int]], inp: int, layout: str) -> None:
        """A V4.1 MXFP8 linear: the source's ``.weight`` + ``.scale`` (32x32 blocks) against the engine's ``.weight``
        + ``.weight_scale`` (one scale row a weight row)."""
        ps = tuple(Part(s, r) for s, r in parts)
        self.units.append(
            LinearUnit(self.group, f"{base}.weight", f"{base}.weight_scale", "mxfp8", ps, inp, layout, self.all_ranks)
        )

    def bf16(self, name: str, parts: list[tuple[str, int]] | list[Part], inp: int, layout: str = "full") -> None:
        ps = tuple(p if isinstance(p, Part) else Part(*p) for p in parts)
        self.units.append(LinearUnit(self.group, name, None, "bf16", ps, inp, layout, self.all_ranks))

    def rows(self, name: str, source: str, ranges: list[tuple[int, int]]) -> None:
        """A tensor each rank holds its own row range of (``ranges``, one per rank), compared byte for byte: a unit
        per rank, so that the ranks of a ~100 GB table are read by several workers at once."""
        for r, rows in zip(self.all_ranks, ranges, strict=True):
            self.units.append(ExactUnit(self.group, name, source, "rows", (r,), rows=(rows,)))

    def vision(self, image_pad: bool = True) -> None:
        """The vision tower, aligner and image_* (vllm/models/deepseek_v4/common/vision.py): BF16 linears compared
        by value, split as the engine splits them (q|k|v and gate|up per section), or whole on every rank when
        vision_n_heads does not divide tp."""
        c = self.cfg
        D, I, H, P, r = c.vision_dim, c.vision_inter_dim, c.hidden_size, c.vision_patch_size, c.vision_downsample_ratio
        split = c.vision_n_heads % self.tp == 0
        col, row = ("col", "row") if split else ("full", "full")
        self.group = "vision"
        self.bf16("vision.patch_embed.proj.weight", [("vision.patch_embed.proj.weight", D)], 3 * P * P)
        self.exact("vision.patch_embed.proj.bias", "vision.patch_embed.proj.bias")
        for b in range(c.vision_n_layers):
            p = f"vision.blocks.{b}"
            self.group = p
            self.exact(f"{p}.norm1.weight", f"{p}.norm1.weight")
            self.exact(f"{p}.norm2.weight", f"{p}.norm2.weight")
            qkv = f"{p}.attn.wqkv.weight"
            self.bf16(qkv, [Part(qkv, D, k * D, sec) for k, sec in enumerate("qkv")], D, col)
            self.exact(f"{p}.attn.wqkv.bias", f"{p}.attn.wqkv.bias", col, sections=3 if split else 1)
            self.bf16(f"{p}.attn.wo.weight", [(f"{p}.attn.wo.weight", D)], D, row)
            self.exact(f"{p}.attn.wo.bias", f"{p}.attn.wo.bias")
            w1 = f"{p}.mlp.w1.weight"
            self.bf16(w1, [Part(w1, I, 0, "gate"), Part(w1, I, I, "up")], D, col)
            self.bf16(f"{p}.mlp.w2.weight", [(f"{p}.mlp.w2.weight", D)], I, row)
        self.group = "vision"
        self.exact("vision.norm.weight", "vision.norm.weight")
        self.bf16("aligner.w1.weight", [("aligner.w1.weight", H)], D * r * r, col)
        self.exact("aligner.w1.bias", "aligner.w1.bias", col)
        self.bf16("aligner.w2.weight", [("aligner.w2.weight", H)], H, row)
        self.exact("aligner.w2.bias", "aligner.w2.bias")
        for name in ("image_start", "image_end", "image_newline", "image_pad")[: 4 if image_pad else 3]:
            self.exact(name, name)

    def attention(self, p: str, sp: str, linear: Callable[..., None]) -> tuple[str, str]:
        """A block's norms, hyper-connections and the attention every V4 and V4.1 block has, its quantized linears
        added by ``linear`` (:meth:`fp8` or :meth:`mxfp8`); returns the engine's and the source's attention prefix."""
        c = self.cfg
        D, H, Dh, Qr = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
        G, Or = c.o_groups, c.o_lora_rank
        self.exact(f"{p}.attn_norm.weight", f"{sp}.attn_norm.weight")
        self.exact(f"{p}.ffn_norm.weight", f"{sp}.ffn_norm.weight")
        for part in ("attn", "ffn"):
            for t in ("fn", "base", "scale"):
                self.exact(f"{p}.hc_{part}_{t}", f"{sp}.hc_{part}_{t}")
        a, sa = f"{p}.attn", f"{sp}.attn"
        self.exact(f"{a}.attn_sink", f"{sa}.attn_sink", "col")
        linear(f"{a}.fused_wqa_wkv", [(f"{sa}.wq_a", Qr), (f"{sa}.wkv", Dh)], D, "full")
        self.exact(f"{a}.q_norm.weight", f"{sa}.q_norm.weight")
        self.exact(f"{a}.kv_norm.weight", f"{sa}.kv_norm.weight")
        linear(f"{a}.wq_b", [(f"{sa}.wq_b", H * Dh)], Qr, "col")
        linear(f"{a}.wo_a", [(f"{sa}.wo_a", G * Or)], H * Dh // G, "col")
        linear(f"{a}.wo_b", [(f"{sa}.wo_b", D)], G * Or, "row")
        return a, sa

    def block(self, p: str, sp: str, *, ratio: int, hash_layer: bool) -> None:
        c, n = self.cfg, self.n
        D, Dh, Qr = c.hidden_size, c.head_dim, c.q_lora_rank
        a, sa = self.attention(p, sp, self.fp8)
        if ratio:
            coff = 2 if ratio == 4 else 1
            cm, sc = f"{p}.{n.compressor}", f"{sa}.compressor"
            self.exact(f"{cm}.ape", f"{sc}.ape")
            self.bf16(
                f"{cm}.fused_wkv_wgate.weight", [(f"{sc}.wkv.weight", coff * Dh), (f"{sc}.wgate.weight", coff * Dh)], D
            )
            self.exact(f"{cm}.norm.weight", f"{sc}.norm.weight")
        if ratio == 4:
            ix, si, ihd = f"{a}.indexer", f"{sa}.indexer", c.index_head_dim
            self.fp8(f"{ix}.wq_b", [(f"{si}.wq_b", c.index_n_heads * ihd)], Qr, "full")
            self.bf16(f"{ix}.weights_proj.weight", [(f"{si}.weights_proj.weight", c.index_n_heads)], D)
            self.exact(f"{ix}.compressor.ape", f"{si}.compressor.ape")
            self.bf16(
                f"{ix}.compressor.fused_wkv_wgate.weight",
                [(f"{si}.compressor.wkv.weight", 2 * ihd), (f"{si}.compressor.wgate.weight", 2 * ihd)],
                D,
            )
            self.exact(f"{ix}.compressor.norm.weight", f"{si}.compressor.norm.weight")
        E, I = c.n_routed_experts, c.moe_intermediate_size
        g, sf = f"{p}.{n.gate}", f"{sp}.ffn"
        self.bf16(f"{g}.weight", [(f"{sf}.gate.weight", E)], D)
        if hash_layer:
            self.exact(f"{g}.tid2eid", f"{sf}.gate.tid2eid")
        if not hash_layer or c.is_vision:  # the vision model's hash layers have a gate bias too
            self.exact(f"{g}.e_score_correction_bias", f"{sf}.gate.bias")
        if c.is_vision:
            self.exact(f"{g}.bias_vl", f"{sf}.gate.bias_vl")
        if c.n_shared_experts:
            sh, ss, Ish = f"{p}.{n.shared}", f"{sf}.shared_experts", I * c.n_shared_experts
            per_rank = None
            if n.shared_pad and (Ish // FP8_BLOCK) % self.tp:  # the engine's whole blocks a rank (engine.py)
                per_rank = cdiv(Ish // FP8_BLOCK, self.tp) * FP8_BLOCK
            self.fp8(f"{sh}.gate_up_proj", [(f"{ss}.w1", Ish), (f"{ss}.w3", Ish)], D, "col", per_rank)
            self.fp8(f"{sh}.down_proj", [(f"{ss}.w2", D)], Ish, "row", per_rank)
        self.routed(p, sp, E, "mxfp4" if c.expert_dtype == "fp4" else "fp8")

    def routed(self, p: str, sp: str, E: int, kind: str) -> None:
        """The ``E`` routed experts of block ``p`` (source ``sp``), one unit per expert and stacked tensor: split
        over the ranks (tp), or each expert whole on its owner (ep)."""
        D, I, n = self.cfg.hidden_size, self.cfg.moe_intermediate_size, self.n
        r, sf = f"{p}.{n.routed}", f"{sp}.ffn"
        sfx = "weight_scale" if kind == "mxfp4" else "weight_scale_inv"
        per = E // self.tp
        for j in range(E):
            if self.ep:
                ranks, local, lay13, lay2 = (j // per,), (j % per,), "full", "full"
            else:
                ranks, local, lay13, lay2 = self.all_ranks, (j,) * self.tp, "col", "row"
            se = f"{sf}.experts.{j}"
            self.units.append(
                LinearUnit(
                    self.group,
                    f"{r}.w13_weight",
                    f"{r}.w13_{sfx}",
                    kind,
                    (Part(f"{se}.w1", I), Part(f"{se}.w3", I)),
                    D,
                    lay13,
                    ranks,
                    j,
                    local,
                )
            )
            self.units.append(
                LinearUnit(
                    self.group,
                    f"{r}.w2_weight",
                    f"{r}.w2_{sfx}",
                    kind,
                    (Part(f"{se}.w2", D),),
                    I,
                    lay2,
                    ranks,
                    j,
                    local,
                )
            )

    def v41_block(self, p: str, sp: str, *, kv: bool, index: bool, ratio: int, experts: int) -> None:
        """One DeepSeek V4.1 decoder block (vllm/models/deepseek_v41/nvidia/model.py, attention.py): MXFP8 attention
        and shared experts, a bf16 compressor (wkv, and wgate at ratio 2) only on a kv source, an indexer (MXFP8 wq_b,
        bf16 weights_proj; wk and k_norm on a kv source too) only on an index source, every router's bias_vl, MXFP4
        routed experts."""
        c = self.cfg
        D, Dh, Qr = c.hidden_size, c.head_dim, c.q_lora_rank
        a, sa = self.attention(p, sp, self.mxfp8)
        if kv:
            cm, sc = f"{a}.compressor", f"{sa}.compressor"
            parts = [(f"{sc}.wkv.weight", Dh)] + ([(f"{sc}.wgate.weight", Dh)] if ratio > 1 else [])
            self.bf16(f"{cm}.fused_wkv_wgate.weight", parts, D)
            self.exact(f"{cm}.norm.weight", f"{sc}.norm.weight")
        if index:
            ix, si, ihd = f"{a}.indexer", f"{sa}.indexer", c.index_head_dim
            self.mxfp8(f"{ix}.wq_b", [(f"{si}.wq_b", c.index_n_heads * ihd)], Qr, "full")
            self.bf16(f"{ix}.weights_proj.weight", [(f"{si}.weights_proj.weight", c.index_n_heads)], D)
            if kv:
                self.bf16(f"{ix}.wk.weight", [(f"{si}.wk.weight", ihd)], Dh)
                self.exact(f"{ix}.k_norm.weight", f"{si}.k_norm.weight")
        g, sf = f"{p}.{self.n.gate}", f"{sp}.ffn"
        self.bf16(f"{g}.weight", [(f"{sf}.gate.weight", experts)], D)
        self.exact(f"{g}.e_score_correction_bias", f"{sf}.gate.bias")
        self.exact(f"{g}.bias_vl", f"{sf}.gate.bias_vl")
        sh, ss, Ish = f"{p}.{self.n.shared}", f"{sf}.shared_experts", c.moe_intermediate_size * c.n_shared_experts
        self.mxfp8(f"{sh}.gate_up_proj", [(f"{ss}.w1", Ish), (f"{ss}.w3", Ish)], D, "col")
        self.mxfp8(f"{sh}.down_proj", [(f"{ss}.w2", D)], Ish, "row")
        self.routed(p, sp, experts, "mxfp4")

    def engram(self, p: str, sp: str, layer: int, layout: EngramLayout) -> None:
        """The Engram of layer ``layer`` (vllm/models/deepseek_v41/common/engram.py): its FP8 table and per-row E8M0
        scale, each rank the rows of its hash heads (uneven), byte for byte; the MXFP8 ``wkv`` column-parallel; the
        bf16 ``q_weight`` / ``k_weight`` whole."""
        c = self.cfg
        e, se = f"{p}.engram", f"{sp}.engram"
        ranges = layout.rank_rows(layer, self.tp)
        self.rows(f"{e}.embed_tokens.weight", f"{se}.embed.weight", ranges)
        self.rows(f"{e}.embed_tokens.weight_scale_inv", f"{se}.embed.scale", ranges)
        inp = layout.hash_heads * c.engram_head_dim
        self.mxfp8(f"{e}.wkv", [(f"{se}.wkv", c.hidden_size * (c.hc_mult + 1))], inp, "col")
        self.exact(f"{e}.q_weight", f"{se}.q_weight")
        self.exact(f"{e}.k_weight", f"{se}.k_weight")


def tensor_units(
    cfg: V4Config,
    profile: str,
    component: str,
    tp: int,
    moe_parallel: str,
    source_names: set[str],
    vllm_series: str | None = None,
) -> list[Unit]:
    """Every engine tensor of one rank set of ``component`` as check units (see the module docstring);
    ``vllm_series``: the series a draft whose parameters differ by series was written for (the manifest's
    ``options.vllm_series``; None: the newest)."""
    if profile not in ENGINES:
        raise UsageError(
            f"profile {profile!r} has no engine table; add one to its profile module in ckpt_tool/mapping/profiles/"
        )
    b = _Builder(cfg, ENGINES[profile], tp, moe_parallel == "ep", source_names)
    if cfg.is_v41:
        if component == "model":
            _v41_target_units(b, cfg)
        else:
            b.group = "embed/head"
            _dspark_units(b, cfg, source_names, draft_kind_of(cfg).holds_context_wkv(vllm_series))
        return b.units
    D, V = cfg.hidden_size, cfg.vocab_size
    b.group = "embed/head"
    if component == "model":
        b.bf16("model.embed_tokens.weight", [("embed.weight", V)], D, "col")
        b.bf16("lm_head.weight", [("head.weight", V)], D, "col")
        b.exact("model.norm.weight", "norm.weight")
        for t in ("fn", "base", "scale"):
            b.exact(f"model.hc_head_{t}", f"hc_head_{t}")
        for layer in range(cfg.num_hidden_layers):
            b.group = f"layers.{layer}"
            b.block(
                f"model.layers.{layer}",
                f"layers.{layer}",
                ratio=cfg.compress_ratio(layer),
                hash_layer=layer < cfg.num_hash_layers,
            )
        if cfg.is_vision:  # DeepseekV4ForConditionalGeneration: the text model under language_model., the tower
            prefix = model_class_of(cfg).target_prefix
            b.units = [_prefixed(u, prefix) for u in b.units]
            b.vision()
        return b.units
    if component == "dspark":
        _dspark_units(b, cfg, source_names)
        return b.units
    # the draft's one embedding: mtp.0's own if stored, else the target's (as the converter materializes it)
    emb = "mtp.0.emb.tok_emb.weight" if "mtp.0.emb.tok_emb.weight" in source_names else "embed.weight"
    b.bf16("model.embed_tokens.weight", [(emb, V)], D, "col")
    for i, S in enumerate(cfg.mtp_layer_ids):
        p, sp = f"model.layers.{S}", f"mtp.{i}"
        b.group = f"mtp.{i} (layer {S})"
        b.exact(f"{p}.enorm.weight", f"{sp}.enorm.weight")
        b.exact(f"{p}.hnorm.weight", f"{sp}.hnorm.weight")
        b.fp8(f"{p}.e_proj", [(f"{sp}.e_proj", D)], D, "full")
        b.fp8(f"{p}.h_proj", [(f"{sp}.h_proj", D)], D, "full")
        for t in ("fn", "base", "scale"):
            b.exact(f"{p}.hc_head_{t}", f"{sp}.hc_head_{t}")
        b.exact(f"{p}.shared_head.norm.weight", f"{sp}.norm.weight")
        head = f"{sp}.head.weight" if f"{sp}.head.weight" in source_names else "head.weight"
        b.bf16(f"{p}.shared_head.head.weight", [(head, V)], D, "col")
        b.block(f"{p}.mtp_block", sp, ratio=0, hash_layer=False)
    return b.units


def _dspark_units(b: _Builder, cfg: V4Config, source_names: set[str], context_wkv: bool = True) -> None:
    """The DSpark draft against DeepSeek's mtp.* names: V4's (vllm/models/deepseek_v4/nvidia/dspark.py) or V4.1's
    (vllm/models/deepseek_v41/nvidia/dspark.py). The target's embedding and head (the draft holds the target's),
    main_proj and (``context_wkv``: V4's in every series, V4.1's from vLLM 0.34) every stage's wkv again as
    context_wkv_proj through the fp8 (V4) or MXFP8 (V4.1) kernel, the Markov head as bf16 linears (``markov_w1`` /
    ``markov_w2`` in a V4 checkpoint, ``markov_head.embed`` / ``.head`` in V4.1's), the norms, hc_head (V4 only) and
    the confidence head by value, every stage's decoder block as a target layer's (V4.1: with
    ``dspark_n_routed_experts`` experts, never a kv or index source)."""
    D, V, n, r = cfg.hidden_size, cfg.vocab_size, cfg.draft_layers, cfg.dspark_markov_rank
    stage_of = _stage_finder(n, source_names)
    linear = b.mxfp8 if cfg.is_v41 else b.fp8
    b.bf16("model.embed_tokens.weight", [("embed.weight", V)], D, "col")
    b.bf16("lm_head.weight", [("head.weight", V)], D, "col")
    b.group = "dspark heads"
    first = stage_of("main_proj.weight", 0)
    linear("model.main_proj", [(f"{first}.main_proj", D)], D * len(cfg.dspark_target_layer_ids), "full")
    b.exact("model.main_norm.weight", f"{stage_of('main_norm.weight', 0)}.main_norm.weight")
    if context_wkv:
        linear("model.context_wkv_proj", [(f"mtp.{i}.attn.wkv", cfg.head_dim) for i in range(n)], D, "full")
    b.exact("model.norm.weight", f"{stage_of('norm.weight', n - 1)}.norm.weight")
    if not cfg.is_v41:  # V4.1 has no hc_head
        for t in ("fn", "base", "scale"):
            b.exact(f"model.hc_head_{t}", f"{stage_of(f'hc_head_{t}', n - 1)}.hc_head_{t}")
    markov = ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2")
    w1, w2 = (f"{stage_of(f'markov_head.{m}.weight', n - 1)}.markov_head.{m}.weight" for m in markov)
    b.bf16("model.markov_head.markov_w1.weight", [(w1, V)], r)
    b.bf16("model.markov_head.markov_w2.weight", [(w2, cfg.draft_vocab_size or V)], r)
    if cfg.enable_confidence_head:
        conf = stage_of("confidence_head.proj.weight", n - 1)
        b.exact("model.confidence_head.proj.weight", f"{conf}.confidence_head.proj.weight")
    for i in range(n):
        b.group = f"dspark stage mtp.{i}"
        p, sp = f"model.layers.{i}", f"mtp.{i}"
        if cfg.is_v41:
            b.v41_block(p, sp, kv=False, index=False, ratio=0, experts=cfg.dspark_n_routed_experts)
        else:
            b.block(p, sp, ratio=0, hash_layer=False)


def _v41_target_units(b: _Builder, cfg: V4Config) -> None:
    """DeepseekV41ForCausalLM (vllm/models/deepseek_v41/nvidia/vl_model.py): the text model under ``language_model.``
    (no hc_head), every layer's block and Engram, the vision tower as V4's without image_pad."""
    D, V = cfg.hidden_size, cfg.vocab_size
    layout = engram_layout(cfg)
    b.group = "embed/head"
    b.bf16("model.embed_tokens.weight", [("embed.weight", V)], D, "col")
    b.bf16("lm_head.weight", [("head.weight", V)], D, "col")
    b.exact("model.norm.weight", "norm.weight")
    for layer in range(cfg.num_hidden_layers):
        b.group = f"layers.{layer}"
        p, sp = f"model.layers.{layer}", f"layers.{layer}"
        b.v41_block(
            p,
            sp,
            kv=layer in cfg.kv_source_layer_ids,
            index=layer in cfg.index_source_layer_ids,
            ratio=cfg.compress_ratio(layer),
            experts=cfg.n_routed_experts,
        )
        if layout is not None and layer in layout.layer_ids:
            b.engram(p, sp, layer, layout)
    b.units = [_prefixed(u, "language_model.") for u in b.units]  # vl_model.py's outer mapper
    b.vision(image_pad=False)


def _stage_finder(n: int, source_names: set[str]):
    """``stage_of(suffix, default)``: the DSpark stage holding a head-stack tensor (vLLM takes it from any stage),
    ``mtp.{default}`` (where DeepSeek ships it) when none does."""

    def stage_of(suffix: str, default: int) -> str:
        held = [i for i in range(n) if f"mtp.{i}.{suffix}" in source_names]
        return f"mtp.{held[0] if held else default}"

    return stage_of


def _prefixed(u: Unit, prefix: str) -> Unit:
    if isinstance(u, ExactUnit):
        return replace(u, name=prefix + u.name)
    return replace(u, weight=prefix + u.weight, scale=None if u.scale is None else prefix + u.scale)


def unit_tensors(u: Unit) -> list[str]:
    """Engine tensor names a unit checks."""
    if isinstance(u, ExactUnit):
        return [u.name]
    return [u.weight] + ([u.scale] if u.scale else [])


def unit_label(u: Unit) -> str:
    """The unit's engine tensor (``[expert j]`` for one routed expert of a stacked tensor)."""
    return u.name if isinstance(u, ExactUnit) else u.label


def unit_parts(u: Unit) -> list[str]:
    """The source tensors (quantized linears: base names) a unit holds, in order."""
    return [u.source] if isinstance(u, ExactUnit) else [p.key for p in u.parts]


# ---------------------------------------------------------------------------------------------
# coverage: what was computed


class Coverage:
    """What the numeric level computed, counted in units of one source part of one engine tensor on one rank:
    a fused weight counts once per part (``fused_wqa_wkv``: wq_a and wkv; ``gate_up_proj``: w1 and w3), a
    stacked routed-expert tensor once per expert and part (w13: w1 and w3; w2), weight and scale together.

    Expected: every unit of the unit table on every rank the plan writes, plus whatever a rank's header holds
    that no unit names (a tensor, a stacked expert slot) — nothing can compute those, so they count against
    coverage. Computed: only what the code that ran a part records (:class:`LinearRunner`, the MTP forward's
    expert probes via :meth:`credit`), never inferred from names. Nothing to cover is n/a, never 100 %.
    """

    SHOWN = 50  # units not computed listed by name in the report

    def __init__(self, plan: Plan, headers: dict[str, ShardHeader], units: dict[str, list[Unit]]) -> None:
        self.units = dict(units)  # the caller may narrow what it runs; what is expected stays
        self.ranks = {comp: sorted({f.rank for f in plan.files if f.component == comp}) for comp in units}
        self.computed: dict[str, dict[tuple[str, str], int]] = {comp: {} for comp in units}
        self.unnamed: dict[str, list[tuple[int, str]]] = {
            comp: _unnamed(plan, headers, comp, us) for comp, us in units.items()
        }

    def add(self, component: str, computed: dict[tuple[str, str], int]) -> None:
        """A runner's record: ``(unit label, source part) -> bits of the ranks computed``."""
        done = self.computed[component]
        for key, bits in computed.items():
            done[key] = done.get(key, 0) | bits

    def credit(self, component: str, records: set[tuple[int, str]]) -> None:
        """``(rank, source part)`` pairs another computation compared with the source (the MTP forward's expert
        probes): the unit holding that part counts as computed on that rank."""
        holders: dict[str, list[str]] = {}
        for u in self.units[component]:
            for src in unit_parts(u):
                holders.setdefault(src, []).append(unit_label(u))
        done = self.computed[component]
        for rank, src in records:
            for label in holders.get(src, ()):
                done[label, src] = done.get((label, src), 0) | 1 << rank

    def summary(self) -> tuple[dict, list[str]]:
        """The report's coverage (``checked`` / ``total`` units, ``percent`` or None when there is nothing to
        cover; per component and rank), and the first :attr:`SHOWN` units not computed, named."""
        components: dict[str, dict] = {}
        missed: list[str] = []
        for comp, units in self.units.items():
            tally = {r: [0, 0] for r in self.ranks[comp]}  # rank -> [checked, total]
            done = self.computed[comp]
            for u in units:
                label = unit_label(u)
                for src in unit_parts(u):
                    bits = done.get((label, src), 0)
                    for r in u.ranks:
                        if r not in tally:
                            continue  # a rank the plan does not write (convert --ranks)
                        tally[r][1] += 1
                        if bits >> r & 1:
                            tally[r][0] += 1
                        elif len(missed) < self.SHOWN:
                            missed.append(f"{comp} rank {r}: {label} part {src}")
            for r, what in self.unnamed[comp]:
                tally[r][1] += 1
                if len(missed) < self.SHOWN:
                    missed.append(f"{comp} rank {r}: {what} (no numeric check computes it)")
            ranks = {str(r): _tally(c, t) for r, (c, t) in tally.items()}
            components[comp] = {
                **_tally(sum(c for c, _ in tally.values()), sum(t for _, t in tally.values())),
                "ranks": ranks,
            }
        whole = _tally(sum(c["checked"] for c in components.values()), sum(c["total"] for c in components.values()))
        return {"unit": "one source part of one engine tensor on one rank", **whole, "components": components}, missed


def _tally(checked: int, total: int) -> dict:
    """``percent`` floored (99.996 % shows 99.99, never 100), None for 0 of 0."""
    return {"checked": checked, "total": total, "percent": math.floor(10000 * checked / total) / 100 if total else None}


def _unnamed(plan: Plan, headers: dict[str, ShardHeader], comp: str, units: list[Unit]) -> list[tuple[int, str]]:
    """``(rank, what)`` for each tensor in the rank's headers that no unit names, and each stacked expert slot
    of a named tensor that no unit computes."""
    named: dict[int, set[str]] = {}
    slots: dict[tuple[int, str], set[int]] = {}
    for u in units:
        for i, r in enumerate(u.ranks):
            named.setdefault(r, set()).update(unit_tensors(u))
            if isinstance(u, LinearUnit) and u.expert is not None:
                for name in unit_tensors(u):
                    slots.setdefault((r, name), set()).add(u.local[i])
    found: list[tuple[int, str]] = []
    for f in plan.files:
        if f.component != comp or f.relpath not in headers:
            continue
        for name, info in headers[f.relpath].tensors.items():
            if name not in named.get(f.rank, ()):
                found.append((f.rank, f"{f.relpath}: {name}"))
            elif (f.rank, name) in slots and info.shape:
                found += [
                    (f.rank, f"{f.relpath}: {name} slot {k}")
                    for k in range(info.shape[0])
                    if k not in slots[f.rank, name]
                ]
    return found


# ---------------------------------------------------------------------------------------------
# running the units


def probe(unit: LinearUnit, seed: int, device: torch.device) -> torch.Tensor:
    """Seeded ``[PROBE_ROWS, in]`` inputs, distinct per unit (and expert); a row-parallel split the engine
    zero-pads gets probe values on the padded inputs too (``[PROBE_ROWS, per_rank * tp]``)."""
    key = zlib.crc32(f"{unit.label}".encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)
    g = torch.Generator().manual_seed(key)
    width = unit.share(unit.inp) * len(unit.ranks) if unit.layout == "row" else unit.inp
    return torch.randn(PROBE_ROWS, width, generator=g).to(device)


class _Sides:
    """Row reads of source tensors (DeepSeek names) and of each output rank's tensors (engine names)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        out: Path,
        plan: Plan,
        headers: dict[str, ShardHeader],
        component: str,
        reader: RowReader,
        device: torch.device,
    ) -> None:
        self.ckpt, self.reader, self.device = ckpt, reader, device
        self.locate: dict[int, dict[str, tuple[Path, TensorInfo]]] = {}
        for f in plan.files:
            if f.component != component or f.relpath not in headers:
                continue
            where = self.locate.setdefault(f.rank, {})
            for name, info in headers[f.relpath].tensors.items():
                where[name] = (out / f.relpath, info)

    def source_info(self, name: str) -> TensorInfo:
        return source_info(self.ckpt, name)

    def source_rows(self, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        return self.reader.source_rows(self.ckpt, name, r0, r1, into).to(self.device)

    def engine_info(self, rank: int, name: str) -> tuple[Path, TensorInfo]:
        hit = self.locate.get(rank, {}).get(name)
        if hit is None:
            raise CheckpointError(f"tensor {name!r} is not in rank {rank}'s files")
        return hit

    def engine_rows(self, rank: int, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        path, info = self.engine_info(rank, name)
        return self.reader.rows(path, info, r0, r1, into).to(self.device)


def _block_rows(kind: str, side: str) -> int:
    """Weight rows one scale row covers on ``side`` (source | engine): 128 for block FP8; for MXFP8 32 in the
    checkpoint, 1 in the engine (vLLM repeats each scale row once per weight row); 1 for MXFP4's per-row groups."""
    if kind == "fp8":
        return FP8_BLOCK
    if kind == "mxfp8":
        return quant.MXFP8_BLOCK[0] if side == "source" else quant.MXFP8_ROW_BLOCK[0]
    return 1


def _scale_rows(kind: str, r0: int, r1: int, side: str) -> tuple[int, int]:
    """The scale rows holding the scales of weight rows ``[r0, r1)`` (``r0`` a multiple of the block rows)."""
    bn = _block_rows(kind, side)
    return r0 // bn, cdiv(r1, bn)


def _row_bytes(kind: str, inp: int) -> int:
    """Bytes of one weight row of ``inp`` inputs (packed fp4: two a byte)."""
    return {"fp8": inp, "mxfp8": inp, "mxfp4": inp // 2, "bf16": 2 * inp}[kind]


def _unit_bytes(u: Unit) -> int:
    """Roughly what a unit reads, to schedule the largest first (exact units: small, counted as one byte)."""
    if isinstance(u, ExactUnit):  # an Engram table's rows: at least one 32-wide block of FP8 a row
        return sum(hi - lo for lo, hi in u.rows) * MX_BLOCK if u.layout == "rows" else 1
    return sum(p.rows for p in u.parts) * _row_bytes(u.kind, u.inp) * 2


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype and the same bytes (numpy's compare runs several times faster than torch.equal on
    bf16; bytes, not values, because the converter copies these tensors verbatim)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.contiguous().view(torch.uint8).numpy(), b.contiguous().view(torch.uint8).numpy()))


class LinearRunner:
    """Runs units; keeps the worst disagreement per unit for the report, and in ``computed`` what it ran:
    ``(unit label, source part) -> bit r set`` once that part's rows on rank r were all compared with the source."""

    def __init__(self, sides: _Sides, *, kernels: str, act: str, seed: int, pool: ComputePool | None = None) -> None:
        self.sides, self.kernels, self.act, self.seed, self.pool = sides, kernels, act, seed, pool
        self.computed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # units run on several threads
        self._local = threading.local()  # each thread's read buffers

    def _buffers(self) -> dict[str, Scratch]:
        """This thread's read buffers: one per role, so a source tile and a rank's tile never share memory."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {role: Scratch() for role in ("source", "source scale", "engine", "engine scale")}
        return bufs

    def take_computed(self) -> dict[tuple[str, str], int]:
        """What :attr:`computed` holds now, emptied (a forked worker hands each batch to the parent)."""
        with self._lock:
            taken, self.computed = self.computed, {}
        return taken

    def _done(self, u: Unit, source: str, ranks) -> None:
        key = (unit_label(u), source)
        with self._lock:
            self.computed[key] = self.computed.get(key, 0) | sum(1 << r for r in set(ranks))

    # the two GEMMs: source = torch reference, engine = the kernels
    def _reference(
        self, kind: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, what: str
    ) -> torch.Tensor:
        from ckpt_tool.verify.kernels.fp8_gemm import prepare_activation

        with compute_slot(self.pool):
            if kind == "bf16":
                return x @ w.float().T
            if kind == "mxfp4":
                return quant.mxfp4_matmul(prepare_activation(x, "bf16"), w, s, what=what)
            if kind == "mxfp8":  # the checkpoint's 32x32 blocks; fp8 activations in the block's 32-input groups
                block = quant.MXFP8_BLOCK
                return quant.fp8_block_matmul(prepare_activation(x, self.act, block[1]), w, s, block, what=what)
            return quant.fp8_block_matmul(prepare_activation(x, self.act), w, s, what=what)

    def _kernel(self, kind: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, what: str) -> torch.Tensor:
        from ckpt_tool.verify.kernels import fp8_block_gemm, mxfp4_gemm

        with compute_slot(self.pool):
            if kind == "bf16":
                return x @ w.float().T
            if kind == "mxfp4":
                return mxfp4_gemm(x, w, s, backend=self.kernels, what=what)
            block = quant.MXFP8_ROW_BLOCK if kind == "mxfp8" else quant.FP8_BLOCK  # vLLM's one scale row a weight row
            return fp8_block_gemm(x, w, s, act=self.act, block=block, backend=self.kernels, what=what)

    def _source_reference(self, u: LinearUnit, part: Part, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of the source part's output on ``x``, the source dequantized in torch. A tile that starts
        inside a scale block (a rank's share of an MXFP8 part may end anywhere) is computed from the block's first
        row and the rows before ``a`` dropped."""
        lead = a % _block_rows(u.kind, "source")
        w, s = self._source_tile(u, part, a - lead, b)
        return self._reference(u.kind, x, w, s, f"source {part.source}")[:, lead:]

    def _source_tile(self, u: LinearUnit, part: Part, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [a, b) of the source part (valid until this thread's next source tile)."""
        bufs = self._buffers()
        if u.kind == "bf16":
            return self.sides.source_rows(part.source, part.row0 + a, part.row0 + b, bufs["source"]), None
        s0, s1 = _scale_rows(u.kind, a, b, "source")
        return (
            self.sides.source_rows(f"{part.source}.weight", a, b, bufs["source"]),
            self.sides.source_rows(f"{part.source}.scale", s0, s1, bufs["source scale"]),
        )

    def _engine_tile(
        self, u: LinearUnit, rank: int, slot: int, a: int, b: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [a, b) of the rank's matrix (of stacked expert ``slot``; valid until this thread's next engine tile)."""
        bufs = self._buffers()
        _, info = self.sides.engine_info(rank, u.weight)
        base = slot * info.shape[1] if u.expert is not None else 0
        w = self.sides.engine_rows(rank, u.weight, base + a, base + b, bufs["engine"])
        if u.scale is None:
            return w, None
        s0, s1 = _scale_rows(u.kind, a, b, "engine")
        sbase = 0
        if u.expert is not None:
            sbase = slot * self.sides.engine_info(rank, u.scale)[1].shape[1]
        return w, self.sides.engine_rows(rank, u.scale, sbase + s0, sbase + s1, bufs["engine scale"])

    def _tiles(self, u: LinearUnit, part_rows: int) -> Iterator[tuple[int, int, int | None]]:
        """(a, b, rank) source row tiles of one part; rank is the column-parallel owner, else None."""
        # the source tile [step, in] is the largest piece either side holds
        step = read_tile_rows(part_rows, _row_bytes(u.kind, u.inp), _block_rows(u.kind, "source"))
        if u.layout == "col":
            n_r = u.share(part_rows)
            for i, r in enumerate(u.ranks):
                for a in range(i * n_r, min((i + 1) * n_r, part_rows), step):
                    yield a, min(a + step, (i + 1) * n_r, part_rows), r
        else:
            for a in range(0, part_rows, step):
                yield a, min(a + step, part_rows), None

    def _pad_tiles(self, u: LinearUnit, part_rows: int) -> Iterator[tuple[int, int, int]]:
        """(a, b, rank): rows [a, b) of the rank's share of one column-parallel part that are the engine's
        zero padding (past the end of the source part)."""
        n_r = u.share(part_rows)
        step = read_tile_rows(n_r, _row_bytes(u.kind, u.inp), _block_rows(u.kind, "engine"))
        for i, r in enumerate(u.ranks):
            real = max(0, min(n_r, part_rows - i * n_r))
            for a in range(real, n_r, step):
                yield a, min(a + step, n_r), r

    def run(self, u: LinearUnit) -> str | None:
        """None when every part on every rank agrees; else one line naming the engine tensor, rank and part."""
        x = probe(u, self.seed, self.sides.device)
        x_src = x[:, : u.inp]  # the source linear's inputs (a padded row-parallel probe is wider)
        slots = dict(zip(u.ranks, u.local)) if u.expert is not None else {r: 0 for r in u.ranks}
        off = 0  # the part's first row in the source's stacked parts
        local_off = 0  # ... and in a column-parallel rank's tensor
        for part in u.parts:
            worst: dict[int | str, list[float]] = {}  # holder -> [max |a-b|, max |a|]
            ran: set[int] = set()  # ranks whose rows of the part were compared

            def note(holder, ref: torch.Tensor, got: torch.Tensor, worst: dict = worst) -> None:
                w = worst.setdefault(holder, [0.0, 0.0])
                d = (ref - got).abs().max().item() if ref.numel() else 0.0
                w[0] = max(w[0], d) if not math.isnan(d) else math.inf
                w[1] = max(w[1], ref.abs().max().item() if ref.numel() else 0.0)

            for a, b, owner in self._tiles(u, part.rows):
                if u.kind == "bf16":  # not quantized: no kernel runs it, and equal values are the stronger check
                    w_src, _ = self._source_tile(u, part, a, b)
                    i = u.ranks.index(owner) if owner is not None else 0
                    if u.layout == "row":  # each rank holds its columns of every row
                        kr = u.share(u.inp)
                        for j, r in enumerate(u.ranks):
                            got, _ = self._engine_tile(u, r, slots[r], off + a, off + b)
                            if not torch.equal(got, w_src[:, j * kr : (j + 1) * kr].to(got.dtype)):
                                return (
                                    f"tensor {u.weight!r} (rank {r}): values differ from source {part.source} "
                                    f"(rows {a}:{b}, columns {j * kr}:{(j + 1) * kr})"
                                )
                            ran.add(r)
                        continue
                    holders = (
                        [(owner, local_off + a - i * u.share(part.rows))]
                        if u.layout == "col"
                        else [(r, off + a) for r in u.ranks]
                    )
                    for r, local in holders:
                        got, _ = self._engine_tile(u, r, slots[r], local, local + (b - a))
                        with compute_slot(self.pool):
                            same = _same_bytes(got, w_src.to(got.dtype))  # a float32 tower lands rounded to bf16
                        if not same:
                            return (
                                f"tensor {u.weight!r} (rank {r}): values differ from source {part.source} (rows "
                                f"{a}:{b})"
                            )
                        ran.add(r)
                    continue
                ref = self._source_reference(u, part, x_src, a, b)
                if u.layout == "row":
                    got = None
                    kr = u.share(u.inp)
                    for i, r in enumerate(u.ranks):
                        w, s = self._engine_tile(u, r, slots[r], a, b)
                        y = self._kernel(u.kind, x[:, i * kr : (i + 1) * kr].contiguous(), w, s, f"{u.label} rank {r}")
                        got = y if got is None else got + y
                    note("sum", ref, got)
                    ran.update(u.ranks)
                elif u.layout == "col":
                    i = u.ranks.index(owner)
                    local = local_off + a - i * u.share(part.rows)
                    w, s = self._engine_tile(u, owner, slots[owner], local, local + (b - a))
                    note(owner, ref, self._kernel(u.kind, x, w, s, f"{u.label} rank {owner}"))
                    ran.add(owner)
                else:
                    for r in u.ranks:
                        w, s = self._engine_tile(u, r, slots[r], off + a, off + b)
                        note(r, ref, self._kernel(u.kind, x, w, s, f"{u.label} rank {r}"))
                        ran.add(r)
            self._done(u, part.key, ran)
            for holder, (d, amax) in worst.items():
                rel = d / max(amax, 1e-30)
                if not rel <= LINEAR_MAX_REL:
                    where = "ranks summed" if holder == "sum" else f"rank {holder}"
                    scale = f" (scale {u.scale!r})" if u.scale else ""
                    expert = "" if u.expert is None else f" expert {u.expert}"
                    return (
                        f"tensor {u.weight!r}{scale}{expert} ({where}): output of part {part.source} disagrees with "
                        f"the source linear: max_rel {rel:.3g} (needs <= {LINEAR_MAX_REL:g})"
                    )
            if u.layout == "col" and u.per_rank is not None:
                for a, b, r in self._pad_tiles(u, part.rows):
                    w, s = self._engine_tile(u, r, slots[r], local_off + a, local_off + b)
                    y = self._kernel(u.kind, x, w, s, f"{u.label} rank {r}")
                    if y.count_nonzero():
                        return (
                            f"tensor {u.weight!r} (rank {r}): rows {local_off + a}:{local_off + b} are the engine's "
                            "zero "
                            f"padding after part {part.source} but compute nonzero output (max |y| "
                            f"{y.abs().max().item():.3g})"
                        )
                    self._done(u, part.key, [r])
            off += part.rows
            local_off += u.share(part.rows) if u.layout == "col" else part.rows
        return None

    def run_exact(self, u: ExactUnit) -> str | None:
        if u.layout == "rows":
            return self._run_rows(u)
        info = self.sides.source_info(u.source)
        src = self.sides.reader.source_whole(self.sides.ckpt, info)
        T = len(u.ranks)
        for i, r in enumerate(u.ranks):
            path, einfo = self.sides.engine_info(r, u.name)
            got = self.sides.reader.whole(path, einfo)
            want = src
            if u.layout == "col":
                n = src.shape[0] // u.sections // T
                want = torch.cat([sec[i * n : (i + 1) * n] for sec in src.chunk(u.sections)])
            if want.dtype.is_floating_point and got.dtype.is_floating_point:
                want = want.to(got.dtype)  # the engine's parameter dtype, as its loader casts (vision tower, image_*)
            same = tuple(got.shape) == tuple(want.shape) and _same_values(want, got)
            self._done(u, u.source, [r])
            if not same:
                return f"tensor {u.name!r} (rank {r}): values differ from source {u.source}"
        return None

    def _run_rows(self, u: ExactUnit) -> str | None:
        """Each rank's row range of the source against the rank's whole tensor, byte for byte (FP8 and E8M0 both
        read as raw bytes), a tile of rows at a time: an Engram table is ~100 GB."""
        info = self.sides.source_info(u.source)
        bufs = self._buffers()
        for r, (lo, hi) in zip(u.ranks, u.rows):
            path, einfo = self.sides.engine_info(r, u.name)
            if einfo.shape[0] != hi - lo:
                return (
                    f"tensor {u.name!r} (rank {r}): {einfo.shape[0]} rows, but the rank's hash heads are source rows "
                    f"{lo}:{hi} of {u.source} ({hi - lo} rows)"
                )
            step = read_tile_rows(hi - lo, info.nbytes // max(row_count(info), 1), 1)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                want = self.sides.source_rows(u.source, a, b, bufs["source"])
                got = self.sides.engine_rows(r, u.name, a - lo, b - lo, bufs["engine"])
                if not _same_bytes(got.view(torch.uint8), want.view(torch.uint8)):
                    return f"tensor {u.name!r} (rank {r}): bytes differ from source {u.source} rows {a}:{b}"
            self._done(u, u.source, [r])
        return None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        return torch.equal(a.to(torch.float64), b.to(torch.float64))
    return torch.equal(a.to(torch.int64), b.to(torch.int64))


class TensorCheck:
    """The per-tensor check of every output tensor, prepared to run: one check per layer (and one for embed/head)
    per component, and the coverage (every unit expected, those run computed).

    The units run in batches: :meth:`task` runs one (in a forked child of ``compute_pool.fan_out``, where the caller
    may schedule other work beside them, or here), :meth:`absorb` takes a batch's answers back, and :meth:`finish`
    runs whatever no child answered, adds the checks to the report and returns the coverage.

    ``skip_mtp_experts``: leave the MTP layers' routed experts to the forward's probe rows (expert_probes.py; numeric.py
    credits them to the coverage); they stay expected. ``pool``: run the units left to :meth:`finish` on it."""

    def __init__(
        self,
        out: Path,
        plan: Plan,
        ckpt: Checkpoint,
        headers: dict[str, ShardHeader],
        reader: RowReader,
        *,
        kernels: str,
        device: torch.device,
        seed: int,
        act: str = "bf16",
        progress: Progress | None = None,
        skip_mtp_experts: bool = False,
        pool: ComputePool | None = None,
    ) -> None:
        from ckpt_tool.processes import TaskQueue

        self.progress = progress or NoProgress()
        opts, cfg = plan.options, plan.config
        self.components = sorted({f.component for f in plan.files})
        plans = {
            comp: tensor_units(cfg, opts.profile, comp, opts.tp, opts.moe_parallel, set(ckpt.tensors), opts.vllm_series)
            for comp in self.components
        }
        self.coverage = Coverage(plan, headers, plans)
        if skip_mtp_experts and "mtp" in plans:
            plans["mtp"] = [u for u in plans["mtp"] if not (isinstance(u, LinearUnit) and u.expert is not None)]
        self.runners = {
            comp: LinearRunner(
                _Sides(ckpt, out, plan, headers, comp, reader, device), kernels=kernels, act=act, seed=seed, pool=pool
            )
            for comp in self.components
        }
        self.jobs = [(comp, u) for comp in self.components for u in plans[comp]]
        self.per = max(1, -(-len(self.jobs) // TaskQueue.LIMIT))  # units per batch: a queue holds at most LIMIT
        # largest units first (the 1 GiB vocab tables), so that no process is left with one at the end
        self.order = sorted(range(len(self.jobs)), key=lambda i: -_unit_bytes(self.jobs[i][1]))
        self.found: dict[int, str | None] = {}  # job -> its problem (None: agrees)

    def stage(self) -> None:
        """Start this check's progress stage; its workers may have run before, beside another level."""
        self.progress.stage("numeric: tensors", len(self.jobs), unit="tensors")

    @property
    def tasks(self) -> int:
        """Batches of units, for :meth:`task`."""
        return -(-len(self.jobs) // self.per)

    def _run(self, i: int) -> str | None:
        comp, u = self.jobs[i]
        runner = self.runners[comp]
        try:
            with torch.no_grad():
                return runner.run_exact(u) if isinstance(u, ExactUnit) else runner.run(u)
        except (CheckpointError, ValueError, RuntimeError) as exc:
            return f"tensor {unit_tensors(u)[0]!r}: {exc}"

    def task(self, task: int, pool: ComputePool | None) -> tuple[list, dict]:
        """Batch ``task`` (largest units first): ``(answers, computed)`` for :meth:`absorb`, marshal-able."""
        for runner in self.runners.values():
            runner.pool = pool
        answers = [(i, self._run(i)) for i in self.order[task * self.per : (task + 1) * self.per]]
        return answers, {comp: runner.take_computed() for comp, runner in self.runners.items()}

    def absorb(self, result: tuple[list, dict]) -> None:
        answers, computed = result
        for i, msg in answers:
            self._answer(i, msg)
        for comp, records in computed.items():
            self.coverage.add(comp, {tuple(key): bits for key, bits in records.items()})

    def _answer(self, i: int, msg: str | None) -> None:
        self.found[i] = msg
        self.progress.advance(1, f"{self.jobs[i][0]} {self.jobs[i][1].group}")

    def finish(self, report: VerifyReport, pool: ComputePool | None) -> Coverage:
        """Run the units nothing answered (all of them, without children) on ``pool``; add the checks."""
        for runner in self.runners.values():
            runner.pool = pool
        todo = [i for i in range(len(self.jobs)) if i not in self.found]
        for i, msg in zip(todo, map_tasks(pool, self._run, todo)):
            self._answer(i, msg)
        for comp in self.components:
            self.coverage.add(comp, self.runners[comp].take_computed())
        checks: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (component, group) -> problems, in unit order
        sizes: dict[tuple[str, str], int] = {}
        for i, (comp, u) in enumerate(self.jobs):
            sizes[comp, u.group] = sizes.get((comp, u.group), 0) + 1
            bad = checks.setdefault((comp, u.group), [])
            if self.found[i]:
                bad.append((self.found[i], unit_tensors(u)[0]))
        for (comp, group), bad in checks.items():
            report.add(problems_check(f"numeric:{comp}/{group}", f"{comp}/{group}", bad, {"units": sizes[comp, group]}))
        return self.coverage
