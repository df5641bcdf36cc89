"""The command line as a new user meets it: paths vs hub ids, exit codes, help, flags, JSON shapes, Ctrl-C, pipes.

One test (or more) per finding of the UX review; each failed before the change it pins down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot

from ckpt_tool.checkpoint.hub import HubRef, parse_hub_ref
from ckpt_tool.cli import common as entry
from ckpt_tool.cli.jsondoc import JSON_FIELDS

REPO = Path(__file__).resolve().parents[1]


def stderr_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# a local path with a slash vs a hub repo id


def test_a_missing_path_whose_first_folder_exists_is_a_path_not_a_repo(
    fixture_dir, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(fixture_dir("fp4").parent)  # the folder holding the fixture folders
    code, _out, err = run_cli(capsys, "inspect", "fp4/sub")
    assert code == 1 and "fp4/ exists here" in err and "Error:" not in err  # no network attempt
    monkeypatch.chdir(fixture_dir("fp4"))
    code, _out, err = run_cli(capsys, "inspect", "model-00001-of-00004.safetensors/x")
    lines = stderr_lines(err)
    assert code == 1 and len(lines) == 1
    assert "no such file or folder" in lines[0] and "if you meant the hub repo" in lines[0] and "hf://" in lines[0]


def test_path_or_repo_rules(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_hub_ref("deepseek-ai/DeepSeek-V4-Flash") == HubRef("deepseek-ai/DeepSeek-V4-Flash", None)
    (tmp_path / "fx").mkdir()
    with pytest.raises(Exception, match=r"fx/ exists here.*hf://fx/fp5"):
        parse_hub_ref("fx/fp5")
    assert parse_hub_ref("hf://fx/fp5") == HubRef("fx/fp5", None)  # explicit hub wins
    assert parse_hub_ref("./org/name") is None  # a path: "no such file or folder" comes from the local reader
    with pytest.raises(Exception, match="written as a path"):
        parse_hub_ref("org/model.safetensors")
    assert parse_hub_ref("org/name@v1", revision="v2").revision == "v2"  # --revision overrides @rev


# ---------------------------------------------------------------------------------------------
# exit codes: 0 ok, 1 failed check or bad input, 2 usage


@pytest.mark.parametrize(
    "args",
    [
        ("convert", "{src}", "{tmp}/out", "--target", "vllm"),
        ("convert", "{src}", "{tmp}/out", "--ranks", "5"),
        ("convert", "{src}", "{tmp}/out", "--moe-parallel", "dp"),
        ("convert", "{src}", "{tmp}/out", "--format", "xml"),
        ("verify", "{tmp}/out", "--source", "{src}", "--level", "everything"),
    ],
    ids=["target", "ranks", "moe-parallel", "format", "level"],
)
def test_usage_errors_exit_2(fixture_dir, tmp_path, capsys, args) -> None:
    src = fixture_dir("fp4")
    code, _out, err = run_cli(capsys, *(a.format(src=src, tmp=tmp_path) for a in args))
    assert code == 2, err
    assert not (tmp_path / "out").exists()


def test_device_cuda_without_cuda_is_a_usage_error(fixture_dir, tmp_path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    src = fixture_dir("fp4")
    assert run_cli(capsys, "convert", src, tmp_path / "out")[0] == 0
    code, _out, err = run_cli(capsys, "verify", tmp_path / "out", "--source", src, "--device", "cuda")
    assert code == 2 and "no CUDA device" in err


def test_choices_are_listed_in_the_error(fixture_dir, tmp_path, capsys) -> None:
    code, _out, err = run_cli(capsys, "convert", fixture_dir("fp4"), tmp_path / "out", "--only", "draft")
    assert code == 2 and "'model'" in err and "'mtp'" in err


def test_a_closed_stdout_is_not_an_error(fixture_dir) -> None:
    cmd = f"{sys.executable} -m ckpt_tool inspect {fixture_dir('fp4')} | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and len(r.stdout.splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# help and flags


@pytest.mark.parametrize("argv", [["-h"], ["convert", "-h"], ["verify", "-h"], ["inspect", "-h"], ["env", "-h"]])
def test_short_help_is_accepted(capsys, argv) -> None:
    code, out, _err = run_cli(capsys, *argv)
    assert code == 0 and "Usage: ckpt-tool" in out


def test_help_shows_plain_metavars_and_every_choice(capsys) -> None:
    _code, convert_help, _ = run_cli(capsys, "convert", "-h")
    _code, verify_help, _ = run_cli(capsys, "verify", "-h")
    text = convert_help + verify_help
    assert "{SRC}" not in text and "<str>" not in text and "<int range>" not in text and "<path>" not in text
    assert "Usage: ckpt-tool convert [OPTIONS] SRC OUT" in convert_help
    for choices in ("<tp|ep>", "<model|mtp>", "<auto|vllm-seed|vllm-0.33+|vllm-0.33>", "<table|json>"):
        assert choices in convert_help, choices
    for choices in ("<structure|values|numeric>", "<auto|triton|torch>", "<auto|cpu|cuda>"):
        assert choices in verify_help, choices
    assert "--tp T" in convert_help and "--revision REV" in convert_help and "--token TOKEN" in convert_help


def test_completion_is_offered(capsys) -> None:
    _code, out, _ = run_cli(capsys, "-h")
    assert "--install-completion" in out


def test_debug_and_quiet_are_accepted_after_the_subcommand(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--debug", "-q")
    assert code == 0, err
    assert out == ""  # -q: no summary
    assert all(not line.startswith("note:") for line in stderr_lines(err))
    code, _out, err = run_cli(capsys, "inspect", tmp_path / "nope", "--debug")
    assert code == 1 and "Traceback" in err  # --debug after the subcommand still shows it


def test_format_json_equals_json(fixture_dir, capsys) -> None:
    src = fixture_dir("fp4")
    a = json.loads(run_cli(capsys, "inspect", src, "--json")[1])
    b = json.loads(run_cli(capsys, "inspect", src, "--format", "json")[1])
    assert a == b


def test_piped_dry_run_keeps_whole_tensor_names(fixture_dir, tmp_path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckpt_tool",
            "convert",
            str(fixture_dir("fp4")),
            str(tmp_path / "out"),
            "--tp",
            "2",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    longest = "model.layers.1.ffn.experts._shared_experts._layer.gate_up_proj.weight_scale_inv"
    assert any(line.split("\t")[1:2] == [longest] for line in r.stdout.splitlines() if line.startswith("tensor\t"))
    assert "…" not in r.stdout


# ---------------------------------------------------------------------------------------------
# Ctrl-C, foreign OUT folders, verify's wording


def test_ctrl_c_says_how_to_resume(fixture_dir, tmp_path, capsys, monkeypatch) -> None:
    import ckpt_tool.output.convert

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_tool.output.convert, "convert", interrupted)
    code, _out, err = run_cli(capsys, "convert", fixture_dir("fp4"), tmp_path / "out")
    assert code == 130
    assert stderr_lines(err) == ["error: interrupted; rerun the same command to resume"]


def test_convert_refuses_an_unrelated_non_empty_folder(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file\n")
    (out / "model").mkdir()
    (out / "model" / "keep.bin").write_bytes(b"precious")
    before = snapshot(out)
    for extra in ((), ("--force",)):
        code, _out, err = run_cli(capsys, "convert", fixture_dir("fp4"), out, *extra)
        assert code == 1 and "not a ckpt-tool OUT" in err and "notes.txt" in err
        assert snapshot(out) == before


def test_convert_into_an_empty_folder_or_its_own_out_is_fine(fixture_dir, tmp_path, capsys) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert run_cli(capsys, "convert", fixture_dir("fp4"), out)[0] == 0
    assert run_cli(capsys, "convert", fixture_dir("fp4"), out, "--force")[0] == 0  # its own OUT: --force redoes it


def test_verify_with_the_wrong_source_says_so_once(fixture_dir, tmp_path, capsys) -> None:
    assert run_cli(capsys, "convert", fixture_dir("fp4"), tmp_path / "out")[0] == 0
    code, _out, err = run_cli(capsys, "verify", tmp_path / "out", "--source", fixture_dir("fp8"))
    lines = stderr_lines(err)
    assert code == 1 and len(lines) == 1
    assert "is not the checkpoint OUT was converted from" in lines[0]


def test_a_failed_structure_check_names_its_file_once() -> None:
    from ckpt_tool.cli.render import check_line
    from ckpt_tool.verify.verdict import Check

    c = Check("structure:mtp/x.safetensors", False, "mtp/x.safetensors: sha256 differs")
    assert check_line(c) == "structure: mtp/x.safetensors: sha256 differs"


# ---------------------------------------------------------------------------------------------
# one JSON shape per command, success and failure alike


def _json(capsys, *args) -> dict:
    code, out, _err = run_cli(capsys, *args, "--json")
    doc = json.loads(out)
    return {"code": code, **doc}


def test_json_documents_have_one_shape_per_command(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4"), tmp_path / "out"
    pairs = {
        "inspect": (_json(capsys, "inspect", src), _json(capsys, "inspect", tmp_path / "nope")),
        "convert": (
            _json(capsys, "convert", src, out),
            _json(capsys, "convert", fixture_dir("missing-mtp"), tmp_path / "o2"),
        ),
        "verify": (
            _json(capsys, "verify", out, "--source", src, "--level", "structure"),
            _json(capsys, "verify", tmp_path / "nope", "--source", src),
        ),
        "unconvert": (
            _json(capsys, "unconvert", out, tmp_path / "back"),
            _json(capsys, "unconvert", tmp_path / "nope", tmp_path / "b2"),
        ),
    }
    dry = _json(capsys, "convert", src, tmp_path / "o3", "--dry-run")
    for command, (good, bad) in pairs.items():
        assert good["code"] == 0 and bad["code"] == 1, command
        for doc in (good, bad):
            assert list(doc)[1:5] == ["schema_version", "command", "ok", "error"], command
            assert doc["schema_version"] == 1 and doc["command"] == command
            assert list(doc)[5:] == list(JSON_FIELDS[command]), command
        assert good["ok"] is True and good["error"] is None
        assert bad["ok"] is False and isinstance(bad["error"], str)
    assert list(dry)[1:] == list(pairs["convert"][0])[1:] and dry["dry_run"] is True
    inspect_bad = pairs["inspect"][1]
    assert inspect_bad["problems"] == [inspect_bad["error"]]  # bad input and failed checks: both in problems
    failed_check = _json(capsys, "inspect", fixture_dir("missing-mtp"))
    assert failed_check["error"] == failed_check["problems"][0]


# ---------------------------------------------------------------------------------------------
# CI summary, env, fixtures --list


def test_github_step_summary_is_written(fixture_dir, tmp_path, capsys, monkeypatch) -> None:
    src, out = fixture_dir("fp4"), tmp_path / "out"
    assert run_cli(capsys, "convert", src, out)[0] == 0
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, stdout, _err = run_cli(
        capsys, "verify", out, "--source", src, "--github", "--kernels", "torch", "--device", "cpu", "--tokens", "4"
    )
    assert code == 0
    text = summary.read_text()
    assert "## ckpt-tool verify: ✅ PASS" in text and "| numeric |" in text
    assert re.search(r"\| 3 \(mtp\.0\) \| [0-9.e+-]+ \|", text), text


def test_junit_has_one_testcase_per_check(fixture_dir, tmp_path, capsys) -> None:
    import xml.etree.ElementTree as ET

    src, out = fixture_dir("fp4"), tmp_path / "out"
    assert run_cli(capsys, "convert", src, out)[0] == 0
    code, stdout, _ = run_cli(
        capsys, "verify", out, "--source", src, "--level", "structure", "--junit", tmp_path / "v.xml", "--json"
    )
    cases = ET.parse(tmp_path / "v.xml").getroot().findall(".//testcase")
    assert code == 0 and len(cases) == json.loads(stdout)["checks"]


def test_env_prints_what_a_bug_report_needs(capsys, monkeypatch) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: None)
    code, out, _ = run_cli(capsys, "env", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["command"] == "env" and doc["ok"] is True
    for key in (
        "ckpt_tool",
        "python",
        "torch",
        "triton",
        "safetensors",
        "huggingface_hub",
        "installed_vllm",
        "target_auto",
        "hf_hub_cache",
    ):
        assert key in doc, key
    assert doc["target_auto"] == "vllm-0.33+" and doc["installed_vllm"] is None
    code, text, _ = run_cli(capsys, "env")
    assert code == 0 and "target_auto" in text and "vllm-0.33+" in text


def test_fixture_list_needs_no_out() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckpt_tool.fixtures.make", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0 and "fp4-2mtp" in r.stdout


def test_main_resets_global_flags_between_calls(capsys) -> None:
    run_cli(capsys, "profiles", "-q")
    assert entry.STATE["quiet"] is True
    code, out, _ = run_cli(capsys, "profiles")
    assert code == 0 and out and entry.STATE["quiet"] is False
    assert os.environ.get("CKPT_TOOL_DEBUG") is None


# ---------------------------------------------------------------------------------------------
# The CLI's imports run one way: entry → common → render → streams


def _ckpt_tool_imports(module: str) -> set[str]:
    """Every ``ckpt_tool`` module ``module``'s source imports, at module level or inside functions."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckpt_tool"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ckpt_tool"))
    return found


