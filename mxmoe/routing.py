"""Routing: masked routes, expert_map, and the route pack the GEMMs walk.

A *route* is one (token, k) pair, numbered ``r = t * top_k + k``. A route is masked
when its id is < 0 or >= the number of experts (global experts with ``expert_map``),
or ``expert_map`` maps it to -1 (or past the local experts); it then contributes zero.

The *route pack* groups routes by local expert into segments padded to the tile height
``block_rows``: ``sorted_routes[slot]`` holds the route in that slot or ``SENTINEL`` for
padding, ``route_slot[r]`` the slot of route ``r`` (``SENTINEL`` if masked). Tile ``i`` <
``num_tiles`` covers slots ``tile_start[i] .. + block_rows`` of expert ``tile_expert[i]``;
only tiles holding a valid row are listed. Buffers have fixed capacities (see
:func:`route_pack_capacity`) so the GPU pack needs no host synchronization. With ``extra`` rows (the wide tiles'
``GemmConfig.extra_rows``) a tile holds ``block_rows - extra`` routes except an expert's last, which holds up to
``block_rows``.

:func:`route_pack` is the PyTorch implementation (any device; stable order within an
expert). :func:`device_route_pack` launches the kernels (one or two, :func:`route_pack_launches`) that build the same
pack except for the order of routes inside an expert's segment (slots are claimed with integer atomics), which changes
no output bit: each row's result depends only on its own data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._details import cdiv, next_pow2
from ._details.config import pdl_launch
from ._details.launch_plan import KernelLaunch, run_launches
from ._details.routing_kernels import route_count_kernel, route_pack_small_kernel, route_scatter_kernel

SENTINEL = -1
ROUTE_BLOCK = 1024  # routes up to which one program packs them all (on a block of their size, 16 at least)
ROUTE_SUBS = 16  # counters per expert of the multi-kernel route pack (routing_kernels.route_count_kernel)


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Local expert of every route as int32 (same shape), ``-1`` where masked (SPEC §3)."""
    ids = topk_ids.long()
    n_global = num_experts if expert_map is None else expert_map.shape[0]
    valid = (ids >= 0) & (ids < n_global)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    local = safe if expert_map is None else expert_map.long()[safe]
    valid &= (local >= 0) & (local < num_experts)
    return torch.where(valid, local, torch.full_like(local, SENTINEL)).to(torch.int32)


def route_pack_capacity(num_routes: int, num_experts: int, block_rows: int, extra: int = 0) -> tuple[int, int]:
    """(max padded rows, max tiles) for any routing of ``num_routes`` routes."""
    # every listed tile holds a valid row, and each non-empty expert wastes < one tile
    max_tiles = min(num_routes, cdiv(num_routes, block_rows - extra) + min(num_experts, num_routes))
    return max_tiles * block_rows, max_tiles


@dataclass
class RoutePack:
    block_rows: int  # slots per tile
    sorted_routes: torch.Tensor  # int32 [max_rows]
    route_slot: torch.Tensor  # int32 [num_routes]
    expert_counts: torch.Tensor  # int32 [E]
    segment_offsets: torch.Tensor  # int32 [E + 1], padded segment starts
    tile_expert: torch.Tensor  # int32 [max_tiles], SENTINEL past num_tiles
    tile_start: torch.Tensor  # int32 [max_tiles]
    num_tiles: torch.Tensor  # int32 [1]
    extra: int = 0  # routes a tile holds past block_rows - extra (an expert's last tile only)


def route_pack(topk_ids: torch.Tensor, num_experts: int, block_rows: int, expert_map: Optional[torch.Tensor] = None,
               extra: int = 0) -> RoutePack:
    """Build the route pack with PyTorch ops (reference; routes in flat order inside an expert)."""
    if block_rows < 1 or num_experts < 1 or not 0 <= extra < block_rows:
        raise ValueError(f"route_pack needs block_rows >= 1, num_experts >= 1 and 0 <= extra < block_rows, got "
                         f"{block_rows}, {num_experts} and {extra}")
    device = topk_ids.device
    local = local_expert_ids(topk_ids, num_experts, expert_map).reshape(-1).long()
    R = local.numel()
    max_rows, max_tiles = route_pack_capacity(R, num_experts, block_rows, extra)
    valid = local >= 0
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).index_add_(0, local[valid], torch.ones_like(local[valid]))
    fill = block_rows - extra  # routes per tile but an expert's last
    tiles = torch.where(counts > 0, (torch.clamp(counts - extra, min=1) + fill - 1) // fill, 0)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(tiles * block_rows, 0)
    key = torch.where(valid, local, torch.full_like(local, num_experts))
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, sorted_key, right=False)  # first sorted index of each expert
    rank = torch.arange(R, device=device) - first
    ok = sorted_key < num_experts
    e_ok = sorted_key[ok]
    tile_in_expert = torch.minimum(rank[ok] // fill, tiles[e_ok] - 1)
    slot = offsets[e_ok] + rank[ok] + tile_in_expert * extra
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
        extra=extra,
    )


