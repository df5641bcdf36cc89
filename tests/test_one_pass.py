"""verify --level numeric in one pass (ckpt_tool.verify.one_pass): a numeric task goes to the workers only after the
values walk has read its bytes, and the walk never runs more than the window ahead of the released tasks not yet
answered; nothing waits forever when a worker dies or the workers stop."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ckpt_tool.verify.one_pass import OnePass

FILE = 100  # bytes of each member's file in the synthetic walk
WINDOW = 40  # line bytes (2 members: 20 bytes of each member's file)
BLOCKED_S = 0.2  # a thread still waiting after this is held (a correct pace holds it forever: never flaky)
RELEASED_S = 120  # a released thread ends within this: only a hang takes so long, not a busy machine


def violations(trace: list, window: int) -> list[str]:
    """What breaks the two rules in a :class:`OnePass` trace: a task released before every member it needs had
    passed the end of what it reads there; a walk step more than ``window`` past the earliest released task not
    answered."""
    bad = []
    for event in trace:
        if event[0] == "release":
            _, task, needs = event
            bad += [f"task {task} released at {pos} < {x} (group {g} member {m})" for g, m, x, pos in needs if pos < x]
        else:
            _, g, m, at, front = event
            if front is not None and at > front + window:
                bad.append(f"group {g} member {m} stepped to {at}, {at - front} past an unanswered task")
    return bad


def two_members(window: int = WINDOW, cls=OnePass) -> tuple[OnePass, list[int]]:
    """One group of two members (files a and b); task 0 reads a to 10, task 1 a and b to 50, task 2 b to 90."""
    released: list[int] = []
    walk = [[[("a", FILE)], [("b", FILE)]]]
    needs = [{"a": 10}, {"a": 50, "b": 50}, {"b": 90}]
    return cls(walk, needs, released.append, window, trace=[]), released


def advance_in_thread(pace: OnePass, group: int, member: int, pos: int) -> threading.Thread:
    t = threading.Thread(target=pace.advance, args=(group, member, pos), daemon=True)
    t.start()
    t.join(BLOCKED_S)
    return t


def test_a_task_is_released_once_every_member_it_reads_has_passed_its_bytes() -> None:
    pace, released = two_members()
    assert released == []
    pace.advance(0, 0, 10)
    assert released == [0]
    pace.answered(0)
    pace.advance(0, 0, 50)  # task 1 reads member 1 up to 50 as well
    assert released == [0]
    pace.advance(0, 1, 49)
    assert released == [0]
    pace.advance(0, 1, 50)
    assert released == [0, 1]
    pace.done(0, 1)  # a member that ends (or fails) no longer keeps a task back
    assert released == [0, 1, 2]
    assert violations(pace.trace, WINDOW) == []


def test_the_walk_waits_while_more_than_the_window_ahead_of_an_unanswered_task() -> None:
    pace, released = two_members()
    pace.advance(0, 0, 10)  # task 0 released: it ends at line position 20
    pace.advance(0, 0, 30)  # line 60 = 20 + the window: may go
    held = advance_in_thread(pace, 0, 0, 31)
    assert held.is_alive(), "the walk ran more than the window ahead of task 0, which no worker answered"
    pace.answered(0)
    held.join(RELEASED_S)
    assert not held.is_alive()
    assert released == [0] and violations(pace.trace, WINDOW) == []


def test_the_rules_fail_when_the_throttle_is_broken() -> None:
    """The trace check above is not vacuous: a walk that does not wait breaks the window rule, and it says so."""

    class NoThrottle(OnePass):
        def advance(self, group: int, member: int, pos: int) -> None:
            with self._cond:
                self._passed(group, member, pos)
                self.trace.append(("step", group, member, self.line(group, pos), self.frontier()))

    pace, _ = two_members(cls=NoThrottle)
    pace.advance(0, 0, 10)
    pace.advance(0, 0, 80)  # task 0 unanswered, 120 line bytes behind
    assert violations(pace.trace, WINDOW) == ["group 0 member 0 stepped to 160, 140 past an unanswered task"]


@pytest.mark.parametrize("how", ["worker gone", "workers stopped"])
def test_a_dead_or_stopped_worker_releases_the_waiting_walk(how: str) -> None:
    pace, _ = two_members()
    pace.advance(0, 0, 10)
    held = advance_in_thread(pace, 0, 0, 90)
    assert held.is_alive()
    pace.worker_gone() if how == "worker gone" else pace.give_up()
    held.join(RELEASED_S)
    assert not held.is_alive()


def test_tasks_that_need_nothing_go_at_once_and_release_all_gives_the_rest() -> None:
    released: list[int] = []
    pace = OnePass([[[("a", FILE)]]], [{}, {"a": 60}, {"elsewhere": 5}], released.append, WINDOW)
    assert released == [0, 2]
    pace.release_all()
    assert released == [0, 2, 1]


def test_groups_lie_one_after_another_on_the_line() -> None:
    """Later groups start where earlier ones end (members x their longest member); an ep member's parts run on."""
    walk = [[[("g0a", 10)], [("g0b", 10)]], [[("r0p0", 5), ("r0p1", 7)], [("r1p0", 4)]]]
    released: list[int] = []
    pace = OnePass(walk, [{"r0p1": 3}], released.append, WINDOW)
    assert pace.line(1, 0) == 20 and pace.end == 20 + 12 * 2
    pace.advance(1, 0, 7)  # 5 bytes of part 0, 2 of part 1
    assert released == []
    pace.advance(1, 0, 8)
    assert released == [0]


