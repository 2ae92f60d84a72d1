"""The activation between the GEMMs (SPEC §4): its names, defaults and the FP32 PyTorch form the references use (the
kernels compute the same in their GEMM1 epilogue)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
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


def check_activation_args(activation, swiglu_limit, swiglu_alpha) -> None:
    """``ValueError`` naming the argument unless ``activation`` is one of ``ACTIVATIONS``, ``swiglu_limit`` None or a
    finite number > 0 and ``swiglu_alpha`` None or (swigluoai only) a finite number."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))
                                     or not math.isfinite(swiglu_limit) or swiglu_limit <= 0):
        raise ValueError(f"swiglu_limit must be a finite number > 0 or None, got {swiglu_limit!r}")
    if swiglu_alpha is not None:
        if activation != "swigluoai":
            raise ValueError("swiglu_alpha applies only to activation='swigluoai'")
        if isinstance(swiglu_alpha, bool) or not isinstance(swiglu_alpha, (int, float)) or not math.isfinite(swiglu_alpha):
            raise ValueError(f"swiglu_alpha must be a finite number, got {swiglu_alpha!r}")


@dataclass(frozen=True)
class Activation:
    """An activation with its parameters resolved (``limit`` inf: no clamp; ``alpha`` 1 for silu): what prepared
    experts remember (:func:`mxmoe.prepare_weights`' ``activation``) and a call is checked against."""
    name: str
    limit: float
    alpha: float

    @classmethod
    def of(cls, name: str, swiglu_limit: Optional[float] = None, swiglu_alpha: Optional[float] = None) -> "Activation":
        check_activation_args(name, swiglu_limit, swiglu_alpha)
        return cls(name, *activation_params(name, swiglu_limit, swiglu_alpha))

    # ``(activation, swiglu_limit, swiglu_alpha)`` as :func:`mxmoe.fused_moe` takes them (made once: read per call)
    call_args: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "call_args", (self.name, None if math.isinf(self.limit) else self.limit,
                                               self.alpha if self.name == "swigluoai" else None))


GPT_OSS_ACTIVATION = Activation("swigluoai", SWIGLUOAI_LIMIT, SWIGLUOAI_ALPHA)


def resolve_call_activation(stored: Optional[Activation], activation: Optional[str], swiglu_limit, swiglu_alpha) -> tuple:
    """The ``(activation, swiglu_limit, swiglu_alpha)`` a call runs with, given what its experts remember.

    Experts that remember none: the call's values, ``"silu"`` if it names none (the behaviour before experts
    remembered theirs). Experts that remember one: a value the call leaves out (None) is the remembered one, and a
    value it gives must equal it, else ``ValueError``: a call cannot silently run another activation than the one the
    weights were prepared for (to change it, ``experts.with_activation(...)``)."""
    if stored is None:
        return ("silu" if activation is None else activation), swiglu_limit, swiglu_alpha
    if swiglu_limit is None and swiglu_alpha is None and (activation is None or activation == stored.name):
        return stored.call_args  # (the common call: one comparison)
    given = {"activation": activation, "swiglu_limit": swiglu_limit, "swiglu_alpha": swiglu_alpha}
    name, limit, alpha = stored.call_args
    remembered = {"activation": name, "swiglu_limit": stored.limit, "swiglu_alpha": alpha}  # (silu: no alpha)
    for arg, value in given.items():
        if value is None:
            continue
        want = remembered[arg]
        same = value == want if arg == "activation" else (
            isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == want)
        if not same:
            raise ValueError(
                f"{arg}={value!r} differs from the experts' activation ({stored.name}, limit {stored.limit}, alpha "
                f"{stored.alpha}), which they were prepared with: leave it out to use theirs, or change theirs with "
                "experts.with_activation(...)")
    return name, limit, alpha
