"""Rendering for people (rich, on stderr/stdout); the JSON documents are in jsondoc. Only the CLI imports this."""

from __future__ import annotations

import os
import resource
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ckpt_tool.checkpoint.summary import InspectReport
from ckpt_tool.cli.streams import drop_stdout
from ckpt_tool.mapping.profiles.draft_kind import draft_kind_of
from ckpt_tool.mapping.target import unverified_warning
from ckpt_tool.verify.verdict import FAILED, SKIPPED


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``| head``): not an error. rich's default exits 1."""
        self.quiet = True
        drop_stdout()
        raise SystemExit(0)


out = _Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
_quiet = {"on": False}


def set_quiet(on: bool) -> None:
    """-q: summaries, notes and progress stay silent; errors, warnings and JSON are still printed."""
    _quiet["on"] = on


def summary_line(message: str) -> None:
    """A human result line on stdout (silent with -q)."""
    if not _quiet["on"]:
        out.print(message, highlight=False, markup=False)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def error_line(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)


def warning_line(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


def note_line(message: str) -> None:
    if not _quiet["on"]:
        err.print(f"[cyan]note:[/] {escape(message)}", highlight=False)


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "-"
    parts, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def render_inspect(r: InspectReport) -> None:
    if _quiet["on"]:
        for p in r.problems:
            error_line(p)
        return
    files = Table(title=f"{escape(r.source)}: {len(r.files)} file(s)", title_justify="left")
    files.add_column("file")
    files.add_column("tensors", justify="right")
    files.add_column("bytes", justify="right")
    for f in r.files:
        files.add_row(escape(f.file), str(f.tensors), human_bytes(f.bytes))
    files.add_row("[bold]total[/]", f"[bold]{r.tensor_count}[/]", f"[bold]{human_bytes(r.total_bytes)}[/]")
    out.print(files)

    dt = Table(title="dtypes", title_justify="left")
    dt.add_column("dtype")
    dt.add_column("tensors", justify="right")
    dt.add_column("bytes", justify="right")
    for d, n in r.dtypes.items():
        dt.add_row(d, str(n), human_bytes(r.dtype_bytes[d]))
    out.print(dt)

    q = r.quant
    out.print(
        f"quantization: linears {q.linear_weight_dtype or '-'} with {q.linear_scale_dtype or '-'} block scales; "
        f"routed experts {q.expert_weight_dtype or '-'} ({q.expert_format or '-'}) with {q.expert_scale_dtype or '-'} "
        "scales; "
        f"config expert_dtype {q.config_expert_dtype or '-'}",
        highlight=False,
    )
    if r.model:
        m = r.model
        draft = f" and draft {m['draft']}" if m["draft"] else " (no MTP draft)"
        tower = ""
        if m.get("vision"):
            v = m["vision"]
            tower = (
                f"; vision tower {v['layers']} blocks, dim {v['dim']}, {v['heads']} heads (split over a tp that "
                "divides the heads, else replicated on every rank)"
            )
        out.print(
            f"model: {m['class']} — vLLM builds {m['architecture']}{draft}{tower}",
            highlight=False,
        )
        if m.get("engram"):
            out.print(engram_line(m["engram"]), highlight=False)
        if m.get("experts"):
            out.print(escape(experts_line(m["experts"])), highlight=False)
    out.print(f"main layers: {_ranges(r.main_layers)} ({len(r.main_layers)})", highlight=False)
    present = ", ".join(f"mtp.{i} ({n} tensors)" for i, n in r.mtp_tensor_counts.items()) or "none"
    kind = (r.model or {}).get("draft_kind")
    title = "DSpark stages" if kind and kind["method"] == "dspark" else "MTP layers"
    out.print(
        f"{title}: expected {', '.join(f'mtp.{i}' for i in r.mtp_expected) or 'none (num_nextn_predict_layers 0)'}; "
        f"present {present}; missing {', '.join(f'mtp.{i}' for i in r.mtp_missing) or 'none'}",
        highlight=False,
    )
    if kind:
        out.print(draft_line(kind), highlight=False)
    if r.ok:
        out.print("[green]verdict: ok[/]")
    else:
        for p in r.problems:
            error_line(p)


def experts_line(e: dict) -> str:
    """``routed experts: NVFP4 (ModelOptNvFp4FusedMoE) in layers.0-2; MXFP4 (Mxfp4MoEMethod) in mtp.0, left by
    quantization_config.ignore ...``."""
    parts = [
        f"{name.upper()} ({f['vllm_method']}) in {_block_ranges(f['blocks'])}" for name, f in e["formats"].items()
    ]
    line = "routed experts: " + "; ".join(parts)
    if e.get("moe_quant_algo"):
        ignore = ", ".join(e["ignore"] or []) or "none"
        left = _block_ranges(e["left_by_ignore"]) if e["left_by_ignore"] else "no block"
        line += (
            f" (NVIDIA's NVFP4 export: quantization_config.moe_quant_algo {e['moe_quant_algo']}, ignore [{ignore}] "
            f"leaves {left} in DeepSeek's format; NVFP4 experts run natively on Blackwell GPUs; under --moe-parallel "
            "ep convert writes every expert's input scales on each rank, as vLLM's FlashInfer NVFP4 backends hold "
            "them: --nvfp4-input-scales local for the others)"
        )
    return line


def _block_ranges(blocks: list[str]) -> str:
    """``layers.0-2, mtp.0`` from ``[layers.0, layers.1, layers.2, mtp.0]``."""
    by: dict[str, list[int]] = {}
    for b in blocks:
        kind, _, i = b.partition(".")
        by.setdefault(kind, []).append(int(i))
    return ", ".join(f"{kind}.{_ranges(ids)}" for kind, ids in by.items())


def engram_line(e: dict) -> str:
    """``Engram tables: layer 1: 9,186 rows (...), ...; split over tp by 16 hash heads (...); vLLM's Engram split
    accepts tp 1, 2, ...``."""
    sizes = ", ".join(f"layer {layer}: {rows:,} rows ({human_bytes(b)})" for layer, rows, b in
                      zip(e["layers"], e["rows"], e["bytes"]))  # fmt: skip
    per = "; ".join(
        f"tp {tp}: " + ", ".join(f"layer {layer} {'/'.join(f'{n:,}' for n in rows)}" for layer, rows in by.items())
        for tp, by in e["rows_per_rank"].items()
    )
    return (
        f"Engram tables: {sizes}; split over tp by {e['hash_heads']} hash heads (rows per rank {per}); vLLM's Engram "
        f"split accepts tp {', '.join(map(str, e['accepted_tp']))}"
    )


def draft_line(kind: dict) -> str:
    """``draft: DSpark (DSparkDraftModel), 3 stages; serve with --speculative-config '{...}' ...``."""
    n = kind["layers"]
    if kind["method"] == "dspark":
        what = f"DSpark ({kind['architecture']}), {n} stage{'s' if n != 1 else ''}"
        rule = (
            f" (num_speculative_tokens {kind['num_speculative_tokens']}: config.json's "
            f"{kind.get('num_speculative_tokens_key') or 'dspark_block_size'}, the block the draft proposes at once; "
            "vLLM 0.33.0 and 0.34.0 take the same number when none is given)"
        )
    else:
        what = f"classic MTP ({kind['architecture']}), {n} layer{'s' if n != 1 else ''}"
        rule = ""
    spec = (
        f'{{"method": "{kind["method"]}", "model": "OUT/{kind["folder"]}", '
        f'"num_speculative_tokens": {kind["num_speculative_tokens"]}}}'
    )
    note = f"; {kind['series_note']}" if kind.get("series_note") else ""
    return f"draft: {what}; serve with --speculative-config '{spec}'{rule}{note}"


def render_plan(plan) -> None:
    if _quiet["on"]:
        return
    if not out.is_terminal:  # piped: whole names, one tensor a line (tab-separated), nothing cut at 80 columns
        _print_plan_plain(plan)
        return
    t = Table(
        title=f"plan: tp={plan.options.tp} moe={plan.options.moe_parallel} only={plan.options.only or 'model+mtp'}",
        title_justify="left",
    )
    t.add_column("file")
    t.add_column("tensors", justify="right")
    t.add_column("bytes", justify="right")
    for f in plan.files:
        t.add_row(escape(f.relpath), str(len(f.tensors)), human_bytes(f.data_bytes))
    t.add_row("[bold]total[/]", f"[bold]{plan.tensor_count}[/]", f"[bold]{human_bytes(plan.total_bytes)}[/]")
    out.print(t)
    rank0 = [f for f in plan.files if f.rank == 0]
    names = Table(title="rank 0 tensors", title_justify="left")
    for col in ("output tensor", "dtype", "shape", "from"):
        names.add_column(col)
    for f in rank0:
        for x in f.tensors:
            src = ", ".join(x.sources[:2]) + (f" (+{len(x.sources) - 2})" if len(x.sources) > 2 else "")
            names.add_row(escape(x.name), x.dtype, str(list(x.shape)), escape(src))
    out.print(names)
    for a, r in plan.materialized.items():
        out.print(f"materialize {escape(a)} from {escape(r)}", highlight=False)
    for d in plan.deviations:
        out.print(f"deviation: {escape(d)}", highlight=False)
    for n in plan.notes:
        out.print(f"note: {escape(n)}", highlight=False)


def _print_plan_plain(plan) -> None:
    o = plan.options
    lines = [f"plan\ttp={o.tp}\tmoe={o.moe_parallel}\tonly={o.only or 'model+mtp'}\tprofile={o.profile}"]
    lines += [f"file\t{f.relpath}\t{len(f.tensors)}\t{f.data_bytes}" for f in plan.files]
    lines.append(f"total\t{plan.tensor_count}\t{plan.total_bytes}")
    for f in plan.files:
        if f.rank == 0:
            for x in f.tensors:
                lines.append(f"tensor\t{x.name}\t{x.dtype}\t{list(x.shape)}\t{','.join(x.sources)}")
    lines += [f"zero-pad\t{f.relpath}\t{t.name}\t{t.padding}" for f in plan.files for t in f.tensors if t.padding]
    lines += [f"materialize\t{a}\t{r}" for a, r in plan.materialized.items()]
    lines += [f"deviation\t{d}" for d in plan.deviations]
    lines += [f"note\t{n}" for n in plan.notes]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


class ConvertProgress:
    """A rich progress bar on stderr (bytes written, rate, ETA; for a streamed source also what was fetched and at
    what rate); silent when stderr is not a terminal, or with -q.

    ``fetched``: () -> (bytes fetched, range requests) so far (a streamed hub source's ``HubStream.fetched``).
    """

    def __init__(self, enabled: bool = True, fetched=None) -> None:
        self.enabled = enabled and err.is_terminal and not _quiet["on"]
        self.progress = None
        self.task = None
        self.fetched = fetched
        self._t0 = 0.0

    def __enter__(self) -> ConvertProgress:
        if self.enabled:
            from rich.progress import (  # start-up (~8 ms): only a drawn bar needs it, not inspect or --dry-run
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                TextColumn("converting"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[fetched]}"),
                console=err,
                transient=False,
            )
            self.progress.__enter__()
        return self

    def start(self, plan) -> None:
        if self.progress is not None:
            from ckpt_tool.output.writer import file_size  # numpy: inspect and --dry-run import this module

            total = sum(file_size(f) for f in plan.files)
            self.task = self.progress.add_task("convert", total=total, fetched="")
            self._t0 = time.monotonic()

    def advance(self, n: int) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task, n)
            if self.fetched is not None:
                self.progress.update(self.task, fetched=self.fetched_text())

    def fetched_text(self) -> str:
        got, requests = self.fetched()
        rate = got / max(time.monotonic() - self._t0, 1e-9)
        return f"fetched {human_bytes(got)} at {human_bytes(rate)}/s in {requests} request(s)"

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def render_convert_summary(result, as_json: bool = False):
    plan = result.plan
    rate = result.bytes_written / result.seconds / 1e6 if result.seconds else 0.0
    doc = {
        "ok": True,
        "out": str(result.out),
        "files_written": len(result.written),
        "files_skipped": len(result.skipped),
        "tensors": plan.tensor_count,
        "bytes": plan.total_bytes,
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
        "mb_per_s": round(rate, 1),
        "peak_rss_bytes": _peak_rss_bytes(),
        "materialized": plan.materialized,
        "deviations": list(plan.deviations),
        "notes": list(plan.notes),
        "warnings": sorted(set(result.warnings)),
    }
    if result.fetched is not None:  # a streamed hub source
        doc["fetched_bytes"], doc["fetch_requests"] = result.fetched
    doc["serve"] = serve_line(plan, result.out)
    for w in doc["warnings"]:
        warning_line(w)
    if as_json:
        return doc
    if _quiet["on"]:
        return doc
    out.print(
        f"[green]converted[/] {plan.tensor_count} tensors, {human_bytes(plan.total_bytes)} into "
        f"{escape(str(result.out))}: "
        f"{len(result.written)} file(s) written, {len(result.skipped)} resumed, {result.seconds:.2f} s, "
        f"{rate:.1f} MB/s, peak RSS {human_bytes(doc['peak_rss_bytes'])}"
        + (
            f"; fetched {human_bytes(result.fetched[0])} in {result.fetched[1]} range request(s)"
            if result.fetched is not None
            else ""
        ),
        highlight=False,
    )
    for d in plan.deviations:
        out.print(f"deviation: {escape(d)}", highlight=False)
    for n in plan.notes:
        out.print(f"note: {escape(n)}", highlight=False)
    if doc["serve"]:
        out.print(f"serve: {escape(doc['serve'])}", highlight=False)
    return doc


