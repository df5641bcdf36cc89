"""The ``ckpt-tool`` entry point: global flags, then the command.

Most commands go through the typer app in :mod:`ckpt_tool.cli.app`. ``inspect`` with plain arguments
(``inspect SRC [--json | --format F] [--revision R] [--token T] [--cache-dir D]``) runs here without
importing typer or rich: building the typer app alone costs ~0.2 s, and inspect is what people run
interactively (target: a full V4 checkpoint in 0.3 s, interpreter start included). Anything else
(``--help``, a usage error, another command) takes the typer path, which calls the same
:func:`run_inspect`; a test holds the two paths to the same output (``CKPT_TOOL_TYPER_ONLY=1``
sends every command line through typer).
"""

from __future__ import annotations

import os
import sys

from ckpt_tool.cli.common import (
    FORMATS,
    STATE,
    apply_global_flags,
    interrupted,
    run_inspect,
    stop_signals,
    take_global_flags,
)

_INSPECT_VALUE_OPTIONS = {"--format": "fmt", "--revision": "revision", "--token": "token", "--cache-dir": "cache_dir"}


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
    if "ckpt_tool.cli.render" in sys.modules:  # an earlier in-process call (tests) may have left it quiet
        sys.modules["ckpt_tool.cli.render"].set_quiet(False)
    args = take_global_flags(list(sys.argv[1:] if argv is None else argv))
    plain = _plain_inspect(args)
    with stop_signals():
        return _run(args, plain)


def _run(args: list[str], plain: dict | None) -> int:
    try:
        if plain is not None and not os.environ.get("CKPT_TOOL_TYPER_ONLY"):
            apply_global_flags()
            try:
                return run_inspect(**plain)
            except (KeyboardInterrupt, BrokenPipeError) as exc:
                return interrupted("inspect", exc)
        from ckpt_tool.cli.app import app

        app(args=args, prog_name="ckpt-tool", standalone_mode=True)
    except SystemExit as exc:  # typer's exit codes; rich's on a closed stdout
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
