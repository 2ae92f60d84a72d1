"""The inline-asm E2M1 conversions, run on the CPU by a small emulator of the PTX they use.

The interpreter cannot run inline asm and the GPU is scarce, so the asm texts of
``mxmoe._details.convert`` are parsed and executed here instruction by instruction (and, or,
shl, shr, prmt with sign replication, mul.lo, mad.lo, mul.rn.bf16x2) on every packed byte and
compared with the exact E2M1 values. On the GPU, the kernels that use them are compared with
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


def _codes(word: int) -> list:
    """The 8 E2M1 codes of a word in K order (byte j: low nibble K = 2j, high nibble K = 2j + 1)."""
    return [(word >> (4 * k)) & 0xF for k in range(8)]


def _e4m3_byte(value: float) -> int:
    return int(torch.tensor([value]).to(torch.float8_e4m3fn).view(torch.uint8)[0])


def test_e4m3_korder_gives_exact_e4m3_in_k_order():
    for word in _words():
        lo, hi = run_asm(convert.E2M1X8_TO_E4M3_KORDER_ASM.value, [word])
        got = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]
        want = [_e4m3_byte(float(E2M1_VALUES[c]) * 2.0**-6) for c in _codes(word)]
        assert got == want, hex(word)


@pytest.mark.parametrize("d", [0, -1, -7, -30, -100])
def test_bf16_korder_gives_exact_scaled_values_in_k_order(d):
    f = (253 + d) << 7  # the converter's factor: BF16 2**(126 + d)
    for word in _words():
        outs = run_asm(convert.E2M1X8_TO_BF16_KORDER_ASM.value, [word, f | (f << 16)])
        got = [_bf16_to_f32((o >> (16 * half)) & 0xFFFF) for o in outs for half in range(2)]
        want = [float(E2M1_VALUES[c]) * 2.0**d for c in _codes(word)]
        assert got == want, (hex(word), d)
        # negative zero stays negative (the sign is placed even for code 8)
        signs = [(o >> (16 * half + 15)) & 1 for o in outs for half in range(2)]
        assert signs == [c >> 3 for c in _codes(word)]


def test_plain_kernel_asm_forms_agree_with_the_korder_ones():
    """The plain template's forms give the same values, low nibbles and high nibbles apart."""
    for word in _words():
        codes = _codes(word)
        lo, hi = run_asm(convert.E2M1X8_TO_E4M3_ASM.value, [word])
        k_lo, k_hi = run_asm(convert.E2M1X8_TO_E4M3_KORDER_ASM.value, [word])
        k_bytes = [(k_lo >> (8 * i)) & 0xFF for i in range(4)] + [(k_hi >> (8 * i)) & 0xFF for i in range(4)]
        assert [(lo >> (8 * i)) & 0xFF for i in range(4)] == k_bytes[0::2]
        assert [(hi >> (8 * i)) & 0xFF for i in range(4)] == k_bytes[1::2]
        outs = run_asm(convert.E2M1X8_TO_BF16_ASM.value, [word])  # values times 2**-126, no factor
        halves = [(o >> (16 * h)) & 0xFFFF for o in outs for h in range(2)]
        # $0,$1: low nibbles of bytes (0, 1), (2, 3); $2,$3: high nibbles
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        for bits, k in zip(halves, order):
            assert _bf16_to_f32(bits) == float(E2M1_VALUES[codes[k]]) * 2.0**-126