def test_verify_one_pass_keeps_both_rules_and_the_report(fixture_dir, tmp_path: Path, monkeypatch) -> None:
    """verify --level numeric, on the forked path, at a window of 64 KiB: every numeric task was released only after
    the walk passed the OUT bytes it reads, the walk never stepped more than the window past an unanswered task, what
    was dropped from the page cache had been passed by the walk (and no source tensor two components are cut from,
    which the other's walk reads again), and the report (checks, messages, coverage) is the serial level's."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.plan import Options
    from ckpt_tool.output.convert import convert
    from ckpt_tool.verify import levels, numeric
    from ckpt_tool.verify.compute_pool import can_fork_workers
    from ckpt_tool.verify.levels import verify

    if not can_fork_workers():
        pytest.skip("forked workers are not available here")
    window = 64 * 1024
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=4))
    traces: list[list] = []
    paces: list[OnePass] = []
    dropped: list[tuple[Path, int, int, bool]] = []  # (path, start, end, had the walk passed it)

    class Recorded(OnePass):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs, trace=[])
            traces.append(self.trace)
            paces.append(self)

    class RecordedDrops(numeric.DropBehind):
        def drop(self, path: Path, start: int, end: int) -> None:
            passed = True
            if path.is_relative_to(out):
                g, m, base = paces[0]._where[str(path.relative_to(out))]
                passed = paces[0]._pos[g][m] >= base + end
            dropped.append((path, start, end, passed))
            super().drop(path, start, end)

    monkeypatch.setattr(numeric, "OnePass", Recorded)
    monkeypatch.setattr(numeric, "DropBehind", RecordedDrops)
    monkeypatch.setattr(levels, "ONE_PASS_WINDOW", window)
    report = verify(out, src, level="numeric", kernels="torch", device="cpu", workers=2)
    assert len(traces) == 1
    trace = traces[0]
    releases = [e for e in trace if e[0] == "release"]
    assert releases and all(e[2] for e in releases), "every task reads some OUT bytes"
    assert sum(1 for e in trace if e[0] == "step" and e[4] is not None) > 0, "the walk was paced"
    assert violations(trace, window) == []
    assert any(p.is_relative_to(out) for p, *_ in dropped) and any(p.is_relative_to(src) for p, *_ in dropped)
    assert [d for d in dropped if not d[3]] == [], "dropped from the cache before the walk had read it"
    embed = open_checkpoint(src).tensors["embed.weight"]  # cut into the main model's and the MTP draft's files
    assert not [d for d in dropped if d[0] == src / embed.file and d[1] == embed.start]
    serial = verify(out, src, level="numeric", kernels="torch", device="cpu", workers=1)
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert [(c.name, c.ok, c.message) for c in report.checks] == [(c.name, c.ok, c.message) for c in serial.checks]
    assert report.coverage == serial.coverage and report.coverage["percent"] == 100.0


def test_verify_one_pass_finishes_when_a_worker_dies(fixture_dir, tmp_path: Path, monkeypatch) -> None:
    """A worker dies holding the first per-tensor task (killed in the task; window one byte: the walk waits on every
    task due, that one too): the walk is freed, the parent computes what no worker answered, and the report is
    complete and passes (with ``worker_gone`` a no-op the walk waits on that task until the alarm kills the workers,
    which frees it, and fails the test)."""
    import os
    import signal

    from ckpt_tool.mapping.plan import Options
    from ckpt_tool.output.convert import convert
    from ckpt_tool.verify import levels, linear_check
    from ckpt_tool.verify.compute_pool import ForkedTasks, can_fork_workers
    from ckpt_tool.verify.levels import verify

    if not can_fork_workers():
        pytest.skip("forked workers are not available here")
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=2))
    parent, real_task, real_start, pids = os.getpid(), linear_check.TensorCheck.task, ForkedTasks.start, []

    def start(self):
        real_start(self)
        pids.extend(self.pids.values())
        return self

    def task(self, number: int, pool):
        if number == 0 and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dying with the task taken, its answer never sent
        return real_task(self, number, pool)

    def hung(*_) -> None:
        for pid in pids:  # every worker gone: nothing holds the walk, so verify can return and the test fail
            os.kill(pid, signal.SIGKILL)
        hung.fired = True

    hung.fired = False
    monkeypatch.setattr(ForkedTasks, "start", start)
    monkeypatch.setattr(linear_check.TensorCheck, "task", task)
    monkeypatch.setattr(levels, "ONE_PASS_WINDOW", 1)
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        report = verify(out, src, level="numeric", kernels="torch", device="cpu", workers=2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not hung.fired, "verify did not finish in time: the walk waited on a dead worker's task"
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert report.coverage["percent"] == 100.0
