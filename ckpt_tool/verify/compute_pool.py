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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

_local = threading.local()  # .pool: the ComputePool whose task this thread runs


def default_workers() -> int:
    """One per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class ComputePool:
    """``workers`` compute slots, ``2 * workers`` threads. Use as a context manager: on exit the threads are
    joined and torch's intra-op thread count of the calling thread is restored."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, workers or default_workers())
        self._slots = threading.BoundedSemaphore(self.workers)
        self._executor = ThreadPoolExecutor(2 * self.workers, thread_name_prefix="numeric", initializer=self._enter)
        self._torch_threads = torch.get_num_threads()

    def _enter(self) -> None:
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
