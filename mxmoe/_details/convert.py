"""In-register conversions shared by the kernels (Triton ``@jit`` helpers).

E2M1 code c = sign(bit 3) | exponent e (bits 2..1) | mantissa m (bit 0). For e >= 1 the
value is 2**(e-1) * (1 + m/2), for e = 0, m = 1 it is 0.5 = 2**-1 with no mantissa: in
both cases the exponent is ``e - 1`` with the effective mantissa ``m * (e > 0)``. So an
E2M1 value times ``2**d`` has biased exponent ``e + bias - 1 + d`` in any wider format,
which lets us build BF16 bits directly, the block scale folded in exactly. Placing ``eem``
under a wider format's low exponent bits gives the value times a fixed power of two (code 1
lands on that format's subnormal 2**-1 step), which is all the inline-asm forms do.

Each inline-asm form has a plain-Triton twin (the interpreter cannot run asm), and the GPU
test ``test_weight_conversion_matches_plain_twin`` checks they give the same bits.
"""
import triton
import triton.language as tl


@triton.jit
def unpack_nibbles(packed, BM: tl.constexpr, BK: tl.constexpr):
    """uint8 [BM, BK/2] -> int32 codes [BM, BK], low nibble = even k."""
    p = packed.to(tl.int32)
    return tl.join(p & 15, p >> 4).reshape(BM, BK)


