"""The name mapping, as data: one table of rules per target profile.

A rule maps one or more source tensors (DeepSeek's names, with placeholders ``{layer}``, ``{mtp}``,
``{expert}``) to one output tensor (the engine's parameter name, with those placeholders and
``{spec}`` = num_hidden_layers + mtp). Patterns compile to anchored regexes over whole dot-separated
segments, so a rule can never hit a substring of another name (the seed loader's
``name.replace(".norm.weight", ...)`` style is exactly what this avoids).

Rule kinds:
- ``Rename``: one source, one output (plus a TP split).
- ``Fuse``: several sources concatenated on dim 0 in the given order (wq_a|wkv, w1|w3, wkv|wgate).
- ``StackExperts``: per-expert sources (``{expert}`` = 0..E-1) stacked into one [E, ...] tensor, each
  expert's parts concatenated on dim 0 first (w1|w3 → w13).
- ``Drop``: a source deliberately not written (recorded in the plan).

Conversions (``convert``): ``copy`` keeps the stored dtype and bytes; ``raw_uint8`` writes the same
bytes as U8 (the seed's ``.view(torch.uint8)`` for fp4 experts and their E8M0 scales); ``e8m0_to_f32``
writes ``2^(b-127)`` as F32 (E8M0 scales landing in a float32 parameter — the seed would store ``b``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum


class Split(str, Enum):
    """How a tensor is divided over tensor-parallel ranks (SPEC.md, "Tensor parallelism")."""

    REPLICATE = "replicate"
    DIM0 = "dim0"  # column parallel / vocab parallel / attn_sink heads: contiguous rows chunk r
    DIM1 = "dim1"  # row parallel: input columns chunk r
    EXPERTS = "experts"  # routed experts: tp → per-expert row (w13) or column (w2) chunk; ep → whole experts


@dataclass(frozen=True)
class Rule:
    kind: str  # rename | fuse | stack | drop
    sources: tuple[str, ...]
    target: str | None
    split: Split = Split.REPLICATE
    convert: str = "copy"
    component: str = "model"  # model | mtp: which output folder the tensor goes to
    note: str = ""
    expert_split_dim: int = 0  # for Split.EXPERTS under --moe-parallel tp: 0 = w13 rows, 1 = w2 inputs
    when_mtp: str | None = None  # None | "first" | "rest": restrict an MTP rule to mtp.0 or mtp.1..
    # the engine zero-pads this TP split up to whole 128-blocks per rank where the blocks do not divide tp
    # (set by the profile, see Profile.pads); otherwise such a split is refused
    pad: bool = False
    regexes: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"{self.kind}:{'+'.join(self.sources)}"


def Rename(src: str, dst: str, split: Split = Split.REPLICATE, convert: str = "copy", note: str = "", **kw) -> Rule:
    return Rule("rename", (src,), dst, split, convert, note=note, **kw)


def Fuse(srcs: tuple[str, ...], dst: str, split: Split = Split.REPLICATE, convert: str = "copy", note: str = "", **kw) -> Rule:
    return Rule("fuse", srcs, dst, split, convert, note=note, **kw)


def StackExperts(srcs: tuple[str, ...], dst: str, convert: str, split_dim: int, note: str = "", **kw) -> Rule:
    return Rule("stack", srcs, dst, Split.EXPERTS, convert, note=note, expert_split_dim=split_dim, **kw)


def Drop(src: str, note: str, **kw) -> Rule:
    return Rule("drop", (src,), None, note=note, **kw)


_PLACEHOLDER = re.compile(r"\{(layer|mtp|expert)\}")


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
        if seg in ("{layer}", "{mtp}", "{expert}"):
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
    fp4 = expert_dtype == "fp4"
    # fp4 experts: uint8 params holding raw bytes (seed: `.view(torch.uint8)`), `.weight_scale`.
    # fp8 experts: block-FP8 params with float32 `.weight_scale_inv`; E8M0 scales become 2^(b-127).
    expert_w = "raw_uint8" if fp4 else "copy"
    expert_s = "raw_uint8" if fp4 else "e8m0_to_f32"
    escale = "weight_scale" if fp4 else "weight_scale_inv"
    c = dict(component=component)
    r = [
        Rename(f"{src}.attn_norm.weight", f"{dst}.attn_norm.weight", **c),
        Rename(f"{src}.ffn_norm.weight", f"{dst}.ffn_norm.weight", note="seed profile keeps ffn_norm", **c),
    ]
    for part in ("attn", "ffn"):
        for t in ("fn", "base", "scale"):
            r.append(Rename(f"{src}.hc_{part}_{t}", f"{dst}.hc_{part}_{t}", **c))
    a, da = f"{src}.attn", f"{dst}.attn"
    r += [
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
    if with_compressor:
        # deepseek_v4.py WeightsMapper: `.attn.compressor.` → `.attn.mla_attn.compressor.`; stacked wkv|wgate
        cm, dcm = f"{a}.compressor", f"{da}.mla_attn.compressor"
        ix, dix = f"{a}.indexer", f"{da}.indexer"
        r += [
            Fuse((f"{cm}.wkv.weight", f"{cm}.wgate.weight"), f"{dcm}.fused_wkv_wgate.weight", **c),
            Rename(f"{cm}.ape", f"{dcm}.ape", **c),
            Rename(f"{cm}.norm.weight", f"{dcm}.norm.weight", **c),
            Rename(f"{ix}.wq_b.weight", f"{dix}.wq_b.weight", note="ReplicatedLinear", **c),
            Rename(f"{ix}.wq_b.scale", f"{dix}.wq_b.weight_scale_inv", **c),
            Rename(f"{ix}.weights_proj.weight", f"{dix}.weights_proj.weight", **c),
            # the substr rule only matches `.attn.compressor.`, so the indexer's stays un-prefixed
            Fuse((f"{ix}.compressor.wkv.weight", f"{ix}.compressor.wgate.weight"), f"{dix}.compressor.fused_wkv_wgate.weight", **c),
            Rename(f"{ix}.compressor.ape", f"{dix}.compressor.ape", **c),
            Rename(f"{ix}.compressor.norm.weight", f"{dix}.compressor.norm.weight", **c),
        ]
    f, df = f"{src}.ffn", f"{dst}.ffn"
    r += [
        Rename(f"{f}.gate.weight", f"{df}.gate.weight", **c),
        Rename(f"{f}.gate.bias", f"{df}.gate.e_score_correction_bias", note="noaux_tc bias", **c),
        Rename(f"{f}.gate.tid2eid", f"{df}.gate.tid2eid", note="hash layers; stored dtype kept", **c),
        Fuse((f"{f}.shared_experts.w1.weight", f"{f}.shared_experts.w3.weight"), f"{df}.shared_experts.gate_up_proj.weight", Split.DIM0, note="MergedColumnParallelLinear: cat(w1 chunk r, w3 chunk r)", **c),
        Fuse((f"{f}.shared_experts.w1.scale", f"{f}.shared_experts.w3.scale"), f"{df}.shared_experts.gate_up_proj.weight_scale_inv", Split.DIM0, **c),
        Rename(f"{f}.shared_experts.w2.weight", f"{df}.shared_experts.down_proj.weight", Split.DIM1, note="RowParallelLinear", **c),
        Rename(f"{f}.shared_experts.w2.scale", f"{df}.shared_experts.down_proj.weight_scale_inv", Split.DIM1, **c),
        StackExperts((f"{f}.experts.{{expert}}.w1.weight", f"{f}.experts.{{expert}}.w3.weight"), f"{df}.experts.w13_weight", expert_w, 0, note="FusedMoE w13: per expert w1 rows then w3 rows", **c),
        StackExperts((f"{f}.experts.{{expert}}.w1.scale", f"{f}.experts.{{expert}}.w3.scale"), f"{df}.experts.w13_{escale}", expert_s, 0, **c),
        StackExperts((f"{f}.experts.{{expert}}.w2.weight",), f"{df}.experts.w2_weight", expert_w, 1, note="FusedMoE w2", **c),
        StackExperts((f"{f}.experts.{{expert}}.w2.scale",), f"{df}.experts.w2_{escale}", expert_s, 1, **c),
    ]
    return r


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
        Drop(f"{m}.emb.tok_emb.weight", note="seed skips embed_tokens of MTP layers after the first", when_mtp="rest", **mc),
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


@dataclass(frozen=True)
class ConvertOverride:
    """A profile's dtype for targets whose base name ends with ``.{tail}`` (only for ``expert_dtype``, if set)."""

    tail: str
    convert: str
    expert_dtype: str | None = None
    why: str = ""


