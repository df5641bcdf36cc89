"""The ``ckpt-tool`` command line: a thin layer over the library. Errors become one line and an exit code.

Exit codes (every command): 0 ok, 1 a check failed or the input is invalid, 2 usage error, 128 + the signal
when stopped (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP; :func:`ckpt_tool.cli.common.stop_signals`). A closed
stdout (``ckpt-tool inspect SRC | head -1``) is not an error. ``--debug`` and ``-q/--quiet`` are accepted
anywhere on the command line. ``--json`` (or ``--format json``) prints one
JSON document per command, of one shape on success and failure (``schema_version``, ``command``,
``ok``, ``error``, then the command's fields; see jsondoc.JSON_FIELDS).
"""

from __future__ import annotations

import errno
import functools
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

import typer

from ckpt_tool import __version__
from ckpt_tool.checkpoint.expert_format import EXPERT_FORMATS
from ckpt_tool.cli.common import (
    FORMATS,
    apply_global_flags,
    interrupted,
    print_plan,
    report_error,
    run_inspect,
    warning_line,
)
from ckpt_tool.cli.jsondoc import json_document, print_json
from ckpt_tool.errors import CkptToolError, OutputError
from ckpt_tool.mapping import target as engine_target
from ckpt_tool.mapping.environment import auto_target, environment_facts
from ckpt_tool.mapping.profiles import DRAFT_KINDS, PROFILES, known_names, series_of
from ckpt_tool.mapping.request import convert_request
from ckpt_tool.mapping.target import unverified_warning

app = typer.Typer(
    name="ckpt-tool",
    help="Convert, inspect and verify DeepSeek V4 safetensors checkpoints for vLLM (target model + MTP draft).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _plain_argument_help() -> None:
    """typer 0.29 shows a required argument as ``{SRC}`` in usage and ``SRC <str>`` in help; plain ``SRC`` reads
    as every other CLI does. (Options carry explicit metavars; choices show as ``<a|b>``.)"""
    arg = getattr(typer.core, "TyperArgument", None)
    if arg is None:  # pragma: no cover - another typer: keep its rendering
        return
    if hasattr(arg, "_usage_display_name"):
        arg._usage_display_name = lambda self: self.display_name_raw if self.required else f"[{self.display_name_raw}]"
    if hasattr(arg, "display_type_rich"):
        arg.display_type_rich = lambda self, ctx: None


_plain_argument_help()


def _target_choices() -> type[Enum]:
    return Enum("TargetChoice", {name: name for name in ("auto", *known_names())}, type=str)  # type: ignore[return-value]


TargetChoice = _target_choices()
TARGET_AUTO = TargetChoice("auto")
Format = Literal[FORMATS]  # type: ignore[valid-type]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckpt-tool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks and debug logging (accepted anywhere).")
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "-q", "--quiet", help="Print only errors and warnings: no progress, notes or summaries (accepted anywhere)."
        ),
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Convert, inspect and verify DeepSeek V4 safetensors checkpoints for vLLM."""
    apply_global_flags(debug, quiet)


def _guarded(command: str):
    """Wrap a command: a stop signal says what to do (exit 128 + the signal); a closed stdout ends quietly (exit 0)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (KeyboardInterrupt, BrokenPipeError) as exc:
                raise typer.Exit(interrupted(command, exc)) from None

        return run

    return wrap


def _wants_json(json_out: bool, fmt: str | None) -> bool:
    return json_out or fmt == "json"


def _fail_user(exc: CkptToolError, command: str | None, json_out: bool, body: dict | None = None) -> None:
    """A user-facing error: the command's JSON document (ok false) when --json owns stdout, one line, the exit code."""
    if json_out and command is not None:
        print_json(json_document(command, body, error=str(exc)))
    _fail(exc, exc.exit_code)


def _fail(exc: BaseException, code: int = 1) -> None:
    report_error(exc)
    raise typer.Exit(code)


