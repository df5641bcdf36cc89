"""What a conversion needs from a hub repo, answered from the index alone: the source tensors whose bytes it reads,
and the plan check once headers are in (:class:`HubNeeds`, the planner side of
``ckpt_tool.checkpoint.hub.ConversionNeeds``)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.aliases import wanted_aliases
from ckpt_tool.mapping.grouping import MTP_RE, match_rule
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.mapping.profiles import PROFILES, model_class_of


def needed_sources(names: list[str] | set[str], config: V4Config, opts: Options) -> set[str]:
    """Source tensor names (from an index: no headers needed) whose bytes a conversion under ``opts`` reads.

    Used to fetch only part of a hub checkpoint. ``--only mtp`` needs the tensors of the MTP rules plus
    the ones materialized aliases copy (embed/head when the checkpoint has no MTP embedding/head);
    tensors a rule drops are not needed. Anything else (``--only model`` or both) needs every tensor:
    the plan checks that every MTP layer is present, so even ``--only model`` reads MTP headers.
    """
    if opts.profile not in PROFILES:
        raise PlanError(f"unknown target profile {opts.profile!r}; known: {', '.join(PROFILES)}")
    names = set(names)
    if opts.only != "mtp":
        return names
    profile = PROFILES[opts.profile]
    draft = profile.draft_of(config)
    series = profile.draft_series(draft, opts.vllm_series)
    rules = profile.rules(config.expert_dtype, model_class_of(config), draft.rules(config, series))
    keep: set[str] = set()
    for name in names:
        hit = match_rule(rules, name)
        if hit is None:
            if MTP_RE.match(name):
                keep.add(name)  # an unknown MTP tensor: kept so the plan reports it
        elif hit[0].kind != "drop" and hit[0].component != "model":
            keep.add(name)
    keep.update(real for real in wanted_aliases(config, names, draft, series).values() if real in names)
    return keep


@dataclass(frozen=True)
class HubNeeds:
    """The planner's answers to the hub input (``ckpt_tool.checkpoint.hub.ConversionNeeds``) for ``opts``."""

    opts: Options

    @property
    def partial(self) -> bool:
        return self.opts.only == "mtp"

    def sources(self, names: set[str], config: V4Config) -> set[str]:
        return needed_sources(names, config, self.opts)

    def check(self, config: V4Config, tensors: dict[str, TensorInfo]) -> None:
        plan_conversion(config, tensors, self.opts)
