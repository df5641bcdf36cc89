"""DeepSeek V4.1 (DeepseekV41ForCausalLM and its DSpark draft DSparkV41DraftModel): inspect names it, its Engram
tables and its draft; convert writes every rank's keys as ckpt-tool's engine table says (Engram rows split unevenly by
hash head, MXFP8 scales one row a weight row; the draft for the vLLM series --vllm names, with or without 0.34's
context_wkv_proj) and refuses a tp vLLM refuses; verify's values level holds every byte, unconvert reads it back.
vLLM's own classes and loaders prove the same output in tests/engine/test_engine_v41.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, snapshot
from safetensors import safe_open

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import EngramLayout
from ckpt_tool.fixtures.broken import patch_bytes, tensor_offset
from ckpt_tool.mapping.engine_table import engine_params


def rank_keys(out: Path, rank: int, component: str = "model") -> dict[str, tuple[str, tuple[int, ...]]]:
    keys = {}
    for path in sorted((out / component).glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():  # noqa: SIM118
                sl = f.get_slice(k)
                keys[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return keys


def convert(capsys, src: Path, out: Path, *args) -> tuple[int, str, str]:
    return run_cli(capsys, "convert", src, out, "--target", "vllm-0.33+", "--only", "model", *args)


def test_inspect_names_v41_its_engram_tables_and_that_its_draft_differs_by_vllm_series(fixture_dir, capsys) -> None:
    code, out, err = run_cli(capsys, "inspect", fixture_dir("v41"))
    assert code == 0, err
    assert "vLLM builds DeepseekV41ForCausalLM" in out
    assert "Engram tables: layer 1:" in out and "hash heads" in out and "accepts tp 1, 2, 3, 4, 6, 8, 16" in out
    assert "draft: DSpark (DSparkV41DraftModel), 3 stages; serve with" in out
    assert "differ by vLLM series (0.34 holds model.context_wkv_proj, 0.33 does not)" in " ".join(out.split())
    code, out, _ = run_cli(capsys, "inspect", fixture_dir("v41"), "--json")
    engram = json.loads(out)["model"]["engram"]
    assert engram["layers"] == [1, 2] and engram["hash_heads"] == 16
    assert len(set(engram["rows_per_rank"]["4"]["1"])) > 1  # uneven rows a rank


@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, False), (4, False), (2, True), (8, True)])
def test_every_rank_holds_the_engine_table(tp, ep, fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("v41"), tmp_path / "out"
    code, _, err = convert(capsys, src, out, "--tp", tp, *(["--moe-parallel", "ep"] if ep else []))
    assert code == 0, err
    assert (out / "model" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    cfg = V4Config.load(src / "config.json")
    for rank in range(tp):
        want = engine_params(cfg, "vllm-0.33+", "model", tp, "ep" if ep else "tp", rank)
        got = rank_keys(out, rank)
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
        for k, p in want.items():
            assert got[k][1] == p.shape or p.prefix, (k, got[k], p)
            assert p.dtype is None or got[k][0] == p.dtype, (k, got[k], p)
        # an MXFP8 scale holds one row a weight row
        w, s = (
            got["language_model.model.layers.0.attn.wq_b.weight"],
            got["language_model.model.layers.0.attn.wq_b.weight_scale"],
        )
        assert s[0] == "U8" and s[1][0] == w[1][0] and s[1][1] == w[1][1] // 32
    layout = EngramLayout.from_config(cfg)
    rows = [rank_keys(out, r)["language_model.model.layers.1.engram.embed_tokens.weight"][1][0] for r in range(tp)]
    assert rows == [hi - lo for lo, hi in layout.rank_rows(1, tp)]


def test_a_tp_vllm_refuses_for_the_engram_split_is_refused_before_writing(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, err = convert(capsys, fixture_dir("v41"), out, "--tp", "5")
    assert code == 1 and "16 hash heads over tp=5" in err and "ParallelEngramEmbedding" in err, err
    assert not out.exists()


@pytest.mark.parametrize(("vllm", "series"), [("0.33.0", "0.33"), ("0.34", "0.34"), (None, "0.34"), ("0.35.1", "0.34")])
def test_the_v41_draft_is_written_for_the_vllm_series_it_names(vllm, series, fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("v41"), tmp_path / "out"
    args = ["--tp", "2", "--target", "vllm-0.33+", *(["--vllm", vllm] if vllm else []), "--json"]
    code, stdout, err = run_cli(capsys, "convert", src, out, *args)
    assert code == 0, err
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["options"]["vllm_series"] == series
    assert any(f"written for vLLM {series}" in n for n in json.loads(stdout)["notes"]), stdout
    cfg = V4Config.load(src / "config.json")
    for rank in range(2):
        want = engine_params(cfg, "vllm-0.33+", "dspark", 2, "tp", rank, series)
        got = rank_keys(out, rank, "dspark")
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for k, p in want.items():
            assert (got[k][1] == p.shape or p.prefix) and got[k][0] == p.dtype, (k, got[k], p)
    assert ("model.context_wkv_proj.weight" in got) == (series == "0.34")
    assert (out / "dspark" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, "--level", "values", "--json")
    assert code == 0, stdout + err


def test_the_0_34_draft_stacks_every_stage_wkv_with_its_scale_expanded(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("v41"), tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--only", "mtp", "--vllm", "0.34")[0] == 0
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]

    def source(name):
        with safe_open(src / index[name], "pt") as f:
            return f.get_tensor(name)

    with safe_open(next((out / "dspark").glob("model-rank-0-part-*.safetensors")), "pt") as f:
        weight, scale = (
            f.get_tensor("model.context_wkv_proj.weight"),
            f.get_tensor("model.context_wkv_proj.weight_scale"),
        )
    stages = range(3)
    want_w = torch.cat([source(f"mtp.{i}.attn.wkv.weight") for i in stages])
    want_s = torch.cat([source(f"mtp.{i}.attn.wkv.scale").view(torch.uint8).repeat_interleave(32, 0) for i in stages])
    assert torch.equal(weight.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(scale, want_s)


def test_a_vllm_series_older_than_the_profile_is_refused_for_the_v41_draft(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", fixture_dir("v41"), out, "--target", "vllm-0.33+", "--vllm", "0.32")
    assert code == 1 and "--vllm 0.32" in err and "covers vLLM 0.33, 0.34" in err, err
    assert not out.exists()
    code, _, err = run_cli(capsys, "convert", fixture_dir("v41"), out, "--vllm", "latest")
    assert code == 2 and "not a vLLM version" in err, err


def test_a_v4_conversion_records_no_vllm_series(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", fixture_dir("dspark-fp4"), out, "--vllm", "0.33")[0] == 0
    assert "vllm_series" not in json.loads((out / "ckpt-tool.json").read_text())["options"]


@pytest.mark.parametrize(
    ("variant", "only", "must"),
    [
        ("v41-missing-engram", "model", "layers.2.engram.embed.weight, .scale missing"),
        ("v41-missing-stage", "mtp", "DSpark stage mtp.2 has no tensor"),
    ],
)
def test_a_broken_v41_checkpoint_is_refused_naming_what_is_missing(
    variant, only, must, fixture_dir, tmp_path, capsys
) -> None:
    src = fixture_dir(variant)
    before = snapshot(src)
    code, _, err = run_cli(capsys, "inspect", src)
    assert code == 1 and must in err and "download the missing files again" in err, err
    if only == "model":
        code, _, err = convert(capsys, src, tmp_path / "out")
        assert code == 1 and must in err, err
    assert not (tmp_path / "out").exists() and snapshot(src) == before


def test_values_level_passes_and_catches_a_flipped_engram_byte_and_unconvert_reads_it_back(
    fixture_dir, tmp_path, capsys
) -> None:
    src, out = fixture_dir("v41"), tmp_path / "out"
    assert convert(capsys, src, out, "--tp", "4")[0] == 0
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, "--level", "values", "--json")
    assert code == 0, stdout + err

    dest = tmp_path / "dest"
    code, _, err = run_cli(capsys, "unconvert", out, dest, "--partial")
    assert code == 0, err
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    whole = {f for f in set(index.values()) if not any(n.startswith("mtp.") for n, g in index.items() if g == f)}
    for shard in sorted(whole):
        assert (dest / shard).read_bytes() == (src / shard).read_bytes(), shard

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    part = bad / "model" / "model-rank-3-part-0.safetensors"
    for name in (
        "language_model.model.layers.2.engram.embed_tokens.weight",
        "language_model.model.layers.0.attn.wq_b.weight_scale",
    ):
        at = tensor_offset(part, name) + 7
        patch_bytes(part, at, bytes([part.read_bytes()[at] ^ 0x01]))
    code, stdout, _ = run_cli(capsys, "verify", bad, "--source", src, "--level", "values", "--json")
    failed = " ".join(
        " ".join((c.get("details") or {}).get("problems") or [c["message"]]) for c in json.loads(stdout)["failures"]
    )
    assert code == 1 and "engram.embed_tokens.weight" in failed and "wq_b.weight_scale" in failed, failed


def test_the_numeric_level_says_it_does_not_cover_v41_yet(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("v41"), tmp_path / "out"
    assert convert(capsys, src, out, "--tp", "2")[0] == 0
    code, _, err = run_cli(capsys, "verify", out, "--source", src)
    assert code == 2 and "does not cover DeepSeek V4.1 yet" in err and "--level values" in err, err


@pytest.mark.parametrize("series", ["0.33", "0.34"])
def test_unconvert_rebuilds_every_v41_shard_from_either_series_output(series, fixture_dir, tmp_path, capsys) -> None:
    src, out, dest = fixture_dir("v41"), tmp_path / "out", tmp_path / "dest"
    assert run_cli(capsys, "convert", src, out, "--tp", "2", "--vllm", series)[0] == 0
    code, _, err = run_cli(capsys, "unconvert", out, dest)
    assert code == 0, err
    for shard in sorted(src.glob("*.safetensors")):
        assert (dest / shard.name).read_bytes() == shard.read_bytes(), shard.name