def _os_error(exc: OSError, out: Path) -> CkptToolError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"{exc.filename or out}: no space left on device; free space and rerun to resume")
    return OutputError(
        f"{exc.filename or out}: {exc.strerror or exc}; check that SRC is readable and OUT is a folder you can create "
        "and write"
    )


# Options several commands share
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (same as --format json).")]
FormatOpt = Annotated[Format | None, typer.Option("--format", help="Output format: table (default) or json.")]
RevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", metavar="REV", help="Hub source: branch, tag or commit (overrides org/name@REV)."),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", metavar="TOKEN", help="Hub source: access token (default: HF_TOKEN or the stored login)."),
]
CacheDirOpt = Annotated[
    str | None,
    typer.Option("--cache-dir", metavar="DIR", help="Hub source: cache folder (default: HF_HUB_CACHE / HF_HOME)."),
]
StreamOpt = Annotated[
    bool,
    typer.Option(
        "--stream",
        help="Hub source: read the shards' bytes with HTTP range requests instead of downloading them (only OUT "
        "and the small files land on disk; see docs/hub.md).",
    ),
]


@app.command()
@_guarded("inspect")
def inspect(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="Checkpoint folder, index .json, one .safetensors file, or hub repo id (org/name[@rev], hf://org/name).",
        ),
    ],
    json_out: JsonOpt = False,
    fmt: FormatOpt = None,
    revision: RevisionOpt = None,
    token: TokenOpt = None,
    cache_dir: CacheDirOpt = None,
) -> None:
    """Header-only look at a checkpoint: files, tensors, dtypes, bytes, quantization, layers, MTP.

    Reads only headers (no tensor bytes). Exits 1 if the checkpoint lacks a tensor the engine needs
    (a main layer, an expert, an MTP layer: the verdict convert gives), the config and the stored shapes
    or dtypes disagree, or a file is invalid.

    Examples:

    \b
      ckpt-tool inspect ./DeepSeek-V4-Flash
      ckpt-tool inspect ./DeepSeek-V4-Flash/model.safetensors.index.json --json
      ckpt-tool inspect deepseek-ai/DeepSeek-V4-Flash --revision main
    """
    raise typer.Exit(
        run_inspect(src, as_json=_wants_json(json_out, fmt), revision=revision, token=token, cache_dir=cache_dir)
    )


def _parse_size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "K": 1024,
        "KB": 1000,
        "KIB": 1024,
        "M": 1024**2,
        "MB": 1000**2,
        "MIB": 1024**2,
        "G": 1024**3,
        "GB": 1000**3,
        "GIB": 1024**3,
        "T": 1024**4,
        "TB": 1000**4,
        "TIB": 1024**4,
    }
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size like 5GiB, 500MB or 1048576") from None
    if unit not in units or value <= 0:
        raise typer.BadParameter(f"{text!r} is not a size like 5GiB, 500MB or 1048576")
    return int(value * units[unit])