def serve_line(plan, out_dir) -> str | None:
    """The ``vllm serve`` line for what ``plan`` wrote into ``out_dir``: the target, with its draft when the plan wrote
    one (None for a draft alone, which serves beside a target converted elsewhere)."""
    components = {f.component for f in plan.files}
    if "model" not in components:
        return None
    kind = draft_kind_of(plan.config)
    opts = plan.options
    return kind.serve_command(
        plan.config, str(out_dir), opts.tp, opts.moe_parallel == "ep", kind.component in components
    )


def check_line(c) -> str:
    """``structure:mtp/x.safetensors`` + ``mtp/x.safetensors: sha256 differs`` reads ``structure: mtp/x...: sha256
    differs``."""
    kind, _, where = c.name.partition(":")
    if where and c.message.startswith(where):
        return f"{kind}: {c.message}"
    return f"{c.name}: {c.message}"


def render_verify(report) -> None:
    for c in report.failures:
        error_line(check_line(c))
    if _quiet["on"]:
        return
    for c in report.skipped:
        note_line(f"skipped {check_line(c)}")
    for n in report.numeric:
        out.print(
            f"numeric layer {n['layer']} (mtp.{n['mtp']}, {n['backend']} on {n['device']}, {n['tokens']} tokens): "
            f"logits cos {n['logits_cosine']:.8f} max_rel {n['logits_max_rel']:.2e}; "
            f"hidden cos {n['hidden_cosine']:.8f} max_rel {n['hidden_max_rel']:.2e}; "
            f"top1 {n['top1_agreement']:.3f} top5 {n['top5_agreement']:.3f}",
            highlight=False,
        )
    if report.coverage is not None:
        out.print(f"numeric coverage: {coverage_text(report.coverage)}", highlight=False)
    if report.engine:
        out.print(escape(engine_line(report.engine)), highlight=False)
        for load in report.engine.get("loads") or []:
            out.print(escape(engine_load_line(load)), highlight=False)
    verdict = "[green]PASS[/]" if report.ok else "[bold red]FAIL[/]"
    out.print(f"verify ({report.level}): {verdict} {report.counts()} ({len(report.checks)} checks)", highlight=False)


