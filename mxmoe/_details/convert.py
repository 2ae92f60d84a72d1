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
def prepared_codes(words, BM: tl.constexpr, BK: tl.constexpr):
    """int32 words [BM, BK/8] of prepared weights (``prepare.interleave_block_bits``: word q of a K32 block
    holds K 8j + 2q + c, j = 0..3, c = 0, 1) -> int32 E2M1 codes [BM, BK] in K order. The plain twin of the
    inline-asm placements below: the same four masked shifts, each giving two values as (sign at bit 15,
    ``eem`` at bits 8..6) of a 16-bit lane."""
    u = words.to(tl.uint32, bitcast=True)
    r0 = u & 0x81C081C0
    r1 = (u << 4) & 0x81C081C0
    r2 = ((u << 10) | (u >> 22)) & 0x81C081C0
    r3 = ((u << 6) & 0x80C080C0) | ((u >> 2) & 0x01000100)
    regs = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [BM, BK/8, b, a]: register j = 2a + b
    lanes = tl.join(regs & 0xFFFF, regs >> 16)  # [.., c]: value c of register j
    codes = (((lanes >> 12) & 8) | ((lanes >> 6) & 7)).to(tl.int32)
    # [BM, block, q, b, a, c] -> [BM, block, a, b, q, c]: K = 32 block + 8 (2a + b) + 2q + c
    return codes.reshape(BM, BK // 32, 4, 2, 2, 2).permute(0, 1, 4, 3, 2, 5).reshape(BM, BK)


@triton.jit
def expand_blocks(v, BM: tl.constexpr, BK: tl.constexpr):
    """Per-K32-block values [BM, BK/32] -> per element [BM, BK]."""
    return tl.broadcast_to(v[:, :, None], (BM, BK // 32, 32)).reshape(BM, BK)


# W4A16 folds each K32 block's 2**(b - r) into the BF16 weights, r = min(ref, FOLD_REF_MAX) per weight row
# (``ref`` its largest scale byte), as the BF16 exponent field FOLD_REF_MAX + b - r of a factor 2**(126 + b - r)
# (253 = 126 for the placement's 2**-126, + 127 the bias): in [0, 254] for every scale byte b <= ref, so no
# clamp, and the factor's BF16x2 bits (the field times 0x00800080) are one multiply-add of b with a per-row
# constant. The epilogue multiplies each row by 2**(r - 127).
FOLD_REF_MAX = tl.constexpr(253)


@triton.jit
def fold_ref(ref):
    """The reference exponent the W4A16 kernels fold a row's blocks relative to (``FOLD_REF_MAX``)."""
    return tl.minimum(ref, FOLD_REF_MAX)


@triton.jit
def e2m1_to_bf16(codes, d):
    """E2M1 codes times 2**d (int32, d <= 1) as exact BF16; underflow below BF16's normals -> 0."""
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

# One 32-bit word of prepared weights (``prepare.interleave_block_bits``) holds the 8 values K 8j + 2q + c
# (j = 0..3, c = 0, 1) of stored word q of a K32 block, their bits placed so that the BF16 bits of value pair j
# (sign at bit 15 + 16c, ``eem`` at bits 8..6 + 16c: the value times 2**-126, as ``e2m1_to_bf16``'s
# subnormal trick) come out of one masked shift each: j = 0 as stored, j = 1 shifted left by 4, j = 2 rotated
# left by 10, j = 3 from two shifts (left 6, right 2). Three to four instructions per two values, then one
# BF16 multiply by the block factor; no nibble split, no byte permute (docs/perf-notes.md step 15).
E2M1X8_TO_BF16_KORDER_ASM = tl.constexpr("""{
        .reg .b32 t, u;
        and.b32 t, $4, 0x81C081C0; mul.rn.bf16x2 $0, t, $5;
        shl.b32 t, $4, 4; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $1, t, $5;
        shf.l.wrap.b32 t, $4, $4, 10; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 $2, t, $5;
        shl.b32 t, $4, 6; and.b32 t, t, 0x80C080C0; shr.b32 u, $4, 2; and.b32 u, u, 0x01000100; or.b32 t, t, u;
        mul.rn.bf16x2 $3, t, $5;
        }""")
"""$0..$3 = BF16x2 (K 8j + 2q, K 8j + 2q + 1), j = 0..3, of the prepared word $4 (stored word q of its block),
times the BF16x2 factor $5 (the same in both halves): 2**(126 + d) makes the placed value times 2**d."""


def _bf16_halves_asm(factor_half=None):
    """The asm of ``E2M1X8_TO_BF16_HALVES_ASM``; ``factor_half`` 0 or 1: the factor is that half of $9 in both halves
    (two blocks' factors in one word, ``gemm_sm90._paired_factors``), which ptxas takes as the multiply's .H0_H0 /
    .H1_H1 operand: no instruction more."""
    pre, factor = "", "$9"
    if factor_half is not None:
        half = ("fl", "fh")[factor_half]
        pre = f".reg .b16 fl, fh; .reg .b32 f; mov.b32 {{fl, fh}}, $9; mov.b32 f, {{{half}, {half}}};"
        factor = "f"
    return """{
        .reg .b32 t, u; %(pre)s
        and.b32 t, $8, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$0, $1}, t;
        shl.b32 t, $8, 4; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$2, $3}, t;
        shf.l.wrap.b32 t, $8, $8, 10; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$4, $5}, t;
        shl.b32 t, $8, 6; and.b32 t, t, 0x80C080C0; shr.b32 u, $8, 2; and.b32 u, u, 0x01000100; or.b32 t, t, u;
        mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$6, $7}, t;
        }""" % dict(pre=pre, f=factor)


E2M1X8_TO_BF16_HALVES_ASM = tl.constexpr(_bf16_halves_asm())
"""``E2M1X8_TO_BF16_KORDER_ASM`` with each BF16x2 result split into its halves: $0..$7 (16-bit) = the values
K 8j + 2q + c (output 2j + c) of the word $8, times the BF16x2 factor $9. For a register operand built from
separate BF16 values (Gluon has no 32-to-2x16-bit register bitcast); ptxas keeps each pair in one register."""
E2M1X8_TO_BF16_HALVES_LO_ASM = tl.constexpr(_bf16_halves_asm(0))
E2M1X8_TO_BF16_HALVES_HI_ASM = tl.constexpr(_bf16_halves_asm(1))
"""``E2M1X8_TO_BF16_HALVES_ASM`` times the low (LO) or high (HI) half of $9 instead of $9 itself: $9 holds two blocks'
factors (``gemm_sm90._paired_factors``)."""
E2M1X8_TO_E4M3_SLOTS_ASM = tl.constexpr("""{
        .reg .b32 t, u;
        and.b32 t, $2, 0x801C801C; shl.b32 u, $2, 4; and.b32 u, u, 0x1C001C00; or.b32 t, t, u;
        shr.b32 u, $2, 4; and.b32 u, u, 0x00800080; or.b32 $0, t, u;
        shf.l.wrap.b32 t, $2, $2, 6; and.b32 t, t, 0x801C801C; shl.b32 u, $2, 2; and.b32 u, u, 0x10801080;
        or.b32 t, t, u; shl.b32 u, $2, 10; and.b32 u, u, 0x0C000C00; or.b32 $1, t, u;
        }""")
"""$0 = E4M3 bytes of K 8 + 2q, 2q, 9 + 2q, 1 + 2q and $1 of K 16 + 2q, 24 + 2q, 17 + 2q, 25 + 2q of the
prepared word $2 (stored word q), times 2**-6 (as ``e2m1_to_e4m3_scaled_by_2pow_minus6``: sign to bit 7,
``eem`` to bits 4..2 of each byte): activation slots 4q .. 4q+3 and 16 + 4q .. 16 + 4q + 3 of
``prepare.e4m3_slot_order``. A value's sign and ``eem`` sit 7 bits apart in the word (placed for BF16) but 3
in E4M3, so each register is three masked shifts of the word; the slot order is the one that needs no more."""
