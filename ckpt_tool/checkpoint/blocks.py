"""DeepSeek V4's quantization blocks, in one place.

Block-FP8 linears hold one scale per 128 x 128 block of the weight (config.json
``quantization_config.weight_block_size``: ``[128, 128]`` in every released V4 checkpoint; DeepSeek-V4's
``inference/model.py`` ``block_size = 128``). MXFP4 routed experts hold one E8M0 scale per 32 consecutive
inputs of a row, two e2m1 values a byte (the OCP microscaling format). NVIDIA's NVFP4 routed experts
(Model Optimizer's exports, ``moe_quant_algo: "NVFP4"``) hold one E4M3 scale per 16 consecutive inputs of a row
and one float32 global scale per tensor (vLLM 0.34.0 ``models/deepseek_v41/quant_config.py``
``_get_nvfp4_config``: ``ModelOptNvFp4Config(..., group_size=16)``). Activations are quantized per token in groups of
128 on the fp8 path.
"""

from __future__ import annotations

FP8_BLOCK = 128  # rows and columns of one block-FP8 scale block
MX_BLOCK = 32  # inputs sharing one MXFP4 scale
NVFP4_BLOCK = 16  # inputs sharing one NVFP4 E4M3 block scale
ACT_GROUP = 128  # activation elements sharing one fp8 scale (per token)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)
