"""``--json`` output: one document per command, of one shape on success and failure.

Kept apart from :mod:`ckpt_tool.cli.render` (rich) so that ``inspect --json`` and ``convert --dry-run --json``
run without importing rich or typer: the header path is interactive.
"""

from __future__ import annotations

import json
import sys
from itertools import chain, repeat
from typing import Any

from ckpt_tool.checkpoint.gc_pause import gc_paused

# --json: one document per command, of one shape on success and failure. Every document starts with
# these four keys; the command's fields follow, null when the command failed before producing them.
SCHEMA_VERSION = 1
JSON_FIELDS: dict[str, tuple[str, ...]] = {
    "inspect": (
        "source",
        "files",
        "tensor_count",
        "total_bytes",
        "dtypes",
        "dtype_bytes",
        "quant",
        "main_layers",
        "mtp_expected",
        "mtp_present",
        "mtp_missing",
        "mtp_tensor_counts",
        "config_error",
        "model",
        "missing_tensors",
        "problems",
    ),
    "convert": (
        "dry_run",
        "out",
        "options",
        "files_written",
        "files_skipped",
        "tensors",
        "tensor_count",
        "bytes",
        "total_bytes",
        "bytes_written",
        "seconds",
        "mb_per_s",
        "peak_rss_bytes",
        "fetched_bytes",  # --stream: bytes read from the hub (null otherwise)
        "fetch_requests",  # --stream: range requests made (retries included)
        "files",
        "dropped",
        "materialized",
        "deviations",
        "notes",
        "warnings",
        "not_selected",
        "partial",
        "finalized",
        "target_note",
        "target_warning",
        "serve",  # the vllm serve line for OUT (null for a draft converted alone)
    ),
    # verify: checks/failed are counts; failures and skipped list whole checks (each with its "status" and
    # "message": what failed, or why it did not run), passed their names; results is every check in order as
    # {"name", "status", "message"} (status passed | failed | skipped; only failed ones make ok false).
    # coverage: {"unit", "checked", "total", "percent", "components": {comp: {... "ranks": {rank: {...}}}}}
    # counted in units actually computed; percent is null when total is 0 (n/a), never 100.
    # target: the manifest's target (profile, vLLM releases it is verified against, the vLLM installed at convert
    # time, "verified": false when the profile is not verified for it).
    # engine (--engine): the vLLM that judged (vllm_version, python, tp, expert_parallel, ranks, real_loads, seconds)
    # and loads: one {"component", "rank", "seconds", "bytes", "disk_read_bytes", "cpu_seconds", "peak_rss_bytes"}
    # per rank its ShardedStateLoader loaded for real (bytes: tensor bytes it read; disk_read_bytes: from the disk).
    "verify": (
        "out",
        "source",
        "level",
        "checks",
        "failed",
        "failures",
        "passed",
        "skipped",
        "results",
        "numeric",
        "coverage",
        "target",
        "engine",
    ),
    "unconvert": ("dest", "files", "identical_files", "tensors", "bytes", "missing"),
    "profiles": ("profiles", "installed_vllm", "auto", "auto_verified", "auto_error"),
    "env": (),  # free-form facts (versions), see ckpt_tool.mapping.environment.environment_facts
}


def json_document(command: str, body: dict | None = None, *, error: str | None = None) -> dict:
    """``{"schema_version", "command", "ok", "error", <the command's fields>}``; ``ok`` is false when ``error`` is
    set."""
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


def _segment_json(s) -> dict:
    if s.kind == "zero":
        return {"kind": "zero", "rows": s.row1 - s.row0, "cols": s.col1 - s.col0, "convert": s.convert}
    doc = {"kind": "source", "src": s.src, "rows": [s.row0, s.row1], "cols": [s.col0, s.col1], "convert": s.convert}
    return {**doc, "pad": s.pad} if s.pad else doc


def _tensor_json(t) -> dict:
    doc = {
        "name": t.name,
        "dtype": t.dtype,
        "shape": t.shape,
        "sources": t.sources,
        "rule": t.rule,
    }  # tuples: JSON arrays
    if t.padding:  # the engine's zero padding: how the tensor is assembled (other tensors are plain slices)
        doc.update(padding=t.padding, segments=[_segment_json(s) for s in t.segments])
    return doc


def plan_json(plan) -> dict:
    """The plan as one JSON document: files, tensors with shapes/dtypes/sources, drops, materializations;
    a tensor holding the engine's zero padding also lists its segments (kind ``source`` or ``zero``)."""
    with gc_paused():  # ~35k small dicts on top of a heap of plan and headers: GC passes cost 5x the building
        return _plan_json(plan)


