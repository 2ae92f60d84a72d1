"""Hopper register-operand conversion shared by the Gluon kernels: E2M1 weight words straight into wgmma's
register operand, with the K32 block scale folded.

* W4A16: BF16 pairs with the block scale folded (``convert``'s K-ordered asm; per-block or paired factors of a
  32-bit scale word), ``_bf16_operand``; the per-row reference exponent after the K loop (``_times_row_ref``).
* W4A8: E4M3 codes with the scale folded through a byte table per block (``_e4m3_operands``), chained in the FP8
  accumulator (``_fp8_chain`` / ``_fp8_wait``); ``_times_row_fold`` after the K loop.
* The fragment layouts that let each thread read exactly its operand words of the prepared bytes
  (``prepare.interleave_block_bits``).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from .convert import (E2M1X8_TO_BF16_HALVES_ASM, E2M1X8_TO_BF16_HALVES_HI_ASM, E2M1X8_TO_BF16_HALVES_LO_ASM,
                      E2M1X8_TO_E4M3_TABLE_ASM, E4M3_TABLE_HI_BASE, E4M3_TABLE_LO_BASE, FOLD_REF_MAX)
from .sm90_pipeline import _packed_layout, _reinterpret


@gluon.jit
def _pow2(exp):
    """2.0**exp as FP32 for int32 exp in [-252, 254] (two normal factors; see ``convert.pow2``)."""
    lo = gl.minimum(gl.maximum(exp, -126), 127)
    hi = exp - lo
    return ((lo + 127) << 23).to(gl.float32, bitcast=True) * ((hi + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _block_factor(b):
    """FP32 2**(b - 122) for scale bytes b in [0, 255] (W4A8's unfolded path: the partial sum of E2M1 * 2**-5 times it
    is the block's exact contribution): the exponent field b + 5 itself, inf from b = 250 on (where 2**(b - 122) times
    the largest E2M1 overflows anyway), two integer operations."""
    return (gl.minimum(b + 5, 255) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_addends(ref):
    """Per row, the addends of the W4A8 fast path's E4M3 table words from its reference byte ``ref``, its largest scale
    byte: b * 0x08080800 + lo and b * 0x08080808 + hi are a block's table words for scale byte b (o = b + 12 - ref,
    ``convert.E2M1X8_TO_E4M3_TABLE_ASM``); uint32, wrapping products."""
    o0 = (12 - ref).to(gl.uint32, bitcast=True)
    return o0 * 0x08080800 + E4M3_TABLE_LO_BASE, o0 * 0x08080808 + E4M3_TABLE_HI_BASE


@gluon.jit
def _times_row_fold(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH: gl.constexpr, BM: gl.constexpr, ROWS: gl.constexpr):
    """W4A8 fast-path accumulators times each weight row's 2**(ref - 133) (its blocks folded into E4M3 as 2**(b + 6 -
    ref), ``_e4m3_addends``); the second half's rows start ``half_rows`` after the first's."""
    offs_r = gl.arange(0, BM, layout=ROWS)
    acc_g = acc_g * _pow2(gl.load(ref_ptr + w_row0 + offs_r) - 133)[:, None]
    if NH == 2:
        acc_u = acc_u * _pow2(gl.load(ref_ptr + w_row0 + half_rows + offs_r) - 133)[:, None]
    return acc_g, acc_u


@gluon.jit
def _fold_ref(ref_ptrs):
    """The reference exponents the W4A16 blocks are folded relative to (``convert.FOLD_REF_MAX``)."""
    return gl.minimum(gl.load(ref_ptrs), FOLD_REF_MAX)


@gluon.jit
def _fold_addend(ref):
    """Per row, the addend of the W4A16 block factors' BF16x2 bits, from the folded reference ``ref`` (``_fold_ref``):
    (FOLD_REF_MAX + b - ref) * 0x00800080 = b * 0x00800080 + this, one multiply-add per (row, block) (per two blocks
    with ``_paired_factors``)."""
    return _opaque((FOLD_REF_MAX - ref) * 0x00800080)[:, None]


@gluon.jit
def _scale_word_rows(s_ptr, w_row0, rows, K, SB: gl.constexpr = 4):
    """Each weight row's scale bytes as 32-bit words (``SCALE_WORDS``: K % 128 == 0, so a row starts 4-byte aligned);
    ``SB`` = 2: as 16-bit halves (K % 64 == 0: a row's K/32 bytes are even)."""
    UNIT: gl.constexpr = gl.int32 if SB == 4 else gl.int16
    return (s_ptr + (w_row0 + rows.to(gl.int64)) * (K // 32)).to(gl.pointer_type(UNIT), bitcast=True)


@gluon.jit
def _opaque(x):
    """``x`` (int32) through an asm move: the compiler cannot factor it, so that ``b * c + _opaque(d * c)``
    stays one multiply-add instead of becoming ``(b + d) * c``, an add and a multiply."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _times_row_ref(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH: gl.constexpr, BM: gl.constexpr, ROWS: gl.constexpr):
    """W4A16 accumulators times each weight row's 2**(r - 127) (the blocks were folded relative to r,
    ``_fold_ref``); the second half's rows start ``half_rows`` after the first's."""
    offs_r = gl.arange(0, BM, layout=ROWS)
    acc_g = acc_g * _pow2(_fold_ref(ref_ptr + w_row0 + offs_r) - 127)[:, None]
    if NH == 2:
        acc_u = acc_u * _pow2(_fold_ref(ref_ptr + w_row0 + half_rows + offs_r) - 127)[:, None]
    return acc_g, acc_u


# ---------------------------------------------------------------------------------------------------
# Small route tiles (decode, small batches): one warpgroup converts straight into wgmma's register
# operand; no warp specialization.
# ---------------------------------------------------------------------------------------------------


@gluon.constexpr_function
def _fragment_words_layout(BM, BK):
    """Layout of a stage's packed tile as 32-bit words [BM, BK/32, 4] (row, K32 block, stored word q) in
    which thread ``q = lane % 4`` holds word q of each (row, block) of rows r and r+8: the prepared layout
    puts K pairs (2q, 2q+1), (2q+8, 2q+9), (2q+16, ..), (2q+24, ..) in it, the pairs of the wgmma m64k16
    BF16 register operand of that thread (K chunks 0 and 1 of the block)."""
    regs = [[8, 0, 0]] + [[0, 1 << j, 0] for j in range((BK // 32).bit_length() - 1)]
    lanes = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[16, 0, 0], [32, 0, 0]], [], [BM, BK // 32, 4])


@gluon.constexpr_function
def _fragment_bytes_layout(BM, BK):
    """The layout of ``_fragment_words_layout`` with each word as its 4 bytes: [BM, BK/32, 4 (q), 4 (i)],
    bytes i = 0..3 of stored word q in consecutive registers of lane q (one 32-bit shared load)."""
    regs = [[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0]] + [[0, 1 << j, 0, 0] for j in range((BK // 32).bit_length() - 1)]
    lanes = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[16, 0, 0, 0], [32, 0, 0, 0]], [], [BM, BK // 32, 4, 4])


@gluon.jit
def _fragment_bytes(packed_s, BM: gl.constexpr, BK: gl.constexpr, U: gl.constexpr = 32):
    """A stage's packed [BM, BK/2] E2M1 (shared, ``_packed_layout`` of unit ``U``) as the bytes of each thread's words
    [BM, BK/32, 4, 4] (``_fragment_bytes_layout``)."""
    NB: gl.constexpr = BK // 32
    if BK // 2 <= U:
        return packed_s.reshape([BM, NB, 4, 4]).load(_fragment_bytes_layout(BM, BK))
    else:  # the prepared order (``_packed_layout``)
        return _reinterpret(packed_s, gl.uint8, [BM, NB, 4, 4], _packed_layout(BM, BK // 2, U, 64, (NB, 4, 4))).load(
            _fragment_bytes_layout(BM, BK))


@gluon.jit
def _e4m3_operands(codes, b, lo, hi, BM: gl.constexpr, BK: gl.constexpr, DOT: gl.constexpr):
    """A stage's packed bytes (``_fragment_bytes``) -> one FP8 register operand [BM, 32] of wgmma per K32 block (a tuple
    of BK/32) in the activations' slot order (``prepare.e4m3_slot_order``): stored word q gives lane q's slots 4q ..
    4q+3 and 16 + 4q .. 16 + 4q + 3, each value looked up in its block's E4M3 table (``convert.E2M1X8_TO_E4M3_TABLE_ASM``)
    of scale byte ``b`` ([BM, BK/32] int32, any layout) with the row's addends ``lo``, ``hi`` ([BM] uint32)."""
    NB: gl.constexpr = BK // 32
    BL: gl.constexpr = _fragment_bytes_layout(BM, BK)
    SB: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, BL))  # [BM, NB]
    SR: gl.constexpr = gl.SliceLayout(1, SB)  # [BM]
    zero = gl.zeros([BM, NB, 4, 4], gl.int32, BL)
    zero_u = gl.zeros([BM, NB, 4, 4], gl.uint32, BL)
    zero_b = gl.zeros([BM, NB], gl.uint32, SB)
    b4 = gl.expand_dims(gl.expand_dims(gl.convert_layout(b, SB, assert_trivial=True), 2), 3) + zero
    lo2 = gl.convert_layout(lo, SR, assert_trivial=True)[:, None] + zero_b
    hi2 = gl.convert_layout(hi, SR, assert_trivial=True)[:, None] + zero_b
    lo4 = gl.expand_dims(gl.expand_dims(lo2, 2), 3) + zero_u
    hi4 = gl.expand_dims(gl.expand_dims(hi2, 2), 3) + zero_u
    x, y = gl.inline_asm_elementwise(E2M1X8_TO_E4M3_TABLE_ASM, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r", [codes, b4, lo4, hi4],
                                     dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    # [BM, NB, q, i, c] -> [BM, NB, c, q, i]: slot 16 c + 4 q + i of block b
    w = gl.join(x, y).permute((0, 1, 4, 2, 3)).reshape([BM, NB, 32]).to(gl.float8e4nv, bitcast=True)
    if NB == 1:
        return (gl.convert_layout(w.reshape([BM, 32]), DOT, assert_trivial=True), )
    elif NB == 2:
        w0, w1 = w.permute((0, 2, 1)).split()
        return (gl.convert_layout(w0, DOT, assert_trivial=True), gl.convert_layout(w1, DOT, assert_trivial=True))
    else:
        gl.static_assert(NB == 4)
        lo_b, hi_b = w.permute((0, 2, 1)).reshape([BM, 32, 2, 2]).split()  # blocks (0, 2) and (1, 3)
        w0, w2 = lo_b.split()
        w1, w3 = hi_b.split()
        return (gl.convert_layout(w0, DOT, assert_trivial=True), gl.convert_layout(w1, DOT, assert_trivial=True),
                gl.convert_layout(w2, DOT, assert_trivial=True), gl.convert_layout(w3, DOT, assert_trivial=True))


@gluon.jit
def _fp8_chain(ops, act_s, acc, NB: gl.constexpr, use_acc=True):
    """Issue one async FP8 wgmma per K32 block of a stage (``ops``: ``_e4m3_operands``) on the stage's activation slots
    ``act_s`` [BT, BK], chained into ``acc`` (its first from zero where ``use_acc`` is False)."""
    for b in gl.static_range(NB):
        xb = act_s.slice(32 * b, 32, dim=1).permute((1, 0))
        if b == 0:
            acc = warpgroup_mma(ops[b], xb, acc, use_acc=use_acc, is_async=True)
        else:
            acc = warpgroup_mma(ops[b], xb, acc, is_async=True)
    return acc


@gluon.jit
def _fp8_wait(acc_g, acc_u, NH: gl.constexpr):
    """Wait for every wgmma in flight. (Triton 3.6 refuses 8-bit ``deps``, and an empty asm reading the FP8 operands
    after the wait changed no instruction of any kernel under 3.6 or 3.9, perf-notes step 57: what keeps an issued
    wgmma's operand registers unwritten until this wait is the schedule, which ``sm90.operand_races`` checks.)"""
    if NH == 2:
        acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
    return acc_g, acc_u


@gluon.jit
def _fragment_words(packed_s, BM: gl.constexpr, BK: gl.constexpr, WL: gl.constexpr, U: gl.constexpr = 32):
    """A stage's packed [BM, BK/2] E2M1 (shared, ``_packed_layout`` of unit ``U``) as int32 words [BM, BK/32, 4] in
    ``WL``."""
    if BK // 2 <= U:
        words: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        return _reinterpret(packed_s, gl.int32, [BM, BK // 8], words).reshape([BM, BK // 32, 4]).load(WL)
    else:
        return _reinterpret(packed_s, gl.int32, [BM, BK // 32, 4], _packed_layout(BM, BK // 8, U // 4, 64,
                                                                                    (BK // 32, 4))).load(WL)


@gluon.constexpr_function
def _pair_select(b0):
    """``prmt`` selector: bytes b0 and b0 + 1 of a word into bytes 0 and 2, zeros above each."""
    return "prmt.b32 $0, $1, 0, %d;" % (b0 | 4 << 4 | (b0 + 1) << 8 | 4 << 12)


@gluon.jit
def _paired_factors(word, first_block: gl.constexpr, fac0, NB: gl.constexpr, SC: gl.constexpr):
    """The BF16x2 block factors 2**(126 + b - r) of blocks ``first_block`` .. + NB - 1 of each row's scale word
    ``word`` ([BM], four blocks' bytes), two blocks per 32-bit word: entry j of the [BM, NB] result holds the factors of
    blocks first_block + 2 (j // 2) and first_block + 2 (j // 2) + 1 in its low and high half (``_bf16_operand`` with
    ``PAIRED``). One ``prmt``
    and one multiply-add per two blocks, against a byte extraction and a multiply-add per block (``fac0``:
    ``_fold_addend``, the same in both halves; each half's sum stays below 2**15)."""
    gl.static_assert(NB % 2 == 0)
    sb = gl.arange(0, NB, layout=gl.SliceLayout(0, SC))
    f = gl.zeros([word.shape[0], NB], gl.int32, SC)
    for p in gl.static_range(NB // 2):
        pair = gl.inline_asm_elementwise(_pair_select(first_block + 2 * p), "=r,r", [word], dtype=gl.int32,
                                         is_pure=True, pack=1)
        f = gl.where((sb // 2 == p)[None, :], pair[:, None] * 128 + fac0, f)
    return f


@gluon.jit
def _scale_word_factors(word, first_block: gl.constexpr, fac0, NB: gl.constexpr, SC: gl.constexpr):
    """W4A16's BF16x2 factors 2**(126 + b - r) of blocks ``first_block`` .. + NB - 1 of each row's scale word ``word``
    ([BM]) as ``_bf16_operand`` takes them with ``PAIRED = NB % 2 == 0``: two blocks per word where NB is even
    (``_paired_factors``), else each block's byte times 0x00800080 plus ``fac0`` (``_fold_addend``)."""
    if NB % 2 == 0:
        f = _paired_factors(word, first_block, fac0, NB, SC)
    else:
        shifts = 8 * (first_block + gl.arange(0, NB, layout=gl.SliceLayout(0, SC)))
        f = ((word[:, None] >> shifts[None, :]) & 0xFF) * 0x00800080 + fac0
    return f


@gluon.jit
def _bf16_operand(words, f, BM: gl.constexpr, BK: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr,
                  PAIRED: gl.constexpr = False):
    """Words [BM, BK/32, 4] (``_fragment_words``) -> the BF16 register operand [BM, BK] of wgmma, each K32
    block times its BF16x2 factor ``f`` ([BM, BK/32] int32 in ``SliceLayout(2, WL)``; ``PAIRED``: block j's factor in
    half j % 2 of its entry, ``_paired_factors``)."""
    NB: gl.constexpr = BK // 32
    f4 = gl.expand_dims(f, 2) + gl.zeros([BM, NB, 4], gl.int32, WL)
    # x_{2i+c} = value c of pair i of stored word q: K 8i + 2q + c of the block
    if PAIRED:  # even blocks take the factor's low half, odd blocks its high half (the block index is a register bit)
        we, wo = words.reshape([BM, NB // 2, 2, 4]).permute((0, 1, 3, 2)).split()
        fe, fo = f4.reshape([BM, NB // 2, 2, 4]).permute((0, 1, 3, 2)).split()
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_LO_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [we, fe], dtype=(gl.bfloat16, ) * 8,
            is_pure=True, pack=1)
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_HI_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wo, fo], dtype=(gl.bfloat16, ) * 8,
            is_pure=True, pack=1)
        x0 = _unsplit_blocks(e0, o0, BM, NB)
        x1 = _unsplit_blocks(e1, o1, BM, NB)
        x2 = _unsplit_blocks(e2, o2, BM, NB)
        x3 = _unsplit_blocks(e3, o3, BM, NB)
        x4 = _unsplit_blocks(e4, o4, BM, NB)
        x5 = _unsplit_blocks(e5, o5, BM, NB)
        x6 = _unsplit_blocks(e6, o6, BM, NB)
        x7 = _unsplit_blocks(e7, o7, BM, NB)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = gl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, f4], dtype=(gl.bfloat16, ) * 8,
            is_pure=True, pack=1)
    w = gl.join(gl.join(gl.join(x0, x1), gl.join(x2, x3)), gl.join(gl.join(x4, x5), gl.join(x6, x7)))
    # [BM, NB, q, c, i_lo, i_hi] -> [BM, NB, i_hi, i_lo, q, c]: K = 32 b + 16 i_hi + 8 i_lo + 2 q + c
    w = w.permute((0, 1, 5, 4, 2, 3)).reshape([BM, BK])
    return gl.convert_layout(w, DOT, assert_trivial=True)


@gluon.jit
def _unsplit_blocks(even, odd, BM: gl.constexpr, NB: gl.constexpr):
    """[BM, NB/2, 4] values of the even and odd blocks -> [BM, NB, 4] (the inverse of ``_bf16_operand``'s split)."""
    return gl.join(even, odd).permute((0, 1, 3, 2)).reshape([BM, NB, 4])


@gluon.constexpr_function
def _small_mma_layout(BT, FP8):
    """The small-tile kernel's accumulator layout: one warpgroup, BT routed rows as the MMA's N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 32 if FP8 else 16])
