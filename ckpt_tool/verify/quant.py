"""Pure-torch reference for the DeepSeek V4 quantized weight formats.

This module is the specification the Triton kernels in :mod:`ckpt_tool.verify.kernels` are tested
against, so it favours exactness over speed:

* FP8 block quantization: ``float8_e4m3fn`` weight ``[N, K]`` with one scale per 128x128 block,
  ``[ceil(N/128), ceil(K/128)]``, stored as float32 (Base checkpoints) or E8M0
  (``float8_e8m0fnu``, or the same bytes as ``uint8`` after conversion). The scale is a
  multiplier: ``W[i, j] = W8[i, j] * S[i // 128, j // 128]``.
* MXFP8 linears (DeepSeek V4.1): the same ``float8_e4m3fn`` weight with one E8M0 scale per 32x32 block
  (:data:`MXFP8_BLOCK`, the checkpoint's ``[N/32, K/32]``), or, once vLLM has repeated every scale row 32
  times, one per row and 32 inputs (:data:`MXFP8_ROW_BLOCK`, ``[N, K/32]``): the FP8 block functions below
  take the block shape.
* MXFP4 experts: packed bytes ``[N, K/2]`` (``int8`` in the source files, ``uint8`` after
  conversion), element ``2k`` in the low nibble and ``2k+1`` in the high nibble, each an e2m1
  code; one E8M0 scale per 32 consecutive inputs of a row, ``[N, K/32]``.
* NVFP4 experts (NVIDIA Model Optimizer's exports, ``moe_quant_algo: "NVFP4"``): packed ``uint8`` ``[N, K/2]``
  with the same nibble order as MXFP4, one ``float8_e4m3fn`` block scale per 16 consecutive inputs of a row
  (``[N, K/16]``) and one float32 global scale per tensor (``weight_scale_2``):
  ``W[i, j] = e2m1(code[i, j]) * float(S[i, j // 16]) * g`` (:func:`nvfp4_dequant`).

Every E8M0 byte ``b`` means ``2**(b - 127)``; ``0xFF`` is NaN and is rejected with a
:class:`~ckpt_tool.errors.CheckpointError` because a NaN scale silently poisons a whole block.
"""

from __future__ import annotations

import math

import torch

from ckpt_tool.checkpoint import blocks
from ckpt_tool.checkpoint.blocks import cdiv
from ckpt_tool.errors import CheckpointError

FP8_BLOCK: tuple[int, int] = (blocks.FP8_BLOCK, blocks.FP8_BLOCK)
"""Block shape (rows, cols) of one FP8 weight scale."""

MXFP8_BLOCK: tuple[int, int] = (blocks.MX_BLOCK, blocks.MX_BLOCK)
"""Block shape of one MXFP8 weight scale as DeepSeek V4.1's checkpoint stores it (``weight_block_size [32, 32]``)."""

MXFP8_ROW_BLOCK: tuple[int, int] = (1, blocks.MX_BLOCK)
"""Block shape of one MXFP8 weight scale as vLLM holds it: every checkpoint scale row repeated once per weight
row (``KMxfp8Static``'s scale loader), so one scale per row and 32 inputs."""

MXFP4_GROUP = blocks.MX_BLOCK
"""Inputs of one row sharing one MXFP4 scale."""

NVFP4_GROUP = blocks.NVFP4_BLOCK
"""Inputs of one row sharing one NVFP4 E4M3 block scale."""

ACT_GROUP = blocks.ACT_GROUP
"""Per-token activation group size of the runtime FP8 activation quantization."""

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_NAN = 0xFF
E8M0_BIAS = 127
E4M3_NAN_MAGNITUDE = 0x7F  # e4m3fn's only NaN codes are 0x7F and 0xFF: exponent and mantissa all ones

# Indexed by the 4-bit code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

# float32 bit pattern of 2**-127, the value of E8M0 byte 0: a float32 subnormal, so it cannot be
# made by shifting the byte into the exponent field like the other 254 finite codes.
_F32_BITS_2_POW_M127 = 0x0040_0000
_F32_QUIET_NAN_BITS = 0x7FC0_0000

_E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


def _label(what: str | None, default: str) -> str:
    return what if what else default


