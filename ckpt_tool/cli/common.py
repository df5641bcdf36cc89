"""What both ways into the command line share: the global flags, one-line errors, interrupts, and inspect.

:mod:`ckpt_tool.cli.entry` (the console script, with its typer-free path for inspect) and the typer app
(:mod:`ckpt_tool.cli.app`) both import this; neither imports the other at module level. It imports
:mod:`ckpt_tool.cli.render` (rich) only inside functions, so ``inspect --json`` never loads rich; render never
imports this module (what both need, :func:`drop_stdout`, lives in :mod:`ckpt_tool.cli.streams`).
"""

from __future__ import annotations

import logging
import os

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


def interrupted(command: str, exc: BaseException) -> int:
    """Ctrl-C says what to do (exit 130); a closed stdout (``| head``) ends quietly (exit 0)."""
    if isinstance(exc, BrokenPipeError):
        drop_stdout()
        return 0
    from ckpt_tool.cli.render import error_line

    error_line("interrupted; rerun the same command to resume" if command == "convert" else "interrupted")
    return 130


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
