"""The activation between the GEMMs (SPEC §4): its names, defaults and the FP32 PyTorch form the references use (the
kernels compute the same in their GEMM1 epilogue)."""
from __future__ import annotations

from typing import Optional

import torch

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
ACTIVATIONS = ("silu", "swigluoai")


def activation_params(activation: str, swiglu_limit: Optional[float], swiglu_alpha: Optional[float]) -> tuple[float, float]:
    """Resolve (limit, alpha) defaults; limit = inf means no clamp."""
    if activation == "swigluoai":
        return (SWIGLUOAI_LIMIT if swiglu_limit is None else float(swiglu_limit),
                SWIGLUOAI_ALPHA if swiglu_alpha is None else float(swiglu_alpha))
    return (float("inf") if swiglu_limit is None else float(swiglu_limit), 1.0)


def apply_activation(h: torch.Tensor, activation: str = "silu", swiglu_limit=None, swiglu_alpha=None) -> torch.Tensor:
    """SPEC §4 on ``h = [gate | up]`` (last dim 2I), in FP32."""
    limit, alpha = activation_params(activation, swiglu_limit, swiglu_alpha)
    half = h.shape[-1] // 2
    g, u = h[..., :half].float(), h[..., half:].float()
    g = torch.clamp(g, max=limit)
    u = torch.clamp(u, min=-limit, max=limit)
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    if activation == "swigluoai":
        return g * torch.sigmoid(alpha * g) * (u + 1.0)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
