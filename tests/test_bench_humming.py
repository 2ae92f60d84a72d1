"""The bench's Humming arms (W4A16 and W4A8) and its GEMM-alone measurement, on the CPU.

Humming (humming-kernels) runs only on a GPU, so the arms' glue is checked against a stand-in with its API and the
semantics of its indexed MoE GEMM (humming/include/humming/scheduler.cuh, epilogue/pipeline.cuh: block b of
``sorted_ids`` belongs to expert ``expert_ids[b]``, entry r reads input row ``r // top_k`` and writes output row r,
entries past the output rows and blocks past ``num_tokens_padded`` are skipped). The tests of Humming itself skip
where it is not importable, those of its kernels where there is no GPU.
"""
import dataclasses
import importlib.util
import inspect
import re
import sys
import types

import pytest
import torch

from conftest import w13_in_layout

import mxmoe
from mxmoe import bench, testing
from mxmoe.reference import quantize_rows_fp8

SILU_MUL_IMPL = "a / (1.0f + expf(-a)) * b"


# ---------------------------------------------------------------- route alignment


def _aligned_by_loop(ids, num_experts, block):
    """What an indexed MoE GEMM expects, built one route at a time: each expert's route ids ascending, its run padded
    to ``block`` with R; one expert id per block; the padded length."""
    R = len(ids)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        run = [r for r in range(R) if ids[r] == e]
        run += [R] * (-len(run) % block)
        sorted_ids += run
        expert_ids += [e] * (len(run) // block)
    return sorted_ids, expert_ids, len(sorted_ids)


@pytest.mark.parametrize("num_experts,routes,block", [(4, 6, 2), (5, 23, 4), (8, 40, 40), (3, 1, 8), (16, 64, 3)])
def test_align_routes_matches_a_loop(num_experts, routes, block):
    gen = torch.Generator().manual_seed(routes * 100 + block)
    ids = torch.randint(0, num_experts, (routes,), generator=gen)
    ids[0] = num_experts - 1  # the last expert's block is in use
    sorted_ids, expert_ids, used = bench.arms._align_routes(ids, num_experts, block)
    want_sorted, want_experts, want_used = _aligned_by_loop(ids.tolist(), num_experts, block)
    assert used.tolist() == [want_used]
    assert sorted_ids[:want_used].tolist() == want_sorted
    assert expert_ids[:want_used // block].tolist() == want_experts
    # the room past the blocks in use: the worst case, all sentinel, experts in range
    assert sorted_ids.numel() == -(-(routes + num_experts * (block - 1)) // block) * block
    assert sorted_ids.numel() % block == 0 and expert_ids.numel() == sorted_ids.numel() // block
    assert bool((sorted_ids[want_used:] == routes).all())
    assert bool(((expert_ids >= 0) & (expert_ids < num_experts)).all())
    assert sorted_ids.dtype == expert_ids.dtype == used.dtype == torch.int32


# ---------------------------------------------------------------- the weights Humming gets


@pytest.mark.parametrize("layout", ["gate_up", "up_gate", "interleaved"])
def test_humming_tensors_are_the_source_bytes_gate_rows_first(layout):
    E, H, I = 3, 64, 96
    gen = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(E, I, H, generator=gen) for _ in range(2))
    w2 = torch.randn(E, H, I, generator=gen)
    (gate_q, gate_s), (up_q, up_s), (w2_q, w2_s) = (mxmoe.quantize_mxfp4(t) for t in (gate, up, w2))
    w13_q, w13_s = w13_in_layout(gate_q, up_q, layout), w13_in_layout(gate_s, up_s, layout)
    experts = mxmoe.prepare_weights(w13_q, w13_s.view(torch.float8_e8m0fnu), w2_q, w2_s, w13_layout=layout)
    (t13, n13, k13), (t2, n2, k2) = bench.arms.humming_mxfp4_tensors(experts)
    assert (n13, k13, n2, k2) == (2 * I, H, H, I)
    # Humming's mxfp4 schema (humming/schema/mxfp4.py): uint8 [E, N, K/2] and [E, N, K/32], the bytes as given
    for t, n, k in ((t13, n13, k13), (t2, n2, k2)):
        assert set(t) == {"weight", "weight_scale"}
        assert t["weight"].dtype == t["weight_scale"].dtype == torch.uint8
        assert t["weight"].shape == (E, n, k // 2) and t["weight_scale"].shape == (E, n, k // 32)
        assert t["weight"].is_contiguous() and t["weight_scale"].is_contiguous()
    assert torch.equal(t13["weight"], torch.cat((gate_q, up_q), 1))  # [gate; up] whatever the source order
    assert torch.equal(t13["weight_scale"], torch.cat((gate_s, up_s), 1))
    assert torch.equal(t2["weight"], w2_q) and torch.equal(t2["weight_scale"], w2_s)


# ---------------------------------------------------------------- the arms' glue, with a stand-in for Humming


def _decode(weight, scale):
    """E2M1-K32 as Humming packs it (humming/include/humming/kernel/pack_weight.cuh: element i at bits 4i, so the
    low nibble first), by a table of its own."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e2m1 = torch.cat((e2m1, -e2m1))
    codes = torch.stack((weight & 0xF, weight >> 4), -1).reshape(*weight.shape[:-1], -1).long()
    return e2m1[codes] * torch.exp2(scale.float() - 127).repeat_interleave(32, -1)


class _FakeLayer:
    """HummingLayer's arguments and the semantics of its indexed MoE GEMM, in torch."""

    blocks = {}  # shape_n -> the M block the fake heuristics give that layer

    def __init__(self, shape_n, shape_k, weight_config, input_config=None, pad_n_to_multiple=1, pad_k_to_multiple=1,
                 num_experts=None, has_bias=False, torch_dtype=None):
        assert weight_config == {"quant_method": "mxfp4"} and torch_dtype == torch.bfloat16 and not has_bias
        self.n, self.k, self.E = shape_n, shape_k, num_experts
        # the input schemas the arms may pass: none (BF16) or Humming's own with E4M3 per token
        assert input_config in (None, {"quant_method": "humming", "dtype": "float8e4m3",
                                       "input_quant_mode": "dynamic_token"})
        self.fp8 = input_config is not None
        input_config and input_config.clear()  # HummingLayer edits the dict: the arm must pass a copy
        self.humming_metas = {"": types.SimpleNamespace(layer=self)}
        self.humming_config = types.SimpleNamespace(a_dtype="float8e4m3" if self.fp8 else "bfloat16")
        self.w = None

    def to(self, device):
        return self

    def load_from_tensors(self, tensors, prefix=""):
        self.tensors = tensors

    def transform(self, allow_inplace=False):
        t = self.tensors
        assert t["weight"].shape == (self.E, self.n, self.k // 2)
        assert t["weight_scale"].shape == (self.E, self.n, self.k // 32)
        self.w = _decode(t["weight"], t["weight_scale"])

    def __call__(self, inputs, outputs=None, input_scale=None, input_scale_2=None, sorted_ids=None, expert_ids=None,
                 num_tokens_padded=None, expert_layout=None, top_k=1, valid_shape_m=0, compute_config=None,
                 tuning_config=None, hadamard_block_size=None, use_pdl=None):
        assert self.w is not None, "call transform() before forward()"
        assert compute_config == {"gemm_type": "indexed"}
        for t in (sorted_ids, expert_ids, num_tokens_padded):
            assert t.dtype == torch.int32 and t.is_contiguous()
        if self.fp8 and inputs.dtype == torch.bfloat16:  # Humming quantizes unquantized inputs itself, per token
            q, s = quantize_rows_fp8(inputs)
            inputs, input_scale = q, s.unsqueeze(1)
        if self.fp8:
            assert inputs.dtype == torch.float8_e4m3fn and input_scale.shape == (inputs.shape[0], 1)
            a = inputs.float() * input_scale
        else:
            assert inputs.dtype == torch.bfloat16 and input_scale is None
            a = inputs.float()
        block = tuning_config["block_shape"][0]
        rows = inputs.shape[0] * top_k
        out = torch.full((rows, self.n), float("nan"), dtype=torch.bfloat16)  # rows not written stay NaN
        for b in range(int(num_tokens_padded[0]) // block):
            e = int(expert_ids[b])
            for r in sorted_ids[b * block:(b + 1) * block].tolist():
                if r < rows:
                    out[r] = (a[r // top_k] @ self.w[e].T).to(torch.bfloat16)
        return out


def _fake_process_input(layer, inputs, *, outputs=None, group_scales=None, token_scales=None, activation_type="none",
                        activation_impl=None, hadamard_block_size=None, layout="normal", expert_tokens=None,
                        scatter_idx=None, num_valid_tokens=None, zero_invalid=False, m_major_scale=False,
                        sublayer_name="", use_pdl=None):
    assert activation_type == "binary_split" and activation_impl == SILU_MUL_IMPL
    half = inputs.shape[1] // 2
    g, u = inputs[:, :half].float(), inputs[:, half:].float()
    a = g / (1 + torch.exp(-g)) * u
    if layer.fp8:  # the layer's input quantization, per row
        q, s = quantize_rows_fp8(a)
        return q, None, s.unsqueeze(1)
    return a.to(torch.bfloat16), None, None


def _fake_heuristics(layer_config, shape_m=None, use_f16_accum=False, use_batch_invariant=False,
                     use_m_major_input_scale=False, gemm_type="dense", device=None):
    assert gemm_type == "indexed" and isinstance(shape_m, int)
    return {"block_shape": (_FakeLayer.blocks[layer_config.layer.n], 128, 64), "use_pdl": False}


@pytest.fixture
def fake_humming(monkeypatch):
    pkg = types.ModuleType("humming")
    layer = types.ModuleType("humming.layer")
    layer.HummingLayer = _FakeLayer
    layer.HummingMethod = types.SimpleNamespace(may_process_input=_fake_process_input)
    tune = types.ModuleType("humming.tune")
    tune.get_heuristics_config = _fake_heuristics
    pkg.layer, pkg.tune = layer, tune
    for name, mod in (("humming", pkg), ("humming.layer", layer), ("humming.tune", tune)):
        monkeypatch.setitem(sys.modules, name, mod)
    return pkg


@pytest.mark.parametrize("arm_cls,mode,tol", [(bench.HummingArm, "w4a16", 0.02), (bench.HummingW4A8Arm, "w4a8", 0.02)])
@pytest.mark.parametrize("blocks", [(4, 4), (3, 5)])  # one alignment for both GEMMs, or one each
def test_humming_arm_glue_matches_reference(fake_humming, arm_cls, mode, tol, blocks):
    shape = bench.Shape(6, 64, 64, 3)  # 2I != H: the fake heuristics tell the GEMMs apart by N
    _FakeLayer.blocks = {2 * shape.I: blocks[0], shape.H: blocks[1]}
    experts, _ = testing.make_experts(shape.E, shape.H, shape.I, seed=2)
    inp = bench.make_inputs(shape, 11, torch.device("cpu"), seed=4)
    arm = arm_cls()
    arm.prepare(experts, shape, 11)
    assert arm_cls.input_config is None or len(arm_cls.input_config) == 3  # the class's dict is not handed over
    call = arm.make_call(inp)
    out = call()
    assert out.dtype == torch.bfloat16 and out.shape == (11, shape.H) and bool(torch.isfinite(out).all())
    assert arm.tiles["gemm1"]["block_shape"][0] == blocks[0] and arm.tiles["gemm2"]["block_shape"][0] == blocks[1]
    ref = mxmoe.fused_moe_reference(inp.x, experts, inp.topk_weights, inp.topk_ids, mode=mode)
    assert mxmoe.relative_l2(out, ref) < tol
    # the other precision's reference is further away: the arm is what its name says
    other = mxmoe.fused_moe_reference(inp.x, experts, inp.topk_weights, inp.topk_ids,
                                      mode="w4a8" if mode == "w4a16" else "w4a16")
    assert mxmoe.relative_l2(out, other) > 2 * mxmoe.relative_l2(out, ref)
    assert torch.equal(call(), out)  # a second call: same routes, same result (no state carried over)


def test_humming_arms_say_when_humming_is_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    for arm in (bench.HummingArm(), bench.HummingW4A8Arm()):
        assert arm.unavailable().startswith("not installed: humming")
    assert {"humming", "humming-w4a8"} <= set(bench.ARM_NAMES)
    assert bench.HummingW4A8Arm.rate == "fp8" and bench.HummingArm.rate == "bf16"


# ---------------------------------------------------------------- GEMM kernels alone


HUMMING_GEMM_NAMES = [
    # as the torch profiler names them after demangling, and mangled
    "void humming<MmaOpClass, Shape<0u, 2048u, 4096u>, Shape<40u, 256u, 64u>, Shape<40u, 32u, 64u>, Shape<0u, 0u, 0u>, "
    "Float8E4M3, Float4E2M1, BFloat16, Float8E8M0, LayerConfig, ComputeConfig, TuningConfig>(CUtensorMap_st const, "
    "void* const, void* const, void* const, void* const, void* const, void* const, void* const, void* const, "
    "unsigned int const*, unsigned int const*, unsigned int const*, unsigned int const*, CUtensorMap_st*, int*, "
    "unsigned int, unsigned int, bool)",
    "_Z7hummingI10MmaOpClass5ShapeILj0ELj2048ELj4096EEEvPKvj",
    "humming<MmaOpClass>(int)",
]
OTHER_KERNEL_NAMES = [
    "void process_input_kernel<Config, TuningConfig, (ProcessInputQuantizationPhase)0>(void const*, void*, "
    "float const*)",
    "_Z20process_input_kernelI6Config12TuningConfigLi0EEvPKvPvPKf",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >(int, "
    "at::native::FillFunctor<int>, std::array<char*, 1ul>)",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, long, "
    "unsigned int>::Policy900, false, long, long, unsigned int, int, "
    "at_cuda_detail::cub::detail::identity_decomposer_t>()",
    "nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT",  # cuBLAS: the top-k sum's batched matmul, glue, not Humming's GEMM
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas",
    "Memset (Device)",
    "void hummingbird<int>(int)",
    "void vllm::humming<int>(int)",
    "_Z11humming_fooPKv",
    "_ZN4vllm7hummingIiEEvi",
    "humming::launch_kernel",  # its torch ops, should their ranges show on the device timeline
    "humming::launch_process_input",
]


def test_humming_gemm_kernel_names():
    assert all(bench.HUMMING_GEMM_KERNEL.match(name) for name in HUMMING_GEMM_NAMES)
    assert not any(bench.HUMMING_GEMM_KERNEL.match(name) for name in OTHER_KERNEL_NAMES)
    # the profiler demangles with torch's demangler: the mangled template instance reads as the pattern expects
    demangled = torch._C._demangle("_Z7hummingI10MmaOpClassEvi")
    if demangled != "_Z7hummingI10MmaOpClassEvi":
        assert demangled == "void humming<MmaOpClass>(int)" and bench.HUMMING_GEMM_KERNEL.match(demangled)
    assert bench.HummingArm.gemm_kernel is bench.HUMMING_GEMM_KERNEL is bench.HummingW4A8Arm.gemm_kernel
    assert bench.MxmoeArm("w4a16").gemm_kernel is None


def test_position_medians_and_gemm_alone():
    gemm1, gemm2, quant = HUMMING_GEMM_NAMES[0], HUMMING_GEMM_NAMES[1], OTHER_KERNEL_NAMES[0]
    per_call = [(quant, [3, 4, 5]), (gemm1, [100, 90, 300]), (quant, [2, 2, 2]), (gemm2, [50, 70, 60]),
                ("nvjet_bmm", [9, 8, 7])]
    events = [(name, us[i]) for i in range(3) for name, us in per_call]  # launch order, call after call
    times = bench.position_medians(events, 3)
    assert times == [(quant, 4), (gemm1, 100), (quant, 2), (gemm2, 60), ("nvjet_bmm", 8)]
    ms, n = bench.gemm_alone_ms(times, bench.HUMMING_GEMM_KERNEL)
    assert n == 2 and ms == pytest.approx(0.160)
    with pytest.raises(RuntimeError, match="not the same number"):
        bench.position_medians(events[1:], 3)  # a kernel lost at the start of the session
    lost_and_extra = events[:3] + [("Memset (Device)", 1.0)] + events[4:]  # call 0 lost its GEMM2, got a memset
    with pytest.raises(RuntimeError, match="differs between calls"):
        bench.position_medians(lost_and_extra, 3)
    with pytest.raises(RuntimeError, match="no kernel matches"):
        bench.gemm_alone_ms([(quant, 4.0)], bench.HUMMING_GEMM_KERNEL)
    assert bench.position_medians([], 5) == []


def test_kernel_times_records_the_calls_after_the_warm_up():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    seen = []

    def fn():
        seen.append(1)
        torch.mm(a, b)
        torch.relu(a)

    times = bench.kernel_times(fn, calls=3, device_type="cpu")
    assert len(seen) == 4  # one warm-up call, then the three recorded
    names = [name for name, _ in times]
    assert names.count("aten::mm") == 1 and names.count("aten::relu") == 1  # one call's ops, once each
    assert all(us >= 0 for _, us in times)
    assert dict(times)["aten::mm"] > 0


def test_gemms_alone_are_measured_after_the_timings_and_reported(monkeypatch, capsys):
    shape = bench.Shape(4, 64, 32, 2)
    cfg = bench.BenchConfig(shape=shape, tokens=(1, 16))

    class GemmArm(bench.Arm):
        name = "peer"
        gemm_kernel = bench.HUMMING_GEMM_KERNEL

        def make_call(self, inp):
            return lambda: inp.T

    profiled = []

    def fake_kernel_times(fn):
        T = fn()
        profiled.append(T)
        if T == 16:
            raise RuntimeError("16 kernels recorded in 5 calls")
        return [(OTHER_KERNEL_NAMES[0], 3.0), (HUMMING_GEMM_NAMES[0], 250.0), (HUMMING_GEMM_NAMES[1], 125.0)]

    monkeypatch.setattr(bench, "kernel_times", fake_kernel_times)
    rows = [dict(T=1, arm="peer", median_ms=0.5), dict(T=16, arm="peer", median_ms=0.7),
            dict(T=1, arm="other", median_ms=0.1), dict(T=16, arm="peer-untimed", error="boom")]
    bench.measure_gemms_alone([GemmArm()], rows, cfg, torch.device("cpu"), lambda msg: None)
    assert profiled == [1, 16]
    assert rows[0]["gemm_ms"] == pytest.approx(0.375) and rows[0]["gemm_kernels"] == 2
    assert "gemm_ms" not in rows[1] and rows[1]["gemm_error"].startswith("RuntimeError: 16 kernels")
    assert "gemm_ms" not in rows[2] and "gemm_ms" not in rows[3]
    bench.print_table(rows)
    out = capsys.readouterr().out.splitlines()
    assert "GEMMs ms" in out[0]
    assert re.search(r"^\s+1 peer\s+-\s+0\.5000\s+0\.3750\s", out[1])
    assert any(re.search(r"^\s+16 peer\s+-\s+0\.7000\s+-\s.*GEMMs alone: RuntimeError: 16 kernels", line)
               for line in out)


# ---------------------------------------------------------------- Humming itself (where importable)


def _humming():
    try:
        import humming.layer
        import humming.tune
    except Exception as exc:  # not installed, or its CUDA dependencies missing
        pytest.skip(f"humming not importable: {type(exc).__name__}: {exc}")
    return humming


def test_humming_api_takes_what_the_arms_pass():
    humming = _humming()
    from humming.schema import BaseInputSchema
    from humming.config import InputQuantizationMode

    fields = {f.name for f in dataclasses.fields(humming.layer.HummingLayer)}
    assert {"shape_n", "shape_k", "weight_config", "input_config", "num_experts", "torch_dtype"} <= fields
    forward = inspect.signature(humming.layer.HummingLayer.forward).parameters
    assert {"input_scale", "sorted_ids", "expert_ids", "num_tokens_padded", "top_k", "compute_config",
            "tuning_config"} <= set(forward)
    process = inspect.signature(humming.layer.HummingMethod.may_process_input).parameters
    assert {"activation_type", "activation_impl"} <= set(process)
    heuristics = inspect.signature(humming.tune.get_heuristics_config).parameters
    assert {"shape_m", "gemm_type", "device"} <= set(heuristics)
    schema = BaseInputSchema.from_config(dict(bench.HummingW4A8Arm.input_config))
    assert str(schema.a_dtype) == "float8e4m3" and schema.input_scale_group_size == 0
    assert schema.input_quant_mode == InputQuantizationMode.DynamicToken


@pytest.mark.gpu
@pytest.mark.parametrize("arm_cls,tol_w4a16,tol_w4a8", [(bench.HummingArm, 0.02, None),
                                                        (bench.HummingW4A8Arm, 0.08, 0.03)])
def test_humming_arms_on_the_gpu(arm_cls, tol_w4a16, tol_w4a8):
    _humming()
    arm = arm_cls()
    if arm.unavailable():
        pytest.skip(arm.unavailable())
    shape = bench.Shape(8, 512, 256, 2)
    device = torch.device("cuda")
    experts, _ = testing.make_experts(shape.E, shape.H, shape.I, seed=1, device=device)
    arm.prepare(experts, shape, 300)
    for T in (1, 37, 300):
        inp = bench.make_inputs(shape, T, device, seed=0)
        call = arm.make_call(inp)
        out = call().clone()
        ref16 = mxmoe.fused_moe_reference(inp.x, experts, inp.topk_weights, inp.topk_ids, mode="w4a16")
        ref8 = mxmoe.fused_moe_reference(inp.x, experts, inp.topk_weights, inp.topk_ids, mode="w4a8")
        errors = f"T={T}: {mxmoe.relative_l2(out, ref16):.4f} vs w4a16, {mxmoe.relative_l2(out, ref8):.4f} vs w4a8"
        assert mxmoe.relative_l2(out, ref16) < tol_w4a16, errors
        if tol_w4a8 is not None:
            assert mxmoe.relative_l2(out, ref8) < tol_w4a8, errors
        ms, n = bench.gemm_alone_ms(bench.kernel_times(call), arm.gemm_kernel)
        assert n == 2 and ms > 0, (n, ms)  # one launch per GEMM
    arm.release()
