"""What both ways into the command line share: the global flags, one-line errors, interrupts, inspect, and
``convert --dry-run``.

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
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ckpt_tool import processes
from ckpt_tool.checkpoint.gc_pause import gc_paused
from ckpt_tool.cli.jsondoc import json_document, json_pieces_sharing, plan_json, print_json, print_json_pieces
from ckpt_tool.cli.streams import drop_stdout
from ckpt_tool.errors import CkptToolError

if TYPE_CHECKING:
    from ckpt_tool.mapping.request import ConvertRequest

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
        from ckpt_tool.cli.render import set_quiet  # rich: not on the --json paths

        set_quiet(True)


def report_error(exc: BaseException) -> None:
    """One ``error:`` line on stderr (the traceback too with --debug)."""
    from ckpt_tool.cli.render import error_line  # rich: not on the --json paths until there is an error

    if STATE["debug"]:
        traceback.print_exception(exc)
    error_line(str(exc))


# What stops a command from outside: Ctrl-C, and what Slurm, Kubernetes (SIGTERM) and a closed terminal (SIGHUP) send.
STOP_SIGNALS = processes.STOP_SIGNALS  # every thread but the main one blocks them (processes.stop_signals_to_main)


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
    from ckpt_tool.cli.render import error_line  # rich: see report_error

    signum = exc.signum if isinstance(exc, Preempted) else signal.SIGINT
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    error_line(f"{how}; rerun the same command to resume" if command == "convert" else how)
    return 128 + signum


def run_inspect(
    src: str, *, as_json: bool, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> int:
    """``ckpt-tool inspect``: the report on stdout (a table, or one JSON document); returns the exit code."""
    from ckpt_tool.mapping.inspection import inspect_source  # inspect's library: not the dry run's

    try:
        report = inspect_source(src, revision=revision, token=token, cache_dir=cache_dir)
    except CkptToolError as exc:
        if as_json:
            print_json(json_document("inspect", {"source": src}, error=str(exc)))
        report_error(exc)
        return exc.exit_code
    if as_json:
        print_json(json_document("inspect", report.to_json(), error=report.problems[0] if report.problems else None))
        if not report.ok:
            from ckpt_tool.cli.render import error_line  # rich: see report_error

            for p in report.problems:
                error_line(p)
    else:
        from ckpt_tool.cli.render import render_inspect  # rich: not for --json

        render_inspect(report)
    return 0 if report.ok else 1


def print_plan(request: ConvertRequest, *, as_json: bool) -> None:
    """``convert --dry-run``'s output: the plan of ``request`` (only the files its ranks or scale-out part write) as
    one JSON document, or as a table and then the note on the ``--target`` chosen."""
    # headers, plan and its JSON are ~10^6 objects, none cyclic, alive until the command ends: one pause for the
    # whole command, not one per step (each resumption had the collector walk the heap built so far)
    with gc_paused():
        _print_plan(request.plan(), request.target, as_json)


def _print_plan(plan, chosen, as_json: bool) -> None:
    if as_json:
        fields = {**plan_json(plan), "dry_run": True, "target_note": chosen.note, "target_warning": chosen.warning}
        doc = json_document("convert", fields)
        print_json_pieces(json_pieces_sharing(doc, ("files",), "tensors"))
        return
    from ckpt_tool.cli.render import note_line, render_plan  # rich: not for --json

    render_plan(plan)
    if chosen.note:
        note_line(chosen.note)


def warning_line(message: str) -> None:
    """One ``warning:`` line on stderr (rich, imported only when there is one)."""
    from ckpt_tool.cli.render import warning_line as show  # rich: see the docstring

    show(message)


def run_dry_run(src: str, out: str, *, tp: int, moe_parallel: str, only: str | None, target: str, as_json: bool) -> int:
    """``ckpt-tool convert SRC OUT --dry-run`` with no option but these (the typer-free path of
    :mod:`ckpt_tool.cli.entry`): what the typer command prints, and its exit code."""
    from ckpt_tool.mapping.request import convert_request  # the planner: the dry run's library, not inspect's

    try:
        # the --target warning before any work: on stderr in --json mode too
        request = convert_request(
            src, tp=tp, moe_parallel=moe_parallel, only=only, target=target, download=False, warn=warning_line
        )
        print_plan(request, as_json=as_json)
    except CkptToolError as exc:
        if as_json:
            print_json(json_document("convert", {"out": out, "dry_run": True}, error=str(exc)))
        report_error(exc)
        return exc.exit_code
    return 0
