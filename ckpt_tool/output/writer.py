"""Streaming writer: one output safetensors file from a plan, copying source byte ranges in bounded chunks.

The header is computed from the plan up front; then the output is assembled in a small ring of
page-aligned ``CHUNK``-sized buffers, never a whole tensor in memory:

- contiguous source ranges (whole tensors, row splits, wide column slices row by row) are read with
  the source's byte reader (:mod:`ckpt_tool.checkpoint.reader`) straight into the buffer, at their place in the
  output;
- narrow column slices (TP split of dim 1) are gathered with numpy from cache-sized blocks of source
  rows; converted segments (E8M0 → float32, int64 → int32: :mod:`conversions`) are converted piece by
  piece into the buffer;
- the engine's zero padding (a zero segment, or zeros after each row of a column slice) is filled from
  a reused piece of the zero element's bytes (:func:`conversions.zero_element`).

A full buffer goes to two threads at once: one feeds it to sha256 (the manifest's checksum is that of
the bytes written; ``hashlib`` releases the GIL), the other writes it at its offset with ``O_DIRECT``
(DMA from the buffer: no copy into the page cache, no dirty-page throttling, no flush backlog for the
final ``fsync``; plain buffered writes where the file system refuses direct I/O). While they work,
the caller's thread fills the next buffer, so reading, hashing and writing overlap. Memory per writer
is ``RING`` buffers of ``CHUNK`` bytes (``ONE_PASS_RING`` for a streamed source) plus two ``PIECE`` scratch
buffers, and all writers of a process together hold at most ``MAX_BUFFERS`` ring buffers (more workers wait
for a ring).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path

import numpy as np

from ckpt_tool.checkpoint import reader as reads
from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.checkpoint.identity import FileIdentity, changed_while_converting
from ckpt_tool.checkpoint.reader import DIRECT_ALIGN, ByteSource, LocalFiles, Scratch
from ckpt_tool.errors import OutputError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.plan import ZERO, OutFile, OutTensor, Segment
from ckpt_tool.processes import join_in_steps, signal_free, usable_cpus

CHUNK = 8 * 1024 * 1024  # bytes per output buffer (one read/hash/write step); bounds memory per worker
RING = 4  # buffers per writer: one being filled, the others being hashed / written
ONE_PASS_RING = 3  # a streamed conversion's writers (one filling, one hashing, one writing): 8 files at 24 MiB
# leave the stream's chunks (hub_ranges: 9 x 64 MiB at most) room under its 1 GiB peak RSS; bench/stream_bench.py
# peaked at 875-1022 MiB with 4 a writer, 790-838 MiB with 3, no slower
MAX_BUFFERS = 32  # ring buffers in the whole process (32 x 8 MiB = 256 MiB), whatever --workers is
MAX_DEFAULT_WORKERS = MAX_BUFFERS // RING  # the most files written at once by default: each gets its ring


def default_workers(pending_files: int) -> int:
    """Files written at once when --workers is not given: one per CPU core while that many are pending.

    Hashing (sha256, ~1.5 GB/s per core) runs beside each file's writes; on storage faster than one
    core hashes, one file at a time would be CPU-bound. Memory stays within MAX_BUFFERS either way.
    """
    return max(1, min(usable_cpus(), MAX_DEFAULT_WORKERS, pending_files))


PIECE = 1024 * 1024  # scratch for gathers and conversions: small enough to stay in CPU cache
SMALL_COLUMN_SLICE = 64 * 1024  # column slices narrower than this are gathered from row blocks

ProgressFn = Callable[[int], None]  # bytes now in the output file; called from writer threads


def header_bytes(out: OutFile, metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of ``out`` (length prefix included), padded so data starts 8-aligned."""
    doc: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for t in out.tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def file_size(out: OutFile) -> int:
    return len(header_bytes(out)) + out.data_bytes


