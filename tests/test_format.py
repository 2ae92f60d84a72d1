"""E2M1-K32 format: decode, quantize, gpt-oss loading (SPEC §2)."""
from __future__ import annotations

import math

import pytest
import torch

from mxmoe import dequantize_mxfp4, load_gpt_oss_experts, prepare_weights, quantize_mxfp4

# SPEC §2, written out literally (code 8 is -0).
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
GRID = sorted({abs(v) for v in SPEC_E2M1})  # 0, 0.5, ..., 6


def packed_row(low_codes, high_codes) -> torch.Tensor:
    """One packed row [1, len] from per-byte low/high nibble codes."""
    return torch.tensor([[lo | (hi << 4) for lo, hi in zip(low_codes, high_codes)]], dtype=torch.uint8)


def expected_scale_exp(amax: float) -> int:
    """Smallest e in the UE8M0 range with amax / 2**e <= 6 (0 for an all-zero block), in float64."""
    if amax == 0:
        return 0
    for e in range(-127, 128):
        if amax <= 6.0 * math.ldexp(1.0, e):
            return e
    raise AssertionError("amax beyond the UE8M0 range")


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("code", range(16))
def test_each_e2m1_code_decodes_to_spec_value(code, e2m1):
    other = (code + 5) % 16
    packed = packed_row([code] * 16, [other] * 16)
    scales = torch.tensor([[127]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scales, dtype=torch.float64)[0]
    assert SPEC_E2M1[code] == e2m1(code)  # the test's bit-field decoder agrees with the SPEC table
    assert torch.all(out[0::2] == SPEC_E2M1[code])
    assert torch.all(out[1::2] == SPEC_E2M1[other])
    # the sign bit survives even for zero: code 8 is -0
    assert torch.all(torch.signbit(out[0::2]) == bool(code & 8))
    assert torch.all(torch.signbit(out[1::2]) == bool(other & 8))


def test_nibble_order_low_nibble_is_even_k():
    packed = packed_row([2] + [0] * 15, [7] + [0] * 15)  # byte 0 = 0x72
    assert packed[0, 0].item() == 0x72
    out = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))[0]
    assert out[0].item() == 1.0 and out[1].item() == 6.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_byte_zero_is_exact_and_finite(dtype):
    packed = packed_row(range(16), range(15, -1, -1))
    out = dequantize_mxfp4(packed, torch.zeros(1, 1, dtype=torch.uint8), dtype=dtype)[0]
    assert torch.isfinite(out).all()
    for k in range(32):
        code = k // 2 if k % 2 == 0 else 15 - k // 2
        assert out[k].item() == math.ldexp(SPEC_E2M1[code], -127), (k, code)


def test_scale_byte_254_is_exact_and_finite():
    packed = packed_row(range(16), range(15, -1, -1))
    scales = torch.full((1, 1), 254, dtype=torch.uint8)
    out64 = dequantize_mxfp4(packed, scales, dtype=torch.float64)[0]
    assert torch.isfinite(out64).all()
    for k in range(32):
        code = k // 2 if k % 2 == 0 else 15 - k // 2
        assert out64[k].item() == math.ldexp(SPEC_E2M1[code], 127)
    # in float32, every value that fits (|e2m1| <= 1.5 times 2**127) is exact too
    small = packed_row([0, 1, 2, 3, 8, 9, 10, 11] * 2, [3] * 16)
    out32 = dequantize_mxfp4(small, scales, dtype=torch.float32)[0]
    assert torch.isfinite(out32).all()
    assert torch.equal(out32.double(), dequantize_mxfp4(small, scales, dtype=torch.float64)[0])
    assert out32[1].item() == 1.5 * 2.0 ** 127  # code 3 at odd k
    assert out32[4].item() == 2.0 ** 127  # code 2 at even k = 4


def test_float8_e8m0fnu_scales_match_uint8():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 4, 48), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 4, 3), generator=g, dtype=torch.uint8)
    ref = dequantize_mxfp4(packed, scales, dtype=torch.float64)
    got = dequantize_mxfp4(packed, scales.view(torch.float8_e8m0fnu), dtype=torch.float64)
    assert torch.isfinite(ref).all()
    assert torch.equal(ref, got)


def test_dequantize_matches_independent_decoder(decode_f64):
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 5, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (2, 5, 2), generator=g, dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(packed, scales, dtype=torch.float64), decode_f64(packed, scales))


@pytest.mark.parametrize("as_e8m0", [False, True])
def test_scale_byte_255_rejected(as_e8m0):
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.tensor([[127], [255]], dtype=torch.uint8)
    if as_e8m0:
        scales = scales.view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="255"):
        dequantize_mxfp4(packed, scales)


def test_dequantize_rejects_mismatched_scale_shape():
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


# ----------------------------------------------------------------------------- quantize


