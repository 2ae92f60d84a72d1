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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it (``pytest -m gpu`` runs only them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
    """Random E2M1-K32 source tensors in ``gate_up`` layout (all byte values, scales in [lo, hi]) on the CPU."""
    from mxmoe.testing import random_code_sources  # (here: TRITON_INTERPRET is decided above)

    return random_code_sources(E, H, I, seed=seed, scale_lo=scale_lo, scale_hi=scale_hi, biases=biases,
                               global_scales=global_scales)


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


def top_scale_pair(E, H, I, shift=130, seed=5, dev="cpu"):
    """Two expert sets whose GEMM1 scale bytes differ by ``shift`` binades: rows of bytes (254, 244, 234, 0)
    (largest byte 254, where the W4A16 kernels fold relative to min(ref, 253); a byte-0 block far below it)
    and the same rows ``shift`` lower (a block at 0 stays 0). With activations times 2**-100 and 2**(shift - 100)
    (normal BF16 either way) every product is the same value times an exact power of two, so W4A16 gives the
    same bits for both (the byte-0 block adds nothing visible to either)."""
    import mxmoe  # here, not at the top: TRITON_INTERPRET is decided above, before mxmoe defines its kernels

    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8, device=dev)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8, device=dev)
    s2 = torch.randint(120, 125, (E, H, I // 32), generator=g, dtype=torch.uint8, device=dev)
    top = torch.tensor([254, 244, 234, 0], dtype=torch.int16, device=dev)[torch.arange(H // 32, device=dev) % 4]
    low = torch.where(top > 0, top - shift, 0)
    pair = [mxmoe.prepare_weights(w13, t.to(torch.uint8).expand(E, 2 * I, H // 32).contiguous(), w2, s2)
            for t in (top, low)]
    assert int(pair[0].w13_ref.max()) == 254
    return pair


def w13_in_layout(gate: torch.Tensor, up: torch.Tensor, layout: str) -> torch.Tensor:
    """gate and up rows (dim 1, same shapes) as one w13-shaped tensor in ``layout``, built here independently of
    mxmoe: ``gate_up`` / ``up_gate`` concatenated, ``interleaved`` even rows gate and odd rows up."""
    if layout == "gate_up":
        return torch.cat((gate, up), 1)
    if layout == "up_gate":
        return torch.cat((up, gate), 1)
    return torch.stack((gate, up), 2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
