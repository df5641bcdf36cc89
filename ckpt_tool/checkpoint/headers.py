"""A safetensors header: what it says (:class:`TensorInfo`, :class:`ShardHeader`) and how it is read and validated,
without touching tensor bytes. (The index is :mod:`ckpt_tool.checkpoint.index`.)

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of UTF-8 JSON + a byte buffer. The JSON
maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
buffer) plus an optional ``__metadata__`` string map. We validate the way the Rust reference does,
and a little more (duplicate keys, leading ``{``, trailing bytes), because the streaming writer
copies byte ranges straight from these offsets: a header we accept must describe the file exactly.

This module imports neither torch nor numpy: inspect and planning stay fast.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import chain, count, repeat
from operator import add, itemgetter, sub
from pathlib import Path
from typing import NamedTuple

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.gc_pause import gc_paused
from ckpt_tool.checkpoint.identity import FileIdentity
from ckpt_tool.checkpoint.paths import not_a_regular_file
from ckpt_tool.checkpoint.strict_json import DuplicateKey, FloatInJSON, json_problem, no_float, reject_duplicates
from ckpt_tool.errors import CheckpointError, HeaderError

MAX_HEADER_SIZE = 100_000_000  # the Rust reference's MAX_HEADER_SIZE
MAX_INT = 2**64 - 1  # shapes and offsets are u64/usize in the reference; bigger numbers are corrupt
CORRUPT = "the file is corrupt — download it again"  # what to do about a header we cannot trust


class TensorInfo(NamedTuple):
    """One tensor as a header describes it. ``start``/``end`` are absolute offsets in ``file``.

    An immutable record like the others, but a NamedTuple rather than a frozen dataclass: a V4
    checkpoint has 69k-145k of these, and building one costs a third of a frozen dataclass's ``__init__``
    (the header path is interactive: ``inspect`` in 0.3 s).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # shard file name, relative to the checkpoint root
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Columns(NamedTuple):
    """A parsed header's per-tensor shapes and offsets as plain lists, in file order: what
    :attr:`ShardHeader.tensors` is built from, and part of what a forked helper hands back."""

    kinds: list[int]  # each tensor's kind (dtype and shape), a key of ``shapes``
    shapes: dict[int, tuple[int, ...]]
    begins: list[int]  # offsets in the data buffer (after the header)
    ends: list[int]


