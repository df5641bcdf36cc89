"""Threads for the numeric level: ``workers`` of them compute at once, as many more read meanwhile.

The numeric level is reading plus dequantizing: per tile, a ``pread`` (which releases the GIL and mostly
waits on the disk) then torch ops (which release the GIL and keep a core busy). A pool of ``2 * workers``
threads, each computing only while it holds one of ``workers`` compute slots, keeps every core busy while
the next tiles are being read, without more threads computing than there are cores (each tile is sized to
stay in one core's cache; two computing on one core would evict each other's). Torch ops inside the pool
run single-threaded, so pool threads and torch's intra-op threads never oversubscribe the cores.

Subnormal floats are flushed to zero in the pool's threads and, while the pool is open, in the calling
thread (``torch.set_flush_denormal``, x86's FTZ/DAZ): an x86 core takes a slow path for every subnormal
operand, and the full-width skeleton's random bf16 head (0.8 % subnormal) multiplies 10x slower with them.
Both sides of every comparison run so, and a value below 2**-126 cannot move a comparison whose tolerance is
relative to the largest output (1e-3 of it per linear, 2e-2 for the forward).

Work is mapped over the pool from the calling thread only, never from inside a task (a task waiting on
tasks of a bounded pool could wait forever); :func:`map_tasks` runs inline when called from a task.

Threads share one interpreter lock: each tile's dozen tensor ops take it for a few microseconds each, so one
process's threads saturate it at a handful of cores. :func:`fan_out` therefore spreads independent tasks (the
per-tensor check's units) over forked processes, each running a one-slot pool of its own, where forking is
safe (Linux, CPU tensors, no other thread that could hold a lock the children need). They are forked through
:func:`ckpt_tool.processes.fork`, which limits torch to one thread in each child before anything else runs (a
fork does not copy the OpenMP team of the forking thread; see that module).
"""

from __future__ import annotations

import marshal
import os
import selectors
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from ckpt_tool.processes import TaskQueue, can_fork, fork, stop_signals_to_main, thread_ending, usable_cpus

T = TypeVar("T")
R = TypeVar("R")

_local = threading.local()  # .pool: the ComputePool whose task this thread runs


class ComputePool:
    """``workers`` compute slots, ``2 * workers`` threads. Use as a context manager: on exit the threads are
    joined and torch's intra-op thread count of the calling thread is restored."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, workers or usable_cpus())  # default: one per CPU
        self._slots = threading.BoundedSemaphore(self.workers)
        self._executor = ThreadPoolExecutor(2 * self.workers, thread_name_prefix="numeric", initializer=self._enter)
        self._torch_threads = torch.get_num_threads()
        self._native_ids: list[int] = []  # the pool's threads, announced to processes.thread_ending once joined

    def _enter(self) -> None:
        stop_signals_to_main()
        self._native_ids.append(threading.get_native_id())
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        _local.pool = self

    def __enter__(self) -> ComputePool:
        # The calling thread computes too (the forward between the mapped parts) while the pool is idle; one
        # torch thread there as well, so no intra-op team is left spinning beside the pool's threads.
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        thread_ending(self._native_ids)  # no fork until they have left the OS with MKL's lock (see processes)
        torch.set_num_threads(self._torch_threads)
        torch.set_flush_denormal(False)  # torch's default; it offers no way to read the setting before

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """``fn`` over ``items`` on the pool, results in order (inline when called from one of its tasks)."""
        if getattr(_local, "pool", None) is self:
            return map(fn, items)
        return self._executor.map(fn, items)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a compute slot around a tile's torch work (a no-op outside the pool's threads)."""
        if getattr(_local, "pool", None) is not self:
            yield
            return
        with self._slots:
            yield


@contextmanager
def compute_slot(pool: ComputePool | None) -> Iterator[None]:
    """:meth:`ComputePool.slot` of ``pool``, or nothing without one."""
    if pool is None:
        yield
    else:
        with pool.slot():
            yield


