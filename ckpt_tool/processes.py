"""Processes: how many CPUs this process may use, forking a child safely, and the work forked children share and
hand back (a task queue, a child's marshalled value, a file of bytes).

Every fork in ckpt-tool goes through :func:`fork`, and every CPU count through :func:`usable_cpus`.

Forked helpers save time twice: ``inspect`` of a full V4 checkpoint is CPU work on 69k-145k header entries
that helpers parse beside this process, and the numeric level's workers each compute on a core of their own
(``verify.compute_pool``). A forked child starts in milliseconds with every module already imported
(``multiprocessing`` costs more to import than the work it would split), and hands its result back through a
pipe as ``marshal`` data: builtins only, no pickling of our classes.

Every caller keeps a serial path and takes it whenever a child cannot help or did not succeed, so a child
never decides an outcome: it only saves time on the way to the same answer. Linux only (fork without exec is
not safe on macOS), and never while another thread could hold a lock the child needs.

A fork copies the forking thread and none of the others, and that includes the OpenMP team torch's intra-op
pool keeps for it. GNU OpenMP (libgomp, torch's runtime in its Linux wheels) records the team per thread and has
no fork handler: a child whose forking thread opens a parallel region of more than one thread (any torch op large
enough, an MKL ``sgemm``) waits forever at the team's barrier for threads that were never copied. So the child
of :func:`fork` first limits torch to one thread (:func:`limit_thread_pools`), before any caller code runs:
forked workers each compute on one core anyway (the parent starts one per CPU).

A thread joined by Python has not yet left the OS: ``Thread.join`` returns once the interpreter is done with it,
and only then does the thread run its native exit path, where MKL (torch's BLAS) frees the thread's buffers under
its process-wide accounting lock (``mm_account_ptr_by_tid``). A fork at that moment copies the lock held by a
thread the child does not have, and the child's first ``sgemm`` spins on it forever (seen in a test of the numeric
level forking right after an earlier run's compute pool closed: the parent waited for an answer that never came,
and reproduced with threads on OpenMP teams: docs/performance.md). Threads
that ran torch are therefore announced when they end (:func:`thread_ending`, the numeric pool does it for its
own), and :func:`can_fork` and :func:`fork` wait until the OS has no such thread any more
(:func:`ended_threads_gone`; microseconds to milliseconds). An announced thread that ran an OpenMP team of two or
more leaves its team's threads behind it: libgomp releases them at the thread's exit and they run the same native
exit path after it, unannounced (their ids are libgomp's). So once the announced threads are gone the wait goes on
until no thread of the process has ended for ``QUIET_S``: a fork then copies no thread midway through its exit.
"""

from __future__ import annotations

import errno
import marshal
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


_ENDING: set[int] = set()  # native ids of threads that ran torch, ended in Python, maybe not yet in the OS
ENDING_WAIT_S = 5.0  # how long can_fork waits for them before it gives up (a fork then waits for a later call)
QUIET_S = 0.02  # no thread of the process ended for this long: none is midway through its exit (a team thread's takes
# microseconds once it runs; 20 ms leaves room for a busy core's scheduling)


def thread_ending(native_ids: Iterable[int]) -> None:
    """Announce threads that ran torch (MKL) and have been joined: no fork happens until the OS has let them go."""
    _ENDING.update(native_ids)


def ended_threads_gone(wait_s: float | None = None) -> bool:
    """Whether every thread announced by :func:`thread_ending` has left the OS, and then no thread of the process has
    ended for :data:`QUIET_S` (the OpenMP team threads of an announced thread end after it), waiting up to ``wait_s``
    for it (default :data:`ENDING_WAIT_S`). Nothing announced: True at once."""
    if not _ENDING:
        return True
    deadline = time.monotonic() + (ENDING_WAIT_S if wait_s is None else wait_s)
    quiet_since, before = None, None
    while True:
        try:
            present = {int(tid) for tid in os.listdir("/proc/self/task")}
        except OSError:  # no /proc: nothing to wait on that can be seen
            _ENDING.clear()
            return True
        _ENDING.intersection_update(present)
        now = time.monotonic()
        if _ENDING or (before is not None and not before <= present):  # announced ones left, or a thread ended
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= QUIET_S:
            return True
        if now >= deadline:
            return False
        before = present
        time.sleep(0.0005)


