"""The name mapping, as data: the base table of rules every target profile starts from.

What one engine release does differently (renamed modules, parameter dtypes, zero padding) is a
profile's data, one module per profile in :mod:`ckpt_tool.mapping.profiles`.

A rule maps one or more source tensors (DeepSeek's names, with placeholders ``{layer}``, ``{mtp}``,
``{expert}``, ``{vblock}`` = a vision tower block) to one output tensor (the engine's parameter name,
with those placeholders and ``{spec}`` = num_hidden_layers + mtp). Patterns compile to anchored regexes
over whole dot-separated segments, so a rule can never hit a substring of another name (the seed loader's
``name.replace(".norm.weight", ...)`` style is exactly what this avoids; "the seed" is the ``vllm-seed`` profile's
loader, docs/profiles.md#the-seed).

Rule kinds:
- ``Rename``: one source, one output (plus a TP split).
- ``Fuse``: several sources concatenated on dim 0 in the given order (wq_a|wkv, w1|w3, wkv|wgate).
- ``StackExperts``: per-expert sources (``{expert}`` = 0..E-1) stacked into one [E, ...] tensor, each
  expert's parts concatenated on dim 0 first (w1|w3 → w13).
- ``Drop``: a source deliberately not written (recorded in the plan).

``Rename`` takes two options the vision tower needs: ``sections`` (one tensor fused on disk, split per
section) and ``replicate_unless`` (a split that applies only when tp divides a config value).

Conversions (``convert``): ``copy`` keeps the stored dtype and bytes; ``raw_uint8`` writes the same
bytes as U8 (the seed's ``.view(torch.uint8)`` for fp4 experts and their E8M0 scales); ``e8m0_to_f32``
writes ``2^(b-127)`` as F32 (E8M0 scales landing in a float32 parameter — the seed would store ``b``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum

from ckpt_tool.checkpoint.expert_format import FP8, MXFP4, NVFP4, ExpertFormat


class Split(str, Enum):
    """How a tensor is divided over tensor-parallel ranks (as vLLM's parallel layers divide it:
    vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py)."""

    REPLICATE = "replicate"
    DIM0 = "dim0"  # column parallel / vocab parallel / attn_sink heads: contiguous rows chunk r
    DIM1 = "dim1"  # row parallel: input columns chunk r
    EXPERTS = "experts"  # routed experts: tp → per-expert row (w13) or column (w2) chunk; ep → whole experts
    # an Engram table: rows by hash head, rank r the buckets of its heads (ckpt_tool.checkpoint.engram), uneven
    ENGRAM = "engram"


@dataclass(frozen=True)
class Rule:
    kind: str  # rename | fuse | stack | drop
    sources: tuple[str, ...]
    target: str | None
    split: Split = Split.REPLICATE
    convert: str = "copy"
    component: str = "model"  # model | mtp: which output folder the tensor goes to
    note: str = ""
    # for Split.EXPERTS under --moe-parallel tp: 0 = w13 rows, 1 = w2 inputs, None = every expert's whole (a value per
    # expert and projection, as NVFP4's global scales)
    expert_split_dim: int | None = 0
    # Split.EXPERTS under --moe-parallel ep: every rank holds every expert's, where the plan's NVFP4 MoE backend keeps
    # them all (Options.nvfp4_input_scales "global"), not only its own
    global_experts: bool = False
    when_mtp: str | None = None  # None | "first" | "rest": restrict an MTP rule to mtp.0 or mtp.1..
    # the engine zero-pads this TP split up to whole 128-blocks per rank where the blocks do not divide tp
    # (set by the profile, see Profile.pads); otherwise such a split is refused
    pad: bool = False
    # Split.DIM0 of one tensor fused on disk from ``sections`` equal row blocks (q|k|v, gate|up): each section is
    # split over tp and rank r holds its chunk of every section, in order (vLLM's QKVParallelLinear /
    # MergedColumnParallelLinear loading a whole fused tensor, shard_id None)
    sections: int = 1
    # the config key tp must divide for the split to apply; otherwise every rank holds the whole tensor
    # (vLLM's vision tower falls back to replicated weights when its heads do not divide tp)
    replicate_unless: str | None = None
    # each source row written this many times (an MXFP8 scale [out/32, in/32] expanded to [out, in/32] before the TP
    # split, as vLLM's KMxfp8Static scale loader repeat_interleaves it)
    repeat: int = 1
    # the config key that counts this stack's routed experts (a V4.1 DSpark stage has its own)
    experts_key: str = "n_routed_experts"
    # source indexes a fuse may lack (a ratio-1 V4.1 compressor has no wgate): the parts present are fused in order
    optional: tuple[int, ...] = ()
    regexes: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"{self.kind}:{'+'.join(self.sources)}"


def Rename(src: str, dst: str, split: Split = Split.REPLICATE, convert: str = "copy", note: str = "", **kw) -> Rule:
    return Rule("rename", (src,), dst, split, convert, note=note, **kw)


def Fuse(
    srcs: tuple[str, ...], dst: str, split: Split = Split.REPLICATE, convert: str = "copy", note: str = "", **kw
) -> Rule:
    return Rule("fuse", srcs, dst, split, convert, note=note, **kw)


def StackExperts(
    srcs: tuple[str, ...], dst: str, convert: str, split_dim: int | None, note: str = "", **kw
) -> Rule:
    return Rule("stack", srcs, dst, Split.EXPERTS, convert, note=note, expert_split_dim=split_dim, **kw)


def Drop(src: str, note: str, **kw) -> Rule:
    return Rule("drop", (src,), None, note=note, **kw)


_PLACEHOLDER = re.compile(r"\{(layer|mtp|expert|vblock)\}")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``layers.{layer}.attn.wq_a.weight`` → ``^layers\\.(?P<layer>0|[1-9]\\d*)\\.attn\\.wq_a\\.weight$``."""
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>0|[1-9][0-9]*)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("^" + "".join(out) + "$")


