"""fused_moe_reference against an independent float64 per-token loop (SPEC §1, §3-§5)."""
from __future__ import annotations

import math

import pytest
import torch

from mxmoe import fused_moe_reference, prepare_weights, relative_l2
from mxmoe.reference import quantize_rows_fp8

E, H, I, T, TOP_K = 4, 64, 32, 7, 3


def act_f64(g: float, u: float, activation: str, limit, alpha) -> float:
    """SPEC §4, scalar float64."""
    if activation == "silu":
        if limit is not None:
            g, u = min(g, limit), max(-limit, min(u, limit))
        return g / (1.0 + math.exp(-g)) * u
    limit = 7.0 if limit is None else limit
    alpha = 1.702 if alpha is None else alpha
    g, u = min(g, limit), max(-limit, min(u, limit))
    return g / (1.0 + math.exp(-alpha * g)) * (u + 1.0)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round float64 to the E4M3 grid, ties to even, saturating at +-448 (3 mantissa bits, min exponent -6)."""
    a = v.abs()
    exponent = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=-6)
    step = torch.pow(2.0, exponent - 3)
    return torch.sign(v) * torch.clamp(torch.round(a / step) * step, max=448.0)  # torch.round: half to even


def fp8_rows_f64(v: torch.Tensor) -> torch.Tensor:
    """SPEC §5 row quantization, dequantized: scale amax/448, RNE, zero row -> zero."""
    scale = v.abs().amax(-1, keepdim=True) / 448.0
    return torch.where(scale > 0, e4m3_round(v / torch.where(scale > 0, scale, 1.0)) * scale, 0.0)


def moe_f64(x, src, layout, weights, ids, *, activation, limit, alpha, expert_map, decode, fp8=False):
    """out[t] = sum_k w[t,k] * (g2 * W2 @ act(g13 * W13 @ x + b13) + b2), route by route, in float64.

    ``fp8``: quantize each token's row once and each routed intermediate row to E4M3 (SPEC §5).
    """
    w13 = decode(src["w13"], src["w13_scale"])  # source layout rows
    w2 = decode(src["w2"], src["w2_scale"])
    b13 = src.get("b13")
    n_local = w13.shape[0]
    n_global = n_local if expert_map is None else expert_map.numel()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    stats = dict(gate_above=0, up_outside=0, routed=0)
    for t in range(x.shape[0]):
        xt = x[t].double()
        if fp8:
            xt = fp8_rows_f64(xt)
        for k in range(ids.shape[1]):
            gid = int(ids[t, k])
            if gid < 0 or gid >= n_global:
                continue
            e = gid if expert_map is None else int(expert_map[gid])
            if e < 0:
                continue
            h = w13[e] @ xt
            if "w13_global_scale" in src:
                h = h * float(src["w13_global_scale"][e])
            if b13 is not None:
                h = h + b13[e].double()
            if layout == "interleaved":
                gate, up = h[0::2], h[1::2]
            elif layout == "up_gate":
                gate, up = h[I:], h[:I]
            else:
                gate, up = h[:I], h[I:]
            a = torch.tensor([act_f64(float(g), float(u), activation, limit, alpha) for g, u in zip(gate, up)], dtype=torch.float64)
            if fp8:
                a = fp8_rows_f64(a)
            y = w2[e] @ a
            if "w2_global_scale" in src:
                y = y * float(src["w2_global_scale"][e])
            if "b2" in src:
                y = y + src["b2"][e].double()
            out[t] += float(weights[t, k]) * y
            lim = limit if limit is not None else (7.0 if activation == "swigluoai" else math.inf)
            stats["gate_above"] += int((gate > lim).sum())
            stats["up_outside"] += int((up.abs() > lim).sum())
            stats["routed"] += 1
    return out, stats


def routing_case(kind: str, seed: int, tokens: int = T):
    """(topk_weights, topk_ids, expert_map) for a routing scenario."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(tokens, TOP_K, generator=g) + 0.25
    if kind == "plain":
        return weights, torch.randint(0, E, (tokens, TOP_K), generator=g, dtype=torch.int32), None
    if kind == "masked":
        ids = torch.randint(0, E, (tokens, TOP_K), generator=g, dtype=torch.int64)
        ids[0, 1], ids[1, 0], ids[2, 2] = -1, E, 1000
        ids[3] = torch.tensor([-5, E, -1])  # a fully masked token
        weights[3] = 10.0  # weight of a masked route is irrelevant
        return weights, ids, None
    # expert parallelism: 7 global experts, this rank holds 4 of them
    expert_map = torch.tensor([-1, 2, 0, -1, 3, 1, -1], dtype=torch.int32)
    ids = torch.randint(0, 7, (tokens, TOP_K), generator=g, dtype=torch.int32)
    ids[0] = torch.tensor([0, 3, 6], dtype=torch.int32)  # all mapped to -1
    ids[1, 0] = 7  # out of the global range
    return weights, ids, expert_map


