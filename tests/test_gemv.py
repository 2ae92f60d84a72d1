"""The decode GEMVs (``_details/gemv.py``) in Triton's CPU interpreter (their plain-Triton twin of the asm), forced on
with ``overrides(gemv_decode=True)``: against the PyTorch emulation and the exact reference, masked routes, the
expert map, biases, the activations, K tails of whole K32 blocks; and the choice itself (``config.gemv_decode``)."""
from __future__ import annotations

import os

import pytest
import torch

from mxmoe import fused_moe, relative_l2
from mxmoe._details.config import gemv_decode, overrides
from mxmoe._details.launch import describe

from test_kernels_interpret import experts, run_both

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before import (conftest sets it without a GPU)")

CASES = {
    # name: (E, H, I, T, top_k, extra); K = 2880 / 10 + 32 = 320: a row's last step partial, its unit 32 bytes;
    # K = 96: 16-byte units
    "one_token": (6, 128, 64, 1, 4, {}),
    "k_tail_units16": (4, 192, 96, 1, 2, {}),
    "gpt_oss_like": (4, 320, 320, 1, 4, {"biases": True, "activation": "swigluoai", "swiglu_limit": 7.0}),
    "clamped_silu_tokens": (5, 128, 128, 3, 2, {"activation": "silu", "swiglu_limit": 3.0}),
    "zero_scale_bytes": (4, 128, 64, 2, 2, {"pattern": "zero_bytes"}),
    "wide_span": (4, 128, 128, 1, 2, {"pattern": "wide_span"}),
}


def _gemv_launched(ex, x, w, ids, **kw) -> bool:
    names = [launch.kernel.fn.__name__ for launch in _launches(ex, x, w, ids)]
    return names == ["moe_gemv_gate_up_kernel", "moe_gemv_down_sum_kernel"]


def _launches(ex, x, w, ids, expert_map=None):
    from mxmoe.selection import plan_layer
    from mxmoe.workspace import workspace_for
    plan = plan_layer(ids.numel(), precision="w4a16")
    ws = workspace_for(ex, ids.shape[0], ids.shape[1], False)
    return describe(x, ex, w, ids, plan, expert_map, torch.empty_like(x), ws)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_gemv_matches_emulation(case):
    E, H, I, T, top_k, extra = CASES[case]
    extra = dict(extra)
    ex = experts(E, H, I, biases=extra.pop("biases", False), pattern=extra.pop("pattern", None))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).int()
    w = torch.rand(T, top_k, generator=g)
    with overrides(gemv_decode=True):
        assert _gemv_launched(ex, x, w, ids)
        out, emu, exact = run_both(ex, x, w, ids, "w4a16", **extra)
    without = fused_moe(x, ex, w, ids, precision="w4a16", out=torch.full_like(x, float("nan")), **extra)
    assert relative_l2(out, emu) <= 2e-3, relative_l2(out, emu)
    assert relative_l2(out, exact) <= 5e-3
    for t in range(T):  # per token too
        assert relative_l2(out[t:t + 1], exact[t:t + 1]) <= 5e-3
    assert relative_l2(out, without) <= 2e-3  # the MMA template's order of the K sum


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gemv_masked_routes_and_expert_map(ids_dtype):
    E_local, E_global, H, I, T, top_k = 4, 12, 64, 64, 3, 4
    ex = experts(E_local, H, I, seed=3, biases=True)
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[4:8] = torch.arange(4, dtype=torch.int32)
    ids = torch.tensor([[5, -1, 13, 7], [-1, -1, 12, 2], [4, 5, 6, 7]]).to(ids_dtype)  # out of range, unmapped
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).bfloat16()
    w = torch.rand(T, top_k, generator=g)
    with overrides(gemv_decode=True):
        assert _gemv_launched(ex, x, w, ids)
        out, emu, exact = run_both(ex, x, w, ids, "w4a16", expert_map=emap)
    assert (out[1] == 0).all()  # every route masked: zero, biases and all
    assert relative_l2(out, emu) <= 2e-3 and relative_l2(out, exact) <= 5e-3


def test_gemv_choice():
    x = torch.randn(1, 128).bfloat16()
    assert not gemv_decode(1, False, 128, 64, x)  # CPU, not forced
    with overrides(gemv_decode=True):
        assert gemv_decode(1, False, 128, 64, x)
        assert not gemv_decode(1, True, 128, 64, x)  # W4A8
        assert not gemv_decode(1, False, 96, 64, x)  # GEMM2's rows: 64-row blocks whole
        assert not gemv_decode(1, False, 128, 48, x)  # I not a multiple of the 16 columns per program
        assert not gemv_decode(1, False, 128, 64, torch.randn(1, 129).bfloat16()[:, 1:])  # odd address
    with overrides(gemv_decode=False):
        assert not gemv_decode(1, False, 128, 64, x)


@pytest.mark.slow  # (compiles both kernels for sm_90a in a subprocess: ~10 s)
def test_gemvs_compile_to_16_byte_loads_without_spills():
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "mxmoe._details.sm90", "gemv"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rep in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert rep["spill_bytes"] == 0, rep
        # the words (and x's pairs) in 16-byte vectors: more 128-bit loads than any other width
        assert rep["loads"].get("LDG.E.128", 0) > max(n for op, n in rep["loads"].items() if op != "LDG.E.128"), rep
