"""``mxmoe.MoEExperts``: one MoE layer's prepared expert weights as a ``torch.nn.Module``.

The :class:`~mxmoe.PreparedExperts` tensors are buffers, so ``.to()``, ``state_dict()`` and ``load_state_dict()``
work and a saved state loads back without preparing again (:meth:`MoEExperts.from_state_dict`); the layout version,
source layout and scale dtypes travel as the module's extra state. ``forward(x, topk_weights, topk_ids)`` runs
:func:`mxmoe.fused_moe` with the activation given at construction, in a :class:`~mxmoe.Workspace` planned once per
device for ``max_tokens`` tokens (or grown, outside CUDA-graph capture, to the largest call seen): after warm-up no
call allocates scratch. The workspace holds W4A8 scratch only where W4A8 can run (``precision="w4a8"``, or ``auto``
with the threshold set when the workspace is planned). The op plans it when it runs (the module passes its
plan's handle), so a ``torch.compile``'d module plans at run time as an eager one does.
"""
from __future__ import annotations

from typing import Optional

import torch

from .moe import fused_moe
from .prepare import LAYOUT_VERSION, PreparedExperts, check_layout_version, prepare_weights
from .activation import ACTIVATIONS, Activation, resolve_call_activation
from .selection import PRECISIONS
from .workspace import WorkspacePlan

_TENSORS = ("w13", "w13_scale", "w2", "w2_scale", "w13_ref", "w2_ref", "w13_fold", "w2_fold", "w13_scale_restore",
            "w2_scale_restore", "b13", "b2", "w13_global_scale", "w2_global_scale")
_OPTIONAL = ("b13", "b2", "w13_global_scale", "w2_global_scale")
_SCALE_DTYPES = {str(d): d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))}


def _check_state_version(extra: dict) -> None:
    if extra.get("layout_version") != LAYOUT_VERSION:
        raise ValueError(f"the state holds experts of layout version {extra.get('layout_version')}, this mxmoe "
                         f"reads {LAYOUT_VERSION}: prepare the source weights again")


class MoEExperts(torch.nn.Module):
    """Prepared experts plus the layer's activation: ``forward(x, topk_weights, topk_ids)`` is the MoE layer's
    expert part (routing stays with the caller). ``max_tokens`` / ``top_k``: the workspace's plan (default: grown
    to the calls seen, outside capture)."""

    def __init__(self, experts: PreparedExperts, *, activation: Optional[str] = None,
                 swiglu_limit: Optional[float] = None, swiglu_alpha: Optional[float] = None, precision: str = "auto",
                 max_tokens: Optional[int] = None, top_k: Optional[int] = None):
        super().__init__()
        check_layout_version(experts)
        # the experts' own activation where none is named; another than theirs raises (as fused_moe does)
        activation, swiglu_limit, swiglu_alpha = resolve_call_activation(experts.activation, activation, swiglu_limit,
                                                                         swiglu_alpha)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.activation, self.swiglu_limit, self.swiglu_alpha, self.precision = activation, swiglu_limit, swiglu_alpha, precision
        self.max_tokens, self.top_k = max_tokens, top_k
        self.source_layout = experts.source_layout
        self.source_scale_dtypes = experts.source_scale_dtypes
        for name in _TENSORS:
            self.register_buffer(name, getattr(experts, name))
        self._plan = WorkspacePlan(max_tokens, top_k, precision)  # resolved by the op when it runs
        self._all_fold = experts.all_fold  # a host flag (computing it from the buffers would sync, and not trace)
        self._prepared: Optional[PreparedExperts] = None

    @classmethod
    def from_gpt_oss(cls, source, prefix: str = "", *, device=None, **kwargs) -> "MoEExperts":
        """One gpt-oss layer's experts (a state dict or a safetensors file; :func:`mxmoe.load_gpt_oss_experts`),
        prepared on ``device`` (default: where the tensors are), with gpt-oss's activation (swigluoai, alpha 1.702,
        limit 7), which the experts remember."""
        from .gpt_oss import load_gpt_oss_experts

        src = load_gpt_oss_experts(source, prefix)
        if device is not None:
            src = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in src.items()}
        return cls(prepare_weights(**src), **kwargs)

    @classmethod
    def from_state_dict(cls, state: dict, prefix: str = "", **kwargs) -> "MoEExperts":
        """A module from a :meth:`state_dict` (no preparation: the prepared tensors are taken as they are)."""
        extra = state[prefix + "_extra_state"]
        _check_state_version(extra)
        tensors = {name: state.get(prefix + name) for name in _TENSORS}
        fold = bool(tensors["w13_fold"].all()) and bool(tensors["w2_fold"].all())
        experts = PreparedExperts(**tensors, source_layout=extra["source_layout"], all_fold=fold,
                                  source_scale_dtypes=tuple(_SCALE_DTYPES[d] for d in extra["source_scale_dtypes"]))
        kwargs.setdefault("activation", extra["activation"])
        kwargs.setdefault("swiglu_limit", extra["swiglu_limit"])
        kwargs.setdefault("swiglu_alpha", extra["swiglu_alpha"])
        return cls(experts, **kwargs)

    def get_extra_state(self) -> dict:
        return dict(layout_version=LAYOUT_VERSION, source_layout=self.source_layout,
                    source_scale_dtypes=[str(d) for d in self.source_scale_dtypes], activation=self.activation,
                    swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)

    def set_extra_state(self, state: dict) -> None:
        _check_state_version(state)
        self.source_layout = state["source_layout"]
        self.source_scale_dtypes = tuple(_SCALE_DTYPES[d] for d in state["source_scale_dtypes"])
        self.activation, self.swiglu_limit, self.swiglu_alpha = (state["activation"], state["swiglu_limit"],
                                                                 state["swiglu_alpha"])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # the restore lists' lengths depend on the weights, and optional tensors may come or go: take those as given
        for name in ("w13_scale_restore", "w2_scale_restore") + _OPTIONAL:
            if prefix + name in state_dict:
                t = state_dict[prefix + name]
                setattr(self, name, t.to(self.w13.device) if t is not None else None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._prepared = None
        self._all_fold = bool(self.w13_fold.all()) and bool(self.w2_fold.all())
        self._plan.workspaces.clear()

    def _apply(self, fn, *args, **kwargs):
        self._prepared = None  # (.to(), .cuda(): the buffers move)
        return super()._apply(fn, *args, **kwargs)

    @property
    def experts(self) -> PreparedExperts:
        """The buffers as a :class:`~mxmoe.PreparedExperts` (built once per set of buffers)."""
        if self._prepared is None or self._prepared.w13 is not self.w13:
            self._prepared = PreparedExperts(**{n: getattr(self, n) for n in _TENSORS}, all_fold=self._all_fold,
                                             source_layout=self.source_layout,
                                             source_scale_dtypes=self.source_scale_dtypes,
                                             activation=Activation.of(self.activation, self.swiglu_limit,
                                                                      self.swiglu_alpha))
        return self._prepared

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fused_moe(x, self.experts, topk_weights, topk_ids, activation=self.activation,
                         swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha, expert_map=expert_map,
                         precision=self.precision, out=out, workspace=self._plan)

    def extra_repr(self) -> str:
        E, two_i, half_h = self.w13.shape
        return (f"E={E}, H={2 * half_h}, I={two_i // 2}, activation={self.activation!r}, precision={self.precision!r}"
                + (f", max_tokens={self.max_tokens}" if self.max_tokens else ""))