@app.command()
@_guarded("convert")
def convert(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC",
            help="Original DeepSeek V4 checkpoint: folder, index .json, .safetensors, or hub repo id (org/name[@rev], hf://org/name).",
        ),
    ],
    out: Annotated[
        Path,
        typer.Argument(
            metavar="OUT", help="Output folder: new, empty, or an earlier OUT of ckpt-tool. Never inside SRC."
        ),
    ],
    tp: Annotated[
        int,
        typer.Option(
            "--tp", min=1, metavar="T", help="Tensor-parallel degree: one set of files per rank (serve with the same)."
        ),
    ] = 1,
    moe_parallel: Annotated[
        Literal["tp", "ep"],
        typer.Option(
            "--moe-parallel",
            help="Routed experts: tp splits each expert's intermediate dim; ep gives each rank whole experts (serve "
            "with --enable-expert-parallel).",
        ),
    ] = "tp",
    nvfp4_input_scales: Annotated[
        Literal["global", "local"],
        typer.Option(
            "--nvfp4-input-scales",
            help="NVFP4 experts (NVIDIA's NVFP4 exports) under --moe-parallel ep: global (default) writes every "
            "expert's input scales on every rank, as vLLM's FlashInfer NVFP4 MoE backends hold them (what vLLM picks "
            "on Blackwell); local writes each rank's own, for the other backends (--moe-backend cutlass, marlin). "
            "See docs/nvfp4.md.",
        ),
    ] = "global",
    only: Annotated[
        Literal["model", "mtp"] | None,
        typer.Option(
            "--only",
            help="Write only the target model, or only the draft built from the source's mtp.* tensors (OUT/mtp "
            "for a classic MTP draft, OUT/dspark for a DSpark one).",
        ),
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", metavar="SIZE", help="Largest output part file, e.g. 5GiB, 500MB.")
    ] = "5GiB",
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            metavar="K",
            help="Output files written (and hashed) in parallel (default: one per CPU core, at most 8, while that many "
            "are pending); each holds up to ~34 MiB of buffers, all together at most ~256 MiB.",
        ),
    ] = None,
    target: Annotated[
        TargetChoice,
        typer.Option(
            "--target",
            help="Engine profile: auto (the installed vLLM's; the newest for no vLLM or a newer one than any verified, "
            "with a warning) or one of 'ckpt-tool profiles'.",
        ),
    ] = TARGET_AUTO,  # type: ignore[valid-type]
    vllm: Annotated[
        str | None,
        typer.Option(
            "--vllm",
            metavar="VERSION",
            help="The vLLM release OUT will be served with (e.g. 0.33.1; default: the installed one): --target auto "
            "picks its profile, and a draft that release series builds differently from the others the profile "
            "covers (DeepSeek V4.1's DSpark) is written for it. Without it and without an installed vLLM: the newest "
            "series the profile covers.",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite a finished (or differently-started) OUT of ckpt-tool.")
    ] = False,
    json_out: JsonOpt = False,
    fmt: FormatOpt = None,
    ranks: Annotated[
        str | None,
        typer.Option(
            "--ranks", metavar="RANKS", help="Write only these TP ranks, e.g. 0,3-5 (the manifest records them)."
        ),
    ] = None,
    shard_index: Annotated[
        int,
        typer.Option("--shard-index", min=0, metavar="K", help="Scale-out: this machine's part K of --shard-count M."),
    ] = 0,
    shard_count: Annotated[
        int,
        typer.Option(
            "--shard-count",
            min=1,
            metavar="M",
            help="Scale-out: write only planned files i with i % M == K; no manifest until --finalize.",
        ),
    ] = 1,
    finalize: Annotated[
        bool,
        typer.Option(
            "--finalize",
            help="After all shards ran (same options): check every file against its checksum, write index, config and "
            "manifest.",
        ),
    ] = False,
    revision: RevisionOpt = None,
    token: TokenOpt = None,
    cache_dir: CacheDirOpt = None,
    stream: StreamOpt = False,
) -> None:
    """Convert an original DeepSeek V4 checkpoint into vLLM's runtime layout (target model + MTP draft).

    Checks first, from headers alone, that the checkpoint has every tensor the engine needs and that
    the plan works; then streams source byte ranges into per-rank files (never a whole shard or fused
    tensor in memory): mtp.{i}.* to model.layers.{N+i}.*, wq_a|wkv and w1|w3 fused, routed experts
    stacked, dtypes as the engine's parameters hold them, split for --tp. Files are written
    atomically; a rerun with the same options resumes; a finished OUT is never overwritten without
    --force, and a non-empty folder that is not an OUT of ckpt-tool is refused.

    SRC may be a hub repo id: headers are read and the plan made first, then only the shards the
    plan needs are downloaded into the HF cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply); with
    --stream no shard is downloaded: their bytes are read with HTTP range requests straight into OUT.

    Examples:

    \b
      ckpt-tool convert ./DeepSeek-V4-Flash ./v4-tp8 --tp 8
      ckpt-tool convert ./DeepSeek-V4-Flash ./v4-mtp --only mtp --dry-run
      ckpt-tool convert deepseek-ai/DeepSeek-V4-Flash ./v4-mtp --only mtp
      ckpt-tool convert hf://deepseek-ai/DeepSeek-V4-Flash ./v4-tp8 --tp 8 --stream
      ckpt-tool convert ./DeepSeek-V4-Flash /shared/v4 --tp 8 --shard-index 2 --shard-count 4   # then --finalize
    """
    as_json = _wants_json(json_out, fmt)
    if shard_index >= shard_count:
        raise typer.BadParameter(f"{shard_index} is not below --shard-count {shard_count}", param_hint="--shard-index")
    if finalize and dry_run:
        raise typer.BadParameter(
            "--finalize writes the manifest; it cannot be combined with --dry-run", param_hint="--finalize"
        )
    if vllm is not None and series_of(vllm) is None:
        raise typer.BadParameter(f"{vllm!r} is not a vLLM version (e.g. 0.34 or 0.34.1)", param_hint="--vllm")
    size = _parse_size(max_shard_size)
    try:
        request = convert_request(
            src,
            tp=tp,
            moe_parallel=moe_parallel,
            nvfp4_input_scales=nvfp4_input_scales,
            only=only,
            max_shard_size=size,
            target=target.value,
            vllm=vllm,
            ranks=ranks,
            shard=(shard_index, shard_count),
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            stream=stream,
            download=not dry_run,
            warn=warning_line,  # before any work: on stderr in --json mode too
        )
        if dry_run:
            print_plan(request, as_json=as_json)
            return
        result = _run_convert(request, out, force=force, workers=workers, finalize=finalize, as_json=as_json)
    except CkptToolError as exc:
        _fail_user(exc, "convert", as_json, {"out": str(out), "dry_run": dry_run})
    _render_convert(result, request, finalize=finalize, as_json=as_json)


