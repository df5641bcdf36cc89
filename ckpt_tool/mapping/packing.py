"""Packing output tensors into output files: one source per output name and rank, then greedy parts of at most
``max_shard_size``, in source byte order."""

from __future__ import annotations

from operator import attrgetter, itemgetter

from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.plan import Options, OutFile, OutTensor

_KEY, _TENSOR, _NAME = itemgetter(0), itemgetter(1), attrgetter("name")  # of outputs' (sort key, tensor) items


def require_one_source(outputs: dict[tuple[str, int], list[tuple[tuple, OutTensor]]]) -> None:
    """Every output tensor of a rank made by one rule instance: a DSpark head-stack tensor shipped by two stages
    (vLLM's loader keeps whichever it reads last) is refused, naming both."""
    for (component, _rank), items in outputs.items():
        if len(set(map(_NAME, map(_TENSOR, items)))) == len(items):
            continue  # (the usual case, at C speed: 35k tensors in a V4-Pro plan at tp 16)
        seen: dict[str, OutTensor] = {}
        for _key, t in items:
            if t.name in seen:
                a, b = seen[t.name].sources[0], t.sources[0]
                raise PlanError(
                    f"{component}/{t.name} would be written from both {a!r} and {b!r}; vLLM's loader keeps whichever "
                    "it reads last: remove the copy the checkpoint should not have"
                )
            seen[t.name] = t


def pack_files(outputs: dict[tuple[str, int], list[tuple[tuple, OutTensor]]], opts: Options) -> tuple[OutFile, ...]:
    """Greedy packing into parts of at most max_shard_size (a bigger tensor gets a part of its own).

    Tensors are ordered by where their first source byte lies (file, offset, then name), so the writer
    reads sources mostly sequentially.
    """
    files: list[OutFile] = []
    for component, rank in sorted(outputs):
        ts = list(map(_TENSOR, sorted(outputs[(component, rank)], key=_KEY)))
        part: list[OutTensor] = []
        size = 0
        n = 0
        for t in ts:
            nbytes = t.nbytes  # a property computed each time (see OutTensor.nbytes): once a tensor here
            if part and size + nbytes > opts.max_shard_size:
                files.append(OutFile(component, rank, n, tuple(part)))
                n += 1
                part, size = [], 0
            part.append(t)
            size += nbytes
        if part:
            files.append(OutFile(component, rank, n, tuple(part)))
    return tuple(files)
