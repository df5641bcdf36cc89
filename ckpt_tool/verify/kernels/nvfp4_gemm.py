"""GEMM against an NVFP4 weight that stays packed: ``y = x @ W_deq.T``."""

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

_BLOCK_KH = 64  # packed bytes per K step = 128 inputs = 8 scale groups


def nvfp4_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    w_global_scale: torch.Tensor,
    *,
    backend: str = "auto",
    what: str | None = None,
) -> torch.Tensor:
    """Compute ``x @ W.T`` in float32 where ``W`` is NVFP4: packed e2m1 nibbles, E4M3 block scales and a global scale.

    ``x`` is ``[M, K]`` float32/bf16/fp16 and is rounded to bf16, as for the MXFP4 GEMM; ``w_packed`` is uint8
    ``[N, K/2]`` (low nibble = even input); ``w_scale`` is ``float8_e4m3fn`` (or its raw uint8 bytes) ``[N, K/16]``;
    ``w_global_scale`` is the float32 ``weight_scale_2`` (0-d or one element). ``backend`` is resolved by
    :func:`resolve_backend`. Both backends see the same bf16 activation and exact ``e2m1 * scale`` products; the
    Triton kernel multiplies the float32 sum by the global scale once, the torch one multiplies each weight, so they
    differ by float32 rounding only. Returns float32 ``[M, N]``. Raises CheckpointError for bad weight or scale
    data (a scale grid other than one per 16 inputs, NaN scale bytes, a non-finite global scale), ValueError for a
    bad ``x``, UsageError for an unavailable backend.
    """
    n, k = quant.check_nvfp4_shapes(w_packed, w_scale, what)
    check_x(x, k, w_packed.device)
    if w_scale.device != w_packed.device:
        raise ValueError(f"w_scale is on {w_scale.device} but the weight is on {w_packed.device}")
    resolved = resolve_backend(backend, w_packed.device)
    m = x.shape[0]
    if resolved == "torch" or m == 0 or n == 0 or k == 0:  # the reference itself (it rejects what the kernel would)
        x_used = x.to(torch.bfloat16).to(torch.float32)
        return tiled_matmul.nvfp4_matmul(x_used, w_packed, w_scale, w_global_scale, what=what)
    scale_bits = quant.check_e4m3_scale(w_scale, f"{what} weight_scale" if what else None)
    g = quant.nvfp4_global_scale(w_global_scale, f"{what} weight_scale_2" if what else None)

    x_arg = x.to(torch.bfloat16)
    # A deliberate twin of mxfp4_gemm.mxfp4_gemm's launch: tiles and lock are shared (gemm_tiles, LAUNCH_LOCK);
    # each kernel's own argument list is spelled out where it is launched.
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, block_n, grid = gemm_tiles(m, n)
    kernel = get_kernel(load_sources().nvfp4_gemm_kernel, resolved)
    with LAUNCH_LOCK:
        kernel[grid](
            x_arg,
            w_packed,
            scale_bits,
            y,
            g,
            m,
            n,
            k // 2,
            x_arg.stride(0),
            x_arg.stride(1),
            w_packed.stride(0),
            w_packed.stride(1),
            scale_bits.stride(0),
            scale_bits.stride(1),
            y.stride(0),
            y.stride(1),
            DOT_BF16=dot_in_bf16(resolved),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_KH=_BLOCK_KH,
            GROUP_BYTES=quant.NVFP4_GROUP // 2,
        )
    return y
