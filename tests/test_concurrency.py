"""Two converts into the same OUT: the second refuses, naming the lock, and never touches the first's files.

The first convert is either held by the test itself (``convert.OutputLock``) or runs in another
process paused half-way through writing its first file (a progress hook waits for a go file), so
the refusal is checked while a temporary file is really open and being written. No step waits a fixed
time for another: bounds here (``HANG_S``) are only reached by a hang.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot

from ckpt_tool.cli.entry import main
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.output.layout import LOCK, MANIFEST, OutputLock

REPO = Path(__file__).resolve().parents[1]
HANG_S = 300  # only a hang takes this long; a busy machine can stall a process for seconds, never for this
OPTS = ["--tp", "2", "--max-shard-size", "2MB"]

PAUSED_CONVERT = r"""
import os, sys, time
from pathlib import Path
from ckpt_tool.output.convert import convert
from ckpt_tool.mapping.plan import Options

src, out, ready, go = map(Path, sys.argv[1:5])
seen = [0]
parent = os.getppid()

def progress(n):
    seen[0] += n
    # progress runs on the writer thread once bytes are in the file: pausing here freezes the
    # temporary's content, so the test can compare snapshots taken before and after a refusal
    if not ready.exists():
        ready.write_text(str(seen[0]))
        while not go.exists():  # no deadline: however long the test takes, it writes go or goes away
            if os.getppid() != parent:
                sys.exit(3)
            time.sleep(0.01)