def test_quantize_round_trips_values_on_the_grid():
    g = torch.Generator().manual_seed(2)
    N, K = 6, 128
    codes = torch.randint(0, 16, (N, K), generator=g)
    exps = torch.randint(-20, 21, (N, K // 32), generator=g)
    # force one +-6 per block so the block's scale is exactly 2**exp
    for n in range(N):
        for b in range(K // 32):
            codes[n, b * 32 + int(torch.randint(0, 32, (1,), generator=g))] = 7 if (n + b) % 2 else 15
    table = torch.tensor(SPEC_E2M1, dtype=torch.float64)
    w = (table[codes] * torch.pow(2.0, exps.double()).repeat_interleave(32, dim=1)).float()
    packed, scales = quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2)
    assert scales.dtype == torch.uint8 and scales.shape == (N, K // 32)
    assert torch.equal(scales.long(), exps + 127)
    expected_packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(packed, expected_packed)  # bit-exact, -0 keeps its sign bit
    assert torch.equal(dequantize_mxfp4(packed, scales), w)


def test_quantize_nibble_order():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, 6.0  # codes 2 (even k) and 7 (odd k)
    packed, scales = quantize_mxfp4(w)
    assert scales.item() == 127
    assert packed[0, 0].item() == 0x72


# tie point -> magnitude it must round to (even code wins)
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("tie,expected", TIES)
@pytest.mark.parametrize("k", [-10, 0, 7])
def test_quantize_rounds_ties_to_even(tie, expected, k):
    s = 2.0 ** k
    eps = 2.0 ** -12
    # sorted grid neighbours of the tie
    lo = max(v for v in GRID if v < tie)
    hi = min(v for v in GRID if v > tie)
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, 0] = 6.0 * s  # pins the scale to 2**k
    w[0, 1], w[0, 2] = tie * s, -tie * s
    w[0, 3], w[0, 4] = tie * (1 + eps) * s, -tie * (1 + eps) * s  # just above: rounds away from zero
    w[0, 5], w[0, 6] = tie * (1 - eps) * s, -tie * (1 - eps) * s  # just below: rounds towards zero
    packed, scales = quantize_mxfp4(w.float())
    assert scales.item() == k + 127
    out = dequantize_mxfp4(packed, scales, dtype=torch.float64)[0]
    assert out[1].item() == expected * s and out[2].item() == -expected * s
    assert out[3].item() == hi * s and out[4].item() == -hi * s
    assert out[5].item() == lo * s and out[6].item() == -lo * s


@pytest.mark.parametrize("k", [-127, -126, -60, -1, 0, 1, 40, 125])
def test_quantize_scale_rule_boundaries(k):
    at = 6.0 * 2.0 ** k  # exactly 6 * 2**k: no headroom needed
    above = float(torch.nextafter(torch.tensor(at, dtype=torch.float32), torch.tensor(math.inf)))
    below = float(torch.nextafter(torch.tensor(at, dtype=torch.float32), torch.tensor(0.0)))
    w = torch.zeros(1, 4 * 32)
    w[0, 3], w[0, 32 + 9], w[0, 64 + 31], w[0, 96] = at, -above, below, 2.0 ** k
    _, scales = quantize_mxfp4(w)
    expected = [k + 127, k + 128, k + 127, max(k - 2, -127) + 127]
    assert scales[0].tolist() == expected
    assert scales[0].tolist() == [expected_scale_exp(v) + 127 for v in (at, above, below, 2.0 ** k)]


def test_quantize_scale_rule_random_blocks():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 256, generator=g) * torch.pow(2.0, torch.randint(-40, 40, (16, 1), generator=g).float())
    w[0, :32] = 0.0  # one all-zero block: documented scale 2**0
    _, scales = quantize_mxfp4(w)
    amax = w.double().reshape(16, 8, 32).abs().amax(-1)
    expected = torch.tensor([[expected_scale_exp(a) + 127 for a in row] for row in amax.tolist()], dtype=torch.uint8)
    assert torch.equal(scales, expected)
    assert scales[0, 0].item() == 127


@pytest.mark.parametrize("amax", [2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** -140, 2.0 ** -130])
def test_quantize_scale_clamps_at_smallest_byte(amax):
    w = torch.zeros(1, 32)
    w[0, 5] = amax
    packed, scales = quantize_mxfp4(w)
    assert scales.item() == 0  # smallest power of two in range, not the all-zero default
    assert torch.isfinite(dequantize_mxfp4(packed, scales)).all()


@pytest.mark.parametrize("seed", range(3))
def test_quantize_error_bound_and_nearest(seed):
    g = torch.Generator().manual_seed(seed)
    N, K = 8, 96
    w = torch.randn(N, K, generator=g) * torch.pow(2.0, torch.randint(-12, 12, (N, K // 32), generator=g).float()).repeat_interleave(32, 1)
    packed, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(packed, scales, dtype=torch.float64)
    s = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, 1)
    v = w.double() / s  # in units of the block scale
    assert (v.abs() <= 6).all()
    err = (w.double() - deq).abs() / s
    half_step = torch.where(v.abs() <= 2, 0.25, torch.where(v.abs() <= 4, 0.5, 1.0))
    assert (err <= half_step).all()
    # and deq is a nearest grid point
    grid = torch.tensor(sorted({x for g_ in GRID for x in (g_, -g_)}), dtype=torch.float64)
    nearest = (v.unsqueeze(-1) - grid).abs().amin(-1)
    assert torch.equal(err, nearest)


def test_quantize_float64_input_rounds_once():
    # just above a tie in float64, but exactly on the tie once rounded to float32
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, 0] = 6.0
    w[0, 1], w[0, 2], w[0, 3] = 0.25 + 2.0 ** -40, -(2.5 + 2.0 ** -30), 5.0 + 2.0 ** -35
    packed, scales = quantize_mxfp4(w)
    assert dequantize_mxfp4(packed, scales, dtype=torch.float64)[0, :4].tolist() == [6.0, 0.5, -3.0, 6.0]
    # float32-representable float64 input quantizes exactly like float32 input
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    for a, b in zip(quantize_mxfp4(x), quantize_mxfp4(x.double())):
        assert torch.equal(a, b)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(TypeError):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))
    bad = torch.ones(2, 32)
    bad[1, 3] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(bad)
    huge = torch.zeros(1, 32, dtype=torch.float64)
    huge[0, 7] = 6.0 * 2.0 ** 127 * (1 + 2.0 ** -20)  # finite in float64, beyond the largest scale
    with pytest.raises(ValueError, match="range"):
        quantize_mxfp4(huge)


