"""The source ``verify`` checks OUT against: is ``--source`` the checkpoint OUT was converted from (its shards' headers
and config, and, for a local source, its files unchanged since), and which checkpoint a hub ``--source`` names."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ckpt_tool.checkpoint.config_keys import shown
from ckpt_tool.checkpoint.hub import HubRef, open_hub_source
from ckpt_tool.checkpoint.identity import FileIdentity, identity_of
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.hub_needs import HubNeeds
from ckpt_tool.mapping.profiles.draft_kind import DRAFT_COMPONENTS
from ckpt_tool.output.layout import MANIFEST, options_from_manifest, read_manifest, source_fingerprint
from ckpt_tool.verify.verdict import Check, VerifyReport


def same_source(manifest: dict, ckpt: Checkpoint, report: VerifyReport, out: Path | None = None) -> bool:
    """Is ``--source`` the checkpoint OUT was converted from (shard sizes and header hashes, config)? One check; a
    changed config.json is named by the keys that differ from OUT's copy of it (``out``: OUT, where it is)."""
    recorded_source = manifest.get("source") or {}
    recorded = recorded_source.get("files") or {}
    fingerprint = source_fingerprint(ckpt)
    current = fingerprint["files"]
    if recorded != current:
        changed = sorted(f for f in set(recorded) | set(current) if recorded.get(f) != current.get(f))
        report.add(
            Check(
                "source-fingerprint",
                False,
                f"{ckpt.root} is not the checkpoint OUT was converted from ({len(changed)} of "
                f"{len(set(recorded) | set(current))} "
                f"shard file(s) differ, e.g. {changed[0]}); pass the original checkpoint as --source, or reconvert",
                file=changed[0],
            )
        )
        return False
    if recorded_source.get("config_sha256") != fingerprint["config_sha256"]:
        report.add(
            Check(
                "source-fingerprint",
                False,
                f"{ckpt.root}/config.json differs from the one OUT was converted with"
                f"{changed_keys_note(out, ckpt.root) if out is not None else ''}; pass the original checkpoint as "
                "--source, or reconvert",
                file="config.json",
            )
        )
        return False
    report.add(Check("source-fingerprint", True))
    return True


def converted_config(out: Path) -> dict | None:
    """The config.json OUT was converted with: each component's config.json is the source's, byte for byte (the
    first one that parses; None where none does)."""
    for component in ("model", *DRAFT_COMPONENTS):
        try:
            doc = json.loads((out / component / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(doc, dict):
            return doc
    return None


def config_changes(before: object, after: object, path: str = "") -> list[str]:
    """The keys (dotted: ``text_config.engram_layer_ids``) whose values differ between two config.json documents,
    with both values: ``num_hidden_layers 3 -> 4``, ``sliding_window 16 -> (removed)``; sorted by key."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[str] = []
        for key in sorted(set(before) | set(after), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in after:
                out.append(f"{where} {shown(before[key])} -> (removed)")
            elif key not in before:
                out.append(f"{where} (absent) -> {shown(after[key])}")
            else:
                out += config_changes(before[key], after[key], where)
        return out
    if before == after and type(before) is type(after):
        return []
    return [f"{path or 'the document'} {shown(before)} -> {shown(after)}"]


def changed_keys_note(out: Path, src_root: Path) -> str:
    """`` (changed: KEY OLD -> NEW, ...)``: what differs between the config.json OUT was converted with and the source's
    now (empty when either cannot be read, or nothing but the bytes differ: whitespace, key order)."""
    before = converted_config(out)
    try:
        after = json.loads((src_root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return ""
    if before is None:
        return ""
    changes = config_changes(before, after)
    if not changes:
        return " (the same keys and values, written differently)"
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    return f" (changed: {'; '.join(changes[:3])}{more})"


def same_identity(manifest: dict, ckpt: Checkpoint, report: VerifyReport) -> None:
    """Is each source file OUT was made from unchanged since (size and mtime_ns as the manifest records them)?

    One check, when the manifest records identities (a local source; a hub source is pinned by its commit).
    """
    recorded = (manifest.get("source") or {}).get("identity")
    if not isinstance(recorded, dict):
        return
    for file, doc in sorted(recorded.items()):
        was = FileIdentity.from_dict(doc) if isinstance(doc, dict) else None
        header = ckpt.shards.get(file)
        now = header.identity if header is not None and header.identity is not None else identity_of(ckpt.root / file)
        said = ["removed"] if now is None else ["unreadable record"] if was is None else was.changes_since(now)
        if said:
            report.add(
                Check(
                    "source-identity",
                    False,
                    f"{ckpt.root / file}: changed since OUT was converted ({'; '.join(said)}); OUT may no longer "
                    "agree with it — reconvert from the source as it is now (a copy that did not keep modification "
                    "times counts as changed too)",
                    file=file,
                )
            )
            return
    report.add(Check("source-identity", True, details={"files": len(recorded)}))


def hub_source_for_verify(ref: HubRef, out: Path, *, stream: bool = False) -> Path | Checkpoint:
    """The checkpoint ``verify --source REF`` reads for a hub ``ref``, fetched
    into the HF cache if absent (``stream``: never fetched, its bytes read with range requests).

    An ``--only mtp`` conversion made from part of a hub repo recorded just the shards it read: it is
    verified against that same partial checkpoint (no other shard is fetched). Otherwise the whole
    snapshot is resolved.
    """
    manifest = read_manifest(out)
    if manifest is None:
        raise CheckpointError(f"{out / MANIFEST}: missing; OUT is not a finished ckpt-tool conversion")
    opts = options_from_manifest(manifest)
    recorded = set((manifest.get("source") or {}).get("files") or {})
    if stream:
        return open_hub_source(ref, HubNeeds(replace(opts, only=None)), stream=True)
    if opts.only == "mtp":
        part = open_hub_source(ref, HubNeeds(opts))  # the shards the conversion read (fetched if absent)
        if recorded == set(part.shards):
            return part  # verify the partial source it was converted from, without fetching the rest
    return open_hub_source(ref, HubNeeds(replace(opts, only=None))).root