@dataclass(frozen=True, eq=False)
class ShardHeader:
    """A validated safetensors header. ``names``, ``dtypes`` and ``tensors`` are in offset (file) order.

    ``tensors`` is built from ``columns`` on first use: inspect needs only the names, dtypes and
    per-dtype totals, and a record per tensor was a tenth of its time. (Equality is identity.)
    """

    file: str
    header_len: int
    file_size: int
    metadata: dict[str, str]
    names: list[str] = field(repr=False)
    dtypes: list[str] = field(repr=False)
    columns: Columns = field(repr=False)
    header_sha256: str = ""
    dtype_totals: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)  # dtype -> (tensors, bytes)
    identity: FileIdentity | None = None  # the file as it was when this header was read (None: not read from a file)

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        kinds, shapes, begins, ends = self.columns
        start = self.data_start
        infos = zip(
            self.names,
            self.dtypes,
            map(shapes.__getitem__, kinds),
            repeat(self.file),
            map(add, begins, repeat(start)),
            map(add, ends, repeat(start)),
        )
        with gc_paused():
            return dict(zip(self.names, map(tuple.__new__, repeat(TensorInfo), infos)))

    def to_wire(self) -> tuple:
        """This header as builtins only (for ``marshal``); :meth:`from_wire` makes it again."""
        return (
            self.file,
            self.header_len,
            self.file_size,
            self.metadata,
            self.names,
            self.dtypes,
            tuple(self.columns),
            self.header_sha256,
            self.dtype_totals,
            None if self.identity is None else tuple(self.identity),
        )

    @classmethod
    def from_wire(cls, wire: tuple) -> ShardHeader:
        file, header_len, file_size, metadata, names, dtypes, columns, sha, totals, identity = wire
        identity = None if identity is None else FileIdentity(*identity)
        return cls(file, header_len, file_size, metadata, names, dtypes, Columns(*columns), sha, totals, identity)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of ``dtype`` and ``shape`` occupies; raises ValueError if bits do not pack to bytes."""
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    if bits % 8:
        raise ValueError(f"{dtype} tensor of shape {list(shape)} is not a whole number of bytes")
    return bits // 8


def _loads(text: str, file: str, parse_float=None) -> object:
    try:
        return json.loads(text, object_pairs_hook=reject_duplicates, parse_float=parse_float)
    except DuplicateKey as dup:
        raise HeaderError(
            file,
            f"key appears twice in a header object; tensor names and entry fields must be unique; {CORRUPT}",
            tensor=dup.key,
        ) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, and ints over sys.get_int_max_str_digits()
        raise HeaderError(file, f"header is not valid JSON ({json_problem(exc)}); {CORRUPT}") from None


def parse_header(raw: bytes, file: str, file_size: int, header_len: int | None = None) -> ShardHeader:
    """Validate a header's JSON bytes against a file of ``file_size`` bytes.

    ``raw`` is the JSON text (without the 8-byte length prefix). Every violation raises
    :class:`HeaderError` naming ``file`` and, where there is one, the tensor.

    Two paths accept exactly the same headers: a quick one for the shape every writer emits (plain
    JSON, tensors in offset order), which gives up at the first thing it does not expect, and the
    careful one, which then finds the problem and words it.
    """
    header_len = len(raw) if header_len is None else header_len
    data_start = 8 + header_len
    with gc_paused():
        tensors = _quick_tensors(raw, file, data_start, file_size - data_start)
    if tensors is None:
        return _parse_careful(raw, file, file_size, header_len)
    metadata, names, dtypes, columns, totals = tensors
    return ShardHeader(
        file=file,
        header_len=header_len,
        file_size=file_size,
        metadata=metadata,
        names=names,
        dtypes=dtypes,
        columns=columns,
        header_sha256=hashlib.sha256(raw).hexdigest(),
        dtype_totals=totals,
    )


_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def _quick_tensors(
    raw: bytes, file: str, data_start: int, buffer_len: int
) -> tuple[dict[str, str], list[str], list[str], Columns, dict[str, tuple[int, int]]] | None:
    """(metadata, names, dtypes, columns, dtype totals) of a well-formed header in offset order, or None
    for anything else.

    Every step is a C-level pass over all entries (``map``, list equality, a Counter-free dict): a
    per-entry Python loop cost as much as the JSON parse itself. The C JSON parser keeps the last of
    repeated keys silently; no key repeats, no string holds a ``:`` and no entry nests an object exactly
    when the text's colons number the members parsed. Each distinct (dtype, shape) gets the full
    per-tensor checks once; offsets must tile the buffer in the order listed.
    """
    try:
        text = raw.decode("utf-8")
        if not text.lstrip(" ").startswith("{"):
            return None
        doc = json.loads(text, parse_float=no_float)
        if type(doc) is not dict:
            return None
        metadata = doc.pop("__metadata__", None)
        members = len(doc)
        if metadata is not None:
            if type(metadata) is not dict or not all(type(k) is str and type(v) is str for k, v in metadata.items()):
                return None
            members += 1 + len(metadata)
        names, entries = list(doc), list(doc.values())
        if set(map(len, entries)) - {3} or text.count(":") != members + 3 * len(entries):
            return None  # (len() of a non-object entry: a TypeError, or a count that is not 3)
        dtypes = list(map(_DTYPE, entries))  # KeyError: a field missing; TypeError: not an object
        shapes = list(map(_SHAPE, entries))
        keys = list(zip(dtypes, map(tuple, shapes)))
        offsets = list(map(_OFFSETS, entries))
        if set(map(len, offsets)) - {2}:
            return None
        begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
        # JSON true/false parse as bools, which equal 1/0 in every comparison below: only ints pass
        if not set(map(type, chain(begins, ends, chain.from_iterable(shapes)))) <= {int}:
            return None
        # (dtype, shape) kinds hashed once: each entry gets its kind's id, the position of the kind's first
        # tensor (setdefault keeps the first position it was offered); everything per kind is looked up by id
        kinds: dict[tuple, int] = {}
        ids = list(map(kinds.setdefault, keys, count()))
        known = {
            i: _tensor_entry(file, names[i], entries[i], data_start) for i in kinds.values()
        }  # full checks, once a kind
        if (begins[:1] or [0]) != [0] or begins[1:] != ends[:-1] or (ends[-1:] or [0]) != [buffer_len]:
            return (
                None  # out of offset order, a gap, an overlap, truncated or trailing bytes: worded by the careful path
            )
        nbytes = {i: info.nbytes for i, info in known.items()}
        if list(map(sub, ends, begins)) != list(map(nbytes.__getitem__, ids)):
            return None
        # one dtype string per kind (JSON gives each entry its own): the tallies over 145k dtypes that
        # inspect and planning do then hash and compare a handful of objects that stay in cache
        dtypes = list(map({i: dtypes[i] for i in known}.__getitem__, ids))
        columns = Columns(ids, {i: info.shape for i, info in known.items()}, begins, ends)  # one shape tuple per kind
        totals: dict[str, tuple[int, int]] = {}
        for i, n in Counter(ids).items():  # a few dozen kinds: inspect sums these, not 69k tensors
            have, size = totals.get(dtypes[i], (0, 0))
            totals[dtypes[i]] = (have + n, size + n * nbytes[i])
        return dict(metadata or {}), names, dtypes, columns, totals
    except (ValueError, TypeError, KeyError, RecursionError, FloatInJSON, HeaderError):
        return None


def _parse_careful(raw: bytes, file: str, file_size: int, header_len: int) -> ShardHeader:
    """:func:`parse_header`'s exact checks, one tensor at a time, each violation worded."""
    text = _careful_text(raw, file)
    doc, floats = _careful_doc(text, file)
    metadata = _careful_metadata(doc, file)
    data_start = 8 + header_len
    infos = _careful_entries(doc, file, data_start, floats or "true" in text or "false" in text)
    _require_tiling(infos, file, file_size, data_start)
    return ShardHeader(
        file=file,
        header_len=header_len,
        file_size=file_size,
        metadata=dict(metadata),
        names=[t.name for t in infos],
        dtypes=[t.dtype for t in infos],
        columns=Columns(
            list(range(len(infos))),
            {i: t.shape for i, t in enumerate(infos)},
            [t.start - data_start for t in infos],
            [t.end - data_start for t in infos],
        ),
        header_sha256=hashlib.sha256(raw).hexdigest(),
        dtype_totals=dtype_totals(infos),
    )


