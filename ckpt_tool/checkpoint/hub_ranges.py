"""Byte ranges of hub files, read straight from the hub: the hub backend of the checkpoint byte reader.

:class:`HubRangeReader` is a :class:`ckpt_tool.checkpoint.reader.ByteSource`: it answers ``read_into`` and
``read_span`` as :class:`~ckpt_tool.checkpoint.reader.LocalFiles` does for a local folder, with HTTP range
requests on the resolve URL of one commit (``/{repo}/resolve/{commit}/{file}``), resolved once by
:func:`ckpt_tool.checkpoint.hub.resolve_commit`: a branch that moves during a run cannot mix two commits.

A file is cut into aligned chunks (``chunk_bytes``; the last one of a file shorter). A read is served from an
LRU cache of chunks; the chunks it misses are fetched with one range request per run of adjacent missing chunks,
and a chunk another thread is already fetching is waited for, not fetched again. The cache holds at most
``cache_bytes``; on top of it each fetch in progress holds the one chunk it is filling, and at most ``workers + 1``
fetches run at once. :meth:`prefetch` starts fetches on ``workers`` background threads so several requests are in
flight. With a spool (``spool_dir``), a chunk the cache lets go that will be read again is written to an unnamed
local file by a thread of its own, so that a fetch never waits on the local disk; until it is written it is still
read from memory (at most ``SPILL_QUEUE`` chunks wait).

Requests go through huggingface_hub's own HTTP client (``get_session``, the URL from ``hf_hub_url``, the token and
user agent from ``build_hf_headers``): proxies, ``HF_ENDPOINT`` and a client factory set by the user apply. The
retry loop is ours, not ``http_backoff``'s, because a range must resume from the byte it reached when the
connection drops mid-body, a body of the wrong length must be refused, the wait must be bounded and every request
counted; ``http_backoff`` does none of these for a streamed body.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import re
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2
import numpy as np
from huggingface_hub import constants, hf_hub_url
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, parse_ratelimit_headers

from ckpt_tool import __version__
from ckpt_tool.checkpoint.hub import HubRef, network_error
from ckpt_tool.checkpoint.reader import Scratch
from ckpt_tool.errors import CheckpointError
from ckpt_tool.processes import signal_free, stop_signals_to_main

log = logging.getLogger(__name__)

MiB = 1 << 20
# The statuses huggingface_hub retries (2.4.0, utils/_http.py, _DEFAULT_RETRY_ON_STATUS_CODES).
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard one range is tried before the read fails.

    ``attempts``: requests in a row that bring no byte (a request that brings bytes starts the count again);
    ``backoff_s``: the first wait after a failure, doubled each time up to ``backoff_max_s``; a 429's
    ``Retry-After`` (or its ``RateLimit`` reset) replaces it; ``max_wait_s``: the most one range sleeps in all.
    The hub's rate limit windows are 5 minutes, so the default waits out one full window.
    """

    attempts: int = 6
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_wait_s: float = 600.0


@dataclass(frozen=True)
class HubReadStats:
    """What a reader has cost so far: ``requests`` (range requests issued, retries included, a redirect to the
    CDN not counted apart), ``bytes_fetched`` (body bytes received, discarded ones included), ``waited_s`` (time
    slept before retries), ``peak_cached_bytes`` (the most the chunk cache ever held)."""

    requests: int
    bytes_fetched: int
    waited_s: float
    peak_cached_bytes: int
    peak_spooled_bytes: int = 0  # the most the spool file held
    spooled_bytes: int = 0  # written to the spool file in all


SPILL_QUEUE = 1  # chunks let go by the memory cache that may wait for the spool's writer; more and a fetch waits
BLOCKS = 64  # a chunk's counts of bytes still to be read are kept per 1/BLOCKS of it (1 MiB of a 64 MiB chunk)


