"""What a target profile is: one engine layout, as data, and the vLLM releases it is verified against.

A profile holds, in one place, every statement ckpt-tool makes about one engine layout:

- how the base rule table (:mod:`ckpt_tool.mapping.rules`) changes for it: target renames, dtype conversions,
  splits the engine zero-pads (``renames``, ``converts``, ``pads``) — what convert writes;
- where the engine keeps the modules whose names move between layouts, and its parameter dtypes
  (``engine``, an :class:`EngineNames`) — what verify holds the output against (:mod:`ckpt_tool.mapping.engine_table`)
  and the names the numeric level reads (:mod:`ckpt_tool.verify.forward_names`);
- the vLLM ``major.minor`` series ``--target auto`` picks it for (``covers``) and the exact releases
  whose own model classes and sharded loader the engine test runs on its output (``verified``).

The two descriptions of one layout (rules and engine names) are written independently, so a typo in
one makes them disagree; ``tests/test_profile_consistency.py`` holds them equal for every profile, and
the engine test holds the engine names against each verified vLLM release's own classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ckpt_tool.checkpoint.expert_format import MOE_QUANT_KEY, formats_used
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.profiles.draft_kind import DraftKind, draft_kind_of
from ckpt_tool.mapping.profiles.model_class import TEXT, ModelClass
from ckpt_tool.mapping.profiles.series import series_of, series_text
from ckpt_tool.mapping.rules import Rule


@dataclass(frozen=True)
class ConvertOverride:
    """A profile's dtype for targets whose base name ends with ``.{tail}`` (only for ``expert_dtype``, if set)."""

    tail: str
    convert: str
    expert_dtype: str | None = None
    why: str = ""


@dataclass(frozen=True)
class EngineNames:
    """Where one engine layout keeps the modules whose names move between layouts, and its dtypes."""

    compressor: str  # attention compressor of compressed layers
    gate: str  # router: weight, e_score_correction_bias, tid2eid
    shared: str  # shared experts: gate_up_proj, down_proj
    routed: str  # routed experts: w13_*, w2_*
    tid2eid: str | None  # dtype of the hash table (None: as stored)
    fp8_expert_linear_scale: str | None  # linear scale dtype when experts are fp8 (None: as stored)
    fp4_expert_linear_scale: str | None  # ... when experts are fp4
    shared_pad: bool = False  # block-FP8 shared experts get cdiv(blocks, tp) 128-blocks a rank (zero-padded)


