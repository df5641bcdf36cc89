"""What both ways into the command line share: the global flags, one-line errors, interrupts, and inspect.

:mod:`ckpt_tool.cli.entry` (the console script, with its typer-free path for inspect) and the typer app
(:mod:`ckpt_tool.cli.app`) both import this; neither imports the other at module level. It imports
:mod:`ckpt_tool.cli.render` (rich) only inside functions, so ``inspect --json`` never loads rich; render never
imports this module (what both need, :func:`drop_stdout`, lives in :mod:`ckpt_tool.cli.streams`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckpt_tool.cli.streams import drop_stdout

STATE = {"debug": False, "quiet": False}
GLOBAL_FLAGS = {"--debug": "debug", "-q": "quiet", "--quiet": "quiet"}
FORMATS = ("table", "json")


def take_global_flags(args: list[str]) -> list[str]:
    """--debug and -q/--quiet anywhere (before a ``--``): noted here and removed, so every command accepts them."""
    kept: list[str] = []
    for i, a in enumerate(args):
        if a == "--":
            kept += args[i:]
            break
        if a in GLOBAL_FLAGS:
            STATE[GLOBAL_FLAGS[a]] = True
        else:
            kept.append(a)
    return kept


def apply_global_flags(debug: bool = False, quiet: bool = False) -> None:
    """Debug logging and quiet output, from the flags (anywhere or before the command) and CKPT_TOOL_DEBUG."""
    STATE["debug"] = STATE["debug"] or debug or bool(os.environ.get("CKPT_TOOL_DEBUG"))
    STATE["quiet"] = STATE["quiet"] or quiet
    logging.basicConfig(
        level=logging.DEBUG if STATE["debug"] else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if STATE["quiet"]:
        from ckpt_tool.cli.render import set_quiet

        set_quiet(True)


def report_error(exc: BaseException) -> None:
    """One ``error:`` line on stderr (the traceback too with --debug)."""
    from ckpt_tool.cli.render import error_line

    if STATE["debug"]:
        import traceback

        traceback.print_exception(exc)
    error_line(str(exc))


# What stops a command from outside: Ctrl-C, and what Slurm, Kubernetes (SIGTERM) and a closed terminal (SIGHUP) send.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Preempted(KeyboardInterrupt):
    """SIGTERM or SIGHUP: raised where Ctrl-C's KeyboardInterrupt would be, so the command stops the same way
    (a convert's files in flight finish or their temporaries go, the journal stays resumable)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_signals() -> Iterator[None]:
    """While a command runs: the first of SIGINT, SIGTERM, SIGHUP stops it as Ctrl-C does; a second one exits at
    once (128 + its number) without waiting for files in flight: their temporaries are cleared by the rerun.

    A signal the command was started ignoring stays ignored (``nohup`` ignores SIGHUP; a shell ignores SIGINT
    for a job started with ``&``)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def at_once(signum: int, frame: object) -> None:
        os.write(2, f"error: {signal.Signals(signum).name} again: stopped at once\n".encode())
        os._exit(128 + signum)

    handled = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]

    def first(signum: int, frame: object) -> None:
        for s in handled:
            signal.signal(s, at_once)
        raise KeyboardInterrupt if signum == signal.SIGINT else Preempted(signum)

    previous = {s: signal.signal(s, first) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def interrupted(command: str, exc: BaseException) -> int:
    """A stop signal says what to do (exit 128 + the signal: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); a closed stdout
    (``| head``) ends quietly (exit 0)."""
    if isinstance(exc, BrokenPipeError):
        drop_stdout()
        return 0
    from ckpt_tool.cli.render import error_line

    signum = exc.signum if isinstance(exc, Preempted) else signal.SIGINT
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    error_line(f"{how}; rerun the same command to resume" if command == "convert" else how)
    return 128 + signum


def run_inspect(
    src: str, *, as_json: bool, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> int:
    """``ckpt-tool inspect``: the report on stdout (a table, or one JSON document); returns the exit code."""
    from ckpt_tool.checkpoint.hub import hub_headers, parse_hub_ref
    from ckpt_tool.checkpoint.summary import inspect_local, inspect_tensors
    from ckpt_tool.cli.jsondoc import json_document, print_json
    from ckpt_tool.errors import CkptToolError

    try:
        ref = parse_hub_ref(src, revision=revision, token=token, cache_dir=cache_dir)
        if ref is not None:
            tensors, config, config_error = hub_headers(ref)
            report = inspect_tensors(src, tensors, config, config_error, whole=not src.endswith(".safetensors"))
        else:
            report = inspect_local(src)
    except CkptToolError as exc:
        if as_json:
            print_json(json_document("inspect", {"source": src}, error=str(exc)))
        report_error(exc)
        return exc.exit_code
    if as_json:
        print_json(json_document("inspect", report.to_json(), error=report.problems[0] if report.problems else None))
        if not report.ok:
            from ckpt_tool.cli.render import error_line

            for p in report.problems:
                error_line(p)
    else:
        from ckpt_tool.cli.render import render_inspect

        render_inspect(report)
    return 0 if report.ok else 1