# one writer: the pause freezes OUT
convert(src, out, Options(tp=2, max_shard_size=2_000_000), progress=progress, workers=1)
"""


@contextlib.contextmanager
def paused_convert(src: Path, out: Path, tmp_path: Path):
    """A convert in another process, paused inside its first output file until the block ends.

    Yields the process; on exit lets it finish (killing it if it hangs) so callers can check its result.
    """
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CONVERT, str(src), str(out), str(ready), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + HANG_S
        while not ready.exists():
            assert first.poll() is None, f"first convert exited early: {first.communicate()}"
            assert time.monotonic() < deadline, "first convert never reached its first write"
            time.sleep(0.02)
        yield first
    finally:
        go.write_text("go")
        try:
            first.stdout_text, first.stderr_text = first.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
            first.stdout_text = first.stderr_text = ""


def check_refused(code: int, err: str) -> None:
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert LOCK in lines[0] and "another ckpt-tool convert" in lines[0] and "wait" in lines[0], lines[0]


@pytest.fixture(scope="module")
def clean(fixture_dir, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    src = fixture_dir("fp4")
    ref = tmp_path_factory.mktemp("concurrency") / "ref"
    assert main(["convert", str(src), str(ref), *OPTS]) == 0
    return src, snapshot(ref)


def test_second_convert_refuses_while_the_lock_is_held(clean, tmp_path: Path, capsys) -> None:
    src, want = clean
    out = tmp_path / "out"
    out.mkdir()
    with OutputLock(out):
        before = snapshot(out)
        for extra in ([], ["--force"], ["--workers", "2"]):
            code, _, err = run_cli(capsys, "convert", src, out, *OPTS, *extra)
            check_refused(code, err)
            assert snapshot(out) == before, f"a refused convert {extra} changed OUT"
    # lock released: the same command now succeeds and equals a clean conversion
    code, _, err = run_cli(capsys, "convert", src, out, *OPTS)
    assert code == 0, err
    assert snapshot(out) == want


def test_second_convert_refuses_while_another_process_is_mid_write(clean, tmp_path: Path, capsys) -> None:
    src, want = clean
    out = tmp_path / "out"
    with paused_convert(src, out, tmp_path) as first:
        temps = list(out.rglob(".*.safetensors.tmp"))
        assert temps, "the first convert should be paused inside its first file"
        before = snapshot(out)
        for extra in ([], ["--force"]):
            code, _, err = run_cli(capsys, "convert", src, out, *OPTS, *extra)
            check_refused(code, err)
            assert snapshot(out) == before, "the refused convert touched the first one's files"
    assert first.returncode == 0, first.stderr_text
    assert snapshot(out) == want, "the first convert's output differs from a clean conversion"


def test_two_racing_processes_one_converts_the_other_refuses(clean, tmp_path: Path) -> None:
    """No pause: whichever loses the race sees the lock (or, if it starts late, the finished OUT)."""
    src, want = clean
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "ckpt_tool", "convert", str(src), str(out), *OPTS]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    results = [(p.wait(timeout=HANG_S), p.communicate()[1]) for p in procs]
    codes = sorted(c for c, _ in results)
    assert codes == [0, 1], results
    loser = next(err for c, err in results if c == 1)
    assert "Traceback" not in loser and len(loser.strip().splitlines()) == 1, loser
    assert LOCK in loser or f"{MANIFEST} is complete" in loser, loser
    assert snapshot(out) == want


def test_a_stale_lock_file_does_not_block(clean, tmp_path: Path, capsys) -> None:
    """A lock file left by a killed convert is just a file: flock locks die with their process."""
    src, want = clean
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text("")
    code, _, err = run_cli(capsys, "convert", src, out, *OPTS)
    assert code == 0, err
    assert snapshot(out) == want


def test_a_shard_run_refuses_while_a_plain_convert_holds_out(clean, tmp_path: Path, capsys) -> None:
    src, _ = clean
    out = tmp_path / "out"
    with paused_convert(src, out, tmp_path) as first:
        before = snapshot(out)
        code, _, err = run_cli(capsys, "convert", src, out, *OPTS, "--shard-index", "0", "--shard-count", "2")
        check_refused(code, err)
        assert snapshot(out) == before
    assert first.returncode == 0


@pytest.mark.parametrize("cpus, pending, expected", [(2, 1, 1), (2, 5, 2), (16, 3, 3), (16, 100, 8), (1, 4, 1)])
def test_default_workers_use_the_cores_while_files_are_pending(monkeypatch, cpus, pending: int, expected: int) -> None:
    """Without --workers, one file per core is written (and hashed) at once, never more than the ring budget allows."""
    from ckpt_tool.output import writer

    monkeypatch.setattr(writer, "usable_cpus", lambda: cpus)
    assert writer.default_workers(pending) == expected
    assert writer.MAX_DEFAULT_WORKERS * writer.RING <= writer.MAX_BUFFERS


def test_a_failed_file_stops_the_other_writers_from_starting_new_files(
    fixture_dir, tmp_path: Path, monkeypatch
) -> None:
    """With several writers, the first failure ends the conversion: files in flight finish, queued ones never start
    (a fatal error must not be followed by gigabytes of further writes), and the error is what convert raises.

    A file that started before the failure finishes only once the failure is recorded (convert's ``failed``
    event, seen through ``threading.Event``), so no scheduling lets its writer go on to further files while the
    failing one is still on its way to record it: at most the failed file and the one in flight start."""
    import threading
    import types

    from ckpt_tool.mapping.plan import Options
    from ckpt_tool.output import convert as conv

    real, started, lock, events = conv.write_output_file, [], threading.Lock(), []

    class Recorded(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            events.append(self)

    def write(f, dest, *args, **kwargs):
        with lock:
            started.append(f.relpath)
            first = len(started) == 1
        if first:
            raise conv.OutputError(f"{dest}: simulated failure")
        if not events[0].wait(HANG_S):
            raise AssertionError("the failure was never recorded")
        return real(f, dest, *args, **kwargs)

    monkeypatch.setattr(conv, "write_output_file", write)
    monkeypatch.setattr(conv, "threading", types.SimpleNamespace(Lock=threading.Lock, Event=Recorded))
    with pytest.raises(conv.OutputError, match="simulated failure"):
        conv.convert(fixture_dir("fp4"), tmp_path / "out", Options(tp=2, max_shard_size=2_000_000), workers=2)
    total = len(plan_conversion(*_cfg_and_tensors(fixture_dir("fp4")), Options(tp=2, max_shard_size=2_000_000)).files)
    assert len(events) == 1
    assert total > 6 and len(started) <= 2, (len(started), total)


def _cfg_and_tensors(src: Path):
    from ckpt_tool.checkpoint.source import open_checkpoint

    ck = open_checkpoint(src)
    return ck.require_config(), ck.tensors
