"""The custom op ``torch.ops.mxmoe.fused_moe`` and the module ``mxmoe.MoEExperts``."""
from __future__ import annotations

import io
import math
import os
import re

import pytest
import torch

import mxmoe
from mxmoe import testing
from mxmoe.op import workspace_handle
from mxmoe.prepare import expert_tensors

from test_format import gpt_oss_state_dict

cuda = pytest.mark.gpu


def _problem(device="cpu", E=4, H=64, I=64, T=7, top_k=2, biases=True):
    experts, _ = testing.make_experts(E, H, I, seed=3, device=device, biases=biases, global_scales=biases)
    w, ids, _, _ = testing.make_routing("masked", T, E, top_k, seed=4, device=device)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    return experts, x, w, ids


def _bits(t):
    return t.view(torch.int16)


class _Layer(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = mxmoe.MoEExperts(experts, activation="swigluoai")

    def forward(self, x, w, ids):
        return self.experts(x, w, ids) * 2


def test_the_op_is_registered_with_its_schema():
    schema = str(torch.ops.mxmoe.fused_moe.default._schema)
    assert re.search(r"Tensor\(a\w*!\) out", schema) and "Tensor[] weights" in schema and "str precision" in schema
    assert re.search(r"(Sym)?Int workspace", schema, re.I) and schema.endswith("-> ()")


@pytest.mark.usefixtures("no_triton_interpret")
def test_opcheck_passes():
    experts, x, w, ids = _problem()
    weights, extras, all_fold = expert_tensors(experts)
    for precision in ("w4a16", "w4a8"):
        args = (x, weights, extras, w, ids, None, torch.empty_like(x), "silu", 3.0, None, precision, all_fold, -1)
        torch.library.opcheck(torch.ops.mxmoe.fused_moe.default, args)


@pytest.mark.usefixtures("no_triton_interpret")
def test_compiled_fullgraph_module_matches_eager_on_the_cpu():
    experts, x, w, ids = _problem()
    layer = _Layer(experts)
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x, w, ids)  # traced before any eager call: the module plans its workspace when the op runs
    assert torch.equal(_bits(got), _bits(layer(x, w, ids)))
    x2 = torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16)  # new values, same graph
    assert torch.equal(_bits(compiled(x2, w, ids)), _bits(layer(x2, w, ids)))


def test_a_compiled_graph_reads_the_threshold_when_it_runs(no_triton_interpret, monkeypatch):
    monkeypatch.delenv("MXMOE_FP8_PREFILL_MIN_ROWS", raising=False)
    experts, x, w, ids = _problem()
    compiled = torch.compile(_Layer(experts), fullgraph=True)
    w4a16 = compiled(x, w, ids)
    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "1")  # every call over it from now on
    w4a8 = compiled(x, w, ids)
    kw = dict(activation="swigluoai", workspace=mxmoe.Workspace(experts, 8, 2, fp8=True))
    assert torch.equal(_bits(w4a8), _bits(mxmoe.fused_moe(x, experts, w, ids, precision="w4a8", **kw) * 2))
    assert torch.equal(_bits(w4a16), _bits(mxmoe.fused_moe(x, experts, w, ids, precision="w4a16", **kw) * 2))
    assert not torch.equal(_bits(w4a8), _bits(w4a16))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels in Triton's interpreter")
def test_the_op_runs_the_kernels_as_fused_moe_did():
    """Through the op, the interpreted kernels give their emulation's bits (W4A16) as the direct path did."""
    experts, x, w, ids = _problem()
    out = mxmoe.fused_moe(x, experts, w, ids, precision="w4a16", activation="swigluoai")
    emu = mxmoe.fused_moe_reference(x, experts, w, ids, activation="swigluoai", mode="w4a16")
    assert mxmoe.relative_l2(out, emu) < 1e-3


def test_the_op_refuses_out_overlapping_x_and_a_dead_workspace(no_triton_interpret):
    experts, x, w, ids = _problem()
    weights, extras, all_fold = expert_tensors(experts)
    with pytest.raises(ValueError, match="out must not overlap x"):
        torch.ops.mxmoe.fused_moe(x, weights, extras, w, ids, None, x, "silu", None, None, "auto", all_fold, -1)
    ws = mxmoe.Workspace(experts, 8, 2)
    handle = workspace_handle(ws)
    del ws
    with pytest.raises(ValueError, match="no live Workspace"):
        torch.ops.mxmoe.fused_moe(x, weights, extras, w, ids, None, torch.empty_like(x), "silu", None, None, "auto",
                                  all_fold, handle)


def test_state_dict_round_trip_is_bitwise(no_triton_interpret):
    experts, x, w, ids = _problem()
    m = mxmoe.MoEExperts(experts, activation="swigluoai", swiglu_limit=5.0)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    back = mxmoe.MoEExperts.from_state_dict(state)
    assert back.activation == "swigluoai" and back.swiglu_limit == 5.0
    for name, t in m.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, back.state_dict()[name]), name
    assert torch.equal(_bits(m(x, w, ids)), _bits(back(x, w, ids)))
    # into an existing module of other weights (restore lists of other lengths, biases present or not)
    other, _ = testing.make_experts(4, 64, 64, seed=9, biases=False)
    target = mxmoe.MoEExperts(other)
    target.load_state_dict(state)
    assert torch.equal(_bits(target(x, w, ids)), _bits(m(x, w, ids)))
    assert mxmoe.unprepare_weights(target.experts)["w13_scale"].equal(mxmoe.unprepare_weights(experts)["w13_scale"])


