"""Path selection between W4A16 and W4A8 (SPEC §6)."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ._details import env_get
from .activation import activation_params

ENV_MIN_ROWS = "MXMOE_FP8_PREFILL_MIN_ROWS"
PATHS = ("w4a16", "w4a8")  # the two paths a call can take
PRECISIONS = ("auto",) + PATHS  # what a caller may ask for


def fp8_min_rows() -> int:
    """The FP8 prefill threshold from ``MXMOE_FP8_PREFILL_MIN_ROWS`` (unset/empty = 0 = off), read at every call (a
    change between calls applies to the next); its parse is cached."""
    return _parse_min_rows(env_get(ENV_MIN_ROWS, ""))


@functools.lru_cache(maxsize=16)
def _parse_min_rows(raw: str) -> int:
    raw = raw.strip()
    if raw == "":
        return 0
    if not re.fullmatch(r"\+?\d+", raw):
        raise ValueError(f"{ENV_MIN_ROWS} must be an integer >= 0 (0 = FP8 path off), got {raw!r}")
    return int(raw)


def is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def select_precision(rows: int, *, precision: str = "auto", capturing: bool | None = None) -> str:
    """Which path runs for ``rows = T * top_k`` routed rows: ``"w4a16"`` or ``"w4a8"``.

    During CUDA-graph capture (``capturing=None`` asks the current stream) W4A16 always
    runs, whatever was asked. Otherwise an explicit ``precision`` wins; ``"auto"`` runs
    W4A8 when ``MXMOE_FP8_PREFILL_MIN_ROWS`` > 0 and ``rows >= `` it. A malformed
    environment value raises ``ValueError``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    threshold = fp8_min_rows()  # validate even when it does not decide
    if capturing is None:
        capturing = is_capturing()
    if capturing:
        return "w4a16"
    if precision != "auto":
        return precision
    return "w4a8" if threshold > 0 and rows >= threshold else "w4a16"


@dataclass(frozen=True)
class LayerPlan:
    """How one call runs, resolved once (by the op when it runs): the path
    and the activation with its limit and alpha (defaults applied). The launchers and the reference read it."""
    path: str  # "w4a16" or "w4a8"
    activation: str = "silu"
    limit: float = math.inf  # inf: no clamp
    alpha: float = 1.0

    @property
    def fp8(self) -> bool:
        return self.path == "w4a8"


def plan_layer(rows: int, *, precision: str = "auto", activation: str = "silu", swiglu_limit: Optional[float] = None,
               swiglu_alpha: Optional[float] = None, capturing: Optional[bool] = None) -> LayerPlan:
    """The :class:`LayerPlan` of a call of ``rows = T * top_k`` routed rows (:func:`select_precision`'s rule)."""
    return _layer_plan(select_precision(rows, precision=precision, capturing=capturing), activation, swiglu_limit,
                       swiglu_alpha)


@functools.lru_cache(maxsize=64)
def _layer_plan(path: str, activation: str, swiglu_limit: Optional[float], swiglu_alpha: Optional[float]) -> LayerPlan:
    """One LayerPlan object per kind of call (they key the launch plans: made once)."""
    return LayerPlan(path, activation, *activation_params(activation, swiglu_limit, swiglu_alpha))
