"""The bench's triton_kernels arm (OpenAI's matmul_ogs), on the CPU.

triton_kernels' GEMMs need a GPU (matmul_ogs asks torch.cuda for the capability and SM count; its topk launches with its
own Tensor wrapper, which Triton's interpreter cannot move to the host), so the arm's glue is checked here: its
registration and ``unavailable`` reasons, the weights it hands over (gate/up interleaved, the source bytes), the
routing arrays against a loop and against triton_kernels' own PyTorch references, the Hopper layout conversion as a
round trip, the fused SiLU-and-mul activation under the interpreter, and the whole data flow as matmul_ogs defines it
(gather, GEMM1 + activation, GEMM2 with gammas, scatter, top-k sum) emulated in torch against mxmoe's reference. The
parts that need ``triton_kernels`` skip where it is not importable (``scripts/fetch_triton_kernels.py`` exports it to
``.triton_kernels/``, which these tests put on the path when present).
"""
import importlib
import importlib.util
import os
import sys

import pytest
import torch

from conftest import w13_in_layout

import mxmoe
from mxmoe import bench, testing
from mxmoe.bench import arms
from mxmoe.bench.problem import Inputs, Shape
from mxmoe.reference import fused_moe_reference, relative_l2

_TK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".triton_kernels")
if os.path.isdir(_TK_DIR) and _TK_DIR not in sys.path:
    sys.path.append(_TK_DIR)


def _has_tk() -> bool:
    try:
        importlib.import_module("triton_kernels.matmul_ogs")
        importlib.import_module("triton_kernels.tensor")
        return True
    except Exception:
        return False


needs_tk = pytest.mark.skipif(not _has_tk(), reason="triton_kernels not importable (scripts/fetch_triton_kernels.py)")


# ---------------------------------------------------------------- registration, availability


def test_arm_is_listed_after_the_humming_arms():
    names = list(bench.ARM_NAMES)
    assert "triton-kernels-w4a16" in names
    assert names.index("triton-kernels-w4a16") > names.index("humming-w4a8")
    arm = next(a for a in arms.all_arms() if a.name == "triton-kernels-w4a16")
    assert isinstance(arm, arms.TritonKernelsArm)
    assert arm.rate == "bf16" and arm.gemm_kernel is arms.TRITON_KERNELS_GEMM_KERNEL and arm.what


