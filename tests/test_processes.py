"""ckpt_tool.processes: forked children start with torch limited to one thread, whatever the parent ran."""

from __future__ import annotations

import os
import select

import pytest
import torch

from ckpt_tool import processes
from ckpt_tool.processes import Child

CHILD_SECONDS = 60  # a child's matmul takes milliseconds; one stuck at an OpenMP barrier never ends
SIDE = 512  # large enough that torch and MKL split the product over a team of threads


def child_result_within(child: Child, seconds: float):
    """The child's result, or a failed test (the child killed) when it has not answered in ``seconds``."""
    ready, _, _ = select.select([child._pipe], [], [], seconds)
    if not ready:
        child.cancel()
        pytest.fail(f"the forked child did not finish in {seconds} s: stuck (an OpenMP team copied by fork?)")
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