ACTIVATIONS = [
    ("silu", None, None),
    ("silu", 1.5, None),
    ("swigluoai", None, None),
    ("swigluoai", 2.5, 0.9),
]


@pytest.mark.parametrize("activation,limit,alpha", ACTIVATIONS, ids=["silu", "silu-limit", "swigluoai", "swigluoai-custom"])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "bias+global"])
@pytest.mark.parametrize("routing", ["plain", "masked", "expert_map"])
def test_exact_mode_matches_float64_loop(activation, limit, alpha, extras, routing, make_source, decode_f64):
    layout = {"plain": "gate_up", "masked": "interleaved", "expert_map": "up_gate"}[routing]
    src = make_source(E, H, I, seed=10, scale_lo=123, scale_hi=127, biases=extras, global_scales=extras)
    # the random source is read in `layout` order: prepare must normalize it
    experts = prepare_weights(**src, w13_layout=layout)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    weights, ids, expert_map = routing_case(routing, seed=12)
    out = fused_moe_reference(x, experts, weights, ids, activation=activation, swiglu_limit=limit,
                              swiglu_alpha=alpha, expert_map=expert_map, mode="exact")
    ref, stats = moe_f64(x, src, layout, weights, ids, activation=activation, limit=limit, alpha=alpha,
                         expert_map=expert_map, decode=decode_f64)
    # the data exercises what is being tested
    assert ref.abs().max() > 0 and stats["routed"] > 0
    if limit is not None or activation == "swigluoai":
        assert stats["gate_above"] > 0 and stats["up_outside"] > 0, stats
    assert out.dtype == torch.float32 and out.shape == (T, H)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    if routing != "plain":
        fully_masked = 3 if routing == "masked" else 0
        assert torch.equal(out[fully_masked], torch.zeros(H))  # exactly zero, biases included


def test_bf16_topk_weights_are_upcast(make_source, decode_f64):
    src = make_source(E, H, I, seed=13)
    experts = prepare_weights(**src)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    weights, ids, _ = routing_case("plain", seed=15)
    weights = weights.to(torch.bfloat16)
    out = fused_moe_reference(x, experts, weights, ids, mode="exact")
    ref, _ = moe_f64(x, src, "gate_up", weights, ids, activation="silu", limit=None, alpha=None,
                     expert_map=None, decode=decode_f64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("mode,tolerance", [("w4a16", 0.01), ("w4a8", 0.05)])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_kernel_modes_close_to_exact(mode, tolerance, activation, make_source):
    # GEMM outputs of the same order as the unit biases, gate/up mostly inside the clamp (a
    # saturated clamp amplifies the FP8 error); E4M3 rows alone cost ~4% relative L2 here
    src = make_source(E, H, I, seed=16, scale_lo=120, scale_hi=124, biases=True)
    experts = prepare_weights(**src)
    tokens = 48
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    weights, ids, _ = routing_case("masked", seed=18, tokens=tokens)
    exact = fused_moe_reference(x, experts, weights, ids, activation=activation, mode="exact")
    out = fused_moe_reference(x, experts, weights, ids, activation=activation, mode=mode)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, H)
    assert torch.isfinite(out.float()).all()
    err = relative_l2(out, exact)
    assert 0 < err <= tolerance, err
    assert torch.equal(out[3].float(), torch.zeros(H))  # fully masked token


