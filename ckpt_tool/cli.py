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


def _fail_user(exc: CkptToolError, json_out: bool) -> None:
    """A user-facing error: one JSON document too when --json owns stdout, then one line and the exit code."""
    if json_out:
        from .report import print_json

        print_json({"ok": False, "error": str(exc)})
    _fail(exc, exc.exit_code)


def _fail(exc: BaseException, code: int = 1) -> None:
    from .report import error_line

    if _state["debug"]:
        import traceback

        traceback.print_exception(exc)
    error_line(str(exc))
    raise typer.Exit(code)


def _os_error(exc: OSError, out: Path) -> CkptToolError:
    from .errors import OutputError

    import errno

    if exc.errno == errno.ENOSPC:
        return OutputError(f"{exc.filename or out}: no space left on device; free space and rerun to resume")
    return OutputError(
        f"{exc.filename or out}: {exc.strerror or exc}; check that SRC is readable and OUT is a folder you can create and write"
    )


@app.command()
def inspect(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Checkpoint folder, index .json, one .safetensors file, or hub repo id (org/name[@rev]).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")] = False,
) -> None:
    """Header-only look at a checkpoint: files, tensors, dtypes, bytes, quantization, MTP layers.

    Reads only headers (no tensor bytes). Exits 1 if an MTP layer the config asks for is missing,
    the config and stored dtypes disagree, or a file is invalid.

    Examples:

    \b
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
        report = inspect_tensors(src, tensors, config, config_error, whole=not src.endswith(".safetensors"))
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


def _parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1024, "KB": 1000, "KIB": 1024, "M": 1024**2, "MB": 1000**2, "MIB": 1024**2,
             "G": 1024**3, "GB": 1000**3, "GIB": 1024**3, "T": 1024**4, "TB": 1000**4, "TIB": 1024**4}
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size like 5GiB, 500MB or 1048576") from None
    if unit not in units or value <= 0:
        raise typer.BadParameter(f"{text!r} is not a size like 5GiB, 500MB or 1048576")
    return int(value * units[unit])


@app.command()
def convert(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Original DeepSeek V4 checkpoint: folder, index .json, .safetensors, or hub repo id (org/name[@rev]).")],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Output folder (created). Never inside SRC.")],
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel degree: one set of files per rank.")] = 1,
    moe_parallel: Annotated[str, typer.Option("--moe-parallel", help="Routed experts: 'tp' splits each expert's intermediate dim, 'ep' gives each rank whole experts.")] = "tp",
    only: Annotated[str | None, typer.Option("--only", help="Write only 'model' (target) or 'mtp' (draft).")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest output part file, e.g. 5GiB, 500MB.")] = "5GiB",
    workers: Annotated[int, typer.Option("--workers", min=1, help="Output files written (and hashed) in parallel; each holds up to ~34 MiB of buffers, all together at most ~256 MiB.")] = 1,
    target: Annotated[str, typer.Option("--target", help="Engine profile: 'auto' (the installed vLLM's, else the newest), or a name from 'ckpt-tool profiles'.")] = "auto",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a finished (or differently-started) OUT.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document (plan or summary) on stdout.")] = False,
    ranks: Annotated[str | None, typer.Option("--ranks", help="Write only these TP ranks, e.g. 0,3-5 (the manifest records them).")] = None,
    shard_index: Annotated[int, typer.Option("--shard-index", min=0, help="Scale-out: this machine's part K of --shard-count M.")] = 0,
    shard_count: Annotated[int, typer.Option("--shard-count", min=1, help="Scale-out: write only planned files i with i % M == K; no manifest until --finalize.")] = 1,
    finalize: Annotated[bool, typer.Option("--finalize", help="After all shards ran (same options): check every file against its checksum, write index, config and manifest.")] = False,
) -> None:
    """Convert an original DeepSeek V4 checkpoint into vLLM's runtime layout (target model + MTP draft).

    Streams source byte ranges into per-rank files (never a whole shard or fused tensor in memory),
    renames mtp.{i}.* to model.layers.{N+i}.*, fuses wq_a|wkv and w1|w3, stacks routed experts,
    reinterprets E8M0/I8 as uint8 for fp4 experts, splits for --tp. Files are written atomically; a
    rerun with the same options resumes; a finished OUT is never overwritten without --force.

    SRC may be a hub repo id: headers are read and the plan made first, then only the shards the
    plan needs are downloaded into the HF cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply).

    Examples:

    \b
      ckpt-tool convert ./DeepSeek-V4-Flash ./v4-tp8 --tp 8
      ckpt-tool convert ./DeepSeek-V4-Flash ./v4-mtp --only mtp --dry-run
      ckpt-tool convert deepseek-ai/DeepSeek-V4-Flash ./v4-mtp --only mtp
      ckpt-tool convert ./DeepSeek-V4-Flash /shared/v4 --tp 8 --shard-index 2 --shard-count 4   # then --finalize
    """
    from .convert import convert as run_convert
    from .plan import Options
    from .report import ConvertProgress, plan_json, print_json, render_plan, render_convert_summary

    if moe_parallel not in ("tp", "ep"):
        raise typer.BadParameter("must be 'tp' or 'ep'", param_hint="--moe-parallel")
    if only not in (None, "model", "mtp"):
        raise typer.BadParameter("must be 'model' or 'mtp'", param_hint="--only")
    from .target import resolve_target

    try:
        chosen = resolve_target(target)
    except CkptToolError as exc:
        _fail_user(exc, json_out)
    opts = Options(tp=tp, moe_parallel=moe_parallel, only=only, max_shard_size=_parse_size(max_shard_size), profile=chosen.profile)
    if shard_index >= shard_count:
        raise typer.BadParameter(f"{shard_index} is not below --shard-count {shard_count}", param_hint="--shard-index")
    if finalize and dry_run:
        raise typer.BadParameter("--finalize writes the manifest; it cannot be combined with --dry-run", param_hint="--finalize")
    try:
        from .convert import parse_ranks, select_files
        from .hub import open_hub_source, parse_hub_ref

        rank_list = parse_ranks(ranks) if ranks is not None else None
        ref = parse_hub_ref(src)
        source = open_hub_source(ref, opts, download=not dry_run) if ref is not None else Path(src)
        if dry_run:
            from dataclasses import replace

            from .plan import plan_conversion
            from .source import open_checkpoint

            ckpt = open_checkpoint(source) if isinstance(source, Path) else source
            plan = plan_conversion(ckpt.require_config(), ckpt.tensors, opts)
            if rank_list is not None or shard_count > 1:
                plan = replace(plan, files=tuple(select_files(plan, rank_list, shard_index, shard_count)))
            if json_out:
                print_json({**plan_json(plan), "target_note": chosen.note})
            else:
                render_plan(plan)
                _target_note(chosen.note)
            raise typer.Exit(0)
        with ConvertProgress(enabled=not json_out) as prog:
            try:
                result = run_convert(
                    source, out, opts, force=force, workers=workers, progress=prog.advance, on_plan=prog.start,
                    ranks=rank_list, shard=(shard_index, shard_count), finalize=finalize,
                )
            except OSError as exc:  # one the library did not word, e.g. OUT's parent is a file: still one line
                raise _os_error(exc, out) from exc
    except typer.Exit:
        raise
    except CkptToolError as exc:
        _fail_user(exc, json_out)
    if json_out:
        doc = render_convert_summary(result, as_json=True)
        doc.update(partial=result.partial, finalized=result.finalized, target_note=chosen.note)
        print_json(doc)
        return
    if finalize:
        from .report import human_bytes

        typer.echo(f"finalized {out}: {len(result.skipped)} file(s) checked, {human_bytes(result.plan.total_bytes)}; manifest complete")
    else:
        render_convert_summary(result)
        if result.partial:
            typer.echo(
                f"shard {shard_index} of {shard_count} done (no manifest yet): run the same command with --finalize "
                "once every shard has finished"
            )
    _target_note(chosen.note)


def _target_note(note: str | None) -> None:
    """--target auto's word on what it chose, after the result (an error stays one line)."""
    if note:
        from .report import note_line

        note_line(note)


