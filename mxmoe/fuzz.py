"""``mxmoe check --fuzz N``: randomized differential cases against the PyTorch references.

Case ``i`` of seed ``S`` is drawn from its own random stream (``random.Random(f"{S}:{i}")`` for its parameters, torch
generators seeded from it for its tensors), so any one case reruns alone: ``mxmoe check --fuzz 1 --start i --seed S``.
What a case draws (:func:`draw_case`):

* shapes: E log-uniform in [1, 300]; H and I multiples of 32 (K tails included) log-uniform up to 7168; top_k in
  [1, 10]; on a GPU ~5 % of the cases gpt-oss-20b's E=32, H=I=2880, top_k=4; T log-uniform in [1, 16384], and in ~2 % of cases T x top_k > 2^17 rows. On a GPU the weights stay under
  ``WEIGHT_BUDGET`` elements and the call under ``MAC_BUDGET`` multiply-adds (the references must stay cheap): the
  larger of H and I halves, then T shrinks. On the CPU (the emulation, or ``TRITON_INTERPRET=1``) shapes are small;
* routing: uniform, every route to one expert, half the experts empty, one or two hot experts; then masked routes
  (-1, ids past the experts, INT32_MIN/MAX, int64 ids >= 2^32 whose low bits are valid, dropped globals) whose weights
  may be 10, Inf or NaN (a masked route contributes zero whatever its weight), whole tokens masked, duplicate ids
  within a token, int32 and int64 ids, an ``expert_map`` over more global experts than local ones;
* biases, global scales, silu or swigluoai, ``swiglu_limit``;
* scale bytes: as quantization gives them, byte 0 in blocks, rows spanning ~30 binades (all rows, or the odd
  experts'), every byte 0..254 sprinkled over blocks (a block raised above its own byte has its codes zeroed, so
  values stay finite), or the whole layer shifted by up to 2^+-100 (x compensates GEMM1's shift, the output carries
  GEMM2's);
* eager calls with or without a planned ``Workspace``; W4A16 also as a CUDA-graph replay (bitwise equal to eager);
  a second run (bitwise equal); a token poisoned with Inf/NaN in ``x`` or in a routing weight (every other token's
  output bitwise unchanged: the README's rule for non-finite inputs); W4A8 GEMM-level cases (each GEMM vs float64,
  :func:`mxmoe.accuracy.gemm_level`).

Bounds (relative L2, SPEC §5, whole output and per token): see :data:`BOUNDS`.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence, TextIO

import torch

from . import accuracy, check, testing
from ._details import interpreting
from .moe import fused_moe
from .prepare import prepare_weights
from .reference import fused_moe_references, relative_l2
from .selection import PATHS

WEIGHT_BUDGET = 1 << 30  # E * 3 * H * I on a GPU
MAC_BUDGET = 1 << 36  # T * top_k * 3 * H * I on a GPU
BIG_ROWS = 1 << 17  # a few cases route more rows than this
GPT_OSS_20B = (32, 2880, 2880, 4)  # E, H, I, top_k
GPT_OSS_SHARE = 0.05
ROUTINGS = testing.FUZZ_ROUTINGS
SCALES = ("normal", "zero_bytes", "wide_span", "mixed_span", "every_byte", "offset")

# metric -> (bound, what); relative L2, excesses in the same unit (0.005 = 0.5 percentage points)
BOUNDS = {
    "w4a16_vs_emulation": (0.005, "W4A16 vs its emulation, whole output"),
    "w4a16_excess_over_emulation": (0.005, "W4A16 vs exact minus its emulation vs exact, whole output (the BF16 "
                                           "intermediate's own error left out: at T=1, I=32 it alone passes 0.5 %)"),
    "w4a16_worst_token": (0.015, "W4A16 vs its emulation, worst token (mxmoe's bound: SPEC bounds W4A16 whole)"),
    "w4a8_excess_over_emulation": (0.005, "W4A8 vs exact minus the FP8 emulation vs exact, whole output"),
    "w4a8_worst_token_excess": (0.015, "the same per token, worst token"),
    "w4a8_gemm1_vs_f64": (0.0015, "W4A8 GEMM1 vs float64 of the same E4M3 operands"),
    "w4a8_gemm2_vs_f64": (0.0015, "W4A8 GEMM2 vs float64 of the same E4M3 operands"),
}
INFO = ("w4a16_vs_exact", "w4a8_vs_exact", "emulation_vs_exact", "w4a8_vs_emulation", "w4a8_vs_emulation_worst_token")
# A token over the W4A8 token-excess bound is explained, and passes, when the kernel's own intermediate shows why: each
# E4M3 code is a rounding of the exact activation (float64 GEMM1 of the quantized x) to within half a code step plus
# CODE_TOL of the route's RMS (4x SPEC's GEMM bound: the FP8 accumulator's own error moves values near a rounding tie
# to the other code), and the token's output matches float64 GEMM2 of those codes within GEMM2_TOKEN_TOL. With few
# elements per token (I = 64) and thousands of tokens, a token collects enough such flips to pass 1.5 points while
# the whole output's excess stays ~0 (measured on the H200: docs/design.md, "Checks that guard the design").
CODE_TOL = 4 * 0.0015
GEMM2_TOKEN_TOL = 0.005
EXPLAINED_TOKENS = 16  # the worst tokens over the bound that are examined


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    index: int
    E: int
    H: int
    I: int
    top_k: int
    T: int
    routing: str = "uniform"
    mask_fraction: float = 0.0  # of the routes, masked
    masked_tokens: int = 0  # tokens with every route masked
    duplicates: bool = False  # a repeated id within some tokens
    ids_dtype: str = "int32"
    dropped: int = 0  # > 0: an expert_map over E + dropped global experts, ``dropped`` of them mapped to -1
    biases: bool = False
    global_scales: bool = False
    activation: str = "silu"
    swiglu_limit: Optional[float] = None
    scales: str = "normal"
    shift13: int = 0  # "offset": binades added to every w13 scale byte (x carries the opposite)
    shift2: int = 0  # and to every w2 byte (the output carries it)
    workspace: bool = False  # a planned Workspace (else the cached one)
    graph: bool = False  # W4A16 also as a CUDA-graph replay
    repeat: bool = False  # a second eager run, bitwise equal
    poison: str = ""  # "", "x" or "weight": a token poisoned with Inf/NaN, other tokens bitwise unchanged
    gemm_level: bool = False  # W4A8 as GEMM-level (zero up rows, swigluoai alpha 0)

    def reproduce(self, device: torch.device, precisions: Sequence[str]) -> str:
        env = "TRITON_INTERPRET=1 " if device.type == "cpu" and interpreting() else ""
        prec = "" if tuple(precisions) == PATHS else f" --precision {','.join(precisions)}"
        return f"{env}mxmoe check --fuzz 1 --start {self.index} --seed {self.seed} --device {device.type}{prec}"

    def summary(self) -> str:
        mods = [self.routing, self.scales, self.ids_dtype, self.activation]
        mods += [f"mask={self.mask_fraction:.2f}"] if self.mask_fraction else []
        mods += [f"masked_tokens={self.masked_tokens}"] if self.masked_tokens else []
        mods += ["dup"] if self.duplicates else []
        mods += [f"emap+{self.dropped}"] if self.dropped else []
        mods += ["bias"] if self.biases else []
        mods += ["gscale"] if self.global_scales else []
        mods += [f"limit={self.swiglu_limit:.2f}"] if self.swiglu_limit is not None else []
        mods += [f"shift={self.shift13},{self.shift2}"] if self.scales == "offset" else []
        mods += ["ws"] if self.workspace else []
        mods += ["graph"] if self.graph else []
        mods += [f"poison:{self.poison}"] if self.poison else []
        mods += ["gemm-level"] if self.gemm_level else []
        return f"E={self.E} H={self.H} I={self.I} top_k={self.top_k} T={self.T} " + " ".join(mods)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _multiple_of_32(rng: random.Random, hi: int) -> int:
    return 32 * _log_uniform(rng, 1, hi // 32)


def draw_case(seed: int, index: int, small: bool) -> FuzzCase:
    """Case ``index`` of ``seed``; ``small``: CPU-sized shapes."""
    rng = random.Random(f"{seed}:{index}")
    E = _log_uniform(rng, 1, 12 if small else 300)
    top_k = rng.randint(1, 6 if small else 10)
    H = _multiple_of_32(rng, 256 if small else 7168)
    I = _multiple_of_32(rng, 256 if small else 7168)
    if not small and rng.random() < 0.02:  # more than 2^17 routed rows, small matrices
        top_k = rng.randint(9, 10)
        T = BIG_ROWS // top_k + rng.randint(1, 4096)
        H, I = min(H, 256), min(I, 256)
    else:
        T = _log_uniform(rng, 1, 40 if small else 16384)
    # gpt-oss-20b's shape (the model people serve most, K tails of 2880) in ~GPT_OSS_SHARE of the GPU cases, drawn from
    # a stream of its own so that every other case stays what it was
    if not small and random.Random(f"{seed}:{index}:gpt-oss").random() < GPT_OSS_SHARE:
        E, H, I, top_k = GPT_OSS_20B
    if not small:
        while E * 3 * H * I > WEIGHT_BUDGET:
            if H >= I:
                H = max(32, H // 64 * 32)
            else:
                I = max(32, I // 64 * 32)
        T = max(1, min(T, MAC_BUDGET // (top_k * 3 * H * I)))
    gemm = rng.random() < 0.1
    routing = rng.choices(ROUTINGS, weights=(0.45, 0.1, 0.2, 0.25))[0]
    case = FuzzCase(
        seed=seed, index=index, E=E, H=H, I=I, top_k=top_k, T=T, routing=routing,
        mask_fraction=rng.uniform(0.05, 0.5) if rng.random() < 0.4 else 0.0,
        masked_tokens=rng.randint(1, min(T, 3)) if rng.random() < 0.3 else 0,
        duplicates=top_k > 1 and rng.random() < 0.15,
        ids_dtype=rng.choice(("int32", "int64")),
        dropped=rng.randint(1, 2 * E) if rng.random() < 0.2 else 0,
        biases=not gemm and rng.random() < 0.3,
        global_scales=not gemm and rng.random() < 0.2,
        activation=rng.choice(("silu", "swigluoai")),
        swiglu_limit=rng.uniform(0.5, 10.0) if rng.random() < 0.4 else None,
        scales=rng.choices(SCALES, weights=(0.35, 0.1, 0.1, 0.1, 0.15, 0.2))[0],
        workspace=rng.random() < 0.5,
        graph=not small and rng.random() < 0.15,
        repeat=rng.random() < 0.15,
        poison=rng.choice(("x", "weight")) if rng.random() < 0.12 and T >= 2 else "",  # (other tokens to watch)
        gemm_level=gemm,
    )
    if case.scales == "offset":
        case = replace(case, shift13=rng.randint(-100, 100), shift2=rng.randint(-100, 100))
    if gemm:  # the GEMM-level activation (accuracy.gemm_level), for both paths' layer runs too
        case = replace(case, activation="swigluoai", swiglu_limit=accuracy.GEMM_LEVEL_LIMIT)
    return case


# --------------------------------------------------------------------------------------
# Building a case's tensors
# --------------------------------------------------------------------------------------


def _experts(case: FuzzCase, device: torch.device, gen: torch.Generator):
    pattern = case.scales if case.scales in testing.SCALE_PATTERNS else "normal"
    src, x_exp = testing.source_tensors(case.E, case.H, case.I, gen, pattern, case.biases, case.global_scales, 2.0,
                                      gen.device)
    if case.gemm_level:
        src["w13"][:, case.I:] = 0  # gate_up rows: the up half (accuracy.gemm_level)
    if case.scales == "every_byte":
        testing.every_byte_scales(src["w13"], src["w13_scale"], gen)
        testing.every_byte_scales(src["w2"], src["w2_scale"], gen)
    elif case.scales == "offset":
        testing.shift_scale_bytes(src["w13_scale"], case.shift13)
        testing.shift_scale_bytes(src["w2_scale"], case.shift2)
    src = {k: v.to(device) for k, v in src.items()}
    return prepare_weights(w13_layout="gate_up", **src), x_exp


@dataclass
class Inputs:
    x: torch.Tensor
    experts: object
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: Optional[torch.Tensor]
    masked_rows: torch.Tensor  # tokens whose routes are all masked

    def args(self):
        return self.x, self.experts, self.topk_weights, self.topk_ids


def build(case: FuzzCase, device: torch.device) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(random.Random(f"{case.seed}:{case.index}:t").getrandbits(62))
    cpu_gen = torch.Generator().manual_seed(random.Random(f"{case.seed}:{case.index}:r").getrandbits(62))
    experts, x_exp = _experts(case, device, gen)
    x = torch.randn(case.T, case.H, generator=gen, device=device)
    if x_exp is not None:
        x = x * torch.exp2(x_exp.to(device).float()).repeat_interleave(32)
    if case.shift13:
        x = x * 2.0 ** -case.shift13
    weights, ids, expert_map, masked = testing.compose_routing(
        case.E, case.T, case.top_k, cpu_gen, routing=case.routing, mask_fraction=case.mask_fraction,
        masked_tokens=case.masked_tokens, duplicates=case.duplicates, ids_dtype=case.ids_dtype, dropped=case.dropped)
    move = lambda t: None if t is None else t.to(device).contiguous()  # noqa: E731
    return Inputs(x=x.to(torch.bfloat16).contiguous(), experts=experts, topk_weights=move(weights), topk_ids=move(ids),
                  expert_map=move(expert_map), masked_rows=move(masked.all(dim=1).nonzero().squeeze(1)))


# --------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------


@dataclass
class FuzzResult:
    case: FuzzCase
    precision: str
    metrics: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    error: Optional[str] = None
    explained: dict = field(default_factory=dict)  # metric over its bound -> what explains it (explain_token_excess)

    @property
    def failures(self) -> list[str]:
        bad = [m for m, v in self.metrics.items() if m in BOUNDS and v is not None and not v <= BOUNDS[m][0]
               and m not in self.explained]
        bad += [c for c, ok in self.checks.items() if not ok]
        return bad + (["error"] if self.error else [])


def _call(inp: Inputs, case: FuzzCase, precision: str, workspace, out=None):
    out = torch.full_like(inp.x, math.nan) if out is None else out
    got, ran = fused_moe(*inp.args(), activation=case.activation, swiglu_limit=case.swiglu_limit,
                         swiglu_alpha=accuracy.GEMM_LEVEL_ALPHA if case.gemm_level else None, expert_map=inp.expert_map,
                         precision=precision, out=out, workspace=workspace, return_precision=True)
    return got, ran, out


def _graph_replay(inp: Inputs, case: FuzzCase, workspace) -> torch.Tensor:
    out = torch.full_like(inp.x, math.nan)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _call(inp, case, "w4a16", workspace, out)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(inp, case, "w4a16", workspace, out)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    del graph
    return out


def _poisoned(inp: Inputs, case: FuzzCase, rng: random.Random) -> tuple[Inputs, int]:
    t = rng.randrange(case.T)
    value = rng.choice((math.inf, -math.inf, math.nan))
    if case.poison == "x":
        x = inp.x.clone()
        cols = torch.randint(case.H, (rng.randint(1, 4),), generator=torch.Generator().manual_seed(case.index))
        x[t, cols.to(x.device)] = value
        return replace(inp, x=x), t
    w = inp.topk_weights.clone()
    w[t, rng.randrange(case.top_k)] = value
    return replace(inp, topk_weights=w), t


def _bitwise_equal_except(a: torch.Tensor, b: torch.Tensor, row: int) -> bool:
    keep = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
    keep[row] = False
    return accuracy.bitwise_equal(a[keep], b[keep])


def _layer(res: FuzzResult, inp: Inputs, refs: dict, workspace, device) -> torch.Tensor:
    case, prec = res.case, res.precision
    got, ran, out = _call(inp, case, prec, workspace)
    accuracy.synchronize(device)
    res.checks.update(check.call_checks(out, got, ran, prec, inp.masked_rows, prec))
    if prec == "w4a16":
        res.checks["w4a16:zero_where_exact_zero"] = accuracy.zero_where_ref_zero(out, refs["exact"])
        res.metrics["w4a16_vs_emulation"] = relative_l2(out, refs["w4a16"])
        res.metrics["w4a16_vs_exact"] = relative_l2(out, refs["exact"])
        res.metrics["w4a16_excess_over_emulation"] = res.metrics["w4a16_vs_exact"] - relative_l2(refs["w4a16"],
                                                                                                refs["exact"])
        res.metrics["w4a16_worst_token"] = accuracy.worst_token_relative_l2(out, refs["w4a16"])
    else:
        m = accuracy.w4a8_layer_metrics(out, refs["w4a8"], refs["exact"])
        res.checks["w4a8:zero_where_exact_zero"] = m.pop("zero_where_exact_zero")
        res.metrics["worst_token"] = m.pop("worst_token")
        res.metrics.update(m)
    return out


def run_one(case: FuzzCase, device: torch.device, precisions: Sequence[str]) -> list[FuzzResult]:
    """Every precision of ``case``: one result each (a failure to build the case fails them all)."""
    results = [FuzzResult(case, p) for p in precisions]
    try:
        inp = build(case, device)
        workspace = None
        if case.workspace:
            from .workspace import Workspace

            workspace = Workspace(inp.experts, case.T, case.top_k, fp8="w4a8" in precisions)
        layer_modes = tuple(m for p in precisions for m in (("w4a16",) if p == "w4a16" else ("w4a8",))
                            if not (p == "w4a8" and case.gemm_level))
        refs = fused_moe_references(*inp.args(), activation=case.activation, swiglu_limit=case.swiglu_limit,
                                    swiglu_alpha=accuracy.GEMM_LEVEL_ALPHA if case.gemm_level else None,
                                    expert_map=inp.expert_map, modes=("exact",) + layer_modes)
    except Exception as exc:
        for r in results:
            r.error = f"building the case: {type(exc).__name__}: {exc}"
        return results
    rng = random.Random(f"{case.seed}:{case.index}:run")
    for res in results:
        try:
            _run_precision(res, inp, refs, workspace, device, rng)
        except Exception as exc:  # a crash is a failed case, not a crashed run
            res.error = f"{type(exc).__name__}: {exc}"
    return results


def _run_precision(res: FuzzResult, inp: Inputs, refs: dict, workspace, device, rng: random.Random) -> None:
    case, prec = res.case, res.precision
    if prec == "w4a8" and case.gemm_level:
        metrics, checks = accuracy.gemm_level(*inp.args(), inp.expert_map)
        res.metrics.update(metrics)
        res.checks.update({f"gemm:{c}": ok for c, ok in checks.items()})
        return
    out = _layer(res, inp, refs, workspace, device)
    if res.failures == ["w4a8_worst_token_excess"]:
        tokens = tokens_over_excess(out, refs["w4a8"], refs["exact"], BOUNDS["w4a8_worst_token_excess"][0])
        why = explain_token_excess(inp, case, out, tokens[:EXPLAINED_TOKENS])
        res.metrics.update({f"explain_{k}": v for k, v in why.items() if k != "ok"})
        if why["ok"]:
            res.explained["w4a8_worst_token_excess"] = why
    if case.repeat:
        again = _call(inp, case, prec, workspace)[2]
        accuracy.synchronize(device)
        res.checks[f"{prec}:deterministic"] = accuracy.bitwise_equal(out, again)
    if case.graph and prec == "w4a16" and device.type == "cuda":
        res.checks["w4a16:graph_replay_bitwise"] = accuracy.bitwise_equal(out, _graph_replay(inp, case, workspace))
    if case.poison:
        bad, token = _poisoned(inp, case, rng)
        poisoned = _call(bad, case, prec, workspace)[2]
        accuracy.synchronize(device)
        res.checks[f"{prec}:poison_{case.poison}_isolated"] = _bitwise_equal_except(out, poisoned, token)


def tokens_over_excess(out: torch.Tensor, emu: torch.Tensor, exact: torch.Tensor, bound: float) -> list[int]:
    """The tokens whose per-token excess over the emulation's error passes ``bound``, worst first."""
    e_out, nonzero = accuracy.per_token_relative_l2(out, exact)
    e_emu, _ = accuracy.per_token_relative_l2(emu, exact)
    excess = torch.where(nonzero, e_out - e_emu, torch.full_like(e_out, -math.inf))
    order = torch.argsort(excess, descending=True)
    return [int(t) for t in order.tolist() if excess[t] > bound]


