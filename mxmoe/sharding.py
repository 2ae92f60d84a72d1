"""Weights for tensor and expert parallelism: each rank's slice of the unprepared MXFP4 experts (TP: an ``I/world``
slice of every expert; EP: ``E/world`` whole experts) and EP's global-to-local ``expert_map``. Used by
:mod:`mxmoe.distributed`'s wrappers, which build them collectively."""
from __future__ import annotations

from typing import Optional

import torch

from .format import BLOCK_K, scales_as_uint8
from .prepare import W13_LAYOUTS


def _check_world(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


def _packed_shapes(w13, w13_scale, w2, w2_scale):
    """(E, H, I) from the packed source tensors, with the checks slicing relies on."""
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
    E, two_i, half_h = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 has {two_i} rows; expected 2*I")
    H, I = 2 * half_h, two_i // 2
    if tuple(w2.shape) != (E, H, I // 2):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}, expected [E, H, I/2] = {(E, H, I // 2)} from w13 {tuple(w13.shape)}")
    return E, H, I


def _check_shard_args(rank: int, world_size: int, w13_layout: str) -> None:
    _check_world(rank, world_size)
    if w13_layout not in W13_LAYOUTS:
        raise ValueError(f"w13_layout must be one of {W13_LAYOUTS}, got {w13_layout!r}")


def _move(t: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    t = t.contiguous()
    return t if device is None else t.to(device)


def tp_shard_weights(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    w13_layout: str = "gate_up",
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    w13_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    device=None,
) -> dict:
    """Rank ``rank``'s tensor-parallel slice of full packed weights: keyword arguments for
    :func:`mxmoe.prepare_weights`.

    Every expert keeps the intermediate columns ``[rank*I/w, (rank+1)*I/w)``: the same
    gate rows and up rows of ``w13`` (and ``b13``), in the source ``w13_layout`` (which is
    kept: ``gate_up``/``up_gate`` take that block of each half, ``interleaved`` the
    contiguous block of rows ``[2*rank*I/w, 2*(rank+1)*I/w)``), and the same K-range of
    ``w2`` (packed bytes ``I/(2w)`` and scale columns ``I/(32w)`` per rank, so ``I/w``
    must be a multiple of 32). ``b2`` goes to rank 0 only (``None`` elsewhere) so the
    all-reduce adds it once; global scales are replicated. Scales keep their dtype
    (uint8 or float8_e8m0fnu). Tensors are copied (contiguous) and moved to ``device``
    when given. Raises ``ValueError`` when ``world_size`` does not divide ``I`` or
    ``I/world_size`` is not a multiple of 32.
    """
    _check_shard_args(rank, world_size, w13_layout)
    E, H, I = _packed_shapes(w13, w13_scale, w2, w2_scale)
    if I % world_size:
        raise ValueError(f"tensor parallelism: world size {world_size} does not divide the intermediate size I = {I}")
    I_local = I // world_size
    if I_local % BLOCK_K:
        raise ValueError(f"tensor parallelism: I / world = {I}/{world_size} = {I_local} is not a multiple of {BLOCK_K} "
                         "(each rank's W2 slice must hold whole K32 scale blocks)")
    lo = rank * I_local
    if w13_layout == "interleaved":  # even rows gate, odd rows up: one contiguous block of row pairs
        rows = torch.arange(2 * lo, 2 * (lo + I_local))
    else:  # gate_up or up_gate: the same block of each half, halves kept in their order
        rows = torch.cat((torch.arange(lo, lo + I_local), torch.arange(I + lo, I + lo + I_local)))

    def w13_rows(t):
        return t.index_select(1, rows.to(t.device))

    s13 = scales_as_uint8(w13_scale, "w13_scale")
    s2 = scales_as_uint8(w2_scale, "w2_scale")
    if s2.shape[-1] * BLOCK_K != I:
        raise ValueError(f"w2_scale has shape {tuple(s2.shape)}, expected [E, H, I/32] with I = {I}")
    out = dict(
        w13=_move(w13_rows(w13), device),
        w13_scale=_move(w13_rows(s13), device).view(w13_scale.dtype),
        w2=_move(w2[:, :, lo // 2:(lo + I_local) // 2], device),
        w2_scale=_move(s2[:, :, lo // BLOCK_K:(lo + I_local) // BLOCK_K], device).view(w2_scale.dtype),
        w13_layout=w13_layout,
        b13=None if b13 is None else _move(w13_rows(b13), device),
        b2=None if (b2 is None or rank != 0) else _move(b2, device),
        w13_global_scale=_move(w13_global_scale, device),
        w2_global_scale=_move(w2_global_scale, device),
    )
    return out


def ep_shard_weights(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    w13_layout: str = "gate_up",
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    w13_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    device=None,
) -> dict:
    """Rank ``rank``'s expert-parallel slice: experts ``[rank*E/w, (rank+1)*E/w)`` of every
    per-expert tensor, as keyword arguments for :func:`mxmoe.prepare_weights`. Raises
    ``ValueError`` when ``world_size`` does not divide ``E``."""
    _check_shard_args(rank, world_size, w13_layout)
    E, _, _ = _packed_shapes(w13, w13_scale, w2, w2_scale)
    if E % world_size:
        raise ValueError(f"expert parallelism: world size {world_size} does not divide the number of experts E = {E}")
    n = E // world_size
    lo = rank * n

    def take(t):
        return None if t is None else _move(t[lo:lo + n], device)

    return dict(
        w13=take(w13), w13_scale=take(w13_scale), w2=take(w2), w2_scale=take(w2_scale), w13_layout=w13_layout,
        b13=take(b13), b2=take(b2), w13_global_scale=take(w13_global_scale), w2_global_scale=take(w2_global_scale),
    )


def ep_expert_map(num_experts: int, rank: int, world_size: int, device=None) -> torch.Tensor:
    """int32 ``[num_experts]``: global id -> local id on ``rank`` (its contiguous block), -1 elsewhere."""
    _check_world(rank, world_size)
    if num_experts % world_size:
        raise ValueError(f"expert parallelism: world size {world_size} does not divide the number of experts E = {num_experts}")
    n = num_experts // world_size
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[rank * n:(rank + 1) * n] = torch.arange(n, dtype=torch.int32)
    return m if device is None else m.to(device)