_NUMBER = re.compile(r"[0-9]+")


def pattern_template(pattern: str) -> str | None:
    """``layers.{layer}.ffn.experts.{expert}.w1.weight`` → ``layers.#.ffn.experts.#.w1.weight``.

    None when a placeholder is not a whole segment or a literal segment is a number: then two
    patterns with different templates might match one name.
    """
    out = []
    for seg in pattern.split("."):
        if seg in ("{layer}", "{mtp}", "{expert}", "{vblock}"):
            out.append("#")
        elif "{" in seg or "}" in seg or _NUMBER.fullmatch(seg):
            return None
        else:
            out.append(seg)
    return ".".join(out)


def indexable(rules: list[Rule]) -> bool:
    """Whether every name matches at most one rule of ``rules``, so that looking names up in the table of
    expanded patterns gives what trying the regexes in table order gives.

    Two patterns can match one name only if their templates are equal (placeholders match numbers
    only, and no literal segment is a number); rules restricted to disjoint MTP layers (``when_mtp``
    first / rest) may share one.
    """
    seen: dict[str, list[str | None]] = {}
    for rule in rules:
        for pat in rule.sources:
            t = pattern_template(pat)
            if t is None or (rule.when_mtp and not pat.startswith("mtp.{mtp}.")):
                return False
            for other in seen.get(t, []):
                if not (other and rule.when_mtp and other != rule.when_mtp):
                    return False
            seen.setdefault(t, []).append(rule.when_mtp)
    return True


def _compiled(rule: Rule) -> Rule:
    return replace(rule, regexes=tuple(compile_pattern(s) for s in rule.sources))


# ---------------------------------------------------------------------------------------------
# Profile vllm-seed: the names DeepSeekV4MTP.load_weights (the seed) and DeepseekV4ForCausalLM place.


def _block_rules(src: str, dst: str, expert_dtype: str, component: str, *, with_compressor: bool) -> list[Rule]:
    """Rules of one decoder block: ``src`` / ``dst`` are the block prefixes (with placeholders)."""
    c = dict(component=component)
    return (
        _norm_rules(src, dst, c)
        + _attention_rules(src, dst, c)
        + (_compressor_rules(src, dst, c) if with_compressor else [])
        + _ffn_rules(src, dst, expert_dtype, c)
    )


