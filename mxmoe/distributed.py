"""Tensor and expert parallelism for the fused MoE layer over ``torch.distributed``.

Two wrappers, each built collectively (every rank of the group calls the constructor
with the same full, unprepared MXFP4 weights) and called collectively:

* :class:`TensorParallelMoE` — every rank holds an ``I/world`` slice of *every* expert
  (:func:`tp_shard_weights`), runs :func:`mxmoe.fused_moe` on all tokens (the same
  ``x`` and routing on every rank) and the partial outputs are summed with one
  ``all_reduce``.
* :class:`ExpertParallelMoE` — every rank holds ``E/world`` whole experts, a contiguous
  block (:func:`ep_shard_weights`, :func:`ep_expert_map`), and its own tokens (``T``
  may differ between ranks). Routed rows travel to the rank that owns their expert with
  ``all_to_all_single``, are computed there with the rank's ``expert_map`` and come
  back the same way.

Numerics
--------
TP. Each rank's partial ``fused_moe`` output is BF16 (its routes are rounded to BF16
and summed over k in FP32, then rounded to BF16, as on one GPU). The partials are
converted to FP32 and summed with ``all_reduce(SUM)`` in FP32, and the sum is rounded
once to BF16. So the result differs from one GPU by the BF16 rounding of the partials
(a few BF16 ulps; relative L2 of a few 1e-3 in the tests). Deterministic for a fixed world size and
process group (NCCL and gloo reduce in a fixed order for a fixed configuration; with
two ranks FP32 addition is commutative, so it is exact and identical on both ranks).
``b2`` is added on rank 0 only (the other ranks get ``b2=None``), so it is added once;
``b13`` is sliced with the rows of ``w13``; per-expert global scales are replicated
(they scale a linear map, so the slices sum correctly). W4A8 under TP quantizes the
intermediate per (routed row, rank's I-slice), not per full row: a slightly finer
scale than on one GPU, so W4A8 TP is not bitwise the single-GPU W4A8 result either.

EP, ``dispatch="route"`` (default). One row per (token, k) route whose expert is valid
is sent to the owning rank, carrying that route's global expert id and FP32 router
weight; the owner runs ``fused_moe`` with ``top_k = 1`` on what it received, so each
route comes back as BF16 ``w * y`` — bit for bit what one GPU computes for that route
(same row data, same per-row quantization in W4A8). The origin sums the routes in FP32
in the fixed order k = 0..top_k-1 and rounds to BF16 once, exactly as one GPU does: on
the PyTorch CPU emulation the output is bitwise the single-process output. Masked routes
(id < 0 or >= E) are not sent and contribute exactly zero. Traffic: ``top_k`` copies of
a token's row at most.

EP, ``dispatch="token"``. One row per (token, rank that owns at least one of its
experts) is sent, with the token's ``top_k`` ids and weights; the owner runs
``fused_moe`` on it with its ``expert_map`` (routes owned elsewhere are masked there)
and returns one BF16 partial per (token, rank). The origin sums the partials in FP32
in rank order 0..world-1 and rounds to BF16. Less traffic (at most ``min(top_k, world)``
rows per token each way), deterministic, but not bitwise the one-GPU result (the partials
are rounded to BF16, as under TP).

Precision selection is the single-GPU rule (:func:`mxmoe.select_precision`) applied to
the **global** routed-row count, so every rank runs the same path: ``T * top_k`` for TP
(``T`` is the same on every rank) and ``sum over ranks of T_r * top_k`` for EP. The
resolved precision is passed explicitly to the local ``fused_moe``.

Host synchronization
--------------------
EP needs one device-to-host read per forward: after the small header ``all_to_all``
(each rank sends every rank ``[row count for it, status, T, H, top_k, E, precision,
threshold, activation ...]``), the received header and this rank's own send counts are
read in one ``.tolist()``; the split sizes of both payload ``all_to_all`` calls (and the
buffer sizes) come from it. EP therefore cannot be captured in a CUDA graph.
TP needs none for the computation (local ``fused_moe`` + ``all_reduce``: capturable);
its optional per-call input check (``check_inputs=True``, default) costs one small
``all_gather`` and one host read, and is skipped during CUDA-graph capture.

Errors
------
Bad configurations that every rank can see (world size not dividing ``E`` for EP, or
``I``; ``I/world`` not a multiple of 32 for TP) raise ``ValueError`` on every rank
before any collective. After that, constructors exchange a small config vector once
(``all_gather``) and raise ``ValueError`` on every rank if ranks were given different
shapes/options or one rank failed to prepare its slice. In ``forward`` every rank
validates its own inputs first, then the ranks exchange a status and shape vector
(EP: the header above, which carries the counts too, so no extra collective; TP: one
``all_gather`` with ``check_inputs``) and all raise ``ValueError`` if any
rank rejected its inputs (that rank re-raises its own error, which may be a
``TypeError``) or shapes/options disagree (H, top_k, precision argument, FP8
threshold, activation parameters; TP also T). Errors a rank can see only after the
exchange cannot occur, so no rank waits forever in a collective because another one
raised. What cannot be detected cheaply (TP ranks passing different token *values* or
routing) is the caller's contract.

Collectives run on the data's device: use NCCL for CUDA tensors and gloo for CPU tensors.
Payloads travel as raw bytes (``uint8``/``int32``/``int64`` views), which both backends
support.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional

import torch

from .activation import ACTIVATIONS
from .moe import call_activation, fused_moe, validate_moe_args
from .prepare import W13_LAYOUTS, PreparedExperts, prepare_weights
from .selection import PRECISIONS, fp8_min_rows, is_capturing, select_precision
from .sharding import ep_expert_map, ep_shard_weights, tp_shard_weights

__all__ = [
    "ExpertParallelMoE", "TensorParallelMoE", "ep_expert_map", "ep_shard_weights", "tp_shard_weights",
]

DISPATCH_MODES = ("route", "token")
_STATUS_OK, _STATUS_BAD = 0, 1


def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist


# ----------------------------------------------------------------------------- helpers


def _float_bits(v) -> int:
    """A float (or None -> NaN) as the int64 bits of its float64, for exchange in an int64 header."""
    return struct.unpack("<q", struct.pack("<d", math.nan if v is None else float(v)))[0]


def _call_fields(H, top_k, precision, activation, swiglu_limit, swiglu_alpha, threshold) -> list[int]:
    """What every rank of a call must agree on (besides T for TP), as int64s."""
    return [H, top_k, PRECISIONS.index(precision), threshold, ACTIVATIONS.index(activation),
            _float_bits(swiglu_limit), _float_bits(swiglu_alpha)]


_CALL_FIELD_NAMES = ("hidden size H", "top_k", "precision argument", "MXMOE_FP8_PREFILL_MIN_ROWS", "activation",
                     "swiglu_limit", "swiglu_alpha")


def _raise_if_disagree(rows: list[list[int]], names: tuple, what: str, local_error: Optional[BaseException], rank: int):
    """``rows[i] = [status_i, fields_i...]`` from every rank: raise on every rank if any
    rank failed or a field differs. The failing rank re-raises its own error."""
    bad = [i for i, r in enumerate(rows) if r[0] != _STATUS_OK]
    if bad:
        if local_error is not None:
            raise local_error
        raise ValueError(f"mxmoe.distributed: {what}: rank(s) {bad} rejected their inputs (see the error on those ranks)")
    for j, name in enumerate(names):
        values = [r[1 + j] for r in rows]
        if any(v != values[0] for v in values):
            raise ValueError(f"mxmoe.distributed: {what}: ranks disagree on {name}: {values} (rank order)")
    if local_error is not None:  # cannot happen (status reported it), kept for safety
        raise local_error


def _all_gather_rows(dist, group, world: int, vec: list[int], device) -> list[list[int]]:
    """all_gather a small int64 vector; one host read."""
    local = torch.tensor(vec, dtype=torch.int64, device=device)
    gathered = torch.empty(world * local.numel(), dtype=torch.int64, device=device)  # flat: gloo wants [world * n]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in newer PyTorch
    gather(gathered, local, group=group)
    return gathered.view(world, -1).tolist()


def _weights_config(experts: Optional[PreparedExperts], layout: str, extras: list[int]) -> list[int]:
    if experts is None:
        return [-1] * (4 + len(extras))
    return [experts.num_experts, experts.hidden_size, experts.intermediate_size, W13_LAYOUTS.index(layout), *extras]


class _Timeline:
    """Optional CUDA-event marks at stage boundaries (``profile=True``); no-op otherwise."""

    def __init__(self):
        self.enabled = False
        self.events: dict[str, torch.cuda.Event] = {}

    def mark(self, name: str, device: torch.device) -> None:
        if self.enabled and device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[name] = ev

    def elapsed_ms(self, a: str, b: str) -> float:
        """Milliseconds between two marks (call after synchronizing)."""
        return self.events[a].elapsed_time(self.events[b])


class _ParallelMoEBase:
    def __init__(self, group, profile: bool):
        self._dist = _dist()
        self.group = group
        self.rank = self._dist.get_rank(group)
        self.world_size = self._dist.get_world_size(group)
        self.timeline = _Timeline()
        self.timeline.enabled = profile

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _check_weights_agree(self, experts, local_error, layout, extras, extra_names, what):
        config = _weights_config(experts, layout, extras)
        status = _STATUS_OK if local_error is None else _STATUS_BAD
        device = experts.device if experts is not None else self._fallback_device
        rows = _all_gather_rows(self._dist, self.group, self.world_size, [status, *config], device)
        names = ("local E", "H", "local I", "w13_layout", *extra_names)
        _raise_if_disagree(rows, names, what, local_error, self.rank)


def _local_validate(experts, x, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha, expert_map, out, precision):
    """Every single-GPU check, on this rank's inputs; returns (T, top_k, threshold)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    T, top_k = validate_moe_args(x, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha, expert_map, out)
    return T, top_k, fp8_min_rows()


