"""What a TP split of a source tensor requires: it divides evenly, each rank holds whole quantization blocks (the
scale sibling splits with its weight), MXFP4 expert rows align, or, where the engine zero-pads a split to whole
blocks per rank, the sizes of that padding."""

from __future__ import annotations

import math

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, cdiv
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expert_format import MXFP4, layer_format
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.grouping import DTYPE_SHAPE, SourceGroup


def rows_cols(t: TensorInfo) -> tuple[int, int]:
    if not t.shape:
        return 1, 1
    return t.shape[0], math.prod(t.shape[1:]) if len(t.shape) > 1 else 1


def _check_split(
    name: str, info: TensorInfo, dim: int, tp: int, sibling: TensorInfo | None, fp8_block: int = FP8_BLOCK
) -> None:
    """TP split of ``dim`` must divide evenly and, for quantized weights, at block granularity (``fp8_block``:
    config.json's weight_block_size, 128 for V4's block FP8, 32 for V4.1's MXFP8)."""
    size = info.shape[dim] if dim < len(info.shape) else 1
    if size % tp:
        raise PlanError(
            f"{info.file}: tensor {name!r}: dim {dim} of size {size} does not split evenly over tp={tp}; "
            "choose a tp that divides it"
        )
    if sibling is None or tp == 1:
        return
    weight, scale = (info, sibling) if name.endswith(".weight") else (sibling, info)
    wdim = weight.shape[dim]
    sdim = scale.shape[dim] if dim < len(scale.shape) else 1
    if sdim % tp:
        raise PlanError(
            f"{scale.file}: tensor {scale.name!r}: {sdim} scale blocks on dim {dim} do not split evenly over tp={tp} "
            "(each rank must hold whole quantization blocks); choose a smaller tp"
        )
    if weight.dtype in ("I8", "U8"):  # packed MXFP4 / NVFP4: 2 values per byte along the input dim
        logical = wdim * 2 if dim == 1 else wdim
        # inputs a scale covers: 32 (MXFP4) or 16 (NVFP4), as the whole tensors' shapes (checked before) say
        block = (weight.shape[1] * 2) // (scale.shape[1] or 1) if dim == 1 else 1
    else:
        logical, block = wdim, fp8_block
    if (logical // tp) != (sdim // tp) * block:
        raise PlanError(
            f"{weight.file}: tensor {weight.name!r}: a tp={tp} chunk of dim {dim} holds {logical // tp} values, "
            f"not a whole number of {block}-wide scale blocks; choose a tp that splits at block granularity"
        )


def _check_mx_split(info: TensorInfo, dim: int, tp: int, sibling: TensorInfo, block: int) -> None:
    """An MXFP8 linear's split: vLLM expands the scale to one row a weight row before slicing, so rows split anywhere
    that divides them; its input dim must leave each rank whole 32-wide blocks (KMxfp8Static.create_weights,
    vllm/model_executor/layers/quantization/modelopt.py: "MXFP8 requires input size divisible by 32")."""
    weight = info if info.name.endswith(".weight") else sibling
    size = weight.shape[dim] if dim < len(weight.shape) else 1
    if size % tp or (dim == 1 and (size // tp) % block):
        raise PlanError(
            f"{weight.file}: tensor {weight.name!r}: dim {dim} of size {size} does not split over tp={tp}"
            + (f" into whole {block}-wide MXFP8 blocks" if dim == 1 else "")
            + "; choose a tp that divides it"
        )


def sibling_name(name: str) -> str | None:
    if name.endswith(".weight"):
        return name[: -len(".weight")] + ".scale"
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".weight"
    if name.endswith(NVFP4_SCALE):
        return name[: -len(NVFP4_SCALE)] + ".weight"
    return None


NVFP4_SCALE = ".weight_scale"  # an NVFP4 expert's block scale, sibling of its .weight


def _sibling(sources: dict[str, TensorInfo], name: str) -> TensorInfo | None:
    other = sibling_name(name)
    if other is None:
        return None
    found = sources.get(other)
    if found is None and name.endswith(".weight"):  # an NVFP4 expert's weight: its scale is .weight_scale
        found = sources.get(name[: -len(".weight")] + NVFP4_SCALE)
    return found


def check_piece(
    info: TensorInfo, split_dim: int | None, tp: int, sources: dict[str, TensorInfo], fp8_block: int = FP8_BLOCK
) -> None:
    """What splitting ``info`` on ``split_dim`` over ``tp`` ranks requires (the same for every rank)."""
    if split_dim is None or tp == 1:
        return
    sibling = _sibling(sources, info.name)
    if sibling is not None and fp8_block != FP8_BLOCK:
        _check_mx_split(info, split_dim, tp, sibling, fp8_block)
        return
    _check_split(info.name, info, split_dim, tp, sibling, fp8_block)
    if split_dim == 1 and len(info.shape) != 2:
        raise PlanError(
            f"{info.file}: tensor {info.name!r}: column split needs a 2-D tensor, got shape {list(info.shape)}"
        )


def engine_pad(info: TensorInfo, dim: int, tp: int, sources: dict[str, TensorInfo]) -> tuple[int, int] | None:
    """(size, per-rank size) of dim ``dim`` of ``info`` when the engine zero-pads its TP split, else None.

    A block-FP8 weight (or its scale) whose whole 128-blocks on ``dim`` do not divide tp: vLLM's
    DeepseekV4MLP gives every rank cdiv(blocks, tp) blocks and zero-pads the checkpoint tensor to that
    before the even split (sizes in elements for the weight, in blocks for the scale). Anything else,
    a split that divides or one that is not whole blocks at all, is checked as usual (None).
    """
    sib = _sibling(sources, info.name)
    if sib is None:
        return None
    weight, scale = (info, sib) if info.name.endswith(".weight") else (sib, info)
    if weight.dtype in ("I8", "U8") or len(weight.shape) != 2 or len(scale.shape) != 2:
        return None
    size, blocks = weight.shape[dim], scale.shape[dim]
    if size % FP8_BLOCK or blocks != size // FP8_BLOCK or blocks % tp == 0:
        return None
    per_rank = cdiv(blocks, tp)
    return (size, per_rank * FP8_BLOCK) if info is weight else (blocks, per_rank)


def check_experts(
    g: SourceGroup, experts: int, split_dim: int | None, tp: int, sources: dict[str, TensorInfo], uniform_stacks: dict
) -> None:
    """Split checks of every expert's parts, in the order the parts are written.

    Experts of one stack share their shape (checked before); so do their scale/weight siblings in a
    regular checkpoint, and then expert 0 speaks for all. Otherwise every expert is checked, so the
    first offender is the one named.
    """
    if split_dim is None or tp == 1:
        return
    nsrc = len(g.rule.sources)
    if g.names is not None:
        bind = tuple(sorted(g.bind.items()))
        uniform = True
        for pattern, names in zip(g.rule.sources, g.names):
            sib = sibling_name(pattern)
            if sib is None or (sib, bind) in uniform_stacks:
                continue
            sibs = {None if s is None else DTYPE_SHAPE(s) for s in map(sources.get, map(sibling_name, names))}
            uniform = uniform and len(sibs) == 1
        if uniform:
            for idx in range(nsrc):
                check_piece(g.parts[(idx, 0)], split_dim, tp, sources)
            return
    for e in range(experts):
        for idx in range(nsrc):
            check_piece(g.parts[(idx, e)], split_dim, tp, sources)


MXFP4_ROW_ALIGN = 128  # vLLM's MXFP4 MoE backends (Marlin, DeepGEMM, CUTLASS, TRTLLM, ...) pad a rank's rows to this


def check_mxfp4_rows(cfg: V4Config, tp: int, first: TensorInfo) -> None:
    """Routed MXFP4 experts split by tp must leave each rank a multiple of 128 intermediate rows (``first``: a source
    tensor of the experts' stack, whose layer's format decides)."""
    rows = cfg.moe_intermediate_size // tp
    if tp == 1 or rows % MXFP4_ROW_ALIGN == 0 or cfg.expert_dtype != "fp4":
        return
    if layer_format(cfg, first.name.split(".ffn.experts.", 1)[0]) is not MXFP4:
        return
    raise PlanError(
        f"routed experts: moe_intermediate_size={cfg.moe_intermediate_size} over tp={tp} leaves {rows} rows a "
        "rank, "
        "not a multiple of 128; most of vLLM's MXFP4 MoE backends round that up at load, a layout that depends on "
        "the backend and that no sharded checkpoint can match: convert with --moe-parallel ep (serve with "
        "--enable-expert-parallel), or choose a tp that leaves a multiple of 128 rows"
    )


def pad_note(size: int, per_rank: int, tp: int) -> str:
    """The plan's note on one shared-expert size the engine zero-pads over ``tp`` ranks."""
    first = size // per_rank  # the first rank holding zeros
    ranks = f"rank {first}" if first == tp - 1 else f"ranks {first}-{tp - 1}"
    return (
        f"shared experts: intermediate {size} = {size // FP8_BLOCK} blocks of {FP8_BLOCK}, which tp={tp} does not "
        "divide; "
        f"each rank holds {per_rank // FP8_BLOCK} block(s), the {(per_rank * tp - size) // FP8_BLOCK} past the end "
        f"zero-filled as the engine pads them (on {ranks})"
    )