# ----------------------------------------------------------------------------- gpt-oss loading

NAMES = {
    "original": ("block.3.mlp.", "mlp1_weight.blocks", "mlp1_weight.scales", "mlp1_bias", "mlp2_weight.blocks", "mlp2_weight.scales", "mlp2_bias"),
    "hf": ("model.layers.3.mlp.experts.", "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales", "down_proj_bias"),
}
E, H, I = 2, 64, 32


def gpt_oss_state_dict(scheme: str, seed: int = 4) -> tuple[dict, str]:
    prefix, b13, s13, bias13, b2, s2, bias2 = NAMES[scheme]
    g = torch.Generator().manual_seed(seed)
    sd = {
        prefix + b13: torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8),
        prefix + s13: torch.randint(120, 130, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
        prefix + bias13: torch.randn(E, 2 * I, generator=g).to(torch.bfloat16),
        prefix + b2: torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8),
        prefix + s2: torch.randint(120, 130, (E, H, I // 32), generator=g, dtype=torch.uint8),
        prefix + bias2: torch.randn(E, H, generator=g).to(torch.bfloat16),
        prefix + "unrelated.weight": torch.zeros(3),
    }
    return sd, prefix


def check_loaded(loaded: dict, sd: dict, scheme: str):
    prefix, b13, s13, bias13, b2, s2, bias2 = NAMES[scheme]
    assert loaded["w13_layout"] == "interleaved"
    assert torch.equal(loaded["w13"], sd[prefix + b13].reshape(E, 2 * I, H // 2))
    assert torch.equal(loaded["w2"], sd[prefix + b2].reshape(E, H, I // 2))
    assert torch.equal(loaded["w13_scale"], sd[prefix + s13])
    assert torch.equal(loaded["w2_scale"], sd[prefix + s2])
    assert torch.equal(loaded["b13"], sd[prefix + bias13])
    assert torch.equal(loaded["b2"], sd[prefix + bias2])
    # it feeds prepare_weights directly; interleaved rows become [gate; up]
    experts = prepare_weights(**loaded)
    w13, _ = experts.source_order_weights()
    assert torch.equal(w13[:, :I], loaded["w13"][:, 0::2])
    assert torch.equal(w13[:, I:], loaded["w13"][:, 1::2])
    assert torch.equal(experts.b13[:, :I], loaded["b13"][:, 0::2].float())


@pytest.mark.parametrize("scheme", ["original", "hf"])
def test_load_gpt_oss_from_state_dict(scheme):
    sd, prefix = gpt_oss_state_dict(scheme)
    check_loaded(load_gpt_oss_experts(sd, prefix=prefix), sd, scheme)


@pytest.mark.parametrize("scheme", ["original", "hf"])
def test_load_gpt_oss_from_safetensors(scheme, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    sd, prefix = gpt_oss_state_dict(scheme, seed=5)
    path = tmp_path / "layer.safetensors"
    safetensors_torch.save_file(sd, str(path))
    check_loaded(load_gpt_oss_experts(path, prefix=prefix), sd, scheme)
    check_loaded(load_gpt_oss_experts(str(path), prefix=prefix), sd, scheme)


def test_load_gpt_oss_without_biases():
    sd, prefix = gpt_oss_state_dict("hf")
    del sd[prefix + "gate_up_proj_bias"], sd[prefix + "down_proj_bias"]
    loaded = load_gpt_oss_experts(sd, prefix=prefix)
    assert "b13" not in loaded and "b2" not in loaded


def test_load_gpt_oss_errors():
    sd, prefix = gpt_oss_state_dict("original")
    with pytest.raises(KeyError):
        load_gpt_oss_experts(sd, prefix="block.4.mlp.")
    sd[prefix + "mlp1_weight.blocks"] = sd[prefix + "mlp1_weight.blocks"].reshape(E, 2 * I, H // 2)
    with pytest.raises(ValueError, match="mlp1_weight.blocks"):
        load_gpt_oss_experts(sd, prefix=prefix)
