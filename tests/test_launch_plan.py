"""Launch plans (``mxmoe._details.launch_plan``) and the launches a call makes.

CPU: a plan builds each launch's arguments from the call's pointer table (views of workspace buffers at their
offsets, the rest constants), refuses what it could not keep, and replays with new pointers; the launch sequence of a call has the expected number of
kernels and no torch op but views. GPU (marked): the first call of a kind records a plan, the next ones hit it, and
plan replays are bitwise the JIT's launches, also with new inputs, under graph capture, and when the environment
changes between calls.
"""
from __future__ import annotations

import os

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction
from torch.utils._python_dispatch import TorchDispatchMode

import mxmoe
from mxmoe import testing
from mxmoe._details.launch_plan import KernelLaunch, LaunchPlan


def _two_pointer_kernel(a_ptr, pair, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = 3):
    pass


_TWO_POINTER_PARAMS = JITFunction(_two_pointer_kernel).params  # (a JITFunction also under the interpreter)


class _FakeCompiled:
    function, packed_metadata = 11, "packed"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _FakeKernel:
    """A JIT kernel's interface as ``KernelLaunch`` and ``LaunchPlan`` use it: ``params``, ``kernel[grid](...)``."""

    def __init__(self):
        self.params = _TWO_POINTER_PARAMS
        self.compiled = _FakeCompiled()
        self.jit_calls = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.jit_calls.append((grid, args, meta))
            return self.compiled
        return launch


def test_a_plan_builds_each_launch_from_the_pointer_table():
    kernel = _FakeKernel()
    x, out = torch.ones(8), torch.zeros(8)
    buffer = torch.zeros(64, dtype=torch.int32)  # a workspace buffer: views of it at fixed offsets
    launch = KernelLaunch(kernel, (5,), (x, (buffer[16:], out), 7), dict(BLOCK=32, num_warps=4))
    plan = LaunchPlan.record([launch], [x, out, buffer], views_from=2)
    assert len(kernel.jit_calls) == 1 and len(plan) == 1  # recording is the first call's launch
    plan.run((1000, 2000, 5000), stream=9)
    (args,) = kernel.compiled.launches
    assert args[:9] == (5, 1, 1, 9, 11, "packed", None, None, None)
    # every parameter in order, the constexprs with their given or default values
    assert args[9:] == (1000, (5000 + 64, 2000), 7, 32, 3)
    plan.run((3000, 4000, 6000), stream=9)
    assert kernel.compiled.launches[1][9:11] == (3000, (6000 + 64, 4000))


def test_a_plan_refuses_pointers_it_could_not_keep():
    buffer, x = torch.zeros(64), torch.ones(8)
    with pytest.raises(AssertionError, match="plan cannot keep it"):  # a view of a call tensor
        LaunchPlan.record([KernelLaunch(_FakeKernel(), (1,), (x[2:], buffer, 1), dict(BLOCK=2))], [x, buffer],
                          views_from=1)
    temporary = torch.zeros(4)
    with pytest.raises(AssertionError, match="plan cannot keep it"):
        LaunchPlan.record([KernelLaunch(_FakeKernel(), (1,), (x, temporary, 1), dict(BLOCK=2))], [x, buffer],
                          views_from=1)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


VIEW_OPS = {"slice", "view", "alias", "as_strided", "select", "_reshape_alias", "detach"}