def block_counts(reads: Iterable[tuple[str, int, int]], chunk_bytes: int) -> dict[tuple[str, int], list[int]]:
    """Bytes read from each block of each chunk (file, index) of ``chunk_bytes``, summed over ``reads`` (file,
    offset, length): a block is ``chunk_bytes // BLOCKS`` bytes, the last one of a chunk takes the rest."""
    block = _block_bytes(chunk_bytes)
    counts: dict[tuple[str, int], list[int]] = {}
    for file, offset, n in reads:
        end = offset + n
        for i in range(offset // chunk_bytes, (end - 1) // chunk_bytes + 1 if n > 0 else 0):
            base = i * chunk_bytes
            lo, hi = max(offset, base), min(end, base + chunk_bytes)
            blocks = counts.get((file, i))
            if blocks is None:
                blocks = counts[(file, i)] = [0] * BLOCKS
            for b in range((lo - base) // block, (hi - 1 - base) // block + 1):
                blocks[min(b, BLOCKS - 1)] += min(hi, base + (b + 1) * block) - max(lo, base + b * block)
    return counts


def _block_bytes(chunk_bytes: int) -> int:
    return max(1, chunk_bytes // BLOCKS)


class _RangeError(Exception):
    """A range that cannot be fetched; ``tail`` is the message after ``{file}: {what}: ``."""

    def __init__(self, tail: str) -> None:
        super().__init__(tail)
        self.tail = tail


Buffer = bytearray | mmap.mmap  # a chunk's bytes (an anonymous map where this module made it: :func:`new_chunk`)


def new_chunk(n: int) -> mmap.mmap:
    """A buffer of ``n`` bytes for a chunk, its pages zeroed by the kernel as they are first written (a ``bytearray``
    is zeroed again by a ``memset`` over all of it first). Private, so that a forked child's chunks are its own."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)


def _refs_of_unreferenced() -> int:
    """What ``sys.getrefcount(made[k])`` says of a buffer in a list ``made`` that nothing else refers to: the list's
    reference and the call's argument (measured here, on this interpreter, not assumed)."""
    made = [new_chunk(1)]
    return sys.getrefcount(made[0])


_UNREFERENCED = _refs_of_unreferenced()


class ChunkPool:
    """Buffers of ``size`` bytes, each used again once nothing refers to it any more.

    A fresh buffer costs the kernel a page fault and a zeroed page per 4 KiB the first time it is written: for a
    streamed conversion that is every fetched byte, and on a 2-core VM about a tenth of the client's CPU time
    (docs/performance.md). The pool hands out again a buffer that no cache entry, waiter, spool write or memoryview
    of a reading thread holds: Python's own reference count says so (a memoryview of a buffer, sliced or not, holds
    a reference to it), read under the pool's lock while the only reference left is the pool's. It makes a new
    buffer only when none is free, and keeps at most ``spare`` free ones (:meth:`trim`, called as chunks leave the
    cache, lets the others go): the memory it holds is what is in use plus ``spare`` buffers. Buffers of another size
    (a file's last chunk) are not pooled. Private maps: a forked child's pool and buffers are copies of its own."""

    def __init__(self, size: int, spare: int = 1) -> None:
        self.size, self.spare = size, spare
        self._made: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> mmap.mmap:
        """A buffer of ``n`` bytes (its bytes: whatever it held last; the caller overwrites all of them)."""
        if n != self.size:
            return new_chunk(n)
        with self._lock:
            free = self._free()
            if not free:
                self._made.append(new_chunk(n))
                return self._made[-1]
            m = self._made[free[0]]
            self._let_go(free[1 + self.spare :])
            return m

    def trim(self) -> None:
        """Let go of the free buffers beyond ``spare``."""
        with self._lock:
            self._let_go(self._free()[self.spare :])

    def _let_go(self, ks: list[int]) -> None:
        if ks:
            gone = set(ks)
            self._made = [self._made[k] for k in range(len(self._made)) if k not in gone]

    def _free(self) -> list[int]:
        return [k for k in range(len(self._made)) if sys.getrefcount(self._made[k]) <= _UNREFERENCED]

    def __len__(self) -> int:
        return len(self._made)

    def clear(self) -> None:
        with self._lock:
            self._made.clear()


RELEASED_COPY = 64 * 1024  # copies of this size and more are made with the GIL released


def copy_released(dst: memoryview, src: memoryview | bytes) -> None:
    """``dst[:] = src``, with the GIL released while the bytes move where there are many (numpy's array assignment
    releases it; a memoryview's does not). Every fetched byte is copied into its chunk and out of it again by the
    reading threads: holding the GIL for those copies would stall the fetches and writers of every other thread."""
    if len(dst) < RELEASED_COPY:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


SOCKET_READ = 1 << 20  # bytes asked of the socket per read of a response body


def read_sockets_in_larger_pieces() -> None:
    """Have huggingface_hub's HTTP stack read a response body ``SOCKET_READ`` bytes per socket read, not 64 KiB.

    Its client (httpx2 over httpcore2) reads an HTTP/1.1 body ``HTTP11Connection.READ_NUM_BYTES`` bytes at a time
    (64 KiB in httpcore2 2.17, ``_sync/http11.py``) and passes each piece through h11, in Python, holding the GIL: for
    a 64 MiB range that is 1,024 pieces. With 1 MiB pieces a streamed conversion took 18-25 % less time on a 2-core
    machine (docs/performance.md). The attribute has no public setter; where it is absent (another release), nothing
    changes."""
    try:
        from httpcore2._sync.http11 import HTTP11Connection
    except ImportError:  # pragma: no cover - another HTTP stack under huggingface_hub
        return
    if getattr(HTTP11Connection, "READ_NUM_BYTES", SOCKET_READ) < SOCKET_READ:
        HTTP11Connection.READ_NUM_BYTES = SOCKET_READ


class _Pending:
    """A chunk some thread is fetching: the others wait on ``done`` and take ``data`` (or ``error``)."""

    __slots__ = ("data", "done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.data: Buffer | None = None
        self.error: _RangeError | None = None

    def result(self) -> Buffer:
        self.done.wait()
        if self.error is not None:
            raise _RangeError(self.error.tail)
        assert self.data is not None
        return self.data


class _Spool:
    """Chunks evicted from the memory cache, kept in one unlinked file on local disk (``folder``: OUT's file system)
    until ``limit`` bytes, least recently used out first: a chunk is wanted again long after its first reader
    (a rank's stacked ``w13`` experts are written before its ``w2``, and both come from the same chunks), and a
    second fetch over the network would cost far more than a local write and read. The file has no name from the
    start, so nothing is left behind, even by ``kill -9``."""

    def __init__(self, folder: Path, limit: int, chunk: int) -> None:
        fd, name = tempfile.mkstemp(prefix=".ckpt-tool-spool-", dir=folder)
        os.unlink(name)
        self.fd, self.chunk, self.slots_max = fd, chunk, max(1, limit // chunk)
        self.slots: OrderedDict[tuple[str, int], int] = OrderedDict()  # chunk -> slot
        self.held: dict[tuple[str, int], list[tuple[int, int]]] = {}  # chunk -> the [lo, hi) of it written, if not all
        self.used = 0  # slots handed out so far
        self.free: list[int] = []  # slots of chunks dropped (nothing left to read in them)
        self.generation: dict[int, int] = {}  # slot -> times it was given to a chunk
        self.peak = 0
        self.written = 0
        self.lock = threading.Lock()

    def __contains__(self, key: tuple[str, int]) -> bool:
        with self.lock:
            return key in self.slots

    def put(self, key: tuple[str, int], data: Buffer, parts: list[tuple[int, int]] | None = None) -> None:
        """Keep chunk ``key``: all of ``data``, or only its byte ranges ``parts`` ([lo, hi), apart and in order). The
        slot is taken under the lock, written outside it, and readable once written."""
        with self.lock:
            if key in self.slots:
                return
            if self.free:
                slot = self.free.pop()
            elif self.used < self.slots_max:
                slot, self.used = self.used, self.used + 1
            else:
                old, slot = self.slots.popitem(last=False)
                self.held.pop(old, None)
            self.generation[slot] = self.generation.get(slot, 0) + 1  # a read of what it held before is stale
        spans = parts if parts is not None else [(0, len(data))]
        view, base = memoryview(data), slot * self.chunk
        for lo, hi in spans:
            at = lo
            while at < hi:
                at += os.pwrite(self.fd, view[at:hi], base + at)
        with self.lock:
            self.written += sum(hi - lo for lo, hi in spans)
            if parts is not None:
                self.held[key] = parts
            self.slots[key] = slot
            self.peak = max(self.peak, len(self.slots) * self.chunk)

    def drop(self, key: tuple[str, int]) -> None:
        """Give chunk ``key``'s slot to the next chunk put (nothing will read it again)."""
        with self.lock:
            slot = self.slots.pop(key, None)
            self.held.pop(key, None)
            if slot is not None:
                self.free.append(slot)

    def read(self, key: tuple[str, int], into: memoryview, at: int) -> bool:
        """Fill ``into`` from byte ``at`` of chunk ``key``; False when the spool does not hold those bytes, or gave
        the slot to another chunk while they were read (the bytes read are then not the chunk's). The lock is not
        held while reading: a read from the disk must not stall every other reader and the spool's writer."""
        with self.lock:
            slot = self.slots.get(key)
            if slot is None:
                return False
            parts = self.held.get(key)
            if parts is not None and not any(lo <= at and at + len(into) <= hi for lo, hi in parts):
                return False
            self.slots.move_to_end(key)
            generation = self.generation[slot]
        pos = slot * self.chunk + at
        while into:
            n = os.preadv(self.fd, [into], pos)
            if n <= 0:
                raise OSError(f"spool file ended early at byte {pos}")
            into, pos = into[n:], pos + n
        with self.lock:
            return self.slots.get(key) == slot and self.generation[slot] == generation

    def close(self) -> None:
        os.close(self.fd)


class HubRangeReader:
    """Byte ranges of ``ref``'s files at ``commit``, read over HTTP; a ``ByteSource`` for a hub source.

    ``sizes``: every file that may be read, with its size in bytes (from the headers the plan was made from);
    a read past the end, or a file the hub says has another size, is an error. ``endpoint``: the hub
    (default: huggingface_hub's ``HF_ENDPOINT``). Threads may call :meth:`read_into` concurrently.

    ``reads``: where the caller knows every read it will make (a conversion's plan: ``writer.source_reads``), a
    function giving them as (file, offset, length), each as often as it will be made. The reader then counts the
    bytes still to be read from each chunk: a chunk read to the end of its count leaves the memory cache and the
    spool at once, a prefetch skips it, and the memory cache lets go to the spool only chunks with bytes left to
    read. A read beyond the counts is still served (fetched again if need be). Without ``reads``, every chunk the
    memory cache lets go is spooled.
    """

    def __init__(
        self,
        ref: HubRef,
        commit: str,
        sizes: dict[str, int],
        *,
        chunk_bytes: int = 64 * MiB,
        cache_bytes: int = 512 * MiB,
        workers: int = 4,
        retry: RetryPolicy = RetryPolicy(),
        endpoint: str | None = None,
        readahead: int = 0,
        spool_dir: Path | None = None,
        spool_bytes: int = 0,
        reads: Callable[[], Iterable[tuple[str, int, int]]] | None = None,
    ) -> None:
        if chunk_bytes <= 0 or cache_bytes < chunk_bytes:
            raise ValueError(
                f"chunk_bytes must be > 0 and cache_bytes >= chunk_bytes, got {chunk_bytes}, {cache_bytes}"
            )
        if retry.attempts < 1:
            raise ValueError(f"retry.attempts must be >= 1, got {retry.attempts}")
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(
                f"{ref}: HF_HUB_OFFLINE is set, and reading shards from the hub needs the network; unset it, or "
                "convert from the HF cache or a local folder"
            )
        self.ref, self.commit, self.sizes = ref, commit, dict(sizes)
        self.chunk_bytes, self.cache_bytes = chunk_bytes, cache_bytes
        self.retry = retry
        self.readahead = readahead  # chunks fetched in the background past the end of each read
        # Every URL names the commit, never the branch: /{repo}/resolve/{commit}/{file} (hf_hub_url, 2.4.0
        # file_download.py); the hub answers it with a 302 to its CDN, which the session follows
        # (follow_redirects=True in utils/_http.py default_client_factory; httpx2 keeps the Range header on a
        # redirect and drops Authorization when the redirect leaves the hub's origin).
        self._urls = {f: hf_hub_url(ref.repo_id, f, revision=commit, endpoint=endpoint) for f in self.sizes}
        # token (the argument, else HF_TOKEN / the stored login) and user agent, as every huggingface_hub call
        self._headers = build_hf_headers(token=ref.token, library_name="ckpt-tool", library_version=__version__)
        # no compression, as get_hf_file_metadata asks (2.4.0 file_download.py): the body is the file's bytes, its
        # Content-Length can be checked, and a CDN does not answer a gzip-accepting Range request with the whole file
        self._headers["Accept-Encoding"] = "identity"
        # http_get's timeout for downloads (2.4.0 file_download.py): seconds without a byte, not for the whole body
        self._timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int], Buffer] = OrderedDict()
        self._chunks = ChunkPool(chunk_bytes)
        self._cached_bytes = 0
        self._inflight: dict[tuple[str, int], _Pending] = {}
        self._requests = self._bytes_fetched = 0
        self._waited_s = 0.0
        self._peak_cached_bytes = 0
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="hub-prefetch", initializer=stop_signals_to_main
        )
        # fetches filling a chunk at once: the prefetch workers and one read (the others that miss wait for it)
        self._filling = threading.BoundedSemaphore(workers + 1)
        self._spool_dir, self._spool_bytes = spool_dir, spool_bytes
        self._spool: _Spool | None = None  # made at the first eviction (in the process that evicts: a forked child)
        # chunks the memory cache let go, readable until the spool's writer thread has written them (:meth:`_spill`)
        self._spilling: dict[tuple[str, int], Buffer] = {}
        self._spiller: tuple[int, queue.Queue, threading.Thread] | None = None  # (pid, its queue, its thread)
        self._closed = False
        # chunk -> bytes of it still to be read, by block (None: unknown, every chunk may be read again)
        self._left: dict[tuple[str, int], list[int]] | None = (
            None if reads is None else block_counts(reads(), chunk_bytes)
        )
        self._block = _block_bytes(chunk_bytes)
        read_sockets_in_larger_pieces()

    # -- the ByteSource API

    def read_into(self, file: str, into: memoryview, offset: int, *, what: str = "") -> None:
        """Fill ``into`` exactly from absolute byte ``offset`` of ``file`` at the pinned commit."""
        end = offset + len(into)
        self._check_span(file, offset, end, what)
        if end == offset:
            return
        into = into.cast("B") if into.format != "B" or into.ndim != 1 else into

        def part(i: int) -> tuple[int, int]:  # the bytes of chunk i this read wants: [lo, hi) of the file
            return max(offset, i * self.chunk_bytes), min(end, (i + 1) * self.chunk_bytes)

        def deliver(i: int, data: Buffer) -> None:
            lo, hi = part(i)
            copy_released(
                into[lo - offset : hi - offset], memoryview(data)[lo - i * self.chunk_bytes : hi - i * self.chunk_bytes]
            )

        def from_spool(i: int) -> bool:  # just the bytes wanted, from the spool file (the page cache, mostly)
            lo, hi = part(i)
            return self._spool is not None and self._spool.read(
                (file, i), into[lo - offset : hi - offset], lo % self.chunk_bytes
            )

        def served(upto: int) -> None:  # chunks i.. upto (inclusive) delivered: their counts go down
            nonlocal i
            if self._left is not None:
                for k in range(i, upto + 1):
                    self._consumed((file, k), *part(k))
            i = upto + 1

        first, last = offset // self.chunk_bytes, (end - 1) // self.chunk_bytes
        i = first
        try:
            while i <= last:
                with self._lock:
                    data, pending = self._held((file, i))
                if data is None and pending is None and from_spool(i):
                    served(i)
                    continue
                claimed = {}
                if data is None and pending is None:
                    with self._lock:
                        data, pending = self._held((file, i))
                        if data is None and pending is None:
                            claimed = self._claim(file, i, last)
                if data is not None:
                    deliver(i, data)
                    served(i)
                elif pending is not None:
                    deliver(i, pending.result())
                    served(i)
                else:
                    self._fetch(file, claimed, deliver)
                    served(max(claimed))
        except _RangeError as exc:
            raise CheckpointError(f"{file}: {what + ': ' if what else ''}{exc.tail}") from None
        self._read_ahead(file, last)

    def view(self, file: str, offset: int, n: int, *, what: str = "") -> memoryview | None:
        """Bytes ``[offset, offset + n)`` of ``file`` without a copy: a read-only view of the chunk in memory that
        holds them all (a chunk another thread is fetching is waited for); None where no one chunk in memory does
        (they straddle two, or were let go to the spool, or nobody fetches them yet): :meth:`read_into` then reads
        them. Either way the bytes count as read (``reads``). The view keeps its chunk from being used again
        (:class:`ChunkPool`) until the view is released.

        The ranks of a tensor-parallel group cut columns from the same rows: each read them whole into its own
        buffer before (at tp 8, eight copies of each row block of a row-parallel weight); with a view each takes
        just its columns from the chunk."""
        end = offset + n
        self._check_span(file, offset, end, what)
        i = offset // self.chunk_bytes
        if n <= 0 or (end - 1) // self.chunk_bytes != i:
            return None
        with self._lock:
            data, pending = self._held((file, i))
        if data is None and pending is not None:
            try:
                data = pending.result()
            except _RangeError:  # (read_into fetches it again, and says so if it cannot)
                return None
        if data is None:
            return None
        self._consumed((file, i), offset, end)
        self._read_ahead(file, i)
        base = i * self.chunk_bytes
        return memoryview(data)[offset - base : end - base].toreadonly()

    def _read_ahead(self, file: str, last: int) -> None:
        if self.readahead:  # the writer reads a file front to back: have the next request in flight already
            self.prefetch(file, (last + 1) * self.chunk_bytes, self.readahead * self.chunk_bytes)

    def read_span(
        self,
        file: str,
        offset: int,
        n: int,
        scratch: Scratch,
        *,
        what: str = "",
        short_ok: bool = False,
        again: bool = False,
    ) -> memoryview:
        """Bytes ``[offset, offset + n)`` of ``file`` as a view into ``scratch`` (the ``ByteSource`` call verify's
        levels make); ``short_ok``: a span past the end of the file gives the bytes there are. (``again``: not used;
        what the chunk cache lets go is kept in the spool where one is set, ``Checkpoint.remote.spool_in``.)"""
        if short_ok:
            n = max(0, min(n, self.sizes.get(file, 0) - offset))
        view = scratch.take(n)
        self.read_into(file, view, offset, what=what)
        return view

    def read_head(self, file: str, n: int) -> bytes:
        """The first ``n`` bytes of ``file`` (its safetensors header) with one request of their own, not through the
        chunk cache: headers are read long before the tensors behind them, and a 64 MiB chunk per shard would be
        fetched for a few hundred KiB."""
        n = min(n, self.sizes.get(file, 0))
        self._check_span(file, 0, n, "header")
        got = bytearray()
        try:
            self._get_range(file, 0, n, got.extend)
        except _RangeError as exc:
            raise CheckpointError(f"{file}: header: {exc.tail}") from None
        return bytes(got)

    def read(self, file: str, offset: int, n: int, *, what: str = "") -> bytearray:
        """Exactly ``n`` bytes from byte ``offset`` of ``file``."""
        buf = bytearray(n)
        self.read_into(file, memoryview(buf), offset, what=what)
        return buf

    def prefetch(self, file: str, offset: int, n: int) -> None:
        """Start fetching the chunks of ``file`` under ``[offset, offset + n)`` in the background.

        A hint: the chunks already cached or in flight are skipped, and at most the cache less one chunk is claimed
        (the chunk being read stays; more would evict what was prefetched before it is read). A failure (retries
        spent) is raised by the reads waiting for those chunks at that moment; a later read fetches them again.
        """
        end = min(offset + n, self.sizes.get(file, 0))
        if end <= offset or self._closed:
            return
        first = offset // self.chunk_bytes
        last = min((end - 1) // self.chunk_bytes, first + max(1, self.cache_bytes // self.chunk_bytes - 1) - 1)
        with self._lock:
            runs, i = [], first
            while i <= last:
                key = (file, i)
                if (
                    key in self._cache
                    or key in self._spilling
                    or key in self._inflight
                    or (self._left is not None and key not in self._left)  # nothing (left) to read in it
                    or (self._spool is not None and key in self._spool)
                ):
                    i += 1
                    continue
                run = self._claim(file, i, last)
                runs.append(run)
                i = max(run) + 1
        for run in runs:
            self._pool.submit(self._prefetch_run, file, run)

    def stats(self) -> HubReadStats:
        with self._lock:
            peak, written = (self._spool.peak, self._spool.written) if self._spool is not None else (0, 0)
            return HubReadStats(
                self._requests, self._bytes_fetched, self._waited_s, self._peak_cached_bytes, peak, written
            )

    def close(self) -> None:
        """Stop the prefetch threads and drop the cache (huggingface_hub's shared session stays open)."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._stop_spiller()
        with self._lock:
            self._cache.clear()
            self._spilling.clear()
            self._cached_bytes = 0
            if self._spool is not None:
                self._spool.close()
                self._spool = None
        self._chunks.clear()

    def __enter__(self) -> HubRangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the chunk cache (callers hold self._lock)

    def _check_span(self, file: str, start: int, end: int, what: str) -> None:
        size = self.sizes.get(file)
        where = f"{file}: {what + ': ' if what else ''}"
        if size is None:
            raise CheckpointError(
                f"{where}not a file of {self.ref.repo_id} at commit {self.commit[:12]} known to this reader"
            )
        if start < 0 or end > size:
            raise CheckpointError(
                f"{where}bytes {start}-{end - 1} lie outside the file ({size} bytes at commit {self.commit[:12]})"
            )

    def _chunk_len(self, file: str, i: int) -> int:
        return min(self.chunk_bytes, self.sizes[file] - i * self.chunk_bytes)

    def _consumed(self, key: tuple[str, int], lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of the file, in chunk ``key``, were read: once none of the chunk is left to read, it
        leaves the memory cache and the spool."""
        block, base = self._block, key[1] * self.chunk_bytes
        with self._lock:
            left = self._left.get(key) if self._left is not None else None
            if left is None:
                return
            for b in range((lo - base) // block, (hi - 1 - base) // block + 1):
                k, n = min(b, BLOCKS - 1), min(hi, base + (b + 1) * block) - max(lo, base + b * block)
                left[k] = max(0, left[k] - n)
            if any(left):
                return
            del self._left[key]
            data = self._cache.pop(key, None)
            if data is not None:
                self._cached_bytes -= len(data)
            self._spilling.pop(key, None)
            spool = self._spool
        del data  # (this frame's reference) the buffer may be free now
        self._chunks.trim()
        if spool is not None:
            spool.drop(key)

    def _held(self, key: tuple[str, int]) -> tuple[Buffer | None, _Pending | None]:
        """Chunk ``key`` in memory, else the fetch of it in flight (else neither)."""
        data = self._cache_get(key)
        return data, None if data is not None else self._inflight.get(key)

    def _cache_get(self, key: tuple[str, int]) -> Buffer | None:
        data = self._cache.get(key)
        if data is not None:
            self._cache.move_to_end(key)
            return data
        return self._spilling.get(key)

    def _claim(self, file: str, first: int, last: int) -> dict[int, _Pending]:
        """Mark chunks ``first..`` (up to ``last``, stopping at one cached or in flight) as fetched by the caller."""
        claimed: dict[int, _Pending] = {}
        i = first
        while (
            i <= last
            and (file, i) not in self._cache
            and (file, i) not in self._spilling
            and (file, i) not in self._inflight
            and (i == first or self._spool is None or (file, i) not in self._spool)
        ):
            claimed[i] = self._inflight[(file, i)] = _Pending()
            i += 1
        return claimed

    def _publish(self, file: str, i: int, data: Buffer, pending: _Pending) -> None:
        evicted = self._keep((file, i), data)
        pending.data = data
        pending.done.set()  # before the spill: a waiter never waits on the local disk
        self._spill(evicted)
        del evicted  # (the chunks the cache let go without spooling them are free now)
        self._chunks.trim()

    def _keep(
        self, key: tuple[str, int], data: Buffer
    ) -> list[tuple[tuple[str, int], Buffer, list[tuple[int, int]] | None]]:
        """Put a chunk that was in flight in the memory cache; the chunks it pushes out, for :meth:`_spill`."""
        evicted = []
        spilling = self._spooling()
        with self._lock:
            del self._inflight[key]
            self._cache[key] = data
            self._cached_bytes += len(data)
            while self._cached_bytes > self.cache_bytes:
                old_key, old = self._cache.popitem(last=False)
                self._cached_bytes -= len(old)
                if self._left is None:
                    evicted.append((old_key, old, None))
                elif old_key in self._left:  # (else nothing will read it again) the parts of it still to be read
                    evicted.append((old_key, old, self._parts(self._left[old_key], len(old))))
                else:
                    continue
                if spilling:
                    self._spilling[old_key] = old  # still served from memory until the spool holds it
            self._peak_cached_bytes = max(self._peak_cached_bytes, self._cached_bytes)
        return evicted

    def _spooling(self) -> bool:
        """A spool is on: asked for, and not given up (a spool write failed)."""
        return self._spool_dir is not None and self._spool_bytes >= self.chunk_bytes

    def _unspill(self, key: tuple[str, int], data: Buffer) -> None:
        """Chunk ``key`` (these bytes, not a later fetch of it) stops being served from memory as waiting for the
        spool. The caller holds the lock."""
        if self._spilling.get(key) is data:
            del self._spilling[key]

    def _parts(self, left: list[int], n: int) -> list[tuple[int, int]]:
        """The byte ranges of an ``n``-byte chunk whose blocks have bytes ``left`` to be read, adjacent ones merged."""
        parts: list[tuple[int, int]] = []
        for b, count in enumerate(left):
            if count:
                lo, hi = b * self._block, n if b == BLOCKS - 1 else min(n, (b + 1) * self._block)
                if parts and parts[-1][1] == lo:
                    parts[-1] = (parts[-1][0], hi)
                elif lo < hi:
                    parts.append((lo, hi))
        return parts

    def _spill(self, evicted: list[tuple[tuple[str, int], Buffer, list[tuple[int, int]] | None]]) -> None:
        """Hand chunks the memory cache let go to the spool's writer thread, where there is a spool: the fetch that
        evicted them goes on receiving while they are written. It waits only while ``SPILL_QUEUE`` chunks are
        already waiting (the memory they hold is bounded); until written, a waiting chunk is read from memory."""
        if not evicted:
            return
        if not self._spooling():  # none, or given up since they were let go
            with self._lock:
                for key, data, _ in evicted:
                    self._unspill(key, data)
            return
        with self._lock:
            if self._spiller is None or self._spiller[0] != os.getpid():  # none yet in this process (or forked)
                q: queue.Queue = queue.Queue(maxsize=SPILL_QUEUE)
                thread = threading.Thread(target=signal_free(self._spill_run), args=(q,), name="hub-spool", daemon=True)
                thread.start()
                self._spiller = (os.getpid(), q, thread)
            q = self._spiller[1]
        for item in evicted:
            q.put(item)

    def _spill_run(self, q: queue.Queue) -> None:
        """The spool's writer: each chunk handed over goes to the spool file (unless nothing is left to read in it),
        then stops being served from memory. A spool that cannot be written (the disk is full) is given up with a
        warning: chunks wanted again are then fetched again."""
        while (item := q.get()) is not None:
            key, data, parts = item
            try:
                with self._lock:
                    wanted = self._spooling() and (self._left is None or key in self._left)
                    if wanted and self._spool is None:
                        self._spool = _Spool(self._spool_dir, self._spool_bytes, self.chunk_bytes)
                    spool = self._spool
                if wanted and spool is not None:
                    spool.put(key, data, parts)
                    with self._lock:
                        read_meanwhile = self._left is not None and key not in self._left
                    if read_meanwhile:  # its last bytes were read from memory while it was written
                        spool.drop(key)
            except Exception as exc:  # (a fetch must never wait on a writer that is gone) the spool is given up
                log.warning(
                    "the spool in %s cannot be written (%s): chunks wanted again will be fetched again",
                    self._spool_dir,
                    getattr(exc, "strerror", None) or exc,
                )
                self._spool_bytes = 0
            finally:
                with self._lock:
                    self._unspill(key, data)
                del item, data
                self._chunks.trim()
                q.task_done()

    def spool_settled(self) -> None:
        """Wait until every chunk handed to the spool's writer so far is in the spool (or given up)."""
        spiller = self._spiller
        if spiller is not None and spiller[0] == os.getpid():
            spiller[1].join()

    def _stop_spiller(self) -> None:
        """Let the spool's writer finish what it was handed, then end it (in the process that started it)."""
        spiller, self._spiller = self._spiller, None
        if spiller is not None and spiller[0] == os.getpid():
            spiller[1].put(None)
            spiller[2].join()

    def _fail(self, file: str, claimed: dict[int, _Pending], error: _RangeError) -> None:
        with self._lock:
            for i in claimed:
                del self._inflight[(file, i)]
        for pending in claimed.values():
            pending.error = error
            pending.done.set()

    # -- fetching

    def _prefetch_run(self, file: str, claimed: dict[int, _Pending]) -> None:
        try:
            self._fetch(file, claimed, None)
        except _RangeError as exc:
            log.debug("prefetch of %s failed (a read will retry it): %s", file, exc.tail)

    def _fetch(self, file: str, claimed: dict[int, _Pending], deliver: Callable[[int, Buffer], None] | None) -> None:
        """Fetch the claimed chunks (adjacent) with one range request, publishing each as soon as it is whole."""
        first, last = min(claimed), max(claimed)
        left = dict(claimed)
        i, buf, fill = first, None, 0

        def take(piece: memoryview) -> None:
            nonlocal i, buf, fill
            while len(piece):
                k = min(len(buf) - fill, len(piece))
                copy_released(memoryview(buf)[fill : fill + k], piece[:k])
                fill, piece = fill + k, piece[k:]
                if fill == len(buf):
                    self._publish(file, i, buf, left.pop(i))
                    if deliver is not None:
                        deliver(i, buf)
                    if i < last:
                        i, buf, fill = i + 1, self._chunks.take(self._chunk_len(file, i + 1)), 0

        start = first * self.chunk_bytes
        end = last * self.chunk_bytes + self._chunk_len(file, last)
        try:
            with self._filling:  # (the memory bound) at most ``workers + 1`` chunks are being filled at once
                buf = self._chunks.take(self._chunk_len(file, first))
                self._get_range(file, start, end, take)
        except _RangeError as exc:
            self._fail(file, left, exc)
            raise
        except BaseException as exc:  # KeyboardInterrupt, a bug: never leave a waiter hanging
            self._fail(file, left, _RangeError(f"fetching bytes {start}-{end - 1} was interrupted ({exc!r})"))
            raise

    def _get_range(self, file: str, start: int, end: int, take: Callable[[memoryview], None]) -> None:
        """Bytes ``[start, end)`` of ``file`` to ``take``, in order, each byte once: retried on 408/429/5xx and on a
        dropped connection (resumed from the byte reached), a body of the wrong length refused."""
        policy = self.retry
        pos, tries, waited, backoff = start, 0, 0.0, policy.backoff_s
        problem = ""
        while pos < end:
            if tries >= policy.attempts:
                raise _RangeError(self._spent(start, end, tries, problem))
            tries += 1
            with self._lock:
                self._requests += 1
            problem, wait = "", None
            headers = {**self._headers, "Range": f"bytes={pos}-{end - 1}"}
            received = 0  # body bytes of this request: counted once it ends (a lock a 64 KiB piece would contend)
            try:
                with get_session().stream("GET", self._urls[file], headers=headers, timeout=self._timeout) as r:
                    problem, wait = self._check_response(r, file, pos, end)
                    if not problem:
                        for piece in r.iter_bytes():
                            if pos + len(piece) > end:
                                problem = f"the body ran past byte {end - 1}"
                                break
                            received += len(piece)
                            take(memoryview(piece))
                            pos += len(piece)
                            tries, backoff = 0, policy.backoff_s  # progress: a fresh count for what is left
                        else:
                            if pos < end:  # a clean end of stream before the length asked for
                                problem = f"the body ended at byte {pos}, short of {end}"
            except httpx2.TransportError as exc:  # connect, timeout, a connection dropped mid-body
                problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"
            finally:
                with self._lock:
                    self._bytes_fetched += received
            if not problem:
                continue
            log.warning("%s: bytes %d-%d: %s (attempt %d of %d)", file, pos, end - 1, problem, tries, policy.attempts)
            if tries >= policy.attempts:
                continue
            delay = wait if wait is not None else backoff
            backoff = min(backoff * 2, policy.backoff_max_s)
            if waited + delay > policy.max_wait_s:
                over = f"{problem}; waiting {delay:g}s more would pass the {policy.max_wait_s:g}s retry budget"
                raise _RangeError(self._spent(start, end, tries, over))
            time.sleep(delay)
            waited += delay
            with self._lock:
                self._waited_s += delay

    def _check_response(self, r, file: str, pos: int, end: int) -> tuple[str, float | None]:
        """("", None) if ``r`` is the 206 for bytes ``[pos, end)``; else what is wrong and how long to wait
        before retrying (None: the backoff). A refusal (401, 403, 404, ...) raises: retrying cannot help."""
        status, size = r.status_code, self.sizes[file]
        if status in RETRY_STATUSES:
            # the wait huggingface_hub's http_backoff takes (2.4.0 utils/_http.py): a 429's RateLimit reset when
            # none is left, else Retry-After in seconds (an HTTP date is not honoured there either)
            limit = parse_ratelimit_headers(r.headers) if status == 429 else None
            retry_after = r.headers.get("Retry-After", "").strip()
            if limit is not None and limit.remaining == 0:
                wait: float | None = float(limit.reset_in_seconds)
            else:
                wait = float(retry_after) if retry_after.isdigit() else None
            return f"HTTP {status}", wait
        length = r.headers.get("Content-Length")
        if status == 206:
            m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
            if m is None:
                return f"206 without a valid Content-Range ({r.headers.get('Content-Range')!r})", None
            if m.group(3) != "*" and int(m.group(3)) != size:
                raise _RangeError(
                    f"bytes {pos}-{end - 1} of commit {self.commit[:12]}: the hub says the file has "
                    f"{m.group(3)} bytes, its header said {size}; the sizes this reader was given are not this "
                    "commit's (plan and read from the same commit)"
                )
            if (int(m.group(1)), int(m.group(2))) != (pos, end - 1):
                return f"asked for bytes {pos}-{end - 1}, answered {m.group(1)}-{m.group(2)}", None
        elif status == 200:  # the Range header was ignored: only right if the whole file was asked for
            if (pos, end) != (0, size):
                return f"asked for bytes {pos}-{end - 1}, answered 200 with the whole file", None
        else:
            r.read()  # hf_raise_for_status reads the error body
            try:
                hf_raise_for_status(r)
            except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, RemoteEntryNotFoundError, ...
                what = f"bytes {pos}-{end - 1} of commit {self.commit[:12]} cannot be read"
                raise _RangeError(str(network_error(self.ref, what, exc))) from None
            return f"unexpected HTTP {status}", None
        if length is not None and length.isdigit() and int(length) != end - pos:
            return f"Content-Length {length} for the {end - pos} bytes asked for", None
        return "", None

    def _spent(self, start: int, end: int, tries: int, problem: str) -> str:
        return (
            f"bytes {start}-{end - 1} of commit {self.commit[:12]} could not be fetched from {self.ref.repo_id} "
            f"after {tries} attempts ({problem}); check the network (and HF_ENDPOINT / proxy settings), then rerun "
            "the same command to resume"
        )