class SourceFiles:
    """The source's bytes as the writer threads read them: the checkpoint's :class:`ByteSource` (its local files,
    read front to back with the kernel's read-ahead, unless ``source`` gives another).

    ``identities``: each local source file as it was when the plan was made (its header read); with them,
    :meth:`check_unchanged` tells whether a file is still that file (:mod:`ckpt_tool.checkpoint.identity`).
    """

    def __init__(
        self, root: Path, identities: dict[str, FileIdentity] | None = None, source: ByteSource | None = None
    ) -> None:
        self.root = root
        self.source = source if source is not None else LocalFiles(root, sequential=True)
        self.identities = identities or {}
        # a source that holds the bytes in memory lends a view of them (HubRangeReader.view); a local file does not
        self._view: Callable[..., memoryview | None] | None = getattr(self.source, "view", None)

    def check_unchanged(self, files: Iterable[str]) -> None:
        """Raise a CheckpointError naming the first of ``files`` that changed since the plan, and how."""
        for file in files:
            recorded = self.identities.get(file)
            if recorded is not None and (error := changed_while_converting(self.root / file, recorded)):
                raise error

    def pread_exact(self, info: TensorInfo, into: memoryview, offset: int) -> None:
        """Fill ``into`` from absolute ``offset`` of ``info``'s file; a short read means the file changed."""
        self.source.read_into(info.file, into, offset, what=f"tensor {info.name!r}")

    def rows(self, info: TensorInfo, into: memoryview, offset: int) -> memoryview:
        """The ``len(into)`` bytes from ``offset`` of ``info``'s file, to be read and let go before the next call:
        a view of the source's own memory where it lends one, else read into ``into``."""
        if self._view is not None:
            lent = self._view(info.file, offset, len(into), what=f"tensor {info.name!r}")
            if lent is not None:
                return lent
        self.pread_exact(info, into, offset)
        return into

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> SourceFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def files_fed(out: OutFile, sources: dict[str, TensorInfo]) -> list[str]:
    """The source files whose bytes go into ``out``."""
    return sorted({sources[name].file for t in out.tensors for name in t.sources})


def source_reads(
    outs: Iterable[OutFile], sources: dict[str, TensorInfo], skip: Container[tuple[str, str]] = ()
) -> Iterator[tuple[str, int, int]]:
    """(source file, absolute offset, length) of every read writing ``outs`` makes, each as many times as it is made
    (a replicated tensor once a rank): what a streamed source still has to serve (``HubStream.spool_in``). ``skip``:
    (relpath, tensor name) of tensors not read from the source (copied from a twin: ``output.twins``)."""
    reader = SegmentReader(SourceFiles(Path()), sources)  # (its geometry only: nothing is opened or read)
    for out in outs:
        for t in out.tensors:
            if (out.relpath, t.name) in skip:
                continue
            for seg in t.segments:
                for offset, length in reader.footprint(seg):
                    yield sources[seg.src].file, offset, length


def _nonfinite(raw: memoryview, dtype: str) -> int:
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2")
        return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))  # exponent all ones: inf or NaN
    if dtype == "F32":
        return int(np.count_nonzero(~np.isfinite(np.frombuffer(raw, dtype="<f4"))))
    return 0


