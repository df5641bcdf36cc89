"""The routed experts' format, as data beside the model class and the draft kind.

A checkpoint's routed experts (``layers.L.ffn.experts.E.w{1,2,3}.*``, ``mtp.K.ffn.experts.E.*``) come in one of
three formats; everything else of the checkpoint (attention, shared experts, head) is the same block FP8 in all:

- ``mxfp4``: DeepSeek's own V4-Flash / V4-Pro / V4.1 (``expert_dtype: "fp4"``): I8 pairs of E2M1 codes [out, in/2]
  and one E8M0 scale per 32 inputs [out, in/32]. vLLM builds ``Mxfp4MoEMethod``
  (model_executor/layers/quantization/mxfp4.py, 0.33.0 and 0.34.0).
- ``fp8``: V4-Flash-Base (``expert_dtype: "fp8"``): block FP8 [out, in] with [out/128, in/128] scales. vLLM builds
  its block-FP8 MoE method (DeepseekV4FP8Config, models/deepseek_v41/quant_config.py).
- ``nvfp4``: NVIDIA's Model Optimizer exports (``nvidia/DeepSeek-V4-Flash-NVFP4`` and siblings): config.json keeps
  ``quant_method: "fp8"`` and ``expert_dtype: "fp4"`` and adds ``quantization_config.moe_quant_algo: "NVFP4"``
  and an ``ignore`` list. U8 pairs of E2M1 codes [out, in/2], one F8_E4M3 scale per 16 inputs [out, in/16], an
  F32 global scale ``weight_scale_2`` and an F32 activation scale ``input_scale`` (scalars) per projection. vLLM
  builds ``ModelOptNvFp4FusedMoE`` (model_executor/layers/quantization/modelopt.py, ``create_weights``).

Which layers are NVFP4 is vLLM's decision, repeated here exactly (:func:`layer_format`): vLLM 0.33.0 and 0.34.0's
``DeepseekV4FP8Config.get_quant_method`` (models/deepseek_v41/quant_config.py, V4 and V4.1 alike on CUDA) builds
``ModelOptNvFp4FusedMoE`` for a routed-experts layer when ``_is_nvfp4_expert_layer(prefix)``, else
``Mxfp4MoEMethod``: ``moe_quant_algo`` must be ``"NVFP4"``; an empty or absent ``ignore`` makes every expert layer
NVFP4 (the older export, whose draft is NVFP4 too); otherwise the layer's name ``layers.{i}.ffn.experts`` (or
``mtp.{i - num_hidden_layers}.ffn.experts`` for a draft layer) is matched with ``fnmatch.fnmatchcase`` against each
pattern, and a match leaves the layer MXFP4.

Each format says, per projection, the source tensors (:class:`SourcePart`) and the per-rank parameters they become
(:class:`TargetParam`: name, conversion, how tp and ep divide it, the vLLM line it comes from). Adding a format is
one record here, its fixtures, and its kernel in verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ckpt_tool.errors import CheckpointError

# config.json's quantization_config keys of an NVFP4 export (vLLM 0.33.0 / 0.34.0 models/deepseek_v41/quant_config.py
# DeepseekV4FP8Config.from_config: moe_quant_algo, and ignore kept as _modelopt_ignore)
MOE_QUANT_KEY = "quantization_config.moe_quant_algo"
IGNORE_KEY = "quantization_config.ignore"
KNOWN_MOE_QUANT_ALGOS = ("NVFP4",)


@dataclass(frozen=True)
class SourcePart:
    """One source tensor of one routed-expert projection, after ``....experts.{j}.w{1,2,3}.``."""

    suffix: str
    dtypes: tuple[str, ...]  # the dtype family, most usual first
    # the shape from the projection's (out, in): "packed" [out, in/2], "mx" [out, in/32], "nv" [out, in/16],
    # "fp8" [out, in], "fp8-blocks" [out/128, in/128] (weight_block_size), "scalar" []
    shape: str


@dataclass(frozen=True)
class TargetParam:
    """One per-rank parameter of the stacked experts: ``w13_{name}`` from w1 then w3, ``w2_{name}`` from w2."""

    name: str  # after w13_ / w2_
    source: str  # the SourcePart suffix it is made of
    convert: str  # ckpt_tool.mapping.conversions kind
    # how the ranks divide it: "rows" (tp: each expert's w13 rows / w2 columns; ep: whole experts), "experts" (one
    # value per expert and projection: tp keeps every expert's, ep the rank's own), "global-experts" (as "experts",
    # except that under ep a backend keeping every expert's activation scales holds them all on every rank)
    split: str
    vllm: str  # where vLLM creates it


@dataclass(frozen=True)
class ExpertFormat:
    """One format of routed experts: its source tensors and the per-rank parameters vLLM holds."""

    name: str
    parts: tuple[SourcePart, ...]
    params: tuple[TargetParam, ...]
    vllm_method: str  # the class vLLM builds for a layer of these experts
    description: str
    block: int  # inputs sharing one scale along a row (the TP split of the inputs must keep them whole)


MXFP4 = ExpertFormat(
    "mxfp4",
    parts=(
        SourcePart("weight", ("I8", "U8"), "packed"),
        SourcePart("scale", ("F8_E8M0", "U8"), "mx"),
    ),
    params=(
        # Mxfp4MoEMethod.create_weights (model_executor/layers/quantization/mxfp4.py): uint8 parameters
        TargetParam("weight", "weight", "raw_uint8", "rows", "mxfp4.py Mxfp4MoEMethod.create_weights: w13_weight"),
        TargetParam("weight_scale", "scale", "raw_uint8", "rows", "mxfp4.py: w13_weight_scale, uint8 E8M0"),
    ),
    vllm_method="Mxfp4MoEMethod",
    description="MXFP4: E2M1 pairs, one E8M0 scale per 32 inputs",
    block=32,
)
FP8 = ExpertFormat(
    "fp8",
    parts=(
        SourcePart("weight", ("F8_E4M3",), "fp8"),
        SourcePart("scale", ("F8_E8M0", "F32"), "fp8-blocks"),
    ),
    params=(
        TargetParam("weight", "weight", "copy", "rows", "DeepseekV4FP8Config block-FP8 MoE: w13_weight"),
        # float32 parameters: an E8M0 byte b becomes 2^(b-127) (the stock loader would store b)
        TargetParam("weight_scale_inv", "scale", "e8m0_to_f32", "rows", "block-FP8 MoE: w13_weight_scale_inv"),
    ),
    vllm_method="Fp8MoEMethod",
    description="block FP8: E4M3, one scale per 128x128 block",
    block=128,
)
NVFP4 = ExpertFormat(
    "nvfp4",
    parts=(
        SourcePart("weight", ("U8",), "packed"),
        SourcePart("weight_scale", ("F8_E4M3",), "nv"),
        SourcePart("weight_scale_2", ("F32",), "scalar"),
        SourcePart("input_scale", ("F32",), "scalar"),
    ),
    params=(
        # ModelOptNvFp4FusedMoE.create_weights (model_executor/layers/quantization/modelopt.py, 0.33.0 :912-1037,
        # 0.34.0 :944-1069): w13_weight U8 [E, 2I, H/2], w2_weight U8 [E, H, I/2]
        TargetParam("weight", "weight", "raw_uint8", "rows", "modelopt.py ModelOptNvFp4FusedMoE: w13_weight, uint8"),
        # w13_weight_scale F8_E4M3 [E, 2I, H/16], w2_weight_scale [E, H, I/16]
        TargetParam("weight_scale", "weight_scale", "copy", "rows", "modelopt.py: w13_weight_scale, float8_e4m3fn"),
        # w13_weight_scale_2 F32 [E, 2] (w1's, w3's), w2_weight_scale_2 F32 [E]
        TargetParam("weight_scale_2", "weight_scale_2", "copy", "experts", "modelopt.py: w13_weight_scale_2 [E, 2]"),
        # w13_input_scale F32 [E, 2], w2_input_scale F32 [E]; E global under ep where the NVFP4 MoE backend keeps
        # every expert's (fused_moe/oracle/nvfp4.py is_global_sf_supported_for_nvfp4_backend: FlashInfer's)
        TargetParam(
            "input_scale", "input_scale", "copy", "global-experts", "modelopt.py: w13_input_scale [E or E_global, 2]"
        ),
    ),
    vllm_method="ModelOptNvFp4FusedMoE",
    description="NVFP4: E2M1 pairs, one E4M3 scale per 16 inputs, F32 global and input scales",
    block=16,
)
EXPERT_FORMATS: dict[str, ExpertFormat] = {f.name: f for f in (MXFP4, FP8, NVFP4)}


@dataclass(frozen=True)
class MoeQuant:
    """What config.json's quantization_config says of the routed experts beyond ``expert_dtype``."""

    algo: str | None = None  # moe_quant_algo ("NVFP4"), None: DeepSeek's own formats
    ignore: tuple[str, ...] = ()  # fnmatch patterns of the layers left in DeepSeek's format


