"""Which kernel runs each GEMM, with which tile config, and the one way to override that.

* :func:`kernel_choice`: the kernel family of a GEMM (``MXMOE_KERNEL``; plain Triton, the small-tile Gluon kernels,
  the warp-specialized W4A8 prefill kernel).
* :func:`gemm_config`: a :class:`GemmConfig` (frozen; :meth:`GemmConfig.validate` checks it against the GEMM) from
  small functions, one per knob; each names its reason and the ``docs/perf-notes.md`` step that measured it.
* :class:`Overrides` / :func:`overrides`: what tests, scripts and tuning change (per-GEMM config fields, PDL, the
  direct decode path, the top-k sum inside GEMM2), as a context that the launch reads when it runs.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

import torch
import triton

from . import env_get, interpreting, wide_tail_steps

TILE_ROWS = (16, 32, 64, 128)  # route-pack tile heights in use
WIDE_ROWS = 256  # the route tiles of the wide W4A16 GEMMs (``GemmConfig.wide``)
WIDE_EXTRA = 32  # ... and their extra rows (``GemmConfig.extra_rows``)
WIDE_FROM = 132  # routed rows per expert above which W4A16 takes them (perf-notes step 21)
DIRECT_MAX_TOKENS = 4  # tokens up to which W4A16 runs without a route pack (slower from T=8; step 17)
SPLIT_LOOP_MIN_STEPS = 16  # K steps per warpgroup from which small-tile W4A16 splits its K loop (step 23)
PROMOTE_K = 1024  # W4A8: the K of one FP8 accumulator chain before its sums go to FP32 (SPEC §5 bound; step 31)
# major.minor releases the Gluon kernels were measured and tested on (``auto`` takes them there): when and the evidence
GLUON_VALIDATED_TRITON = {
    "3.6": "2026-11-30, H200 and H100: every GPU test, fuzz and bench since (docs/perf-notes.md)",
    "3.9": "2026-12-06, H100: pytest -m gpu 170 passed, fuzz 600/600 cases per path, bench beside 3.6 "
           "(docs/triton39-h100-session37.json, perf-notes step 39)",
}


@dataclass(frozen=True)
class GemmConfig:
    block_rows: int  # BT: route-pack tile height (MMA N)
    block_m: int  # weight rows per program (MMA M)
    block_k: int
    num_warps: int
    num_stages: int
    kernel: str = "triton"  # gemm.moe_gemm_kernel; sm90 Gluon: "gluon_small",
    # "gluon_ws8" (sm90_ws8.moe_gemm_ws8_kernel: W4A8 prefill, producer + two consumer warpgroups)
    maxnreg: int = 0  # gluon: registers per thread (0: Triton's default); the partitions' budgets below
    loader_regs: int = 64  # "gluon_ws8": the producer's and each consumer warpgroup's registers per thread
    converter_regs: int = 224  # (128 x 64 + 2 x 128 x 224 = 64 K)
    pingpong: bool = False  # "gluon_ws8": the consumer warpgroups issue each step's MMAs in strict turns
    scale_words: bool = False  # gluon_small: scale bytes in 32-bit loads, 4/(block_k/32) steps each (K % 128 == 0);
    # without it 16-bit loads (K % 128 == 64, gpt-oss's 2880; block_k up to 64), both kernels (``scale_bytes``)
    k_split: int = 1  # gluon_small: 2 = a second warpgroup runs the second half of the K steps (decode)
    pair: bool = False  # gluon_small GEMM2: two 64-row weight blocks per program (block_m stays the block's rows)
    k_parts: int = 1  # gluon_small GEMM1 without a route pack: 2 = two programs split the K steps (decode grids
    # that fill the SMs unevenly)
    wide: bool = False  # gluon_small W4A16 on 256-row route tiles, persistent, two warpgroups: GEMM1 the gate and up
    # rows of 32 output columns each (``_wide_gemm1``), GEMM2 64 output columns each (``_wide_gemm2``)
    sub_tiles: int = 1  # gluon_small GEMM2 on a pack of sub_tiles * block_rows-row tiles (the wide GEMM1's)
    split_loop: bool = False  # gluon_small W4A16 (not wide): the K loop's steps that refill within the program untested,
    # then its last ones tested (``sm90_small._small_steps``)
    promote: int = 0  # gluon_small W4A8 fast path: K steps per FP8 accumulator chain, each chain's sums then added to
    # FP32 accumulators (0: one chain over all of K)
    promote_smem: bool = False  # ... those FP32 sums in shared memory (tiles whose chains take all the registers)
    half_tiles: bool = False  # gluon_small (not wide): a tile whose second half holds no route runs on its first half
    # (the MMAs' N and the activation copies halved; ``sm90_small._small_tile``)
    extra_rows: int = 0  # wide W4A16: route tiles of block_rows + extra_rows slots, the extra rows multiplied (a second
    # MMA on the same converted weights) only where a tile holds them: an expert's last rows past a multiple of
    # block_rows, up to extra_rows, take no tile of their own (``sm90_wide._wide_mma_extra``)

    @property
    def scale_bytes(self) -> int:
        return scale_bytes(self.scale_words)

    def validate(self, n: int, k: int, gemm1: bool, fp8: bool) -> "GemmConfig":
        """This config, if its Gluon kernel can run it on an ``n x k`` GEMM; else ``ValueError`` saying why."""
        if self.kernel == "gluon_ws8":
            if not fp8 or k % 64 or n % 64 or self.block_k != 128 or self.block_m not in (128, 256):
                raise ValueError("the W4A8 prefill kernel takes W4A8, K and N multiples of 64, block_k=128 and "
                                 "block_m 128 or 256")
            if self.block_rows not in ((64, 128) if self.block_m == 256 else (64, 128, 256)):
                raise ValueError("the W4A8 prefill kernel takes 64- or 128-row route tiles, 256 at block_m=128")
            if self.sub_tiles != 1:
                raise ValueError("the W4A8 prefill kernel takes its route pack's tiles whole (sub_tiles=1)")
            if self.promote and self.block_rows * self.block_m > 128 * 128:
                raise ValueError("the W4A8 prefill kernel's promoted sums fit the registers at block_rows x block_m "
                                 "<= 128 x 128 only")
            return self
        if self.kernel != "gluon_small":
            return self
        steps = k // self.block_k
        if k % self.block_k:
            raise ValueError(f"the small-tile Gluon kernel needs K ({k}) to be a multiple of block_k ({self.block_k})")
        if self.scale_words and (k % 128 or 128 % self.block_k):
            raise ValueError("scale_words needs K % 128 == 0 and block_k dividing 128")
        if self.block_k > 32 * self.scale_bytes:  # (a scale load spans whole K steps)
            raise ValueError(f"block_k ({self.block_k}) is more than a scale load's K (32 per byte, "
                             f"{self.scale_bytes} bytes): 128 needs scale_words")
        if self.k_split not in (1, 2):
            raise ValueError("k_split must be 1 or 2")
        if self.k_parts not in (1, 2) or (self.k_parts == 2 and (not gemm1 or fp8 or self.k_split != 1)):
            raise ValueError("k_parts=2 is for W4A16 GEMM1 without k_split")
        if self.block_m != 64 or self.num_warps != 4:
            raise ValueError("the small-tile Gluon kernel takes block_m=64 and num_warps=4 (one warpgroup)")
        if self.pair and gemm1:
            raise ValueError("pair is for GEMM2")
        if self.split_loop and (fp8 or self.wide):
            raise ValueError("split_loop is for W4A16 on small tiles (W4A8 spills with it; the wide tiles split theirs)")
        if self.wide and not (self.block_rows in (128, WIDE_ROWS) and not fp8 and self.k_split == 1
                              and self.k_parts == 1):
            raise ValueError(f"wide takes W4A16 on 128- or {WIDE_ROWS}-row tiles, no K split")
        if self.half_tiles and not halves_fit(self.block_rows, self.wide, self.k_split, self.k_parts, self.sub_tiles):
            raise ValueError("half_tiles is for small tiles of 32 rows or more, without K split or sub-tiles")
        if self.extra_rows and not (self.extra_rows == WIDE_EXTRA and self.wide):
            raise ValueError(f"extra_rows ({self.extra_rows}) is {WIDE_EXTRA} on W4A16's wide tiles only")
        # both wide kernels: at least the K steps they unroll at a tile's end
        wide_short = self.wide and steps < wide_tail_steps(self.block_k, self.num_stages, self.scale_bytes)
        if self.wide and not gemm1 and (wide_short or self.pair or self.block_k != 64 or self.num_stages < 3):
            raise ValueError("the wide GEMM2 takes no pair, block_k=64, at least 3 stages and at least its unrolled last "
                             "K steps")
        if gemm1 and wide_short:
            raise ValueError("the wide GEMM1 takes at least its unrolled last K steps (num_stages - 1, rounded up to "
                             "whole scale loads)")
        if self.wide and wide_shared_bytes(self, gemm1) > SHARED_MAX:
            raise ValueError(f"the wide tiles' ring and output staging take {wide_shared_bytes(self, gemm1)} "
                             f"bytes of shared memory, more than {SHARED_MAX}")
        if n % self.block_m:  # (pair at N % 128 == 64: the last program's second block repeats its first, unstored)
            raise ValueError(f"the small-tile Gluon kernel needs N ({n}) to be a multiple of block_m")
        group = 32 * self.scale_bytes // self.block_k  # K steps per scale load
        if steps // (self.k_split * group) < 1:
            raise ValueError(f"k_split={self.k_split} needs at least {self.k_split * group} K steps, K={k} has fewer")
        return self


SHARED_MAX = 232448  # sm90: shared memory per program (227 KB)


def wide_shared_bytes(cfg: GemmConfig, gemm1: bool) -> int:
    """Shared memory of the wide kernels (``sm90_wide``), barriers left out: the BF16 activation ring (its extra rows
    too), both warpgroups' packed weights and BF16 output staging (GEMM1 BM/2 columns, GEMM2 BM) and GEMM2's routes and
    routing weights."""
    act = cfg.num_stages * (cfg.block_rows + cfg.extra_rows) * cfg.block_k * 2
    packed = 2 * cfg.num_stages * cfg.block_m * cfg.block_k // 2
    if gemm1:
        return act + packed + 2 * cfg.block_rows * cfg.block_m // 2 * 2
    # (with extra rows GEMM2 stages half of a 256-row tile at a time)
    staged = cfg.block_rows // (2 if cfg.extra_rows and cfg.block_rows > 128 else 1)
    return act + packed + 2 * staged * cfg.block_m * 2 + 2 * 4 * cfg.block_rows * 4


def scale_bytes(scale_words: bool) -> int:
    """The small and wide kernels' scale bytes per row and load (``SCALE_BYTES``): a 32-bit word with ``scale_words``,
    else 16 bits (a K % 64 == 0 row's bytes start 2-byte aligned)."""
    return 4 if scale_words else 2


# ----------------------------------------------------------------------------------------------------- overrides


@dataclass(frozen=True)
class Overrides:
    """What a test, a script or a tuning run may change; the defaults are the library's choices.

    ``gemm1`` / ``gemm2``: :class:`GemmConfig` fields (and ``kernel``) set on top of what :func:`gemm_config` picks;
    ``pdl``: programmatic dependent launch on sm90 (off: every kernel waits for the previous one to finish, e.g. for
    tools that serialize launches anyway); ``direct_decode``: up to :data:`DIRECT_MAX_TOKENS` W4A16 tokens without a
    route pack; ``direct_sum``: there, the top-k sum inside GEMM2 (else the top-k-sum kernel); ``tuned``: the tuned
    tables' fields under ``gemm1`` / ``gemm2`` (``tuned.lookup``; off: the heuristics alone, as the tuner measures)."""
    gemm1: Mapping = field(default_factory=dict)
    gemm2: Mapping = field(default_factory=dict)
    pdl: bool = True
    direct_decode: bool = True
    direct_sum: bool = True
    tuned: bool = True


DEFAULT_OVERRIDES = Overrides()  # (the launcher keeps launch plans only under these)
_OVERRIDES: contextvars.ContextVar = contextvars.ContextVar("mxmoe_overrides", default=DEFAULT_OVERRIDES)


def current_overrides() -> Overrides:
    return _OVERRIDES.get()


@contextlib.contextmanager
def overrides(*, gemm: Optional[Mapping] = None, **changes):
    """``with overrides(gemm1={...}, pdl=False): ...``: the calls inside launch with these :class:`Overrides` (on top
    of any outer ones); ``gemm``: config fields for both GEMMs (``gemm1`` / ``gemm2`` entries win)."""
    base = _OVERRIDES.get()
    if gemm is not None:
        changes["gemm1"] = {**gemm, **changes.get("gemm1", {})}
        changes["gemm2"] = {**gemm, **changes.get("gemm2", {})}
    token = _OVERRIDES.set(replace(base, **changes))
    try:
        yield _OVERRIDES.get()
    finally:
        _OVERRIDES.reset(token)


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device, kernel_arg: bool = True) -> dict:
    """Launch options for programmatic dependent launch (Hopper): the kernel may start while the previous one
    in the stream finishes, and waits for it with ``griddepcontrol.wait`` before touching memory."""
    if not current_overrides().pdl or interpreting() or not _has_pdl(device):
        return {}
    return dict(launch_pdl=True, **({"PDL": True} if kernel_arg else {}))