def _e4m3_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 code step at magnitude ``|v|`` (3 mantissa bits; subnormal steps 2^-9)."""
    return 0.5 * torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)


def explain_token_excess(inp: Inputs, case: FuzzCase, out: torch.Tensor, tokens: Sequence[int]) -> dict:
    """Whether the W4A8 kernels' own intermediate explains ``tokens``' excess (see :data:`CODE_TOL`). Reruns the call
    into a planned workspace (bitwise the same output, checked) to read the intermediate's E4M3 codes and scales.
    Returns ``{"ok", "code_dev", "gemm2_token"}``: the largest code deviation in units of the allowed one (<= 1
    passes) and the largest per-token relative L2 of the output against float64 GEMM2 of the kernel's codes."""
    from .workspace import Workspace
    from .activation import apply_activation
    from .reference import decode_expert, quantize_rows_fp8
    from .routing import local_expert_ids

    ex = inp.experts
    ws = Workspace(ex, case.T, case.top_k, fp8=True)
    again = _call(inp, case, "w4a8", ws)[2]
    accuracy.synchronize(out.device)
    if not accuracy.bitwise_equal(again, out):
        return dict(ok=False, code_dev=math.inf, gemm2_token=math.inf)
    k = case.top_k
    local = local_expert_ids(inp.topk_ids, ex.num_experts, inp.expert_map).reshape(-1).long()
    slot = ws.route_slot[: case.T * k].long()
    q, s = quantize_rows_fp8(inp.x)
    code_dev, gemm2 = 0.0, 0.0
    for t in tokens:
        y = torch.zeros(case.H, dtype=torch.float64, device=out.device)
        for r in range(t * k, t * k + k):
            e = int(local[r])
            if e < 0:
                continue
            if int(slot[r]) < 0:
                return dict(ok=False, code_dev=math.inf, gemm2_token=math.inf)
            w13, w2 = decode_expert(ex, e)
            h = (q[t].float().double() * s[t].double()) @ w13.double().T
            if ex.b13 is not None:
                h = h + ex.b13[e].double()
            a = apply_activation(h, case.activation, case.swiglu_limit).double()
            codes = accuracy.from_slot_order(ws.inter_q.view(torch.uint8)[slot[r]][None].contiguous())
            codes = codes.view(torch.float8_e4m3fn)[0].float().double()
            scale = ws.inter_scale[slot[r]].double()
            target = a / scale if scale > 0 else torch.zeros_like(a)
            allowed = _e4m3_half_step(target) + CODE_TOL * target.pow(2).mean().sqrt()
            code_dev = max(code_dev, float(((codes - target.clamp(-448, 448)).abs() / allowed).max()))
            y2 = (codes * scale) @ w2.double().T
            if ex.b2 is not None:
                y2 = y2 + ex.b2[e].double()
            y = y + inp.topk_weights[t, r - t * k].double() * y2
        gemm2 = max(gemm2, relative_l2(out[t], y))
    return dict(ok=code_dev <= 1.0 and gemm2 <= GEMM2_TOKEN_TOL, code_dev=code_dev, gemm2_token=gemm2)


