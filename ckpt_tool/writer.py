"""Streaming writer: one output safetensors file from a plan, copying source byte ranges in bounded chunks.

The header is computed from the plan up front; then every tensor's segments are gathered straight
from the source files (``os.pread``, no mmap, no whole tensor in memory) into a reused buffer and
appended. Memory per writer is a few chunk buffers, whatever the size of a shard or a fused tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointError, OutputError
from .format import DTYPE_BITS, TensorInfo
from .plan import OutFile, Segment

CHUNK = 8 * 1024 * 1024  # bytes per read; bounds memory per worker at a few times this
SMALL_COLUMN_SLICE = 64 * 1024  # column slices narrower than this are gathered from row blocks

ProgressFn = Callable[[int], None]


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
    """Read-only file descriptors of the source shards, opened once and shared by writer threads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                try:
                    self._fds[file] = os.open(self.root / file, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(f"{file}: cannot open for reading ({exc.strerror})") from None
            return self._fds[file]

    def pread_exact(self, info: TensorInfo, into: memoryview, offset: int) -> None:
        """Fill ``into`` from absolute ``offset`` of ``info``'s file; a short read means the file changed."""
        fd = self.fd(info.file)
        got = 0
        while got < len(into):
            n = os.preadv(fd, [into[got:]], offset + got)
            if n == 0:
                raise CheckpointError(
                    f"{info.file}: tensor {info.name!r}: file ended early at byte {offset + got}; "
                    "was it truncated or modified during conversion?"
                )
            got += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _e8m0_to_f32(raw: memoryview, info: TensorInfo) -> bytes:
    import numpy as np

    b = np.frombuffer(raw, dtype=np.uint8)
    nan = np.flatnonzero(b == 0xFF)
    if nan.size:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r}: E8M0 scale byte 0xFF (NaN) at element {int(nan[0])} "
            f"({nan.size} in this chunk); the checkpoint is corrupt"
        )
    bits = b.astype(np.uint32) << 23
    bits[b == 0] = 0x00400000  # 2^-127 is a float32 subnormal, not 0
    return bits.view(np.float32).astype("<f4").tobytes()


def _check_e8m0(raw: memoryview, info: TensorInfo) -> None:
    import numpy as np

    nan = np.flatnonzero(np.frombuffer(raw, dtype=np.uint8) == 0xFF)
    if nan.size:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r}: E8M0 scale byte 0xFF (NaN) in {nan.size} element(s) of a chunk; "
            "the checkpoint is corrupt — re-download this shard"
        )


def _nonfinite(raw: memoryview, dtype: str) -> int:
    import numpy as np

    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2")
        return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))  # exponent all ones: inf or NaN
    if dtype == "F32":
        return int(np.count_nonzero(~np.isfinite(np.frombuffer(raw, dtype="<f4"))))
    return 0


class SegmentReader:
    """Streams the bytes of one segment in chunks, reusing one buffer.

    On the way it rejects E8M0 NaN bytes (0xFF) in scales and notes non-finite values in norm
    weights (``warnings``): both are cheap scans of bytes already in memory.
    """

    def __init__(self, files: SourceFiles, sources: dict[str, TensorInfo], warnings: list[str] | None = None) -> None:
        self.files = files
        self.sources = sources
        self.buf = bytearray(CHUNK)
        self.gather = bytearray(CHUNK)
        self.warnings = warnings if warnings is not None else []

    def stream(self, seg: Segment, emit: Callable[[memoryview | bytes], None]) -> None:
        info = self.sources[seg.src]
        eb = DTYPE_BITS[info.dtype] // 8
        cols = (info.numel // info.shape[0]) if info.shape else 1
        row_bytes = cols * eb
        convert = seg.convert
        if convert == "e8m0_to_f32":
            out = lambda mv: emit(_e8m0_to_f32(mv, info))  # noqa: E731
        elif info.dtype == "F8_E8M0":
            out = lambda mv: (_check_e8m0(mv, info), emit(mv))  # noqa: E731
        elif info.name.endswith("norm.weight") and info.dtype in ("BF16", "F32"):
            def out(mv: memoryview) -> None:
                bad = _nonfinite(mv, info.dtype)
                if bad:
                    self.warnings.append(
                        f"{info.file}: tensor {info.name!r}: {bad} NaN/Inf value(s) in a norm weight; "
                        "copied as stored, but the model will produce NaNs"
                    )
                emit(mv)
        else:
            out = emit
        if seg.col0 == 0 and seg.col1 == cols:
            self._contiguous(info, info.start + seg.row0 * row_bytes, (seg.row1 - seg.row0) * row_bytes, out)
            return
        c0, width = seg.col0 * eb, (seg.col1 - seg.col0) * eb
        if width >= SMALL_COLUMN_SLICE or row_bytes > CHUNK:
            for row in range(seg.row0, seg.row1):
                self._contiguous(info, info.start + row * row_bytes + c0, width, out)
            return
        import numpy as np

        rows_per_chunk = max(1, CHUNK // row_bytes)
        row = seg.row0
        while row < seg.row1:
            n = min(rows_per_chunk, seg.row1 - row)
            mv = memoryview(self.buf)[: n * row_bytes]
            self.files.pread_exact(info, mv, info.start + row * row_bytes)
            src = np.frombuffer(mv, dtype=np.uint8).reshape(n, row_bytes)[:, c0 : c0 + width]
            dst = np.frombuffer(memoryview(self.gather)[: n * width], dtype=np.uint8).reshape(n, width)
            np.copyto(dst, src)
            out(memoryview(self.gather)[: n * width])
            row += n

    def _contiguous(self, info: TensorInfo, offset: int, length: int, out: Callable[[memoryview], None]) -> None:
        done = 0
        while done < length:
            n = min(CHUNK, length - done)
            mv = memoryview(self.buf)[:n]
            self.files.pread_exact(info, mv, offset + done)
            out(mv)
            done += n


def write_output_file(
    out: OutFile,
    dest: Path,
    files: SourceFiles,
    sources: dict[str, TensorInfo],
    progress: ProgressFn | None = None,
    warnings: list[str] | None = None,
) -> tuple[int, str]:
    """Write ``out`` to ``dest`` via a temporary name, fsync, rename. Returns (size, sha256)."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    digest = hashlib.sha256()
    header = header_bytes(out)
    expected = len(header) + out.data_bytes
    reader = SegmentReader(files, sources, warnings)
    try:
        with open(tmp, "wb", buffering=0) as fh:
            try:
                os.posix_fallocate(fh.fileno(), 0, expected)
            except OSError as exc:
                if exc.errno in (28,):  # ENOSPC: fail now rather than half-way
                    raise
            written = 0

            def emit(chunk: memoryview | bytes) -> None:
                nonlocal written
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    n = fh.write(view)
                    view = view[n:]
                written += len(chunk)
                if progress:
                    progress(len(chunk))

            emit(header)
            for t in out.tensors:
                start = written
                for seg in t.segments:
                    reader.stream(seg, emit)
                if written - start != t.nbytes:  # pragma: no cover - a plan/writer disagreement is a bug
                    raise AssertionError(f"{out.relpath}: {t.name} wrote {written - start} bytes, planned {t.nbytes}")
            fh.truncate(written)
            os.fsync(fh.fileno())
        if written != expected:  # pragma: no cover
            raise AssertionError(f"{out.relpath}: wrote {written} bytes, planned {expected}")
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == 28:
            raise OutputError(f"{dest}: no space left on device while writing; free space and rerun to resume") from None
        raise OutputError(f"{dest}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return expected, digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(memoryview(buf)[:n])
    return digest.hexdigest()
