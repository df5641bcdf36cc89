"""Hub repo ids as sources: ``org/name[@revision]`` or ``hf://org/name[@revision]``.

``inspect`` reads headers only: ``HfApi.get_safetensors_metadata`` (HTTP range reads) online, the
cached snapshot's shard headers offline. ``convert`` (and ``verify --source``) resolve the revision
to a commit, fetch config.json and the index, read every header, plan — so a bad ``--tp`` or a
missing MTP layer fails before any shard is fetched — then download only the shards the plan needs
with ``snapshot_download(allow_patterns=[...])`` into the normal HF cache (``HF_HOME``,
``HF_TOKEN`` and ``HF_HUB_OFFLINE`` are honoured by huggingface_hub itself; its tqdm bars show the
download). With ``HF_HUB_OFFLINE=1`` the cached snapshot is used as it is, and a file the
conversion needs but the cache lacks is named.

``--only mtp`` needs only the shards holding ``mtp.*`` (plus ``embed``/``head`` when they are
materialized): the checkpoint is then opened from those shards alone (:func:`open_partial`), the
index still naming every shard. A local folder with a missing shard stays an error
(:func:`ckpt_tool.checkpoint.source.open_checkpoint`). huggingface_hub is imported lazily so local use never
pays for it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import HeaderError, TensorInfo, parse_header, read_shard_header
from ckpt_tool.checkpoint.index import read_index
from ckpt_tool.checkpoint.paths import load_config
from ckpt_tool.checkpoint.source import INDEX_NAME, Checkpoint, open_checkpoint
from ckpt_tool.errors import CheckpointError

_REPO_RE = re.compile(r"^(?:hf://)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")
SMALL_FILES = ("config.json", INDEX_NAME)
# Non-weight files `vllm serve OUT/model` needs (convert.serving_files copies what the snapshot holds).
SERVING_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.md", "LICENSE*")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None
    token: str | None = field(default=None, repr=False, compare=False)  # --token (else HF_TOKEN / the login)
    cache_dir: str | None = field(default=None, compare=False)  # --cache-dir (else HF_HUB_CACHE / HF_HOME)

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    @property
    def kw(self) -> dict:
        """token / cache_dir for huggingface_hub's download functions (only those given)."""
        return {k: v for k, v in (("token", self.token), ("cache_dir", self.cache_dir)) if v is not None}


def _looks_local(src: str) -> str | None:
    """Why ``src`` (a missing path shaped ``a/b``) is more likely a mistyped local path than a repo id."""
    if src.startswith(("./", "../", "/", "~")) or src.endswith((".json", ".safetensors")):
        return "it is written as a path"
    first = Path(src.split("/", 1)[0])
    if first.exists():
        return f"{first}/ exists here"
    return None


