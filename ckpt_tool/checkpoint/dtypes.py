"""The safetensors dtypes: one row each, the one table the package, the fixtures, the tests and the benches read.

Plain data from the standard library only: the header path (``inspect``, ``convert --dry-run``) reads it without
importing torch, and ``tests/engine/vllm_worker.py`` loads this file by path in an interpreter where ckpt_tool may
not import. A torch dtype is named by a string (``getattr(torch, name)`` where torch is imported).
"""

from __future__ import annotations

from typing import NamedTuple


class Dtype(NamedTuple):
    """One safetensors dtype."""

    bits: int  # per element; sub-byte dtypes pack along the last dim
    torch: str | None  # the torch dtype safetensors' torch loader gives a tensor of it; None: it gives none


# Every dtype safetensors 0.8 knows, in the reference's order (a header error lists them in this order). The torch
# names are safetensors' own (safetensors/torch.py ``_TYPES``, and F8_E8M0 -> float8_e8m0fnu in ``safe_open``).
DTYPES: dict[str, Dtype] = {
    #              bits  torch
    "BOOL": Dtype(8, "bool"),
    "U8": Dtype(8, "uint8"),
    "I8": Dtype(8, "int8"),
    "F8_E5M2": Dtype(8, "float8_e5m2"),
    "F8_E4M3": Dtype(8, "float8_e4m3fn"),
    "F8_E8M0": Dtype(8, "float8_e8m0fnu"),
    "F8_E4M3FNUZ": Dtype(8, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": Dtype(8, "float8_e5m2fnuz"),
    "F4": Dtype(4, None),
    "F6_E2M3": Dtype(6, None),
    "F6_E3M2": Dtype(6, None),
    "I16": Dtype(16, "int16"),
    "U16": Dtype(16, "uint16"),
    "F16": Dtype(16, "float16"),
    "BF16": Dtype(16, "bfloat16"),
    "I32": Dtype(32, "int32"),
    "U32": Dtype(32, "uint32"),
    "F32": Dtype(32, "float32"),
    "I64": Dtype(64, "int64"),
    "U64": Dtype(64, "uint64"),
    "F64": Dtype(64, "float64"),
    "C64": Dtype(64, "complex64"),
}

DTYPE_BITS: dict[str, int] = {name: d.bits for name, d in DTYPES.items()}
"""Bits per element of each dtype."""

TORCH_NAMES: dict[str, str] = {name: d.torch for name, d in DTYPES.items() if d.torch is not None}
"""safetensors dtype -> the name of the torch dtype safetensors' torch loader gives (dtypes torch has)."""