def _as_e8m0_bits(t: torch.Tensor, what: str | None) -> torch.Tensor:
    """Return the raw E8M0 bytes of ``t`` as uint8, rejecting any other dtype."""
    if t.dtype not in _E8M0_DTYPES:
        raise CheckpointError(
            f"{_label(what, 'E8M0 scale')}: expected dtype float8_e8m0fnu or uint8 (raw E8M0 bytes), got {t.dtype}"
        )
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def check_e8m0(t: torch.Tensor, what: str | None = None) -> torch.Tensor:
    """Validate E8M0 scale bytes and return them as a uint8 tensor (a view, no copy).

    Raises CheckpointError if the dtype is not E8M0/uint8 or if any byte is 0xFF (NaN); the
    message names the tensor (``what``), how many NaN bytes there are and where the first one is.
    """
    bits = _as_e8m0_bits(t, what)
    if not bits.numel() or int(bits.max()) != E8M0_NAN:  # 0xFF is the largest byte: one pass when there is none
        return bits
    nan = bits == E8M0_NAN
    count = int(nan.sum())
    flat = int(torch.nonzero(nan.flatten())[0, 0])
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(bits.shape)))
    raise CheckpointError(
        f"{_label(what, 'E8M0 scale')}: {count} NaN byte(s) (0xFF) in E8M0 scale of shape "
        f"{list(bits.shape)}, first at index {list(pos)}"
    )


def e8m0_to_float32(t: torch.Tensor, what: str | None = None) -> torch.Tensor:
    """Decode E8M0 scales (``float8_e8m0fnu`` or raw ``uint8`` bytes) to exact float32 powers of two.

    Byte ``b`` in 1..254 decodes to ``2**(b - 127)`` by placing it in the float32 exponent field;
    byte 0 decodes to ``2**-127`` (a float32 subnormal, not zero). Byte 0xFF is NaN and raises
    :class:`CheckpointError` naming ``what``, the NaN count and the first position. (Decoded through a
    256-entry table built that way, :func:`_e8m0_values`.)
    """
    bits = check_e8m0(t, what)
    if bits.numel() and int(bits.min()) > 0:  # no byte 0: the exponent field alone, two vectorized passes
        return (bits.to(torch.int32) << 23).view(torch.float32)
    return _lookup(decode_table("e8m0", bits.device), bits).view(bits.shape)


def _e8m0_values() -> torch.Tensor:
    """float32 ``[256]``: the value of every E8M0 byte, built from the bits as :func:`e8m0_to_float32` says
    (0xFF: NaN)."""
    bits = torch.arange(256, dtype=torch.int32)
    f32_bits = torch.where(bits == 0, _F32_BITS_2_POW_M127, bits << 23)
    return torch.where(bits == E8M0_NAN, _F32_QUIET_NAN_BITS, f32_bits).view(torch.float32)


def _e4m3_values() -> torch.Tensor:
    """float32 ``[256]``: torch's float8_e4m3fn cast of every byte (tests hold it to :func:`e4m3_decode_bits`)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _byte_pair_values() -> torch.Tensor:
    """``[256]`` int64 holding two float32 each: the e2m1 values of a packed byte's low and high nibble, in
    that order in memory, so one lookup per byte yields both of its elements."""
    b = torch.arange(256)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.stack((values[b & 0xF], values[b >> 4]), dim=-1).contiguous().view(torch.int64).view(256)


_TABLE_BUILDERS = {"e8m0": _e8m0_values, "e4m3": _e4m3_values, "e2m1_pairs": _byte_pair_values}
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def decode_table(kind: str, device: torch.device) -> torch.Tensor:
    """A 256-entry decode table (built once per device)."""
    table = _TABLES.get((kind, device))
    if table is None:
        table = _TABLES[kind, device] = _TABLE_BUILDERS[kind]().to(device)
    return table


class DecodeScratch:
    """Reusable buffers for the lookups of :func:`fp8_block_scaled` and :func:`mxfp4_scaled`, for a caller that
    dequantizes many tiles in a row (one per thread): a tile decoded into fresh memory costs a third more on
    CPU than into buffers already in cache. What those functions return then lives in these buffers, valid
    until the next call with the same scratch."""

    def __init__(self) -> None:
        self._codes = torch.empty(0, dtype=torch.int32)
        self._values: dict[torch.dtype, torch.Tensor] = {}

    def codes(self, n: int, device: torch.device) -> torch.Tensor:
        if self._codes.numel() < n or self._codes.device != device:
            self._codes = torch.empty(n, dtype=torch.int32, device=device)
        return self._codes[:n]

    def values(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._values.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = self._values[dtype] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


def _lookup(table: torch.Tensor, codes: torch.Tensor, scratch: DecodeScratch | None = None) -> torch.Tensor:
    """``table[codes]`` flattened, for uint8 ``codes``: one gather per byte (int32 indices; torch's float8 cast
    and bit arithmetic take several times longer on CPU than this lookup)."""
    flat = codes.reshape(-1).view(torch.uint8)
    if scratch is None:
        return table.index_select(0, flat.to(torch.int32))
    idx = scratch.codes(flat.numel(), flat.device).copy_(flat)
    return torch.index_select(table, 0, idx, out=scratch.values(flat.numel(), table.dtype, table.device))


def float32_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode exact powers of two in [2**-127, 2**127] as E8M0 bytes (uint8).

    Raises ValueError for anything else: this is an encoder for quantizers and fixtures, and a
    scale that is not an exact power of two cannot be stored in E8M0 without changing the weights.
    """
    s = scale.to(torch.float64)
    mant, exp = torch.frexp(s)
    # frexp gives s = mant * 2**exp with mant in [0.5, 1); a power of two has mant == 0.5.
    ok = (mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)
    if not bool(ok.all()):
        bad = s[~ok].flatten()[0].item()
        raise ValueError(f"E8M0 can only hold powers of two in [2**-127, 2**127], got {bad!r}")
    return (exp - 1 + E8M0_BIAS).to(torch.uint8)


