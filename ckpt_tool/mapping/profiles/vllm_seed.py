"""Profile ``vllm-seed``: the layout vLLM's DeepSeek V4 MTP loader placed before vLLM 0.33.

``DeepSeekV4MTP.load_weights`` of vLLM's first DeepSeek V4 support (``vllm/model_executor/models/
deepseek_v4_mtp.py``, before the model moved to ``vllm/models/deepseek_v4/`` in 0.33) and the main model
beside it: the parameter names as those modules declare them (``ffn.gate.*``, ``ffn.shared_experts.*``,
``ffn.experts.w13_weight``, ``attn.mla_attn.compressor.*``), scales and the hash table copied in their
stored dtypes. It is the base rule table unchanged. No released vLLM's ``sharded_state`` loader takes
this layout (0.33 and later key the MoE module's aliases): it is kept for engines built from that code.
That loader is what "the seed" means across the code (docs/profiles.md#the-seed).
"""

from __future__ import annotations

from ckpt_tool.mapping.profiles.profile import EngineNames, Profile
from ckpt_tool.mapping.rules import vllm_seed_rules

PROFILE = Profile(
    name="vllm-seed",
    description=(
        "vLLM's DeepSeek V4 MTP loader before 0.33 (ffn.gate.*, ffn.shared_experts.*, ffn.experts.w13_weight, "
        "attn.mla_attn.compressor.*; tid2eid and scales in their stored dtypes)"
    ),
    build=vllm_seed_rules,
    engine=EngineNames(
        compressor="attn.mla_attn.compressor",
        gate="ffn.gate",
        shared="ffn.shared_experts",
        routed="ffn.experts",
        tid2eid=None,
        fp8_expert_linear_scale=None,
        fp4_expert_linear_scale=None,
    ),
    verified_by="that loader's code (DeepSeekV4MTP.load_weights); no released vLLM's sharded_state loader takes it",
)