class SegmentReader:
    """Streams the bytes of one segment in chunks, reusing its buffers.

    On the way it rejects E8M0 NaN bytes (0xFF) in scales and notes non-finite values in norm
    weights (``warnings``): both are cheap scans of bytes already in memory.
    """

    def __init__(self, files: SourceFiles, sources: dict[str, TensorInfo], warnings: list[str] | None = None) -> None:
        self.files = files
        self.sources = sources
        self._buf: bytearray | None = None
        self._gather: bytearray | None = None
        self.warnings = warnings if warnings is not None else []

    @property
    def buf(self) -> bytearray:
        if self._buf is None:
            self._buf = bytearray(PIECE)
        return self._buf

    @property
    def gather(self) -> bytearray:
        if self._gather is None:
            self._gather = bytearray(PIECE)
        return self._gather

    @staticmethod
    def geometry(info: TensorInfo) -> tuple[int, int]:
        """(element bytes, row bytes) of ``info`` seen as 2-D [shape[0], prod(shape[1:])]."""
        eb = DTYPE_BITS[info.dtype] // 8
        cols = (info.numel // info.shape[0]) if info.shape else 1
        return eb, cols * eb

    def checker(self, info: TensorInfo) -> Callable[[memoryview], None] | None:
        """The scan ``info``'s bytes must pass on their way out (None: none)."""
        if info.dtype == "F8_E8M0":
            return lambda mv: conversions.reject_e8m0_nan(mv, info)
        if info.name.endswith("norm.weight") and info.dtype in ("BF16", "F32"):

            def check(mv: memoryview) -> None:
                bad = _nonfinite(mv, info.dtype)
                if bad:
                    self.warnings.append(
                        f"{info.file}: tensor {info.name!r}: {bad} NaN/Inf value(s) in a norm weight; "
                        "copied as stored, but the model will produce NaNs"
                    )

            return check
        return None

    def byte_ranges(self, seg: Segment) -> list[tuple[int, int]] | None:
        """(absolute offset, length) source ranges whose concatenation is ``seg``'s output bytes as they
        are, or None when the segment needs a gather of narrow slices, a dtype conversion or zeros."""
        if seg.convert not in conversions.BYTEWISE or seg.pad or seg.repeat > 1 or seg.src == ZERO:
            return None
        return self._ranges(seg, self.sources[seg.src])

    def _ranges(self, seg: Segment, info: TensorInfo) -> list[tuple[int, int]] | None:
        eb, row_bytes = self.geometry(info)
        if seg.col0 == 0 and seg.col1 * eb == row_bytes:
            return [(info.start + seg.row0 * row_bytes, (seg.row1 - seg.row0) * row_bytes)]
        c0, width = seg.col0 * eb, (seg.col1 - seg.col0) * eb
        if width >= SMALL_COLUMN_SLICE or row_bytes > CHUNK:
            return [(info.start + row * row_bytes + c0, width) for row in range(seg.row0, seg.row1)]
        return None  # narrow slices of many rows: gathered

    def footprint(self, seg: Segment) -> list[tuple[int, int]]:
        """(absolute offset, length) of every source byte writing ``seg`` reads, as :func:`_fill_segment` and
        :meth:`stream` read them: its ranges where it is copied as it is, else the whole rows it is cut from."""
        if seg.src == ZERO:
            return []
        info = self.sources[seg.src]
        ranges = None if seg.pad or seg.repeat > 1 else self._ranges(seg, info)
        if ranges is not None:
            return ranges
        _, row_bytes = self.geometry(info)  # gather_columns / gather_padded: blocks of whole rows
        return [(info.start + seg.row0 * row_bytes, (seg.row1 - seg.row0) * row_bytes)]

    def stream(self, seg: Segment, emit: Callable[[memoryview | bytes], None]) -> None:
        """Call ``emit`` with the output bytes of a source segment, in order, in pieces of at most ``CHUNK``."""
        info = self.sources[seg.src]
        check = self.checker(info)
        if seg.pad or seg.repeat > 1:
            self.gather_padded(seg, info, check, emit)
            return
        if seg.convert not in conversions.BYTEWISE:
            out = lambda mv: emit(conversions.forward(seg.convert, mv, info))  # noqa: E731
        elif check is not None:
            out = lambda mv: (check(mv), emit(mv))  # noqa: E731
        else:
            out = emit
        ranges = self._ranges(seg, info)
        if ranges is None:
            self.gather_columns(seg, info, out)
            return
        buf = memoryview(self.buf)
        for offset, length in ranges:
            done = 0
            while done < length:
                n = min(PIECE, length - done)
                self.files.pread_exact(info, buf[:n], offset + done)
                out(buf[:n])
                done += n

    def gather_columns(self, seg: Segment, info: TensorInfo, out: Callable[[memoryview], None]) -> None:
        """Columns [col0, col1) of rows [row0, row1): read blocks of whole rows (cache-sized) and pack
        the slices with numpy into a reused buffer."""
        eb, row_bytes = self.geometry(info)
        c0, width = seg.col0 * eb, (seg.col1 - seg.col0) * eb
        rows_per_block = max(1, PIECE // row_bytes)
        src = (
            memoryview(self.buf) if row_bytes <= PIECE else memoryview(bytearray(row_bytes))
        )  # one row > PIECE: <= CHUNK
        gather = memoryview(self.gather)
        row = seg.row0
        while row < seg.row1:
            n = min(rows_per_block, seg.row1 - row)
            mv = self.files.rows(info, src[: n * row_bytes], info.start + row * row_bytes)
            dst = np.frombuffer(gather[: n * width], dtype=np.uint8).reshape(n, width)
            np.copyto(dst, np.frombuffer(mv, dtype=np.uint8).reshape(n, row_bytes)[:, c0 : c0 + width])
            del dst, mv  # (a lent view holds its chunk: let it go before waiting on the output)
            out(gather[: n * width])
            row += n

    def gather_padded(
        self,
        seg: Segment,
        info: TensorInfo,
        check: Callable[[memoryview], None] | None,
        emit: Callable[[memoryview | bytes], None],
    ) -> None:
        """Columns [col0, col1) of rows [row0, row1), each row followed by ``seg.pad`` zero elements and written
        ``seg.repeat`` times: blocks of whole source rows are read, the slices checked or converted, and placed row by
        row with numpy in front of the pad (an MXFP8 scale row is small: the repeat stays in cache)."""
        eb, row_bytes = self.geometry(info)
        out_dtype = conversions.out_dtype(info.dtype, seg.convert)
        out_eb = DTYPE_BITS[out_dtype] // 8
        zero_row = np.tile(np.frombuffer(conversions.zero_element(seg.convert, out_dtype), dtype=np.uint8), seg.pad)
        c0, width = seg.col0 * eb, (seg.col1 - seg.col0) * eb
        real, padded = (seg.col1 - seg.col0) * out_eb, seg.width * out_eb
        rows_per_block = max(1, PIECE // max(row_bytes, padded * seg.repeat))
        src = memoryview(self.buf) if rows_per_block * row_bytes <= PIECE else memoryview(bytearray(row_bytes))
        row = seg.row0
        while row < seg.row1:
            n = min(rows_per_block, seg.row1 - row)
            mv = self.files.rows(info, src[: n * row_bytes], info.start + row * row_bytes)
            sliced = np.ascontiguousarray(np.frombuffer(mv, dtype=np.uint8).reshape(n, row_bytes)[:, c0 : c0 + width])
            del mv
            if seg.convert not in conversions.BYTEWISE:
                sliced = np.frombuffer(conversions.forward(seg.convert, sliced.data, info), dtype=np.uint8)
            elif check is not None:
                check(sliced.data)
            block = np.empty((n, padded), dtype=np.uint8)
            block[:, :real] = sliced.reshape(n, real)
            block[:, real:] = zero_row
            if seg.repeat > 1:
                block = np.repeat(block, seg.repeat, axis=0)
            emit(block.data)
            row += n


# ---------------------------------------------------------------------------------------------
# The output pipeline


class _Budget:
    """Ring buffers in use by all writers of the process: bounded, so --workers K stays bounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            while self.used + n > self.limit and self.used > 0:
                self.cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


_BUDGET = _Budget(MAX_BUFFERS)


class _Sink:
    """Where a segment's bytes go: ``space()`` (room to fill), ``commit(n)`` (n bytes of it filled), ``written``."""

    def space(self) -> memoryview:  # pragma: no cover - each sink has its own
        raise NotImplementedError

    def commit(self, n: int) -> None:  # pragma: no cover - each sink has its own
        raise NotImplementedError

    def write(self, data: memoryview | bytes) -> None:
        """``data`` through ``space`` and ``commit``, as much at a time as there is room."""
        view = memoryview(data).cast("B")
        while view:
            room = self.space()
            n = min(len(room), len(view))
            room[:n] = view[:n]
            self.commit(n)
            view = view[n:]


class _Pipeline(_Sink):
    """Assembles the output in ring buffers; a hasher thread and a writer thread consume each full one.

    The caller fills ``space()`` then ``commit(n)``s it, or ``write(bytes)``; ``finish()`` flushes the
    last partial buffer and returns the sha256. Errors of either thread surface in the caller.
    """

    def __init__(
        self,
        fd: int,
        plain_fd: int,
        path: Path,
        direct: bool,
        progress: ProgressFn | None,
        pace: Callable[[int], None] | None = None,
        ring: int = RING,
    ) -> None:
        self.fd = fd
        self.plain_fd = plain_fd  # the same file without O_DIRECT (``fd`` itself when that has none): partial pages
        self.path = path  # the file, for reading deferred bytes back (defer)
        self.readback = LocalFiles(direct=direct)  # (opens the file at its first deferred range)
        self.scratch = Scratch()  # (page-aligned, for direct reads back)
        self.direct = direct
        self.progress = progress
        self.pace = pace
        self.digest = hashlib.sha256()
        self.error: BaseException | None = None
        self.ring = ring
        _BUDGET.acquire(self.ring)
        try:
            self.bufs = [mmap.mmap(-1, CHUNK) for _ in range(self.ring)]  # page-aligned, as O_DIRECT wants
        except BaseException:
            _BUDGET.release(self.ring)
            raise
        self.views = [memoryview(b) for b in self.bufs]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.ring):
            self.free.put(i)
        self.pending = [0] * self.ring
        self.lock = threading.Lock()
        self.hash_q: queue.SimpleQueue = queue.SimpleQueue()
        self.write_q: queue.SimpleQueue = queue.SimpleQueue()
        self.cur: int | None = None
        self.fill = 0
        self.lead = 0  # where the current buffer's bytes start: at the file offset's place in a page (direct writes)
        self.offset = 0  # file offset of the current buffer's first byte
        self.threads = [
            threading.Thread(
                target=signal_free(self._run), args=(self.hash_q, self._hash), name="ckpt-tool-hash", daemon=True
            ),
            threading.Thread(
                target=signal_free(self._run), args=(self.write_q, self._write), name="ckpt-tool-write", daemon=True
            ),
        ]
        for t in self.threads:
            t.start()
        self.closed = False

    @property
    def written(self) -> int:
        return self.offset + self.fill - self.lead

    # -- caller side ----------------------------------------------------------------------------

    def space(self) -> memoryview:
        """The free part of the current buffer (a fresh buffer when it is full)."""
        if self.cur is None:
            self._check()
            if self.pace is not None:  # before reading the source for the next buffer (Lockstep.advance)
                self.pace(self.written)
            while True:
                try:
                    self.cur = self.free.get(timeout=0.5)
                    break
                except queue.Empty:
                    self._check()
            self.fill = self.lead = self.offset % DIRECT_ALIGN if self.direct else 0
        return self.views[self.cur][self.fill :]

    def commit(self, n: int) -> None:
        self.fill += n
        if self.fill == CHUNK:
            self._submit()

    def _submit(self) -> None:
        assert self.cur is not None
        i, lead, n, off = self.cur, self.lead, self.fill - self.lead, self.offset
        self.pending[i] = 2
        self.hash_q.put((i, lead, n, off))
        self.write_q.put((i, lead, n, off))
        self.cur, self.fill, self.lead = None, 0, 0
        self.offset = off + n

    def defer(self, n: int) -> None:
        """The next ``n`` bytes of the file are written by others (:class:`_Region`), and are there now: they are
        hashed in their place, read back from the file, and this pipeline goes on after them."""
        self._check()
        if self.cur is not None and self.fill > self.lead:
            self._submit()
        elif self.cur is not None:  # an empty buffer, started for an offset that is no longer the next one
            self.free.put(self.cur)
            self.cur, self.fill, self.lead = None, 0, 0
        self.hash_q.put((-1, 0, n, self.offset))
        self.offset += n

    def finish(self) -> str:
        if self.cur is not None and self.fill > self.lead:
            self._submit()
        self._stop()
        self._check()
        return self.digest.hexdigest()

    def abort(self) -> None:
        with self.lock:
            if self.error is None:
                self.error = _Aborted()
        self._stop()

    def _stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.hash_q.put(None)
        self.write_q.put(None)
        for t in self.threads:
            join_in_steps(t)  # a stop signal's handler runs meanwhile (processes.SIGNAL_POLL_S)
        self.readback.close()
        try:
            for v in self.views:
                v.release()
            for b in self.bufs:
                b.close()
        except BufferError:  # a slice is still referenced (an exception's traceback): the GC unmaps it
            pass
        _BUDGET.release(self.ring)

    def _check(self) -> None:
        if self.error is not None and not isinstance(self.error, _Aborted):
            raise self.error

    # -- consumer threads -------------------------------------------------------------------------

    def _run(self, q: queue.SimpleQueue, work: Callable[[int, int, int, int], None]) -> None:
        while (item := q.get()) is not None:
            i, lead, n, off = item
            try:
                if self.error is None:
                    work(i, lead, n, off)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                with self.lock:
                    if self.error is None:
                        self.error = exc
            if i < 0:  # (a deferred range: no buffer of the ring)
                continue
            with self.lock:
                self.pending[i] -= 1
                done = self.pending[i] == 0
            if done:
                self.free.put(i)

    def _hash(self, i: int, lead: int, n: int, off: int) -> None:
        if i >= 0:
            self.digest.update(self.views[i][lead : lead + n])
            return
        # a deferred range: read back from the file, in order (directly, as it was written)
        for piece in _pieces(self.readback, self.path, off, n, self.scratch, "bytes written out of order"):
            self.digest.update(piece)

    def _write(self, i: int, lead: int, n: int, off: int) -> None:
        self.write_at(self.views[i][lead : lead + n], off)
        if self.progress:  # counted once the bytes are in the file, not when they were queued
            self.progress(n)

    def write_at(self, view: memoryview, off: int) -> None:
        """``view`` (which starts at ``off``'s place in a page of its buffer) at file offset ``off``: its whole pages
        with a direct write, the bytes of partial pages at either end through the page cache."""
        n = len(view)
        if self.direct:
            head = min(n, -off % DIRECT_ALIGN)
            body = (n - head) - (n - head) % DIRECT_ALIGN
            if head:
                _pwrite_all(self.plain_fd, view[:head], off)
            try:
                done = head + (_pwrite_all(self.fd, view[head : head + body], off + head) if body else 0)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # the file system takes no direct I/O here after all
                done = head
            view, off = view[done:], off + done
        if len(view):
            _pwrite_all(self.plain_fd, view, off)

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False


class _Aborted(Exception):
    pass


class _Region(_Sink):
    """One tensor of an interleaved group (:func:`interleaved_groups`) after the group's first: written at its own
    place in the file (``offset``), a ``PIECE`` at a time, while the pipeline writes the group's first tensor; the
    pipeline hashes it afterwards, read back (:meth:`_Pipeline.defer`). Its bytes arrive in file order, so it writes
    as the pipeline does (:meth:`_Pipeline.write_at`): whole pages directly, the partial page at either end through
    the page cache. (Through the page cache it all cost about 1.7 s of CPU a GiB on a VM whose free memory the host
    takes back: every page-cache page written is a fresh one.) It takes the pipeline's calls (``space``, ``commit``,
    ``write``, ``written``), so a segment fills it as it fills the pipeline."""

    def __init__(self, pipe: _Pipeline, offset: int, progress: ProgressFn | None) -> None:
        self.pipe, self.offset, self.progress = pipe, offset, progress
        self.view = memoryview(mmap.mmap(-1, PIECE))  # page-aligned, as O_DIRECT wants
        self.fill = self.flushed = 0
        self.lead = self._lead()  # where the buffered bytes start: at the file offset's place in a page

    @property
    def written(self) -> int:
        return self.flushed + self.fill

    def space(self) -> memoryview:
        return self.view[self.lead + self.fill :]

    def commit(self, n: int) -> None:
        self.fill += n
        if self.lead + self.fill == len(self.view):
            self.flush()

    def flush(self) -> None:
        if self.fill:
            self.pipe.write_at(self.view[self.lead : self.lead + self.fill], self.offset + self.flushed)
            if self.progress:
                self.progress(self.fill)
            self.flushed += self.fill
            self.fill = 0
            self.lead = self._lead()

    def _lead(self) -> int:
        return (self.offset + self.flushed) % DIRECT_ALIGN if self.pipe.direct else 0


def _pwrite_all(fd: int, view: memoryview, off: int) -> int:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], off + done)
        if n <= 0:  # pragma: no cover - pwrite raises rather than returning 0
            raise OSError(errno.EIO, "short write")
        done += n
    return done


