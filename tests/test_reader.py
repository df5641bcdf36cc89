"""The one reader of checkpoint bytes (``ckpt_tool.checkpoint.reader``): what it reads, how it fails, and that the
stages read through it."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpt_tool.checkpoint import page_cache
from ckpt_tool.checkpoint import reader as reads
from ckpt_tool.checkpoint.reader import LocalFiles, Scratch, SequentialRead
from ckpt_tool.errors import CheckpointError

PACKAGE = Path(reads.__file__).resolve().parents[1]


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(3 * 4096 * 97 + 1234)  # not a whole number of pages
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("direct", [True, False])
def test_spans_at_any_offset_and_size_are_the_files_bytes_direct_or_not(data_file, monkeypatch, direct) -> None:
    """Unaligned starts and ends, reads on both sides of DIRECT_FROM, from several threads: the bytes are the file's,
    and a direct reader really reads the large ones with O_DIRECT."""
    monkeypatch.setattr(reads, "DIRECT_FROM", 8192)
    path, data = data_file
    _evict(path)  # (else a direct reader copies the whole file from the page cache)
    spans = [(0, 1), (1, 8191), (4095, 8193), (5000, 100_000), (len(data) - 7, 7), (0, len(data)), (12_345, 0)]
    with LocalFiles(path.parent, direct=direct) as files:

        def one(span: tuple[int, int]) -> bytes:
            return bytes(files.read_span(path.name, *span, Scratch()))

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, spans * 3))
        assert got == [data[a : a + n] for a, n in spans * 3]
        assert files._fd(path.name, buffered=False)[1] is (direct and reads.DIRECT_IO)
        assert files._fd(path.name, buffered=True)[1] is False  # small reads: the buffered descriptor


def test_a_short_read_names_the_file_what_and_the_bytes(data_file) -> None:
    path, data = data_file
    with LocalFiles(path.parent) as files:
        with pytest.raises(CheckpointError) as err:
            files.read_into(path.name, memoryview(bytearray(100)), len(data) - 10, what="tensor 'w'")
    msg = str(err.value)
    assert "shard.safetensors" in msg and "tensor 'w'" in msg and f"bytes {len(data) - 10}-{len(data) + 89}" in msg
    assert "ended early" in msg
    with LocalFiles(path.parent, direct=True) as files:
        assert len(files.read_span(path.name, len(data) - 10, 100, Scratch(), short_ok=True)) == 10
        with pytest.raises(CheckpointError, match="ended early"):
            files.read_span(path.name, len(data) - 10, 500_000, Scratch())


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with LocalFiles(tmp_path) as files, pytest.raises(CheckpointError, match=r"nope.safetensors: cannot be opened"):
        files.read("nope.safetensors", 0, 1)


@pytest.mark.parametrize("refuses_at", ["open", "read"])
def test_a_file_system_that_refuses_direct_io_is_read_through_the_cache(data_file, monkeypatch, refuses_at) -> None:
    """EINVAL for O_DIRECT, at the open or at the first read (file systems do either; this machine's do neither,
    so the refusal is injected): the direct reader reads that file through the cache and gives the same bytes."""
    import errno
    import fcntl

    path, data = data_file
    real_open, real_preadv = os.open, os.preadv

    def refusing_open(p, flags, *a):
        if flags & os.O_DIRECT and refuses_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    def refusing_preadv(fd, bufs, pos):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, pos)

    _evicted(path)  # (a cached file is read through the cache anyway)
    monkeypatch.setattr(reads.os, "open", refusing_open)
    monkeypatch.setattr(reads.os, "preadv", refusing_preadv)
    with LocalFiles(path.parent, direct=True) as files:
        assert bytes(files.read_span(path.name, 3, 500_000, Scratch())) == data[3:500_003]
        assert bytes(files.read_span(path.name, 4096, 300_000, Scratch())) == data[4096:304_096]
        assert files._fd(path.name, buffered=False)[1] is False


def test_small_reads_of_a_direct_reader_ask_the_kernel_for_no_read_ahead(data_file, monkeypatch) -> None:
    """A direct reader's small reads go through a buffered descriptor that reads no further than asked
    (POSIX_FADV_RANDOM): the kernel's read-ahead would bring in the large neighbours, which are read directly, so
    from the disk twice. A buffered reader's descriptors keep their read-ahead (sequential: the hint for it)."""
    path, data = data_file
    hints: dict[int, int] = {}
    monkeypatch.setattr(reads, "DIRECT_IO", True)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: hints.__setitem__(fd, advice))
    with LocalFiles(direct=True) as files:
        assert bytes(files.read_span(path, 10, 100, Scratch())) == data[10:110]
        assert bytes(files.read_span(path, 0, reads.DIRECT_FROM, Scratch())) == data[: reads.DIRECT_FROM]
        (small,) = [fd for (_, buffered), (fd, _) in files._fds.items() if buffered]
        assert hints == {small: os.POSIX_FADV_RANDOM}
    hints.clear()
    with LocalFiles(sequential=True) as files:
        files.read_span(path, 10, 100, Scratch())
        assert list(hints.values()) == [os.POSIX_FADV_SEQUENTIAL]


