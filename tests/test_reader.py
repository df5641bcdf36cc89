"""The one reader of checkpoint bytes (``ckpt_tool.checkpoint.reader``): what it reads, how it fails, and that the
stages read through it."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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

    monkeypatch.setattr(reads.os, "open", refusing_open)
    monkeypatch.setattr(reads.os, "preadv", refusing_preadv)
    if not reads.DIRECT_IO:
        pytest.skip("direct I/O is off here")
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
