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
from cli_helpers import rank_keys, run_cli, snapshot
from safetensors import safe_open

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.engram import EngramSplit
from ckpt_tool.checkpoint.headers import read_shard_header
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.fixtures.broken import patch_bytes, tensor_offset
from ckpt_tool.mapping.engine_table import engine_params
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.verify.linear_check import TensorCheck
from ckpt_tool.verify.numeric import check_numeric
from ckpt_tool.verify.rows import RowReader
from ckpt_tool.verify.tensor_units import ExactUnit, LinearUnit, tensor_units, unit_tensors
from ckpt_tool.verify.verdict import VerifyReport


def rank_file_keys(path: Path) -> str:
    with safe_open(path, "pt") as f:
        return " ".join(f.keys())


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
        got = rank_keys(out, "model", rank)
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
    layout = EngramSplit.from_config(cfg)
    table = "language_model.model.layers.1.engram.embed_tokens.weight"
    rows = [rank_keys(out, "model", r)[table][1][0] for r in range(tp)]
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
        got = rank_keys(out, "dspark", rank)
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


def numeric_level(src: Path, out: Path, kernels: str = "torch", act: str = "bf16") -> VerifyReport:
    """The numeric level alone on ``out`` (structure and values are the CLI's; their own tests cover them)."""
    ckpt = open_checkpoint(src)
    opts = Options(**json.loads((out / "ckpt-tool.json").read_text())["options"])
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, opts)
    headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
    report = VerifyReport(str(out), str(src), "numeric")
    check_numeric(out, plan, ckpt, headers, report, kernels=kernels, device="cpu", tokens=8, seed=1, act=act)
    return report


def numeric_problems(report: VerifyReport) -> str:
    return " ".join(
        " ".join((c.details or {}).get("problems") or [c.message])
        for c in report.failures
        if c.name.startswith("numeric")
    )


def test_verify_runs_the_numeric_level_on_v41_with_full_coverage(fixture_dir, tmp_path, capsys) -> None:
    """``verify OUT --source SRC`` (numeric, the default level) on a V4.1 OUT with its draft: every check passes,
    coverage 100 % of target and draft, the MTP reference forward skipped, saying why."""
    src, out = fixture_dir("v41"), tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--tp", "2", "--vllm", "0.34")[0] == 0
    code, stdout, err = run_cli(capsys, "verify", out, "--source", src, "--json")
    doc = json.loads(stdout)
    assert code == 0, [(c["name"], c["message"]) for c in doc["failures"]] or err
    for comp in ("model", "dspark"):
        cov = doc["coverage"]["components"][comp]
        assert cov["percent"] == 100.0 and cov["checked"] == cov["total"] > 0, (comp, cov)
    forward = [c for c in doc["results"] if c["name"] == "numeric:mtp-forward"]
    assert forward[0]["status"] == "skipped" and "DeepSeek V4.1" in forward[0]["message"], forward


@pytest.mark.parametrize(
    ("tp", "moe", "series", "act"),
    [(1, "tp", "0.33", "bf16"), (2, "tp", "0.34", "bf16"), (4, "tp", "0.33", "fp8"), (8, "ep", "0.34", "bf16")],
)
def test_the_numeric_level_covers_every_v41_target_and_draft_tensor(
    tp, moe, series, act, fixture_dir, tmp_path, capsys
):
    """Target and DSpark draft (with 0.34's context_wkv_proj, or without for 0.33) at tp 1, 2, 4 and 8 ep: every MXFP8
    linear through the kernels, MXFP4 experts, the Engram tables each rank's hash-head rows, the rest by value; one
    layout with fp8 activations (quantized in the MXFP8 block's 32-input groups)."""
    src, out = fixture_dir("v41"), tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", tp, "--moe-parallel", moe, "--vllm", series)
    assert code == 0, err
    report = numeric_level(src, out, act=act)
    assert report.ok, [(c.name, c.message) for c in report.failures]
    assert report.coverage["percent"] == 100.0, report.coverage
    comps = report.coverage["components"]
    assert set(comps) == {"model", "dspark"} and all(len(c["ranks"]) == tp for c in comps.values())


def test_mxfp8_linears_run_through_the_triton_kernel_in_the_interpreter(fixture_dir, tmp_path, capsys, monkeypatch):
    """One MXFP8 linear of each layout (replicated indexer wq_b, column-parallel wo_a, row-parallel wo_b) at tp 2
    through the Triton kernel (CPU interpreter) with vLLM's per-row scales, against the source's 32x32 blocks in torch:
    every part on every rank computed and agreeing. (The whole level passes the same way, in ~2 min on the
    interpreter; the torch path above runs it in CI.)"""
    pytest.importorskip("triton")
    import triton.language  # noqa: F401  (before the variable: see tests/test_kernels.py)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    src, out = fixture_dir("v41"), tmp_path / "out"
    assert convert(capsys, src, out, "--tp", "2")[0] == 0
    ckpt = open_checkpoint(src)
    opts = Options(**json.loads((out / "ckpt-tool.json").read_text())["options"])
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, opts)
    headers = {f.relpath: read_shard_header(out / f.relpath, f.relpath) for f in plan.files}
    wanted = ("layers.1.attn.indexer.wq_b.weight", "layers.1.attn.wo_a.weight", "layers.1.attn.wo_b.weight")
    with RowReader() as reader:
        check = TensorCheck(out, plan, ckpt, headers, reader, kernels="triton", device=torch.device("cpu"), seed=1)
        runner = check.runners["model"]
        units = [u for _, u in check.jobs if isinstance(u, LinearUnit) and u.weight.endswith(wanted)]
        assert len(units) == 3 and {u.layout for u in units} == {"full", "col", "row"}
        for u in units:
            assert u.kind == "mxfp8" and runner.run(u) is None, u.weight
    computed = runner.take_computed()
    assert all(computed[u.weight, p.source] == 0b11 for u in units for p in u.parts), computed