@pytest.mark.parametrize("T,path,expected", [
    (3, "w4a16", ["route_pack_small", "moe_gemm", "moe_gemm", "topk_sum"]),
    (600, "w4a16", ["route_count", "route_scatter", "moe_gemm", "moe_gemm", "topk_sum"]),
    (600, "w4a8", ["route_count", "route_scatter", "quantize_rows", "moe_gemm", "quantize_rows", "moe_gemm",
                   "topk_sum"]),
])
def test_a_call_launches_these_kernels_and_no_torch_op(T, path, expected):
    """The plain-Triton sequence (the CPU's; the GPU's Gluon kernels add the direct path at T <= 4: two launches).
    Describing a call runs no torch op but views: no fill, no zeroing."""
    from mxmoe._details.launch import describe
    from mxmoe.selection import plan_layer

    E, H, I, top_k = 6, 64, 64, 2
    experts, _ = testing.make_experts(E, H, I, seed=0)
    ws = mxmoe.Workspace(experts, T, top_k, fp8=True)
    x = torch.randn(T, H).bfloat16()
    ids = torch.randint(0, E, (T, top_k), dtype=torch.int32)
    w = torch.rand(T, top_k)
    out, plan = torch.empty_like(x), plan_layer(T * top_k, precision=path)
    with _OpNames() as ops:
        launches = describe(x, experts, w, ids, plan, None, out, ws)[0]
    names = [launch.kernel.fn.__name__.removesuffix("_kernel") for launch in launches]
    assert names == expected
    assert ops.names <= VIEW_OPS, ops.names - VIEW_OPS


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels in Triton's interpreter")
def test_a_kind_of_call_records_one_plan_that_later_calls_hit(monkeypatch):
    """``launch.run_layer``'s cache on the CPU (plans made to apply, the recorded plan a stand-in): a call records,
    the same call again hits with a pointer table of call tensors, experts and workspace; another layer's experts
    and another workspace hit the same plan; another T, ``MXMOE_KERNEL`` or path records anew; overrides run the
    JIT path."""
    from mxmoe._details import launch
    from mxmoe._details.config import overrides

    class StandIn:
        def __init__(self):
            self.tables = []

        def run(self, pointers, stream):
            self.tables.append(pointers)

    recorded = []

    def record(launches, table, views_from):
        recorded.append(StandIn())
        assert views_from == 5 + 10 + 4 and len(table) == views_from + len(mxmoe.Workspace.BUFFERS)
        return recorded[-1]

    monkeypatch.setattr(launch, "_direct_launches", lambda x: True)
    monkeypatch.setattr(launch.LaunchPlan, "record", staticmethod(record))
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.delenv("MXMOE_KERNEL", raising=False)
    E, H, I, top_k = 4, 64, 64, 2
    layer_a, layer_b = (testing.make_experts(E, H, I, seed=s)[0] for s in (0, 1))
    ws_a, ws_b = mxmoe.Workspace(layer_a, 8, top_k), mxmoe.Workspace(layer_a, 8, top_k)

    def call(T, experts=layer_a, ws=ws_a, **kw):
        x = torch.randn(T, H).bfloat16()
        ids = torch.randint(0, E, (T, top_k), dtype=torch.int32)
        return mxmoe.fused_moe(x, experts, torch.rand(T, top_k), ids, workspace=ws, precision="w4a16", **kw)

    call(3)
    assert len(recorded) == 1 and not recorded[0].tables
    call(3)
    call(3, experts=layer_b, ws=ws_b)
    assert len(recorded) == 1 and len(recorded[0].tables) == 2
    first, second = recorded[0].tables
    assert len(first) == 5 + 10 + 4 + len(mxmoe.Workspace.BUFFERS)
    assert first[5] == layer_a.w13.data_ptr() and second[5] == layer_b.w13.data_ptr()  # the experts' addresses
    assert first[19] == ws_a.counts.data_ptr() and second[19] == ws_b.counts.data_ptr()  # the workspace's
    call(5)
    monkeypatch.setenv("MXMOE_KERNEL", "triton")
    call(3)
    assert len(recorded) == 3
    with overrides(pdl=False):
        call(3)
        call(7)
    assert len(recorded) == 3 and len(recorded[0].tables) == 2


# --------------------------------------------------------------------------------------------------------- GPU


def _gpu_problem(T, E=16, H=512, I=256, top_k=4, seed=0):
    experts, _ = testing.make_experts(E, H, I, seed=seed, device="cuda", gen_device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed + T)
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, top_k), generator=g, device="cuda", dtype=torch.int32)
    w = torch.rand(T, top_k, generator=g, device="cuda")
    return experts, x, w, ids


