"""The DSpark draft (DeepSeek-V4-Flash-0731's mtp.0-2): inspect names it, convert writes it to OUT/dspark in
vLLM's DSparkDeepseekV4ForCausalLM layout (the per-rank keys checked against ckpt-tool's engine table here, and
against vLLM's own classes and loaders in tests/engine/test_engine_dspark.py), verify covers every tensor, and each
broken checkpoint gets its own diagnosis before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import rank_keys, run_cli, snapshot

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.fixtures.broken import patch_bytes, tensor_offset
from ckpt_tool.fixtures.make import DSPARK_BLOCK_SIZE, DSPARK_STAGES, MAIN_LAYERS
from ckpt_tool.mapping.engine_table import engine_params

DOWNLOAD = "download the missing files again"


def convert(capsys, src: Path, out: Path, *args) -> tuple[int, str, str]:
    return run_cli(capsys, "convert", src, out, "--target", "vllm-0.33+", *args)


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_names_the_dspark_draft_its_stages_and_how_to_serve_it(fixture_dir, capsys) -> None:
    code, out, err = run_cli(capsys, "inspect", fixture_dir("dspark-fp4"))
    assert code == 0, err
    assert "DSpark stages: expected mtp.0, mtp.1, mtp.2;" in out and "missing none" in out
    assert "draft: DSpark (DSparkDraftModel), 3 stages" in out
    assert f'"method": "dspark", "model": "OUT/dspark", "num_speculative_tokens": {DSPARK_BLOCK_SIZE}' in out

    code, out, _ = run_cli(capsys, "inspect", fixture_dir("dspark-fp4"), "--json")
    kind = json.loads(out)["model"]["draft_kind"]
    assert kind["kind"] == "dspark" and kind["method"] == "dspark" and kind["folder"] == "dspark"
    assert kind["layers"] == DSPARK_STAGES and kind["num_speculative_tokens"] == DSPARK_BLOCK_SIZE


def test_inspect_of_a_classic_checkpoint_names_the_mtp_draft(fixture_dir, capsys) -> None:
    code, out, _ = run_cli(capsys, "inspect", fixture_dir("fp4"), "--json")
    assert code == 0
    kind = json.loads(out)["model"]["draft_kind"]
    assert (kind["kind"], kind["method"], kind["folder"], kind["layers"]) == ("mtp", "mtp", "mtp", 1)


# ---------------------------------------------------------------------------------------------
# Diagnoses, before anything is written


@pytest.mark.parametrize(
    ("variant", "must", "must_not"),
    [
        ("dspark-missing-stage", ["DSpark stage mtp.2 has no tensor", DOWNLOAD], ["MTP speculative decoding"]),
        ("dspark-missing-head", ["mtp.2.markov_head.markov_w2.weight", DOWNLOAD], ["enorm", "e_proj"]),
        ("dspark-no-mtp", ["DSpark stage mtp.0 has no tensor", "--only model"], ["enorm", "MTP speculative"]),
        ("dspark-config-mtp-weights", ["classic MTP head", "mtp.0.e_proj.weight", "config.json"], [DOWNLOAD]),
        ("mtp-config-dspark-weights", ["hold DSpark stages", "mtp.0.main_proj.weight", "config.json"], [DOWNLOAD]),
        ("missing-mtp", ["MTP speculative decoding layer 3"], ["DSpark", "dspark"]),
    ],
)
def test_a_broken_draft_gets_its_own_diagnosis_and_nothing_is_written(
    variant, must, must_not, fixture_dir, tmp_path, capsys
) -> None:
    src = fixture_dir(variant)
    before = snapshot(src)
    out = tmp_path / "out"
    for cmd in (["inspect", src], ["convert", src, out]):
        code, _, err = run_cli(capsys, *cmd)
        assert code == 1, (cmd, err)
        line = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(line) == 1, err
        assert all(m in line[0] for m in must) and not any(m in line[0] for m in must_not), line[0]
    assert not out.exists()
    assert snapshot(src) == before


def test_only_model_converts_the_target_of_a_dspark_config_without_stages(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, err = convert(capsys, fixture_dir("dspark-no-mtp"), out, "--only", "model")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["model"]


def test_a_head_tensor_in_two_stages_is_refused_naming_both(fixture_copy, tmp_path, capsys) -> None:
    """vLLM's _remap_dspark_name takes head-stack tensors from any stage, and a second copy silently wins."""
    src = fixture_copy("dspark-fp4")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["mtp.2.norm.weight"]
    path = src / shard
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    size = header["mtp.2.norm.weight"]["data_offsets"][1] - header["mtp.2.norm.weight"]["data_offsets"][0]
    header["mtp.1.norm.weight"] = {**header["mtp.2.norm.weight"], "data_offsets": [end, end + size]}
    body = raw[8 + n :][:end] + raw[8 + n :][slice(*header["mtp.2.norm.weight"]["data_offsets"])]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)
    index["weight_map"]["mtp.1.norm.weight"] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = convert(capsys, src, tmp_path / "out")
    assert code == 1
    assert "model.norm.weight" in err and "'mtp.1.norm.weight'" in err and "'mtp.2.norm.weight'" in err, err


