"""The W4A8 prefill kernel (``_details/sm90_ws8.py``: a producer and two consumer warpgroups): its configs on the
CPU; on the GPU, bit-identity against the small-tile kernel with the same FP8 chains and SPEC §5's GEMM bounds (the
default chains over all of K, the tests' 1024-K chains), the reference shape and gpt-oss's (K tails of 2880)."""
from __future__ import annotations

import pytest
import torch

from mxmoe._details.config import GemmConfig, gemm_config, unfolded_config

WS8 = {"kernel": "gluon_ws8"}


def test_config_route_tiles_stages_and_chains():
    ref = gemm_config(65536, 288, 1024, 4096, True, WS8, gemm1=True)
    assert (ref.kernel, ref.block_rows, ref.block_m, ref.block_k, ref.promote) == ("gluon_ws8", 128, 256, 128, 0)
    assert ref.num_stages == 6  # 6 x (16 KB of weights + 16 KB of activations) <= 192 KB
    assert (ref.loader_regs, ref.converter_regs) == (64, 224)
    # 256-row tiles (an override or a tuned table): one m-tile per warpgroup follows the tile height, 4 stages,
    # the producer at 96 registers
    tall = gemm_config(65536, 288, 1024, 4096, True, dict(WS8, block_rows=256), gemm1=True)
    assert (tall.block_m, tall.num_stages, tall.loader_regs, tall.converter_regs) == (128, 4, 96, 208)
    small = gemm_config(8192, 288, 1024, 4096, True, WS8, gemm1=True)  # 28 rows per expert: 64-row tiles
    assert small.block_rows == 64 and small.num_stages == 8
    oss = gemm_config(32768, 128, 2880, 2880, True, WS8, gemm1=False)  # K tail of 64, N % 256 != 0
    assert oss.block_rows == 128 and oss.promote == 0
    long_k = gemm_config(65536, 256, 2048, 7168, True, WS8, gemm1=True)  # past 4096 K: chains of 4096 K
    assert long_k.block_rows == 64 and long_k.promote * long_k.block_k == 4096
    tests = gemm_config(65536, 288, 1024, 4096, True, dict(WS8, block_rows=64, promote=8), gemm1=True)
    assert tests.promote == 8
    one = gemm_config(65536, 288, 1024, 4096, True, dict(WS8, block_m=128, block_rows=256), gemm1=True)
    assert one.num_stages == 4  # one m-tile per warpgroup: 4 x (8 KB of weights + 32 KB of activations)


@pytest.mark.parametrize("bad", [dict(block_rows=128, promote=8), dict(block_rows=32), dict(block_k=64),
                                 dict(block_m=256, block_rows=256), dict(block_m=64),
                                 dict(block_m=128, block_rows=256, promote=8), dict(block_rows=128, sub_tiles=2),
                                 dict(block_m=128, block_rows=256, sub_tiles=2)])
def test_config_refuses_what_the_kernel_cannot_run(bad):
    with pytest.raises(ValueError):
        gemm_config(65536, 288, 1024, 4096, True, dict(WS8, **bad), gemm1=True)
    with pytest.raises(ValueError, match="W4A8"):
        GemmConfig(128, 256, 128, 4, 6, kernel="gluon_ws8").validate(1024, 4096, True, False)
    with pytest.raises(ValueError, match="multiples of 64"):
        GemmConfig(128, 256, 128, 4, 6, kernel="gluon_ws8").validate(1024, 4000, True, True)


def test_unfolded_experts_take_the_small_tile_kernel_on_the_same_pack():
    cfg = gemm_config(65536, 288, 1024, 4096, True, WS8, gemm1=True)
    exact = unfolded_config(cfg, True, 4096)
    assert exact.kernel == "gluon_small" and exact.block_m == 64 and exact.promote == 0
    assert exact.block_rows * exact.sub_tiles == cfg.block_rows  # the same route tiles, in 64-row sub-tiles
    tall = gemm_config(65536, 288, 1024, 4096, True, dict(WS8, block_m=128, block_rows=256), gemm1=True)
    exact = unfolded_config(tall, True, 4096)
    assert exact.block_rows * exact.sub_tiles == 256  # (its pack: 256-row tiles)


# ----------------------------------------------------------------------------------------------------------- GPU


