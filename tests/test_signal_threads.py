"""A stop signal sent to the process reaches the main thread, whatever thread the kernel would have picked: every
thread ckpt-tool starts blocks SIGINT, SIGTERM and SIGHUP (``processes.stop_signals_to_main``).

Python runs a signal's handler only in the main thread; a main thread waiting on a lock without a timeout (joining a
writer, waiting for a file's future) wakes only when the signal interrupts its own wait. Delivered to a writer thread
instead, a SIGTERM waited for the files in flight, and the preemption tests that wait for the handler hung or not
depending on which thread the kernel chose (issue 43).
"""

from __future__ import annotations

import ast
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_tool.processes import STOP_SIGNALS, signal_free, stop_signals_to_main

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_tool"


def _blocked_here() -> set[int]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def test_threads_started_through_the_helpers_block_the_stop_signals() -> None:
    seen: list[set[int]] = []
    t = threading.Thread(target=signal_free(lambda: seen.append(_blocked_here())))
    t.start()
    t.join()
    with ThreadPoolExecutor(2, initializer=stop_signals_to_main) as pool:
        seen.append(pool.submit(_blocked_here).result())
    plain = threading.Thread(target=lambda: seen.append(_blocked_here()))
    plain.start()
    plain.join()
    assert all(set(STOP_SIGNALS) <= s for s in seen[:2]), seen
    assert not set(STOP_SIGNALS) & seen[2]  # a thread started without them keeps the main thread's mask
    assert not set(STOP_SIGNALS) & _blocked_here()  # the main thread itself is never changed
    stop_signals_to_main()
    assert not set(STOP_SIGNALS) & _blocked_here()


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _thread_starts(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _name(node.func) in ("Thread", "ThreadPoolExecutor")
    ]


def test_every_thread_the_tool_starts_goes_through_the_helpers() -> None:
    """Each ``threading.Thread(target=...)`` in ckpt_tool wraps its target in ``signal_free``, and each
    ``ThreadPoolExecutor(...)`` names an initializer that calls ``stop_signals_to_main``."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for call in _thread_starts(tree):
            kw = {k.arg: k.value for k in call.keywords}
            where = f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
            if _name(call.func) == "Thread":
                target = kw.get("target")
                ok = isinstance(target, ast.Call) and getattr(target.func, "id", None) == "signal_free"
            else:
                init = kw.get("initializer")
                ok = init is not None and (
                    getattr(init, "id", None) == "stop_signals_to_main"
                    or (isinstance(init, ast.Attribute) and _calls_helper(tree, init.attr))
                )
            if not ok:
                bad.append(where)
    assert not bad, bad


def _calls_helper(tree: ast.AST, method: str) -> bool:
    """Whether the method ``method`` defined in ``tree`` calls ``stop_signals_to_main()`` first."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == method and node.body:
            first = node.body[0]
            return (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Call)
                and getattr(first.value.func, "id", None) == "stop_signals_to_main"
            )
    return False


class _Stop(Exception):
    pass


def test_a_signal_another_thread_received_is_handled_while_the_main_thread_waits() -> None:
    """A library's thread started without the mask (OpenBLAS starts its own) takes a process-directed signal: the
    main thread, waiting for a writer through ``join_in_steps``, runs the handler while the writer is still going.
    (A plain ``join()`` returns only when the writer ends, and the handler with it: seen in the issue-43 runs.)"""
    from ckpt_tool.processes import join_in_steps

    release, finished = threading.Event(), threading.Event()

    def write() -> None:
        release.wait(120)
        finished.set()

    writer = threading.Thread(target=signal_free(write))
    main = threading.main_thread().ident

    def waiting_on_writer() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "_wait_for_tstate_lock":  # inside Thread.join, however it was called
                return True
            frame = frame.f_back
        return False

    def library_thread_takes_the_signal() -> None:
        while not waiting_on_writer() and not release.is_set():  # sent once the main thread waits on the writer
            time.sleep(0.001)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    library = threading.Thread(target=library_thread_takes_the_signal)

    def stop(signum, frame):
        raise _Stop

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        writer.start()
        try:
            library.start()  # its signal may be handled as soon as this returns, or inside the wait below
            join_in_steps(writer)
            raise AssertionError("the handler never ran")
        except _Stop:
            # handled while the writer was still writing (not writer.is_alive(): a join a handler's exception
            # interrupted marks the thread stopped, CPython's threading._wait_for_tstate_lock)
            assert not finished.is_set()
    finally:
        release.set()
        writer.join()
        library.join()
        signal.signal(signal.SIGUSR1, previous)
