"""Completeness against the engine: what config.json says the engine needs, checked before any byte is written."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import run_cli, snapshot

from ckpt_tool.checkpoint.agreement import (
    config_disagreement,
    kinds_agree,
    require_agreement,
    shape_kinds,
    tensor_roles,
)
from ckpt_tool.checkpoint.completeness import check_completeness, describe_missing
from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expected import expected_shapes, required_tensors
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.errors import MTP_MISSING_MESSAGE, CheckpointError, PlanError
from ckpt_tool.fixtures.broken import S3, drop_tensors
from ckpt_tool.fixtures.make import GOOD_VARIANTS, PAD_VARIANTS, VISION_VARIANTS
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import NO_MTP_NOTE, plan_conversion


@pytest.mark.parametrize("variant", GOOD_VARIANTS + VISION_VARIANTS)
def test_required_tensors_are_exactly_what_every_good_fixture_holds(fixture_dir, variant: str) -> None:
    ckpt = open_checkpoint(fixture_dir(variant))
    required = {n for names in required_tensors(ckpt.config, {"model", "mtp"}).values() for n in names}
    optional = {n for n in ckpt.tensors if n.endswith((".emb.tok_emb.weight", ".head.weight")) and n.startswith("mtp.")}
    assert required == set(ckpt.tensors) - optional
    assert check_completeness(ckpt.config, ckpt.tensors).complete


@pytest.mark.parametrize("variant", GOOD_VARIANTS + PAD_VARIANTS + VISION_VARIANTS)
def test_every_stored_tensor_has_the_shape_and_dtype_its_config_implies(fixture_dir, variant: str) -> None:
    ckpt = open_checkpoint(fixture_dir(variant))
    expected = expected_shapes(ckpt.config)
    roles = tensor_roles(list(ckpt.tensors))
    assert set(roles) <= set(expected)  # every tensor judged, the optional MTP embedding/head too
    for role, t in zip(roles, ckpt.tensors.values()):
        assert expected[role].agrees(t.dtype, t.shape), (t.name, t.dtype, t.shape, expected[role])
    assert config_disagreement(ckpt.config, ckpt.tensors.values()) is None
    assert kinds_agree(
        ckpt.config, shape_kinds(list(ckpt.tensors), [(t.dtype, t.shape) for t in ckpt.tensors.values()])
    )
    require_agreement(ckpt.config, ckpt.tensors)


def test_names_and_shapes_come_from_one_derivation(fixture_dir) -> None:
    """Every name completeness requires has an expected shape, and routed experts share one per layer."""
    cfg = open_checkpoint(fixture_dir("fp4")).config
    required = [n for names in required_tensors(cfg, {"model", "mtp"}).values() for n in names]
    expected = expected_shapes(cfg)
    assert set(tensor_roles(required)) == set(expected) - {"mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"}
    assert tensor_roles(["layers.2.ffn.experts.7.w2.scale", "layers.2.ffn.shared_experts.w2.scale"]) == [
        "layers.2.ffn.experts.*.w2.scale",
        "layers.2.ffn.shared_experts.w2.scale",
    ]
    assert expected["layers.2.ffn.experts.*.w2.weight"].shape == (256, 512 // 2)  # MXFP4: [hidden, inter/2] int8
    assert expected["layers.2.ffn.experts.*.w2.scale"].shape == (256, 512 // 32)
    assert expected["layers.1.attn.compressor.ape"].shape == (4, 2 * 128)  # ratio 4: coff 2
    assert expected["layers.2.attn.compressor.ape"].shape == (128, 128)  # ratio 128: coff 1


# (config key, edited value, the tensor the message names first, the actual shape it names)
EDITED_KEYS = [
    ("hidden_size", 640, "embed.weight", "BF16 [512, 256]"),
    ("n_routed_experts", 16, "layers.0.ffn.gate.weight", "BF16 [8, 256]"),
    ("n_routed_experts", 4, "layers.0.ffn.gate.weight", "BF16 [8, 256]"),
    ("moe_intermediate_size", 1024, "layers.0.ffn.shared_experts.w1.weight", "F8_E4M3 [512, 256]"),
    ("num_attention_heads", 8, "layers.0.attn.wq_b.weight", "F8_E4M3 [512, 256]"),
    ("head_dim", 256, "layers.0.attn.wq_b.weight", "F8_E4M3 [512, 256]"),
    ("vocab_size", 1024, "embed.weight", "BF16 [512, 256]"),
    ("expert_dtype", "fp8", "layers.0.ffn.experts.0.w1.weight", "I8 [512, 128] (fp4)"),
    ("q_lora_rank", 512, "layers.0.attn.wq_a.weight", "F8_E4M3 [256, 256]"),
    ("o_groups", 2, "layers.0.attn.wo_a.weight", "F8_E4M3 [512, 128]"),
    ("n_shared_experts", 2, "layers.0.ffn.shared_experts.w1.weight", "F8_E4M3 [512, 256]"),
    ("num_experts_per_tok", 4, "layers.0.ffn.gate.tid2eid", "I64 [512, 2]"),
    ("hc_mult", 2, "layers.0.hc_attn_fn", "F32 [24, 1024]"),
    ("index_head_dim", 64, "layers.1.attn.indexer.wq_b.weight", "F8_E4M3 [512, 256]"),
    ("compress_ratios", [0, 128, 4, 0], "layers.1.attn.compressor.wkv.weight", "BF16 [256, 256]"),
]


@pytest.mark.parametrize("key,value,tensor,actual", EDITED_KEYS, ids=[f"{k}={v}" for k, v, *_ in EDITED_KEYS])
def test_an_edited_config_key_is_named_with_a_tensor_and_expected_vs_actual(
    fixture_dir, key, value, tensor, actual
) -> None:
    ckpt = open_checkpoint(fixture_dir("fp4"))
    cfg = V4Config.from_dict({**ckpt.config.raw, key: value})
    with pytest.raises(PlanError) as err:
        require_agreement(cfg, ckpt.tensors)
    line = str(err.value)
    named = f"{key}[1] 128" if key == "compress_ratios" else f"{key} {value!r}"
    assert line.startswith(
        f"{named} in config.json, but tensor {tensor!r} in {ckpt.tensors[tensor].file} is {actual}, not the "
    ), line
    assert "\n" not in line and f"fix {key}" in line
    found = config_disagreement(cfg, ckpt.tensors.values())
    assert found is not None and found.key == key and found.tensor.name == tensor
    assert (f"(and {found.count - 1} more tensor" in line) == (found.count > 1)  # one line, however many disagree


def test_a_disagreement_no_key_explains_names_the_tensor(fixture_dir) -> None:
    ckpt = open_checkpoint(fixture_dir("fp4"))
    tensors = dict(ckpt.tensors)
    t = tensors["layers.1.hc_ffn_scale"]
    tensors[t.name] = t._replace(shape=(4,))  # hc scales are 3 long whatever the config says
    found = config_disagreement(ckpt.config, tensors.values())
    assert found is not None and found.key is None and found.count == 1
    assert found.message(ckpt.config).startswith(
        f"tensor 'layers.1.hc_ffn_scale' in {t.file} is F32 [4], but config.json implies F32 [3];"
    )


def test_names_config_json_does_not_imply_are_not_judged(fixture_dir) -> None:
    ckpt = open_checkpoint(fixture_dir("fp4"))
    extra = ckpt.tensors["layers.0.attn_norm.weight"]._replace(name="layers.7.attn_norm.weight", shape=(3,))
    assert config_disagreement(ckpt.config, [*ckpt.tensors.values(), extra]) is None


def test_layer_kinds_follow_compress_ratio_and_hash_status(fixture_dir) -> None:
    cfg = open_checkpoint(fixture_dir("fp4")).config
    groups = required_tensors(cfg, {"model", "mtp"})
    swa, csa, hca, mtp = groups["layers.0"], groups["layers.1"], groups["layers.2"], groups["mtp.0"]
    assert "layers.0.ffn.gate.tid2eid" in swa and "layers.0.ffn.gate.bias" not in swa  # hash layer
    assert not any(".compressor." in n or ".indexer." in n for n in swa)  # ratio 0
    assert "layers.1.attn.indexer.wq_b.weight" in csa and "layers.1.attn.compressor.ape" in csa  # ratio 4
    assert "layers.2.attn.compressor.ape" in hca and not any(".indexer." in n for n in hca)  # ratio 128
    assert "mtp.0.ffn.gate.bias" in mtp and not any(".compressor." in n for n in mtp)
    assert sum(".experts." in n for n in hca) == cfg.n_routed_experts * 6


def test_a_deleted_main_layer_is_refused_before_writing(fixture_dir, tmp_path, capsys) -> None:
    ckpt = open_checkpoint(fixture_dir("fp4"))
    tensors = {n: t for n, t in ckpt.tensors.items() if not n.startswith("layers.1.")}
    with pytest.raises(PlanError, match=r"layers\.1\.\*: all 88 tensors missing"):
        plan_conversion(ckpt.config, tensors, Options())


def test_missing_parts_are_grouped_per_layer_in_one_line(fixture_dir) -> None:
    ckpt = open_checkpoint(fixture_dir("fp4"))
    gone = {
        "layers.2.attn.wo_b.weight",
        "layers.2.attn.wo_b.scale",
        "layers.0.ffn.experts.3.w1.weight",
        "layers.0.ffn.experts.5.w1.weight",
        "norm.weight",
    }
    result = check_completeness(ckpt.config, set(ckpt.tensors) - gone)
    line = result.message(ckpt.config)
    assert "\n" not in line
    assert "layers.0.ffn.experts.{3,5}.w1.weight missing" in line
    assert "layers.2.attn.wo_b.weight, .scale missing" in line
    assert "norm.weight missing" in line
    assert "download" in line


def test_the_vision_model_needs_its_tower_and_every_routers_bias_vl(fixture_dir) -> None:
    """vLLM's stock loader silently leaves bias_vl and the hash layers' gate bias uninitialised when absent, and its
    vision loader raises on a missing tower tensor only at start-up: convert refuses both from the headers."""
    ckpt = open_checkpoint(fixture_dir("vl-fp4"))
    gone = {
        "layers.0.ffn.gate.bias_vl",
        "layers.0.ffn.gate.bias",
        "mtp.0.ffn.gate.bias_vl",
        "vision.blocks.1.attn.wqkv.weight",
        "aligner.w2.bias",
    }
    line = check_completeness(ckpt.config, set(ckpt.tensors) - gone).message(ckpt.config)
    for name in gone:
        assert name in line or name.rsplit(".", 1)[0] in line, (name, line)
    with pytest.raises(PlanError, match=r"vision\.blocks\.1\.attn\.wqkv\.weight missing"):
        plan_conversion(ckpt.config, {n: t for n, t in ckpt.tensors.items() if n not in gone}, Options(tp=2))


def test_a_vision_tensor_disagreeing_with_the_vision_keys_names_the_key(fixture_dir) -> None:
    ckpt = open_checkpoint(fixture_dir("vl-fp4"))
    raw = {**ckpt.config.raw, "vision_inter_dim": 64}
    cfg = V4Config.from_dict(raw)
    with pytest.raises(PlanError, match=r"vision_inter_dim 64 in config.json, but tensor 'vision\.blocks\.0\.mlp"):
        require_agreement(cfg, ckpt.tensors)


def test_a_vision_config_without_its_tower_keys_is_refused(fixture_dir) -> None:
    raw = {**open_checkpoint(fixture_dir("vl-fp4")).config.raw}
    del raw["vision_dim"]
    with pytest.raises(CheckpointError, match="vision_dim"):
        V4Config.from_dict(raw)


def test_long_lists_are_cut_with_a_count() -> None:
    names = [f"layers.1.t{k}.weight" for k in range(12)]
    assert describe_missing("layers.1", names, 77).endswith("and 4 more missing")


def test_inspect_gives_the_same_verdict_as_convert(fixture_dir, tmp_path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("fp4"), src)
    drop_tensors(S3, lambda n: n.startswith("layers.2.attn.wo_b."))(tmp_path)
    code_i, out_i, err_i = run_cli(capsys, "inspect", src, "--json")
    code_c, _out_c, err_c = run_cli(capsys, "convert", src, src.parent / "out")
    assert code_i == code_c == 1
    assert "layers.2.attn.wo_b.weight, .scale missing" in err_i
    assert "layers.2.attn.wo_b.weight, .scale missing" in err_c
    assert json.loads(out_i)["missing_tensors"] == {
        "layers.2": ["layers.2.attn.wo_b.weight", "layers.2.attn.wo_b.scale"]
    }
    assert not (src.parent / "out").exists()


def test_only_model_converts_a_checkpoint_without_mtp_and_says_the_draft_is_elsewhere(
    fixture_dir, tmp_path, capsys
) -> None:
    src = fixture_dir("missing-mtp")
    before = snapshot(src)
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--only", "model", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["notes"] == [NO_MTP_NOTE]
    assert doc["deviations"] == []  # nothing of the draft is materialized when no draft is written
    manifest = json.loads((tmp_path / "out" / "ckpt-tool.json").read_text())
    assert manifest["notes"] == [NO_MTP_NOTE]
    assert not (tmp_path / "out" / "mtp").exists()
    assert snapshot(src) == before


def test_without_only_model_an_absent_mtp_layer_gets_the_engines_sentence(fixture_dir, tmp_path, capsys) -> None:
    code, _out, err = run_cli(capsys, "convert", fixture_dir("missing-mtp"), tmp_path / "out")
    assert code == 1
    assert MTP_MISSING_MESSAGE.format(layer=3) in err
    assert not (tmp_path / "out").exists()


def test_only_model_on_a_checkpoint_with_mtp_materializes_nothing(fixture_dir, tmp_path, capsys) -> None:
    code, out, err = run_cli(capsys, "convert", fixture_dir("fp4"), tmp_path / "out", "--only", "model", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["materialized"] == {} and doc["deviations"] == [] and doc["notes"] == []


# ---------------------------------------------------------------------------------------------
# A servable OUT/model: the source's non-weight files come along


def test_out_model_carries_tokenizer_generation_config_and_chat_template(fixture_dir, tmp_path, capsys) -> None:
    from ckpt_tool.fixtures.make import serving_files

    src = fixture_dir("fp4")
    code, _out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--tp", "2")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "ckpt-tool.json").read_text())
    for name in serving_files():
        assert (tmp_path / "out" / "model" / name).read_bytes() == (src / name).read_bytes()
        assert f"model/{name}" in manifest["serving_files"]
        assert not (tmp_path / "out" / "mtp" / name).exists()
    assert not any(
        p.name.endswith(".index.json") or p.name.startswith("model-0") for p in (tmp_path / "out" / "model").iterdir()
    )


def test_verify_fails_when_a_serving_file_is_missing_from_out(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    assert run_cli(capsys, "convert", src, tmp_path / "out")[0] == 0
    (tmp_path / "out" / "model" / "tokenizer.json").unlink()
    code, out, _err = run_cli(capsys, "verify", tmp_path / "out", "--source", src, "--level", "structure", "--json")
    assert code == 1
    failed = json.loads(out)["failures"]
    assert [c["name"] for c in failed] == ["serving-files:model"]
    assert "tokenizer.json: missing" in failed[0]["message"]


@pytest.mark.parametrize("nvfp4", [False, True], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_the_full_size_bench_skeleton_agrees_with_its_config(model: str, nvfp4: bool, monkeypatch) -> None:
    """bench/make_skeleton.py writes V4-Flash / V4-Pro's real names, shapes and dtypes, and (--nvfp4) NVIDIA's NVFP4
    export of them: its config.json must imply them all."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "make_skeleton.py"
    spec = importlib.util.spec_from_file_location(f"make_skeleton_{model}", path)
    skeleton = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, skeleton)  # (its dataclasses look their module up)
    spec.loader.exec_module(skeleton)  # a module of its own: use_pro() changes its constants
    if model == "pro":
        skeleton.use_pro()
    assert skeleton.agrees_with_its_config(nvfp4=nvfp4)