def _run_convert(request, out: Path, *, force: bool, workers: int | None, finalize: bool, as_json: bool):
    """The conversion of ``request`` into ``out``, its progress on stderr."""
    from ckpt_tool.cli.render import ConvertProgress  # rich: loaded by the commands that draw with it
    from ckpt_tool.output.convert import convert as run_convert  # the writer: loaded by the command that writes

    with ConvertProgress(enabled=not as_json, fetched=request.fetched) as prog:
        try:
            return run_convert(
                request.source,
                out,
                request.opts,
                force=force,
                workers=workers,
                progress=prog.advance,
                on_plan=prog.start,
                ranks=request.ranks,
                shard=request.shard,
                finalize=finalize,
            )
        except OSError as exc:  # one the library did not word, e.g. OUT's parent is a file: still one line
            raise _os_error(exc, out) from exc


def _render_convert(result, request, *, finalize: bool, as_json: bool) -> None:
    """convert's summary: one JSON document, or lines (a finalize's, a shard's, a whole run's) then the target note."""
    from ckpt_tool.cli.render import human_bytes, render_convert_summary, summary_line  # rich: see _run_convert

    chosen = request.target
    if as_json:
        doc = render_convert_summary(result, as_json=True)
        doc.update(
            partial=result.partial,
            finalized=result.finalized,
            target_note=chosen.note,
            target_warning=chosen.warning,
            dry_run=False,
        )
        print_json(json_document("convert", doc))
        return
    if finalize:
        summary_line(
            f"finalized {result.out}: {len(result.skipped)} file(s) checked, {human_bytes(result.plan.total_bytes)}; "
            "manifest complete"
        )
    else:
        render_convert_summary(result)
        if result.partial:
            shard_index, shard_count = request.shard
            summary_line(
                f"shard {shard_index} of {shard_count} done (no manifest yet): run the same command with --finalize "
                "once every shard has finished"
            )
    _target_note(chosen.note)


