"""Public entry point: ``fused_moe`` (validation, path selection, dispatch).

Which code runs where:

* CUDA tensors: the Triton kernels (route pack, GEMM1 + activation, GEMM2, top-k sum).
* CPU tensors with ``TRITON_INTERPRET=1``: the same Triton kernels in Triton's
  interpreter, in their pure-Triton form (no inline asm) — slow, for tests.
* CPU tensors otherwise: the PyTorch emulation of the chosen path
  (:func:`mxmoe.reference.fused_moe_reference` with ``mode`` = the precision).

``fused_moe`` validates its arguments and calls the custom op ``torch.ops.mxmoe.fused_moe`` (:mod:`mxmoe.op`), or in a
plain eager call the op's body itself (``op.runs_directly``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .activation import check_activation_args, resolve_call_activation
from .op import fused_moe_op, runs_directly, workspace_handle
from .prepare import PreparedExperts, check_layout_version, expert_tensors
from .selection import PRECISIONS, select_precision
from .workspace import Workspace, WorkspacePlan


def _check_tensor(t, name, dtypes, dim, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the experts' device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def call_activation(experts, activation, swiglu_limit, swiglu_alpha) -> tuple:
    """``(activation, swiglu_limit, swiglu_alpha)`` of a call on ``experts``: the experts' remembered activation
    where the call names none, an error where it names another (``activation.resolve_call_activation``)."""
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts must be a PreparedExperts (from mxmoe.prepare_weights), got {type(experts).__name__}")
    return resolve_call_activation(experts.activation, activation, swiglu_limit, swiglu_alpha)


def validate_moe_args(x, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha, expert_map, out):
    """Every check of SPEC §7; raises before any work. Returns (T, top_k)."""
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts must be a PreparedExperts (from mxmoe.prepare_weights), got {type(experts).__name__}")
    check_layout_version(experts)
    device = experts.device
    _check_tensor(x, "x", (torch.bfloat16,), 2, device)
    if x.shape[1] != experts.hidden_size:
        raise ValueError(f"x has hidden size {x.shape[1]}, experts have {experts.hidden_size}")
    _check_tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), 2, device)
    T, top_k = topk_ids.shape
    if T != x.shape[0]:
        raise ValueError(f"topk_ids has {T} rows, x has {x.shape[0]}")
    if top_k < 1:
        raise ValueError("topk_ids must have at least one column")
    _check_tensor(topk_weights, "topk_weights", (torch.float32, torch.bfloat16), 2, device)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}")
    if expert_map is not None:
        _check_tensor(expert_map, "expert_map", (torch.int32,), 1, device)
        if expert_map.numel() == 0:
            raise ValueError("expert_map must not be empty")
    check_activation_args(activation, swiglu_limit, swiglu_alpha)
    if out is not None:
        _check_tensor(out, "out", (torch.bfloat16,), 2, device)
        if out.shape != x.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
        # (out overlapping x: checked by the op, which sees real tensors also under torch.compile)
    return T, top_k


def fused_moe(
    x: torch.Tensor,
    experts: PreparedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: Optional[str] = None,
    swiglu_limit: Optional[float] = None,
    swiglu_alpha: Optional[float] = None,
    expert_map: Optional[torch.Tensor] = None,
    precision: str = "auto",
    out: Optional[torch.Tensor] = None,
    workspace=None,
    return_precision: bool = False,
):
    """Fused MoE layer: ``out[t] = sum_k topk_weights[t,k] * y_{topk_ids[t,k]}(x[t])``.

    ``x`` BF16 ``[T, H]``; ``topk_weights`` FP32 or BF16 ``[T, top_k]``; ``topk_ids`` int32
    or int64 ``[T, top_k]`` (masked routes per SPEC §3 contribute zero); ``expert_map``
    int32 ``[E_global]`` (global -> local id or -1) for expert parallelism.
    ``activation``: ``"silu"`` (``swiglu_limit`` clamps as in GLM) or ``"swigluoai"``
    (defaults alpha 1.702, limit 7); left out (None), the one the experts remember
    (``prepare_weights(activation=...)``, the gpt-oss loaders), else ``"silu"``. Naming another
    than the experts remember raises ``ValueError`` (``experts.with_activation`` changes theirs). ``precision``: ``"auto"`` (environment
    ``MXMOE_FP8_PREFILL_MIN_ROWS``), ``"w4a16"`` or ``"w4a8"``; CUDA-graph capture always
    runs W4A16. ``out``: optional BF16 ``[T, H]`` to write. ``workspace``: a
    :class:`mxmoe.Workspace` sized for the largest T (needed for graph capture; without
    one a cached workspace grows on demand outside capture). Returns ``out``, or
    ``(out, precision_that_ran)`` with ``return_precision=True``.
    Bad arguments raise ``TypeError``/``ValueError`` naming the argument, before any work.
    """
    activation, swiglu_limit, swiglu_alpha = call_activation(experts, activation, swiglu_limit, swiglu_alpha)
    T, top_k = validate_moe_args(x, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha, expert_map, out)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if workspace is not None:
        if not isinstance(workspace, (Workspace, WorkspacePlan)):  # (a plan: MoEExperts's)
            raise TypeError(f"workspace must be a mxmoe.Workspace, got {type(workspace).__name__}")
    if out is None:
        out = torch.empty_like(x)
    weights, extras, all_fold = expert_tensors(experts)
    # the op chooses the path when it runs (threshold, graph capture) and checks the workspace against that choice:
    # in a compiled graph this code runs once, at trace time
    run = fused_moe_op if runs_directly(x, topk_weights) else torch.ops.mxmoe.fused_moe
    run(x, weights, extras, topk_weights, topk_ids, expert_map, out, activation, swiglu_limit, swiglu_alpha, precision,
        all_fold, workspace_handle(workspace))
    if not return_precision:
        return out
    if torch.compiler.is_compiling():
        raise ValueError("return_precision=True is for eager calls: under torch.compile the op chooses the path "
                         "when the graph runs")
    return out, select_precision(T * top_k, precision=precision)
