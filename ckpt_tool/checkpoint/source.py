"""Opening a source checkpoint: config, index and every shard header, cross-checked. No tensor bytes.

A source is a folder (with or without ``model.safetensors.index.json``), an index file, or one
``.safetensors`` file. Hub repo ids are resolved in :mod:`ckpt_tool.checkpoint.hub`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.forked_read import read_shards_forked
from ckpt_tool.checkpoint.gc_pause import gc_paused
from ckpt_tool.checkpoint.headers import ShardHeader, TensorInfo, read_shard_header
from ckpt_tool.checkpoint.index import read_index
from ckpt_tool.checkpoint.paths import INDEX_NAME, load_config, not_a_regular_file, resolve_layout
from ckpt_tool.checkpoint.reader import ByteSource, LocalFiles, RemoteSource
from ckpt_tool.errors import CheckpointError

__all__ = ["INDEX_NAME", "Checkpoint", "load_config", "open_checkpoint", "resolve_layout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A validated source checkpoint: every tensor's file, dtype, shape and byte range."""

    root: Path
    config: V4Config | None
    config_error: str | None
    index_file: str | None
    shards: dict[str, ShardHeader] = field(repr=False)
    tensors: dict[str, TensorInfo] = field(repr=False)
    remote: RemoteSource | None = field(default=None, repr=False, compare=False)
    """Opens the bytes of a source whose shards are not under ``root`` (a hub repo read by range requests)."""

    def open_bytes(self, *, direct: bool = False, sequential: bool = False) -> ByteSource:
        """Where this checkpoint's tensor bytes are read from: its files (``direct``/``sequential``: the read policy,
        :class:`~ckpt_tool.checkpoint.reader.LocalFiles`), or its remote source."""
        if self.remote is not None:
            return self.remote()
        return LocalFiles(self.root, direct=direct, sequential=sequential)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def require_config(self) -> V4Config:
        if self.config is None:
            raise CheckpointError(self.config_error or f"{self.root}: config.json not found")
        return self.config


def open_checkpoint(src: Path, *, need_config: bool = True, forked: bool = True) -> Checkpoint:
    """Read config, index and all shard headers of ``src`` and check they agree.

    Checks: every shard the index names exists and parses; the index's tensor set equals the union of
    the shard headers; no tensor is stored twice; each tensor lives in the file the index says. A
    checkpoint of many shards with an index is read with forked helpers (``forked=False``: never), which
    answer only for a consistent checkpoint; the serial path gives the same result and words every error.
    """
    with gc_paused():  # ~300k objects, none cyclic: the collector's passes cost more than the parse
        read = (
            read_shards_forked(
                src,
                _header_at,
                need_config=need_config,
                wire=ShardHeader.to_wire,
                unwire=ShardHeader.from_wire,
                on_own=_records_of,
            )
            if forked
            else None
        )
        if read is not None:
            shards = dict(zip(read.files, read.values))
            tensors: dict[str, TensorInfo] = {}
            for header in read.values:
                tensors.update(header.tensors)
            if len(tensors) == len(read.weight_map):  # (the placement digest has ruled out a tensor stored twice)
                return Checkpoint(read.root, read.config, read.config_error, read.index_file, shards, tensors)
        return _open_checkpoint(src, need_config)


def _records_of(header: ShardHeader) -> None:
    """Build ``header``'s per-tensor records (a cached property) now: this process's own shards, while it waits for
    the helpers (V4-Pro's 145k records cost ~50 ms, all built after the read before)."""
    header.tensors  # noqa: B018 - the cached property is built for what it caches


def _header_at(root: Path, file: str) -> tuple[ShardHeader, list[str]]:
    header = read_shard_header(root / file, file)
    return header, header.names


def _open_checkpoint(src: Path, need_config: bool) -> Checkpoint:
    root, index_path, explicit = resolve_layout(Path(src))
    config, config_error = load_config(root, need_config=need_config)

    weight_map: dict[str, str] | None = None
    if index_path is not None:
        weight_map = read_index(index_path)
        files = sorted(set(weight_map.values()))
    elif explicit is not None:
        files = explicit
    else:
        files = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors files and no {INDEX_NAME}")

    shards: dict[str, ShardHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        path = root / file
        kind = not_a_regular_file(path)
        if kind is not None:
            where = f"{index_path.name}" if index_path else str(root)
            if kind == "missing":
                raise CheckpointError(
                    f"{file}: named by {where} but missing from {root}; the download is incomplete — fetch this file"
                )
            raise CheckpointError(
                f"{file}: named by {where}, but {path} is {kind}, not a safetensors file (not opened); replace it "
                "with the shard file — fetch this file again"
            )
        header = read_shard_header(path, file)
        before = len(tensors)
        tensors.update(header.tensors)
        if len(tensors) != before + len(header.tensors):
            _stored_twice(header, shards)
        shards[file] = header

    if weight_map is not None and weight_map != {name: info.file for name, info in tensors.items()}:
        assert index_path is not None
        _index_disagrees(index_path, weight_map, tensors)
    return Checkpoint(
        root=root,
        config=config,
        config_error=config_error,
        index_file=index_path.name if index_path else None,
        shards=shards,
        tensors=tensors,
    )


def _stored_twice(header: ShardHeader, earlier: dict[str, ShardHeader]) -> None:
    """Raise for the first tensor of ``header`` that an earlier shard also stores."""
    for file, other in earlier.items():
        for name in header.tensors:
            if name in other.tensors:
                raise CheckpointError(
                    f"{header.file}: tensor {name!r} is also stored in {file}; a tensor must be stored once — "
                    "remove the stray copy or download the checkpoint again"
                )
    raise AssertionError("a tensor count mismatch without a repeated name")  # pragma: no cover


def _index_disagrees(index_path: Path, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    """Raise naming the first way the index's weight map and the shards' headers differ."""
    for name, file in weight_map.items():
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(
                f"{index_path.name}: tensor {name!r} is mapped to {file} but that shard does not contain it; "
                "the index and the shards disagree — download the checkpoint again"
            )
        if info.file != file:
            raise CheckpointError(
                f"{index_path.name}: tensor {name!r} is mapped to {file} but is stored in {info.file}; "
                "the index and the shards disagree — download the checkpoint again"
            )
    extra = sorted(set(tensors) - set(weight_map))
    shown = ", ".join(repr(n) for n in extra[:5])
    raise CheckpointError(
        f"{index_path.name}: {len(extra)} tensor(s) stored in shards but absent from the index "
        f"(e.g. {shown} in {tensors[extra[0]].file}); the index and the shards disagree — download the checkpoint again"
    )