def parse_hub_ref(
    src: str, *, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> HubRef | None:
    """A hub reference if ``src`` is one, else None (a local path).

    ``hf://org/name`` is always the hub. An existing local path always wins. A missing ``org/name``
    is the hub unless it looks like a local path (its first folder exists here, or it is written as
    a path): then it is a local path that is missing, and the error says how to mean the hub.
    ``revision`` (--revision) overrides an ``@rev`` suffix.
    """
    explicit = src.startswith("hf://")
    if not explicit and Path(src).exists():
        return None
    m = _REPO_RE.match(src)
    if not m:
        return None
    if not explicit and (why := _looks_local(src)) is not None:
        raise CheckpointError(
            f"{src}: no such file or folder ({why}); if you meant the hub repo {m.group(1)}, write hf://{src}"
        )
    return HubRef(m.group(1), revision or m.group(2), token, cache_dir)


def network_error(ref: HubRef, what: str, exc: Exception) -> CheckpointError:
    """A hub failure as one line with its fix: network, auth, a wrong name, or offline use."""
    name = type(exc).__name__
    text = str(exc).splitlines()[0] if str(exc) else ""
    not_readable = ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError", "NotASafetensorsRepoError")
    if name in not_readable or "401" in text or "404" in text:
        fix = "check the repo id and revision, and that your token (--token, HF_TOKEN or `hf auth login`) may read it"
    else:
        fix = (
            "check the network (and HF_ENDPOINT / proxy settings); to work from the HF cache set HF_HUB_OFFLINE=1, "
            "or pass a local checkpoint folder"
        )
    return CheckpointError(f"{ref}: {what} ({name}: {text}); {fix}")


def _hf():
    try:
        import huggingface_hub  # start-up: only hub sources pay for it, never a local folder
        from huggingface_hub import constants
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a declared dependency
        raise CheckpointError(f"reading hub repos needs huggingface_hub ({exc})") from None
    return huggingface_hub, constants


# ---------------------------------------------------------------------------------------------
# Which files a conversion needs


class ConversionNeeds(Protocol):
    """What a conversion needs from a hub repo, as the planner answers it (``ckpt_tool.mapping.hub_needs.HubNeeds``):
    the hub input asks, it never plans itself."""

    @property
    def partial(self) -> bool:
        """Only some shards are read (``--only mtp``): the checkpoint is opened from those alone."""
        ...

    def sources(self, names: set[str], config: V4Config) -> set[str]:
        """The source tensors whose bytes the conversion reads, from their names alone."""
        ...

    def check(self, config: V4Config, tensors: dict[str, TensorInfo]) -> None:
        """Raise the plan's error for these headers, before any shard is downloaded."""
        ...


def needed_files(weight_map: dict[str, str], config: V4Config, needs: ConversionNeeds) -> list[str]:
    """Shard files holding a tensor the conversion reads."""
    return sorted({weight_map[n] for n in needs.sources(set(weight_map), config)})


def allow_patterns(weight_map: dict[str, str], config: V4Config, needs: ConversionNeeds) -> list[str]:
    """``snapshot_download`` allow_patterns for a conversion: config, index and the needed shards."""
    return [*SMALL_FILES, *needed_files(weight_map, config, needs)]


# ---------------------------------------------------------------------------------------------
# Resolving a snapshot folder


def cached_snapshot(ref: HubRef) -> Path:
    """The snapshot folder of ``ref`` in the local HF cache, without any network access."""
    hf, constants = _hf()
    try:
        folder = hf.snapshot_download(
            ref.repo_id, revision=ref.revision, allow_patterns=["config.json"], local_files_only=True, **ref.kw
        )
    except Exception as exc:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        why = "HF_HUB_OFFLINE is set and " if constants.HF_HUB_OFFLINE else ""
        raise CheckpointError(
            f"{ref}: {why}the repo is not in the local HF cache ({ref.cache_dir or constants.HF_HUB_CACHE}) "
            f"({type(exc).__name__}); unset HF_HUB_OFFLINE to download it, or point at a local folder"
        ) from None
    return Path(folder)


def _missing(folder: Path, files: list[str]) -> list[str]:
    return [f for f in files if not (folder / f).is_file()]  # a dangling blob link counts as missing


def _read_small(folder: Path, ref: HubRef) -> tuple[V4Config, dict[str, str] | None]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{ref}: config.json is not in the snapshot {folder}")
    config, _ = load_config(folder)  # as a local folder's: the snapshot holds the serving files (tokenizer.json)
    index = folder / INDEX_NAME
    return config, (read_index(index) if index.is_file() else None)


def _small_files(ref: HubRef, commit: str) -> tuple[Path, V4Config, dict[str, str] | None]:
    """Download (or find cached) config.json, the index and the serving files of ``ref`` at ``commit``: the snapshot
    folder, the config and the index's weight map (None: a one-file repo)."""
    hf, _ = _hf()
    try:
        folder = Path(
            hf.snapshot_download(
                ref.repo_id, revision=commit, allow_patterns=[*SMALL_FILES, *SERVING_PATTERNS], **ref.kw
            )
        )
    except Exception as exc:
        raise network_error(ref, f"cannot download config.json / {INDEX_NAME}", exc) from None
    config, weight_map = _read_small(folder, ref)
    return folder, config, weight_map


def _offline_error(ref: HubRef, folder: Path, missing: list[str], what: str) -> CheckpointError:
    return CheckpointError(
        f"{ref}: HF_HUB_OFFLINE is set and {len(missing)} file(s) {what} are not in the HF cache "
        f"(snapshot {folder}): {', '.join(missing)}; unset HF_HUB_OFFLINE to download them"
    )


def resolve_commit(ref: HubRef) -> str:
    """The commit ``ref``'s revision names now: every later read is pinned to it, so a branch that moves
    meanwhile cannot mix two commits. A wrong repo id or revision fails here, named as such."""
    hf, _ = _hf()
    try:
        return hf.HfApi(token=ref.token).model_info(ref.repo_id, revision=ref.revision).sha
    except Exception as exc:
        raise network_error(ref, "cannot resolve the repo on the hub", exc) from None


def metadata_tensors(ref: HubRef, revision: str | None) -> dict[str, TensorInfo]:
    """Every tensor's header from the hub (HTTP range reads, no download). Offsets are buffer-relative."""
    hf, _ = _hf()
    try:
        meta = hf.HfApi(token=ref.token).get_safetensors_metadata(ref.repo_id, revision=revision)
    except Exception as exc:  # network, auth, not-a-safetensors-repo
        raise network_error(ref, "cannot read safetensors headers from the hub", exc) from None
    tensors: dict[str, TensorInfo] = {}
    for file, fmeta in meta.files_metadata.items():
        for name, t in fmeta.tensors.items():
            begin, end = t.data_offsets
            tensors[name] = TensorInfo(name, t.dtype, tuple(t.shape), file, begin, end)
    return tensors


def open_partial(
    folder: Path, weight_map: dict[str, str], files: list[str], names: set[str], config: V4Config
) -> Checkpoint:
    """A checkpoint of hub snapshot ``folder`` opened from ``files`` alone, keeping the tensors ``names``.

    The same agreement checks as open_checkpoint, restricted to those shards: each exists and parses,
    stores exactly the tensors the index maps to it, and no tensor twice.
    """
    shards = {}
    tensors: dict[str, TensorInfo] = {}
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, set()).add(name)
    for file in files:
        path = folder / file
        if not path.is_file():
            raise CheckpointError(
                f"{file}: named by {INDEX_NAME} and needed, but missing from {folder}; fetch this file"
            )
        header = read_shard_header(path, file)
        stored, mapped = set(header.tensors), by_file.get(file, set())
        if stored != mapped:
            extra, absent = sorted(stored - mapped), sorted(mapped - stored)
            what = (
                f"stores {extra[0]!r} the index does not map to it"
                if extra
                else f"lacks {absent[0]!r} the index maps to it"
            )
            raise CheckpointError(f"{INDEX_NAME}: the index and the shards disagree: {file} {what}")
        shards[file] = header
        for name, info in header.tensors.items():
            if name in names:
                tensors[name] = info
    return Checkpoint(
        root=folder, config=config, config_error=None, index_file=INDEX_NAME, shards=shards, tensors=tensors
    )