def _norm_rules(src: str, dst: str, c: dict) -> list[Rule]:
    """A block's norms and hyper-connection parameters."""
    r = [
        Rename(f"{src}.attn_norm.weight", f"{dst}.attn_norm.weight", **c),
        Rename(f"{src}.ffn_norm.weight", f"{dst}.ffn_norm.weight", note="seed profile keeps ffn_norm", **c),
    ]
    for part in ("attn", "ffn"):
        for t in ("fn", "base", "scale"):
            r.append(Rename(f"{src}.hc_{part}_{t}", f"{dst}.hc_{part}_{t}", **c))
    return r


def _attention_rules(src: str, dst: str, c: dict) -> list[Rule]:
    """A block's attention projections, norms and sink."""
    a, da = f"{src}.attn", f"{dst}.attn"
    return [
        # stacked_params_mapping: ("attn.fused_wqa_wkv", "attn.wq_a", 0), (.., "attn.wkv", 1); disable_tp=True
        Fuse((f"{a}.wq_a.weight", f"{a}.wkv.weight"), f"{da}.fused_wqa_wkv.weight", **c),
        Fuse((f"{a}.wq_a.scale", f"{a}.wkv.scale"), f"{da}.fused_wqa_wkv.weight_scale_inv", **c),
        Rename(f"{a}.q_norm.weight", f"{da}.q_norm.weight", **c),
        Rename(f"{a}.kv_norm.weight", f"{da}.kv_norm.weight", **c),
        Rename(f"{a}.wq_b.weight", f"{da}.wq_b.weight", Split.DIM0, note="ColumnParallelLinear", **c),
        Rename(f"{a}.wq_b.scale", f"{da}.wq_b.weight_scale_inv", Split.DIM0, **c),
        Rename(f"{a}.wo_a.weight", f"{da}.wo_a.weight", Split.DIM0, note="ColumnParallelLinear, kept FP8", **c),
        Rename(f"{a}.wo_a.scale", f"{da}.wo_a.weight_scale_inv", Split.DIM0, **c),
        Rename(f"{a}.wo_b.weight", f"{da}.wo_b.weight", Split.DIM1, note="RowParallelLinear", **c),
        Rename(f"{a}.wo_b.scale", f"{da}.wo_b.weight_scale_inv", Split.DIM1, **c),
        Rename(f"{a}.attn_sink", f"{da}.attn_sink", Split.DIM0, note="heads [r*H/T, (r+1)*H/T), no -inf padding", **c),
    ]


def _compressor_rules(src: str, dst: str, c: dict) -> list[Rule]:
    """A compressed-attention block's compressor and indexer."""
    a, da = f"{src}.attn", f"{dst}.attn"
    # deepseek_v4.py WeightsMapper: `.attn.compressor.` → `.attn.mla_attn.compressor.`; stacked wkv|wgate
    cm, dcm = f"{a}.compressor", f"{da}.mla_attn.compressor"
    ix, dix = f"{a}.indexer", f"{da}.indexer"
    return [
        Fuse((f"{cm}.wkv.weight", f"{cm}.wgate.weight"), f"{dcm}.fused_wkv_wgate.weight", **c),
        Rename(f"{cm}.ape", f"{dcm}.ape", **c),
        Rename(f"{cm}.norm.weight", f"{dcm}.norm.weight", **c),
        Rename(f"{ix}.wq_b.weight", f"{dix}.wq_b.weight", note="ReplicatedLinear", **c),
        Rename(f"{ix}.wq_b.scale", f"{dix}.wq_b.weight_scale_inv", **c),
        Rename(f"{ix}.weights_proj.weight", f"{dix}.weights_proj.weight", **c),
        # the substr rule only matches `.attn.compressor.`, so the indexer's stays un-prefixed
        Fuse(
            (f"{ix}.compressor.wkv.weight", f"{ix}.compressor.wgate.weight"),
            f"{dix}.compressor.fused_wkv_wgate.weight",
            **c,
        ),
        Rename(f"{ix}.compressor.ape", f"{dix}.compressor.ape", **c),
        Rename(f"{ix}.compressor.norm.weight", f"{dix}.compressor.norm.weight", **c),
    ]


