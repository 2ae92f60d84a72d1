"""``mxmoe check``: synthetic numerical checks of both paths against the PyTorch references.

Each :class:`Case` builds one synthetic problem (random weights quantized with
:func:`mxmoe.quantize_mxfp4`, a routing from :func:`make_routing`, optional scale-byte
patterns, biases and activation), runs ``fused_moe`` with ``precision="w4a16"`` and
``"w4a8"`` into outputs pre-filled with NaN, and compares against
:func:`mxmoe.fused_moe_reference` in its three modes:

==============  =======================================  ==========
metric          what                                     tolerance
==============  =======================================  ==========
``a8~emu``      W4A8 vs the FP8 emulation (mode w4a8)    0.5 %
``a16~emu``     W4A16 vs its emulation (mode w4a16)      0.5 %
``a8~a16``      W4A8 vs W4A16                            (info)
``a16~exact``   W4A16 vs the exact FP32 reference        0.5 %
``a8~exact``    W4A8 vs the exact FP32 reference         5 %
``emu8~exact``  the FP8 emulation vs exact               (info)
==============  =======================================  ==========

``emu8~exact`` is the error FP8 activations cost by themselves (about 4.5% on these
Gaussian inputs; SPEC §1 quotes about 4.6% for the SM120 reference): a W4A8 result can
not be much better than it, and it shows how much of ``a8~exact`` the data account for.

plus: every output element written and finite, the returned tensor is ``out``, the path
that ran is the one asked for, rows whose routes are all masked are exactly zero, and two
runs give bitwise the same output. Relative L2 is ``||out - ref|| / ||ref||`` over the
whole output (SPEC §5).

On a CUDA device ``fused_moe`` runs the Triton kernels. Without one the same cases run at
small shapes on the CPU, where ``fused_moe`` is the PyTorch emulation (so ``a8~emu`` is
the emulation against itself) unless ``TRITON_INTERPRET=1`` runs the kernels in Triton's
interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, TextIO

import torch

from .format import quantize_mxfp4
from .moe import fused_moe
from .prepare import PreparedExperts, prepare_weights
from .reference import fused_moe_reference, relative_l2

# --------------------------------------------------------------------------------------
# Tolerances (relative L2) and the metrics table
# --------------------------------------------------------------------------------------

# metric name -> (label, tolerance or None for information only)
METRICS = {
    "w4a8_vs_emulation": ("a8~emu", 0.005),
    "w4a16_vs_emulation": ("a16~emu", 0.005),
    "w4a8_vs_w4a16": ("a8~a16", None),
    "w4a16_vs_exact": ("a16~exact", 0.005),
    "w4a8_vs_exact": ("a8~exact", 0.05),
    "emulation_vs_exact": ("emu8~exact", None),
}
PRECISIONS = ("w4a16", "w4a8")
ROUTINGS = ("uniform", "hot", "empty", "masked", "expert_map")
SCALE_PATTERNS = ("normal", "zero_bytes", "wide_span")
WIDE_SPAN_BINADES = 30  # block scales of one row span this many binades in the wide_span pattern
WIDE_SPAN_X_GAIN = 8  # binades of that span the activations compensate (FP8 E4M3 keeps them)


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

    @property
    def shape(self) -> str:
        return f"{self.E},{self.H},{self.I},{self.top_k}"


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


def random_mxfp4(E: int, N: int, K: int, std: float, gen: torch.Generator, device, chunk_elems: int = 1 << 27):
    """Random normal weights ``[E, N, K]`` of standard deviation ``std``, quantized to E2M1-K32.

    Quantizes a few experts at a time so large shapes stay within memory.
    Returns ``(packed uint8 [E, N, K/2], scales uint8 [E, N, K/32])``.
    """
    packed = torch.empty(E, N, K // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(E, N, K // 32, dtype=torch.uint8, device=device)
    step = max(1, chunk_elems // max(N * K, 1))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        w = torch.randn(e1 - e0, N, K, generator=gen, device=device) * std
        packed[e0:e1], scales[e0:e1] = quantize_mxfp4(w)
    return packed, scales


def _zero_scale_bytes(scales: torch.Tensor, gen: torch.Generator) -> None:
    """Byte 0 (2^-127) in ~12% of blocks, in the first three rows of expert 0 and all of the last expert."""
    blocks = torch.rand(scales.shape, generator=gen, device=scales.device) < 0.12
    scales[blocks] = 0
    scales[0, :3] = 0
    scales[-1] = 0


def _spread(n: int, span: int, gen: torch.Generator, device) -> torch.Tensor:
    """``n`` offsets covering ``[0, span]`` (both ends present when n >= 2), in random order."""
    if n == 1:
        return torch.zeros(1, dtype=torch.int16, device=device)
    d = torch.linspace(0, span, n, device=device).round().to(torch.int16)
    return d[torch.randperm(n, generator=gen, device=device)]


def _wide_span_w13(scales: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Lower K-block ``k`` of every w13 row by ``d_k`` binades (``d`` spans 30); returns ``d``.

    The pattern is shared by all rows so the activations can compensate part of it: block
    ``k`` of ``x`` is multiplied by ``2**min(d_k, 8)``, so blocks 9-16 binades below a row's
    largest scale still carry a visible share of the dot product (a kernel that clamps them
    to 2^-11 of the row's largest scale, or drops them, fails ``a8~emu``).
    """
    d = _spread(scales.shape[-1], WIDE_SPAN_BINADES, gen, scales.device)
    scales.copy_((scales.to(torch.int16) - d).clamp(1, 254).to(torch.uint8))
    return d


