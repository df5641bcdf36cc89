"""The tiled matmul: ``x @ W.T`` in float32 for a quantized (or bf16) weight ``W`` that is never whole in float32,
dequantized with the :mod:`ckpt_tool.verify.quant` reference a tile of rows at a time into reused memory (the value
checks' and the numeric forward's CPU path)."""

from __future__ import annotations

import threading

import torch

from ckpt_tool.checkpoint.blocks import cdiv
from ckpt_tool.verify.quant import (
    FP8_BLOCK,
    MXFP4_GROUP,
    DecodeScratch,
    as_e4m3_bits,
    check_fp8_block_shapes,
    check_mxfp4_shapes,
    check_nvfp4_shapes,
    decode_table,
    e4m3_scale_to_float32,
    e8m0_to_float32,
    fp8_block_scaled,
    fp8_scale_to_float32,
    mxfp4_scaled,
    nvfp4_global_scale,
    nvfp4_scaled,
)

MATMUL_TILE_ELEMENTS = 1 << 17
"""Weight elements the matmuls below dequantize at once (512 KiB of float32): the tile, its lookup indices
and the activation stay in one core's L2 cache while it is multiplied. On the 2-core development VM this
runs ~1.3x faster than 8 MiB tiles into fresh memory."""

_SCRATCH = threading.local()


