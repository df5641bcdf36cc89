"""``verify --engine`` without vLLM: the loader's rules as pure functions (``ckpt_tool.verify.engine.judge``), and the
one-line exit 2 when the interpreter has no vLLM or its vLLM cannot be built. (tests/engine/test_engine_check.py runs
the real releases.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.verify.engine.judge import HeldTensor, judge_files, judge_load
from tests.cli_helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
SINK = "model.layers.0.attn.attn_sink"
WQ = "model.layers.0.attn.wq_b.weight"
METER = REPO / "ckpt_tool" / "verify" / "engine" / "load_meter.py"
TABLE = {SINK: ("float32", [64]), WQ: ("float8_e4m3fn", [256, 128])}


def held(**over) -> dict[str, HeldTensor]:
    files = {
        SINK: HeldTensor("F32", (2,), "model-rank-0-part-0.safetensors"),
        WQ: HeldTensor("F8_E4M3", (256, 128), "model-rank-0-part-0.safetensors"),
    }
    files.update(over)
    return {k: v for k, v in files.items() if v is not None}


def test_files_exactly_as_the_table_pass_with_the_documented_sink_slice() -> None:
    problems, prefix = judge_files(TABLE, held(), [], {}, {SINK})
    assert problems == [] and prefix == [SINK]


def test_a_smaller_tensor_the_profile_does_not_document_fails() -> None:
    problems, _ = judge_files(TABLE, held(), [], {}, set())
    assert [t for _, t in problems] == [SINK] and "slice" in problems[0][0]


def test_each_loader_rule_fails_naming_the_tensor() -> None:
    bad = held(
        **{
            WQ: HeldTensor("BF16", (256, 256), "a.safetensors"),  # cast, and larger than the parameter
            "model.layers.0.ffn.gate.weight": HeldTensor("BF16", (8, 256), "b.safetensors"),  # an alias, not a key
        }
    )
    bad.pop(SINK)
    problems, _ = judge_files(
        TABLE,
        bad,
        [(WQ, "a.safetensors", "c.safetensors")],
        {"model.layers.0.ffn.gate.weight": "model.layers.0.ffn.experts.gate.weight"},
        {SINK},
    )
    text = "\n".join(m for m, _ in problems)
    assert "is in both a.safetensors and c.safetensors" in text  # popped once: the second copy is a KeyError
    assert "'model.layers.0.ffn.gate.weight' in b.safetensors is not a parameter key" in text
    assert "'model.layers.0.ffn.experts.gate.weight' is the key _filter_subtensors keeps" in text
    assert "dtype BF16 (bfloat16), the parameter is float8_e4m3fn" in text
    assert "shape [256, 256] does not fit the parameter's [256, 128]" in text
    assert f"parameter '{SINK}' (float32[64]) is in no file" in text
    assert [t for _, t in problems][:2] == [WQ, "model.layers.0.ffn.gate.weight"]  # the loader's KeyErrors first


def test_the_real_loads_warnings_cast_and_undocumented_slices_fail() -> None:
    load = {
        "cpu_table": TABLE,
        "exception": None,
        "log": [
            {
                "level": "WARNING",
                "message": f"loading tensor of shape torch.Size([2]) into parameter '{SINK}' of shape torch.Size([64])",
            },
            {
                "level": "WARNING",
                "message": f"Attempted to load weight {WQ} with dtype torch.bfloat16 "
                "into parameter with dtype torch.float8_e4m3fn",
            },
            {"level": "WARNING", "message": "something else"},
        ],
        "warnings": [],
    }
    problems, others = judge_load(load, TABLE, {SINK})
    assert [t for _, t in problems] == [WQ] and others == ["WARNING: something else"]
    problems, _ = judge_load(load, TABLE, set())
    assert [t for _, t in problems] == [SINK, WQ]


def test_a_meta_build_that_disagrees_with_the_cpu_build_fails() -> None:
    load = {
        "cpu_table": {**TABLE, "extra": ("float32", [1])},
        "exception": {"type": "ValueError", "message": "Missing keys ('x',)"},
    }
    problems, _ = judge_load(load, TABLE, set())
    assert "disagree" in problems[0][0] and problems[0][1] == "extra"
    assert "raised ValueError: Missing keys" in problems[1][0]


@pytest.fixture(scope="module")
def out_tp2(fixture_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine-judge") / "out"
    code = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", "convert", str(fixture_dir("fp4")), str(out), "--tp", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
    ).returncode
    assert code == 0
    return out


def _interpreter(tmp_path: Path, body: str) -> Path:
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\n{body}\n")
    py.chmod(0o755)
    return py


def test_no_vllm_is_one_line_and_exit_2(out_tp2, tmp_path, capsys) -> None:
    # -S: no site-packages, so certainly no vllm (the probe itself needs only the standard library)
    py = _interpreter(tmp_path, f'exec "{sys.executable}" -S "$@"')
    code, out, err = run_cli(capsys, "verify", out_tp2, "--engine", "--engine-python", py)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "cannot import vllm" in err and "--engine-python" in err, err


def test_a_vllm_that_cannot_be_built_is_one_line_naming_the_step(out_tp2, tmp_path, capsys) -> None:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")  # no vllm.platforms: a build we cannot stub
    py = _interpreter(tmp_path, f'PYTHONPATH="{site}" exec "{sys.executable}" "$@"')
    code, out, err = run_cli(capsys, "verify", out_tp2, "--engine", "--engine-python", py, "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and doc["level"] == "engine"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "vLLM 9.9.9" in err and "import vllm" in err and "cannot be built" in err, err


def test_a_missing_interpreter_is_one_line_and_exit_2(out_tp2, tmp_path, capsys) -> None:
    code, _, err = run_cli(capsys, "verify", out_tp2, "--engine", "--engine-python", tmp_path / "nope" / "python")
    assert code == 2 and err.count("\n") == 1 and "no such file" in err


@pytest.mark.parametrize(
    "args", [(), ("--engine-python", "python3")], ids=["no-source-no-engine", "python-without-engine"]
)
def test_verify_needs_a_source_or_the_engine(out_tp2, capsys, args) -> None:
    code, _, err = run_cli(capsys, "verify", out_tp2, *args)
    assert code == 2 and err.count("\n") == 1, err


def test_the_probe_needs_no_ckpt_tool(tmp_path) -> None:
    """The serving environment has no ckpt_tool: probe.py and vllm_stubs.py import only the standard library
    before vllm (here: none, so the answer is 'no-vllm', from a process that cannot import ckpt_tool)."""
    probe = REPO / "ckpt_tool" / "verify" / "engine" / "probe.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-S", "-I", str(probe)],
        input=json.dumps({"protocol": 1, "jobs": []}),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    answer = json.loads(proc.stdout)
    assert proc.returncode == 0 and answer["fatal"]["kind"] == "no-vllm", proc.stderr


def _load_meter():
    """ckpt_tool/verify/engine/load_meter.py as probe.py and the engine worker load it: by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_meter_under_test", METER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_load_meter_counts_what_a_cold_load_reads(tmp_path) -> None:
    """The figures verify --engine and the serve-load bench report come from the load itself: the tensor bytes the
    iterator handed over, and the bytes this process made the disk read (the file evicted first: every byte)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 8 MiB of float32
    path = tmp_path / "rank.safetensors"
    save_file(tensors, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, which DONTNEED drops
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    meter = _load_meter().LoadMeter()

    def read_all():  # what ShardedStateLoader.iterate_over_files does (vLLM 0.33.0/0.34.0 sharded_state_loader.py)
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                yield key, f.get_tensor(key)

    with meter:
        loaded = {k: t.clone() for k, t in meter.counted(read_all())}
    got = meter.figures()
    want = sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)  # counting changed nothing
    assert got["tensor_bytes"] == want and got["tensors"] == len(tensors)
    assert got["seconds"] > 0 and got["cpu_seconds"] >= 0
    if got["disk_read_bytes"] is not None:  # /proc/self/io readable (Linux with task I/O accounting)
        assert got["disk_read_bytes"] >= want, got
    assert got["peak_rss_bytes"] >= got["rss_before_bytes"] > 0


def test_each_real_load_reaches_the_text_and_the_junit_output(tmp_path, capsys) -> None:
    """verify --engine's per-rank load figures: one text line per loaded rank, the JUnit testcase's time and
    properties; a rank judged from its table alone has neither."""
    import xml.etree.ElementTree as ET

    from ckpt_tool.cli import render
    from ckpt_tool.verify.verdict import Check, VerifyReport

    load = {"seconds": 0.25, "bytes": 3 * 1024**2, "disk_read_bytes": 1024**2, "cpu_seconds": 0.2}
    report = VerifyReport(out="OUT", source=None, level="engine")
    report.add(Check("engine-vllm:model/rank-0", True, "judged", details={"real_load": {**load, "exception": None}}))
    report.add(Check("engine-vllm:model/rank-1", True, "judged", details={"real_load": None}))
    report.engine = {"vllm_version": "0.34.0", "ranks": 2, "real_loads": 1, "loads": [
        {"component": "model", "rank": 0, **load, "peak_rss_bytes": 1}]}  # fmt: skip
    render.render_verify(report)
    text = capsys.readouterr().out
    assert "engine load model/rank-0: 3.00 MiB of tensors in 0.25 s, 0.2 CPU s, 1.00 MiB of it from disk" in text
    assert "rank-1:" not in text
    render.write_junit(report, tmp_path / "v.xml")
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "v.xml").getroot().iter("testcase")}
    loaded, table_only = cases["engine-vllm:model/rank-0"], cases["engine-vllm:model/rank-1"]
    assert float(loaded.get("time")) == 0.25 and table_only.get("time") is None
    props = {p.get("name"): p.get("value") for p in loaded.iter("property")}
    assert props == {"load_bytes": str(3 * 1024**2), "load_disk_read_bytes": str(1024**2), "load_cpu_seconds": "0.2"}
