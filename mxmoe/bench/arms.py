"""The bench's arms: mxmoe's two paths and its peers (torch grouped GEMMs, FlashInfer, Humming, OpenAI's
triton_kernels), each a class with ``unavailable`` / ``prepare`` / ``make_call``."""
from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from .._details import cdiv
from ..format import dequantize_mxfp4
from ..moe import fused_moe
from ..prepare import PreparedExperts, _from_gate_up
from ..reference import FP8_MAX
from ..workspace import Workspace

from .problem import Inputs, Shape
from .timing import HUMMING_GEMM_KERNEL


# --------------------------------------------------------------------------------------
# Arms
# --------------------------------------------------------------------------------------


class Arm:
    """One implementation being timed. Subclasses set the class attributes and methods."""

    name = "arm"
    rate = "bf16"  # which matrix rate its floor uses: "bf16" or "fp8"
    graphable = True  # may be timed as CUDA-graph replays
    what = ""  # what the timing includes and leaves out
    gemm_kernel: Optional["re.Pattern"] = None  # matches its GEMM kernels' names: their time alone is reported
    # Set by the methods where they apply, read by the bench: ``note`` (prepare: the path the arm took) and
    # ``tiles`` (make_call: the tile configs it uses for that call).

    def unavailable(self) -> Optional[str]:
        """Why this arm cannot run here ("not installed: ..."), or None."""
        return None

    def prepare(self, experts: PreparedExperts, shape: Shape, max_tokens: int) -> None:
        """One-time setup for the shape (weight conversion etc.)."""

    def make_call(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        """A zero-argument callable computing the layer for ``inp`` (output buffer owned by the arm)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what prepare() allocated."""


class MxmoeArm(Arm):
    def __init__(self, precision: str):
        self.precision = precision
        self.name = f"mxmoe-{precision}"
        self.rate = "fp8" if precision == "w4a8" else "bf16"
        self.graphable = precision == "w4a16"  # capture always runs W4A16 (SPEC §6)
        self.what = ("mxmoe.fused_moe, everything included (route pack, both GEMMs, activation, top-k sum)"
                     + ("; timed eagerly since graph capture runs W4A16" if precision == "w4a8" else ""))
        self.workspace = None

    def prepare(self, experts, shape, max_tokens):
        self.experts = experts
        self.workspace = Workspace(experts, max_tokens, shape.top_k, fp8=True)  # planned scratch, as a server would

    def make_call(self, inp):
        out = torch.empty_like(inp.x)
        kw = dict(precision=self.precision, out=out, workspace=self.workspace)
        x, experts, w, ids = inp.x, self.experts, inp.topk_weights, inp.topk_ids
        _, ran = fused_moe(x, experts, w, ids, return_precision=True, **kw)
        self.ran = ran
        return lambda: fused_moe(x, experts, w, ids, **kw)

    def release(self):
        self.workspace = None


def _group_by_expert(flat_ids: torch.Tensor, num_experts: int, align: int, capacity: int):
    """Sort routes by expert without a host sync: ``(order, dest_row, group_ends int32)``.

    Route ``order[j]`` goes to row ``dest_row[j]`` of a buffer of ``capacity`` rows in which
    expert e's group spans ``[ends[e-1], ends[e])``, its length padded to ``align``.
    """
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts  # index in sorted order of each expert's first route
    rank = torch.arange(flat_ids.numel(), device=flat_ids.device) - first_sorted[sorted_ids]
    dest = (ends - padded)[sorted_ids] + rank
    return order, dest, ends.to(torch.int32)


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    half = h.shape[-1] // 2
    g, u = h[:, :half].float(), h[:, half:].float()
    return torch.nn.functional.silu(g) * u


def _rowwise_fp8(a: torch.Tensor):
    scale = a.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (a.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _dequantized(experts: PreparedExperts, dtype=torch.bfloat16, chunk_elems: int = 1 << 26):
    """Experts' weights decoded exactly (SPEC §2) to ``dtype``: ``(w13 [E, 2I, H], w2 [E, H, I])``."""
    def decode(w, s):
        out = torch.empty(*w.shape[:-1], w.shape[-1] * 2, dtype=dtype, device=w.device)
        step = max(1, chunk_elems // max(out[0].numel(), 1))
        for e0 in range(0, w.shape[0], step):
            out[e0:e0 + step] = dequantize_mxfp4(w[e0:e0 + step], s[e0:e0 + step], dtype=torch.float32).to(dtype)
        return out

    w13, w2 = experts.source_order_weights()
    return decode(w13, experts.w13_scale), decode(w2, experts.w2_scale)


class TorchGroupedMMArm(Arm):
    name = "torch-grouped-mm-bf16"
    rate = "bf16"
    what = ("torch._grouped_mm on BF16 weights dequantized once beforehand (3.76x the MXFP4 bytes); included: "
            "argsort/gather of routes, both grouped GEMMs, SiLU-and-mul as separate torch ops, un-permute and "
            "top-k sum; excluded: the one-time dequantization")
    align = 1

    def unavailable(self):
        return None if hasattr(torch, "_grouped_mm") else f"not installed: torch {torch.__version__} has no _grouped_mm"

    def prepare(self, experts, shape, max_tokens):
        self.shape = shape
        self.w13, self.w2 = _dequantized(experts)

    def _layout(self, inp):
        R = inp.T * self.shape.top_k
        flat = inp.topk_ids.reshape(-1).long()
        capacity = R + self.shape.E * (self.align - 1)
        return R, flat, capacity

    def make_call(self, inp):
        s, (R, flat, capacity) = self.shape, self._layout(inp)
        x, w = inp.x, inp.topk_weights.reshape(-1, 1).float()
        xs = torch.zeros(capacity, s.H, dtype=torch.bfloat16, device=x.device)
        out = torch.empty_like(x)
        w13t, w2t = self.w13.transpose(1, 2), self.w2.transpose(1, 2)

        def call():
            order, dest, ends = _group_by_expert(flat, s.E, self.align, capacity)
            xs[dest] = x[order // s.top_k]
            h = torch._grouped_mm(xs, w13t, offs=ends)
            a = _silu_mul(h).to(torch.bfloat16)
            y = torch._grouped_mm(a, w2t, offs=ends)
            routed = torch.empty(R, s.H, dtype=torch.float32, device=x.device)
            routed[order] = y[dest].float() * w[order]
            torch.sum(routed.view(inp.T, s.top_k, s.H), dim=1, out=out)  # out is BF16; sum in FP32 first
            return out

        return call

    def release(self):
        self.w13 = self.w2 = None


class TorchScaledGroupedMMArm(TorchGroupedMMArm):
    name = "torch-scaled-grouped-mm-fp8"
    rate = "fp8"
    what = ("torch._scaled_grouped_mm on FP8 E4M3 weights re-quantized once per output channel from MXFP4 (lossy: "
            "K32 block scales cannot be kept; 2x the MXFP4 bytes) with row-wise FP8 activations; included: per-row "
            "FP8 quantization of x and of the intermediate, argsort/gather, both GEMMs, SiLU-and-mul, un-permute and "
            "top-k sum; excluded: the one-time weight conversion; groups padded to 16 rows")
    align = 16

    def unavailable(self):
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"not installed: torch {torch.__version__} has no _scaled_grouped_mm"
        return None

    def prepare(self, experts, shape, max_tokens):
        self.shape = shape

        def fp8(w):  # [E, N, K] -> e4m3 [E, N, K], scale fp32 [E, N]
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            sc = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                q[e], sc[e] = _rowwise_fp8(w[e])
            return q, sc

        w13, w2 = _dequantized(experts)
        self.w13, self.s13 = fp8(w13)
        del w13
        self.w2, self.s2 = fp8(w2)

    def make_call(self, inp):
        s, (R, flat, capacity) = self.shape, self._layout(inp)
        x, w = inp.x, inp.topk_weights.reshape(-1, 1).float()
        xs = torch.zeros(capacity, s.H, dtype=torch.float8_e4m3fn, device=x.device)
        xs_scale = torch.ones(capacity, dtype=torch.float32, device=x.device)
        out = torch.empty_like(x)
        w13t, w2t = self.w13.transpose(1, 2), self.w2.transpose(1, 2)

        def call():
            order, dest, ends = _group_by_expert(flat, s.E, self.align, capacity)
            xq, xsc = _rowwise_fp8(x)
            tok = order // s.top_k
            xs[dest] = xq[tok]
            xs_scale[dest] = xsc[tok]
            h = torch._scaled_grouped_mm(xs, w13t, xs_scale, self.s13, offs=ends, out_dtype=torch.bfloat16)
            aq, asc = _rowwise_fp8(_silu_mul(h))
            y = torch._scaled_grouped_mm(aq, w2t, asc, self.s2, offs=ends, out_dtype=torch.bfloat16)
            routed = torch.empty(R, s.H, dtype=torch.float32, device=x.device)
            routed[order] = y[dest].float() * w[order]
            torch.sum(routed.view(inp.T, s.top_k, s.H), dim=1, out=out)
            return out

        return call

    def release(self):
        self.w13 = self.w2 = self.s13 = self.s2 = None


class FlashInferArm(Arm):
    name = "flashinfer-cutlass-mxfp4"
    rate = "bf16"
    what = ("flashinfer.fused_moe.cutlass_fused_moe, MXFP4 weights with BF16 activations (use_w4_group_scaling, "
            "SM90 mixed-input layout via FlashInfer's interleave helpers), SwiGLU with alpha=1, beta=0 = SiLU-and-mul; "
            "everything included")

    def unavailable(self):
        if importlib.util.find_spec("flashinfer") is None:
            return "not installed: flashinfer (pip install flashinfer-python)"
        return None

    def prepare(self, experts, shape, max_tokens):
        from flashinfer import fused_moe as fi  # noqa: F401

        self.fi = fi
        self.shape = shape
        half = shape.I
        w13, w2 = experts.source_order_weights()
        w13 = torch.cat((w13[:, half:], w13[:, :half]), dim=1).contiguous()  # [up; gate] = "w3w1"
        s13 = torch.cat((experts.w13_scale[:, half:], experts.w13_scale[:, :half]), dim=1).contiguous()
        s2 = experts.w2_scale
        if hasattr(fi, "interleave_moe_weights_for_sm90_mixed_gemm"):
            w13 = fi.interleave_moe_weights_for_sm90_mixed_gemm(w13, "fp4")
            w2 = fi.interleave_moe_weights_for_sm90_mixed_gemm(w2.contiguous(), "fp4")
            s13 = fi.interleave_moe_scales_for_sm90_mixed_gemm(s13, group_size=32)
            s2 = fi.interleave_moe_scales_for_sm90_mixed_gemm(s2.contiguous(), group_size=32)
        self.w13, self.w2, self.s13, self.s2 = w13, w2, s13, s2
        dev = experts.device
        self.alpha = torch.ones(shape.E, dtype=torch.float32, device=dev)
        self.beta = torch.zeros(shape.E, dtype=torch.float32, device=dev)

    def make_call(self, inp):
        from flashinfer.fused_moe.core import ActivationType

        out = torch.empty_like(inp.x)
        ids = inp.topk_ids.to(torch.int32)
        kw = dict(input=inp.x, token_selected_experts=ids, token_final_scales=inp.topk_weights,
                  fc1_expert_weights=self.w13, fc2_expert_weights=self.w2, output_dtype=torch.bfloat16,
                  quant_scales=[self.s13.view(torch.int32), self.s2.view(torch.int32)],
                  swiglu_alpha=self.alpha, swiglu_beta=self.beta, swiglu_limit=None,
                  use_w4_group_scaling=True, activation_type=ActivationType.Swiglu, output=out)

        def call():
            self.fi.cutlass_fused_moe(**kw)
            return out

        return call

    def release(self):
        self.w13 = self.w2 = self.s13 = self.s2 = None


def _align_routes(flat_ids: torch.Tensor, num_experts: int, block: int):
    """vLLM-style route alignment without a host sync: ``(sorted_ids, expert_ids, num_padded)`` (int32).

    ``sorted_ids`` lists the route ids expert by expert, each expert's run padded to ``block`` with the sentinel
    ``R = flat_ids.numel()``, in room for the worst case (``R + E * (block - 1)`` rounded up to a block);
    ``expert_ids`` gives each ``block``-row block's expert; ``num_padded`` ([1]) is the padded length in use (the
    kernels skip the blocks past it).
    """
    capacity = -(-(flat_ids.numel() + num_experts * (block - 1)) // block) * block
    order, dest, ends = _group_by_expert(flat_ids, num_experts, block, capacity)
    sorted_ids = torch.full((capacity,), flat_ids.numel(), dtype=torch.int32, device=flat_ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block, dtype=torch.int32, device=flat_ids.device)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:]


def humming_mxfp4_tensors(experts: PreparedExperts) -> tuple:
    """The experts as Humming's ``mxfp4`` weight schema takes them, one ``(tensors, shape_n, shape_k)`` per GEMM:
    ``weight`` the E2M1 bytes (uint8 ``[E, N, K/2]``, low nibble first) and ``weight_scale`` the UE8M0 bytes
    (uint8 ``[E, N, K/32]``) as given; w13's rows ``[gate; up]`` (its ``binary_split`` activation reads the gate
    half first)."""
    w13, w2 = experts.source_order_weights()
    H, I = experts.hidden_size, experts.intermediate_size
    return (({"weight": w13.contiguous(), "weight_scale": experts.w13_scale.contiguous()}, 2 * I, H),
            ({"weight": w2.contiguous(), "weight_scale": experts.w2_scale.contiguous()}, H, I))


def _humming_path(layer) -> str:
    """What Humming made of a transformed layer: activation type and quantization, scale handling, weight layout."""
    cfg = getattr(layer, "humming_config", None)

    def value(name):
        v = getattr(cfg, name, "?")
        return getattr(v, "value", v)  # enums by their value

    return (f"{value('a_dtype')} activations (quantization {value('input_quant_mode')}), fused E8M0 scales "
            f"{value('use_fused_e8m0_scale')}, weight_scale_2 {value('weight_scale_2_type')}, packed-K layout "
            f"{value('use_packed_k_layout')}")


class HummingArm(Arm):
    name = "humming"
    rate = "bf16"
    what = ("Humming (humming-kernels) indexed MoE GEMMs on the MXFP4 weights (its mxfp4 schema: the E2M1 bytes and "
            "E8M0 scales as given, transformed once) with BF16 activations, one tuning config per GEMM from its "
            "heuristics for the call's routed rows; included: the route alignment to its M block (torch ops, no host "
            "sync), both GEMMs, SiLU-and-mul by its process-input kernel, the weighted top-k sum as one batched "
            "matmul (router weights in BF16); excluded: the one-time weight transform and kernel compilation")
    gemm_kernel = HUMMING_GEMM_KERNEL  # its GEMM kernels alone are reported next to the call (gemm_ms)
    input_config: Optional[dict] = None  # Humming's input schema; None: activations in the layer's dtype (BF16)

    def unavailable(self):
        if importlib.util.find_spec("humming") is None:
            return "not installed: humming (pip install humming-kernels)"
        return None

    def prepare(self, experts, shape, max_tokens):
        from humming.layer import HummingLayer

        self.shape = shape

        def layer(tensors, n, k):
            # a copy of input_config: HummingLayer fills the missing keys into the dict it is given
            lay = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "mxfp4"},
                               input_config=dict(self.input_config) if self.input_config else None,
                               num_experts=shape.E, torch_dtype=torch.bfloat16).to(experts.device)
            lay.load_from_tensors(tensors)
            lay.transform()
            return lay

        self.l13, self.l2 = (layer(*gemm) for gemm in humming_mxfp4_tensors(experts))
        self.note = "GEMM1: " + _humming_path(self.l13) + "; GEMM2: " + _humming_path(self.l2)

    def make_call(self, inp):
        from humming.layer import HummingMethod
        from humming.tune import get_heuristics_config

        s = self.shape
        flat = inp.topk_ids.reshape(-1).long()
        w = inp.topk_weights.view(inp.T, 1, s.top_k)
        out = torch.empty_like(inp.x)
        compute = {"gemm_type": "indexed"}
        # each GEMM's tile config from Humming's heuristics for the routed rows; its M block sets the route alignment
        t13, t2 = (get_heuristics_config(lay.humming_metas[""], shape_m=inp.T * s.top_k, gemm_type="indexed",
                                         device=inp.x.device) for lay in (self.l13, self.l2))
        self.tiles = {"gemm1": t13, "gemm2": t2}
        b13, b2 = t13["block_shape"][0], t2["block_shape"][0]
        keys = ("sorted_ids", "expert_ids", "num_tokens_padded")  # _align_routes's outputs as Humming's arguments

        def call():
            routes = {block: dict(zip(keys, _align_routes(flat, s.E, block))) for block in {b13, b2}}
            # [R, 2I]; with 8-bit activations Humming quantizes x per token first (its process-input kernel)
            h = self.l13(inp.x, **routes[b13], top_k=s.top_k, compute_config=compute, tuning_config=t13)
            # SiLU(gate) * up in FP32 from the two halves, one kernel (as vLLM's silu_and_mul); with 8-bit
            # activations the same kernel quantizes each routed row and returns its scale (else None)
            a, _, a_scale = HummingMethod.may_process_input(self.l2, h, activation_type="binary_split",
                                                            activation_impl="a / (1.0f + expf(-a)) * b")
            y = self.l2(a, input_scale=a_scale, **routes[b2], top_k=1, compute_config=compute,
                        tuning_config=t2)  # [R, H], route order
            torch.bmm(w.to(y.dtype), y.view(inp.T, s.top_k, s.H), out=out.view(inp.T, 1, s.H))
            return out

        return call

    def release(self):
        self.l13 = self.l2 = None


class HummingW4A8Arm(HummingArm):
    name = "humming-w4a8"
    rate = "fp8"
    what = ("Humming (humming-kernels) W4A8: the same MXFP4 bytes as the humming arm, transformed once for FP8 E4M3 "
            "activations (on SM90 its fused-E8M0 path: each K32 scale folded into the weights, converted to E4M3, "
            "with one factor per expert or channel in the epilogue); per call: x quantized per token to E4M3 "
            "(dynamic, FP32 scales) by its process-input kernel, the route alignment to each GEMM's M block (torch "
            "ops), its indexed GEMM1 with the heuristics' tile config, SiLU-and-mul and per-routed-row E4M3 "
            "quantization in one process-input kernel, its indexed GEMM2, the weighted top-k sum as one batched "
            "matmul; excluded: the one-time weight transform and kernel compilation")
    # the names are Humming's (humming/schema/humming.py, HummingInputSchema): dtype aliases a_dtype
    input_config = {"quant_method": "humming", "dtype": "float8e4m3", "input_quant_mode": "dynamic_token"}

    def unavailable(self):
        why = super().unavailable()
        if why:
            return why
        try:
            from humming.schema import BaseInputSchema, is_humming_schema_compatible
            from humming.schema.mxfp4 import Mxfp4WeightSchema

            weights = Mxfp4WeightSchema().to_humming_schema(torch.bfloat16)
            activations = BaseInputSchema.from_config(dict(self.input_config))
            supported = is_humming_schema_compatible(activations, weights, torch.bfloat16)
        except Exception as exc:
            return f"humming could not check its W4A8 path here: {type(exc).__name__}: {exc}"
        if not supported:
            major, minor = torch.cuda.get_device_capability()
            return (f"unsupported on this device: Humming has no E4M3-activation path for MXFP4 weights on "
                    f"SM{major}{minor}")
        return None


# --------------------------------------------------------------------------------------
# OpenAI's triton_kernels (Triton's python/triton_kernels): matmul_ogs
# --------------------------------------------------------------------------------------

# Its GEMM kernels: ``_matmul_ogs`` and the persistent ``_p_matmul_ogs``, named by their repr
# (matmul_ogs_details/_common.py, make_matmul_repr: ``_matmul_ogs_<layouts>_<dtypes>_<blocks>`` and the fused
# functions' reprs appended; ``_matmul_`` / ``_p_matmul_`` after Triton's rename of matmul_ogs to matmul). Its other
# kernels (routing: _topk_forward, _sum_bitmatrix_rows, _bitmatrix_metadata_compute_stage*, _ragged_tensor_metadata_*;
# the top-k sum: _reduce) are not matched.
TRITON_KERNELS_GEMM_KERNEL = re.compile(r"^_(?:p_)?matmul(?:_ogs)?_")
TRITON_KERNELS_NUM_WARPS = 8  # the Hopper scale layout's warps, which the GEMMs then run with (vLLM's choice)
# Each GEMM's K padded to a multiple of 128: its Hopper MXFP4 GEMMs take 128-K tiles and load the swizzled scales
# unmasked (matmul_ogs_details/_matmul_ogs.py, opt_flags_nvidia.py at e4e68d1), so a K of 2880 reads past a row's
# scales (fixed upstream later). The layouts pad N themselves.
TRITON_KERNELS_K_MULTIPLE = 128


@triton.jit(repr=lambda _: "_mxmoe_silu_mul")
def _tk_silu_mul(x, limit):
    """triton_kernels fused activation (FnSpecs, reduction_n=2): ``x`` [BLOCK_M, BLOCK_N] FP32 GEMM1 tile with gate
    and up interleaved along N (gate in the even columns, as its swiglu_fn reads them) -> SiLU(gate) * up
    [BLOCK_M, BLOCK_N // 2], mxmoe's ``silu`` (SPEC §4: gate clamped above and up both ways at ``limit``, or not)."""
    gate, up = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    if limit is not None:
        gate = tl.minimum(gate, limit)
        up = tl.clamp(up, -limit, limit)
    return gate / (1.0 + tl.exp(-gate)) * up


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) of a w13-shaped tensor ``[E, 2I, ...]`` from ``[gate; up]`` to interleaved: row 2j = gate j,
    row 2j+1 = up j, the order triton_kernels' fused swiglu (and gpt-oss checkpoints) use."""
    return _from_gate_up(t, "interleaved").contiguous()


def triton_kernels_mxfp4_tensors(experts: PreparedExperts, hidden: int = 0, intermediate: int = 0) -> dict:
    """The experts' MXFP4 bytes as triton_kernels' MoE GEMMs take them, before its layout conversion: ``w13``
    uint8 ``[E, 2I, H/2]`` (E2M1 pairs, low nibble first) with rows gate/up interleaved (:func:`interleave_gate_up`)
    and ``w13_scale`` uint8 ``[E, 2I, H/32]`` the same; ``w2`` ``[E, H, I/2]``, ``w2_scale`` ``[E, H, I/32]``; ``b13``
    (FP32, interleaved) and ``b2`` where the experts have biases. The scale bytes are the prepared ones (a zero
    block's byte may be lowered, :func:`mxmoe.prepare.kernel_scales`: the same values decode). ``hidden`` /
    ``intermediate`` larger than H / I: padded to them with zero values (scale byte 127), zero biases: the extra
    gate/up pairs give zero activations, the extra output columns zeros, the sums over the padded K the same."""
    w13, w2 = experts.source_order_weights()
    out = {"w13": interleave_gate_up(w13), "w13_scale": interleave_gate_up(experts.w13_scale),
           "w2": w2.contiguous(), "w2_scale": experts.w2_scale.contiguous()}
    if experts.b13 is not None:
        out["b13"] = interleave_gate_up(experts.b13.float().unsqueeze(-1)).squeeze(-1).contiguous()
    if experts.b2 is not None:
        out["b2"] = experts.b2.float().contiguous()
    H, I = experts.hidden_size, experts.intermediate_size
    Hp, Ip = max(hidden, H), max(intermediate, I)
    if (Hp, Ip) != (H, I):
        sizes = {"w13": (2 * Ip, Hp // 2), "w13_scale": (2 * Ip, Hp // 32), "w2": (Hp, Ip // 2),
                 "w2_scale": (Hp, Ip // 32), "b13": (2 * Ip,), "b2": (Hp,)}
        for name, t in out.items():
            fill = 127 if name.endswith("_scale") else 0
            padded = torch.full((t.shape[0], *sizes[name]), fill, dtype=t.dtype, device=t.device)
            padded[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
            out[name] = padded
    return out


def triton_kernels_weight(w: torch.Tensor, scale: torch.Tensor, value_layout=None, scale_layout=None,
                          num_warps: int = TRITON_KERNELS_NUM_WARPS):
    """One GEMM's weights ``[E, N, K/2]`` + scales ``[E, N, K/32]`` (uint8, K-contiguous rows) as matmul_ogs' ``w``
    (a ``triton_kernels.tensor.Tensor`` of FP4, logical shape ``[E, K, N]``, K-major: the B operand x @ W[e]) and
    ``weight_scale`` (logical ``[E, K/32, N]``), in ``value_layout`` / ``scale_layout`` (default: the device's, from
    ``triton_kernels.tensor_details.layout``: on SM90 HopperMXValueLayout and HopperMXScaleLayout with ``num_warps``),
    both with the MX axis 1 (K), as vLLM's ``_swizzle_mxfp4`` does."""
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    value_opts, scale_opts = {}, {}
    if value_layout is None:
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    elif value_layout is layout.HopperMXValueLayout:
        value_opts = {"mx_axis": 1}
    if scale_layout is None:
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
    elif scale_layout is layout.HopperMXScaleLayout:
        scale_opts = {"mx_axis": 1, "num_warps": num_warps}
    value = convert_layout(wrap_torch_tensor(w.transpose(-2, -1), dtype=FP4), value_layout, **value_opts)
    scale = convert_layout(wrap_torch_tensor(scale.transpose(-2, -1)), scale_layout, **scale_opts)
    return value, scale


def triton_kernels_route_indices(topk_ids: torch.Tensor, num_experts: int) -> tuple:
    """The routing arrays matmul_ogs takes, in torch (no host sync): ``(col_sorted, row_sorted, hist)`` int32.
    ``col_sorted[m]`` is the flat route (``t * top_k + k``) at position m of the expert-sorted order (routes of one
    expert in token order), ``row_sorted`` its inverse (route -> position), ``hist[e]`` expert e's routes: what
    triton_kernels' bitmatrix metadata computes (``BitmatrixMetadata.col_sorted_indx`` / ``row_sorted_indx`` /
    ``col_sum``) from a top-k. Used where its topk kernel cannot take the routing (top_k not a power of 2) and by the
    tests as the reference."""
    flat = topk_ids.reshape(-1).long()
    col_sorted = torch.argsort(flat, stable=True)
    row_sorted = torch.empty_like(col_sorted)
    row_sorted[col_sorted] = torch.arange(flat.numel(), device=flat.device)
    hist = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    hist.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return col_sorted.to(torch.int32), row_sorted.to(torch.int32), hist


class TritonKernelsArm(Arm):
    name = "triton-kernels-w4a16"
    rate = "bf16"
    what = ("OpenAI's triton_kernels (Triton's python/triton_kernels, the matmul_ogs vLLM and SGLang run gpt-oss with "
            "on Hopper) on the MXFP4 weights in its Hopper layouts (HopperMXValueLayout / HopperMXScaleLayout, 8 warps, "
            "as vLLM's _swizzle_mxfp4; converted once), upcast to BF16 in its GEMMs, BF16 activations; included: its "
            "routing from the given ids and weights (topk kernel with the ids provided: bitmatrix, sorted-index "
            "metadata, ragged metadata), GEMM1 gathering x with SiLU-and-mul fused (gate/up interleaved), GEMM2 with the "
            "router weights in its epilogue writing each route's row, its reduce kernel summing the top-k rows; "
            "excluded: the one-time weight conversion and kernel compilation")
    gemm_kernel = TRITON_KERNELS_GEMM_KERNEL
    # CUDA graphs: no host sync on this path (routing and matmul_ogs read shapes only; split-K, the one extra
    # reduce, is off for MXFP4 weights); each call allocates its scratch (the GEMM2 rows before the top-k sum) from
    # the caching allocator, which a graph's private pool serves
    graphable = True

    def unavailable(self):
        if importlib.util.find_spec("triton_kernels") is None:
            return ("not installed: triton_kernels (Triton's python/triton_kernels: scripts/fetch_triton_kernels.py "
                    "exports it to .triton_kernels/, then PYTHONPATH=$PWD/.triton_kernels)")
        if not torch.cuda.is_available():
            return "unsupported here: no CUDA device (triton_kernels' matmul_ogs runs on NVIDIA GPUs)"
        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            return f"unsupported on this device: SM{major}{minor} (the arm uses triton_kernels' SM90+ MXFP4 layouts)"
        try:
            for module in ("triton_kernels.matmul_ogs", "triton_kernels.topk", "triton_kernels.tensor",
                           "triton_kernels.swiglu"):
                importlib.import_module(module)
        except Exception as exc:
            return f"triton_kernels could not be imported: {type(exc).__name__}: {exc}"
        return None

    def prepare(self, experts, shape, max_tokens):
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig
        from triton_kernels.numerics import InFlexData

        if experts.w13_global_scale is not None or experts.w2_global_scale is not None:
            raise NotImplementedError("per-expert global scales are not wired into the triton_kernels arm")
        self.shape = shape
        self.hidden, self.intermediate = (cdiv(n, TRITON_KERNELS_K_MULTIPLE) * TRITON_KERNELS_K_MULTIPLE
                                          for n in (shape.H, shape.I))  # (GEMM1's K, GEMM2's K)
        src = triton_kernels_mxfp4_tensors(experts, self.hidden, self.intermediate)
        self.w13, s13 = triton_kernels_weight(src["w13"], src["w13_scale"])
        self.w2, s2 = triton_kernels_weight(src["w2"], src["w2_scale"])
        self.b13, self.b2 = src.get("b13"), src.get("b2")
        self.pc13 = PrecisionConfig(weight_scale=s13, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.pc2 = PrecisionConfig(weight_scale=s2, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        act = experts.activation
        if act is None or act.name == "silu":
            limit = None if act is None or act.limit == float("inf") else act.limit
            self.act = FusedActivation(FnSpecs("mxmoe_silu_mul", _tk_silu_mul, ("limit",), reduction_n=2), (limit,))
            act_note = "SiLU-and-mul (mxmoe's silu) as a fused activation of its GEMM1"
        else:  # swigluoai: triton_kernels' own swiglu is the same function (SPEC §4 / its compute_swiglu)
            import triton_kernels.swiglu

            self.act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit"),
                                               reduction_n=2), (act.alpha, act.limit))
            act_note = f"its swiglu (alpha {act.alpha}, limit {act.limit}) fused in its GEMM1"
        self.route_by_topk = shape.top_k & (shape.top_k - 1) == 0  # its topk kernel needs a power-of-2 top_k
        layouts = f"{type(self.w13.storage.layout).__name__} / {type(s13.storage.layout).__name__}"
        pads = ("" if (self.hidden, self.intermediate) == (shape.H, shape.I) else
                f"; H, I padded to {self.hidden}, {self.intermediate} (x copied into a zero-padded buffer per call)")
        self.note = (f"weights in {layouts}; {act_note}; routing by "
                     + ("its topk kernel with the ids given" if self.route_by_topk else
                        "torch argsort (top_k not a power of 2) and its ragged metadata") + pads)

    def _routing(self, inp: Inputs):
        """Per call: matmul_ogs' RoutingData, GatherIndx and ScatterIndx for ``inp``'s ids and weights."""
        from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
        from triton_kernels.tensor import make_ragged_tensor_metadata

        s = self.shape
        R = inp.T * s.top_k
        if self.route_by_topk:
            from triton_kernels.topk import topk

            # its topk with the indices given skips the selection: it reads x at the ids (the router weights placed
            # there), builds the bitmatrix, and SparseMatrix computes the sorted indices from it
            dense = torch.zeros(inp.T, s.E, dtype=torch.float32, device=inp.x.device)
            dense.scatter_(1, inp.topk_ids.long(), inp.topk_weights.float())
            # (int32 ids: with int16 ones its bitmatrix shifts 1 << (id % 32) in 16 bits, dropping experts 16 to 31 of
            # every 32: gpt-oss-20b's outputs were not finite, perf-notes step 43)
            ids = inp.topk_ids.to(torch.int32).contiguous()
            sparse = topk(dense, s.top_k, apply_softmax=False, y_indx=ids)
            meta = sparse.mask_metadata
            col_sorted, row_sorted, hist = meta.col_sorted_indx, meta.row_sorted_indx, meta.col_sum
            gate = sparse.vals.reshape(-1)[col_sorted]
        else:
            col_sorted, row_sorted, hist = triton_kernels_route_indices(inp.topk_ids, s.E)
            gate = inp.topk_weights.float().reshape(-1)[col_sorted]
        ragged = make_ragged_tensor_metadata(hist, R)
        routing = RoutingData(gate, ragged.slice_sizes, s.E, s.top_k, ragged)
        return routing, GatherIndx(col_sorted, row_sorted), ScatterIndx(row_sorted, col_sorted)

    def make_call(self, inp):
        from triton_kernels.matmul_ogs import matmul_ogs

        s = self.shape
        padded = self.hidden != s.H
        x = torch.zeros(inp.T, self.hidden, dtype=inp.x.dtype, device=inp.x.device) if padded else inp.x
        out = torch.empty(inp.T, self.hidden, dtype=inp.x.dtype, device=inp.x.device)
        h = torch.empty(inp.T * s.top_k, self.intermediate, dtype=inp.x.dtype, device=inp.x.device)  # GEMM1 out

        def call():
            if padded:  # (the pad columns stay zero)
                x[:, : s.H].copy_(inp.x)
            routing, gather, scatter = self._routing(inp)
            matmul_ogs(x, self.w13, self.b13, routing, gather_indx=gather, precision_config=self.pc13,
                       fused_activation=self.act, y=h)
            matmul_ogs(h, self.w2, self.b2, routing, scatter_indx=scatter, precision_config=self.pc2,
                       gammas=routing.gate_scal, y=out)
            return out[:, : s.H]

        return call

    def release(self):
        self.w13 = self.w2 = self.b13 = self.b2 = self.pc13 = self.pc2 = None


def all_arms() -> list[Arm]:
    return [MxmoeArm("w4a16"), MxmoeArm("w4a8"), TorchGroupedMMArm(), TorchScaledGroupedMMArm(), FlashInferArm(),
            HummingArm(), HummingW4A8Arm(), TritonKernelsArm()]


ARM_NAMES = tuple(a.name for a in all_arms())
