"""The inline-asm E2M1 conversions, run on the CPU by a small emulator of the PTX they use.

The interpreter cannot run inline asm and the GPU is scarce, so the asm texts of
``mxmoe._details.convert`` are parsed and executed here instruction by instruction (and, or,
shl, shr, shf.l.wrap, prmt with sign replication, lop3, mul.lo, mad.lo, mul.rn.bf16x2, 16-bit moves) on words covering every
byte value and compared with the exact E2M1 values. On the GPU, the kernels that use them are compared with
the plain-Triton twins (tests/test_gpu_moe.py).
"""
import re

import numpy as np
import pytest
import torch

from mxmoe._details import convert
from mxmoe.format import E2M1_VALUES

MASK = 0xFFFFFFFF


def _bf16_to_f32(h: int) -> float:
    return float(np.array([h << 16], dtype=np.uint32).view(np.float32)[0])


def _f32_to_bf16_rne(x: float) -> int:
    bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _prmt(a: int, b: int, c: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (c >> (4 * i)) & 0xF
        byte = src[n & 7]
        if n & 8:  # sign-replicate mode: the selected byte's msb in all 8 bits
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_asm(text: str, args: list) -> list:
    """Execute ``text`` with ``$k`` operands: outputs first (returned), then ``args`` (32-bit words)."""
    body = text.strip().strip("{}")
    regs = {}
    n_args = len(args)
    n_out = max(int(k) for k in re.findall(r"\$(\d+)", body)) + 1 - n_args
    for k, v in enumerate(args):
        regs[f"${n_out + k}"] = v & MASK

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & MASK

    for ins in filter(None, (s.strip() for s in body.split(";"))):
        if ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # split a 32-bit value into two 16-bit registers
            pair, src_reg = rest.split("}")
            lo_reg, hi_reg = (t.strip() for t in pair.strip("{").split(","))
            v = val(src_reg.strip(" ,"))
            regs[lo_reg], regs[hi_reg] = v & 0xFFFF, v >> 16
            continue
        if op == "mov.b32" and "{" in rest:  # pack two 16-bit registers into a 32-bit one
            d, pair = rest.split(",", 1)
            lo_reg, hi_reg = (t.strip() for t in pair.strip().strip("{}").split(","))
            regs[d.strip()] = regs[lo_reg] | (regs[hi_reg] << 16)
            continue
        ops = [t.strip() for t in rest.split(",")]
        d, src = ops[0], [val(t) for t in ops[1:]]
        if op == "and.b32":
            r = src[0] & src[1]
        elif op == "or.b32":
            r = src[0] | src[1]
        elif op == "shl.b32":
            r = (src[0] << src[1]) & MASK
        elif op == "shr.b32":
            r = src[0] >> src[1]
        elif op == "shf.l.wrap.b32":  # funnel shift left of (src[1]:src[0]) by src[2] mod 32, upper word
            r = ((((src[1] << 32) | src[0]) << (src[2] & 31)) >> 32) & MASK
        elif op == "prmt.b32":
            r = _prmt(*src)
        elif op == "lop3.b32":  # any function of three words, bit by bit: lut bit (a << 2 | b << 1 | c)
            a, b, c, lut = src
            r = 0
            for i in range(32):
                r |= ((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i
        elif op == "mul.lo.u32":
            r = (src[0] * src[1]) & MASK
        elif op == "mad.lo.u32":
            r = (src[0] * src[1] + src[2]) & MASK
        elif op == "mul.rn.bf16x2":
            r = 0
            for half in range(2):
                x = _bf16_to_f32((src[0] >> (16 * half)) & 0xFFFF) * _bf16_to_f32((src[1] >> (16 * half)) & 0xFFFF)
                r |= _f32_to_bf16_rne(x) << (16 * half)
        else:
            raise NotImplementedError(op)
        regs[d] = r
    return [regs[f"${k}"] for k in range(n_out)]


def _words():
    """Packed words with every byte value (so every code pair) in every byte position, and random ones."""
    rng = np.random.default_rng(0)
    return [v * 0x01010101 for v in range(256)] + [int(x) for x in rng.integers(0, 2**32, 64, dtype=np.uint64)]


# bits (m, e0, e1, s) of the 8 values of a prepared word, value 2j + c = K 8j + 2q + c of its block
# (``prepare.interleave_block_bits``), written out independently of the conversion code
_VALUE_BITS = ((6, 7, 8, 15), (22, 23, 24, 31), (2, 3, 4, 11), (18, 19, 20, 27),
               (28, 29, 30, 5), (12, 13, 14, 21), (0, 1, 10, 9), (16, 17, 26, 25))


def _codes(word: int) -> list:
    """The 8 E2M1 codes of a prepared word, value 2j + c (K 8j + 2q + c of the block) first to last."""
    return [sum(((word >> b) & 1) << i for i, b in enumerate(bits)) for bits in _VALUE_BITS]


def test_value_bit_table_is_the_prepared_layout():
    from mxmoe.prepare import interleave_block_bits

    rng = np.random.default_rng(7)
    for _ in range(20):
        block = torch.tensor(rng.integers(0, 256, 16), dtype=torch.uint8)
        k_codes = [(block[k // 2].item() >> (4 * (k % 2))) & 15 for k in range(32)]
        words = interleave_block_bits(block[None])[0].numpy().view("<u4")
        for q in range(4):
            assert _codes(int(words[q])) == [k_codes[8 * j + 2 * q + c] for j in range(4) for c in range(2)]


def _e4m3_byte(value: float) -> int:
    return int(torch.tensor([value]).to(torch.float8_e4m3fn).view(torch.uint8)[0])


# the activation slot of each value 2j + c of a stored word q (K 8j + 2q + c), as 4q + this (+ 16 from j = 2):
# ``convert.E2M1X8_TO_E4M3_TABLE_ASM``'s byte order, written out independently of it
_E4M3_SLOT = (1, 3, 0, 2, 19, 17, 16, 18)


def _table_args(b: int, ref: int) -> list:
    lo = ((12 - ref) * 0x08080800 + convert.E4M3_TABLE_LO_BASE.value) & MASK
    hi = ((12 - ref) * 0x08080808 + convert.E4M3_TABLE_HI_BASE.value) & MASK
    return [b] * 4 + [lo] * 4 + [hi]  # ($12 .. $14, the rest of the hi repeats, are not read)


def _e4m3_table_bytes(word: int, table: list) -> list:
    """The 8 output bytes of the table asm by activation slot offset (4q + i, then 16 + 4q + i: here i, then 4 + i)."""
    lo, hi = run_asm(convert.E2M1X8_TO_E4M3_TABLE_ASM.value, [word] + table)
    return [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]


@pytest.mark.parametrize("ref", [0, 11, 127, 200, 254])
def test_e4m3_table_asm_folds_every_scale_of_the_window_exactly(ref):
    """Folded: for every scale byte b from ref - 11 to ref the table gives E2M1 * 2**(b + 6 - ref) exactly, each value
    in its slot, signs (negative zero too) kept."""
    rng = np.random.default_rng(ref)
    words = _words()
    for b in range(max(ref - convert.FOLD_SPAN, 0), ref + 1):
        for word in (words if b in (ref, ref - 11) else [words[i] for i in rng.integers(0, len(words), 24)]):
            got = _e4m3_table_bytes(word, _table_args(b, ref))
            want = [None] * 8
            for v, c in enumerate(_codes(word)):
                byte = _e4m3_byte(float(E2M1_VALUES[c]) * 2.0**(b + 6 - ref)) | ((c >> 3) << 7)
                want[_E4M3_SLOT[v] % 4 + 4 * (_E4M3_SLOT[v] >= 16)] = byte
            assert got == want, (hex(word), b, ref)


def test_e4m3_table_asm_unfolded_gives_e2m1_times_2_pow_minus_5():
    """The rows that do not fold: scale byte 0 with the constant addends of o = 1, E2M1 * 2**-5 (every value normal)."""
    table = [0] * 4 + [convert.E4M3_UNFOLDED_LO.value] * 4 + [convert.E4M3_UNFOLDED_HI.value]
    for word in _words():
        want = [None] * 8
        for v, c in enumerate(_codes(word)):
            want[_E4M3_SLOT[v] % 4 + 4 * (_E4M3_SLOT[v] >= 16)] = _e4m3_byte(float(E2M1_VALUES[c]) * 2.0**-5) | ((c >> 3) << 7)
        assert _e4m3_table_bytes(word, table) == want, hex(word)


@pytest.mark.parametrize("d", [0, -1, -7, -30, -100])
def test_bf16_korder_gives_exact_scaled_values_in_value_order(d):
    f = (253 + d) << 7  # the converter's factor: BF16 2**(126 + d)
    for word in _words():
        outs = run_asm(convert.E2M1X8_TO_BF16_KORDER_ASM.value, [word, f | (f << 16)])
        got = [_bf16_to_f32((o >> (16 * half)) & 0xFFFF) for o in outs for half in range(2)]
        want = [float(E2M1_VALUES[c]) * 2.0**d for c in _codes(word)]
        assert got == want, (hex(word), d)
        # negative zero stays negative (the sign is placed even for code 8)
        signs = [(o >> (16 * half + 15)) & 1 for o in outs for half in range(2)]
        assert signs == [c >> 3 for c in _codes(word)]


def test_bf16_halves_asm_is_the_korder_asm_split_in_halves():
    rng = np.random.default_rng(3)
    for _ in range(200):
        word = int(rng.integers(0, 2**32))
        f = max(253 + int(rng.integers(-40, 1)), 0) << 7
        pairs = run_asm(convert.E2M1X8_TO_BF16_KORDER_ASM.value, [word, f | (f << 16)])
        halves = run_asm(convert.E2M1X8_TO_BF16_HALVES_ASM.value, [word, f | (f << 16)])
        assert halves == [p >> (16 * h) & 0xFFFF for p in pairs for h in range(2)]


def test_bf16_halves_lo_hi_take_one_half_of_a_paired_factor():
    """The paired-factor forms (two blocks' factors in one word, ``sm90_operands._paired_factors``): LO multiplies by the
    low half, HI by the high half, exactly as the plain form with that factor in both halves."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        word = int(rng.integers(0, 2**32))
        f_lo, f_hi = (max(253 + int(rng.integers(-40, 2)), 0) << 7 for _ in range(2))
        paired = f_lo | (f_hi << 16)
        assert run_asm(convert.E2M1X8_TO_BF16_HALVES_LO_ASM.value, [word, paired]) == run_asm(
            convert.E2M1X8_TO_BF16_HALVES_ASM.value, [word, f_lo | (f_lo << 16)])
        assert run_asm(convert.E2M1X8_TO_BF16_HALVES_HI_ASM.value, [word, paired]) == run_asm(
            convert.E2M1X8_TO_BF16_HALVES_ASM.value, [word, f_hi | (f_hi << 16)])


@pytest.mark.parametrize("first_block", [0, 2])
def test_paired_factor_words_hold_each_blocks_factor(first_block):
    """``sm90_operands._paired_factors``: prmt(word) * 128 + the row's addend gives, in its low / high half, the BF16
    bits of block first_block / first_block + 1's factor (the per-block form: byte * 0x00800080 + addend), for every
    scale byte b <= ref (the range ``FOLD_REF_MAX`` keeps the field in, so no half carries into the other)."""
    from mxmoe._details.sm90_operands import _pair_select

    rng = np.random.default_rng(6)
    fold_max = convert.FOLD_REF_MAX.value
    for _ in range(300):
        ref = int(rng.integers(0, 255))
        b = [int(v) for v in rng.integers(0, ref + 1, 4)]
        word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
        addend = (fold_max - min(ref, fold_max)) * 0x00800080
        (pair, ) = run_asm(_pair_select(first_block), [word])
        f = (pair * 128 + addend) & MASK
        for half in range(2):
            per_block = (b[first_block + half] * 0x00800080 + addend) & 0xFFFF
            assert (f >> (16 * half)) & 0xFFFF == per_block, (ref, b, half)


def test_e4m3_table_word_asm_is_the_packed_form():
    """The plain template's pack=1 form reads its scale byte and addends from $3 .. $5, the Gluon form from $3, $7, $11."""
    rng = np.random.default_rng(8)
    for _ in range(200):
        word, b, lo, hi = (int(v) for v in rng.integers(0, 2**32, 4, dtype=np.uint64))
        assert run_asm(convert.E2M1X8_TO_E4M3_TABLE_WORD_ASM.value, [word, b, lo, hi]) == run_asm(
            convert.E2M1X8_TO_E4M3_TABLE_ASM.value, [word] + [b] * 4 + [lo] * 4 + [hi])


def test_fp8_stored_words_give_the_activation_slot_order():
    """The W4A8 converter's claim for prepared words: stored word q gives the E4M3 values of activation slots
    4q .. 4q+3 and 16 + 4q .. 16 + 4q + 3 of ``prepare.e4m3_slot_order``."""
    from mxmoe.prepare import e4m3_slot_order, interleave_block_bits

    rng = np.random.default_rng(4)
    table = [0] * 4 + [convert.E4M3_UNFOLDED_LO.value] * 4 + [convert.E4M3_UNFOLDED_HI.value]
    for _ in range(50):
        block = torch.tensor(rng.integers(0, 256, 16), dtype=torch.uint8)
        codes = [(block[k // 2].item() >> (4 * (k % 2))) & 15 for k in range(32)]
        k_order = [_e4m3_byte(float(E2M1_VALUES[c]) * 2.0**-5) | ((c >> 3) << 7) for c in codes]
        slots = e4m3_slot_order(torch.tensor(k_order)).tolist()
        stored = interleave_block_bits(block[None])[0].tolist()
        for q in range(4):
            got = _e4m3_table_bytes(int.from_bytes(bytes(stored[4 * q:4 * q + 4]), "little"), table)
            assert got[:4] == slots[4 * q:4 * q + 4]
            assert got[4:] == slots[16 + 4 * q:16 + 4 * q + 4]
