"""Completeness against the engine: every source tensor the engine needs, derived from config.json alone.

The rule table says how a tensor is renamed when it is there; this module says what must be there.
vLLM builds every main layer ``0..num_hidden_layers-1`` with the modules its compress ratio and hash
status imply, every routed expert, the embedding, head, final norm and ``hc_head``, and every MTP
layer; a tensor the checkpoint lacks is a KeyError or an uninitialised parameter at engine start-up.
We find it from the headers, before a byte is written, and name what is missing grouped by layer.

The same derivation gives each tensor's shape and dtype family (:func:`block_layout`), and the headers
must agree with it: vLLM builds its parameters from config.json, and its sharded loader copies a smaller
tensor into a slice of a larger parameter with only a warning, so a checkpoint whose config.json is
another's (the wrong variant's, one edited for another expert count) would start as a wrong model.
:func:`require_agreement` refuses it in one line naming the config key, a tensor and expected vs actual.

Layout (DeepSeek-V4's inference/model.py): compress ratio 0 → sliding-window only; ratio > 0 → a compressor;
ratio 4 → also the indexer (with its own compressor). Hash layers (``L < num_hash_layers``) route
through ``ffn.gate.tid2eid`` and have no gate bias; the others carry ``ffn.gate.bias`` (noaux_tc).
MTP blocks never compress and always carry the bias; so do DSpark stages, which replace the MTP layers when
config.json names ``dspark_target_layer_ids`` (:func:`dspark_layout`). The vision model (``vision_n_layers > 0``) adds
``ffn.gate.bias_vl`` to every block, ``ffn.gate.bias`` to hash layers too, and its tower (:func:`vision_layout`).
An MTP layer's own embedding/head are optional:
the plan materializes them from ``embed.weight`` / ``head.weight`` when absent.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any

from ckpt_tool.checkpoint.blocks import MX_BLOCK
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import DSPARK_STAGE_MISSING_MESSAGE, MTP_MISSING_MESSAGE, PlanError

GLOBAL_GROUP = "globals"
# A group whose missing names exceed this is summarised instead of listed.
_MAX_LISTED = 8


def name_lines(names: list[str]) -> str | None:
    """``names`` as one text, each after a newline (``"\\nA\\nB"``): what the regex counts below scan at
    C speed. None when a name holds a newline itself (then the lines would not be the names)."""
    joined = "\n" + "\n".join(names)
    return joined if joined.count("\n") == len(names) else None


def count_by_index(names: Iterable[str], head: str, lines: str | None = None) -> dict[int, int]:
    """Tensor count per ``N`` of the names ``{head}N.…`` (``head`` like ``layers.`` or ``mtp.``).

    One regex pass over the names' :func:`name_lines` (pass ``lines`` when already joined): a pattern
    that starts with a literal (``\\nmtp.``) lets the regex engine skip to candidates at C speed
    (inspect counts 69k names this way); without lines each name is matched on its own.
    """
    names = list(names)
    lines = name_lines(names) if lines is None else lines
    index = rf"{re.escape(head)}(0|[1-9][0-9]*)\."  # an index as the engine writes it
    if lines is not None:
        found = re.findall("\n" + index, lines)
    else:
        found = [m.group(1) for n in names if (m := re.match(index, n))]
    return {int(i): count for i, count in Counter(found).items()}


def layer_indices(names: Iterable[str], head: str = "layers.", lines: str | None = None) -> set[int]:
    """Every ``N`` of the names ``{head}N.…``, without a match per name.

    A regex run matches a whole stretch of consecutive names under one index (``\\1`` repeats the
    index just read), so a shard listing its layers in order costs one match per layer, not per name
    (inspect reads 66k layer names).
    """
    names = list(names)
    lines = name_lines(names) if lines is None else lines
    if lines is None:
        return set(count_by_index(names, head))
    index = rf"{re.escape(head)}(0|[1-9][0-9]*)\."
    run = re.compile(rf"\n{index}[^\n]*(?:\n{re.escape(head)}\1\.[^\n]*)*")
    return set(map(int, run.findall(lines)))


# ---------------------------------------------------------------------------------------------
# What config.json implies for each tensor: its name, shape and dtype family (one derivation)


@dataclass(frozen=True)
class Dim:
    """One dimension config.json implies: its size and the config keys it derives from (what a
    disagreement names)."""

    size: int
    keys: tuple[str, ...] = ()

    def __mul__(self, other: Dim | int) -> Dim:
        other = _as_dim(other)
        return Dim(self.size * other.size, _union(self.keys, other.keys))

    __rmul__ = __mul__

    def __add__(self, other: Dim | int) -> Dim:
        other = _as_dim(other)
        return Dim(self.size + other.size, _union(self.keys, other.keys))

    __radd__ = __add__

    def __floordiv__(self, other: Dim | int) -> Dim:
        other = _as_dim(other)
        return Dim(self.size // other.size, _union(self.keys, other.keys))

    def blocks(self, block: Dim) -> Dim:
        """How many ``block``-long blocks cover this dimension (a block scale's length)."""
        return Dim(-(-self.size // block.size), _union(self.keys, block.keys))

    def also(self, key: str) -> Dim:
        """The same size, derived from ``key`` too."""
        return Dim(self.size, _union(self.keys, (key,)))


def _as_dim(value: Dim | int) -> Dim:
    return value if isinstance(value, Dim) else Dim(value)


def _union(*keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for group in keys for k in group))


@dataclass(frozen=True)
class Expected:
    """The shape and dtype family config.json implies for one source tensor."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # the dtype family, most usual first
    dim_keys: tuple[tuple[str, ...], ...]  # per dimension, the config keys its size derives from
    dtype_key: str | None = None  # the config key that chooses the dtype family (expert_dtype)

    def agrees(self, dtype: str, shape: tuple[int, ...]) -> bool:
        return dtype in self.dtypes and tuple(shape) == self.shape

    def blame(self, dtype: str, shape: tuple[int, ...]) -> tuple[str, ...]:
        """The config keys that could explain a tensor of ``dtype`` and ``shape`` (in dimension order).

        A dtype outside the family is the dtype key's doing alone (the shape of another format differs too).
        """
        if dtype not in self.dtypes:
            return (self.dtype_key,) if self.dtype_key else ()
        if len(shape) != len(self.shape):
            return _union(*self.dim_keys)
        return _union(*(keys for keys, want, got in zip(self.dim_keys, self.shape, shape) if want != got))

    def describe(self) -> str:
        return f"{' or '.join(self.dtypes)} {list(self.shape)}"


def _spec(dtypes: tuple[str, ...], *dims: Dim, dtype_key: str | None = None) -> Expected:
    return Expected(tuple(d.size for d in dims), dtypes, tuple(d.keys for d in dims), dtype_key)


# Dtype families as DeepSeek stores V4 (the released V4-Flash / V4-Pro / V4-Flash-Base safetensors;
# DeepSeek-V4's inference/model.py declares the same): BF16 norms, embeddings and dense projections; F32
# hyper-connection, sink, ape and gate-bias tensors; block-FP8 linears (E4M3) with E8M0 block scales
# (float32 in V4-Flash-Base); MXFP4 routed experts as int8 pairs of e2m1 with E8M0 per-32 scales (U8 when
# re-saved from vLLM's uint8 parameters); int64 (or int32, the engine's) hash-routing tables.
BF16 = ("BF16",)
F32 = ("F32",)
FP8 = ("F8_E4M3",)
BLOCK_SCALE = ("F8_E8M0", "F32")
MXFP4 = ("I8", "U8")
MX_SCALE = ("F8_E8M0", "U8")
TOKEN_TABLE = ("I64", "I32")
EXPERT_DTYPE = "expert_dtype"
BLOCK_KEY = "quantization_config.weight_block_size"
RATIO_KEY = "compress_ratios"
EXPERT_ROLE = ".ffn.experts.*."  # a routed expert's index, in a role (see tensor_roles)

Layout = tuple[tuple[str, Expected], ...]  # (name suffix, what config.json implies for it), in required order


def _dim(config: V4Config, key: str) -> Dim:
    return Dim(getattr(config, key), (key,))


def _blocks(config: V4Config) -> tuple[Dim, Dim]:
    rows, cols = config.weight_block_size
    return Dim(rows, (BLOCK_KEY,)), Dim(cols, (BLOCK_KEY,))


def _fp8_linear(config: V4Config, prefix: str, out: Dim, inp: Dim) -> list[tuple[str, Expected]]:
    """A block-FP8 linear [out, in] and its scale [cdiv(out, 128), cdiv(in, 128)] (weight_block_size)."""
    bo, bi = _blocks(config)
    return [
        (f"{prefix}.weight", _spec(FP8, out, inp)),
        (f"{prefix}.scale", _spec(BLOCK_SCALE, out.blocks(bo), inp.blocks(bi))),
    ]


def _routed_expert(config: V4Config, w: str, out: Dim, inp: Dim) -> list[tuple[str, Expected]]:
    """One routed expert's linear in the format expert_dtype names: MXFP4 [out, in/2] int8 with [out, in/32]
    scales, or block FP8. Every dimension the other format would size differently derives from expert_dtype too."""
    ed = EXPERT_DTYPE
    if config.expert_dtype == "fp4":
        return [
            (f"{w}.weight", _spec(MXFP4, out, (inp // 2).also(ed), dtype_key=ed)),
            (f"{w}.scale", _spec(MX_SCALE, out.also(ed), (inp // MX_BLOCK).also(ed), dtype_key=ed)),
        ]
    bo, bi = _blocks(config)
    return [
        (f"{w}.weight", _spec(FP8, out, inp.also(ed), dtype_key=ed)),
        (f"{w}.scale", _spec(BLOCK_SCALE, out.blocks(bo).also(ed), inp.blocks(bi).also(ed), dtype_key=ed)),
    ]


def _compressor(prefix: str, ratio: Dim, width: Dim, hidden: Dim, norm: Dim) -> list[tuple[str, Expected]]:
    return [
        (f"{prefix}.wkv.weight", _spec(BF16, width, hidden)),
        (f"{prefix}.wgate.weight", _spec(BF16, width, hidden)),
        (f"{prefix}.ape", _spec(F32, ratio, width)),
        (f"{prefix}.norm.weight", _spec(BF16, norm)),
    ]


def _block_start(config: V4Config) -> tuple[tuple[Dim, ...], list[tuple[str, Expected]]]:
    """What every decoder block (V4 and V4.1) starts with: its dims (hidden, heads, head_dim, q_lora_rank, o_groups,
    o_lora_rank, hc_mult) and its norms and hyper-connection maps."""
    d = functools.partial(_dim, config)
    dims = tuple(
        d(k)
        for k in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult")
    )
    D, hc = dims[0], dims[6]
    mix = (2 + hc) * hc
    fixed = [("attn_norm.weight", _spec(BF16, D)), ("ffn_norm.weight", _spec(BF16, D))]
    for part in ("attn", "ffn"):
        fixed += [
            (f"hc_{part}_fn", _spec(F32, mix, hc * D)),
            (f"hc_{part}_base", _spec(F32, mix)),
            (f"hc_{part}_scale", _spec(F32, Dim(3))),
        ]
    return dims, fixed


@functools.lru_cache(maxsize=16)
def block_layout(config: V4Config, ratio: int, hash_layer: bool) -> tuple[Layout, Layout]:
    """One decoder block (a main layer or an MTP block): its tensors after ``{prefix}.``, and one routed
    expert's after ``{prefix}.ffn.experts.{j}.`` (every expert alike), with what config.json implies for each.

    Shapes as DeepSeek-V4's inference/model.py builds the modules (and vLLM's DeepSeek V4 model loads
    them): hc_mult streams mixed by [(2+hc)*hc, hc*D] maps, a grouped output projection
    ``wo_a`` [G*Or, H*Dh/G], compressors of ``coff = 2`` (ratio 4, with the indexer) or 1 times head_dim.
    """
    d = functools.partial(_dim, config)
    (D, H, Dh, Qr, G, Or, hc), fixed = _block_start(config)
    for lin, out, inp in (
        ("wq_a", Qr, D),
        ("wq_b", H * Dh, Qr),
        ("wkv", Dh, D),
        ("wo_a", G * Or, H * Dh // G),
        ("wo_b", D, G * Or),
    ):
        fixed += _fp8_linear(config, f"attn.{lin}", out, inp)
    fixed += [
        ("attn.q_norm.weight", _spec(BF16, Qr)),
        ("attn.kv_norm.weight", _spec(BF16, Dh)),
        ("attn.attn_sink", _spec(F32, H)),
    ]
    if ratio:
        coff = Dim(2 if ratio == 4 else 1, (RATIO_KEY,))
        fixed += _compressor("attn.compressor", Dim(ratio, (RATIO_KEY,)), coff * Dh, D, Dh)
    if ratio == 4:
        IH, ID = d("index_n_heads"), d("index_head_dim")
        fixed += _fp8_linear(config, "attn.indexer.wq_b", IH * ID, Qr)
        fixed += [("attn.indexer.weights_proj.weight", _spec(BF16, IH, D))]
        fixed += _compressor("attn.indexer.compressor", Dim(4, (RATIO_KEY,)), Dim(2, (RATIO_KEY,)) * ID, D, ID)
    E, I = d("n_routed_experts"), d("moe_intermediate_size")
    fixed += [("ffn.gate.weight", _spec(BF16, E, D))]
    if hash_layer:
        fixed += [("ffn.gate.tid2eid", _spec(TOKEN_TABLE, d("vocab_size"), d("num_experts_per_tok")))]
    if not hash_layer or config.is_vision:  # vision checkpoints ship a gate bias on hash layers too
        fixed += [("ffn.gate.bias", _spec(F32, E))]
    if config.is_vision:  # the router's bias for image tokens, every block (MTP ones too)
        fixed += [("ffn.gate.bias_vl", _spec(F32, E.also("vision_n_layers")))]
    if config.n_shared_experts:
        shared = I * d("n_shared_experts")
        for w, out, inp in (("w1", shared, D), ("w2", D, shared), ("w3", shared, D)):
            fixed += _fp8_linear(config, f"ffn.shared_experts.{w}", out, inp)
    expert: list[tuple[str, Expected]] = []
    for w, out, inp in (("w1", I, D), ("w2", D, I), ("w3", I, D)):
        expert += _routed_expert(config, w, out, inp)
    return tuple(fixed), tuple(expert)


@functools.lru_cache(maxsize=4)
def global_layout(config: V4Config) -> Layout:
    """The tensors outside every layer: embedding, head, final norm and hc_head."""
    D, V, hc = _dim(config, "hidden_size"), _dim(config, "vocab_size"), _dim(config, "hc_mult")
    return (
        ("embed.weight", _spec(BF16, V, D)),
        ("head.weight", _spec(BF16, V, D)),
        ("norm.weight", _spec(BF16, D)),
        ("hc_head_fn", _spec(F32, hc, hc * D)),
        ("hc_head_base", _spec(F32, hc)),
        ("hc_head_scale", _spec(F32, Dim(1))),
    )


@functools.lru_cache(maxsize=4)
def mtp_layout(config: V4Config) -> tuple[Layout, Layout, Layout]:
    """An MTP layer's tensors besides its decoder block, after ``mtp.{i}.``: (before the block, after it,
    optional: its own embedding and head, which the plan materializes from the main ones when absent)."""
    D, V, hc = _dim(config, "hidden_size"), _dim(config, "vocab_size"), _dim(config, "hc_mult")
    before = (
        ("enorm.weight", _spec(BF16, D)),
        ("hnorm.weight", _spec(BF16, D)),
        *_fp8_linear(config, "e_proj", D, D),
        *_fp8_linear(config, "h_proj", D, D),
    )
    after = (
        ("norm.weight", _spec(BF16, D)),
        ("hc_head_fn", _spec(F32, hc, hc * D)),
        ("hc_head_base", _spec(F32, hc)),
        ("hc_head_scale", _spec(F32, Dim(1))),
    )
    optional = (("emb.tok_emb.weight", _spec(BF16, V, D)), ("head.weight", _spec(BF16, V, D)))
    return before, after, optional


# DSpark stages (vllm/models/deepseek_v4/nvidia/dspark.py, 0.33.0 and 0.34.0; DeepSeek-V4-Flash-0731's mtp.*): a
# decoder block per stage (layer id num_hidden_layers + i: compress ratio 1, never hash-routed), main_proj and
# main_norm on the first stage, the head stack on the last. Markov and confidence heads are unquantized.
HEAD_FLOAT = ("BF16", "F32")
MARKOV_KEY = "dspark_markov_rank"
TARGETS_KEY = "dspark_target_layer_ids"


@functools.lru_cache(maxsize=4)
def dspark_layout(config: V4Config) -> tuple[Layout, Layout]:
    """A DSpark draft's tensors besides its stages' decoder blocks: (the first stage's, after ``mtp.0.``; the last
    stage's, after ``mtp.{n-1}.``). ``main_proj`` is a block-FP8 [H, H·len(dspark_target_layer_ids)] (ReplicatedLinear
    with the target's quant config); ``markov_w1`` [V, r] and ``markov_w2`` [draft_vocab, r] (DSparkMarkovHead,
    vllm/model_executor/models/qwen3_dspark.py); ``confidence_head.proj`` [1, H + r] when enable_confidence_head."""
    D, V, hc = _dim(config, "hidden_size"), _dim(config, "vocab_size"), _dim(config, "hc_mult")
    targets = Dim(len(config.dspark_target_layer_ids), (TARGETS_KEY,))
    r = Dim(config.dspark_markov_rank, (MARKOV_KEY,))
    draft_vocab = Dim(config.draft_vocab_size, ("draft_vocab_size",)) if config.draft_vocab_size else V
    first = (*_fp8_linear(config, "main_proj", D, D * targets), ("main_norm.weight", _spec(BF16, D)))
    last: tuple[tuple[str, Expected], ...] = (
        ("norm.weight", _spec(BF16, D)),
        ("hc_head_fn", _spec(F32, hc, hc * D)),
        ("hc_head_base", _spec(F32, hc)),
        ("hc_head_scale", _spec(F32, Dim(1))),
        ("markov_head.markov_w1.weight", _spec(HEAD_FLOAT, V, r)),
        ("markov_head.markov_w2.weight", _spec(HEAD_FLOAT, draft_vocab, r)),
    )
    if config.enable_confidence_head:
        last += (("confidence_head.proj.weight", _spec(HEAD_FLOAT, Dim(1), D + r)),)
    return first, last


# DeepSeek V4.1 (vllm/models/deepseek_v41/, 0.33.0 and 0.34.0): MXFP8 linears (F8_E4M3 with [out/32, in/32] E8M0
# scales, weight_block_size [32, 32]), MXFP4 routed experts, a compressor (bf16 wkv, and wgate at ratio 2) only on
# kv_source_layer_ids, an indexer only on index_source_layer_ids (wk / k_norm only where the layer is a kv source too),
# a gate bias_vl on every MoE layer (the V4.1 config has vision), the Engram on engram_layer_ids, no hash layers,
# no hc_head; draft stages with dspark_n_routed_experts experts, never sources, without Engram.
MX8_SCALE = ("F8_E8M0", "U8")


def _mx8_linear(config: V4Config, prefix: str, out: Dim, inp: Dim) -> list[tuple[str, Expected]]:
    bo, bi = _blocks(config)
    return [
        (f"{prefix}.weight", _spec(FP8, out, inp)),
        (f"{prefix}.scale", _spec(MX8_SCALE, out.blocks(bo), inp.blocks(bi))),
    ]


@functools.lru_cache(maxsize=64)
def v41_block_layout(config: V4Config, layer: int | None) -> tuple[Layout, Layout]:
    """One V4.1 decoder block (``layer`` None: a DSpark stage) and one routed expert, as :func:`block_layout`."""
    d = functools.partial(_dim, config)
    (D, H, Dh, Qr, G, Or, hc), fixed = _block_start(config)
    for lin, out, inp in (("wq_a", Qr, D), ("wq_b", H * Dh, Qr), ("wkv", Dh, D), ("wo_a", G * Or, H * Dh // G),
                          ("wo_b", D, G * Or)):  # fmt: skip
        fixed += _mx8_linear(config, f"attn.{lin}", out, inp)
    fixed += [
        ("attn.q_norm.weight", _spec(BF16, Qr)),
        ("attn.kv_norm.weight", _spec(BF16, Dh)),
        ("attn.attn_sink", _spec(F32, H)),
    ]
    kv = layer is not None and layer in config.kv_source_layer_ids
    index = layer is not None and layer in config.index_source_layer_ids
    if kv:
        fixed += [("attn.compressor.wkv.weight", _spec(BF16, Dh, D))]
        if config.compress_ratio(layer) > 1:
            fixed += [("attn.compressor.wgate.weight", _spec(BF16, Dh, D))]
        fixed += [("attn.compressor.norm.weight", _spec(BF16, Dh))]
    if index:
        IH, ID = d("index_n_heads"), d("index_head_dim")
        fixed += _mx8_linear(config, "attn.indexer.wq_b", IH * ID, Qr)
        fixed += [("attn.indexer.weights_proj.weight", _spec(BF16, IH, D))]
        if kv:
            fixed += [("attn.indexer.wk.weight", _spec(BF16, ID, Dh)), ("attn.indexer.k_norm.weight", _spec(BF16, ID))]
    E = d("n_routed_experts") if layer is not None else Dim(config.dspark_n_routed_experts or 0,
                                                            ("dspark_n_routed_experts",))  # fmt: skip
    I = d("moe_intermediate_size")
    fixed += [
        ("ffn.gate.weight", _spec(BF16, E, D)),
        ("ffn.gate.bias", _spec(F32, E)),
        ("ffn.gate.bias_vl", _spec(F32, E)),
    ]
    shared = I * d("n_shared_experts")
    for w, out, inp in (("w1", shared, D), ("w2", D, shared), ("w3", shared, D)):
        fixed += _mx8_linear(config, f"ffn.shared_experts.{w}", out, inp)
    if layer is not None and layer in config.engram_layer_ids:
        rows = Dim(config.engram_num_embeddings[config.engram_layer_ids.index(layer)], ("engram_num_embeddings",))
        ed = d("engram_head_dim")
        cols = Dim(
            (config.engram_max_ngram_size - 1) * config.engram_n_heads, ("engram_max_ngram_size", "engram_n_heads")
        )
        fixed += [
            ("engram.embed.weight", _spec(FP8, rows, ed)),
            ("engram.embed.scale", _spec(MX8_SCALE, rows, ed // MX_BLOCK)),
            *_mx8_linear(config, "engram.wkv", D * (hc + 1), cols * ed),
            ("engram.q_weight", _spec(BF16, hc, D)),
            ("engram.k_weight", _spec(BF16, hc, D)),
        ]
    expert: list[tuple[str, Expected]] = []
    for w, out, inp in (("w1", I, D), ("w2", D, I), ("w3", I, D)):
        expert += _routed_expert(config, w, out, inp)
    return tuple(fixed), tuple(expert)


@functools.lru_cache(maxsize=4)
def v41_dspark_layout(config: V4Config) -> tuple[Layout, Layout]:
    """The V4.1 DSpark draft's first-stage and last-stage tensors besides their blocks (MXFP8 main_proj; the
    Markov head as markov_head.embed / .head; no hc_head)."""
    D, V = _dim(config, "hidden_size"), _dim(config, "vocab_size")
    targets = Dim(len(config.dspark_target_layer_ids), (TARGETS_KEY,))
    r = Dim(config.dspark_markov_rank, (MARKOV_KEY,))
    first = (*_mx8_linear(config, "main_proj", D, D * targets), ("main_norm.weight", _spec(BF16, D)))
    last: tuple[tuple[str, Expected], ...] = (
        ("norm.weight", _spec(BF16, D)),
        ("markov_head.embed.weight", _spec(HEAD_FLOAT, V, r)),
        ("markov_head.head.weight", _spec(HEAD_FLOAT, V, r)),
    )
    if config.enable_confidence_head:
        last += (("confidence_head.proj.weight", _spec(HEAD_FLOAT, Dim(1), D + r)),)
    return first, last


@functools.lru_cache(maxsize=4)
def v41_global_layout(config: V4Config) -> Layout:
    D, V = _dim(config, "hidden_size"), _dim(config, "vocab_size")
    return (("embed.weight", _spec(BF16, V, D)), ("head.weight", _spec(BF16, V, D)), ("norm.weight", _spec(BF16, D)))


# The vision tower stores float weights; vLLM casts whatever float dtype it finds into its BF16 parameters (F32 for
# image_*), so either is accepted, the usual one first.
TOWER_FLOAT = ("BF16", "F32")
IMAGE_FLOAT = ("F32", "BF16")
VISION_GROUP = "vision"


@functools.lru_cache(maxsize=4)
def vision_layout(config: V4Config) -> tuple[Layout, Layout]:
    """The vision model's own tensors: (outside the tower blocks, one block's after ``vision.blocks.{b}.``).

    Shapes as vLLM's common/vision.py builds them (0.33.0, 0.34.0): patch embedding [D, 3·P²], per block a fused
    q|k|v [3D, D], an output projection [D, D], a fused gate|up [2I, D] and a down projection [D, I]; the aligner
    merges r×r patches ([H, D·r²], then [H, H]); the image_* embeddings are [H].
    """
    d = functools.partial(_dim, config)
    D, I, P, r, H = (
        d(k) for k in ("vision_dim", "vision_inter_dim", "vision_patch_size", "vision_downsample_ratio", "hidden_size")
    )
    t = functools.partial(_spec, TOWER_FLOAT)
    outside = (
        ("vision.patch_embed.proj.weight", t(D, 3 * P * P)),
        ("vision.patch_embed.proj.bias", t(D)),
        ("vision.norm.weight", t(D)),
        ("aligner.w1.weight", t(H, D * r * r)),
        ("aligner.w1.bias", t(H)),
        ("aligner.w2.weight", t(H, H)),
        ("aligner.w2.bias", t(H)),
        *((name, _spec(IMAGE_FLOAT, H)) for name in ("image_start", "image_end", "image_newline", "image_pad")),
    )
    block = (
        ("norm1.weight", t(D)),
        ("norm2.weight", t(D)),
        ("attn.wqkv.weight", t(3 * D, D)),
        ("attn.wqkv.bias", t(3 * D)),
        ("attn.wo.weight", t(D, D)),
        ("attn.wo.bias", t(D)),
        ("mlp.w1.weight", t(2 * I, D)),
        ("mlp.w2.weight", t(D, I)),
    )
    return outside, block


def _suffixes(layout: Layout) -> list[str]:
    return [suffix for suffix, _ in layout]


def block_tensors(
    prefix: str, config: V4Config, *, ratio: int, hash_layer: bool, v41_layer: int | None | bool = False
) -> list[str]:
    """Source names of one decoder block (a main layer or an MTP block) under ``prefix``; ``v41_layer``: a V4.1
    block, of main layer ``v41_layer`` (None: a DSpark stage)."""
    if v41_layer is not False:
        fixed, expert = v41_block_layout(config, v41_layer)
        experts = config.n_routed_experts if v41_layer is not None else (config.dspark_n_routed_experts or 0)
    else:
        fixed, expert = block_layout(config, ratio, hash_layer)
        experts = config.n_routed_experts
    names = list(map(f"{prefix}.".__add__, _suffixes(fixed)))
    # 6 names per routed expert, 66k in a V4 checkpoint: the same suffixes for every block, joined by concatenation
    names += map(f"{prefix}.ffn.experts".__add__, _expert_suffixes(experts, tuple(_suffixes(expert))))
    return names


@functools.lru_cache(maxsize=4)
def _expert_suffixes(experts: int, per_expert: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f".{j}.{s}" for j in range(experts) for s in per_expert)


def mtp_tensors(i: int, config: V4Config) -> list[str]:
    """Source names MTP layer ``i`` must hold (its own embedding/head are optional: materialized)."""
    p = f"mtp.{i}"
    before, after, _optional = mtp_layout(config)
    names = list(map(f"{p}.".__add__, _suffixes(before)))
    names += block_tensors(p, config, ratio=0, hash_layer=False)
    names += map(f"{p}.".__add__, _suffixes(after))
    return names


def dspark_tensors(i: int, config: V4Config) -> list[str]:
    """Source names DSpark stage ``i`` must hold."""
    p = f"mtp.{i}"
    first, last = v41_dspark_layout(config) if config.is_v41 else dspark_layout(config)
    names = list(map(f"{p}.".__add__, _suffixes(first))) if i == 0 else []
    names += block_tensors(p, config, ratio=0, hash_layer=False, v41_layer=None if config.is_v41 else False)
    if i == config.draft_layers - 1:
        names += map(f"{p}.".__add__, _suffixes(last))
    return names


def draft_tensors(i: int, config: V4Config) -> list[str]:
    """Source names draft layer ``i`` must hold: a DSpark stage or a classic MTP layer."""
    return dspark_tensors(i, config) if config.is_dspark else mtp_tensors(i, config)


def required_tensors(config: V4Config, components: Iterable[str]) -> dict[str, list[str]]:
    """Group (``globals``, ``layers.L``, ``mtp.i``) → the source names the engine needs, for ``components``."""
    components = set(components)
    groups: dict[str, list[str]] = {}
    if "model" in components and config.is_v41:
        groups[GLOBAL_GROUP] = _suffixes(v41_global_layout(config))
        for layer in range(config.num_hidden_layers):
            groups[f"layers.{layer}"] = block_tensors(
                f"layers.{layer}", config, ratio=0, hash_layer=False, v41_layer=layer
            )
        outside, block = vision_layout(config)
        groups[VISION_GROUP] = [n for n in _suffixes(outside) if n != "image_pad"]  # V4.1's wrapper has no image_pad
        for b in range(config.vision_n_layers):
            groups[f"vision.blocks.{b}"] = [f"vision.blocks.{b}.{suffix}" for suffix in _suffixes(block)]
    elif "model" in components:
        groups[GLOBAL_GROUP] = _suffixes(global_layout(config))
        for layer in range(config.num_hidden_layers):
            groups[f"layers.{layer}"] = block_tensors(
                f"layers.{layer}",
                config,
                ratio=config.compress_ratio(layer),
                hash_layer=layer < config.num_hash_layers,
            )
        if config.is_vision:
            outside, block = vision_layout(config)
            groups[VISION_GROUP] = _suffixes(outside)
            for b in range(config.vision_n_layers):
                groups[f"vision.blocks.{b}"] = [f"vision.blocks.{b}.{suffix}" for suffix in _suffixes(block)]
    if "mtp" in components:  # the draft, whichever kind
        for i in range(config.draft_layers):
            groups[f"mtp.{i}"] = draft_tensors(i, config)
    return groups


@dataclass(frozen=True)
class Completeness:
    """What a checkpoint lacks against the engine's needs, for the components being converted."""

    missing_groups: dict[str, list[str]]  # group -> missing names (in required order)
    required_counts: dict[str, int]  # group -> how many names the group requires
    mtp_absent: tuple[int, ...]  # draft layers with no tensor at all (the engine's own message applies)
    mtp_waived: bool  # --only model and no draft layer at all: allowed, with a note
    mismatch: str | None = None  # mtp.* hold another draft kind than config.json describes (nothing is missing)

    @property
    def complete(self) -> bool:
        return not self.missing_groups and not self.mtp_absent and self.mismatch is None

    def message(self, config: V4Config) -> str:
        """The one-line verdict: the draft-kind mismatch alone when there is one; else the engine's own sentence
        for an absent MTP layer (ours for an absent DSpark stage), grouped names otherwise."""
        if self.mismatch is not None:
            return self.mismatch
        absent = [absent_draft_layer(config, i) for i in self.mtp_absent]
        if not self.missing_groups:
            return " ".join(absent)
        groups = [describe_missing(g, names, self.required_counts[g]) for g, names in self.missing_groups.items()]
        return (
            " ".join(absent + ["checkpoint lacks tensors the engine needs: " + "; ".join(groups)])
            + " — the checkpoint is incomplete: download the missing files again, or use a checkpoint that has them"
        )


