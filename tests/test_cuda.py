"""The CUDA path: the compiled Triton kernels on a GPU against the CPU path (the torch reference on the CPU), and
``verify --level numeric --device cuda`` on a fixture.

Every test here is marked ``cuda`` and skipped, with the reason, where torch sees no CUDA device (tests/conftest.py);
``python tests/cuda_check.py`` runs them on a machine with one GPU and says in one line what ran (docs/testing.md).

Tolerance, as in tests/test_kernels.py: both sides see the same rounded activation and the same exact weight values,
so they differ only by float32 summation order. Every output element must satisfy ``|y_gpu - y_cpu| <= RTOL *
(|x| @ |W|.T)`` (the float64 sum of absolute products, W the reference dequantization); a decoding or indexing bug
puts a whole product term, ~1/K of that sum, into the error. Each kernel test also changes one scale byte on the GPU
side and requires the same bound to fail, so the comparison can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tool.verify import quant
from ckpt_tool.verify.kernels import fp8_block_gemm, mxfp4_gemm, nvfp4_gemm, resolve_backend

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
"""Allowed |GPU - CPU| as a fraction of sum_k |x[m, k] * W[n, k]|; float32 accumulation gives ~1e-7."""

SHAPES = [(1, 256, 512), (16, 512, 1024), (37, 384, 2048), (128, 4096, 4096)]
"""(tokens, output rows, inputs): one token, a tile's worth, ragged tokens and rows, and one V4-Flash-sized weight
(4096 inputs, as the routed experts' w2 at hidden 4096)."""


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled Triton backend on CUDA (the interpreter off), as ``--kernels auto`` picks it there."""
    pytest.importorskip("triton", reason="the compiled kernels need triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", "cuda") == "triton"
    return "triton"


def _close(gpu: torch.Tensor, cpu: torch.Tensor, x_used: torch.Tensor, w_deq: torch.Tensor) -> tuple[bool, float]:
    """Whether every element of ``gpu`` is within the bound of ``cpu``, and the largest error / bound."""
    bound = RTOL * (x_used.double().abs() @ w_deq.double().abs().T) + 1e-300
    ratio = (gpu.cpu().double() - cpu.double()).abs() / bound
    ratio = torch.where(torch.isnan(ratio), torch.inf, ratio)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    return worst <= 1.0, worst


def _check(
    what: str,
    gemm: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scale_at: int,
    x_used: torch.Tensor,
    w_deq: torch.Tensor,
    backend: str,
    **how,
) -> None:
    """``gemm`` on the GPU (compiled) within the bound of ``gemm`` on the CPU (torch), and not within it once one
    byte of the scale (``weights[scale_at]``) is changed on the GPU side."""
    cpu = gemm(x, *weights, backend="torch", **how)
    gpu = gemm(x.cuda(), *(w.cuda() for w in weights), backend=backend, **how)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32 and gpu.shape == cpu.shape
    ok, worst = _close(gpu, cpu, x_used, w_deq)
    assert ok, f"{what}: GPU and CPU differ by up to {worst:.3g} x the bound"

    bent = [w.cuda() for w in weights]
    scale = bent[scale_at].view(torch.uint8)
    scale[0, 0] = scale[0, 0] + 1 if int(scale[0, 0]) < 120 else scale[0, 0] - 1  # one scale byte, still finite
    ok, worst = _close(gemm(x.cuda(), *bent, backend=backend, **how), cpu, x_used, w_deq)
    assert not ok, f"{what}: one scale byte changed and the GPU result still within the bound ({worst:.3g})"


@pytest.mark.parametrize("act", ["bf16", "fp8"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_block_gemm_compiled_on_cuda_matches_the_cpu_path(compiled: str, act: str, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    w = torch.randn(n, k, generator=gen) * 0.02
    q, s = quant.fp8_block_quant(w)  # e4m3 weight, E8M0 128 x 128 scales
    x = torch.randn(m, k, generator=gen)
    x_used = quant.fp8_act_dequant(*quant.fp8_act_quant(x)) if act == "fp8" else x.to(torch.bfloat16).float()
    w_deq = quant.fp8_block_dequant(q.view(torch.uint8), s)
    _check(f"fp8 {act} {m}x{n}x{k}", fp8_block_gemm, x, (q, s), 1, x_used, w_deq, compiled, act=act)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_mxfp4_gemm_compiled_on_cuda_matches_the_cpu_path(compiled: str, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 104729 + n * 17 + k)
    packed, scale = quant.mxfp4_quant(torch.randn(n, k, generator=gen) * 0.02)
    x = torch.randn(m, k, generator=gen)
    w_deq = quant.mxfp4_dequant(packed, scale)
    _check(f"mxfp4 {m}x{n}x{k}", mxfp4_gemm, x, (packed, scale), 1, x.to(torch.bfloat16).float(), w_deq, compiled)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_nvfp4_gemm_compiled_on_cuda_matches_the_cpu_path(compiled: str, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 7907 + n * 13 + k)
    packed, scale, g = quant.nvfp4_quant(torch.randn(n, k, generator=gen) * 0.02)
    x = torch.randn(m, k, generator=gen)
    w_deq = quant.nvfp4_dequant(packed, scale, g)
    _check(f"nvfp4 {m}x{n}x{k}", nvfp4_gemm, x, (packed, scale, g), 1, x.to(torch.bfloat16).float(), w_deq, compiled)


def test_verify_numeric_on_cuda_passes_a_good_conversion_with_the_compiled_kernels(fixture_dir, tmp_path) -> None:
    """``ckpt-tool verify --level numeric --device cuda`` (a process of its own, as a user runs it) on the fp4
    fixture converted at tp 2: every check passes, the MTP forward ran with the compiled kernels on the GPU, and the
    numeric coverage is whole."""
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    ckpt = [sys.executable, "-m", "ckpt_tool"]
    done = subprocess.run([*ckpt, "convert", src, out, "--tp", "2", "--json"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    cmd = [*ckpt, "verify", out, "--source", src, "--level", "numeric", "--device", "cuda", "--kernels", "auto"]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env)
    doc = json.loads(done.stdout or "{}")
    assert done.returncode == 0 and doc.get("ok"), (doc.get("failures"), done.stderr[-2000:])
    assert doc["numeric"] and all(n["device"].startswith("cuda") and n["backend"] == "triton" for n in doc["numeric"])
    assert doc["coverage"]["percent"] == 100.0, doc["coverage"]
