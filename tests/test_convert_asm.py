"""The inline-asm E2M1 conversions, run on the CPU by a small emulator of the PTX they use.

The interpreter cannot run inline asm and the GPU is scarce, so the asm texts of
``mxmoe._details.convert`` are parsed and executed here instruction by instruction (and, or,
shl, shr, shf.l.wrap, prmt with sign replication, mul.lo, mad.lo, mul.rn.bf16x2, 16-bit moves) on words covering every
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


def test_e4m3_slots_asm_gives_exact_e4m3_in_slot_order():
    """Bytes of $0 then $1: values (2j + c) 2, 0, 3, 1, 4, 6, 5, 7 (``prepare.e4m3_slot_order``)."""
    for word in _words():
        lo, hi = run_asm(convert.E2M1X8_TO_E4M3_SLOTS_ASM.value, [word])
        got = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]
        codes = _codes(word)
        want = [_e4m3_byte(float(E2M1_VALUES[codes[v]]) * 2.0**-6) for v in (2, 0, 3, 1, 4, 6, 5, 7)]
        assert got == want, hex(word)


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
    """The paired-factor forms (two blocks' factors in one word, ``gemm_sm90._paired_factors``): LO multiplies by the
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
    """``gemm_sm90._paired_factors``: prmt(word) * 128 + the row's addend gives, in its low / high half, the BF16
    bits of block first_block / first_block + 1's factor (the per-block form: byte * 0x00800080 + addend), for every
    scale byte b <= ref (the range ``FOLD_REF_MAX`` keeps the field in, so no half carries into the other)."""
    from mxmoe._details.gemm_sm90 import _pair_select

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


def test_fp8_stored_words_give_the_activation_slot_order():
    """The W4A8 converter's claim for prepared words: stored word q gives the E4M3 values of activation slots
    4q .. 4q+3 and 16 + 4q .. 16 + 4q + 3 of ``prepare.e4m3_slot_order``."""
    from mxmoe.prepare import e4m3_slot_order, interleave_block_bits

    rng = np.random.default_rng(4)
    for _ in range(50):
        block = torch.tensor(rng.integers(0, 256, 16), dtype=torch.uint8)
        codes = [(block[k // 2].item() >> (4 * (k % 2))) & 15 for k in range(32)]
        k_order = [_e4m3_byte(float(E2M1_VALUES[c]) * 2.0**-6) for c in codes]
        slots = e4m3_slot_order(torch.tensor(k_order)).tolist()
        stored = interleave_block_bits(block[None])[0].tolist()
        for q in range(4):
            o0, o1 = run_asm(convert.E2M1X8_TO_E4M3_SLOTS_ASM.value, [int.from_bytes(bytes(stored[4 * q:4 * q + 4]), "little")])
            assert [(o0 >> (8 * i)) & 0xFF for i in range(4)] == slots[4 * q:4 * q + 4]
            assert [(o1 >> (8 * i)) & 0xFF for i in range(4)] == slots[16 + 4 * q:16 + 4 * q + 4]