def limit_thread_pools() -> None:
    """One thread for torch's intra-op pool in this thread (OpenMP, MKL, and the pool new threads start with),
    where torch is loaded at all: the header path never imports it and pays nothing here."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def fork() -> int:
    """``os.fork()``, with the child's thread pools limited (:func:`limit_thread_pools`) and the stop signals
    (SIGINT, SIGTERM, SIGHUP) left to their default action there (they reach the whole process group: a child just
    goes, the parent says how to resume), before the caller's code runs, and only once every thread announced by
    :func:`thread_ending` is gone. Raises OSError when the system refuses a fork, or such a thread is still there."""
    if not ended_threads_gone():
        raise OSError(errno.EAGAIN, "a thread that ran torch is still ending: a child would inherit its MKL lock")
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child's coverage is not collected)
        for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop, signal.SIG_DFL)
        limit_thread_pools()
    return pid


def can_fork(*, daemon_threads: bool = False) -> bool:
    """Whether forking is safe here: Linux, ``CKPT_TOOL_NO_FORK`` unset, and no other thread running that could
    hold a lock the child needs (nor one still ending, :func:`ended_threads_gone`). ``daemon_threads``: daemon
    threads may run (a terminal's progress-bar refresher: the caller's children touch no lock such a thread takes)."""
    if sys.platform != "linux" or os.environ.get("CKPT_TOOL_NO_FORK"):
        return False
    threading = sys.modules.get("threading")
    if threading is None:
        return True
    me = threading.current_thread()
    # a lock held by another Python thread at fork time stays held in the child forever
    alone = all(t is me or (daemon_threads and t.daemon) for t in threading.enumerate())
    return alone and ended_threads_gone()


class TaskQueue:
    """Task numbers that forked processes take one at a time, each taking the next free one.

    A pipe: every process reads 2-byte task numbers from the shared read end (the kernel serialises reads, so no
    two processes get the same number) until it is empty and its write end closed. Work shares itself out by
    speed, which a fixed split cannot do on a machine where the other core is busy.

    ``TaskQueue(n)``: numbers ``0..n-1``, all written before the fork and the write end closed at once.
    ``TaskQueue(n, released=True)``: none yet; the parent :meth:`put` s each number when it may be taken (verify's
    one pass releases a numeric task once the values walk has read its bytes) and :meth:`end` s the queue after the
    last. Each child calls :meth:`in_child` first: a child holding the write end would never see the queue end.
    At most ``LIMIT`` numbers in all, so a write never waits for a reader (a pipe holds 64 KiB unread).
    """

    LIMIT = 32768  # tasks that fit in a pipe's 64 KiB buffer without a reader

    def __init__(self, tasks: int, *, released: bool = False) -> None:
        if tasks > self.LIMIT:
            raise ValueError(f"{tasks} tasks: at most {self.LIMIT} fit in one queue")
        self.tasks = tasks
        read_end, write_end = os.pipe()
        self._fd: int | None = read_end
        self._write: int | None = write_end
        if not released:
            try:
                self.put(*range(tasks))
            finally:
                self.end()

    def put(self, *tasks: int) -> None:
        """Make ``tasks`` takeable (never blocks: the pipe holds every number there can be)."""
        assert self._write is not None, "the queue was ended"
        data = memoryview(b"".join(i.to_bytes(2, "big") for i in tasks))
        while data:
            data = data[os.write(self._write, data) :]

    @property
    def accepts(self) -> bool:
        """Whether :meth:`put` may still add numbers (this process holds the write end)."""
        return self._write is not None

    def end(self) -> None:
        """No more numbers: once the queue is empty, :meth:`take` returns in every process."""
        if self._write is not None:
            os.close(self._write)
            self._write = None

    def in_child(self) -> None:
        """In a forked child: drop the inherited write end (only the parent adds numbers and ends the queue)."""
        self.end()

    def take(self) -> Iterator[int]:
        """The task numbers this process gets, until none are left."""
        while self._fd is not None:
            token = os.read(self._fd, 2)
            if len(token) < 2:
                return
            yield int.from_bytes(token, "big")

    def close(self) -> None:
        self.end()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TaskQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Child:
    """``fn(*args)`` running in a forked process; :meth:`result` waits for its value (None if it failed)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        read_end, write_end = os.pipe()
        pid = fork()
        if pid == 0:  # pragma: no cover (the child's coverage is not collected)
            _run_child(read_end, write_end, fn, args)
        os.close(write_end)
        self._pid: int | None = pid
        self._pipe = os.fdopen(read_end, "rb")

    def result(self) -> Any | None:
        """The child's return value, or None when it raised, was killed or sent something unreadable."""
        if self._pid is None:
            return None
        try:
            data = self._pipe.read()
        finally:
            self._pipe.close()
            status = self._reap()
        if status != 0:
            return None
        try:
            return marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            return None

    def cancel(self) -> None:
        """Stop the child (if still running) and reap it; its result is dropped."""
        if self._pid is None:
            return
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._pipe.close()
        self._reap()

    def _reap(self) -> int:
        pid, self._pid = self._pid, None
        assert pid is not None
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def _run_child(read_end: int, write_end: int, fn: Callable[..., Any], args: tuple) -> None:  # pragma: no cover
    """In the child: compute, write the marshalled value, leave without running the parent's exit hooks."""
    code = 1
    try:
        os.close(read_end)
        data = marshal.dumps(fn(*args))
        with os.fdopen(write_end, "wb") as out:
            out.write(data)
        code = 0
    except BaseException:  # noqa: BLE001 - any failure means "no result"; the parent takes the serial path
        pass
    finally:
        os._exit(code)  # no atexit, no flushing of stdio buffers inherited from the parent


