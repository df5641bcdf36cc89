"""DeepSeek V4.1's base rule table: the checkpoint's names to ``DeepseekV41ForCausalLM``'s parameters.

Written from vLLM 0.33.0 / 0.34.0 (the same target keys in both): ``vllm/models/deepseek_v41/nvidia/vl_model.py``
(the outer mapper re-roots the text model under ``language_model.``; ``vision.*``, ``aligner.*``, ``image_*`` keep
their names; ``mtp.*`` is the draft's), ``nvidia/model.py`` (``load_weights``: stacked ``w1|w3``, ``wq_a|wkv``,
``compressor.wkv|wgate``; ``.shared_experts.w2`` → ``down_proj``; ``.ffn.gate.bias`` →
``e_score_correction_bias``; ``_linear_scale_param_name``: ``.scale`` → ``.weight_scale`` for MXFP8 linears,
``weight_block_size [32, 32]`` with fp4 experts; no ``hc_head``), ``attention.py`` (a compressor only on
``kv_source_layer_ids``, an indexer only on ``index_source_layer_ids``, its ``wk``/``k_norm`` only when the layer is a
kv source too; both unquantized but the indexer's ``wq_b``) and ``common/engram.py`` (the Engram of
``engram_layer_ids``: its FP8 table split by hash head, ``wkv`` column-parallel, ``q_weight``/``k_weight`` whole).

MXFP8 scales: the checkpoint stores [out/32, in/32] E8M0; vLLM's ``KMxfp8Static`` scale loader
(vllm/model_executor/layers/quantization/modelopt.py) views it as uint8 and repeats every row 32 times before the
usual TP slice, so a rank holds [out_rank, in_rank/32] uint8 (``Rule.repeat``). The Engram table's scale is per row
(one 32-wide block a row) and is not expanded.

The rules match the names that are there; which must be there (a compressor on a kv source, ``wgate`` with ratio
2, an Engram table on each Engram layer) is :mod:`ckpt_tool.checkpoint.completeness`'s to say, so a compressor's
``wgate`` is an optional part of its fuse.
"""

from __future__ import annotations

from ckpt_tool.checkpoint.expert_format import MXFP4, NVFP4
from ckpt_tool.errors import PlanError
from ckpt_tool.mapping.rules import (
    DSPARK_EMBED,
    DSPARK_HEAD,
    Fuse,
    Rename,
    Rule,
    Split,
    _compiled,
    dspark_context_wkv,
    routed_expert_rules,
    vision_tower_rules,
)

MX_REPEAT = 32  # an MXFP8 scale row covers 32 weight rows: the engine repeats it that many times
MX = dict(repeat=MX_REPEAT, convert="raw_uint8")  # an MXFP8 linear's scale: uint8 bytes, one row a weight row


def _mx_linear(src: str, dst: str, split: Split = Split.REPLICATE, note: str = "", **c) -> list[Rule]:
    return [
        Rename(f"{src}.weight", f"{dst}.weight", split, note=note, **c),
        Rename(f"{src}.scale", f"{dst}.weight_scale", split, **MX, **c),
    ]


