"""``torch.ops.mxmoe.fused_moe``: the layer as one PyTorch custom op, for ``torch.compile`` and serving engines.

Schema (plain tensors, floats, strings)::

    mxmoe::fused_moe(Tensor x, Tensor[] weights, Tensor?[] extras, Tensor topk_weights, Tensor topk_ids,
                     Tensor? expert_map, Tensor(a!) out, str activation, float? swiglu_limit, float? swiglu_alpha,
                     str precision, bool all_fold, int workspace) -> ()

How the library's objects cross the boundary:

* a :class:`~mxmoe.PreparedExperts` as its tensors (``prepare.expert_tensors``), ``weights`` = ``[w13, w13_scale, w2, w2_scale, w13_ref,
  w2_ref, w13_fold, w2_fold, w13_scale_restore, w2_scale_restore]`` and ``extras`` = ``[b13, b2, w13_global_scale, w2_global_scale]`` (each may be None),
  and its host flag ``all_fold``;
* a :class:`~mxmoe.Workspace` as an int handle (:func:`workspace_handle`; -1: none, the cached workspace), or a
  module's workspace plan the same way (the op plans its workspace when it runs, also in a compiled graph). A
  workspace is scratch: what the op writes there is never read by the caller, so it is not an argument PyTorch has to
  track; the op writes ``out`` only (``mutates_args``).
* ``precision`` as the caller gave it (``auto``, ``w4a16``, ``w4a8``): the op resolves it when it runs, so the
  threshold and CUDA-graph capture are read at run time, also in a compiled graph.

:func:`mxmoe.fused_moe` calls the op, or in a plain eager call its body directly (:func:`runs_directly`).
Registered with ``torch.library.Library`` (schema, one implementation for every device, ``register_fake``) rather
than ``torch.library.custom_op``, whose Python wrapper costs far more host time per call (see ``SCHEMA``). The fake
(meta) implementation writes nothing and returns nothing: ``out`` keeps its shape and dtype. Arguments are
validated by :func:`mxmoe.fused_moe` before the op; the op itself checks what needs real tensors (``out`` overlapping
``x``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._details import interpreting
from ._details.launch import run_layer
from .prepare import experts_from_tensors
from .reference import fused_moe_reference
from .selection import plan_layer
from .workspace import lookup_workspace

def kernel_backend(device: torch.device) -> str:
    """``"triton"`` where the kernels run (CUDA, or CPU under the interpreter), else ``"reference"``."""
    return "triton" if device.type == "cuda" or interpreting() else "reference"


def workspace_handle(workspace) -> int:
    """The int that stands for ``workspace`` (None: -1) in the op's schema (an attribute read: traceable)."""
    return -1 if workspace is None else workspace.handle


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


SCHEMA = ("fused_moe(Tensor x, Tensor[] weights, Tensor?[] extras, Tensor topk_weights, Tensor topk_ids, "
          "Tensor? expert_map, Tensor(a!) out, str activation, float? swiglu_limit, float? swiglu_alpha, "
          "str precision, bool all_fold, int workspace) -> ()")
# torch.library.Library and register_fake, not torch.library.custom_op: the latter's Python wrapper cost 25-200 us per
# call on the CPU of the development machine (a no-op with this schema: 200 us), the plain registration 3 us
_LIB = torch.library.Library("mxmoe", "DEF")
_LIB.define(SCHEMA)


def fused_moe_op(x: torch.Tensor, weights: list, extras: list, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: Optional[torch.Tensor], out: torch.Tensor, activation: str, swiglu_limit: Optional[float],
                 swiglu_alpha: Optional[float], precision: str, all_fold: bool, workspace: int) -> None:
    """Run the layer into ``out`` (arguments validated by :func:`mxmoe.fused_moe`)."""
    if out.numel() and _overlaps(out, x):
        raise ValueError("out must not overlap x")
    T, top_k = topk_ids.shape
    plan = plan_layer(T * top_k, precision=precision, activation=activation, swiglu_limit=swiglu_limit,
                      swiglu_alpha=swiglu_alpha, capturing=x.is_cuda and torch.cuda.is_current_stream_capturing())
    scratch = lookup_workspace(workspace) if workspace != -1 else None  # a Workspace or a WorkspacePlan
    if workspace != -1 and scratch is None:
        raise ValueError("workspace handle refers to no live Workspace (mxmoe.op.workspace_handle)")
    if kernel_backend(x.device) == "triton":
        run_layer(x, weights, extras, all_fold, topk_weights, topk_ids, expert_map, out, plan, scratch)
    else:
        experts = experts_from_tensors(weights, extras, all_fold)
        if scratch is not None:  # the same check as the launcher's, though the emulation reads no workspace
            scratch.for_call(experts, T, top_k, plan.fp8)
        out.copy_(fused_moe_reference(x, experts, topk_weights, topk_ids, activation=plan.activation,
                                      swiglu_limit=plan.limit, swiglu_alpha=plan.alpha, expert_map=expert_map,
                                      mode=plan.path))


_LIB.impl("fused_moe", fused_moe_op, "CompositeExplicitAutograd")

_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def runs_directly(x: torch.Tensor, topk_weights: torch.Tensor) -> bool:
    """Whether :func:`mxmoe.fused_moe` may call the op's body (:func:`fused_moe_op`) itself instead of going through
    the dispatcher (which costs an eager call 20-30 us of host time on the H200's host, docs/perf-notes.md step 34):
    an eager call on plain tensors, no tracing (``torch.compile``, ``torch.export``), no torch function or dispatch
    mode (fake tensors, ``make_fx``, profilers of ops), no input that autograd would follow. Every other call goes
    through ``torch.ops.mxmoe.fused_moe``; both run the same body."""
    return (not torch.compiler.is_compiling() and type(x) is torch.Tensor and _DISPATCH_MODES is not None
            and not _DISPATCH_MODES() and not torch._C._is_torch_function_mode_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad)))


@torch.library.register_fake("mxmoe::fused_moe", lib=_LIB)
def _fused_moe_fake(x, weights, extras, topk_weights, topk_ids, expert_map, out, activation, swiglu_limit,
                    swiglu_alpha, precision, all_fold, workspace) -> None:
    return None
