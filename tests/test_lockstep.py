"""Lockstep: the members of a group stay within a window of the slowest one still working, and never deadlock."""

from __future__ import annotations

import random
import threading
import time

from ckpt_tool.checkpoint.lockstep import Lockstep

HANG_S = 120  # only a hang takes this long; a busy machine stalls a thread for seconds at most


def test_no_member_gets_more_than_the_window_ahead_of_the_slowest() -> None:
    group = Lockstep(4, window=10)
    spread: list[int] = []
    lock = threading.Lock()
    positions = [0] * 4

    def run(m: int) -> None:
        rng = random.Random(m)
        pos = 0
        while pos < 400:
            pos += rng.randint(1, 5)
            group.advance(m, pos)
            with lock:
                positions[m] = pos
                spread.append(max(positions) - min(positions))
            time.sleep(rng.random() / 2000 * (4 if m == 3 else 1))  # member 3 is slow (pacing: the bound holds anyway)
        group.done(m)

    threads = [threading.Thread(target=run, args=(m,)) for m in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_S)
    assert not any(t.is_alive() for t in threads)
    assert max(spread) <= 10 + 5  # the window plus one step (a member records its step before the others move)


def test_a_finished_member_holds_nobody_back_and_a_big_step_of_the_slowest_is_allowed() -> None:
    group = Lockstep(2, window=4)
    group.advance(0, 3)
    group.done(0)
    group.advance(1, 1000)  # the only member left: free
    group = Lockstep(2, window=4)
    group.advance(1, 2)
    group.advance(0, 100)  # member 0 is the slowest (0 <= 2): one step far ahead is allowed
    t = threading.Thread(target=group.advance, args=(0, 200))
    t.start()
    t.join(timeout=0.2)  # a correct Lockstep holds it forever: the time only decides how soon a bug is seen
    assert t.is_alive()  # now 98 ahead of member 1: waits
    group.advance(1, 197)
    t.join(timeout=HANG_S)  # released: a busy machine may take a while to run it, only a hang this long
    assert not t.is_alive()
