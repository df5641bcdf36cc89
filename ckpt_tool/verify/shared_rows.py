"""Source row blocks read once for every rank that cuts from them (the values level's lockstep groups).

At tensor parallelism the ranks of one part hold slices of the same source tensors: a row-parallel weight's ranks each
take columns of the same rows, a replicated tensor is the same rows on every rank. The values level compares the
ranks' files at once, one thread each, in lockstep (:mod:`ckpt_tool.checkpoint.lockstep`), and each thread asks for
the source rows its next block is cut from: the same ``(file, offset, length)`` the other ranks ask for at the same
place of their own files. :class:`SharedRows` reads such a block once, for the first rank that asks, and hands the
same memory to the others; it is let go once the last request the group will make for it has been served. The group
counts its requests before it starts (``wanted``), so nothing is kept for a rank that never comes, and a rank that
stops early on a tensor (a mismatch found) gives up the requests it will not make (:meth:`SharedRows.skip`).

What that saves: at tp 8 a row-parallel weight was read eight times, once per rank, from the page cache (the disk
served it once); the copies out of the cache cost more CPU than anything else the values level does. Read once, the
source can also be read with ``O_DIRECT`` (no copy at all) when nothing reads it again.

Memory: a block lives from the first rank's read to the last rank's; the lockstep keeps the ranks within a window of
each other, so the blocks alive are those cut into one window of each rank's file (the caller sizes the window).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_tool.checkpoint.reader import ByteSource, Scratch

Key = tuple[str | Path, int, int]
"""A source block: (file, byte offset, length)."""


@dataclass
class _Block:
    scratch: Scratch
    ready: threading.Event = field(default_factory=threading.Event)
    view: memoryview | None = None
    error: BaseException | None = None
    users: int = 0  # requests holding the view now
    kept: bool = True  # in SharedRows._blocks: wanted by a request still to come


class SharedRows:
    """Blocks of ``source`` read once for the ``wanted`` requests of each (a Counter of :data:`Key`, every request the
    group will make); a block not counted there is read for its one request. A block read while those kept for later
    requests hold ``most`` bytes is not kept (each later request reads it again): memory stays bounded even where the
    ranks reach the same block far apart (``--moe-parallel ep``, whose ranks' files differ in layout). Any thread may
    call. ``again``: blocks other groups read too (the MTP draft's copy of the embedding and head): they go through the
    source's cache, where the next group finds them."""

    def __init__(self, source: ByteSource, wanted: Counter[Key], *, most: int, again: set[Key] = frozenset()) -> None:
        self._source, self._again = source, again
        self._left = wanted  # requests still to come, per block
        self._most, self._kept_bytes = most, 0
        self._blocks: dict[Key, _Block] = {}
        self._spare: list[Scratch] = []  # memory of blocks let go, for the next ones
        self._lock = threading.Lock()
        self.reads = 0  # blocks read from the source (tests)
        self.read_bytes = 0

    @contextmanager
    def rows(self, key: Key, *, what: str = "") -> Iterator[memoryview]:
        """The bytes of ``key`` for one request, valid inside the ``with``; read now if no other request has."""
        with self._lock:
            block = self._blocks.get(key)
            first = block is None
            if first:
                block = _Block(self._spare.pop() if self._spare else Scratch())
                if self._left.get(key, 0) > 1 and self._kept_bytes + key[2] <= self._most:
                    self._blocks[key] = block
                    self._kept_bytes += key[2]
                else:
                    block.kept = False
                self.reads += 1
                self.read_bytes += key[2]
            block.users += 1
        try:
            if first:
                try:
                    block.view = self._source.read_span(
                        key[0], key[1], key[2], block.scratch, what=what, again=key in self._again
                    )
                except BaseException as exc:
                    block.error = exc
                    raise
                finally:
                    block.ready.set()
            else:
                block.ready.wait()
                if block.error is not None:
                    raise block.error
            yield block.view
        finally:
            self._served(key, block)

    def skip(self, keys: Iterable[Key]) -> None:
        """Requests that will not be made after all (a rank gave up a tensor): blocks no one else wants go."""
        with self._lock:
            for key in keys:
                if self._last(key):
                    block = self._blocks.pop(key, None)
                    if block is not None:
                        self._let_go(key, block)

    def _served(self, key: Key, block: _Block) -> None:
        with self._lock:
            if self._last(key) and self._blocks.get(key) is block:
                del self._blocks[key]
                self._let_go(key, block)
            block.users -= 1
            self._free(block)

    def _last(self, key: Key) -> bool:
        """Count one request of ``key`` as made: was it the last one wanted? (the lock held)"""
        left = self._left.get(key, 0) - 1
        if left > 0:
            self._left[key] = left
            return False
        self._left.pop(key, None)  # (a request after the count ran out reads the block again: none is kept for it)
        return True

    def _let_go(self, key: Key, block: _Block) -> None:
        """``block`` is no longer kept for later requests (the lock held)."""
        block.kept = False
        self._kept_bytes -= key[2]
        self._free(block)

    def _free(self, block: _Block) -> None:
        """Its memory to the spares once no request holds it and none to come wants it (the lock held)."""
        if not block.kept and block.users == 0:
            block.view = None
            self._spare.append(block.scratch)

    @property
    def held(self) -> int:
        """Blocks kept now (read, and wanted by a request still to come)."""
        with self._lock:
            return len(self._blocks)