def moe_quant_of(raw: dict[str, Any]) -> MoeQuant:
    """``quantization_config``'s ``moe_quant_algo`` and ``ignore`` as vLLM reads them (vLLM 0.33.0 / 0.34.0:
    ``(moe_quant_algo or "").upper()``). Their types and values are config_keys' rules, applied before this runs:
    an algorithm ckpt-tool does not know and an ignore list that is not a list of strings are refused there."""
    quant = raw.get("quantization_config")
    if not isinstance(quant, dict) or not quant.get("moe_quant_algo"):
        return MoeQuant()
    ignore = quant.get("ignore")
    return MoeQuant(quant["moe_quant_algo"].upper(), tuple(ignore) if isinstance(ignore, list) else ())


def experts_module(prefix: str) -> str:
    """``layers.3.ffn.experts`` for the block under ``layers.3`` (``mtp.0`` likewise): the name vLLM matches."""
    return f"{prefix}.ffn.experts"


def layer_format(config, prefix: str) -> ExpertFormat:
    """The format of the routed experts of the block under ``prefix`` (``layers.L`` or ``mtp.K``) for ``config``
    (a V4Config), as vLLM decides it (module docstring)."""
    if config.expert_dtype == "fp8":
        return FP8
    quant: MoeQuant = config.moe_quant
    if quant.algo != "NVFP4":
        return MXFP4
    module = experts_module(prefix)
    if any(fnmatchcase(module, pattern) for pattern in quant.ignore):
        return MXFP4
    return NVFP4