def open_hub_source(ref: HubRef, needs: ConversionNeeds, *, download: bool = True, stream: bool = False) -> Checkpoint:
    """Resolve ``ref`` for a conversion: check the plan from headers, fetch only the needed shards, open.

    ``download=False`` (``--dry-run``) checks from the hub's headers without fetching any shard and
    returns a checkpoint whose tensors come from those headers (for planning only). ``stream``: no shard is
    downloaded; the checkpoint's bytes are read with HTTP range requests (:func:`open_hub_stream`).
    """
    if stream and download:
        return open_hub_stream(ref, needs)
    hf, constants = _hf()
    if constants.HF_HUB_OFFLINE:
        folder = cached_snapshot(ref)
        config, weight_map = _read_small(folder, ref)
        if weight_map is None:  # one-file repo: whatever .safetensors the snapshot holds
            return open_checkpoint(folder)
        names = needs.sources(set(weight_map), config)
        files = sorted({weight_map[n] for n in names})
        missing = _missing(folder, files)
        if missing:
            raise _offline_error(ref, folder, missing, "this conversion needs")
        return _open(folder, weight_map, files, names, config, needs)

    commit = resolve_commit(ref)
    folder, config, weight_map = _small_files(ref, commit)
    header_tensors = metadata_tensors(ref, commit)
    if weight_map is None:
        weight_map = {n: t.file for n, t in header_tensors.items()}
    names = needs.sources(set(weight_map), config)
    files = sorted({weight_map[n] for n in names})
    # plan from the hub's headers first: every plan error comes before a byte is downloaded
    needs.check(config, {n: header_tensors[n] for n in names if n in header_tensors})
    if not download:
        planned = {n: header_tensors[n] for n in names if n in header_tensors}
        return Checkpoint(
            root=folder, config=config, config_error=None, index_file=INDEX_NAME, shards={}, tensors=planned
        )
    try:
        hf.snapshot_download(
            ref.repo_id, revision=commit, allow_patterns=[*SMALL_FILES, *SERVING_PATTERNS, *files], **ref.kw
        )
    except Exception as exc:
        raise network_error(
            ref, f"downloading {len(files)} shard(s) failed (rerun to resume the download)", exc
        ) from None
    missing = _missing(folder, files)
    if missing:
        raise CheckpointError(
            f"{ref}: after the download {len(missing)} needed file(s) are still missing from {folder}: "
            f"{', '.join(missing)}"
        )
    return _open(folder, weight_map, files, names, config, needs)