def _target_note(note: str | None) -> None:
    """--target auto's word on what it chose, after the result (an error stays one line)."""
    if note:
        from ckpt_tool.cli.render import note_line  # rich: see _run_convert

        note_line(note)


@app.command()
@_guarded("verify")
def verify(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="A folder written by ckpt-tool convert.")],
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            metavar="SRC",
            help="The original checkpoint OUT was converted from (folder, or hub repo id org/name[@rev]); needed by "
            "every level.",
        ),
    ] = None,
    level: Annotated[
        Literal["structure", "values", "numeric"],
        typer.Option("--level", help="How far to go; each level includes the ones before."),
    ] = "numeric",
    kernels: Annotated[
        Literal["auto", "triton", "torch"], typer.Option("--kernels", help="GEMM backend for the converted side.")
    ] = "auto",
    device: Annotated[
        Literal["auto", "cpu", "cuda"], typer.Option("--device", help="Where the numeric check runs.")
    ] = "auto",
    tokens: Annotated[int, typer.Option("--tokens", min=1, metavar="N", help="Tokens in the numeric forward.")] = 16,
    seed: Annotated[int, typer.Option("--seed", metavar="S", help="Seed of the numeric inputs.")] = 0,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            metavar="K",
            help="Output files the values level compares (and hashes) at once (default one per CPU, at most 4; the "
            "ranks of one part are always compared together, in lockstep), and tiles the numeric level computes at "
            "once (default one per CPU; as many threads again read ahead).",
        ),
    ] = None,
    json_out: JsonOpt = False,
    fmt: FormatOpt = None,
    junit: Annotated[
        Path | None,
        typer.Option("--junit", metavar="FILE", help="Also write a JUnit XML report (one testcase per check)."),
    ] = None,
    github: Annotated[
        bool,
        typer.Option(
            "--github",
            help="GitHub Actions: ::error annotations for failures, and a Markdown summary to $GITHUB_STEP_SUMMARY.",
        ),
    ] = False,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine",
            help="Also let vLLM judge OUT: its own model classes built for OUT's config and tp (no GPU), each rank's "
            "files held to its sharded_state loader's rules.",
        ),
    ] = False,
    engine_python: Annotated[
        str | None,
        typer.Option(
            "--engine-python",
            metavar="PY",
            help="--engine: the interpreter of the environment you serve with (default: this one, if it has vLLM).",
        ),
    ] = None,
    revision: RevisionOpt = None,
    token: TokenOpt = None,
    cache_dir: CacheDirOpt = None,
    stream: StreamOpt = False,
) -> None:
    """Prove a converted checkpoint right: structure, exact values, then numbers; --engine: as vLLM loads it.

    structure: files, names, dtypes, shapes and rank sets exactly as the rules give, each rank against
    the target engine's parameter table; index.json; manifest checksums; serving files. values:
    every output tensor re-derived from the source bytes and compared exactly. numeric: each MTP layer
    run from the source (dequantized torch) and from the converted ranks (fp8-block / MXFP4 kernels,
    ranks combined as a TP engine does), compared within the tolerances printed in the report.
    engine (--engine, with or without --source): for every rank of OUT/model and OUT/mtp, the vLLM of
    --engine-python builds its own model classes on the meta device for OUT's config, tp and expert
    parallelism, and each rank's files must be exactly what its sharded_state loader takes (keys,
    dtypes, shapes; attn_sink's documented slice); small OUTs are also loaded by that loader.
    Exit 0 when no check fails (a skipped check says why), 1 when one fails or the level asked for cannot
    run in full (numeric on an OUT of some --ranks), 2 on usage errors or when no vLLM could judge.

    Examples:

    \b
      ckpt-tool verify ./v4-tp8 --source ./DeepSeek-V4-Flash
      ckpt-tool verify ./v4-tp8 --source ./DeepSeek-V4-Flash --level values --json --junit verify.xml
      ckpt-tool verify ./v4-tp8 --engine --engine-python /opt/serving-venv/bin/python
    """
    # rich and the levels (numpy, the engine check): loaded by the command that uses them, not at every start-up
    from ckpt_tool.cli.render import StageProgress, github_annotations, github_summary, render_verify, write_junit
    from ckpt_tool.verify.levels import verify_out

    as_json = _wants_json(json_out, fmt)
    try:
        with StageProgress(enabled=not as_json) as prog:
            report = verify_out(
                out,
                source,
                level=level,
                kernels=kernels,
                device=device,
                tokens=tokens,
                seed=seed,
                workers=workers,
                engine=engine,
                engine_python=engine_python,
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                stream=stream,
                progress=prog,
            )
    except CkptToolError as exc:
        _fail_user(
            exc, "verify", as_json, {"out": str(out), "source": source, "level": "engine" if source is None else level}
        )
    if warning := unverified_warning(report.target):
        warning_line(warning)  # on stderr, --json too (its document carries target.verified)
    if junit is not None:
        write_junit(report, junit)
    if github:
        github_annotations(report, json_on_stdout=as_json)
        github_summary(report)
    if as_json:
        doc = report.to_json()
        print_json(json_document("verify", doc, error=None if report.ok else report.failures[0].message))
    else:
        render_verify(report)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