def _open_output(path: Path) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if reads.DIRECT_IO:  # (read at the call: CKPT_TOOL_DIRECT_IO, or a test, may turn it off)
        try:
            return os.open(path, flags | os.O_DIRECT, 0o666), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


def output_error(exc: OSError, path: Path) -> OutputError:
    """The one-line error for a failed write of ``path`` (disk full gets its own advice)."""
    if exc.errno == errno.ENOSPC:
        return OutputError(f"{path}: no space left on device while writing; free space and rerun to resume")
    return OutputError(f"{path}: cannot write ({exc.strerror or exc})")


def interleaved_groups(
    tensors: Iterable[OutTensor], reader: SegmentReader, alone: Container[str] = ()
) -> list[list[OutTensor]]:
    """``tensors`` (in file order) cut into runs whose source bytes interleave: a tensor joins the run before it when
    its first source byte lies before the run's last one (a rank's stacked routed experts: ``w13_weight``, its scale,
    ``w2_weight`` and its scale all take a slice of every expert, and the experts' ``w1``, ``w2`` and ``w3`` lie one
    after the other in the source). A tensor made of zeros only, or named in ``alone``, is a run of its own."""
    groups: list[list[OutTensor]] = []
    end: tuple[str, int] | None = None  # the last source byte of the run so far
    for t in tensors:
        spans = [
            (reader.sources[seg.src].file, offset, offset + length)
            for seg in t.segments
            for offset, length in reader.footprint(seg)
        ]
        if not spans or t.name in alone:
            groups.append([t])
            end = None
            continue
        first = min((file, lo) for file, lo, _ in spans)
        last = max((file, hi) for file, _, hi in spans)
        if end is not None and groups and first < end:
            groups[-1].append(t)
            end = max(end, last)
        else:
            groups.append([t])
            end = last
    return groups


