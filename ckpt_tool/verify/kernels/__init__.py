"""GEMMs that consume DeepSeek V4 quantized weights directly (FP8 block, MXFP4, NVFP4).

Each GEMM has a Triton backend (compiled on CUDA, or the Triton CPU interpreter under
``TRITON_INTERPRET=1``) and a torch backend that dequantizes with :mod:`ckpt_tool.verify.quant` and
multiplies in float32. Importing this package never imports triton; it is imported on first use.
"""

from __future__ import annotations

from ckpt_tool.verify.kernels._backend import (
    REQUESTABLE_BACKENDS,
    RESOLVED_BACKENDS,
    available_backends,
    interpreter_active,
    resolve_backend,
)
from ckpt_tool.verify.kernels.fp8_gemm import ACT_MODES, fp8_block_gemm
from ckpt_tool.verify.kernels.mxfp4_gemm import mxfp4_gemm
from ckpt_tool.verify.kernels.nvfp4_gemm import nvfp4_gemm

__all__ = [
    "ACT_MODES",
    "REQUESTABLE_BACKENDS",
    "RESOLVED_BACKENDS",
    "available_backends",
    "fp8_block_gemm",
    "interpreter_active",
    "mxfp4_gemm",
    "nvfp4_gemm",
    "resolve_backend",
]
