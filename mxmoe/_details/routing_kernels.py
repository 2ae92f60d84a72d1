"""Route pack on the device: no host synchronization, no torch fill, at most two launches.

1. ``count`` (the routes' grid): each route's local expert (masking, ``expert_map``); its rank inside the expert
   claimed with an integer atomic on one of ``SUBS`` counters per expert (program p counts on counter p % SUBS: an
   expert's routes queue on one address otherwise, 18 us of atomics at 65536 routes over 288 experts). The last
   program to arrive (an arrival counter, ``done``; acquire/release) reads and zeroes the counters and writes per-expert totals,
   padded segment offsets, the tile list, the tile count and each counter's first slot inside its expert's segment.
2. ``scatter`` (the routes' grid): ``route_slot`` and ``sorted_routes``; its programs also write the sentinel into
   every padding slot (``sorted_routes`` past each expert's routes and past the last tile), disjoint from the routes'.

The rank counters and ``done`` are zero between calls (zeros when the workspace is made; the count kernel's last
program zeroes them), so no launch clears them.

Up to ``BLOCK`` routes (decode, small batches), ``route_pack_small_kernel`` does all of it in one program: the counts
in registers, the ranks on the expert counts it zeroes first, the sentinel fill before the scatter.

``EXTRA`` (the wide tiles' extra rows): tiles of ``BT`` slots hold ``BT - EXTRA`` routes each except an expert's last,
which holds up to ``BT`` (``_tiles_of``, ``_segment_slot``): an expert's rows past a multiple of ``BT - EXTRA``, up to
``EXTRA`` of them, take no tile of their own.
"""
import triton
import triton.language as tl


@triton.jit
def _local_experts(ids_ptr, expert_map_ptr, offs, num_routes, num_experts, num_global, HAS_MAP: tl.constexpr):
    """(local expert or -1, valid) of the routes ``offs``."""
    in_range = offs < num_routes
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int64)
    valid = (ids >= 0) & (ids < num_global) & in_range
    local = tl.where(valid, ids, 0)
    if HAS_MAP:
        local = tl.load(expert_map_ptr + local, mask=valid, other=-1).to(tl.int64)
    valid &= (local >= 0) & (local < num_experts)
    return tl.where(valid, local, -1), valid


