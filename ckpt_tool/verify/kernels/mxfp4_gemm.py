"""GEMM against an MXFP4 weight that stays packed: ``y = x @ W_deq.T``."""

from __future__ import annotations

import torch

from ckpt_tool.verify import quant, tiled_matmul
from ckpt_tool.verify.kernels._backend import (
    LAUNCH_LOCK,
    dot_in_bf16,
    gemm_tiles,
    get_kernel,
    load_sources,
    resolve_backend,
)
from ckpt_tool.verify.kernels.fp8_gemm import check_x

_BLOCK_KH = 64  # packed bytes per K step = 128 inputs = 4 scale groups


def mxfp4_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    backend: str = "auto",
    what: str | None = None,
) -> torch.Tensor:
    """Compute ``x @ W.T`` in float32 where ``W`` is MXFP4: packed e2m1 nibbles plus E8M0 scales.

    ``x`` is ``[M, K]`` float32/bf16/fp16 and is rounded to bf16 (the activation dtype the MXFP4
    expert GEMMs run with); ``w_packed`` is int8 or uint8 ``[N, K/2]`` (low nibble = even input);
    ``w_scale`` is ``float8_e8m0fnu`` or uint8 ``[N, ceil(K/32)]``. ``backend`` is resolved by
    :func:`resolve_backend`. Returns float32 ``[M, N]``. Raises CheckpointError for bad weight or
    scale data (including NaN scale bytes), ValueError for a bad ``x``, UsageError for an
    unavailable backend.
    """
    n, k = quant.check_mxfp4_shapes(w_packed, w_scale, what)
    packed = w_packed.view(torch.uint8)
    check_x(x, k, packed.device)
    if w_scale.device != packed.device:
        raise ValueError(f"w_scale is on {w_scale.device} but the weight is on {packed.device}")
    resolved = resolve_backend(backend, packed.device)
    m = x.shape[0]
    if resolved == "torch" or m == 0 or n == 0 or k == 0:  # the reference itself (it rejects NaN scale bytes)
        return tiled_matmul.mxfp4_matmul(x.to(torch.bfloat16).to(torch.float32), packed, w_scale, what=what)
    scale_bits = quant.check_e8m0(w_scale, f"{what} scale" if what else None)

    x_arg = x.to(torch.bfloat16)
    # A deliberate twin of fp8_gemm.fp8_block_gemm's launch: tiles and lock are shared (gemm_tiles, LAUNCH_LOCK);
    # each kernel's own argument list is spelled out where it is launched.
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, block_n, grid = gemm_tiles(m, n)
    kernel = get_kernel(load_sources().mxfp4_gemm_kernel, resolved)
    with LAUNCH_LOCK:
        kernel[grid](
            x_arg,
            packed,
            scale_bits,
            y,
            m,
            n,
            k // 2,
            x_arg.stride(0),
            x_arg.stride(1),
            packed.stride(0),
            packed.stride(1),
            scale_bits.stride(0),
            scale_bits.stride(1),
            y.stride(0),
            y.stride(1),
            DOT_BF16=dot_in_bf16(resolved),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_KH=_BLOCK_KH,
            GROUP_BYTES=quant.MXFP4_GROUP // 2,
        )
    return y
