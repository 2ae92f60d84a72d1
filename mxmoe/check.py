"""``mxmoe check``: synthetic numerical checks of both paths against the PyTorch references.

Each layer :class:`Case` builds one synthetic problem (random weights quantized with
:func:`mxmoe.quantize_mxfp4`, a routing from :func:`make_routing`, optional scale-byte
patterns, biases and activation), runs ``fused_moe`` with ``precision="w4a16"`` and
``"w4a8"`` into outputs pre-filled with NaN, and compares against
:func:`mxmoe.fused_moe_reference` in its three modes. Bounds (relative L2, SPEC §5):

=================  ================================================================  ===========
metric (label)     what                                                              bound
=================  ================================================================  ===========
``a16~emu``        W4A16 vs its emulation (mode w4a16)                               0.5 %
``a16~exact``      W4A16 vs the exact FP32 reference                                 0.5 %
``a8~exact``       W4A8 vs exact                                                     (info)
``emu8~exact``     the FP8 emulation (mode w4a8) vs exact: the format's own error    (info)
``a8 excess``      ``a8~exact`` minus ``emu8~exact``, whole output                   0.5 points
``a8 tok excess``  worst token of (W4A8's error vs exact minus the emulation's)      1.5 points
``a8~emu``         W4A8 vs the FP8 emulation                                         2 % at the
                                                                                     reference
                                                                                     shape, else
                                                                                     (info)
``a8~emu tok``     worst token of W4A8 vs the emulation                              (info)
``a8~a16``         W4A8 vs W4A16                                                     (info)
=================  ================================================================  ===========

Per-token relative L2 is ``||out[t] - ref[t]|| / ||ref[t]||``; the token excess compares
W4A8's per-token error vs exact with the emulation's for the same token. Tokens whose exact
row is zero (every route masked, a zero x row without biases) are left out of the per-token
metrics and must be exactly zero (check ``zero_where_exact_zero``). The reference shape is
``REFERENCE_SHAPE`` (E=288, H=4096, I=1024, top_k=8). Excesses are differences of relative
L2 errors, shown like them in percent (so 0.5 means 0.5 percentage points).

``emu8~exact`` is the error FP8 activations cost by themselves (about 4.5% on these
Gaussian inputs; SPEC §1 quotes about 4.6% for the SM120 reference): a W4A8 result can not
be much better than it. The FP8 tensor core's accumulator moves values near an E4M3 rounding
tie to the other code, a whole step away from the emulation and just as close to the truth,
so ``a8~emu`` is information, not a bound, except at the reference shape.

GEMM-level cases (``Case.kind == "gemm"``, SPEC §5: each GEMM vs float64 of the same E4M3
operands <= 1.5e-3):

===============  ==================================================================  ========
``gemm1~f64``    GEMM1's FP32 output (before the activation) vs float64             0.15 %
``gemm2~f64``    GEMM2's routed rows (routing weight applied) in FP32 vs float64    0.15 %
``gemm1 route``  the worst single route's GEMM1 row vs float64                      (info)
``gemm2 route``  the worst single route's GEMM2 row vs float64                      (info)
===============  ==================================================================  ========

They run the real kernels with no kernel change: the experts' up rows are E2M1 zeros and
the activation is swigluoai with alpha 0 and limit 1e30, so the activation is
``gate * sigmoid(0) * (clamp(0) + 1) = gate / 2`` exactly and twice GEMM1's rows
(``launch.gemm1_rows``, FP32 for W4A8) are the gate GEMM's FP32 sums. Its float64 reference
takes x quantized per row exactly as :func:`mxmoe.reference.quantize_rows_fp8` (E4M3 codes
and FP32 scale) and the exactly decoded weights (:func:`mxmoe.reference.decode_expert`).
GEMM2 runs in a whole W4A8 call whose workspace's routed rows are an FP32 buffer (the
kernels store in their output pointer's dtype; with the usual BF16 buffer the output
rounding alone, ~1.1e-3, would leave the 1.5e-3 bound untestable); its float64 reference
multiplies the E4M3 intermediate the call itself quantized (the workspace's codes, back from
the kernels' slot order, and scales) with the decoded ``w2``.

plus: every output element written and finite, the returned tensor is ``out``, the path
that ran is the one asked for, rows whose routes are all masked are exactly zero, and two
runs give bitwise the same output. Relative L2 is ``||out - ref|| / ||ref||`` over the
whole output (SPEC §5).

On a CUDA device ``fused_moe`` runs the Triton kernels. Without one the same cases run at
small shapes on the CPU, where ``fused_moe`` is the PyTorch emulation (so ``a8~emu`` is
the emulation against itself, and the GEMM-level cases compare the emulation's FP32 GEMMs
with float64) unless ``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence, TextIO

import torch

from .moe import fused_moe, kernel_backend, validate_moe_args
from .prepare import PreparedExperts
from .reference import apply_activation, decode_expert, fused_moe_references, quantize_rows_fp8, relative_l2
from .routing import local_expert_ids
from .selection import PATHS
from .testing import make_experts, make_routing

# --------------------------------------------------------------------------------------
# Bounds (relative L2) and the metrics table
# --------------------------------------------------------------------------------------

REFERENCE_SHAPE = (288, 4096, 1024, 8)  # E, H, I, top_k (SPEC: the reference shape)


class Metric(NamedTuple):
    label: str  # column of the table
    tolerance: Optional[float]  # bound on the value, None: information only
    what: str
    kind: str = "layer"  # the cases that have it: "layer" or "gemm"
    reference_shape_only: bool = False  # the bound holds at REFERENCE_SHAPE only; information elsewhere


# metric name -> Metric; the order is the table's
METRICS = {
    "w4a16_vs_emulation": Metric("a16~emu", 0.005, "W4A16 vs its emulation (reference mode w4a16)"),
    "w4a16_vs_exact": Metric("a16~exact", 0.005, "W4A16 vs the exact FP32 reference"),
    "w4a8_vs_exact": Metric("a8~exact", None, "W4A8 vs the exact FP32 reference"),
    "emulation_vs_exact": Metric("emu8~exact", None, "the FP8 emulation (mode w4a8) vs exact (the format's own error)"),
    "w4a8_excess_over_emulation": Metric(
        "a8 excess", 0.005, "a8~exact minus emu8~exact over the whole output (percentage points)"),
    "w4a8_worst_token_excess": Metric(
        "a8 tok excess", 0.015, "largest over tokens of W4A8's per-token error vs exact minus the emulation's for the "
        "same token (points; tokens whose exact row is zero left out)"),
    "w4a8_vs_emulation": Metric("a8~emu", 0.02, "W4A8 vs the FP8 emulation", reference_shape_only=True),
    "w4a8_vs_emulation_worst_token": Metric("a8~emu tok", None, "largest per-token relative L2 of W4A8 vs the emulation"),
    "w4a8_vs_w4a16": Metric("a8~a16", None, "W4A8 vs W4A16"),
    "w4a8_gemm1_vs_f64": Metric(
        "gemm1~f64", 0.0015, "W4A8 GEMM1's FP32 output (before the activation) vs float64 of the same E4M3 operands",
        kind="gemm"),
    "w4a8_gemm2_vs_f64": Metric(
        "gemm2~f64", 0.0015, "W4A8 GEMM2's routed rows in FP32 (routing weight applied) vs float64 of the same E4M3 "
        "operands", kind="gemm"),
    "w4a8_gemm1_worst_route": Metric(
        "gemm1 route", None, "largest relative L2 of one route's GEMM1 row vs float64 (rows of zero reference left out)",
        kind="gemm"),
    "w4a8_gemm2_worst_route": Metric("gemm2 route", None, "the same for GEMM2", kind="gemm"),
}
CASE_KINDS = ("layer", "gemm")
# the GEMM-level cases' activation: swigluoai at alpha 0 with no clamp in reach gives gate * sigmoid(0) * (up + 1)
# = gate / 2 exactly where the up rows are zero
GEMM_LEVEL_LIMIT = 1e30
GEMM_LEVEL_ALPHA = 0.0


def metric_names(kind: str) -> list[str]:
    """The metrics of ``kind`` (``"layer"`` or ``"gemm"``) cases, in table order."""
    return [m for m, d in METRICS.items() if d.kind == kind]


def tolerance(metric: str, dims: tuple) -> Optional[float]:
    """The bound on ``metric`` for a case of ``dims = (E, H, I, top_k)``; None where it is information only."""
    d = METRICS[metric]
    if d.reference_shape_only and tuple(dims) != REFERENCE_SHAPE:
        return None
    return d.tolerance


# --------------------------------------------------------------------------------------
# Synthetic problems
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One synthetic problem. Shapes are the ones used on the device the case runs on."""

    name: str
    what: str
    E: int
    H: int
    I: int
    top_k: int
    T: int
    routing: str = "uniform"
    ids_dtype: torch.dtype = torch.int32
    scales: str = "normal"
    activation: str = "silu"
    swiglu_limit: Optional[float] = None
    biases: bool = False
    global_scales: bool = False
    zero_x_row: bool = False
    kind: str = "layer"  # "layer": the whole call; "gemm": each W4A8 GEMM vs float64 (gemm_level)
    draw_on_device: bool = False  # draw the weights on the device the case runs on (large shapes)

    @property
    def shape(self) -> str:
        return f"{self.E},{self.H},{self.I},{self.top_k}"

    @property
    def dims(self) -> tuple:
        return (self.E, self.H, self.I, self.top_k)


