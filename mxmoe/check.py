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

GEMM-level cases (``Case.kind == "gemm"``): :mod:`mxmoe.accuracy` (``gemm_level``).

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
from typing import Optional, Sequence, TextIO

import torch

from .accuracy import (CASE_KINDS, METRICS, REFERENCE_SHAPE, bitwise_equal, gemm_level, metric_names, synchronize,
                       tolerance, w4a8_layer_metrics, zero_where_ref_zero)
from .moe import fused_moe
from .prepare import PreparedExperts
from .reference import fused_moe_references, relative_l2
from .selection import PATHS
from .testing import make_experts, make_routing



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
        synchronize(device)
        tag = "a8" if prec == "w4a8" else "a16"
        res.checks.update(call_checks(out, got, ran, prec, p.masked_rows, tag))
        res.checks[f"{tag}:deterministic"] = bitwise_equal(out, again)
        outs[prec] = out
    refs = fused_moe_references(*args, **p.kwargs())
    synchronize(device)
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
