"""Plan, then select: the conversion's plan and the part of it one run handles (``--ranks``, ``--shard-index K
--shard-count M``), the one call that ``convert``, its dry run, ``verify`` and ``unconvert`` make.

Deterministic: the selection depends only on the plan, so every machine of a scale-out computes the same one,
and the shards of one rank selection are disjoint and together cover it exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import UsageError
from ckpt_tool.mapping.plan import Options, OutFile, Plan
from ckpt_tool.mapping.planner import plan_conversion


@dataclass(frozen=True)
class PlannedRun:
    """One run's share of a conversion: ``whole`` (every planned file; its options as the plan settled them, which
    the run's fingerprint records), ``covered`` (the files of the rank selection: what the manifest and index
    describe) and ``part`` (the files this run writes: ``covered``'s files ``i % M == K``)."""

    whole: Plan
    covered: Plan
    part: Plan


def plan_run(
    config: V4Config,
    tensors: dict[str, TensorInfo],
    opts: Options,
    *,
    ranks: Sequence[int] | None = None,
    shard: tuple[int, int] = (0, 1),
) -> PlannedRun:
    """Plan the conversion of ``tensors`` for ``opts`` (raises before anything is read or written), then select the
    files of ``ranks`` (all if None) and of that selection the scale-out part ``shard`` (index, count)."""
    whole = plan_conversion(config, tensors, opts)
    covered = whole if ranks is None else replace(whole, files=tuple(select_files(whole, ranks)))
    part = covered if shard == (0, 1) else replace(whole, files=tuple(select_files(whole, ranks, *shard)))
    return PlannedRun(whole, covered, part)


def parse_ranks(text: str, tp: int | None = None) -> tuple[int, ...]:
    """``"0,3-5"`` → ``(0, 3, 4, 5)``; with ``tp``, every rank below it. Raises UsageError on anything else."""
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UsageError(f"--ranks {text!r}: {part!r} is not a rank or a range like 3-5")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UsageError(f"--ranks {text!r}: range {part!r} ends before it starts")
        ranks.update(range(lo, hi + 1))
    if tp is not None and (bad := sorted(r for r in ranks if r >= tp)):
        raise UsageError(f"--ranks {text}: rank(s) {', '.join(map(str, bad))} outside 0..{tp - 1} for --tp {tp}")
    return tuple(sorted(ranks))


def select_files(
    plan: Plan, ranks: Sequence[int] | None = None, shard_index: int = 0, shard_count: int = 1
) -> list[OutFile]:
    """The planned files of ``ranks`` (all if None), then every ``shard_count``-th of them from ``shard_index``."""
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise UsageError(f"--shard-index {shard_index} --shard-count {shard_count}: need 0 <= K < M")
    if ranks is not None:
        bad = sorted(r for r in ranks if not 0 <= r < plan.options.tp)
        if bad:
            raise UsageError(
                f"--ranks {', '.join(map(str, bad))} outside 0..{plan.options.tp - 1} (tp={plan.options.tp})"
            )
        chosen = set(ranks)
        files = [f for f in plan.files if f.rank in chosen]
    else:
        files = list(plan.files)
    return [f for i, f in enumerate(files) if i % shard_count == shard_index]
