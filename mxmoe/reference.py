"""PyTorch references for the fused MoE layer (CPU or GPU tensors).

Three modes, by where they round:

* ``"exact"``: FP32 everywhere (weights decoded exactly, no rounding but FP32's), FP32 out.
* ``"w4a16"``: what the W4A16 kernels compute: BF16 activations, exact weights, FP32
  accumulation, BF16 intermediate after the activation, each route's weighted output
  rounded to BF16, FP32 top-k sum in order k = 0..top_k-1, BF16 output.
* ``"w4a8"``: the FP8 emulation of SPEC §5: activations quantized per row to E4M3
  (scale amax/448, RNE, saturating; zero row -> zero), exact weights, FP32 products and
  sums, the intermediate quantized per routed row to E4M3 the same way, then as w4a16.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .activation import apply_activation, resolve_call_activation
from .format import dequantize_mxfp4
from .prepare import PreparedExperts, _source_bytes
from .routing import local_expert_ids

FP8_MAX = 448.0
REFERENCE_MODES = ("exact", "w4a16", "w4a8")


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 quantization: ``(q float8_e4m3fn [..., K], scale float32 [...])``.

    ``scale = amax(|row|) / 448`` in FP32; ``q = RNE(x / scale)`` saturated to +-448; a
    zero row gets scale 0 and q = 0.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale.unsqueeze(-1) > 0, xf / safe.unsqueeze(-1), torch.zeros_like(xf))
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Quantize rows to E4M3 and back to FP32 (what the W4A8 path multiplies with)."""
    q, s = quantize_rows_fp8(x)
    return q.float() * s.unsqueeze(-1)


def decode_expert(experts: PreparedExperts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s weights as FP32 ``(w13 [2I, H] gate_up, w2 [H, I])``, global scales applied."""
    w13 = dequantize_mxfp4(_source_bytes(experts.w13[e:e + 1])[0], experts.w13_scale[e])
    w2 = dequantize_mxfp4(_source_bytes(experts.w2[e:e + 1])[0], experts.w2_scale[e])
    if experts.w13_global_scale is not None:
        w13 = w13 * experts.w13_global_scale[e]
    if experts.w2_global_scale is not None:
        w2 = w2 * experts.w2_global_scale[e]
    return w13, w2


@contextlib.contextmanager
def _no_tf32():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def fused_moe_reference(
    x: torch.Tensor,
    experts: PreparedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: Optional[str] = None,
    swiglu_limit: Optional[float] = None,
    swiglu_alpha: Optional[float] = None,
    expert_map: Optional[torch.Tensor] = None,
    mode: str = "exact",
) -> torch.Tensor:
    """Reference MoE layer ``out[t] = sum_k w[t,k] * y_{id[t,k]}(x[t])`` (SPEC §1-§5).

    Returns FP32 ``[T, H]`` for ``mode="exact"``, BF16 otherwise. Masked routes (id out
    of range or mapped to -1 by ``expert_map``) contribute exactly zero. ``activation``: as
    :func:`mxmoe.fused_moe` (None: the experts' remembered one, else silu; another raises).
    """
    return fused_moe_references(x, experts, topk_weights, topk_ids, activation=activation, swiglu_limit=swiglu_limit,
                                swiglu_alpha=swiglu_alpha, expert_map=expert_map, modes=(mode,))[mode]


def fused_moe_references(
    x: torch.Tensor,
    experts: PreparedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: Optional[str] = None,
    swiglu_limit: Optional[float] = None,
    swiglu_alpha: Optional[float] = None,
    expert_map: Optional[torch.Tensor] = None,
    modes: tuple = REFERENCE_MODES,
) -> dict:
    """:func:`fused_moe_reference` in each of ``modes`` at once: ``{mode: output}``. Each expert's weights are
    decoded once for all modes (the fuzz harness's references)."""
    activation, swiglu_limit, swiglu_alpha = resolve_call_activation(experts.activation, activation, swiglu_limit,
                                                                     swiglu_alpha)
    for mode in modes:
        if mode not in REFERENCE_MODES:
            raise ValueError(f"mode must be one of {REFERENCE_MODES}, got {mode!r}")
    T, top_k = topk_ids.shape
    H = experts.hidden_size
    local = local_expert_ids(topk_ids, experts.num_experts, expert_map).reshape(-1)
    weights = topk_weights.float().reshape(-1)
    # each mode's activations (W4A8: each token quantized once, shared by its routes)
    inputs = {"exact": lambda: x.float(), "w4a16": lambda: x.to(torch.bfloat16).float(),
              "w4a8": lambda: fp8_roundtrip(x.float())}
    xs = {mode: inputs[mode]() for mode in modes}
    routed = {mode: torch.zeros(T * top_k, H, dtype=torch.float32, device=x.device) for mode in modes}
    with _no_tf32():
        for e in torch.unique(local[local >= 0]).tolist():
            route = (local == e).nonzero().squeeze(1)
            w13, w2 = decode_expert(experts, e)
            for mode in modes:
                h = xs[mode][route // top_k] @ w13.T
                if experts.b13 is not None:
                    h = h + experts.b13[e]
                a = apply_activation(h, activation, swiglu_limit, swiglu_alpha)
                if mode == "w4a16":
                    a = a.to(torch.bfloat16).float()
                elif mode == "w4a8":
                    a = fp8_roundtrip(a)
                y = a @ w2.T
                if experts.b2 is not None:
                    y = y + experts.b2[e]
                y = y * weights[route].unsqueeze(1)
                routed[mode][route] = y if mode == "exact" else y.to(torch.bfloat16).float()
    outs = {}
    for mode in modes:
        out = routed[mode].reshape(T, top_k, H)
        total = out[:, 0].clone()
        for k in range(1, top_k):  # fixed order, as the kernels sum
            total += out[:, k]
        outs[mode] = total if mode == "exact" else total.to(torch.bfloat16)
    return outs


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over the whole tensor, in float64 (inf if out has NaN)."""
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    denom = r.norm()
    return float((o - r).norm() / denom) if denom > 0 else float((o - r).norm())