@pytest.mark.parametrize("series", ["0.33", "0.34"])
def test_the_numeric_units_name_every_v41_engine_parameter_exactly_once(series, fixture_dir) -> None:
    """The numeric level's units, written from vLLM's names, against the engine table at every layout; the draft's
    for the series (context_wkv_proj only in 0.34); every source tensor a unit reads is in the checkpoint."""
    ckpt = open_checkpoint(fixture_dir("v41"))
    cfg = ckpt.require_config()
    for comp in ("model", "dspark"):
        for tp, moe in [(1, "tp"), (2, "tp"), (4, "tp"), (2, "ep"), (8, "ep")]:
            units = tensor_units(cfg, "vllm-0.33+", comp, tp, moe, set(ckpt.tensors), series)
            for rank in range(tp):
                want = set(engine_params(cfg, "vllm-0.33+", comp, tp, moe, rank, series))
                names = [n for u in units if rank in u.ranks for n in unit_tensors(u)]
                assert set(names) == want, (comp, tp, moe, rank, sorted(set(names) ^ want)[:5])
            for u in units:
                reads = [u.source] if isinstance(u, ExactUnit) else [p.source for p in u.parts]
                if isinstance(u, LinearUnit) and u.kind != "bf16":
                    reads = [f"{r}.{t}" for r in reads for t in ("weight", "scale")]
                assert all(n in ckpt.tensors for n in reads), reads
    assert any(u.weight == "model.context_wkv_proj.weight" for u in units if isinstance(u, LinearUnit)) == (
        series == "0.34"
    )


def test_the_numeric_level_fails_naming_a_flipped_mxfp8_weight_or_scale_byte_and_swapped_fused_parts(
    fixture_dir, tmp_path, capsys
) -> None:
    """A byte of an MXFP8 weight (column-parallel wq_b), of an expanded scale row (row-parallel wo_b: one of the 32
    copies of a checkpoint scale row), of an Engram table and of its scale, and the two halves of the shared experts'
    gate_up_proj swapped, on one rank each, fail the numeric level, naming the engine tensor and the rank."""
    src, out = fixture_dir("v41"), tmp_path / "out"
    assert convert(capsys, src, out, "--tp", "2")[0] == 0
    assert numeric_level(src, out).ok
    layer = "language_model.model.layers.0"
    part = out / "model" / "model-rank-1-part-0.safetensors"

    def flip(name: str, row: int, col: int, bit: int) -> None:
        with safe_open(part, "pt") as f:
            cols = f.get_slice(name).get_shape()[1]
        at = tensor_offset(part, name) + row * cols + col  # one-byte elements: FP8, E8M0 as uint8
        patch_bytes(part, at, bytes([part.read_bytes()[at] ^ bit]))

    flip(f"{layer}.attn.wq_b.weight", 3, 5, 0x40)
    got = numeric_problems(numeric_level(src, out))
    assert f"{layer}.attn.wq_b.weight" in got and "rank 1" in got, got
    flip(f"{layer}.attn.wq_b.weight", 3, 5, 0x40)  # back
    flip(f"{layer}.attn.wo_b.weight_scale", 17, 1, 0x01)  # row 17: one of the 32 copies of scale row 0
    got = numeric_problems(numeric_level(src, out))
    assert f"{layer}.attn.wo_b.weight" in got and "wo_b.weight_scale" in got and "ranks summed" in got, got
    flip(f"{layer}.attn.wo_b.weight_scale", 17, 1, 0x01)
    engram = "language_model.model.layers.2.engram.embed_tokens"  # rank 1's hash-head rows, then their scales
    for name in (f"{engram}.weight", f"{engram}.weight_scale_inv"):
        flip(name, 2, 0, 0x01)
        got = numeric_problems(numeric_level(src, out))
        assert f"{name}' (rank 1): bytes differ from source layers.2.engram.embed." in got, got
        flip(name, 2, 0, 0x01)

    # the shared experts under the engine's name for them (the FusedMoE alias), weight and scale rows both swapped
    with safe_open(part, "pt") as f:
        names = [k for k in f.keys() if k.startswith(f"{layer}.ffn.") and ".gate_up_proj.weight" in k]  # noqa: SIM118
        halves = {n: f.get_tensor(n).view(torch.uint8).chunk(2) for n in names}
    assert len(names) == 2, names
    for n, (w1, w3) in halves.items():
        patch_bytes(part, tensor_offset(part, n), torch.cat([w3, w1]).numpy().tobytes())
    got = numeric_problems(numeric_level(src, out))
    assert "gate_up_proj.weight" in got and "part layers.0.ffn.shared_experts.w1" in got and "rank 1" in got, got


@pytest.mark.parametrize("series", ["0.33", "0.34"])
def test_unconvert_rebuilds_every_v41_shard_from_either_series_output(series, fixture_dir, tmp_path, capsys) -> None:
    src, out, dest = fixture_dir("v41"), tmp_path / "out", tmp_path / "dest"
    assert run_cli(capsys, "convert", src, out, "--tp", "2", "--vllm", series)[0] == 0
    code, _, err = run_cli(capsys, "unconvert", out, dest)
    assert code == 0, err
    for shard in sorted(src.glob("*.safetensors")):
        assert (dest / shard.name).read_bytes() == shard.read_bytes(), shard.name
