"""Per rank, the segments of one rule instance: which rows and columns of which sources (and which zero fills)
make the rank's output tensor, for every kind of split (replicated, by rows, by columns, fused sections, repeated
scale rows, Engram hash heads, engine padding, routed experts under tp or ep)."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import engram_split
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.grouping import SourceGroup
from ckpt_tool.mapping.plan import ZERO, Bounds, Options, Segment, Segments
from ckpt_tool.mapping.rules import Rule, Split
from ckpt_tool.mapping.splits import check_experts, check_mxfp4_rows, check_piece, engine_pad, rows_cols

# per rank: output shape, segments, the first source read (for ordering), elements of zero padding
RankTensor = tuple[tuple[int, ...], Sequence[Segment], str, int]


def _bounds(info: TensorInfo, split_dim: int | None, tp: int, rank: int) -> Bounds:
    rows, cols = rows_cols(info)
    if split_dim is None or tp == 1:
        return 0, rows, 0, cols
    if split_dim == 0:
        step = rows // tp
        return rank * step, (rank + 1) * step, 0, cols
    step = cols // tp
    return 0, rows, rank * step, (rank + 1) * step


def plan_group(
    g: SourceGroup,
    cfg: V4Config,
    opts: Options,
    sources: dict[str, TensorInfo],
    srcs: tuple[str, ...],
    uniform_stacks: dict,
    padded: set[tuple[int, int]],
) -> list[RankTensor]:
    """Per rank: output shape, segments, the first source read (for ordering) and the elements of zero
    padding of one rule instance.

    ``padded`` collects (size, per-rank size) of every weight split the engine zero-pads (for the plan's note).
    """
    rule, tp = g.rule, opts.tp
    if rule.split == Split.ENGRAM:
        return _plan_engram(g, cfg, tp)
    if rule.kind in ("rename", "fuse") and rule.repeat > 1:
        infos = [g.parts[k] for k in sorted(g.parts, key=lambda k: (k[1] or 0, k[0]))]
        split_dim = {Split.REPLICATE: None, Split.DIM0: 0, Split.DIM1: 1}[rule.split]
        return _plan_repeated(infos, split_dim, tp, conv_of(infos[0], rule), rule.repeat)
    if rule.kind in ("rename", "fuse"):
        return _plan_linear(g, cfg, tp, sources, padded)
    return _plan_stack(g, cfg, opts, sources, srcs, uniform_stacks)


def _plan_stack(
    g: SourceGroup,
    cfg: V4Config,
    opts: Options,
    sources: dict[str, TensorInfo],
    srcs: tuple[str, ...],
    uniform_stacks: dict,
) -> list[RankTensor]:
    """Per rank of StackExperts: [E_local, rows, cols]; every expert's parts share one shape (checked), so one
    period (routed experts are never padded: a split that does not divide at block granularity is refused)."""
    rule, tp = g.rule, opts.tp
    E = getattr(cfg, rule.experts_key)
    conv = conversions.effective(g.parts[(0, 0)].dtype, rule.convert)
    nsrc = len(rule.sources)
    # under ep a rank holds its own experts, unless the NVFP4 MoE backend keeps every expert's input scales
    local_experts = opts.moe_parallel == "ep" and not (rule.global_experts and opts.nvfp4_input_scales == "global")
    if opts.moe_parallel == "ep":
        if E % tp:
            raise PlanError(
                f"n_routed_experts={E} does not split over tp={tp} with --moe-parallel ep; choose a tp that divides it"
            )
        split_dim = None
    else:
        split_dim = rule.expert_split_dim
        check_experts(g, E, split_dim, tp, sources, uniform_stacks)
        if split_dim is not None:
            check_mxfp4_rows(cfg, tp, g.parts[(0, 0)])
    period = [g.parts[(idx, 0)] for idx in range(nsrc)]
    scalars = all(not i.shape for i in period)  # one value per expert and projection: [E, parts] (w2's: [E])
    out = []
    for rank in range(tp):
        bounds = tuple(_bounds(i, split_dim, tp, rank) for i in period)
        if local_experts:
            step = E // tp
            names = srcs[rank * step * nsrc : (rank + 1) * step * nsrc]
            n_local = step
        else:
            names, n_local = srcs, E
        rows = sum(b[1] - b[0] for b in bounds)
        if scalars:
            shape: tuple[int, ...] = (n_local, nsrc) if nsrc > 1 else (n_local,)
        else:
            shape = (n_local, rows, bounds[0][3] - bounds[0][2])
        out.append((shape, Segments(names, bounds, conv), names[0], 0))
    return out


def _plan_linear(
    g: SourceGroup, cfg: V4Config, tp: int, sources: dict[str, TensorInfo], padded: set[tuple[int, int]]
) -> list[RankTensor]:
    """Per rank of a rename or fuse: replicated, or split by rows or columns (fused sections, engine padding)."""
    rule = g.rule
    split_dim = {Split.REPLICATE: None, Split.DIM0: 0, Split.DIM1: 1}[rule.split]
    if rule.replicate_unless and getattr(cfg, rule.replicate_unless) % tp:
        split_dim = None  # the engine holds this tensor whole on every rank at this tp
    infos = [g.parts[k] for k in sorted(g.parts, key=lambda k: (k[1] or 0, k[0]))]
    if rule.sections > 1 and split_dim == 0 and tp > 1:
        return _plan_sections(infos[0], rule.sections, tp, conv_of(infos[0], rule))
    first = infos[0]
    conv = conversions.effective(first.dtype, rule.convert)
    if rule.pad and split_dim is not None and tp > 1:
        pads = [engine_pad(info, split_dim, tp, sources) for info in infos]
        if any(pads):
            return _plan_padded(infos, pads, split_dim, tp, conv, sources, padded)
    for info in infos:
        check_piece(info, split_dim, tp, sources, cfg.weight_block_size[split_dim or 0])
    names = tuple(i.name for i in infos)
    tail = list(first.shape[1:])
    if split_dim == 1:
        tail[0] //= tp
    if split_dim is None or tp == 1:  # every rank reads the same: one Segments for all
        bounds = tuple(_bounds(i, None, 1, 0) for i in infos)
        rows = sum(b[1] for b in bounds)
        return [((rows, *tail) if first.shape else (), Segments(names, bounds, conv), names[0], 0)] * tp
    out = []
    sizes = list(map(rows_cols, infos))
    for rank in range(tp):
        if split_dim == 0:
            bounds = tuple((rank * (r // tp), (rank + 1) * (r // tp), 0, c) for r, c in sizes)
        else:
            bounds = tuple((0, r, rank * (c // tp), (rank + 1) * (c // tp)) for r, c in sizes)
        rows = sum(b[1] - b[0] for b in bounds)
        out.append(((rows, *tail) if first.shape else (), Segments(names, bounds, conv), names[0], 0))
    return out


def _plan_repeated(infos: list[TensorInfo], split_dim: int | None, tp: int, conv: str, repeat: int) -> list[RankTensor]:
    """Per rank of a scale whose rows the engine repeats ``repeat`` times before its TP split (an MXFP8 scale:
    vLLM's KMxfp8Static loader, vllm/model_executor/layers/quantization/modelopt.py, repeat_interleaves the
    checkpoint's [out/32, in/32] to [out, in/32]); each fused part is expanded on its own, as the engine loads
    each shard of a merged linear separately."""
    out = []
    for rank in range(tp):
        segs: list[Segment] = []
        rows = width = 0
        for info in infos:
            R, C = rows_cols(info)
            if split_dim == 0 and tp > 1:
                if (R * repeat) % tp:
                    raise PlanError(
                        f"{info.file}: tensor {info.name!r}: {R * repeat} expanded scale rows do not split over "
                        f"tp={tp}; choose a tp that divides them"
                    )
                per = R * repeat // tp  # a rank may start or end inside one scale row's copies
                segs += _repeated_rows(info.name, rank * per, (rank + 1) * per, C, conv, repeat)
                rows, width = rows + per, C
            elif split_dim == 1 and tp > 1:
                if C % tp:
                    raise PlanError(
                        f"{info.file}: tensor {info.name!r}: {C} scale columns do not split evenly over tp={tp}; "
                        "choose a tp that divides them"
                    )
                step = C // tp
                segs.append(Segment(info.name, 0, R, rank * step, (rank + 1) * step, conv, repeat=repeat))
                rows, width = rows + R * repeat, step
            else:
                segs.append(Segment(info.name, 0, R, 0, C, conv, repeat=repeat))
                rows, width = rows + R * repeat, C
        out.append(((rows, width), tuple(segs), infos[0].name, 0))
    return out


def _repeated_rows(name: str, lo: int, hi: int, cols: int, conv: str, repeat: int) -> list[Segment]:
    """Expanded rows [lo, hi) of a source whose rows each appear ``repeat`` times: at most a partial first row, a run
    of whole ones and a partial last row."""
    segs, row = [], lo // repeat
    if lo % repeat:
        k = min(repeat - lo % repeat, hi - lo)
        segs.append(Segment(name, row, row + 1, 0, cols, conv, repeat=k))
        lo, row = lo + k, row + 1
    whole = (hi - lo) // repeat
    if whole:
        segs.append(Segment(name, row, row + whole, 0, cols, conv, repeat=repeat))
        lo, row = lo + whole * repeat, row + whole
    if hi > lo:
        segs.append(Segment(name, row, row + 1, 0, cols, conv, repeat=hi - lo))
    return segs


def _plan_engram(g: SourceGroup, cfg: V4Config, tp: int) -> list[RankTensor]:
    """Per rank of an Engram table (or its scale): the rows of the rank's hash heads, uneven across ranks
    (:mod:`ckpt_tool.checkpoint.engram`), read in one run of whole rows."""
    split = engram_split(cfg)
    assert split is not None and "layer" in g.bind, g.rule.id
    split.require(tp)
    (info,) = [g.parts[k] for k in g.parts]
    rows, cols = rows_cols(info)
    want = split.num_embeddings[split.layer_ids.index(g.bind["layer"])]
    if rows != want:
        raise PlanError(
            f"{info.file}: tensor {info.name!r} has {rows} rows, config.json engram_num_embeddings says {want}; "
            "use the config.json released with these weights"
        )
    conv = conv_of(info, g.rule)
    out = []
    for lo, hi in split.rank_rows(g.bind["layer"], tp):
        out.append(((hi - lo, *info.shape[1:]), (Segment(info.name, lo, hi, 0, cols, conv),), info.name, 0))
    return out


def conv_of(info: TensorInfo, rule: Rule) -> str:
    return conversions.effective(info.dtype, rule.convert)


def _plan_sections(info: TensorInfo, sections: int, tp: int, conv: str) -> list[RankTensor]:
    """Per rank of one tensor fused on disk from ``sections`` equal row blocks: rank r holds chunk r of every
    section, in section order (see Rule.sections)."""
    rows, cols = rows_cols(info)
    if rows % (sections * tp):
        raise PlanError(
            f"{info.file}: tensor {info.name!r}: {rows} rows are not {sections} sections that split evenly over "
            f"tp={tp}; choose a tp that divides {rows // sections if rows % sections == 0 else rows}"
        )
    sec, step = rows // sections, rows // sections // tp
    names = (info.name,) * sections
    out = []
    for rank in range(tp):
        bounds = tuple((k * sec + rank * step, k * sec + (rank + 1) * step, 0, cols) for k in range(sections))
        shape = (sections * step, *info.shape[1:])
        out.append((shape, Segments(names, bounds, conv), info.name, 0))
    return out


def _plan_padded(
    infos: list[TensorInfo],
    pads: list[tuple[int, int] | None],
    split_dim: int,
    tp: int,
    conv: str,
    sources: dict[str, TensorInfo],
    padded: set[tuple[int, int]],
) -> list[RankTensor]:
    """Per rank of a rename/fuse whose split the engine zero-pads (see :func:`engine_pad`): a padded part
    gives each rank ``per_rank`` rows (dim 0) or columns (dim 1), its share of the source first, then
    zeros; a rank past the source's end holds zeros only. Parts that need no pad split evenly as usual.
    """
    for info, pad in zip(infos, pads):
        if pad is None:
            check_piece(info, split_dim, tp, sources)
        elif info.name.endswith(".weight"):
            padded.add(pad)
    out = []
    for rank in range(tp):
        segs: list[Segment] = []
        rows = width = 0
        for info, pad in zip(infos, pads):
            if pad is None:
                r0, r1, c0, c1 = _bounds(info, split_dim, tp, rank)
                segs.append(Segment(info.name, r0, r1, c0, c1, conv))
                part_rows, part_width = r1 - r0, c1 - c0
            else:
                src_rows, src_cols = rows_cols(info)
                size, per_rank = pad
                lo = min(rank * per_rank, size)
                hi = min(lo + per_rank, size)
                if split_dim == 0:
                    if hi > lo:
                        segs.append(Segment(info.name, lo, hi, 0, src_cols, conv))
                    if per_rank > hi - lo:
                        segs.append(Segment(ZERO, 0, per_rank - (hi - lo), 0, src_cols, conv))
                    part_rows, part_width = per_rank, src_cols
                else:
                    if hi > lo:
                        segs.append(Segment(info.name, 0, src_rows, lo, hi, conv, per_rank - (hi - lo)))
                    else:
                        segs.append(Segment(ZERO, 0, src_rows, 0, per_rank, conv))
                    part_rows, part_width = src_rows, per_rank
            rows += part_rows
            width = width or part_width
        tail = list(infos[0].shape[1:])
        if split_dim == 1:
            tail[0] = width
        out.append(((rows, *tail), tuple(segs), infos[0].name, sum(s.zeros for s in segs)))
    return out
