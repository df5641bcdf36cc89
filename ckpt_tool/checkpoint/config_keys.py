"""Every config.json key the tool reads, for each model class and draft kind: the JSON type vLLM reads it as, what its
value must satisfy (in range, distinct where vLLM requires it, consistent with the other keys and with the tensors
present) and the vLLM file each rule comes from (0.33.0 and 0.34.0 alike unless a line says otherwise).

vLLM trusts these values: a layer id past the model indexes nothing (``dspark_target_layer_ids``: the draft is fed
fewer hidden states than ``main_proj`` was trained on), a float where an int belongs fails inside a ``range``, a
string ``"4"`` multiplies as a string. So :class:`V4Config` applies :func:`check_types` before it builds (the JSON
types: a traceback is never the answer to a value of the wrong type) and :func:`check_values` after (ranges and
relations); :func:`check_tensors` compares the keys that name layers holding particular tensors with the headers
(``inspect`` and the planner, before anything is written). Each refusal is one line naming the key, its value and
what the model or the checkpoint holds.

Keys are named as in the flat config vLLM builds (V4.1: ``text_config`` copied to the top level, ``vision_config``
as ``vision_*``: vllm/transformers_utils/configs/deepseek_v41.py); messages name them as written in the file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ckpt_tool.errors import CheckpointError, PlanError

# JSON types, as vLLM reads the key
INT = "integer"
NUMBER = "number"
STRING = "string"
BOOL = "boolean"
INTS = "list of integers"
STRINGS = "list of strings"
OBJECT = "object"

# model classes (ckpt_tool.mapping.profiles.model_class) and draft kinds (ckpt_tool.mapping.profiles.draft_kind)
TEXT, VISION, V41 = "text", "vision", "v41"
MTP, DSPARK, DSPARK_V41 = "mtp", "dspark", "dspark-v41"
V4 = frozenset({TEXT, VISION})
EVERY = frozenset({TEXT, VISION, V41})
DSPARKS = frozenset({DSPARK, DSPARK_V41})

# The largest count (layers, stages, experts, hash heads) the tool plans for: beyond any DeepSeek model (V4-Pro: 61
# layers, 384 experts), and it bounds the name lists built from the config before a header is compared with them.
MAX_COUNT = 4096
MAX_EXPERT_LAYERS = 1 << 18  # routed experts times the layers holding them (V4-Pro: 62 x 384): 6 names each
MAX_HASH_HEADS = 16384  # Engram hash heads over all layers (V4.1-Flash: 24 a layer), each a prime to find

V4_SRC = "vllm/models/deepseek_v4/nvidia/model.py, attention.py"
V41_SRC = "vllm/models/deepseek_v41/nvidia/model.py, attention.py"
HF_V4_SRC = "transformers' configuration_deepseek_v4.py, which vLLM's DeepSeek V4 model reads"
DSPARK_SRC = "vllm/models/deepseek_v4/nvidia/dspark.py, deepseek_v41/nvidia/dspark.py"
AUX_SRC = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config"
SPEC_SRC = "vllm 0.33.0 config/speculative.py SpeculativeConfig; 0.34.0 v1/worker/gpu/spec_decode/dspark/config.py"
ENGRAM_SRC = "vllm/models/deepseek_v41/common/engram.py EngramLayout, ParallelEngramEmbedding"
VISION_SRC = "vllm/models/deepseek_v4/common/vision.py"
NVFP4_SRC = "vllm/models/deepseek_v41/quant_config.py DeepseekV4FP8Config (_is_nvfp4_expert_layer)"
V41_VISION_SRC = "vllm/transformers_utils/configs/deepseek_v41.py, which fills vision_* from vision_config"

Check = Callable[[Any, dict], "str | None"]  # (value, the flat config) -> what is wrong (None: nothing)


@dataclass(frozen=True)
class KeyRule:
    """One key the tool reads: its JSON type, where it applies, what it must satisfy and why."""

    key: str  # in the flat config (``quantization_config.weight_block_size``: a nested one)
    json_type: str
    applies: frozenset[str]  # the model classes and draft kinds it is read for
    rule: str  # what the value must satisfy, in words (docs/verification.md lists the main ones)
    source: str  # the vLLM file the type and the rule come from
    required: bool | Callable[[dict], bool] = False  # vLLM reads it without a default (a callable: only then)
    null_is_default: bool = False  # vLLM reads null as absent (``getattr(config, key, None) or default``)
    check: Check | None = None
    read: Callable[[dict], bool] | None = None  # vLLM reads the key only where this holds (None: always)

    def needed(self, flat: dict) -> bool:
        return self.required(flat) if callable(self.required) else self.required

    def is_read(self, flat: dict) -> bool:
        return self.read is None or self.read(flat)


# ---------------------------------------------------------------------------------------------------------------------
# checks: each returns what is wrong with a well-typed value, in words that follow "KEY is VALUE in config.json, but"


def _at_least(low: int, high: int | None = MAX_COUNT) -> Check:
    def check(v, flat):
        if v < low:
            return f"it must be at least {low}"
        if high is not None and v > high:
            return f"it is beyond any DeepSeek model (the tool reads at most {high})"
        return None

    return check


def _layers(flat: dict) -> int:
    return flat["num_hidden_layers"]


def _layer_list(low: Callable[[dict], int], high: Callable[[dict], int], what: str, ascending: bool = True) -> Check:
    """Each id in [low, high], each once (ascending where ``ascending``): ids that name a layer of the model."""

    def check(ids, flat):
        lo, hi = low(flat), high(flat)
        outside = [i for i in ids if not lo <= i <= hi]
        if outside:
            return (
                f"{'layer' if len(outside) == 1 else 'layers'} {', '.join(map(str, outside[:4]))} "
                f"{'is' if len(outside) == 1 else 'are'} not {what} {lo}-{hi} (num_hidden_layers {_layers(flat)})"
            )
        seen: set[int] = set()
        for i in ids:
            if i in seen:
                return f"layer {i} is named twice"
            seen.add(i)
        if ascending and list(ids) != sorted(ids):
            return "the ids are not in ascending order (vLLM collects them in layer order)"
        return None

    return check


def _v4_ratios(ratios, flat):
    bad = sorted({r for r in ratios if r not in (0, 4, 128)})
    if bad:
        return f"ratio {bad[0]} is not one of 0 (sliding window), 4 (CSA) and 128 (HCA)"
    if len(ratios) < _layers(flat):
        return f"it has {len(ratios)} entries for {_layers(flat)} layers (num_hidden_layers)"
    return None


def _v41_ratios(ratios, flat):
    bad = sorted({r for r in ratios if r not in (0, 1, 2)})
    return f"ratio {bad[0]} is not one of 0, 1 and 2" if bad else None


# What V4.1 builds on a source layer takes only some compress ratios (vllm/models/deepseek_v41, 0.33.0 and 0.34.0):
# a kv source's compressor 1 or 2 (compressor.py raises a ValueError for any other), an index source's indexer any
# ratio above 0 (attention.py divides max_model_len by it)
SOURCE_RATIOS = {
    "kv_source_layer_ids": ((1, 2), "vLLM's V4.1 compressor takes 1 or 2 (deepseek_v41/compressor.py)"),
    "index_source_layer_ids": ((1, 2), "vLLM's V4.1 indexer divides by it (deepseek_v41/attention.py)"),
}


def _sources(key: str) -> Check:
    """V4.1's kv / index source layers: model layers, each once, ascending, each with a ratio its module takes
    (:data:`SOURCE_RATIOS`), and one at or below every layer whose compress ratio is above 0 (attention.py:
    ``max(s for s in sources if s <= layer_id)``, a ValueError otherwise)."""
    in_range = _layer_list(lambda f: 0, lambda f: _layers(f) - 1, "among the model's layers")
    takes, why = SOURCE_RATIOS[key]

    def check(ids, flat):
        problem = in_range(ids, flat)
        if problem:
            return problem
        ratios = flat.get("compress_ratios") or []
        for layer in ids:
            ratio = ratios[layer] if layer < len(ratios) else 0  # past the list: 0 (attention.py)
            if ratio not in takes:
                return f"compress_ratios gives source layer {layer} ratio {ratio}: {why}"
        compressed = [layer for layer, r in enumerate(ratios) if r > 0]
        uncovered = [layer for layer in compressed if not any(s <= layer for s in ids)]
        if uncovered:
            return (
                f"layer {uncovered[0]} has compress ratio {ratios[uncovered[0]]} and no {key.split('_')[0]} source "
                "at or below it"
            )
        return None

    return check


def _v41(flat: dict) -> bool:
    """V4.1's config class (vllm/transformers_utils/configs/deepseek_v41.py) copies text_config as it is, with no
    defaults: a key its model reads as ``config.key`` must be there (V4's transformers config has defaults)."""
    return flat.get("model_type") == "deepseek_v41"


def _any_compressed(flat: dict) -> bool:
    return any(r > 0 for r in flat.get("compress_ratios") or [] if isinstance(r, int))


def _engram(flat: dict) -> bool:
    return bool(flat.get("engram_layer_ids"))


def _engram_layers(ids, flat):
    problem = _layer_list(lambda f: 0, lambda f: _layers(f) - 1, "among the model's layers")(ids, flat)
    if problem:
        return problem
    tables = flat.get("engram_num_embeddings")
    if isinstance(tables, list) and len(tables) != len(ids):
        return f"engram_num_embeddings gives {len(tables)} table sizes for {len(ids)} layers (vLLM asserts one each)"
    return None


def _experts(v, flat):
    """A count, and with the layers that hold experts (main layers and draft layers) within the names the tool lists."""
    problem = COUNT(v, flat)
    if problem:
        return problem
    counts = (flat["num_hidden_layers"], flat["num_nextn_predict_layers"], _int_or(flat.get("n_mtp_layers"), 0))
    if max(counts) > MAX_COUNT:
        return None  # that count's own rule refuses it
    layers = counts[0] + max(counts[1:])
    if v * layers > MAX_EXPERT_LAYERS:
        return f"with {layers} layers it makes {v * layers} routed experts, beyond any DeepSeek model"
    return None


def _int_or(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _hash_heads(v, flat):
    """The hash heads of every Engram layer together: each a prime the tool draws (engram.EngramSplit)."""
    heads = (flat.get("engram_max_ngram_size", 2) - 1) * flat.get("engram_n_heads", 1)
    total = heads * len(flat.get("engram_layer_ids") or [])
    if total > MAX_HASH_HEADS:
        return (
            f"it makes {heads} hash heads a layer, {total} in all, beyond any DeepSeek model (the tool reads at most "
            f"{MAX_HASH_HEADS})"
        )
    return None


def _engram_rows(rows, flat):
    """Each table exactly as long as its layer's hash buckets together.

    Fewer rows: vLLM refuses them (ParallelEngramEmbedding asserts ``sum(head_sizes) <= num_embeddings``). More rows:
    vLLM builds the model, but no hash reaches the rows past the last bucket, and the buckets it does reach are not
    the ones the table was trained with: the prime buckets come from ``engram_vocab_size``, ``engram_n_heads`` and
    ``engram_max_ngram_size`` (EngramLayout), and DeepSeek lays each table out as exactly those buckets (V4.1-Flash:
    24 primes just above 16,000,000 a layer, 384,006,168 and 384,016,682 rows). A table longer than its buckets is
    one laid out for other Engram keys: the served model would look up the wrong rows, with no error anywhere."""
    if any(r < 1 for r in rows):
        return "every table size must be at least 1"
    from ckpt_tool.checkpoint.engram import EngramSplit  # the prime buckets, as vLLM draws them

    ids = flat.get("engram_layer_ids") or []
    split = EngramSplit.from_config(_Attrs(flat, engram_layer_ids=tuple(ids), engram_num_embeddings=tuple(rows)))
    for layer, have, sizes in zip(ids, rows, split.head_sizes if split else ()):
        if have < sum(sizes):
            return f"layer {layer}'s table has {have} rows, fewer than its {sum(sizes)} hash buckets"
        if have > sum(sizes):
            return (
                f"layer {layer}'s {len(sizes)} hash buckets (prime sizes from engram_vocab_size "
                f"{flat.get('engram_vocab_size')}) reach only {sum(sizes)} of its {have} rows: the table was laid out "
                "for other engram_vocab_size, engram_n_heads or engram_max_ngram_size values"
            )
    return None


class _Attrs:
    """The flat config as attributes (what EngramSplit.from_config reads), with some overridden."""

    def __init__(self, flat: dict, **override) -> None:
        self.__dict__.update(flat)
        self.__dict__.update(override)


def _rope_dim(v, flat):
    """Rotary pairs: an even count (vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py asserts
    ``rope_dim % 2 == 0``); V4.1's compressor asserts 64 (vllm/models/deepseek_v41/compressor.py). No parameter's shape
    depends on it, so only these rules can catch a wrong one."""
    if v < 2 or v % 2:
        return "it must be an even number of at least 2 (rotary pairs: vLLM's fused_inv_rope_fp8_quant asserts it)"
    if _v41(flat) and _any_compressed(flat) and v != 64:
        return "vLLM's V4.1 compressor asserts 64 (deepseek_v41/compressor.py) and compress_ratios compresses layers"
    return None


def _head_dim(v, flat):
    rope = flat["qk_rope_head_dim"]
    return None if v > rope else f"it must exceed qk_rope_head_dim {rope} (nope part: head_dim - qk_rope_head_dim)"


def _above_zero(v, flat):
    return None if v > 0 else "it must be above 0"


def _model_type(v, flat):
    return None if v in ("deepseek_v4", "deepseek_v41") else "it is neither deepseek_v4 nor deepseek_v41"


def _expert_dtype(v, flat):
    return None if v in ("fp4", "fp8") else "it is neither fp4 nor fp8"


def _groups(v, flat):
    heads = flat["num_attention_heads"]
    return f"it must divide num_attention_heads {heads}" if v < 1 or heads % v else None


def _topk(total_key: str, fallback: str | None = None) -> Check:
    def check(v, flat):
        total = flat.get(total_key) or (flat.get(fallback) if fallback else None)
        if v < 1:
            return "it must be at least 1"
        if isinstance(total, int) and v > total:
            return f"it exceeds the {total} experts ({total_key if flat.get(total_key) else fallback})"
        return None

    return check


def _vision_dim(v, flat):
    heads = flat.get("vision_n_heads")
    if v < 1:
        return "it must be at least 1"
    return f"it must divide into vision_n_heads {heads}" if isinstance(heads, int) and heads > 0 and v % heads else None


def _block_size(v, flat):
    return "both block sizes must be at least 1" if len(v) != 2 or min(v) < 1 else None


def _in_vocab(v, flat):
    return None if 0 <= v < flat["vocab_size"] else f"it is not a token id below vocab_size {flat['vocab_size']}"


def _moe_quant_algo(v, flat):
    """vLLM compares ``(moe_quant_algo or "").upper()`` with "NVFP4" and builds MXFP4 experts for anything else: an
    algorithm ckpt-tool does not know would be served in the wrong format (empty: DeepSeek's own formats)."""
    from ckpt_tool.checkpoint.expert_format import KNOWN_MOE_QUANT_ALGOS

    if v == "" or v.upper() in KNOWN_MOE_QUANT_ALGOS:
        return None
    return (
        f"it is a format of routed experts ckpt-tool does not know (known: {', '.join(KNOWN_MOE_QUANT_ALGOS)}, in any "
        "case); vLLM would build MXFP4 experts for it"
    )


def _nvfp4_experts(flat: dict) -> bool:
    """moe_quant_algo names NVFP4: only then does vLLM match the experts' names with ``ignore``."""
    quant = flat.get("quantization_config")
    algo = quant.get("moe_quant_algo") if isinstance(quant, dict) else None
    return isinstance(algo, str) and algo.upper() == "NVFP4"


def _multiple_of_32(v, flat):
    return "it must be a positive multiple of 32 (one E8M0 scale per 32 columns)" if v < 32 or v % 32 else None


def _dspark_targets(v41: bool) -> Check:
    """V4's ids name the layer whose output feeds the draft (vLLM captures after layer id, as id + 1: 0..N-1);
    V4.1's are used as they are, the input of layer id (1..N: layer 0 has no input to capture, the end of the last
    layer is N). nvidia/model.py's capture loops take each once, in layer order."""
    if v41:
        return _layer_list(lambda f: 1, _layers, "among the layer boundaries vLLM V4.1 captures,")
    return _layer_list(lambda f: 0, lambda f: _layers(f) - 1, "among the model's layers")


def _dspark(flat: dict) -> bool:
    return flat.get("dspark_target_layer_ids") is not None


def _nonempty(check: Check) -> Check:
    def nonempty(v, flat):
        return "it must name at least one layer" if not v else check(v, flat)

    return nonempty


POSITIVE = _at_least(1, None)
COUNT = _at_least(1)

# ---------------------------------------------------------------------------------------------------------------------
# the table


def _r(key, json_type, applies, rule, source, **kw) -> KeyRule:
    return KeyRule(key, json_type, frozenset(applies), rule, source, **kw)


# fmt: off
RULES: tuple[KeyRule, ...] = (
    # the model, every class
    _r("model_type", STRING, EVERY, "deepseek_v4 or deepseek_v41", "vllm/transformers_utils/config.py (the config "
       "class by model_type)", required=True, check=_model_type),
    _r("num_hidden_layers", INT, EVERY, f"0-{MAX_COUNT}", V4_SRC, required=True, check=_at_least(0)),
    _r("num_nextn_predict_layers", INT, EVERY, f"0-{MAX_COUNT}", V4_SRC, required=True, check=_at_least(0)),
    _r("vocab_size", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("hidden_size", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("num_attention_heads", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("qk_rope_head_dim", INT, EVERY, "even, >= 2; V4.1 with compressed layers: 64", V4_SRC + ", compressor.py",
       required=True, check=_rope_dim),
    _r("head_dim", INT, EVERY, "> qk_rope_head_dim", V4_SRC, required=True, check=_head_dim),
    _r("q_lora_rank", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("o_groups", INT, EVERY, "divides num_attention_heads", V4_SRC, required=True, check=_groups),
    _r("o_lora_rank", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("n_routed_experts", INT, EVERY, f"1-{MAX_COUNT}", V4_SRC, required=True, check=_experts),
    _r("n_shared_experts", INT, EVERY, f"0-{MAX_COUNT}", V4_SRC, required=True, check=_at_least(0)),
    _r("num_experts_per_tok", INT, EVERY, "1-n_routed_experts", V4_SRC, required=True,
       check=_topk("n_routed_experts")),
    _r("moe_intermediate_size", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("hc_mult", INT, EVERY, ">= 1", V4_SRC, required=True, check=POSITIVE),
    _r("num_hash_layers", INT, V4, ">= 0 (the first min(it, num_hidden_layers) layers)", HF_V4_SRC, required=True,
       check=_at_least(0, None)),
    _r("num_hash_layers", INT, {V41}, "any (V4.1 has no hash layers: nvidia/model.py passes 0)", V41_SRC),
    _r("compress_ratios", INTS, V4, "each 0, 4 or 128; one per layer at least", HF_V4_SRC + " (layer_types)",
       required=True, check=_v4_ratios),
    _r("compress_ratios", INTS, {V41}, "each 0, 1 or 2 (layers past the list: 0)", "vllm/models/deepseek_v41/"
       "attention.py", required=True, check=_v41_ratios),
    _r("rms_norm_eps", NUMBER, EVERY, "> 0", V4_SRC, required=True, check=_above_zero),
    _r("index_n_heads", INT, EVERY, ">= 1", V4_SRC, required=_v41, check=POSITIVE),
    _r("index_head_dim", INT, EVERY, ">= 1", V4_SRC, required=_v41, check=POSITIVE),
    _r("sliding_window", INT, EVERY, ">= 1", V4_SRC, required=_v41, check=POSITIVE),
    _r("hc_sinkhorn_iters", INT, EVERY, ">= 1", V4_SRC, required=_v41, check=POSITIVE),
    _r("hc_eps", NUMBER, EVERY, "any", V4_SRC, required=_v41),
    _r("routed_scaling_factor", NUMBER, EVERY, "any", V4_SRC),
    _r("swiglu_limit", NUMBER, EVERY, "any", V4_SRC, required=_v41),
    _r("rope_theta", NUMBER, EVERY, "any", V4_SRC),
    _r("scoring_func", STRING, EVERY, "any", V4_SRC),
    _r("norm_topk_prob", BOOL, EVERY, "any", V4_SRC, required=_v41),
    _r("expert_dtype", STRING, EVERY, "fp4 or fp8", "vllm/models/deepseek_v4/quant_config.py", check=_expert_dtype),
    # vLLM picks the FP8 linear method and its block from it: without it every linear would be built unquantized
    _r("quantization_config", OBJECT, EVERY, "an object", "vllm/models/deepseek_v41/quant_config.py", required=True),
    _r("quantization_config.weight_block_size", INTS, EVERY, "two sizes, each >= 1",
       "vllm/models/deepseek_v41/quant_config.py", required=True, check=_block_size),
    _r("quantization_config.expert_dtype", STRING, {V41}, "fp4 or fp8 (V4.1's expert format when no expert_dtype)",
       V41_VISION_SRC, check=_expert_dtype),
    _r("quantization_config.scale_fmt", STRING, EVERY, "any", "vllm/models/deepseek_v41/quant_config.py"),
    # NVIDIA's NVFP4 exports (ckpt_tool.checkpoint.expert_format): which routed experts are NVFP4
    _r("quantization_config.moe_quant_algo", STRING, EVERY, "NVFP4, in any case (null, empty or absent: DeepSeek's "
       "own expert formats)", NVFP4_SRC, null_is_default=True, check=_moe_quant_algo),
    # vLLM drops a non-list and the non-strings of a list without a word, which changes the layers it builds NVFP4:
    # the tool refuses both
    _r("quantization_config.ignore", STRINGS, EVERY, "module-name patterns (fnmatch) of the expert layers left in "
       "DeepSeek's format; read only with moe_quant_algo NVFP4 (null or absent: none)", NVFP4_SRC,
       null_is_default=True, read=_nvfp4_experts),
    # the vision tower (V4: top-level vision_* keys; V4.1: vision_config, with vLLM's defaults)
    _r("vision_n_layers", INT, EVERY, f"0-{MAX_COUNT}", VISION_SRC, check=_at_least(0)),
    _r("vision_n_heads", INT, {VISION, V41}, ">= 1", VISION_SRC, required=lambda f: f.get("vision_n_layers", 0) != 0,
       check=POSITIVE),
    _r("vision_dim", INT, {VISION, V41}, "a multiple of vision_n_heads", VISION_SRC,
       required=lambda f: f.get("vision_n_layers", 0) != 0, check=_vision_dim),
    *(
        _r(key, INT, {VISION, V41}, ">= 1", VISION_SRC, required=lambda f: f.get("vision_n_layers", 0) != 0,
           check=POSITIVE)
        for key in ("vision_inter_dim", "vision_patch_size", "vision_downsample_ratio")
    ),
    # the DSpark draft (V4 and V4.1)
    _r("dspark_target_layer_ids", INTS, {DSPARK}, "V4: layers 0..num_hidden_layers-1, each once, ascending",
       f"{AUX_SRC} (V4: id + 1); nvidia/model.py captures after layer idx when idx + 1 is one of them",
       required=True, check=_nonempty(_dspark_targets(False))),
    _r("dspark_target_layer_ids", INTS, {DSPARK_V41}, "V4.1: layer boundaries 1..num_hidden_layers, each once, "
       "ascending", f"{AUX_SRC} (V4.1: as given); deepseek_v41/nvidia/model.py _run_layers, _collapse",
       required=True, check=_nonempty(_dspark_targets(True))),
    _r("dspark_markov_rank", INT, DSPARKS, ">= 1", DSPARK_SRC, required=True, check=POSITIVE),
    _r("dspark_block_size", INT, DSPARKS, ">= 1 (the serve line's num_speculative_tokens)", SPEC_SRC, required=True,
       check=POSITIVE),
    _r("block_size", INT, DSPARKS, ">= 1 (wins over dspark_block_size)", SPEC_SRC, check=POSITIVE),
    _r("n_mtp_layers", INT, DSPARKS, f"1-{MAX_COUNT} (null: the default)", DSPARK_SRC, null_is_default=True,
       check=COUNT),
    _r("enable_confidence_head", BOOL, DSPARKS, "true or false", DSPARK_SRC),
    _r("draft_vocab_size", INT, DSPARKS, ">= 1 (null: vocab_size)", DSPARK_SRC, null_is_default=True, check=POSITIVE),
    _r("dspark_noise_token_id", INT, DSPARKS, "a token id below vocab_size",
       "vllm/v1/worker/gpu/spec_decode/utils.py", check=_in_vocab),
    _r("dspark_n_routed_experts", INT, {DSPARK_V41}, f"1-{MAX_COUNT} (null: n_routed_experts)", V41_SRC,
       null_is_default=True, check=COUNT),
    _r("dspark_num_experts_per_tok", INT, {DSPARK_V41}, "1-the stages' experts (null: num_experts_per_tok)", V41_SRC,
       null_is_default=True, check=_topk("dspark_n_routed_experts", "n_routed_experts")),
    # DeepSeek V4.1: source layers and the Engram
    _r("kv_source_layer_ids", INTS, {V41}, "model layers, each once, ascending, one at or below every compressed "
       "layer", "vllm/models/deepseek_v41/attention.py", required=_any_compressed,
       check=_sources("kv_source_layer_ids")),
    _r("index_source_layer_ids", INTS, {V41}, "model layers, each once, ascending, one at or below every "
       "compressed layer", "vllm/models/deepseek_v41/attention.py", required=_any_compressed,
       check=_sources("index_source_layer_ids")),
    _r("engram_layer_ids", INTS, {V41}, "model layers, each once, ascending; as many as engram_num_embeddings",
       ENGRAM_SRC + "; nvidia/model.py picks a layer's table by its index here", check=_engram_layers),
    _r("engram_max_ngram_size", INT, {V41}, "2-", ENGRAM_SRC, required=_engram, check=_at_least(2, None)),
    _r("engram_n_heads", INT, {V41}, f">= 1, at most {MAX_HASH_HEADS} hash heads in all", ENGRAM_SRC, required=_engram,
       check=lambda v, f: POSITIVE(v, f) or _hash_heads(v, f)),
    _r("engram_head_dim", INT, {V41}, "a multiple of 32", ENGRAM_SRC, required=_engram, check=_multiple_of_32),
    _r("engram_vocab_size", INT, {V41}, ">= 2", ENGRAM_SRC, required=_engram, check=_at_least(2, None)),
    _r("engram_compressed_vocab_size", INT, {V41}, ">= 1", ENGRAM_SRC, required=_engram, check=POSITIVE),
    _r("engram_pad_token_id", INT, {V41}, ">= 0", ENGRAM_SRC, required=_engram, check=_at_least(0, None)),
    _r("engram_num_embeddings", INTS, {V41}, "per Engram layer, its hash buckets' rows exactly", ENGRAM_SRC,
       required=_engram, check=_engram_rows),
)
# fmt: on

# ---------------------------------------------------------------------------------------------------------------------
# applying the table


def classes_of(flat: dict) -> frozenset[str]:
    """The model class and draft kind a flat config describes (what the rules' ``applies`` name)."""
    from ckpt_tool.checkpoint.config import DSPARK_KEY, V41_MODEL_TYPE

    dspark = flat.get(DSPARK_KEY) is not None
    if flat.get("model_type") == V41_MODEL_TYPE:
        return frozenset({V41, DSPARK_V41} if dspark else {V41})
    vision = flat.get("vision_n_layers")
    model = VISION if isinstance(vision, int) and not isinstance(vision, bool) and vision > 0 else TEXT
    return frozenset({model, DSPARK if dspark else MTP})


def config_classes(config) -> frozenset[str]:
    """The model class and draft kind a V4Config describes, by name: what ckpt_tool.mapping.profiles' model_class_of
    and draft_kind_of choose (a later stage: tests/test_stage_order.py holds the two equal)."""
    if config.is_v41:
        return frozenset({V41, DSPARK_V41})
    return frozenset({VISION if config.is_vision else TEXT, DSPARK if config.is_dspark else MTP})


@dataclass(frozen=True)
class DraftFacts:
    """What a message says of a draft kind (ckpt_tool.mapping.profiles.draft_kind's record of the same name)."""

    name: str
    layer_word: str
    vllm_file: str


def draft_of(config) -> DraftFacts:
    """The draft kind ``config`` describes, as :func:`config_classes` names it."""
    if config.is_v41:
        return DraftFacts(DSPARK_V41, "DSpark stage", "vllm/models/deepseek_v41/nvidia/dspark.py")
    if config.is_dspark:
        return DraftFacts(DSPARK, "DSpark stage", "vllm/models/deepseek_v4/nvidia/dspark.py")
    return DraftFacts(MTP, "MTP layer", "vllm/models/deepseek_v4/nvidia/mtp.py")


def rules_for(classes: Collection[str]) -> list[KeyRule]:
    """The rules that apply to a config of ``classes`` (a model class and a draft kind), in table order."""
    return [r for r in RULES if r.applies & set(classes)]


_MISSING = object()


def _lookup(flat: dict, key: str) -> Any:
    head, _, tail = key.partition(".")
    value = flat.get(head, _MISSING)
    if tail:
        return value.get(tail, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def _has_type(value: Any, json_type: str) -> bool:
    if json_type == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if json_type == STRING:
        return isinstance(value, str)
    if json_type == BOOL:
        return isinstance(value, bool)
    if json_type == INTS:
        return isinstance(value, list) and all(_has_type(v, INT) for v in value)
    if json_type == STRINGS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, dict)


def _finite(value: int | float) -> bool:
    """A number vLLM can hold as a float (JSON integers have no bound: 10**400 is one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (``null``, ``a string``, ``a float``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer" if _finite(value) else "an integer too large for a float"
    if isinstance(value, float):
        return "a float" if math.isfinite(value) else "not a finite number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        if all(_has_type(v, INT) for v in value):
            return "a list of integers" if value else "an empty list"
        return "a list of strings" if all(isinstance(v, str) for v in value) else "a list of mixed values"
    return "an object"


def shown(value: Any, limit: int = 60) -> str:
    """A value as it reads in config.json, cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def key_in_file(original: dict, key: str) -> str:
    """How ``key`` (a flat-config name) is written in the config.json ``original``: V4.1 nests most keys."""
    from ckpt_tool.checkpoint.config import V41_VISION_KEYS

    if not isinstance(original.get("text_config"), dict):
        return key
    for name, (attr, _) in V41_VISION_KEYS.items():
        if attr == key:
            return f"vision_config.{name}"
    return f"text_config.{key}" if key in original["text_config"] else key


def _refusal(where: str, original: dict, rule: KeyRule, value: Any, problem: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {key_in_file(original, rule.key)} is {shown(value)} in config.json, but {problem} ({rule.source}); "
        "use the model's released config.json, or fix the config"
    )


def check_types(flat: dict, original: dict | None = None, where: str = "config.json") -> None:
    """Raise CheckpointError (one line) for the first key of ``flat`` whose JSON type is not the one vLLM reads, or
    that vLLM reads without a default and is missing or null."""
    original = flat if original is None else original
    for rule in rules_for(classes_of(flat)):
        value = _lookup(flat, rule.key)
        if not rule.is_read(flat):
            continue
        if value is _MISSING:
            if rule.needed(flat):
                raise CheckpointError(
                    f"{where}: {key_in_file(original, rule.key)} is missing from config.json, but vLLM reads it "
                    f"without a default ({rule.source}); use the model's released config.json"
                )
        elif value is None and rule.null_is_default:
            continue
        elif value is None and not rule.needed(flat):
            # vLLM's getattr(config, key, default) returns the null itself: refused like any other wrong type
            raise _refusal(where, original, rule, value, f"vLLM reads {_a(rule.json_type)} or no key at all")
        elif not _has_type(value, rule.json_type):
            raise _refusal(where, original, rule, value, f"it is {json_kind(value)}; vLLM reads {_a(rule.json_type)}")


def check_values(flat: dict, original: dict | None = None, where: str = "config.json") -> None:
    """Raise CheckpointError (one line) for the first key whose value breaks its rule (after :func:`check_types`)."""
    original = flat if original is None else original
    for rule in rules_for(classes_of(flat)):
        value = _lookup(flat, rule.key)
        if rule.check is None or value is _MISSING or value is None or not rule.is_read(flat):
            continue
        problem = rule.check(value, flat)
        if problem:
            raise _refusal(where, original, rule, value, problem)


def _a(json_type: str) -> str:
    return ("an " if json_type[0] in "aeiou" else "a ") + json_type


# ---------------------------------------------------------------------------------------------------------------------
# against the tensors present


@dataclass(frozen=True)
class HeldBy:
    """A key that names the layers holding a tensor: the tensor (after ``layers.{L}.``) that shows a layer is one."""

    key: str
    tensor: str  # a regex over the name after ``layers.{L}.``
    what: str  # what that tensor is, for the message
    applies: frozenset[str]
    source: str


HELD_BY = (
    HeldBy("engram_layer_ids", r"engram\.", "Engram tables", frozenset({V41}), ENGRAM_SRC),
    HeldBy(
        "kv_source_layer_ids",
        r"attn\.compressor\.",
        "a compressor",
        frozenset({V41}),
        "vllm/models/deepseek_v41/attention.py",
    ),
    HeldBy(
        "index_source_layer_ids",
        r"attn\.indexer\.",
        "an indexer",
        frozenset({V41}),
        "vllm/models/deepseek_v41/attention.py",
    ),
    HeldBy("num_hash_layers", r"ffn\.gate\.tid2eid", "a hash-routing table (ffn.gate.tid2eid)", V4, HF_V4_SRC),
)


def layers_holding(lines: str | None, names: Collection[str], tensor: str) -> set[int]:
    """Every main layer L with a tensor ``layers.{L}.<tensor>...``: one regex pass over the names joined by
    newlines (``lines``, :func:`ckpt_tool.checkpoint.completeness.name_lines`), else a match per name."""
    pattern = rf"layers\.(0|[1-9][0-9]*)\.{tensor}"
    if lines is not None:
        return set(map(int, re.findall("\n" + pattern, lines)))
    compiled = re.compile(pattern)
    return {int(m.group(1)) for n in names if (m := compiled.match(n))}


def tensor_key_problem(config, names: Collection[str]) -> str | None:
    """One line when a key that names the layers holding particular tensors (:data:`HELD_BY`) disagrees with the
    layers that hold them: the key, its value and the layers the checkpoint holds them for (None: they agree).

    Judged only among the main layers the checkpoint holds (a layer absent altogether is completeness's to name;
    a draft-only source holds none)."""
    from ckpt_tool.checkpoint.completeness import layer_indices, name_lines

    classes = config_classes(config)
    helds = [h for h in HELD_BY if h.applies & classes]
    names = names if isinstance(names, (set, frozenset, dict, list, tuple)) else list(names)
    lines = name_lines(list(names))
    present = layer_indices(names, lines=lines)
    if present and max(present) >= config.num_hidden_layers:
        # vLLM builds layers 0..num_hidden_layers-1 and nothing loads the others (fewer: completeness names them)
        return (
            f"{key_in_file(config.raw, 'num_hidden_layers')} is {config.num_hidden_layers} in config.json, but the "
            f"checkpoint holds layers {_ranges(sorted(present))} ({V4_SRC} builds that many); config.json is not "
            "the one released with these weights: use that one, or fix the config"
        )
    extra = (
        _extra_draft_layers(config, names, lines)
        or _held_without_key(config, names, lines, present)
        or _compressed_without_ratio(config, names, lines, present)
    )
    if extra is not None:
        return extra
    for held in helds:
        have = layers_holding(lines, names, held.tensor) & present
        if held.key == "num_hash_layers":
            value: Any = config.num_hash_layers
            named = {layer for layer in present if layer < value}  # the first layers: no range() of the value
        else:
            value = list(getattr(config, held.key))
            named = set(value)
        if named & present == have:
            continue
        holds = f"layers {_ranges(sorted(have))}" if have else "no layer"
        return (
            f"{key_in_file(config.raw, held.key)} is {shown(value)} in config.json, but the checkpoint holds "
            f"{held.what} for {holds} (vLLM builds them where the key says: {held.source}); config.json is not the "
            "one released with these weights: use that one, or fix the config"
        )
    return None


def _extra_draft_layers(config, names: Collection[str], lines: str | None) -> str | None:
    """Draft layers ``mtp.{i}`` past the count config.json gives (vLLM builds that many, and nothing loads the others;
    fewer: completeness names the missing ones)."""
    from ckpt_tool.checkpoint.completeness import count_by_index

    held = sorted(count_by_index(names, "mtp.", lines))
    if not held or held[-1] < config.draft_layers:
        return None
    kind = draft_of(config)
    # the key vLLM counts them by: DSpark's n_mtp_layers (V4.1's falls back to num_nextn_predict_layers), else nextn
    counted_by_stages = config.is_dspark and (config.n_mtp_layers or not config.is_v41)
    key = "n_mtp_layers" if counted_by_stages else "num_nextn_predict_layers"
    value = getattr(config, key)
    shown_value = shown(value) if value is not None else f"absent (vLLM's {kind.name} draft: {config.draft_layers})"
    return (
        f"{key_in_file(config.raw, key)} is {shown_value} in config.json, but the checkpoint holds "
        f"{kind.layer_word}s mtp.{_ranges(held)} ({kind.vllm_file} builds {config.draft_layers}); "
        "config.json is not the one released with these weights: use that one, or fix the config"
    )


def _held_without_key(config, names: Collection[str], lines: str | None, present: set[int]) -> str | None:
    """Tensors stored for modules the config's counts and switches leave out: vLLM builds no parameter for them (its
    sharded loader refuses the extra keys; a rule would still convert them). Shared experts with n_shared_experts 0
    (V4: nvidia/model.py builds them only when it is above 0), a confidence head with enable_confidence_head false
    (nvidia/dspark.py), vision blocks past vision_n_layers (common/vision.py)."""
    from ckpt_tool.checkpoint.completeness import count_by_index

    def refuse(key: str, value, what: str) -> str:
        return (
            f"{key_in_file(config.raw, key)} is {shown(value)} in config.json, but the checkpoint holds {what}, for "
            "which vLLM would build no parameter; config.json is not the one released with these weights: use that "
            "one, or fix the config"
        )

    if not config.is_v41 and not config.n_shared_experts:
        shared = layers_holding(lines, names, r"ffn\.shared_experts\.") & present
        if shared:
            what = f"shared experts in layers {_ranges(sorted(shared))}"
            return refuse("n_shared_experts", config.n_shared_experts, what)
    if config.is_dspark and not config.enable_confidence_head:
        heads = sorted(count_by_index([n for n in names if ".confidence_head." in n], "mtp."))
        if heads:
            what = f"a confidence head (mtp.{_ranges(heads)}.confidence_head.*)"
            return refuse("enable_confidence_head", _file_value(config.raw, "enable_confidence_head"), what)
    blocks = sorted(count_by_index(names, "vision.blocks.", lines))
    if blocks and blocks[-1] >= config.vision_n_layers:
        return refuse("vision_n_layers", config.vision_n_layers, f"vision tower blocks {_ranges(blocks)}")
    return None


# The attention modules whose presence a main layer's compress ratio decides, and the ratios that build them.
# V4 (vllm/models/deepseek_v4/attention.py, 0.33.0 and 0.34.0): a compressor for 4 or 128, an indexer (with its own
# compressor) for 4 only; a draft layer's ratio is 1. V4.1: the source layer ids place compressors and indexers
# (HELD_BY); a kv source's compressor has a gate only for ratio 2 (deepseek_v41/compressor.py ``has_gate``).
RATIO_MODULES = {
    False: ((r"attn\.compressor\.", "a compressor", (4, 128)), (r"attn\.indexer\.", "an indexer", (4,))),
    True: ((r"attn\.compressor\.wgate\.", "a compressor gate (attn.compressor.wgate)", (2,)),),
}
RATIO_SRC = {False: "vllm/models/deepseek_v4/attention.py", True: "vllm/models/deepseek_v41/compressor.py"}


def _compressed_without_ratio(config, names: Collection[str], lines: str | None, present: set[int]) -> str | None:
    """A module stored for a main layer whose compress ratio builds none (:data:`RATIO_MODULES`; vLLM's sharded loader
    refuses the extra keys, a rule would still convert them). A missing one is completeness's to name."""
    for tensor, what, ratios in RATIO_MODULES[config.is_v41]:
        held = layers_holding(lines, names, tensor) & present
        stray = sorted(layer for layer in held if config.compress_ratio(layer) not in ratios)
        if stray:
            have = ", ".join(f"{config.compress_ratio(layer)} for layer {layer}" for layer in stray[:3])
            rule = f"vLLM builds {what} only for ratio {' or '.join(map(str, ratios))}"
            return (
                f"{key_in_file(config.raw, 'compress_ratios')} is {shown(list(config.compress_ratios))} in "
                f"config.json, but the checkpoint holds {what} for {_layer_word(stray)} {_ranges(stray)}, whose "
                f"ratios it gives as {have} ({rule}: {RATIO_SRC[config.is_v41]}); config.json is not the one released "
                "with these weights: use that one, or fix the config"
            )
    return None


def _layer_word(ids: list[int]) -> str:
    return "layer" if len(ids) == 1 else "layers"


def _file_value(raw: dict, key: str):
    """``key`` as config.json gives it (V4.1: text_config first, as vLLM's config class copies it up)."""
    text = raw.get("text_config")
    return text[key] if isinstance(text, dict) and key in text else raw.get(key)


def check_tensors(config, names: Collection[str]) -> None:
    """:func:`tensor_key_problem`, raised as PlanError."""
    problem = tensor_key_problem(config, names)
    if problem is not None:
        raise PlanError(problem)


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