def _in_source_order(group: list[OutTensor], reader: SegmentReader) -> Iterator[tuple[int, Segment]]:
    """(tensor index, segment) of every segment of ``group``, each tensor's in its own order, the tensors merged so
    that the source is read front to back: the next segment is always the one, of the tensors' next ones, whose
    first source byte comes first (a segment of zeros comes as soon as it is next in its tensor)."""
    at = [0] * len(group)

    def key(k: int) -> tuple[str, int]:
        seg = group[k].segments[at[k]]
        spans = reader.footprint(seg)
        return ("", -1) if not spans else (reader.sources[seg.src].file, spans[0][0])

    heads = {k: key(k) for k in range(len(group)) if group[k].segments}
    while heads:
        k = min(heads, key=heads.__getitem__)
        yield k, group[k].segments[at[k]]
        at[k] += 1
        if at[k] < len(group[k].segments):
            heads[k] = key(k)
        else:
            del heads[k]


def write_output_file(
    out: OutFile,
    dest: Path,
    files: SourceFiles,
    sources: dict[str, TensorInfo],
    progress: ProgressFn | None = None,
    warnings: list[str] | None = None,
    pace: Callable[[int], None] | None = None,
    one_pass: bool = False,
    twins: dict[str, tuple[Path, int]] | None = None,
) -> tuple[int, str]:
    """Write ``out`` to ``dest`` via a temporary name, fsync, rename. Returns (size, sha256).

    ``pace``: called with the bytes written so far before each buffer is filled from the source (a
    :class:`~ckpt_tool.checkpoint.lockstep.Lockstep` keeping the ranks of a group together may hold it there).

    ``one_pass``: tensors whose source bytes interleave (:func:`interleaved_groups`) are written together, in one
    pass over their source bytes, each at its place in the file; the group's first tensor goes through the pipeline
    as every other tensor, the others are hashed after it, read back. Same bytes, same checksum; what it saves is a
    second pass over the source, which a streamed source would have to keep on local disk in between.

    ``twins``: tensors (by name) whose bytes are already in a finished file of OUT (path, absolute offset), copied
    from there rather than read from the source (``output.twins``).

    Before the rename, every source file ``out`` read from must still be the file the plan was made from
    (``files.identities``): a source changed mid-file leaves no file under the final name.
    """
    tmp = dest.with_name(f".{dest.name}.tmp")
    header = header_bytes(out)
    expected = len(header) + out.data_bytes
    reader = SegmentReader(files, sources, warnings)
    pipe: _Pipeline | None = None
    try:
        fd, direct = _open_output(tmp)
        plain_fd = os.open(tmp, os.O_RDWR | getattr(os, "O_CLOEXEC", 0)) if direct else fd
        try:
            try:
                os.posix_fallocate(fd, 0, expected)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:  # fail now rather than half-way
                    raise
            pipe = _Pipeline(fd, plain_fd, tmp, direct, progress, pace, ONE_PASS_RING if one_pass else RING)
            pipe.write(header)
            twins = twins or {}
            groups = interleaved_groups(out.tensors, reader, twins) if one_pass else [[t] for t in out.tensors]
            for group in groups:
                if group[0].name in twins:  # (a run of its own)
                    _copy_twin(pipe, *twins[group[0].name], group[0].nbytes)
                else:
                    _write_group(pipe, reader, files, group, progress, out.relpath)
            written = pipe.written
            digest = pipe.finish()
            os.ftruncate(fd, written)
            os.fsync(fd)
            files.check_unchanged(files_fed(out, sources))  # what was read is still the source: only then final
        except BaseException:
            if pipe is not None:
                pipe.abort()
            raise
        finally:
            os.close(fd)
            if plain_fd != fd:
                os.close(plain_fd)
        if written != expected:  # pragma: no cover
            raise AssertionError(f"{out.relpath}: wrote {written} bytes, planned {expected}")
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise output_error(exc, dest) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return expected, digest


