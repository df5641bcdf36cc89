"""The reference forward's name tables: each role of an MTP layer (``enorm``, ``wq_a``, ``expert.{j}.w1``, ...) and
the tensor it reads, in DeepSeek's names on the source side and in the engine's names on the converted side."""

from __future__ import annotations

from ckpt_tool.mapping.profiles import PROFILES, EngineNames

# Roles of the reference forward → tensor names. Source side: suffix after ``mtp.{i}.``.
SOURCE_TENSORS = {
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "norm": "norm.weight",
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "q_norm": "attn.q_norm.weight",
    "kv_norm": "attn.kv_norm.weight",
    "attn_sink": "attn.attn_sink",
    "gate.weight": "ffn.gate.weight",
    "gate.bias": "ffn.gate.bias",
    **{f"hc_{p}_{t}": f"hc_{p}_{t}" for p in ("attn", "ffn", "head") for t in ("fn", "base", "scale")},
}
SOURCE_LINEARS = {
    "e_proj": "e_proj",
    "h_proj": "h_proj",
    "wq_a": "attn.wq_a",
    "wkv": "attn.wkv",
    "wq_b": "attn.wq_b",
    "wo_a": "attn.wo_a",
    "wo_b": "attn.wo_b",
    "shared.w1": "ffn.shared_experts.w1",
    "shared.w2": "ffn.shared_experts.w2",
    "shared.w3": "ffn.shared_experts.w3",
}


def converted_tensor_names(engine: EngineNames) -> dict[str, str]:
    """Converted side: role -> engine name in one MTP layer ({S} = num_hidden_layers + i), from the profile's
    engine names (where the router, shared and routed experts live). Never read from the rule table, so a
    wrong rule cannot make both sides agree; tests/test_profile_consistency.py holds these names to the
    engine table of every profile."""
    blk, ffn = "model.layers.{S}.mtp_block", "model.layers.{S}.mtp_block.{part}"
    gate, shared = ffn.format(S="{S}", part=engine.gate), ffn.format(S="{S}", part=engine.shared)
    return {
        "enorm": "model.layers.{S}.enorm.weight",
        "hnorm": "model.layers.{S}.hnorm.weight",
        "norm": "model.layers.{S}.shared_head.norm.weight",
        "hc_head_fn": "model.layers.{S}.hc_head_fn",
        "hc_head_base": "model.layers.{S}.hc_head_base",
        "hc_head_scale": "model.layers.{S}.hc_head_scale",
        "attn_norm": f"{blk}.attn_norm.weight",
        "ffn_norm": f"{blk}.ffn_norm.weight",
        "q_norm": f"{blk}.attn.q_norm.weight",
        "kv_norm": f"{blk}.attn.kv_norm.weight",
        "attn_sink": f"{blk}.attn.attn_sink",
        "gate.weight": f"{gate}.weight",
        "gate.bias": f"{gate}.e_score_correction_bias",
        **{f"hc_{p}_{t}": f"{blk}.hc_{p}_{t}" for p in ("attn", "ffn") for t in ("fn", "base", "scale")},
        "embed": "model.embed_tokens.weight",
        "head": "model.layers.{S}.shared_head.head.weight",
        # linears: base names of (weight, scale)
        "e_proj": "model.layers.{S}.e_proj",
        "h_proj": "model.layers.{S}.h_proj",
        "fused_wqa_wkv": f"{blk}.attn.fused_wqa_wkv",
        "wq_b": f"{blk}.attn.wq_b",
        "wo_a": f"{blk}.attn.wo_a",
        "wo_b": f"{blk}.attn.wo_b",
        "gate_up_proj": f"{shared}.gate_up_proj",
        "down_proj": f"{shared}.down_proj",
        "experts": ffn.format(S="{S}", part=engine.routed),
    }


CONVERTED_TENSORS: dict[str, dict[str, str]] = {name: converted_tensor_names(p.engine) for name, p in PROFILES.items()}
