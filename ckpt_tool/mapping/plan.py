"""Planning a conversion from headers alone: which bytes of which source tensors form every output tensor.

Everything that can be checked without reading tensor bytes is checked here, before any output is
written: shapes and dtypes that agree with what config.json implies (:mod:`ckpt_tool.checkpoint.completeness`),
every source tensor matched by exactly one rule (unknown names are an error listing them),
fused parts that agree, complete expert sets, TP splits that divide at block granularity (or, where the
profile's engine zero-pads a split to whole blocks per rank, the padded layout), and every MTP layer
present. The result is a :class:`Plan`: per output file, per tensor, the :class:`Segment` byte gathers
(and zero fills) the writer executes.

Planning is on the interactive path (``--dry-run``, every convert and verify), so it does per-tensor
work only where it must: source names are looked up in a table of the names the config implies
(every rule instance expanded, experts by string concatenation) instead of trying rule regexes per
tensor (the regexes still match whatever the table does not hold: extra layers, strays, unknowns);
checks run once per rule instance and per expert only when experts differ; and an output tensor's
segments are computed on demand (:class:`Segments`): all experts of a stack share one period of
row/column bounds, and a V4 plan at tp 8 would otherwise hold half a million Segment objects.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import chain
from operator import attrgetter

from ckpt_tool.checkpoint.blocks import FP8_BLOCK, MX_BLOCK, cdiv
from ckpt_tool.checkpoint.completeness import count_by_index, require_agreement, require_complete
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.engram import engram_layout
from ckpt_tool.checkpoint.headers import TensorInfo, gc_paused
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.profiles import DEFAULT_PROFILE, MTP, PROFILES, canonical_name, draft_kind_of, model_class_of
from ckpt_tool.mapping.rules import MATERIALIZE, Rule, Split, indexable

GiB = 1024**3
_MTP_RE = re.compile(r"^mtp\.(0|[1-9][0-9]*)\.")
DSPARK_ALIAS_NOTE = (
    "dspark: model.embed_tokens.weight and lm_head.weight hold the target's embed/head shards (vLLM replaces the "
    "draft's with the target's after loading, but its sharded loader wants the keys)"
)
DSPARK_CONTEXT_NOTE = (
    "dspark: model.context_wkv_proj holds every stage's attn.wkv a second time, as vLLM's DSpark loader duplicates it"
)
NO_MTP_NOTE = (
    "the checkpoint has no MTP layers: converted the target model only; speculative decoding needs the MTP draft "
    "from a checkpoint that includes it (convert that one with --only mtp)"
)


@dataclass(frozen=True)
class Options:
    """Conversion options that change the output bytes (they are part of the resume fingerprint)."""

    tp: int = 1
    moe_parallel: str = "tp"  # tp | ep
    only: str | None = None  # None | "model" | "mtp" (the draft, whichever kind: its source tensors are mtp.*)
    max_shard_size: int = 5 * GiB
    profile: str = DEFAULT_PROFILE
    # the vLLM release (or series) OUT is served with (None: the newest the profile covers); it changes the bytes only
    # where the series a profile covers build the draft differently, and a plan keeps it only there, as the series
    vllm_series: str | None = None

    def __post_init__(self) -> None:
        # a profile's earlier name (an alias) means the profile: manifests and plans record the current name
        object.__setattr__(self, "profile", canonical_name(self.profile))

    def as_dict(self) -> dict:
        doc = {
            "tp": self.tp,
            "moe_parallel": self.moe_parallel,
            "only": self.only,
            "max_shard_size": self.max_shard_size,
            "profile": self.profile,
        }
        return doc if self.vllm_series is None else {**doc, "vllm_series": self.vllm_series}


def selects(only: str | None, component: str) -> bool:
    """Whether ``--only only`` converts ``component`` (an OUT folder): ``mtp`` selects the draft of either kind."""
    if only is None:
        return True
    return component == "model" if only == "model" else component != "model"


ZERO = "<zero>"  # Segment.src of a zero fill (no source tensor can have this name: it matches no rule)


@dataclass(frozen=True)
class Segment:
    """Rows [row0, row1) x columns [col0, col1) of a source tensor seen as 2-D [shape[0], prod(shape[1:])],
    each row followed by ``pad`` zeros; or, when ``src`` is :data:`ZERO`, (row1 - row0) x (col1 - col0) zeros.

    Zeros are the engine's padding of a split that does not divide at block granularity: zero source
    elements through ``convert`` (:func:`conversions.zero_element`), in the output tensor's dtype.
    """

    src: str  # source tensor name (a materialized alias resolves through Plan.sources), or ZERO
    row0: int
    row1: int
    col0: int
    col1: int
    convert: str = "copy"  # a conversions.KINDS entry
    pad: int = 0  # zero elements after each row's columns (a rank partly past the end of a padded column split)
    repeat: int = 1  # each source row written this many times in a row (MXFP8 scales expanded to one row a weight row)

    @property
    def kind(self) -> str:
        """``zero`` (a zero fill) or ``source`` (bytes of a source tensor, maybe with zeros after each row)."""
        return "zero" if self.src == ZERO else "source"

    @property
    def width(self) -> int:
        """Output elements per row."""
        return self.col1 - self.col0 + self.pad

    @property
    def rows(self) -> int:
        """Output rows."""
        return (self.row1 - self.row0) * self.repeat

    @property
    def numel(self) -> int:
        return self.rows * self.width

    @property
    def zeros(self) -> int:
        """Output elements that are zero fill."""
        return self.numel if self.src == ZERO else self.rows * self.pad


Bounds = tuple[int, int, int, int]  # row0, row1, col0, col1


class Segments(Sequence[Segment]):
    """The segments of one output tensor, made on demand: segment ``k`` gathers ``bounds[k % len(bounds)]``
    of source ``names[k]``.

    The experts of a stack all have one shape, so their segments differ only in the source name: a
    stacked tensor keeps its names and one period of bounds (one per fused part), and a Segment exists
    only while a consumer holds it. Indexes, iterates, compares and hashes like the tuple of its segments.
    """

    __slots__ = ("names", "bounds", "convert", "repeat")

    def __init__(self, names: tuple[str, ...], bounds: tuple[Bounds, ...], convert: str, repeat: int = 1) -> None:
        assert bounds and len(names) % len(bounds) == 0, (len(names), len(bounds))
        self.names = names
        self.bounds = bounds
        self.convert = convert
        self.repeat = repeat

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return tuple(self[i] for i in range(*k.indices(len(self.names))))
        name = self.names[k]  # IndexError / TypeError as a tuple gives them
        r0, r1, c0, c1 = self.bounds[k % len(self.bounds)]  # k % n is the same period for negative k
        return Segment(name, r0, r1, c0, c1, self.convert, repeat=self.repeat)

    def __iter__(self) -> Iterator[Segment]:
        bounds, period, conv, rep = self.bounds, len(self.bounds), self.convert, self.repeat
        for k, name in enumerate(self.names):
            r0, r1, c0, c1 = bounds[k % period]
            yield Segment(name, r0, r1, c0, c1, conv, repeat=rep)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Segments) and (self.names, self.bounds, self.convert, self.repeat) == (
            other.names,
            other.bounds,
            other.convert,
            other.repeat,
        ):
            return True
        if isinstance(other, (Segments, tuple, list)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Segments({list(self)!r})"


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: Sequence[Segment]  # a Segments (computed on demand) or a tuple
    rule: str
    sources: tuple[str, ...]  # the source tensors this rank's tensor is built from (under ep: its own experts')
    padding: int = 0  # elements of the engine's zero padding among the segments (see Segment.zeros)

    # asked for by packing, file sizes, totals and the JSON: ~70k times in a V4-Pro plan, ~35k of them the first
    # time for their tensor; computing it each time costs a quarter of what functools.cached_property's first
    # access does (it takes a lock until Python 3.12), and its later ones save little
    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


_NEW = object.__new__


def _out_tensor(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    segments: Sequence[Segment],
    rule: str,
    sources: tuple[str, ...],
    padding: int,
) -> OutTensor:
    """``OutTensor(...)``, the same object, at a third of the cost: a frozen dataclass's ``__init__`` sets each field
    through ``object.__setattr__``, and a V4 plan makes 12k-35k of them (nothing in OutTensor runs at init)."""
    t = _NEW(OutTensor)
    d = t.__dict__
    d["name"], d["dtype"], d["shape"], d["segments"] = name, dtype, shape, segments
    d["rule"], d["sources"], d["padding"] = rule, sources, padding
    return t


assert tuple(OutTensor.__dataclass_fields__) == ("name", "dtype", "shape", "segments", "rule", "sources", "padding")


@dataclass(frozen=True)
class OutFile:
    component: str  # model | mtp | dspark: the folder of OUT
    rank: int
    part: int
    tensors: tuple[OutTensor, ...]

    @property
    def name(self) -> str:
        return f"model-rank-{self.rank}-part-{self.part}.safetensors"

    @property
    def relpath(self) -> str:
        return f"{self.component}/{self.name}"

    @cached_property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Plan:
    options: Options
    config: V4Config
    sources: dict[str, TensorInfo]  # every name a Segment may refer to (materialized aliases included)
    files: tuple[OutFile, ...]
    dropped: dict[str, str]  # source name -> why
    materialized: dict[str, str]  # alias name -> real source tensor
    deviations: tuple[str, ...]
    unused_by_selection: tuple[str, ...] = field(default=())  # consumed by a component --only skipped
    notes: tuple[str, ...] = field(default=())  # what the user should know that is not a deviation

    @property
    def total_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    @property
    def tensor_count(self) -> int:
        return sum(len(f.tensors) for f in self.files)


# ---------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """Sources bound to one rule instance (fixed layer/mtp), before splitting."""

    rule: Rule
    bind: dict[str, int]
    parts: dict[tuple[int, int | None], TensorInfo] = field(default_factory=dict)  # (source idx, expert) -> info
    first: int = 0  # position of its first source in the checkpoint's order: groups are planned in that order
    # names[idx][j] / infos[idx][j]: source idx of expert j (one name for non-stack rules), when the parts
    # are exactly the names the config implies (built from the name table, nothing added); else None
    names: list[list[str]] | None = None
    infos: list[list[TensorInfo]] | None = None
    kinds: list[set[tuple[str, tuple[int, ...]]]] | None = None  # per source idx: its (dtype, shape)s


_DTYPE_SHAPE = attrgetter("dtype", "shape")


def _match(rules: list[Rule], name: str) -> tuple[Rule, int, dict[str, int]] | None:
    mtp = _MTP_RE.match(name)
    for rule in rules:
        if rule.when_mtp and mtp:
            first = mtp.group(1) == "0"
            if (rule.when_mtp == "first") != first:
                continue
        for idx, rx in enumerate(rule.regexes):
            m = rx.match(name)
            if m:
                return rule, idx, {k: int(v) for k, v in m.groupdict().items()}
    return None


def _binds(rule: Rule, cfg: V4Config) -> list[dict[str, int]]:
    """Every layer/mtp binding of ``rule`` the config implies (``{expert}`` is expanded by the caller)."""
    text = "".join(rule.sources)
    binds: list[dict[str, int]] = [{}]
    if "{layer}" in text:
        binds = [{**b, "layer": i} for b in binds for i in range(cfg.num_hidden_layers)]
    if "{vblock}" in text:
        binds = [{**b, "vblock": i} for b in binds for i in range(cfg.vision_n_layers)]
    if "{mtp}" in text:
        mtps = range(cfg.draft_layers)
        if rule.when_mtp == "first":
            mtps = range(min(1, cfg.draft_layers))
        elif rule.when_mtp == "rest":
            mtps = range(1, cfg.draft_layers)
        binds = [{**b, "mtp": i} for b in binds for i in mtps]
    return binds


def _expand(pattern: str, bind: dict[str, int], experts: range) -> list[str]:
    if "{expert}" not in pattern:
        return [pattern.format(**bind)]
    pre, post = pattern.format(**bind, expert="\0").split("\0")
    return [f"{pre}{j}{post}" for j in experts]


def _group_sources(
    rules: list[Rule], sources: dict[str, TensorInfo], cfg: V4Config
) -> tuple[list[_Group], dict[str, str], list[str]]:
    """Bind every source to its rule instance: (groups in order of their first source, dropped, unknown).

    The result is what matching every name against the rules in table order gives: the names the
    config implies come from the expanded table (a name matches at most one rule there, see
    :func:`rules.indexable`), the rest from the regexes.
    """
    pos = {name: i for i, name in enumerate(sources)}
    groups: dict[tuple[str, tuple], _Group] = {}
    dropped: list[tuple[int, str, str]] = []
    found: list[list[str]] = []
    claimed = 0
    if indexable(rules):
        get = sources.get
        expert_keys: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for rule in rules:
            experts = range(getattr(cfg, rule.experts_key) or 0)
            for bind in _binds(rule, cfg):
                per_idx = [_expand(p, bind, experts) for p in rule.sources]
                if rule.kind == "drop":
                    hits = [n for n in per_idx[0] if n in pos]
                    dropped += [(pos[n], n, rule.note) for n in hits]
                    found.append(hits)
                    claimed += len(hits)
                    continue
                parts: dict[tuple[int, int | None], TensorInfo] = {}
                complete = True
                have: list[str] = []
                per_idx_infos = []
                for idx, names in enumerate(per_idx):
                    lacking = False
                    try:
                        infos = list(map(sources.__getitem__, names))
                    except KeyError:  # (``None in infos`` would call TensorInfo.__eq__ per element)
                        infos, lacking = list(map(get, names)), True
                    per_idx_infos.append(infos)
                    if len(names) == 1 and "{expert}" not in rule.sources[idx]:
                        keys: Sequence = ((idx, None),)
                    else:
                        ek = (idx, len(experts))
                        keys = expert_keys.get(ek) or expert_keys.setdefault(ek, [(idx, j) for j in experts])
                    if lacking:
                        complete = False
                        hit = [(k, n, i) for k, n, i in zip(keys, names, infos) if i is not None]
                        parts.update((k, i) for k, _n, i in hit)
                        have += [n for _k, n, _i in hit]
                    else:
                        parts.update(zip(keys, infos))
                        have += names
                if not parts:
                    continue
                key = (rule.id, tuple(sorted(bind.items())))
                if key in groups:  # two rules with one id (never in the shipped tables): merge, old-style
                    g = groups[key]
                    g.parts.update(parts)
                    g.first = min(g.first, min(map(pos.__getitem__, have)))
                    g.names = g.infos = None
                else:
                    first = min(map(pos.__getitem__, have))
                    groups[key] = _Group(
                        rule, dict(bind), parts, first, *((per_idx, per_idx_infos) if complete else (None, None))
                    )
                found.append(have)
                claimed += len(have)
    rest: Sequence[str] = sources
    if claimed:
        if claimed == len(sources):
            rest = ()
        else:
            taken = set(chain.from_iterable(found))
            rest = [n for n in sources if n not in taken]
    unknown: list[str] = []
    for name in rest:
        hit = _match(rules, name)
        if hit is None:
            unknown.append(name)
            continue
        rule, idx, bind = hit
        if rule.kind == "drop":
            dropped.append((pos[name], name, rule.note))
            continue
        expert = bind.pop("expert", None)
        key = (rule.id, tuple(sorted(bind.items())))
        g = groups.get(key)
        if g is None:
            g = groups[key] = _Group(rule, bind, first=pos[name])
        g.parts[(idx, expert)] = sources[name]
        g.first = min(g.first, pos[name])
        g.names = g.infos = None
    dropped.sort()
    return sorted(groups.values(), key=lambda g: g.first), {n: note for _p, n, note in dropped}, unknown


def _rows_cols(t: TensorInfo) -> tuple[int, int]:
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
    if weight.dtype in ("I8", "U8"):  # packed MXFP4: 2 values per byte along the input dim
        logical = wdim * 2 if dim == 1 else wdim
        block = MX_BLOCK if dim == 1 else 1
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


def _sibling_name(name: str) -> str | None:
    if name.endswith(".weight"):
        return name[: -len(".weight")] + ".scale"
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".weight"
    return None


def _sibling(sources: dict[str, TensorInfo], name: str) -> TensorInfo | None:
    other = _sibling_name(name)
    return None if other is None else sources.get(other)


def _check_piece(
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


def _engine_pad(info: TensorInfo, dim: int, tp: int, sources: dict[str, TensorInfo]) -> tuple[int, int] | None:
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


def _bounds(info: TensorInfo, split_dim: int | None, tp: int, rank: int) -> Bounds:
    rows, cols = _rows_cols(info)
    if split_dim is None or tp == 1:
        return 0, rows, 0, cols
    if split_dim == 0:
        step = rows // tp
        return rank * step, (rank + 1) * step, 0, cols
    step = cols // tp
    return 0, rows, rank * step, (rank + 1) * step


def _check_experts(
    g: _Group, experts: int, split_dim: int | None, tp: int, sources: dict[str, TensorInfo], uniform_stacks: dict
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
            sib = _sibling_name(pattern)
            if sib is None or (sib, bind) in uniform_stacks:
                continue
            sibs = {None if s is None else _DTYPE_SHAPE(s) for s in map(sources.get, map(_sibling_name, names))}
            uniform = uniform and len(sibs) == 1
        if uniform:
            for idx in range(nsrc):
                _check_piece(g.parts[(idx, 0)], split_dim, tp, sources)
            return
    for e in range(experts):
        for idx in range(nsrc):
            _check_piece(g.parts[(idx, e)], split_dim, tp, sources)


MXFP4_ROW_ALIGN = 128  # vLLM's MXFP4 MoE backends (Marlin, DeepGEMM, CUTLASS, TRTLLM, ...) pad a rank's rows to this


def _check_mxfp4_rows(cfg: V4Config, tp: int) -> None:
    """Routed MXFP4 experts split by tp must leave each rank a multiple of 128 intermediate rows."""
    rows = cfg.moe_intermediate_size // tp
    if cfg.expert_dtype == "fp4" and tp > 1 and rows % MXFP4_ROW_ALIGN:
        raise PlanError(
            f"routed experts: moe_intermediate_size={cfg.moe_intermediate_size} over tp={tp} leaves {rows} rows a "
            "rank, "
            "not a multiple of 128; most of vLLM's MXFP4 MoE backends round that up at load, a layout that depends on "
            "the backend and that no sharded checkpoint can match: convert with --moe-parallel ep (serve with "
            "--enable-expert-parallel), or choose a tp that leaves a multiple of 128 rows"
        )


def _plan_group(
    g: _Group,
    cfg: V4Config,
    opts: Options,
    sources: dict[str, TensorInfo],
    srcs: tuple[str, ...],
    uniform_stacks: dict,
    padded: set[tuple[int, int]],
) -> list[tuple[tuple[int, ...], Sequence[Segment], str, int]]:
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
        split_dim = {Split.REPLICATE: None, Split.DIM0: 0, Split.DIM1: 1}[rule.split]
        if rule.replicate_unless and getattr(cfg, rule.replicate_unless) % tp:
            split_dim = None  # the engine holds this tensor whole on every rank at this tp
        infos = [g.parts[k] for k in sorted(g.parts, key=lambda k: (k[1] or 0, k[0]))]
        if rule.sections > 1 and split_dim == 0 and tp > 1:
            return _plan_sections(infos[0], rule.sections, tp, conv_of(infos[0], rule))
        first = infos[0]
        conv = conversions.effective(first.dtype, rule.convert)
        if rule.pad and split_dim is not None and tp > 1:
            pads = [_engine_pad(info, split_dim, tp, sources) for info in infos]
            if any(pads):
                return _plan_padded(infos, pads, split_dim, tp, conv, sources, padded)
        for info in infos:
            _check_piece(info, split_dim, tp, sources, cfg.weight_block_size[split_dim or 0])
        names = tuple(i.name for i in infos)
        tail = list(first.shape[1:])
        if split_dim == 1:
            tail[0] //= tp
        if split_dim is None or tp == 1:  # every rank reads the same: one Segments for all
            bounds = tuple(_bounds(i, None, 1, 0) for i in infos)
            rows = sum(b[1] for b in bounds)
            return [((rows, *tail) if first.shape else (), Segments(names, bounds, conv), names[0], 0)] * tp
        out = []
        sizes = list(map(_rows_cols, infos))
        for rank in range(tp):
            if split_dim == 0:
                bounds = tuple((rank * (r // tp), (rank + 1) * (r // tp), 0, c) for r, c in sizes)
            else:
                bounds = tuple((0, r, rank * (c // tp), (rank + 1) * (c // tp)) for r, c in sizes)
            rows = sum(b[1] - b[0] for b in bounds)
            out.append(((rows, *tail) if first.shape else (), Segments(names, bounds, conv), names[0], 0))
        return out

    # StackExperts: [E_local, rows, cols]; every expert's parts share one shape (checked), so one period
    # (routed experts are never padded: a split that does not divide at block granularity is refused)
    E = getattr(cfg, rule.experts_key)
    conv = conversions.effective(g.parts[(0, 0)].dtype, rule.convert)
    nsrc = len(rule.sources)
    if opts.moe_parallel == "ep":
        if E % tp:
            raise PlanError(
                f"n_routed_experts={E} does not split over tp={tp} with --moe-parallel ep; choose a tp that divides it"
            )
        split_dim = None
    else:
        split_dim = rule.expert_split_dim
        _check_experts(g, E, split_dim, tp, sources, uniform_stacks)
        _check_mxfp4_rows(cfg, tp)
    period = [g.parts[(idx, 0)] for idx in range(nsrc)]
    out = []
    for rank in range(tp):
        bounds = tuple(_bounds(i, split_dim, tp, rank) for i in period)
        if opts.moe_parallel == "ep":
            step = E // tp
            names = srcs[rank * step * nsrc : (rank + 1) * step * nsrc]
            n_local = step
        else:
            names, n_local = srcs, E
        rows = sum(b[1] - b[0] for b in bounds)
        out.append(((n_local, rows, bounds[0][3] - bounds[0][2]), Segments(names, bounds, conv), names[0], 0))
    return out


def _plan_repeated(
    infos: list[TensorInfo], split_dim: int | None, tp: int, conv: str, repeat: int
) -> list[tuple[tuple[int, ...], Sequence[Segment], str, int]]:
    """Per rank of a scale whose rows the engine repeats ``repeat`` times before its TP split (an MXFP8 scale:
    vLLM's KMxfp8Static loader, vllm/model_executor/layers/quantization/modelopt.py, repeat_interleaves the
    checkpoint's [out/32, in/32] to [out, in/32]); each fused part is expanded on its own, as the engine loads
    each shard of a merged linear separately."""
    out = []
    for rank in range(tp):
        segs: list[Segment] = []
        rows = width = 0
        for info in infos:
            R, C = _rows_cols(info)
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


def _plan_engram(g: _Group, cfg: V4Config, tp: int) -> list[tuple[tuple[int, ...], Sequence[Segment], str, int]]:
    """Per rank of an Engram table (or its scale): the rows of the rank's hash heads, uneven across ranks
    (:mod:`ckpt_tool.checkpoint.engram`), read in one run of whole rows."""
    layout = engram_layout(cfg)
    assert layout is not None and "layer" in g.bind, g.rule.id
    layout.require(tp)
    (info,) = [g.parts[k] for k in g.parts]
    rows, cols = _rows_cols(info)
    want = layout.num_embeddings[layout.layer_ids.index(g.bind["layer"])]
    if rows != want:
        raise PlanError(
            f"{info.file}: tensor {info.name!r} has {rows} rows, config.json engram_num_embeddings says {want}; "
            "use the config.json released with these weights"
        )
    conv = conv_of(info, g.rule)
    out = []
    for lo, hi in layout.rank_rows(g.bind["layer"], tp):
        out.append(((hi - lo, *info.shape[1:]), (Segment(info.name, lo, hi, 0, cols, conv),), info.name, 0))
    return out


def conv_of(info: TensorInfo, rule: Rule) -> str:
    return conversions.effective(info.dtype, rule.convert)


def _plan_sections(
    info: TensorInfo, sections: int, tp: int, conv: str
) -> list[tuple[tuple[int, ...], Sequence[Segment], str, int]]:
    """Per rank of one tensor fused on disk from ``sections`` equal row blocks: rank r holds chunk r of every
    section, in section order (see Rule.sections)."""
    rows, cols = _rows_cols(info)
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
) -> list[tuple[tuple[int, ...], Sequence[Segment], str, int]]:
    """Per rank of a rename/fuse whose split the engine zero-pads (see :func:`_engine_pad`): a padded part
    gives each rank ``per_rank`` rows (dim 0) or columns (dim 1), its share of the source first, then
    zeros; a rank past the source's end holds zeros only. Parts that need no pad split evenly as usual.
    """
    for info, pad in zip(infos, pads):
        if pad is None:
            _check_piece(info, split_dim, tp, sources)
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
                src_rows, src_cols = _rows_cols(info)
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


def plan_conversion(config: V4Config, tensors: dict[str, TensorInfo], opts: Options) -> Plan:
    """Plan converting ``tensors`` (a checkpoint's headers) under ``opts``. Raises PlanError before any write."""
    with gc_paused():  # tens of thousands of small objects, none cyclic (see checkpoint.headers.gc_paused)
        return _plan_conversion(config, tensors, opts)


def _plan_conversion(config: V4Config, tensors: dict[str, TensorInfo], opts: Options) -> Plan:
    if opts.tp < 1:
        raise PlanError(f"--tp must be >= 1, got {opts.tp}")
    if opts.moe_parallel not in ("tp", "ep"):
        raise PlanError(f"--moe-parallel must be 'tp' or 'ep', got {opts.moe_parallel!r}")
    if opts.profile not in PROFILES:
        raise PlanError(f"unknown target profile {opts.profile!r}; known: {', '.join(PROFILES)}")
    profile = PROFILES[opts.profile]
    draft = profile.draft_of(config) if opts.only != "model" else draft_kind_of(config)
    series = profile.draft_series(draft, opts.vllm_series) if opts.only != "model" else None
    rules = profile.rules(config.expert_dtype, model_class_of(config), draft.rules(config, series))
    # the series stays in the plan's options (manifest, resume fingerprint) only where it changes the bytes
    opts = replace(opts, vllm_series=series if series and draft.layout_varies(profile.covers) else None)

    require_agreement(config, tensors)  # shapes and dtypes config.json implies (the experts' format too)
    complete = require_complete(config, tensors, opts.only)
    layout = engram_layout(config) if selects(opts.only, "model") else None
    if layout is not None:
        layout.require(opts.tp)  # vLLM's own refusal of this tp, before any other split is looked at
    mtp_present = set(count_by_index(tensors, "mtp."))
    extra_mtp = sorted(i for i in mtp_present if i >= config.draft_layers)
    if extra_mtp:
        key = "num_nextn_predict_layers" if draft is MTP else "n_mtp_layers (default 3)"
        raise PlanError(
            f"checkpoint has {draft.layer_word}(s) {extra_mtp} but config.json {key} gives "
            f"{config.draft_layers}; fix the config or remove the extra tensors"
        )

    sources = dict(tensors)
    materialized = _materialize(config, tensors, sources, draft, series) if opts.only != "model" else {}

    groups, dropped, unknown = _group_sources(rules, sources, config)
    if unknown:
        unknown.sort()
        first, rest = unknown[0], unknown[1:]
        also = ""
        if rest:
            shown = ", ".join(f"{n!r} (in {sources[n].file})" for n in rest[:5])
            also = f" (nor do {len(rest)} more: {shown}{', ...' if len(rest) > 5 else ''})"
        raise PlanError(
            f"{sources[first].file}: tensor {first!r}: matches no rule of profile {opts.profile!r}{also}; is this a "
            "DeepSeek V4 checkpoint in DeepSeek's own names? Convert the original checkpoint, or remove the extra "
            "tensors"
        )

    uniform_stacks = _uniform_stacks(groups)
    padded: set[tuple[int, int]] = set()  # (size, per-rank size) of every weight split zero-padded
    outputs: dict[tuple[str, int], list[tuple[tuple, OutTensor]]] = defaultdict(list)
    unused_by_selection: list[str] = []
    for g in groups:
        if not _group_ok(g, config):
            _check_group(_in_source_order(g, sources), config)  # raises, naming parts in checkpoint order
            g.names = g.infos = None  # passed the full check after all: plan it without the shortcuts
        rule = g.rule
        names = {**g.bind, "spec": config.num_hidden_layers + g.bind.get("mtp", 0)}
        target = rule.target.format(**names)  # type: ignore[union-attr]
        if g.names is not None:  # (expert, idx) order without sorting: names[idx][expert]
            srcs = tuple(chain.from_iterable(zip(*g.names)))
        else:
            srcs = tuple(g.parts[k].name for k in sorted(g.parts, key=lambda k: (k[1] or 0, k[0])))
        if not selects(opts.only, rule.component):
            unused_by_selection.extend(srcs)
            continue
        first = next(iter(g.parts.values()))
        dtype = conversions.out_dtype(first.dtype, rule.convert)
        for rank, (shape, segs, head, zeros) in enumerate(
            _plan_group(g, config, opts, sources, srcs, uniform_stacks, padded)
        ):
            info = sources[head]
            read = segs.names if isinstance(segs, Segments) else srcs  # under ep a rank reads its own experts only
            outputs[(rule.component, rank)].append(
                ((info.file, info.start, target), _out_tensor(target, dtype, shape, segs, rule.id, read, zeros))
            )

    _require_one_source(outputs)
    files = _pack(outputs, opts)
    deviations = []
    notes: list[str] = [NO_MTP_NOTE] if complete.mtp_waived else []
    if materialized and draft is MTP:
        deviations.append(
            "materialized "
            + ", ".join(f"{a} from {r}" for a, r in sorted(materialized.items()))
            + " (vLLM's stock loaders leave them uninitialised; its sharded loader needs the keys)"
        )
    elif materialized:
        notes.append(DSPARK_ALIAS_NOTE)
        if draft.holds_context_wkv(series):
            notes.append(DSPARK_CONTEXT_NOTE)
    if opts.vllm_series:
        notes.append(series_note(draft, opts.vllm_series, PROFILES[opts.profile].covers))
    if config.expert_dtype == "fp8" and any(t.dtype == "F8_E8M0" and ".experts." in n for n, t in tensors.items()):
        deviations.append(
            "fp8 routed-expert E8M0 scales written as float32 2^(b-127) (the seed and vLLM 0.33's stock loader store "
            "the raw byte b as a number: vLLM #51946, #43416)"
        )
    return Plan(
        options=opts,
        config=config,
        sources=sources,
        files=files,
        dropped=dropped,
        materialized=materialized,
        deviations=tuple(deviations),
        unused_by_selection=tuple(sorted(unused_by_selection)),
        notes=tuple(notes) + tuple(pad_note(n, per, opts.tp) for n, per in sorted(padded)),
    )


def series_note(draft, series: str, covers: tuple[str, ...]) -> str:
    """The plan's note on a draft written for one vLLM series of the several its profile covers."""
    holds = draft.holds_context_wkv(series)
    others = [c for c in covers if draft.holds_context_wkv(c) != holds]
    return (
        f"{draft.component}: written for vLLM {series}, whose {draft.architecture} "
        f"{'holds' if holds else 'has no'} model.context_wkv_proj; for vLLM {', '.join(others)} convert with "
        f"--vllm {others[0]}"
    )


def _materialize(
    config: V4Config, tensors: dict[str, TensorInfo], sources: dict[str, TensorInfo], draft, series: str | None
) -> dict[str, str]:
    """Add to ``sources`` the aliases the draft's rules read (alias → real source tensor): the classic MTP's own
    embedding/head where the checkpoint lacks them, every alias of another draft kind."""
    wanted: dict[str, str] = {}
    if draft is MTP:
        for i in range(config.draft_layers):
            for alias_pat, real in MATERIALIZE.items():
                alias = alias_pat.format(mtp=i)
                if alias not in tensors and not (alias.endswith("emb.tok_emb.weight") and i > 0):
                    wanted[alias] = real
    else:
        wanted = draft.aliases(config, series)
    for alias, real in wanted.items():
        if real not in tensors:
            raise PlanError(f"{alias} is missing and cannot be materialized: {real} is not in the checkpoint either")
        r = tensors[real]
        sources[alias] = TensorInfo(alias, r.dtype, r.shape, r.file, r.start, r.end)
    return wanted


def _require_one_source(outputs: dict[tuple[str, int], list[tuple[tuple, OutTensor]]]) -> None:
    """Every output tensor of a rank made by one rule instance: a DSpark head-stack tensor shipped by two stages
    (vLLM's loader keeps whichever it reads last) is refused, naming both."""
    for (component, _rank), items in outputs.items():
        seen: dict[str, OutTensor] = {}
        for _key, t in items:
            if t.name in seen:
                a, b = seen[t.name].sources[0], t.sources[0]
                raise PlanError(
                    f"{component}/{t.name} would be written from both {a!r} and {b!r}; vLLM's loader keeps whichever "
                    "it reads last: remove the copy the checkpoint should not have"
                )
            seen[t.name] = t


def _group_ok(g: _Group, cfg: V4Config) -> bool:
    """Whether :func:`_check_group` would pass, decided with set operations (no names formatted)."""
    rule, n = g.rule, len(g.rule.sources)
    if g.infos is None:
        return False  # irregular or incomplete: the full check decides
    if rule.kind == "stack":
        kinds = g.kinds if g.kinds is not None else _kinds(g)
        if any(len(k) != 1 for k in kinds):
            return False  # experts of one source disagree
        reps = [next(iter(k)) for k in kinds]
        return len({d for d, _s in reps}) == 1 and len({s[1:] for _d, s in reps}) == 1
    infos = g.parts.values()
    return len(g.parts) == n and len({t.dtype for t in infos}) == 1 and len({t.shape[1:] for t in infos}) == 1


def _kinds(g: _Group) -> list[set[tuple[str, tuple[int, ...]]]]:
    assert g.infos is not None
    return [set(map(_DTYPE_SHAPE, infos)) for infos in g.infos]


def _uniform_stacks(groups: list[_Group]) -> dict[tuple[str, tuple], tuple[str, tuple[int, ...]]]:
    """(source pattern, binding) → (dtype, shape) for every complete stack source whose experts all agree.

    A stacked weight's split check looks at each expert's scale (and the other way round); when that
    sibling source is in here, all experts' siblings look alike and expert 0 speaks for all.
    """
    out = {}
    for g in groups:
        if g.rule.kind == "stack" and g.infos is not None:
            g.kinds = _kinds(g)
            bind = tuple(sorted(g.bind.items()))
            for pattern, kinds in zip(g.rule.sources, g.kinds):
                if len(kinds) == 1:
                    out[(pattern, bind)] = next(iter(kinds))
    return out


def _in_source_order(g: _Group, sources: dict[str, TensorInfo]) -> _Group:
    """``g`` with its parts in the order matching met them (what :func:`_check_group` messages list)."""
    pos = {name: i for i, name in enumerate(sources)}
    parts = dict(sorted(g.parts.items(), key=lambda kv: pos[kv[1].name]))
    return _Group(g.rule, g.bind, parts, g.first, None)


def _check_group(g: _Group, cfg: V4Config) -> None:
    rule = g.rule
    where = rule.target.format(**{**g.bind, "spec": cfg.num_hidden_layers + g.bind.get("mtp", 0)})  # type: ignore[union-attr]
    if rule.kind == "stack":
        E = getattr(cfg, rule.experts_key)
        for idx, pat in enumerate(rule.sources):
            have = sorted(e for (i, e) in g.parts if i == idx)
            if have != list(range(E)):
                missing = sorted(set(range(E)) - set(have))
                extra = sorted(set(have) - set(range(E)))
                raise PlanError(
                    f"{where}: routed experts incomplete for {pat.format(**g.bind, expert='{j}')}: "
                    f"missing {missing or '-'}, unexpected {extra or '-'} (config {rule.experts_key}={E}); "
                    f"the checkpoint is incomplete — download it again or fix {rule.experts_key} in config.json"
                )
    else:
        missing = [
            s.format(**g.bind)
            for i, s in enumerate(rule.sources)
            if (i, None) not in g.parts and i not in rule.optional
        ]
        if missing:
            raise PlanError(
                f"{where}: fused parts missing from the checkpoint: {', '.join(missing)}; the checkpoint is incomplete "
                "— "
                "download it again"
            )
    infos = list(g.parts.values())
    dtypes = {t.dtype for t in infos}
    if len(dtypes) > 1:
        raise PlanError(f"{where}: parts have different dtypes: " + ", ".join(f"{t.name}={t.dtype}" for t in infos))
    tails = {t.shape[1:] for t in infos}
    if len(tails) > 1:
        raise PlanError(
            f"{where}: parts disagree in trailing shape: " + ", ".join(f"{t.name}={list(t.shape)}" for t in infos)
        )
    if rule.kind == "stack":
        shapes = {}
        for (idx, _e), t in g.parts.items():
            shapes.setdefault(idx, set()).add(t.shape)
        for idx, s in shapes.items():
            if len(s) > 1:
                raise PlanError(f"{where}: experts disagree in shape for {rule.sources[idx]}: {sorted(s)}")


def _pack(outputs: dict[tuple[str, int], list[tuple[tuple, OutTensor]]], opts: Options) -> tuple[OutFile, ...]:
    """Greedy packing into parts of at most max_shard_size (a bigger tensor gets a part of its own).

    Tensors are ordered by where their first source byte lies (file, offset, then name), so the writer
    reads sources mostly sequentially.
    """
    files: list[OutFile] = []
    for component, rank in sorted(outputs):
        ts = [t for _key, t in sorted(outputs[(component, rank)], key=lambda kt: kt[0])]
        part: list[OutTensor] = []
        size = 0
        n = 0
        for t in ts:
            if part and size + t.nbytes > opts.max_shard_size:
                files.append(OutFile(component, rank, n, tuple(part)))
                n += 1
                part, size = [], 0
            part.append(t)
            size += t.nbytes
        if part:
            files.append(OutFile(component, rank, n, tuple(part)))
    return tuple(files)


def needed_sources(names: list[str] | set[str], config: V4Config, opts: Options) -> set[str]:
    """Source tensor names (from an index: no headers needed) whose bytes a conversion under ``opts`` reads.

    Used to fetch only part of a hub checkpoint. ``--only mtp`` needs the tensors of the MTP rules plus
    the ones materialized aliases copy (embed/head when the checkpoint has no MTP embedding/head);
    tensors a rule drops are not needed. Anything else (``--only model`` or both) needs every tensor:
    the plan checks that every MTP layer is present, so even ``--only model`` reads MTP headers.
    """
    if opts.profile not in PROFILES:
        raise PlanError(f"unknown target profile {opts.profile!r}; known: {', '.join(PROFILES)}")
    names = set(names)
    if opts.only != "mtp":
        return names
    profile = PROFILES[opts.profile]
    draft = profile.draft_of(config)
    series = profile.draft_series(draft, opts.vllm_series)
    rules = profile.rules(config.expert_dtype, model_class_of(config), draft.rules(config, series))
    keep: set[str] = set()
    for name in names:
        hit = _match(rules, name)
        if hit is None:
            if _MTP_RE.match(name):
                keep.add(name)  # an unknown MTP tensor: kept so the plan reports it
        elif hit[0].kind != "drop" and hit[0].component != "model":
            keep.add(name)
    if draft is MTP:
        for i in range(config.draft_layers):
            for alias_pat, real in MATERIALIZE.items():
                alias = alias_pat.format(mtp=i)
                if alias in names or (alias.endswith("emb.tok_emb.weight") and i > 0):
                    continue
                if real in names:
                    keep.add(real)
    else:
        keep.update(real for real in draft.aliases(config, series).values() if real in names)
    return keep


@dataclass(frozen=True)
class HubNeeds:
    """The planner's answers to the hub input (``ckpt_tool.checkpoint.hub.ConversionNeeds``) for ``opts``."""

    opts: Options

    @property
    def partial(self) -> bool:
        return self.opts.only == "mtp"

    def sources(self, names: set[str], config: V4Config) -> set[str]:
        return needed_sources(names, config, self.opts)

    def check(self, config: V4Config, tensors: dict[str, TensorInfo]) -> None:
        plan_conversion(config, tensors, self.opts)
