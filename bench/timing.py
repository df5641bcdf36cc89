"""Timing one command for the benches: wall and CPU seconds, peak RSS, bytes read from disk; a cold page cache.

    from timing import drop_caches, run_timed
    how = drop_caches(src, out)          # "drop_caches" or "fadvise(DONTNEED) per file (...)"
    t = run_timed([sys.executable, "-m", "ckpt_tool", "verify", ...], cwd=REPO)
    t.seconds, t.cpu_seconds, t.peak_rss_mib, t.disk_read_bytes, t.disk_write_bytes

The command runs as a child process reaped with ``wait4``: the kernel hands back that child's resource use,
its waited-for descendants' included (forked workers), so nothing from earlier commands leaks in (the
``RUSAGE_CHILDREN`` maximum of this process would keep the largest RSS of any command run before). What is
measured:

- CPU seconds: user + system of the tree (and each apart);
- peak RSS: ``ru_maxrss`` — the largest single process of the tree (not their sum);
- bytes written to disk: ``ru_oublock`` x 512 — what the tree handed the block layer (direct writes, and dirty
  pages written back on its behalf, ``fsync`` included);
- bytes read from disk: ``ru_inblock`` x 512 — what the tree asked the block layer for (direct reads and the
  kernel's read-ahead on its behalf; page-cache hits are not counted). Cross-checked against the growth of this
  process's own ``/proc/self/io`` ``read_bytes``, which absorbs a reaped child's counters
  (``io_cross_check_bytes``).

A cold page cache: :func:`drop_caches` writes 3 to ``/proc/sys/vm/drop_caches`` after ``sync`` (root); where
that is not allowed it evicts every file under the given folders with ``posix_fadvise(DONTNEED)`` instead and says
so in what it returns, for the bench to print. :func:`evicting` keeps dropping given files while a command runs: a
page cache smaller than the checkpoint, on a machine whose memory holds it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


@dataclass(frozen=True)
class Timing:
    cmd: str
    rc: int
    seconds: float
    user_seconds: float
    sys_seconds: float
    peak_rss_mib: float
    disk_read_bytes: int
    disk_write_bytes: int
    io_cross_check_bytes: int | None  # /proc/self/io read_bytes growth over the command (None: no /proc)
    stdout: str
    stderr: str

    @property
    def cpu_seconds(self) -> float:
        return self.user_seconds + self.sys_seconds


def _self_read_bytes() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def run_timed(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> Timing:
    """Run ``cmd`` to its end; its figures. Output is collected through files (no pipe to drain while waiting)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        io0 = _self_read_bytes()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        io1 = _self_read_bytes()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        return Timing(
            cmd=" ".join(map(str, cmd)),
            rc=proc.returncode,
            seconds=seconds,
            user_seconds=usage.ru_utime,
            sys_seconds=usage.ru_stime,
            peak_rss_mib=usage.ru_maxrss / 1024,  # KiB on Linux
            disk_read_bytes=usage.ru_inblock * 512,
            disk_write_bytes=usage.ru_oublock * 512,
            io_cross_check_bytes=None if io0 is None or io1 is None else io1 - io0,
            stdout=out.read(),
            stderr=err.read(),
        )


def drop_caches(*folders: Path) -> str:
    """Empty the page cache before a timed command; how it was done, to print beside the figures.

    The whole cache (``echo 3 > /proc/sys/vm/drop_caches`` after ``sync``) where allowed, else every file under
    ``folders`` evicted with ``posix_fadvise(DONTNEED)`` (clean pages only: hence ``sync`` first)."""
    subprocess.run(["sync"], check=False)
    try:
        DROP_CACHES.write_text("3\n")
        return "drop_caches"
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
    evict(*folders)
    return f"fadvise(DONTNEED) per file ({DROP_CACHES}: {reason})"


def evict(*folders: Path) -> None:
    """Drop every file under ``folders`` from the page cache (``posix_fadvise(DONTNEED)``; clean pages only)."""
    for folder in folders:
        for p in Path(folder).rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


@contextmanager
def evicting(folders: list[Path], every: float) -> Iterator[None]:
    """While the block runs, drop ``folders`` from the page cache every ``every`` seconds (0: never): a page cache
    that keeps a file's bytes for at most that long, as when the files are far larger than memory."""
    if not every:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            evict(*folders)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
