"""GEMM against an FP8 block-quantized weight that stays quantized: ``y = x @ W_deq.T``."""

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

ACT_MODES: tuple[str, ...] = ("bf16", "fp8")

# The kernel's K step equals the scale block's K size (and the fp8 activation group); the block's N size is
# looked up per output column. tl.dot wants a power of two of at least 16 along K.
_KERNEL_BLOCK_K = (32, 64, 128)


def check_x(x: torch.Tensor, k: int, device: torch.device) -> None:
    """Raise ValueError unless ``x`` is a floating-point ``[M, k]`` tensor on ``device``."""
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a 2-D floating-point [M, K] tensor, got {x.dtype} {list(x.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} but the weight has K={k}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the weight is on {device}")


def prepare_activation(x: torch.Tensor, act: str, group: int = quant.ACT_GROUP) -> torch.Tensor:
    """The activation exactly as both backends see it, as float32 (bf16-rounded, or fp8 round trip in groups of
    ``group`` inputs: 128 for the 128x128 blocks, 32 for MXFP8's, the weight block's K size).

    ``x`` is ``[..., K]``: the fp8 groups run along the last dim per token, so leading dims (``h_proj``'s
    ``[T, hc, D]``) are flattened for the quantizer and restored after.
    """
    if act == "fp8":
        lead = x.shape[:-1]
        xq, xs = quant.fp8_act_quant(x.reshape(-1, x.shape[-1]), group)
        return quant.fp8_act_dequant(xq, xs, group).reshape(*lead, x.shape[-1])
    return x.to(torch.bfloat16).to(torch.float32)


def _checked_weight(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, act: str, block: tuple[int, int], what: str | None
) -> torch.Tensor:
    """:func:`fp8_block_gemm`'s arguments checked (the errors it documents); the weight as e4m3 bits."""
    if act not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {act!r}")
    if block[1] not in _KERNEL_BLOCK_K or block[0] < 1:
        raise ValueError(f"block {list(block)}: the kernels take 1+ rows by {_KERNEL_BLOCK_K} inputs")
    bits = quant.as_e4m3_bits(w, what)
    quant.check_fp8_block_shapes(bits, w_scale, block, what)
    check_x(x, bits.shape[1], bits.device)
    if w_scale.device != bits.device:
        raise ValueError(f"w_scale is on {w_scale.device} but the weight is on {bits.device}")
    return bits


def fp8_block_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    act: str = "bf16",
    block: tuple[int, int] = quant.FP8_BLOCK,
    backend: str = "auto",
    what: str | None = None,
) -> torch.Tensor:
    """Compute ``x @ W.T`` in float32 where ``W`` is FP8 block-quantized with ``block`` (rows, cols) scale blocks:
    128x128 (DeepSeek V4, :data:`~ckpt_tool.verify.quant.FP8_BLOCK`), 32x32 (a V4.1 checkpoint's MXFP8,
    :data:`~ckpt_tool.verify.quant.MXFP8_BLOCK`) or 1x32 (MXFP8 as vLLM holds it, one scale row a weight row,
    :data:`~ckpt_tool.verify.quant.MXFP8_ROW_BLOCK`).

    ``x`` is ``[M, K]`` float32/bf16/fp16; ``w`` is ``float8_e4m3fn`` (or its uint8 bits)
    ``[N, K]``; ``w_scale`` is ``[ceil(N/bn), ceil(K/bk)]`` float32, ``float8_e8m0fnu`` or uint8
    raw E8M0 bytes. ``act="bf16"`` rounds ``x`` to bf16; ``act="fp8"`` quantizes it per token and per
    ``bk`` inputs to e4m3 with power-of-two scales (:func:`ckpt_tool.verify.quant.fp8_act_quant`, as vLLM
    does at runtime). ``backend`` is resolved by :func:`resolve_backend`; both backends see the
    same rounded activation, so they differ only by float32 summation order.
    Returns float32 ``[M, N]``. Raises CheckpointError for bad weight/scale data, ValueError for a
    bad ``x``, ``act`` or ``block``, UsageError for an unavailable backend.
    """
    bits = _checked_weight(x, w, w_scale, act=act, block=block, what=what)
    n, k = bits.shape
    resolved = resolve_backend(backend, bits.device)
    m = x.shape[0]
    if resolved == "torch" or m == 0 or n == 0 or k == 0:  # the reference itself (it rejects NaN scale bytes)
        return tiled_matmul.fp8_block_matmul(prepare_activation(x, act, block[1]), bits, w_scale, block, what=what)
    scale_what = f"{what} scale" if what else None
    if w_scale.dtype == torch.float32:
        scale_arg, scale_e8m0 = w_scale, False
    else:
        # Validates the dtype and rejects NaN (0xFF) bytes before the kernel runs.
        scale_arg, scale_e8m0 = quant.check_e8m0(w_scale, scale_what), True

    if act == "fp8":
        xq, xs = quant.fp8_act_quant(x, block[1])
        x_arg, xs_arg = xq.view(torch.uint8), xs
    else:
        x_arg = x.to(torch.bfloat16)
        xs_arg = x_arg  # unused by the kernel when ACT_FP8 is off; any pointer will do
    # A deliberate twin of mxfp4_gemm.mxfp4_gemm's launch: tiles and lock are shared (gemm_tiles, LAUNCH_LOCK);
    # each kernel's own argument list is spelled out where it is launched.
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m, block_n, grid = gemm_tiles(m, n)
    kernel = get_kernel(load_sources().fp8_block_gemm_kernel, resolved)
    with LAUNCH_LOCK:
        kernel[grid](
            x_arg,
            xs_arg,
            bits,
            scale_arg,
            y,
            m,
            n,
            k,
            x_arg.stride(0),
            x_arg.stride(1),
            xs_arg.stride(0),
            xs_arg.stride(1),
            bits.stride(0),
            bits.stride(1),
            scale_arg.stride(0),
            scale_arg.stride(1),
            y.stride(0),
            y.stride(1),
            ACT_FP8=act == "fp8",
            SCALE_E8M0=scale_e8m0,
            DOT_BF16=dot_in_bf16(resolved),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block[1],
            SCALE_BLOCK_N=block[0],
        )
    return y
