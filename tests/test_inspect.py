"""``ckpt-tool inspect``: header-only summaries, exit codes, one-line errors, JSON output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.cli.entry import main
from ckpt_tool.errors import MTP_MISSING_MESSAGE
from ckpt_tool.fixtures.make import (
    BROKEN_VARIANTS,
    DRAFT_BROKEN_VARIANTS,
    GOOD_VARIANTS,
    NVFP4_BROKEN_VARIANTS,
    VARIANTS,
)

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
SHARDS = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]

MTP_SENTENCE = (
    "MTP speculative decoding layer 3 weights missing from checkpoint. "
    "The checkpoint may have been quantized without including the MTP layers. "
    "Use a checkpoint that includes MTP layer weights, or disable speculative decoding."
)

QUANT = {
    # variant: (linear_scale_dtype, expert_weight_dtype, expert_scale_dtype, expert_format)
    "fp4": ("F8_E8M0", "I8", "F8_E8M0", "fp4"),
    "fp4-mtp-emb": ("F8_E8M0", "I8", "F8_E8M0", "fp4"),
    "fp4-2mtp": ("F8_E8M0", "I8", "F8_E8M0", "fp4"),
    "fp8": ("F32", "F8_E4M3", "F32", "fp8"),
    "fp8-e8m0": ("F8_E8M0", "F8_E4M3", "F8_E8M0", "fp8"),
}

BROKEN_FILE = {
    "truncated": SHARDS[3],
    "bad-header-len": SHARDS[3],
    "overlap": SHARDS[3],
    "missing-file": SHARDS[1],
}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_error_line(err: str) -> str:
    lines = _ANSI.sub("", err).strip("\n").splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CKPT_TOOL_DEBUG", None)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# Good variants


@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_inspect_json_of_good_variant_reports_counts_mtp_and_quant(fixture_dir, capsys, variant: str) -> None:
    root = fixture_dir(variant)
    code, out, err = run_cli(capsys, str(root), "--json")
    assert code == 0, err
    assert err == ""
    doc = json.loads(out)
    index = json.loads((root / INDEX).read_text())
    v = VARIANTS[variant]

    assert doc["ok"] is True and doc["problems"] == [] and doc["config_error"] is None
    assert doc["source"] == str(root)
    assert doc["tensor_count"] == len(index["weight_map"])
    assert doc["total_bytes"] == index["metadata"]["total_size"]
    assert sum(doc["dtypes"].values()) == doc["tensor_count"]
    assert sum(doc["dtype_bytes"].values()) == doc["total_bytes"]
    assert [f["file"] for f in doc["files"]] == SHARDS
    assert sum(f["tensors"] for f in doc["files"]) == doc["tensor_count"]
    for f in doc["files"]:
        assert f["tensors"] == sum(1 for file in index["weight_map"].values() if file == f["file"])
    assert doc["main_layers"] == [0, 1, 2]
    assert doc["mtp_expected"] == list(range(v.mtp_layers))
    assert doc["mtp_present"] == list(range(v.mtp_layers))
    assert doc["mtp_missing"] == []
    assert set(doc["mtp_tensor_counts"]) == {str(i) for i in range(v.mtp_layers)}
    assert all(n > 0 for n in doc["mtp_tensor_counts"].values())

    lin_s, exp_w, exp_s, fmt = QUANT[variant]
    q = doc["quant"]
    assert q["linear_weight_dtype"] == "F8_E4M3"
    assert q["linear_scale_dtype"] == lin_s
    assert q["expert_weight_dtype"] == exp_w
    assert q["expert_scale_dtype"] == exp_s
    assert q["expert_format"] == fmt
    assert q["config_expert_dtype"] == v.expert_dtype
    assert q["consistent"] is True


def test_fp4_quant_fields_and_fp8_quant_fields(fixture_dir, capsys) -> None:
    _, out, _ = run_cli(capsys, str(fixture_dir("fp4")), "--json")
    q = json.loads(out)["quant"]
    assert (q["linear_scale_dtype"], q["expert_format"]) == ("F8_E8M0", "fp4")
    _, out, _ = run_cli(capsys, str(fixture_dir("fp8")), "--json")
    q = json.loads(out)["quant"]
    assert (q["linear_scale_dtype"], q["expert_format"]) == ("F32", "fp8")


def test_mtp_tensor_counts_include_emb_and_head_when_stored(fixture_dir, capsys) -> None:
    _, out, _ = run_cli(capsys, str(fixture_dir("fp4")), "--json")
    plain = json.loads(out)["mtp_tensor_counts"]["0"]
    _, out, _ = run_cli(capsys, str(fixture_dir("fp4-mtp-emb")), "--json")
    assert json.loads(out)["mtp_tensor_counts"]["0"] == plain + 2


def test_inspect_human_output_of_good_variant(fixture_dir, capsys) -> None:
    root = fixture_dir("fp4")
    code, out, err = run_cli(capsys, str(root))
    assert code == 0 and err == ""
    assert "verdict: ok" in out
    assert "main layers: 0-2 (3)" in out
    assert "MTP layers: expected mtp.0; present mtp.0" in out  # "expected 0" read as "none expected"
    for shard in SHARDS:
        assert shard in out
    assert "F8_E8M0" in out and "I8 (fp4)" in out


def test_inspect_via_python_dash_m_module_entry(fixture_dir) -> None:
    root = fixture_dir("fp8")
    res = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "inspect", str(root), "--json"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True
    assert doc["tensor_count"] == len(json.loads((root / INDEX).read_text())["weight_map"])
    assert doc["quant"]["expert_format"] == "fp8"


def test_inspect_of_index_json_path_equals_inspect_of_folder(fixture_dir, capsys) -> None:
    root = fixture_dir("fp4")
    code, out, err = run_cli(capsys, str(root / INDEX), "--json")
    assert code == 0, err
    by_index = json.loads(out)
    _, out, _ = run_cli(capsys, str(root), "--json")
    by_folder = json.loads(out)
    by_index.pop("source"), by_folder.pop("source")
    assert by_index == by_folder


def test_inspect_of_a_single_safetensors_file(fixture_dir, capsys) -> None:
    root = fixture_dir("fp4")
    index = json.loads((root / INDEX).read_text())["weight_map"]
    code, out, err = run_cli(capsys, str(root / SHARDS[3]), "--json")
    assert code == 0, err  # the last shard holds the tail of mtp.0, so the config's MTP layer is present
    doc = json.loads(out)
    assert [f["file"] for f in doc["files"]] == [SHARDS[3]]
    assert doc["tensor_count"] == sum(1 for f in index.values() if f == SHARDS[3])
    assert doc["mtp_present"] == [0]


def test_inspect_of_a_single_shard_without_mtp_reports_it_missing(fixture_dir, capsys) -> None:
    code, out, err = run_cli(capsys, str(fixture_dir("fp4") / SHARDS[0]), "--json")
    assert code == 1
    assert json.loads(out)["mtp_missing"] == [0]
    assert MTP_SENTENCE in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# Failed checks


def test_missing_mtp_message_constant_renders_the_exact_sentence() -> None:
    assert MTP_MISSING_MESSAGE.format(layer=3) == MTP_SENTENCE


def test_missing_mtp_exits_1_with_the_exact_sentence(fixture_dir, capsys) -> None:
    code, out, err = run_cli(capsys, str(fixture_dir("missing-mtp")))
    assert code == 1
    line = one_error_line(err)
    assert line == "error: " + MTP_SENTENCE
    assert "verdict: ok" not in out


def test_missing_mtp_json_reports_ok_false_and_the_sentence(fixture_dir, capsys) -> None:
    code, out, err = run_cli(capsys, str(fixture_dir("missing-mtp")), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    assert doc["mtp_expected"] == [0] and doc["mtp_present"] == [] and doc["mtp_missing"] == [0]
    assert doc["problems"] == [MTP_SENTENCE]
    assert one_error_line(err) == "error: " + MTP_SENTENCE


def test_every_broken_variant_is_covered() -> None:
    # the NVFP4 exports' broken variants: tests/test_nvfp4.py (inspect and convert, each with its diagnosis)
    covered = set(BROKEN_FILE) | {"missing-mtp"} | set(DRAFT_BROKEN_VARIANTS) | set(NVFP4_BROKEN_VARIANTS)
    assert covered == set(BROKEN_VARIANTS)


@pytest.mark.parametrize("variant", sorted(BROKEN_FILE))
def test_broken_variant_exits_1_with_one_error_line_naming_the_file(fixture_dir, capsys, variant: str) -> None:
    code, out, err = run_cli(capsys, str(fixture_dir(variant)))
    assert code == 1
    line = one_error_line(err)
    assert line.startswith(f"error: {BROKEN_FILE[variant]}: "), line
    assert out == ""


@pytest.mark.parametrize("variant", sorted(BROKEN_FILE))
def test_broken_variant_with_json_prints_one_json_document_with_ok_false(fixture_dir, capsys, variant: str) -> None:
    root = fixture_dir(variant)
    code, out, err = run_cli(capsys, str(root), "--json")
    assert code == 1
    doc = json.loads(out)  # exactly one document: json.loads rejects trailing text
    assert doc["ok"] is False and doc["source"] == str(root)
    assert doc["error"].startswith(BROKEN_FILE[variant] + ": ")
    assert one_error_line(err) == "error: " + doc["error"]


def test_broken_variant_via_subprocess_has_no_traceback(fixture_dir) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "inspect", str(fixture_dir("truncated"))],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    assert "truncated" in one_error_line(res.stderr)
    assert SHARDS[3] in res.stderr


def test_config_expert_dtype_disagreeing_with_stored_experts_exits_1(fixture_copy, capsys) -> None:
    root = fixture_copy("fp4")
    cfg = json.loads((root / "config.json").read_text())
    cfg["expert_dtype"] = "fp8"
    (root / "config.json").write_text(json.dumps(cfg))

    code, out, err = run_cli(capsys, str(root))
    assert code == 1
    line = one_error_line(err)
    assert "expert_dtype 'fp8'" in line and "I8" in line and "fp4" in line

    code, out, err = run_cli(capsys, str(root), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    assert doc["quant"]["consistent"] is False
    assert doc["quant"]["config_expert_dtype"] == "fp8" and doc["quant"]["expert_format"] == "fp4"


def edit_config(root: Path, **changes: object) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(changes)
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "key,value,tensor",
    [
        ("hidden_size", 640, "embed.weight"),
        ("n_routed_experts", 16, "layers.0.ffn.gate.weight"),
        ("num_attention_heads", 8, "layers.0.attn.wq_b.weight"),
    ],
)
def test_a_config_key_the_headers_disagree_with_is_the_verdict(
    fixture_copy, capsys, key: str, value: object, tensor: str
) -> None:
    root = fixture_copy("fp4")
    edit_config(root, **{key: value})
    code, out, err = run_cli(capsys, str(root))
    assert code == 1 and "verdict: ok" not in out
    line = one_error_line(err)  # one line, not one per tensor (nor the experts 8..15 a 16-expert config "misses")
    assert line.startswith(f"error: {key} {value} in config.json, but tensor {tensor!r} in {SHARDS[0]} is ")

    code, out, err = run_cli(capsys, str(root), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert doc["problems"] == [line.removeprefix("error: ")]


def test_a_single_shard_is_checked_against_the_config_too(fixture_copy, capsys) -> None:
    root = fixture_copy("fp4")
    edit_config(root, vocab_size=1024)
    code, out, err = run_cli(capsys, str(root / SHARDS[3]), "--json")
    assert code == 1
    assert json.loads(out)["problems"] == [one_error_line(err).removeprefix("error: ")]
    assert f"vocab_size 1024 in config.json, but tensor 'head.weight' in {SHARDS[3]} is BF16 [512, 256]" in err


def test_hub_metadata_gets_the_verdict_local_headers_get(fixture_copy) -> None:
    """Hub metadata has no parsed shards: inspect tallies its tensors instead, and must judge them alike."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.checkpoint.summary import inspect_tensors

    root = fixture_copy("fp4")
    edit_config(root, moe_intermediate_size=1024)
    ck = open_checkpoint(root)
    from_headers = inspect_tensors("x", ck.tensors, ck.config, shards=ck.shards.values())
    tallied = inspect_tensors("x", ck.tensors, ck.config)
    assert from_headers == tallied and len(tallied.problems) == 1
    assert tallied.problems[0].startswith(
        "moe_intermediate_size 1024 in config.json, but tensor 'layers.0.ffn.shared_experts.w1.weight'"
    )