class HandBackFile:
    """Bytes a forked child hands back to its parent through an anonymous file (memfd where there is one), for
    results too large to send through a pipe: :meth:`put` in the child appends a buffer and returns its offset,
    :meth:`read_into` in the parent fills a buffer from an offset. The file goes with :meth:`close`."""

    def __init__(self, name: str) -> None:
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(name)
        else:
            import tempfile  # not at the top: only where there is no memfd (not Linux), off the header path

            self.fd = os.dup(tempfile.TemporaryFile().fileno())
        self.end = 0

    def put(self, data: Any) -> int:
        """Append ``data`` (a buffer) and return the offset it starts at."""
        at, view = self.end, memoryview(data).cast("B")
        size = len(view)
        while view:
            view = view[os.pwrite(self.fd, view, self.end) :]
            self.end = at + size - len(view)
        return at

    def read_into(self, view: memoryview, at: int) -> bool:
        """Fill ``view`` (bytes) from offset ``at``; False when the file ends first."""
        while view:
            n = os.preadv(self.fd, [view], at)
            if n <= 0:
                return False
            view, at = view[n:], at + n
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@contextmanager
def helpers(count: int, fn: Callable[..., Any], *args: Any) -> Iterator[list[Child]]:
    """Up to ``count`` children each running ``fn(*args)``: fewer when the system refuses a fork (process
    or memory limits), which work shared through a :class:`TaskQueue` absorbs. All are stopped on exit."""
    children: list[Child] = []
    try:
        for _ in range(count):
            try:
                children.append(Child(fn, *args))
            except OSError:
                break
        yield children
    finally:
        for child in children:
            child.cancel()


# The signals that stop a command (ckpt_tool.cli.common.stop_signals installs their handlers in the main thread).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_signals_to_main() -> None:
    """Block the stop signals in the calling thread unless it is the main thread: every thread ckpt-tool starts calls
    this first (:func:`signal_free`, or as a ThreadPoolExecutor's initializer).

    The kernel delivers a signal sent to the process to any thread that does not block it, and Python runs the
    handler only in the main thread, at its next bytecode. A main thread waiting on a lock with no timeout (joining a
    writer, waiting for a file's future) wakes only when the signal interrupts its own wait: a SIGTERM that lands on a
    writer thread would wait for the files in flight to end before it is seen, and a second one would not stop the
    command at once. Threads started by these threads inherit the mask."""
    if threading.current_thread() is not threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def signal_free(target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` run with the stop signals blocked in its thread (:func:`stop_signals_to_main`)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        stop_signals_to_main()
        return target(*args, **kwargs)

    return run


# How long the main thread waits on another thread at a time. A handler runs in the main thread only once it is back
# in Python: a wait with no timeout returns for a signal delivered to the main thread itself, and a process-directed
# signal may go to any thread that does not block it (a library's own, such as OpenBLAS's, started unblocked).
SIGNAL_POLL_S = 0.05


def join_in_steps(thread: threading.Thread) -> None:
    """``thread.join()`` in steps of :data:`SIGNAL_POLL_S`, so that a stop signal's handler runs meanwhile."""
    while thread.is_alive():
        thread.join(SIGNAL_POLL_S)


def results_in_steps(futures: Iterable[Any]) -> None:
    """Each future's result in turn (its exception raised), waited for in steps of :data:`SIGNAL_POLL_S`."""
    from concurrent.futures import wait  # only where a pool is used

    for fut in futures:
        while not fut.done():
            wait([fut], timeout=SIGNAL_POLL_S)
        fut.result()


def settle_in_steps(futures: list[Any]) -> None:
    """Wait, in steps of :data:`SIGNAL_POLL_S`, until every future has finished (the files in flight after a first
    stop signal; a second one is seen meanwhile)."""
    from concurrent.futures import wait

    while wait(futures, timeout=SIGNAL_POLL_S).not_done:
        pass
