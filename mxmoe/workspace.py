"""``Workspace``: the device scratch of a call (route pack, intermediate, routed rows, W4A8's quantized rows), and
``WorkspacePlan``: workspaces made and grown on demand (the module's, and the library's default for calls without
``workspace=``). Buffers only: the route pack launches from :mod:`mxmoe.routing`, the GEMMs from ``_details.launch``.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from ._details.config import DIRECT_MAX_TOKENS, pack_shapes
from .prepare import PreparedExperts
from .routing import ROUTE_SUBS, route_pack_capacity
from .selection import fp8_min_rows

_WORKSPACES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count()


def register_workspace(workspace) -> int:
    """A new handle for ``workspace`` (a Workspace or a WorkspacePlan takes one when it is created): valid while it
    lives. When the op runs, the launcher takes the workspace it names if that holds the call (``held_workspace``) and
    calls ``for_call(experts, tokens, top_k, fp8)`` (check, or grow a plan's) only when it does not; the CPU emulation
    calls ``for_call``."""
    handle = next(_NEXT_HANDLE)
    _WORKSPACES[handle] = workspace
    return handle


def lookup_workspace(handle: int):
    """The live Workspace or WorkspacePlan of ``handle``, else None."""
    return _WORKSPACES.get(handle)


class Workspace:
    """Device scratch for :func:`mxmoe.fused_moe`, sized once from (max tokens, top_k, E, H, I).

    Create it before CUDA-graph capture and pass it as ``workspace=``; calls with more
    tokens or a larger top_k than it was sized for raise ``ValueError``. ``fp8``: room for the W4A8 path (its
    quantized rows); default where ``precision="auto"`` can take W4A8 (``MXMOE_FP8_PREFILL_MIN_ROWS`` > 0 now).
    Pass ``fp8=True`` to call it with ``precision="w4a8"``.
    """

    def __init__(self, experts: PreparedExperts, max_tokens: int, top_k: int, *, fp8: Optional[bool] = None,
                 device=None):
        if max_tokens < 1 or top_k < 1:
            raise ValueError("max_tokens and top_k must be >= 1")
        if fp8 is None:  # W4A8 scratch where ``auto`` can take W4A8 (the threshold set now)
            fp8 = fp8_min_rows() > 0
        self.handle = register_workspace(self)  # what stands for it in the custom op's arguments
        device = torch.device(device) if device is not None else experts.device
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
        R = max_tokens * top_k
        caps = [route_pack_capacity(R, E, bt, extra) for bt, extra in pack_shapes(R, E)]
        max_rows = max(c[0] for c in caps)
        max_tiles = max(c[1] for c in caps)
        i32 = dict(dtype=torch.int32, device=device)
        self.max_tokens, self.top_k, self.fp8 = max_tokens, top_k, fp8
        self.shape = (E, H, I)
        self.route_subs = ROUTE_SUBS
        # the pack's rank counters [route_subs, E] and its count kernel's arrivals: zero between calls (the pack's
        # kernels zero them after use)
        self.counts = torch.zeros(ROUTE_SUBS * E, **i32)
        self.route_done = torch.zeros(1, **i32)
        self.device = self.counts.device  # (with its index)
        self.expert_counts = torch.empty(E, **i32)
        self.sub_offsets = torch.empty(ROUTE_SUBS * E, **i32)
        self.route_expert = torch.empty(R, **i32)
        self.route_rank = torch.empty(R, **i32)
        self.route_slot = torch.empty(R, **i32)
        self.sorted_routes = torch.empty(max_rows, **i32)
        self.offsets = torch.empty(E + 1, **i32)
        self.tile_expert = torch.empty(max_tiles, **i32)
        self.tile_start = torch.empty(max_tiles, **i32)
        self.num_tiles = torch.empty(1, **i32)
        # W4A16 keeps the intermediate in BF16; W4A8 in FP32 until its per-row requantization
        self.intermediate = torch.empty(max_rows * I * (4 if fp8 else 2), dtype=torch.uint8, device=device)
        self.routed_out = torch.empty(R, H, dtype=torch.bfloat16, device=device)
        # arrivals per (token, GEMM2 column block) of the top-k sum inside GEMM2 (DIRECT_SUM); the last program
        # resets its counter, so they are zero between calls
        self.sum_counters = torch.zeros(DIRECT_MAX_TOKENS * (H // 64), **i32)
        # GEMM1's K halves (k_parts): FP32 sums of each (route, column block, half, gate/up) and arrivals per (route,
        # column block), zero between calls
        direct_tiles = DIRECT_MAX_TOKENS * top_k * (I // 64)
        self.part_sums = torch.empty(direct_tiles * 4 * 64, dtype=torch.float32, device=device)
        self.part_counters = torch.zeros(direct_tiles, **i32)
        if fp8:
            self.x_q = torch.empty(max_tokens, H, dtype=torch.float8_e4m3fn, device=device)
            self.x_scale = torch.empty(max_tokens, dtype=torch.float32, device=device)
            self.inter_q = torch.empty(max_rows, I, dtype=torch.float8_e4m3fn, device=device)
            self.inter_scale = torch.empty(max_rows, dtype=torch.float32, device=device)

    def shortfalls(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> list[str]:
        """What this workspace lacks for a call (an empty list where it fits), one phrase each."""
        shape = _shape(experts)
        wrong = []
        if self.shape != shape:
            wrong.append("it was sized for experts of (E, H, I) = %s, these are %s" % (self.shape, shape))
        if self.counts.device != experts.device:
            wrong.append(f"it is on {self.counts.device}, the experts on {experts.device}")
        if tokens > self.max_tokens:
            wrong.append(f"it holds {self.max_tokens} tokens, this call has {tokens}")
        if top_k > self.top_k:
            wrong.append(f"it holds top_k {self.top_k}, this call has top_k {top_k}")
        if fp8 and not self.fp8:
            wrong.append("this call runs W4A8 and it has no W4A8 scratch (create it with fp8=True)")
        return wrong

    def holds(self, device: torch.device, shape: tuple, tokens: int, top_k: int, fp8: bool) -> bool:
        """Whether it fits a call (``shortfalls`` is empty) by the call's numbers alone: the launcher's check per call."""
        return (shape == self.shape and tokens <= self.max_tokens and top_k <= self.top_k and (self.fp8 or not fp8)
                and device == self.device)

    BUFFERS = ("counts", "route_done", "expert_counts", "sub_offsets", "route_expert", "route_rank", "route_slot",
               "sorted_routes", "offsets", "tile_expert", "tile_start", "num_tiles", "intermediate", "routed_out",
               "sum_counters", "part_sums", "part_counters", "x_q", "x_scale", "inter_q", "inter_scale")

    def tensors(self) -> list:
        """Its buffers in ``BUFFERS`` order, None where it has none (W4A8's without ``fp8``): a launch plan's pointers
        into the workspace are these plus an offset."""
        return [getattr(self, name, None) for name in self.BUFFERS]

    def for_call(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> "Workspace":
        """This workspace, checked for the call (the op resolves a handle this way, a plan's too)."""
        self.check(experts, tokens, top_k, fp8)
        return self

    def fits(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> bool:
        return self.holds(experts.device, _shape(experts), tokens, top_k, fp8)

    def check(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> None:
        """Raise ``ValueError`` naming what this workspace lacks for the call, if anything."""
        wrong = self.shortfalls(experts, tokens, top_k, fp8)
        if wrong:
            raise ValueError("workspace does not fit this call: " + "; ".join(wrong))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors() if t is not None)


class WorkspacePlan:
    """Workspaces planned per device and expert shape, made (outside CUDA-graph capture) when a call first needs
    one and grown to the largest call seen; at least ``max_tokens`` x ``top_k``, with W4A8 scratch ahead of need for
    ``precision="w4a8"`` or ``"auto"`` with the threshold set. The op resolves a plan's handle when it runs, so a
    compiled graph plans at run time too. The module's plan and the library's default (no ``workspace=``)."""

    def __init__(self, max_tokens: int = 0, top_k: int = 0, precision: Optional[str] = None):
        self.max_tokens, self.top_k, self.precision = max_tokens or 0, top_k or 0, precision
        self.workspaces: dict = {}
        self.handle = register_workspace(self)

    def current(self, device: torch.device, shape: tuple, tokens: int, top_k: int, fp8: bool) -> Optional[Workspace]:
        """The workspace a call of these numbers takes if it has one already (no planning), else None."""
        ws = self.workspaces.get((device, *shape))
        return ws if ws is not None and ws.holds(device, shape, tokens, top_k, fp8) else None

    def for_call(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> Workspace:
        found = self.current(experts.device, _shape(experts), tokens, top_k, fp8)
        if found is not None:
            return found
        key = (experts.device, *_shape(experts))
        ws = self.workspaces.get(key)
        if experts.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError("workspace: no workspace large enough for this call during CUDA-graph capture; pass "
                             "workspace=mxmoe.Workspace(experts, max_tokens, top_k) or make the same call eagerly first")
        ahead = self.precision == "w4a8" or (self.precision == "auto" and fp8_min_rows() > 0)
        ws = Workspace(experts, max(tokens, 1, self.max_tokens, ws.max_tokens if ws else 0),
                       max(top_k, self.top_k, ws.top_k if ws else 0), fp8=fp8 or ahead or bool(ws and ws.fp8))
        self.workspaces[key] = ws
        return ws


def _shape(experts: PreparedExperts) -> tuple:
    return experts.num_experts, experts.hidden_size, experts.intermediate_size


_DEFAULT_PLAN = WorkspacePlan()


def workspace_for(experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> Workspace:
    """The library's cached workspace for a call without ``workspace=`` (:class:`WorkspacePlan`)."""
    return _DEFAULT_PLAN.for_call(experts, tokens, top_k, fp8)


def held_workspace(scratch, device: torch.device, shape: tuple, tokens: int, top_k: int,
                   fp8: bool) -> Optional[Workspace]:
    """The Workspace a call takes from ``scratch`` (a Workspace, a WorkspacePlan, or None: the library's default) if
    it fits already, by the call's numbers alone; None where ``scratch.for_call`` must decide (grow, or raise)."""
    if isinstance(scratch, Workspace):
        return scratch if scratch.holds(device, shape, tokens, top_k, fp8) else None
    return (scratch or _DEFAULT_PLAN).current(device, shape, tokens, top_k, fp8)


def default_plan() -> WorkspacePlan:
    return _DEFAULT_PLAN