def _write_group(
    pipe: _Pipeline,
    reader: SegmentReader,
    files: SourceFiles,
    group: list[OutTensor],
    progress: ProgressFn | None,
    relpath: str,
) -> None:
    """The tensors of ``group``, one after the other in the file: the first through ``pipe``; the others (if any)
    each at its own offset (:class:`_Region`), their segments taken in source order with the first's, then hashed in
    their place (``pipe.defer``)."""
    offset = pipe.written + group[0].nbytes
    sinks: list[_Pipeline | _Region] = [pipe]
    for t in group[1:]:
        sinks.append(_Region(pipe, offset, progress))
        offset += t.nbytes
    start = pipe.written
    order = _in_source_order(group, reader) if len(group) > 1 else ((0, seg) for seg in group[0].segments)
    for k, seg in order:
        _fill_segment(sinks[k], reader, files, seg, group[k].dtype)
    made = [pipe.written - start, *(sink.written for sink in sinks[1:])]
    for t, n in zip(group, made, strict=True):
        if n != t.nbytes:  # pragma: no cover - a plan/writer disagreement is a bug
            raise AssertionError(f"{relpath}: {t.name} wrote {n} bytes, planned {t.nbytes}")
    for sink in sinks[1:]:
        sink.flush()
    if len(group) > 1:
        pipe.defer(sum(t.nbytes for t in group[1:]))