def test_unavailable_without_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(arms.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton_kernels" else real(name, *a))
    why = arms.TritonKernelsArm().unavailable()
    assert why.startswith("not installed: triton_kernels") and "fetch_triton_kernels.py" in why


def test_unavailable_without_cuda(monkeypatch):
    monkeypatch.setattr(arms.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = arms.TritonKernelsArm().unavailable()
    assert "no CUDA device" in why


def test_unavailable_before_hopper(monkeypatch):
    monkeypatch.setattr(arms.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "SM80" in arms.TritonKernelsArm().unavailable()


def test_gemm_kernel_names():
    pat = arms.TRITON_KERNELS_GEMM_KERNEL
    for name in ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x256x128x1_mxmoe_silu_mul", "_p_matmul_ogs_NNT_bf16xbf16xmxfp4_x",
                 "_matmul_NNT_bf16xbf16xmxfp4_64x128x128x1"):
        assert pat.match(name), name
    for name in ("_reduce_forward", "_topk_forward", "_sum_bitmatrix_rows", "_ragged_tensor_metadata_compute",
                 "_bitmatrix_metadata_compute_stage2", "humming<...>", "_swiglu"):
        assert not pat.match(name), name


# ---------------------------------------------------------------- weights handed over


def test_interleave_gate_up_against_a_loop():
    t = torch.arange(3 * 10 * 4).reshape(3, 10, 4)
    got = arms.interleave_gate_up(t)
    for j in range(5):
        assert torch.equal(got[:, 2 * j], t[:, j]) and torch.equal(got[:, 2 * j + 1], t[:, 5 + j])


@pytest.mark.parametrize("layout", ["gate_up", "up_gate", "interleaved"])
def test_tensors_are_the_source_bytes_gate_up_interleaved(layout):
    E, H, I = 3, 64, 96
    gen = torch.Generator().manual_seed(11)
    gate, up = (torch.randn(E, I, H, generator=gen) for _ in range(2))
    w2 = torch.randn(E, H, I, generator=gen)
    (gq, gs), (uq, us), (w2q, w2s) = (mxmoe.quantize_mxfp4(t) for t in (gate, up, w2))
    b_gate, b_up = torch.randn(E, I, generator=gen), torch.randn(E, I, generator=gen)
    w13q, w13s, b13 = (w13_in_layout(g, u, layout) for g, u in ((gq, uq), (gs, us), (b_gate, b_up)))
    experts = mxmoe.prepare_weights(w13q, w13s, w2q, w2s, w13_layout=layout, b13=b13)
    t = arms.triton_kernels_mxfp4_tensors(experts)
    # row 2j = gate j, row 2j+1 = up j (triton_kernels' swiglu: gate in the even columns of GEMM1's output)
    assert torch.equal(t["w13"][:, 0::2], gq) and torch.equal(t["w13"][:, 1::2], uq)
    assert torch.equal(t["w13_scale"][:, 0::2], gs) and torch.equal(t["w13_scale"][:, 1::2], us)
    assert torch.equal(t["b13"][:, 0::2], b_gate) and torch.equal(t["b13"][:, 1::2], b_up)
    assert torch.equal(t["w2"], w2q) and torch.equal(t["w2_scale"], w2s)
    assert "b2" not in t
    assert all(v.is_contiguous() for v in t.values())


def test_lowered_zero_block_scales_decode_the_same():
    experts, _ = testing.make_experts(2, 64, 64, seed=3, scales="zero_bytes")
    t = arms.triton_kernels_mxfp4_tensors(experts)
    src = mxmoe.unprepare_weights(experts)
    want = arms.interleave_gate_up(mxmoe.dequantize_mxfp4(src["w13"], src["w13_scale"]))
    assert torch.equal(mxmoe.dequantize_mxfp4(t["w13"], t["w13_scale"]), want)


# ---------------------------------------------------------------- routing


def _route_loop(ids, E):
    flat = ids.reshape(-1).tolist()
    col = [r for e in range(E) for r in range(len(flat)) if flat[r] == e]
    row = [0] * len(flat)
    for m, r in enumerate(col):
        row[r] = m
    return col, row, [flat.count(e) for e in range(E)]


@pytest.mark.parametrize("T,E,k,kind", [(1, 4, 2, "uniform"), (37, 8, 4, "uniform"), (50, 16, 3, "hot"),
                                        (9, 32, 4, "uniform")])
def test_route_indices_against_a_loop(T, E, k, kind):
    _, ids, _, _ = testing.make_routing(kind, T, E, k, seed=T)
    col, row, hist = arms.triton_kernels_route_indices(ids, E)
    want_col, want_row, want_hist = _route_loop(ids, E)
    assert col.tolist() == want_col and row.tolist() == want_row and hist.tolist() == want_hist
    assert col.dtype == row.dtype == hist.dtype == torch.int32


def _histc_of_int_ids(monkeypatch):
    """Its torch references histogram int32 ids, which torch's CPU histc refuses: histc of their float values."""
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, *a, **kw: histc(t.float(), *a, **kw))


def _arm_routing(s: Shape, T: int, seed: int, by_topk: bool):
    """(router weights, ids, the arm's ``_routing`` of them) for a uniform routing of ``T`` tokens on ``s``."""
    w, ids, _, _ = testing.make_routing("uniform", T, s.E, s.top_k, seed=seed)
    arm = arms.TritonKernelsArm()
    arm.shape, arm.route_by_topk = s, by_topk
    inp = Inputs(T=T, x=torch.zeros(T, s.H, dtype=torch.bfloat16), topk_weights=w, topk_ids=ids, distinct_experts=0)
    return w, ids, arm._routing(inp)


@needs_tk
def test_route_indices_match_triton_kernels_torch_references(monkeypatch):
    """Its PyTorch reference of the top-k with the ids given (topk_torch) and of the bitmatrix metadata."""
    from triton_kernels.tensor import make_bitmatrix_metadata_torch
    from triton_kernels.topk import topk_torch

    _histc_of_int_ids(monkeypatch)
    T, E, k = 45, 16, 4
    w, ids, _, _ = testing.make_routing("uniform", T, E, k, seed=5)
    dense = torch.zeros(T, E).scatter_(1, ids.long(), w.float())
    sparse = topk_torch(dense, k, apply_softmax=False, y_indx=ids.to(torch.int16))
    meta = make_bitmatrix_metadata_torch(sparse.indx, sparse.mask)
    col, row, hist = arms.triton_kernels_route_indices(ids, E)
    assert torch.equal(meta.col_sorted_indx.long(), col.long())
    assert torch.equal(meta.row_sorted_indx.long(), row.long())
    assert torch.equal(meta.col_sum.long(), hist.long())
    assert torch.equal(sparse.vals.reshape(-1)[col.long()], w.float().reshape(-1)[col.long()])


@needs_tk
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in")
def test_routing_path_runs_its_ragged_metadata_kernels_in_the_interpreter():
    from triton_kernels.tensor import make_ragged_tensor_metadata_torch

    s = Shape(8, 64, 64, 3)  # top_k 3: the torch-argsort path (its topk kernel needs a power of 2)
    T = 21
    w, ids, (routing, gather, scatter) = _arm_routing(s, T, seed=2, by_topk=False)
    col, row, hist = arms.triton_kernels_route_indices(ids, s.E)
    assert torch.equal(gather.src_indx, col) and torch.equal(gather.dst_indx, row)
    assert torch.equal(scatter.src_indx, row) and torch.equal(scatter.dst_indx, col)
    assert routing.n_expts_tot == s.E and routing.n_expts_act == s.top_k
    assert torch.equal(routing.gate_scal, w.float().reshape(-1)[col.long()])
    want = make_ragged_tensor_metadata_torch(hist, T * s.top_k)
    got = routing.expt_data
    assert torch.equal(got.slice_sizes, want.slice_sizes) and torch.equal(got.slice_offs, want.slice_offs)
    assert torch.equal(got.block_offs_data, want.block_offs_data)
    assert torch.equal(got.block_schedule_data, want.block_schedule_data)


# ---------------------------------------------------------------- layouts


@needs_tk
@pytest.mark.parametrize("N,K", [(96, 160), (128, 2880)])
def test_hopper_layouts_round_trip(N, K):
    from triton_kernels.tensor import FP4
    from triton_kernels.tensor_details import layout

    E = 2
    gen = torch.Generator().manual_seed(N + K)
    w = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(100, 140, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    value, scale = arms.triton_kernels_weight(w, s, layout.HopperMXValueLayout, layout.HopperMXScaleLayout)
    # matmul_ogs' B operand: logical [E, K, N] FP4, K-major
    assert value.dtype == FP4 and list(value.shape) == [E, K, N] and list(scale.shape) == [E, K // 32, N]
    assert isinstance(value.storage.layout, layout.HopperMXValueLayout)
    assert isinstance(scale.storage.layout, layout.HopperMXScaleLayout)
    assert scale.storage.layout.num_warps == arms.TRITON_KERNELS_NUM_WARPS
    back = value.storage.layout.unswizzle_data(value.storage.data)
    back_s = scale.storage.layout.unswizzle_data(scale.storage.data)
    assert torch.equal(back[:, :K // 2, :N], w.transpose(-2, -1))
    assert torch.equal(back_s[:, :K // 32, :N], s.transpose(-2, -1))


# ---------------------------------------------------------------- the fused activation


@pytest.fixture(scope="module")
def silu_mul_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def apply(X, Y, limit, M: tl.constexpr, N: tl.constexpr):
        offs_m = tl.arange(0, M)
        x = tl.load(X + offs_m[:, None] * N + tl.arange(0, N)[None, :])
        y = arms._tk_silu_mul(x, limit)
        tl.store(Y + offs_m[:, None] * (N // 2) + tl.arange(0, N // 2)[None, :], y)

    return apply


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in")
@pytest.mark.parametrize("limit", [None, 1.5])
def test_fused_silu_mul_reads_interleaved_gate_up(silu_mul_kernel, limit):
    from mxmoe.activation import apply_activation

    M, N = 16, 64
    x = 3 * torch.randn(M, N, generator=torch.Generator().manual_seed(1))
    y = torch.empty(M, N // 2)
    silu_mul_kernel[(1,)](x, y, limit, M, N)
    gate_up = torch.cat((x[:, 0::2], x[:, 1::2]), 1)  # back to mxmoe's [gate | up]
    want = apply_activation(gate_up, "silu", swiglu_limit=limit)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the data flow, emulated


def _emulate(x, experts, w, ids, hidden=0, intermediate=0):
    """matmul_ogs' MoE as its kernels define it (_matmul_ogs: X row GatherIndx.src // top_k, bias, fused activation,
    gammas at the sorted position, write-back to row ScatterIndx.dst; matmul_ogs: the top-k rows summed by reduce),
    in torch on the arm's tensors: interleaved gate/up, expert-sorted routes (padded to ``hidden`` / ``intermediate``
    as the arm pads them, ``x`` then with zero columns)."""
    from mxmoe.activation import apply_activation

    E, k = experts.num_experts, ids.shape[1]
    T = x.shape[0]
    t = arms.triton_kernels_mxfp4_tensors(experts, hidden, intermediate)
    if t["w13"].shape[2] * 2 > x.shape[1]:
        x = torch.nn.functional.pad(x, (0, t["w13"].shape[2] * 2 - x.shape[1]))
    w13 = mxmoe.dequantize_mxfp4(t["w13"], t["w13_scale"])  # [E, 2I, H], interleaved rows
    w2 = mxmoe.dequantize_mxfp4(t["w2"], t["w2_scale"])
    col, row, hist = arms.triton_kernels_route_indices(ids, E)
    gate = w.float().reshape(-1)[col.long()]
    offs = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(hist.long(), 0)))
    h = torch.empty(T * k, w13.shape[1] // 2)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        acc = x.float()[col[lo:hi].long() // k] @ w13[e].T
        h[lo:hi] = apply_activation(torch.cat((acc[:, 0::2], acc[:, 1::2]), 1), "silu").bfloat16().float()
    routed = torch.empty(T * k, w2.shape[1])
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        y = (h[lo:hi] @ w2[e].T) * gate[lo:hi, None]
        routed[col[lo:hi].long()] = y.bfloat16().float()  # each route's row, in token order
    return routed.view(T, k, -1).sum(1).bfloat16()


def test_padded_sizes_give_the_same_outputs():
    """The arm pads H and I (zero values, zero biases) as serving engines do for its Hopper path: the output's first H
    columns are the unpadded flow's, the rest zero."""
    E, H, I, k, T = 4, 64, 96, 2, 11
    experts, _ = testing.make_experts(E, H, I, seed=5, biases=True)
    w, ids, _, _ = testing.make_routing("uniform", T, E, k, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    t = arms.triton_kernels_mxfp4_tensors(experts, 256, 128)
    assert [tuple(t[n].shape) for n in ("w13", "w13_scale", "w2", "w2_scale", "b13", "b2")] == \
        [(E, 256, 128), (E, 256, 8), (E, 256, 64), (E, 256, 4), (E, 256), (E, 256)]
    plain = _emulate(x, experts, w, ids)
    padded = _emulate(x, experts, w, ids, 256, 128)
    torch.testing.assert_close(padded[:, :H].float(), plain.float(), rtol=1e-2, atol=1e-3)
    assert relative_l2(padded[:, :H], plain) < 1e-3 and not padded[:, H:].any()


def test_emulated_data_flow_matches_the_reference():
    E, H, I, k, T = 6, 64, 96, 3, 29
    experts, _ = testing.make_experts(E, H, I, seed=4)
    w, ids, _, _ = testing.make_routing("uniform", T, E, k, seed=4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = _emulate(x, experts, w, ids)
    want = fused_moe_reference(x, experts, w, ids, mode="w4a16")
    assert relative_l2(got, want) < 5e-3
    assert relative_l2(got, fused_moe_reference(x, experts, w, ids)) < 1e-2


@needs_tk
@pytest.mark.parametrize("activation", [None, "swigluoai"])
def test_prepare_builds_matmul_ogs_operands(monkeypatch, activation):
    """prepare() on CPU tensors, the Hopper layouts named (the default ones are picked from the GPU's capability)."""
    import functools

    from triton_kernels.tensor_details import layout

    monkeypatch.setattr(arms, "triton_kernels_weight", functools.partial(
        arms.triton_kernels_weight, value_layout=layout.HopperMXValueLayout, scale_layout=layout.HopperMXScaleLayout))
    E, H, I = 4, 64, 96
    experts, _ = testing.make_experts(E, H, I, seed=1)
    if activation:
        experts = experts.with_activation(activation)
    arm = arms.TritonKernelsArm()
    arm.prepare(experts, Shape(E, H, I, 2), 8)
    Hp, Ip = 128, 128  # (each GEMM's K padded: TRITON_KERNELS_K_MULTIPLE)
    assert (arm.hidden, arm.intermediate) == (Hp, Ip) and "padded to 128, 128" in arm.note
    assert list(arm.w13.shape) == [E, Hp, 2 * Ip] and list(arm.w2.shape) == [E, Ip, Hp]
    assert list(arm.pc13.weight_scale.shape) == [E, Hp // 32, 2 * Ip]
    assert list(arm.pc2.weight_scale.shape) == [E, Ip // 32, Hp]
    assert arm.act.specs.reduction_n == 2 and arm.route_by_topk
    if activation:  # its own swiglu: gpt-oss's swigluoai with mxmoe's default alpha and limit
        assert arm.act.specs.name == "swiglu" and arm.act.fn_args == (1.702, 7.0)
    else:
        assert arm.act.specs.fn is arms._tk_silu_mul and arm.act.fn_args == (None,)
    arm.release()
    assert arm.w13 is None


@needs_tk
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in")
def test_its_topk_gets_int32_ids_and_routes_every_expert(monkeypatch):
    """The top-k path hands its ``topk`` int32 ids: with int16 ones its bitmatrix shifts ``1 << (id % 32)`` in 16 bits
    and drops experts 16-31 (gpt-oss-20b, E = 32, ran non-finite on an H100). Its kernel stands in as its torch
    reference here (the kernel needs a GPU), so this checks the ids' dtype and the routing built from them."""
    import triton_kernels.topk as tk_topk

    seen = []

    def recording_topk(x, k, apply_softmax=True, y_indx=None, **kw):
        seen.append(y_indx.dtype)
        return tk_topk.topk_torch(x, k, apply_softmax=apply_softmax, y_indx=y_indx)

    monkeypatch.setattr(tk_topk, "topk", recording_topk)
    _histc_of_int_ids(monkeypatch)
    s = Shape(32, 64, 64, 4)
    w, ids, (routing, gather, scatter) = _arm_routing(s, 19, seed=3, by_topk=True)
    assert seen == [torch.int32]
    col, row, hist = arms.triton_kernels_route_indices(ids, s.E)
    assert torch.equal(gather.src_indx.long(), col.long()) and torch.equal(gather.dst_indx.long(), row.long())
    assert torch.equal(routing.gate_scal, w.float().reshape(-1)[col.long()])