def map_tasks(pool: ComputePool | None, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
    """``fn`` over ``items``: on ``pool`` when there is one, else in this thread."""
    return map(fn, items) if pool is None else pool.map(fn, items)


def can_fork_workers() -> bool:
    """Whether :func:`fan_out` may fork here (:func:`~ckpt_tool.processes.can_fork`, daemon threads allowed: a
    child runs only torch, ``os`` and ``marshal``). Never with CUDA initialized (a child cannot use it)."""
    return can_fork(daemon_threads=True) and not torch.cuda.is_initialized()


def may_fan_out(pool: ComputePool | None, device: torch.device) -> bool:
    """Whether work goes to forked processes: more than one worker, CPU tensors, and a process that may fork."""
    return pool is not None and pool.workers > 1 and device.type == "cpu" and can_fork_workers()


_FRAME = 4  # bytes of the length before each marshalled result


def fan_out(
    tasks: int, processes: int, run: Callable[[int, ComputePool], Any], servers: int = 2
) -> Iterator[tuple[int, Any]]:
    """``run(task, pool)`` for tasks ``0..tasks-1`` in ``processes`` forked children, yielding ``(task, result)``
    as results arrive (``result`` marshal-able): :class:`ForkedTasks` started, read and closed in one go."""
    forked = ForkedTasks(tasks, processes, run, servers)
    try:
        forked.start()
        yield from forked.results()
    finally:
        forked.close()


class ForkedTasks:
    """``run(task, pool)`` for tasks ``0..tasks-1`` in ``processes`` forked children.

    :meth:`start` forks them (call it while :func:`can_fork_workers` holds: before the caller starts other
    threads, which a child would not have); :meth:`results` yields ``(task, result)`` as results arrive, and may
    run on a thread the caller starts after the fork; :meth:`stop` kills the children (their pipes then end, so
    :meth:`results` returns); :meth:`close` stops them and reaps them. Each child runs a :class:`ComputePool` of one
    slot; ``servers`` of its threads take tasks from a shared :class:`~ckpt_tool.processes.TaskQueue`, one
    reading while another computes (``servers=1``: the child's main thread takes them, and ``run`` may map work
    over ``pool``). Tasks a child took and never answered (it died, or was stopped) are simply not yielded: the
    caller runs what is missing itself, so a child never decides an outcome. Fewer children start when the
    system refuses a fork.

    ``released``: no task may be taken until :meth:`release` names it (in any order, from any one thread), and the
    children leave once :meth:`end` was called and every released task taken; else every task is takeable at once.
    """

    def __init__(
        self,
        tasks: int,
        processes: int,
        run: Callable[[int, ComputePool], Any],
        servers: int = 2,
        *,
        released: bool = False,
    ) -> None:
        self.tasks, self.processes, self.run, self.servers = tasks, processes, run, servers
        self.pids: dict[int, int] = {}  # read fd -> pid
        self.queue = TaskQueue(tasks, released=released)

    def start(self) -> ForkedTasks:
        queue = self.queue
        try:
            for _ in range(self.processes):
                read_end, write_end = os.pipe()
                try:
                    pid = fork()
                except OSError:
                    os.close(read_end)
                    os.close(write_end)
                    break
                if pid == 0:  # pragma: no cover (the child's coverage is not collected)
                    os.close(read_end)
                    queue.in_child()
                    _child(queue, write_end, self.run, self.servers)
                os.close(write_end)
                self.pids[read_end] = pid
        finally:
            if not queue.accepts:  # every task queued: the children hold the read end, the parent needs none
                queue.close()
        return self

    def release(self, *tasks: int) -> None:
        """Tasks the children may take now (``released`` only)."""
        self.queue.put(*tasks)

    def end(self) -> None:
        """No task is released after this: the children leave once the queue is empty (``released`` only)."""
        self.queue.end()

    def results(self, ended: Callable[[], None] | None = None) -> Iterator[tuple[int, Any]]:
        """``(task, result)`` as they arrive, until every child has gone; ``ended()`` is called each time one goes
        (its unanswered tasks, if it took any, are never answered)."""
        return _collect(self.pids, ended)

    def stop(self) -> None:
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Stop and reap the children; call it once nothing reads :meth:`results` any more."""
        self.stop()
        for fd, pid in self.pids.items():
            os.close(fd)
            os.waitpid(pid, 0)
        self.pids = {}
        self.queue.close()


def _collect(pids: dict[int, int], ended: Callable[[], None] | None = None) -> Iterator[tuple[int, Any]]:
    """Read ``(task, result)`` frames from every child's pipe until each closes (``ended()`` after each)."""
    buffers = {fd: bytearray() for fd in pids}
    with selectors.DefaultSelector() as sel:
        for fd in pids:
            sel.register(fd, selectors.EVENT_READ)
        while buffers:
            for key, _ in sel.select():
                fd = key.fd
                chunk = os.read(fd, 1 << 20)
                buf = buffers[fd]
                if not chunk:
                    sel.unregister(fd)
                    del buffers[fd]
                    if ended is not None:
                        ended()
                    continue
                buf += chunk
                while len(buf) >= _FRAME and len(buf) >= _FRAME + int.from_bytes(buf[:_FRAME], "big"):
                    n = int.from_bytes(buf[:_FRAME], "big")
                    try:
                        task, result = marshal.loads(bytes(buf[_FRAME : _FRAME + n]))
                    except (EOFError, ValueError, TypeError):
                        task = None
                    del buf[: _FRAME + n]
                    if task is not None:
                        yield task, result


def _child(
    queue: TaskQueue, write_end: int, run: Callable[[int, ComputePool], Any], servers: int
) -> None:  # pragma: no cover
    """In a child: ``servers`` threads take tasks and write their results, then the child leaves without running
    the parent's exit hooks. Any failure just ends it: the parent runs what it did not answer."""
    code = 1
    try:
        lock = threading.Lock()

        def serve(_: int) -> None:
            for task in queue.take():
                data = marshal.dumps((task, run(task, pool)))
                frame = len(data).to_bytes(_FRAME, "big") + data
                with lock:
                    view = memoryview(frame)
                    while view:
                        view = view[os.write(write_end, view) :]

        with ComputePool(1) as pool:
            if servers == 1:
                serve(0)
            else:
                list(pool.map(serve, range(servers)))
        code = 0
    except BaseException:  # noqa: BLE001 - any failure means "no answer"; the parent runs the task itself
        pass
    finally:
        os._exit(code)
