"""Triton kernel sources for the quantized GEMMs. Imports triton: load only via ``_backend.get_kernel``.

The functions here are deliberately left undecorated; ``_backend.get_kernel`` applies
``triton.jit`` on first use so the compiled/interpreted choice follows ``TRITON_INTERPRET`` at call
time (see ``_backend``'s docstring).

All quantized operands arrive as uint8 bytes and are decoded with integer and bit operations:
the interpreter cannot load float8 pointers and convert them (it fails on the cast), and the same
code then runs unchanged when compiled. Decoding is inlined rather than put in helper functions
because a helper would itself have to be decorated once per mode and looked up by name.

Use only ``@builtin`` parts of ``triton.language`` here (``tl.full``, ``tl.where``, ``tl.dot``,
``tl.trans``, ...), not its ``@jit`` helpers (``tl.zeros``, ``tl.cdiv``, ``tl.sum``, ``tl.max``,
``tl.interleave``, ...): those were decorated when triton.language was imported, so if that
happened before ``TRITON_INTERPRET=1`` was set they are compiled-mode functions that the
interpreter refuses to call ("Cannot call @triton.jit'd outside of the scope of a kernel").
Sticking to builtins keeps these kernels interpretable whatever the import order.

Bit recipes (``b`` is an int32 holding the byte):

* e4m3fn: sign ``b>>7``, exponent ``(b>>3)&15`` (bias 7), mantissa ``b&7``. Normal values are the
  float32 bits ``(e + 120) << 23 | m << 20``; e == 0 is subnormal ``m * 2**-9``; e == 15, m == 7
  is NaN.
* e2m1: sign ``n>>3``, exponent ``(n>>1)&3`` (bias 1), mantissa ``n&1``. Normal values are the
  float32 bits ``(e + 126) << 23 | m << 22``; e == 0 is ``m * 0.5``.
* E4M3 block scales (NVFP4) are decoded with the e4m3fn recipe; their NaN bytes (0x7F, 0xFF) are rejected on the
  host before launch.
* E8M0: ``b << 23`` as float32 bits is ``2**(b-127)`` for b in 1..254; b == 0 is ``2**-127``,
  the float32 subnormal ``0x00400000``. 0xFF (NaN) is rejected on the host before launch.
"""

from __future__ import annotations

import triton.language as tl


def fp8_block_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_xsk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ym,
    stride_yn,
    ACT_FP8: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
):
    """y[M, N] = x[M, K] @ (w[N, K] * scale).T, one [BLOCK_M, BLOCK_N] tile per program.

    BLOCK_K equals the K size of a weight scale block (and of an activation scale group), so each
    K step multiplies its partial product by exactly one weight scale per output column and, for
    fp8 activations, one activation scale per row. SCALE_BLOCK_N is the block's rows: 128 (DeepSeek V4),
    32 (a V4.1 checkpoint's MXFP8) or 1 (MXFP8 as vLLM holds it, one scale row a weight row).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    ws_row = rn // SCALE_BLOCK_N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        x_raw = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0,
        )
        if ACT_FP8:
            xb = x_raw.to(tl.int32)
            x_e = (xb >> 3) & 15
            x_m = xb & 7
            x_bits = ((x_e + 120) << 23) | (x_m << 20)
            x_bits = tl.where((x_e == 15) & (x_m == 7), 0x7FC00000, x_bits)
            xv = x_bits.to(tl.float32, bitcast=True)
            xv = tl.where(x_e == 0, x_m.to(tl.float32) * 0.001953125, xv)
            xv = tl.where(((xb >> 7) & 1) == 1, -xv, xv)
        else:
            xv = x_raw.to(tl.float32)

        wb = tl.load(
            w_ptr + rn[:, None] * stride_wn + k[None, :] * stride_wk,
            mask=n_ok[:, None] & k_ok[None, :],
            other=0,
        ).to(tl.int32)
        w_e = (wb >> 3) & 15
        w_m = wb & 7
        w_bits = ((w_e + 120) << 23) | (w_m << 20)
        w_bits = tl.where((w_e == 15) & (w_m == 7), 0x7FC00000, w_bits)
        wv = w_bits.to(tl.float32, bitcast=True)
        wv = tl.where(w_e == 0, w_m.to(tl.float32) * 0.001953125, wv)
        wv = tl.where(((wb >> 7) & 1) == 1, -wv, wv)

        # Both operands are exact in bf16, so the bf16 dot (fp32 accumulate) loses nothing.
        if DOT_BF16:
            part = tl.dot(xv.to(tl.bfloat16), tl.trans(wv.to(tl.bfloat16)))
        else:
            part = tl.dot(xv, tl.trans(wv), input_precision="ieee")

        ws_raw = tl.load(ws_ptr + ws_row * stride_wsn + kb * stride_wsk, mask=n_ok, other=0)
        if SCALE_E8M0:
            sb = ws_raw.to(tl.int32)
            ws = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
        else:
            ws = ws_raw.to(tl.float32)
        if ACT_FP8:
            xs = tl.load(xs_ptr + rm * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)
            part = part * xs[:, None]
        acc += part * ws[None, :]

    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
        acc,
        mask=m_ok[:, None] & n_ok[None, :],
    )


def mxfp4_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    KH,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ym,
    stride_yn,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
):
    """y[M, N] = x[M, 2*KH] @ W.T for MXFP4 W given as packed bytes [N, KH] and E8M0 scales.

    Rather than interleave the two nibbles of each byte back into K order, the kernel splits x
    into its even and odd columns: the low nibbles multiply x[:, 0::2] and the high nibbles
    x[:, 1::2], two dots per K step with no reshape. One scale covers GROUP_BYTES packed bytes.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rkh = tl.arange(0, BLOCK_KH)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in range(0, (KH + BLOCK_KH - 1) // BLOCK_KH):
        kh = kt * BLOCK_KH + rkh
        kh_ok = kh < KH
        w_mask = n_ok[:, None] & kh_ok[None, :]
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + kh[None, :] * stride_wk, mask=w_mask, other=0).to(tl.int32)
        sb = tl.load(
            ws_ptr + rn[:, None] * stride_wsn + (kh // GROUP_BYTES)[None, :] * stride_wsk,
            mask=w_mask,
            other=127,
        ).to(tl.int32)
        scale = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)

        lo = wb & 15
        lo_e = (lo >> 1) & 3
        lo_m = lo & 1
        w_lo = (((lo_e + 126) << 23) | (lo_m << 22)).to(tl.float32, bitcast=True)
        w_lo = tl.where(lo_e == 0, lo_m.to(tl.float32) * 0.5, w_lo)
        w_lo = tl.where((lo >> 3) == 1, -w_lo, w_lo) * scale

        hi = (wb >> 4) & 15
        hi_e = (hi >> 1) & 3
        hi_m = hi & 1
        w_hi = (((hi_e + 126) << 23) | (hi_m << 22)).to(tl.float32, bitcast=True)
        w_hi = tl.where(hi_e == 0, hi_m.to(tl.float32) * 0.5, w_hi)
        w_hi = tl.where((hi >> 3) == 1, -w_hi, w_hi) * scale

        x_mask = m_ok[:, None] & kh_ok[None, :]
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * kh)[None, :] * stride_xk, mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * kh + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)

        # e2m1 value times a power of two is exact in bf16 (bar exponents below 2**-133).
        if DOT_BF16:
            acc += tl.dot(x_even.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)))
            acc += tl.dot(x_odd.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)))
        else:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_hi), input_precision="ieee")

    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
        acc,
        mask=m_ok[:, None] & n_ok[None, :],
    )


