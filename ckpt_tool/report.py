"""Rendering for people (rich, on stderr/stdout) and machines (JSON on stdout). Only the CLI imports this."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .inspect import InspectReport

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def print_json(doc: Any) -> None:
    """One JSON document on stdout (nothing else goes to stdout in --json mode)."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def error_line(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)


def warning_line(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


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
        f"routed experts {q.expert_weight_dtype or '-'} ({q.expert_format or '-'}) with {q.expert_scale_dtype or '-'} scales; "
        f"config expert_dtype {q.config_expert_dtype or '-'}",
        highlight=False,
    )
    out.print(f"main layers: {_ranges(r.main_layers)} ({len(r.main_layers)})", highlight=False)
    present = ", ".join(f"mtp.{i} ({n} tensors)" for i, n in r.mtp_tensor_counts.items()) or "none"
    out.print(
        f"MTP layers: expected {_ranges(r.mtp_expected)}; present {present}; missing {_ranges(r.mtp_missing)}",
        highlight=False,
    )
    if r.ok:
        out.print("[green]verdict: ok[/]")
    else:
        for p in r.problems:
            error_line(p)
