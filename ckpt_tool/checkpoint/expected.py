"""What config.json implies for each source tensor: its name, shape and dtype family, derived once from the config
(the engine builds its parameters the same way), grouped by layer; and from that the names the engine needs.

The blocks (DeepSeek-V4's inference/model.py): compress ratio 0 → sliding-window only; ratio > 0 → a compressor;
ratio 4 → also the indexer (with its own compressor). Hash layers (``L < num_hash_layers``) route
through ``ffn.gate.tid2eid`` and have no gate bias; the others carry ``ffn.gate.bias`` (noaux_tc).
MTP blocks never compress and always carry the bias; so do DSpark stages, which replace the MTP layers when
config.json names ``dspark_target_layer_ids`` (:func:`dspark_specs`). The vision model (``vision_n_layers > 0``) adds
``ffn.gate.bias_vl`` to every block, ``ffn.gate.bias`` to hash layers too, and its tower (:func:`vision_specs`).
An MTP layer's own embedding/head are optional:
the plan materializes them from ``embed.weight`` / ``head.weight`` when absent.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from ckpt_tool.checkpoint import expert_format
from ckpt_tool.checkpoint.blocks import MX_BLOCK, NVFP4_BLOCK
from ckpt_tool.checkpoint.config import V4Config

GLOBAL_GROUP = "globals"


@dataclass(frozen=True)
class Dim:
    """One dimension config.json implies: its size and the config keys it derives from (what a
    disagreement names)."""

    size: int
    keys: tuple[str, ...] = ()

    def __mul__(self, other: Dim | int) -> Dim:
        other = _as_dim(other)
        return Dim(self.size * other.size, union_keys(self.keys, other.keys))

    __rmul__ = __mul__

    def __add__(self, other: Dim | int) -> Dim:
        other = _as_dim(other)
        return Dim(self.size + other.size, union_keys(self.keys, other.keys))

    __radd__ = __add__

    def __floordiv__(self, other: Dim | int) -> Dim:
        other = _as_dim(other)
        return Dim(self.size // other.size, union_keys(self.keys, other.keys))

    def blocks(self, block: Dim) -> Dim:
        """How many ``block``-long blocks cover this dimension (a block scale's length)."""
        return Dim(-(-self.size // block.size), union_keys(self.keys, block.keys))

    def also(self, key: str) -> Dim:
        """The same size, derived from ``key`` too."""
        return Dim(self.size, union_keys(self.keys, (key,)))


def _as_dim(value: Dim | int) -> Dim:
    return value if isinstance(value, Dim) else Dim(value)


def union_keys(*keys: tuple[str, ...]) -> tuple[str, ...]:
    """The config keys of every group, each once, in first-seen order."""
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
            return union_keys(*self.dim_keys)
        return union_keys(*(keys for keys, want, got in zip(self.dim_keys, self.shape, shape) if want != got))

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

Specs = tuple[tuple[str, Expected], ...]  # (name suffix, what config.json implies for it), in required order


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


def _routed_expert(config: V4Config, fmt: str, w: str, out: Dim, inp: Dim) -> list[tuple[str, Expected]]:
    """One routed expert's linear in the format ``fmt`` (:mod:`ckpt_tool.checkpoint.expert_format`): MXFP4 [out, in/2]
    int8 with [out, in/32] scales, block FP8, or NVFP4 [out, in/2] U8 with [out, in/16] E4M3 scales and two scalars.
    Every dimension another format would size differently derives from the key that chooses the format too."""
    ef = expert_format.EXPERT_FORMATS[fmt]
    key = expert_format.MOE_QUANT_KEY if ef is expert_format.NVFP4 else EXPERT_DTYPE
    bo, bi = _blocks(config)
    dims = {
        "packed": (out, (inp // 2).also(key)),
        "mx": (out.also(key), (inp // MX_BLOCK).also(key)),
        "nv": (out.also(key), (inp // NVFP4_BLOCK).also(key)),
        "fp8": (out, inp.also(key)),
        "fp8-blocks": (out.blocks(bo).also(key), inp.blocks(bi).also(key)),
        "scalar": (),
    }
    return [(f"{w}.{part.suffix}", _spec(part.dtypes, *dims[part.shape], dtype_key=key)) for part in ef.parts]


def _format_of(config: V4Config, prefix: str | None) -> str:
    """The experts' format name of the block under ``prefix`` (None: the one DeepSeek's own expert_dtype names)."""
    if prefix is None:
        return expert_format.FP8.name if config.expert_dtype == "fp8" else expert_format.MXFP4.name
    return expert_format.layer_format(config, prefix).name


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
def block_specs(config: V4Config, ratio: int, hash_layer: bool, fmt: str | None = None) -> tuple[Specs, Specs]:
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
        expert += _routed_expert(config, fmt or _format_of(config, None), w, out, inp)
    return tuple(fixed), tuple(expert)


@functools.lru_cache(maxsize=4)
def global_specs(config: V4Config) -> Specs:
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
def mtp_specs(config: V4Config) -> tuple[Specs, Specs, Specs]:
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
def dspark_specs(config: V4Config) -> tuple[Specs, Specs]:
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
def v41_block_specs(config: V4Config, layer: int | None, fmt: str | None = None) -> tuple[Specs, Specs]:
    """One V4.1 decoder block (``layer`` None: a DSpark stage) and one routed expert (``fmt``: its format's name), as
    :func:`block_specs`."""
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
        expert += _routed_expert(config, fmt or _format_of(config, None), w, out, inp)
    return tuple(fixed), tuple(expert)


@functools.lru_cache(maxsize=4)
def v41_dspark_specs(config: V4Config) -> tuple[Specs, Specs]:
    """The V4.1 DSpark draft's first-stage and last-stage tensors besides their blocks (MXFP8 main_proj; the
    Markov head as markov_head.embed / .head; no hc_head)."""
    D, V = _dim(config, "hidden_size"), _dim(config, "vocab_size")
    targets = Dim(len(config.dspark_target_layer_ids), (TARGETS_KEY,))
    r = Dim(config.dspark_markov_rank, (MARKOV_KEY,))
    # DSparkMarkovHead(vocab_size, draft_vocab_size or vocab_size, rank): embed is markov_w1, head markov_w2
    draft_vocab = Dim(config.draft_vocab_size, ("draft_vocab_size",)) if config.draft_vocab_size else V
    first = (*_mx8_linear(config, "main_proj", D, D * targets), ("main_norm.weight", _spec(BF16, D)))
    last: tuple[tuple[str, Expected], ...] = (
        ("norm.weight", _spec(BF16, D)),
        ("markov_head.embed.weight", _spec(HEAD_FLOAT, V, r)),
        ("markov_head.head.weight", _spec(HEAD_FLOAT, draft_vocab, r)),
    )
    if config.enable_confidence_head:
        last += (("confidence_head.proj.weight", _spec(HEAD_FLOAT, Dim(1), D + r)),)
    return first, last


@functools.lru_cache(maxsize=4)
def v41_global_specs(config: V4Config) -> Specs:
    D, V = _dim(config, "hidden_size"), _dim(config, "vocab_size")
    return (("embed.weight", _spec(BF16, V, D)), ("head.weight", _spec(BF16, V, D)), ("norm.weight", _spec(BF16, D)))


# The vision tower stores float weights; vLLM casts whatever float dtype it finds into its BF16 parameters (F32 for
# image_*), so either is accepted, the usual one first.
TOWER_FLOAT = ("BF16", "F32")
IMAGE_FLOAT = ("F32", "BF16")
VISION_GROUP = "vision"


@functools.lru_cache(maxsize=4)
def vision_specs(config: V4Config) -> tuple[Specs, Specs]:
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


def _suffixes(layout: Specs) -> list[str]:
    return [suffix for suffix, _ in layout]


def block_tensors(
    prefix: str, config: V4Config, *, ratio: int, hash_layer: bool, v41_layer: int | None | bool = False
) -> list[str]:
    """Source names of one decoder block (a main layer or an MTP block) under ``prefix``; ``v41_layer``: a V4.1
    block, of main layer ``v41_layer`` (None: a DSpark stage)."""
    fmt = _format_of(config, prefix)
    if v41_layer is not False:
        fixed, expert = v41_block_specs(config, v41_layer, fmt)
        experts = config.n_routed_experts if v41_layer is not None else (config.dspark_n_routed_experts or 0)
    else:
        fixed, expert = block_specs(config, ratio, hash_layer, fmt)
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
    before, after, _optional = mtp_specs(config)
    names = list(map(f"{p}.".__add__, _suffixes(before)))
    names += block_tensors(p, config, ratio=0, hash_layer=False)
    names += map(f"{p}.".__add__, _suffixes(after))
    return names


def dspark_tensors(i: int, config: V4Config) -> list[str]:
    """Source names DSpark stage ``i`` must hold."""
    p = f"mtp.{i}"
    first, last = v41_dspark_specs(config) if config.is_v41 else dspark_specs(config)
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
        groups[GLOBAL_GROUP] = _suffixes(v41_global_specs(config))
        for layer in range(config.num_hidden_layers):
            groups[f"layers.{layer}"] = block_tensors(
                f"layers.{layer}", config, ratio=0, hash_layer=False, v41_layer=layer
            )
        outside, block = vision_specs(config)
        groups[VISION_GROUP] = [n for n in _suffixes(outside) if n != "image_pad"]  # V4.1's wrapper has no image_pad
        for b in range(config.vision_n_layers):
            groups[f"vision.blocks.{b}"] = [f"vision.blocks.{b}.{suffix}" for suffix in _suffixes(block)]
    elif "model" in components:
        groups[GLOBAL_GROUP] = _suffixes(global_specs(config))
        for layer in range(config.num_hidden_layers):
            groups[f"layers.{layer}"] = block_tensors(
                f"layers.{layer}",
                config,
                ratio=config.compress_ratio(layer),
                hash_layer=layer < config.num_hash_layers,
            )
        if config.is_vision:
            outside, block = vision_specs(config)
            groups[VISION_GROUP] = _suffixes(outside)
            for b in range(config.vision_n_layers):
                groups[f"vision.blocks.{b}"] = [f"vision.blocks.{b}.{suffix}" for suffix in _suffixes(block)]
    if "mtp" in components:  # the draft, whichever kind
        for i in range(config.draft_layers):
            groups[f"mtp.{i}"] = draft_tensors(i, config)
    return groups


@functools.lru_cache(maxsize=4)
def expected_shapes(config: V4Config) -> dict[str, Expected]:
    """Role (a name, routed experts' index as ``*``: :func:`tensor_roles`) → what config.json implies for
    it, for every tensor the engine needs and the optional MTP embedding/head."""
    if config.is_v41:
        return _v41_expected_shapes(config)
    roles = dict(global_specs(config))

    def block(prefix: str, ratio: int, hash_layer: bool) -> None:
        fixed, expert = block_specs(config, ratio, hash_layer, _format_of(config, prefix))
        roles.update((f"{prefix}.{suffix}", e) for suffix, e in fixed)
        roles.update((f"{prefix}{EXPERT_ROLE}{suffix}", e) for suffix, e in expert)

    for layer in range(config.num_hidden_layers):
        block(f"layers.{layer}", config.compress_ratio(layer), layer < config.num_hash_layers)
    if config.is_vision:
        outside, vblock = vision_specs(config)
        roles.update(outside)
        for b in range(config.vision_n_layers):
            roles.update((f"vision.blocks.{b}.{suffix}", e) for suffix, e in vblock)
    if config.is_dspark:
        first, last = dspark_specs(config)
        for i in range(config.draft_layers):
            roles.update((f"mtp.{i}.{suffix}", e) for suffix, e in (*first, *last))  # any stage may hold them
            block(f"mtp.{i}", 0, False)
        return roles
    before, after, optional = mtp_specs(config)
    for i in range(config.num_nextn_predict_layers):
        roles.update((f"mtp.{i}.{suffix}", e) for suffix, e in (*before, *after, *optional))
        block(f"mtp.{i}", 0, False)
    return roles


def _v41_expected_shapes(config: V4Config) -> dict[str, Expected]:
    roles = dict(v41_global_specs(config))

    def block(prefix: str, layer: int | None) -> None:
        fixed, expert = v41_block_specs(config, layer, _format_of(config, prefix))
        roles.update((f"{prefix}.{suffix}", e) for suffix, e in fixed)
        roles.update((f"{prefix}{EXPERT_ROLE}{suffix}", e) for suffix, e in expert)

    for layer in range(config.num_hidden_layers):
        block(f"layers.{layer}", layer)
    outside, vblock = vision_specs(config)
    roles.update(outside)
    for b in range(config.vision_n_layers):
        roles.update((f"vision.blocks.{b}.{suffix}", e) for suffix, e in vblock)
    first, last = v41_dspark_specs(config)
    for i in range(config.draft_layers):
        roles.update((f"mtp.{i}.{suffix}", e) for suffix, e in (*first, *last))
        block(f"mtp.{i}", None)
    return roles
