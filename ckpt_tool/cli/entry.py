"""The ``ckpt-tool`` entry point: global flags, then the command.

Most commands go through the typer app in :mod:`ckpt_tool.cli.app`. ``inspect`` with plain arguments
(``inspect SRC [--json | --format F] [--revision R] [--token T] [--cache-dir D]``) and a plain dry run
(``convert SRC OUT --dry-run [--tp T] [--moe-parallel M] [--only O] [--target P] [--json | --format F]``) run
here without importing typer: building the typer app alone costs ~0.2 s (typer builds pydantic adapters for
every option), as much as the rest of a dry run of a full V4 checkpoint, and both commands are what people run
interactively (targets: inspect within 2.5x, a dry run within 5x of reading and parsing every header). Anything
else (``--help``, a usage error, any other option or command) takes the typer path, which calls the same
:func:`run_inspect` / :func:`print_plan`; tests hold the two paths to the same output (``CKPT_TOOL_TYPER_ONLY=1``
sends every command line through typer).
"""

from __future__ import annotations

import os
import sys

from ckpt_tool.checkpoint.gc_pause import gc_paused
from ckpt_tool.cli.common import (
    FORMATS,
    STATE,
    apply_global_flags,
    interrupted,
    run_dry_run,
    run_inspect,
    stop_signals,
    take_global_flags,
)
from ckpt_tool.mapping.profiles import known_names

_INSPECT_VALUE_OPTIONS = {"--format": "fmt", "--revision": "revision", "--token": "token", "--cache-dir": "cache_dir"}
# convert --dry-run's options this path takes, each with the values typer would accept (anything else: typer says)
_DRY_RUN_CHOICES = {"--moe-parallel": ("tp", "ep"), "--only": ("model", "mtp"), "--format": FORMATS}


def _scan(args: list[str], flags: tuple[str, ...], valued: tuple[str, ...]) -> tuple[list, set, dict] | None:
    """``args`` as (positional arguments, ``flags`` given, ``valued`` option -> its last value, as ``--opt v`` or
    ``--opt=v``); None at anything else (``--help``, an unknown option, a ``--``, an option missing its value)."""
    positional: list[str] = []
    given: set[str] = set()
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if a in flags:
            given.add(a)
        elif name in valued:
            if not eq:
                if i + 1 >= len(args):
                    return None
                i += 1
                value = args[i]
            values[name] = value
        elif a.startswith("-"):
            return None
        else:
            positional.append(a)
        i += 1
    return positional, given, values


def _plain_inspect(args: list[str]) -> dict | None:
    """The keyword arguments of :func:`run_inspect` when ``args`` is a plain inspect command line, else None."""
    scanned = _scan(args[1:], ("--json",), tuple(_INSPECT_VALUE_OPTIONS)) if args[:1] == ["inspect"] else None
    if scanned is None or len(scanned[0]) != 1:
        return None  # a second argument, or none: typer says what to do
    positional, given, values = scanned
    fmt = values.pop("--format", None)
    if fmt not in (None, *FORMATS):
        return None
    found = {"src": positional[0], "as_json": "--json" in given or fmt == "json"}
    return found | {_INSPECT_VALUE_OPTIONS[o]: v for o, v in values.items()}


def _plain_dry_run(args: list[str]) -> dict | None:
    """The keyword arguments of :func:`run_dry_run` when ``args`` is a plain ``convert --dry-run``, else None."""
    valued = ("--tp", "--target", *_DRY_RUN_CHOICES)
    scanned = _scan(args[1:], ("--dry-run", "--json"), valued) if args[:1] == ["convert"] else None
    if scanned is None or len(scanned[0]) != 2 or "--dry-run" not in scanned[1]:
        return None
    (src, out), given, values = scanned
    tp = values.get("--tp", "1")
    if not tp.isdigit() or int(tp) < 1 or not _known_target(values.get("--target", "auto")):
        return None
    if any(values.get(o) not in (*choices, None) for o, choices in _DRY_RUN_CHOICES.items()):
        return None
    return {
        "src": src,
        "out": out,
        "tp": int(tp),
        "moe_parallel": values.get("--moe-parallel", "tp"),
        "only": values.get("--only"),
        "target": values.get("--target", "auto"),
        "as_json": "--json" in given or values.get("--format") == "json",
    }


def _known_target(name: str) -> bool:
    return name == "auto" or name in known_names()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    STATE.update(debug=False, quiet=False)
    if "ckpt_tool.cli.render" in sys.modules:  # an earlier in-process call (tests) may have left it quiet
        sys.modules["ckpt_tool.cli.render"].set_quiet(False)
    args = take_global_flags(list(sys.argv[1:] if argv is None else argv))
    quick = not os.environ.get("CKPT_TOOL_TYPER_ONLY")
    plain = _plain_inspect(args) if quick else None
    dry_run = _plain_dry_run(args) if quick and plain is None else None
    with stop_signals():
        return _run(args, plain, dry_run)


def _run(args: list[str], plain: dict | None, dry_run: dict | None) -> int:
    try:
        if plain is not None or dry_run is not None:
            apply_global_flags()
            # headers, plan and output are ~10^6 objects, none cyclic: the collector stays off until they are
            # freed. Turned on while they were alive, its first pass walked them all (0.1-0.2 s, more than the
            # plan's JSON)
            with gc_paused():
                try:
                    return run_inspect(**plain) if plain is not None else run_dry_run(**dry_run)
                except (KeyboardInterrupt, BrokenPipeError) as exc:
                    return interrupted(args[0], exc)
        from ckpt_tool.cli.app import app  # typer (~0.2 s to build the app): only off the fast paths above

        app(args=args, prog_name="ckpt-tool", standalone_mode=True)
    except SystemExit as exc:  # typer's exit codes; rich's on a closed stdout
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