def check_completeness(
    config: V4Config, names: Iterable[str], only: str | None = None, *, mtp_present: set[int] | None = None
) -> Completeness:
    """Compare source tensor ``names`` with what the engine needs for the components ``only`` selects.

    ``only="model"`` allows a checkpoint without any MTP layer (re-quantized uploads often drop them):
    the target model converts and the draft must come from elsewhere. ``mtp_present``: the MTP indices
    with any tensor, when the caller has counted them already.
    """
    have = names if isinstance(names, (set, frozenset, dict)) else set(names)  # a headers dict as it is: no copy
    if mtp_present is None:
        mtp_present = set(count_by_index(have, "mtp."))
    components = {"model", "mtp"} if only is None else {only}
    mtp_waived = only == "model" and not mtp_present and config.draft_layers > 0
    if only != "model" and mtp_present:
        mismatch = draft_kind_mismatch(config, have)
        if mismatch is not None:
            return Completeness({}, {}, (), False, mismatch)
    absent = tuple(i for i in range(config.draft_layers) if i not in mtp_present)
    if only == "model":
        absent = ()  # MTP layers are not converted: none need be there (a partial one still fails the plan)
    groups = required_tensors(config, components)
    missing: dict[str, list[str]] = {}
    for group, required in groups.items():
        if group.startswith("mtp.") and int(group[4:]) in absent:
            continue  # reported with the engine's own message
        if all(map(have.__contains__, required)):
            continue
        lack = [n for n in required if n not in have]
        if lack:
            missing[group] = lack
    return Completeness(missing, {g: len(r) for g, r in groups.items()}, absent, mtp_waived)


