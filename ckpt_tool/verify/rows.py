"""Rows of safetensors tensors read with ``pread``, for the numeric level.

A tensor is seen as 2-D ``[prod(shape[:-1]), shape[-1]]`` (a stacked expert ``e`` of ``[E, N, K]`` is rows
``e*N .. (e+1)*N``). Reads go straight into a fresh torch buffer: no mmap, whose touched pages would
count against RSS for the whole checkpoint, and never more than the rows asked for (rounded out to whole
pages where a file is read with ``O_DIRECT``). FP8, E8M0 and packed FP4 bytes come back as ``uint8`` (the
quant functions and kernels take raw bytes). One reader serves many threads (``pread`` is positional).
"""

from __future__ import annotations

import errno
import math
import os
import threading
from pathlib import Path

import torch

from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.uint8,
    "F8_E8M0": torch.uint8,
    "I8": torch.uint8,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I32": torch.int32,
}


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
DIRECT_FROM = 256 * 1024
"""Reads of a file opened with ``O_DIRECT`` from this size on bypass the page cache; smaller ones (scales) do not
(see :class:`RowReader`)."""


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc); a no-op elsewhere. Called between verify stages."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class ReadBuffer:
    """Memory a caller reads tiles into again and again (one per thread and role: the source tile, a rank's
    tile, their scales). Each 4 MiB tile read into fresh memory costs a thousand page faults, which were a
    fifth of the numeric level's CPU time. A tensor read into it is valid until the next read into it."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def take(self, n: int, align: int) -> torch.Tensor:
        """``n`` bytes starting at a multiple of ``align`` (grown as needed)."""
        lead = -self._buf.data_ptr() % align
        if self._buf.numel() < lead + n:
            self._buf = torch.empty(n + align, dtype=torch.uint8)
            lead = -self._buf.data_ptr() % align
        return self._buf[lead : lead + n]


class RowReader:
    """Reads row ranges of tensors; each file is opened once, read-only, and closed by :meth:`close`.

    Files under ``direct_root`` (the converted OUT: the writer wrote it with ``O_DIRECT``, so it is not in
    the page cache) are read with ``O_DIRECT`` where the file system allows: each read rounded out to whole
    pages into an aligned buffer, nothing copied through or left in the page cache, which keeps the cache for
    the files read through it. ``CKPT_TOOL_DIRECT_IO=0`` (or a file system that refuses) reads them through the cache.

    ``direct_source``: every other file (the source) is read with ``O_DIRECT`` as well. The numeric level
    reads each source byte once, so the page cache would only cost it: on the 15 GiB skeleton the level's
    system time fell from 28 to 10 CPU s with the source read directly (``bench/verify_bench.py``).

    Reads smaller than ``DIRECT_FROM`` (the scales of one rank's slice of a routed expert: 32 KiB) go through
    the page cache even there, on a second descriptor: the kernel's read-ahead then serves the next experts'
    scales from one larger read, shared by every process reading the file, where each 32 KiB direct read would
    wait for the disk alone.

    ``into`` (a :class:`ReadBuffer`) lets a caller that reads tile after tile reuse its memory.

    Every ``TRIM_EVERY_BYTES`` read it hands freed heap pages back to the OS: tiles of a few MiB freed
    between small long-lived tensors fragment glibc's heap, and without this the resident size of a
    full-width layer's forward climbs to GBs although the live data stay at tile size.
    """

    def __init__(self, direct_root: Path | None = None, *, direct_source: bool = False) -> None:
        from ckpt_tool.output.writer import DIRECT_IO

        # (path, for small reads) -> (fd, direct): a file read with O_DIRECT gets a second, buffered descriptor for
        # reads under DIRECT_FROM
        self._fds: dict[tuple[Path, bool], tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self._direct_root = direct_root if DIRECT_IO else None
        self._direct_source = direct_source and DIRECT_IO
        self._since_trim = 0
        self._trim = _malloc_trim()

    def _fd(self, path: Path, small: bool = False) -> tuple[int, bool]:
        """``(fd, direct)`` of ``path``, opened on first use; ``small``: the buffered one, for small reads."""
        with self._lock:
            hit = self._fds.get((path, small))
            if hit is None:
                hit = self._fds[path, small] = self._open(path, direct_ok=not small)
            return hit

    def _open(self, path: Path, direct_ok: bool) -> tuple[int, bool]:
        direct = self._direct_source or (self._direct_root is not None and path.is_relative_to(self._direct_root))
        try:
            if direct and direct_ok:
                try:
                    return os.open(path, os.O_RDONLY | os.O_DIRECT), True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # the file system takes no O_DIRECT: read it through the cache
                        raise
            return os.open(path, os.O_RDONLY), False
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None

    def _read(self, path: Path, pos: int, n: int, into: ReadBuffer | None = None) -> torch.Tensor:
        """``n`` bytes at ``pos`` as a uint8 tensor (in ``into`` when given); short only where the file is."""
        fd, direct = self._fd(path)
        if direct and n < DIRECT_FROM:
            fd, direct = self._fd(path, small=True)
        if direct:
            return self._read_direct(path, fd, pos, n, into)
        buf = into.take(n, 64) if into is not None else torch.empty(n, dtype=torch.uint8)
        got = os.preadv(fd, [buf.numpy()], pos) if n else 0
        return buf[:got]

    def _read_direct(self, path: Path, fd: int, pos: int, n: int, into: ReadBuffer | None = None) -> torch.Tensor:
        """``_read`` with ``O_DIRECT``: whole pages into a page-aligned buffer, the bytes asked for viewed out."""
        from ckpt_tool.output.writer import DIRECT_ALIGN

        a0 = pos - pos % DIRECT_ALIGN
        a1 = -(-(pos + n) // DIRECT_ALIGN) * DIRECT_ALIGN
        if into is not None:
            page = into.take(a1 - a0, DIRECT_ALIGN)
        else:
            buf = torch.empty(a1 - a0 + DIRECT_ALIGN, dtype=torch.uint8)
            lead = -buf.data_ptr() % DIRECT_ALIGN  # the page-aligned start O_DIRECT wants
            page = buf[lead : lead + a1 - a0]
        try:
            got = os.preadv(fd, [page.numpy()], a0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            with self._lock:  # the file system took the open but not the read: read it through the cache
                self._fds[path, False] = (os.open(path, os.O_RDONLY), False)
            return self._read(path, pos, n, into)
        skip = pos - a0
        return page[skip : skip + max(0, min(n, got - skip))]

    def rows(self, path: Path, info: TensorInfo, r0: int, r1: int, into: ReadBuffer | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``info`` (in file ``path``) as a ``[r1 - r0, last dim]`` tensor; read into ``into``
        when given (valid until its next read)."""
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
        buf = self._read(path, info.start + r0 * row_bytes, n, into)
        if buf.numel() != n:
            raise CheckpointError(f"{path}: tensor {info.name!r}: file ended early; was it modified?")
        if buf.storage_offset() % size:  # a direct read of a tensor that starts off its dtype's alignment
            buf = buf.clone()
        self._since_trim += n  # (a lost update between threads only delays a trim)
        if self._since_trim >= TRIM_EVERY_BYTES and self._trim is not None:
            self._since_trim = 0
            self._trim(0)
        return buf.view(dtype).view(r1 - r0, cols)

    def source_rows(
        self, ckpt: Checkpoint, name: str, r0: int, r1: int, into: ReadBuffer | None = None
    ) -> torch.Tensor:
        """Rows ``[r0, r1)`` of source tensor ``name`` of ``ckpt`` (into ``into``, as :meth:`rows`)."""
        info = source_info(ckpt, name)
        return self.rows(ckpt.root / info.file, info, r0, r1, into)

    def whole(self, path: Path, info: TensorInfo) -> torch.Tensor:
        """The whole tensor in its own shape (for the small ones: norms, hc_*, sinks, biases, tables)."""
        return self.rows(path, info, 0, row_count(info)).reshape(info.shape)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
