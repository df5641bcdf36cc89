"""The ``ckpt-tool`` command line: a thin layer over the library. Errors become one line and an exit code.

Exit codes (every command): 0 ok, 1 a check failed or the input is invalid, 2 usage error.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from . import __version__
from .errors import CkptToolError

app = typer.Typer(
    name="ckpt-tool",
    help="Convert, inspect and verify DeepSeek V4 safetensors checkpoints for vLLM (target model + MTP draft).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckpt-tool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logging.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Convert, inspect and verify DeepSeek V4 safetensors checkpoints for vLLM."""
    _state["debug"] = debug or bool(os.environ.get("CKPT_TOOL_DEBUG"))
    logging.basicConfig(level=logging.DEBUG if _state["debug"] else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _fail(exc: BaseException, code: int = 1) -> None:
    from .report import error_line

    if _state["debug"]:
        import traceback

        traceback.print_exception(exc)
    error_line(str(exc))
    raise typer.Exit(code)


@app.command()
def inspect(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Checkpoint folder, index .json, one .safetensors file, or hub repo id (org/name[@rev]).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")] = False,
) -> None:
    """Header-only look at a checkpoint: files, tensors, dtypes, bytes, quantization, MTP layers.

    Reads only headers (no tensor bytes). Exits 1 if an MTP layer the config asks for is missing,
    the config and stored dtypes disagree, or a file is invalid.

    Examples:
      ckpt-tool inspect ./DeepSeek-V4-Flash
      ckpt-tool inspect ./DeepSeek-V4-Flash/model.safetensors.index.json --json
      ckpt-tool inspect deepseek-ai/DeepSeek-V4-Flash
    """
    from .hub import hub_headers, parse_hub_ref
    from .inspect import inspect_tensors
    from .report import print_json, render_inspect
    from .source import open_checkpoint

    try:
        ref = parse_hub_ref(src)
        if ref is not None:
            tensors, config, config_error = hub_headers(ref)
        else:
            ckpt = open_checkpoint(Path(src), need_config=False)
            tensors, config, config_error = ckpt.tensors, ckpt.config, ckpt.config_error
        report = inspect_tensors(src, tensors, config, config_error)
    except CkptToolError as exc:
        if json_out:
            print_json({"source": src, "ok": False, "error": str(exc)})
        _fail(exc, exc.exit_code)
        return
    if json_out:
        print_json(report.to_json())
        if not report.ok:
            from .report import error_line

            for p in report.problems:
                error_line(p)
    else:
        render_inspect(report)
    raise typer.Exit(0 if report.ok else 1)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    try:
        app(args=argv, prog_name="ckpt-tool", standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    return 0