@dataclass
class Problem:
    """Inputs of one ``fused_moe`` call plus what the checks need to know about them."""

    x: torch.Tensor
    experts: PreparedExperts
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: Optional[torch.Tensor]
    activation: str
    swiglu_limit: Optional[float]
    masked_rows: torch.Tensor  # int64 indices of tokens whose routes are all masked

    def kwargs(self) -> dict:
        return dict(activation=self.activation, swiglu_limit=self.swiglu_limit, expert_map=self.expert_map)


_device_experts: dict = {}  # the last experts drawn on a device (Case.draw_on_device), shared by the next cases


def _case_experts(case: Case, device: torch.device, seed: int):
    kw = dict(seed=seed, scales=case.scales, biases=case.biases, global_scales=case.global_scales,
              zero_up=case.kind == "gemm")
    if not case.draw_on_device or device.type == "cpu":
        return make_experts(case.E, case.H, case.I, device=device, **kw)
    key = (case.E, case.H, case.I, str(device), tuple(sorted(kw.items())))
    if key not in _device_experts:
        _device_experts.clear()  # one set resident (the reference shape's take ~2 GB)
        _device_experts[key] = make_experts(case.E, case.H, case.I, device=device, gen_device=device, **kw)
    return _device_experts[key]


def build_problem(case: Case, device="cpu", seed: int = 0) -> Problem:
    """The inputs of ``case`` on ``device``: drawn on the CPU, so a seed gives the same problem everywhere
    (except the weights of ``draw_on_device`` cases, drawn on the device). GEMM-level cases (``kind == "gemm"``) get
    experts whose up rows are zero and the activation of :func:`gemm_level`."""
    device = torch.device(device)
    if case.kind not in CASE_KINDS:
        raise ValueError(f"kind must be one of {CASE_KINDS}, got {case.kind!r}")
    experts, x_exp = _case_experts(case, device, seed)
    # everything random is drawn on the CPU: a seed gives the same problem on every device
    gen = torch.Generator().manual_seed(seed + 104729)
    x = torch.randn(case.T, case.H, generator=gen)
    if x_exp is not None:
        x = x * torch.exp2(x_exp.cpu().float()).repeat_interleave(32)
    if case.zero_x_row and case.T > 1:
        x[1] = 0.0
    weights, ids, expert_map, masked_rows = make_routing(case.routing, case.T, case.E, case.top_k, seed=seed,
                                                         ids_dtype=case.ids_dtype)
    move = lambda t: None if t is None else t.to(device).contiguous()  # noqa: E731
    return Problem(x=move(x.to(torch.bfloat16)), experts=experts, topk_weights=move(weights), topk_ids=move(ids),
                   expert_map=move(expert_map), activation=case.activation, swiglu_limit=case.swiglu_limit,
                   masked_rows=move(masked_rows))