def _careful_text(raw: bytes, file: str) -> str:
    """The header's text: UTF-8 that starts (after spaces) with ``{``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(file, f"header is not valid UTF-8 ({exc.reason} at byte {exc.start}); {CORRUPT}") from None
    if not text.lstrip(" ").startswith("{"):
        raise HeaderError(
            file,
            "header is not a JSON object (does not start with '{'); the file is not safetensors — download it again",
        )
    return text


def _careful_doc(text: str, file: str) -> tuple[dict, bool]:
    """The header's JSON object, and whether it holds a float (parsed as one, so the field checks word it)."""
    try:
        with gc_paused():
            doc = _loads(text, file, parse_float=no_float)
    except FloatInJSON:  # never valid in a header; parsed again as floats so the field checks word the complaint
        doc = _loads(text, file, parse_float=None)
        floats = True
    else:
        floats = False
    if not isinstance(doc, dict):
        raise HeaderError(file, f"header is a JSON {type(doc).__name__}, expected an object; {CORRUPT}")
    return doc, floats


def _careful_metadata(doc: dict, file: str) -> dict[str, str]:
    """``__metadata__`` taken out of ``doc``: a string → string map (empty when absent)."""
    metadata = doc.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError(file, f"__metadata__ must map strings to strings; {CORRUPT}")
    return metadata


def _careful_entries(doc: dict, file: str, data_start: int, every_entry: bool) -> list[TensorInfo]:
    """Every entry of ``doc`` checked (``every_entry``: with the full checks each, else once per dtype and shape)."""
    # (dtype, *shape) -> (shape tuple, nbytes) once validated: a V4 shard has a few dozen distinct ones
    # among ~1500 tensors. JSON true/false and floats equal ints as keys, so a header with those takes the
    # full checks for every tensor.
    sizes: dict[tuple, tuple[tuple[int, ...], int]] | None = None if every_entry else {}
    infos: list[TensorInfo] = []
    append = infos.append
    with gc_paused():
        for name, entry in doc.items():
            if sizes is not None and type(entry) is dict and len(entry) == 3:
                dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
                if type(shape) is list and type(offsets) is list and len(offsets) == 2:
                    try:
                        key = (dtype, *shape)
                        known = sizes.get(key)
                    except TypeError:  # an unhashable shape element: the full checks name it
                        key, known = None, None
                    begin, end = offsets
                    if (
                        known is not None
                        and type(begin) is int
                        and type(end) is int
                        and 0 <= begin
                        and end - begin == known[1]
                        and end <= MAX_INT
                    ):
                        append(TensorInfo(name, dtype, known[0], file, data_start + begin, data_start + end))
                        continue
                    info = _tensor_entry(file, name, entry, data_start)
                    if key is not None:
                        sizes[key] = (info.shape, info.nbytes)
                    append(info)
                    continue
            append(_tensor_entry(file, name, entry, data_start))
    return infos