@dataclass(frozen=True)
class Profile:
    """A target profile, as data: the base rule table plus what this engine release does differently.

    ``renames`` map a run of whole dot-separated segments of a target name to another (first entry
    found in the name wins, applied once). ``converts`` change the element conversion of targets by
    their base-name tail. ``pads`` are runs of whole segments of a source name whose rules' TP split the
    engine zero-pads to whole quantization blocks per rank (where the blocks do not divide tp) instead
    of refusing it. ``covers`` are the vLLM ``major.minor`` series ``--target auto`` picks this profile
    for; ``verified`` names the exact releases whose own loader the engine test runs. A new vLLM
    release whose layout changes is one more entry in ``PROFILES`` (and one engine-test parameter).
    """

    name: str
    description: str
    build: Callable[[str], list[Rule]]  # the base rule table, by expert_dtype
    renames: tuple[tuple[str, str], ...] = ()
    converts: tuple[ConvertOverride, ...] = ()
    pads: tuple[str, ...] = ()
    covers: tuple[str, ...] = ()
    verified: tuple[str, ...] = ()
    verified_by: str = ""
    notes: tuple[str, ...] = ()

    def rules(self, expert_dtype: str) -> list[Rule]:
        out = []
        for rule in self.build(expert_dtype):
            rule = override_convert(rule, self.converts, expert_dtype)
            if any(_segment_run(src, run) >= 0 for src in rule.sources for run in self.pads):
                rule = replace(rule, pad=True)
            out.append(rename_target(rule, self.renames))
        return out


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


