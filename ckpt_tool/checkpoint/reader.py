"""Ranged reads of checkpoint files: the one module that decides how tensor bytes are read.

Every stage that reads tensor bytes reads them through here: convert's writer (the source), verify's values level
(the source, and each OUT file front to back), its numeric level (row tiles of both) and unconvert (OUT). What is
decided here, once:

- each file is opened once, read-only, and read positionally (``pread``), so threads share the descriptors;
- ``direct`` files are read with ``O_DIRECT`` where the file system allows it: whole 4 KiB pages into page-aligned
  memory, nothing copied through or left in the page cache (convert writes OUT that way, so it is not cached; the
  numeric level reads each source byte once). What the page cache already holds of a direct read's range is copied
  from there instead (``ckpt_tool.checkpoint.page_cache``: asked, not read; the disk would read it again, and a source
  verified right after convert is all cached); a range that is only partly cached is read a piece at a time, each
  from where it is, so no byte comes from the disk twice. A read under ``DIRECT_FROM`` bytes (the scales of one
  expert's rank slice: 32 KiB) goes through a second, buffered descriptor instead, without read-ahead
  (``POSIX_FADV_RANDOM``): the kernel's would read up to ``read_ahead_kb`` (8 MiB on this VM) of the weights beside
  it, which are read directly, so from the disk a second time (values level, 3-layer skeleton: 34.46 GiB read with
  it, 33.53 without); a file system that refuses ``O_DIRECT`` (at the open or at the first read) is read through the
  cache; ``CKPT_TOOL_DIRECT_IO=0`` turns direct I/O off everywhere (the writer's too);
- ``sequential`` files (convert's source) get the kernel's sequential read-ahead hint;
- a failed or short read is a :class:`CheckpointError` naming the file, the tensor and the byte range.

Where bytes come from is a :class:`ByteSource`: :class:`LocalFiles` (a folder, or absolute paths) here; a source
that is not on this disk (a hub repo read by HTTP range requests) is one more class with the same methods, handed
to the same callers by ``Checkpoint.open_bytes``.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from ckpt_tool.checkpoint import page_cache
from ckpt_tool.errors import CheckpointError
from ckpt_tool.processes import signal_free

DIRECT_ALIGN = 4096  # O_DIRECT offset/length/address granularity kept to (covers 512-byte devices too)
ALIGN = max(DIRECT_ALIGN, page_cache.PAGE)  # a direct read's bounds: also whole pages of the page cache, asked about
DIRECT_IO = os.environ.get("CKPT_TOOL_DIRECT_IO", "1") != "0" and hasattr(os, "O_DIRECT")
DIRECT_FROM = 256 * 1024  # reads of a direct file from this size on bypass the page cache; smaller ones do not
SEQUENTIAL_BLOCK = 8 * 1024 * 1024  # bytes a front-to-back read asks for at once


class ByteSource(Protocol):
    """Where a checkpoint's bytes come from: exact reads of byte ranges of its files, from any thread."""

    def read_into(self, file: str | Path, into: memoryview, offset: int, *, what: str = "") -> None:
        """Fill ``into`` from byte ``offset`` of ``file``, or raise a CheckpointError naming file and range."""

    def read_span(
        self,
        file: str | Path,
        offset: int,
        n: int,
        scratch: Scratch,
        *,
        what: str = "",
        short_ok: bool = False,
        again: bool = False,
    ) -> memoryview:
        """Bytes ``[offset, offset + n)`` of ``file`` as a view into ``scratch`` (a source may read more, aligned);
        ``again``: they will be read again, so a source with a cache keeps them there."""

    def close(self) -> None: ...


class RemoteSource(Protocol):
    """A checkpoint whose shards are not on this disk (a hub repo at one commit): opens byte sources of it, and
    keeps what was read of it before the tensors (each shard's raw header)."""

    commit: str

    def __call__(self) -> ByteSource: ...

    def header_bytes(self, file: str) -> bytes:
        """The JSON header of ``file`` as stored (without its 8-byte length)."""
        ...

    def spool_in(self, folder: Path, reads: Callable[[], Iterable[tuple[str, int, int]]] | None = None) -> None:
        """Byte sources opened from now on may keep fetched bytes in an unnamed file in ``folder``; ``reads``: every
        (file, offset, length) they will be asked for, where the caller knows (only bytes read again are kept)."""
        ...