def _case(E, H, I, top_k, T, scales="normal", seed=3):
    from mxmoe import testing

    ex = testing.make_experts(E, H, I, seed=seed, device="cuda", gen_device="cuda", scales=scales, biases=True)[0]
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:top_k] for _ in range(T)]).int()
    drop = torch.rand(T, top_k, device="cuda", generator=g)
    ids[drop < 0.05] = -1
    ids[(drop >= 0.05) & (drop < 0.08)] = E + 3
    ids[T // 3] = -1  # a token with every route masked
    w = torch.rand(T, top_k, device="cuda", generator=g)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    return ex, x, w, ids


def _call(ex, x, w, ids, variant):
    import mxmoe
    from mxmoe._details.config import overrides

    out = torch.full_like(x, float("nan"))
    per_gemm = variant if "gemm1" in variant else dict(gemm=variant)
    with overrides(**per_gemm):  # (a workspace sized under the variant: its route pack may be larger)
        ws = mxmoe.Workspace(ex, x.shape[0], ids.shape[1], fp8=True)
        mxmoe.fused_moe(x, ex, w, ids, precision="w4a8", activation="swigluoai", out=out, workspace=ws)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [((288, 4096, 1024, 8), 1024), ((288, 4096, 1024, 8), 4096),
                                     ((128, 2880, 2880, 4), 2048), ((32, 2880, 2880, 4), 1500)])
@pytest.mark.parametrize("scales", ["normal", "zero_bytes"])
def test_bitwise_the_small_tile_kernel_with_the_same_chains(shape, T, scales):
    """Both GEMMs on the new kernel and on the small-tile kernel, on the same route tiles and FP8 chains (64-row tiles:
    1024 K; 128-row tiles: all of K), masked routes, biases, swigluoai; ``zero_bytes``: some experts do not fold and
    take the exact unfolded kernel beside it. Every element written, the same bits; a second run the same."""
    from mxmoe.accuracy import bitwise_equal

    ex, x, w, ids = _case(*shape, T, scales)
    small_64 = {"kernel": "gluon_small", "block_rows": 64}
    small_128 = {"kernel": "gluon_small", "block_rows": 128, "promote": 0, "promote_smem": False}
    for small, new in ((small_64, dict(WS8, block_rows=64, promote=8)), (small_128, dict(WS8, block_rows=128)),
                       (small_64, dict(WS8, block_m=128, block_rows=128, promote=8)),  # one m-tile per warpgroup
                       (small_128, dict(WS8, block_m=128, block_rows=256)),
                       (small_128, dict(WS8, block_rows=128, pingpong=True)),  # MMAs issued in turns
                       (small_128, dict(WS8, block_m=128, block_rows=256, pingpong=True)),
                       (small_64, dict(WS8, block_m=128, block_rows=128, promote=8, pingpong=True))):
        want = _call(ex, x, w, ids, small)
        got = _call(ex, x, w, ids, new)
        assert not bool(got.isnan().any())
        assert bitwise_equal(got, want), (small, float((got.float() - want.float()).abs().max()))
        assert bitwise_equal(_call(ex, x, w, ids, new), got)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [((288, 4096, 1024, 8), 2048), ((128, 2880, 2880, 4), 2048)])
def test_gemm_level_bounds(shape, T):
    """SPEC §5: each GEMM vs float64 of the same E4M3 operands <= 1.2e-2 as the kernel runs by default (chains over
    all of K), <= 1.5e-3 with chains cut to 1024 K (the bound that finds a wrong scale, block or route)."""
    from mxmoe import accuracy, testing
    from mxmoe._details.config import overrides

    E, H, I, top_k = shape
    ex = testing.make_experts(E, H, I, seed=0, device="cuda", gen_device="cuda", zero_up=True)[0]
    _, x, w, ids = _case(*shape, T)
    for variant, bound in ((WS8, 1.2e-2), (dict(WS8, block_rows=64, promote=8), 1.5e-3)):
        with overrides(gemm=variant):
            m, checks = accuracy.gemm_level(x, ex, w, ids)
        assert all(checks.values()), checks
        assert m["w4a8_gemm1_vs_f64"] <= bound and m["w4a8_gemm2_vs_f64"] <= bound, (variant, m)


@pytest.mark.parametrize("shape,tokens,expected", [
    ((288, 4096, 1024, 8), 2048, (False, False)),   # 57 rows per expert: the small kernel (ws8 measured 15-20 % slower)
    ((288, 4096, 1024, 8), 8192, (True, False)),    # GEMM1 on 128-row tiles; GEMM2's K = 1024: the small kernel
    ((128, 2880, 2880, 4), 1024, (True, True)),     # K % 128 != 0 from 32 rows per expert
    ((128, 2880, 2880, 4), 512, (False, False)),
    ((256, 7168, 2048, 8), 8192, (False, True)),    # K past 4096: not measured
])
def test_w4a8_prefill_choice(shape, tokens, expected):
    from mxmoe._details.config import w4a8_prefill

    E, H, I, top_k = shape
    assert (w4a8_prefill(tokens * top_k, E, H), w4a8_prefill(tokens * top_k, E, I)) == expected