def _jit(fn):
    """``fn`` with the launches through the JIT (any overrides set: no plan)."""
    from mxmoe._details.config import overrides

    with overrides(pdl=True):
        return fn()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 40, 700])
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
@pytest.mark.parametrize("ids_dtype,mapped", [(torch.int32, False), (torch.int64, True)])
def test_plans_replay_bitwise_the_jit_launches(T, precision, ids_dtype, mapped):
    from mxmoe._details.launch import PLAN_STATS

    experts, x, w, ids = _gpu_problem(T)
    emap = None
    if mapped:  # 20 global experts, 4 of them elsewhere
        emap = torch.tensor([*range(16), -1, -1, -1, -1], dtype=torch.int32, device="cuda")
        ids = torch.where(ids % 5 == 0, ids + 4, ids)
    ids = ids.to(ids_dtype)
    ws = mxmoe.Workspace(experts, T, ids.shape[1], fp8=True)
    kw = dict(precision=precision, workspace=ws, expert_map=emap)
    expected = _jit(lambda: mxmoe.fused_moe(x, experts, w, ids, **kw))
    before = dict(PLAN_STATS)
    first = mxmoe.fused_moe(x, experts, w, ids, **kw)
    second = mxmoe.fused_moe(x, experts, w, ids, **kw)
    assert PLAN_STATS["recorded"] == before["recorded"] + 1 and PLAN_STATS["hits"] == before["hits"] + 1
    assert torch.equal(first.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(second.view(torch.int16), expected.view(torch.int16))
    # new call tensors (other addresses, other values) through the same plan
    x2, w2 = torch.randn_like(x.float()).bfloat16(), torch.rand_like(w)
    ids2 = ids.flip(0).contiguous()
    out2 = torch.full_like(x, float("nan"))
    mxmoe.fused_moe(x2, experts, w2, ids2, out=out2, **kw)
    assert PLAN_STATS["hits"] == before["hits"] + 2
    expected2 = _jit(lambda: mxmoe.fused_moe(x2, experts, w2, ids2, **kw))
    assert torch.equal(out2.view(torch.int16), expected2.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_one_plan_serves_every_layer_and_workspace_of_a_kind(precision):
    """Another layer's experts (same shapes) and another workspace reuse the plan: their addresses are the pointer
    table's, not the plan's; the results are bitwise the JIT's."""
    from mxmoe._details.launch import PLAN_STATS

    layer_a, x, w, ids = _gpu_problem(300, seed=0)
    layer_b = _gpu_problem(300, seed=1)[0]
    ws_a, ws_b = mxmoe.Workspace(layer_a, 300, 4, fp8=True), mxmoe.Workspace(layer_a, 512, 4, fp8=True)
    mxmoe.fused_moe(x, layer_a, w, ids, precision=precision, workspace=ws_a)
    recorded = PLAN_STATS["recorded"]
    for experts, ws in ((layer_b, ws_a), (layer_a, ws_b), (layer_b, ws_b)):
        got = mxmoe.fused_moe(x, experts, w, ids, precision=precision, workspace=ws)
        expected = _jit(lambda: mxmoe.fused_moe(x, experts, w, ids, precision=precision, workspace=ws))
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert PLAN_STATS["recorded"] == recorded


@pytest.mark.gpu
def test_a_graph_captures_a_plan_replay():
    experts, x, w, ids = _gpu_problem(5)
    ws = mxmoe.Workspace(experts, 5, 4)
    out = torch.empty_like(x)
    for _ in range(2):  # record, then hit
        mxmoe.fused_moe(x, experts, w, ids, out=out, workspace=ws)
    eager = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mxmoe.fused_moe(x, experts, w, ids, out=out, workspace=ws)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.gpu
def test_plans_follow_the_environment_between_calls(monkeypatch):
    from mxmoe._details.launch import PLAN_STATS

    experts, x, w, ids = _gpu_problem(64)
    ws = mxmoe.Workspace(experts, 64, 4, fp8=True)
    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "0")
    out16, ran = mxmoe.fused_moe(x, experts, w, ids, workspace=ws, return_precision=True)
    assert ran == "w4a16"
    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "128")
    out8, ran = mxmoe.fused_moe(x, experts, w, ids, workspace=ws, return_precision=True)
    assert ran == "w4a8"
    assert torch.equal(out8.view(torch.int16), _jit(lambda: mxmoe.fused_moe(x, experts, w, ids, precision="w4a8",
                                                                           workspace=ws)).view(torch.int16))
    monkeypatch.setenv("MXMOE_KERNEL", "triton")  # another kernel choice: another plan
    recorded = PLAN_STATS["recorded"]
    plain = mxmoe.fused_moe(x, experts, w, ids, workspace=ws, precision="w4a16")
    assert PLAN_STATS["recorded"] == recorded + 1
    assert torch.equal(plain.view(torch.int16), _jit(lambda: mxmoe.fused_moe(x, experts, w, ids, precision="w4a16",
                                                                            workspace=ws)).view(torch.int16))
    assert relative_l2_ok(plain, out16)