def e4m3_decode_bits(bits: torch.Tensor) -> torch.Tensor:
    """Decode raw e4m3fn bytes (uint8) to float32 with integer/bit operations only.

    e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (``m/8 * 2**-6``); 0x7F/0xFF are NaN; there is no infinity, so the max is 448. This does not
    use torch's float8 cast, so tests can cross-check that cast against it.
    """
    if bits.dtype != torch.uint8:
        raise ValueError(f"e4m3_decode_bits expects uint8 raw bits, got {bits.dtype}")
    b = bits.to(torch.int32)
    sign = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + (127 - 7)) << 23) | (m << 20)
    # Subnormal m * 2**-9: renormalize so the leading 1 of m becomes the implicit float32 bit.
    p = (m >= 2).to(torch.int32) + (m >= 4).to(torch.int32)  # floor(log2(m)) for m in 1..7
    sub = ((p - 9 + 127) << 23) | ((m - (1 << p)) << (23 - p))
    sub = torch.where(m == 0, 0, sub)
    mag = torch.where(e == 0, sub, normal)
    mag = torch.where((e == 0xF) & (m == 0x7), _F32_QUIET_NAN_BITS, mag)
    value = mag.view(torch.float32)
    # Negate rather than OR in bit 31 so no int32 shift overflows; -(+0.0) is -0.0 as required.
    return torch.where(sign == 1, -value, value)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit e2m1 codes (any integer dtype, values 0..15) to float32 via the value table."""
    if nibbles.dtype.is_floating_point or nibbles.dtype == torch.bool:
        raise ValueError(f"e2m1_decode expects integer codes, got {nibbles.dtype}")
    codes = nibbles.to(torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("e2m1 codes must be in 0..15")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    return table[codes]


def as_e4m3_bits(weight: torch.Tensor, what: str | None = None) -> torch.Tensor:
    """Return an FP8 weight's raw e4m3 bits as uint8 (a view); CheckpointError for other dtypes."""
    if weight.dtype == torch.float8_e4m3fn:
        return weight.view(torch.uint8)
    if weight.dtype == torch.uint8:
        return weight
    raise CheckpointError(
        f"{_label(what, 'FP8 weight')}: expected dtype float8_e4m3fn or uint8 (raw e4m3 bits), got {weight.dtype}"
    )