# --------------------------------------------------------------------------------------
# The run: counts, worst error per category, failures with their reproduction
# --------------------------------------------------------------------------------------

CATEGORIES = ("routing", "scales", "ids_dtype", "activation", "expert_map", "biases", "K tail", "shape", "T", "extras")


def categories(case: FuzzCase) -> dict:
    """The category values ``case`` falls in, one per axis of :data:`CATEGORIES`."""
    tails = [d for d in (case.H, case.I) if d % 128]
    extras = [name for name, on in (("graph", case.graph), ("poison", bool(case.poison)), ("repeat", case.repeat),
                                    ("workspace", case.workspace), ("gemm-level", case.gemm_level),
                                    ("masked tokens", bool(case.masked_tokens)), ("masked routes",
                                                                                  case.mask_fraction > 0),
                                    ("duplicates", case.duplicates)) if on]
    rows = case.T * case.top_k
    return {
        "routing": case.routing, "scales": case.scales, "ids_dtype": case.ids_dtype, "activation": case.activation,
        "expert_map": "yes" if case.dropped else "no", "biases": "yes" if case.biases else "no",
        "K tail": ("32" if any(d % 64 for d in tails) else "64") if tails else "none",
        "shape": "gpt-oss-20b" if (case.E, case.H, case.I, case.top_k) == GPT_OSS_20B else "drawn",
        "T": ("rows > 2^17" if rows > BIG_ROWS else "T <= 16" if case.T <= 16 else "T <= 1024" if case.T <= 1024
              else "T > 1024"),
        "extras": extras,
    }