def relative_l2_ok(a, b) -> bool:
    return mxmoe.relative_l2(a, b) < 1e-2


def _triton_source(module: str) -> str:
    """The text of one of Triton's modules, without importing it (its launcher's form is what a plan relies on)."""
    import importlib.util

    with open(importlib.util.find_spec(module).origin) as f:
        return " ".join(f.read().split())  # (whitespace normalized: the calls span lines)


def test_plans_call_the_installed_tritons_launchers_in_their_form():
    """A plan calls a compiled kernel's launcher the way the JIT does (every release), and on the releases of
    ``DIRECT_LAUNCH_FORMS`` the C launch function the way ``CudaLauncher.__call__`` does. Triton 3.9 changed the C
    function; this test, in CI's two Triton stages, is what says when a release calls it differently."""
    import triton

    from mxmoe._details.launch_plan import DIRECT_LAUNCH_FORMS

    jit = _triton_source("triton.runtime.jit")
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *") in jit
    driver = _triton_source("triton.backends.nvidia.driver")
    form = DIRECT_LAUNCH_FORMS.get(".".join(triton.__version__.split("+")[0].split(".")[:2]))
    if form == "spread":
        assert ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
                "global_scratch, profile_scratch, *args)") in driver
        assert "def __call__(self, gridX, gridY, gridZ, stream, function, *args):" in driver
    elif form == "tuple":
        assert ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
                "kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch, "
                "profile_scratch, self.arg_annotations, self.kernel_signature, kernel_args)") in driver
        assert ("def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, "
                "launch_enter_hook, launch_exit_hook, *args):") in driver
        assert "kernel_args = args " in driver  # (the tuple of the JIT's arguments, as a plan builds it)
        assert "self.launch = wrap_handle_tensordesc(launcher, signature, tensordesc_meta)" in driver


def test_each_release_gets_its_launch_form(monkeypatch):
    from types import SimpleNamespace

    import triton

    from mxmoe._details import launch_plan

    c_function = len  # (a builtin, as the C launch function is)
    wrapper = SimpleNamespace(launch=c_function, global_scratch_size=0, profile_scratch_size=0,
                              launch_cooperative_grid=False, launch_pdl=True, gsan_enabled=False,
                              arg_annotations="ann", kernel_signature=b"sig")
    compiled = SimpleNamespace(run=wrapper, function=7, packed_metadata="meta")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert launch_plan._launcher(compiled) == (c_function, (7, False, True, None, None, "meta", None, None, None),
                                               False)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert launch_plan._launcher(compiled) == (c_function, (7, False, True, "meta", None, None, None, None, None,
                                                            "ann", b"sig"), True)
    jit_form = (wrapper, (7, "meta", None, None, None), False)
    for version in ("3.7.0", "3.10.0+git123"):  # (releases without a known C form)
        monkeypatch.setattr(triton, "__version__", version)
        assert launch_plan._launcher(compiled) == jit_form
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    wrapper.gsan_enabled = True  # (the sanitizer adds arguments in the wrapper)
    assert launch_plan._launcher(compiled) == jit_form
    wrapper.gsan_enabled, wrapper.launch = False, lambda *a: None  # (a Python wrapper for tensor descriptors)
    assert launch_plan._launcher(compiled) == jit_form
    wrapper.launch = c_function
    for version in ("3.6.0", "3.9.0"):
        monkeypatch.setattr(triton, "__version__", version)
        wrapper.global_scratch_size = 256  # (a kernel that needs scratch memory: the wrapper allocates it)
        assert launch_plan._launcher(compiled) == jit_form
        wrapper.global_scratch_size = 0


def test_launches_ask_for_fp_fusion_explicitly():
    """Every launch through the JIT names FP fusion (what the kernels were validated with), so a Triton whose default
    differs (3.10) compiles the same kernels, and 3.9 does not warn on a user's first call."""
    from mxmoe._details.launch_plan import KernelLaunch

    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.update(grid=grid, args=args, meta=meta)
            return launch

    KernelLaunch(Kernel(), (3,), (1, 2), dict(BLOCK=64)).run()
    assert seen == dict(grid=(3,), args=(1, 2), meta=dict(enable_fp_fusion=True, BLOCK=64))