@triton.jit
def _tiles_of(counts, BT: tl.constexpr, EXTRA: tl.constexpr):
    """Tiles of an expert with ``counts`` routes: ``BT - EXTRA`` routes per tile, the last up to ``BT``."""
    if EXTRA == 0:
        return (counts + BT - 1) // BT
    return tl.where(counts > 0, (tl.maximum(counts - EXTRA, 1) + BT - EXTRA - 1) // (BT - EXTRA), 0)


@triton.jit
def _segment_slot(q, counts, BT: tl.constexpr, EXTRA: tl.constexpr):
    """The slot (from its expert's segment start) of the ``q``-th route of an expert with ``counts`` routes."""
    if EXTRA == 0:
        return q
    j = tl.minimum(q // (BT - EXTRA), _tiles_of(counts, BT, EXTRA) - 1)
    return q + j * EXTRA


@triton.jit(do_not_specialize=["num_routes", "max_tiles"])
def route_count_kernel(ids_ptr, expert_map_ptr, counts_ptr, done_ptr, route_expert_ptr, route_rank_ptr,
                       expert_counts_ptr, offsets_ptr, sub_offsets_ptr, tile_expert_ptr, tile_start_ptr, num_tiles_ptr,
                       num_routes, num_experts, num_global, max_tiles,
                       HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, SUBS: tl.constexpr, BT: tl.constexpr,
                       E_BLOCK: tl.constexpr, T_BLOCK: tl.constexpr, EXTRA: tl.constexpr = 0):
    """``counts_ptr``: [SUBS, num_experts] counters; this program's routes rank on row program_id % SUBS. The last
    program to finish computes the pack's offsets and tiles from the complete counters (``_pack_offsets``)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    local, valid = _local_experts(ids_ptr, expert_map_ptr, offs, num_routes, num_experts, num_global, HAS_MAP)
    counter = counts_ptr + (pid % SUBS) * num_experts + tl.where(valid, local, 0)
    rank = tl.atomic_add(counter, tl.full((BLOCK,), 1, tl.int32), mask=valid)
    tl.store(route_expert_ptr + offs, local.to(tl.int32), mask=offs < num_routes)
    tl.store(route_rank_ptr + offs, rank, mask=valid)
    # every thread's rank atomics before the arrival (CTA barrier, then a release by the arriving thread); the last
    # arrival's acquire makes all programs' counts visible to it
    tl.debug_barrier()
    arrived = tl.atomic_add(done_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.debug_barrier()
        _pack_offsets(counts_ptr, expert_counts_ptr, offsets_ptr, sub_offsets_ptr, tile_expert_ptr, tile_start_ptr,
                      num_tiles_ptr, num_experts, max_tiles, BT, E_BLOCK, T_BLOCK, SUBS, EXTRA)
        tl.atomic_xchg(done_ptr, 0)


@triton.jit
def _pack_offsets(counts_ptr, expert_counts_ptr, offsets_ptr, sub_offsets_ptr, tile_expert_ptr, tile_start_ptr,
                  num_tiles_ptr, num_experts, max_tiles, BT: tl.constexpr, E_BLOCK: tl.constexpr,
                  T_BLOCK: tl.constexpr, SUBS: tl.constexpr, EXTRA: tl.constexpr):
    """From the [SUBS, num_experts] counters (read, then zeroed; complete: the caller acquired every program's
    arrival): the totals, the pack's
    offsets and tiles, and ``sub_offsets`` [SUBS, num_experts], the first slot of each counter's routes (counter s
    after counters 0 .. s - 1 of its expert) as if the segment had no gaps (``EXTRA``: the scatter places them)."""
    e = tl.arange(0, E_BLOCK)
    s = tl.arange(0, SUBS)
    in_e = (e < num_experts)[None, :] & (s >= 0)[:, None]
    # plain volatile loads, then zeros (the count kernel of the next call runs after this one): an atomic exchange
    # each took 30 us from one program at 288 experts (H200, docs/perf-notes.md step 34)
    counters = counts_ptr + s[:, None] * num_experts + e[None, :]
    sub_counts = tl.load(counters, mask=in_e, other=0, volatile=True)
    tl.store(counters, tl.zeros((SUBS, E_BLOCK), tl.int32), mask=in_e)
    counts = tl.sum(sub_counts, axis=0)
    tl.store(expert_counts_ptr + e, counts, mask=e < num_experts)
    first_slot = _offsets_and_tiles(counts, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_tiles_ptr, num_experts,
                                    max_tiles, BT, E_BLOCK, T_BLOCK, EXTRA)
    before = tl.cumsum(sub_counts, axis=0) - sub_counts
    tl.store(sub_offsets_ptr + s[:, None] * num_experts + e[None, :], first_slot[None, :] + before, mask=in_e)


@triton.jit
def _offsets_and_tiles(counts, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_tiles_ptr, num_experts, max_tiles,
                       BT: tl.constexpr, E_BLOCK: tl.constexpr, T_BLOCK: tl.constexpr, EXTRA: tl.constexpr = 0):
    """From the per-expert ``counts`` ([E_BLOCK], in registers): padded segment offsets, the tile count and
    the tile list; returns each expert's first slot ([E_BLOCK]). Each expert writes its own tiles over a
    fill of unlisted ones (a CTA barrier orders the two): O(E + tiles) work."""
    e = tl.arange(0, E_BLOCK)
    tiles = _tiles_of(counts, BT, EXTRA)
    tile_end = tl.cumsum(tiles, axis=0)  # inclusive
    tl.store(offsets_ptr + 1 + e, tile_end * BT, mask=e < num_experts)
    tl.store(offsets_ptr + e, 0, mask=e == 0)
    tl.store(num_tiles_ptr, tl.sum(tiles, axis=0))
    for t0 in range(0, max_tiles, T_BLOCK):
        t = t0 + tl.arange(0, T_BLOCK)
        tl.store(tile_expert_ptr + t, tl.full((T_BLOCK,), -1, tl.int32), mask=t < max_tiles)
        tl.store(tile_start_ptr + t, tl.zeros((T_BLOCK,), tl.int32), mask=t < max_tiles)
    tl.debug_barrier()
    tile_first = tile_end - tiles
    for j in range(0, tl.max(tiles, axis=0)):
        listed = (j < tiles) & (e < num_experts)
        t = tile_first + j
        tl.store(tile_expert_ptr + t, e, mask=listed)
        # segments are padded to whole tiles, so tile t starts at slot t * BT
        tl.store(tile_start_ptr + t, t * BT, mask=listed)
    return tile_first * BT


@triton.jit(do_not_specialize=["num_routes", "max_rows"])
def route_scatter_kernel(route_expert_ptr, route_rank_ptr, sub_offsets_ptr, expert_counts_ptr, offsets_ptr,
                         tile_expert_ptr, num_tiles_ptr, route_slot_ptr, sorted_routes_ptr, num_routes, num_experts,
                         max_rows, BT: tl.constexpr, BLOCK: tl.constexpr, SUBS: tl.constexpr, EXTRA: tl.constexpr = 0):
    """On the count kernel's grid: a route's slot is its counter's first slot plus its rank on that counter
    (``EXTRA``: placed in its tile by ``_segment_slot``). The programs also stride over the ``max_rows`` slots and
    write the sentinel into the padding ones: past the last listed tile, or past the routes of their tile (the routes'
    slots are the others: no write overlaps)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_routes
    local = tl.load(route_expert_ptr + offs, mask=in_range, other=-1)
    valid = local >= 0
    rank = tl.load(route_rank_ptr + offs, mask=valid, other=0)
    slot = tl.load(sub_offsets_ptr + (pid % SUBS) * num_experts + local, mask=valid, other=0) + rank
    if EXTRA > 0:
        start = tl.load(offsets_ptr + local, mask=valid, other=0)
        slot = start + _segment_slot(slot - start, tl.load(expert_counts_ptr + local, mask=valid, other=0), BT, EXTRA)
    tl.store(route_slot_ptr + offs, tl.where(valid, slot, -1), mask=in_range)
    tl.store(sorted_routes_ptr + slot, offs, mask=valid)
    used_tiles = tl.load(num_tiles_ptr)
    for s0 in range(pid * BLOCK, max_rows, tl.num_programs(0) * BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        tile = s // BT
        listed = (s < max_rows) & (tile < used_tiles)
        expert = tl.load(tile_expert_ptr + tile, mask=listed, other=0)
        start = tl.load(offsets_ptr + expert, mask=listed, other=0)
        count = tl.load(expert_counts_ptr + expert, mask=listed, other=0)
        if EXTRA > 0:  # the routes of the tile: BT - EXTRA, the expert's last tile the rest
            j = tile - start // BT
            last = _tiles_of(count, BT, EXTRA) - 1
            held = tl.where(j < last, BT - EXTRA, count - last * (BT - EXTRA))
            pad = (s < max_rows) & ((tile >= used_tiles) | (s - tile * BT >= held))
        else:
            pad = (s < max_rows) & ((tile >= used_tiles) | (s >= start + count))
        tl.store(sorted_routes_ptr + s, tl.full((BLOCK,), -1, tl.int32), mask=pad)


@triton.jit
def route_pack_small_kernel(ids_ptr, expert_map_ptr, counts_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr,
                            num_tiles_ptr, route_slot_ptr, sorted_routes_ptr,
                            num_routes, num_experts, num_global, max_rows, max_tiles,
                            HAS_MAP: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                            T_BLOCK: tl.constexpr, PDL: tl.constexpr = False, EXTRA: tl.constexpr = 0):
    """The whole pack for at most ``BLOCK`` routes in one program: the counts in registers (a histogram),
    ranks from integer atomics on ``counts_ptr`` (the pack's expert counts, zeroed first; the only global round trip
    after the id loads), fills ordered before the scatters by CTA barriers. ``PDL``: launched with programmatic dependent launch (wait for the previous
    kernel, which may still read the last pack)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    e = tl.arange(0, E_BLOCK)
    tl.store(counts_ptr + e, tl.zeros((E_BLOCK,), tl.int32), mask=e < num_experts)
    for r0 in range(0, max_rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        tl.store(sorted_routes_ptr + r, tl.full((BLOCK,), -1, tl.int32), mask=r < max_rows)
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK)
    local, valid = _local_experts(ids_ptr, expert_map_ptr, offs, num_routes, num_experts, num_global, HAS_MAP)
    expert = tl.where(valid, local, 0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + expert, tl.full((BLOCK,), 1, tl.int32), mask=valid)
    counts = tl.histogram(expert, E_BLOCK, mask=valid)
    first_slot = _offsets_and_tiles(counts, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_tiles_ptr, num_experts,
                                    max_tiles, BT, E_BLOCK, T_BLOCK, EXTRA)
    slot = tl.gather(first_slot, expert, 0) + _segment_slot(rank, tl.gather(counts, expert, 0), BT, EXTRA)
    tl.store(route_slot_ptr + offs, tl.where(valid, slot, -1), mask=offs < num_routes)
    tl.store(sorted_routes_ptr + slot, offs, mask=valid)