@pytest.mark.parametrize("activation,limit,alpha", ACTIVATIONS, ids=["silu", "silu-limit", "swigluoai", "swigluoai-custom"])
def test_w4a8_mode_matches_independent_fp8_emulation(activation, limit, alpha, make_source, decode_f64):
    src = make_source(E, H, I, seed=22, scale_lo=120, scale_hi=124, biases=True, global_scales=True)
    experts = prepare_weights(**src, w13_layout="interleaved")
    tokens = 24
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    weights, ids, expert_map = routing_case("expert_map", seed=24, tokens=tokens)
    kwargs = dict(activation=activation, limit=limit, alpha=alpha, expert_map=expert_map, decode=decode_f64)
    emulated, _ = moe_f64(x, src, "interleaved", weights, ids, fp8=True, **kwargs)
    exact, _ = moe_f64(x, src, "interleaved", weights, ids, **kwargs)
    out = fused_moe_reference(x, experts, weights, ids, activation=activation, swiglu_limit=limit, swiglu_alpha=alpha,
                              expert_map=expert_map, mode="w4a8")
    # BF16 output and FP32 sums vs float64; the FP8 rounding itself must be the same
    assert relative_l2(out, emulated) <= 0.005
    assert relative_l2(emulated, exact) > 0.01  # the quantization is visible at this tolerance


def test_independent_e4m3_rounding_agrees_with_torch():
    v = torch.randn(4096, generator=torch.Generator().manual_seed(25), dtype=torch.float64) * 100
    v = torch.cat([v, torch.tensor([448.0, 460.0, 500.0, -1e4, 2.0 ** -10, 3 * 2.0 ** -10, 17.0, 19.0])])
    assert torch.equal(e4m3_round(v), v.float().to(torch.float8_e4m3fn).double())


def test_reference_rejects_unknown_mode(make_source):
    experts = prepare_weights(**make_source(E, H, I, seed=19))
    with pytest.raises(ValueError, match="mode"):
        fused_moe_reference(torch.zeros(1, H), experts, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), mode="fp8")


# ----------------------------------------------------------------------------- FP8 row quantization


def test_fp8_zero_row_gives_zero_scale_and_q():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(20))
    x[1] = 0.0
    x[3] = -0.0
    q, scale = quantize_rows_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    qf = q.float()
    assert torch.isfinite(qf).all() and torch.isfinite(scale).all()
    assert scale[1].item() == 0.0 and scale[3].item() == 0.0
    assert torch.equal(qf[1], torch.zeros(64)) and torch.equal(qf[3], torch.zeros(64))
    assert (scale[[0, 2]] > 0).all()


def test_fp8_scale_is_row_amax_over_448():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(21)) * torch.tensor([[1e-3], [1.0], [7.0], [1e4], [3e-20]])
    q, scale = quantize_rows_fp8(x)
    assert torch.equal(scale, x.abs().amax(-1) / 448.0)
    assert torch.equal(q.float().abs().amax(-1), torch.full((5,), 448.0))  # the row maximum lands on 448


def test_fp8_saturates_at_448():
    # amax = 8e-43: amax/448 rounds to the smallest float32 subnormal, so x/scale is ~571 > 448
    x = torch.tensor([[8e-43, -8e-43, 4e-43, 0.0], [3.0, -3.0, 1.5, 0.0]])
    q, scale = quantize_rows_fp8(x)
    qf = q.float()
    assert scale[0].item() > 0
    assert torch.isfinite(qf).all()
    assert qf[0, 0].item() == 448.0 and qf[0, 1].item() == -448.0
    assert qf[1, 0].item() == 448.0 and qf[1, 1].item() == -448.0
    assert (qf.abs() <= 448).all()


def test_fp8_rounds_to_nearest_even():
    # amax 448 -> scale exactly 1, so q is x rounded to E4M3
    values = [448.0, 17.0, 19.0, -17.0, -19.0, 1.0625, 1.1875, 232.0, 248.0, 2.0 ** -10, 3 * 2.0 ** -10, 17.0001]
    expected = [448.0, 16.0, 20.0, -16.0, -20.0, 1.0, 1.25, 224.0, 256.0, 0.0, 2.0 ** -8, 18.0]
    q, scale = quantize_rows_fp8(torch.tensor([values]))
    assert scale.item() == 1.0
    assert q.float()[0].tolist() == expected
