"""Profile ``vllm-0.33+``: the ``--load-format sharded_state`` layout of vLLM 0.33 and 0.34.

Written from vLLM's own code: ``vllm/models/deepseek_v4/nvidia/model.py`` (``DeepseekV4ForCausalLM``) and
``nvidia/mtp.py`` (``DeepSeekV4MTP``), ``state_dict()`` keys as
``vllm/model_executor/model_loader/sharded_state_loader.py`` (``ShardedStateLoader._filter_subtensors``)
keeps them. vLLM 0.34.0 holds the same keys, per-rank shapes and dtypes as 0.33.0 (its changes to these files
— ``wo_a`` as ``DeepseekV4GroupedWoA``, the compressor's CUDA-only ``DeepseekV4CompressorKVScoreLinear``,
``has_own_embed_tokens = False`` on the draft, the loader resolving a hub id through ``_prepare_weights`` —
construct the same parameters), so one profile covers both series; the engine test loads this profile's
output with each verified release's own loader, byte-compared with its stock load.

Called ``vllm-0.33`` before 0.34 was verified; that name still works.
"""

from __future__ import annotations

from ckpt_tool.mapping.profiles.profile import ConvertOverride, EngineNames, Profile
from ckpt_tool.mapping.rules import vllm_seed_rules

# The MoE module (FusedMoE in nvidia/model.py) holds the router and the shared experts a second time; of two
# state_dict keys sharing storage, _filter_subtensors keeps the one that sorts first (`ffn.experts.*`).
RENAMES: tuple[tuple[str, str], ...] = (
    ("attn.mla_attn.compressor", "attn.compressor"),  # DeepseekV4Attention.compressor, no mla_attn wrapper
    ("ffn.gate", "ffn.experts.gate"),  # FusedMoE(gate=...) alias of DeepseekV4MoE.gate
    ("ffn.shared_experts", "ffn.experts._shared_experts._layer"),  # FusedMoE shared-experts runner alias
    ("ffn.experts", "ffn.experts.routed_experts"),  # RoutedExperts inside FusedMoE
)
CONVERTS: tuple[ConvertOverride, ...] = (
    ConvertOverride("ffn.gate.tid2eid", "int_to_i32", why="hash table parameter is int32 (int64 only with MegaMoE)"),
    ConvertOverride(
        "weight_scale_inv",
        "e8m0_to_f32",
        expert_dtype="fp8",
        why="with fp8 experts every block-FP8 linear's scale parameter is float32 (DeepseekV4FP8Config.is_scale_e8m0 "
        "holds E8M0 parameters only for fp4-expert checkpoints)",
    ),
)
# DeepseekV4MLP (nvidia/model.py, and the MTP's): block-FP8 shared experts get cdiv(blocks, tp) blocks a rank, the
# checkpoint's weights and scales zero-padded on the intermediate dim (w1/w3 rows, w2 columns) before the even TP
# split, so trailing ranks hold zeros (not under sequence-parallel MoE, which ckpt-tool does not target).
PADS: tuple[str, ...] = ("shared_experts",)

PROFILE = Profile(
    name="vllm-0.33+",
    description=(
        "vLLM's DeepseekV4ForCausalLM / DeepSeekV4MTP (vllm/models/deepseek_v4/nvidia/) since 0.33: "
        "--load-format sharded_state keys (ffn.experts.routed_experts.*, ffn.experts.gate.*, "
        "ffn.experts._shared_experts._layer.*, attn.compressor.*), int32 tid2eid, float32 linear scales for "
        "fp8-expert checkpoints, shared experts zero-padded to whole blocks a rank"
    ),
    build=vllm_seed_rules,
    engine=EngineNames(
        compressor="attn.compressor",
        gate="ffn.experts.gate",
        shared="ffn.experts._shared_experts._layer",
        routed="ffn.experts.routed_experts",
        tid2eid="I32",
        fp8_expert_linear_scale="F32",
        fp4_expert_linear_scale="F8_E8M0",
        shared_pad=True,
    ),
    renames=RENAMES,
    converts=CONVERTS,
    pads=PADS,
    covers=("0.33", "0.34"),
    verified=("0.33.0", "0.34.0"),
    verified_by="each release's own model classes and ShardedStateLoader.load_weights, built on CPU (tests/engine)",
    notes=(
        "attn_sink is written with the H/tp real heads; the engine pads its parameter to the attention "
        "backend's head count (FlashMLA 64/128, FlashInfer 8..128) with -inf and the sharded loader copies "
        "the prefix, warning about the shape once per layer",
        "vLLM 0.34 no longer refuses a draft checkpoint without MTP layers under --load-format auto "
        "(model_loader/mtp_validation.py was removed): convert's check before writing is the early one",
    ),
    aliases=("vllm-0.33",),
    # DSparkDeepseekV4ForCausalLM (nvidia/dspark.py) in both releases: same decoder-layer classes and aliasing as the
    # target's, so the renames above hold for its stages too; V4.1's (deepseek_v41/nvidia/dspark.py) holds
    # model.context_wkv_proj in 0.34.0 only (draft_kind.DSPARK_V41): its files are written for one series
    drafts=("mtp", "dspark", "dspark-v41"),
    # DeepseekV41ForCausalLM (vllm/models/deepseek_v41/nvidia/vl_model.py): the same target keys in 0.33.0 and 0.34.0
    models=("text", "vision", "v41"),
    # NVIDIA's NVFP4 exports: DeepseekV4FP8Config.get_quant_method (models/deepseek_v41/quant_config.py, 0.33.0 and
    # 0.34.0) builds ModelOptNvFp4FusedMoE for the routed experts its ignore list leaves (ckpt_tool.checkpoint.
    # expert_format); the seed's vLLM predates it
    expert_formats=("mxfp4", "fp8", "nvfp4"),
)
