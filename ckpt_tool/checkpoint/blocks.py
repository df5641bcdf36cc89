"""DeepSeek V4's quantization blocks, in one place.

Block-FP8 linears hold one scale per 128 x 128 block of the weight (config.json
``quantization_config.weight_block_size``: ``[128, 128]`` in every released V4 checkpoint; DeepSeek-V4's
``inference/model.py`` ``block_size = 128``). MXFP4 routed experts hold one E8M0 scale per 32 consecutive
inputs of a row, two e2m1 values a byte (the OCP microscaling format). Activations are quantized per token
in groups of 128 on the fp8 path.
"""

from __future__ import annotations

FP8_BLOCK = 128  # rows and columns of one block-FP8 scale block
MX_BLOCK = 32  # inputs sharing one MXFP4 scale
ACT_GROUP = 128  # activation elements sharing one fp8 scale (per token)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)