# ------------------------------------------------------------------------------------------------ kernel choice


WS8_MAX_CHAIN_K = 4096  # W4A8 prefill: the longest FP8 accumulator chain SPEC §5 allows


def w4a8_prefill(rows: int, num_experts: int, k: int) -> bool:
    """Whether a W4A8 GEMM of reduction length ``k`` runs the warp-specialized prefill kernel (``sm90_ws8``) rather
    than the small-tile kernel, where it measured faster (H100, perf-notes step 36): K % 128 != 0 (gpt-oss's 2880: the
    small kernel's 64-K stages) from 32 routed rows per expert (-8 to -29 % on the call); K % 128 == 0 on 128-row
    route tiles (over 64 rows per expert) and K >= 2048 (the reference shape's GEMM1: -10 to -15 %; its GEMM2, K =
    1024, is 7-30 % slower on it, and GEMM1 on 64-row tiles 15 % slower). K past ``WS8_MAX_CHAIN_K``: not measured,
    the small kernel."""
    per_expert = rows / max(num_experts, 1)
    if k <= 0 or k > WS8_MAX_CHAIN_K:
        return False
    if k % 128:
        return per_expert >= 32
    return per_expert > 64 and k >= 2048


def kernel_choice(device: torch.device, rows: int = 0, num_experts: int = 1, fp8: bool = False,
                  shapes_ok: bool = True, k: int = 0) -> str:
    """``MXMOE_KERNEL`` (auto | triton | gluon; unset or empty = auto): the kernel of a GEMM of reduction length ``k``
    over ``rows`` routed rows on CUDA.

    ``auto`` runs Gluon kernels on sm90 where they measured fastest (perf-notes steps 10, 11, 14, 49): the small-tile
    ``moe_gemm_small_kernel`` (and its wide form) for every GEMM except W4A8 prefill (:func:`w4a8_prefill`; ``k`` the
    GEMM's K), which runs the warp-specialized ``moe_gemm_ws8_kernel``; the plain
    template for shapes the Gluon kernels do not take (``shapes_ok``). Gluon's API moves between Triton releases, so
    ``auto`` takes it only on the Triton it was validated on (``GLUON_VALIDATED_TRITON``); ``MXMOE_KERNEL=gluon``
    forces it on any. The interpreter and CPU always run the plain template. Returns ``"triton"``, ``"gluon_ws8"`` or
    ``"gluon_small"``.
    """
    choice = env_get("MXMOE_KERNEL", "").strip() or "auto"  # unset or empty: auto
    if choice not in ("auto", "triton", "gluon"):
        raise ValueError(f"MXMOE_KERNEL must be auto, triton or gluon, got {choice!r}")
    if choice == "triton" or interpreting() or device.type != "cuda":
        return "triton"
    hopper = torch.cuda.get_device_capability(device)[0] == 9 and gluon_kernel() is not None
    gluon = "gluon_small"
    if fp8 and w4a8_prefill(rows, num_experts, k):
        gluon = "gluon_ws8"
    if choice == "gluon":
        if not hopper:
            raise ValueError("MXMOE_KERNEL=gluon needs an sm90 (Hopper) GPU and a Triton with Gluon")
        return gluon if shapes_ok else "triton"
    validated = gluon_validated(triton.__version__)
    return gluon if hopper and validated and shapes_ok else "triton"


