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
    (two blocks' factors in one word, ``sm90_operands._paired_factors``), which ptxas takes as the multiply's .H0_H0 /
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
factors (``sm90_operands._paired_factors``)."""
# W4A8 converts each prepared word to E4M3 with one byte-permute lookup per 4 values in an 8-byte table of the block's
# magnitudes (index = ``eem`` = code & 7): table byte j = the E4M3 bits of E2M1 magnitude j times 2**(o - 6), o in [1, 12]
# (every such value is an E4M3 normal: 0.5 * 2**-5 = 2**-6 up to 6 * 2**6 = 384). Byte j is 8 o plus a constant for
# j >= 1 and 0 for j = 0, so the two table words are linear in o: o * 0x08080800 + 0x0C080000 and o * 0x08080808 +
# 0x1C181410, one multiply-add each from the block's scale byte b, o = b + 12 - ref with a per-row addend
# (``sm90_operands._e4m3_addends``; mod 2**32, the bytes come out right whatever the carries in between). Folded (the fast path,
# prepare.fold_fits): every nonzero block of the row has b >= ref - 11, so o is in range and the block scale is in the
# E4M3 value; the epilogue applies 2**(ref - 133) per row. Unfolded (rows of wider spans): b = 0 and the addend of o = 1
# (``E4M3_UNFOLDED_LO`` / ``_HI``), values E2M1 * 2**-5, and each block's partial sum is scaled by 2**(b - 122).
E4M3_TABLE_LO_BASE = tl.constexpr(0x0C080000)  # the table words' bytes at o = 0 (as integers mod 2**32)
E4M3_TABLE_HI_BASE = tl.constexpr(0x1C181410)
FOLD_SPAN = 11  # a block folds exactly when its scale byte is at most this far below its row's largest
E4M3_UNFOLDED_O = 1
E4M3_UNFOLDED_LO = tl.constexpr((E4M3_UNFOLDED_O * 0x08080800 + E4M3_TABLE_LO_BASE.value) & 0xFFFFFFFF)
E4M3_UNFOLDED_HI = tl.constexpr((E4M3_UNFOLDED_O * 0x08080808 + E4M3_TABLE_HI_BASE.value) & 0xFFFFFFFF)


@triton.jit
def e2m1_to_e4m3(codes, o):
    """The plain twin of the table lookup: E4M3 bits (uint8) of E2M1 codes (int32) times 2**(o - 6), o in [1, 12]
    (int32, broadcast): magnitude 0.5 has exponent field o, e >= 1 e + o with the mantissa bit at 2; sign to bit 7."""
    e = (codes >> 1) & 3
    m = codes & 1
    mag = tl.where(e == 0, m * (o << 3), ((e + o) << 3) | (m << 2))
    return (mag | ((codes & 8) << 4)).to(tl.uint8)


def _e4m3_table_asm(b, lo, hi):
    return """{
        .reg .b32 ta, tb, t, u, v, n, s, h, m;
        mad.lo.u32 ta, %(b)s, 0x08080800, %(lo)s; mad.lo.u32 tb, %(b)s, 0x08080808, %(hi)s;
        shr.b32 t, $2, 2; shl.b32 u, $2, 8; lop3.b32 v, u, $2, 0x03000300, 0xE4; prmt.b32 n, t, v, 0x7520;
        and.b32 s, n, 0x77777777; prmt.b32 $0, ta, tb, s; shr.b32 h, s, 16; prmt.b32 $1, ta, tb, h;
        shl.b32 m, n, 4; prmt.b32 s, n, m, 0xBFAE; prmt.b32 h, n, m, 0xC9D8;
        lop3.b32 $0, $0, s, 0x80808080, 0xF8; lop3.b32 $1, $1, h, 0x80808080, 0xF8;
        }""" % dict(b=b, lo=lo, hi=hi)


E2M1X8_TO_E4M3_TABLE_ASM = tl.constexpr(_e4m3_table_asm("$3", "$7", "$11"))
"""With ``pack=4`` (the 4 bytes of a prepared word as one register): $0 / $1 = the E4M3 bytes of the word's values
in activation slots 4q .. 4q+3 / 16 + 4q .. 16 + 4q + 3 (``prepare.e4m3_slot_order``) of the prepared word $2 (stored
word q of its block), looked up in the table of scale byte $3 with the row's addends $7 / $11 (``sm90_operands._e4m3_addends``;
$4..$6, $8..$10, $12..$14 repeat them). The word's bits are placed for BF16 (a value's sign 7 bits above its ``eem``),
so the lookup first gathers the 8 ``eem`` fields into nibbles: ``n`` = bytes 0 and 2 of the word >> 2 (values 2, 0 and
3, 1: K 8 + 2q, 2q, 9 + 2q, 1 + 2q) and bytes 1 and 3 of the word with bits 0, 1, 16, 17 moved up by 8 (values 6, 5, 7,
4: the split value pair 3 made whole), the other values' signs in each nibble's top bit; then one prmt per 4 values
into the table, and the signs (prmt in sign-replicate mode from ``n`` and ``n << 4``) merged by lop3: 15 instructions
per 8 values, the table's 2 included (docs/perf-notes.md step 31)."""
E2M1X8_TO_E4M3_TABLE_WORD_ASM = tl.constexpr(_e4m3_table_asm("$3", "$4", "$5"))
"""``E2M1X8_TO_E4M3_TABLE_ASM`` with ``pack=1`` and 32-bit operands: $0 / $1 the two registers of E4M3 bytes, $2 the
prepared word, $3 the scale byte, $4 / $5 the row's addends (the plain template's form)."""


@triton.jit
def slot_k(slots):
    """K of each W4A8 activation slot (``prepare.E4M3_VALUE_SLOT``): slot 32 b + 16 h + 4 q + i holds K = 32 b + 16 h +
    8 j + 2 q + c, j = 1 - (i & 1) (the value pair within the half), c = i >> 1 (h = 0) or (i ^ (i >> 1)) & 1 (h = 1).
    A slot's K stays in its 16-K half."""
    i = slots & 3
    c = tl.where((slots & 16) == 0, i >> 1, (i ^ (i >> 1)) & 1)
    return (slots & ~15) + 8 * (1 - (i & 1)) + 2 * ((slots >> 2) & 3) + c