# --------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------


def default_cases(small: bool) -> list[Case]:
    """Every check case; ``small`` gives CPU-sized shapes (seconds in total)."""
    if small:
        E, H, I, k = 8, 256, 128, 4
        tail = dict(E=8, H=96, I=160, top_k=4)  # multiples of 32, not of 64 or 128
        big = dict(E=8, H=256, I=128, top_k=4, T=64)
        wide = dict(E=8, H=512, I=256, top_k=4)
        ref = dict(E=16, H=256, I=128, top_k=8)  # the reference shape's top_k
        T = dict(partial=13, hot=40, empty=24, masked=20, emap=16, scales=24, act=19, top1=9,
                 ref_decode=12, ref_prefill=40, gemm_decode=9, gemm_mid=20, gemm_prefill=40)
    else:
        E, H, I, k = 32, 1024, 512, 4
        tail = dict(E=8, H=2880, I=2880, top_k=4)  # the ktail shape's 2880: not a multiple of 128
        big = dict(E=32, H=1024, I=512, top_k=8, T=2048)
        wide = dict(E=8, H=4096, I=1024, top_k=4)  # the reference shape's H and I
        ref = dict(zip(("E", "H", "I", "top_k"), REFERENCE_SHAPE))
        # reference shape: 64 tokens take 16-row route tiles, 1500 64-row tiles, 4096 128-row tiles (whose W4A8 GEMM1
        # keeps its FP32 sums in shared memory)
        T = dict(partial=37, hot=300, empty=200, masked=100, emap=64, scales=64, act=77, top1=33,
                 ref_decode=64, ref_prefill=4096, gemm_decode=64, gemm_mid=1500, gemm_prefill=4096)
    base = dict(E=E, H=H, I=I, top_k=k)
    on_device = dict(draw_on_device=True)
    return [
        Case("decode_t1", "one token", T=1, **base),
        Case("top1", "top_k = 1", T=T["top1"], **{**base, "top_k": 1}),
        Case("partial_tiles", "odd T, uneven expert counts, one all-zero x row", T=T["partial"], zero_x_row=True, **base),
        Case("hot_experts", "two hot experts take most routes; upper half empty", T=T["hot"], routing="hot", **base),
        Case("empty_experts", "only the last k+1 experts used", T=T["empty"], routing="empty", **base),
        Case("masked_int32", "ids -1, >= E, INT32_MIN/MAX; all-masked tokens", T=T["masked"], routing="masked", **base),
        Case("masked_int64", "int64 ids incl. >= 2^32 (low bits valid)", T=T["masked"], routing="masked",
             ids_dtype=torch.int64, **base),
        Case("expert_map", "2E global ids, odd ones mapped to -1", T=T["emap"], routing="expert_map", **base),
        Case("zero_scale_bytes", "scale byte 0 in blocks, rows and a whole expert", T=T["scales"],
             scales="zero_bytes", **base),
        Case("wide_scale_span", "block scales of a row span ~30 binades", T=T["scales"], scales="wide_span", **base),
        Case("k_tail", "H and I multiples of 32, not of 128", T=T["partial"], **tail),
        Case("ref_hidden", "the reference shape's H and I (long K loops)", T=T["partial"], **wide),
        Case("bias_silu", "biases, global scales, zero x row", T=T["act"], biases=True, global_scales=True,
             zero_x_row=True, **base),
        Case("silu_limit", "silu with swiglu_limit=2 (clamped SwiGLU)", T=T["act"], swiglu_limit=2.0, **base),
        Case("swigluoai", "gpt-oss activation (alpha 1.702, limit 7) with biases", T=T["act"], activation="swigluoai",
             biases=True, **base),
        Case("many_rows", "many routed rows (large tiles)", routing="uniform", **big),
        Case("mixed_scale_span", "the odd experts' block scales span ~30 binades (W4A8: both paths in one call)",
             T=T["scales"], scales="mixed_span", **base),
        Case("ref_decode", "the reference shape (a8~emu <= 2% there), few rows per expert", T=T["ref_decode"],
             **ref, **on_device),
        Case("ref_prefill", "the reference shape, many rows per expert", T=T["ref_prefill"], **ref, **on_device),
        # GEMM-level (SPEC §5: each GEMM vs float64 of the same E4M3 operands), masked routes and a zero x row
        Case("gemm_ref_decode", "GEMM-level, reference shape, small route tiles", T=T["gemm_decode"],
             routing="masked", zero_x_row=True, kind="gemm", **ref, **on_device),
        Case("gemm_ref_mid", "GEMM-level, reference shape, mid-size route tiles", T=T["gemm_mid"], routing="masked",
             zero_x_row=True, kind="gemm", **ref, **on_device),
        Case("gemm_ref_prefill", "GEMM-level, reference shape, the largest route tiles", T=T["gemm_prefill"],
             routing="masked", zero_x_row=True, kind="gemm", **ref, **on_device),
        Case("gemm_mixed_span", "GEMM-level, odd experts on W4A8's exact path", T=T["scales"], routing="masked",
             scales="mixed_span", zero_x_row=True, kind="gemm", **base),
        Case("gemm_k_tail", "GEMM-level, H and I multiples of 32, not of 128", T=T["partial"], routing="masked",
             zero_x_row=True, kind="gemm", **tail),
    ]