# What tells the two draft kinds apart in a checkpoint's names: a classic MTP layer's input projections, a DSpark
# draft's head stack (nvidia/mtp.py and nvidia/dspark.py load them; the other class has no such parameter).
CLASSIC_MTP_SIGNS = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight")
DSPARK_SIGNS = ("main_proj.weight", "main_norm.weight", "markov_head.", "confidence_head.")


def _signs(names: Iterable[str], signs: tuple[str, ...]) -> list[str]:
    pattern = re.compile(r"^mtp\.(?:0|[1-9][0-9]*)\.(?:" + "|".join(map(re.escape, signs)) + ")")
    return sorted(n for n in names if n.startswith("mtp.") and pattern.match(n))


def draft_kind_mismatch(config: V4Config, names: Iterable[str]) -> str | None:
    """One line when ``mtp.*`` holds the other draft kind than config.json describes (None when they agree).

    vLLM takes the draft kind from the speculative method the user names, and builds its parameters from
    config.json: DSpark stages served as MTP end in ``KeyError ... mtp_block.main_norm`` (nvidia/mtp.py), and
    classic MTP weights under a DSpark config leave every DSpark head uninitialised. Nothing is missing, so the
    verdict names the config, not a download."""
    if config.is_dspark:
        found = _signs(names, CLASSIC_MTP_SIGNS)
        if found:
            return (
                f"config.json names {TARGETS_KEY} (a DSpark draft), but mtp.* hold a classic MTP head "
                f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), which vLLM's DSpark draft has no "
                "parameter for; config.json is not the one released with these weights: use that one (it has no "
                "dspark_* keys), or convert the target alone with --only model"
            )
        return None
    found = _signs(names, DSPARK_SIGNS)
    if found:
        return (
            f"mtp.* hold DSpark stages ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), but config.json "
            f"has no {TARGETS_KEY}, so vLLM would build a classic MTP draft and fail on them (KeyError ... "
            "mtp_block.main_norm); config.json is not the one released with these weights: use that one (it names "
            f"{TARGETS_KEY} and {MARKOV_KEY}), or convert the target alone with --only model"
        )
    return None