@app.command()
def verify(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="A folder written by ckpt-tool convert.")],
    source: Annotated[str, typer.Option("--source", help="The original checkpoint OUT was converted from (folder, or hub repo id org/name[@rev]).")],
    level: Annotated[str, typer.Option("--level", help="structure | values | numeric (each includes the ones before).")] = "numeric",
    kernels: Annotated[str, typer.Option("--kernels", help="GEMM backend for the converted side: auto | triton | torch.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto | cpu | cuda.")] = "auto",
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Tokens in the numeric forward.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the numeric inputs.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON document on stdout.")] = False,
    junit: Annotated[Path | None, typer.Option("--junit", help="Also write a JUnit XML report (one testcase per check).")] = None,
    github: Annotated[bool, typer.Option("--github", help="Print GitHub Actions ::error annotations for failures.")] = False,
) -> None:
    """Prove a converted checkpoint right: structure, exact values, then a numeric forward of every MTP layer.

    structure: files, names, dtypes, shapes and rank sets exactly as the rules give; index.json;
    manifest checksums. values: every output tensor re-derived from the source bytes and compared
    exactly. numeric: each MTP layer run from the source (dequantized torch) and from the converted
    ranks (fp8-block / MXFP4 kernels, ranks combined as a TP engine does), compared within the
    tolerances printed in the report. Exit 0 when every check passes, 1 when one fails, 2 on usage errors.

    Examples:

    \b
      ckpt-tool verify ./v4-tp8 --source ./DeepSeek-V4-Flash
      ckpt-tool verify ./v4-tp8 --source ./DeepSeek-V4-Flash --level values --json --junit verify.xml
    """
    from .report import print_json, render_verify, write_junit, github_annotations
    from .verify import LEVELS, verify as run_verify

    if level not in LEVELS:
        raise typer.BadParameter(f"must be one of {', '.join(LEVELS)}", param_hint="--level")
    if kernels not in ("auto", "triton", "torch"):
        raise typer.BadParameter("must be auto, triton or torch", param_hint="--kernels")
    if device not in ("auto", "cpu", "cuda"):
        raise typer.BadParameter("must be auto, cpu or cuda", param_hint="--device")
    try:
        from .hub import parse_hub_ref, snapshot_for_verify

        ref = parse_hub_ref(source)
        src_path = snapshot_for_verify(ref, out) if ref is not None else Path(source)
        report = run_verify(out, src_path, level=level, kernels=kernels, device=device, tokens=tokens, seed=seed)
    except CkptToolError as exc:
        _fail_user(exc, json_out)
    if junit is not None:
        write_junit(report, junit)
    if github:
        github_annotations(report, json_on_stdout=json_out)
    if json_out:
        print_json(report.to_json())
    else:
        render_verify(report)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def unconvert(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="A folder written by ckpt-tool convert.")],
    dest: Annotated[Path, typer.Argument(metavar="DEST", help="Folder for the rebuilt original checkpoint (created).")],
    source: Annotated[Path | None, typer.Option("--source", help="Only for OUTs without ckpt-tool-source.json: the checkpoint OUT was converted from (its headers are read).")] = None,
    partial: Annotated[bool, typer.Option("--partial", help="Write the source tensors OUT holds even if some are not in it (--only, --ranks, dropped).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty DEST.")] = False,
    no_checksums: Annotated[bool, typer.Option("--no-checksums", help="Skip re-hashing OUT's files against the manifest.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON summary on stdout.")] = False,
) -> None:
    """Rebuild the original DeepSeek V4 checkpoint from a converted OUT (DeepSeek names, TP ranks merged).

    Re-plans the conversion from the manifest, the recorded source headers and config.json, then runs
    it backwards: ranks concatenated along their split dims, experts unstacked, fused tensors unfused,
    uint8 views and float32 E8M0 scales back to their stored dtypes. Every lossless conversion round
    trips byte for byte; a source file whose tensors all come back is identical to the original file.

    Examples:

    \b
      ckpt-tool unconvert ./v4-tp8 ./DeepSeek-V4-Flash-again
      ckpt-tool unconvert ./v4-mtp ./mtp-only --partial
    """
    from .report import human_bytes, print_json
    from .unconvert import unconvert as run_unconvert

    try:
        result = run_unconvert(out, dest, source=source, partial=partial, force=force, check_checksums=not no_checksums)
    except CkptToolError as exc:
        _fail_user(exc, json_out)
    if json_out:
        print_json({
            "ok": True, "dest": str(dest), "files": result.files, "identical_files": result.identical_files,
            "tensors": result.tensors, "bytes": result.bytes, "missing": sorted(result.missing),
        })
    else:
        typer.echo(
            f"unconverted {result.tensors} tensors ({human_bytes(result.bytes)}) into {dest}: {len(result.files)} file(s), "
            f"{len(result.identical_files)} identical to the original files"
            + (f"; {len(result.missing)} source tensor(s) not in OUT" if result.missing else "")
        )


