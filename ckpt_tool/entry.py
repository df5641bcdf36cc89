"""The ``ckpt-tool`` entry point: global flags, then the command.

Most commands go through the typer app in :mod:`ckpt_tool.cli`. ``inspect`` with plain arguments
(``inspect SRC [--json | --format F] [--revision R] [--token T] [--cache-dir D]``) runs here without
importing typer or rich: building the typer app alone costs ~0.2 s, and inspect is what people run
interactively (target: a full V4 checkpoint in 0.3 s, interpreter start included). Anything else
(``--help``, a usage error, another command) takes the typer path, which calls the same
:func:`run_inspect`; a test holds the two paths to the same output (``CKPT_TOOL_TYPER_ONLY=1``
sends every command line through typer).
"""

from __future__ import annotations

import logging
import os
import sys

STATE = {"debug": False, "quiet": False}
GLOBAL_FLAGS = {"--debug": "debug", "-q": "quiet", "--quiet": "quiet"}
FORMATS = ("table", "json")
_INSPECT_VALUE_OPTIONS = {"--format": "fmt", "--revision": "revision", "--token": "token", "--cache-dir": "cache_dir"}


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
    logging.basicConfig(level=logging.DEBUG if STATE["debug"] else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if STATE["quiet"]:
        from .report import set_quiet

        set_quiet(True)


def report_error(exc: BaseException) -> None:
    """One ``error:`` line on stderr (the traceback too with --debug)."""
    from .report import error_line

    if STATE["debug"]:
        import traceback

        traceback.print_exception(exc)
    error_line(str(exc))


def interrupted(command: str, exc: BaseException) -> int:
    """Ctrl-C says what to do (exit 130); a closed stdout (``| head``) ends quietly (exit 0)."""
    if isinstance(exc, BrokenPipeError):
        drop_stdout()
        return 0
    from .report import error_line

    error_line("interrupted; rerun the same command to resume" if command == "convert" else "interrupted")
    return 130


def drop_stdout() -> None:
    """The reader went away (``| head``): send what is left of stdout to /dev/null so exit is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a descriptor (captured): nothing to redirect
        pass


def run_inspect(src: str, *, as_json: bool, revision: str | None = None, token: str | None = None, cache_dir: str | None = None) -> int:
    """``ckpt-tool inspect``: the report on stdout (a table, or one JSON document); returns the exit code."""
    from .errors import CkptToolError
    from .hub import hub_headers, parse_hub_ref
    from .inspect import inspect_local, inspect_tensors
    from .jsondoc import json_document, print_json

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
            from .report import error_line

            for p in report.problems:
                error_line(p)
    else:
        from .report import render_inspect

        render_inspect(report)
    return 0 if report.ok else 1


def _plain_inspect(args: list[str]) -> dict | None:
    """The keyword arguments of :func:`run_inspect` when ``args`` is a plain inspect command line, else None."""
    if len(args) < 2 or args[0] != "inspect":
        return None
    found: dict = {"src": None, "as_json": False}
    rest = args[1:]
    i = 0
    while i < len(rest):
        a = rest[i]
        name, eq, value = a.partition("=")
        if a == "--json":
            found["as_json"] = True
        elif name in _INSPECT_VALUE_OPTIONS:
            if not eq:
                if i + 1 >= len(rest):
                    return None
                i += 1
                value = rest[i]
            found[_INSPECT_VALUE_OPTIONS[name]] = value
        elif a.startswith("-") or found["src"] is not None:
            return None  # --help, an unknown option, a second argument, a '--': typer says what to do
        else:
            found["src"] = a
        i += 1
    fmt = found.pop("fmt", None)
    if found["src"] is None or fmt not in (None, *FORMATS):
        return None
    found["as_json"] = found["as_json"] or fmt == "json"
    return found


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    STATE.update(debug=False, quiet=False)
    if "ckpt_tool.report" in sys.modules:  # an earlier in-process call (tests) may have left it quiet
        sys.modules["ckpt_tool.report"].set_quiet(False)
    args = take_global_flags(list(sys.argv[1:] if argv is None else argv))
    plain = _plain_inspect(args)
    try:
        if plain is not None and not os.environ.get("CKPT_TOOL_TYPER_ONLY"):
            apply_global_flags()
            try:
                return run_inspect(**plain)
            except (KeyboardInterrupt, BrokenPipeError) as exc:
                return interrupted("inspect", exc)
        from .cli import app

        app(args=args, prog_name="ckpt-tool", standalone_mode=True)
    except SystemExit as exc:  # typer's exit codes; rich's on a closed stdout
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