def absent_draft_layer(config: V4Config, i: int) -> str:
    """The sentence for draft layer ``i`` without any tensor: vLLM's own for a classic MTP layer."""
    if config.is_dspark:
        return DSPARK_STAGE_MISSING_MESSAGE.format(stage=i, stages=config.draft_layers)
    return MTP_MISSING_MESSAGE.format(layer=config.num_hidden_layers + i)


def require_complete(config: V4Config, names: Iterable[str], only: str | None = None) -> Completeness:
    """:func:`check_completeness`, raising PlanError with its one-line verdict when anything is missing."""
    result = check_completeness(config, names, only)
    if not result.complete:
        raise PlanError(result.message(config))
    return result


def describe_missing(group: str, names: list[str], required: int) -> str:
    """``layers.1.*: all 77 tensors missing`` or ``layers.1.attn.wo_b.weight, .scale missing``."""
    if len(names) == required:
        return (
            f"{group}.*: all {required} tensors missing"
            if group != GLOBAL_GROUP
            else f"all {required} global tensors missing ({', '.join(names)})"
        )
    items = _collapse_experts(names)
    items = _collapse_linears(items)
    shown = items[:_MAX_LISTED]
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(shown) + more + " missing"


_EXPERT_RE = re.compile(r"^(?P<head>.+\.ffn\.experts)\.(?P<j>\d+)\.(?P<tail>w[123]\.(?:weight|scale))$")