def test_zero_block_restore_survives_the_round_trip(no_triton_interpret):
    experts, _, _, _ = _problem(biases=False)
    src = mxmoe.unprepare_weights(experts)
    src["w2"][1, 3, :16] = 0
    src["w2_scale"][1, 3, 0] = 250  # lowered in the kernels' scales, restored by unprepare
    experts = mxmoe.prepare_weights(**src)
    back = mxmoe.MoEExperts.from_state_dict(mxmoe.MoEExperts(experts).state_dict())
    assert torch.equal(mxmoe.unprepare_weights(back.experts)["w2_scale"], src["w2_scale"])


def test_module_forward_is_fused_moe_with_a_planned_workspace(no_triton_interpret, monkeypatch):
    monkeypatch.delenv("MXMOE_FP8_PREFILL_MIN_ROWS", raising=False)
    experts, x, w, ids = _problem()
    m = mxmoe.MoEExperts(experts, activation="swigluoai", max_tokens=32, top_k=4)
    y = m(x, w, ids)
    assert torch.equal(_bits(y), _bits(mxmoe.fused_moe(x, experts, w, ids, activation="swigluoai")))
    ws = m._plan.workspaces[(x.device, 4, 64, 64)]
    assert ws.max_tokens == 32 and ws.top_k == 4 and not ws.fp8  # no W4A8 scratch: auto without a threshold
    m(x[:3], w[:3], ids[:3])
    assert m._plan.workspaces[(x.device, 4, 64, 64)] is ws  # planned once
    w8 = mxmoe.MoEExperts(experts, precision="w4a8")
    w8(x, w, ids)
    assert w8._plan.workspaces[(x.device, 4, 64, 64)].fp8
    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "64")
    assert mxmoe.Workspace(experts, 8, 2).fp8 and not mxmoe.Workspace(experts, 8, 2, fp8=False).fp8
    with pytest.raises(ValueError, match="activation must be one of"):
        mxmoe.MoEExperts(experts, activation="gelu")


def test_from_gpt_oss_prepares_one_layer(no_triton_interpret):
    sd, prefix = gpt_oss_state_dict("hf")
    m = mxmoe.MoEExperts.from_gpt_oss(sd, prefix)
    assert m.activation == "swigluoai" and m.source_layout == "interleaved"
    src = mxmoe.load_gpt_oss_experts(sd, prefix)
    assert torch.equal(mxmoe.unprepare_weights(m.experts)["w13"], src["w13"])
    E, H = src["w2"].shape[:2]
    x = torch.randn(3, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 0], [0, 0]], dtype=torch.int32)
    y = m(x, torch.full((3, 2), 0.5), ids)
    ref = mxmoe.fused_moe_reference(x, m.experts, torch.full((3, 2), 0.5), ids, activation="swigluoai", mode="w4a16")
    assert torch.equal(_bits(y), _bits(ref))


@cuda
def test_module_moves_to_cuda_from_cpu_prepared_weights():
    experts, x, w, ids = _problem()
    m = mxmoe.MoEExperts(experts, activation="swigluoai").to("cuda")
    assert m.w13.is_cuda and m.experts.w13.is_cuda
    y = m(x.cuda(), w.cuda(), ids.cuda())
    ref = mxmoe.fused_moe_reference(x.cuda(), m.experts, w.cuda(), ids.cuda(), activation="swigluoai", mode="w4a16")
    assert mxmoe.relative_l2(y, ref) < 5e-3


@cuda
@pytest.mark.parametrize("T", [3, 40])
def test_compiled_module_and_its_graph_replay_are_bitwise_eager_on_the_gpu(T):
    experts, x, w, ids = _problem("cuda", E=8, H=256, I=128, T=T, top_k=4)
    layer = _Layer(experts).cuda()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x, w, ids)  # traced before any eager call
    eager = layer(x, w, ids)
    assert torch.equal(_bits(got), _bits(eager))
    out = torch.empty_like(x)
    static = (x.clone(), w.clone(), ids.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(compiled(*static))  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(compiled(*static))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(eager))


def test_a_plain_eager_call_skips_the_dispatcher_and_any_other_goes_through_the_op(no_triton_interpret):
    """``fused_moe`` runs the op's body itself only where nothing could see the op (``op.runs_directly``): not under
    a dispatch mode, nor for inputs autograd follows; both ways give the same bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mxmoe.op import runs_directly

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    experts, x, w, ids = _problem()
    assert runs_directly(x, w)
    direct = mxmoe.fused_moe(x, experts, w, ids)
    with Ops() as ops:
        assert not runs_directly(x, w)
        through = mxmoe.fused_moe(x, experts, w, ids)
    assert "mxmoe.fused_moe.default" in ops.names
    assert torch.equal(_bits(direct), _bits(through))
    assert not runs_directly(x, w.clone().requires_grad_())
    with torch.no_grad():
        assert runs_directly(x, w.clone().requires_grad_())
