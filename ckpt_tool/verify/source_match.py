"""The source ``verify`` checks OUT against: is ``--source`` the checkpoint OUT was converted from (its shards' headers
and config, and, for a local source, its files unchanged since), and which checkpoint a hub ``--source`` names."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpt_tool.checkpoint.hub import HubRef, open_hub_source
from ckpt_tool.checkpoint.identity import FileIdentity, identity_of
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError
from ckpt_tool.mapping.hub_needs import HubNeeds
from ckpt_tool.output.layout import MANIFEST, options_from_manifest, read_manifest, source_fingerprint
from ckpt_tool.verify.verdict import Check, VerifyReport


def same_source(manifest: dict, ckpt: Checkpoint, report: VerifyReport) -> bool:
    """Is ``--source`` the checkpoint OUT was converted from (shard sizes and header hashes, config)? One check."""
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
                f"{ckpt.root}/config.json differs from the one OUT was converted with; pass the original checkpoint as "
                "--source, or reconvert",
                file="config.json",
            )
        )
        return False
    report.add(Check("source-fingerprint", True))
    return True


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
