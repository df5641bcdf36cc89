"""Reference planner for tests: the planner (``ckpt_tool/mapping/planner.py``, then ``plan.py``) as it was before it
was made fast.

Straightforward on purpose: every name tried against the rule regexes, every segment built eagerly,
every check per tensor and per rank. ``tests/test_planner_equivalence.py`` compares the real planner
with it. Do not optimise this file; change it only when the plan's intended output changes.

Original docstring: planning a conversion from headers alone: which bytes of which source tensors form every
output tensor.

Everything that can be checked without reading tensor bytes is checked here, before any output is
written: every source tensor matched by exactly one rule (unknown names are an error listing them),
fused parts that agree, complete expert sets, TP splits that divide at block granularity, and every
MTP layer present. The result is a :class:`Plan`: per output file, per tensor, a list of
:class:`Segment` byte gathers the writer executes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from ckpt_tool.checkpoint.agreement import require_agreement
from ckpt_tool.checkpoint.completeness import require_complete
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.config_keys import check_tensors
from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.profiles import DEFAULT_PROFILE, PROFILES
from ckpt_tool.mapping.rules import MATERIALIZE, Rule, Split
from ckpt_tool.mapping.splits import pad_note  # the note's wording; which sizes pad is worked out here

GiB = 1024**3
FP8_BLOCK = 128
MX_BLOCK = 32
_MTP_RE = re.compile(r"^mtp\.(0|[1-9][0-9]*)\.")
NO_MTP_NOTE = (
    "the checkpoint has no MTP layers: converted the target model only; speculative decoding needs the MTP draft "
    "from a checkpoint that includes it (convert that one with --only mtp)"
)


@dataclass(frozen=True)
class Options:
    """Conversion options that change the output bytes (they are part of the resume fingerprint)."""

    tp: int = 1
    moe_parallel: str = "tp"  # tp | ep
    only: str | None = None  # None | "model" | "mtp"
    max_shard_size: int = 5 * GiB
    profile: str = DEFAULT_PROFILE

    def as_dict(self) -> dict:
        return {
            "tp": self.tp,
            "moe_parallel": self.moe_parallel,
            "only": self.only,
            "max_shard_size": self.max_shard_size,
            "profile": self.profile,
        }


ZERO = "<zero>"  # Segment.src of a zero fill


@dataclass(frozen=True)
class Segment:
    """Rows [row0, row1) x columns [col0, col1) of a source tensor seen as 2-D [shape[0], prod(shape[1:])],
    each row followed by ``pad`` zeros; or, when ``src`` is ZERO, (row1 - row0) x (col1 - col0) zeros."""

    src: str  # source tensor name (a materialized alias resolves through Plan.sources)
    row0: int
    row1: int
    col0: int
    col1: int
    convert: str = "copy"  # a conversions.KINDS entry
    pad: int = 0

    @property
    def numel(self) -> int:
        return (self.row1 - self.row0) * (self.col1 - self.col0 + self.pad)


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    rule: str
    sources: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8

    @property
    def padding(self) -> int:
        return sum(s.numel if s.src == ZERO else (s.row1 - s.row0) * s.pad for s in self.segments)


@dataclass(frozen=True)
class OutFile:
    component: str  # model | mtp
    rank: int
    part: int
    tensors: tuple[OutTensor, ...]

    @property
    def name(self) -> str:
        return f"model-rank-{self.rank}-part-{self.part}.safetensors"

    @property
    def relpath(self) -> str:
        return f"{self.component}/{self.name}"

    @property
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


def _rows_cols(t: TensorInfo) -> tuple[int, int]:
    if not t.shape:
        return 1, 1
    return t.shape[0], math.prod(t.shape[1:]) if len(t.shape) > 1 else 1


def _check_split(name: str, info: TensorInfo, dim: int, tp: int, sibling: TensorInfo | None) -> None:
    """TP split of ``dim`` must divide evenly and, for quantized weights, at block granularity."""
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
        logical, block = wdim, FP8_BLOCK
    if (logical // tp) != (sdim // tp) * block:
        raise PlanError(
            f"{weight.file}: tensor {weight.name!r}: a tp={tp} chunk of dim {dim} holds {logical // tp} values, "
            f"not a whole number of {block}-wide scale blocks; choose a tp that splits at block granularity"
        )


def _sibling(sources: dict[str, TensorInfo], name: str) -> TensorInfo | None:
    if name.endswith(".weight"):
        return sources.get(name[: -len(".weight")] + ".scale")
    if name.endswith(".scale"):
        return sources.get(name[: -len(".scale")] + ".weight")
    return None


def _chunk(n: int, tp: int, r: int) -> tuple[int, int]:
    step = n // tp
    return r * step, (r + 1) * step


def _engine_padded(
    info: TensorInfo, sibling: TensorInfo | None, dim: int, tp: int, rank: int, conv: str, padded: set[tuple[int, int]]
) -> list[Segment] | None:
    """vLLM's _pad_shared_expert_weight, then an even split: a block-FP8 weight (elements) or scale (blocks) is
    zero-padded on ``dim`` to a multiple of tp blocks and rank ``rank`` takes its chunk. None: not such a tensor."""
    if sibling is None:
        return None
    weight, scale = (info, sibling) if info.name.endswith(".weight") else (sibling, info)
    if weight.dtype in ("I8", "U8") or len(weight.shape) != 2 or len(scale.shape) != 2:
        return None
    if weight.shape[dim] % FP8_BLOCK or scale.shape[dim] != weight.shape[dim] // FP8_BLOCK:
        return None
    step = FP8_BLOCK if info is weight else 1
    n = info.shape[dim]
    total = -(-n // (tp * step)) * tp * step
    lo, hi = _chunk(total, tp, rank)
    real = range(lo, min(hi, n))
    zeros = (hi - lo) - len(real)
    rows, cols = info.shape
    if info is weight:
        padded.add((n, hi - lo))
    if dim == 0:
        segs = [Segment(info.name, real.start, real.stop, 0, cols, conv)] if len(real) else []
        return segs + ([Segment(ZERO, 0, zeros, 0, cols, conv)] if zeros else [])
    if len(real):
        return [Segment(info.name, 0, rows, real.start, real.stop, conv, zeros)]
    return [Segment(ZERO, 0, rows, 0, zeros, conv)]


def _segments_for(
    group: _Group, cfg: V4Config, opts: Options, rank: int, sources: dict[str, TensorInfo], padded: set[tuple[int, int]]
) -> tuple[tuple[int, ...], list[Segment]]:
    """Output shape and segments of one rule instance on one rank."""
    rule, tp = group.rule, opts.tp
    infos = [group.parts[k] for k in sorted(group.parts, key=lambda k: (k[1] or 0, k[0]))]
    first = infos[0]
    conv = conversions.effective(first.dtype, rule.convert)

    def piece(info: TensorInfo, split_dim: int | None) -> list[Segment]:
        rows, cols = _rows_cols(info)
        r0, r1, c0, c1 = 0, rows, 0, cols
        if split_dim is not None and tp > 1:
            sibling = _sibling(sources, info.name)
            try:
                _check_split(info.name, info, split_dim, tp, sibling)
            except PlanError:
                segs = _engine_padded(info, sibling, split_dim, tp, rank, conv, padded) if rule.pad else None
                if segs is None:
                    raise
                return segs
            if split_dim == 0:
                r0, r1 = _chunk(rows, tp, rank)
            else:
                if len(info.shape) != 2:
                    raise PlanError(
                        f"{info.file}: tensor {info.name!r}: column split needs a 2-D tensor, "
                        f"got shape {list(info.shape)}"
                    )
                c0, c1 = _chunk(cols, tp, rank)
        return [Segment(info.name, r0, r1, c0, c1, conv)]

    if rule.kind in ("rename", "fuse"):
        split_dim = {Split.REPLICATE: None, Split.DIM0: 0, Split.DIM1: 1}[rule.split]
        segs = [s for i in infos for s in piece(i, split_dim)]
        tail = list(first.shape[1:])
        if split_dim == 1:
            tail[0] = segs[0].col1 - segs[0].col0 + segs[0].pad
        rows = sum(s.row1 - s.row0 for s in segs)
        return (rows, *tail) if first.shape else (), segs

    # StackExperts: [E_local, rows, cols]
    E = cfg.n_routed_experts
    if opts.moe_parallel == "ep":
        if E % tp:
            raise PlanError(
                f"n_routed_experts={E} does not split over tp={tp} with --moe-parallel ep; choose a tp that divides it"
            )
        experts = range(*_chunk(E, tp, rank))
        split_dim = None
    else:
        experts = range(E)
        split_dim = rule.expert_split_dim
    segs = []
    for e in experts:
        for idx in range(len(rule.sources)):
            segs += piece(group.parts[(idx, e)], split_dim)
    rows = cfg.moe_intermediate_size // tp
    if opts.moe_parallel != "ep" and cfg.expert_dtype == "fp4" and tp > 1 and rows % 128:
        raise PlanError(
            f"routed experts: moe_intermediate_size={cfg.moe_intermediate_size} over tp={tp} "
            f"leaves {rows} rows a rank, "
            "not a multiple of 128; most of vLLM's MXFP4 MoE backends round that up at load, a layout that depends on "
            "the backend and that no sharded checkpoint can match: convert with --moe-parallel ep (serve with "
            "--enable-expert-parallel), or choose a tp that leaves a multiple of 128 rows"
        )
    per_expert = len(rule.sources)
    rows = sum(s.row1 - s.row0 for s in segs[:per_expert])
    cols = segs[0].col1 - segs[0].col0
    return (len(experts), rows, cols), segs


def plan_conversion(config: V4Config, tensors: dict[str, TensorInfo], opts: Options) -> Plan:
    """Plan converting ``tensors`` (a checkpoint's headers) under ``opts``. Raises PlanError before any write."""
    if opts.tp < 1:
        raise PlanError(f"--tp must be >= 1, got {opts.tp}")
    if opts.moe_parallel not in ("tp", "ep"):
        raise PlanError(f"--moe-parallel must be 'tp' or 'ep', got {opts.moe_parallel!r}")
    if opts.profile not in PROFILES:
        raise PlanError(f"unknown target profile {opts.profile!r}; known: {', '.join(PROFILES)}")
    rules = PROFILES[opts.profile].rules(config.expert_dtype)

    check_tensors(config, tensors)  # the keys that name layers holding tensors (config_keys)
    require_agreement(config, tensors)  # shapes and dtypes config.json implies (the experts' format too)
    complete = require_complete(config, tensors, opts.only)
    mtp_present = {int(m.group(1)) for n in tensors if (m := _MTP_RE.match(n))}
    extra_mtp = sorted(i for i in mtp_present if i >= config.num_nextn_predict_layers)
    if extra_mtp:
        raise PlanError(
            f"checkpoint has MTP layer(s) {extra_mtp} but config.json num_nextn_predict_layers is "
            f"{config.num_nextn_predict_layers}; fix the config or remove the extra tensors"
        )

    sources = dict(tensors)
    materialized: dict[str, str] = {}
    for i in (
        range(config.num_nextn_predict_layers) if opts.only != "model" else ()
    ):  # nothing of the draft is written with --only model
        for alias_pat, real in MATERIALIZE.items():
            alias = alias_pat.format(mtp=i)
            if alias in sources or (alias.endswith("emb.tok_emb.weight") and i > 0):
                continue
            if real not in tensors:
                raise PlanError(
                    f"{alias} is missing and cannot be materialized: {real} is not in the checkpoint either"
                )
            r = tensors[real]
            sources[alias] = TensorInfo(alias, r.dtype, r.shape, r.file, r.start, r.end)
            materialized[alias] = real

    groups: dict[tuple[str, tuple], _Group] = {}
    dropped: dict[str, str] = {}
    unknown: list[str] = []
    for name, info in sources.items():
        hit = _match(rules, name)
        if hit is None:
            unknown.append(name)
            continue
        rule, idx, bind = hit
        if rule.kind == "drop":
            dropped[name] = rule.note
            continue
        expert = bind.pop("expert", None)
        key = (rule.id, tuple(sorted(bind.items())))
        g = groups.setdefault(key, _Group(rule, bind))
        g.parts[(idx, expert)] = info
    if unknown:
        unknown.sort()
        first, rest = unknown[0], unknown[1:]
        also = ""
        if rest:
            shown = ", ".join(f"{n!r} (in {sources[n].file})" for n in rest[:5])
            also = f" (nor do {len(rest)} more: {shown}{', ...' if len(rest) > 5 else ''})"
        raise PlanError(
            f"{sources[first].file}: tensor {first!r}: matches no rule of profile {opts.profile!r}{also}; is this a "
            "DeepSeek V4 checkpoint in DeepSeek's own names? Convert the original checkpoint, "
            "or remove the extra tensors"
        )

    outputs: dict[tuple[str, int], list[OutTensor]] = defaultdict(list)
    unused_by_selection: list[str] = []
    padded: set[tuple[int, int]] = set()
    for g in groups.values():
        _check_group(g, config)
        rule = g.rule
        names = {**g.bind, "spec": config.num_hidden_layers + g.bind.get("mtp", 0)}
        target = rule.target.format(**names)  # type: ignore[union-attr]
        srcs = tuple(g.parts[k].name for k in sorted(g.parts, key=lambda k: (k[1] or 0, k[0])))
        if opts.only and rule.component != opts.only:
            unused_by_selection.extend(srcs)
            continue
        first = next(iter(g.parts.values()))
        dtype = conversions.out_dtype(first.dtype, rule.convert)
        for rank in range(opts.tp):
            shape, segs = _segments_for(g, config, opts, rank, sources, padded)
            read = (
                tuple(dict.fromkeys(s.src for s in segs))
                if rule.kind == "stack" and opts.moe_parallel == "ep"
                else srcs
            )
            outputs[(rule.component, rank)].append(OutTensor(target, dtype, shape, tuple(segs), rule.id, read))

    files = _pack(outputs, sources, opts)
    deviations = []
    if materialized:
        deviations.append(
            "materialized "
            + ", ".join(f"{a} from {r}" for a, r in sorted(materialized.items()))
            + " (vLLM's stock loaders leave them uninitialised; its sharded loader needs the keys)"
        )
    if config.expert_dtype == "fp8" and any(t.dtype == "F8_E8M0" and ".experts." in n for n, t in tensors.items()):
        deviations.append(
            "fp8 routed-expert E8M0 scales written as float32 2^(b-127) (the seed and vLLM 0.33's stock loader "
            "store the raw byte b as a number: vLLM #51946, #43416)"
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
        notes=((NO_MTP_NOTE,) if complete.mtp_waived else ())
        + tuple(pad_note(n, per, opts.tp) for n, per in sorted(padded)),
    )


def _check_group(g: _Group, cfg: V4Config) -> None:
    rule = g.rule
    where = rule.target.format(**{**g.bind, "spec": cfg.num_hidden_layers + g.bind.get("mtp", 0)})  # type: ignore[union-attr]
    if rule.kind == "stack":
        E = cfg.n_routed_experts
        for idx, pat in enumerate(rule.sources):
            have = sorted(e for (i, e) in g.parts if i == idx)
            if have != list(range(E)):
                missing = sorted(set(range(E)) - set(have))
                extra = sorted(set(have) - set(range(E)))
                raise PlanError(
                    f"{where}: routed experts incomplete for {pat.format(**g.bind, expert='{j}')}: "
                    f"missing {missing or '-'}, unexpected {extra or '-'} (config n_routed_experts={E}); "
                    "the checkpoint is incomplete — download it again or fix n_routed_experts in config.json"
                )
    else:
        missing = [s.format(**g.bind) for i, s in enumerate(rule.sources) if (i, None) not in g.parts]
        if missing:
            raise PlanError(
                f"{where}: fused parts missing from the checkpoint: {', '.join(missing)}; "
                "the checkpoint is incomplete — "
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


def _pack(
    outputs: dict[tuple[str, int], list[OutTensor]], sources: dict[str, TensorInfo], opts: Options
) -> tuple[OutFile, ...]:
    """Greedy packing into parts of at most max_shard_size (a bigger tensor gets a part of its own).

    Tensors are ordered by where their first source byte lies, so the writer reads sources mostly
    sequentially.
    """
    files: list[OutFile] = []
    for component, rank in sorted(outputs):

        def first_read(t: OutTensor) -> TensorInfo:  # a rank of zeros only is placed where its first source is
            return sources[t.segments[0].src if t.segments[0].src != ZERO else t.sources[0]]

        ts = sorted(outputs[(component, rank)], key=lambda t: (first_read(t).file, first_read(t).start, t.name))
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
    rules = PROFILES[opts.profile].rules(config.expert_dtype)
    keep: set[str] = set()
    for name in names:
        hit = _match(rules, name)
        if hit is None:
            if _MTP_RE.match(name):
                keep.add(name)  # an unknown MTP tensor: kept so the plan reports it
        elif hit[0].kind != "drop" and hit[0].component == "mtp":
            keep.add(name)
    for i in range(config.num_nextn_predict_layers):
        for alias_pat, real in MATERIALIZE.items():
            alias = alias_pat.format(mtp=i)
            if alias in names or (alias.endswith("emb.tok_emb.weight") and i > 0):
                continue
            if real in names:
                keep.add(real)
    return keep