# ----------------------------------------------------------------------------- TP


class TensorParallelMoE(_ParallelMoEBase):
    """Tensor-parallel fused MoE: each rank of ``group`` holds an ``I/world`` slice of
    every expert; ``forward`` runs the local :func:`mxmoe.fused_moe` and sums the
    partials with one FP32 ``all_reduce`` (see the module docstring for numerics).

    Build it on every rank with the same full packed weights (the arguments of
    :func:`mxmoe.prepare_weights`); ``device`` moves the rank's slice there (default:
    the weights' device). ``group=None`` is the default process group. Construction
    exchanges a small config vector once (``all_gather``). ``check_inputs`` (default
    True) makes every ``forward`` check, with one small ``all_gather`` and one host
    read, that all ranks got valid inputs of the same shapes and options (skipped during
    CUDA-graph capture; turn it off for a sync-free, capturable forward once the
    caller is trusted). ``profile=True`` records CUDA events at stage boundaries in
    ``self.timeline`` (marks ``start``, ``computed``, ``reduced``, ``end``).
    """

    def __init__(self, w13, w13_scale, w2, w2_scale, *, w13_layout: str = "gate_up", b13=None, b2=None,
                 w13_global_scale=None, w2_global_scale=None, group=None, device=None, check_inputs: bool = True,
                 profile: bool = False,
                 activation: Optional[str] = None, swiglu_limit=None, swiglu_alpha=None):
        super().__init__(group, profile)
        # pure functions of shapes and world size: raise on every rank, before any collective
        shard = tp_shard_weights(w13, w13_scale, w2, w2_scale, rank=self.rank, world_size=self.world_size,
                                 w13_layout=w13_layout, b13=b13, b2=b2, w13_global_scale=w13_global_scale,
                                 w2_global_scale=w2_global_scale, device=device)
        self._fallback_device = shard["w13"].device
        self.full_intermediate_size = w13.shape[1] // 2
        self.w13_layout = w13_layout
        experts, error = None, None
        try:
            experts = prepare_weights(**shard, activation=activation, swiglu_limit=swiglu_limit,
                                      swiglu_alpha=swiglu_alpha)
        except (ValueError, TypeError) as e:
            error = e
        extras = [self.full_intermediate_size, int(b13 is not None), int(b2 is not None),
                  int(w13_global_scale is not None), int(w2_global_scale is not None)]
        self._check_weights_agree(experts, error, w13_layout, extras,
                                  ("full I", "b13 given", "b2 given", "w13_global_scale given", "w2_global_scale given"),
                                  "TensorParallelMoE construction")
        self.experts: PreparedExperts = experts
        self.check_inputs = check_inputs

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: Optional[str] = None,
                swiglu_limit=None, swiglu_alpha=None, expert_map: Optional[torch.Tensor] = None, precision: str = "auto",
                out: Optional[torch.Tensor] = None, workspace=None, return_precision: bool = False):
        """The MoE layer on the full (replicated) ``x [T, H]`` and routing, same arguments
        as :func:`mxmoe.fused_moe` (``expert_map`` maps global ids onto *all* experts,
        which every TP rank holds). Collective: every rank of the group must call it with
        the same tokens and routing. Returns BF16 ``[T, H]`` (in ``out`` if given) on
        every rank, or ``(out, precision_that_ran)`` with ``return_precision=True``."""
        dist, tl = self._dist, self.timeline
        error, T, top_k, threshold = None, -1, -1, -1
        try:
            activation, swiglu_limit, swiglu_alpha = call_activation(self.experts, activation, swiglu_limit, swiglu_alpha)
            T, top_k, threshold = _local_validate(self.experts, x, topk_weights, topk_ids, activation, swiglu_limit,
                                                  swiglu_alpha, expert_map, out, precision)
        except (ValueError, TypeError) as e:
            error = e
        capturing = is_capturing()
        if self.check_inputs and not capturing:
            if error is None:
                fields = [T, *_call_fields(x.shape[1], top_k, precision, activation, swiglu_limit, swiglu_alpha, threshold),
                          int(expert_map is not None)]
            else:
                fields = [-1] * 9
            rows = _all_gather_rows(dist, self.group, self.world_size, [_STATUS_OK if error is None else _STATUS_BAD, *fields],
                                    self.experts.device)
            _raise_if_disagree(rows, ("T",) + _CALL_FIELD_NAMES + ("expert_map given",), "TensorParallelMoE.forward",
                               error, self.rank)
        elif error is not None:
            raise error
        path = select_precision(T * top_k, precision=precision, capturing=capturing)  # every rank the same
        tl.mark("start", x.device)
        partial = fused_moe(x, self.experts, topk_weights, topk_ids, activation=activation, swiglu_limit=swiglu_limit,
                            swiglu_alpha=swiglu_alpha, expert_map=expert_map, precision=path, workspace=workspace)
        tl.mark("computed", x.device)
        acc = partial.float()  # BF16 partial -> FP32; the sum over ranks is FP32
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group)
        tl.mark("reduced", x.device)
        result = acc.to(torch.bfloat16) if out is None else out.copy_(acc)
        tl.mark("end", x.device)
        return (result, path) if return_precision else result