def _collapse_experts(names: list[str]) -> list[str]:
    """Routed experts lacking the same tensor collapse to ``...experts.{3,5}.w1.weight``, in first-seen order."""
    ids: dict[str, list[str]] = {}  # display template (or plain name) -> expert ids
    for n in names:
        m = _EXPERT_RE.match(n)
        key = f"{m.group('head')}.{{}}.{m.group('tail')}" if m else n
        ids.setdefault(key, []).append(m.group("j") if m else "")
    out = []
    for key, js in ids.items():
        if js == [""]:
            out.append(key)
        else:
            out.append(key.format(js[0] if len(js) == 1 else "{" + ",".join(js) + "}"))
    return out


def _collapse_linears(items: list[str]) -> list[str]:
    """``X.weight`` followed by ``X.scale`` reads ``X.weight, .scale``."""
    out: list[str] = []
    for item in items:
        if out and item.endswith(".scale") and out[-1] == item[: -len(".scale")] + ".weight":
            out[-1] += ", .scale"
        else:
            out.append(item)
    return out


# ---------------------------------------------------------------------------------------------
# Shapes and dtypes: every stored tensor the config implies against what it implies


@functools.lru_cache(maxsize=4)
def expected_shapes(config: V4Config) -> dict[str, Expected]:
    """Role (a name, routed experts' index as ``*``: :func:`tensor_roles`) → what config.json implies for
    it, for every tensor the engine needs and the optional MTP embedding/head."""
    if config.is_v41:
        return _v41_expected_shapes(config)
    roles = dict(global_layout(config))

    def block(prefix: str, ratio: int, hash_layer: bool) -> None:
        fixed, expert = block_layout(config, ratio, hash_layer)
        roles.update((f"{prefix}.{suffix}", e) for suffix, e in fixed)
        roles.update((f"{prefix}{EXPERT_ROLE}{suffix}", e) for suffix, e in expert)

    for layer in range(config.num_hidden_layers):
        block(f"layers.{layer}", config.compress_ratio(layer), layer < config.num_hash_layers)
    if config.is_vision:
        outside, vblock = vision_layout(config)
        roles.update(outside)
        for b in range(config.vision_n_layers):
            roles.update((f"vision.blocks.{b}.{suffix}", e) for suffix, e in vblock)
    if config.is_dspark:
        first, last = dspark_layout(config)
        for i in range(config.draft_layers):
            roles.update((f"mtp.{i}.{suffix}", e) for suffix, e in (*first, *last))  # any stage may hold them
            block(f"mtp.{i}", 0, False)
        return roles
    before, after, optional = mtp_layout(config)
    for i in range(config.num_nextn_predict_layers):
        roles.update((f"mtp.{i}.{suffix}", e) for suffix, e in (*before, *after, *optional))
        block(f"mtp.{i}", 0, False)
    return roles