def test_a_small_tile_gemm_takes_the_prefill_kernels_route_tiles(monkeypatch):
    """GEMM1 on the prefill kernel, GEMM2 on the small-tile kernel: both read one route pack, so the small kernel runs
    on the prefill kernel's tile height where its own choice differs."""
    from types import SimpleNamespace

    from mxmoe._details import launch

    experts = SimpleNamespace(num_experts=288, hidden_size=4096, intermediate_size=1024)
    x = torch.zeros(4, 4096, dtype=torch.bfloat16)
    for rows, bt in ((288 * 32, 64), (288 * 60, 64), (288 * 100, 128)):
        # (GEMM1's K is H = 4096, GEMM2's I = 1024)
        monkeypatch.setattr(launch, "kernel_choice", lambda *a, k=0, **kw: "gluon_ws8" if k == 4096 else "gluon_small")
        cfg1, cfg2 = launch._configs(x, experts, rows // 4, rows, True)
        assert (cfg1.kernel, cfg2.kernel) == ("gluon_ws8", "gluon_small")
        assert cfg1.block_rows == bt and cfg2.block_rows * cfg2.sub_tiles == bt
    from mxmoe._details.config import overrides

    with overrides(gemm1={"block_m": 128, "block_rows": 256}):  # in two 128-row sub-tiles
        cfg1, cfg2 = launch._configs(x, experts, 288 * 228 // 8, 288 * 228, True)
    assert (cfg1.block_rows, cfg2.block_rows, cfg2.sub_tiles) == (256, 128, 2)


@pytest.mark.parametrize("shape,tokens,expected", [
    ((288, 4096, 1024, 8), 4096, (False, False)),   # 114 rows per expert: no 256-row packs
    ((288, 4096, 1024, 8), 8192, (True, False)),    # GEMM1 at 0.93 per slot, the same slots; GEMM2 small, in halves
    ((128, 2880, 2880, 4), 4096, (False, False)),
    ((128, 2880, 2880, 4), 5120, (True, True)),     # 160 rows per expert: one 256-row tile or two 128-row ones
    ((128, 2880, 2880, 4), 8192, (False, False)),   # 256 +- 16 rows: 20 % more slots than 128-row tiles
    ((32, 2880, 2880, 4), 8192, (True, True)),
    ((256, 7168, 2048, 8), 8192, (False, False)),   # GEMM1's K past 4096: 64-row tiles
])
def test_tall_route_tiles_where_their_expected_cost_is_lower(shape, tokens, expected):
    from mxmoe._details.config import w4a8_prefill, w4a8_tall_tiles

    E, H, I, top_k = shape
    kernels = tuple("gluon_ws8" if w4a8_prefill(tokens * top_k, E, k) else "gluon_small" for k in (H, I))
    assert w4a8_tall_tiles(tokens * top_k, E, H, I, kernels) == expected


@pytest.mark.parametrize("shape,tokens,tiles", [
    ((288, 4096, 1024, 8), 8192, ((256, 1, 128), (128, 2, 64))),    # GEMM2 the small kernel on the halves
    ((32, 2880, 2880, 4), 8192, ((256, 1, 128), (256, 1, 128))),
    ((128, 2880, 2880, 4), 4096, ((128, 1, 256), (128, 1, 256))),
])
def test_both_gemms_on_one_pack_with_256_row_tiles(monkeypatch, shape, tokens, tiles):
    """The heuristics' 256-row tiles: (block_rows, sub_tiles, block_m) of each GEMM; overrides of the tiles win."""
    from types import SimpleNamespace

    from mxmoe._details import launch
    from mxmoe._details.config import overrides, w4a8_prefill

    E, H, I, top_k = shape
    experts = SimpleNamespace(num_experts=E, hidden_size=H, intermediate_size=I)
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    rows = tokens * top_k
    monkeypatch.setattr(launch, "kernel_choice",
                        lambda *a, k=0, **kw: "gluon_ws8" if w4a8_prefill(rows, E, k) else "gluon_small")
    cfgs = launch._configs(x, experts, top_k, rows, True)
    assert tuple((c.block_rows, c.sub_tiles, c.block_m) for c in cfgs) == tiles
    with overrides(gemm={"block_rows": 128}):
        cfgs = launch._configs(x, experts, top_k, rows, True)
    assert all((c.block_rows, c.sub_tiles) == (128, 1) for c in cfgs)
