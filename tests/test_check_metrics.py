"""``mxmoe check``'s SPEC §5 metrics on the CPU: per-token relative L2, the W4A8 excess over the FP8 emulation,
zero rows, bound scopes, and the GEMM-level references (against an independent float64 decoder; with
``TRITON_INTERPRET=1`` the plain-Triton kernels through ``accuracy.gemm_level``)."""
from __future__ import annotations

import math
import os

import pytest
import torch

import mxmoe
from mxmoe import accuracy, check, testing
from mxmoe.check import Case, CaseResult
from mxmoe.accuracy import (REFERENCE_SHAPE, excess_over_emulation, per_token_relative_l2, w4a8_layer_failures,
                            w4a8_layer_metrics, zero_where_ref_zero)

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                               reason="runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, no GPU)")


# ---------------------------------------------------------------- per-token relative L2, zero rows


def test_per_token_relative_l2_by_hand():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    out = torch.tensor([[3.0, 4.5], [0.0, 0.0], [1.0, 0.1], [0.0, 2.0]])
    err, nonzero = per_token_relative_l2(out, ref)
    assert nonzero.tolist() == [True, False, True, True]
    assert err.dtype == torch.float64
    assert err[0].item() == pytest.approx(0.1) and err[2].item() == pytest.approx(0.1) and err[3].item() == 0.0
    assert math.isnan(err[1].item())  # no relative error of a zero row
    out[2, 1] = float("nan")
    err, _ = per_token_relative_l2(out, ref)
    assert err[2].item() == math.inf and err[0].item() == pytest.approx(0.1)
    assert accuracy.worst_token_relative_l2(out, ref) == math.inf


def test_zero_where_ref_zero():
    ref = torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, -0.0]])
    assert zero_where_ref_zero(torch.tensor([[5.0, 5.0], [0.0, -0.0], [0.0, 0.0]]), ref)
    assert not zero_where_ref_zero(torch.tensor([[5.0, 5.0], [0.0, 1e-30], [0.0, 0.0]]), ref)
    assert not zero_where_ref_zero(torch.tensor([[5.0, 5.0], [0.0, 0.0], [float("nan"), 0.0]]), ref)
    assert zero_where_ref_zero(torch.ones(2, 3), torch.ones(2, 3))  # no zero row: nothing to check


# ---------------------------------------------------------------- the excess over the emulation


def test_excess_over_emulation_by_hand():
    exact = torch.tensor([[10.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    emu = exact + torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.02]])  # token errors 1 %, -, 1 %
    out = exact + torch.tensor([[0.3, 0.0, 0.0], [0.0, 7.0, 0.0], [0.0, 0.0, 0.02]])  # 3 %, (zero row hit), 1 %
    whole, worst, token = excess_over_emulation(out, emu, exact)
    norm = math.sqrt(104.0)
    # (the zero exact row's 7.0 counts in the whole output's error, not per token)
    assert whole == pytest.approx((math.sqrt(0.09 + 49.0 + 0.0004) - math.sqrt(0.01 + 0.0004)) / norm, rel=1e-5)
    assert worst == pytest.approx(0.02, rel=1e-5) and token == 0
    assert not zero_where_ref_zero(out, exact)
    out[1, 1] = 0.0
    whole, worst, token = excess_over_emulation(out, emu, exact)
    assert whole == pytest.approx((math.sqrt(0.0904) - math.sqrt(0.0104)) / norm, rel=1e-5)
    assert worst == pytest.approx(0.02, rel=1e-5) and token == 0 and zero_where_ref_zero(out, exact)
    # better than the emulation on a token: a negative excess
    whole, worst, token = excess_over_emulation(exact.clone(), emu, exact)
    assert whole < 0 and worst == pytest.approx(-0.01, rel=1e-5)
    # every exact row zero: no per-token value; NaN in out: inf
    z = torch.zeros(2, 3)
    assert excess_over_emulation(z, z, z) == (0.0, None, -1)
    out[2, 0] = float("nan")
    whole, worst, token = excess_over_emulation(out, emu, exact)
    assert whole == math.inf and worst == math.inf and token == 2