def _ffn_rules(src: str, dst: str, expert_dtype: str, c: dict) -> list[Rule]:
    """A block's router, shared experts and routed experts (stacked)."""
    f, df = f"{src}.ffn", f"{dst}.ffn"
    return [
        Rename(f"{f}.gate.weight", f"{df}.gate.weight", **c),
        Rename(f"{f}.gate.bias", f"{df}.gate.e_score_correction_bias", note="noaux_tc bias", **c),
        Rename(f"{f}.gate.tid2eid", f"{df}.gate.tid2eid", note="hash layers; stored dtype kept", **c),
        Fuse(
            (f"{f}.shared_experts.w1.weight", f"{f}.shared_experts.w3.weight"),
            f"{df}.shared_experts.gate_up_proj.weight",
            Split.DIM0,
            note="MergedColumnParallelLinear: cat(w1 chunk r, w3 chunk r)",
            **c,
        ),
        Fuse(
            (f"{f}.shared_experts.w1.scale", f"{f}.shared_experts.w3.scale"),
            f"{df}.shared_experts.gate_up_proj.weight_scale_inv",
            Split.DIM0,
            **c,
        ),
        Rename(
            f"{f}.shared_experts.w2.weight",
            f"{df}.shared_experts.down_proj.weight",
            Split.DIM1,
            note="RowParallelLinear",
            **c,
        ),
        Rename(f"{f}.shared_experts.w2.scale", f"{df}.shared_experts.down_proj.weight_scale_inv", Split.DIM1, **c),
        *routed_expert_rules(f"{f}.experts", f"{df}.experts", expert_formats_of(expert_dtype), c),
    ]


def expert_formats_of(expert_dtype: str) -> tuple[ExpertFormat, ...]:
    """The formats a block's routed experts may come in for config.json's ``expert_dtype``: block FP8, or MXFP4 and
    NVFP4 alike (an NVFP4 export keeps ``expert_dtype: "fp4"``; its ``ignore`` list leaves some layers MXFP4). Their
    rules match disjoint source names but the shared packed weight's; which applies to a layer is config.json's
    (ckpt_tool.checkpoint.expert_format.layer_format), held against the tensors present before planning."""
    return (FP8,) if expert_dtype == "fp8" else (MXFP4, NVFP4)


def routed_expert_rules(src: str, dst: str, formats: tuple[ExpertFormat, ...], c: dict) -> list[Rule]:
    """The stacked routed-expert parameters of every format in ``formats`` (``src``/``dst``: the experts' module in
    the checkpoint's and the engine's names): FusedMoE's ``w13_*`` from each expert's w1 then w3, ``w2_*`` from w2
    (vLLM's fused_moe_make_expert_params_mapping); a rule two formats share (the packed weight) once."""
    rules: list[Rule] = []
    seen: set[tuple[str, ...]] = set()
    for fmt in formats:
        for stack, parts, rows_dim in (("w13", ("w1", "w3"), 0), ("w2", ("w2",), 1)):
            for param in fmt.params:
                sources = tuple(f"{src}.{{expert}}.{w}.{param.source}" for w in parts)
                if sources in seen:
                    continue
                seen.add(sources)
                rules.append(
                    StackExperts(
                        sources,
                        f"{dst}.{stack}_{param.name}",
                        param.convert,
                        rows_dim if param.split == "rows" else None,
                        note=f"{fmt.name}: {param.vllm}",
                        global_experts=param.split == "global-experts",
                        **c,
                    )
                )
    return rules