def v41_block_rules(src: str, dst: str, component: str, experts_key: str = "n_routed_experts") -> list[Rule]:
    """One V4.1 decoder block: ``src`` / ``dst`` the block prefixes (with placeholders)."""
    c = dict(component=component)
    r = [
        Rename(f"{src}.attn_norm.weight", f"{dst}.attn_norm.weight", **c),
        Rename(f"{src}.ffn_norm.weight", f"{dst}.ffn_norm.weight", **c),
    ]
    r += [
        Rename(f"{src}.hc_{p}_{t}", f"{dst}.hc_{p}_{t}", **c) for p in ("attn", "ffn") for t in ("fn", "base", "scale")
    ]
    a, da = f"{src}.attn", f"{dst}.attn"
    r += [
        # MergedColumnParallelLinear(disable_tp=True): each part's scale expanded on its own, then stacked
        Fuse((f"{a}.wq_a.weight", f"{a}.wkv.weight"), f"{da}.fused_wqa_wkv.weight", **c),
        Fuse((f"{a}.wq_a.scale", f"{a}.wkv.scale"), f"{da}.fused_wqa_wkv.weight_scale", **MX, **c),
        Rename(f"{a}.q_norm.weight", f"{da}.q_norm.weight", **c),
        Rename(f"{a}.kv_norm.weight", f"{da}.kv_norm.weight", **c),
        *_mx_linear(f"{a}.wq_b", f"{da}.wq_b", Split.DIM0, "ColumnParallelLinear", **c),
        *_mx_linear(f"{a}.wo_a", f"{da}.wo_a", Split.DIM0, "DeepseekV4GroupedWoA: columns by group", **c),
        *_mx_linear(f"{a}.wo_b", f"{da}.wo_b", Split.DIM1, "RowParallelLinear", **c),
        Rename(f"{a}.attn_sink", f"{da}.attn_sink", Split.DIM0, note="heads [r*H/T, (r+1)*H/T)", **c),
        # kv sources: DeepseekV4CompressorKVScoreLinear(quant_config=None), wkv | wgate (ratio 2 only), bf16
        Fuse(
            (f"{a}.compressor.wkv.weight", f"{a}.compressor.wgate.weight"),
            f"{da}.compressor.fused_wkv_wgate.weight",
            optional=(1,),
            **c,
        ),
        Rename(f"{a}.compressor.norm.weight", f"{da}.compressor.norm.weight", **c),
        # index sources: ReplicatedLinear wq_b (MXFP8), weights_proj; kv sources also wk (bf16) and k_norm
        *_mx_linear(f"{a}.indexer.wq_b", f"{da}.indexer.wq_b", note="ReplicatedLinear", **c),
        Rename(f"{a}.indexer.weights_proj.weight", f"{da}.indexer.weights_proj.weight", **c),
        Rename(f"{a}.indexer.wk.weight", f"{da}.indexer.wk.weight", **c),
        Rename(f"{a}.indexer.k_norm.weight", f"{da}.indexer.k_norm.weight", **c),
    ]
    f, df = f"{src}.ffn", f"{dst}.ffn"
    sh, dsh = f"{f}.shared_experts", f"{df}.shared_experts"
    e = dict(experts_key=experts_key, **c)
    r += [
        Rename(f"{f}.gate.weight", f"{df}.gate.weight", **c),
        Rename(f"{f}.gate.bias", f"{df}.gate.e_score_correction_bias", note="noaux_tc bias", **c),
        Rename(f"{f}.gate.bias_vl", f"{df}.gate.bias_vl", note="image-token routing (vision config)", **c),
        Fuse((f"{sh}.w1.weight", f"{sh}.w3.weight"), f"{dsh}.gate_up_proj.weight", Split.DIM0, **c),
        Fuse((f"{sh}.w1.scale", f"{sh}.w3.scale"), f"{dsh}.gate_up_proj.weight_scale", Split.DIM0, **MX, **c),
        *_mx_linear(f"{sh}.w2", f"{dsh}.down_proj", Split.DIM1, "RowParallelLinear", **c),
        # MXFP4 routed experts: uint8 bytes and E8M0 scales viewed as uint8 (nvidia/model.py load_weights); an NVIDIA
        # NVFP4 export's (DeepSeek-V4.1-Flash-NVFP4) NVFP4 ones beside them (ckpt_tool.checkpoint.expert_format)
        *routed_expert_rules(f"{f}.experts", f"{df}.experts", (MXFP4, NVFP4), e),
    ]
    return r