def _layer(T=200, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(T, H, generator=g)
    emu = exact + 0.045 * torch.randn(T, H, generator=g) * exact.norm(dim=1, keepdim=True) / math.sqrt(H)
    noise = torch.randn(T, H, generator=g) * exact.norm(dim=1, keepdim=True) / math.sqrt(H)
    return exact, emu, noise


def test_layer_bounds_whole_token_and_reference_shape():
    exact, emu, noise = _layer()
    small = (8, 256, 128, 4)
    ok = emu + 0.01 * noise  # 1 % from the emulation: ~0.1 points above its error
    m = w4a8_layer_metrics(ok, emu, exact)
    assert 0 < m["w4a8_excess_over_emulation"] < 0.003 and m["w4a8_worst_token_excess"] < 0.01
    assert m["w4a8_vs_emulation"] == pytest.approx(0.01, rel=0.1)
    assert m["emulation_vs_exact"] == pytest.approx(0.045, rel=0.1)
    assert w4a8_layer_failures(m, small) == [] and w4a8_layer_failures(m, REFERENCE_SHAPE) == []
    # one token 10 % off: only the per-token bound sees it (~6.5 points there, ~0.1 over the whole output)
    one = ok.clone()
    one[7] *= 1.1
    m = w4a8_layer_metrics(one, emu, exact)
    assert m["worst_token"] == 7 and m["w4a8_worst_token_excess"] > 0.05
    assert w4a8_layer_failures(m, small) == ["w4a8_worst_token_excess"]
    # 2.5 % from the emulation everywhere: the whole excess (~0.65 points), and a8~emu at the reference shape only
    far = emu + 0.025 * noise
    m = w4a8_layer_metrics(far, emu, exact)
    assert 0.005 < m["w4a8_excess_over_emulation"] < 0.009
    assert w4a8_layer_failures(m, small) == ["w4a8_excess_over_emulation"]
    assert w4a8_layer_failures(m, REFERENCE_SHAPE) == ["w4a8_excess_over_emulation", "w4a8_vs_emulation"]
    # a row whose exact reference is zero must be zero
    exact[3] = 0.0
    emu[3] = 0.0
    bad = ok.clone()
    bad[3] = 1e-3
    m = w4a8_layer_metrics(bad, emu, exact)
    assert not m["zero_where_exact_zero"] and w4a8_layer_failures(m, small) == ["zero_where_exact_zero"]
    assert "token" in accuracy.describe_w4a8(m)


def test_bounds_and_their_scope():
    assert accuracy.tolerance("w4a8_vs_emulation", REFERENCE_SHAPE) == 0.02
    assert accuracy.tolerance("w4a8_vs_emulation", (288, 4096, 1024, 4)) is None
    assert accuracy.tolerance("w4a8_excess_over_emulation", (8, 96, 160, 3)) == 0.005
    assert accuracy.tolerance("w4a8_worst_token_excess", (8, 96, 160, 3)) == 0.015
    assert accuracy.tolerance("w4a8_gemm1_vs_f64", (8, 96, 160, 3)) == accuracy.tolerance("w4a8_gemm2_vs_f64", (1, 32, 32, 1)) == 1.5e-3
    assert accuracy.tolerance("w4a16_vs_exact", (8, 96, 160, 3)) == 0.005
    assert accuracy.tolerance("w4a8_vs_exact", REFERENCE_SHAPE) is None  # information: the emulation's error is the yardstick
    assert set(accuracy.metric_names("gemm")) == {"w4a8_gemm1_vs_f64", "w4a8_gemm2_vs_f64", "w4a8_gemm1_worst_route",
                                               "w4a8_gemm2_worst_route"}
    assert [m for m in accuracy.metric_names("gemm") if accuracy.tolerance(m, REFERENCE_SHAPE)] == [
        "w4a8_gemm1_vs_f64", "w4a8_gemm2_vs_f64"]  # the worst routes: information
    assert set(accuracy.metric_names("layer")) | set(accuracy.metric_names("gemm")) == set(accuracy.METRICS)
    ref = Case("r", "", *REFERENCE_SHAPE, T=4)
    small = Case("s", "", 8, 256, 128, 8, T=4)
    for case, expect in ((ref, ["a8~emu"]), (small, [])):
        r = CaseResult(case, metrics={"w4a8_vs_emulation": 0.03, "w4a8_excess_over_emulation": 0.004,
                                      "w4a8_worst_token_excess": None})
        assert r.failures == expect
        assert ("!" in check.format_row(r, 4)) == bool(expect)
    r = CaseResult(small, metrics={"w4a8_excess_over_emulation": 0.006, "w4a8_worst_token_excess": 0.016})
    assert r.failures == ["a8 excess", "a8 tok excess"]
    g = CaseResult(Case("g", "", 8, 256, 128, 4, T=4, kind="gemm"), metrics={"w4a8_gemm1_vs_f64": 1.6e-3,
                                                                            "w4a8_gemm2_vs_f64": 1.4e-3})
    assert g.failures == ["gemm1~f64"] and set(g.as_dict()["tolerances"]) == set(accuracy.metric_names("gemm"))


def test_cases_cover_the_reference_shape_and_gemm_level():
    big = {c.name: c for c in check.default_cases(small=False)}
    small = {c.name: c for c in check.default_cases(small=True)}
    assert set(big) == set(small)
    assert big["ref_decode"].dims == big["gemm_ref_prefill"].dims == REFERENCE_SHAPE
    gemm = [c for c in big.values() if c.kind == "gemm"]
    assert {c.T for c in gemm if c.dims == REFERENCE_SHAPE} == {64, 1500, 4096}
    assert all(c.routing == "masked" and not c.biases and not c.global_scales for c in gemm)
    assert all(c.draw_on_device for c in big.values() if c.dims == REFERENCE_SHAPE)


# ---------------------------------------------------------------- GEMM-level references


def _gemm_experts(make_source, E=4, H=64, I=96, seed=3, zero_up=True):
    src = make_source(E, H, I, seed=seed)
    if zero_up:
        src["w13"][:, I:] = 0
    return src, mxmoe.prepare_weights(**src)


def _masked_ids(T, top_k, E, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    ids[0] = torch.tensor([-1, E + 3][:top_k] + [-1] * (top_k - 2))
    ids[2, 0] = -1
    ids[3, -1] = E
    w = torch.rand(T, top_k, generator=g) + 0.1
    return ids, w


def test_gemm_references_against_an_independent_decoder(make_source, decode_f64):
    E, H, I, top_k, T = 4, 64, 96, 2, 7
    src, ex = _gemm_experts(make_source, E, H, I)
    ids, w = _masked_ids(T, top_k, E, seed=1)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[4] = 0  # a zero row: scale 0, zero output
    w13 = decode_f64(src["w13"], src["w13_scale"])  # [E, 2I, H] float64, not mxmoe's decoder
    w2 = decode_f64(src["w2"], src["w2_scale"])
    # x per row: amax / 448 in FP32, x / s rounded to E4M3 (RNE, saturating), times s in float64
    xf = x.float()
    s = xf.abs().amax(1) / 448
    q = torch.where(s[:, None] > 0, xf / torch.where(s > 0, s, 1)[:, None], 0).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn)
    xq = q.float().double() * s.double()[:, None]
    ref1 = accuracy.gemm1_reference_f64(x, ex, ids)
    a_q = torch.randn(T * top_k, I, generator=torch.Generator().manual_seed(4)).mul(30).to(torch.float8_e4m3fn)
    a_scale = torch.rand(T * top_k, generator=torch.Generator().manual_seed(5))
    ref2 = accuracy.gemm2_reference_f64(a_q, a_scale, ex, w, ids)
    flat = ids.reshape(-1).long()
    for r in range(T * top_k):
        e, t = int(flat[r]), r // top_k
        if not 0 <= e < E:  # masked: zero rows
            assert (ref1[r] == 0).all() and (ref2[r] == 0).all()
            continue
        torch.testing.assert_close(ref1[r], xq[t] @ w13[e, :I].T, rtol=1e-13, atol=0)
        a = a_q[r].float().double() * float(a_scale[r])
        torch.testing.assert_close(ref2[r], (a @ w2[e].T) * float(w[t, r % top_k]), rtol=1e-13, atol=0)
    assert (ref1[4 * top_k:5 * top_k] == 0).all()
    # the trick needs zero up rows and no global scale
    _, ex_up = _gemm_experts(make_source, E, H, I, zero_up=False)
    with pytest.raises(ValueError, match="up rows"):
        accuracy.gemm1_reference_f64(x, ex_up, ids)
    src["w13_global_scale"] = torch.full((E,), 1.5)
    with pytest.raises(ValueError, match="global scales"):
        accuracy.gemm1_reference_f64(x, mxmoe.prepare_weights(**src), ids)


def test_from_slot_order_inverts_the_kernels_order():
    from mxmoe.prepare import e4m3_slot_order

    q = torch.randint(0, 256, (5, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    slotted = e4m3_slot_order(q)
    assert not torch.equal(slotted, q)  # the order is not the identity
    assert torch.equal(accuracy.from_slot_order(slotted), q)


def test_zero_up_experts_make_swigluoai_at_alpha_0_half_the_gate():
    """The activation the GEMM-level case relies on: swigluoai, alpha 0, limit 1e30 on [gate | 0] is gate / 2
    exactly, also for large and negative gates."""
    from mxmoe.activation import apply_activation

    gate = torch.tensor([[-3e5, -1.0, -0.0, 0.0, 1e-30, 2.5, 7.0, 3e7]])
    h = torch.cat([gate, torch.zeros_like(gate)], dim=1)
    y = apply_activation(h, "swigluoai", accuracy.GEMM_LEVEL_LIMIT, accuracy.GEMM_LEVEL_ALPHA)
    assert torch.equal(2 * y, gate)
    experts, _ = testing.make_experts(4, 64, 32, seed=1, zero_up=True)
    w13, _ = mxmoe.reference.decode_expert(experts, 2)
    assert (w13[32:] == 0).all() and (w13[:32] != 0).any()
    full, _ = testing.make_experts(4, 64, 32, seed=1)
    assert torch.equal(full.w2, experts.w2) and (mxmoe.reference.decode_expert(full, 2)[0][32:] != 0).any()


@pytest.mark.usefixtures("no_triton_interpret")
def test_gemm_level_on_the_emulation(monkeypatch):
    """Without the kernels (CPU, no interpreter) ``gemm_level`` measures the emulation's FP32 GEMMs: FP32 rounding
    only. A wrong row (another route's) is caught."""
    case = Case("g", "", 4, 64, 96, 3, T=9, routing="masked", zero_x_row=True, kind="gemm")
    p = check.build_problem(case)
    assert p.masked_rows.numel() >= 1
    metrics, checks = accuracy.gemm_level(p.x, p.experts, p.topk_weights, p.topk_ids)
    assert all(checks.values()) and "gemm2:route_slots" not in checks  # (a kernel-path check)
    assert 0 < metrics["w4a8_gemm1_vs_f64"] < 1e-6 and 0 < metrics["w4a8_gemm2_vs_f64"] < 1e-6
    assert metrics["w4a8_gemm1_vs_f64"] <= metrics["w4a8_gemm1_worst_route"] < 1e-6
    real = accuracy._emulated_gemm1_rows

    def swapped(*args):
        rows = real(*args)
        valid = (rows != 0).any(1).nonzero().squeeze(1)
        rows[valid[0]], rows[valid[1]] = rows[valid[1]].clone(), rows[valid[0]].clone()
        return rows

    monkeypatch.setattr(accuracy, "_emulated_gemm1_rows", swapped)
    metrics, _ = accuracy.gemm_level(p.x, p.experts, p.topk_weights, p.topk_ids)
    assert metrics["w4a8_gemm1_vs_f64"] > 0.1 and metrics["w4a8_gemm1_worst_route"] > 0.5


def test_gemm_level_refuses_biases():
    experts, _ = testing.make_experts(4, 64, 32, seed=1, zero_up=True, biases=True)
    w, ids, _, _ = testing.make_routing("uniform", 3, 4, 2)
    with pytest.raises(ValueError, match="biases"):
        accuracy.gemm_level(torch.randn(3, 64).bfloat16(), experts, w, ids)


@interpret
@pytest.mark.slow
def test_gemm_level_runs_the_kernels_in_the_interpreter(monkeypatch):
    """The plain-Triton kernels (FP32 dots in the interpreter) through ``launch.gemm1_rows`` and a W4A8 call with an
    FP32 ``routed_out``: far inside 1.5e-3, every check true. Taking the workspace's codes in their stored slot order
    (no ``from_slot_order``) breaks GEMM2's operands, and a GEMM1 that does not run leaves the NaN the intermediate
    was filled with."""
    case = Case("g", "", 4, 64, 96, 3, T=9, routing="masked", zero_x_row=True, kind="gemm")
    p = check.build_problem(case)
    metrics, checks = accuracy.gemm_level(p.x, p.experts, p.topk_weights, p.topk_ids)
    assert checks.get("gemm2:route_slots") is True  # the kernel path ran
    assert all(checks.values()), checks
    assert metrics["w4a8_gemm1_vs_f64"] < 1e-6 and metrics["w4a8_gemm2_vs_f64"] < 1e-6, metrics
    with monkeypatch.context() as m:
        m.setattr(accuracy, "from_slot_order", lambda q: q)
        metrics, _ = accuracy.gemm_level(p.x, p.experts, p.topk_weights, p.topk_ids)
        assert metrics["w4a8_gemm2_vs_f64"] > 0.1
    from mxmoe._details import launch

    real = launch._gemm_launches

    def no_gemm1(*args, **kw):
        return real(*args, **kw) if not kw.get("gemm1", True) else []

    monkeypatch.setattr(launch, "_gemm_launches", no_gemm1)
    _, checks = accuracy.gemm_level(p.x, p.experts, p.topk_weights, p.topk_ids)
    assert checks["gemm1:written"] is False


@interpret
@pytest.mark.slow
def test_check_command_gemm_case_in_the_interpreter(capsys):
    cases = [Case("gemm_tiny", "tiny GEMM-level", 4, 64, 96, 2, T=6, routing="masked", zero_x_row=True, kind="gemm"),
             Case("layer_tiny", "tiny layer", 4, 64, 96, 2, T=6, routing="masked")]
    assert check.run_checks(cases, torch.device("cpu")) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "interpreter" in lines[0] and "GEMM-level (W4A8):" in lines
    gemm_header = lines[lines.index("GEMM-level (W4A8):") + 1]
    assert "gemm1~f64" in gemm_header and "gemm2~f64" in gemm_header and "a8 excess" not in gemm_header
    layer_header = next(line for line in lines if line.startswith("case") and "a8 tok excess" in line)
    assert lines.index(layer_header) > lines.index(gemm_header)  # a header wherever the kind changes
    assert "2 passed, 0 failed on cpu" in out
