"""Keeping the threads that read one source for several output files within a window of each other.

At tensor parallelism every rank's file is cut from the same source tensors: a row-parallel weight's source rows are
read once per rank. When the files of one group (the ranks of one part) are worked on at once and kept close, every
rank wants a source byte within a short time of the first, so the first read serves them all: from the page cache
for a local source (the window is far smaller than memory), from the chunk cache of a hub source. Each member
reports its position (bytes of its own file done; the ranks' files of a group have nearly the same layout); one that
gets more than ``window`` ahead of the slowest member still working waits for it. The slowest member never waits,
so the group always moves.
"""

from __future__ import annotations

import threading


class Lockstep:
    """``members`` workers, each at a position; :meth:`advance` holds one back while it is more than ``window``
    ahead of the slowest member that is not :meth:`done`."""

    def __init__(self, members: int, window: int) -> None:
        self.window = window
        self._pos = [0] * members
        self._active = set(range(members))
        self._cond = threading.Condition()

    def _slowest_other(self, member: int) -> int | None:
        others = [self._pos[m] for m in self._active if m != member]
        return min(others) if others else None

    def advance(self, member: int, pos: int) -> None:
        """Member ``member`` is about to work at ``pos``: wait while that is more than ``window`` past the slowest
        other member (never when ``member`` itself is the slowest)."""
        with self._cond:
            while True:
                slowest = self._slowest_other(member)
                if slowest is None or self._pos[member] <= slowest or pos <= slowest + self.window:
                    break
                self._cond.wait()
            moved = pos != self._pos[member]
            self._pos[member] = pos
            if moved:
                self._cond.notify_all()

    def done(self, member: int) -> None:
        """Member ``member`` finished (or failed): it no longer holds the others back."""
        with self._cond:
            self._active.discard(member)
            self._cond.notify_all()
