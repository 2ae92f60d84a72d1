"""Shared fixtures for the CPU test suite.

The helpers here are deliberately independent of mxmoe's own decoding code: the E2M1
decoder is written from the bit-field definition (SPEC §2), not from mxmoe's table.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is defined (at ``import mxmoe``), so the
# switch is made here, before any test module imports mxmoe: without a GPU the kernels run in
# the interpreter. Tests that want the PyTorch path on CPU unset it (``no_triton_interpret``).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def e2m1_value(code: int) -> float:
    """E2M1 from its bit fields: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)
    return sign * magnitude  # code 8 gives -0.0


def decode_mxfp4_f64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent float64 decoder: packed uint8 ``[..., K/2]`` + UE8M0 bytes ``[..., K/32]`` -> ``[..., K]``."""
    if scales.dtype != torch.uint8:
        scales = scales.view(torch.uint8)
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    p = packed.to(torch.int64)
    codes = torch.empty(*p.shape[:-1], p.shape[-1] * 2, dtype=torch.int64)
    codes[..., 0::2] = p & 0xF  # low nibble = even k
    codes[..., 1::2] = p >> 4
    values = table[codes]
    factor = torch.tensor([math.ldexp(1.0, b - 127) for b in range(256)], dtype=torch.float64)[scales.to(torch.int64)]
    return values * factor.repeat_interleave(32, dim=-1)


def random_source_experts(E: int, H: int, I: int, *, seed: int, scale_lo: int = 122, scale_hi: int = 126,
                          biases: bool = False, global_scales: bool = False) -> dict:
    """Random E2M1-K32 source tensors in ``gate_up`` layout (all byte values, scales in [lo, hi])."""
    g = torch.Generator().manual_seed(seed)
    src = dict(
        w13=torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8),
        w13_scale=torch.randint(scale_lo, scale_hi + 1, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
        w2=torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8),
        w2_scale=torch.randint(scale_lo, scale_hi + 1, (E, H, I // 32), generator=g, dtype=torch.uint8),
    )
    if biases:
        src["b13"] = torch.randn(E, 2 * I, generator=g)
        src["b2"] = torch.randn(E, H, generator=g)
    if global_scales:
        src["w13_global_scale"] = torch.rand(E, generator=g) + 0.5
        src["w2_global_scale"] = torch.rand(E, generator=g) + 0.5
    return src


@pytest.fixture
def decode_f64():
    return decode_mxfp4_f64


@pytest.fixture
def e2m1():
    return e2m1_value


@pytest.fixture
def make_source():
    return random_source_experts


@pytest.fixture
def no_triton_interpret(monkeypatch):
    """Make CPU ``fused_moe`` calls run the PyTorch reference, not the Triton interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