@pytest.mark.parametrize("block", [4096, 10_000, 1 << 20])
def test_a_front_to_back_read_hashes_every_byte_once(data_file, block) -> None:
    import hashlib

    path, data = data_file
    seq = SequentialRead(path, len(data), block)
    try:
        assert seq.read(100, 5000) == data[100:5100]
        assert seq.read(200_000, 3) == data[200_000:200_003]
        assert seq.hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        seq.close()


@pytest.mark.parametrize("block", [4096, 10_000])
def test_a_front_to_back_read_compares_in_place_and_names_the_first_differing_byte(data_file, block) -> None:
    """``mismatch``: None where the file's bytes equal the ones wanted, else the offset of the first that differs,
    within a block or in a range spanning several (its first byte, its last, one on each side of a block boundary),
    and every byte still hashed once."""
    import hashlib

    path, data = data_file
    seq = SequentialRead(path, len(data), block)
    try:
        assert seq.mismatch(100, data[100:5100]) is None
        start = 6000
        for n, flip in [(3 * block, 0), (2 * block + 7, 2 * block + 6), (5000, 2191)]:  # (in file order)
            want = bytearray(data[start : start + n])
            want[flip] ^= 0x10
            assert seq.mismatch(start, bytes(want)) == flip, (start, n, flip)
            assert seq.mismatch(start + n, data[start + n : start + n + 3]) is None
            start += n + 1000
        edge = start - start % block + block  # a block boundary: the difference just after it
        want = bytearray(data[edge - 50 : edge + 50])
        want[50] ^= 1
        assert seq.mismatch(edge - 50, bytes(want)) == 50
        assert seq.hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        seq.close()


def test_no_stage_reads_checkpoint_bytes_but_through_the_reader() -> None:
    """One reader: positional reads and direct-I/O opens for reading live in checkpoint/reader.py. (The writer opens
    OUT with O_DIRECT to write it; the hand-back file of a forked worker (processes.py) and the hub reader's spool
    are their own scratch files, not a checkpoint's.)"""
    allowed = {"checkpoint/reader.py", "processes.py", "checkpoint/hub_ranges.py"}
    pattern = re.compile(r"os\.pread|O_RDONLY\s*\|\s*os\.O_DIRECT|\.readinto\(")
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if str(p.relative_to(PACKAGE)) not in allowed and pattern.search(p.read_text())
    ]
    assert offenders == []


def _recording_preadv(monkeypatch) -> list[tuple[bool, int, int]]:
    """Every ``preadv`` from now on as (through an O_DIRECT descriptor, offset, bytes asked)."""
    import fcntl

    calls: list[tuple[bool, int, int]] = []
    real = os.preadv

    def preadv(fd, bufs, pos, *flags):
        calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), pos, sum(len(b) for b in bufs)))
        return real(fd, bufs, pos, *flags)

    monkeypatch.setattr(reads.os, "preadv", preadv)
    return calls


