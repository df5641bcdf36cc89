"""Which parts of a file range the page cache holds now, asked without reading a byte.

A direct reader (:class:`ckpt_tool.checkpoint.reader.LocalFiles`) asks before each large read: what the cache holds
is copied from it, the rest read with ``O_DIRECT``. Reading cached bytes from the disk again costs disk time the
cache has already paid: ``verify --level values`` right after ``convert`` (its source still cached) read 10.7 GiB
from the disk for 5.4 GiB of OUT and took 2.7 x convert's time.

How it asks (Linux only; elsewhere the answer is "unknown", ``None``, and the caller reads as it would without asking):

- ``cachestat(2)`` (Linux 6.5+, syscall 451 on every architecture: ``include/uapi/asm-generic/unistd.h``): the
  count of cached pages in a range, a few microseconds however large. Mixed ranges are halved until each piece is
  all cached, none cached, or at most ``least`` bytes (read through the cache: each byte still comes from the disk
  at most once). The kernel refuses it (EPERM) to a process that neither owns the file nor may write it
  (``mm/filemap.c``, ``can_do_cachestat``): unknown.
- where the kernel has no ``cachestat`` (ENOSYS), ``mincore(2)`` on a mapping of the range that is never touched:
  one byte a page, but ~50 us per MiB (a page-cache lookup per page). It answers truly only to the file's owner,
  one who may write it, or root (``mm/mincore.c``, ``can_do_mincore``, since Linux 5.0), and to anyone else
  reports every page cached; so it is asked only where that holds (:func:`_mincore_tells_truth`), else unknown.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable

PAGE = mmap.PAGESIZE
_CACHESTAT = 451
_BIT0 = bytes(b & 1 for b in range(256))  # mincore's vector: bit 0 of each byte is "resident", the rest reserved

Runs = list[tuple[int, int, bool]]
"""A range as pieces ``(first byte, end byte, through the cache)``, in order."""


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recent")]


def _bind() -> tuple[ctypes.CDLL | None, Callable | None]:
    """libc and its 64-bit-offset ``mmap``, typed (None, None off Linux or where they are missing)."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        map_fn = libc.mmap64 if hasattr(libc, "mmap64") else libc.mmap
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None, None
    map_fn.restype = ctypes.c_void_p
    map_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    return libc, map_fn


_LIBC, _MMAP = _bind()
_MAP_FAILED = ctypes.c_void_p(-1).value
_has_cachestat = _LIBC is not None  # until the kernel says ENOSYS


def _cachestat(fd: int, start: int, end: int) -> int | None:
    """Cached pages of ``[start, end)`` (``end > start``); None where ``cachestat`` is missing or refused."""
    global _has_cachestat
    if not _has_cachestat:
        return None
    stat = _Stat()
    if _LIBC.syscall(_CACHESTAT, fd, ctypes.byref(_Range(start, end - start)), ctypes.byref(stat), 0) == 0:
        return stat.nr_cache
    if ctypes.get_errno() == errno.ENOSYS:
        _has_cachestat = False
    return None


def _mincore_tells_truth(fd: int) -> bool:
    """The process owns ``fd``'s file, may write it, or is root (see the module docstring)."""
    euid = os.geteuid()
    return euid == 0 or os.fstat(fd).st_uid == euid or os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True)


def resident(fd: int, start: int, end: int) -> bytes | None:
    """``mincore``'s answer for ``[start, end)`` (multiples of :data:`PAGE`): one byte a page, 1 where the page cache
    holds that page now, 0 where not (and past the end of the file); None where it cannot be asked."""
    if _LIBC is None:
        return None
    if end <= start:
        return b""
    length = end - start
    addr = _MMAP(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        vec = ctypes.create_string_buffer(length // PAGE)
        if _LIBC.mincore(addr, length, vec) != 0:
            return None
        return vec.raw.translate(_BIT0)
    finally:
        _LIBC.munmap(addr, length)


def cached_runs(fd: int, start: int, end: int, least: int) -> Runs | None:
    """``[start, end)`` of ``fd``'s file (multiples of :data:`PAGE`) as pieces to read through the page cache (it
    holds some of them) or directly (it holds none): halved while mixed, down to ``least`` bytes, adjacent pieces
    alike merged. None: the cache cannot be asked here (the caller reads as it would without asking)."""
    if end <= start:
        return []
    count: Callable[[int, int], int | None] = lambda s, e: _cachestat(fd, s, e)  # noqa: E731
    whole = count(start, end)
    if whole is None:
        if _has_cachestat or not _mincore_tells_truth(fd):  # (refused: mincore would not tell the truth either)
            return None
        pages = resident(fd, start, end)
        if pages is None:
            return None
        count = lambda s, e: pages.count(1, (s - start) // PAGE, (e - start) // PAGE)  # noqa: E731
        whole = count(start, end)
    runs: Runs = []

    def split(s: int, e: int, n: int | None) -> None:
        n = n or 0  # (a failure midway: read that piece directly)
        if 0 < n < (e - s) // PAGE and e - s > least:
            mid = s + (e - s) // 2 // PAGE * PAGE
            split(s, mid, count(s, mid))
            split(mid, e, count(mid, e))
            return
        cached = n > 0
        if runs and runs[-1][2] == cached:
            runs[-1] = (runs[-1][0], e, cached)
        else:
            runs.append((s, e, cached))

    split(start, end, whole)
    return runs
