"""Hand-computed checks of the pure-torch quantization reference (ckpt_tool.verify.quant)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_tool.errors import CheckpointError
from ckpt_tool.verify import quant, tiled_matmul


def _assert_equal_blocks(actual: torch.Tensor, expected: torch.Tensor, block: tuple[int, int], what: str) -> None:
    """Exact comparison (NaN == NaN, sign of zero ignored); on failure name the worst block."""
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    a, e = actual.double(), expected.double()
    diff = (a - e).abs()
    diff = torch.where(torch.isnan(a) & torch.isnan(e), 0.0, diff)
    diff = torch.where(torch.isnan(diff), math.inf, diff)
    if bool((diff > 0).any()):
        idx = int(torch.argmax(diff))
        i, j = divmod(idx, actual.shape[1])
        nbad = int((diff > 0).sum())
        raise AssertionError(
            f"{what}: {nbad}/{diff.numel()} elements differ; max abs err {diff.flatten()[idx].item():.6g} in "
            f"(row-block {i // block[0]}, col-block {j // block[1]}) of {block[0]}x{block[1]} blocks at element "
            f"({i}, {j}): got {a[i, j].item()!r}, expected {e[i, j].item()!r}"
        )


# ---------------------------------------------------------------- e2m1


def test_e2m1_every_code() -> None:
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = quant.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.dtype == torch.float32
    assert got.tolist() == expected
    # Code 8 is negative zero, not plain zero.
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_e2m1_rejects_out_of_range_codes() -> None:
    with pytest.raises(ValueError):
        quant.e2m1_decode(torch.tensor([16]))


# ---------------------------------------------------------------- E8M0


def test_e8m0_bytes_1_to_254_are_powers_of_two() -> None:
    b = torch.arange(1, 255, dtype=torch.uint8)
    got = quant.e8m0_to_float32(b)
    assert got.dtype == torch.float32
    for byte, value in zip(b.tolist(), got.tolist()):
        assert value == math.ldexp(1.0, byte - 127), byte


def test_e8m0_byte_0_is_2_pow_minus_127_not_zero() -> None:
    got = quant.e8m0_to_float32(torch.tensor([0], dtype=torch.uint8))
    assert got.item() == math.ldexp(1.0, -127)
    assert got.item() != 0.0
    assert got.view(torch.int32).item() == 0x0040_0000  # the float32 subnormal 2**-127


def test_e8m0_accepts_float8_e8m0fnu_and_agrees_with_torch_cast() -> None:
    b = torch.arange(0, 255, dtype=torch.uint8)
    as_e8m0 = b.view(torch.float8_e8m0fnu)
    assert torch.equal(quant.e8m0_to_float32(as_e8m0), quant.e8m0_to_float32(b))
    assert torch.equal(quant.e8m0_to_float32(as_e8m0), as_e8m0.to(torch.float32))


def test_e8m0_nan_rejected_with_count_position_and_name() -> None:
    s = torch.full((3, 4), 127, dtype=torch.uint8)
    s[1, 2] = 0xFF
    s[2, 0] = 0xFF
    with pytest.raises(CheckpointError) as exc:
        quant.e8m0_to_float32(s, what="model.layers.3.ffn.w1.scale")
    msg = str(exc.value)
    assert "model.layers.3.ffn.w1.scale" in msg
    assert "2 NaN" in msg
    assert "[1, 2]" in msg
    with pytest.raises(CheckpointError, match="NaN"):
        quant.e8m0_to_float32(s.view(torch.float8_e8m0fnu))


def test_e8m0_rejects_other_dtypes() -> None:
    with pytest.raises(CheckpointError, match="float8_e8m0fnu or uint8"):
        quant.e8m0_to_float32(torch.ones(2, dtype=torch.float32))


def test_float32_to_e8m0_round_trip_and_rejects_non_powers() -> None:
    b = torch.arange(0, 255, dtype=torch.uint8)
    assert torch.equal(quant.float32_to_e8m0(quant.e8m0_to_float32(b)), b)
    with pytest.raises(ValueError):
        quant.float32_to_e8m0(torch.tensor([3.0]))


# ---------------------------------------------------------------- e4m3


@pytest.mark.parametrize(
    ("byte", "value"),
    [
        (0x00, 0.0),
        (0x01, 2.0**-9),  # smallest subnormal: 1/8 * 2**-6
        (0x02, 2.0**-8),
        (0x03, 3 * 2.0**-9),
        (0x07, 7 * 2.0**-9),  # largest subnormal
        (0x08, 2.0**-6),  # smallest normal
        (0x30, 0.5),
        (0x38, 1.0),
        (0x39, 1.125),
        (0x40, 2.0),
        (0x7E, 448.0),  # max: 1.75 * 2**8
        (0x81, -(2.0**-9)),
        (0xB8, -1.0),
        (0xFE, -448.0),
    ],
)
def test_e4m3_decode_hand_values(byte: int, value: float) -> None:
    got = quant.e4m3_decode_bits(torch.tensor([byte], dtype=torch.uint8)).item()
    assert got == value


def test_e4m3_decode_nan_and_negative_zero() -> None:
    got = quant.e4m3_decode_bits(torch.tensor([0x7F, 0xFF, 0x80], dtype=torch.uint8))
    assert math.isnan(got[0].item()) and math.isnan(got[1].item())
    assert got[2].item() == 0.0 and torch.signbit(got[2])


def test_e4m3_decode_matches_torch_cast_on_all_256_codes() -> None:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = quant.e4m3_decode_bits(b)
    theirs = b.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    finite = ~torch.isnan(ours)
    # Compare bit patterns so the sign of zero counts too.
    assert torch.equal(ours[finite].view(torch.int32), theirs[finite].view(torch.int32))


# ---------------------------------------------------------------- FP8 block dequant


def test_fp8_block_dequant_tiny_hand_example_block_boundaries() -> None:
    # Weight [3, 5] in 2x3 blocks -> scale [2, 2]; every weight is 1.0 (0x38) or 2.0 (0x40), so
    # each output is the scale of its block (times 2), which shows where the boundaries fall.
    bits = torch.tensor(
        [
            [0x38, 0x38, 0x38, 0x38, 0x38],
            [0x38, 0x38, 0x40, 0x40, 0x38],
            [0x38, 0xB8, 0x38, 0x38, 0x38],
        ],
        dtype=torch.uint8,
    )
    scale = torch.tensor([[0.5, 4.0], [8.0, 0.25]], dtype=torch.float32)
    expected = torch.tensor(
        [
            [0.5, 0.5, 0.5, 4.0, 4.0],
            [0.5, 0.5, 1.0, 8.0, 4.0],
            [8.0, -8.0, 8.0, 0.25, 0.25],
        ]
    )
    got = quant.fp8_block_dequant(bits, scale, block=(2, 3))
    _assert_equal_blocks(got, expected, (2, 3), "uint8 bits, float32 scale")
    got = quant.fp8_block_dequant(bits.view(torch.float8_e4m3fn), scale, block=(2, 3))
    _assert_equal_blocks(got, expected, (2, 3), "float8_e4m3fn, float32 scale")
    # Same scales as E8M0 bytes: 0.5 = 2**-1 -> 126, 4 -> 129, 8 -> 130, 0.25 -> 125.
    e8 = torch.tensor([[126, 129], [130, 125]], dtype=torch.uint8)
    _assert_equal_blocks(quant.fp8_block_dequant(bits, e8, block=(2, 3)), expected, (2, 3), "uint8 e8m0 scale")
    _assert_equal_blocks(
        quant.fp8_block_dequant(bits, e8.view(torch.float8_e8m0fnu), block=(2, 3)),
        expected,
        (2, 3),
        "float8_e8m0fnu scale",
    )


def test_fp8_block_dequant_128_boundaries() -> None:
    # [130, 129] -> scale [2, 2]; rows 127/128 and columns 127/128 straddle the block edges.
    bits = torch.full((130, 129), 0x38, dtype=torch.uint8)  # all 1.0
    bits[129, 128] = 0x7E  # 448 in the last, partial block
    scale = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8) + 126  # 2**0, 2**1, 2**2, 2**3
    w = quant.fp8_block_dequant(bits, scale)
    assert w.shape == (130, 129)
    assert w[127, 127].item() == 1.0
    assert w[127, 128].item() == 2.0
    assert w[128, 127].item() == 4.0
    assert w[128, 128].item() == 8.0
    assert w[129, 128].item() == 448.0 * 8.0
    assert w[0, 0].item() == 1.0


def test_mxfp8_checkpoint_blocks_and_vllm_row_expanded_scales_dequantize_alike() -> None:
    """A V4.1 MXFP8 weight read with its checkpoint's 32x32 scales and with vLLM's layout (every scale row repeated
    once per weight row, 1x32 blocks) is the same weight; a 32-row block boundary shows in the 32x32 reading."""
    gen = torch.Generator().manual_seed(41)
    bits = torch.randint(0, 126, (96, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(120, 134, (3, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    blocks = quant.fp8_block_dequant(bits, scale, quant.MXFP8_BLOCK)
    rows = quant.fp8_block_dequant(bits, scale.repeat_interleave(32, dim=0), quant.MXFP8_ROW_BLOCK)
    _assert_equal_blocks(rows, blocks, quant.MXFP8_BLOCK, "1x32 row scales vs 32x32 blocks")
    ones = torch.full((64, 64), 0x38, dtype=torch.uint8)  # all 1.0: each element is its block's scale
    s = torch.tensor([[127, 128], [129, 130]], dtype=torch.uint8)  # 1, 2, 4, 8
    w = quant.fp8_block_dequant(ones, s, quant.MXFP8_BLOCK)
    assert (w[31, 31].item(), w[31, 32].item(), w[32, 31].item(), w[32, 32].item()) == (1.0, 2.0, 4.0, 8.0)
    with pytest.raises(CheckpointError, match=r"1x32 blocks \(expected \[64, 2\]\)"):
        quant.fp8_block_dequant(ones, s, quant.MXFP8_ROW_BLOCK)  # a scale not yet expanded


def test_fp8_block_dequant_shape_and_dtype_errors() -> None:
    bits = torch.zeros(256, 300, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"expected \[2, 3\]"):
        quant.fp8_block_dequant(bits, torch.ones(2, 2), what="w")
    with pytest.raises(CheckpointError, match="float8_e4m3fn or uint8"):
        quant.fp8_block_dequant(bits.to(torch.float32), torch.ones(2, 3))
    with pytest.raises(CheckpointError, match="float32, float8_e8m0fnu or uint8"):
        quant.fp8_block_dequant(bits, torch.ones(2, 3, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match="2-D"):
        quant.fp8_block_dequant(bits[0], torch.ones(2, 3))
    bad = torch.full((2, 3), 127, dtype=torch.uint8)
    bad[1, 1] = 0xFF
    with pytest.raises(CheckpointError, match=r"layers\.1\.w scale.*1 NaN.*\[1, 1\]"):
        quant.fp8_block_dequant(bits, bad, what="layers.1.w")


# ---------------------------------------------------------------- MXFP4 dequant


def test_mxfp4_dequant_hand_example_nibble_order_and_groups() -> None:
    # One row, K = 64 (32 bytes, 2 scale groups). Byte 0x21: element 0 = code 1 (0.5, low nibble),
    # element 1 = code 2 (1.0, high nibble). Byte 0xF8: element 2 = code 8 (-0), element 3 = code 15 (-6).
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0] = 0x21
    packed[0, 1] = 0xF8
    packed[0, 15] = 0x70  # elements 30, 31: 0, 6 (end of group 0)
    packed[0, 16] = 0x07  # elements 32, 33: 6, 0 (start of group 1)
    scale = torch.tensor([[127, 129]], dtype=torch.uint8)  # 1 and 4
    w = quant.mxfp4_dequant(packed, scale)
    expected = torch.zeros(1, 64)
    expected[0, :4] = torch.tensor([0.5, 1.0, -0.0, -6.0])
    expected[0, 31] = 6.0
    expected[0, 32] = 24.0
    _assert_equal_blocks(w, expected, (1, 32), "mxfp4")
    assert torch.signbit(w[0, 2])
    # int8 storage (source files) holds the same bytes.
    _assert_equal_blocks(quant.mxfp4_dequant(packed.view(torch.int8), scale), expected, (1, 32), "int8 packed")
    _assert_equal_blocks(
        quant.mxfp4_dequant(packed, scale.view(torch.float8_e8m0fnu)), expected, (1, 32), "e8m0fnu scale"
    )


def test_mxfp4_dequant_errors() -> None:
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"expected \[4, 2\]"):
        quant.mxfp4_dequant(packed, torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match="int8 or uint8"):
        quant.mxfp4_dequant(packed.to(torch.int32), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match="float8_e8m0fnu or uint8"):
        quant.mxfp4_dequant(packed, torch.zeros(4, 2, dtype=torch.float32))
    bad = torch.full((4, 2), 127, dtype=torch.uint8)
    bad[3, 1] = 0xFF
    with pytest.raises(CheckpointError, match=r"experts\.7\.w2 scale.*\[3, 1\]"):
        quant.mxfp4_dequant(packed, bad, what="experts.7.w2")


# ---------------------------------------------------------------- NVFP4 dequant

FINITE_E4M3_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
"""The 254 non-NaN e4m3fn bytes (0x7F and 0xFF are NaN)."""


def test_nvfp4_dequant_hand_example_nibble_order_groups_and_global_scale() -> None:
    # One row, K = 32 (16 bytes, 2 groups of 16). Byte 0x21: element 0 = code 1 (0.5, low nibble), element 1 =
    # code 2 (1.0, high nibble); byte 0xF8: element 2 = code 8 (-0), element 3 = code 15 (-6). Group 0's E4M3
    # scale 0x3C = 1.5, group 1's 0x40 = 2.0; global scale 0.25.
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21
    packed[0, 1] = 0xF8
    packed[0, 7] = 0x70  # elements 14, 15: 0, 6 (end of group 0)
    packed[0, 8] = 0x07  # elements 16, 17: 6, 0 (start of group 1)
    scale = torch.tensor([[0x3C, 0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = quant.nvfp4_dequant(packed, scale, torch.tensor(0.25))
    expected = torch.zeros(1, 32)
    expected[0, :4] = torch.tensor([0.5 * 1.5 * 0.25, 1.0 * 1.5 * 0.25, -0.0, -6.0 * 1.5 * 0.25])
    expected[0, 15] = 6.0 * 1.5 * 0.25
    expected[0, 16] = 6.0 * 2.0 * 0.25
    _assert_equal_blocks(w, expected, (1, 16), "nvfp4")
    assert torch.signbit(w[0, 2])
    # raw E4M3 bytes as uint8 and a one-element global scale read the same
    _assert_equal_blocks(
        quant.nvfp4_dequant(packed, scale.view(torch.uint8), torch.tensor([0.25])), expected, (1, 16), "uint8 scale"
    )


def test_nvfp4_dequant_every_code_and_every_finite_scale_byte_is_the_definition() -> None:
    """Row i holds all 256 bytes (every code in both nibbles) under E4M3 scale byte FINITE_E4M3_BYTES[i]; each
    element must be e2m1(code) * e4m3(byte) * g rounded once to float32, with e4m3 decoded by the integer decoder
    (not torch's cast) and the product taken in float64 (exact: 2 + 4 + 24 significant bits)."""
    g = torch.tensor(0.0123, dtype=torch.float32)  # not a power of two: the rounding is tested too
    rows = FINITE_E4M3_BYTES.numel()
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(rows, 256).contiguous()
    scale = FINITE_E4M3_BYTES[:, None].expand(rows, 512 // 16).contiguous()
    got = quant.nvfp4_dequant(packed, scale, g)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(rows, 512)
    e2m1 = torch.tensor(quant.E2M1_VALUES, dtype=torch.float64)[codes.long()]
    s = quant.e4m3_decode_bits(FINITE_E4M3_BYTES).double()[:, None]
    want = (e2m1 * s * g.double()).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max()


def test_nvfp4_dequant_errors_name_the_tensor() -> None:
    packed = torch.zeros(4, 16, dtype=torch.uint8)  # K = 32: two groups
    ok_scale = torch.full((4, 2), 0x38, dtype=torch.uint8)
    g = torch.tensor(1.0)
    with pytest.raises(CheckpointError, match=r"experts\.3\.w1: scale shape \[4, 1\].*one E4M3 scale per 16.*\[4, 2\]"):
        quant.nvfp4_dequant(packed, torch.zeros(4, 1, dtype=torch.uint8), g, what="experts.3.w1")  # an MXFP4 grid
    with pytest.raises(CheckpointError, match="K=24 inputs, not a multiple"):
        quant.nvfp4_dequant(torch.zeros(4, 12, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), g)
    with pytest.raises(CheckpointError, match="packed dtype uint8"):
        quant.nvfp4_dequant(packed.view(torch.int8), ok_scale, g)
    with pytest.raises(CheckpointError, match="float8_e4m3fn or uint8"):
        quant.nvfp4_dequant(packed, ok_scale.float(), g)
    for nan_byte in (0x7F, 0xFF):
        bad = ok_scale.clone()
        bad[2, 1] = nan_byte
        with pytest.raises(CheckpointError, match=r"experts\.3\.w1 weight_scale: 1 NaN byte.*first at index \[2, 1\]"):
            quant.nvfp4_dequant(packed, bad.view(torch.float8_e4m3fn), g, what="experts.3.w1")
    for bad_g in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(CheckpointError, match=r"experts\.3\.w1 weight_scale_2: .*not a finite number"):
            quant.nvfp4_dequant(packed, ok_scale, torch.tensor(bad_g), what="experts.3.w1")
    with pytest.raises(CheckpointError, match="float32 scalar"):
        quant.nvfp4_dequant(packed, ok_scale, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(CheckpointError, match=r"got shape \[2\]"):
        quant.nvfp4_dequant(packed, ok_scale, torch.ones(2))


def test_nvfp4_stacked_dequant_scales_each_expert_part_by_its_own_global_scale() -> None:
    """vLLM's per-rank layout: w13 [E, 2I, H/2] with w13_weight_scale_2 [E, 2] (w1 rows, then w3 rows), w2 with
    w2_weight_scale_2 [E]."""
    gen = torch.Generator().manual_seed(3)
    E, I2, H = 3, 8, 32
    packed = torch.randint(0, 256, (E, I2, H // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = FINITE_E4M3_BYTES[torch.randint(0, 254, (E, I2, H // 16), generator=gen)]
    g13 = torch.tensor([[1.0, 2.0], [0.5, 0.125], [3.0, 7.0]])
    got = quant.nvfp4_stacked_dequant(packed, scale, g13)
    for e in range(E):
        for p, rows in enumerate((slice(0, I2 // 2), slice(I2 // 2, I2))):
            want = quant.nvfp4_dequant(packed[e, rows], scale[e, rows], g13[e, p])
            assert torch.equal(got[e, rows], want), (e, p)
    g2 = torch.tensor([1.0, 0.25, 4.0])
    got2 = quant.nvfp4_stacked_dequant(packed, scale, g2)
    for e in range(E):
        assert torch.equal(got2[e], quant.nvfp4_dequant(packed[e], scale[e], g2[e]))
    with pytest.raises(CheckpointError, match="does not fit packed shape"):
        quant.nvfp4_stacked_dequant(packed, scale, torch.ones(E, 3))  # 8 rows do not split into 3 parts
    with pytest.raises(CheckpointError, match="does not fit packed shape"):
        quant.nvfp4_stacked_dequant(packed, scale, torch.ones(E + 1, 2))


# ---------------------------------------------------------------- quantizers


def _representable_fp8_weight(gen: torch.Generator, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """Random e4m3 values (no NaN) times one random power of two per block."""
    bits = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    bits = torch.where((bits & 0x7F) == 0x7F, 0x38, bits)
    e = torch.randint(-20, 20, (-(-n // block[0]), -(-k // block[1])), generator=gen)
    s = torch.pow(2.0, e.double()).float()
    return quant.fp8_block_dequant(bits, s, block)


@pytest.mark.parametrize("scale_dtype", ["e8m0", "float32"])
@pytest.mark.parametrize(("n", "k"), [(128, 128), (256, 384), (130, 200)])
def test_fp8_block_quant_round_trip_exact(scale_dtype: str, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = _representable_fp8_weight(gen, n, k, quant.FP8_BLOCK)
    q, s = quant.fp8_block_quant(w, scale_dtype)
    assert q.dtype == torch.float8_e4m3fn
    assert s.dtype == (torch.float8_e8m0fnu if scale_dtype == "e8m0" else torch.float32)
    assert list(s.shape) == [-(-n // 128), -(-k // 128)]
    _assert_equal_blocks(quant.fp8_block_dequant(q, s), w, quant.FP8_BLOCK, f"round trip {scale_dtype}")


def test_fp8_block_quant_scale_is_smallest_power_of_two_that_fits() -> None:
    w = torch.zeros(128, 256)
    w[0, 0] = 448.0  # exactly fits scale 1
    w[0, 128] = 449.0  # needs scale 2
    q, s = quant.fp8_block_quant(w, "float32")
    assert s.tolist() == [[1.0, 2.0]]
    assert q.to(torch.float32)[0, 0].item() == 448.0
    # Non-power-of-two float32 scales (DeepSeek Base style) are amax / 448.
    _, s = quant.fp8_block_quant(w, "float32", pow2=False)
    assert torch.equal(s, torch.tensor([[1.0, 449.0 / 448.0]], dtype=torch.float32))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(quant.E2M1_VALUES), min_size=64, max_size=64),
    st.integers(min_value=-100, max_value=100),
)
def test_mxfp4_quant_round_trip_exact(values: list[float], exponent: int) -> None:
    w = torch.tensor(values, dtype=torch.float32).view(1, 64) * 2.0**exponent
    packed, scale = quant.mxfp4_quant(w)
    assert packed.dtype == torch.uint8 and list(packed.shape) == [1, 32]
    assert scale.dtype == torch.uint8 and list(scale.shape) == [1, 2]
    _assert_equal_blocks(quant.mxfp4_dequant(packed, scale), w, (1, 32), "mxfp4 round trip")


def test_mxfp4_quant_rounds_to_nearest_ties_to_even() -> None:
    # Group amax 6 -> scale 1. 0.25 -> 0 (tie, even), 0.75 -> 1 (tie, even), 2.5 -> 2, 5 -> 4, 5.1 -> 6.
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0, 5.1])
    w[0, 6] = -1.75
    packed, scale = quant.mxfp4_quant(w)
    assert scale.tolist() == [[127]]
    got = quant.mxfp4_dequant(packed, scale)[0, :7].tolist()
    assert got == [6.0, 0.0, 1.0, 2.0, 4.0, 6.0, -2.0]


def test_nvfp4_quant_follows_the_model_optimizer_recipe() -> None:
    # Row 0 block 0 holds the tensor's amax 6 * 2**5 = 192: global = 192 / (448 * 6) and that block's E4M3 scale
    # is 448 (byte 0x7E); its values are e2m1 values times 2**5 and come back as the same codes. Block 1 is all
    # zeros: scale 1.0 (0x38), codes 0. Row 1 block 0's amax 3 gives scale e4m3(3 / 6 / global) = e4m3(7) = 7.
    w = torch.zeros(2, 32)
    w[0, :16] = torch.tensor([6.0, -6.0, 0.5, -0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -4.0, 0.0, -1.0, -1.5, -2.0, -3.0, 6.0])
    w[0, :16] *= 32.0
    w[1, 0] = 3.0
    packed, scale, g = quant.nvfp4_quant(w)
    assert packed.dtype == torch.uint8 and list(packed.shape) == [2, 16]
    assert scale.dtype == torch.float8_e4m3fn and list(scale.shape) == [2, 2]
    assert g.dtype == torch.float32 and g.dim() == 0
    assert g.item() == torch.tensor(192.0 / 2688.0, dtype=torch.float32).item()
    assert scale.view(torch.uint8).tolist() == [[0x7E, 0x38], [0x4E, 0x38]]  # 448, 1, 7 (e=9, m=6 -> 1.75 * 4), 1
    want_codes = [7, 15, 1, 9, 2, 3, 4, 5, 6, 14, 0, 10, 11, 12, 13, 7]
    assert quant.mxfp4_unpack_codes(packed)[0, :16].tolist() == want_codes
    back = quant.nvfp4_dequant(packed, scale, g)
    torch.testing.assert_close(back, w, rtol=2.0**-22, atol=0.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=-60, max_value=60))
def test_nvfp4_quant_error_is_at_most_one_e2m1_step_of_the_block(seed: int, exponent: int) -> None:
    """Each element comes back within the largest e2m1 rounding step, 1.0 (between 4 and 6) times its block's
    scale * global: rounding to the nearest value and the clamp to 6 (an E4M3 scale rounded down by at most 2**-4)
    both stay inside it."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 64, generator=gen) * torch.exp2(torch.randint(-8, 8, (4, 1), generator=gen).float())
    w = w * 2.0**exponent
    packed, scale, g = quant.nvfp4_quant(w)
    back = quant.nvfp4_dequant(packed, scale, g)
    step = (scale.to(torch.float32).double() * g.double()).repeat_interleave(16, dim=1)
    assert bool(((back.double() - w.double()).abs() <= step * (1 + 1e-6)).all())


def test_nvfp4_quant_refuses_a_k_off_the_group() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.nvfp4_quant(torch.ones(2, 24))


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_fp8_act_quant_scales_are_minimal_powers_of_two(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 200, generator=gen) * torch.exp2(torch.randint(-30, 30, (3, 1), generator=gen).float())
    q, s = quant.fp8_act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and list(s.shape) == [3, 2]
    amax = torch.stack([x[:, :128].abs().amax(1), x[:, 128:].abs().amax(1)], dim=1).double()
    mant, _ = torch.frexp(s.double())
    assert bool((mant == 0.5).all()), "scales must be powers of two"
    assert bool((amax <= 448.0 * s.double()).all()), "scaled group must fit in e4m3"
    assert bool((amax > 448.0 * s.double() / 2).all()), "scale must be the smallest that fits"
    # Rounding to e4m3 (3 mantissa bits) is within half an ulp: 2**-4 relative for normals, and
    # 2**-10 (half the subnormal step 2**-9) in scaled units for subnormals.
    err = (quant.fp8_act_dequant(q, s) - x).abs()
    s_full = s.repeat_interleave(128, dim=1)[:, :200]
    assert bool((err <= torch.maximum(x.abs() * 2.0**-4, s_full * 2.0**-10)).all())


# ---------------------------------------------------------------- lookup tables and tiled matmuls


def test_fp8_block_dequant_decodes_every_e4m3_code_like_the_bit_decoder() -> None:
    """The lookup table the dequantizer gathers from agrees with the integer decoder on all 256 codes (sign of
    zero and NaN included), whole-block and ragged shapes alike."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = quant.e4m3_decode_bits(codes)
    for rows, cols in ((2, 128), (1, 256), (256, 1)):
        got = quant.fp8_block_dequant(codes.view(rows, cols), torch.ones(-(-rows // 128), -(-cols // 128))).flatten()
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32)), (rows, cols)


def test_decode_scratch_reuse_gives_the_same_tiles() -> None:
    """Dequantizing into a reused scratch gives what fresh memory gives, tile after tile of different sizes."""
    gen = torch.Generator().manual_seed(5)
    scratch = quant.DecodeScratch()
    for n in (64, 3, 32):
        packed = torch.randint(0, 256, (n, 48), generator=gen, dtype=torch.int32).to(torch.uint8)
        scale = torch.randint(100, 150, (n, 3), generator=gen, dtype=torch.int32).to(torch.uint8)
        s = quant.e8m0_to_float32(scale)
        assert torch.equal(quant.mxfp4_scaled(packed, s, scratch), quant.mxfp4_dequant(packed, scale))
        bits = torch.randint(0, 126, (n, 200), generator=gen, dtype=torch.int32).to(torch.uint8)
        fs = torch.rand(-(-n // 128), 2, generator=gen)
        assert torch.equal(
            quant.fp8_block_scaled(bits, fs, quant.FP8_BLOCK, scratch), quant.fp8_block_dequant(bits, fs)
        )


@pytest.mark.parametrize("m", [1, 4, 20])  # 20: past the row count where the product is taken transposed
@pytest.mark.parametrize(("n", "k"), [(300, 256), (130, 200), (7, 64)])
def test_tiled_matmuls_equal_dequantize_then_multiply(monkeypatch: pytest.MonkeyPatch, m: int, n: int, k: int) -> None:
    """fp8_block_matmul (128x128, 32x32 and 1x32 blocks) / mxfp4_matmul / nvfp4_matmul / bf16_matmul, many tiles each (a
    4096-element tile), equal x @ W.T with W dequantized whole, up to float32 summation order."""
    monkeypatch.setattr(tiled_matmul, "MATMUL_TILE_ELEMENTS", 4096)
    gen = torch.Generator().manual_seed(n * k + m)
    x = torch.randn(m, k, generator=gen)
    bits = torch.randint(0, 126, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    for scale in (
        torch.randint(118, 136, (-(-n // 128), -(-k // 128)), generator=gen, dtype=torch.int32).to(torch.uint8),
        torch.rand(-(-n // 128), -(-k // 128), generator=gen) + 0.01,
    ):
        want = x @ quant.fp8_block_dequant(bits, scale).T
        torch.testing.assert_close(
            tiled_matmul.fp8_block_matmul(x, bits, scale), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
        )
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    mscale = torch.randint(118, 136, (n, -(-k // 32)), generator=gen, dtype=torch.int32).to(torch.uint8)
    want = x @ quant.mxfp4_dequant(packed, mscale).T
    torch.testing.assert_close(
        tiled_matmul.mxfp4_matmul(x, packed, mscale), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
    )
    for block in (quant.MXFP8_BLOCK, quant.MXFP8_ROW_BLOCK):
        bn = block[0]
        mx = torch.randint(118, 136, (-(-n // bn), -(-k // 32)), generator=gen, dtype=torch.int32).to(torch.uint8)
        want = x @ quant.fp8_block_dequant(bits, mx, block).T
        torch.testing.assert_close(
            tiled_matmul.fp8_block_matmul(x, bits, mx, block), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
        )
    if k % quant.NVFP4_GROUP == 0:
        nscale = torch.randint(0x20, 0x50, (n, k // 16), generator=gen, dtype=torch.int32).to(torch.uint8)
        g = torch.tensor(0.0173)
        want = x @ quant.nvfp4_dequant(packed, nscale, g).T
        torch.testing.assert_close(
            tiled_matmul.nvfp4_matmul(x, packed, nscale, g), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
        )
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    want = x @ w.float().T
    torch.testing.assert_close(tiled_matmul.bf16_matmul(x, w), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_tiled_matmuls_reject_what_the_dequantizers_reject() -> None:
    x = torch.randn(2, 128)
    nan = torch.full((1, 1), 0xFF, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"layers\.0\.w scale.*NaN"):
        tiled_matmul.fp8_block_matmul(x, torch.zeros(128, 128, dtype=torch.uint8), nan, what="layers.0.w")
    with pytest.raises(CheckpointError, match=r"experts\.1\.w1 scale.*NaN"):
        tiled_matmul.mxfp4_matmul(
            x, torch.zeros(1, 64, dtype=torch.uint8), torch.full((1, 4), 0xFF, dtype=torch.uint8), what="experts.1.w1"
        )
    with pytest.raises(CheckpointError, match="does not match"):
        tiled_matmul.mxfp4_matmul(x, torch.zeros(1, 64, dtype=torch.uint8), torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match=r"experts\.1\.w2 weight_scale: 1 NaN"):
        tiled_matmul.nvfp4_matmul(
            x,
            torch.zeros(1, 64, dtype=torch.uint8),
            torch.tensor([[0x38] * 7 + [0x7F]], dtype=torch.uint8),
            torch.tensor(1.0),
            what="experts.1.w2",
        )