def _evict(path: Path) -> list | None:
    """``path`` written to the disk and dropped from the page cache; what the cache then holds of it (as
    ``page_cache.cached_runs`` says: None where it cannot be asked)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        end = -(-path.stat().st_size // page_cache.PAGE) * page_cache.PAGE
        return page_cache.cached_runs(fd, 0, end, page_cache.PAGE)
    finally:
        os.close(fd)


def _evicted(path: Path) -> None:
    """``path`` out of the page cache, or the test skipped (no direct I/O, the cache cannot be asked, or the file
    system keeps its pages: tmpfs)."""
    if not reads.DIRECT_IO:
        pytest.skip("direct I/O is off here")
    runs = _evict(path)
    end = -(-path.stat().st_size // page_cache.PAGE) * page_cache.PAGE
    if runs != [(0, end, False)]:
        pytest.skip(f"{path.parent}: the page cache cannot be asked, or keeps the file's pages ({runs})")


@pytest.mark.parametrize("query", ["cachestat", "mincore"])
def test_the_page_cache_is_asked_what_it_holds_without_reading(data_file, monkeypatch, query) -> None:
    """cached_runs: a file just evicted is all to be read directly; after its first 64 KiB are read through the cache,
    they come back as pieces to take from the cache and the rest still as direct, in page-aligned pieces (asking read
    nothing: the tail is still not cached). Both ways of asking: cachestat, and mincore where the kernel lacks it
    (ENOSYS, injected)."""
    import ctypes
    import errno

    path, data = data_file
    _evicted(path)
    if query == "mincore":
        monkeypatch.setattr(page_cache, "_has_cachestat", True)

        def no_cachestat(*args):
            ctypes.set_errno(errno.ENOSYS)
            return -1

        monkeypatch.setattr(page_cache._LIBC, "syscall", no_cachestat)
    end = -(-len(data) // page_cache.PAGE) * page_cache.PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: the 64 KiB asked for, no more
        assert len(os.pread(fd, 65536, 0)) == 65536
        assert page_cache.cached_runs(fd, 0, end, page_cache.PAGE) == [(0, 65536, True), (65536, end, False)]
        assert page_cache.cached_runs(fd, 65536, end, page_cache.PAGE) == [(65536, end, False)]
        assert page_cache.cached_runs(fd, 0, end, 1 << 30) == [(0, end, True)]  # mixed, not split: through the cache
        if query == "mincore":
            assert not page_cache._has_cachestat
            monkeypatch.setattr(page_cache, "_mincore_tells_truth", lambda fd: False)
            assert page_cache.cached_runs(fd, 0, end, page_cache.PAGE) is None  # it would say "all cached"
    finally:
        os.close(fd)


def test_a_direct_reader_takes_what_the_page_cache_holds_from_it_and_the_rest_from_the_disk(data_file, monkeypatch):
    """Cold, a large read is one O_DIRECT read; warm (the file just read), one read through the cache and none direct
    (the disk would read again what the cache holds: verify values right after convert read its source twice over);
    partly cached, the cached pages through the cache and the others directly, each byte asked for once. The bytes
    are the file's every time."""
    path, data = data_file
    _evicted(path)
    offset, n = 5000, 1_000_000
    calls = _recording_preadv(monkeypatch)
    with LocalFiles(direct=True) as files:
        assert bytes(files.read_span(path, offset, n, Scratch())) == data[offset : offset + n]
        assert calls == [(True, 4096, 1_003_520)]  # [4096, 1007616): whole pages

        calls.clear()
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 65536, 0)  # pages [0, 64 KiB) cached (not through the recorded preadv)
        os.pread(fd, 65536, 524288)  # and [512, 576) KiB
        os.close(fd)
        calls.clear()
        monkeypatch.setattr(reads, "DIRECT_FROM", 4096)  # pieces split down to a page
        assert bytes(files.read_span(path, offset, n, Scratch())) == data[offset : offset + n]
        assert calls == [(False, 4096, 61440), (True, 65536, 458752), (False, 524288, 65536), (True, 589824, 417792)]

        calls.clear()
        path.read_bytes()  # all of it cached
        assert bytes(files.read_span(path, offset, n, Scratch())) == data[offset : offset + n]
        assert calls == [(False, offset, n)]


def test_a_direct_read_split_between_cache_and_disk_ends_at_the_end_of_the_file(data_file, monkeypatch) -> None:
    """Pieces past the end of the file (cached or not, as the kernel answers) give a short read: what there is, or
    the 'ended early' error; the pieces' order is kept whatever they are."""
    path, data = data_file
    if not reads.DIRECT_IO:
        pytest.skip("direct I/O is off here")
    size = len(data)
    end = -(-size // 4096) * 4096
    with LocalFiles(direct=True) as files:
        for runs in ([(0, 8192, False), (8192, end, True)], [(0, end - 4096, True), (end - 4096, end, False)]):
            monkeypatch.setattr(
                page_cache,
                "cached_runs",
                lambda fd, a, b, least, runs=runs: [
                    (max(a, r0), min(b, r1), c) for r0, r1, c in runs if r1 > a and r0 < b
                ],
            )
            assert bytes(files.read_span(path, 100, size, Scratch(), short_ok=True)) == data[100:]
            with pytest.raises(CheckpointError, match="ended early"):
                files.read_span(path, 100, size, Scratch())