# ---------------------------------------------------------------------------------------------
# Streaming: the shards' bytes read with range requests, never downloaded

HEAD_BYTES = 1 << 20  # one request reads a shard's header (V4's are ~200 KiB); a longer one takes a second


class HubStream:
    """Opens :class:`~ckpt_tool.checkpoint.hub_ranges.HubRangeReader` s of one repo at one commit (the
    ``Checkpoint.remote`` of a streamed source: each ``open_bytes`` gets its own reader and closes it) and adds up
    what they fetched, for the progress line and the summary."""

    def __init__(self, ref: HubRef, commit: str, sizes: dict[str, int], **options) -> None:
        self.ref, self.commit, self.sizes, self.options = ref, commit, sizes, options
        self._readers: list = []
        self.headers: dict[str, bytes] = {}  # each shard's raw JSON header, as read

    def header_bytes(self, file: str) -> bytes:
        return self.headers[file]

    def spool_in(self, folder: Path, reads: Callable[[], Iterable[tuple[str, int, int]]] | None = None) -> None:
        """Readers opened from now on keep the chunks their memory cache lets go in an unlinked file in ``folder``
        (OUT: its file system has room for OUT), up to ``CKPT_TOOL_HUB_SPOOL_GB`` (docs/hub.md). ``reads``: every
        read they will serve (``HubRangeReader``'s ``reads``), so that only chunks read again are kept."""
        self.options = {**self.options, "spool_dir": folder, "spool_bytes": spool_limit(), "reads": reads}

    def __call__(self):
        from ckpt_tool.checkpoint.hub_ranges import HubRangeReader  # cycle: hub_ranges imports HubRef from here

        reader = HubRangeReader(self.ref, self.commit, self.sizes, **self.options)
        self._readers.append(reader)
        return reader

    def fetched(self) -> tuple[int, int]:
        """(bytes fetched, range requests) by every reader opened so far."""
        stats = [r.stats() for r in self._readers]
        return sum(s.bytes_fetched for s in stats), sum(s.requests for s in stats)