def _v41_expected_shapes(config: V4Config) -> dict[str, Expected]:
    roles = dict(v41_global_layout(config))

    def block(prefix: str, layer: int | None) -> None:
        fixed, expert = v41_block_layout(config, layer)
        roles.update((f"{prefix}.{suffix}", e) for suffix, e in fixed)
        roles.update((f"{prefix}{EXPERT_ROLE}{suffix}", e) for suffix, e in expert)

    for layer in range(config.num_hidden_layers):
        block(f"layers.{layer}", layer)
    outside, vblock = vision_layout(config)
    roles.update(outside)
    for b in range(config.vision_n_layers):
        roles.update((f"vision.blocks.{b}.{suffix}", e) for suffix, e in vblock)
    first, last = v41_dspark_layout(config)
    for i in range(config.draft_layers):
        roles.update((f"mtp.{i}.{suffix}", e) for suffix, e in (*first, *last))
        block(f"mtp.{i}", None)
    return roles


_EXPERT_INDEX = re.compile(
    r"\.ffn\.experts\.[0-9]+\."
)  # any digits: the plain pattern substitutes 69k names ~1.5x faster


def tensor_roles(names: list[str], lines: str | None = None) -> list[str]:
    """Each name with its routed-expert index as ``*`` (``layers.3.ffn.experts.*.w1.weight``): the key of
    :func:`expected_shapes`. One substitution over the names' :func:`name_lines` (pass ``lines`` when
    already joined), not a match per name."""
    lines = name_lines(names) if lines is None else lines
    if lines is None:
        return [_EXPERT_INDEX.sub(EXPERT_ROLE, n) for n in names]
    roles = _EXPERT_INDEX.sub(EXPERT_ROLE, lines).split("\n")
    del roles[0]
    return roles


