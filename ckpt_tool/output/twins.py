"""Tensors a file shares byte for byte with a file written before it in the same run: taken from that file, not the
source, where the source is streamed.

A classic MTP draft's files hold its own copy of the target's embedding and head (the draft model's parameters, as
planned in ``ckpt_tool/mapping``); DeepSeek's V4 checkpoints store them once (the draft's names, where present, are
aliases of the same bytes), and a rank of the draft cuts exactly the rows the same rank of the target cut. A
streamed conversion writes the target's rank group first, then the draft's: reading those tensors from the source
again meant keeping 2 GiB of V4-Flash's source (the embedding and the head) in the stream's spool on local disk
between the two groups. The bytes are already in the target's files just written.

Two output tensors are twins when they have the same dtype and shape and the same segments of the same source bytes
(an alias resolved to the bytes it names): their bytes are equal by construction. Only files of an earlier rank
group of this run count (``convert._write_in_lockstep`` writes the groups one after the other, each finished before
the next starts): a file an earlier run left is not read back here, whatever happened to it since.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.mapping.plan import OutFile, OutTensor
from ckpt_tool.output.writer import header_bytes


@dataclass(frozen=True)
class Twin:
    """Where the bytes of a tensor already are: file ``relpath`` of OUT, from absolute byte ``offset``."""

    relpath: str
    offset: int


def _identity(t: OutTensor, sources: dict[str, TensorInfo]) -> tuple:
    """What makes ``t``'s bytes: its dtype, shape and each segment over the source bytes it names (not the name)."""
    segments = []
    for s in t.segments:
        info = sources.get(s.src)  # (None for a run of zeros: ZERO names no source)
        src = (s.src,) if info is None else (info.file, info.start, info.dtype, tuple(info.shape))
        segments.append((src, s.row0, s.row1, s.col0, s.col1, s.convert, s.pad, s.repeat))
    return (t.dtype, tuple(t.shape), tuple(segments))


def find_twins(groups: Sequence[Sequence[OutFile]], sources: dict[str, TensorInfo]) -> dict[tuple[str, str], Twin]:
    """(relpath, tensor name) -> its twin in a file of an earlier group of ``groups`` (written in this order)."""
    seen: dict[tuple, Twin] = {}
    twins: dict[tuple[str, str], Twin] = {}
    for group in groups:
        found: dict[tuple, Twin] = {}
        for f in group:
            offset = len(header_bytes(f))
            for t in f.tensors:
                key = _identity(t, sources)
                if key in seen:
                    twins[f.relpath, t.name] = seen[key]
                else:
                    found.setdefault(key, Twin(f.relpath, offset))
                offset += t.nbytes
        for key, twin in found.items():  # (a group's own files are written at once: none can lend to another)
            seen.setdefault(key, twin)
    return twins


def twins_of(out: OutFile, twins: dict[tuple[str, str], Twin]) -> dict[str, Twin]:
    """The tensors of ``out`` that have a twin, by name."""
    return {t.name: twins[out.relpath, t.name] for t in out.tensors if (out.relpath, t.name) in twins}