def nvfp4_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    global_scale,
    M,
    N,
    KH,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ym,
    stride_yn,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
):
    """y[M, N] = x[M, 2*KH] @ W.T for NVFP4 W: packed bytes [N, KH], E4M3 block scales (raw bytes, one per
    GROUP_BYTES packed bytes = 16 inputs) and one float32 global scale.

    The MXFP4 kernel's even/odd split (low nibbles times x[:, 0::2], high nibbles times x[:, 1::2]); the block
    scale is an e4m3 byte decoded with the bit recipe above, and the global scale multiplies the accumulated sum
    once at the end: e2m1 x e4m3 has at most 6 significant bits, exact in bf16 (and in the float32 dot), while a
    float32 global scale is not, so folding it into the weights would round every one of them.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rkh = tl.arange(0, BLOCK_KH)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in range(0, (KH + BLOCK_KH - 1) // BLOCK_KH):
        kh = kt * BLOCK_KH + rkh
        kh_ok = kh < KH
        w_mask = n_ok[:, None] & kh_ok[None, :]
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + kh[None, :] * stride_wk, mask=w_mask, other=0).to(tl.int32)
        sb = tl.load(
            ws_ptr + rn[:, None] * stride_wsn + (kh // GROUP_BYTES)[None, :] * stride_wsk,
            mask=w_mask,
            other=0x38,
        ).to(tl.int32)
        s_e = (sb >> 3) & 15
        s_m = sb & 7
        scale = (((s_e + 120) << 23) | (s_m << 20)).to(tl.float32, bitcast=True)
        scale = tl.where(s_e == 0, s_m.to(tl.float32) * 0.001953125, scale)
        scale = tl.where(((sb >> 7) & 1) == 1, -scale, scale)

        lo = wb & 15
        lo_e = (lo >> 1) & 3
        lo_m = lo & 1
        w_lo = (((lo_e + 126) << 23) | (lo_m << 22)).to(tl.float32, bitcast=True)
        w_lo = tl.where(lo_e == 0, lo_m.to(tl.float32) * 0.5, w_lo)
        w_lo = tl.where((lo >> 3) == 1, -w_lo, w_lo) * scale

        hi = (wb >> 4) & 15
        hi_e = (hi >> 1) & 3
        hi_m = hi & 1
        w_hi = (((hi_e + 126) << 23) | (hi_m << 22)).to(tl.float32, bitcast=True)
        w_hi = tl.where(hi_e == 0, hi_m.to(tl.float32) * 0.5, w_hi)
        w_hi = tl.where((hi >> 3) == 1, -w_hi, w_hi) * scale

        x_mask = m_ok[:, None] & kh_ok[None, :]
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * kh)[None, :] * stride_xk, mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * kh + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)

        if DOT_BF16:
            acc += tl.dot(x_even.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)))
            acc += tl.dot(x_odd.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)))
        else:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_hi), input_precision="ieee")

    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
        acc * global_scale,
        mask=m_ok[:, None] & n_ok[None, :],
    )