def _plan_json(plan) -> dict:
    # the ranks of a split tensor hold equal documents (same name, dtype, shape, sources, rule): they share one dict,
    # which json_pieces_sharing then encodes once (a V4-Pro plan at tp 8: 17k tensors on its ranks, 2k distinct)
    shared: dict[tuple, dict] = {}

    def tensor_doc(t) -> dict:
        if t.padding:  # its segments are the rank's own
            return _tensor_json(t)
        key = (t.name, t.dtype, t.shape, t.rule, id(t.sources))  # a plan gives all ranks of a tensor one tuple
        doc = shared.get(key)
        if doc is None:
            doc = shared[key] = _tensor_json(t)
        return doc

    return {
        "options": plan.options.as_dict(),
        "tensor_count": plan.tensor_count,
        "total_bytes": plan.total_bytes,
        "files": [
            {
                "file": f.relpath,
                "rank": f.rank,
                "bytes": f.data_bytes,
                "tensors": [tensor_doc(t) for t in f.tensors],
            }
            for f in plan.files
        ],
        "dropped": plan.dropped,
        "materialized": plan.materialized,
        "deviations": list(plan.deviations),
        "notes": list(plan.notes),
        "not_selected": len(plan.unused_by_selection),
    }


def print_json(doc: Any, *, compact: bool = False) -> None:
    """One JSON document on stdout (nothing else goes to stdout in --json mode).

    ``compact``: no indentation. indent=2 makes CPython use its pure-Python encoder, and a V4 plan
    (--dry-run --json: ~30 MB) then takes seconds to print; compact output goes through the C encoder.
    """
    print_json_pieces([json.dumps(doc, default=str) if compact else json.dumps(doc, indent=2, default=str)])


def print_json_pieces(pieces: list[str]) -> None:
    """A JSON document already encoded, as the pieces that make its text (see :func:`json_pieces_sharing`), on
    stdout: written one after another, not joined first (a dry run's 20-50 MB would be copied twice more: joined,
    then encoded whole)."""
    sys.stdout.writelines(pieces)
    sys.stdout.write("\n")
    sys.stdout.flush()


# What a shared list's holder holds while the rest of the document is encoded (see json_pieces_sharing): a string no
# checkpoint names a tensor, and if one did, the holders' count of it would not match and plain json.dumps runs
SHARED = "\x00shared list\x00"


def json_pieces_sharing(doc: dict, lists: tuple[str, ...], key: str) -> list[str]:
    """Pieces whose concatenation is ``json.dumps(doc, default=str)`` (compact), byte for byte, with each ``key``
    list encoded once per distinct run of items and each distinct item (by identity) encoded once. ``lists`` is the
    path of list-valued keys to the dicts holding ``key``: ``("files",)`` and ``"tensors"`` means every
    ``doc["files"][i]["tensors"]``.

    A dry run's plan lists each tensor on every rank: of V4-Pro's 47 MB plan at tp 8, the ranks' 17k tensor
    documents are 2k distinct ones (one dict each, shared by the ranks: :func:`plan_json`), and 22 distinct file
    lists of 176. While the rest is encoded the holders hold :data:`SHARED` there, and the text is cut at each
    ``"key": "<SHARED>"``, in document order, which is the order walked here; a list's text is ``[`` + its items'
    texts joined by ``, `` + ``]``, as the encoder writes it.
    """
    holders: list[dict] = [doc]
    for name in lists:
        holders = [item for holder in holders for item in holder[name]]
    values = [holder[key] for holder in holders]  # kept alive: no id is reused while it counts
    encode = json.JSONEncoder(default=str).encode  # json.dumps(x, default=str), without a new encoder a call
    items: dict[int, str] = {}  # id of an item -> its JSON
    runs: dict[tuple[int, ...], str] = {}  # ids of a list's items -> the list's JSON
    texts = []
    for value in values:
        ids = tuple(map(id, value))
        if ids not in runs:
            for item, i in zip(value, ids):
                if i not in items:
                    items[i] = encode(item)
            runs[ids] = "[" + ", ".join(map(items.__getitem__, ids)) + "]"
        texts.append(runs[ids])
    try:
        for holder in holders:
            holder[key] = SHARED
        text = json.dumps(doc, default=str)
    finally:
        for holder, value in zip(holders, values):
            holder[key] = value
    parts = text.split(json.dumps(key) + ": " + json.dumps(SHARED))
    if len(parts) != len(holders) + 1:  # the document holds the marker itself
        return [json.dumps(doc, default=str)]
    cut = json.dumps(key) + ": "
    return [parts[0], *chain.from_iterable(zip(repeat(cut), texts, parts[1:]))]