def vllm_seed_rules(expert_dtype: str) -> list[Rule]:
    """Profile ``vllm-seed``: vLLM's DeepSeek V4 main model and the seed's MTP loader."""
    rules: list[Rule] = [
        # target model (deepseek_v4.py WeightsMapper)
        Rename("embed.weight", "model.embed_tokens.weight", Split.DIM0, note="VocabParallelEmbedding"),
        Rename("head.weight", "lm_head.weight", Split.DIM0, note="ParallelLMHead"),
        Rename("norm.weight", "model.norm.weight"),
        Rename("hc_head_fn", "model.hc_head_fn"),
        Rename("hc_head_base", "model.hc_head_base"),
        Rename("hc_head_scale", "model.hc_head_scale"),
    ]
    rules += _block_rules("layers.{layer}", "model.layers.{layer}", expert_dtype, "model", with_compressor=True)
    m, S = "mtp.{mtp}", "model.layers.{spec}"
    mc = dict(component="mtp")
    rules += [
        # seed: `.emb.tok_emb.weight` → `model.embed_tokens.weight`; only mtp.0's reaches the engine
        # (for spec layers past the first, names without `.layers` are skipped).
        Rename(f"{m}.emb.tok_emb.weight", "model.embed_tokens.weight", Split.DIM0, when_mtp="first", **mc),
        Drop(
            f"{m}.emb.tok_emb.weight",
            note="seed skips embed_tokens of MTP layers after the first",
            when_mtp="rest",
            **mc,
        ),
        Rename(f"{m}.head.weight", f"{S}.shared_head.head.weight", Split.DIM0, note="SharedHead ParallelLMHead", **mc),
        Rename(f"{m}.norm.weight", f"{S}.shared_head.norm.weight", **mc),
        Rename(f"{m}.enorm.weight", f"{S}.enorm.weight", **mc),
        Rename(f"{m}.hnorm.weight", f"{S}.hnorm.weight", **mc),
        Rename(f"{m}.e_proj.weight", f"{S}.e_proj.weight", note="ReplicatedLinear fp8", **mc),
        Rename(f"{m}.e_proj.scale", f"{S}.e_proj.weight_scale_inv", **mc),
        Rename(f"{m}.h_proj.weight", f"{S}.h_proj.weight", **mc),
        Rename(f"{m}.h_proj.scale", f"{S}.h_proj.weight_scale_inv", **mc),
        Rename(f"{m}.hc_head_fn", f"{S}.hc_head_fn", **mc),
        Rename(f"{m}.hc_head_base", f"{S}.hc_head_base", **mc),
        Rename(f"{m}.hc_head_scale", f"{S}.hc_head_scale", **mc),
    ]
    # compress ratio is hard-coded 1 for MTP layers: no compressor / indexer in the MTP block
    rules += _block_rules(m, f"{S}.mtp_block", expert_dtype, "mtp", with_compressor=False)
    return [_compiled(r) for r in rules]


# What the MTP draft model needs that a checkpoint may lack (the released V4-Flash has no MTP
# embedding/head): output name → (source tensor to copy, split). The seed loader would leave these
# uninitialised and speculative decoding would silently accept nothing.
MATERIALIZE = {
    "mtp.{mtp}.emb.tok_emb.weight": "embed.weight",
    "mtp.{mtp}.head.weight": "head.weight",
}


# ---------------------------------------------------------------------------------------------
# The vision model (DeepseekV4ForConditionalGeneration): what it adds to the text model's table.
# Names as vLLM 0.33.0 / 0.34.0 consume them: vllm/models/deepseek_v4/common/vl_model.py (hf_to_vllm_mapper: `vision.`,
# `aligner.`, `image_` pass unchanged, "Weight names match the HF checkpoint") and common/vision.py (the modules).


def vision_block_rules() -> list[Rule]:
    """Router tensors every decoder block of the vision model adds, in the text model's names (the model class
    prefixes the target model's). ``gate.bias`` of hash layers already matches the text rule."""
    # DeepseekV4MoE.gate.bias_vl (nvidia/model.py): float32 [E], routes the image sentinel tokens; replicated
    rules = [
        Rename("layers.{layer}.ffn.gate.bias_vl", "model.layers.{layer}.ffn.gate.bias_vl", note="image-token routing"),
        Rename(
            "mtp.{mtp}.ffn.gate.bias_vl",
            "model.layers.{spec}.mtp_block.ffn.gate.bias_vl",
            component="mtp",
            note="DeepSeekV4MTP keeps the vision config: its block builds bias_vl too",
        ),
    ]
    return [_compiled(r) for r in rules]


