"""Reading a many-shard checkpoint's headers with forked helpers (inspect, and opening a source to plan).

A full V4 checkpoint has 46 shard headers holding 69k-145k entries: parsing them is most of what
``inspect`` and ``convert --dry-run`` cost. :func:`read_shards_forked` lets helpers (one per spare CPU,
at most 3) take shards from a shared queue at once, while this process reads the config and the index
(and does whatever ``on_index`` asks with it), then takes shards too until none are left.

It only ever answers for a checkpoint it can prove consistent: an index naming exactly the folder's
shards, every header readable, and every stored tensor placed where the index says (checked by a
digest each process adds its shards to, :func:`index_digest`). Anything else returns None, and the
caller's serial path gives the same answer or words the error: a helper never decides an outcome.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.index import read_index
from ckpt_tool.checkpoint.paths import load_config, resolve_layout
from ckpt_tool.errors import CkptToolError
from ckpt_tool.processes import TaskQueue, can_fork, helpers, usable_cpus

# Shards a checkpoint needs before helpers pay for themselves (a fork and hand-back cost ~10 ms).
FORK_MIN_FILES = 8
MAX_HELPERS = 3

Read = Callable[[Path, str], tuple[Any, list[str]]]  # (root, file) -> (what the caller wants, the file's tensor names)


@dataclass(frozen=True)
class ForkedRead:
    """What :func:`read_shards_forked` read: config, index, and one value per shard in file order."""

    root: Path
    index_file: str
    config: V4Config | None
    config_error: str | None
    weight_map: dict[str, str]  # its names are exactly the stored names, each placed where it is stored
    files: list[str]
    values: list[Any]
    on_index: Any  # what the ``on_index`` callback returned


def read_shards_forked(
    src: str | Path,
    read: Read,
    *,
    need_config: bool,
    wire: Callable[[Any], Any] = lambda value: value,
    unwire: Callable[[Any], Any] = lambda value: value,
    on_index: Callable[[V4Config | None, dict[str, str]], Any] | None = None,
    on_own: Callable[[Any], Any] | None = None,
) -> ForkedRead | None:
    """``read(root, file)`` for every shard of ``src``, shared with forked helpers; None: read serially.

    ``wire`` turns a helper's value into builtins for ``marshal`` and ``unwire`` back. ``on_index`` runs
    in this process with the config and the index's weight map while the helpers parse (its result is
    valid once this function returns a result: the index's names are then the stored ones). ``on_own`` runs
    on each value this process read itself, once the queue is empty and before it waits for the helpers to
    finish theirs: work every value needs afterwards, done while this process would otherwise wait.
    """
    try:
        root, index_path, explicit = resolve_layout(Path(src))
    except CkptToolError:
        return None
    files = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    if index_path is None or explicit is not None or not FORK_MIN_FILES <= len(files) <= TaskQueue.LIMIT:
        return None
    if not can_fork() or usable_cpus() < 2 or not hashes_keyed_at_random():
        return None  # see index_digest
    try:
        queue = TaskQueue(len(files))
    except OSError:  # out of file descriptors: no helpers
        return None
    try:
        with queue, helpers(min(usable_cpus() - 1, MAX_HELPERS), _take, root, files, queue, read, wire) as children:
            config, config_error = load_config(root, need_config=need_config)
            weight_map = read_index(index_path)
            if sorted(set(weight_map.values())) != files:
                return None  # the serial path reads the files the index names, and says which are missing
            early = on_index(config, weight_map) if on_index is not None else None
            indexed = index_digest(weight_map, files)
            done = _take(root, files, queue, read, None)
            if on_own is not None:
                for _i, value, _count, _digest in done:
                    on_own(value)
            for child in children:
                theirs = child.result()
                if theirs is None:
                    return None
                done += [(i, unwire(value), count, digest) for i, value, count, digest in theirs]
    except CkptToolError:
        return None
    done.sort(key=lambda item: item[0])
    if [item[0] for item in done] != list(range(len(files))):
        return None  # pragma: no cover (every file is taken once; a lost one means no answer from here)
    if sum(item[2] for item in done) != len(weight_map) or sum(item[3] for item in done) != indexed:
        return None  # a tensor stored twice, or the index and the headers disagree: the serial path says which
    return ForkedRead(root, index_path.name, config, config_error, weight_map, files, [item[1] for item in done], early)


def _take(root: Path, files: list[str], queue: TaskQueue, read: Read, wire: Callable[[Any], Any] | None) -> list[tuple]:
    """The files this process gets from ``queue``: (file number, value, tensor count, placement digest)
    each; in a helper (``wire`` given) the value as builtins, for marshal."""
    out = []
    for i in queue.take():
        value, names = read(root, files[i])
        out.append((i, value if wire is None else wire(value), len(names), placement_digest(files[i], names)))
    return out


def placement_digest(file: str, names: Iterable[str]) -> int:
    """What the tensors stored in ``file`` add to a placement digest (see :func:`index_digest`)."""
    return _file_key(file) * sum(map(hash, names))


def index_digest(weight_map: dict[str, str], files: Iterable[str] | None = None) -> int:
    """Sum over tensors of ``hash(tensor) * key(file)``: equal to the sum of :func:`placement_digest` over
    the shards (with equal counts) when the index places every stored tensor where it is stored, without
    looking up in the index 145k names that other processes parsed.

    The sum is order-free, so each process adds its own shards. ``hash`` of a str is keyed by a random
    per-process secret (helpers are forked: they share it), and each file's key is an odd number drawn
    from it. A misplaced tensor changes the sum by h(tensor) x (difference of two file keys), two tensors
    trading files by (h(a) - h(b)) x (difference of keys): zero only by a 2^-64 chance, and not something
    an input can be built for; with a fixed PYTHONHASHSEED this path is not used
    (:func:`hashes_keyed_at_random`). (A sum of ``hash((tensor, file))`` is not enough: tuple hashing is
    nearly additive, and a swap cancelled out in about one case in four.) A tensor stored in two files
    shows up in the counts: the index places it once. ``files``: the index's files, when already known
    (every value of ``weight_map`` must be among them).
    """
    keys = {file: _file_key(file) for file in (set(weight_map.values()) if files is None else files)}
    # summed a run of entries in one file at a time (an index lists each file's tensors together): one product a
    # run, not one a tensor (145k 128-bit products took a fifth of reading V4-Pro's index)
    runs = groupby(weight_map.items(), _FILE)
    return sum(keys[file] * sum(map(hash, map(_NAME, run))) for file, run in runs)


_NAME, _FILE = itemgetter(0), itemgetter(1)  # of a weight map's (tensor, file) items


def _file_key(file: str) -> int:
    return hash(file) | 1  # odd: a multiple of it is zero only when the other factor is


def hashes_keyed_at_random() -> bool:
    """Whether str hashes use this process's random secret (not PYTHONHASHSEED=0 or another fixed seed)."""
    seed = "random" if sys.flags.ignore_environment else os.environ.get("PYTHONHASHSEED", "random")
    return bool(sys.flags.hash_randomization) and seed in ("", "random")