def _wide_span_rows(scales: torch.Tensor, gen: torch.Generator) -> None:
    """Each row of w2 gets its own random block offsets spanning ~30 binades."""
    nb = scales.shape[-1]
    d = torch.randint(0, WIDE_SPAN_BINADES + 1, scales.shape, generator=gen, device=scales.device, dtype=torch.int16)
    if nb >= 2:
        d[..., 0] = 0
        d[..., -1] = WIDE_SPAN_BINADES
    scales.copy_((scales.to(torch.int16) - d).clamp(1, 254).to(torch.uint8))


def make_experts(E: int, H: int, I: int, *, seed: int = 0, device="cpu", gen_device=None, scales: str = "normal",
                 biases: bool = False, global_scales: bool = False, gain: float = 2.0):
    """Random prepared experts on ``device``: ``(PreparedExperts, x_block_exponents or None)``.

    w13 entries ~ N(0, (gain/sqrt(H))^2) so gate/up values have standard deviation about
    ``gain`` for unit inputs (limits and clamps are exercised); w2 ~ N(0, 1/I).
    ``scales``: ``"normal"`` (what quantization gives), ``"zero_bytes"`` or ``"wide_span"``
    (see :func:`_zero_scale_bytes`, :func:`_wide_span_w13`). For ``wide_span`` the second
    value holds the per-K-block exponents (int) to multiply the activations by.
    Random numbers are drawn on ``gen_device`` (default the CPU, so a seed gives the same
    weights on every device; pass the GPU for large shapes).
    """
    if scales not in SCALE_PATTERNS:
        raise ValueError(f"scales must be one of {SCALE_PATTERNS}, got {scales!r}")
    device = torch.device(device)
    gen_device = torch.device(gen_device if gen_device is not None else "cpu")
    if gen_device.type == "cpu":
        src, x_exp = _cpu_source(E, H, I, seed, scales, biases, global_scales, gain)
    else:
        src, x_exp = _source(E, H, I, seed, scales, biases, global_scales, gain, gen_device)
    src = {k: v.to(device) for k, v in src.items()}
    return prepare_weights(w13_layout="gate_up", **src), None if x_exp is None else x_exp.to(device)


