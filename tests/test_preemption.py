"""SIGTERM and SIGHUP (Slurm, Kubernetes, a closed terminal) stop a running ``convert`` as Ctrl-C does.

Real signals, sent by this test to a real ``ckpt-tool convert`` process. A small wrapper holds the writer (each
buffer, once it is in the file, waits until the test creates a gate file) and creates a marker file when the first
part file is being written, so the signal lands mid-conversion every time; it also creates a second marker once the
process has handled its first stop signal. Nothing here waits a fixed time for the other process: each step waits
for a file the other side creates. The first signal: one line that says how to resume, exit 128 + the signal, no
temporary left, no manifest; the rerun ends byte-identical to an uninterrupted conversion. A second signal exits at
once, without waiting for the files in flight (whose gate never opens: only exiting at once ends that process).
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
    import os, signal, sys, time
    from contextlib import contextmanager

    import ckpt_tool.cli.common as common
    import ckpt_tool.cli.entry as entry
    import ckpt_tool.output.convert as conv

    writing, gate, stopping, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    real_write, real_stop_signals = conv.write_output_file, common.stop_signals
    parent = os.getppid()


    def write(out, dest, files, sources, progress=None, *rest, **kw):
        def held(n):
            open(writing, "a").close()
            while not os.path.exists(gate):  # no deadline: the test opens it, kills this process, or goes
                if os.getppid() != parent:
                    os._exit(3)
                time.sleep(0.01)
            if progress:
                progress(n)

        return real_write(out, dest, files, sources, held, *rest, **kw)


    def noting(handler):
        def note(signum, frame):
            try:
                handler(signum, frame)  # the first stop signal's handler raises, once it has set the second's
            finally:
                open(stopping, "a").close()

        return note


    @contextmanager
    def stop_signals():
        with real_stop_signals():
            for s in common.STOP_SIGNALS:
                handler = signal.getsignal(s)
                if callable(handler):  # not one the process was started ignoring
                    signal.signal(s, noting(handler))
            yield


    conv.write_output_file = write
    entry.stop_signals = stop_signals
    sys.exit(entry.main(argv))
    """
)
HANG_S = 300  # only a hang takes this long; a busy machine can stall a process for seconds, never for this


class SlowConvert:
    """A ``convert`` in another process, held inside its first part file until :meth:`open_gate`."""

    def __init__(self, tmp_path: Path, src: Path, out: Path, *extra: str, ignoring: int | None = None) -> None:
        """``ignoring``: a signal the process is started ignoring (as ``nohup`` starts it ignoring SIGHUP)."""
        wrapper = tmp_path / "slow_convert.py"
        wrapper.write_text(WRAPPER)
        self.writing, self.gate, self.stopping = tmp_path / "writing", tmp_path / "gate", tmp_path / "stopping"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("CKPT_TOOL_DEBUG", None)
        markers = [str(self.writing), str(self.gate), str(self.stopping)]
        cmd = [sys.executable, str(wrapper), *markers, "convert", str(src), str(out), *OPTS, *extra]
        def dispositions() -> None:
            # A child inherits ignored signals: under `nohup` (SIGHUP) or as a job a shell started with & (SIGINT)
            # the test runner's would make the convert keep them ignored, as it must. Each test sets its own.
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN if s == ignoring else signal.SIG_DFL)

        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=dispositions
        )
        self.wait_for(self.writing, "the conversion never started writing")

    def wait_for(self, marker: Path, what: str) -> None:
        deadline = time.monotonic() + HANG_S
        while not marker.exists():
            assert self.proc.poll() is None, self.proc.communicate()[1]
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    def signal_handled(self, signum: int) -> None:
        """Send ``signum`` and return once the process has run its handler."""
        self.proc.send_signal(signum)
        self.wait_for(self.stopping, f"the process never handled {signal.Signals(signum).name}")

    def open_gate(self) -> None:
        self.gate.touch()

    def finish(self) -> str:
        """Its stderr once it has exited (killed, and the test failed, if it hangs)."""
        try:
            return self.proc.communicate(timeout=HANG_S)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the conversion did not exit: {self.proc.communicate()[1]}")


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
    convert = SlowConvert(tmp_path, src, out, "--workers", "1")
    convert.signal_handled(signum)
    convert.open_gate()  # the file in flight finishes; no other starts
    stderr = convert.finish()
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert convert.proc.returncode == code, stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "rerun the same command to resume" in lines[0], stderr
    if signum != signal.SIGINT:
        assert signal.Signals(signum).name in lines[0]
    assert not (out / "ckpt-tool.json").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "a temporary was left behind"

    assert run_cli(capsys, "convert", src, out, *OPTS)[0] == 0
    assert snapshot(out) == snapshot(reference)


def test_a_second_signal_exits_at_once(fixture_dir, reference: Path, tmp_path: Path, capsys) -> None:
    """Two files in flight, held until a gate that never opens: the first SIGTERM waits for them, so the process
    goes on; a SIGHUP after it does not wait (exiting at all is exiting at once: the files in flight never end)."""
    src = fixture_dir(VARIANT)
    out = tmp_path / "out"
    convert = SlowConvert(tmp_path, src, out, "--workers", "2")
    convert.signal_handled(signal.SIGTERM)
    assert convert.proc.poll() is None, "the first signal did not wait for the files in flight"
    convert.proc.send_signal(signal.SIGHUP)
    stderr = convert.finish()
    assert convert.proc.returncode == 128 + signal.SIGHUP, stderr
    assert "SIGHUP again" in stderr
    assert not (out / "ckpt-tool.json").exists()

    assert run_cli(capsys, "convert", src, out, *OPTS)[0] == 0  # the temporaries it left are cleared, resumed
    assert snapshot(out) == snapshot(reference)


def test_a_signal_ignored_at_start_stays_ignored(fixture_dir, reference: Path, tmp_path: Path) -> None:
    """``nohup ckpt-tool convert ...``: a closed terminal's SIGHUP does not stop it (an ignored signal is dropped
    when it is sent: the gate opens after it)."""
    out = tmp_path / "out"
    convert = SlowConvert(tmp_path, fixture_dir(VARIANT), out, "--workers", "1", ignoring=signal.SIGHUP)
    convert.proc.send_signal(signal.SIGHUP)
    convert.open_gate()
    stderr = convert.finish()
    assert convert.proc.returncode == 0, stderr
    assert snapshot(out) == snapshot(reference)