# vLLM 0.33.0 (vllm/models/deepseek_v4/nvidia/{model,mtp}.py; research/vllm_0_33.md). Its MoE module
# holds the router and the shared experts a second time; the sharded loader keeps the alias that
# sorts first (`ffn.experts.*`) of each pair of state_dict keys sharing storage.
VLLM_0_33_RENAMES: tuple[tuple[str, str], ...] = (
    ("attn.mla_attn.compressor", "attn.compressor"),  # DeepseekV4Attention.compressor, no mla_attn wrapper
    ("ffn.gate", "ffn.experts.gate"),  # FusedMoE(gate=...) alias of DeepseekV4MoE.gate
    ("ffn.shared_experts", "ffn.experts._shared_experts._layer"),  # FusedMoE shared-experts runner alias
    ("ffn.experts", "ffn.experts.routed_experts"),  # RoutedExperts inside FusedMoE
)
VLLM_0_33_CONVERTS: tuple[ConvertOverride, ...] = (
    ConvertOverride("ffn.gate.tid2eid", "int_to_i32", why="hash table parameter is int32 (int64 only with MegaMoE)"),
    ConvertOverride(
        "weight_scale_inv", "e8m0_to_f32", expert_dtype="fp8",
        why="with fp8 experts every block-FP8 linear's scale parameter is float32 (E8M0 params exist only for fp4-expert checkpoints)",
    ),
)
# DeepseekV4MLP / load_weights (and the MTP's): block-FP8 shared experts get cdiv(blocks, tp) blocks a rank, the
# checkpoint's weights and scales zero-padded on the intermediate dim (w1/w3 rows, w2 columns) before the even
# TP split, so trailing ranks hold zeros (not under sequence parallelism, which ckpt-tool does not target).
VLLM_0_33_PADS: tuple[str, ...] = ("shared_experts",)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "vllm-seed",
            "the seed loader: vLLM DeepSeek V4 + DeepSeekV4MTP.load_weights of an older vLLM (ffn.gate.*, "
            "attn.mla_attn.compressor.*, ffn.experts.w13_weight; tid2eid and scales in their stored dtypes)",
            vllm_seed_rules,
            verified_by="the seed loader's code (shared/seeds); matches no released vLLM's sharded_state loader",
        ),
        Profile(
            "vllm-0.33",
            "vLLM 0.33 DeepseekV4ForCausalLM / DeepSeekV4MTP (nvidia/): --load-format sharded_state keys "
            "(ffn.experts.routed_experts.*, ffn.experts.gate.*, ffn.experts._shared_experts._layer.*, "
            "attn.compressor.*), int32 tid2eid, float32 linear scales for fp8-expert checkpoints",
            vllm_seed_rules,
            VLLM_0_33_RENAMES,
            VLLM_0_33_CONVERTS,
            VLLM_0_33_PADS,
            covers=("0.33",),
            verified=("0.33.0",),
            verified_by="vLLM's own model classes and ShardedStateLoader.load_weights, built on CPU (tests/engine)",
            notes=(
                "attn_sink is written with the H/tp real heads; the engine pads its parameter to the attention "
                "backend's head count (FlashMLA 64/128, FlashInfer 8..128) with -inf and the sharded loader copies "
                "the prefix, warning about the shape once per layer",
            ),
        ),
    )
}
DEFAULT_PROFILE = "vllm-0.33"  # the newest: what --target auto picks when no vLLM is installed


# What the MTP draft model needs that a checkpoint may lack (the released V4-Flash has no MTP
# embedding/head): output name → (source tensor to copy, split). The seed loader would leave these
# uninitialised and speculative decoding would silently accept nothing.
MATERIALIZE = {
    "mtp.{mtp}.emb.tok_emb.weight": "embed.weight",
    "mtp.{mtp}.head.weight": "head.weight",
}