def block_prefixes(config) -> list[str]:
    """Every block with routed experts: the main layers, then the draft's."""
    return [f"layers.{i}" for i in range(config.num_hidden_layers)] + [
        f"mtp.{i}" for i in range(config.draft_layers)
    ]


def formats_by_layer(config) -> dict[str, str]:
    """Block prefix → the name of its experts' format."""
    return {p: layer_format(config, p).name for p in block_prefixes(config)}


def formats_used(config) -> tuple[str, ...]:
    """The formats ``config``'s experts come in, main layers' first."""
    return tuple(dict.fromkeys(formats_by_layer(config).values()))


def describe_experts(config) -> dict:
    """What ``inspect`` says of the routed experts: each format with the blocks it covers and the class vLLM builds
    for them, the NVFP4 keys of quantization_config, and which blocks the ignore list leaves in DeepSeek's format."""
    by_layer = formats_by_layer(config)
    formats: dict[str, dict] = {}
    for prefix, name in by_layer.items():
        entry = formats.setdefault(name, {"vllm_method": EXPERT_FORMATS[name].vllm_method, "blocks": []})
        entry["blocks"].append(prefix)
    quant: MoeQuant = config.moe_quant
    ignored = [p for p, name in by_layer.items() if quant.algo == "NVFP4" and name != NVFP4.name]
    return {
        "formats": {name: {**e, "description": EXPERT_FORMATS[name].description} for name, e in formats.items()},
        "moe_quant_algo": quant.algo,
        "ignore": list(quant.ignore) if quant.algo else None,
        "left_by_ignore": ignored,
    }


# the source tensors that mark a projection's format: NVFP4's three scales, MXFP4's (and FP8's) block scale
_MARKERS = {f".{p.suffix}": NVFP4 for p in NVFP4.parts if p.suffix != "weight"} | {".scale": MXFP4}


def stored_formats(names) -> tuple[dict[str, dict[str, str]], dict[str, set[str]]]:
    """For the routed experts ``names`` (a checkpoint's tensor names) hold: block prefix (``layers.L`` / ``mtp.K``)
    → {format name: a tensor of it}, told apart by each projection's scale tensors; and every projection holding an
    NVFP4 scale (``layers.0.ffn.experts.5.w1``) → the NVFP4 parts it holds."""
    found: dict[str, dict[str, str]] = {}
    nvfp4_parts: dict[str, set[str]] = {}
    for name in names:
        head, sep, tail = name.partition(".ffn.experts.")
        if not sep:
            continue
        for suffix, fmt in _MARKERS.items():
            if tail.endswith(suffix):
                found.setdefault(head, {}).setdefault(fmt.name, name)
                if fmt is NVFP4:
                    nvfp4_parts.setdefault(name[: -len(suffix)], set()).add(suffix[1:])
                break
    return found, nvfp4_parts


