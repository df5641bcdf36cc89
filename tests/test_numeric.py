"""Numeric verify through the Triton kernels in the CPU interpreter (``TRITON_INTERPRET=1``), end to end.

Each case runs ``python -m ckpt_tool verify OUT --source SRC --kernels triton --json`` in a fresh
subprocess, because the interpreter mode must be in the environment before triton decorates a
kernel. Measured on the 2-core CPU box (wall time of the whole subprocess, torch import included; every
tensor of the 3 main layers and the MTP layer through the interpreted kernels, every expert routed):
fp4 tp 2 ~15 s, fp8-e8m0 tp 4 ep ~12 s; forward logits max_rel <= 1.3e-3 (the interpreter noise floor
mtp_forward.py documents); every per-tensor check within 1e-3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_tool.mapping.plan import Options
from ckpt_tool.output.convert import convert

REPO = Path(__file__).resolve().parent.parent

triton = pytest.importorskip("triton", reason="the Triton interpreter needs triton installed")


def run_module(args: list[str], *, interpret: bool, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("CKPT_TOOL_DEBUG", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.perf_counter() - t0


CASES = [("fp4", 2, "tp"), ("fp8-e8m0", 4, "ep")]


@pytest.mark.parametrize("variant,tp,moe", CASES, ids=[f"{v}-tp{t}-{m}" for v, t, m in CASES])
def test_numeric_verify_under_triton_interpreter(fixture_dir, tmp_path, record_property, variant, tp, moe) -> None:
    src = fixture_dir(variant)
    out = tmp_path / "out"
    convert(src, out, Options(tp=tp, moe_parallel=moe))
    proc, wall = run_module(["verify", str(out), "--source", str(src), "--kernels", "triton", "--json"], interpret=True)
    record_property("wall_s", round(wall, 2))
    print(f"{variant} tp{tp} {moe}: triton-interpreter verify wall {wall:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["failed"] == 0 and doc["level"] == "numeric"
    assert doc["numeric"], "no numeric entries"
    for entry in doc["numeric"]:
        assert entry["backend"] == "triton-interpreter", entry
        assert entry["device"] == "cpu" and entry["ok"] is True
        # interpreter floor documented in mtp_forward.py: max_rel <= 1.3e-3, cosine >= 0.9999999
        assert entry["logits_max_rel"] <= 5e-3 and entry["hidden_max_rel"] <= 5e-3, entry
        assert entry["logits_cosine"] >= 0.999999 and entry["hidden_cosine"] >= 0.999999, entry
        print(
            f"  layer {entry['layer']}: logits max_rel {entry['logits_max_rel']:.3g} cos {entry['logits_cosine']:.9f}; "
            f"hidden max_rel {entry['hidden_max_rel']:.3g} cos {entry['hidden_cosine']:.9f}"
        )


def test_triton_kernels_without_interpreter_on_cpu_is_a_clear_usage_error(fixture_dir, tmp_path) -> None:
    """Pinned behaviour: --kernels triton on cpu tensors without TRITON_INTERPRET exits 2 with one error line
    naming the fix (no traceback, no silent fallback to torch). ``--device cpu`` keeps it so on a GPU box too."""
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=1))
    args = ["verify", str(out), "--source", str(src), "--kernels", "triton", "--device", "cpu"]
    proc, _ = run_module(args, interpret=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err_lines) == 1, proc.stderr
    assert err_lines[0].startswith("error: GEMM backend 'triton' needs CUDA tensors")
    assert "TRITON_INTERPRET=1" in err_lines[0] and "torch" in err_lines[0]
    assert proc.stdout == ""


def test_triton_kernels_without_interpreter_json_reports_the_error(fixture_dir, tmp_path, capsys, monkeypatch) -> None:
    """Same, in-process, with --json: stdout is one JSON document {ok: false, error}, exit 2."""
    from ckpt_tool.cli.entry import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=1))
    capsys.readouterr()
    code = main(["verify", str(out), "--source", str(src), "--kernels", "triton", "--device", "cpu", "--json"])
    cap = capsys.readouterr()
    assert code == 2, cap.out + cap.err
    doc = json.loads(cap.out)
    assert doc["ok"] is False and "TRITON_INTERPRET=1" in doc["error"]
    assert "Traceback" not in cap.err