def engine_line(engine: dict) -> str:
    """verify --engine: which vLLM judged, with which interpreter, how many ranks (and how many it loaded for real)."""
    return (
        f"engine: vLLM {engine.get('vllm_version')} ({engine.get('python')}) judged {engine.get('ranks')} rank(s) at "
        "tp "
        f"{engine.get('tp')}{' with expert parallel' if engine.get('expert_parallel') else ''}, "
        f"{engine.get('real_loads')} loaded by its ShardedStateLoader, in {engine.get('seconds')} s"
    )


def engine_load_line(load: dict) -> str:
    """verify --engine: one rank's real load by vLLM's ShardedStateLoader, as the probe measured it."""
    disk = load.get("disk_read_bytes")
    return (
        f"engine load {load['component']}/rank-{load['rank']}: {human_bytes(load['bytes'] or 0)} of tensors in "
        f"{load['seconds']} s, {load['cpu_seconds']} CPU s"
        + ("" if disk is None else f", {human_bytes(disk)} of it from disk (the rest from the page cache)")
    )


def write_junit(report, path) -> None:
    """JUnit XML: one testsuite, one testcase per check; a <failure> for each failed one, a <skipped> (with
    its reason) for each skipped one, both counted on the suite."""
    import xml.etree.ElementTree as ET  # start-up: only --junit writes XML; inspect and --dry-run import this module

    counts = {
        "tests": str(len(report.checks)),
        "failures": str(len(report.failures)),
        "errors": "0",
        "skipped": str(len(report.skipped)),
    }
    suites = ET.Element("testsuites", **counts)
    suite = ET.SubElement(suites, "testsuite", name="ckpt-tool verify", **counts)
    for c in report.checks:
        engine = c.name.startswith("engine-vllm:")
        case = ET.SubElement(
            suite, "testcase", classname=f"ckpt-tool.verify.{'engine' if engine else report.level}", name=c.name
        )
        loaded = c.details.get("real_load") if engine and isinstance(c.details, dict) else None
        if loaded and loaded.get("seconds") is not None:  # the rank's real load: its time, and what it read
            case.set("time", f"{loaded['seconds']:.6f}")
            props = ET.SubElement(case, "properties")
            for key in ("bytes", "disk_read_bytes", "cpu_seconds"):
                ET.SubElement(props, "property", name=f"load_{key}", value=str(loaded.get(key)))
        if engine and c.ok:  # which vLLM passed it
            ET.SubElement(case, "system-out").text = c.message
        if c.status == FAILED:
            fail = ET.SubElement(case, "failure", message=c.message[:1000], type="VerifyFailure")
            fail.text = "\n".join(c.details.get("problems", [c.message])) if isinstance(c.details, dict) else c.message
        elif c.status == SKIPPED:
            ET.SubElement(case, "skipped", message=c.message[:1000]).text = c.message
    ET.ElementTree(suites).write(str(path), encoding="utf-8", xml_declaration=True)


