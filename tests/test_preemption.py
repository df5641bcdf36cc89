"""SIGTERM and SIGHUP (Slurm, Kubernetes, a closed terminal) stop a running ``convert`` as Ctrl-C does.

Real signals, sent by this test to a real ``ckpt-tool convert`` process. A small wrapper slows the writer
(each buffer waits ``DELAY`` seconds once it is in the file) and creates a marker file when the first part
file is being written, so the signal lands mid-conversion every time. The first signal: one line that says
how to resume, exit 128 + the signal, no temporary left, no manifest; the rerun ends byte-identical to an
uninterrupted conversion. A second signal exits at once, without waiting for the files in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot

REPO = Path(__file__).resolve().parents[1]
OPTS = ["--tp", "2", "--max-shard-size", "2MB"]
VARIANT = "fp4"

WRAPPER = textwrap.dedent(
    """
    import os, sys, time

    import ckpt_tool.output.convert as conv

    marker, delay, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    real_write = conv.write_output_file


    def write(out, dest, files, sources, progress=None, *rest, **kw):
        def slow(n):
            open(marker, "a").close()
            time.sleep(delay)
            if progress:
                progress(n)

        return real_write(out, dest, files, sources, slow, *rest, **kw)


    conv.write_output_file = write
    from ckpt_tool.cli.entry import main

    sys.exit(main(argv))
    """
)


def start_slow_convert(
    tmp_path: Path, src: Path, out: Path, delay: float, *extra: str, ignoring: int | None = None
) -> tuple[subprocess.Popen, Path]:
    """``ignoring``: a signal the process is started ignoring (as ``nohup`` starts it ignoring SIGHUP)."""
    wrapper = tmp_path / "slow_convert.py"
    wrapper.write_text(WRAPPER)
    marker = tmp_path / "writing"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPT_TOOL_DEBUG", None)
    cmd = [sys.executable, str(wrapper), str(marker), str(delay), "convert", str(src), str(out), *OPTS, *extra]
    ignore = None if ignoring is None else (lambda: signal.signal(ignoring, signal.SIG_IGN))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.05)
    return proc, marker


@pytest.fixture(scope="module")
def reference(fixture_dir, tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("preempt") / "reference"
    from ckpt_tool.cli.entry import main

    assert main(["convert", str(fixture_dir(VARIANT)), str(ref), *OPTS]) == 0
    return ref


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_stop_signal_says_how_to_resume_and_the_rerun_finishes_identically(
    signum: int, code: int, fixture_dir, reference: Path, tmp_path: Path, capsys
) -> None:
    src = fixture_dir(VARIANT)
    out = tmp_path / "out"
    proc, _marker = start_slow_convert(tmp_path, src, out, 0.5, "--workers", "1")
    proc.send_signal(signum)
    _stdout, stderr = proc.communicate(timeout=60)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "rerun the same command to resume" in lines[0], stderr
    if signum != signal.SIGINT:
        assert signal.Signals(signum).name in lines[0]
    assert not (out / "ckpt-tool.json").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "a temporary was left behind"

    assert run_cli(capsys, "convert", src, out, *OPTS)[0] == 0
    assert snapshot(out) == snapshot(reference)


def test_a_second_signal_exits_at_once(fixture_dir, reference: Path, tmp_path: Path, capsys) -> None:
    """Two files in flight, each ~10 s from done: the first SIGTERM waits for them, a SIGHUP after it does not."""
    src = fixture_dir(VARIANT)
    out = tmp_path / "out"
    proc, _marker = start_slow_convert(tmp_path, src, out, 10.0, "--workers", "2")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None, "the first signal did not wait for the files in flight"
    sent = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    _stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 3, "the second signal did not stop the process at once"
    assert proc.returncode == 128 + signal.SIGHUP, stderr
    assert "SIGHUP again" in stderr
    assert not (out / "ckpt-tool.json").exists()

    assert run_cli(capsys, "convert", src, out, *OPTS)[0] == 0  # the temporaries it left are cleared, resumed
    assert snapshot(out) == snapshot(reference)


def test_a_signal_ignored_at_start_stays_ignored(fixture_dir, reference: Path, tmp_path: Path) -> None:
    """``nohup ckpt-tool convert ...``: a closed terminal's SIGHUP does not stop it."""
    out = tmp_path / "out"
    proc, _marker = start_slow_convert(
        tmp_path, fixture_dir(VARIANT), out, 0.2, "--workers", "1", ignoring=signal.SIGHUP
    )
    proc.send_signal(signal.SIGHUP)
    _stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert snapshot(out) == snapshot(reference)
