"""What a conversion plan is: the options that shape the output (:class:`Options`), and per output file, per
tensor, the :class:`Segment` byte gathers (and zero fills) the writer executes (:class:`Plan`).

:func:`ckpt_tool.mapping.planner.plan_conversion` makes one from headers. An output tensor's segments are made on
demand (:class:`Segments`): all experts of a stack share one period of row/column bounds, and a V4 plan at tp 8
would otherwise hold half a million Segment objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.mapping.profiles import DEFAULT_PROFILE, canonical_name

GiB = 1024**3


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
    # NVFP4 experts under ep: "global" (every rank holds every expert's input scales, as vLLM's FlashInfer NVFP4 MoE
    # backends keep them: Blackwell's default) or "local" (the rank's own, as the other backends); a plan keeps it only
    # where it changes the bytes (NVFP4 experts, --moe-parallel ep)
    nvfp4_input_scales: str | None = None

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
        if self.vllm_series is not None:
            doc["vllm_series"] = self.vllm_series
        if self.nvfp4_input_scales is not None:
            doc["nvfp4_input_scales"] = self.nvfp4_input_scales
        return doc


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


def out_tensor(
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