def device_route_pack(workspace, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], block_rows: int,
                      num_experts: int, extra: int = 0) -> RoutePack:
    """The route pack of :func:`route_pack` built by the Triton kernels into ``workspace``'s buffers (no host sync,
    capturable); returns views of them."""
    pack, launches = route_pack_launches(workspace, topk_ids, expert_map, block_rows, num_experts, extra)
    run_launches(launches)
    return pack


def route_pack_launches(ws, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], block_rows: int,
                        num_experts: int, extra: int = 0) -> tuple[RoutePack, list]:
    """The launches of :func:`device_route_pack` (``_details.launch_plan.KernelLaunch``) and the pack they build:
    one kernel up to ``ROUTE_BLOCK`` routes, else two (``_details.routing_kernels``); no torch fill. ``ws``: the
    Workspace whose buffers the pack is built in."""
    R = topk_ids.numel()
    max_rows, max_tiles = route_pack_capacity(R, num_experts, block_rows, extra)
    if max_rows > ws.sorted_routes.numel() or max_tiles > ws.tile_expert.numel():
        raise ValueError(f"workspace: no room for a pack of {block_rows}-row tiles of {R} routes")
    sorted_routes = ws.sorted_routes[:max_rows]
    n_global = num_experts if expert_map is None else expert_map.numel()
    emap = expert_map if expert_map is not None else ws.counts
    e_block = next_pow2(num_experts)
    if R <= ROUTE_BLOCK:  # decode, small batches: one launch
        # a block of the routes' size, not ROUTE_BLOCK: H200 graph replays, R=8: 5.0 -> 3.2 us, R=128: 5.0 ->
        # 3.4 us (docs/perf-notes.md step 15)
        block = max(16, next_pow2(R))
        launches = [KernelLaunch(
            route_pack_small_kernel, (1,),
            (topk_ids, emap, ws.expert_counts, ws.offsets, ws.tile_expert, ws.tile_start, ws.num_tiles,
             ws.route_slot, sorted_routes, R, num_experts, n_global, max_rows, max_tiles),
            dict(HAS_MAP=expert_map is not None, BT=block_rows, BLOCK=block, E_BLOCK=e_block, T_BLOCK=ROUTE_BLOCK,
                 num_warps=4, **pdl_launch(topk_ids.device), **_extra_meta(extra)))]
    else:
        grid = (cdiv(R, ROUTE_BLOCK),)
        launches = [
            KernelLaunch(route_count_kernel, grid,
                         (topk_ids, emap, ws.counts, ws.route_done, ws.route_expert, ws.route_rank,
                          ws.expert_counts, ws.offsets, ws.sub_offsets, ws.tile_expert, ws.tile_start,
                          ws.num_tiles, R, num_experts, n_global, max_tiles),
                         dict(HAS_MAP=expert_map is not None, BLOCK=ROUTE_BLOCK, SUBS=ws.route_subs, BT=block_rows,
                              E_BLOCK=e_block, T_BLOCK=ROUTE_BLOCK, **_extra_meta(extra))),
            KernelLaunch(route_scatter_kernel, grid,
                         (ws.route_expert, ws.route_rank, ws.sub_offsets, ws.expert_counts, ws.offsets,
                          ws.tile_expert, ws.num_tiles, ws.route_slot, sorted_routes, R, num_experts, max_rows),
                         dict(BT=block_rows, BLOCK=ROUTE_BLOCK, SUBS=ws.route_subs, **_extra_meta(extra))),
        ]
    pack = RoutePack(block_rows=block_rows, sorted_routes=sorted_routes, route_slot=ws.route_slot[:R],
                     expert_counts=ws.expert_counts, segment_offsets=ws.offsets,
                     tile_expert=ws.tile_expert[:max_tiles], tile_start=ws.tile_start[:max_tiles],
                     num_tiles=ws.num_tiles, extra=extra)
    return pack, launches


def _extra_meta(extra: int) -> dict:
    """The pack kernels' ``EXTRA`` where it is set (left out at 0: the kernels as compiled before it existed)."""
    return dict(EXTRA=extra) if extra else {}