def _gh_escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


def github_annotations(report, json_on_stdout: bool = False) -> None:
    """GitHub Actions ``::error`` lines, and a ``::notice`` for each skipped check: on stdout, or on stderr when
    --json owns stdout (the runner reads both)."""
    stream = sys.stderr if json_on_stdout else sys.stdout
    for kind, checks in (("error", report.failures), ("notice", report.skipped)):
        for c in checks:
            file = f"file={_gh_escape(c.file, True)}," if c.file else ""
            title = _gh_escape(f"ckpt-tool verify {c.name}{' skipped' if kind == 'notice' else ''}", True)
            stream.write(f"::{kind} {file}title={title}::{_gh_escape(c.message)}\n")
    stream.flush()


def github_summary(report) -> None:
    """verify --github: a Markdown summary appended to $GITHUB_STEP_SUMMARY (the page people read on a run)."""

    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return
    lines = [
        f"## ckpt-tool verify: {'✅ PASS' if report.ok else '❌ FAIL'}",
        "",
        "| level | checks | passed | skipped | failed | numeric coverage |",
        "|---|---:|---:|---:|---:|---|",
        f"| {report.level} | {len(report.checks)} | {len(report.passed)} | {len(report.skipped)} | "
        f"{len(report.failures)} "
        f"| {coverage_text(report.coverage)} |",
    ]
    if warning := unverified_warning(report.target):
        lines += ["", f"> ⚠️ {warning}"]
    if report.numeric:
        lines += [
            "",
            "| layer | logits max rel | logits cosine | hidden max rel | top-1 | top-5 | ok |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for n in report.numeric:
            lines.append(
                f"| {n['layer']} (mtp.{n['mtp']}) | {n['logits_max_rel']:.2e} | {n['logits_cosine']:.6f} | "
                f"{n['hidden_max_rel']:.2e} "
                f"| {n['top1_agreement']:.3f} | {n['top5_agreement']:.3f} | {'✅' if n.get('ok', True) else '❌'} |"
            )
    if report.engine:
        lines += [
            "",
            engine_line(report.engine),
            "",
            "| component / rank | parameters | loaded by vLLM | ok |",
            "|---|---:|---|---|",
        ]
        for c in report.checks:
            if c.name.startswith("engine-vllm:"):
                real = "yes" if c.details.get("real_load") is not None else "table only"
                lines.append(
                    f"| {c.name.partition(':')[2]} | {c.details.get('parameters', '-')} | {real} | "
                    f"{'✅' if c.ok else '❌'} |"
                )
    if report.failures:
        lines += ["", "### Failures", ""]
        lines += [f"- `{c.name}`: {c.message}" for c in report.failures[:50]]
        if len(report.failures) > 50:
            lines.append(f"- ... and {len(report.failures) - 50} more")
    if report.skipped:
        lines += ["", "### Skipped", ""]
        lines += [f"- `{c.name}`: {c.message}" for c in report.skipped]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


def coverage_text(coverage: dict | None) -> str:
    """``"328/328 units (100.0 %)"``; ``"n/a (0 of 0)"`` when there was nothing to cover; ``"-"`` when the numeric
    level did not run."""
    if not coverage:
        return "-"
    if not coverage["total"]:
        return "n/a (0 of 0)"
    return f"{coverage['checked']}/{coverage['total']} units ({coverage['percent']} %)"


class StageProgress:
    """verify / unconvert progress on stderr: one rich bar per stage (bytes, or tensors), the current file or
    layer as its description. Only on a terminal (and not with -q or --json); silent otherwise.
    Implements ckpt_tool.verify.verdict.Progress; thread-safe (rich's Progress locks)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and err.is_terminal and not _quiet["on"]
        self.progress = None
        self.task = None

    def __enter__(self) -> StageProgress:
        return self

    def _start(self) -> None:
        """The bar, from the first stage on (a command that fails before its first stage draws nothing)."""
        if self.enabled and self.progress is None:
            from rich.progress import (  # start-up (~8 ms): only a drawn bar needs it, not inspect or --dry-run
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("{task.fields[stage]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=err,
                transient=False,
            )
            self.progress.__enter__()

    def stage(self, name: str, total: int, unit: str = "B") -> None:
        self._start()
        if self.progress is not None:
            if self.task is not None:
                self.progress.update(self.task, completed=self.progress.tasks[-1].total)
            self.task = self.progress.add_task("", total=total, stage=name)

    def advance(self, n: int = 1, what: str | None = None) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, advance=n, description=what or "")

    def __call__(self, n: int) -> None:  # the byte-count callable unconvert takes
        self.advance(n)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)
