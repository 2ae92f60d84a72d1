"""The Triton kernels themselves, run in Triton's CPU interpreter (their pure-Triton form).

With TRITON_INTERPRET=1, ``fused_moe`` on CPU tensors launches the route-pack, quantize, GEMM
and top-k kernels; their results are compared with the PyTorch emulation of the same path
(bitwise where the arithmetic is the same) and with the exact reference.
"""
from __future__ import annotations

import os

import pytest
import torch

import mxmoe
from mxmoe import fused_moe, fused_moe_reference, relative_l2

from conftest import top_scale_pair


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before import (conftest sets it without a GPU)")


def experts(E, H, I, *, seed=0, biases=False, scale_lo=118, scale_hi=124, pattern=None):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(scale_lo, scale_hi + 1, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(scale_lo, scale_hi + 1, (E, H, I // 32), generator=g, dtype=torch.uint8)
    if pattern == "zero_bytes":
        s13[:, ::3, ::2] = 0
        s2[:, 1::4, :] = 0
    elif pattern == "wide_span":  # blocks of one row 0, 10, 20, 30 binades apart
        s13 = (126 - 10 * (torch.arange(H // 32) % 4)).to(torch.uint8).expand(E, 2 * I, H // 32).contiguous()
        s2 = (126 - 10 * (torch.arange(I // 32) % 4)).to(torch.uint8).expand(E, H, I // 32).contiguous()
    kw = dict(b13=torch.randn(E, 2 * I, generator=g), b2=torch.randn(E, H, generator=g)) if biases else {}
    return mxmoe.prepare_weights(w13, s13, w2, s2, **kw)


def run_both(ex, x, w, ids, precision, **kw):
    out = torch.full_like(x, float("nan"))
    res, ran = fused_moe(x, ex, w, ids, precision=precision, out=out, return_precision=True, **kw)
    assert res is out and ran == precision
    assert not torch.isnan(out.float()).any(), "an output element was not written"
    emu = fused_moe_reference(x, ex, w, ids, mode=precision, **kw)
    exact = fused_moe_reference(x, ex, w, ids, mode="exact", **kw)
    return out, emu, exact


CASES = {
    # name: (E, H, I, T, top_k, extra)
    "partial_tiles": (6, 128, 64, 9, 3, {}),
    "k_tail_32": (4, 96, 96, 5, 2, {}),  # K = 96: BK falls back to 32
    "biases_swigluoai": (4, 64, 64, 6, 2, {"biases": True, "activation": "swigluoai"}),
    "clamped_silu": (4, 64, 64, 6, 2, {"activation": "silu", "swiglu_limit": 3.0}),
    "zero_scale_bytes": (4, 64, 64, 6, 2, {"pattern": "zero_bytes"}),
    "wide_span": (4, 128, 128, 5, 2, {"pattern": "wide_span"}),
}


@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_emulation(case, precision):
    E, H, I, T, top_k, extra = CASES[case]
    extra = dict(extra)
    ex = experts(E, H, I, biases=extra.pop("biases", False), pattern=extra.pop("pattern", None))
    if case == "wide_span":
        assert (ex.w13_scale.amax(-1).int() - ex.w13_scale.amin(-1).int()).max() == 30  # 30-binade rows
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, E, (T, top_k), generator=g, dtype=torch.int32)
    w = torch.rand(T, top_k, generator=g)
    out, emu, exact = run_both(ex, x, w, ids, precision, **extra)
    # same rounding points as the emulation; FP32 sums in another order move a few BF16 ulps at most
    assert relative_l2(out, emu) <= 2e-3, relative_l2(out, emu)
    assert relative_l2(out, exact) <= (5e-3 if precision == "w4a16" else 5e-2)


@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_masked_routes_empty_experts_expert_map(ids_dtype, precision):
    E_local, E_global, H, I, T, top_k = 4, 12, 64, 64, 8, 3
    ex = experts(E_local, H, I, seed=3)
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[4:8] = torch.arange(4, dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(-2, E_global + 2, (T, top_k), generator=g).to(ids_dtype)
    ids[0] = torch.tensor([5, 5, 5])  # one hot expert; experts 4 and 7 may stay empty
    ids[3] = -1  # a token whose routes are all masked
    x = torch.randn(T, H, generator=g).bfloat16()
    x[5] = 0  # a zero token row (scale 0 in W4A8, never NaN)
    w = torch.rand(T, top_k, generator=g)
    out, emu, exact = run_both(ex, x, w, ids, precision, expert_map=emap)
    assert (out[3] == 0).all()
    assert relative_l2(out, emu) <= 2e-3
    assert relative_l2(out, exact) <= (5e-3 if precision == "w4a16" else 5e-2)


def test_w4a16_largest_scale_byte_254():
    E, H, I, T, top_k = 4, 128, 64, 6, 2
    ex_top, ex_low = top_scale_pair(E, H, I)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, E, (T, top_k), generator=g, dtype=torch.int32)
    w = torch.rand(T, top_k, generator=g)
    out_top = fused_moe(x * 2.0 ** -100, ex_top, w, ids, precision="w4a16", out=torch.full_like(x, float("nan")))
    out_low, emu, exact = run_both(ex_low, x * 2.0 ** 30, w, ids, "w4a16")
    assert torch.equal(out_top.view(torch.int16), out_low.view(torch.int16))
    assert relative_l2(out_low, emu) <= 2e-3 and relative_l2(out_low, exact) <= 5e-3


def test_all_routes_masked_gives_zeros():
    ex = experts(4, 64, 64)
    x = torch.randn(3, 64).bfloat16()
    ids = torch.full((3, 2), -1, dtype=torch.int32)
    out = fused_moe(x, ex, torch.rand(3, 2), ids, out=torch.full_like(x, float("nan")))
    assert (out == 0).all()


@pytest.mark.parametrize("block_rows", [16, 32])
# one launch on a block of 16, 64 or 128 routes (R = 15, 60, 120), the multi-kernel pack (R = 1200)
@pytest.mark.parametrize("tokens,mapped", [(5, False), (20, True), (40, False), (40, True), (400, False)])
@pytest.mark.parametrize("subs", [1, 16])  # rank counters per expert (two count programs on one counter with 1)
def test_device_route_pack_matches_torch_pack(block_rows, tokens, mapped, subs, monkeypatch):
    from mxmoe.routing import ROUTE_BLOCK, device_route_pack
    from mxmoe.workspace import Workspace

    E, T, top_k = 7, tokens, 3
    assert (T * top_k <= ROUTE_BLOCK) == (tokens < 400)
    ex = experts(E, 64, 64)
    g = torch.Generator().manual_seed(5)
    emap = None
    if mapped:  # 10 global experts, 3 of them not here
        emap = torch.tensor([0, -1, 1, 2, 3, -1, 4, 5, 6, -1], dtype=torch.int32)
    ids = torch.randint(-1, (E if emap is None else 10) + 1, (T, top_k), generator=g, dtype=torch.int32)
    ids[:36, 0] = 2  # hot expert: several tiles where T allows
    ws = Workspace(ex, T, top_k, fp8=True)
    ws.sorted_routes.fill_(7)  # stale contents from an earlier call must not leak
    ws.expert_counts.fill_(3)
    ws.sub_offsets.fill_(4)
    ws.tile_expert.fill_(5)
    ws.tile_start.fill_(9)
    # the rank counters are zero between calls (no launch clears them): a pack of the other kind first must leave
    # them so
    other = ids[:2] if T * top_k > ROUTE_BLOCK else ids.repeat(400 // T + 1, 1)
    big = Workspace(ex, max(T, other.shape[0]), top_k, fp8=True)
    for w in (ws, big):
        w.route_subs = subs
    device_route_pack(big, other, emap, block_rows, E)
    assert not big.counts.any() and not big.route_done.any()
    pack = device_route_pack(big, ids, emap, block_rows, E)
    assert not big.counts.any() and not big.route_done.any()
    big_pack = (pack.expert_counts.clone(), pack.segment_offsets.clone(), pack.tile_expert.clone())
    pack = device_route_pack(ws, ids, emap, block_rows, E)
    assert not ws.counts.any() and not ws.route_done.any()
    assert all(torch.equal(a, b) for a, b in zip(big_pack, (pack.expert_counts, pack.segment_offsets,
                                                              pack.tile_expert)))
    ref = mxmoe.route_pack(ids, E, block_rows, expert_map=emap)
    assert torch.equal(pack.expert_counts, ref.expert_counts)
    assert torch.equal(pack.segment_offsets, ref.segment_offsets)
    assert torch.equal(pack.num_tiles, ref.num_tiles)
    assert torch.equal(pack.tile_expert, ref.tile_expert)
    assert torch.equal(pack.tile_start, ref.tile_start)
    # same routes in each expert's segment (order within a segment may differ), sentinel padding
    assert torch.equal((pack.route_slot < 0), (ref.route_slot < 0))
    valid = pack.route_slot >= 0
    assert torch.equal(pack.sorted_routes[pack.route_slot[valid].long()], torch.nonzero(valid).squeeze(1).int())
    for e in range(E):
        lo, hi = ref.segment_offsets[e].item(), ref.segment_offsets[e + 1].item()
        assert sorted(pack.sorted_routes[lo:hi].tolist()) == sorted(ref.sorted_routes[lo:hi].tolist())
    used = ref.segment_offsets[-1].item()
    assert (pack.sorted_routes[used:] == -1).all()


@pytest.mark.parametrize("E,tokens", [(2, 200), (3, 400)])  # one launch (600 routes), the multi-kernel pack (1200)
def test_device_route_pack_of_wide_tiles(E, tokens):
    """The GPU pack kernels on 256-row tiles (W4A16 prefill above ``WIDE_FROM`` rows per expert) against the torch
    pack, in a workspace sized for them."""
    from mxmoe._details.config import WIDE_FROM, WIDE_ROWS
    from mxmoe.routing import device_route_pack
    from mxmoe.workspace import Workspace

    top_k = 3
    assert tokens * top_k > WIDE_FROM * E  # the workspace makes room for the wide tiles
    ids = torch.randint(-1, E, (tokens, top_k), generator=torch.Generator().manual_seed(E), dtype=torch.int32)
    ids[: tokens // 2, 0] = 0  # a hot expert: several wide tiles
    ws = Workspace(experts(E, 64, 64), tokens, top_k)
    pack = device_route_pack(ws, ids, None, WIDE_ROWS, E)
    ref = mxmoe.route_pack(ids, E, WIDE_ROWS)
    for name in ("expert_counts", "segment_offsets", "num_tiles", "tile_expert", "tile_start"):
        assert torch.equal(getattr(pack, name), getattr(ref, name)), name
    assert (pack.num_tiles[0] > E) and torch.equal((pack.route_slot < 0), (ref.route_slot < 0))


@pytest.mark.parametrize("E,tokens", [(2, 200), (3, 400)])  # one launch (600 routes), the multi-kernel pack (1200)
def test_device_route_pack_with_extra_rows(E, tokens):
    """The wide tiles' extra rows (288 slots, 256 routes per tile but an expert's last, which holds up to 288): the
    GPU pack kernels against the torch pack, slot for slot where routes sit and where padding does; the torch pack's
    tiles by hand: an expert of 256 + 1..32 routes takes one tile, of 257 + 32 two."""
    from mxmoe._details.config import WIDE_EXTRA, WIDE_ROWS, overrides
    from mxmoe.routing import device_route_pack
    from mxmoe.workspace import Workspace

    top_k, slots = 3, WIDE_ROWS + WIDE_EXTRA
    ids = torch.randint(-1, E, (tokens, top_k), generator=torch.Generator().manual_seed(E), dtype=torch.int32)
    ids[: tokens // 3, 0] = 0  # a hot expert: several tiles
    with overrides(gemm1=dict(extra_rows=WIDE_EXTRA)):  # (the workspace sized for the pack)
        ws = Workspace(experts(E, 64, 64), tokens, top_k)
    ws.sorted_routes.fill_(7)
    pack = device_route_pack(ws, ids, None, slots, E, WIDE_EXTRA)
    ref = mxmoe.route_pack(ids, E, slots, extra=WIDE_EXTRA)
    for name in ("expert_counts", "segment_offsets", "num_tiles", "tile_expert", "tile_start"):
        assert torch.equal(getattr(pack, name), getattr(ref, name)), name
    valid = pack.route_slot >= 0
    assert torch.equal(valid, ref.route_slot >= 0)
    assert torch.equal(pack.sorted_routes[pack.route_slot[valid].long()], torch.nonzero(valid).squeeze(1).int())
    assert torch.equal(pack.sorted_routes >= 0, ref.sorted_routes[: pack.sorted_routes.numel()] >= 0)
    for e, count in enumerate(ref.expert_counts.tolist()):
        tiles = max(-(-max(count - WIDE_EXTRA, 1) // WIDE_ROWS), 1) if count else 0
        assert (ref.tile_expert == e).sum().item() == tiles
        seg = ref.sorted_routes[ref.segment_offsets[e]: ref.segment_offsets[e + 1]].view(tiles, slots) >= 0
        held = [WIDE_ROWS] * (tiles - 1) + [count - WIDE_ROWS * (tiles - 1)] if tiles else []
        assert seg.sum(1).tolist() == held and all(seg[t, :h].all() for t, h in enumerate(held))


def test_workspace_refuses_a_pack_it_has_no_room_for():
    """A pack of taller tiles than the workspace was sized for (the wide tiles below ``WIDE_FROM`` rows per expert)
    is an error, not a write past the buffers."""
    from mxmoe._details.config import WIDE_ROWS
    from mxmoe.routing import device_route_pack
    from mxmoe.workspace import Workspace

    E, T, top_k = 7, 40, 3
    ws = Workspace(experts(E, 64, 64), T, top_k)
    ids = torch.randint(0, E, (T, top_k), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    device_route_pack(ws, ids, None, 128, E)
    with pytest.raises(ValueError, match="no room"):
        device_route_pack(ws, ids, None, WIDE_ROWS, E)


def test_row_quantizer_matches_reference():
    from mxmoe._details.launch import _quantize_rows
    from mxmoe.prepare import e4m3_slot_order
    from mxmoe.reference import quantize_rows_fp8

    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 224, generator=g) * torch.tensor([1, 1e-3, 1e3, 0, 7, 1])[:, None]
    x[4, :10] = torch.tensor([448 * 7 / 0.999, -3.5, 2.25, 1e-9, -0.0, 5, 6, 7, 8, 9])
    q = torch.empty(6, 224, dtype=torch.float8_e4m3fn)
    s = torch.empty(6)
    _quantize_rows(x, q, s).run()
    q_ref, s_ref = quantize_rows_fp8(x)
    assert torch.equal(s, s_ref)
    # stored in the W4A8 kernels' slot order within each K32 block
    assert torch.equal(q.view(torch.uint8), e4m3_slot_order(q_ref.view(torch.uint8)))
    assert (s[3] == 0) and (q[3].float() == 0).all()


@pytest.mark.parametrize("K", [2080, 4160])
def test_row_quantizer_skips_padding_rows_and_spans_k_chunks(K):
    """A row in one block (read once) and over two (the last partial; read twice), with route-pack padding rows
    (``row_valid`` < 0) left as they were, the others equal to the reference."""
    from mxmoe._details.launch import _quantize_rows
    from mxmoe.prepare import e4m3_slot_order
    from mxmoe.reference import quantize_rows_fp8

    g = torch.Generator().manual_seed(3)
    rows = 37
    x = torch.randn(rows, K, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    valid = torch.arange(rows, dtype=torch.int32)
    valid[[0, 5, 6, 36]] = -1
    q = torch.full((rows, K), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((rows,), float("nan"))
    launch = _quantize_rows(x, q, s, row_valid=valid)
    assert (launch.meta["BLOCK_K"] < K) == (K > 4096)
    launch.run()
    q_ref, s_ref = quantize_rows_fp8(x)
    kept = valid >= 0
    assert torch.equal(s[kept], s_ref[kept]) and s[~kept].isnan().all()
    assert torch.equal(q.view(torch.uint8)[kept], e4m3_slot_order(q_ref.view(torch.uint8))[kept])
    assert (q.view(torch.uint8)[~kept] == 0x7F).all()

