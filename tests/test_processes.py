"""ckpt_tool.processes: forked children start with torch limited to one thread, whatever the parent ran."""

from __future__ import annotations

import os
import select
import threading
import time

import pytest
import torch

from ckpt_tool import processes
from ckpt_tool.processes import Child
from ckpt_tool.verify.compute_pool import ComputePool, ForkedTasks, can_fork_workers

CHILD_SECONDS = 60  # a child's matmul takes milliseconds; one stuck on a lock fork copied held never ends
SIDE = 512  # large enough that torch and MKL split the product over a team of threads
ROUNDS = 30  # of the numeric level's fork path; without the wait below, a quarter of them hung here


def child_result_within(child: Child, seconds: float):
    """The child's result, or a failed test (the child killed) when it has not answered in ``seconds``."""
    ready, _, _ = select.select([child._pipe], [], [], seconds)
    if not ready:
        child.cancel()
        pytest.fail(f"the forked child did not finish in {seconds} s: stuck on a lock fork copied (OpenMP, MKL)")
    return child.result()


def matmul_in_this_thread() -> tuple[int, float]:
    a = torch.ones(SIDE, SIDE)
    return torch.get_num_threads(), float((a @ a).sum())


def test_a_child_computes_after_the_forking_thread_ran_a_thread_team() -> None:
    """The parent's thread ran a matmul on a team of two OpenMP threads; the child forked from it runs one on the
    same thread and finishes, on one thread (unlimited, GNU OpenMP waits forever for the team fork did not copy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        matmul_in_this_thread()  # the team now exists, attached to this thread
        with Child(matmul_in_this_thread) as child:
            got = child_result_within(child, CHILD_SECONDS)
        assert torch.get_num_threads() == 2  # the parent keeps its own setting
    finally:
        torch.set_num_threads(threads)
    assert got == (1, float(SIDE**3))


def a_tile_product(task: int, pool: object = None) -> float:
    """What a numeric task's tile costs MKL: a few activation rows times a weight tile (its buffers come from MKL's
    allocator, the one whose lock a fork must not copy held)."""
    x = torch.full((4, SIDE), 1.0 + task % 3)
    w = torch.ones(256 + 64 * (task % 5), SIDE)
    return float((w @ x.T).sum())


def test_forked_numeric_workers_start_after_the_pool_threads_before_them_have_left() -> None:
    """The numeric level's fork path, 30 times: a compute pool's threads multiply and are joined, then two workers
    are forked and multiply in threads of their own. A pool thread joined by Python still runs its native exit
    path, where MKL frees its buffers under a process-wide lock; a fork then gives the child that lock held, and its
    first product spins forever. Every round must answer within CHILD_SECONDS."""
    expected = [a_tile_product(task) for task in range(8)]
    for _ in range(ROUNDS):
        with ComputePool(4) as pool:
            list(pool.map(a_tile_product, range(16)))
        assert can_fork_workers()
        forked = ForkedTasks(8, 2, a_tile_product).start()
        answers: dict[int, float] = {}
        collector = threading.Thread(target=answers.update, args=(forked.results(),), daemon=True)
        collector.start()
        collector.join(CHILD_SECONDS)
        stuck = collector.is_alive()
        forked.close()
        assert not stuck, f"a forked worker did not answer in {CHILD_SECONDS} s: it inherited a lock held at the fork"
        assert [answers[task] for task in range(8)] == expected


def a_product_on_a_team_of_two() -> float:
    """A product MKL splits over this thread's own OpenMP team of two, whose threads end with this one."""
    torch.set_num_threads(2)
    return float((torch.ones(64, 256) @ torch.ones(256, 256).T).sum())


def a_product_in_a_new_thread() -> float:
    answer: list[float] = []
    worker = threading.Thread(target=lambda: answer.append(a_product_on_a_team_of_two()))
    worker.start()
    worker.join()
    return answer[0]