class Scratch:
    """Page-aligned memory a caller reads into again and again (grown as needed); what a read returns from it is
    valid until the next read into it. Each few-MiB read into fresh memory costs a thousand page faults."""

    def __init__(self) -> None:
        self._buf: mmap.mmap | None = None

    def take(self, n: int) -> memoryview:
        if self._buf is None or len(self._buf) < n:  # (the old one is freed once no view of it is left)
            self._buf = mmap.mmap(-1, max(n, DIRECT_ALIGN))  # anonymous: page-aligned, as O_DIRECT wants
        return memoryview(self._buf)[:n]


def _where(file: str | Path, what: str, offset: int, n: int) -> str:
    return f"{file}: {what + ': ' if what else ''}bytes {offset}-{offset + n - 1}" if n else f"{file}"


class LocalFiles:
    """Files under ``root`` (or absolute paths), each opened on first use; see the module docstring for the policy.

    ``direct``: read with ``O_DIRECT`` where allowed (reads under ``DIRECT_FROM`` excepted).
    ``sequential``: the files are read mostly front to back, so the kernel may read ahead further.
    """

    def __init__(self, root: Path | None = None, *, direct: bool = False, sequential: bool = False) -> None:
        self.root = root
        self.direct = direct and DIRECT_IO
        self.sequential = sequential
        self._fds: dict[tuple[Path, bool], tuple[int, bool]] = {}  # (path, buffered wanted) -> (fd, is direct)
        self._retired: list[int] = []  # direct descriptors replaced by buffered ones
        self._lock = threading.Lock()

    def path(self, file: str | Path) -> Path:
        return Path(file) if self.root is None else self.root / file

    def _fd(self, file: str | Path, buffered: bool) -> tuple[int, bool]:
        path = self.path(file)
        key = (path, buffered or not self.direct)
        with self._lock:
            hit = self._fds.get(key)
            if hit is None:
                hit = self._fds[key] = self._open(path, direct=not key[1], small=key[1] and self.direct)
            return hit

    def _open(self, path: Path, direct: bool, small: bool = False) -> tuple[int, bool]:
        """A descriptor of ``path`` (and whether it reads directly). ``small``: the buffered one of a direct reader,
        for reads under ``DIRECT_FROM``, without read-ahead (see the module docstring)."""
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            if direct:
                try:
                    return os.open(path, flags | os.O_DIRECT), True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # the file system takes no O_DIRECT: read it through the cache
                        raise
            fd = os.open(path, flags)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be opened for reading ({exc.strerror})") from None
        hint = "POSIX_FADV_RANDOM" if small else "POSIX_FADV_SEQUENTIAL" if self.sequential else None
        if hint is not None and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, getattr(os, hint))
            except OSError:
                pass
        return fd, False

    def _refused_direct(self, file: str | Path) -> None:
        """The file system took the O_DIRECT open but not a read: read this file through the cache from now on."""
        path = self.path(file)
        with self._lock:
            fd, direct = self._fds[path, False]
            if direct:  # (another thread may have switched it already)
                self._retired.append(fd)  # closed with the others: a thread may still be reading it
                self._fds[path, False] = self._open(path, direct=False)

    def read_into(self, file: str | Path, into: memoryview, offset: int, *, what: str = "") -> None:
        """Fill ``into`` from byte ``offset`` of ``file`` through the cache; short means truncated or changed."""
        fd, _ = self._fd(file, buffered=True)
        got = self._pread(fd, file, into, offset, what)
        if got < len(into):
            raise CheckpointError(
                f"{_where(file, what, offset, len(into))}: file ended early at byte {offset + got}; was it truncated "
                "or modified?"
            )

    def read(self, file: str | Path, offset: int, n: int, *, what: str = "") -> bytearray:
        """Exactly ``n`` bytes from byte ``offset`` of ``file``, through the cache."""
        buf = bytearray(n)
        self.read_into(file, memoryview(buf), offset, what=what)
        return buf

    def read_span(
        self,
        file: str | Path,
        offset: int,
        n: int,
        scratch: Scratch,
        *,
        what: str = "",
        short_ok: bool = False,
        again: bool = False,
    ) -> memoryview:
        """Bytes ``[offset, offset + n)`` of ``file`` as a view into ``scratch`` (valid until its next read): read
        with ``O_DIRECT`` (whole pages, no copy) where this reader's policy says so and the page cache does not hold
        them (the pages it holds copied from it), else through the cache.
        ``short_ok``: a read past the end of the file returns what there is instead of raising. ``again``: the bytes
        will be read again, so through the page cache, where the next read finds them (both reads with ``again``)."""
        fd, direct = self._fd(file, buffered=n < DIRECT_FROM or again)
        if direct:
            a0 = offset - offset % ALIGN
            a1 = -(-(offset + n) // ALIGN) * ALIGN
            small, _ = self._fd(file, buffered=True)
            runs = page_cache.cached_runs(small, a0, a1, DIRECT_FROM)
            if runs is None:
                runs = [(a0, a1, False)]
            if runs == [(a0, a1, True)]:  # all cached: copied from there, no disk read (as a buffered reader reads)
                fd, direct = small, False
        if direct:
            page = scratch.take(a1 - a0)
            got = 0  # bytes from a0
            try:
                for r0, r1, cached in runs:  # each piece from where it is: the page cache, else the disk directly
                    into = page[r0 - a0 : r1 - a0]
                    got += self._pread(small if cached else fd, file, into, r0, what, direct=not cached)
                    if got < r1 - a0:  # the end of the file
                        break
            except _DirectRefused:
                self._refused_direct(file)
                return self.read_span(file, offset, n, scratch, what=what, short_ok=short_ok, again=again)
            view = page[offset - a0 : offset - a0 + max(0, min(n, got - (offset - a0)))]
        else:
            view = scratch.take(n)
            view = view[: self._pread(fd, file, view, offset, what)]
        if len(view) < n and not short_ok:
            raise CheckpointError(
                f"{_where(file, what, offset, n)}: file ended early at byte {offset + len(view)}; was it truncated or "
                "modified?"
            )
        return view

    def _pread(self, fd: int, file: str | Path, into: memoryview, offset: int, what: str, direct: bool = False) -> int:
        """Read into ``into`` from ``offset`` until it is full or the file ends; the bytes read. ``direct``: ``fd``
        was opened with O_DIRECT (EINVAL on its first read raises :class:`_DirectRefused`)."""
        got = 0
        while got < len(into):
            try:
                n = os.preadv(fd, [into[got:]], offset + got)
            except OSError as exc:
                if exc.errno == errno.EINVAL and got == 0 and direct:
                    raise _DirectRefused from None
                raise CheckpointError(
                    f"{_where(file, what, offset, len(into))}: cannot be read ({exc.strerror})"
                ) from None
            if n == 0:
                break
            got += n
            if direct and (offset + got) % DIRECT_ALIGN:  # a direct read ends short only at the end of the file
                break
        return got

    def close(self) -> None:
        with self._lock:
            for fd in [fd for fd, _ in self._fds.values()] + self._retired:
                os.close(fd)
            self._fds.clear()
            self._retired.clear()

    def __enter__(self) -> LocalFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DropBehind:
    """Drops byte ranges of files from the page cache once nothing will read them again (``posix_fadvise``
    ``DONTNEED``: the kernel drops the pages wholly inside a range; a page shared with bytes still wanted stays).
    verify's one pass reads every byte twice through the cache, the values walk then a numeric worker: what both
    have read goes, so what one has read and the other not yet is never pushed out by what neither needs. A no-op
    where the call is missing or refused."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def drop(self, path: Path, start: int, end: int) -> None:
        if end <= start or not hasattr(os, "posix_fadvise"):
            return
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    return
            try:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _DirectRefused(Exception):
    """A direct read the file system refused (EINVAL): the caller retries through the cache."""


class SequentialRead:
    """One file read front to back in ``block``-sized pieces, hashing every byte once: the values level compares
    an OUT file and checks its manifest sha256 on one read.

    The reads are ``direct`` ones (convert wrote OUT with ``O_DIRECT``: it is not in the page cache, and no copy goes
    through it), by a thread that stays ``DEPTH`` blocks ahead, so the disk works while the caller compares.
    ``direct=False``: through the page cache instead, for a caller that reads the bytes again soon (verify's numeric
    level in one pass).
    """

    DEPTH = 3  # blocks read ahead of the one being compared

    def __init__(self, path: Path, size: int, block: int = SEQUENTIAL_BLOCK, *, direct: bool = True) -> None:
        self.path, self.size, self.block_bytes, self.hash = path, size, block, hashlib.sha256()
        self.files = LocalFiles(direct=direct, sequential=not direct)
        self.free: queue.Queue = queue.Queue()
        self.full: queue.Queue = queue.Queue()
        for _ in range(self.DEPTH + 1):
            self.free.put(Scratch())
        self.block: Scratch | None = None  # the block being served
        self.view, self.block_start, self.block_len = memoryview(b""), 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=signal_free(self._prefetch), name="verify-read", daemon=True)
        self.thread.start()

    def _prefetch(self) -> None:
        pos = 0
        try:
            while pos < self.size and not self.stop.is_set():
                scratch = self.free.get()
                if scratch is None:
                    return
                want = min(self.block_bytes, self.size - pos)
                view = self.files.read_span(self.path, pos, want, scratch, short_ok=True)
                self.full.put((scratch, view, pos))
                if not view:
                    return
                pos += len(view)
        except BaseException as exc:  # handed to the reader, which raises it in the caller's thread
            self.full.put(exc)

    def _next_block(self) -> None:
        if self.block is not None:
            self.free.put(self.block)
        item = self.full.get()
        if isinstance(item, BaseException):
            raise item
        self.block, self.view, self.block_start = item
        self.block_len = len(self.view)
        if self.block_len == 0:
            raise CheckpointError(f"{self.path}: file ended early at byte {self.block_start}; was it modified?")
        self.hash.update(self.view)

    def read(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)``; calls must ask for increasing offsets (tensors in file order)."""
        if start < self.block_start:
            raise AssertionError("tensors must be read in file order")
        parts = []
        while n > 0:
            while self.block is None or start >= self.block_start + self.block_len:
                if self.block is not None and self.block_start + self.block_len >= self.size:
                    return b"".join(parts)  # past the end: the caller reports a short file
                self._next_block()
            lo = start - self.block_start
            take = min(n, self.block_len - lo)
            parts.append(bytes(self.view[lo : lo + take]))  # a copy: the block goes back to the prefetcher next
            start, n = start + take, n - take
        return b"".join(parts)

    def mismatch(self, start: int, want: bytes) -> int | None:
        """Where bytes ``[start, start + len(want))`` first differ from ``want`` (an offset into ``want``; None: they
        are equal), compared in place (``bytes.startswith`` over the blocks: a memcmp, no copy of the file's bytes).
        The range must lie within the file (``size``); the same order rule as :meth:`read`."""
        if start < self.block_start:
            raise AssertionError("tensors must be read in file order")
        if start + len(want) > self.size:
            raise AssertionError("a comparison past the end of the file")
        done = 0
        while done < len(want):
            while self.block is None or start >= self.block_start + self.block_len:
                self._next_block()
            lo = start - self.block_start
            take = min(len(want) - done, self.block_len - lo)
            piece = self.view[lo : lo + take]
            if not want.startswith(piece, done):  # (want[done:] starts with piece: the two equal, compared in place)
                same, differs = 0, take  # piece[:same] equal; the first difference is in [same, differs)
                while differs - same > 1:
                    mid = (same + differs) // 2
                    if want.startswith(piece[same:mid], done + same):
                        same = mid
                    else:
                        differs = mid
                return done + same
            start, done = start + take, done + take
        return None

    def hexdigest(self) -> str:
        while self.block_start + self.block_len < self.size:  # (an empty file asks for no block)
            self._next_block()
        return self.hash.hexdigest()

    def close(self) -> None:
        self.stop.set()
        self.free.put(None)  # wakes a prefetcher waiting for a buffer
        if self.block is not None:
            self.free.put(self.block)
        self.thread.join()
        self.view = memoryview(b"")
        self.files.close()


def sha256_file(path: Path, block: int = SEQUENTIAL_BLOCK) -> str:
    """sha256 of a file, read front to back as :class:`SequentialRead` reads (direct where allowed, read ahead)."""
    reader = SequentialRead(path, path.stat().st_size, block)
    try:
        return reader.hexdigest()
    finally:
        reader.close()