def test_the_seed_profile_refuses_a_dspark_draft(fixture_dir, tmp_path, capsys) -> None:
    code, _, err = run_cli(capsys, "convert", fixture_dir("dspark-fp4"), tmp_path / "out", "--target", "vllm-seed")
    assert code == 1
    assert "dspark draft" in err and "vllm-seed" in err and "--only model" in err, err


# ---------------------------------------------------------------------------------------------
# The output


@pytest.mark.parametrize(("variant", "tp", "ep"), [("dspark-fp4", 1, False), ("dspark-fp4", 2, False),
                                                   ("dspark-fp4", 2, True), ("dspark-fp8", 2, False)])  # fmt: skip
def test_dspark_folder_holds_the_engine_table_on_every_rank(variant, tp, ep, fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir(variant)
    out = tmp_path / "out"
    code, _, err = convert(capsys, src, out, "--tp", tp, *(["--moe-parallel", "ep"] if ep else []))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dspark", "model"]
    assert (out / "dspark" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    cfg = V4Config.load(src / "config.json")
    want = engine_params(cfg, "vllm-0.33+", "dspark", tp, "ep" if ep else "tp")
    for rank in range(tp):
        got = rank_keys(out, "dspark", rank)
        assert set(got) == set(want), set(got) ^ set(want)
        for k, p in want.items():
            shape_ok = got[k][1] == p.shape or (p.prefix and all(a <= b for a, b in zip(got[k][1], p.shape)))
            assert shape_ok and (p.dtype is None or got[k][0] == p.dtype), (k, got[k], p)
    # stage keys are the ModuleList index, never num_hidden_layers + i as the classic MTP's
    assert not any(k.startswith(f"model.layers.{MAIN_LAYERS}.") for k in rank_keys(out, "dspark", 0))


def test_only_mtp_writes_the_dspark_draft_alone(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, err = convert(capsys, fixture_dir("dspark-fp4"), out, "--only", "mtp")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dspark"]


def test_verify_covers_every_dspark_tensor_and_catches_a_flipped_byte(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("dspark-fp4"), tmp_path / "out"
    assert convert(capsys, src, out, "--tp", "2")[0] == 0
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, "--json")
    doc = json.loads(stdout)
    assert code == 0, err
    assert doc["coverage"]["checked"] == doc["coverage"]["total"]
    assert doc["coverage"]["components"]["dspark"]["checked"] == doc["coverage"]["components"]["dspark"]["total"] > 0
    forward = [c for c in doc["results"] if c["name"] == "numeric:mtp-forward"]
    assert forward and forward[0]["status"] == "skipped" and "DSpark" in forward[0]["message"]

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    part = bad / "dspark" / "model-rank-1-part-0.safetensors"
    at = tensor_offset(part, "model.context_wkv_proj.weight") + 3
    patch_bytes(part, at, bytes([part.read_bytes()[at] ^ 0x10]))
    code, stdout, _ = run_cli(capsys, "verify", bad, "--source", src, "--level", "values", "--json")
    failed = [c for c in json.loads(stdout)["results"] if c["status"] == "failed"]
    assert code == 1 and any("context_wkv_proj" in c["message"] for c in failed), failed


def test_unconvert_rebuilds_the_dspark_source_from_out_alone(fixture_dir, tmp_path, capsys) -> None:
    """The aliases the DSpark draft reads (embed, head, every stage's wkv a second time) agree with the tensors
    they copy, so OUT alone gives back every source file byte for byte."""
    src, out, dest = fixture_dir("dspark-fp8"), tmp_path / "out", tmp_path / "dest"
    assert convert(capsys, src, out, "--tp", "2")[0] == 0
    code, _, err = run_cli(capsys, "unconvert", out, dest)
    assert code == 0, err
    for shard in sorted(src.glob("*.safetensors")):
        assert (dest / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_a_hub_only_mtp_conversion_fetches_the_stages_and_the_tensors_the_draft_aliases(fixture_dir) -> None:
    """--only mtp from the hub fetches only what the plan reads: every mtp.* tensor, and embed/head, which the DSpark
    draft holds as the target's own shards."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.hub_needs import needed_sources
    from ckpt_tool.mapping.plan import Options

    ck = open_checkpoint(fixture_dir("dspark-fp4"))
    need = needed_sources(set(ck.tensors), ck.config, Options(only="mtp", profile="vllm-0.33+"))
    assert need == {n for n in ck.tensors if n.startswith("mtp.")} | {"embed.weight", "head.weight"}
