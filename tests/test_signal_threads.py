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
import threading
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