def _require_tiling(infos: list[TensorInfo], file: str, file_size: int, data_start: int) -> None:
    """The tensors' bytes tile the data buffer exactly (``infos`` sorted by offset where they were not)."""
    buffer_len = file_size - data_start
    # Contiguous from 0, no gaps, no overlap, buffer used exactly (trailing bytes are rejected too).
    # Writers emit tensors in offset order: one pass confirms it; otherwise sort and say where it breaks.
    cursor = data_start
    in_order = True
    for info in infos:
        if info.start != cursor:
            in_order = False
            break
        cursor = info.end
    if not in_order:
        infos.sort(key=lambda t: (t.start, t.end))
        cursor = data_start
        for info in infos:
            if info.start != cursor:
                what = "overlaps the previous tensor" if info.start < cursor else "leaves a gap before it"
                raise HeaderError(
                    file,
                    f"data_offsets start at {info.start - data_start} but the previous tensor ends at "
                    f"{cursor - data_start}: the tensor {what}; {CORRUPT}",
                    tensor=info.name,
                )
            cursor = info.end
    used = cursor - data_start
    if used > buffer_len:
        last = infos[-1].name if infos else None
        raise HeaderError(
            file,
            f"data ends at byte {cursor} but the file has only {file_size} bytes: the file is truncated "
            f"({cursor - file_size} bytes missing); download it again",
            tensor=last,
        )
    if used < buffer_len:
        raise HeaderError(
            file,
            f"{buffer_len - used} trailing bytes after the last tensor; the file is not a clean safetensors file — "
            "download it again",
        )


def dtype_totals(infos: Iterable[TensorInfo]) -> dict[str, tuple[int, int]]:
    """dtype -> (tensor count, bytes) of ``infos``."""
    totals: dict[str, tuple[int, int]] = {}
    for t in infos:
        have, size = totals.get(t.dtype, (0, 0))
        totals[t.dtype] = (have + 1, size + t.end - t.start)
    return totals


def _small_uints(values: list) -> bool:
    for v in values:
        if type(v) is not int or v < 0 or v > MAX_INT:
            return False
    return True


def _tensor_entry(file: str, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(file, f"header entry is not an object; {CORRUPT}", tensor=name)
    # this runs ~69k times for a full V4 checkpoint: cheap checks first, details only on failure
    if len(entry) != 3 or "dtype" not in entry or "shape" not in entry or "data_offsets" not in entry:
        raise HeaderError(
            file,
            f"header entry must have exactly dtype, shape, data_offsets (got {sorted(entry)}); {CORRUPT}",
            tensor=name,
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(
            file,
            f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)}); the file is corrupt or newer than this tool — "
            "download it again or upgrade ckpt-tool",
            tensor=name,
        )
    if type(shape) is not list or not _small_uints(shape):
        raise HeaderError(
            file, f"shape {shape!r} is not a list of non-negative integers (below 2^64); {CORRUPT}", tensor=name
        )
    if type(offsets) is not list or len(offsets) != 2 or not _small_uints(offsets):
        raise HeaderError(
            file, f"data_offsets {offsets!r} is not two non-negative integers (below 2^64); {CORRUPT}", tensor=name
        )
    begin, end = offsets
    if math.prod(shape) > MAX_INT:
        raise HeaderError(file, f"shape has more than 2^64 elements; {CORRUPT}", tensor=name)
    if end < begin:
        raise HeaderError(file, f"data_offsets {offsets} end before they begin; {CORRUPT}", tensor=name)
    try:
        want = expected_nbytes(dtype, tuple(shape))
    except ValueError as exc:
        raise HeaderError(file, f"{exc}; {CORRUPT}", tensor=name) from None
    if want != end - begin:
        raise HeaderError(
            file,
            f"shape {shape} x {dtype} needs {want} bytes but data_offsets {offsets} hold {end - begin}; {CORRUPT}",
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), file, data_start + begin, data_start + end)


def read_shard_header(path: Path, file: str | None = None) -> ShardHeader:
    """Read and validate the header of the safetensors file at ``path`` (no tensor bytes are read)."""
    file = file or path.name
    kind = not_a_regular_file(path)
    if kind not in (None, "missing"):  # never open it: a named pipe would block until someone wrote to it
        raise CheckpointError(f"{file}: is {kind}, expected a safetensors file ({path}); not opened — put it there")
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            size = st.st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise HeaderError(
                    file,
                    f"file is {size} bytes, too small to be safetensors (needs an 8-byte header length); {CORRUPT}",
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_SIZE:
                raise HeaderError(
                    file, f"header length {header_len} exceeds the {MAX_HEADER_SIZE}-byte limit; {CORRUPT}"
                )
            if 8 + header_len > size:
                raise HeaderError(
                    file,
                    f"header length {header_len} points past the end of the {size}-byte file; "
                    "the file is truncated or not safetensors — download it again",
                )
            raw = fh.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found ({path})") from None
    except IsADirectoryError:
        raise CheckpointError(f"{file}: is a folder, expected a safetensors file ({path})") from None
    except PermissionError:
        raise CheckpointError(f"{file}: permission denied reading {path}") from None
    except OSError as exc:
        raise CheckpointError(
            f"{file}: cannot read {path} ({exc.strerror or exc}); check the file or fetch it again"
        ) from None
    return replace(parse_header(raw, file, size, header_len), identity=FileIdentity.of_stat(st))
