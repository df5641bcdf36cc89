"""The plan entry point, :func:`plan_conversion`: a checkpoint's headers and config in, a
:class:`~ckpt_tool.mapping.plan.Plan` out, or a PlanError before any byte is written.

Everything that can be checked without reading tensor bytes is checked here: shapes and dtypes that agree with what
config.json implies (:mod:`ckpt_tool.checkpoint.agreement`), every source tensor matched by exactly one rule
(unknown names are an error listing them; :mod:`.grouping`), fused parts that agree, complete expert sets, TP splits
that divide at block granularity or that the profile's engine zero-pads (:mod:`.splits`), and every MTP layer present.
Each rule instance's per-rank segments come from :mod:`.rank_segments`, the output files from :mod:`.packing`.

Planning is on the interactive path (``--dry-run``, every convert and verify), so it does per-tensor work only where
it must: checks run once per rule instance, and per expert only when experts differ.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from itertools import chain

from ckpt_tool.checkpoint.agreement import require_agreement
from ckpt_tool.checkpoint.completeness import count_by_index, require_complete
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.config_keys import check_tensors
from ckpt_tool.checkpoint.engram import engram_split
from ckpt_tool.checkpoint.expert_format import formats_used, require_nvfp4_grid, require_stored_formats
from ckpt_tool.checkpoint.gc_pause import gc_paused
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping import conversions
from ckpt_tool.mapping.aliases import materialize
from ckpt_tool.mapping.grouping import (
    SourceGroup,
    check_group,
    find_uniform_stacks,
    group_ok,
    group_sources,
    in_source_order,
)
from ckpt_tool.mapping.packing import pack_files, require_one_source
from ckpt_tool.mapping.plan import Options, OutTensor, Plan, Segments, out_tensor, selects
from ckpt_tool.mapping.profiles import MTP, PROFILES, draft_kind_of, model_class_of
from ckpt_tool.mapping.rank_segments import plan_group
from ckpt_tool.mapping.splits import pad_note

DSPARK_ALIAS_NOTE = (
    "dspark: model.embed_tokens.weight and lm_head.weight hold the target's embed/head shards (vLLM replaces the "
    "draft's with the target's after loading, but its sharded loader wants the keys)"
)
DSPARK_CONTEXT_NOTE = (
    "dspark: model.context_wkv_proj holds every stage's attn.wkv a second time, as vLLM's DSpark loader duplicates it"
)
NO_MTP_NOTE = (
    "the checkpoint has no MTP layers: converted the target model only; speculative decoding needs the MTP draft "
    "from a checkpoint that includes it (convert that one with --only mtp)"
)


def plan_conversion(config: V4Config, tensors: dict[str, TensorInfo], opts: Options) -> Plan:
    """Plan converting ``tensors`` (a checkpoint's headers) under ``opts``. Raises PlanError before any write."""
    with gc_paused():  # tens of thousands of small objects, none cyclic (see checkpoint.gc_pause)
        return _plan_conversion(config, tensors, opts)


def _plan_conversion(config: V4Config, tensors: dict[str, TensorInfo], opts: Options) -> Plan:
    _require_options(opts)
    profile = PROFILES[opts.profile]
    profile.require_expert_formats(config)
    draft = profile.draft_of(config) if opts.only != "model" else draft_kind_of(config)
    series = profile.draft_series(draft, opts.vllm_series) if opts.only != "model" else None
    rules = profile.rules(config.expert_dtype, model_class_of(config), draft.rules(config, series))
    # the series stays in the plan's options (manifest, resume fingerprint) only where it changes the bytes
    opts = replace(opts, vllm_series=series if series and draft.layout_varies(profile.covers) else None)
    opts = replace(opts, nvfp4_input_scales=nvfp4_input_scales(config, opts))

    check_tensors(config, tensors)  # the keys that name layers holding tensors (config_keys)
    require_stored_formats(config, tensors)  # each block's experts in the format vLLM builds for it (expert_format)
    require_nvfp4_grid(tensors)  # NVFP4 block scales one per 16 inputs
    require_agreement(config, tensors)  # shapes and dtypes config.json implies (the experts' format too)
    complete = require_complete(config, tensors, opts.only)
    engram = engram_split(config) if selects(opts.only, "model") else None
    if engram is not None:
        engram.require(opts.tp)  # vLLM's own refusal of this tp, before any other split is looked at
    _refuse_extra_draft_layers(config, tensors, draft)

    sources = dict(tensors)
    materialized = materialize(config, tensors, sources, draft, series) if opts.only != "model" else {}

    groups, dropped, unknown = group_sources(rules, sources, config)
    if unknown:
        _refuse_unknown(unknown, sources, opts.profile)
    outputs, unused_by_selection, padded = _plan_outputs(groups, config, opts, sources)
    require_one_source(outputs)
    files = pack_files(outputs, opts)
    deviations, notes = _deviations_and_notes(config, tensors, opts, draft, series, materialized)
    if complete.mtp_waived:
        notes.insert(0, NO_MTP_NOTE)
    return Plan(
        options=opts,
        config=config,
        sources=sources,
        files=files,
        dropped=dropped,
        materialized=materialized,
        deviations=tuple(deviations),
        unused_by_selection=tuple(sorted(unused_by_selection)),
        notes=tuple(notes) + tuple(pad_note(n, per, opts.tp) for n, per in sorted(padded)),
    )


NVFP4_INPUT_SCALES = ("global", "local")
# What each --nvfp4-input-scales writes, and the vLLM NVFP4 MoE backends that hold it (fused_moe/oracle/nvfp4.py,
# 0.33.0 and 0.34.0: is_global_sf_supported_for_nvfp4_backend is true for the FlashInfer backends, the ones vLLM
# selects on Blackwell by default; ModelOptNvFp4FusedMoE.create_weights sizes w13_input_scale / w2_input_scale by the
# global expert count for them)
NVFP4_BACKENDS = {
    "global": "FlashInfer (FLASHINFER_TRTLLM, Blackwell's default; FLASHINFER_CUTLASS, FLASHINFER_CUTEDSL)",
    "local": "VLLM_CUTLASS, MARLIN, HUMMING, EMULATION",
}


def nvfp4_input_scales(config: V4Config, opts: Options) -> str | None:
    """The NVFP4 input-scale layout of the plan: the option's (default "global") where it changes the bytes (NVFP4
    experts under --moe-parallel ep), else None."""
    if opts.moe_parallel != "ep" or "nvfp4" not in formats_used(config):
        return None
    chosen = opts.nvfp4_input_scales or "global"
    if chosen not in NVFP4_INPUT_SCALES:
        raise PlanError(f"--nvfp4-input-scales must be 'global' or 'local', got {chosen!r}")
    return chosen


def _require_options(opts: Options) -> None:
    if opts.tp < 1:
        raise PlanError(f"--tp must be >= 1, got {opts.tp}")
    if opts.moe_parallel not in ("tp", "ep"):
        raise PlanError(f"--moe-parallel must be 'tp' or 'ep', got {opts.moe_parallel!r}")
    if opts.profile not in PROFILES:
        raise PlanError(f"unknown target profile {opts.profile!r}; known: {', '.join(PROFILES)}")


def _refuse_extra_draft_layers(config: V4Config, tensors: dict[str, TensorInfo], draft) -> None:
    """Draft layers in the checkpoint past the count config.json gives are an error, not silently dropped."""
    mtp_present = set(count_by_index(tensors, "mtp."))
    extra_mtp = sorted(i for i in mtp_present if i >= config.draft_layers)
    if extra_mtp:
        key = "num_nextn_predict_layers" if draft is MTP else "n_mtp_layers (default 3)"
        raise PlanError(
            f"checkpoint has {draft.layer_word}(s) {extra_mtp} but config.json {key} gives "
            f"{config.draft_layers}; fix the config or remove the extra tensors"
        )


def _refuse_unknown(unknown: list[str], sources: dict[str, TensorInfo], profile: str) -> None:
    """Source tensors no rule of ``profile`` matches: an error naming the first and up to five more."""
    unknown.sort()
    first, rest = unknown[0], unknown[1:]
    also = ""
    if rest:
        shown = ", ".join(f"{n!r} (in {sources[n].file})" for n in rest[:5])
        also = f" (nor do {len(rest)} more: {shown}{', ...' if len(rest) > 5 else ''})"
    raise PlanError(
        f"{sources[first].file}: tensor {first!r}: matches no rule of profile {profile!r}{also}; is this a "
        "DeepSeek V4 checkpoint in DeepSeek's own names? Convert the original checkpoint, or remove the extra "
        "tensors"
    )


Outputs = dict[tuple[str, int], list[tuple[tuple, OutTensor]]]  # (component, rank) -> (sort key, tensor)s


def _plan_outputs(
    groups: list[SourceGroup], config: V4Config, opts: Options, sources: dict[str, TensorInfo]
) -> tuple[Outputs, list[str], set[tuple[int, int]]]:
    """Every rank's output tensors of every group (checked first), the sources a component ``--only`` skips
    would have consumed, and (size, per-rank size) of every weight split zero-padded."""
    uniform_stacks = find_uniform_stacks(groups)
    padded: set[tuple[int, int]] = set()
    outputs: Outputs = defaultdict(list)
    unused_by_selection: list[str] = []
    for g in groups:
        if not group_ok(g, config):
            check_group(in_source_order(g, sources), config)  # raises, naming parts in checkpoint order
            g.names = g.infos = None  # passed the full check after all: plan it without the shortcuts
        rule = g.rule
        names = {**g.bind, "spec": config.num_hidden_layers + g.bind.get("mtp", 0)}
        target = rule.target.format(**names)  # type: ignore[union-attr]
        if g.names is not None:  # (expert, idx) order without sorting: names[idx][expert]
            srcs = tuple(chain.from_iterable(zip(*g.names)))
        else:
            srcs = tuple(g.parts[k].name for k in sorted(g.parts, key=lambda k: (k[1] or 0, k[0])))
        if not selects(opts.only, rule.component):
            unused_by_selection.extend(srcs)
            continue
        first = next(iter(g.parts.values()))
        dtype = conversions.out_dtype(first.dtype, rule.convert)
        rule_id = rule.id  # (a property formatted each time: once a group, not once a rank)
        for rank, (shape, segs, head, zeros) in enumerate(
            plan_group(g, config, opts, sources, srcs, uniform_stacks, padded)
        ):
            info = sources[head]
            read = segs.names if isinstance(segs, Segments) else srcs  # under ep a rank reads its own experts only
            outputs[(rule.component, rank)].append(
                ((info.file, info.start, target), out_tensor(target, dtype, shape, segs, rule_id, read, zeros))
            )
    return outputs, unused_by_selection, padded


def _deviations_and_notes(
    config: V4Config, tensors: dict[str, TensorInfo], opts: Options, draft, series, materialized: dict[str, str]
) -> tuple[list[str], list[str]]:
    """What the plan does differently from vLLM's stock loaders (deviations), and what the user should know."""
    deviations: list[str] = []
    notes: list[str] = []
    if materialized and draft is MTP:
        deviations.append(
            "materialized "
            + ", ".join(f"{a} from {r}" for a, r in sorted(materialized.items()))
            + " (vLLM's stock loaders leave them uninitialised; its sharded loader needs the keys)"
        )
    elif materialized:
        notes.append(DSPARK_ALIAS_NOTE)
        if draft.holds_context_wkv(series):
            notes.append(DSPARK_CONTEXT_NOTE)
    if opts.vllm_series:
        notes.append(series_note(draft, opts.vllm_series, PROFILES[opts.profile].covers))
    if opts.nvfp4_input_scales:
        other = "local" if opts.nvfp4_input_scales == "global" else "global"
        notes.append(
            f"NVFP4 experts under ep: input scales written {opts.nvfp4_input_scales} ("
            + ("every expert's on each rank" if other == "local" else "each rank's own experts'")
            + f"), the layout of vLLM's NVFP4 MoE backends {NVFP4_BACKENDS[opts.nvfp4_input_scales]}; for "
            f"{NVFP4_BACKENDS[other]} convert with --nvfp4-input-scales {other}"
        )
    if config.expert_dtype == "fp8" and any(t.dtype == "F8_E8M0" and ".experts." in n for n, t in tensors.items()):
        deviations.append(
            "fp8 routed-expert E8M0 scales written as float32 2^(b-127) (the seed and vLLM 0.33's stock loader store "
            "the raw byte b as a number: vLLM #51946, #43416)"
        )
    return deviations, notes


def series_note(draft, series: str, covers: tuple[str, ...]) -> str:
    """The plan's note on a draft written for one vLLM series of the several its profile covers."""
    holds = draft.holds_context_wkv(series)
    others = [c for c in covers if draft.holds_context_wkv(c) != holds]
    return (
        f"{draft.component}: written for vLLM {series}, whose {draft.architecture} "
        f"{'holds' if holds else 'has no'} model.context_wkv_proj; for vLLM {', '.join(others)} convert with "
        f"--vllm {others[0]}"
    )
