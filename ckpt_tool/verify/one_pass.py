"""One pass over the bytes: ``verify --level numeric`` reads each source and OUT byte from the disk once.

The values level walks OUT front to back (the ranks' files of a part at once, in lockstep: a *group* of *members*,
each member one thread reading its files in order) and reads the source rows each block is cut from. The numeric
level's forked workers run their tasks (a per-tensor check of one converted linear across ranks, parts and experts,
or one side of the MTP forward) on the same bytes. Both read through the page cache, and :class:`OnePass` makes the
workers' reads hits of what the walk has just read:

- release: a task's *needs* are the OUT tensors it reads, as ``(group, member, end)``: the position in the member's
  files the walk must have passed (the walk reads the source rows of a tensor together with the tensor's OUT
  bytes, so it has read the source bytes too). A task is given to the workers once every need is passed; a task
  that needs nothing (none in practice), at once.
- throttle: positions lie on one line, the walk's bytes in order (a group's offset plus its members times the
  position in it: OUT bytes read). A walk thread about to read at line position ``P`` waits while a released task
  not yet answered ends more than ``window`` before ``P``: so a worker reads what the walk read at most ``window``
  OUT bytes (and the source rows cut into them) plus one task ago, still in the page cache.

Nothing can deadlock: a walk thread waits only for released tasks, which a worker answers without any walk thread
moving. A worker that dies leaves its task unanswered, so when a worker goes, every task released so far stops
holding the walk (the parent computes whatever no worker answered); once every worker has gone (stopped, dead, or
done), nothing holds it. The lockstep of a group never holds its slowest member, and what holds a member here
needs no member to move: the walk always has a thread that can go on.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable

# (relpath, file size) per file of a member, members per group, groups in walk order: ``values._lockstep_groups``
Walk = list[list[list[tuple[str, int]]]]


def places(walk: Walk) -> dict[str, tuple[int, int, int]]:
    """Each file of the walk: ``(group, member, offset of the file in the member's bytes)``."""
    where = {}
    for g, members in enumerate(walk):
        for m, files in enumerate(members):
            base = 0
            for relpath, size in files:
                where[relpath] = (g, m, base)
                base += size
    return where


class OnePass:
    """The values walk ``walk`` releasing ``needs`` (per task: ``{relpath: end offset}`` of the OUT tensors it reads)
    through ``release(task)`` and held within ``window`` OUT bytes of the released tasks not yet :meth:`answered`.

    Walk threads call :meth:`advance` before each block and :meth:`done` when their member ends (or fails); the
    thread collecting the workers' answers calls :meth:`answered`, :meth:`worker_gone` and :meth:`give_up`.
    ``trace``: a list to record releases and steps in (tests prove the two rules on it)."""

    def __init__(
        self,
        walk: Walk,
        needs: list[dict[str, int]],
        release: Callable[[int], None],
        window: int,
        trace: list | None = None,
    ) -> None:
        self.window, self._release, self.trace = window, release, trace
        self._cond = threading.Condition()
        self._where = places(walk)
        self._offset: list[int] = []  # line position of each group's start
        self._members = [len(members) for members in walk]
        self._pos: list[list[float]] = [[0.0] * len(members) for members in walk]  # per member: position passed
        line = 0
        for members in walk:
            self._offset.append(line)
            line += max(sum(size for _, size in files) for files in members) * len(members)
        self.end = line  # the line position past the whole walk
        # per (group, member): (position, task) in the order the member passes them; a cursor into each
        self._waiting: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._cursor: dict[tuple[int, int], int] = {}
        self._unmet: list[int] = []
        self._ends: list[int] = []  # per task: the line position of its last need
        self.needs: list[list[tuple[int, int, int]]] = []
        for task, files in enumerate(needs):
            per: dict[tuple[int, int], int] = {}
            for relpath, end in files.items():
                if relpath not in self._where:
                    continue  # a file the walk does not read: nothing to wait for
                g, m, base = self._where[relpath]
                per[g, m] = max(per.get((g, m), 0), base + end)
            self.needs.append([(g, m, x) for (g, m), x in sorted(per.items())])
            self._unmet.append(len(per))
            self._ends.append(max((self.line(g, x) for (g, _), x in per.items()), default=0))
            for key, x in per.items():
                self._waiting.setdefault(key, []).append((x, task))
        for key in self._waiting:
            self._waiting[key].sort()
            self._cursor[key] = 0
        self.released: set[int] = set()
        self._open: list[tuple[int, int]] = []  # heap of (end, task): released, not answered (lazily pruned)
        self._answered: set[int] = set()
        self._held = True  # False once no worker is left to answer
        with self._cond:
            for task, unmet in enumerate(self._unmet):
                if not unmet:
                    self._give(task)

    def line(self, group: int, pos: float) -> float:
        """Position ``pos`` of a member of ``group`` on the walk's line (OUT bytes read when every member is there)."""
        return self._offset[group] + pos * self._members[group]

    def _give(self, task: int) -> None:
        self.released.add(task)
        heapq.heappush(self._open, (self._ends[task], task))
        if self.trace is not None:
            self.trace.append(("release", task, [(g, m, x, self._pos[g][m]) for g, m, x in self.needs[task]]))
        self._release(task)

    def _passed(self, group: int, member: int, pos: float) -> None:
        """The member has read everything before ``pos``: release what that completes (the lock held)."""
        self._pos[group][member] = pos
        key = (group, member)
        waiting = self._waiting.get(key)
        if not waiting:
            return
        i = self._cursor[key]
        while i < len(waiting) and waiting[i][0] <= pos:
            task = waiting[i][1]
            self._unmet[task] -= 1
            if not self._unmet[task]:
                self._give(task)
            i += 1
        self._cursor[key] = i

    def frontier(self) -> float | None:
        """The line position of the earliest-ending released task not answered (None: none holds the walk)."""
        while self._open and self._open[0][1] in self._answered:
            heapq.heappop(self._open)
        return self._open[0][0] if self._held and self._open else None

    def advance(self, group: int, member: int, pos: int) -> None:
        """A walk thread has read its files up to ``pos`` and is about to read on: release the tasks that completes,
        then wait while that is more than ``window`` past the earliest released task not yet answered."""
        at = self.line(group, pos)
        with self._cond:
            self._passed(group, member, pos)
            while (front := self.frontier()) is not None and at > front + self.window:
                self._cond.wait()
            if self.trace is not None:
                self.trace.append(("step", group, member, at, self.frontier()))

    def done(self, group: int, member: int) -> None:
        """The member's walk ended (or failed): it no longer keeps a task from release."""
        with self._cond:
            self._passed(group, member, float("inf"))

    def release_all(self) -> None:
        """Release every task not released yet (the walk is over, or will not run)."""
        with self._cond:
            for task in range(len(self._unmet)):
                if task not in self.released:
                    self._unmet[task] = 0
                    self._give(task)

    def answered(self, task: int) -> None:
        """A worker answered ``task``: it no longer holds the walk."""
        with self._cond:
            self._answered.add(task)
            self._cond.notify_all()

    def worker_gone(self) -> None:
        """A worker left: any task it took may never be answered, so none released so far holds the walk."""
        with self._cond:
            self._answered.update(self.released)
            self._cond.notify_all()

    def give_up(self) -> None:
        """No worker is left (or the level is being stopped): nothing holds the walk any more."""
        with self._cond:
            self._held = False
            self._cond.notify_all()