Kind = tuple[str, str, tuple[int, ...]]  # (role, dtype, shape)
DtypeShape = tuple[str, tuple[int, ...]]


def shape_kinds(
    names: list[str],
    kinds: Iterable[Hashable],
    kind_of: Callable[[Any], DtypeShape] | None = None,
    lines: str | None = None,
) -> set[Kind]:
    """The distinct (role, dtype, shape) of tensors ``names``: what :func:`kinds_agree` checks. A few
    thousand for a V4 checkpoint's 69k tensors, whose routed experts share a handful; plain builtins,
    so a forked helper can hand them back.

    ``kinds``: each tensor's (dtype, shape), or a key ``kind_of`` turns into one (a parsed header's kind
    numbers: pairing 69k names with small ints, then looking up the few distinct ones, costs less).
    """
    pairs = set(zip(tensor_roles(names, lines), kinds))
    if kind_of is None:
        return {(role, dtype, shape) for role, (dtype, shape) in pairs}
    return {(role, *kind_of(kind)) for role, kind in pairs}


def kinds_agree(config: V4Config, kinds: Iterable[Kind]) -> bool:
    """Whether every tensor behind ``kinds`` that config.json implies has the shape and dtype it implies
    (names it does not imply are not judged here: completeness and the plan's rules are)."""
    expected = expected_shapes(config)
    for role, dtype, shape in kinds:
        e = expected.get(role)
        if e is not None and not e.agrees(dtype, shape):
            return False
    return True