# ----------------------------------------------------------------------------- EP


@dataclass
class _Items:
    """An expert-parallel forward's items (routes or (rank, token) pairs) grouped by destination rank."""
    flat_ids: torch.Tensor  # global expert id per route (int32; -1 where it names no expert)
    order: torch.Tensor  # items sorted by destination rank (stable)
    item_token: torch.Tensor  # the token of each item
    send_counts: torch.Tensor  # items per destination rank (on device)


class ExpertParallelMoE(_ParallelMoEBase):
    """Expert-parallel fused MoE: rank ``r`` of ``group`` holds experts
    ``[r*E/w, (r+1)*E/w)`` and its own tokens; ``forward`` dispatches routed rows to the
    owning ranks with ``all_to_all_single``, runs the local :func:`mxmoe.fused_moe` with
    this rank's ``expert_map`` and combines the returned rows in a fixed order (see the
    module docstring: ``dispatch="route"`` is bitwise the single-GPU computation,
    ``"token"`` sends less).

    Build it on every rank with the same full packed weights; ``device`` moves the
    rank's experts there. ``group=None`` is the default group. Construction exchanges a
    small config vector once. Each ``forward`` does one host read (the row counts).
    ``profile=True`` records CUDA events in ``self.timeline`` (marks ``start``,
    ``header`` (routing and the header exchange with its host read done),
    ``dispatched``, ``computed``, ``combined``, ``end``; communication is
    ``start->dispatched`` plus ``computed->combined``).
    """

    def __init__(self, w13, w13_scale, w2, w2_scale, *, w13_layout: str = "gate_up", b13=None, b2=None,
                 w13_global_scale=None, w2_global_scale=None, group=None, device=None, dispatch: str = "route",
                 profile: bool = False,
                 activation: Optional[str] = None, swiglu_limit=None, swiglu_alpha=None):
        super().__init__(group, profile)
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
        shard = ep_shard_weights(w13, w13_scale, w2, w2_scale, rank=self.rank, world_size=self.world_size,
                                 w13_layout=w13_layout, b13=b13, b2=b2, w13_global_scale=w13_global_scale,
                                 w2_global_scale=w2_global_scale, device=device)
        self._fallback_device = shard["w13"].device
        self.global_num_experts = w13.shape[0]
        self.local_num_experts = self.global_num_experts // self.world_size
        self.dispatch = dispatch
        self.w13_layout = w13_layout
        experts, error = None, None
        try:
            experts = prepare_weights(**shard, activation=activation, swiglu_limit=swiglu_limit,
                                      swiglu_alpha=swiglu_alpha)
        except (ValueError, TypeError) as e:
            error = e
        extras = [self.global_num_experts, DISPATCH_MODES.index(dispatch), int(b13 is not None), int(b2 is not None),
                  int(w13_global_scale is not None), int(w2_global_scale is not None)]
        self._check_weights_agree(experts, error, w13_layout, extras,
                                  ("global E", "dispatch", "b13 given", "b2 given", "w13_global_scale given",
                                   "w2_global_scale given"), "ExpertParallelMoE construction")
        self.experts: PreparedExperts = experts
        self.expert_map = ep_expert_map(self.global_num_experts, self.rank, self.world_size, device=experts.device)

    @property
    def num_experts(self) -> int:
        return self.global_num_experts

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: Optional[str] = None,
                swiglu_limit=None, swiglu_alpha=None, expert_map: Optional[torch.Tensor] = None, precision: str = "auto",
                out: Optional[torch.Tensor] = None, workspace=None, return_precision: bool = False):
        """The MoE layer on this rank's tokens ``x [T_r, H]`` (``T_r`` may differ between
        ranks, and be 0) with global expert ids ``topk_ids [T_r, top_k]``; other
        arguments as :func:`mxmoe.fused_moe` (``expert_map`` must be None: the wrapper
        owns it). Collective. Returns BF16 ``[T_r, H]`` (in ``out`` if given), or
        ``(out, precision_that_ran)`` with ``return_precision=True``."""
        tl, device = self.timeline, self.experts.device
        error, T, top_k, threshold = None, 0, 0, -1
        try:
            if expert_map is not None:
                raise ValueError("expert_map must be None for ExpertParallelMoE (it builds each rank's map itself)")
            # the local check uses this rank's experts: they share H, dtype rules and device with the full set
            activation, swiglu_limit, swiglu_alpha = call_activation(self.experts, activation, swiglu_limit, swiglu_alpha)
            T, top_k, threshold = _local_validate(self.experts, x, topk_weights, topk_ids, activation, swiglu_limit,
                                                  swiglu_alpha, None, out, precision)
        except (ValueError, TypeError) as e:
            error = e
        tl.mark("start", device)
        if error is None:
            items = self._items(topk_ids, T, top_k)
            counts, status = items.send_counts, _STATUS_OK
            fields = _call_fields(x.shape[1], top_k, precision, activation, swiglu_limit, swiglu_alpha, threshold)
        else:
            items, status, fields = None, _STATUS_BAD, [-1] * len(_CALL_FIELD_NAMES)
            counts = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        # (raises on every rank when a rank failed or the calls disagree)
        send_counts, recv_counts, global_tokens = self._headers(counts, status, T, fields, error)
        path = select_precision(global_tokens * top_k, precision=precision)  # from the global rows: every rank the same
        tl.mark("header", device)
        x_recv, meta_recv = self._dispatch(x, topk_weights, items, send_counts, recv_counts, T, top_k)
        tl.mark("dispatched", device)
        k_recv = meta_recv.shape[1] // 2
        if x_recv.shape[0]:
            ids_recv = meta_recv[:, :k_recv].contiguous()
            w_recv = meta_recv[:, k_recv:].contiguous().view(torch.float32)
            y = fused_moe(x_recv, self.experts, w_recv, ids_recv, activation=activation, swiglu_limit=swiglu_limit,
                          swiglu_alpha=swiglu_alpha, expert_map=self.expert_map, precision=path,
                          workspace=workspace)
        else:
            y = torch.empty(0, x.shape[1], dtype=torch.bfloat16, device=device)
        tl.mark("computed", device)
        result = self._combine(y, items, send_counts, recv_counts, T, top_k, out)
        tl.mark("end", device)
        return (result, path) if return_precision else result

    def _items(self, topk_ids: torch.Tensor, T: int, top_k: int) -> "_Items":
        """Routing, on device: one item per route (route mode, item ``t * top_k + k``) or per (rank, token) (token
        mode, item ``r * T + t``), grouped by destination rank (stable inside)."""
        device, world = self.experts.device, self.world_size
        ids = topk_ids.reshape(-1).long()
        valid = (ids >= 0) & (ids < self.global_num_experts)
        owner = torch.where(valid, torch.div(ids, self.local_num_experts, rounding_mode="floor"),
                            torch.full_like(ids, world))
        if self.dispatch == "route":
            key = owner
            item_token = torch.arange(T * top_k, device=device) // max(top_k, 1)
        else:
            need = torch.zeros(T, world + 1, dtype=torch.bool, device=device)
            need.scatter_(1, owner.view(T, top_k), True)
            ranks = torch.arange(world, device=device).unsqueeze(1).expand(world, T)
            key = torch.where(need[:, :world].t(), ranks, torch.full_like(ranks, world)).reshape(-1)
            item_token = torch.arange(T, device=device).repeat(world)
        order = torch.sort(key, stable=True).indices
        flat_ids = torch.where(valid, ids, torch.full_like(ids, -1)).to(torch.int32)
        return _Items(flat_ids, order, item_token, torch.bincount(key, minlength=world + 1)[:world])

    def _headers(self, send_counts_dev, status: int, T: int, fields: list, error) -> tuple[list, list, int]:
        """The header exchange (row j to rank j: [count for j, status, T, E, dispatch, fields...]) and its one host
        read; raises on every rank where a rank failed or the calls disagree. Returns (send counts, receive counts,
        the tokens of all ranks)."""
        world, device = self.world_size, self.experts.device
        info = torch.tensor([status, T, self.global_num_experts, DISPATCH_MODES.index(self.dispatch), *fields],
                            dtype=torch.int64, device=device)
        send_hdr = torch.cat((send_counts_dev.unsqueeze(1), info.unsqueeze(0).expand(world, -1)), dim=1).contiguous()
        recv_hdr = torch.empty_like(send_hdr)
        self._dist.all_to_all_single(recv_hdr, send_hdr, group=self.group)
        host = torch.cat((recv_hdr.reshape(-1), send_counts_dev)).tolist()  # the one host read of the forward
        width = send_hdr.shape[1]
        rows = [host[i * width:(i + 1) * width] for i in range(world)]
        # status, then everything but T (column 2) must agree
        agree_rows = [[r[1]] + [r[3], r[4]] + r[5:] for r in rows]
        _raise_if_disagree(agree_rows, ("global E", "dispatch") + _CALL_FIELD_NAMES, "ExpertParallelMoE.forward",
                           error, self.rank)
        return host[world * width:], [r[0] for r in rows], sum(r[2] for r in rows)

    def _dispatch(self, x, topk_weights, items: "_Items", send_counts: list, recv_counts: list, T: int,
                  top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows, then metadata (global ids, FP32 router-weight bits as int32), to the ranks that own them."""
        device, H = self.experts.device, x.shape[1]
        n_send, n_recv = sum(send_counts), sum(recv_counts)
        sel = items.order[:n_send]
        tok = items.item_token[sel]
        x_send = x.index_select(0, tok)
        weights32 = topk_weights.float()
        if self.dispatch == "route":
            meta_send = torch.stack((items.flat_ids[sel], weights32.reshape(-1)[sel].view(torch.int32)), dim=1)
        else:
            ids32 = items.flat_ids.view(T, top_k)
            meta_send = torch.cat((ids32.index_select(0, tok), weights32.view(torch.int32).index_select(0, tok)), dim=1)
        meta_send = meta_send.contiguous()
        x_recv = torch.empty(n_recv, H, dtype=torch.bfloat16, device=device)
        meta_recv = torch.empty(n_recv, meta_send.shape[1], dtype=torch.int32, device=device)
        self._dist.all_to_all_single(x_recv.view(torch.uint8), x_send.view(torch.uint8), recv_counts, send_counts,
                                     group=self.group)
        self._dist.all_to_all_single(meta_recv, meta_send, recv_counts, send_counts, group=self.group)
        return x_recv, meta_recv

    def _combine(self, y, items: "_Items", send_counts: list, recv_counts: list, T: int, top_k: int, out):
        """Rows come back in send order (one extra zero row stands for "not sent"); each token's sum in FP32 in a
        fixed order: k = 0..top_k-1 (route mode) or rank 0..world-1 (token mode)."""
        device, n_send, H = self.experts.device, sum(send_counts), y.shape[1]
        back = torch.empty(n_send + 1, H, dtype=torch.bfloat16, device=device)
        back[n_send].zero_()
        self._dist.all_to_all_single(back[:n_send].view(torch.uint8), y.contiguous().view(torch.uint8), send_counts,
                                     recv_counts, group=self.group)
        self.timeline.mark("combined", device)
        inv = torch.empty_like(items.order)
        inv[items.order] = torch.arange(items.order.numel(), device=device)
        pos = inv.clamp(max=n_send)  # items not sent sort after all sent ones
        pos = pos.view(T, top_k).t().contiguous() if self.dispatch == "route" else pos.view(self.world_size, T)
        acc = back.index_select(0, pos[0]).float() if pos.shape[0] else torch.zeros(T, H, device=device)
        for j in range(1, pos.shape[0]):
            acc += back.index_select(0, pos[j]).float()
        return acc.to(torch.bfloat16) if out is None else out.copy_(acc)
