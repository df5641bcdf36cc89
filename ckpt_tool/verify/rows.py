"""Rows of safetensors tensors read with ``pread``, for the numeric level.

A tensor is seen as 2-D ``[prod(shape[:-1]), shape[-1]]`` (a stacked expert ``e`` of ``[E, N, K]`` is rows
``e*N .. (e+1)*N``). Reads go through :mod:`ckpt_tool.checkpoint.reader` into scratch memory the caller reuses (not
a mapping of the file, whose touched pages would count against RSS for the whole checkpoint), never more than the
rows asked for (rounded out to whole pages where a file is read with ``O_DIRECT``). FP8, E8M0 and packed FP4 bytes
come back as ``uint8`` (the quant functions and kernels take raw bytes). One reader serves many threads.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from ckpt_tool.checkpoint.dtypes import TORCH_NAMES
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.checkpoint.reader import ByteSource, LocalFiles, Scratch
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError

RAW_BYTES = ("F8_E4M3", "F8_E8M0", "I8", "U8")  # read as uint8: the quant functions and kernels take raw bytes
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: torch.uint8 if name in RAW_BYTES else getattr(torch, TORCH_NAMES[name])
    for name in (*RAW_BYTES, "BF16", "F16", "F32", "I64", "I32")
}
"""The dtypes the numeric level reads, and the torch dtype it reads each as."""


def source_info(ckpt: Checkpoint, name: str) -> TensorInfo:
    """The header of source tensor ``name`` (DeepSeek's name); CheckpointError if the checkpoint lacks it."""
    info = ckpt.tensors.get(name)
    if info is None:
        raise CheckpointError(f"source tensor {name!r} is not in the checkpoint")
    return info


def row_count(info: TensorInfo) -> int:
    """Rows of the 2-D view of ``info``."""
    return math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1


READ_TILE_BYTES = 4 * 1024 * 1024
"""Weight bytes the numeric level reads per tile and side (whole rows): large enough that a direct read
streams at disk speed, small enough that a few threads each holding a tile or two stay in tens of MiB."""


def read_tile_rows(n: int, row_bytes: int, align: int) -> int:
    """Rows per read tile of a tensor of ``n`` rows of ``row_bytes``: a multiple of ``align``, at least ``align``
    (one scale block), at most ``n``."""
    rows = max(align, (READ_TILE_BYTES // max(row_bytes, 1)) // align * align)
    return min(rows, max(n, 1))


TRIM_EVERY_BYTES = 256 * 1024 * 1024


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc); a no-op elsewhere. Called between verify stages."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class RowReader:
    """Reads row ranges of tensors through :mod:`ckpt_tool.checkpoint.reader` (its direct-I/O policy); each file
    opened once, read-only, and closed by :meth:`close`.

    Files under ``direct_root`` (the converted OUT: the writer wrote it with ``O_DIRECT``, so it is not in the page
    cache) are read with ``O_DIRECT``, other paths through the cache. ``source``: where :meth:`source_rows` reads
    the checkpoint's bytes (``Checkpoint.open_bytes``; the numeric level opens it direct: it reads each source byte
    once, so the page cache would only cost it — on the 15 GiB skeleton the level's system time fell from 28 to 10
    CPU s with the source read directly, ``bench/verify_bench.py``); without it, the checkpoint's files by path.

    ``into`` (a :class:`Scratch`) lets a caller that reads tile after tile reuse its memory.

    Every ``TRIM_EVERY_BYTES`` read it hands freed heap pages back to the OS: tiles of a few MiB freed
    between small long-lived tensors fragment glibc's heap, and without this the resident size of a
    full-width layer's forward climbs to GBs although the live data stay at tile size.
    """

    def __init__(self, direct_root: Path | None = None, *, source: ByteSource | None = None) -> None:
        self._direct_root = direct_root
        self._out = LocalFiles(direct=True)
        self._other = LocalFiles()
        self._source = source
        self._since_trim = 0
        self._trim = _malloc_trim()

    def _read(self, path: Path, pos: int, n: int, into: Scratch | None, what: str) -> torch.Tensor:
        """``n`` bytes at ``pos`` as a uint8 tensor (in ``into`` when given)."""
        files = self._out if self._direct_root is not None and path.is_relative_to(self._direct_root) else self._other
        view = files.read_span(path, pos, n, into if into is not None else Scratch(), what=what)
        return torch.frombuffer(view, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)

    def _read_source(self, file: str, pos: int, n: int, into: Scratch | None, what: str) -> torch.Tensor:
        assert self._source is not None
        view = self._source.read_span(file, pos, n, into if into is not None else Scratch(), what=what)
        return torch.frombuffer(view, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)

    def rows(
        self, path: Path, info: TensorInfo, r0: int, r1: int, into: Scratch | None = None, *, source: bool = False
    ) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``info`` (in file ``path``) as a ``[r1 - r0, last dim]`` tensor; read into ``into``
        when given (valid until its next read). ``source``: ``info`` is a source tensor, read from ``source``."""
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} has dtype {info.dtype}, which the numeric level does not read"
            )
        cols = info.shape[-1] if info.shape else 1
        size = dtype.itemsize
        row_bytes = cols * size
        if not 0 <= r0 <= r1 <= row_count(info):
            raise CheckpointError(f"{path}: tensor {info.name!r}: rows {r0}:{r1} outside its {row_count(info)} rows")
        n = (r1 - r0) * row_bytes
        what = f"tensor {info.name!r} rows {r0}:{r1}"
        if source:
            buf = self._read_source(info.file, info.start + r0 * row_bytes, n, into, what)
        else:
            buf = self._read(path, info.start + r0 * row_bytes, n, into, what)
        if n and buf.data_ptr() % size:  # a direct read of a tensor that starts off its dtype's alignment
            buf = buf.clone()
        self._since_trim += n  # (a lost update between threads only delays a trim)
        if self._since_trim >= TRIM_EVERY_BYTES and self._trim is not None:
            self._since_trim = 0
            self._trim(0)
        return buf.view(dtype).view(r1 - r0, cols)

    def source_rows(self, ckpt: Checkpoint, name: str, r0: int, r1: int, into: Scratch | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of source tensor ``name`` of ``ckpt`` (into ``into``, as :meth:`rows`)."""
        info = source_info(ckpt, name)
        return self.rows(ckpt.root / info.file, info, r0, r1, into, source=self._source is not None)

    def source_whole(self, ckpt: Checkpoint, info: TensorInfo) -> torch.Tensor:
        """The whole source tensor ``info`` in its own shape."""
        rows = self.rows(ckpt.root / info.file, info, 0, row_count(info), source=self._source is not None)
        return rows.reshape(info.shape)

    def whole(self, path: Path, info: TensorInfo) -> torch.Tensor:
        """The whole tensor in its own shape (for the small ones: norms, hc_*, sinks, biases, tables)."""
        return self.rows(path, info, 0, row_count(info)).reshape(info.shape)

    def close(self) -> None:
        self._out.close()
        self._other.close()
        if self._source is not None:
            self._source.close()

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
