"""Quantized GEMM kernels vs the ckpt_tool.verify.quant reference.

The Triton backend runs in the Triton CPU interpreter here. ``ckpt_tool.verify.kernels`` decorates its
kernels on first use and they use only builtin ``triton.language`` ops, so turning the
interpreter on with ``monkeypatch.setenv("TRITON_INTERPRET", "1")`` works even when triton was
imported earlier in the session. The ``interp`` fixture imports triton *before* setting the
variable on purpose: importing it under TRITON_INTERPRET=1 would turn triton.language's own
``@jit`` helpers (tl.zeros, tl.sum, ...) into interpreter functions for the rest of the process,
breaking compiled kernels of any test that runs later on a GPU machine. One subprocess test
covers the other order (variable set before triton is imported, as in a CI job).

Tolerance: both backends see the same rounded activation and exact weight values, so they differ
from the float64 reference only by float32 rounding. Every output element must satisfy
``|y - y_ref| <= RTOL * (|x| @ |W|.T)`` (the float64 sum of absolute products); an indexing or
decoding bug puts a whole product term, ~1/K of that sum, into the error, far above RTOL.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ckpt_tool.errors import CheckpointError, UsageError
from ckpt_tool.verify import quant
from ckpt_tool.verify.kernels import _backend, fp8_block_gemm, mxfp4_gemm, nvfp4_gemm, resolve_backend

RTOL = 1e-5
"""Allowed error as a fraction of sum_k |x[m, k] * W[n, k]|; float32 accumulation gives ~1e-7."""

TILE = (16, 128)
"""(rows, cols) of the output tiles named in failure messages; 128 columns = one weight scale row."""


def assert_gemm_close(actual: torch.Tensor, x_used: torch.Tensor, w_deq: torch.Tensor, what: str) -> float:
    """Compare ``actual`` with ``x_used @ w_deq.T`` in float64; return the max error / tolerance.

    On failure, name the (row-block, col-block) output tile holding the max abs error, its value,
    and the other tiles that are out of tolerance (in the style of gguf-py's test_quants.py).
    """
    x64, w64 = x_used.double(), w_deq.double()
    expected = x64 @ w64.T
    bound = RTOL * (x64.abs() @ w64.abs().T) + 1e-300
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    err = (actual.double() - expected).abs()
    err = torch.where(torch.isnan(err), math.inf, err)
    ratio = err / bound
    bad = ratio > 1
    if bool(bad.any()):
        m_tiles, n_tiles = -(-actual.shape[0] // TILE[0]), -(-actual.shape[1] // TILE[1])
        tile_err = torch.zeros(m_tiles, n_tiles, dtype=torch.float64)
        tile_bad = torch.zeros(m_tiles, n_tiles, dtype=torch.int64)
        for i in range(m_tiles):
            for j in range(n_tiles):
                sl = (slice(i * TILE[0], (i + 1) * TILE[0]), slice(j * TILE[1], (j + 1) * TILE[1]))
                tile_err[i, j] = err[sl].max()
                tile_bad[i, j] = bad[sl].sum()
        idx = int(torch.argmax(err))
        m, n = divmod(idx, actual.shape[1])
        others = [
            f"({i}, {j}): {int(tile_bad[i, j])} bad, max {tile_err[i, j].item():.3g}"
            for i in range(m_tiles)
            for j in range(n_tiles)
            if tile_bad[i, j] > 0
        ]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} outputs exceed tol = {RTOL:g} * sum|x*w|. "
            f"Max abs err {err[m, n].item():.6g} in (row-block {m // TILE[0]}, col-block {n // TILE[1]}) "
            f"of {TILE[0]}x{TILE[1]} output tiles, at ({m}, {n}): got {actual[m, n].item()!r}, "
            f"expected {expected[m, n].item()!r}, tol {bound[m, n].item():.3g}. "
            f"Tiles out of tolerance: {'; '.join(others)}"
        )
    return float(ratio.max())


@pytest.fixture
def interp(monkeypatch: pytest.MonkeyPatch) -> str:
    """Turn the Triton interpreter on for one test; return the backend name to request."""
    pytest.importorskip("triton")
    import triton.language  # noqa: F401  (imported before the variable is set, see module doc)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", "cpu") == "triton-interpreter"
    return "triton"


@pytest.fixture
def no_interp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _random_fp8_weight(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Uniform random e4m3 bytes over all 254 non-NaN codes (subnormals and +-448 included)."""
    bits = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    return torch.where((bits & 0x7F) == 0x7F, 0x00, bits)


def _fp8_scale(gen: torch.Generator, n: int, k: int, kind: str) -> torch.Tensor:
    shape = (-(-n // 128), -(-k // 128))
    e8m0 = torch.randint(118, 136, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    if kind == "e8m0fnu":
        return e8m0.view(torch.float8_e8m0fnu)
    if kind == "uint8":
        return e8m0
    # Base-checkpoint style float32 scale: not a power of two.
    return torch.rand(shape, generator=gen) * 0.01 + 1e-4


def _x_used(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "fp8":
        return quant.fp8_act_dequant(*quant.fp8_act_quant(x))
    return x.to(torch.bfloat16).to(torch.float32)


FP8_SHAPES = [(1, 128, 128), (5, 256, 256), (16, 256, 128), (16, 128, 256), (5, 200, 320)]


@pytest.mark.parametrize("backend", ["torch", "interp"])
@pytest.mark.parametrize("act", ["bf16", "fp8"])
@pytest.mark.parametrize("scale_kind", ["e8m0fnu", "uint8", "float32"])
@pytest.mark.parametrize(("m", "n", "k"), FP8_SHAPES)
def test_fp8_block_gemm_matches_reference(
    request: pytest.FixtureRequest, backend: str, act: str, scale_kind: str, m: int, n: int, k: int
) -> None:
    requested = request.getfixturevalue("interp") if backend == "interp" else "torch"
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    w = _random_fp8_weight(gen, n, k)
    s = _fp8_scale(gen, n, k, scale_kind)
    x = torch.randn(m, k, generator=gen)
    y = fp8_block_gemm(x, w.view(torch.float8_e4m3fn), s, act=act, backend=requested)
    what = f"fp8 {backend} {act} {scale_kind} {m}x{n}x{k}"
    assert_gemm_close(y, _x_used(x, act), quant.fp8_block_dequant(w, s), what)


def test_fp8_kernel_decodes_scales_exactly(interp: str) -> None:
    # All weights 1.0, one-hot activations: y[r, n] is exactly the scale of weight block (n//128, r).
    # E8M0 bytes 0 (2**-127, a float32 subnormal), 1, 127 and 254 (2**127).
    w = torch.full((256, 256), 0x38, dtype=torch.uint8)
    s = torch.tensor([[0, 1], [127, 254]], dtype=torch.uint8)
    x = torch.zeros(2, 256)
    x[0, 0] = 1.0
    x[1, 128] = 1.0
    y = fp8_block_gemm(x, w, s, backend=interp)
    expected = torch.empty(2, 256)
    expected[0, :128], expected[0, 128:] = 2.0**-127, 1.0
    expected[1, :128], expected[1, 128:] = 2.0**-126, 2.0**127
    assert torch.equal(y, expected), (y[:, [0, 128]], expected[:, [0, 128]])


def test_fp8_kernel_decodes_every_e4m3_code(interp: str) -> None:
    # Row n of w holds code n in every column (NaN codes replaced), scale 1, x one-hot at k=3:
    # y[0, n] must equal the e4m3 value of code n exactly, subnormals and sign of zero aside.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, 0x38, codes)
    w = codes[:, None].expand(256, 128).contiguous()
    x = torch.zeros(1, 128)
    x[0, 3] = 1.0
    y = fp8_block_gemm(x, w, torch.full((2, 1), 127, dtype=torch.uint8), backend=interp)
    assert torch.equal(y[0], quant.e4m3_decode_bits(codes))


MXFP8_SHAPES = [(1, 32, 32), (5, 96, 64), (16, 64, 256), (4, 80, 96)]


@pytest.mark.parametrize("backend", ["torch", "interp"])
@pytest.mark.parametrize("act", ["bf16", "fp8"])
@pytest.mark.parametrize("block", [quant.MXFP8_BLOCK, quant.MXFP8_ROW_BLOCK], ids=["32x32", "1x32"])
@pytest.mark.parametrize(("m", "n", "k"), MXFP8_SHAPES)
def test_mxfp8_gemm_matches_reference(
    request: pytest.FixtureRequest, backend: str, act: str, block: tuple[int, int], m: int, n: int, k: int
) -> None:
    """V4.1's MXFP8 through the FP8 GEMM with 32-wide blocks: the checkpoint's 32x32 scales and vLLM's per-row
    ones (1x32), every e4m3 code, fp8 activations in 32-input groups."""
    requested = request.getfixturevalue("interp") if backend == "interp" else "torch"
    gen = torch.Generator().manual_seed(m * 131 + n * 7 + k + block[0])
    w = _random_fp8_weight(gen, n, k)
    shape = (-(-n // block[0]), -(-k // block[1]))
    s = torch.randint(118, 136, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    x = torch.randn(m, k, generator=gen)
    y = fp8_block_gemm(x, w, s, act=act, block=block, backend=requested)
    x_used = quant.fp8_act_dequant(*quant.fp8_act_quant(x, 32), 32) if act == "fp8" else _x_used(x, act)
    what = f"mxfp8 {backend} {act} {block} {m}x{n}x{k}"
    assert_gemm_close(y, x_used, quant.fp8_block_dequant(w, s, block), what)


def test_mxfp8_kernel_reads_one_scale_per_row_and_32_inputs(interp: str) -> None:
    # All weights 1.0, scale [n, g] = 2**(n % 7 - g): one-hot x at input 32*g + 5 gives y[g, n] = that scale exactly,
    # which a kernel reading a 32-row block's scale, or a 128-wide group, gets wrong.
    n_idx, g_idx = torch.arange(64)[:, None], torch.arange(4)[None, :]
    s = (127 + n_idx % 7 - g_idx).to(torch.uint8)
    w = torch.full((64, 128), 0x38, dtype=torch.uint8)
    x = torch.zeros(4, 128)
    for g in range(4):
        x[g, 32 * g + 5] = 1.0
    y = fp8_block_gemm(x, w, s, block=quant.MXFP8_ROW_BLOCK, backend=interp)
    assert torch.equal(y, torch.exp2((n_idx % 7 - g_idx).float()).T), y


def test_mxfp8_kernel_error_against_the_reference_is_float32_rounding(interp: str) -> None:
    """The stated tolerance, measured: a V4.1-shaped MXFP8 linear (one rank's wq_b, 512 x 64, vLLM's 1x32 scales)
    through the kernel vs the torch reference; both see the same bf16 activation, so they differ by summation order
    alone, far below the per-tensor check's max_rel 1e-3."""
    gen = torch.Generator().manual_seed(7)
    w = _random_fp8_weight(gen, 512, 64)
    s = torch.randint(118, 136, (512, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    x = torch.randn(4, 64, generator=gen)
    ref = fp8_block_gemm(x, w, s, block=quant.MXFP8_ROW_BLOCK, backend="torch")
    got = fp8_block_gemm(x, w, s, block=quant.MXFP8_ROW_BLOCK, backend=interp)
    max_rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert max_rel <= 1e-6, max_rel


def test_the_fp8_gemm_refuses_a_block_its_kernel_cannot_step_through() -> None:
    with pytest.raises(ValueError, match="block"):
        fp8_block_gemm(torch.ones(1, 48), torch.zeros(16, 48, dtype=torch.uint8), torch.ones(1, 1), block=(16, 48))


MXFP4_SHAPES = [(1, 128, 128), (5, 256, 256), (16, 128, 256), (5, 80, 96)]


@pytest.mark.parametrize("backend", ["torch", "interp"])
@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize(("m", "n", "k"), MXFP4_SHAPES)
def test_mxfp4_gemm_matches_reference(
    request: pytest.FixtureRequest, backend: str, packed_dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    requested = request.getfixturevalue("interp") if backend == "interp" else "torch"
    gen = torch.Generator().manual_seed(m * 104729 + n * 17 + k)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(118, 136, (n, -(-k // 32)), generator=gen, dtype=torch.int32).to(torch.uint8)
    x = torch.randn(m, k, generator=gen)
    y = mxfp4_gemm(x, packed.view(packed_dtype), scale.view(torch.float8_e8m0fnu), backend=requested)
    assert_gemm_close(
        y,
        x.to(torch.bfloat16).to(torch.float32),
        quant.mxfp4_dequant(packed, scale),
        f"mxfp4 {backend} {packed_dtype} {m}x{n}x{k}",
    )


def test_mxfp4_kernel_nibble_order_and_group_scales(interp: str) -> None:
    # Row n of the packed weight is byte n everywhere; scales are 2**(n % 8 - 4) for group 0 and
    # 2**-127 / 2**0 alternating for group 1. One-hot x picks inputs 0 (low nibble), 1 (high
    # nibble) and 33 (high nibble, second group), so y is a table lookup times a scale.
    table = torch.tensor(quant.E2M1_VALUES)
    n_idx = torch.arange(256)
    packed = n_idx.to(torch.uint8)[:, None].expand(256, 32).contiguous()
    s0 = (n_idx % 8 - 4 + 127).to(torch.uint8)
    s1 = torch.where(n_idx % 2 == 0, 0, 127).to(torch.uint8)
    scale = torch.stack([s0, s1], dim=1)
    x = torch.zeros(3, 64)
    x[0, 0] = x[1, 1] = x[2, 33] = 1.0
    y = mxfp4_gemm(x, packed, scale, backend=interp)
    f0 = torch.exp2((n_idx % 8 - 4).double())
    f1 = torch.where(n_idx % 2 == 0, 2.0**-127, 1.0).double()
    expected = torch.stack([table[n_idx & 15] * f0, table[n_idx >> 4] * f0, table[n_idx >> 4] * f1]).float()
    assert torch.equal(y, expected), (y - expected).abs().max()


# ---------------------------------------------------------------- NVFP4

FINITE_E4M3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
"""Every non-NaN e4m3fn byte (0x7F and 0xFF are NaN): subnormals, both zeros, 448 and negative scales."""

# K a multiple of 16 but not of the kernel's 128-input step (96, 48, 272), N not a multiple of its 64-column tile
NVFP4_SHAPES = [(1, 128, 128), (5, 256, 256), (16, 128, 256), (5, 80, 96), (3, 200, 48), (33, 70, 272)]


def _random_nvfp4(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes (all 16 codes in both nibbles) and random scale bytes over all 254 finite E4M3 codes."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = FINITE_E4M3[torch.randint(0, FINITE_E4M3.numel(), (n, k // 16), generator=gen)]
    return packed, scale


@pytest.mark.parametrize("backend", ["torch", "interp"])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e4m3fn, torch.uint8])
@pytest.mark.parametrize(("m", "n", "k"), NVFP4_SHAPES)
def test_nvfp4_gemm_matches_reference(
    request: pytest.FixtureRequest, backend: str, scale_dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    """Within RTOL * sum|x*w| of the float64 product of the bf16 activation and the reference dequantization (the
    global scale not a power of two, so its rounding is in the comparison)."""
    requested = request.getfixturevalue("interp") if backend == "interp" else "torch"
    gen = torch.Generator().manual_seed(m * 7907 + n * 13 + k)
    packed, scale = _random_nvfp4(gen, n, k)
    g = torch.tensor(0.00731, dtype=torch.float32)
    x = torch.randn(m, k, generator=gen)
    y = nvfp4_gemm(x, packed, scale.view(scale_dtype), g, backend=requested)
    assert_gemm_close(
        y,
        x.to(torch.bfloat16).to(torch.float32),
        quant.nvfp4_dequant(packed, scale, g),
        f"nvfp4 {backend} {scale_dtype} {m}x{n}x{k}",
    )


def test_nvfp4_kernel_decodes_every_code_and_every_finite_scale_byte_exactly(interp: str) -> None:
    """Byte j of every row holds code j in its low nibble and 15 - j in its high one, so the identity activation's
    row 2j picks code j and row 2j + 1 code 15 - j; row n's two groups have scale bytes FINITE_E4M3[n] and
    FINITE_E4M3[253 - n]. With a power-of-two global scale every output is exactly e2m1 * e4m3 * g: a swapped
    nibble, a misread scale byte (subnormal, sign, 448) or a scale taken from the wrong group is off by far more."""
    n = FINITE_E4M3.numel()
    j = torch.arange(16)
    packed = (j | ((15 - j) << 4)).to(torch.uint8).expand(n, 16).contiguous()
    scale = torch.stack([FINITE_E4M3, FINITE_E4M3.flip(0)], dim=1)
    g = torch.tensor(2.0**-3)
    y = nvfp4_gemm(torch.eye(32), packed, scale, g, backend=interp)
    codes = torch.stack([j, 15 - j], dim=1).flatten()  # input i's code
    e2m1 = torch.tensor(quant.E2M1_VALUES, dtype=torch.float64)[codes]
    s = quant.e4m3_decode_bits(scale).double()  # [n, 2]
    expected = (e2m1[:, None] * s[:, torch.arange(32) // 16].T * 0.125).float()
    assert torch.equal(y, expected), (y - expected).abs().max()


def test_nvfp4_kernel_error_against_the_reference_is_float32_rounding(interp: str) -> None:
    """The stated tolerance, measured: one V4-shaped rank's expert part (w2 of a 2-rank tp split: 512 x 256) from
    nvfp4_quant through the kernel vs the torch reference; they differ by summation order and where the global
    scale is applied, far below the per-tensor check's max_rel 1e-3."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(512, 256, generator=gen) * 0.02
    packed, scale, g = quant.nvfp4_quant(w)
    x = torch.randn(4, 256, generator=gen)
    ref = nvfp4_gemm(x, packed, scale, g, backend="torch")
    got = nvfp4_gemm(x, packed, scale, g, backend=interp)
    max_rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert max_rel <= 1e-6, max_rel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton NVFP4 kernel (bf16 dot) needs CUDA")
@pytest.mark.parametrize(("m", "n", "k"), NVFP4_SHAPES)
def test_nvfp4_gemm_compiled_on_cuda_matches_reference(no_interp: None, m: int, n: int, k: int) -> None:
    """The compiled kernel, whose tl.dot takes bf16 operands (exact for e2m1 x e4m3 products), on a GPU."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(m * 31 + n * 7 + k)
    packed, scale = _random_nvfp4(gen, n, k)
    g = torch.tensor(0.00731)
    x = torch.randn(m, k, generator=gen)
    y = nvfp4_gemm(x.cuda(), packed.cuda(), scale.cuda(), g.cuda(), backend="triton")
    assert_gemm_close(
        y.cpu(), x.to(torch.bfloat16).float(), quant.nvfp4_dequant(packed, scale, g), f"nvfp4 cuda {m}x{n}x{k}"
    )


@pytest.mark.parametrize("backend", ["torch", "interp"])
def test_nvfp4_gemm_rejects_bad_scales_naming_the_tensor(request: pytest.FixtureRequest, backend: str) -> None:
    requested = request.getfixturevalue("interp") if backend == "interp" else "torch"
    x = torch.ones(1, 64)
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    scale = torch.full((4, 4), 0x38, dtype=torch.uint8)
    for nan_byte in (0x7F, 0xFF):
        bad = scale.clone()
        bad[1, 3] = nan_byte
        with pytest.raises(CheckpointError, match=r"experts\.w13_weight expert 2 w1 weight_scale: 1 NaN.*\[1, 3\]"):
            nvfp4_gemm(x, packed, bad, torch.tensor(1.0), backend=requested, what="experts.w13_weight expert 2 w1")
    for g in (float("nan"), float("inf")):
        with pytest.raises(CheckpointError, match=r"w2 weight_scale_2: .*not a finite number"):
            nvfp4_gemm(x, packed, scale, torch.tensor(g), backend=requested, what="w2")
    with pytest.raises(CheckpointError, match=r"one E4M3 scale per 16 inputs: expected \[4, 4\]"):
        nvfp4_gemm(x, packed, torch.full((4, 2), 0x38, dtype=torch.uint8), torch.tensor(1.0), backend=requested)
    with pytest.raises(ValueError, match="K=32"):
        nvfp4_gemm(torch.ones(1, 32), packed, scale, torch.tensor(1.0), backend=requested)


# ---------------------------------------------------------------- errors and backend selection


@pytest.mark.parametrize("backend", ["torch", "interp"])
def test_nan_scale_rejected_by_both_gemms(request: pytest.FixtureRequest, backend: str) -> None:
    requested = request.getfixturevalue("interp") if backend == "interp" else "torch"
    w8 = torch.zeros(128, 128, dtype=torch.uint8)
    s = torch.full((1, 1), 0xFF, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"layers\.2\.wq scale.*1 NaN"):
        fp8_block_gemm(torch.ones(1, 128), w8, s, backend=requested, what="layers.2.wq")
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="NaN"):
        mxfp4_gemm(torch.ones(1, 64), packed, torch.full((4, 2), 0xFF, dtype=torch.uint8), backend=requested)


def test_gemm_shape_errors() -> None:
    with pytest.raises(CheckpointError, match=r"expected \[2, 1\]"):
        fp8_block_gemm(torch.ones(1, 128), torch.zeros(256, 128, dtype=torch.uint8), torch.ones(1, 1), backend="torch")
    with pytest.raises(ValueError, match="K=64"):
        fp8_block_gemm(torch.ones(1, 64), torch.zeros(128, 128, dtype=torch.uint8), torch.ones(1, 1), backend="torch")
    with pytest.raises(ValueError, match="act"):
        fp8_block_gemm(torch.ones(1, 128), torch.zeros(128, 128, dtype=torch.uint8), torch.ones(1, 1), act="int8")
    with pytest.raises(CheckpointError, match=r"expected \[4, 2\]"):
        mxfp4_gemm(torch.ones(1, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))


def test_backend_selection_without_interpreter(no_interp: None) -> None:
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("auto", "cpu") == "torch"
    if _backend.triton_import_error() is None:
        with pytest.raises(UsageError, match="TRITON_INTERPRET=1"):
            resolve_backend("triton", "cpu")
        with pytest.raises(UsageError, match="TRITON_INTERPRET=1"):
            w8 = torch.zeros(128, 128, dtype=torch.uint8)
            fp8_block_gemm(torch.ones(1, 128), w8, torch.ones(1, 1), backend="triton")
    with pytest.raises(UsageError, match="unknown GEMM backend"):
        resolve_backend("cuda", "cpu")
    assert "torch" in _backend.available_backends()
    assert "triton-interpreter" not in _backend.available_backends()


def test_backend_selection_when_triton_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.available_backends() == ["torch"]
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "torch"
    with pytest.raises(UsageError, match="cannot be imported"):
        resolve_backend("triton", "cuda")


def test_backend_selection_with_interpreter(interp: str) -> None:
    assert resolve_backend("triton", "cpu") == "triton-interpreter"
    assert resolve_backend("triton-interpreter", "cpu") == "triton-interpreter"
    assert resolve_backend("torch", "cpu") == "torch"
    assert _backend.available_backends() == ["triton-interpreter", "torch"]


def test_interpreter_set_before_import_and_package_import_is_lazy() -> None:
    """Fresh process, TRITON_INTERPRET=1 from the start (as a CI job sets it)."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import sys, torch
        import ckpt_tool.verify.kernels as K
        assert "triton" not in sys.modules, "importing ckpt_tool.verify.kernels imported triton"
        from ckpt_tool.verify import quant
        assert K.resolve_backend("auto", "cpu") == "triton-interpreter"
        w = torch.randn(128, 256)
        x = torch.randn(3, 256)
        q, s = quant.fp8_block_quant(w)
        y = K.fp8_block_gemm(x, q, s, backend="triton")
        r = K.fp8_block_gemm(x, q, s, backend="torch")
        assert (y - r).abs().max().item() <= 1e-4, (y - r).abs().max().item()
        p, s = quant.mxfp4_quant(w)
        y = K.mxfp4_gemm(x, p, s, backend="triton")
        r = K.mxfp4_gemm(x, p, s, backend="torch")
        assert (y - r).abs().max().item() <= 1e-4, (y - r).abs().max().item()
        p, s, g = quant.nvfp4_quant(w)
        y = K.nvfp4_gemm(x, p, s, g, backend="triton")
        r = K.nvfp4_gemm(x, p, s, g, backend="torch")
        assert (y - r).abs().max().item() <= 1e-4, (y - r).abs().max().item()
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
