"""Streaming reads from the hub (``ckpt_tool/checkpoint/hub_ranges.py``), with the real huggingface_hub client.

The fp4 fixture is served by ``tests/hub_server.py`` in this process (the endpoint passed explicitly: HF_ENDPOINT
is read at import); what went over the wire is asserted from the server's request log. Each range request is a
GET on the hub's resolve URL (logged with host "hub", answered 302) followed by the GET on the CDN that carries
the bytes (host "cdn", answered 206). Chunks are 256 KiB, so the 1-5 MB shards span several.
"""

from __future__ import annotations

import math
import random
import shutil
import threading
from pathlib import Path

import pytest
from hub_server import HANG_S, Fault, HubServer, Request

from ckpt_tool.checkpoint import hub_ranges
from ckpt_tool.checkpoint.headers import read_shard_header
from ckpt_tool.checkpoint.hub import HubRef
from ckpt_tool.checkpoint.hub_ranges import HubRangeReader, RetryPolicy, block_counts
from ckpt_tool.checkpoint.reader import LocalFiles
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.writer import SourceFiles, source_reads, write_output_file

REPO_ID = "deepseek-ai/Tiny-V4"
CHUNK = 256 * 1024
FAST = RetryPolicy(attempts=4, backoff_s=0.01, backoff_max_s=0.05, max_wait_s=5.0)
BIG = "model-00003-of-00004.safetensors"  # 4.9 MB: 19 chunks


def shard_sizes(src: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(src.glob("*.safetensors"))}


@pytest.fixture
def src(fixture_dir) -> Path:
    return fixture_dir("fp4")


@pytest.fixture
def hub(src):
    with HubServer() as server:
        server.push(REPO_ID, src)
        yield server


def reader_for(hub: HubServer, src: Path, *, repo_id: str = REPO_ID, commit: str | None = None, **kw):
    commit = commit or hub.repos[REPO_ID].refs["main"]
    kw = {"chunk_bytes": CHUNK, "cache_bytes": 8 * CHUNK, "retry": FAST, **kw}
    return HubRangeReader(HubRef(repo_id, "main"), commit, shard_sizes(src), endpoint=hub.url, **kw)


def range_requests(hub: HubServer, file: str) -> list[Request]:
    """The range requests the reader issued for ``file`` (on the hub; each is followed to the CDN)."""
    return hub.requests("GET", file=file, host="hub")


def span(r: Request) -> tuple[int, int]:
    a, b = r.range.removeprefix("bytes=").split("-")
    return int(a), int(b) + 1


# ---------------------------------------------------------------------------------------------
# Bytes, and what they cost


def test_every_tensor_and_random_spans_are_the_files_bytes(hub, src) -> None:
    rng = random.Random(32)
    with reader_for(hub, src, cache_bytes=4 * CHUNK) as reader:
        for file, size in shard_sizes(src).items():
            data = (src / file).read_bytes()
            for info in read_shard_header(src / file, file).tensors.values():
                buf = bytearray(info.nbytes)
                reader.read_into(file, memoryview(buf), info.start, what=f"tensor {info.name!r}")
                assert buf == data[info.start : info.end], info.name
            for _ in range(40):
                n = rng.choice([1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, rng.randrange(1, size)])
                n = min(n, size)
                offset = rng.choice([0, size - n, rng.randrange(0, size - n + 1)])
                assert reader.read(file, offset, n) == data[offset : offset + n], (file, offset, n)