def v41_rules(expert_dtype: str) -> list[Rule]:
    """DeepseekV41ForCausalLM: the text model under ``language_model.``, its Engram, the vision tower."""
    if expert_dtype != "fp4":
        raise PlanError(
            f"DeepSeek V4.1 with expert_dtype {expert_dtype!r}: only the released MXFP8 / MXFP4 layout (fp4 experts, "
            "weight_block_size [32, 32]) is supported; convert the original V4.1 checkpoint"
        )
    t, L = "language_model.model", "layers.{layer}"
    rules = [
        Rename("embed.weight", f"{t}.embed_tokens.weight", Split.DIM0, note="VocabParallelEmbedding"),
        Rename("head.weight", "language_model.lm_head.weight", Split.DIM0, note="ParallelLMHead"),
        Rename("norm.weight", f"{t}.norm.weight", note="no hc_head in V4.1"),
    ]
    rules += v41_block_rules(L, f"{t}.{L}", "model")
    e, de = f"{L}.engram", f"{t}.{L}.engram"
    rules += [
        # ParallelEngramEmbedding: each rank the rows of its hash heads; the E8M0 scale as raw bytes
        Rename(f"{e}.embed.weight", f"{de}.embed_tokens.weight", Split.ENGRAM, note="rows by hash head"),
        Rename(f"{e}.embed.scale", f"{de}.embed_tokens.weight_scale_inv", Split.ENGRAM, convert="raw_uint8"),
        *_mx_linear(f"{e}.wkv", f"{de}.wkv", Split.DIM0, "ColumnParallelLinear(gather_output=True)"),
        Rename(f"{e}.q_weight", f"{de}.q_weight"),
        Rename(f"{e}.k_weight", f"{de}.k_weight"),
    ]
    # the tower and the aligner are V4's classes (common/vision.py); V4.1 has no image_pad (no rule matches it then)
    return [_compiled(r) for r in rules] + vision_tower_rules()


def v41_dspark_rules(stages: int, *, context_wkv: bool) -> list[Rule]:
    """The V4.1 DSpark draft (vllm/models/deepseek_v41/nvidia/dspark.py, ``DSparkDeepseekV4ForCausalLM``): the
    target's embedding and head (as for V4's draft: vLLM replaces both with the target's after loading, but the sharded
    loader wants their keys), MXFP8 main_proj, the Markov head stored as markov_head.embed / .head (its loader's
    aliases for markov_w1 / markov_w2), the float32 confidence head, no hc_head; decoder blocks with
    dspark_n_routed_experts experts at model.layers.{i}. ``context_wkv``: the class holds ``model.context_wkv_proj``
    (vLLM 0.34.0, dspark.py ``MergedColumnParallelLinear([head_dim] * stages, disable_tp=True)``, every stage's
    ``attn.wkv`` again, MXFP8 scales expanded per part); 0.33.0's computes the context KV from each stage's
    ``fused_wqa_wkv`` and has no such parameter (see draft_kind.DSPARK_V41)."""
    m, d = "mtp.{mtp}", dict(component="dspark")
    rules = [
        Rename(DSPARK_EMBED, "model.embed_tokens.weight", Split.DIM0, note="the target's embed (aliased)", **d),
        Rename(DSPARK_HEAD, "lm_head.weight", Split.DIM0, note="the target's head (aliased)", **d),
        *_mx_linear(f"{m}.main_proj", "model.main_proj", note="ReplicatedLinear, MXFP8", **d),
        Rename(f"{m}.main_norm.weight", "model.main_norm.weight", **d),
        Rename(f"{m}.norm.weight", "model.norm.weight", **d),
        Rename(f"{m}.markov_head.embed.weight", "model.markov_head.markov_w1.weight", convert="to_bf16", **d),
        Rename(f"{m}.markov_head.head.weight", "model.markov_head.markov_w2.weight", convert="to_bf16", **d),
        Rename(f"{m}.confidence_head.proj.weight", "model.confidence_head.proj.weight", convert="to_f32", **d),
    ]
    if context_wkv and stages:
        note = "every stage's attn.wkv, stacked in stage order"
        rules += [
            Fuse(tuple(dspark_context_wkv(i, "weight") for i in range(stages)), "model.context_wkv_proj.weight",
                 note=note, **d),
            Fuse(tuple(dspark_context_wkv(i, "scale") for i in range(stages)), "model.context_wkv_proj.weight_scale",
                 **MX, **d),
        ]  # fmt: skip
    rules += v41_block_rules(m, "model.layers.{mtp}", "dspark", experts_key="dspark_n_routed_experts")
    return [_compiled(r) for r in rules]