def _worst(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a
    return b if a is None or b > a else a


def summarize(results: Sequence[FuzzResult]) -> dict:
    """``{precision: {"cases", "passed", "failed", "worst": {metric: v}, "categories": {axis: {value: {"cases",
    "failed", metric: worst}}}}}``."""
    out = {}
    for res in results:
        s = out.setdefault(res.precision, dict(cases=0, passed=0, failed=0, explained=0, worst={}, categories={}))
        s["cases"] += 1
        s["failed" if res.failures else "passed"] += 1
        s["explained"] += bool(res.explained and not res.failures)
        metrics = {m: v for m, v in res.metrics.items() if m in BOUNDS or m in INFO}
        for m, v in metrics.items():
            s["worst"][m] = _worst(s["worst"].get(m), v)
        for axis, values in categories(res.case).items():
            for value in values if isinstance(values, list) else [values]:
                c = s["categories"].setdefault(axis, {}).setdefault(value, dict(cases=0, failed=0))
                c["cases"] += 1
                c["failed"] += bool(res.failures)
                for m, v in metrics.items():
                    if m in BOUNDS:
                        c[m] = _worst(c.get(m), v)
    return out


_SHORT = {"w4a16_vs_emulation": "a16~emu", "w4a16_excess_over_emulation": "a16 excess", "w4a16_worst_token": "a16 tok",
          "w4a8_excess_over_emulation": "a8 excess", "w4a8_worst_token_excess": "a8 tok exc",
          "w4a8_gemm1_vs_f64": "gemm1", "w4a8_gemm2_vs_f64": "gemm2"}


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.3f}"