def matmul_tile_rows(n: int, k: int, align: int) -> int:
    """Rows per tile of an ``[n, k]`` weight in :func:`dequant_matmul`: a multiple of ``align``, at least one."""
    rows = max(align, (MATMUL_TILE_ELEMENTS // max(k, 1)) // align * align)
    return min(rows, max(n, 1))


def _thread_scratch() -> DecodeScratch:
    scratch = getattr(_SCRATCH, "scratch", None)
    if scratch is None:
        scratch = _SCRATCH.scratch = DecodeScratch()
    return scratch


def dequant_matmul(x: torch.Tensor, n: int, k: int, align: int, dequant_rows) -> torch.Tensor:
    """``x @ W.T`` in float32 for ``x [M, k]`` float32 and a weight ``W [n, k]`` that is never whole in float32:
    ``dequant_rows(r0, r1, scratch)`` returns rows ``[r0, r1)`` dequantized (``r0`` a multiple of ``align``),
    possibly in ``scratch``, this thread's :class:`DecodeScratch`, used before the next tile is asked for."""
    scratch = _thread_scratch()
    rows = matmul_tile_rows(n, k, align)
    m = x.shape[0]
    if m > _TRANSPOSE_ABOVE_M and x.device.type == "cpu":
        # MKL's sgemm for x @ W.T slows 2-3x past a dozen rows of x; W @ x.T (x.T made contiguous) does not
        xt = x.T.contiguous()
        yt = torch.empty(n, m, dtype=torch.float32, device=x.device)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            torch.matmul(dequant_rows(r0, r1, scratch), xt, out=yt[r0:r1])
        return yt.T.contiguous()
    if rows >= n:
        return x @ dequant_rows(0, n, scratch).T
    tiles = cdiv(n, rows)
    y = torch.empty(tiles, m, rows, dtype=torch.float32, device=x.device)  # each tile's product contiguous
    for i in range(tiles):
        r0 = i * rows
        r1 = min(n, r0 + rows)
        torch.mm(x, dequant_rows(r0, r1, scratch).T, out=y[i, :, : r1 - r0])
    return _untile(y, n)


def _untile(y: torch.Tensor, n: int) -> torch.Tensor:
    """``[tiles, M, rows]`` products of consecutive row tiles as ``[M, n]``."""
    tiles, m, rows = y.shape
    flat = y.permute(1, 0, 2).reshape(m, tiles * rows)
    return flat if tiles * rows == n else flat[:, :n].contiguous()


_TRANSPOSE_ABOVE_M = 12


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.float().T`` for float32 ``x [M, K]`` and a bf16 (or any float) ``weight [N, K]``, converted to
    float32 a tile of rows at a time into reused memory."""
    n, k = weight.shape

    def rows(r0: int, r1: int, scratch: DecodeScratch) -> torch.Tensor:
        return scratch.values((r1 - r0) * k, torch.float32, weight.device).view(r1 - r0, k).copy_(weight[r0:r1])

    return dequant_matmul(x, n, k, 1, rows)


def fp8_block_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    *,
    what: str | None = None,
) -> torch.Tensor:
    """``x @ fp8_block_dequant(weight, scale, block).T`` for float32 ``x [M, K]`` (as the caller rounded it), the
    weight dequantized a tile of rows at a time; the same checks and errors as :func:`fp8_block_dequant`."""
    bits = as_e4m3_bits(weight, what)
    check_fp8_block_shapes(bits, scale, block, what)
    s = fp8_scale_to_float32(scale, f"{what} scale" if what else None)
    bn = block[0]
    n, k = bits.shape
    return dequant_matmul(
        x,
        n,
        k,
        bn,
        lambda r0, r1, scratch: fp8_block_scaled(bits[r0:r1], s[r0 // bn : cdiv(r1, bn)], block, scratch),
    )


def mxfp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *, what: str | None = None
) -> torch.Tensor:
    """``x @ mxfp4_dequant(packed, scale).T`` for float32 ``x [M, K]`` (as the caller rounded it), the weight
    dequantized a tile of rows at a time; the same checks and errors as :func:`mxfp4_dequant`."""
    n, k = check_mxfp4_shapes(packed, scale, what)
    s = e8m0_to_float32(scale, f"{what} scale" if what else None)
    bits = packed.view(torch.uint8)
    rows = matmul_tile_rows(n, k, 1)
    if k % MXFP4_GROUP or rows >= n or x.shape[0] > _TRANSPOSE_ABOVE_M or x.device.type != "cpu":
        return dequant_matmul(x, n, k, 1, lambda r0, r1, scratch: mxfp4_scaled(bits[r0:r1], s[r0:r1], scratch))
    # The same steps as dequant_matmul over mxfp4_scaled, with every view made once: this loop runs ~10^5
    # times per layer, and at ~100 us of arithmetic a tile the per-call costs of ten tensor ops would be a fifth.
    scratch = _thread_scratch()
    kh, groups = k // 2, k // MXFP4_GROUP
    codes = packed.reshape(-1).view(torch.uint8)
    s = s.unsqueeze(-1)
    table = decode_table("e2m1_pairs", packed.device)
    idx = scratch.codes(rows * kh, packed.device)
    values = scratch.values(rows * kh, torch.int64, packed.device)
    w = values.view(torch.float32).view(rows, groups, MXFP4_GROUP)
    w_t = w.view(rows, k).T
    tiles = cdiv(n, rows)
    y = torch.empty(tiles, x.shape[0], rows, dtype=torch.float32, device=x.device)
    for i in range(tiles - (n % rows != 0)):
        r0 = i * rows
        idx.copy_(codes[r0 * kh : (r0 + rows) * kh])
        torch.index_select(table, 0, idx, out=values)
        w.mul_(s[r0 : r0 + rows])
        torch.mm(x, w_t, out=y[i])
    if n % rows:  # the last, shorter tile
        r0 = (tiles - 1) * rows
        torch.mm(x, mxfp4_scaled(bits[r0:], s[r0:, :, 0], scratch).T, out=y[-1, :, : n - r0])
    return _untile(y, n)


def nvfp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    what: str | None = None,
) -> torch.Tensor:
    """``x @ nvfp4_dequant(packed, scale, global_scale).T`` for float32 ``x [M, K]`` (as the caller rounded it), the
    weight dequantized a tile of rows at a time; the same checks and errors as :func:`nvfp4_dequant`."""
    n, k = check_nvfp4_shapes(packed, scale, what)
    s = e4m3_scale_to_float32(scale, f"{what} weight_scale" if what else None)
    g = nvfp4_global_scale(global_scale, f"{what} weight_scale_2" if what else None)
    return dequant_matmul(x, n, k, 1, lambda r0, r1, scratch: nvfp4_scaled(packed[r0:r1], s[r0:r1], g, scratch))