def select_cases(cases: Sequence[Case], names: Optional[Sequence[str]]) -> list[Case]:
    """The cases named (all when ``names`` is empty); unknown names raise ``ValueError``."""
    if not names:
        return list(cases)
    by_name = {c.name: c for c in cases}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# Layer metrics: whole and per token, W4A8 against the emulation's own error
# --------------------------------------------------------------------------------------


def per_token_relative_l2(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``t`` of ``[T, H]`` tensors: ``(||out[t] - ref[t]|| / ||ref[t]||`` as float64 ``[T]``, bool ``[T]``
    rows whose ``ref`` row is nonzero``)``. Rows whose ``ref`` row is zero have NaN (no relative error exists; see
    :func:`zero_where_ref_zero`); a row of ``out`` that is not finite has inf."""
    o, r = out.double(), ref.double()
    num = (o - r).norm(dim=-1)
    den = r.norm(dim=-1)
    nonzero = den > 0
    err = num / torch.where(nonzero, den, torch.ones_like(den))
    err = torch.where(torch.isfinite(o).all(dim=-1), err, torch.full_like(err, math.inf))
    return torch.where(nonzero, err, torch.full_like(err, math.nan)), nonzero


def zero_where_ref_zero(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether every row of ``out`` whose ``ref`` row is all zero is exactly zero (e.g. tokens with every route
    masked, SPEC §3)."""
    zero = (ref == 0).all(dim=-1)
    return bool((out[zero] == 0).all())


def worst_token_relative_l2(out: torch.Tensor, ref: torch.Tensor) -> Optional[float]:
    """The largest per-token relative L2 over rows whose ``ref`` row is nonzero (None if there is none)."""
    err, nonzero = per_token_relative_l2(out, ref)
    return float(err[nonzero].max()) if bool(nonzero.any()) else None


def excess_over_emulation(out: torch.Tensor, emu: torch.Tensor, exact: torch.Tensor) -> tuple[float, Optional[float], int]:
    """SPEC §5's layer bound for W4A8: ``(whole, worst_token, token)``.

    ``whole = rel_l2(out, exact) - rel_l2(emu, exact)`` over the whole output; ``worst_token`` the largest over
    tokens ``t`` whose exact row is nonzero of ``rel_l2(out[t], exact[t]) - rel_l2(emu[t], exact[t])`` (None if
    every exact row is zero), ``token`` that token (-1 if none). A non-finite ``out`` gives inf.
    """
    whole = relative_l2(out, exact) - relative_l2(emu, exact)
    e_out, nonzero = per_token_relative_l2(out, exact)
    e_emu, _ = per_token_relative_l2(emu, exact)
    if not bool(nonzero.any()):
        return whole, None, -1
    excess = torch.where(nonzero, e_out - e_emu, torch.full_like(e_out, -math.inf))
    token = int(excess.argmax())
    return whole, float(excess[token]), token


def w4a8_layer_metrics(out: torch.Tensor, emu: torch.Tensor, exact: torch.Tensor) -> dict:
    """Every W4A8 layer metric of :data:`METRICS` (``w4a8_*`` and ``emulation_vs_exact``) for one output ``out``
    against the FP8 emulation ``emu`` and the exact reference, plus ``worst_token`` (the token of the worst excess,
    -1 if none) and ``zero_where_exact_zero`` (:func:`zero_where_ref_zero`)."""
    whole, worst, token = excess_over_emulation(out, emu, exact)
    return {
        "w4a8_vs_exact": relative_l2(out, exact),
        "emulation_vs_exact": relative_l2(emu, exact),
        "w4a8_excess_over_emulation": whole,
        "w4a8_worst_token_excess": worst,
        "w4a8_vs_emulation": relative_l2(out, emu),
        "w4a8_vs_emulation_worst_token": worst_token_relative_l2(out, emu),
        "worst_token": token,
        "zero_where_exact_zero": zero_where_ref_zero(out, exact),
    }


def w4a8_layer_failures(m: dict, dims: tuple) -> list[str]:
    """The bounded metrics of ``m`` (:func:`w4a8_layer_metrics`) above their bound for a case of ``dims``, and
    ``zero_where_exact_zero`` if it failed: an empty list when the W4A8 output meets SPEC §5."""
    bad = [name for name, v in m.items() if name in METRICS and v is not None
           and tolerance(name, dims) is not None and not v <= tolerance(name, dims)]
    return bad + ([] if m["zero_where_exact_zero"] else ["zero_where_exact_zero"])


def describe_w4a8(m: dict) -> str:
    """One line of :func:`w4a8_layer_metrics` for messages: values in percent, excesses in points."""
    def f(v):
        return "-" if v is None else f"{100 * v:.3f}"
    return (f"vs exact {f(m['w4a8_vs_exact'])}% (emulation {f(m['emulation_vs_exact'])}%), excess "
            f"{f(m['w4a8_excess_over_emulation'])} points whole, {f(m['w4a8_worst_token_excess'])} at worst (token "
            f"{m['worst_token']}); vs emulation {f(m['w4a8_vs_emulation'])}% whole, "
            f"{f(m['w4a8_vs_emulation_worst_token'])}% worst token; exact-zero rows zero: {m['zero_where_exact_zero']}")


# --------------------------------------------------------------------------------------
# GEMM-level: each W4A8 GEMM against float64 of the same E4M3 operands
# --------------------------------------------------------------------------------------


def gemm1_reference_f64(x: torch.Tensor, experts: PreparedExperts, topk_ids: torch.Tensor,
                        expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 ``[T * top_k, I]``: each route's gate GEMM ``xq[t] · w13[e, :I]ᵀ`` (masked routes zero), with ``xq``
    = x quantized per row exactly as :func:`mxmoe.reference.quantize_rows_fp8` (the E4M3 codes times the FP32
    scale, exact in float64) and the weights decoded exactly (:func:`mxmoe.reference.decode_expert`, global scales
    none). Raises ``ValueError`` where an expert's up rows are not zero (the GEMM-level trick needs them zero)."""
    T, top_k = topk_ids.shape
    I = experts.intermediate_size
    if experts.w13_global_scale is not None:
        raise ValueError("GEMM-level references take experts without global scales (decode_expert rounds them)")
    q, s = quantize_rows_fp8(x)
    xq = q.float().double() * s.double().unsqueeze(-1)  # (E4M3 -> FP32 -> float64: exact)
    local = local_expert_ids(topk_ids, experts.num_experts, expert_map).reshape(-1).long()
    ref = torch.zeros(T * top_k, I, dtype=torch.float64, device=x.device)
    for e in torch.unique(local[local >= 0]).tolist():
        route = (local == e).nonzero().squeeze(1)
        w13, _ = decode_expert(experts, e)
        if bool((w13[I:] != 0).any()):
            raise ValueError(f"expert {e}'s up rows are not zero: the GEMM-level check needs them zero "
                             "(make_experts(..., zero_up=True))")
        ref[route] = xq[route // top_k] @ w13[:I].double().T
    return ref


def gemm2_reference_f64(a_q: torch.Tensor, a_scale: torch.Tensor, experts: PreparedExperts,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 ``[T * top_k, H]``: each route's GEMM2 row ``(a_q[r] * a_scale[r]) · w2[e]ᵀ * topk_weights[r]``
    (masked routes zero), ``a_q`` float8_e4m3fn ``[T * top_k, I]`` in K order and ``a_scale`` ``[T * top_k]`` the
    intermediate's E4M3 codes and FP32 scales per route; weights decoded exactly, no global scale, no bias."""
    T, top_k = topk_ids.shape
    if experts.w2_global_scale is not None or experts.b2 is not None:
        raise ValueError("GEMM-level references take experts without global scales or biases")
    a = a_q.float().double() * a_scale.double().unsqueeze(-1)
    w = topk_weights.double().reshape(-1)
    local = local_expert_ids(topk_ids, experts.num_experts, expert_map).reshape(-1).long()
    ref = torch.zeros(T * top_k, experts.hidden_size, dtype=torch.float64, device=a_q.device)
    for e in torch.unique(local[local >= 0]).tolist():
        route = (local == e).nonzero().squeeze(1)
        _, w2 = decode_expert(experts, e)
        ref[route] = (a[route] @ w2.double().T) * w[route].unsqueeze(1)
    return ref


def from_slot_order(q: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, K]`` of one-byte values (E4M3 codes as uint8) in the W4A8 kernels' activation slot order
    (``prepare.e4m3_slot_order``, per K32 block) back in K order, same dtype."""
    from .prepare import e4m3_slot_order  # (here: prepare's internals move more than this module)

    n, K = q.shape
    k_of = e4m3_slot_order(torch.arange(32, dtype=torch.float32, device=q.device).unsqueeze(0))[0].long()
    blocks = q.reshape(n, K // 32, 32)
    out = torch.empty_like(blocks)
    out[..., k_of] = blocks  # slot s holds K k_of[s]
    return out.reshape(n, K)


def _emulated_gemm1_rows(x, experts: PreparedExperts, local: torch.Tensor, top_k: int) -> torch.Tensor:
    """What ``launch.gemm1_rows`` computes, in FP32 PyTorch: E4M3-rounded x · w13ᵀ and the GEMM-level activation."""
    xq = quantize_rows_fp8(x)
    xq = xq[0].float() * xq[1].unsqueeze(-1)
    rows = torch.zeros(local.numel(), experts.intermediate_size, dtype=torch.float32, device=x.device)
    for e in torch.unique(local[local >= 0]).tolist():
        route = (local == e).nonzero().squeeze(1)
        w13, _ = decode_expert(experts, e)
        h = xq[route // top_k] @ w13.T
        rows[route] = apply_activation(h, "swigluoai", GEMM_LEVEL_LIMIT, GEMM_LEVEL_ALPHA)
    return rows


def _emulated_gemm2_rows(a_q, a_scale, experts: PreparedExperts, topk_weights, local: torch.Tensor) -> torch.Tensor:
    a = a_q.float() * a_scale.unsqueeze(-1)
    w = topk_weights.float().reshape(-1)
    rows = torch.zeros(local.numel(), experts.hidden_size, dtype=torch.float32, device=a_q.device)
    for e in torch.unique(local[local >= 0]).tolist():
        route = (local == e).nonzero().squeeze(1)
        _, w2 = decode_expert(experts, e)
        rows[route] = (a[route] @ w2.T) * w[route].unsqueeze(1)
    return rows


def _kernel_gemm1_rows(x, experts, topk_weights, topk_ids, expert_map) -> torch.Tensor:
    """``launch.gemm1_rows`` (W4A8) into a workspace whose intermediate is NaN first: unwritten rows stay NaN."""
    from ._details import launch
    from .workspace import workspace_for

    T, top_k = topk_ids.shape
    ws = workspace_for(experts, T, top_k, True)  # the workspace gemm1_rows takes
    inter = getattr(ws, "intermediate", None)
    if inter is not None:
        inter.fill_(0xFF)  # (uint8 bytes: FP32 NaN)
    return launch.gemm1_rows(x, experts, topk_weights, topk_ids, "swigluoai", GEMM_LEVEL_LIMIT, GEMM_LEVEL_ALPHA,
                             "w4a8", expert_map)


def gemm_level(x: torch.Tensor, experts: PreparedExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               expert_map: Optional[torch.Tensor] = None) -> tuple[dict, dict]:
    """SPEC §5's GEMM-level bound for W4A8: ``(metrics, checks)`` with ``w4a8_gemm1_vs_f64`` and
    ``w4a8_gemm2_vs_f64`` (relative L2 over every route's row; the bounded ones), ``w4a8_gemm1_worst_route`` and
    ``w4a8_gemm2_worst_route`` (the largest of one route's row, information), and booleans.

    ``experts``: up rows all E2M1 zeros (``make_experts(..., zero_up=True)``), no biases, no global scales. The
    activation is swigluoai at alpha 0, limit 1e30: ``gate * sigmoid(0) * (0 + 1) = gate / 2`` exactly, so twice
    GEMM1's FP32 rows are the gate GEMM's sums (:func:`gemm1_reference_f64`). GEMM2: one W4A8 ``fused_moe`` call with
    that activation whose workspace's routed rows are an FP32 buffer (pre-filled with NaN), against float64 of the
    intermediate's E4M3 codes and scales that call produced (:func:`gemm2_reference_f64`).

    Where ``fused_moe`` runs the kernels (CUDA, or ``TRITON_INTERPRET=1``) this measures them; elsewhere (CPU) it
    measures the PyTorch emulation's FP32 GEMMs, which only exercises the references. Tile configs other than the
    library's: ``config.overrides`` around the call (developer measurements, e.g. scripts/w4a8_fold.py).
    """
    if experts.b13 is not None or experts.b2 is not None:
        raise ValueError("the GEMM-level check takes experts without biases")
    T, top_k = topk_ids.shape
    R = T * top_k
    validate_moe_args(x, experts, topk_weights, topk_ids, "swigluoai", GEMM_LEVEL_LIMIT, GEMM_LEVEL_ALPHA, expert_map,
                      None)
    local = local_expert_ids(topk_ids, experts.num_experts, expert_map).reshape(-1).long()
    valid = local >= 0
    kernels = kernel_backend(x.device) == "triton"
    checks = {}
    # GEMM1
    if kernels:
        rows = _kernel_gemm1_rows(x, experts, topk_weights, topk_ids, expert_map)
        again = _kernel_gemm1_rows(x, experts, topk_weights, topk_ids, expert_map)
    else:
        rows = again = _emulated_gemm1_rows(x, experts, local, top_k)
    _sync(x.device)
    checks["gemm1:fp32"] = rows.dtype == torch.float32 and tuple(rows.shape) == (R, experts.intermediate_size)
    checks["gemm1:written"] = bool(torch.isfinite(rows[valid]).all())
    checks["gemm1:masked_routes_zero"] = bool((rows[~valid] == 0).all())
    checks["gemm1:deterministic"] = _bitwise_equal(rows, again)
    # the float64 references rounded to FP32, the format the kernels compute in: an expert whose scale bytes are all 0
    # gives GEMM2 sums near 1e-80, which no FP32 holds (the kernel's 0 is right; found by mxmoe check --fuzz)
    ref1 = gemm1_reference_f64(x, experts, topk_ids, expert_map).float()
    g1 = relative_l2(2 * rows.double(), ref1)
    # GEMM2
    if kernels:
        from .workspace import Workspace

        ws = Workspace(experts, T, top_k, fp8=True)
        if not hasattr(ws, "routed_out"):
            raise RuntimeError("Workspace.routed_out is gone: the GEMM2-level check writes GEMM2's rows in FP32 there")
        ws.routed_out = torch.full((R, experts.hidden_size), math.nan, dtype=torch.float32, device=x.device)
        out = torch.full_like(x, math.nan)
        _, ran = fused_moe(x, experts, topk_weights, topk_ids, activation="swigluoai",
                           swiglu_limit=GEMM_LEVEL_LIMIT, swiglu_alpha=GEMM_LEVEL_ALPHA, expert_map=expert_map,
                           precision="w4a8", out=out, workspace=ws, return_precision=True)
        _sync(x.device)
        checks["gemm2:path"] = ran == "w4a8"
        slot = ws.route_slot[:R].long()
        checks["gemm2:route_slots"] = torch.equal(slot >= 0, valid)  # the pack drops exactly the masked routes
        use = valid & (slot >= 0)
        # the intermediate GEMM2 read: its E4M3 codes (as bytes: indexing needs no FP8 support) and FP32 scales
        codes = torch.zeros(R, experts.intermediate_size, dtype=torch.uint8, device=x.device)
        codes[use] = from_slot_order(ws.inter_q.view(torch.uint8)[slot[use]].contiguous())
        a_q = codes.view(torch.float8_e4m3fn)
        a_scale = torch.zeros(R, dtype=torch.float32, device=x.device)
        a_scale[use] = ws.inter_scale[slot[use]]
        y2 = ws.routed_out[:R]
        checks["gemm2:written"] = bool(torch.isfinite(y2[valid]).all())
        y2 = torch.where(valid.unsqueeze(1), y2, torch.zeros_like(y2))  # GEMM2 writes no masked route's row
        checks["call:finite"] = bool(torch.isfinite(out).all())
    else:
        a_q, a_scale = quantize_rows_fp8(rows)
        y2 = _emulated_gemm2_rows(a_q, a_scale, experts, topk_weights, local)
    ref2 = gemm2_reference_f64(a_q, a_scale, experts, topk_weights, topk_ids, expert_map).float()
    g2 = relative_l2(y2, ref2)
    metrics = {"w4a8_gemm1_vs_f64": g1, "w4a8_gemm2_vs_f64": g2,
               "w4a8_gemm1_worst_route": worst_token_relative_l2(2 * rows.double(), ref1),
               "w4a8_gemm2_worst_route": worst_token_relative_l2(y2, ref2)}
    return metrics, checks


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    case: Case
    metrics: dict = field(default_factory=dict)  # metric name -> relative L2 (excesses: differences of them)
    checks: dict = field(default_factory=dict)  # check name -> bool
    error: Optional[str] = None
    seconds: float = 0.0
    notes: dict = field(default_factory=dict)  # information beside the metrics (e.g. the worst token)

    def tolerances(self) -> dict:
        """The bound of each of this case's metrics (None: information only)."""
        return {m: tolerance(m, self.case.dims) for m in metric_names(self.case.kind)}

    @property
    def failures(self) -> list[str]:
        tol = self.tolerances()
        bad = [METRICS[m].label for m, v in self.metrics.items()
               if tol.get(m) is not None and v is not None and not (v <= tol[m])]
        bad += [c for c, ok in self.checks.items() if not ok]
        if self.error:
            bad.append("error")
        return bad

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        c = dataclasses.asdict(self.case)
        c["ids_dtype"] = str(self.case.ids_dtype).replace("torch.", "")
        return dict(case=c, metrics=self.metrics, tolerances=self.tolerances(), checks=self.checks, notes=self.notes,
                    error=self.error, passed=self.passed, failures=self.failures, seconds=round(self.seconds, 3))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, device="cpu", seed: int = 0) -> CaseResult:
    """Build ``case`` on ``device``, run both paths and the references (or, for GEMM-level cases,
    :func:`gemm_level`), and score them."""
    device = torch.device(device)
    res = CaseResult(case)
    start = time.perf_counter()
    try:
        p = build_problem(case, device, seed)
        if case.kind == "gemm":
            metrics, checks = gemm_level(p.x, p.experts, p.topk_weights, p.topk_ids, p.expert_map)
            res.metrics.update(metrics)
            res.checks.update({f"a8:{c}": ok for c, ok in checks.items()})
        else:
            _run_layer_case(res, p, device)
    except Exception as exc:  # a broken path is a failed case, not a crashed run
        res.error = f"{type(exc).__name__}: {exc}"
    res.seconds = time.perf_counter() - start
    return res


def call_checks(out: torch.Tensor, got: torch.Tensor, ran: str, precision: str, masked_rows: torch.Tensor,
                tag: str) -> dict:
    """The checks of one ``fused_moe`` call into a NaN-filled ``out``, keyed ``"{tag}:name"``: the path asked for ran,
    ``out`` was returned, every element written and finite, tokens with every route masked zero."""
    checks = {f"{tag}:path": ran == precision,
              f"{tag}:returns_out": got is out or (got.data_ptr() == out.data_ptr() and got.shape == out.shape),
              f"{tag}:written": not bool(torch.isnan(out).any()),
              f"{tag}:finite": bool(torch.isfinite(out).all())}
    if masked_rows.numel():
        checks[f"{tag}:masked_rows_zero"] = bool((out[masked_rows] == 0).all())
    return checks


def _run_layer_case(res: CaseResult, p: Problem, device: torch.device) -> None:
    args = (p.x, p.experts, p.topk_weights, p.topk_ids)
    outs = {}
    for prec in PATHS:
        out = torch.full_like(p.x, float("nan"))
        got, ran = fused_moe(*args, **p.kwargs(), precision=prec, out=out, return_precision=True)
        again = fused_moe(*args, **p.kwargs(), precision=prec)
        _sync(device)
        tag = "a8" if prec == "w4a8" else "a16"
        res.checks.update(call_checks(out, got, ran, prec, p.masked_rows, tag))
        res.checks[f"{tag}:deterministic"] = _bitwise_equal(out, again)
        outs[prec] = out
    refs = fused_moe_references(*args, **p.kwargs())
    _sync(device)
    a8 = w4a8_layer_metrics(outs["w4a8"], refs["w4a8"], refs["exact"])
    res.checks["a16:zero_where_exact_zero"] = zero_where_ref_zero(outs["w4a16"], refs["exact"])
    res.checks["a8:zero_where_exact_zero"] = a8.pop("zero_where_exact_zero")
    res.notes["a8_worst_token"] = a8.pop("worst_token")
    res.metrics = {
        "w4a16_vs_emulation": relative_l2(outs["w4a16"], refs["w4a16"]),
        "w4a16_vs_exact": relative_l2(outs["w4a16"], refs["exact"]),
        **a8,
        "w4a8_vs_w4a16": relative_l2(outs["w4a8"], outs["w4a16"]),
    }
    res.metrics = {m: res.metrics[m] for m in metric_names("layer")}  # table order


def backend_description(device: torch.device) -> str:
    """One sentence on what ``fused_moe`` runs on ``device``."""
    if device.type == "cuda":
        return f"CUDA device {torch.cuda.get_device_name(device)}: fused_moe runs the mxmoe Triton kernels."
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "CPU with TRITON_INTERPRET=1: fused_moe runs the Triton kernels in Triton's interpreter (slow)."
    return ("CPU: fused_moe is the PyTorch emulation (mxmoe.reference), not the kernels, so 'a8~emu' compares the "
            "emulation with itself and the GEMM-level cases the emulation's FP32 GEMMs with float64; set "
            "TRITON_INTERPRET=1 to run the Triton kernels in the interpreter.")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` (CUDA if present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; CUDA devices get their index."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _pct(v: Optional[float], digits: int = 3) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
    return f"{100 * v:.{digits}f}"


def _col(label: str) -> int:
    return max(len(label), 8)


def format_row(r: CaseResult, width: int) -> str:
    cols = []
    tol = r.tolerances()
    for m in metric_names(r.case.kind):
        v = r.metrics.get(m)
        s = _pct(v, 4 if r.case.kind == "gemm" else 3)  # (GEMM-level: bounds of 0.15 %)
        if v is not None and tol[m] is not None and not v <= tol[m]:
            s += "!"
        cols.append(f"{s:>{_col(METRICS[m].label)}}")
    verdict = "pass" if r.passed else "FAIL " + ",".join(r.failures)
    return f"{r.case.name:<{width}} {r.case.shape:>16} {r.case.T:>5}  " + " ".join(cols) + f"  {verdict}"


def header(width: int, kind: str = "layer") -> str:
    cols = " ".join(f"{METRICS[m].label:>{_col(METRICS[m].label)}}" for m in metric_names(kind))
    return f"{'case':<{width}} {'E,H,I,top_k':>16} {'T':>5}  " + cols + "  result"


def legend(kinds: Sequence[str]) -> list[str]:
    """One line per metric of ``kinds``: label, meaning, bound."""
    lines = []
    for m, d in METRICS.items():
        if d.kind not in kinds:
            continue
        if d.tolerance is None:
            bound = "information"
        else:
            unit = " points" if "excess" in m else "%"
            bound = f"<= {100 * d.tolerance:g}{unit}"
            if d.reference_shape_only:
                shape = ",".join(map(str, REFERENCE_SHAPE))
                bound += f" at the reference shape {shape}, information elsewhere"
        lines.append(f"  {d.label:<14} {d.what}: {bound}")
    return lines


def run_checks(cases: Sequence[Case], device: torch.device, *, seed: int = 0, stream: Optional[TextIO] = None,
               json_path: Optional[str] = None) -> int:
    """Run ``cases``, print a table to ``stream`` (stdout); returns 0 if all pass, else 1."""
    stream = stream or sys.stdout
    width = max([len(c.name) for c in cases] + [4])
    print(backend_description(device), file=stream)
    kinds = [k for k in CASE_KINDS if any(c.kind == k for c in cases)]
    print("relative L2 in % (excesses: differences of them, in percentage points); '!' marks a miss. Columns:",
          file=stream)
    for line in legend(kinds):
        print(line, file=stream)
    print("Also checked: every element written (outputs pre-filled with NaN), finite, path, deterministic, all-masked "
          "rows and rows whose exact reference is zero exactly zero.", file=stream)
    results = []
    shown = None
    for case in cases:
        if case.kind != shown:
            shown = case.kind
            print(("GEMM-level (W4A8):\n" if shown == "gemm" and kinds != ["gemm"] else "") + header(width, shown),
                  file=stream)
        r = run_case(case, device, seed)
        results.append(r)
        print(format_row(r, width), file=stream, flush=True)
        if r.error:
            print(f"{'':<{width}}   error: {r.error}", file=stream)
    failed = [r.case.name for r in results if not r.passed]
    summary = (f"{len(results) - len(failed)} passed, {len(failed)} failed"
               + (f" ({', '.join(failed)})" if failed else "") + f" on {device.type}")
    print(summary, file=stream)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=str(device), backend=backend_description(device), seed=seed,
                           reference_shape=list(REFERENCE_SHAPE),
                           metrics={m: dict(label=d.label, tolerance=d.tolerance, what=d.what, kind=d.kind,
                                            reference_shape_only=d.reference_shape_only)
                                    for m, d in METRICS.items()},
                           tolerances={m: d.tolerance for m, d in METRICS.items()},
                           results=[r.as_dict() for r in results]), f, indent=1)
    return 1 if failed else 0
