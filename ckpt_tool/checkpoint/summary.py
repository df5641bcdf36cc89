"""Header-only summary of a checkpoint: files, tensors, bytes, dtypes, quantization, layers, MTP presence."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import asdict, dataclass, field, replace
from itertools import chain, compress, repeat
from operator import itemgetter, not_
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_tool.checkpoint.agreement import (
    STORED_FORMAT,
    Disagreement,
    DtypeShape,
    config_disagreement,
    kinds_agree,
    shape_kinds,
)
from ckpt_tool.checkpoint.completeness import (
    Completeness,
    absent_draft_layer,
    check_completeness,
    count_by_index,
    layer_indices,
    name_lines,
)
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.config_keys import tensor_key_problem
from ckpt_tool.checkpoint.expert_format import require_stored_formats
from ckpt_tool.checkpoint.forked_read import read_shards_forked
from ckpt_tool.checkpoint.gc_pause import gc_paused
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo, dtype_totals, read_shard_header
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import CheckpointError


@dataclass(frozen=True)
class FileSummary:
    file: str
    tensors: int
    bytes: int


@dataclass(frozen=True)
class QuantScheme:
    """What the stored dtypes say about quantization (never guessed from element size)."""

    linear_weight_dtype: str | None  # e.g. F8_E4M3 for block-FP8 linears
    linear_scale_dtype: str | None  # F8_E8M0 or F32
    expert_weight_dtype: str | None  # I8 (packed MXFP4) or F8_E4M3
    expert_scale_dtype: str | None
    expert_format: str | None  # "fp4" | "fp8" as stored
    config_expert_dtype: str | None  # config.json's expert_dtype

    @property
    def consistent(self) -> bool:
        return self.expert_format is None or self.config_expert_dtype in (None, self.expert_format)


@dataclass(frozen=True)
class InspectReport:
    source: str
    files: list[FileSummary]
    tensor_count: int
    total_bytes: int
    dtypes: dict[str, int]  # dtype -> tensor count
    dtype_bytes: dict[str, int]
    quant: QuantScheme
    main_layers: list[int]
    mtp_expected: list[int]  # draft layer (MTP layer or DSpark stage) indices i the config asks for
    mtp_present: list[int]
    mtp_missing: list[int]
    mtp_tensor_counts: dict[int, int]
    config_error: str | None = None
    # the model class vLLM builds for config.json: text or vision, the target and draft classes, the vision tower's
    # size; filled by the mapping stage, which knows the classes (ckpt_tool.mapping.inspection); None without a config
    model: dict | None = None
    config: V4Config | None = field(default=None, repr=False, compare=False)  # what ``model`` is read from; not JSON
    missing_tensors: dict[str, list[str]] = field(default_factory=dict)  # group (layers.L, mtp.i, globals) -> names
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        doc = asdict(replace(self, config=None))
        del doc["config"]
        doc["ok"] = self.ok
        doc["quant"]["consistent"] = self.quant.consistent
        return doc


class ShardTally(NamedTuple):
    """What inspect keeps of one file's headers: sums, no per-tensor records.

    A plain tuple of builtins, so a forked helper can hand it back through ``marshal``. The four
    ``dtype -> tensors`` maps split ``.weight`` and ``.scale`` tensors into routed experts and the rest
    (linears), each dtype in the order first seen. ``shape_kinds`` holds the file's distinct (role, dtype,
    shape): what config.json's implied shapes and dtypes are checked on without a record per tensor.
    """

    file: str
    dtype_totals: dict[str, tuple[int, int]]  # dtype -> (tensors, bytes)
    expert_weights: dict[str, int]
    expert_scales: dict[str, int]
    linear_weights: dict[str, int]
    linear_scales: dict[str, int]
    first_expert_weight: dict[str, str]  # dtype -> its first routed-expert weight (what a quant problem cites)
    layers: list[int]  # main layers with any tensor here
    mtp: dict[int, int]  # MTP index -> tensors
    shape_kinds: set[tuple[str, str, tuple[int, ...]]]  # see agreement.shape_kinds


_EXPERTS = ".ffn.experts."
# the block scales: DeepSeek's ``.scale`` (E8M0), NVIDIA's NVFP4 ``.weight_scale`` (E4M3, one per 16 inputs; its F32
# ``weight_scale_2`` and ``input_scale`` are one number a tensor, not a grid)
_SCALES = (".scale", ".weight_scale")
_QUANT_FIELDS = ("expert_weights", "expert_scales", "linear_weights", "linear_scales")


def tally_file(
    file: str,
    names: list[str],
    dtypes: list[str],
    totals: dict[str, tuple[int, int]],
    kinds: Iterable[Hashable],
    kind_of: Callable[[Any], DtypeShape] | None = None,
) -> ShardTally:
    """The :class:`ShardTally` of one file's tensor ``names`` and ``dtypes`` (``totals``: its per-dtype sums;
    ``kinds`` and ``kind_of``: their shapes, as :func:`ckpt_tool.checkpoint.agreement.shape_kinds` takes them).

    Routed experts are 96 % of a V4 checkpoint's names, so the passes over every name are C-level
    (suffix tests feeding a Counter of dtypes); only the few other names get a Python loop, and the
    experts' counts are all weights (scales) less theirs.
    """
    weights = Counter(compress(dtypes, map(str.endswith, names, repeat(".weight"))))
    scales = Counter(compress(dtypes, map(str.endswith, names, repeat(_SCALES))))
    linear_weights: Counter[str] = Counter()
    linear_scales: Counter[str] = Counter()
    for name, dtype in compress(zip(names, dtypes), map(not_, map(str.__contains__, names, repeat(_EXPERTS)))):
        if name.endswith(".weight"):
            linear_weights[dtype] += 1
        elif name.endswith(_SCALES):
            linear_scales[dtype] += 1
    expert_weights = weights - linear_weights
    lines = name_lines(names)
    return ShardTally(
        file=file,
        dtype_totals=totals,
        expert_weights=dict(expert_weights),
        expert_scales=dict(scales - linear_scales),
        linear_weights=dict(linear_weights),
        linear_scales=dict(linear_scales),
        first_expert_weight={dtype: _first_expert_weight(names, dtypes, dtype) for dtype in expert_weights},
        layers=sorted(layer_indices(names, lines=lines)),
        mtp=count_by_index(names, "mtp.", lines=lines),
        shape_kinds=shape_kinds(names, kinds, kind_of, lines),
    )


def _first_expert_weight(names: list[str], dtypes: list[str], dtype: str) -> str:
    return next(n for n, d in zip(names, dtypes) if d == dtype and _EXPERTS in n and n.endswith(".weight"))


def _most_common(counts: dict[str, int]) -> str | None:
    """The dtype with the most tensors; a tie goes to the one seen first."""
    return max(counts, key=counts.__getitem__) if counts else None


_DTYPE, _DTYPE_SHAPE = itemgetter(1), itemgetter(1, 2)


def _tally_header(header: ShardHeader) -> ShardTally:
    """The tally of a parsed header; its tensors' shapes by the header's kind numbers (no record per tensor)."""
    dtypes, shapes = header.dtypes, header.columns.shapes
    return tally_file(
        header.file, header.names, dtypes, header.dtype_totals, header.columns.kinds, lambda i: (dtypes[i], shapes[i])
    )


def inspect_tensors(
    source: str,
    tensors: dict[str, TensorInfo],
    config: V4Config | None,
    config_error: str | None = None,
    *,
    whole: bool = True,
    shards: Iterable[ShardHeader] | None = None,
) -> InspectReport:
    """Summarise a set of tensor headers (from local shards or the hub) against the config.

    ``whole=False`` (one ``.safetensors`` file of a checkpoint) skips the completeness verdict, which
    only means something for a whole checkpoint; absent MTP layers are still reported. ``shards``: the
    headers ``tensors`` came from, whose per-dtype totals (tallied while parsing) save a pass over every tensor.
    """
    with gc_paused():
        shards = list(shards) if shards is not None else []
        if sum(len(h.names) for h in shards) == len(tensors):
            tallies = [_tally_header(h) for h in shards]
        else:  # hub metadata: no parsed shards; group the tensors by file
            by_file: dict[str, dict[str, TensorInfo]] = {}
            for name, t in tensors.items():
                by_file.setdefault(t.file, {})[name] = t
            tallies = [
                tally_file(
                    f,
                    list(ts),
                    list(map(_DTYPE, ts.values())),
                    dtype_totals(ts.values()),
                    map(_DTYPE_SHAPE, ts.values()),
                )
                for f, ts in by_file.items()
            ]
        disagreement = None
        if config is not None and not kinds_agree(config, chain.from_iterable(t.shape_kinds for t in tallies)):
            disagreement = config_disagreement(config, tensors.values())  # tensor by tensor, to word it
        return summarize(source, tallies, tensors, config, config_error, whole=whole, disagreement=disagreement)


def _stored_format_problem(config: V4Config, names) -> str | None:
    """The routed experts stored in another format than config.json makes vLLM build (expert_format), if any."""
    try:
        require_stored_formats(config, names)
    except CheckpointError as exc:
        return str(exc)
    return None


def summarize(
    source: str,
    tallies: list[ShardTally],
    names: Collection[str],
    config: V4Config | None,
    config_error: str | None = None,
    *,
    whole: bool = True,
    completeness: Completeness | None = None,
    disagreement: Disagreement | None = None,
) -> InspectReport:
    """The report from per-file tallies (in file order) and every tensor name (for completeness, unless
    ``completeness`` already holds the verdict on those names). ``disagreement``: how the headers disagree
    with config.json, if they do (:func:`ckpt_tool.checkpoint.agreement.config_disagreement`)."""
    sums = _sum_tallies(tallies)
    quant = _quant_scheme(sums.quant_counts, config)
    expected = list(range(config.draft_layers)) if config else []
    missing = [i for i in expected if i not in sums.mtp_counts]
    problems: list[str] = [config_error] if config_error else []
    missing_tensors: dict[str, list[str]] = {}
    held = tensor_key_problem(config, names) if config is not None and whole else None
    if held is None and config is not None:
        held = _stored_format_problem(config, names)
    if held is not None:  # a key naming layers that hold other tensors: what else disagrees follows from it
        problems.append(held)
    elif config is not None:
        if whole and completeness is None:  # convert's verdict (both components)
            completeness = check_completeness(config, names, mtp_present=set(sums.mtp_counts))
        problems += _config_problems(config, sums, quant, missing, completeness if whole else None, disagreement)
        if whole:
            missing_tensors = completeness.missing_groups  # type: ignore[union-attr]
    file_count, dtype_bytes, mtp_counts = sums.file_count, sums.dtype_bytes, sums.mtp_counts
    return InspectReport(
        source=source,
        files=[FileSummary(f, file_count[f], sums.file_bytes[f]) for f in sorted(file_count)],
        tensor_count=sum(file_count.values()),
        total_bytes=sum(dtype_bytes.values()),
        dtypes=dict(sorted(sums.dtypes.items())),
        dtype_bytes=dict(sorted(dtype_bytes.items())),
        quant=quant,
        main_layers=sorted(sums.main_layers),
        mtp_expected=expected,
        mtp_present=sorted(mtp_counts),
        mtp_missing=missing,
        mtp_tensor_counts=dict(sorted(mtp_counts.items())),
        config_error=config_error,
        config=config,
        missing_tensors=missing_tensors,
        problems=problems,
    )


@dataclass
class _Sums:
    """The per-file tallies added up."""

    file_count: Counter[str] = field(default_factory=Counter)
    file_bytes: Counter[str] = field(default_factory=Counter)
    dtypes: Counter[str] = field(default_factory=Counter)
    dtype_bytes: Counter[str] = field(default_factory=Counter)
    quant_counts: dict[str, Counter[str]] = field(default_factory=lambda: {k: Counter() for k in _QUANT_FIELDS})
    first_expert_weight: dict[str, tuple[str, str]] = field(default_factory=dict)  # dtype -> (file, name)
    main_layers: set[int] = field(default_factory=set)
    mtp_counts: Counter[int] = field(default_factory=Counter)


def _sum_tallies(tallies: list[ShardTally]) -> _Sums:
    sums = _Sums()
    for t in tallies:
        for dtype, (count, size) in t.dtype_totals.items():
            sums.file_count[t.file] += count
            sums.file_bytes[t.file] += size
            sums.dtypes[dtype] += count
            sums.dtype_bytes[dtype] += size
        for key, counts in sums.quant_counts.items():
            counts.update(getattr(t, key))
        for dtype, name in t.first_expert_weight.items():  # each dtype's first routed-expert weight
            sums.first_expert_weight.setdefault(dtype, (t.file, name))
        sums.main_layers.update(t.layers)
        sums.mtp_counts.update(t.mtp)
    return sums


def _quant_scheme(quant_counts: dict[str, Counter[str]], config: V4Config | None) -> QuantScheme:
    expert_dtype = _most_common(quant_counts["expert_weights"])
    return QuantScheme(
        linear_weight_dtype="F8_E4M3" if quant_counts["linear_weights"]["F8_E4M3"] else None,
        linear_scale_dtype=_most_common(quant_counts["linear_scales"]),
        expert_weight_dtype=expert_dtype,
        expert_scale_dtype=_most_common(quant_counts["expert_scales"]),
        expert_format=STORED_FORMAT.get(expert_dtype or "", None),
        config_expert_dtype=config.expert_dtype if config else None,
    )


def _config_problems(
    config: V4Config,
    sums: _Sums,
    quant: QuantScheme,
    missing: list[int],
    completeness: Completeness | None,
    disagreement: Disagreement | None,
) -> list[str]:
    """Convert's verdicts against config.json, in its order (``completeness`` None: one shard of several, which
    is only told the draft layers it lacks). With a config.json that disagrees with the weights, what else it
    implies (tensors missing, another expert format) follows from that one cause: one line, not three."""
    problems: list[str] = []
    if disagreement is not None:
        problems.append(disagreement.message(config))
    if completeness is not None:
        if not completeness.complete and disagreement is None:
            problems.append(completeness.message(config))
    elif disagreement is None:
        problems += [absent_draft_layer(config, i) for i in missing]
    if not quant.consistent and disagreement is None:
        expert_dtype = quant.expert_weight_dtype
        file, name = sums.first_expert_weight[expert_dtype]  # type: ignore[index]
        problems.append(
            f"{file}: tensor {name!r}: config.json says expert_dtype {config.expert_dtype!r} but routed "
            f"experts are stored as {expert_dtype} ({quant.expert_format}); fix config.json or use the matching "
            "checkpoint"
        )
    return problems


def inspect_local(src: str) -> InspectReport:
    """inspect of a local folder, index file or single ``.safetensors`` file (raises CkptToolError)."""
    with gc_paused():
        report = None if src.endswith(".safetensors") else inspect_forked(src)
        if report is not None:
            return report
        ckpt = open_checkpoint(Path(src), need_config=False, forked=False)
        return inspect_tensors(
            src,
            ckpt.tensors,
            ckpt.config,
            ckpt.config_error,
            whole=not src.endswith(".safetensors"),
            shards=ckpt.shards.values(),
        )


def inspect_forked(src: str) -> InspectReport | None:
    """The report of a many-shard checkpoint, tallied by forked helpers while this process reads the index
    and checks completeness on its names (:func:`ckpt_tool.checkpoint.forked_read.read_shards_forked`); None where only
    the serial path can answer (it then gives the same report, or words the error: a header that
    disagrees with config.json is worded there, from the per-tensor records these tallies do not keep)."""
    read = read_shards_forked(
        src, _tally_file_at, need_config=False, wire=tuple, unwire=ShardTally._make, on_index=_completeness
    )
    if read is None:
        return None
    if read.config is not None and not kinds_agree(
        read.config, chain.from_iterable(t.shape_kinds for t in read.values)
    ):
        return None
    return summarize(src, read.values, read.weight_map, read.config, read.config_error, completeness=read.on_index)


def _tally_file_at(root: Path, file: str) -> tuple[ShardTally, list[str]]:
    header = read_shard_header(root / file, file)
    return _tally_header(header), header.names


def _completeness(config: V4Config | None, names: dict[str, str]) -> Completeness | None:
    return check_completeness(config, names) if config is not None else None