def print_summary(summary: dict, stream: TextIO) -> None:
    for prec, s in summary.items():
        metrics = [m for m in BOUNDS if m in s["worst"]]
        explained = f" ({s['explained']} of them over the token bound, explained)" if s["explained"] else ""
        print(f"\n{prec}: {s['cases']} cases, {s['passed']} passed{explained}, {s['failed']} failed. Worst (%, bound):",
              file=stream)
        print("  " + ", ".join(f"{_SHORT[m]} {_fmt(s['worst'][m])} ({100 * BOUNDS[m][0]:g})" for m in metrics),
              file=stream)
        head = f"  {'category':<26} {'cases':>6} {'fail':>5} " + " ".join(f"{_SHORT[m]:>10}" for m in metrics)
        print(head, file=stream)
        for axis, values in s["categories"].items():
            for value, c in sorted(values.items()):
                cols = " ".join(f"{_fmt(c.get(m)):>10}" for m in metrics)
                print(f"  {axis + ': ' + str(value):<26} {c['cases']:>6} {c['failed']:>5} {cols}", file=stream)


def run_fuzz(count: int, device: torch.device, *, seed: int = 0, start: int = 0,
             precisions: Sequence[str] = PATHS, small: Optional[bool] = None, stream: Optional[TextIO] = None,
             json_path: Optional[str] = None) -> int:
    """Run cases ``start .. start + count - 1`` of ``seed``; print each failure with its reproduction, then the
    counts and the worst error per category. Returns 0 when every case passed, else 1."""
    stream = stream or sys.stdout
    small = device.type != "cuda" if small is None else small
    print(check.backend_description(device), file=stream)
    print(f"fuzz: {count} cases from {start}, seed {seed}, {', '.join(precisions)}, "
          f"{'small' if small else 'full-size'} shapes", file=stream, flush=True)
    began = time.perf_counter()
    results, failures, explained = [], [], []
    for i in range(start, start + count):
        case = draw_case(seed, i, small)
        for res in run_one(case, device, precisions):
            results.append(res)
            if res.explained and not res.failures:
                explained.append(res)
                print(f"explained case {i} {res.precision}: {res.case.summary()} | token excess "
                      f"{res.metrics['w4a8_worst_token_excess']:.5f}, code deviation "
                      f"{res.metrics['explain_code_dev']:.3f} of the allowed, GEMM2 token "
                      f"{res.metrics['explain_gemm2_token']:.2e}", file=stream, flush=True)
            if res.failures:
                failures.append(res)
                shown = {m: round(v, 6) for m, v in res.metrics.items() if m in BOUNDS and v is not None}
                print(f"FAIL case {i} {res.precision}: {','.join(res.failures)} | {case.summary()} | {shown}"
                      + (f" | {res.error}" if res.error else ""), file=stream)
                print(f"  reproduce: {case.reproduce(device, [res.precision])}", file=stream, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (cases differ in size: hold no cache between them, e.g. beside other shards)
        done = i - start + 1
        if done % 100 == 0:
            print(f"  {done}/{count} cases, {len(failures)} failures, {time.perf_counter() - began:.0f} s",
                  file=stream, flush=True)
    seconds = time.perf_counter() - began
    summary = summarize(results)
    print_summary(summary, stream)
    print(f"\n{count} cases ({len(results)} case-precisions), {len(failures)} failed, {seconds:.1f} s on {device}",
          file=stream)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=str(device), backend=check.backend_description(device), seed=seed, start=start,
                           count=count, precisions=list(precisions), small=small, seconds=round(seconds, 1),
                           bounds={m: dict(bound=b, what=w) for m, (b, w) in BOUNDS.items()}, summary=summary,
                           failures=[dict(index=r.case.index, precision=r.precision, failures=r.failures,
                                          error=r.error, metrics=r.metrics, case=asdict(r.case),
                                          reproduce=r.case.reproduce(device, [r.precision])) for r in failures],
                           explained=[dict(index=r.case.index, precision=r.precision, metrics=r.metrics,
                                           case=asdict(r.case)) for r in explained]),
                      f, indent=1)
    return 1 if failures else 0