@dataclass(frozen=True)
class Profile:
    """A target profile (see the module docstring).

    ``renames`` map a run of whole dot-separated segments of a target name to another (first entry
    found in the name wins, applied once). ``converts`` change the element conversion of targets by
    their base-name tail. ``pads`` are runs of whole segments of a source name whose rules' TP split the
    engine zero-pads to whole quantization blocks per rank (where the blocks do not divide tp) instead
    of refusing it. ``aliases`` are earlier names of the profile that keep working on the command line
    and in manifests written by earlier versions.
    """

    name: str
    description: str
    build: Callable[[str], list[Rule]]  # the base rule table, by expert_dtype
    engine: EngineNames
    renames: tuple[tuple[str, str], ...] = ()
    converts: tuple[ConvertOverride, ...] = ()
    pads: tuple[str, ...] = ()
    covers: tuple[str, ...] = ()
    verified: tuple[str, ...] = ()
    verified_by: str = ""
    notes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    drafts: tuple[str, ...] = ("mtp",)  # the draft kinds (draft_kind.DRAFT_KINDS) this engine layout builds
    models: tuple[str, ...] = ("text", "vision")  # the model classes (model_class.MODEL_CLASSES) it builds
    # the formats of routed experts (ckpt_tool.checkpoint.expert_format.EXPERT_FORMATS) its engine builds
    expert_formats: tuple[str, ...] = ("mxfp4", "fp8")

    def require_expert_formats(self, config) -> None:
        """PlanError when ``config``'s routed experts come in a format this layout's engine does not build."""
        used = formats_used(config)
        unknown = [f for f in used if f not in self.expert_formats]
        if unknown:
            raise PlanError(
                f"config.json describes {', '.join(unknown)} routed experts ({MOE_QUANT_KEY} "
                f"{config.moe_quant.algo!r}), which profile {self.name!r} does not build (its engine builds: "
                f"{', '.join(self.expert_formats)}); convert with a profile whose vLLM serves them (ckpt-tool profiles)"
            )

    def draft_of(self, config) -> DraftKind:
        """The draft kind of ``config``; PlanError when this layout's engine does not build it."""
        kind = draft_kind_of(config)
        if kind.name not in self.drafts:
            raise PlanError(
                f"config.json describes a {kind.name} draft ({kind.architecture}), which profile {self.name!r} "
                f"does not build (its engine builds: {', '.join(self.drafts)}); convert with a profile whose vLLM "
                "serves it (ckpt-tool profiles), or with --only model"
            )
        return kind

    def draft_series(self, kind: DraftKind, requested: str | None) -> str | None:
        """The vLLM series (``"0.34"``) whose parameters ``kind`` is written with: of the series this profile covers,
        the newest not newer than ``requested`` (a version or series; None: the newest covered). PlanError when
        ``requested`` is older than every covered series and the draft's parameters differ between them. None for a
        profile that covers no series."""
        covered = sorted((s for s in map(series_of, self.covers) if s is not None), reverse=True)
        if not covered:
            return None
        if requested is None:
            return series_text(covered[0])
        want = series_of(requested)
        if want is None:
            raise PlanError(f"--vllm {requested!r}: not a vLLM version (e.g. 0.34 or 0.34.1)")
        fits = [s for s in covered if s <= want]
        if not fits:
            if not kind.layout_varies(self.covers):
                return series_text(covered[-1])
            raise PlanError(
                f"--vllm {requested}: profile {self.name!r} covers vLLM {', '.join(self.covers)}, and its "
                f"{kind.architecture} differs between them; pass one of those series"
            )
        return series_text(fits[0])

    def rules(
        self, expert_dtype: str, model_class: ModelClass = TEXT, draft_rules: list[Rule] | None = None
    ) -> list[Rule]:
        """This layout's rule table for ``model_class`` (the text model unless given) and its draft (the classic
        MTP unless ``draft_rules`` are given): the class's block rules go through the profile's renames like the
        base table's, then the target model's keys get the class's prefix; the class's own rules (the vision tower)
        are added as they are. Another draft kind's rules (:meth:`DraftKind.rules`) replace the classic MTP rules
        (the vision class's MTP ones too) and go through the renames like them."""
        out = []
        if model_class.name not in self.models:
            raise PlanError(
                f"profile {self.name!r} does not build {model_class.architecture} (its engine builds: "
                f"{', '.join(self.models)}); convert with a profile whose vLLM serves it (ckpt-tool profiles)"
            )
        build = model_class.base_rules or self.build
        base = [*build(expert_dtype), *model_class.block_rules()]
        if draft_rules is not None:
            base = [r for r in base if r.component != "mtp"] + draft_rules
        for rule in base:
            rule = override_convert(rule, self.converts, expert_dtype)
            if any(_segment_run(src, run) >= 0 for src in rule.sources for run in self.pads):
                rule = replace(rule, pad=True)
            rule = rename_target(rule, self.renames)
            if model_class.target_prefix and rule.component == "model" and rule.target is not None:
                rule = replace(rule, target=model_class.target_prefix + rule.target)
            out.append(rule)
        return out + model_class.extra_rules()

    @property
    def newest_series(self) -> tuple[int, int] | None:
        """The newest vLLM series this profile covers, as (major, minor); None when it covers none."""
        parsed = [series_of(c) for c in self.covers]
        return max((p for p in parsed if p is not None), default=None)


def _segment_run(name: str, run: str) -> int:
    """Index in ``name`` where the whole-segment run ``run`` starts, or -1."""
    return f".{name}.".find(f".{run}.")  # the leading dot shifts by one: the index is the run's start in name


def rename_target(rule: Rule, renames: tuple[tuple[str, str], ...]) -> Rule:
    """``rule`` with the first whole-segment run of its target found in ``renames`` replaced."""
    if rule.target is None:
        return rule
    for run, new in renames:
        at = _segment_run(rule.target, run)
        if at >= 0:
            return replace(rule, target=rule.target[:at] + new + rule.target[at + len(run) :])
    return rule


def override_convert(rule: Rule, converts: tuple[ConvertOverride, ...], expert_dtype: str) -> Rule:
    if rule.target is None:
        return rule
    for c in converts:
        if (c.expert_dtype in (None, expert_dtype)) and (rule.target == c.tail or rule.target.endswith("." + c.tail)):
            return replace(rule, convert=c.convert)
    return rule