def test_a_sequential_read_fetches_each_byte_once_in_one_request_per_chunk_at_most(hub, src) -> None:
    size = shard_sizes(src)[BIG]
    header = read_shard_header(src / BIG, BIG)
    with reader_for(hub, src) as reader:
        reader.read(BIG, 0, header.data_start)
        for info in sorted(header.tensors.values(), key=lambda t: t.start):
            reader.read(BIG, info.start, info.nbytes)
        stats = reader.stats()
    log = range_requests(hub, BIG)
    assert stats.requests == len(log) <= math.ceil(size / CHUNK)
    assert stats.bytes_fetched == hub.bytes_sent(BIG) == size  # within 1.02x: exactly 1x
    spans = sorted(span(r) for r in log)
    assert spans[0][0] == 0 and spans[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no byte fetched twice, none missed
    assert all(a % CHUNK == 0 for a, _ in spans)  # aligned chunks


def test_a_read_over_missing_chunks_is_one_request_per_run_of_adjacent_ones(hub, src) -> None:
    data = (src / BIG).read_bytes()
    with reader_for(hub, src) as reader:
        assert reader.read(BIG, 3 * CHUNK + 10, 20) == data[3 * CHUNK + 10 : 3 * CHUNK + 30]  # chunk 3 cached
        assert reader.read(BIG, CHUNK + 5, 5 * CHUNK) == data[CHUNK + 5 : 6 * CHUNK + 5]  # chunks 1-6
    assert [span(r) for r in range_requests(hub, BIG)] == [
        (3 * CHUNK, 4 * CHUNK),
        (1 * CHUNK, 3 * CHUNK),  # 1-2 in one request
        (4 * CHUNK, 7 * CHUNK),  # 4-6 in one request
    ]


def test_the_last_chunk_of_a_file_is_shorter_and_reads_past_the_end_are_refused(hub, src) -> None:
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    with reader_for(hub, src) as reader:
        assert reader.read(BIG, size - 3, 3) == data[-3:]
        with pytest.raises(CheckpointError, match=rf"^{BIG}: tensor 'x': bytes {size - 3}-{size} lie outside"):
            reader.read(BIG, size - 3, 4, what="tensor 'x'")
        with pytest.raises(CheckpointError, match="^model-9.safetensors: not a file of"):
            reader.read("model-9.safetensors", 0, 1)
    assert [span(r) for r in range_requests(hub, BIG)] == [(size // CHUNK * CHUNK, size)]


# ---------------------------------------------------------------------------------------------
# Faults


def test_429_with_retry_after_and_503_are_retried(hub, src) -> None:
    hub.inject(Fault(file=BIG, host="hub", status=503))
    hub.inject(Fault(file=BIG, host="cdn", status=429, retry_after=1))
    with reader_for(hub, src) as reader:
        assert reader.read(BIG, 0, 100) == (src / BIG).read_bytes()[:100]
        stats = reader.stats()
    log = hub.requests("GET", file=BIG)
    assert [(r.host, r.status) for r in log] == [
        ("hub", 503),
        ("hub", 302),
        ("cdn", 429),
        ("hub", 302),
        ("cdn", 206),
    ]
    assert all(r.range == f"bytes=0-{CHUNK - 1}" for r in log)  # the Range is sent again, and kept on the redirect
    assert stats.requests == 3 and stats.waited_s >= 1.0  # Retry-After: 1 was honoured


def test_a_connection_dropped_mid_body_resumes_from_the_byte_it_reached(hub, src) -> None:
    hub.inject(Fault(file=BIG, host="cdn", drop_after=100_000))
    with reader_for(hub, src) as reader:
        assert reader.read(BIG, 0, 3 * CHUNK) == (src / BIG).read_bytes()[: 3 * CHUNK]
        stats = reader.stats()
    cdn = hub.requests("GET", file=BIG, host="cdn")
    assert [(r.range, r.sent) for r in cdn] == [
        (f"bytes=0-{3 * CHUNK - 1}", 100_000),
        (f"bytes=100000-{3 * CHUNK - 1}", 3 * CHUNK - 100_000),  # the rest, not the start again
    ]
    assert stats.requests == 2 and stats.bytes_fetched == 3 * CHUNK


def test_a_short_body_is_refused_and_fetched_again(hub, src) -> None:
    hub.inject(Fault(file=BIG, host="cdn", short_by=7))
    with reader_for(hub, src) as reader:
        assert reader.read(BIG, 0, CHUNK) == (src / BIG).read_bytes()[:CHUNK]
    assert [(r.range, r.sent) for r in hub.requests("GET", file=BIG, host="cdn")] == [
        (f"bytes=0-{CHUNK - 1}", CHUNK - 7),  # Content-Range bytes 0-{CHUNK-8}: not what was asked
        (f"bytes=0-{CHUNK - 1}", CHUNK),
    ]


def test_retries_spent_is_one_error_naming_file_range_commit_repo_and_the_rerun(hub, src) -> None:
    commit = hub.repos[REPO_ID].refs["main"]
    hub.inject(Fault(file=BIG, host="cdn", status=503, times=FAST.attempts))
    with reader_for(hub, src) as reader:
        with pytest.raises(CheckpointError) as err:
            reader.read(BIG, 10, 20, what="tensor 'layers.0.ffn.w1'")
        assert str(err.value) == (
            f"{BIG}: tensor 'layers.0.ffn.w1': bytes 0-{CHUNK - 1} of commit {commit[:12]} could not be fetched from "
            f"{REPO_ID} after {FAST.attempts} attempts (HTTP 503); check the network (and HF_ENDPOINT / proxy "
            "settings), then rerun the same command to resume"
        )
        assert reader.stats().requests == FAST.attempts
        # the failure is not cached: the next read asks again (and the hub answers now)
        assert reader.read(BIG, 10, 20) == (src / BIG).read_bytes()[10:30]


def test_a_retry_after_beyond_the_wait_budget_fails_at_once(hub, src) -> None:
    hub.inject(Fault(file=BIG, host="cdn", status=429, retry_after=3600))
    with reader_for(hub, src) as reader:
        with pytest.raises(CheckpointError, match=r"after 1 attempts \(HTTP 429; waiting 3600s more would pass"):
            reader.read(BIG, 0, 1)
        assert reader.stats().waited_s == 0


@pytest.mark.parametrize(
    ("repo_id", "file", "error"),
    [
        ("other-org/Nope", BIG, "RepositoryNotFoundError"),
        (REPO_ID, "model-00005-of-00004.safetensors", "RemoteEntryNotFoundError"),
    ],
    ids=["unknown-repo", "unknown-file"],
)
def test_a_refusal_is_one_clear_error_without_retries(hub, src, repo_id, file, error) -> None:
    sizes = {**shard_sizes(src), file: 1000}
    commit = hub.repos[REPO_ID].refs["main"]
    reader = HubRangeReader(
        HubRef(repo_id, "main"), commit, sizes, chunk_bytes=CHUNK, cache_bytes=CHUNK, retry=FAST, endpoint=hub.url
    )
    with reader, pytest.raises(CheckpointError) as err:
        reader.read(file, 0, 10, what="tensor 'x'")
    message = str(err.value)
    assert message.startswith(f"{file}: tensor 'x': {repo_id}@main: bytes 0-999 of commit {commit[:12]} cannot be read")
    assert f"({error}: " in message and "check the repo id and revision" in message
    assert reader.stats().requests == 1 and len(hub.requests("GET", file=file)) == 1


def test_sizes_from_another_commit_are_refused_not_retried(hub, src) -> None:
    sizes = {**shard_sizes(src), BIG: shard_sizes(src)[BIG] + 1}
    commit = hub.repos[REPO_ID].refs["main"]
    reader = HubRangeReader(HubRef(REPO_ID, "main"), commit, sizes, chunk_bytes=CHUNK, retry=FAST, endpoint=hub.url)
    with reader, pytest.raises(CheckpointError, match="the hub says the file has .* bytes, its header said"):
        reader.read(BIG, 0, 10)
    assert reader.stats().requests == 1


# ---------------------------------------------------------------------------------------------
# Pinning, threads, memory


def test_a_branch_moved_after_the_commit_was_resolved_still_reads_that_commit(hub, src, tmp_path) -> None:
    from huggingface_hub import HfApi

    old = HfApi(endpoint=hub.url, token=False).model_info(REPO_ID, revision="main").sha
    moved = tmp_path / "moved"
    shutil.copytree(src, moved)
    data = (src / BIG).read_bytes()
    (moved / BIG).write_bytes(data[: len(data) // 2] + bytes(len(data) - len(data) // 2))  # same size, new bytes
    new = hub.push(REPO_ID, moved)
    assert new != old
    with reader_for(hub, src, commit=old) as reader:
        assert reader.read(BIG, len(data) - 1000, 1000) == data[-1000:]
    assert all(f"/resolve/{old}/" in r.path for r in range_requests(hub, BIG))


def test_threads_reading_one_chunk_at_once_fetch_it_once(hub, src) -> None:
    data = (src / BIG).read_bytes()
    hub.inject(Fault(file=BIG, host="cdn", delay_s=0.5))  # the first fetch is surely in flight when the rest ask
    threads, start, results = 8, threading.Barrier(8), {}
    with reader_for(hub, src) as reader:

        def read(k: int) -> None:
            start.wait()
            results[k] = reader.read(BIG, CHUNK + 1000 * k, 5000)

        workers = [threading.Thread(target=read, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert reader.stats().requests == 1
    assert all(results[k] == data[CHUNK + 1000 * k : CHUNK + 1000 * k + 5000] for k in range(threads))
    assert [span(r) for r in range_requests(hub, BIG)] == [(CHUNK, 2 * CHUNK)]


def test_the_cache_never_holds_more_than_cache_bytes_and_evicts_the_least_recently_used(hub, src) -> None:
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    rng = random.Random(5)
    with reader_for(hub, src, cache_bytes=3 * CHUNK) as reader:
        for _ in range(60):
            offset = rng.randrange(0, size - 1000)
            assert reader.read(BIG, offset, 1000) == data[offset : offset + 1000]
        assert reader.read(BIG, 0, size) == data  # one read bigger than the whole cache
        stats = reader.stats()
        assert stats.peak_cached_bytes == 3 * CHUNK  # full, never over
        before = stats.requests
        reader.read(BIG, size - 10, 10)  # the last chunk: the most recently used, still cached
        assert reader.stats().requests == before
        reader.read(BIG, 0, 10)  # the first: evicted long ago
        assert reader.stats().requests == before + 1
        assert reader.stats().peak_cached_bytes == 3 * CHUNK


def test_prefetch_has_several_requests_in_flight_and_the_reads_then_fetch_nothing(hub, src) -> None:
    files = sorted(shard_sizes(src))[:3]
    for file in files:  # each answer waits until two requests were in flight at once (a hang if never)
        hub.inject(Fault(file=file, host="cdn", before=lambda: hub.wait_peak(2)))
    with reader_for(hub, src, workers=3) as reader:
        for file in files:
            reader.prefetch(file, 0, 2 * CHUNK)
        for file in files:
            assert reader.read(file, 100, 2 * CHUNK - 100) == (src / file).read_bytes()[100 : 2 * CHUNK]
        assert reader.stats().requests == 3
    assert hub.peak_inflight >= 2
    assert all([span(r) for r in range_requests(hub, file)] == [(0, 2 * CHUNK)] for file in files)


def test_chunks_the_memory_cache_lets_go_are_read_again_from_the_spool_not_the_hub(hub, src, tmp_path) -> None:
    """A second pass over a file far larger than the memory cache fetches nothing: every chunk evicted waits in the
    spool, an unnamed file (nothing is left in its folder, even while it is in use); a spool smaller than the file
    keeps only the most recent chunks."""
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    chunks = math.ceil(size / CHUNK)
    with reader_for(hub, src, cache_bytes=2 * CHUNK, spool_dir=tmp_path, spool_bytes=100 * CHUNK) as reader:
        for _ in range(2):
            for at in range(0, size, 100_000):
                assert reader.read(BIG, at, min(100_000, size - at)) == data[at : at + 100_000]
        reader.spool_settled()
        stats = reader.stats()
        assert stats.requests == chunks and stats.bytes_fetched == size  # each byte once, over two passes
        assert stats.peak_cached_bytes <= 2 * CHUNK and 0 < stats.peak_spooled_bytes <= chunks * CHUNK
        assert list(tmp_path.iterdir()) == []
    with reader_for(hub, src, cache_bytes=2 * CHUNK, spool_dir=tmp_path, spool_bytes=4 * CHUNK) as reader:
        assert reader.read(BIG, 0, size) == data
        assert reader.read(BIG, 0, size) == data
        reader.spool_settled()
        assert reader.stats().bytes_fetched > size  # the early chunks left the small spool: fetched again
        assert reader.stats().peak_spooled_bytes == 4 * CHUNK


def test_a_spool_that_cannot_be_written_is_given_up_and_the_reads_go_on(hub, src, tmp_path, caplog) -> None:
    """The spool's folder is gone (as a full disk refuses it): a warning, no waiter left hanging, every read right,
    and chunks wanted again fetched again."""
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    with reader_for(hub, src, cache_bytes=2 * CHUNK, spool_dir=tmp_path / "gone", spool_bytes=100 * CHUNK) as reader:
        for _ in range(2):
            for at in range(0, size, 100_000):
                assert reader.read(BIG, at, min(100_000, size - at)) == data[at : at + 100_000]
        assert reader.stats().bytes_fetched > size
        reader.spool_settled()
        assert not reader._spilling  # no chunk let go is held in memory for a spool that is given up
    assert "cannot be written" in caplog.text


def test_with_the_reads_known_a_chunk_with_nothing_left_to_read_is_not_spooled(hub, src, tmp_path) -> None:
    """Every chunk of a file read once, front to back: none goes to the spool, each leaves the memory cache as its
    last byte is read; a read the counts did not announce is still served (fetched again)."""
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    kw = {"cache_bytes": 2 * CHUNK, "spool_dir": tmp_path, "spool_bytes": 100 * CHUNK}
    with reader_for(hub, src, reads=lambda: [(BIG, 0, size)], **kw) as reader:
        for at in range(0, size, 100_000):
            assert reader.read(BIG, at, min(100_000, size - at)) == data[at : at + 100_000]
        stats = reader.stats()
        assert stats.bytes_fetched == size and stats.spooled_bytes == 0 and stats.peak_spooled_bytes == 0
        assert reader._cached_bytes == 0 and reader._left == {}
        assert reader.read(BIG, 5 * CHUNK, 10) == data[5 * CHUNK : 5 * CHUNK + 10]
        assert reader.stats().requests == stats.requests + 1
    with reader_for(hub, src, **kw) as reader:  # no counts: today's behaviour, every chunk let go is spooled
        for at in range(0, size, 100_000):
            reader.read(BIG, at, min(100_000, size - at))
        reader.spool_settled()
        assert reader.stats().spooled_bytes >= size - 3 * CHUNK


def test_with_the_reads_known_a_chunk_read_again_later_is_spooled_and_read_from_there(hub, src, tmp_path) -> None:
    """Chunks 8-11 and a few KiB of chunk 3 are read a second time after the whole file: they (and only they) wait in
    the spool, of chunk 3 just the blocks read again; the second reads fetch nothing, and the spool lets each chunk go
    once its last byte is read."""
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    block = CHUNK // 64
    again = [(8 * CHUNK + 10, 3 * CHUNK), (3 * CHUNK + block + 904, 2 * block + 100)]  # chunks 8-11; 3, blocks 1-3
    reads = [(BIG, 0, size), *((BIG, at, n) for at, n in again)]
    kw = {"cache_bytes": 2 * CHUNK, "spool_dir": tmp_path, "spool_bytes": 100 * CHUNK}
    with reader_for(hub, src, reads=lambda: reads, **kw) as reader:
        for at in range(0, size, 100_000):
            assert reader.read(BIG, at, min(100_000, size - at)) == data[at : at + 100_000]
        reader.spool_settled()
        assert set(reader._spool.slots) <= {(BIG, i) for i in (3, 8, 9, 10, 11)}
        assert reader._spool.held[(BIG, 3)] == [(block, 4 * block)]
        spooled = reader.stats().spooled_bytes
        assert 3 * block <= spooled <= 4 * CHUNK + 3 * block
        for at, n in again:
            assert reader.read(BIG, at, n) == data[at : at + n]
        reader.spool_settled()
        stats = reader.stats()
        assert stats.requests == math.ceil(size / CHUNK) and stats.bytes_fetched == size  # each byte once
        assert stats.spooled_bytes == spooled and reader._spool.slots == {} and reader._left == {}


@pytest.mark.parametrize("lends", [False, True], ids=["copies", "lends-views"])
@pytest.mark.parametrize("one_pass", [False, True], ids=["usual", "one-pass"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_reads_a_plan_announces_are_the_reads_its_writer_makes(src, tmp_path, tp, one_pass, lends) -> None:
    """``source_reads`` counts, chunk by chunk, exactly the bytes writing the plan's files reads (whole tensors, row
    splits, gathered column slices, padded and converted segments, a replicated tensor once a rank), whether the
    writer takes interleaved tensors one after the other or in one pass (as a streamed conversion does), and whether
    the source lends views of its bytes (as the hub reader does) or they are copied."""
    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=tp))
    made: list[tuple[str, int, int]] = []

    class Recording(LocalFiles):
        def read_into(self, file, into, offset, *, what=""):
            made.append((str(file), offset, len(into)))
            super().read_into(file, into, offset, what=what)

    class Lending(Recording):
        def view(self, file, offset, n, *, what=""):
            made.append((str(file), offset, n))
            return memoryview((src / file).read_bytes()[offset : offset + n])

    with SourceFiles(src, {}, (Lending if lends else Recording)(src)) as files:
        for f in plan.files:
            write_output_file(f, tmp_path / f.name, files, plan.sources, one_pass=one_pass)
    announced = source_reads(plan.files, plan.sources)
    assert block_counts(announced, 64 * 4096) == block_counts(made, 64 * 4096)  # bytes a 4 KiB block


def test_a_fetch_goes_on_while_the_spool_is_written_and_a_chunk_waiting_for_it_is_read_from_memory(
    hub, src, tmp_path, monkeypatch
) -> None:
    """The spool's writer is held up (a slow local disk): the file is still read front to back without a stall, and a
    chunk the memory cache let go that is still waiting for the spool is read from memory, not fetched again."""
    size = shard_sizes(src)[BIG]
    data = (src / BIG).read_bytes()
    release = threading.Event()
    real_put = hub_ranges._Spool.put

    def slow_put(spool, *args, **kw):
        assert release.wait(HANG_S), "the spool's writer was never released"
        return real_put(spool, *args, **kw)

    monkeypatch.setattr(hub_ranges, "SPILL_QUEUE", 100)
    monkeypatch.setattr(hub_ranges._Spool, "put", slow_put)
    with reader_for(hub, src, cache_bytes=2 * CHUNK, spool_dir=tmp_path, spool_bytes=100 * CHUNK) as reader:
        try:
            assert reader.read(BIG, 0, size) == data  # no put has finished: a fetch waiting on one would hang here
            assert (BIG, 0) in reader._spilling  # the first chunk let go waits for the spool, in memory
            requests = reader.stats().requests
            assert reader.read(BIG, 0, CHUNK) == data[:CHUNK]
            assert reader.stats().requests == requests  # read from memory: nothing fetched again
        finally:
            release.set()
        reader.spool_settled()
        assert not reader._spilling and reader.stats().spooled_bytes > 0


def test_a_chunk_let_go_just_as_the_spool_is_given_up_is_not_held_in_memory(hub, src, tmp_path) -> None:
    """A fetch lets a chunk go while the spool is on; before it hands it over, the spool's writer gives the spool up
    (a full disk): the chunk is dropped from memory, not kept there for a writer that will never take it."""
    with reader_for(hub, src, cache_bytes=2 * CHUNK, spool_dir=tmp_path, spool_bytes=100 * CHUNK) as reader:
        evicted = []
        for i in range(3):
            reader._inflight[(BIG, i)] = hub_ranges._Pending()
            evicted += reader._keep((BIG, i), bytearray(CHUNK))
        assert [key for key, _, _ in evicted] == [(BIG, 0)] and (BIG, 0) in reader._spilling
        reader._spool_bytes = 0  # given up meanwhile
        reader._spill(evicted)
        assert not reader._spilling


def test_a_spool_read_from_the_disk_holds_up_no_other_reader_and_a_slot_given_away_meanwhile_is_refused(
    tmp_path, monkeypatch
) -> None:
    """A spool read waiting on the local disk leaves the spool free: another chunk is put and read meanwhile (the lock
    was held for the whole read, and a prefetch waiting on it held every reader up). A read whose slot was given to
    another chunk while it read says so (False), so that its bytes are fetched again rather than served."""
    spool = hub_ranges._Spool(tmp_path, 4 * CHUNK, CHUNK)
    chunks = {i: hub_ranges.new_chunk(CHUNK) for i in range(3)}
    for i, data in chunks.items():
        data[:] = bytes([i + 1]) * CHUNK
    spool.put(("a", 0), chunks[0])
    spool.put(("a", 1), chunks[1])
    entered, release = threading.Event(), threading.Event()
    real_preadv = hub_ranges.os.preadv

    def slow_preadv(fd, buffers, offset):
        if threading.current_thread().name == "slow-reader":
            entered.set()
            assert release.wait(HANG_S), "the slow read was never released"
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(hub_ranges.os, "preadv", slow_preadv)
    got: dict[str, bool] = {}
    into = memoryview(bytearray(4096))

    def slow_read() -> None:
        got["a0"] = spool.read(("a", 0), into, 100)

    reader = threading.Thread(target=slow_read, name="slow-reader")
    reader.start()
    try:
        assert entered.wait(HANG_S)
        spool.put(("a", 2), chunks[2])  # neither waits for the slow read
        other = memoryview(bytearray(10))
        assert spool.read(("a", 1), other, 5) and bytes(other) == b"\x02" * 10
        spool.drop(("a", 0))  # its slot goes to the next chunk put, while the slow read is still reading it
        spool.put(("b", 0), chunks[2])
    finally:
        release.set()
        reader.join()
    assert got == {"a0": False}
    fresh = memoryview(bytearray(10))
    assert spool.read(("b", 0), fresh, 0) and bytes(fresh) == b"\x03" * 10
    spool.close()


def test_the_hub_client_reads_a_body_a_mebibyte_per_socket_read(hub, src) -> None:
    """huggingface_hub's HTTP stack (httpcore2) reads 64 KiB per socket read unless told otherwise; a range reader
    raises it to ``SOCKET_READ``, and the reads are still the file's bytes."""
    from httpcore2._sync.http11 import HTTP11Connection

    with reader_for(hub, src) as reader:
        assert HTTP11Connection.READ_NUM_BYTES == hub_ranges.SOCKET_READ == 1 << 20
        size = shard_sizes(src)[BIG]
        assert reader.read(BIG, 0, size) == (src / BIG).read_bytes()


# ---------------------------------------------------------------------------------------------
# Chunk buffers used again (ChunkPool)


def test_a_pooled_buffer_is_not_handed_out_again_while_anything_refers_to_it() -> None:
    """The pool hands a buffer out again only once nothing but the pool refers to it: not while a cache entry holds
    it, nor while a memoryview of a slice of it is being copied from (the buffer itself long dropped)."""
    pool = hub_ranges.ChunkPool(4096)
    a, b, c = pool.take(4096), pool.take(4096), pool.take(4096)
    ids = [id(a), id(b), id(c)]
    assert len(set(ids)) == 3  # each held: three buffers
    cache = {"k": a}  # ``a`` only in a cache entry
    view = memoryview(b)[100:200]  # ``b`` only through a reading thread's view of a slice of it
    del a, b, c  # nothing refers to ``c``
    d = pool.take(4096)
    assert id(d) == ids[2] and len(pool) == 3  # ``c`` handed out again
    e = pool.take(4096)
    assert id(e) not in ids and len(pool) == 4  # neither ``a`` nor ``b``: a new one
    cache.clear()
    assert id(pool.take(4096)) == ids[0]  # ``a`` let go by the cache: handed out again
    view.release()
    assert id(pool.take(4096)) == ids[0]  # (the one just taken was dropped at once: free again)
    f = pool.take(4096)
    assert id(f) == ids[0] and id(pool.take(4096)) == ids[1] and len(pool) == 4  # ``b``, its view released
    assert len(pool.take(100)) == 100 and len(pool) == 4  # another size (a file's last chunk) is not pooled


def test_the_pool_keeps_at_most_its_spare_free_buffers() -> None:
    pool = hub_ranges.ChunkPool(4096, spare=2)
    held = [pool.take(4096) for _ in range(5)]
    assert len(pool) == 5
    held.clear()
    pool.trim()
    assert len(pool) == 2


def test_reads_and_views_in_several_threads_reuse_a_few_buffers_and_read_the_files_bytes(hub, src) -> None:
    """Threads reading a 19-chunk shard in random order (cache hits, views, waits for another thread's fetch,
    prefetches) take no more buffers than the cache, the fetches in progress and the pool's spares hold at once,
    not one a chunk; every byte read is the file's (a buffer handed out again while a reader still copied from it,
    or while the cache held it, would show here as wrong bytes)."""
    data = (src / BIG).read_bytes()
    piece = CHUNK // 3  # reads that straddle chunks
    spans = [(o, min(piece, len(data) - o)) for o in range(0, len(data), piece)] * 2
    random.Random(7).shuffle(spans)
    workers, cached = 3, 3
    with reader_for(hub, src, cache_bytes=cached * CHUNK, readahead=2, workers=workers) as reader:
        wrong: list[int] = []

        def read(k: int) -> None:  # threads 1 and 3 take views where the reader lends them
            for o, n in spans[k::4]:
                got = reader.view(BIG, o, n) if k % 2 else None
                if got is None:
                    got = memoryview(bytearray(n))
                    reader.read_into(BIG, got, o)
                if got != data[o : o + n]:
                    wrong.append(o)
                del got

        threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong
        assert len(reader._chunks) <= cached + (workers + 1) + reader._chunks.spare < math.ceil(len(data) / CHUNK)


def test_a_view_lends_a_chunks_bytes_read_only_and_counts_them_as_read(hub, src) -> None:
    """A view is the chunk's bytes, not a copy, and read-only (the ranks share the chunk); it counts as the read it
    replaces: a chunk read to the end of its count leaves the cache. No view where no one chunk in memory holds
    the bytes: nothing fetched yet, or a span across two chunks (the caller reads those with read_into)."""
    data = (src / BIG).read_bytes()
    reads = [(BIG, 0, CHUNK), (BIG, 0, CHUNK), (BIG, CHUNK, 100)]
    with reader_for(hub, src, reads=lambda: reads) as reader:
        assert reader.view(BIG, 0, 4096) is None  # not fetched, nobody fetching it
        assert reader.read(BIG, 0, CHUNK) == data[:CHUNK]
        lent = reader.view(BIG, 0, CHUNK)
        assert lent is not None and lent.readonly and lent == data[:CHUNK]
        assert (BIG, 0) not in reader._cache and (BIG, 0) not in reader._left  # both announced reads made
        assert lent == data[:CHUNK]  # still the bytes: the view holds its chunk
        assert reader.view(BIG, CHUNK - 10, 20) is None  # across chunks 0 and 1
        assert reader.stats().requests == 1
