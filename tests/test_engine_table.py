"""verify against the target engine's parameter table: a profile gone stale fails verify, not the engine.

(The table itself is checked against vLLM 0.33's own model classes in tests/engine.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.fixtures.make import GOOD_VARIANTS
from ckpt_tool.mapping import profiles
from ckpt_tool.mapping.engine_table import engine_params
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.profiles import vllm_0_33_plus
from ckpt_tool.output.convert import convert
from ckpt_tool.verify.levels import verify

CASES = [(v, tp, moe) for v in GOOD_VARIANTS for tp, moe in ((1, "tp"), (2, "tp"), (4, "ep"))]


@pytest.mark.parametrize("profile", ["vllm-0.33+", "vllm-seed"])
@pytest.mark.parametrize("variant,tp,moe", CASES, ids=[f"{v}-tp{t}-{m}" for v, t, m in CASES])
def test_every_rank_matches_the_engine_table(fixture_dir, tmp_path, variant, tp, moe, profile) -> None:
    src = fixture_dir(variant)
    convert(src, tmp_path / "out", Options(tp=tp, moe_parallel=moe, profile=profile))
    report = verify(tmp_path / "out", src, level="structure")
    engine = [c for c in report.checks if c.name.startswith("engine:")]
    assert report.ok, [c.message for c in report.failures]
    assert sorted(c.name for c in engine) == sorted(
        f"engine:{comp}/rank-{r}" for comp in ("model", "mtp") for r in range(tp)
    )


def _stale(monkeypatch, **changes) -> None:
    p = profiles.PROFILES["vllm-0.33+"]
    monkeypatch.setitem(profiles.PROFILES, "vllm-0.33+", replace(p, **changes))


def test_a_profile_missing_a_rename_fails_verify_naming_the_tensor(fixture_dir, tmp_path, monkeypatch) -> None:
    src = fixture_dir("fp4")
    _stale(monkeypatch, renames=tuple(r for r in vllm_0_33_plus.RENAMES if r[0] != "ffn.experts"))
    convert(src, tmp_path / "out", Options(tp=2))
    report = verify(tmp_path / "out", src, level="structure")
    failed = {c.name: c for c in report.failures}
    assert set(failed) == {f"engine:{c}/rank-{r}" for c in ("model", "mtp") for r in (0, 1)}
    msg = failed["engine:mtp/rank-0"].message
    assert "ffn.experts.w13_weight" in msg and "not a parameter of the engine" in msg
    problems = failed["engine:model/rank-1"].details["problems"]
    assert any("ffn.experts.routed_experts.w2_weight_scale' is missing" in p for p in problems)


def test_a_profile_writing_the_wrong_dtype_fails_verify(fixture_dir, tmp_path, monkeypatch) -> None:
    src = fixture_dir("fp8-e8m0")
    _stale(monkeypatch, converts=tuple(c for c in vllm_0_33_plus.CONVERTS if c.convert != "e8m0_to_f32"))
    convert(src, tmp_path / "out", Options(tp=1))
    report = verify(tmp_path / "out", src, level="structure")
    problems = [p for c in report.failures for p in c.details["problems"]]
    assert any("fused_wqa_wkv.weight_scale_inv': dtype F8_E8M0, the engine's parameter is F32" in p for p in problems)
    assert not any("routed_experts" in p for p in problems)  # expert scales convert by the base table


def test_engine_table_of_v4_flash_dimensions() -> None:
    cfg = V4Config.from_dict(
        {
            "model_type": "deepseek_v4",
            "vocab_size": 129280,
            "hidden_size": 4096,
            "num_hidden_layers": 43,
            "num_nextn_predict_layers": 1,
            "num_attention_heads": 64,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1024,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 2048,
            "num_hash_layers": 3,
            "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
            "hc_mult": 4,
            "rms_norm_eps": 1e-6,
        }
    )
    mtp = engine_params(cfg, "vllm-0.33+", "mtp", 8, "ep")
    r = "model.layers.43.mtp_block.ffn.experts.routed_experts"
    assert mtp[f"{r}.w13_weight"].shape == (32, 4096, 2048) and mtp[f"{r}.w13_weight"].dtype == "U8"
    assert (
        mtp["model.layers.43.mtp_block.attn.attn_sink"].shape == (8,)
        and mtp["model.layers.43.mtp_block.attn.attn_sink"].prefix
    )
    model = engine_params(cfg, "vllm-0.33+", "model", 8, "tp")
    assert model["model.layers.0.ffn.experts.gate.tid2eid"].dtype == "I32"
    assert "model.layers.2.attn.indexer.wq_b.weight" in model and "model.layers.3.attn.indexer.wq_b.weight" not in model
    assert model["model.layers.3.ffn.experts.routed_experts.w2_weight"].shape == (256, 4096, 128)