def test_inspect_without_config_reports_the_config_problem(fixture_copy, capsys) -> None:
    root = fixture_copy("fp4")
    (root / "config.json").unlink()
    code, out, err = run_cli(capsys, str(root), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and "config.json not found" in doc["config_error"]
    assert doc["tensor_count"] > 0 and doc["mtp_expected"] == []
    assert "config.json not found" in one_error_line(err)


def test_nonexistent_local_path_exits_1(tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(capsys, str(tmp_path / "nope"))
    assert code == 1
    assert "no such file or folder" in one_error_line(err)


def test_index_naming_dot_as_shard_exits_1_with_one_line(fixture_copy, capsys) -> None:
    root = fixture_copy("fp4")
    index = json.loads((root / INDEX).read_text())
    index["weight_map"]["embed.weight"] = "."
    (root / INDEX).write_text(json.dumps(index))
    code, _, err = run_cli(capsys, str(root))
    assert code == 1
    assert "'.'" in one_error_line(err)


@pytest.mark.parametrize(
    "key,value",
    [("compress_ratios", ["x"]), ("quantization_config", "fp8"), ("hc_sinkhorn_iters", "many")],
)
def test_malformed_config_value_exits_1_with_one_line(fixture_copy, capsys, key: str, value: object) -> None:
    root = fixture_copy("fp4")
    cfg = json.loads((root / "config.json").read_text())
    cfg[key] = value
    (root / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, str(root))
    assert code == 1
    assert "config.json" in one_error_line(err)


# ---------------------------------------------------------------------------------------------
# Usage errors


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["inspect"],
        ["inspect", "x", "--bogus"],
        ["inspect", "--bogus", "x"],
        ["no-such-command"],
        ["inspect", "a", "b"],
    ],
    ids=["no-args", "no-src", "unknown-option-after", "unknown-option-before", "unknown-command", "two-srcs"],
)
def test_usage_errors_exit_2(capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err


def test_help_exits_0(capsys) -> None:
    assert main(["inspect", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Hub ids (never touching the network)


def test_hub_id_with_hf_hub_offline_exits_1_with_a_clear_message(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "inspect", "deepseek-ai/DeepSeek-V4-Flash"],
        cwd=tmp_path,  # no local folder of that name here, so the argument is a hub id
        env=subprocess_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stderr
    line = one_error_line(res.stderr)
    assert "deepseek-ai/DeepSeek-V4-Flash" in line and "HF_HUB_OFFLINE" in line
    assert res.stdout == ""


def test_hub_id_with_hf_hub_offline_json_prints_ok_false(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "inspect", "hf://org/model@main", "--json"],
        cwd=tmp_path,
        env=subprocess_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "HF_HUB_OFFLINE" in doc["error"] and doc["source"] == "hf://org/model@main"


# ---------------------------------------------------------------------------------------------
# The quick entry path: plain `inspect` runs without typer/rich, with the typer path's exact output


def test_plain_inspect_json_imports_neither_typer_nor_rich_nor_torch(fixture_dir) -> None:
    src = fixture_dir("fp4")
    code = (
        "import sys\nfrom ckpt_tool.cli.entry import main\n"
        f"rc = main(['inspect', {str(src)!r}, '--json'])\n"
        "heavy = sorted(m for m in ('typer', 'rich', 'torch', 'click', 'pydantic', 'huggingface_hub') "
        "if m in sys.modules)\n"
        "sys.stderr.write(f'rc={rc} heavy={heavy}')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.stderr.strip().endswith("rc=0 heavy=[]"), r.stderr
    assert json.loads(r.stdout)["ok"] is True


@pytest.mark.parametrize(
    "args",
    [
        ["--json"],
        ["--format", "json"],
        ["--format=json", "-q"],
        [],
        ["--format", "table", "--debug"],
        ["--json", "--revision", "main"],
    ],
)
@pytest.mark.parametrize("variant", ["fp4", "missing-mtp", "truncated"])
def test_quick_inspect_path_prints_what_the_typer_path_prints(
    capsys, monkeypatch, fixture_dir, variant: str, args: list[str]
) -> None:
    from tests.cli_helpers import run_cli

    src = fixture_dir(variant)
    quick = run_cli(capsys, "inspect", src, *args)
    monkeypatch.setenv("CKPT_TOOL_TYPER_ONLY", "1")
    typer_path = run_cli(capsys, "inspect", src, *args)
    assert quick == typer_path


@pytest.mark.parametrize(
    "args",
    [
        ["inspect"],
        ["inspect", "a", "b"],
        ["inspect", "a", "--help"],
        ["inspect", "a", "--format", "xml"],
        ["inspect", "a", "--token"],
        ["inspect", "--", "a"],
        ["convert", "a", "b"],
        ["inspect", "a", "--unknown"],
    ],
)
def test_anything_but_a_plain_inspect_goes_to_typer(args: list[str]) -> None:
    from ckpt_tool.cli.entry import _plain_inspect

    assert _plain_inspect(args) is None


def test_plain_inspect_reads_every_option_form() -> None:
    from ckpt_tool.cli.entry import _plain_inspect

    got = _plain_inspect(["inspect", "--revision=v1", "org/x", "--token", "t", "--cache-dir=/c", "--format", "json"])
    assert got == {"src": "org/x", "as_json": True, "revision": "v1", "token": "t", "cache_dir": "/c"}


@pytest.mark.parametrize("variant", ["fp4", "fp8", "fp4-2mtp"])
def test_header_totals_and_a_tensor_tally_give_the_same_report(fixture_dir, variant: str) -> None:
    """inspect sums files and dtypes from the totals the header parse kept (local checkpoints) or by tallying
    every tensor (hub metadata): both must say the same."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.checkpoint.summary import inspect_tensors

    ck = open_checkpoint(fixture_dir(variant))
    from_headers = inspect_tensors("x", ck.tensors, ck.config, shards=ck.shards.values())
    tallied = inspect_tensors("x", ck.tensors, ck.config)
    assert from_headers == tallied
    assert sum(f.bytes for f in tallied.files) == sum(t.nbytes for t in ck.tensors.values())


@pytest.mark.parametrize(
    "variant,cls,architecture,draft",
    [
        ("fp4", "text", "DeepseekV4ForCausalLM", "DeepSeekV4MTP"),
        ("vl-fp4", "vision", "DeepseekV4ForConditionalGeneration", "DeepSeekV4MTP"),
        ("vl-fp4-nomtp", "vision", "DeepseekV4ForConditionalGeneration", None),
    ],
)
def test_inspect_names_the_model_class_and_what_vllm_builds(fixture_dir, capsys, variant, cls, architecture, draft):
    root = fixture_dir(variant)
    code, out, _ = run_cli(capsys, str(root), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] is True
    model = doc["model"]
    assert (model["class"], model["architecture"], model["draft"]) == (cls, architecture, draft)
    assert model["target_prefix"] == ("language_model." if cls == "vision" else "")
    if cls == "vision":
        assert model["vision"] == {
            "layers": 2, "dim": 64, "heads": 4, "inter_dim": 128, "patch_size": 4, "downsample_ratio": 2
        }  # fmt: skip
    code, text, _ = run_cli(capsys, str(root))
    assert code == 0 and f"model: {cls} — vLLM builds {architecture}" in text