def vision_tower_rules() -> list[Rule]:
    """The vision tower, the aligner and the image_* embeddings: unprefixed, BF16 (image_* F32) as the parameters
    hold them; split as vision.py's parallel layers split them, or whole on every rank when vision_n_heads does
    not divide tp (vllm/model_executor/models/vision.py is_vit_use_data_parallel)."""
    v, b = "vision", "vision.blocks.{vblock}"
    heads = dict(replicate_unless="vision_n_heads")
    bf16 = dict(convert="to_bf16")
    rules = [
        Rename(f"{v}.patch_embed.proj.weight", f"{v}.patch_embed.proj.weight", note="ReplicatedLinear", **bf16),
        Rename(f"{v}.patch_embed.proj.bias", f"{v}.patch_embed.proj.bias", **bf16),
        Rename(f"{b}.norm1.weight", f"{b}.norm1.weight", **bf16),
        Rename(f"{b}.norm2.weight", f"{b}.norm2.weight", **bf16),
        Rename(
            f"{b}.attn.wqkv.weight",
            f"{b}.attn.wqkv.weight",
            Split.DIM0,
            note="QKVParallelLinear: rows q|k|v, each split by heads",
            sections=3,
            **heads,
            **bf16,
        ),
        Rename(f"{b}.attn.wqkv.bias", f"{b}.attn.wqkv.bias", Split.DIM0, sections=3, **heads, **bf16),
        Rename(f"{b}.attn.wo.weight", f"{b}.attn.wo.weight", Split.DIM1, note="RowParallelLinear", **heads, **bf16),
        Rename(f"{b}.attn.wo.bias", f"{b}.attn.wo.bias", note="row-parallel bias: whole", **bf16),
        Rename(
            f"{b}.mlp.w1.weight",
            f"{b}.mlp.w1.weight",
            Split.DIM0,
            note="MergedColumnParallelLinear: rows gate|up, each split",
            sections=2,
            **heads,
            **bf16,
        ),
        Rename(f"{b}.mlp.w2.weight", f"{b}.mlp.w2.weight", Split.DIM1, note="RowParallelLinear", **heads, **bf16),
        Rename(f"{v}.norm.weight", f"{v}.norm.weight", **bf16),
        Rename("aligner.w1.weight", "aligner.w1.weight", Split.DIM0, note="ColumnParallelLinear", **heads, **bf16),
        Rename("aligner.w1.bias", "aligner.w1.bias", Split.DIM0, **heads, **bf16),
        Rename("aligner.w2.weight", "aligner.w2.weight", Split.DIM1, note="RowParallelLinear", **heads, **bf16),
        Rename("aligner.w2.bias", "aligner.w2.bias", **bf16),
    ]
    rules += [Rename(n, n, convert="to_f32", note="float32 parameter of the wrapper") for n in IMAGE_EMBEDDINGS]
    return [_compiled(r) for r in rules]


IMAGE_EMBEDDINGS = ("image_start", "image_end", "image_newline", "image_pad")


# ---------------------------------------------------------------------------------------------
# The DSpark draft (DSparkDeepseekV4ForCausalLM, vllm/models/deepseek_v4/nvidia/dspark.py, vLLM 0.33.0 and 0.34.0):
# what replaces the classic MTP rules when config.json names dspark_target_layer_ids. Names as its load_weights and
# _remap_dspark_name place them: head-stack tensors (main_proj, main_norm, norm, hc_head_*, markov_head,
# confidence_head) from whichever stage holds them at model level, everything else of stage i under
# model.layers.{i} (the ModuleList index, not num_hidden_layers + i as the classic MTP's), and every stage's
# attn.wkv a second time as its shard of model.context_wkv_proj (_duplicate_context_wkv_weights).

DSPARK_EMBED = "dspark.embed.weight"  # alias of embed.weight: the draft's VocabParallelEmbedding
DSPARK_HEAD = "dspark.head.weight"  # alias of head.weight: the draft's ParallelLMHead