def test_render_and_common_do_not_import_each_other() -> None:
    assert "ckpt_tool.cli.render" in _ckpt_tool_imports("ckpt_tool.cli.common")
    for module in ("ckpt_tool.cli.render", "ckpt_tool.cli.streams"):
        back = {m for m in _ckpt_tool_imports(module) if m in ("ckpt_tool.cli.common", "ckpt_tool.cli.entry")}
        assert not back, f"{module} imports {back}: the CLI's imports must run entry → common → render → streams"
    assert _ckpt_tool_imports("ckpt_tool.cli.streams") == set()


# ---------------------------------------------------------------------------------------------
# convert --dry-run without typer (cli/entry.py): the same output as the typer command


@pytest.mark.parametrize(
    "args",
    [
        ["--tp", "2", "--json"],
        ["--tp=2", "--moe-parallel", "ep", "--format", "json"],
        ["--only", "mtp", "--format=table"],
        ["--tp", "2", "-q"],
        ["--target", "vllm-0.33+", "--json"],
        [],
    ],
)
@pytest.mark.parametrize("variant", ["fp4", "missing-mtp"])
def test_quick_dry_run_prints_what_the_typer_path_prints(
    fixture_dir, tmp_path, capsys, monkeypatch, variant: str, args: list[str]
) -> None:
    from ckpt_tool.cli.entry import _plain_dry_run

    line = ["convert", str(fixture_dir(variant)), str(tmp_path / "out"), "--dry-run", *args]
    assert _plain_dry_run([a for a in line if a != "-q"]) is not None
    quick = run_cli(capsys, *line)
    monkeypatch.setenv("CKPT_TOOL_TYPER_ONLY", "1")
    typer_path = run_cli(capsys, *line)
    assert quick == typer_path
    assert quick[0] == (0 if variant == "fp4" else 1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "a", "b"],  # no --dry-run: a conversion
        ["convert", "a", "--dry-run"],
        ["convert", "a", "b", "c", "--dry-run"],
        ["convert", "a", "b", "--dry-run", "--tp", "0"],
        ["convert", "a", "b", "--dry-run", "--tp", "x"],
        ["convert", "a", "b", "--dry-run", "--tp"],
        ["convert", "a", "b", "--dry-run", "--moe-parallel", "dp"],
        ["convert", "a", "b", "--dry-run", "--only", "all"],
        ["convert", "a", "b", "--dry-run", "--format", "xml"],
        ["convert", "a", "b", "--dry-run", "--target", "vllm-9"],
        ["convert", "a", "b", "--dry-run", "--ranks", "0"],
        ["convert", "a", "b", "--dry-run", "--help"],
        ["convert", "a", "b", "--dry-run", "--", "c"],
        ["inspect", "a", "b", "--dry-run"],
    ],
)
def test_anything_but_a_plain_dry_run_goes_to_typer(args: list[str]) -> None:
    from ckpt_tool.cli.entry import _plain_dry_run

    assert _plain_dry_run(args) is None


def test_a_dry_run_imports_neither_typer_nor_torch(fixture_dir, tmp_path) -> None:
    """The header path stays light: a plain dry run (and inspect) loads no typer, pydantic, torch, triton or vLLM, and
    with --json not rich either."""
    src, out = str(fixture_dir("fp4")), str(tmp_path / "out")
    code = (
        "import sys; from ckpt_tool.cli.entry import main\n"
        f"assert main(['convert', {src!r}, {out!r}, '--tp', '2', '--dry-run', '--json']) == 0\n"
        f"assert main(['inspect', {src!r}, '--json']) == 0\n"
        "heavy = {'typer', 'pydantic', 'rich', 'torch', 'triton', 'vllm'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