def require_stored_formats(config, names, where: str = "config.json") -> None:
    """CheckpointError when a block's routed experts are stored in a format other than the one vLLM would build for
    them from config.json (``moe_quant_algo`` and ``ignore``, :func:`layer_format`), or in two formats at once:
    naming the block, the key that decides, the pattern that matched and a tensor of the stored format. Before any
    other check, so that the diagnosis is the config's, not a list of "missing" tensors."""
    if config.expert_dtype == "fp8":
        return
    by_block, nvfp4_parts = stored_formats(names)
    for prefix, stored in by_block.items():
        want = layer_format(config, prefix)
        module = experts_module(prefix)
        if len(stored) > 1:
            shown = ", ".join(f"{fmt.upper()} ({tensor})" for fmt, tensor in sorted(stored.items()))
            raise CheckpointError(
                f"{module}: routed experts stored in two formats ({shown}); vLLM builds one method a layer: the "
                "checkpoint is inconsistent, re-download it"
            )
        (fmt, tensor), = stored.items()
        if fmt == want.name:
            continue
        quant: MoeQuant = config.moe_quant
        if quant.algo is None:
            why = f"{MOE_QUANT_KEY} is absent, so vLLM builds {want.vllm_method} ({want.name.upper()})"
            fix = f"a config.json that names {MOE_QUANT_KEY} \"NVFP4\" (the export's own)"
        else:
            matched = next((p for p in quant.ignore if fnmatchcase(module, p)), None)
            why = (
                f"{IGNORE_KEY} pattern {matched!r} matches {module!r}, so vLLM builds {want.vllm_method} "
                f"({want.name.upper()})"
                if matched
                else f"{IGNORE_KEY} {list(quant.ignore)} matches no {module!r}, so vLLM builds {want.vllm_method} "
                f"({want.name.upper()})"
            )
            fix = f"an {IGNORE_KEY} that {'leaves' if fmt == MXFP4.name else 'does not leave'} {module!r} out"
        raise CheckpointError(
            f"{where}: {why}, but {tensor!r} is {fmt.upper()}: the experts' format is ambiguous; use the model's "
            f"released config.json ({fix})"
        )
    _require_nvfp4_parts(nvfp4_parts)


def _require_nvfp4_parts(nvfp4_parts: dict[str, set[str]]) -> None:
    """Every NVFP4 projection holds its block scale, its global scale and its input scale."""
    want = {p.suffix for p in NVFP4.parts if p.suffix != "weight"}
    for stem in sorted(nvfp4_parts):
        missing = sorted(want - nvfp4_parts[stem])
        if missing:
            what = {"weight_scale": "E4M3 block scales", "weight_scale_2": "float32 global scale",
                    "input_scale": "float32 activation scale"}  # fmt: skip
            named = ", ".join(f"{stem}.{m} ({what[m]})" for m in missing)
            raise CheckpointError(
                f"NVFP4 routed expert {stem} lacks {named}: vLLM's ModelOptNvFp4FusedMoE loads one for every "
                "projection; the shard that holds it is incomplete: download it again, or use a checkpoint that has it"
            )


def require_nvfp4_grid(tensors: dict) -> None:
    """Every NVFP4 block scale (``.weight_scale`` beside a U8 ``.weight``) holds one E4M3 scale per 16 inputs of its
    weight's row, as ModelOptNvFp4FusedMoE (group_size 16) loads it; ``tensors``: name → TensorInfo."""
    for name, info in tensors.items():
        if ".ffn.experts." not in name or not name.endswith(".weight_scale"):
            continue
        weight = tensors.get(name[: -len("_scale")])
        if weight is None or weight.dtype != "U8" or len(weight.shape) != 2 or len(info.shape) != 2:
            continue  # the shapes' own check names what is wrong with them
        inputs = weight.shape[1] * 2
        if info.shape[0] != weight.shape[0] or info.shape[1] * NVFP4.block != inputs:
            per = inputs / info.shape[1] if info.shape[1] else float("inf")
            raise CheckpointError(
                f"{info.file}: tensor {name!r}: {list(info.shape)} scales for a weight of {weight.shape[0]} rows of "
                f"{inputs} inputs, one scale per {per:g} inputs; NVFP4 takes one E4M3 scale per {NVFP4.block} "
                f"inputs ([{weight.shape[0]}, {inputs // NVFP4.block}]): the tensor is not an NVFP4 block scale, "
                "re-download the shard or use the export as released"
            )
