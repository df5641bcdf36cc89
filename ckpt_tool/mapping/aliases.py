"""The aliases a draft's rules read: source names the checkpoint may not hold, made from a real tensor of it (the
classic MTP's own embedding/head, every alias of another draft kind), so the plan can gather from them."""

from __future__ import annotations

from collections.abc import Container

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.profiles import MTP
from ckpt_tool.mapping.rules import MATERIALIZE


def wanted_aliases(config: V4Config, have: Container[str], draft, series: str | None) -> dict[str, str]:
    """Alias → real source tensor for every alias the draft's rules read: the classic MTP's embedding/head where
    ``have`` (the checkpoint's names) lacks them, every alias of another draft kind."""
    if draft is not MTP:
        return draft.aliases(config, series)
    wanted: dict[str, str] = {}
    for i in range(config.draft_layers):
        for alias_pat, real in MATERIALIZE.items():
            alias = alias_pat.format(mtp=i)
            if alias not in have and not (alias.endswith("emb.tok_emb.weight") and i > 0):
                wanted[alias] = real
    return wanted


def materialize(
    config: V4Config, tensors: dict[str, TensorInfo], sources: dict[str, TensorInfo], draft, series: str | None
) -> dict[str, str]:
    """Add to ``sources`` the aliases the draft's rules read (see :func:`wanted_aliases`); returns alias → real
    source tensor. Raises PlanError when the real tensor is missing too."""
    wanted = wanted_aliases(config, tensors, draft, series)
    for alias, real in wanted.items():
        if real not in tensors:
            raise PlanError(f"{alias} is missing and cannot be materialized: {real} is not in the checkpoint either")
        r = tensors[real]
        sources[alias] = TensorInfo(alias, r.dtype, r.shape, r.file, r.start, r.end)
    return wanted
