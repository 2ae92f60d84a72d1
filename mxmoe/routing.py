"""Routing: masked routes, expert_map, and the route pack the GEMMs walk.

A *route* is one (token, k) pair, numbered ``r = t * top_k + k``. A route is masked
when its id is < 0 or >= the number of experts (global experts with ``expert_map``),
or ``expert_map`` maps it to -1 (or past the local experts); it then contributes zero.

The *route pack* groups routes by local expert into segments padded to the tile height
``block_rows``: ``sorted_routes[slot]`` holds the route in that slot or ``SENTINEL`` for
padding, ``route_slot[r]`` the slot of route ``r`` (``SENTINEL`` if masked). Tile ``i`` <
``num_tiles`` covers slots ``tile_start[i] .. + block_rows`` of expert ``tile_expert[i]``;
only tiles holding a valid row are listed. Buffers have fixed capacities (see
:func:`route_pack_capacity`) so the GPU pack needs no host synchronization.

:func:`route_pack` is the PyTorch implementation (any device; stable order within an
expert). The GPU kernels build the same pack except for the order of routes inside an
expert's segment (slots are claimed with integer atomics), which changes no output bit:
each row's result depends only on its own data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SENTINEL = -1


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Local expert of every route as int32 (same shape), ``-1`` where masked (SPEC §3)."""
    ids = topk_ids.long()
    n_global = num_experts if expert_map is None else expert_map.shape[0]
    valid = (ids >= 0) & (ids < n_global)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    local = safe if expert_map is None else expert_map.long()[safe]
    valid &= (local >= 0) & (local < num_experts)
    return torch.where(valid, local, torch.full_like(local, SENTINEL)).to(torch.int32)


def route_pack_capacity(num_routes: int, num_experts: int, block_rows: int) -> tuple[int, int]:
    """(max padded rows, max tiles) for any routing of ``num_routes`` routes."""
    # every listed tile holds a valid row, and each non-empty expert wastes < one tile
    max_tiles = min(num_routes, -(-num_routes // block_rows) + min(num_experts, num_routes))
    return max_tiles * block_rows, max_tiles


@dataclass
class RoutePack:
    block_rows: int
    sorted_routes: torch.Tensor  # int32 [max_rows]
    route_slot: torch.Tensor  # int32 [num_routes]
    expert_counts: torch.Tensor  # int32 [E]
    segment_offsets: torch.Tensor  # int32 [E + 1], padded segment starts
    tile_expert: torch.Tensor  # int32 [max_tiles], SENTINEL past num_tiles
    tile_start: torch.Tensor  # int32 [max_tiles]
    num_tiles: torch.Tensor  # int32 [1]


def route_pack(topk_ids: torch.Tensor, num_experts: int, block_rows: int, expert_map: Optional[torch.Tensor] = None) -> RoutePack:
    """Build the route pack with PyTorch ops (reference; routes in flat order inside an expert)."""
    if block_rows < 1 or num_experts < 1:
        raise ValueError(f"route_pack needs block_rows >= 1 and num_experts >= 1, got {block_rows} and {num_experts}")
    device = topk_ids.device
    local = local_expert_ids(topk_ids, num_experts, expert_map).reshape(-1).long()
    R = local.numel()
    max_rows, max_tiles = route_pack_capacity(R, num_experts, block_rows)
    valid = local >= 0
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).index_add_(0, local[valid], torch.ones_like(local[valid]))
    tiles = (counts + block_rows - 1) // block_rows
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(tiles * block_rows, 0)
    key = torch.where(valid, local, torch.full_like(local, num_experts))
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, sorted_key, right=False)  # first sorted index of each expert
    rank = torch.arange(R, device=device) - first
    ok = sorted_key < num_experts
    slot = offsets[sorted_key[ok]] + rank[ok]
    sorted_routes = torch.full((max_rows,), SENTINEL, dtype=torch.int32, device=device)
    sorted_routes[slot] = order[ok].to(torch.int32)
    route_slot = torch.full((R,), SENTINEL, dtype=torch.int32, device=device)
    route_slot[order[ok]] = slot.to(torch.int32)
    tile_end = torch.cumsum(tiles, 0)
    n_tiles = tile_end[-1] if num_experts else torch.zeros((), dtype=torch.long, device=device)
    t = torch.arange(max_tiles, device=device)
    tile_e = torch.searchsorted(tile_end, t, right=True).clamp(max=max(num_experts - 1, 0))
    listed = t < n_tiles
    start = offsets[tile_e] + (t - (tile_end[tile_e] - tiles[tile_e])) * block_rows
    return RoutePack(
        block_rows=block_rows,
        sorted_routes=sorted_routes,
        route_slot=route_slot,
        expert_counts=counts.to(torch.int32),
        segment_offsets=offsets.to(torch.int32),
        tile_expert=torch.where(listed, tile_e, torch.full_like(tile_e, SENTINEL)).to(torch.int32),
        tile_start=torch.where(listed, start, torch.zeros_like(start)).to(torch.int32),
        num_tiles=n_tiles.reshape(1).to(torch.int32),
    )
