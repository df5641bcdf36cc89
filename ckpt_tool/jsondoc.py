"""``--json`` output: one document per command, of one shape on success and failure.

Kept apart from :mod:`ckpt_tool.report` (rich) so that ``inspect --json`` runs without importing rich
or typer: the header path is interactive.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# --json: one document per command, of one shape on success and failure. Every document starts with
# these four keys; the command's fields follow, null when the command failed before producing them.
SCHEMA_VERSION = 1
JSON_FIELDS: dict[str, tuple[str, ...]] = {
    "inspect": (
        "source", "files", "tensor_count", "total_bytes", "dtypes", "dtype_bytes", "quant", "main_layers",
        "mtp_expected", "mtp_present", "mtp_missing", "mtp_tensor_counts", "config_error", "missing_tensors", "problems",
    ),
    "convert": (
        "dry_run", "out", "options", "files_written", "files_skipped", "tensors", "tensor_count", "bytes", "total_bytes",
        "bytes_written", "seconds", "mb_per_s", "peak_rss_bytes", "files", "dropped", "materialized", "deviations", "notes",
        "warnings", "not_selected", "partial", "finalized", "target_note",
    ),
    "verify": ("out", "source", "level", "checks", "failed", "failures", "passed", "numeric", "coverage"),
    "unconvert": ("dest", "files", "identical_files", "tensors", "bytes", "missing"),
    "profiles": ("profiles", "installed_vllm", "auto", "auto_error"),
    "env": (),  # free-form facts (versions), see cli.environment_facts
}


def json_document(command: str, body: dict | None = None, *, error: str | None = None) -> dict:
    """``{"schema_version", "command", "ok", "error", <the command's fields>}``; ``ok`` is false when ``error`` is set."""
    body = dict(body or {})
    body.pop("ok", None)
    fields = JSON_FIELDS[command]
    if fields:
        extra = set(body) - set(fields)
        assert not extra, f"{command} JSON has undocumented fields {sorted(extra)}"
        body = {k: body.get(k) for k in fields}
    if command == "inspect" and error is not None and not body.get("problems"):
        body["problems"] = [error]  # bad input and failed checks both land in problems
    return {"schema_version": SCHEMA_VERSION, "command": command, "ok": error is None, "error": error, **body}


def print_json(doc: Any, *, compact: bool = False) -> None:
    """One JSON document on stdout (nothing else goes to stdout in --json mode).

    ``compact``: no indentation. indent=2 makes CPython use its pure-Python encoder, and a V4 plan
    (--dry-run --json: ~30 MB) then takes seconds to print; compact output goes through the C encoder.
    """
    sys.stdout.write((json.dumps(doc, default=str) if compact else json.dumps(doc, indent=2, default=str)) + "\n")
    sys.stdout.flush()