def test_a_child_computes_after_threads_that_ran_mkl_ended_just_before_the_fork() -> None:
    """Eight threads multiply (each on an OpenMP team of two) and are joined, and a child is forked at once: 30
    times, the child's product in a thread of its own answers. Without the announcement (``thread_ending``) that
    makes fork wait until they have left the OS, 17 rounds in 60 hung in MKL's ``mm_account_ptr_by_tid``: the
    ending threads free their MKL buffers under a lock that the fork copied held. Their teams' threads end after
    them, unannounced: with only the announced threads waited for, 1 round in 150-300 hung (after the main thread had
    run a team of its own, as the first test here does), and this test failed in one run of the file in three."""
    for _ in range(ROUNDS):
        ended = [threading.Thread(target=a_product_on_a_team_of_two) for _ in range(8)]
        for thread in ended:
            thread.start()
        for thread in ended:
            thread.join()
        processes.thread_ending(thread.native_id for thread in ended)
        with Child(a_product_in_a_new_thread) as child:
            assert child_result_within(child, CHILD_SECONDS) == 64 * 256 * 256


def test_fork_waits_for_announced_threads_to_leave_the_os(monkeypatch) -> None:
    """A thread announced as ending is waited for; one that never leaves stops the fork (the caller's serial path)."""
    ended = threading.Thread(target=a_tile_product, args=(0,))
    ended.start()
    ended.join()
    processes.thread_ending([ended.native_id])
    assert processes.ended_threads_gone(wait_s=CHILD_SECONDS)  # it left the OS while this waited
    assert ended.native_id not in {int(t) for t in os.listdir("/proc/self/task")}
    monkeypatch.setattr(processes, "ENDING_WAIT_S", 0.05)
    processes.thread_ending([threading.get_native_id()])  # this thread never leaves while it asks
    try:
        assert not processes.ended_threads_gone()
        with pytest.raises(OSError, match="still ending"):
            processes.fork()
    finally:
        processes._ENDING.clear()


class SteppedClock:
    """``processes.time`` for :func:`processes.ended_threads_gone`: each of its sleeps moves the clock on by the
    sleep asked for, and ``at(t, action)`` runs ``action`` in the sleep that first reaches ``t``. The wait then
    sees what happens at a point of its own clock, however the machine schedules the threads."""

    def __init__(self) -> None:
        self.now = 0.0
        self.actions: list[tuple[float, object]] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        due = [a for a in self.actions if a[0] <= self.now]
        self.actions = [a for a in self.actions if a[0] > self.now]
        for _, action in due:
            action()


def gone_from_the_os(thread: threading.Thread) -> None:
    """Wait (a hang only: CHILD_SECONDS) until ``thread``, joined, has left /proc/self/task."""
    thread.join()
    deadline = time.monotonic() + CHILD_SECONDS
    while thread.native_id in {int(t) for t in os.listdir("/proc/self/task")}:
        assert time.monotonic() < deadline, "a joined thread never left the OS"
        time.sleep(0.001)


def test_the_wait_goes_on_while_other_threads_are_still_ending(monkeypatch) -> None:
    """Once the announced threads are gone, the wait lasts until no thread of the process has ended for QUIET_S: a
    thread that ends meanwhile (as an announced thread's OpenMP team threads do, after it) is waited for. The late
    thread ends half-way through the quiet time of the wait's own clock (:class:`SteppedClock`)."""
    announced = threading.Thread(target=lambda: None)
    announced.start()
    gone_from_the_os(announced)
    release = threading.Event()
    late = threading.Thread(target=release.wait)
    late.start()
    clock = SteppedClock()
    monkeypatch.setattr(processes, "time", clock)
    ended_at: list[float] = []

    def end_late() -> None:
        release.set()
        gone_from_the_os(late)
        ended_at.append(clock.now)

    clock.actions.append((processes.QUIET_S / 2, end_late))
    processes.thread_ending([announced.native_id])
    assert processes.ended_threads_gone()
    assert ended_at, "the wait ended before the late thread did"
    assert clock.now - ended_at[0] >= processes.QUIET_S  # and it went on for the quiet time after it


def test_fork_limits_the_child_before_the_callers_code_runs(monkeypatch) -> None:
    """The limit is applied in the child by fork() itself, not left to each caller."""
    calls = []
    monkeypatch.setattr(processes, "limit_thread_pools", lambda: calls.append(os.getpid()))
    pid = processes.fork()
    if pid == 0:  # pragma: no cover
        os._exit(0 if calls == [os.getpid()] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and calls == []


def test_usable_cpus_counts_the_affinity_mask(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert processes.usable_cpus() == 3