# what a routed expert's weight dtype says its format is
STORED_FORMAT = {"I8": "fp4", "U8": "fp4", "F8_E4M3": "fp8"}


@dataclass(frozen=True)
class Disagreement:
    """Tensors whose headers disagree with config.json: the key to blame (None where no key explains
    them), the first tensor that shows it, and how many tensors disagree in all."""

    key: str | None
    tensor: TensorInfo
    expected: Expected
    count: int

    def message(self, config: V4Config) -> str:
        """One line: the key and its value, the tensor and its file, expected vs actual, the count, the fix."""
        t = self.tensor
        actual = f"{t.dtype} {list(t.shape)}"
        if self.key == EXPERT_DTYPE and t.dtype in STORED_FORMAT and _EXPERT_INDEX.search(t.name):
            actual += f" ({STORED_FORMAT[t.dtype]})"
        more = self.count - 1
        more = f" (and {more:,} more tensor{'s disagree' if more > 1 else ' disagrees'})" if more else ""
        if self.key is None:
            return (
                f"tensor {t.name!r} in {t.file} is {actual}, but config.json implies {self.expected.describe()}{more}; "
                "the checkpoint does not have DeepSeek V4's layout: convert the original checkpoint with its own "
                "config.json"
            )
        return (
            f"{_key_value(config, self.key, t.name)} in config.json, but tensor {t.name!r} in {t.file} is {actual}, "
            f"not the {self.expected.describe()} it implies{more}; config.json is not the one released with these "
            f"weights: use that one, or fix {self.key.split('.')[-1]}"
        )


def _key_value(config: V4Config, key: str, name: str) -> str:
    """``hidden_size 640``, ``expert_dtype 'fp8'``, ``compress_ratios[1] 128`` (the layer of ``name``)."""
    if key == RATIO_KEY:
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer:
            return f"{key}[{layer.group(1)}] {config.compress_ratio(int(layer.group(1)))}"
        return f"{key} {list(config.compress_ratios)}"
    if key == BLOCK_KEY:
        return f"{key} {list(config.weight_block_size)}"
    return f"{key} {getattr(config, key)!r}"


def config_disagreement(config: V4Config, tensors: Iterable[TensorInfo]) -> Disagreement | None:
    """Every tensor config.json implies against what it implies, one by one, in checkpoint order (file, then
    offset: the same first tensor whether the headers came from local shards or the hub's metadata).

    The key to blame is the one most disagreeing tensors could be explained by: an edited ``hidden_size``
    shows in nearly every tensor, ``num_attention_heads`` in a few per layer that all involve it, while
    ``head_dim`` or ``o_groups`` share only some of them. On a tie, the key whose tensors disagree the
    most often (``n_shared_experts`` over ``moe_intermediate_size``, which the routed experts share too),
    then the first seen.
    """
    expected = expected_shapes(config)
    infos = sorted(tensors, key=_PLACE)
    roles = tensor_roles([t.name for t in infos])
    found: list[tuple[TensorInfo, Expected, tuple[str, ...]]] = []
    for info, role in zip(infos, roles):
        e = expected.get(role)
        if e is not None and not e.agrees(info.dtype, info.shape):
            found.append((info, e, e.blame(info.dtype, info.shape)))
    if not found:
        return None
    votes = Counter(key for *_, keys in found for key in keys)
    involved: Counter[str] = Counter()  # tensors checked whose shape or dtype a key takes part in
    for role, n in Counter(roles).items():
        if (e := expected.get(role)) is not None:
            for key in _union(*e.dim_keys, (e.dtype_key,) if e.dtype_key else ()):
                involved[key] += n
    key = max(votes, key=lambda k: (votes[k], votes[k] / involved[k])) if votes else None
    info, e, _ = next(f for f in found if key is None or key in f[2])
    return Disagreement(key, info, e, len(found))


_DTYPE_SHAPE = itemgetter(1, 2)
_PLACE = attrgetter("file", "start")


def require_agreement(config: V4Config, tensors: dict[str, TensorInfo]) -> None:
    """Raise PlanError naming the key, a tensor and expected vs actual when a header disagrees with what
    config.json implies. The distinct kinds are checked first; tensors one by one only when one disagrees."""
    infos = tensors.values()
    if kinds_agree(config, shape_kinds(list(tensors), map(_DTYPE_SHAPE, infos))):
        return
    found = config_disagreement(config, infos)
    if found is not None:
        raise PlanError(found.message(config))