def dspark_context_wkv(stage: int, part: str) -> str:
    """Alias of ``mtp.{stage}.attn.wkv.{part}`` read a second time for ``model.context_wkv_proj`` (a name no
    checkpoint holds and no other rule matches)."""
    return f"dspark.context_wkv.stage{stage}.{part}"


def dspark_rules(expert_dtype: str, stages: int, *, vision: bool) -> list[Rule]:
    """The DSpark draft's rules: ``stages`` stages under ``mtp.{mtp}``, written to OUT's ``dspark`` folder."""
    m, d = "mtp.{mtp}", dict(component="dspark")
    rules = [
        # has_own_embed_tokens / has_own_lm_head = False: load_dspark_model (v1/worker/gpu/spec_decode/dspark/
        # utils.py) replaces both with the target's after loading, but the modules exist and the sharded loader wants
        # their keys: the target's own vocab shards, what vLLM's save_model would hold after that replacement
        Rename(DSPARK_EMBED, "model.embed_tokens.weight", Split.DIM0, note="the target's embed (aliased)", **d),
        Rename(DSPARK_HEAD, "lm_head.weight", Split.DIM0, note="the target's head (aliased)", **d),
        Rename(f"{m}.main_proj.weight", "model.main_proj.weight", note="ReplicatedLinear, block FP8", **d),
        Rename(f"{m}.main_proj.scale", "model.main_proj.weight_scale_inv", **d),
        Rename(f"{m}.main_norm.weight", "model.main_norm.weight", **d),
        Rename(f"{m}.norm.weight", "model.norm.weight", **d),
        Rename(f"{m}.hc_head_fn", "model.hc_head_fn", **d),
        Rename(f"{m}.hc_head_base", "model.hc_head_base", **d),
        Rename(f"{m}.hc_head_scale", "model.hc_head_scale", **d),
        # DSparkMarkovHead (model_executor/models/qwen3_dspark.py): nn.Embedding and ParallelLMHead(disable_tp=True),
        # unquantized, in the model dtype
        Rename(f"{m}.markov_head.markov_w1.weight", "model.markov_head.markov_w1.weight", convert="to_bf16", **d),
        Rename(f"{m}.markov_head.markov_w2.weight", "model.markov_head.markov_w2.weight", convert="to_bf16", **d),
        # DSparkConfidenceHead.proj: ReplicatedLinear(params_dtype=torch.float32), no bias
        Rename(f"{m}.confidence_head.proj.weight", "model.confidence_head.proj.weight", convert="to_f32", **d),
    ]
    if stages:
        # MergedColumnParallelLinear([head_dim] * stages, disable_tp=True): stage i's wkv rows (and scale rows) in order
        for part, target in (("weight", "weight"), ("scale", "weight_scale_inv")):
            rules.append(
                Fuse(
                    tuple(dspark_context_wkv(i, part) for i in range(stages)),
                    f"model.context_wkv_proj.{target}",
                    note="every stage's attn.wkv, stacked in stage order",
                    **d,
                )
            )
    # DeepseekV4DecoderLayer built at layer id num_hidden_layers + i: compress ratio 1 (no compressor or indexer)
    rules += _block_rules(m, "model.layers.{mtp}", expert_dtype, "dspark", with_compressor=False)
    if vision:  # the layer reads the target's (vision) config: its router has bias_vl
        rules.append(Rename(f"{m}.ffn.gate.bias_vl", "model.layers.{mtp}.ffn.gate.bias_vl", **d))
    return [_compiled(r) for r in rules]


def dspark_aliases(stages: int, *, context_wkv: bool = True) -> dict[str, str]:
    """Alias name → the source tensor it reads: the embedding, the head and (``context_wkv``: for the draft's
    context_wkv_proj) every stage's wkv a second time."""
    out = {DSPARK_EMBED: "embed.weight", DSPARK_HEAD: "head.weight"}
    for i in range(stages if context_wkv else 0):
        for part in ("weight", "scale"):
            out[dspark_context_wkv(i, part)] = f"mtp.{i}.attn.wkv.{part}"
    return out