@app.command()
def profiles(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """List the target profiles (engine parameter layouts) convert can write, and what --target auto picks.

    Each profile names the vLLM releases whose own loader it is verified against (the engine test
    builds vLLM's model classes on CPU and runs its sharded_state loader on converted output).
    """
    from .report import print_json
    from .rules import PROFILES
    from .target import installed_vllm, resolve_target

    installed = installed_vllm()
    try:
        auto: str | None = resolve_target("auto").profile
        auto_error = None
    except CkptToolError as exc:
        auto, auto_error = None, str(exc)
    docs = [
        {
            "name": p.name,
            "description": p.description,
            "vllm_verified": list(p.verified),
            "vllm_covers": [f"{c}.x" for c in p.covers],
            "verified_by": p.verified_by,
            "notes": list(p.notes),
        }
        for p in PROFILES.values()
    ]
    if json_out:
        print_json({"profiles": docs, "installed_vllm": installed, "auto": auto, "auto_error": auto_error})
        return
    for d in docs:
        verified = f"verified against vLLM {', '.join(d['vllm_verified'])}" if d["vllm_verified"] else d["verified_by"]
        typer.echo(f"{d['name']:12s} {verified}\n{'':12s} {d['description']}")
    typer.echo(f"--target auto: {auto or auto_error} (installed vLLM: {installed or 'none'})")


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