def _positive(name: str, default: float) -> float:
    """A positive number from environment variable ``name`` (``default`` when unset)."""
    text = os.environ.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        raise CheckpointError(f"{name}={text!r}: not a number") from None
    if value <= 0:
        raise CheckpointError(f"{name}={text!r}: must be positive")
    return value


def spool_limit() -> int:
    """Bytes of fetched chunks a streamed conversion may keep on local disk (``CKPT_TOOL_HUB_SPOOL_GB``, default 16):
    a chunk is read again about one layer's routed experts later (V4-Flash ~5.3 GiB, V4-Pro ~12 GiB)."""
    return int(_positive("CKPT_TOOL_HUB_SPOOL_GB", 16) * (1 << 30))


def stream_settings() -> dict:
    """The range readers' settings: 64 MiB requests (the hub allows some thousands of requests per 5 minutes), two
    of them ahead of the reads, and the retry policy; ``CKPT_TOOL_HUB_CHUNK_MB``, ``CKPT_TOOL_HUB_ATTEMPTS`` and
    ``CKPT_TOOL_HUB_BACKOFF_S`` change them (docs/hub.md)."""
    from ckpt_tool.checkpoint.hub_ranges import RetryPolicy  # cycle: hub_ranges imports HubRef from here

    number = _positive
    backoff = number("CKPT_TOOL_HUB_BACKOFF_S", 1.0)
    return {
        "chunk_bytes": int(number("CKPT_TOOL_HUB_CHUNK_MB", 64) * (1 << 20)),
        # in memory; what it lets go waits in the spool (HubStream.spool_in). The reader's chunks at most: this, one
        # for each fetch in progress (workers + 1), two on their way to the spool and the pool's spare: 9 x 64 MiB
        "cache_bytes": 128 << 20,
        "workers": 3,  # 4: no faster with the one-pass writer, peak RSS up to 1,020 MiB (bench/stream_bench.py)
        "readahead": 2,
        "retry": RetryPolicy(
            attempts=int(number("CKPT_TOOL_HUB_ATTEMPTS", 6)), backoff_s=backoff, backoff_max_s=max(30.0, backoff)
        ),
    }


def file_sizes(ref: HubRef, commit: str, files: list[str]) -> dict[str, int]:
    """Each file's size at ``commit`` (one paths-info request for all of them)."""
    hf, _ = _hf()
    try:
        infos = hf.HfApi(token=ref.token).get_paths_info(ref.repo_id, files, revision=commit)
    except Exception as exc:
        raise network_error(ref, "cannot list the shards' sizes", exc) from None
    sizes = {i.path: i.size for i in infos if getattr(i, "size", None) is not None}
    missing = [f for f in files if f not in sizes]
    if missing:
        raise CheckpointError(
            f"{ref}: {len(missing)} file(s) named by {INDEX_NAME} are not in the repo at commit {commit[:12]}: "
            f"{', '.join(missing[:5])}; the index and the repo disagree"
        )
    return sizes