def _copy_twin(pipe: _Pipeline, path: Path, offset: int, n: int) -> None:
    """``n`` bytes of the finished OUT file ``path`` from ``offset`` (a twin's) into the pipeline, read directly."""
    scratch = Scratch()  # (not the pipeline's: its hasher thread may be reading a deferred range back meanwhile)
    for piece in _pieces(pipe.readback, path, offset, n, scratch, "a twin's bytes"):
        pipe.write(piece)


def _pieces(files: LocalFiles, path: Path, offset: int, n: int, scratch: Scratch, what: str) -> Iterator[memoryview]:
    """Bytes ``[offset, offset + n)`` of the output file ``path``, a ``PIECE`` at a time, in order (each view valid
    until the next)."""
    done = 0
    while done < n:
        k = min(PIECE, n - done)
        yield files.read_span(path, offset + done, k, scratch, what=what)
        done += k


def _fill_segment(pipe: _Sink, reader: SegmentReader, files: SourceFiles, seg: Segment, dtype: str) -> None:
    if seg.src == ZERO:
        _fill_zeros(pipe, conversions.zero_element(seg.convert, dtype), seg.numel)
        return
    ranges = reader.byte_ranges(seg)
    if ranges is None:  # narrow column slices or a dtype conversion: through the reader's scratch
        reader.stream(seg, pipe.write)
        return
    info = reader.sources[seg.src]
    check = reader.checker(info)
    if check is not None and DTYPE_BITS[info.dtype] > 8:  # a scan of whole elements (norms: small)
        reader.stream(seg, pipe.write)
        return
    for offset, length in ranges:  # read straight into the output buffer
        done = 0
        while done < length:
            room = pipe.space()
            n = min(len(room), length - done)
            files.pread_exact(info, room[:n], offset + done)
            if check is not None:
                check(room[:n])
            pipe.commit(n)
            done += n


@functools.lru_cache(maxsize=4)
def _zero_piece(element: bytes) -> bytes:
    """``PIECE`` bytes of repeated ``element`` (one per zero-element kind: zero bytes, float32 2^-127)."""
    return element * (PIECE // len(element))


def _fill_zeros(pipe: _Sink, element: bytes, count: int) -> None:
    """``count`` copies of ``element`` into the output buffer, a piece at a time (never the whole fill in memory)."""
    piece = memoryview(_zero_piece(element))
    left = count * len(element)
    done = 0
    while left:
        room = pipe.space()
        at = done % len(element)  # a buffer may end inside an element: continue the pattern where it stopped
        n = min(len(room), left, len(piece) - at)
        room[:n] = piece[at : at + n]
        pipe.commit(n)
        left -= n
        done += n