@triton.jit
def expand_blocks(v, BM: tl.constexpr, BK: tl.constexpr):
    """Per-K32-block values [BM, BK/32] -> per element [BM, BK]."""
    return tl.broadcast_to(v[:, :, None], (BM, BK // 32, 32)).reshape(BM, BK)


@triton.jit
def e2m1_to_bf16(codes, d):
    """E2M1 codes times 2**d (int32, d <= 0) as exact BF16; underflow below BF16's normals -> 0."""
    e = (codes >> 1) & 3
    m = codes & (e > 0).to(tl.int32)
    exp = e + 126 + d
    bits = (exp << 7) | (m << 6)
    bits = tl.where(((codes & 7) != 0) & (exp > 0), bits, 0) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_to_e4m3_scaled_by_2pow_minus6(codes):
    """E2M1 codes (int32) -> E4M3 bits (uint8) of the value times 2**-6: sign to bit 7, ``eem``
    to bits 4..2 (code 1, 0.5, becomes the E4M3 subnormal 2**-7). Exact for every code."""
    return (((codes & 7) << 2) | ((codes & 8) << 4)).to(tl.uint8)


@triton.jit
def pow2(exp):
    """2.0**exp as FP32 for int32 exp in [-252, 254] (two normal factors, no exp2 approximation)."""
    lo = tl.minimum(tl.maximum(exp, -126), 127)
    hi = exp - lo  # in [-126, 127]
    f_lo = ((lo + 127) << 23).to(tl.float32, bitcast=True)
    f_hi = ((hi + 127) << 23).to(tl.float32, bitcast=True)
    return f_lo * f_hi


@triton.jit
def fp32_to_e4m3_rne(v):
    """FP32 -> E4M3 bits (uint8), round-to-nearest-even, saturating at 448.

    Bit-exact plain-Triton twin of ``.to(tl.float8e4nv)`` (cvt.rn.satfinite), used where the
    interpreter's conversion rounds wrongly.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = tl.minimum(tl.abs(v), 448.0)
    abits = a.to(tl.uint32, bitcast=True)
    # normal range (a >= 2**-6): keep 3 mantissa bits, RNE on the 20 dropped bits
    keep = abits >> 20
    rem = abits & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    normal = keep + up.to(tl.uint32) - (120 << 3)
    # subnormal range: multiples of 2**-9, RNE through the float adder
    q = (a * 512.0 + 12582912.0) - 12582912.0
    sub = q.to(tl.uint32)
    out = tl.where(a >= 0.015625, normal, sub)
    return (out | sign).to(tl.uint8)


@triton.jit
def fp32_to_bf16_rne(v):
    """FP32 -> BF16 round-to-nearest-even by integer ops (the interpreter's ``.to`` truncates)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_rounded(ptrs, v, mask, PURE: tl.constexpr):
    """Store FP32 ``v`` in the pointers' dtype, rounding to nearest even also under the interpreter."""
    if PURE and ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, fp32_to_bf16_rne(v), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


# ---- inline-asm forms for the GPU (the interpreter cannot run them; see the plain twins above) ----

# The asm texts are shared with the Gluon kernel (gemm_sm90); documented on the functions below.
E2M1X8_TO_BF16_ASM = tl.constexpr("""{
        .reg .b32 t0, t1, u, v;
        prmt.b32 t0, $4, 0, 0x4140;
        prmt.b32 t1, $4, 0, 0x4342;
        shl.b32 u, t0, 6;  and.b32 u, u, 0x01C001C0; shl.b32 v, t0, 12; and.b32 v, v, 0x80008000; or.b32 $0, u, v;
        shl.b32 u, t1, 6;  and.b32 u, u, 0x01C001C0; shl.b32 v, t1, 12; and.b32 v, v, 0x80008000; or.b32 $1, u, v;
        shl.b32 u, t0, 2;  and.b32 u, u, 0x01C001C0; shl.b32 v, t0, 8;  and.b32 v, v, 0x80008000; or.b32 $2, u, v;
        shl.b32 u, t1, 2;  and.b32 u, u, 0x01C001C0; shl.b32 v, t1, 8;  and.b32 v, v, 0x80008000; or.b32 $3, u, v;
        }""")
E2M1X8_TO_E4M3_ASM = tl.constexpr("""{
        .reg .b32 u, v;
        and.b32 u, $2, 0x07070707; shl.b32 u, u, 2; and.b32 v, $2, 0x08080808; shl.b32 v, v, 4; or.b32 $0, u, v;
        and.b32 u, $2, 0x70707070; shr.b32 u, u, 2; and.b32 v, $2, 0x80808080; or.b32 $1, u, v;
        }""")


# K-ordered forms for the Gluon converter: one 32-bit word of packed codes (bytes 0..3; byte j holds
# K = 2j in its low nibble and K = 2j + 1 in its high one) -> values in K order, no re-interleaving.
# a = low nibbles, b = high nibbles (each byte < 16, so prmt's sign-replicate selector 8 gives a zero byte).
E2M1X8_TO_BF16_KORDER_ASM = tl.constexpr("""{
        .reg .b32 a, b, t;
        and.b32 a, $4, 0x0F0F0F0F; shr.b32 b, $4, 4; and.b32 b, b, 0x0F0F0F0F;
        prmt.b32 t, a, b, 0x8480; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $0, t, $5;
        prmt.b32 t, a, b, 0x8581; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $1, t, $5;
        prmt.b32 t, a, b, 0x8682; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $2, t, $5;
        prmt.b32 t, a, b, 0x8783; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $3, t, $5;
        }""")
"""$0..$3 = BF16x2 (K 2j, K 2j+1) of the word $4, times the BF16x2 factor $5 (the same in both halves).

Per pair: prmt puts code K2j at bits 0..3 and K2j+1 at bits 16..19 (zeros elsewhere); times 0x1040
adds copies shifted by 6 (``eem`` to bits 8..6) and 12 (sign to bit 15) that cannot overlap; the mask
keeps the BF16 bits of the value times 2**-126 (as ``e2m1x8_to_bf16_scaled_by_2pow126``), and the
factor 2**(126 + d) makes it the value times 2**d."""
E2M1X8_TO_E4M3_KORDER_ASM = tl.constexpr("""{
        .reg .b32 u, v, t;
        shl.b32 t, $2, 2; and.b32 u, t, 0x1C1C1C1C; shl.b32 t, $2, 4; and.b32 t, t, 0x80808080; or.b32 u, u, t;
        shr.b32 t, $2, 2; and.b32 v, t, 0x1C1C1C1C; and.b32 t, $2, 0x80808080; or.b32 v, v, t;
        prmt.b32 $0, u, v, 0x5140; prmt.b32 $1, u, v, 0x7362;
        }""")
"""$0 = E4M3 bytes of K 0..3, $1 of K 4..7 of the word $2, times 2**-6 (as
``e2m1x8_to_e4m3_scaled_by_2pow_minus6``): u = the low nibbles (K 0, 2, 4, 6) and v = the high ones
(K 1, 3, 5, 7) with ``eem`` moved to bits 4..2 and the sign to bit 7 of each byte, then two prmt
interleave them."""

E2M1X8_TO_BF16_HALVES_ASM = tl.constexpr("""{
        .reg .b32 a, b, t;
        and.b32 a, $8, 0x0F0F0F0F; shr.b32 b, $8, 4; and.b32 b, b, 0x0F0F0F0F;
        prmt.b32 t, a, b, 0x8480; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, $9;
        mov.b32 {$0, $1}, t;
        prmt.b32 t, a, b, 0x8581; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, $9;
        mov.b32 {$2, $3}, t;
        prmt.b32 t, a, b, 0x8682; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, $9;
        mov.b32 {$4, $5}, t;
        prmt.b32 t, a, b, 0x8783; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, $9;
        mov.b32 {$6, $7}, t;
        }""")
"""``E2M1X8_TO_BF16_KORDER_ASM`` with each BF16x2 result split into its halves: $0..$7 (16-bit) = the
values of K 0..7 of the word $8, times the BF16x2 factor $9. For a register operand built from separate
BF16 values (Gluon has no 32-to-2x16-bit register bitcast); ptxas keeps each pair in one register."""


@triton.jit
def e2m1x8_to_bf16_scaled_by_2pow126(packed):
    """uint8 [.., n] (two E2M1 per byte) -> (low-nibble values, high-nibble values) as BF16 times 2**-126.

    Bit placement only: sign to bit 15, exponent/mantissa ``eem`` to bits 8..6, which is the E2M1
    value times 2**-126 (code 1 becomes the BF16 subnormal 2**-127). Two prmt spread four bytes
    into 16-bit lanes; shifts and masks place the nibbles (ptxas fuses them into LOP3).
    """
    return tl.inline_asm_elementwise(
        asm=E2M1X8_TO_BF16_ASM,
        constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def bf16_block_factor(d):
    """BF16 2**(126 + d) for int32 d <= 0 (0 where that underflows): times the 2**-126 placement gives 2**d."""
    exp = tl.maximum(253 + d, 0)
    return (exp << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1x8_to_e4m3_scaled_by_2pow_minus6(packed):
    """uint8 [.., n] -> (low-nibble, high-nibble) E4M3 bits (uint8) of the E2M1 values times 2**-6.

    Bit placement only: sign to bit 7, ``eem`` to bits 4..2 (code 1 becomes the E4M3
    subnormal 2**-7). Plain twin: ``e2m1_to_e4m3_scaled_by_2pow_minus6``.
    """
    return tl.inline_asm_elementwise(
        asm=E2M1X8_TO_E4M3_ASM,
        constraints="=r,=r,r", args=[packed], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
