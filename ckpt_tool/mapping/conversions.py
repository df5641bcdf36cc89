"""Element conversions a rule may apply on the way from a source tensor to the engine's parameter.

One place for each conversion's output dtype, its forward bytes (the writer, verify's values level)
and its inverse (unconvert), so a new engine dtype is one entry here and one profile field.

- ``copy``: the stored bytes and dtype.
- ``raw_uint8``: the same bytes, declared U8 (the seed's ``.view(torch.uint8)`` for fp4 experts;
  the seed: docs/profiles.md#the-seed).
- ``e8m0_to_f32``: an E8M0 byte ``b`` becomes float32 ``2^(b-127)`` (a scale landing in a float32
  parameter); a float32 source is copied.
- ``to_bf16`` / ``to_f32``: a float32 source rounded to bfloat16 (nearest even, as torch casts), a bfloat16
  source widened to float32; a source already in the output dtype is copied.
- ``int_to_i32``: a 64-bit integer table (``tid2eid``) becomes int32, refused if a value does not fit;
  an int32 source is copied.

The engine's zero padding (block-FP8 shared experts at a tp their blocks do not divide) is zero source
elements through the same conversion (:func:`zero_element`): the engine pads in the loaded dtype, then
loads, so an E8M0 zero byte landing in a float32 parameter is ``2^-127``, not ``0.0``.

Conversions work on little-endian bytes with numpy: never torch, so the writer stays light.
"""

from __future__ import annotations

from ckpt_tool.checkpoint.dtypes import DTYPE_BITS
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.errors import CheckpointError

BYTEWISE = ("copy", "raw_uint8")  # output bytes are the source bytes
KINDS = (*BYTEWISE, "e8m0_to_f32", "int_to_i32", "to_bf16", "to_f32")

# kind -> (source dtype it converts, output dtype); other source dtypes are copied unchanged.
# to_bf16 / to_f32: a vision-tower tensor stored in the other float dtype lands in the engine's BF16 (F32 for
# image_*) parameter as vLLM's loader copy_()s it: torch's cast, round to nearest even.
_CONVERTS = {
    "e8m0_to_f32": ("F8_E8M0", "F32"),
    "int_to_i32": ("I64", "I32"),
    "to_bf16": ("F32", "BF16"),
    "to_f32": ("BF16", "F32"),
}


def effective(src_dtype: str, kind: str) -> str:
    """The conversion that really applies to a source of ``src_dtype`` (``copy`` when it already fits)."""
    if kind in _CONVERTS and _CONVERTS[kind][0] != src_dtype:
        return "copy"
    return kind


def out_dtype(src_dtype: str, kind: str) -> str:
    """The dtype written for a source of ``src_dtype`` under ``kind``."""
    if kind == "raw_uint8":
        return "U8"
    kind = effective(src_dtype, kind)
    return _CONVERTS[kind][1] if kind in _CONVERTS else src_dtype


def zero_element(kind: str, dtype: str) -> bytes:
    """The output bytes of one zero source element under ``kind``, written as ``dtype`` (zero bytes, except
    that ``e8m0_to_f32`` maps the E8M0 zero byte to float32 ``2^-127``, as :func:`forward` does)."""
    if kind == "e8m0_to_f32":
        return E8M0_ZERO_F32
    return bytes(DTYPE_BITS[dtype] // 8)


E8M0_ZERO_F32 = (0x00400000).to_bytes(4, "little")  # 2^-127: the float32 value of E8M0 byte 0 (a subnormal)


def reject_e8m0_nan(raw: memoryview | bytes, info: TensorInfo):
    """E8M0 bytes ``raw`` of ``info`` as numpy uint8; CheckpointError naming the first 0xFF (NaN) byte."""
    import numpy as np  # start-up: convert --dry-run imports this module, never numpy

    b = np.frombuffer(raw, dtype=np.uint8)
    nan = np.flatnonzero(b == 0xFF)
    if nan.size:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r}: E8M0 scale byte 0xFF (NaN) at element {int(nan[0])} "
            f"({nan.size} in this chunk); the checkpoint is corrupt — re-download this shard"
        )
    return b


def forward(kind: str, raw: memoryview | bytes, info: TensorInfo) -> bytes:
    """Output bytes of a whole number of source elements ``raw`` of tensor ``info`` (a non-bytewise kind)."""
    import numpy as np  # start-up: convert --dry-run imports this module, never numpy

    if kind == "e8m0_to_f32":
        b = reject_e8m0_nan(raw, info)
        bits = b.astype(np.uint32) << 23
        bits[b == 0] = 0x00400000  # 2^-127 is a float32 subnormal, not 0
        return bits.view(np.float32).astype("<f4").tobytes()
    if kind == "int_to_i32":
        v = np.frombuffer(raw, dtype="<i8")
        bad = np.flatnonzero((v < -(2**31)) | (v >= 2**31))
        if bad.size:
            raise CheckpointError(
                f"{info.file}: tensor {info.name!r}: value {int(v[bad[0]])} at element {int(bad[0])} does not fit the "
                "engine's int32 parameter; the table is corrupt — re-download this shard"
            )
        return v.astype("<i4").tobytes()
    if kind == "to_bf16":
        bits = np.frombuffer(raw, dtype="<u4")
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even on the dropped 16 bits
        rounded[nan] = (bits[nan] >> 16) | 0x40  # a NaN stays a (quiet) NaN
        return rounded.astype("<u2").tobytes()
    if kind == "to_f32":
        return (np.frombuffer(raw, dtype="<u2").astype("<u4") << 16).tobytes()
    raise AssertionError(f"forward() of bytewise or unknown conversion {kind!r}")


def inverse(kind: str, raw: bytes, where: str):
    """Source bytes (numpy uint8) of output bytes ``raw`` under ``kind``; CheckpointError if not an image of it."""
    import numpy as np  # start-up: convert --dry-run imports this module, never numpy

    if kind == "e8m0_to_f32":
        bits = np.frombuffer(raw, dtype="<u4")
        b = (bits >> 23).astype(np.uint8)
        sub = bits == 0x00400000  # 2^-127, written for byte 0
        ok = sub | (((bits & 0x807FFFFF) == 0) & (b >= 1) & (b <= 254))
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise CheckpointError(
                f"{where}: float32 scale {np.frombuffer(raw, dtype='<f4')[i]!r} at element {i} is not 2^(b-127) of an "
                "E8M0 byte"
            )
        b[sub] = 0
        return b
    if kind == "int_to_i32":
        return np.frombuffer(raw, dtype="<i4").astype("<i8").view(np.uint8)
    if kind == "to_f32":
        bits = np.frombuffer(raw, dtype="<u4")
        if (bits & 0xFFFF).any():
            raise CheckpointError(f"{where}: a float32 value is not a widened bfloat16")
        return (bits >> 16).astype("<u2").view(np.uint8)
    if kind == "to_bf16":
        raise CheckpointError(f"{where}: float32 rounded to bfloat16 cannot be restored")
    return np.frombuffer(raw, dtype=np.uint8)
