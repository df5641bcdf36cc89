"""``convert hf://org/name OUT --stream`` (and ``verify --source hf://... --stream``): every shard byte read with HTTP
range requests through huggingface_hub, straight into OUT; no shard on disk.

The real client in the CLI's subprocess against ``tests/hub_server.py`` (the hub's resolve, paths-info and
model-info endpoints with Range support, a CDN redirect, injected faults, a request log); every figure asserted
here is read from the server's log, and every OUT is compared byte for byte with a local conversion.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hub_server import HANG_S, Fault, HubServer, Request
from test_hub import REPO, REPO_ID, shard_of, tensor_files

from ckpt_tool.mapping.plan import Options
from ckpt_tool.output.convert import convert

CHUNK_MB = 0.25  # small requests, so the fixture's shards take several and the merging is seen
FAST = {"CKPT_TOOL_HUB_BACKOFF_S": "0.05"}


def env_for(hf_home: Path, endpoint: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CKPT_TOOL_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", HF_ENDPOINT=endpoint)
    env.update(CKPT_TOOL_HUB_CHUNK_MB=str(CHUNK_MB), **extra)
    return env


def run(cwd: Path, hub: HubServer, *args, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *map(str, args)],
        cwd=cwd,
        env=env_for(cwd / "hf", hub.url, extra),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def hub(fixture_dir):
    with HubServer() as server:
        server.push(REPO_ID, fixture_dir("fp4"))
        yield server


def shard_reads(hub: HubServer) -> list[Request]:
    """The range reads of shards the CDN answered (each hub resolve is redirected there)."""
    return [r for r in hub.requests("GET", host="cdn") if r.file and r.file.endswith(".safetensors")]


def local_conversion(fixture_dir, tmp_path: Path, **opts) -> dict[str, str]:
    local = tmp_path / "local"
    convert(fixture_dir("fp4"), local, Options(**opts))
    return tensor_files(local)


def no_shard_on_disk(tmp_path: Path) -> None:
    stored = [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]
    assert stored == [] and not list((tmp_path / "hf").rglob("*.safetensors"))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_streamed_conversion_is_the_local_one_with_each_byte_fetched_once(hub, fixture_dir, tmp_path, tp) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    res = run(tmp_path, hub, "convert", f"hf://{REPO_ID}", out, "--tp", tp, "--stream", "--json")
    assert res.returncode == 0, res.stderr
    assert tensor_files(out) == local_conversion(fixture_dir, tmp_path, tp=tp)
    no_shard_on_disk(tmp_path)
    sizes = {f: (src / f).stat().st_size for f in set(shard_of(src).values())}
    reads = shard_reads(hub)
    heads = [next(r for r in reads if r.file == f) for f in sizes]  # the plan is made first: from these
    assert all(r.range.startswith("bytes=0-") for r in heads)
    body = sum(r.sent for r in reads) - sum(r.sent for r in heads)
    assert body <= 1.02 * sum(sizes.values())  # every needed byte once (the whole fixture is needed)
    chunk = int(CHUNK_MB * (1 << 20))
    assert len(reads) - len(heads) <= sum(math.ceil(n / chunk) for n in sizes.values())
    doc = json.loads(res.stdout)
    assert doc["fetched_bytes"] == sum(r.sent for r in reads) and doc["fetch_requests"] == len(reads)
    commit = hub.repos[REPO_ID].refs["main"]
    resolves = [r for r in hub.requests(host="hub") if "/resolve/" in r.path]
    assert resolves and all(f"/resolve/{commit}/" in r.path for r in resolves)


@pytest.mark.parametrize(
    "fault",
    [
        Fault(status=503, host="cdn", times=2),
        Fault(status=429, retry_after=1, host="cdn"),
        Fault(drop_after=50_000, host="cdn"),
        Fault(short_by=7, host="cdn"),
    ],
    ids=["503", "429-retry-after", "dropped-mid-body", "short-body"],
)
def test_a_fault_while_streaming_is_retried_and_out_is_the_same(hub, fixture_dir, tmp_path, fault) -> None:
    shard = "model-00002-of-00004.safetensors"
    fault.file = shard
    hub.inject(fault)
    out = tmp_path / "out"
    res = run(tmp_path, hub, "convert", REPO_ID, out, "--tp", "2", "--stream", **FAST)
    assert res.returncode == 0, res.stderr
    assert fault.times == 0  # the fault happened
    assert tensor_files(out) == local_conversion(fixture_dir, tmp_path, tp=2)


def test_retries_spent_is_exit_1_naming_file_and_bytes_and_nothing_complete(hub, tmp_path) -> None:
    """The hub fails every read of one shard once the conversion has started writing (its journal exists: the
    hub looks when each request arrives): one error line naming the shard and the byte range, each retry a warning
    before it, exit 1, no complete manifest."""
    shard = "model-00003-of-00004.safetensors"
    out = tmp_path / "out"
    writing = (out / ".ckpt-tool-journal.json").exists
    hub.inject(Fault(status=503, file=shard, host="cdn", times=10_000, when=writing))
    env = env_for(tmp_path / "hf", hub.url, {"CKPT_TOOL_HUB_ATTEMPTS": "2", **FAST})
    args = [sys.executable, "-m", "ckpt_tool", "convert", REPO_ID, str(out), "--tp", "2", "--stream"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], stderr
    assert shard in errors[0] and "bytes " in errors[0] and "HTTP 503" in errors[0], stderr
    assert "after 2 attempts" in errors[0] and "rerun the same command to resume" in errors[0]
    manifest = out / "ckpt-tool.json"
    assert not manifest.exists() or not json.loads(manifest.read_text()).get("complete")


def test_a_branch_moved_during_the_run_does_not_mix_commits(hub, fixture_dir, tmp_path) -> None:
    """main moves to a commit whose shards hold other bytes while the conversion reads: OUT is the first commit's."""
    changed = tmp_path / "changed"
    shutil.copytree(fixture_dir("fp4"), changed)
    for shard in sorted(set(shard_of(changed).values())):
        data = bytearray((changed / shard).read_bytes())
        data[-1000:] = bytes(1000)  # tensor bytes, not the header: the plan is the same
        (changed / shard).write_bytes(bytes(data))
    first = hub.repos[REPO_ID].refs["main"]
    # the push lands while the run's first read of a shard (it has resolved main by then) waits for its answer
    hub.inject(Fault(host="cdn", before=lambda: hub.push(REPO_ID, changed)))
    res = run(tmp_path, hub, "convert", REPO_ID, tmp_path / "out", "--tp", "2", "--stream")
    assert res.returncode == 0, res.stderr
    assert hub.repos[REPO_ID].refs["main"] != first  # main did move, mid-run
    assert all(f"/resolve/{first}/" in r.path for r in hub.requests(host="hub") if "/resolve/" in r.path)
    assert tensor_files(tmp_path / "out") == local_conversion(fixture_dir, tmp_path, tp=2)


