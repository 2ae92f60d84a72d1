"""Route pack invariants and masked routes (SPEC §3)."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from mxmoe import local_expert_ids, route_pack
from mxmoe.routing import SENTINEL, route_pack_capacity

FIELDS = ("sorted_routes", "route_slot", "expert_counts", "segment_offsets", "tile_expert", "tile_start", "num_tiles")


def local_of(gid: int, num_experts: int, expert_map) -> int:
    """SPEC §3 in plain Python: local expert of a global id, or -1 when masked."""
    n_global = num_experts if expert_map is None else len(expert_map)
    if gid < 0 or gid >= n_global:
        return -1
    e = gid if expert_map is None else expert_map[gid]
    return e if 0 <= e < num_experts else -1


def check_pack(pack, ids: torch.Tensor, num_experts: int, block_rows: int, expert_map=None):
    """Check every route pack invariant against a plain-Python model of the routing."""
    emap = None if expert_map is None else expert_map.tolist()
    flat = ids.reshape(-1).tolist()
    R = len(flat)
    local = [local_of(g, num_experts, emap) for g in flat]
    for name in FIELDS:
        assert getattr(pack, name).dtype == torch.int32, name
    assert pack.block_rows == block_rows

    sorted_routes = pack.sorted_routes.tolist()
    route_slot = pack.route_slot.tolist()
    counts = pack.expert_counts.tolist()
    offsets = pack.segment_offsets.tolist()
    num_tiles = pack.num_tiles.tolist()
    max_rows, max_tiles = route_pack_capacity(R, num_experts, block_rows)

    # counts and padded segments
    assert counts == [sum(1 for e in local if e == x) for x in range(num_experts)]
    assert len(offsets) == num_experts + 1 and offsets[0] == 0
    for e in range(num_experts):
        assert offsets[e + 1] - offsets[e] == -(-counts[e] // block_rows) * block_rows
    # capacity never exceeded
    assert len(sorted_routes) == max_rows and len(pack.tile_expert) == max_tiles == len(pack.tile_start)
    assert offsets[-1] <= max_rows and num_tiles[0] <= max_tiles

    # every valid route exactly once, at its slot, inside its expert's segment, in flat order
    assert len(route_slot) == R
    for r, e in enumerate(local):
        if e < 0:
            assert route_slot[r] == SENTINEL
        else:
            s = route_slot[r]
            assert offsets[e] <= s < offsets[e] + counts[e]
            assert sorted_routes[s] == r
    seen = Counter(v for v in sorted_routes if v != SENTINEL)
    assert set(seen) == {r for r, e in enumerate(local) if e >= 0}
    assert all(n == 1 for n in seen.values())
    for e in range(num_experts):
        segment = sorted_routes[offsets[e]:offsets[e + 1]]
        assert segment[:counts[e]] == sorted(r for r, x in enumerate(local) if x == e)
        assert all(v == SENTINEL for v in segment[counts[e]:])  # padding
    assert all(v == SENTINEL for v in sorted_routes[offsets[-1]:])

    # tiles: exactly the non-empty tiles, in expert order, then sentinels
    expected_tiles = [(e, offsets[e] + j * block_rows) for e in range(num_experts) for j in range(-(-counts[e] // block_rows))]
    n = num_tiles[0]
    assert n == len(expected_tiles)
    assert list(zip(pack.tile_expert[:n].tolist(), pack.tile_start[:n].tolist())) == expected_tiles
    assert all(v == SENTINEL for v in pack.tile_expert[n:].tolist())
    for _, start in expected_tiles:
        assert sorted_routes[start] != SENTINEL  # every listed tile holds a valid row


def assert_packs_equal(a, b):
    assert a.block_rows == b.block_rows
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ----------------------------------------------------------------------------- local ids


def test_local_expert_ids_masks_out_of_range_and_unmapped():
    ids = torch.tensor([[0, 3, -1], [4, 100, 2]], dtype=torch.int64)
    assert local_expert_ids(ids, 4).tolist() == [[0, 3, -1], [-1, -1, 2]]
    expert_map = torch.tensor([1, -1, 0, -1, 3, -1], dtype=torch.int32)  # 6 global -> 4 local
    local = local_expert_ids(ids, 4, expert_map)
    assert local.dtype == torch.int32
    assert local.tolist() == [[1, -1, -1], [3, -1, 0]]


# ----------------------------------------------------------------------------- hand-made packs


def test_small_pack_by_hand():
    ids = torch.tensor([[2, 0], [2, 2], [-1, 0], [5, 2]], dtype=torch.int32)  # E = 4, route r = 2t + k
    pack = route_pack(ids, num_experts=4, block_rows=2)
    check_pack(pack, ids, 4, 2)
    assert pack.expert_counts.tolist() == [2, 0, 4, 0]
    assert pack.segment_offsets.tolist() == [0, 2, 2, 6, 6]
    assert pack.sorted_routes[:6].tolist() == [1, 5, 0, 2, 3, 7]
    assert pack.route_slot.tolist() == [2, 0, 3, 4, -1, 1, -1, 5]
    assert pack.num_tiles.item() == 3
    assert pack.tile_expert[:3].tolist() == [0, 2, 2] and pack.tile_start[:3].tolist() == [0, 2, 4]


def test_partial_tiles_are_padded_with_sentinel():
    ids = torch.tensor([[0], [0], [0], [1]], dtype=torch.int64)
    pack = route_pack(ids, num_experts=2, block_rows=4)
    check_pack(pack, ids, 2, 4)
    assert pack.segment_offsets.tolist() == [0, 4, 8]
    assert pack.sorted_routes[:8].tolist() == [0, 1, 2, SENTINEL, 3, SENTINEL, SENTINEL, SENTINEL]


def test_empty_experts_have_no_tiles():
    ids = torch.tensor([[3, 3], [3, 7]], dtype=torch.int32)
    pack = route_pack(ids, num_experts=8, block_rows=16)
    check_pack(pack, ids, 8, 16)
    assert pack.num_tiles.item() == 2
    assert pack.tile_expert[:2].tolist() == [3, 7]
    assert set(pack.tile_expert.tolist()) <= {3, 7, SENTINEL}


@pytest.mark.parametrize("with_map", [False, True])
def test_all_routes_masked_gives_no_tiles(with_map):
    expert_map = torch.tensor([-1, -1, -1], dtype=torch.int32) if with_map else None
    ids = torch.tensor([[-1, 3], [0, 2], [-7, 99]], dtype=torch.int64)
    if not with_map:
        ids = torch.where(ids >= 0, ids + 3, ids)  # 3, 6, 5, 102 are all >= E = 3
    pack = route_pack(ids, num_experts=3, block_rows=4, expert_map=expert_map)
    check_pack(pack, ids, 3, 4, expert_map)
    assert pack.num_tiles.item() == 0
    assert pack.expert_counts.tolist() == [0, 0, 0]
    assert (pack.route_slot == SENTINEL).all() and (pack.sorted_routes == SENTINEL).all()
    assert (pack.tile_expert == SENTINEL).all()


def test_expert_map_routes_to_local_experts():
    expert_map = torch.tensor([-1, 1, -1, 0, 2, -1], dtype=torch.int32)
    ids = torch.tensor([[1, 3], [0, 4], [5, 3], [6, -1]], dtype=torch.int32)
    pack = route_pack(ids, num_experts=3, block_rows=2, expert_map=expert_map)
    check_pack(pack, ids, 3, 2, expert_map)
    assert pack.expert_counts.tolist() == [2, 1, 1]
    assert pack.route_slot.tolist() == [2, 0, -1, 4, -1, 1, -1, -1]


@pytest.mark.parametrize("block_rows", [1, 4, 16])
def test_capacity_worst_cases(block_rows):
    E = 8
    # every expert gets one route more than a whole number of tiles: maximal padding
    one_more = torch.arange(E).repeat_interleave(block_rows + 1).reshape(-1, 1)
    # every expert gets exactly one route
    singletons = torch.arange(E).reshape(-1, 2)
    for ids in (one_more, singletons):
        pack = route_pack(ids, num_experts=E, block_rows=block_rows)
        check_pack(pack, ids, E, block_rows)


def worst_case_tiles(R: int, E: int, B: int) -> int:
    """Most tiles any routing of R routes to E experts can need: one route per expert, then whole tiles."""
    return R if R <= E else E + (R - E) // B


def brute_force_worst_tiles(R: int, E: int, B: int) -> int:
    """max over count vectors (c_1..c_E, sum R) of sum ceil(c_e / B), by dynamic programming."""
    best = [0] + [-1] * R  # best[r]: most tiles with r routes over the experts seen so far
    for _ in range(E):
        best = [max(best[r - c] + -(-c // B) for c in range(r + 1) if best[r - c] >= 0) for r in range(R + 1)]
    return best[R]


@pytest.mark.parametrize("E,R,B", [(1, 5, 2), (3, 2, 4), (3, 10, 4), (4, 13, 3), (5, 17, 1), (2, 9, 8)])
def test_worst_case_formula(E, R, B):
    assert worst_case_tiles(R, E, B) == brute_force_worst_tiles(R, E, B)


@pytest.mark.parametrize("E,R,B", [(1, 0, 4), (4, 1, 64), (3, 10, 4), (5, 17, 1), (300, 64, 16), (288, 8 * 16384, 128)])
def test_capacity_bound_is_an_upper_bound(E, R, B):
    max_rows, max_tiles = route_pack_capacity(R, E, B)
    assert max_rows == max_tiles * B
    assert worst_case_tiles(R, E, B) <= max_tiles <= R


@pytest.mark.parametrize("num_experts,block_rows,name", [(4, 0, "block_rows"), (0, 16, "num_experts")])
def test_route_pack_rejects_degenerate_sizes(num_experts, block_rows, name):
    with pytest.raises(ValueError, match=name):
        route_pack(torch.zeros(2, 2, dtype=torch.int32), num_experts, block_rows)


# ----------------------------------------------------------------------------- ids dtype


@pytest.mark.parametrize("with_map", [False, True])
def test_int32_and_int64_ids_give_identical_packs(with_map):
    g = torch.Generator().manual_seed(0)
    E = 5
    expert_map = torch.tensor([0, -1, 4, 1, -1, 2, 3, -1], dtype=torch.int32) if with_map else None
    n_global = 8 if with_map else E
    ids64 = torch.randint(-2, n_global + 2, (37, 4), generator=g, dtype=torch.int64)
    a = route_pack(ids64, E, 8, expert_map)
    b = route_pack(ids64.to(torch.int32), E, 8, expert_map)
    check_pack(a, ids64, E, 8, expert_map)
    assert_packs_equal(a, b)


# ----------------------------------------------------------------------------- stress


@pytest.mark.parametrize("seed", range(40))
def test_random_packs(seed):
    rng = random.Random(seed)
    E = rng.choice([1, 2, 3, 7, 16, 33])
    B = rng.choice([1, 2, 16, 64])
    T = rng.choice([0, 1, 5, 31, 200])
    top_k = rng.choice([1, 2, 4, 8])
    g = torch.Generator().manual_seed(seed)
    expert_map = None
    n_global = E
    if rng.random() < 0.4:
        n_global = E + rng.randint(0, 6)
        perm = torch.randperm(n_global, generator=g)
        expert_map = torch.where(perm < E, perm, torch.full_like(perm, -1)).to(torch.int32)
    if rng.random() < 0.5:  # hot experts: most routes on a couple of experts
        hot = torch.randint(0, n_global, (2,), generator=g)
        ids = hot[torch.randint(0, 2, (T, top_k), generator=g)]
        ids = torch.where(torch.rand(T, top_k, generator=g) < 0.2, torch.randint(0, n_global, (T, top_k), generator=g), ids)
    else:
        ids = torch.randint(0, n_global, (T, top_k), generator=g)
    masked = torch.rand(T, top_k, generator=g) < rng.choice([0.0, 0.1, 0.5])
    ids = torch.where(masked, torch.randint(-3, 0, (T, top_k), generator=g) if rng.random() < 0.5 else ids + n_global, ids)
    ids = ids.to(rng.choice([torch.int32, torch.int64]))
    pack = route_pack(ids, E, B, expert_map)
    check_pack(pack, ids, E, B, expert_map)