@_guarded("unconvert")
def unconvert(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="A folder written by ckpt-tool convert.")],
    dest: Annotated[Path, typer.Argument(metavar="DEST", help="Folder for the rebuilt original checkpoint (created).")],
    source: Annotated[
        Path | None,
        typer.Option(
            "--source",
            metavar="SRC",
            help="Only for OUTs without ckpt-tool-source.json: the checkpoint OUT was converted from (its headers are "
            "read).",
        ),
    ] = None,
    partial: Annotated[
        bool,
        typer.Option(
            "--partial",
            help="Write the source tensors OUT holds even if some are not in it (--only, --ranks, dropped).",
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty DEST.")] = False,
    no_checksums: Annotated[
        bool, typer.Option("--no-checksums", help="Skip re-hashing OUT's files against the manifest.")
    ] = False,
    json_out: JsonOpt = False,
    fmt: FormatOpt = None,
) -> None:
    """Rebuild the original DeepSeek V4 checkpoint from a converted OUT (DeepSeek names, TP ranks merged).

    Re-plans the conversion from the manifest, the recorded source headers and config.json, then runs
    it backwards: ranks concatenated along their split dims, experts unstacked, fused tensors unfused,
    uint8 views and converted dtypes back to their stored ones. Every lossless conversion round
    trips byte for byte; a source file whose tensors all come back is identical to the original file.

    Examples:

    \b
      ckpt-tool unconvert ./v4-tp8 ./DeepSeek-V4-Flash-again
      ckpt-tool unconvert ./v4-mtp ./mtp-only --partial
    """
    # rich and the rebuilder (numpy): loaded by the command that uses them, not at every start-up
    from ckpt_tool.cli.render import StageProgress, human_bytes, summary_line
    from ckpt_tool.output.unconvert import unconvert as run_unconvert

    as_json = _wants_json(json_out, fmt)
    try:
        with StageProgress(enabled=not as_json) as prog:
            result = run_unconvert(
                out, dest, source=source, partial=partial, force=force, check_checksums=not no_checksums, progress=prog
            )
    except CkptToolError as exc:
        _fail_user(exc, "unconvert", as_json, {"dest": str(dest)})
    if as_json:
        print_json(
            json_document(
                "unconvert",
                {
                    "dest": str(dest),
                    "files": result.files,
                    "identical_files": result.identical_files,
                    "tensors": result.tensors,
                    "bytes": result.bytes,
                    "missing": sorted(result.missing),
                },
            )
        )
    else:
        summary_line(
            f"unconverted {result.tensors} tensors ({human_bytes(result.bytes)}) into {dest}: {len(result.files)} "
            "file(s), "
            f"{len(result.identical_files)} identical to the original files"
            + (f"; {len(result.missing)} source tensor(s) not in OUT" if result.missing else "")
        )


@app.command()
@_guarded("profiles")
def profiles(json_out: JsonOpt = False, fmt: FormatOpt = None) -> None:
    """List the target profiles (engine parameter layouts) convert can write, and what --target auto picks.

    Each profile names the vLLM releases whose own loader it is verified against (the engine test
    builds each release's model classes on CPU and runs its sharded_state loader on converted output),
    the vLLM series --target auto picks it for, and its earlier names (aliases) that still work.
    A vLLM newer than every verified release gets the newest profile with a warning; check such an
    OUT with `ckpt-tool verify OUT --engine`.
    """
    installed = engine_target.installed_vllm()  # looked up when called: tests stand in for the installed vLLM
    auto = auto_target()
    docs = [
        {
            "name": p.name,
            "aliases": list(p.aliases),
            "description": p.description,
            "vllm_verified": list(p.verified),
            "vllm_covers": [f"{c}.x" for c in p.covers],
            "verified_by": p.verified_by,
            "notes": list(p.notes),
            "drafts": [draft_doc(DRAFT_KINDS[k]) for k in p.drafts],
            "expert_formats": [expert_format_doc(EXPERT_FORMATS[f]) for f in p.expert_formats],
        }
        for p in PROFILES.values()
    ]
    if _wants_json(json_out, fmt):
        print_json(json_document("profiles", {"profiles": docs, "installed_vllm": installed, **auto}))
        return
    width = max(len(d["name"]) for d in docs) + 2
    for d in docs:
        verified = f"verified against vLLM {', '.join(d['vllm_verified'])}" if d["vllm_verified"] else d["verified_by"]
        aliases = f" (also: {', '.join(d['aliases'])})" if d["aliases"] else ""
        typer.echo(f"{d['name']:{width}s}{verified}{aliases}\n{'':{width}s}{d['description']}")
        drafts = "; ".join(
            f"{x['kind']} ({x['architecture']}, method {x['method']}, OUT/{x['folder']})" for x in d["drafts"]
        )
        typer.echo(f"{'':{width}s}drafts: {drafts}")
        formats = "; ".join(f"{x['name']} ({x['vllm_method']})" for x in d["expert_formats"])
        typer.echo(f"{'':{width}s}routed experts: {formats}")
    picked = auto["auto"] or auto["auto_error"]
    if auto["auto"] and auto["auto_verified"] is False:
        picked += f" (NOT verified for vLLM {installed}: check OUT with `ckpt-tool verify OUT --engine`)"
    typer.echo(f"--target auto: {picked} (installed vLLM: {installed or 'none'})")


@app.command()
@_guarded("env")
def env(json_out: JsonOpt = False, fmt: FormatOpt = None) -> None:
    """What to paste into a bug report: versions of the tool and its stack, the profile --target auto
    picks (and whether it is verified for the installed vLLM), the HF cache in use, CUDA and Triton's
    interpreter setting."""
    doc = environment_facts()
    if _wants_json(json_out, fmt):
        print_json(json_document("env", doc))
        return
    width = max(len(k) for k in doc)
    for k, v in doc.items():
        typer.echo(f"{k:{width}s}  {v if v is not None else '-'}")


def draft_doc(kind) -> dict:
    """One draft kind (``mapping.profiles.DraftKind``) for ``profiles``."""
    return {"kind": kind.name, "architecture": kind.architecture, "method": kind.method, "folder": kind.component}


def expert_format_doc(fmt) -> dict:
    """One format of routed experts (``checkpoint.expert_format.ExpertFormat``) for ``profiles``."""
    return {
        "name": fmt.name,
        "vllm_method": fmt.vllm_method,
        "description": fmt.description,
        "source_tensors": [p.suffix for p in fmt.parts],
        "parameters": [f"w13_{p.name}" for p in fmt.params] + [f"w2_{p.name}" for p in fmt.params],
    }