def test_kill_9_mid_stream_then_the_same_command_finishes_identically_fetching_no_finished_file_again(
    hub, fixture_dir, tmp_path
) -> None:
    """Killed once the target's files are finished and the draft's are being written: the same command finishes
    OUT byte-identical, keeps the finished files and fetches only the chunks the draft's files read."""
    from ckpt_tool.checkpoint.source import open_checkpoint

    src = fixture_dir("fp4")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ckpt_tool", "convert", REPO_ID, str(out), "--tp", "4", "--stream"]
    env = env_for(tmp_path / "hf", hub.url, {})
    journal = out / ".ckpt-tool-journal.json"
    model = {f"model/model-rank-{r}-part-0.safetensors" for r in range(4)}

    def target_written() -> bool:
        try:
            return model <= set(json.loads(journal.read_text() or "{}").get("files", {}))
        except FileNotFoundError:  # not yet, or no longer: the run removes it once OUT is complete
            return False

    held, killed = threading.Event(), threading.Event()

    def hold() -> None:  # a read once the target's files are written: the draft's, answered after the kill
        held.set()
        killed.wait(HANG_S)

    hub.inject(Fault(host="cdn", times=10_000, when=target_written, before=hold))
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + HANG_S
        while not held.wait(0.05):
            assert proc.poll() is None, f"the run never read after its target's files: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "the run never wrote its target's files"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed.set()
    assert model <= set(json.loads(journal.read_text())["files"]), "the target's files did not finish first"
    hub.faults.clear()
    hub.clear()
    res = subprocess.run([*args, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["files_skipped"] >= 4
    assert tensor_files(out) == local_conversion(fixture_dir, tmp_path, tp=4)
    # what the draft reads: mtp.*, and embed/head where the draft materializes them; chunk by chunk, plus one chunk
    # read ahead a shard
    chunk = int(CHUNK_MB * (1 << 20))
    ckpt = open_checkpoint(src)
    wanted = [t for n, t in ckpt.tensors.items() if n.startswith("mtp.") or n in ("embed.weight", "head.weight")]
    chunks = {(t.file, i) for t in wanted for i in range(t.start // chunk, (t.end - 1) // chunk + 1)}
    reads = shard_reads(hub)
    heads = [next(r for r in reads if r.file == f) for f in sorted({r.file for r in reads})]
    body = sum(r.sent for r in reads) - sum(r.sent for r in heads)
    assert body <= (len(chunks) + len(ckpt.shards)) * chunk
    assert body < 0.9 * sum(h.file_size for h in ckpt.shards.values())


@pytest.mark.parametrize("level", ["values", "numeric"])
def test_verify_streams_its_source_too(hub, fixture_dir, tmp_path, level) -> None:
    out = tmp_path / "out"
    convert(fixture_dir("fp4"), out, Options(tp=2))
    res = run(tmp_path, hub, "verify", out, "--source", REPO_ID, "--stream", "--level", level, "--json")
    assert res.returncode == 0, res.stderr + res.stdout
    no_shard_on_disk(tmp_path)
    assert shard_reads(hub)


def test_stream_of_a_local_folder_is_a_usage_error(fixture_dir, tmp_path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "convert", str(fixture_dir("fp4")), str(tmp_path / "o"), "--stream"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "--stream reads a hub repo" in res.stderr