def gemm2_pair_fits(n: int) -> bool:
    """Whether GEMM2's N divides into the small-tile kernel's pairs of 64-row weight blocks (``pair``)."""
    return n % 128 == 0


def triton_release(version: str) -> str:
    """The major.minor release of a Triton version string (``"3.6.1+git1234"`` -> ``"3.6"``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


@functools.cache
def gluon_validated(version: str) -> bool:
    """Whether ``auto`` may pick the Gluon kernel under Triton ``version`` (e.g. ``"3.6.0"``)."""
    return triton_release(version) in GLUON_VALIDATED_TRITON


@functools.cache
def gluon_kernel(name: str = "gluon_small", wide: bool = False):
    """The Gluon entry kernel of a family: ``"gluon_ws8"`` ``sm90_ws8.moe_gemm_ws8_kernel``, ``"gluon_small"``
    ``sm90_small.moe_gemm_small_kernel`` or, ``wide``, ``sm90_wide.moe_gemm_wide_kernel``; None without Gluon."""
    try:
        if name == "gluon_ws8":
            from .sm90_ws8 import moe_gemm_ws8_kernel as kernel
        elif wide:
            from .sm90_wide import moe_gemm_wide_kernel as kernel
        else:
            from .sm90_small import moe_gemm_small_kernel as kernel
    except ImportError:  # a Triton without Gluon
        return None
    return kernel


# ------------------------------------------------------------------------------------------------------- knobs


def tile_rows_for(rows: int, num_experts: int, cap: int = TILE_ROWS[-1], first_fill: float = 1.0) -> int:
    """Route-pack tile height for ``rows`` routed rows: small tiles where experts see few rows, the smallest
    only while experts average at most ``first_fill`` of it."""
    per_expert = rows / max(num_experts, 1)
    for bt in TILE_ROWS:
        if per_expert <= bt * (first_fill if bt == TILE_ROWS[0] else 1) or bt >= cap:
            return bt
    return TILE_ROWS[-1]


def pack_shapes(routes: int, num_experts: int) -> list:
    """(slots per tile, extra rows) of every route pack a call of up to ``routes`` routed rows may build (a
    workspace's): the heights of :func:`pack_tile_heights`, and the wide tiles with their extra rows where a call of
    at most ``routes`` rows may take them (:func:`_wide_packs_within`) or the overrides set them."""
    shapes = [(bt, 0) for bt in pack_tile_heights(routes, num_experts)]
    shapes += [(bt + extra, extra) for bt, extra in _wide_packs_within(routes, num_experts) if extra]
    changes = current_overrides()
    for gemm in (changes.gemm1, changes.gemm2):
        if gemm.get("extra_rows"):
            shapes.append((gemm.get("block_rows", WIDE_ROWS) + gemm["extra_rows"], gemm["extra_rows"]))
    return sorted(set(shapes))


@functools.lru_cache(maxsize=256)
def _wide_packs_within(routes: int, num_experts: int) -> set:
    """The (tile rows, extra rows) :func:`wide_pack` picks for some call of at most ``routes`` routed rows (any H and
    I): ``routes`` itself and every whole number of rows per expert up to one past it (its bands are tens of rows
    wide, so a call between two whole numbers is covered). A workspace reserves the packs with extra rows (12.5 % or
    25 % more pack and intermediate rows) only where some call it fits may take them."""
    E = max(num_experts, 1)
    return {wide_pack(routes, num_experts)} | {wide_pack(m * E, num_experts) for m in range(1, routes // E + 2)}


def pack_shape(cfg: GemmConfig) -> tuple[int, int]:
    """(slots per tile, extra rows) of the route pack a GEMM on ``cfg`` reads."""
    return cfg.block_rows * cfg.sub_tiles + cfg.extra_rows, cfg.extra_rows


def pack_tile_heights(routes: int, num_experts: int) -> list:
    """The route-tile heights a call of ``routes`` routed rows may pack (a workspace holds the largest such pack):
    the small tiles, the wide ones past ``WIDE_FROM`` rows per expert, and those the current overrides set."""
    heights = set(TILE_ROWS)
    if routes > WIDE_FROM * num_experts:
        heights.add(WIDE_ROWS)
    changes = current_overrides()
    for gemm in (changes.gemm1, changes.gemm2):
        if "block_rows" in gemm:
            heights.add(gemm["block_rows"] * gemm.get("sub_tiles", 1))
    return sorted(heights)


WIDE_MIN_K = 64 * wide_tail_steps(64, 6)  # the smallest H of the wide tiles (their unrolled last steps, 6 stages)


# a wide tile's cost in 128-row small tiles' (H100, perf-notes step 53: GEMM1 per tile at gpt-oss-120b 7.0-7.25 us on
# the small tiles, 8.3-8.9 on 128 + 32-slot wide tiles, 10.7 on 256-row ones; GEMM2 alike)
WIDE_TILE_COST = {128: 1.18, WIDE_ROWS: 1.5}


@functools.lru_cache(maxsize=16384)  # (a workspace asks for every whole number of rows per expert up to its own)
def wide_pack(rows: int, num_experts: int, hidden: int = 0, inter: int = 0) -> tuple[int, int]:
    """(tile rows, extra rows) of the wide tiles W4A16 takes for ``rows`` routed rows, (0, 0) for the small tiles
    (``hidden`` / ``inter``: H and I, 0 where any may be). Past ``WIDE_FROM`` rows per expert the 256-row tiles (step
    21; with :func:`wide_extra_rows`), from ``WIDE_MIN_K`` (any H multiple of 64: gpt-oss's 2880 loads its scales in
    16-bit halves, step 49). Between 64 and 256 rows per expert (the small tiles' 128 rows, one wide tile) 128 +
    32-slot tiles instead where their expected cost under uniform routing (``_tiles_per_expert``, ``WIDE_TILE_COST``)
    is lower, and GEMM2 runs the wide kernel too (both read one pack): experts of ~119-152 rows, where 128-row tiles
    give half of them a second tile and 256-row tiles are half empty (step 53: gpt-oss-120b T=4096 -14 %, T=4608
    -10 %, gpt-oss-20b T=1024 -21 %, the reference shape T=4864 -17 %; measured up to 176 rows per expert)."""
    m = rows / max(num_experts, 1)
    if m <= 64 or (hidden and hidden < WIDE_MIN_K):
        return 0, 0
    gemm2_wide = not inter or _wide_gemm2_fits(inter)
    choice = (0, 0)
    if m > WIDE_FROM:
        choice = (WIDE_ROWS, wide_extra_rows(rows, num_experts) if gemm2_wide else 0)
    if m >= WIDE_ROWS or not gemm2_wide:
        return choice
    spread = _row_spread(rows, num_experts)
    if choice[0]:
        cost = WIDE_TILE_COST[WIDE_ROWS] * _tiles_per_expert(spread, WIDE_ROWS)
    else:
        cost = _tiles_per_expert(spread, 128)
    if WIDE_TILE_COST[128] * _tiles_per_expert(spread, 128, WIDE_EXTRA) < cost:
        return 128, WIDE_EXTRA
    return choice


def _row_spread(rows: int, num_experts: int) -> list:
    """Uniform routing's rows per expert as (count, probability): about normal, mean m = rows / E, variance
    m (1 - 1/E)."""
    m = rows / max(num_experts, 1)
    sd = max(math.sqrt(m * (1 - 1 / max(num_experts, 1))), 1e-9)
    spread = [(r, math.exp(-0.5 * ((r - m) / sd) ** 2)) for r in range(max(int(m - 6 * sd), 0), int(m + 6 * sd) + 2)]
    total = sum(p for _, p in spread)
    return [(r, p / total) for r, p in spread]


def _tiles(r: int, height: int, extra: int = 0) -> int:
    """Route tiles of an expert of ``r`` rows: ``height`` rows each, its last up to ``height + extra``."""
    return -(-max(r - extra, 1) // height) if r else 0


def _tiles_per_expert(spread: list, height: int, extra: int = 0) -> float:
    """The expected route tiles per expert over a ``_row_spread``."""
    return sum(p * _tiles(r, height, extra) for r, p in spread)


def _wide_knobs(cfg: dict, k: int, gemm1: bool) -> None:
    """The wide tiles: GEMM1 on two warpgroups, 5 stages (step 21); GEMM2 persistent on two warpgroups where it has
    its unrolled last 4 steps, else on the tiles' 128-row halves (I = 128 at TP 8); as many stages as fit the shared
    memory (with the extra rows' ring GEMM1 takes 4: the same time, step 52). The 128-row tiles: 6 stages each (step
    53), fewer where K has fewer steps than they unroll."""
    bk = cfg["block_k"]
    if gemm1:
        cfg.update(wide=True, maxnreg=255, num_stages=6 if cfg["block_rows"] == 128 else 5)
    elif _wide_gemm2_fits(k, bk):
        cfg.update(wide=True, maxnreg=255, num_stages=6 if cfg["block_rows"] == 128 else 4)
    else:
        cfg.update(block_rows=128, sub_tiles=2, block_k=64)
    while cfg["wide"] and wide_shared_bytes(GemmConfig(**cfg), gemm1) > SHARED_MAX:
        cfg["num_stages"] -= 1
    # (the 128-row tiles' 6 stages unroll 6 K steps at a tile's end: fewer where K has fewer, down to 4)
    while cfg["wide"] and cfg["num_stages"] > 4 and \
            k // bk < wide_tail_steps(bk, cfg["num_stages"], scale_bytes(cfg["scale_words"])):
        cfg["num_stages"] -= 1


def _wide_gemm2_fits(k: int, block_k: int = 64) -> bool:
    """Whether GEMM2 of reduction length ``k`` runs the wide kernel (its unrolled last steps at 4 stages), not the
    128-row halves of the wide tiles."""
    return k // block_k >= wide_tail_steps(block_k, 4, scale_bytes(k % 128 == 0))


WIDE_EXTRA_GAIN = 0.93  # the extra rows' tile cost at most this fraction of the 256-row tiles' (step 52: +5-9 % per tile)


@functools.lru_cache(maxsize=1024)
def wide_extra_rows(rows: int, num_experts: int) -> int:
    """``WIDE_EXTRA`` where the wide tiles' extra rows pay for ``rows`` routed rows (else 0): under uniform routing
    (each expert's rows about normal, mean m = rows / E, variance m (1 - 1/E)) the expected tile costs, a tile with
    more than 256 rows counted 1 + 32/256 (its second MMA), at most ``WIDE_EXTRA_GAIN`` of the 256-row tiles'. A
    tile costs the same whatever its rows (perf-notes step 52), so the extra rows pay where experts' rows sit just past
    a multiple of 256 (gpt-oss-120b at T=8192: 256 +- 16) and cost their overhead elsewhere (the reference shape at
    T=8192, 228 rows: +5 %)."""
    base = cost = 0.0
    for r, p in _row_spread(rows, num_experts):
        base += p * _tiles(r, WIDE_ROWS)
        tiles = _tiles(r, WIDE_ROWS, WIDE_EXTRA)
        last = r - (tiles - 1) * WIDE_ROWS
        cost += p * (tiles + (WIDE_EXTRA / WIDE_ROWS if tiles and last > WIDE_ROWS else 0))
    return WIDE_EXTRA if cost < WIDE_EXTRA_GAIN * base else 0


def _decode_split(cfg: dict, rows: int, num_experts: int, n: int, k: int, fp8: bool, sm_count: int,
                  gemm1: bool) -> None:
    """Decode grids that fit the SMs at once. GEMM1: a second warpgroup takes half of the K steps (step 12); between
    1 and 1.5 programs per SM, W4A16: two programs per tile split the K steps (step 18). W4A16 GEMM2 up to 1.5
    programs per SM (gpt-oss at T=1: 180): the second warpgroup too, which doubles its bytes in flight (steps 44 and
    47: H100 call 47 -> 38 µs; 512 programs, the reference shape's, were slower with it)."""
    if not (sm_count and rows <= num_experts and k >= 512):
        return
    programs = (n // 64) * rows
    if gemm1 and programs <= sm_count:
        cfg.update(k_split=2, maxnreg=128)
    elif not fp8 and programs <= 3 * sm_count // 2:
        cfg.update(**(dict(k_parts=2) if gemm1 else dict(k_split=2, maxnreg=128)))


def _w4a8_tiles(cfg: dict, n: int, k: int, gemm1: bool) -> None:
    """W4A8 on the small tiles (step 31): 128 K per stage where the scale words allow; GEMM2 in pairs; FP8 chains of
    ``PROMOTE_K``, their FP32 sums in registers up to 64-row tiles and in shared memory at 128 rows (64-K stages)."""
    bt = cfg["block_rows"]
    if k % 128 == 0:
        cfg.update(block_k=128, num_stages=3 if bt <= 32 else 4)
    if not gemm1 and gemm2_pair_fits(n):
        cfg.update(pair=True)
    two_chains = gemm1 or cfg["pair"]
    promote = k > PROMOTE_K
    if bt == 128 and two_chains:
        if promote or gemm1:
            cfg.update(block_k=64 if k % 64 == 0 else cfg["block_k"], num_stages=4)
        else:  # GEMM2 pairs at 128 rows, no promotion: 3 stages of 128 K
            cfg.update(num_stages=3)
    if promote:
        cfg.update(promote=max(PROMOTE_K // cfg["block_k"], 1), promote_smem=bt == 128 and two_chains)


def _w4a16_gemm2(cfg: dict, rows: int, n: int, k: int) -> None:
    """W4A16 GEMM2: 128 K per stage on 16-row tiles (step 12); one token with at most 8 K steps: 6 stages, so that 5
    load before its wait while GEMM1 runs (step 19); two 64-row blocks per program from 32-row tiles (step 14), at
    N % 128 == 64 (gpt-oss; the last pair's second block repeats its first) on 128-row tiles only (step 49: GEMM2
    30-44 % faster than on the warp-specialized kernel there, 23-25 % slower than single blocks at 32 and 64 rows)."""
    bt = cfg["block_rows"]
    if bt == 16 and k % 128 == 0:
        cfg.update(block_k=128)
    if bt == 16 and rows <= 8 and k // cfg["block_k"] <= 8:
        cfg.update(num_stages=6)
    if bt >= 32 and not cfg["wide"] and (gemm2_pair_fits(n) or bt == 128):
        cfg.update(pair=True)


def _split_loop(cfg: dict, k: int, fp8: bool) -> bool:
    """W4A16's K loop in two parts (no per-step tests in the first) from 16 steps per warpgroup (step 23)."""
    steps = k // cfg["block_k"] // (cfg["k_split"] * cfg["k_parts"])  # per warpgroup
    return not (fp8 or cfg["wide"]) and steps >= SPLIT_LOOP_MIN_STEPS


def halves_fit(block_rows: int, wide: bool, k_split: int, k_parts: int, sub_tiles: int) -> bool:
    """Whether a small-tile config can run a tile on its first half (``half_tiles``): tiles of 32 rows or more, no K
    split, no sub-tiles."""
    return block_rows >= 32 and not wide and k_split == 1 and k_parts == 1 and sub_tiles == 1


def _half_tiles(cfg: dict, fp8: bool) -> bool:
    """W4A16 where the tiles can run halved: a tile whose second half holds no route (an expert's last tile; most
    tiles where experts average about half a tile) runs the MMAs and activation copies of its first half (step 54)."""
    return not fp8 and halves_fit(cfg["block_rows"], cfg["wide"], cfg["k_split"], cfg["k_parts"], cfg["sub_tiles"])


def _small_config(rows, num_experts, n, k, fp8, override: dict, gemm1, sm_count) -> GemmConfig:
    if k % 64 or n % 64:
        raise ValueError("the small-tile Gluon kernel needs N and K multiples of 64")
    chosen_bt = override.pop("block_rows", None)
    hidden, inter = (k, n) if gemm1 else (n, k)
    wide_bt, wide_extra = (0, 0) if fp8 else wide_pack(rows, num_experts, hidden, inter)
    # (16-row tiles up to 12 rows per expert: above, experts past 16 rows convert their weights twice; step 14)
    bt = chosen_bt or wide_bt or tile_rows_for(rows, num_experts, first_fill=0.75)
    cfg = dict(block_rows=bt, block_m=64, block_k=64, num_warps=4, num_stages=4, scale_words=k % 128 == 0,
               k_split=1, pair=False, k_parts=1, wide=False, sub_tiles=1)
    if override.get("wide", bt == WIDE_ROWS or (chosen_bt is None and wide_bt > 0)):
        # (before the stages: their ring takes shared memory; the extra rows only where GEMM2 runs the wide kernel,
        # whose K is GEMM1's N: both read one pack)
        extra = 0
        if bt == wide_bt:
            extra = wide_extra
        elif bt == WIDE_ROWS and not fp8 and _wide_gemm2_fits(inter):  # (an override's 256-row tiles)
            extra = wide_extra_rows(rows, num_experts)
        cfg["extra_rows"] = override.pop("extra_rows", extra)
        _wide_knobs(cfg, k, gemm1)
    _decode_split(cfg, rows, num_experts, n, k, fp8, sm_count, gemm1)
    if fp8 and not cfg["wide"]:
        _w4a8_tiles(cfg, n, k, gemm1)
    elif not gemm1:
        _w4a16_gemm2(cfg, rows, n, k)
    cfg.update(override)
    if "split_loop" not in override:
        cfg["split_loop"] = _split_loop(cfg, k, fp8)
    if "half_tiles" not in override:
        cfg["half_tiles"] = _half_tiles(cfg, fp8)
    return GemmConfig(kernel="gluon_small", **cfg).validate(n, k, gemm1, fp8)


def tiles_beside(ws8: GemmConfig) -> dict:
    """The small-tile kernel's route-tile fields for a GEMM beside one on the W4A8 prefill kernel (``ws8``), on its
    pack: its tiles are at most 128 rows, so 256-row tiles in two sub-tiles."""
    return dict(block_rows=min(ws8.block_rows, 128), sub_tiles=max(ws8.block_rows // 128, 1))


# W4A8 prefill on 256-row route tiles (one m-tile per warpgroup) against 128-row tiles (two): each GEMM's time per
# pack slot, by (GEMM1, K % 128 == 0), H100, perf-notes step 58: the reference shape's GEMM1 0.91-0.94; gpt-oss's
# (K = 2880) GEMM1 0.94-1.01, GEMM2 0.76-0.80; unmeasured: 1
WS8_TALL_SLOT_COST = {(True, True): 0.93, (True, False): 0.96, (False, False): 0.79, (False, True): 1.0}
SMALL_SUB_TILE_COST = 1.03  # the small-tile kernel on a 256-row pack's 128-row halves against a 128-row pack (step 58)


@functools.lru_cache(maxsize=1024)  # (off a launch plan every call asks: ~0.3 ms of Python uncached)
def w4a8_tall_tiles(rows: int, num_experts: int, hidden: int, inter: int, kernels: tuple) -> tuple[bool, bool]:
    """Which W4A8 GEMMs (GEMM1, GEMM2) take 256-row route tiles (``kernels``: each GEMM's :func:`kernel_choice`):
    every one on the prefill kernel, a small-tile GEMM beside them on the pack's 128-row halves
    (:func:`tiles_beside`), where experts average more than ``WIDE_FROM`` rows (a workspace holds 256-row packs there)
    and, under uniform routing's expected slots per expert (``_tiles_per_expert``), the two GEMMs' costs (MACs per
    row: GEMM1 2, GEMM2 1; ``WS8_TALL_SLOT_COST``, ``SMALL_SUB_TILE_COST``) come out lower than on 128-row tiles."""
    ks, ws8 = (hidden, inter), tuple(kernel == "gluon_ws8" for kernel in kernels)
    if rows <= WIDE_FROM * num_experts or not any(ws8) or max(k for k, w in zip(ks, ws8) if w) > WS8_MAX_CHAIN_K:
        return False, False  # (past it the prefill kernel's chains need 64-row tiles)
    spread = _row_spread(rows, num_experts)
    short, tall = 128 * _tiles_per_expert(spread, 128), 256 * _tiles_per_expert(spread, 256)
    cost = sum(macs * (tall * WS8_TALL_SLOT_COST[gemm1, k % 128 == 0] if w else short * SMALL_SUB_TILE_COST)
               for gemm1, w, k, macs in zip((True, False), ws8, ks, (2, 1)))
    return ws8 if cost < 3 * short else (False, False)


def ws8_m_tiles(cfg: GemmConfig) -> int:
    """The W4A8 prefill kernel's m64 tiles per consumer warpgroup: ``block_m`` (weight rows per program) / 128."""
    return cfg.block_m // 128


def _ws8_config(rows, num_experts, n, k, override: dict) -> GemmConfig:
    """The W4A8 prefill kernel (``sm90_ws8``): 128-row route tiles where experts average more than 64 rows, else 64
    (256-row tiles, one m-tile per warpgroup, where :func:`w4a8_tall_tiles` picks them, or by override or a tuned
    table: perf-notes steps 57-58); as many 128-K stages as fit 192 KB of shared memory (block_m x 64 B of weights
    and BT x 128 B of activations each); FP8 chains over all of K up to ``WS8_MAX_CHAIN_K``, past it (H = 7168)
    chains of that length on 64-row tiles."""
    bt, promote = (128 if tile_rows_for(rows, num_experts) >= 128 else 64), 0
    if k > WS8_MAX_CHAIN_K:
        bt, promote = 64, WS8_MAX_CHAIN_K // 128
    cfg = dict(block_rows=bt, block_k=128, num_warps=4, promote=promote)
    cfg.update(override)
    cfg.setdefault("block_m", 128 if cfg["block_rows"] == 256 else 256)  # (256-row tiles: one m-tile per warpgroup)
    # the producer's 256 activation rows' pointers spill at 64 registers (128 x 96 + 2 x 128 x 208 = 64 K)
    regs = dict(loader_regs=96, converter_regs=208) if cfg["block_rows"] == 256 else dict(loader_regs=64,
                                                                                          converter_regs=224)
    cfg = {**regs, **cfg}
    cfg.setdefault("num_stages", (192 * 1024) // (cfg["block_m"] * 64 + cfg["block_rows"] * 128))
    return GemmConfig(kernel="gluon_ws8", **cfg).validate(n, k, True, True)


def _template_config(rows, num_experts, n, k, fp8, override: dict) -> GemmConfig:
    """The plain template: 4 warps and 64 weight rows keep 2-4 CTAs per SM, whose conversion and MMA phases overlap
    (Triton waits for each wgmma); W4A8 one FP8 MMA per K32 block (its scale multiplies the partial sum)."""
    bt = tile_rows_for(rows, num_experts)
    cfg = dict(block_rows=bt, block_m=64, block_k=128 if bt <= 32 else 64, num_warps=4, num_stages=3)
    if fp8:  # 8 warps hold both accumulators at 128 rows
        cfg.update(block_k=32, num_stages=4, num_warps=8 if bt == 128 else 4)
    cfg.update(override)
    if fp8 and cfg["block_k"] != 32:
        raise ValueError("W4A8 tiles are one K32 scale block deep (block_k=32)")
    while n % cfg["block_m"]:
        cfg["block_m"] //= 2
    while k % cfg["block_k"]:
        cfg["block_k"] //= 2
    return GemmConfig(**cfg)


def gemm_config(rows: int, num_experts: int, n: int, k: int, fp8: bool, override: Optional[Mapping] = None,
                kernel: str = "triton", gemm1: bool = True, sm_count: int = 0) -> GemmConfig:
    """The config of one GEMM (``n`` output rows of weights, ``k`` deep) over ``rows`` routed rows on ``kernel``'s
    family; ``override``: config fields (and ``kernel``) on top; ``sm_count``: the decode K split's grid (0: none)."""
    override = dict(override or {})
    kernel = override.pop("kernel", kernel)
    if kernel == "gluon_small":
        return _small_config(rows, num_experts, n, k, fp8, override, gemm1, sm_count)
    if kernel == "gluon_ws8":
        return _ws8_config(rows, num_experts, n, k, override)
    if kernel != "triton":
        raise ValueError(f"unknown kernel {kernel!r}: triton, gluon_small or gluon_ws8")
    return _template_config(rows, num_experts, n, k, fp8, override)


def unfolded_config(cfg: GemmConfig, gemm1: bool, k: int) -> GemmConfig:
    """The config of the exact per-block W4A8 kernel (experts whose scales do not fold) on the route pack of ``cfg``:
    at most 64 routed rows per program (each block's partial sums sit beside the accumulators), larger route tiles in
    sub-tiles; 128 K per stage where the scale words allow, 64 for GEMM1 at 64 rows under a cap of 200 registers and
    160 at 32 rows (perf-notes steps 13 and 15)."""
    if cfg.kernel == "gluon_ws8":  # (its route pack, the small-tile kernel's form)
        cfg = GemmConfig(block_rows=cfg.block_rows, block_m=64, block_k=64, num_warps=4, num_stages=4,
                         kernel="gluon_small", scale_words=k % 128 == 0)
    bt = min(cfg.block_rows, 64)
    bk = 128 if k % 128 == 0 else cfg.block_k
    nreg = 0
    if gemm1 and bk == 128 and bt == 64:
        bk, nreg = 64, 200
    elif gemm1 and bk == 128 and bt == 32:
        nreg = 160
    return replace(cfg, block_rows=bt, sub_tiles=cfg.sub_tiles * cfg.block_rows // bt, block_k=bk, maxnreg=nreg,
                   num_stages=3 if bt <= 32 and bk == 128 else 4, pair=cfg.pair and bt == 16, promote=0,
                   promote_smem=False)


# The Gluon entry kernels' runtime arguments, in bundles (tuples; each element specialized as a flat argument would be)
ARG_BUNDLES = {
    "a": ("a_ptr", "a_scale_ptr", "stride_a"),  # the activations (W4A8: E4M3 rows and their scales)
    "w": ("w_ptr", "s_ptr", "ref_ptr", "gscale_ptr", "bias_ptr"),  # the prepared weights of one GEMM
    "pack": ("sorted_routes_ptr", "tile_expert_ptr", "num_tiles_ptr"),  # the route pack
    "out": ("out_ptr", "stride_out", "topk_weights_ptr"),  # the output rows and the routing weights
    "dims": ("N", "K", "top_k", "limit", "alpha"),  # sizes and the activation's parameters
}


def bundled(args) -> list:
    """The entry kernels' runtime arguments, in ``ARG_BUNDLES``' order, as its tuples."""
    it = iter(args)
    return [tuple(next(it) for _ in names) for names in ARG_BUNDLES.values()]


SMALL_ARG_BUNDLES = {  # the small-tile kernel's besides
    "direct": ("ids_ptr", "expert_map_ptr", "num_global", "num_experts"),  # the direct path: routes without a pack
    "joins": ("sum_out_ptr", "stride_sum_out", "counters_ptr", "parts_ptr"),  # top-k sum in GEMM2, K parts' sums
    "fold_ptr": ("fold_ptr", ),  # W4A8: the experts whose scales fold (passed alone, not as a tuple)
}


def small_kernel_constexprs(cfg: GemmConfig, gemm1: bool, pdl: bool, n: int) -> dict:
    """The small-tile or wide kernel's constexprs for ``cfg`` (on an ``n``-row GEMM) besides the common ones (its
    launch's, and ``sm90.compile_gemm``'s). ``SPLIT_REGS``: the second warpgroup's registers per thread (K split, wide
    tiles), the launch's ``maxnreg`` as the first's (128 where none is set, the kernel's default). ``EARLY_WEIGHTS``:
    with PDL, GEMM2 copies its first weight stages before it waits for GEMM1. ``REPEAT_LAST``: GEMM2 on two 64-row
    blocks per program (``pair``, the wide tiles) at N % 128 == 64, whose last program's second block repeats its
    first (a constexpr: N % 128 == 0 compiles as before)."""
    common = dict(SPLIT_REGS=cfg.maxnreg or 128, EARLY_WEIGHTS=pdl and not gemm1 and cfg.k_split == 1,
                  REPEAT_LAST=(cfg.pair or (cfg.wide and not gemm1)) and not gemm2_pair_fits(n))
    if cfg.wide:
        return dict(common, SCALE_BYTES=cfg.scale_bytes, EXTRA_ROWS=cfg.extra_rows)
    return dict(common, SCALE_BYTES=cfg.scale_bytes, KSPLIT=cfg.k_split, PAIR=cfg.pair, K_PARTS=cfg.k_parts,
                SUB_TILES=cfg.sub_tiles, SPLIT_LOOP=cfg.split_loop, PROMOTE=cfg.promote, PROMOTE_SMEM=cfg.promote_smem,
                HALF_TILES=cfg.half_tiles)