def _source(E, H, I, seed, scales, biases, global_scales, gain, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    w13, s13 = random_mxfp4(E, 2 * I, H, gain / math.sqrt(H), gen, device)
    w2, s2 = random_mxfp4(E, H, I, 1.0 / math.sqrt(I), gen, device)
    x_exp = None
    if scales == "zero_bytes":
        _zero_scale_bytes(s13, gen)
        _zero_scale_bytes(s2, gen)
    elif scales == "wide_span":
        x_exp = _wide_span_w13(s13, gen).clamp(max=WIDE_SPAN_X_GAIN)
        _wide_span_rows(s2, gen)
    src = dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    if biases:
        src["b13"] = 0.5 * torch.randn(E, 2 * I, generator=gen, device=device)
        src["b2"] = 0.2 * torch.randn(E, H, generator=gen, device=device)
    if global_scales:
        src["w13_global_scale"] = 0.5 + 1.5 * torch.rand(E, generator=gen, device=device)
        src["w2_global_scale"] = 0.5 + 1.5 * torch.rand(E, generator=gen, device=device)
    return src, x_exp


@functools.lru_cache(maxsize=4)
def _cpu_source(E, H, I, seed, scales, biases, global_scales, gain):
    """CPU source tensors, cached: most check cases share one set of weights."""
    return _source(E, H, I, seed, scales, biases, global_scales, gain, torch.device("cpu"))


def _topk_distinct(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.topk(scores, top_k, dim=-1).indices


def make_routing(kind: str, T: int, E: int, top_k: int, *, seed: int = 0, device="cpu",
                 ids_dtype: torch.dtype = torch.int32):
    """Routing ``(topk_weights fp32 [T,k], topk_ids [T,k], expert_map or None, masked_rows)``.

    ``kind``:

    * ``uniform``: k distinct experts per token from random scores; the first tokens cover
      every expert when ``T*k >= E``.
    * ``hot``: experts 0 and 1 take almost every token, a few others share the rest, the
      upper half of the experts is empty.
    * ``empty``: only the last ``k+1`` experts are used (empty segments come first).
    * ``masked``: uniform, then ~25% of routes get id -1 and ~10% an id past the experts
      (for int64 ids values >= 2^32 whose low 32 bits are a valid id); tokens 0 and T//2 are
      all masked (int32: the last token's first id is INT32_MIN). Masked routes keep a large
      weight: they must contribute zero anyway.
    * ``expert_map``: ids over ``2E`` global experts; ``expert_map`` sends even globals to
      local ``g // 2`` and odd ones to -1; token 0 is all masked.

    Weights are a softmax over the chosen scores (positive, summing to 1 per token).
    """
    if kind not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    n_global = 2 * E if kind == "expert_map" else E
    scores = torch.randn(T, n_global, generator=gen, device=device)
    if kind == "hot":
        eligible = min(E, max(top_k + 2, E // 2))
        bias = torch.full((n_global,), -1e9, device=device)
        bias[:eligible] = 0.0
        bias[:2] = 8.0
        scores = scores + bias
    elif kind == "empty":
        eligible = min(E, top_k + 1)
        bias = torch.full((n_global,), -1e9, device=device)
        bias[E - eligible:] = 0.0
        scores = scores + bias
    elif T * top_k >= n_global:
        # cover every expert: token t's scores favour a slice of a random permutation
        perm = torch.randperm(n_global, generator=gen, device=device)
        for t in range(-(-n_global // top_k)):
            chosen = perm[t * top_k:(t + 1) * top_k]
            scores[t, chosen] += 1e6
    ids = _topk_distinct(scores, top_k)
    weights = torch.softmax(torch.gather(scores.clamp(min=-30.0, max=30.0), 1, ids), dim=-1).float()
    ids = ids.to(torch.int64)
    expert_map = None
    masked = torch.zeros(T, top_k, dtype=torch.bool, device=device)
    if kind == "masked":
        r = torch.rand(T, top_k, generator=gen, device=device)
        minus_one = r < 0.25
        past = (r >= 0.25) & (r < 0.35)
        if ids_dtype == torch.int64:
            far = torch.where(torch.arange(top_k, device=device) % 2 == 0, (1 << 32) + ids % E, torch.full_like(ids, E))
        else:
            far = torch.where(torch.arange(top_k, device=device) % 2 == 0, torch.full_like(ids, 2**31 - 1), torch.full_like(ids, E))
        ids = torch.where(minus_one, torch.full_like(ids, -1), torch.where(past, far, ids))
        for t in {0, T // 2}:
            if t < T:
                ids[t] = torch.tensor([-1 if k % 2 == 0 else E + k for k in range(top_k)], device=device)
        if ids_dtype == torch.int32:
            ids[T - 1:, :1] = -(2**31)  # most negative int32
        weights = torch.where(ids < 0, torch.full_like(weights, 10.0), weights)
        masked = (ids < 0) | (ids >= E)
    elif kind == "expert_map":
        expert_map = torch.where(torch.arange(n_global, device=device) % 2 == 0,
                                 torch.arange(n_global, device=device) // 2, torch.full((n_global,), -1, device=device))
        expert_map = expert_map.to(torch.int32)
        ids[0] = torch.arange(top_k, device=device) * 2 + 1  # odd globals: all masked
        masked = expert_map.long()[ids] < 0
    masked_rows = masked.all(dim=1).nonzero().squeeze(1)
    return weights.contiguous(), ids.to(ids_dtype).contiguous(), expert_map, masked_rows


def build_problem(case: Case, device="cpu", seed: int = 0) -> Problem:
    """The inputs of ``case`` on ``device``: drawn on the CPU, so a seed gives the same problem everywhere."""
    device = torch.device(device)
    experts, x_exp = make_experts(case.E, case.H, case.I, seed=seed, device=device, scales=case.scales,
                                  biases=case.biases, global_scales=case.global_scales)
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
        T = dict(partial=13, hot=40, empty=24, masked=20, emap=16, scales=24, act=19, top1=9)
    else:
        E, H, I, k = 32, 1024, 512, 4
        tail = dict(E=8, H=2880, I=2880, top_k=4)  # the ktail shape's 2880: not a multiple of 128
        big = dict(E=32, H=1024, I=512, top_k=8, T=2048)
        wide = dict(E=8, H=4096, I=1024, top_k=4)  # the reference shape's H and I
        T = dict(partial=37, hot=300, empty=200, masked=100, emap=64, scales=64, act=77, top1=33)
    base = dict(E=E, H=H, I=I, top_k=k)
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
    metrics: dict = field(default_factory=dict)  # metric name -> relative L2
    checks: dict = field(default_factory=dict)  # check name -> bool
    error: Optional[str] = None
    seconds: float = 0.0

    @property
    def failures(self) -> list[str]:
        bad = [METRICS[m][0] for m, v in self.metrics.items()
               if METRICS[m][1] is not None and not (v <= METRICS[m][1])]
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
        return dict(case=c, metrics=self.metrics, checks=self.checks, error=self.error, passed=self.passed,
                    failures=self.failures, seconds=round(self.seconds, 3))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, device="cpu", seed: int = 0) -> CaseResult:
    """Build ``case`` on ``device``, run both paths and the references, and score them."""
    device = torch.device(device)
    res = CaseResult(case)
    start = time.perf_counter()
    try:
        p = build_problem(case, device, seed)
        args = (p.x, p.experts, p.topk_weights, p.topk_ids)
        outs = {}
        for prec in PRECISIONS:
            out = torch.full_like(p.x, float("nan"))
            got, ran = fused_moe(*args, **p.kwargs(), precision=prec, out=out, return_precision=True)
            again = fused_moe(*args, **p.kwargs(), precision=prec)
            _sync(device)
            tag = "a8" if prec == "w4a8" else "a16"
            res.checks[f"{tag}:path"] = ran == prec
            res.checks[f"{tag}:returns_out"] = got is out or (got.data_ptr() == out.data_ptr() and got.shape == out.shape)
            res.checks[f"{tag}:written"] = not bool(torch.isnan(out).any())
            res.checks[f"{tag}:finite"] = bool(torch.isfinite(out).all())
            res.checks[f"{tag}:deterministic"] = _bitwise_equal(out, again)
            if p.masked_rows.numel():
                res.checks[f"{tag}:masked_rows_zero"] = bool((out[p.masked_rows] == 0).all())
            outs[prec] = out
        refs = {mode: fused_moe_reference(*args, **p.kwargs(), mode=mode) for mode in ("exact", "w4a16", "w4a8")}
        _sync(device)
        res.metrics = {
            "w4a8_vs_emulation": relative_l2(outs["w4a8"], refs["w4a8"]),
            "w4a16_vs_emulation": relative_l2(outs["w4a16"], refs["w4a16"]),
            "w4a8_vs_w4a16": relative_l2(outs["w4a8"], outs["w4a16"]),
            "w4a16_vs_exact": relative_l2(outs["w4a16"], refs["exact"]),
            "w4a8_vs_exact": relative_l2(outs["w4a8"], refs["exact"]),
            "emulation_vs_exact": relative_l2(refs["w4a8"], refs["exact"]),
        }
    except Exception as exc:  # a broken path is a failed case, not a crashed run
        res.error = f"{type(exc).__name__}: {exc}"
    res.seconds = time.perf_counter() - start
    return res


def backend_description(device: torch.device) -> str:
    """One sentence on what ``fused_moe`` runs on ``device``."""
    if device.type == "cuda":
        return f"CUDA device {torch.cuda.get_device_name(device)}: fused_moe runs the mxmoe Triton kernels."
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "CPU with TRITON_INTERPRET=1: fused_moe runs the Triton kernels in Triton's interpreter (slow)."
    return ("CPU: fused_moe is the PyTorch emulation (mxmoe.reference), not the kernels, so 'a8~emu' compares the "
            "emulation with itself; set TRITON_INTERPRET=1 to run the Triton kernels in the interpreter.")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` (CUDA if present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; CUDA devices get their index."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _pct(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "inf"
    return f"{100 * v:.3f}"


def format_row(r: CaseResult, width: int) -> str:
    cols = []
    for m, (label, tol) in METRICS.items():
        v = r.metrics.get(m)
        s = _pct(v)
        if v is not None and tol is not None and not v <= tol:
            s += "!"
        cols.append(f"{s:>{max(len(label), 8)}}")
    verdict = "pass" if r.passed else "FAIL " + ",".join(r.failures)
    return f"{r.case.name:<{width}} {r.case.shape:>16} {r.case.T:>5}  " + " ".join(cols) + f"  {verdict}"


def header(width: int) -> str:
    cols = " ".join(f"{label:>{max(len(label), 8)}}" for label, _ in METRICS.values())
    return f"{'case':<{width}} {'E,H,I,top_k':>16} {'T':>5}  " + cols + "  result"


def run_checks(cases: Sequence[Case], device: torch.device, *, seed: int = 0, stream: Optional[TextIO] = None,
               json_path: Optional[str] = None) -> int:
    """Run ``cases``, print a table to ``stream`` (stdout); returns 0 if all pass, else 1."""
    stream = stream or sys.stdout
    width = max([len(c.name) for c in cases] + [4])
    print(backend_description(device), file=stream)
    tol = ", ".join(f"{label} <= {100 * t:g}%" for label, t in METRICS.values() if t is not None)
    print(f"relative L2 in %, tolerances: {tol}; '!' marks a miss. Also checked: every element written "
          f"(out pre-filled with NaN), finite, path, deterministic, all-masked rows exactly zero.", file=stream)
    print(header(width), file=stream)
    results = []
    for case in cases:
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
                           tolerances={m: t for m, (_, t) in METRICS.items()},
                           results=[r.as_dict() for r in results]), f, indent=1)
    return 1 if failed else 0