def open_hub_stream(ref: HubRef, needs: ConversionNeeds, **reader_options) -> Checkpoint:
    """A checkpoint of ``ref`` whose shards stay on the hub: config, index and serving files are downloaded to the
    HF cache as usual; every shard's header is read with one range request (the same bytes a download would give,
    so the plan and the source fingerprint equal a local conversion's); the tensors' bytes are read later, as the
    conversion asks for them, by the readers ``Checkpoint.open_bytes`` opens (``reader_options``: theirs)."""
    hf, constants = _hf()
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(
            f"{ref}: --stream reads the shards from the hub, and HF_HUB_OFFLINE is set; unset it, or drop --stream to "
            "convert from the HF cache"
        )
    commit = resolve_commit(ref)
    folder, config, weight_map = _small_files(ref, commit)
    if weight_map is None:
        raise CheckpointError(
            f"{ref}: --stream needs {INDEX_NAME} to know the shards; this repo has none — drop --stream"
        )
    files = sorted(set(weight_map.values()))
    sizes = file_sizes(ref, commit, files)
    stream = HubStream(ref, commit, sizes, **{**stream_settings(), **reader_options})
    shards = {}
    tensors: dict[str, TensorInfo] = {}
    with stream() as heads:
        for file in files:
            raw = heads.read_head(file, HEAD_BYTES)
            if len(raw) < 8:
                raise HeaderError(file, f"file is {sizes[file]} bytes, too small to be safetensors")
            header_len = int.from_bytes(raw[:8], "little")
            if 8 + header_len > sizes[file]:
                raise HeaderError(
                    file, f"header length {header_len} points past the end of the {sizes[file]}-byte file"
                )
            if 8 + header_len > len(raw):
                raw = heads.read_head(file, 8 + header_len)
            stream.headers[file] = raw[8 : 8 + header_len]
            header = parse_header(stream.headers[file], file, sizes[file], header_len)
            before = len(tensors)
            tensors.update(header.tensors)
            if len(tensors) != before + len(header.tensors):
                raise CheckpointError(f"{file}: stores a tensor another shard stores too; a tensor must be stored once")
            shards[file] = header
    if weight_map != {name: info.file for name, info in tensors.items()}:
        raise CheckpointError(
            f"{INDEX_NAME}: the index and the shards' headers disagree at commit {commit[:12]}; the repo is "
            "inconsistent"
        )
    names = needs.sources(set(weight_map), config)
    needs.check(config, {n: tensors[n] for n in names})
    return Checkpoint(
        root=folder,
        config=config,
        config_error=None,
        index_file=INDEX_NAME,
        shards=shards,
        tensors=tensors,
        remote=stream,
    )


def _open(
    folder: Path,
    weight_map: dict[str, str],
    files: list[str],
    names: set[str],
    config: V4Config,
    needs: ConversionNeeds,
) -> Checkpoint:
    if needs.partial:  # part of the repo: open just those shards, keep just those tensors
        return open_partial(folder, weight_map, files, names, config)
    return open_checkpoint(folder)  # every shard: exactly the local-folder behaviour


def snapshot_for_inspect(ref: HubRef) -> Checkpoint:
    """Offline ``inspect``: every shard header from the cached snapshot (all shards must be cached)."""
    folder = cached_snapshot(ref)
    index = folder / INDEX_NAME
    if index.is_file():
        missing = _missing(folder, sorted(set(read_index(index).values())))
        if missing:
            raise _offline_error(ref, folder, missing, "named by the index")
    return open_checkpoint(folder, need_config=False)


def hub_headers(ref: HubRef) -> tuple[dict[str, TensorInfo], V4Config | None, str | None]:
    """Tensor headers and config of a hub repo, without downloading any shard (offline: from the cache)."""
    hf, constants = _hf()
    if constants.HF_HUB_OFFLINE:
        ckpt = snapshot_for_inspect(ref)
        return ckpt.tensors, ckpt.config, ckpt.config_error
    # resolved first: get_safetensors_metadata reports a missing repo or revision as "not a safetensors repo"
    commit = resolve_commit(ref)
    tensors = metadata_tensors(ref, commit)
    config: V4Config | None = None
    config_error: str | None = None
    try:
        path = hf.hf_hub_download(ref.repo_id, "config.json", revision=commit, **ref.kw)
        config = V4Config.from_dict(json.loads(Path(path).read_text()), where=f"{ref}/config.json")
    except CheckpointError as exc:
        config_error = str(exc)
    except Exception as exc:  # network and hub errors: report, inspect can still show headers
        config_error = str(network_error(ref, "config.json could not be read", exc))
    return tensors, config, config_error