def check_fp8_block_shapes(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    what: str | None = None,
) -> None:
    """Raise CheckpointError unless weight is 2-D and scale is ``[ceil(N/bn), ceil(K/bk)]``."""
    name = _label(what, "FP8 weight")
    if weight.dim() != 2:
        raise CheckpointError(f"{name}: expected a 2-D [N, K] weight, got shape {list(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    want = [cdiv(n, bn), cdiv(k, bk)]
    if list(scale.shape) != want:
        raise CheckpointError(
            f"{name}: scale shape {list(scale.shape)} does not match weight shape {[n, k]} with "
            f"{bn}x{bk} blocks (expected {want})"
        )


def fp8_scale_to_float32(scale: torch.Tensor, what: str | None = None) -> torch.Tensor:
    """Return an FP8 block scale as float32: float32 passes through, E8M0 / uint8 bytes are decoded."""
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype in _E8M0_DTYPES:
        return e8m0_to_float32(scale, what)
    raise CheckpointError(
        f"{_label(what, 'FP8 scale')}: expected dtype float32, float8_e8m0fnu or uint8 (raw E8M0 "
        f"bytes), got {scale.dtype}"
    )


def fp8_block_dequant(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    *,
    what: str | None = None,
) -> torch.Tensor:
    """Dequantize an FP8 block-quantized weight to float32: ``W[i, j] = W8[i, j] * S[i//bn, j//bk]``.

    ``weight`` is ``float8_e4m3fn`` or its raw bits as ``uint8`` ``[N, K]``; ``scale`` is float32,
    ``float8_e8m0fnu`` or uint8 (always read as raw E8M0 bytes), shape ``[ceil(N/bn), ceil(K/bk)]``.
    Raises CheckpointError for wrong dtypes, shapes or NaN E8M0 bytes.
    """
    bits = as_e4m3_bits(weight, what)
    check_fp8_block_shapes(bits, scale, block, what)
    s = fp8_scale_to_float32(scale, f"{what} scale" if what else None)
    return fp8_block_scaled(bits, s, block)


def fp8_block_scaled(
    bits: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scratch: DecodeScratch | None = None
) -> torch.Tensor:
    """:func:`fp8_block_dequant` past its checks: uint8 e4m3 bits ``[N, K]`` and float32 block scales
    ``[ceil(N/bn), ceil(K/bk)]`` (already decoded). For callers that decode a weight's scales once and
    dequantize it a tile of rows at a time (into ``scratch`` when given)."""
    n, k = bits.shape
    w = _lookup(decode_table("e4m3", bits.device), bits, scratch).view(n, k)
    bn, bk = block
    if n % bn == 0 and k % bk == 0:  # whole blocks: broadcast the scales, no [N, K] scale copy
        return w.view(n // bn, bn, k // bk, bk).mul_(scale[:, None, :, None]).view(n, k)
    s_full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w.mul_(s_full)


def check_mxfp4_shapes(packed: torch.Tensor, scale: torch.Tensor, what: str | None = None) -> tuple[int, int]:
    """Validate MXFP4 dtypes/shapes; return ``(N, K)`` of the unpacked weight.

    ``packed`` must be int8/uint8 ``[N, K/2]`` and ``scale`` E8M0/uint8 ``[N, ceil(K/32)]``.
    """
    name = _label(what, "MXFP4 weight")
    if packed.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"{name}: expected packed dtype int8 or uint8, got {packed.dtype}")
    if scale.dtype not in _E8M0_DTYPES:
        raise CheckpointError(
            f"{name}: expected scale dtype float8_e8m0fnu or uint8 (raw E8M0 bytes), got {scale.dtype}"
        )
    if packed.dim() != 2:
        raise CheckpointError(f"{name}: expected a 2-D [N, K/2] packed weight, got shape {list(packed.shape)}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    want = [n, cdiv(k, MXFP4_GROUP)]
    if list(scale.shape) != want:
        raise CheckpointError(
            f"{name}: scale shape {list(scale.shape)} does not match packed shape {list(packed.shape)} "
            f"(K={k}, one scale per {MXFP4_GROUP} inputs: expected {want})"
        )
    return n, k


def mxfp4_unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Split packed MXFP4 bytes ``[N, K/2]`` into e2m1 codes ``[N, K]`` (uint8): low nibble first."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], 2 * b.shape[1])


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, *, what: str | None = None) -> torch.Tensor:
    """Dequantize MXFP4 to float32: ``W[i, j] = e2m1(nibble(i, j)) * 2**(S[i, j//32] - 127)``.

    ``packed`` is int8 or uint8 ``[N, K/2]`` (element 2k in the low nibble, 2k+1 in the high one);
    ``scale`` is ``float8_e8m0fnu`` or uint8 ``[N, ceil(K/32)]``. Raises CheckpointError for wrong
    dtypes, shapes or NaN scale bytes.
    """
    check_mxfp4_shapes(packed, scale, what)
    return mxfp4_scaled(packed, e8m0_to_float32(scale, f"{what} scale" if what else None))


def mxfp4_scaled(packed: torch.Tensor, scale: torch.Tensor, scratch: DecodeScratch | None = None) -> torch.Tensor:
    """:func:`mxfp4_dequant` past its checks: packed bytes ``[N, K/2]`` and float32 group scales
    ``[N, ceil(K/32)]`` (already decoded). For callers that decode a weight's scales once and dequantize it
    a tile of rows at a time (into ``scratch`` when given)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    # One lookup per byte gives both of its values (low nibble first): the same table as
    # e2m1_decode(mxfp4_unpack_codes(packed)), without int64 codes per element.
    values = _lookup(decode_table("e2m1_pairs", packed.device), packed, scratch).view(torch.float32)
    if k % MXFP4_GROUP == 0:
        return values.view(n, k // MXFP4_GROUP, MXFP4_GROUP).mul_(scale.unsqueeze(-1)).view(n, k)
    return values.view(n, k).mul_(scale.repeat_interleave(MXFP4_GROUP, dim=1)[:, :k])


_E4M3_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def check_e4m3_scale(t: torch.Tensor, what: str | None = None) -> torch.Tensor:
    """Validate E4M3 scale bytes (``float8_e4m3fn`` or their raw ``uint8`` bytes) and return them as uint8 (a view).

    Raises CheckpointError for another dtype, or for NaN bytes (0x7F, 0xFF), naming ``what``, how many there are and
    where the first one is: a NaN block scale poisons its 16 weights and every output they reach.
    """
    name = _label(what, "E4M3 scale")
    if t.dtype not in _E4M3_DTYPES:
        raise CheckpointError(f"{name}: expected dtype float8_e4m3fn or uint8 (raw E4M3 bytes), got {t.dtype}")
    bits = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    if not bits.numel():
        return bits
    nan = (bits & 0x7F) == E4M3_NAN_MAGNITUDE
    if not bool(nan.any()):
        return bits
    count = int(nan.sum())
    flat = int(torch.nonzero(nan.flatten())[0, 0])
    pos = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(bits.shape))]
    raise CheckpointError(
        f"{name}: {count} NaN byte(s) (0x7F/0xFF) in E4M3 scale of shape {list(bits.shape)}, first at index {pos}"
    )


def nvfp4_global_scale(global_scale: torch.Tensor, what: str | None = None) -> float:
    """An NVFP4 tensor's global scale (``weight_scale_2``: one float32, a 0-d or one-element tensor) as a float.

    Raises CheckpointError for another dtype, more than one element, or a NaN/infinite value, naming ``what``.
    """
    name = _label(what, "NVFP4 global scale")
    if not isinstance(global_scale, torch.Tensor) or global_scale.dtype != torch.float32:
        got = global_scale.dtype if isinstance(global_scale, torch.Tensor) else type(global_scale).__name__
        raise CheckpointError(f"{name}: expected a float32 scalar (weight_scale_2), got {got}")
    if global_scale.numel() != 1:
        raise CheckpointError(
            f"{name}: expected one float32 global scale (weight_scale_2), got shape {list(global_scale.shape)}"
        )
    g = float(global_scale.reshape(()))
    if not math.isfinite(g):
        raise CheckpointError(f"{name}: global scale (weight_scale_2) is {g}, not a finite number")
    return g


def check_nvfp4_shapes(packed: torch.Tensor, scale: torch.Tensor, what: str | None = None) -> tuple[int, int]:
    """Validate NVFP4 dtypes and shapes; return ``(N, K)`` of the unpacked weight.

    ``packed`` must be uint8 ``[N, K/2]`` with K a multiple of 16, and ``scale`` ``float8_e4m3fn`` (or its raw
    uint8 bytes) ``[N, K/16]``: one scale per 16 inputs exactly, as vLLM's ``ModelOptNvFp4FusedMoE.create_weights``
    sizes it (``hidden_size // group_size``) and as its ``dequantize_to_dtype`` reshapes it (vLLM 0.34.0
    ``layers/quantization/modelopt.py``, ``utils/nvfp4_emulation_utils.py``).
    """
    name = _label(what, "NVFP4 weight")
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"{name}: expected packed dtype uint8 (two e2m1 codes a byte), got {packed.dtype}")
    if scale.dtype not in _E4M3_DTYPES:
        raise CheckpointError(
            f"{name}: expected scale dtype float8_e4m3fn or uint8 (raw E4M3 bytes), got {scale.dtype}"
        )
    if packed.dim() != 2:
        raise CheckpointError(f"{name}: expected a 2-D [N, K/2] packed weight, got shape {list(packed.shape)}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    if k % NVFP4_GROUP:
        raise CheckpointError(
            f"{name}: packed shape {list(packed.shape)} holds K={k} inputs, not a multiple of the NVFP4 group "
            f"({NVFP4_GROUP})"
        )
    want = [n, k // NVFP4_GROUP]
    if list(scale.shape) != want:
        raise CheckpointError(
            f"{name}: scale shape {list(scale.shape)} does not match packed shape {list(packed.shape)} "
            f"(K={k}, one E4M3 scale per {NVFP4_GROUP} inputs: expected {want})"
        )
    return n, k


def e4m3_scale_to_float32(scale: torch.Tensor, what: str | None = None) -> torch.Tensor:
    """Decode checked E4M3 scale bytes (:func:`check_e4m3_scale`) to float32, same shape (exact: every finite
    e4m3 value is a float32)."""
    bits = check_e4m3_scale(scale, what)
    return _lookup(decode_table("e4m3", bits.device), bits).view(bits.shape)


def nvfp4_dequant(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, *, what: str | None = None
) -> torch.Tensor:
    """Dequantize NVFP4 to float32: ``W[i, j] = e2m1(code[i, j]) * float(S[i, j // 16]) * g``.

    ``packed`` is uint8 ``[N, K/2]``; ``scale`` is ``float8_e4m3fn`` (or raw uint8 bytes) ``[N, K/16]``;
    ``global_scale`` is the float32 ``weight_scale_2`` (0-d or one element), a multiplier, as ModelOpt exports it
    and vLLM reads it (``dequantize_nvfp4_moe_weights(..., invert_global_scales=False)`` for
    ``ModelOptNvFp4FusedMoE``, vLLM 0.34.0 ``layers/quantization/modelopt.py``). Each element is the exact product
    ``e2m1 * S`` (2 and 4 significant bits: exact in float32) times ``g``, rounded once.

    Nibble order: element ``2k`` of a row is the low nibble of byte ``k``, ``2k+1`` the high nibble, as for MXFP4.
    NVIDIA Model Optimizer packs ``(q[..., 1::2] << 4) | q[..., 0::2]`` and unpacks the low nibble to the even
    element (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``, ``NVFP4QTensor.quantize`` / ``dequantize``,
    which ``examples/deepseek/deepseek_v4/quantize_to_nvfp4.py`` calls); vLLM's ``break_fp4_bytes`` stacks
    ``(low, high)`` per byte and its Triton dequant interleaves ``low_nibble`` first (vLLM 0.33.0 and 0.34.0
    ``layers/quantization/utils/nvfp4_emulation_utils.py``). tests/engine/test_engine_nvfp4_dequant.py holds this
    function to that vLLM code, run from each release's wheel.

    Raises CheckpointError for wrong dtypes or shapes (a scale grid other than one per 16 inputs), NaN scale bytes
    (0x7F/0xFF) or a non-finite global scale.
    """
    check_nvfp4_shapes(packed, scale, what)
    s = e4m3_scale_to_float32(scale, f"{what} weight_scale" if what else None)
    g = nvfp4_global_scale(global_scale, f"{what} weight_scale_2" if what else None)
    return nvfp4_scaled(packed, s, g)


def nvfp4_scaled(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: float, scratch: DecodeScratch | None = None
) -> torch.Tensor:
    """:func:`nvfp4_dequant` past its checks: packed bytes ``[N, K/2]``, float32 block scales ``[N, K/16]`` (already
    decoded) and the global scale as a float. For callers that decode a weight's scales once and dequantize it a
    tile of rows at a time (into ``scratch`` when given)."""
    values = nvfp4_block_scaled(packed, scale, scratch)
    return values.mul_(global_scale) if global_scale != 1.0 else values


def nvfp4_stacked_dequant(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, *, what: str | None = None
) -> torch.Tensor:
    """Dequantize one rank's stacked NVFP4 expert parameter to float32 ``[E, R, K]``, as vLLM lays it out.

    ``packed`` uint8 ``[E, R, K/2]``, ``scale`` E4M3 ``[E, R, K/16]``, ``global_scale`` float32 ``[E, P]`` or
    ``[E]`` (P = 1): the R rows are P equal parts, part p of expert e scaled by ``global_scale[e, p]``. That is
    ``w13_weight`` (w1 rows then w3 rows) with ``w13_weight_scale_2 [E, 2]``, and ``w2_weight`` with
    ``w2_weight_scale_2 [E]`` (vLLM 0.34.0 ``layers/quantization/modelopt.py``,
    ``ModelOptNvFp4FusedMoE.create_weights``; its ``dequantize_nvfp4_moe_weights`` chunks the rows the same way).
    The whole tensor in float32: for tests and small tensors; a verify pass takes one expert's part at a time.
    """
    name = _label(what, "NVFP4 experts")
    if packed.dim() != 3 or scale.dim() != 3 or global_scale.dim() not in (1, 2):
        raise CheckpointError(
            f"{name}: expected packed [E, R, K/2], scale [E, R, K/16] and global scale [E, P] or [E], got shapes "
            f"{list(packed.shape)}, {list(scale.shape)}, {list(global_scale.shape)}"
        )
    e, r = packed.shape[0], packed.shape[1]
    parts = global_scale.shape[1] if global_scale.dim() == 2 else 1
    if global_scale.shape[0] != e or scale.shape[0] != e or parts < 1 or r % parts:
        raise CheckpointError(
            f"{name}: global scale shape {list(global_scale.shape)} does not fit packed shape {list(packed.shape)} "
            f"(one global scale per expert and part, the {r} rows split evenly into parts)"
        )
    g = global_scale.reshape(e, parts)
    rows = r // parts
    out = []
    for i in range(e):
        out.append(
            torch.cat(
                [
                    nvfp4_dequant(
                        packed[i, p * rows : (p + 1) * rows],
                        scale[i, p * rows : (p + 1) * rows],
                        g[i, p],
                        what=f"{name} expert {i} part {p}",
                    )
                    for p in range(parts)
                ]
            )
        )
    return torch.stack(out) if out else torch.empty(0, r, 2 * packed.shape[2])


def nvfp4_block_scaled(packed: torch.Tensor, scale: torch.Tensor, scratch: DecodeScratch | None = None) -> torch.Tensor:
    """``e2m1(code) * S`` without the global scale, float32 ``[N, K]``: exact (the kernels multiply by the global
    scale once per output instead of once per weight)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    # the MXFP4 pair table: the byte layout is the same (low nibble = even input)
    values = _lookup(decode_table("e2m1_pairs", packed.device), packed, scratch).view(torch.float32)
    return values.view(n, k // NVFP4_GROUP, NVFP4_GROUP).mul_(scale.unsqueeze(-1)).view(n, k)


def _exp2_f64(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 ``2**e`` for integer ``e`` in [-1022, 1023], built from the exponent bits.

    Built from bits because ``torch.ldexp`` computes ``2**e`` in the default float32 dtype, which
    underflows below 2**-149 and would make the exponent search below wrong for tiny inputs.
    """
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _pow2_ceil_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer e with ``amax <= qmax * 2**e`` (int64), computed exactly in float64."""
    a = amax.to(torch.float64)
    # frexp: a/qmax = mant * 2**exp with mant in [0.5, 1), so exp - 1 or exp is the answer; the
    # two corrections also absorb the rounding of the float64 division.
    _, exp = torch.frexp(a / qmax)
    e = exp.to(torch.int64).clamp(-1000, 1000)
    e = torch.where(a <= qmax * _exp2_f64(e - 1), e - 1, e)
    e = torch.where(a > qmax * _exp2_f64(e), e + 1, e)
    return e


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.abs()
    return padded.view(nb, bn, kb, bk).amax(dim=(1, 3))


def _check_finite_2d(w: torch.Tensor, fn: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{fn} expects a 2-D tensor, got shape {list(w.shape)}")
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{fn}: input contains NaN or infinity")
    return w


def fp8_block_quant(
    w: torch.Tensor,
    scale_dtype: str = "e8m0",
    block: tuple[int, int] = FP8_BLOCK,
    *,
    pow2: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight ``[N, K]`` to FP8 blocks: returns ``(w_fp8, scale)``.

    Each block's scale is the smallest power of two with ``amax / scale <= 448`` (or, with
    ``pow2=False`` and ``scale_dtype="float32"``, exactly ``amax / 448`` as DeepSeek's Base
    checkpoints do). ``scale_dtype="e8m0"`` returns a ``float8_e8m0fnu`` scale, ``"float32"`` a
    float32 one. With power-of-two scales, a weight whose blocks are e4m3 values times a common
    power of two round-trips exactly through :func:`fp8_block_dequant`. For tests and fixtures.
    """
    if scale_dtype not in ("e8m0", "float32"):
        raise ValueError(f"scale_dtype must be 'e8m0' or 'float32', got {scale_dtype!r}")
    if scale_dtype == "e8m0" and not pow2:
        raise ValueError("E8M0 scales are powers of two; pow2=False needs scale_dtype='float32'")
    w = _check_finite_2d(w, "fp8_block_quant")
    amax = _block_amax(w, block)
    if pow2:
        e = _pow2_ceil_exponent(amax, E4M3_MAX).clamp(-E8M0_BIAS, E8M0_BIAS)
        # An all-zero block has no meaningful scale; 1.0 keeps the encoding canonical.
        e = torch.where(amax == 0, 0, e)
        scale = _exp2_f64(e).to(torch.float32)
    else:
        scale = torch.where(amax == 0, 1.0, amax / E4M3_MAX).to(torch.float32)
    n, k = w.shape
    bn, bk = block
    s_full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    # Clamp because a non-power-of-two scale can round w / scale a hair above 448, and torch's
    # cast does not saturate (it would produce NaN).
    q = (w / s_full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if scale_dtype == "e8m0":
        return q, float32_to_e8m0(scale).view(torch.float8_e8m0fnu)
    return q, scale


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values with ``|v| <= 6`` to the nearest e2m1 code (ties to even mantissa)."""
    mag = v.abs()
    # Midpoints between neighbouring magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6]; at a tie the code with
    # mantissa bit 0 wins, so the comparison is strict where the upper neighbour is odd.
    code = (
        (mag > 0.25).to(torch.uint8)
        + (mag >= 0.75).to(torch.uint8)
        + (mag > 1.25).to(torch.uint8)
        + (mag >= 1.75).to(torch.uint8)
        + (mag > 2.5).to(torch.uint8)
        + (mag >= 3.5).to(torch.uint8)
        + (mag > 5.0).to(torch.uint8)
    )
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def mxfp4_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight ``[N, K]`` (K even) to MXFP4: returns ``(packed_uint8, scale_uint8)``.

    The scale of each 32-input group is the smallest power of two with ``amax / scale <= 6``,
    returned as raw E8M0 bytes ``[N, ceil(K/32)]``; values are rounded to the nearest e2m1 value
    (ties to even) and packed low nibble first, ``[N, K/2]``. For tests and fixtures.
    """
    w = _check_finite_2d(w, "mxfp4_quant")
    n, k = w.shape
    if k % 2:
        raise ValueError(f"mxfp4_quant needs an even K, got {k}")
    groups = cdiv(k, MXFP4_GROUP)
    padded = torch.zeros(n, groups * MXFP4_GROUP, dtype=torch.float32, device=w.device)
    padded[:, :k] = w
    amax = padded.abs().view(n, groups, MXFP4_GROUP).amax(dim=2)
    e = _pow2_ceil_exponent(amax, E2M1_MAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    e = torch.where(amax == 0, 0, e)
    scale = _exp2_f64(e).to(torch.float32)
    q = (padded.view(n, groups, MXFP4_GROUP) / scale[:, :, None]).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _e2m1_encode(q.view(n, -1)[:, :k])
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (e + E8M0_BIAS).to(torch.uint8)


def nvfp4_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a float weight ``[N, K]`` (K a multiple of 16) to NVFP4: returns ``(packed, scale, global_scale)``.

    The recipe of NVIDIA Model Optimizer's dynamic NVFP4 weight quantizer (``NVFP4QTensor.get_weights_scaling_factor``
    and ``quantize``, ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``): the float32 global scale is
    ``amax / (448 * 6)`` (1.0 for an all-zero weight, which then encodes as zeros); each 16-input block's scale is
    ``block_amax / 6 / global`` rounded to nearest E4M3 (an all-zero block gets 1.0; the rest at least ``2**-9``,
    E4M3's smallest subnormal, and at most 448); values are ``w / (scale * global)`` rounded to the nearest e2m1
    value (ties to even) and packed low nibble first. Returns uint8 ``[N, K/2]``, ``float8_e4m3fn`` ``[N, K/16]``
    and a 0-d float32. For tests and fixtures.
    """
    w = _check_finite_2d(w, "nvfp4_quant")
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"nvfp4_quant needs K a multiple of {NVFP4_GROUP}, got {k}")
    amax = w.abs().max() if w.numel() else torch.tensor(0.0)
    g = (amax / (E4M3_MAX * E2M1_MAX)).to(torch.float32)
    if not bool(g > 0):
        g = torch.tensor(1.0, dtype=torch.float32)
    grouped = w.view(n, k // NVFP4_GROUP, NVFP4_GROUP)
    block_amax = grouped.abs().amax(dim=2) if w.numel() else torch.zeros(n, 0)
    s = block_amax / (E2M1_MAX * g)
    s = torch.where(s == 0, 1.0, s).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn)
    q = (grouped / (s.to(torch.float32) * g).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).view(n, k)
    codes = _e2m1_encode(q)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), s, g.reshape(())


def fp8_act_quant(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations ``[M, K]`` per token and per ``group`` inputs to e4m3 with ue8m0 scales.

    Mirrors vLLM's runtime ``per_token_group_quant_fp8`` with ``use_ue8m0``: the scale is
    ``max(amax, 1e-10) / 448`` rounded up to a power of two, and ``x / scale`` is rounded to
    nearest e4m3. (vLLM computes the power of two with float32 ``log2``/``ceil``; this computes it
    exactly, which can only differ when ``amax / 448`` is within float rounding of a power of two.)
    Returns ``(x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)``.
    """
    if x.dim() != 2:
        raise ValueError(f"fp8_act_quant expects a 2-D [M, K] tensor, got shape {list(x.shape)}")
    x = x.to(torch.float32)
    m, k = x.shape
    groups = cdiv(k, group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x
    amax = padded.abs().view(m, groups, group).amax(dim=2).clamp_min(1e-10)
    e = _pow2_ceil_exponent(amax, E4M3_MAX)
    scale = _exp2_f64(e).to(torch.float32)
    q = (padded.view(m, groups, group) / scale[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.view(m, -1)[:, :k].to(torch.float8_e4m3fn).contiguous(), scale


def fp8_act_dequant(x_fp8: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Inverse of :func:`fp8_act_quant`: ``x[m, k] = x_fp8[m, k] * scale[m, k // group]`` in float32."""
    k = x_fp8.shape[1]
    return x_fp8.to(torch.float32) * scale.repeat_interleave(group, dim=1)[:, :k]


__all__ = [
    "ACT_GROUP",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "MXFP4_GROUP",
    "MXFP8_BLOCK",
    "MXFP8_ROW_BLOCK",
    "NVFP4_GROUP",
    "DecodeScratch",
    "as_e4m3_bits",
    "check_e4m3_scale",
    "check_e8m0",
    "check_fp8_block_shapes",
    "check_mxfp4_shapes",
    "check_nvfp4_shapes",
    "e2m1_decode",
    "e4m3_decode_bits",
    "e4m3_scale_to_float32",
    "e8m0_to_float32",
    "float32_to_e8m0",
    "fp8_act_dequant",
    "fp8_act_quant",
    "fp8_block_dequant",
    "fp8_block_quant",
    "fp8_block_scaled",
    "fp8_scale_to_float32",
    "mxfp4_dequant",
    "mxfp4_quant",
    "mxfp4_scaled",
    "mxfp4_unpack_codes",
    "nvfp4_block_scaled",
    "nvfp4_dequant",
    "nvfp4_global_scale",
    "nvfp4_quant",
    "nvfp4_scaled",
    "nvfp4_stacked_dequant",
]
