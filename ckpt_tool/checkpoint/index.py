"""The safetensors index, ``model.safetensors.index.json``: its tensor → shard file map, with every file name checked
to lie inside the checkpoint folder."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from ckpt_tool.checkpoint.strict_json import UNPROVEN, DuplicateKey, json_problem, loads_unique, reject_duplicates
from ckpt_tool.errors import CheckpointError


def safe_relative_name(name: object, where: str) -> str:
    """Check that an index entry names a file inside the checkpoint folder; return it normalised."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: shard file name {name!r} is not a non-empty string")
    if "\\" in name or "\x00" in name or name.startswith("/") or PurePosixPath(name).is_absolute():
        raise CheckpointError(
            f"{where}: shard file {name!r} is an absolute or unsafe path; it must lie inside the checkpoint folder — "
            "fix the index or download it again"
        )
    parts = PurePosixPath(name).parts
    if not parts or any(p in ("..", ".") for p in parts) or ":" in parts[0]:
        raise CheckpointError(
            f"{where}: shard file {name!r} points outside the checkpoint folder; refusing it — fix the index or "
            "download it again"
        )
    return "/".join(parts)


def read_index(path: Path) -> dict[str, str]:
    """Read ``model.safetensors.index.json``: the tensor → shard file map, with every file name checked."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
        doc = loads_unique(text)
        if doc is UNPROVEN:
            doc = json.loads(text, object_pairs_hook=reject_duplicates)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: index file not found") from None
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read the index ({exc.strerror or exc})") from None
    except DuplicateKey as dup:
        raise CheckpointError(f"{where}: tensor {dup.key!r} appears twice in the index") from None
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, ints over the digit limit, deep nesting
        raise CheckpointError(f"{where}: not valid JSON ({json_problem(exc)}); download the index again") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{where}: no 'weight_map' object; this is not a safetensors index — download the index again"
        )
    # 69k entries name ~46 files: validate each distinct file name once (this dominated inspect time).
    try:
        clean = all(type(f) is str and safe_relative_name(f, where) == f for f in set(weight_map.values()))
    except (TypeError, CheckpointError):  # unhashable or unsafe: the loop below names the tensor
        clean = False
    if clean:
        return weight_map  # every value already a clean relative name (keys are JSON strings)
    checked: dict[object, str] = {}
    result: dict[str, str] = {}
    for name, file in weight_map.items():
        key = file if isinstance(file, str) else repr(file)
        if key not in checked:
            checked[key] = safe_relative_name(file, f"{where}: tensor {name!r}")
        result[str(name)] = checked[key]
    return result
