"""Launch plan of the Triton path: workspace, tile configs, the kernel sequence.

Run path (no allocation once the workspace exists, no host sync, capturable):
route pack (one kernel up to 1024 routes, else 2 fills + 3 kernels) -> [W4A8: quantize x rows] -> GEMM1 +
activation -> [W4A8: quantize intermediate rows] -> GEMM2 + routing weight -> top-k sum. Up to
``DIRECT_MAX_TOKENS`` W4A16 tokens (``direct_routes``): GEMM1 -> GEMM2 + routing weight + top-k sum, no pack.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton

from . import interpreting  # interpreter runs use the plain-Triton forms (no inline asm, FP32 dots)
from ..prepare import PreparedExperts, row_block_unit
from ..routing import RoutePack, route_pack_capacity
from ..selection import fp8_min_rows
from .elementwise import quantize_rows_kernel, topk_sum_kernel
from .gemm import moe_gemm_kernel
from .routing_kernels import route_count_kernel, route_offsets_kernel, route_pack_small_kernel, route_scatter_kernel

TILE_ROWS = (16, 32, 64, 128)  # route-pack tile heights in use
WIDE_ROWS = 256  # the route tiles of the wide W4A16 GEMMs (``GemmConfig.wide``)
WIDE_FROM = 132  # routed rows per expert above which W4A16 takes them (gemm_config)
WIDE_GEMM2 = True  # GEMM2 on the wide tiles themselves (persistent), else on their 128-row halves
PDL = True  # programmatic dependent launch (compute capability >= 9) of the one-launch route pack, the small-tile
# GEMMs and the top-k sum
EARLY_WEIGHTS = True  # with PDL: GEMM2's first weight stages load before GEMM1 finished
ROUTE_BLOCK = 1024  # routes up to which one program packs them all (on a block of their size, 16 at least)
ROUTE_SUBS = 16  # counters per expert of the multi-kernel route pack (routing_kernels.route_count_kernel)
DIRECT_DECODE = True  # a few tokens, W4A16 on the small-tile Gluon kernels: each route a 16-row tile of its own
# and no route-pack launch (the GEMMs read the top-k ids themselves; docs/perf-notes.md step 17)
DIRECT_MAX_TOKENS = 4  # up to which (a repeated expert costs a second tile; measured slower from T=8)
DIRECT_SUM = True  # with DIRECT_DECODE: GEMM2's last program per (token, column block) adds the token's routed
# rows (no top-k-sum launch)


@dataclass(frozen=True)
class GemmConfig:
    block_rows: int  # BT: route-pack tile height (MMA N)
    block_m: int  # weight rows per program (MMA M)
    block_k: int
    num_warps: int
    num_stages: int
    kernel: str = "triton"  # gemm.moe_gemm_kernel; sm90 Gluon: "gluon" (moe_gemm_ws_kernel), "gluon_small"
    maxnreg: int = 0  # gluon: registers per thread (0: Triton's default); the partitions' budgets below
    loader_regs: int = 48  # (8 MMA warps x 176 registers + these fill the register file)
    converter_regs: int = 112
    scale_words: bool = False  # gluon_small: scale bytes in 32-bit loads, 4/(block_k/32) steps each (K % 128 == 0)
    k_split: int = 1  # gluon_small: 2 = a second warpgroup runs the second half of the K steps (decode)
    pair: bool = False  # gluon_small GEMM2: two 64-row weight blocks per program (block_m stays the block's rows)
    k_parts: int = 1  # gluon_small GEMM1 without a route pack: 2 = two programs split the K steps (decode grids
    # that fill the SMs unevenly)
    wide: bool = False  # gluon_small W4A16 on 256-row route tiles, persistent, two warpgroups: GEMM1 the gate and up
    # rows of 32 output columns each (``_wide_gemm1``), GEMM2 64 output columns each (``_wide_gemm2``)
    sub_tiles: int = 1  # gluon_small GEMM2 on a pack of sub_tiles * block_rows-row tiles (the wide GEMM1's)
    split_loop: bool = False  # gluon_small W4A16 (not wide): the K loop's steps that refill within the program untested,
    # then its last ones tested (``gemm_sm90._small_steps``)
    promote: int = 0  # gluon_small W4A8 fast path: K steps per FP8 accumulator chain, each chain's sums then added to
    # FP32 accumulators (0: one chain over all of K)
    promote_smem: bool = False  # ... those FP32 sums in shared memory (tiles whose chains take all the registers)


def kernel_choice(device: torch.device, rows: int = 0, num_experts: int = 1, fp8: bool = False,
                  shapes_ok: bool = True, gemm1: bool = True, n: int = 0) -> str:
    """``MXMOE_KERNEL`` (auto | triton | gluon; unset or empty = auto): the kernel of GEMM1 (``gemm1``) or
    GEMM2 (``n`` output columns) on CUDA.

    ``auto`` runs Gluon kernels on sm90 where they measured fastest on the H200 (docs/perf-notes.md,
    steps 10, 11 and 14): the one-warpgroup register-operand ``gemm_sm90.moe_gemm_small_kernel`` for every
    GEMM, except W4A16 GEMM2 on 128-row route tiles (prefill) where its two-block form cannot run
    (``n % 128 != 0``): there the persistent warp-specialized ``gemm_sm90.moe_gemm_ws_kernel``; the plain
    template for shapes the Gluon kernels do not take (``shapes_ok``). Gluon is experimental and its API
    moves between Triton releases, so ``auto`` takes it only on the Triton it was validated on
    (``GLUON_VALIDATED_TRITON``); ``MXMOE_KERNEL=gluon`` forces the same Gluon kernels on any. The
    interpreter and CPU always run the plain template. Returns ``"triton"``, ``"gluon"``
    (warp-specialized) or ``"gluon_small"``.
    """
    choice = os.environ.get("MXMOE_KERNEL", "").strip() or "auto"  # unset or empty: auto
    if choice not in ("auto", "triton", "gluon"):
        raise ValueError(f"MXMOE_KERNEL must be auto, triton or gluon, got {choice!r}")
    if choice == "triton" or interpreting() or device.type != "cuda":
        return "triton"
    hopper = torch.cuda.get_device_capability(device)[0] == 9 and _gluon_kernel() is not None
    prefill_gemm2 = not (fp8 or gemm1) and tile_rows_for(rows, num_experts) == TILE_ROWS[-1] and not gemm2_pair_fits(n)
    gluon = "gluon" if prefill_gemm2 else "gluon_small"
    if choice == "gluon":
        if not hopper:
            raise ValueError("MXMOE_KERNEL=gluon needs an sm90 (Hopper) GPU and a Triton with Gluon")
        return gluon if shapes_ok else "triton"
    validated = gluon_validated(triton.__version__)
    return gluon if hopper and validated and shapes_ok else "triton"


def gemm2_pair_fits(n: int) -> bool:
    """Whether GEMM2's N divides into the small-tile kernel's pairs of 64-row weight blocks (``pair``)."""
    return n % 128 == 0


GLUON_VALIDATED_TRITON = ("3.6",)  # major.minor releases the Gluon kernel was measured and tested on


@functools.cache
def gluon_validated(version: str) -> bool:
    """Whether ``auto`` may pick the Gluon kernel under Triton ``version`` (e.g. ``"3.6.0"``)."""
    return ".".join(version.split("+")[0].split(".")[:2]) in GLUON_VALIDATED_TRITON


@functools.cache
def _gluon_kernel(name: str = "gluon"):
    try:
        from .gemm_sm90 import moe_gemm_small_kernel, moe_gemm_ws_kernel
    except ImportError:  # a Triton without Gluon
        return None
    return moe_gemm_small_kernel if name == "gluon_small" else moe_gemm_ws_kernel


def tile_rows_for(rows: int, num_experts: int, cap: int = TILE_ROWS[-1], first_fill: float = 1.0) -> int:
    """Route-pack tile height for ``rows`` routed rows: small tiles where experts see few rows, the smallest
    only while experts average at most ``first_fill`` of it."""
    per_expert = rows / max(num_experts, 1)
    for bt in TILE_ROWS:
        if per_expert <= bt * (first_fill if bt == TILE_ROWS[0] else 1) or bt >= cap:
            return bt
    return TILE_ROWS[-1]


def wide_tail_steps(block_k: int, num_stages: int) -> int:
    """K steps a wide tile unrolls at its end (``gemm_sm90._wide_tail_steps``): its last num_stages - 1, rounded up to
    whole scale words (128 K each)."""
    per_word = 128 // block_k
    return per_word * -(-(num_stages - 1) // per_word)


SPLIT_LOOP_MIN_STEPS = 16  # K steps per warpgroup from which the small-tile W4A16 GEMMs split their K loop
# (``GemmConfig.split_loop``)
WIDE_MIN_K = 64 * wide_tail_steps(64, 6)  # the smallest H of the wide tiles: the wide GEMM1 unrolls its last steps (at
# up to 6 stages)


PROMOTE_K = 1024  # W4A8 fast path: the K over which one FP8 accumulator chain runs before its sums go to FP32


def _w4a8_tiles(cfg: dict, bt: int, n: int, k: int, gemm1: bool) -> None:
    """The W4A8 fast path's tile knobs on the small-tile kernel (H200, reference shape, docs/perf-notes.md step 31):
    128 K per stage where the scale words allow; GEMM2 always in pairs of 64-row blocks (T=1024..8192 GEMM2 -7 to -11
    %); FP8 accumulator chains of ``PROMOTE_K`` (longer ones miss SPEC §5's 1.5e-3 on GEMM1: 2048 K 1.9e-3, 4096 K
    4.3e-3), their FP32 sums in registers up to 64-row tiles and in shared memory at 128 rows (64-K stages there, so
    that two programs still fit on an SM)."""
    if k % 128 == 0:
        cfg.update(block_k=128, num_stages=3 if bt <= 32 else 4)
    if not gemm1 and gemm2_pair_fits(n):
        cfg.update(pair=True)
    two_chains = gemm1 or cfg["pair"]
    promote = k > PROMOTE_K
    if bt == 128 and two_chains:
        if promote or gemm1:
            cfg.update(block_k=64 if k % 64 == 0 else cfg["block_k"], num_stages=4)
        else:  # GEMM2 pairs at 128 rows, no promotion: 3 stages of 128 K (T=8192 GEMM2 1.31 -> 1.10 ms)
            cfg.update(num_stages=3)
    if promote:
        cfg.update(promote=max(PROMOTE_K // cfg["block_k"], 1), promote_smem=bt == 128 and two_chains)


def unfolded_config(cfg: GemmConfig, gemm1: bool, k: int) -> GemmConfig:
    """The config of the exact per-block W4A8 kernel (experts whose scales do not fold) on the route pack of ``cfg``:
    at most 64 routed rows per program (each block's partial sums sit beside the accumulators), larger route tiles in
    sub-tiles; 128 K per stage where the scale words allow, 64 for GEMM1 at 64 rows under a cap of 200 registers and
    160 at 32 rows (docs/perf-notes.md steps 13 and 15)."""
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


def gemm_config(rows: int, num_experts: int, n: int, k: int, fp8: bool, override: Optional[dict] = None,
                kernel: str = "triton", gemm1: bool = True, sm_count: int = 0) -> GemmConfig:
    override = dict(override or {})
    kernel = override.pop("kernel", kernel)
    if kernel == "gluon_small":
        if k % 64 or n % 64:
            raise ValueError("the small-tile Gluon kernel needs N and K multiples of 64")
        # 16-row tiles up to 12 rows per expert on average: above, the experts past 16 rows (a Poisson spread)
        # take a second tile, converting their weights twice; 32-row tiles measured faster from there (H200,
        # reference shape: T=512 W4A16 0.957 -> 0.893, W4A8 0.817 -> 0.803 ms; T=576 1.080 -> 0.902, 0.862 ->
        # 0.812; equal at 12.4 rows, slower below; docs/perf-notes.md step 14)
        chosen_bt = override.pop("block_rows", None)
        bt = chosen_bt or tile_rows_for(rows, num_experts, first_fill=0.75)
        # W4A16 with more than WIDE_FROM rows per expert (most experts past one 128-row tile): 256-row tiles, GEMM1
        # on two warpgroups (``wide``: half the conversion per MMA), GEMM2 likewise (persistent) where its scale words
        # fit (I % 128 == 0), else on their 128-row halves; GEMM2's N (= H, GEMM1's K) % 128 == 0. H200, reference
        # shape, the call against 128-row tiles: T=4608 (128 rows per expert) +11.7 %, 4864 (135) -6.4 %, 5120 (142)
        # -12.5 %, 6144 -10 %, 8192 -9.8 % (docs/perf-notes.md step 21)
        # (and H >= WIDE_MIN_K: the wide GEMM1 unrolls its last num_stages - 1 K steps, at whole scale words)
        hidden = k if gemm1 else n
        if not (chosen_bt or fp8) and rows > WIDE_FROM * num_experts and hidden % 128 == 0 and hidden >= WIDE_MIN_K:
            bt = WIDE_ROWS
        cfg = dict(block_rows=bt, block_m=64, block_k=64, num_warps=4, num_stages=4, scale_words=k % 128 == 0,
                   k_split=1, pair=False, k_parts=1, wide=False, sub_tiles=1)
        if bt == WIDE_ROWS:  # wide route tiles: both GEMMs on two warpgroups (GEMM2 persistent), or GEMM2 on halves
            # GEMM1 on 5 stages: H200 T=8192 1.935 -> 1.855 ms, 6144 1.885 -> 1.721 (6: 1.869 / 1.767); 255 registers
            # (persistent: the next tile's copy state through the tail; 232 spills)
            if gemm1:
                cfg.update(wide=True, maxnreg=255, num_stages=5)
            elif WIDE_GEMM2 and k % 128 == 0 and k // 64 >= wide_tail_steps(64, 4):
                # persistent, two warpgroups of one 64 x 256 chain each (``gemm_sm90._wide_gemm2``); it unrolls a
                # tile's last 4 K steps, else (I = 128, e.g. at 8-way tensor parallelism) the halves
                cfg.update(wide=True, maxnreg=255, num_stages=4)
            else:
                cfg.update(block_rows=128, sub_tiles=2)
                bt = 128
        # Decode GEMM1 (at most one route tile per routed row). Programs that fit on the SMs at once: one warpgroup
        # per SM issues too few instructions per cycle, so a second one takes half of the K steps (T=1 on the H200:
        # 26 -> 21 us; GEMM2 and larger grids got slower; docs/perf-notes.md step 12). Between 1 and 1.5 programs
        # per SM (E=128, H=I=2880, top_k=4 at T=1: 180 on 132): a third of the SMs would run two programs while the
        # rest run one; two programs per tile, each half of the K steps, even that out (W4A16 only without a route
        # pack, ``direct_routes``: the halves join per route; docs/perf-notes.md step 18)
        programs = (n // 64) * rows
        if gemm1 and sm_count and rows <= num_experts and k >= 512:
            if programs <= sm_count:
                cfg.update(k_split=2, maxnreg=128)
            elif not fp8 and programs <= 3 * sm_count // 2:
                cfg.update(k_parts=2)
        if fp8:
            _w4a8_tiles(cfg, bt, n, k, gemm1)
        # W4A16 GEMM2 on 16-row tiles: 64 bytes per weight row and stage (T=1/4/16/64/256: GEMM2 -5..-11 %;
        # 32- and 64-row tiles equal or slower; docs/perf-notes.md step 12)
        if not (fp8 or gemm1) and bt == 16 and k % 128 == 0:
            cfg.update(block_k=128)
        # W4A16 GEMM2 of one token (T * top_k <= 8 routes) with at most 8 K steps: 6 stages, so that 5 steps' weights
        # load before its wait, while GEMM1 runs (EARLY_WEIGHTS). H200, reference shape, T=1 graph replay 31.10 ->
        # 29.76 us (a slower machine: 38.69 -> 37.54); 5 or 7 stages, T=2 and 3 and the 2880 shapes (45 steps) were
        # slower (docs/perf-notes.md step 19)
        if not (fp8 or gemm1) and bt == 16 and rows <= 8 and k // cfg["block_k"] <= 8:
            cfg.update(num_stages=6)
        # GEMM2 with two 64-row blocks per program, one converting while the other's MMA runs, where it measured
        # faster (H200, perf-notes step 14): W4A16 from 32-row tiles (GEMM2 T=1024 0.386 -> 0.361, T=8192
        # 1.689 -> 1.455 ms against the kernels before; slower on 16-row tiles), W4A8 on 16-row tiles (T=64
        # 0.170 -> 0.159 ms; from 32 rows its registers cost programs per SM: slower)
        if not (gemm1 or fp8) and gemm2_pair_fits(n) and bt >= 32 and not cfg["wide"]:
            cfg.update(pair=True)
        cfg.update(override)
        if "split_loop" not in override:
            # W4A16's K loop in two parts (no per-step tests in the first): H200, reference shape, the call T=1024
            # 907-909 -> 867-869 us, T=2048 1234-1264 -> 1204-1217, T=4096 1962-1978 -> 1860-1936; T=1 GEMM1 17.6 ->
            # 16.3 us. Where a warpgroup has 8 K steps (GEMM2 on 16-row tiles) no gain showed (calls T=16 -4.8 %,
            # T=64 +2.6 %), so from 16 (docs/perf-notes.md step 23)
            steps = k // cfg["block_k"] // (cfg["k_split"] * cfg["k_parts"])  # per warpgroup
            cfg["split_loop"] = not (fp8 or cfg["wide"]) and steps >= SPLIT_LOOP_MIN_STEPS
        if k % cfg["block_k"]:
            raise ValueError(f"the small-tile Gluon kernel needs K ({k}) to be a multiple of block_k ({cfg['block_k']})")
        if cfg["scale_words"] and (k % 128 or 128 % cfg["block_k"]):
            raise ValueError("scale_words needs K % 128 == 0 and block_k dividing 128")
        if cfg["k_split"] not in (1, 2):
            raise ValueError("k_split must be 1 or 2")
        if cfg["k_parts"] not in (1, 2) or (cfg["k_parts"] == 2 and (not gemm1 or fp8 or cfg["k_split"] != 1)):
            raise ValueError("k_parts=2 is for W4A16 GEMM1 without k_split")
        if cfg["block_m"] != 64 or cfg["num_warps"] != 4:
            raise ValueError("the small-tile Gluon kernel takes block_m=64 and num_warps=4 (one warpgroup)")
        if cfg["pair"] and gemm1:
            raise ValueError("pair is for GEMM2")
        if cfg["split_loop"] and (fp8 or cfg["wide"]):
            raise ValueError("split_loop is for W4A16 on small tiles (W4A8 spills with it; the wide tiles split theirs)")
        if cfg["wide"] and not (not fp8 and cfg["block_rows"] == 256 and cfg["k_split"] == 1 and cfg["k_parts"] == 1):
            raise ValueError("wide is for W4A16 on 256-row tiles")
        # both wide kernels: scale words, and at least the K steps they unroll at a tile's end
        wide_short = cfg["wide"] and (not cfg["scale_words"]
                                      or k // cfg["block_k"] < wide_tail_steps(cfg["block_k"], cfg["num_stages"]))
        if cfg["wide"] and not gemm1 and (wide_short or cfg["pair"] or n % 128 or cfg["block_k"] != 64
                                          or cfg["num_stages"] not in (3, 4)):
            # (5 stages with its output staging exceed the shared memory)
            raise ValueError("the wide GEMM2 takes N % 128 == 0, scale_words, no pair, block_k=64, 3 or 4 stages and "
                             "at least its unrolled last K steps")
        if gemm1 and wide_short:
            raise ValueError("the wide GEMM1 takes scale_words and at least its unrolled last K steps "
                             "(num_stages - 1, rounded up to whole scale words)")
        if n % (cfg["block_m"] * (2 if cfg["pair"] else 1)):
            raise ValueError(f"the small-tile Gluon kernel needs N ({n}) to be a multiple of its rows per program "
                             f"(block_m, twice that with pair)")
        group = 128 // cfg["block_k"] if cfg["scale_words"] else 1  # K steps per scale word
        if (k // cfg["block_k"]) // (cfg["k_split"] * group) < 1:
            raise ValueError(f"k_split={cfg['k_split']} needs at least {cfg['k_split'] * group} K steps, K={k} has fewer")
        return GemmConfig(kernel="gluon_small", **cfg)
    if kernel == "gluon":
        if fp8:
            raise ValueError("the warp-specialized Gluon kernel is W4A16 (W4A8 runs the small-tile kernel)")
        if k % 64 or n % 64:
            raise ValueError("the Gluon kernel needs N and K multiples of 64")
        bt = tile_rows_for(rows, num_experts)
        if bt >= 64:
            # two MMA warpgroups on 128 weight rows (per half): half the activation traffic of 64-row
            # tiles (docs/perf-notes.md step 8)
            cfg = dict(block_rows=bt, block_m=128 if n % 128 == 0 else 64, block_k=64, num_warps=8)
        else:
            cfg = dict(block_rows=bt, block_m=64, block_k=64, num_warps=4)
        cfg.update(override)
        halves = 2 if gemm1 else 1
        bm, bk = cfg["block_m"], cfg["block_k"]
        stage = halves * bm * (bk * 2 + bk // 2) + cfg["block_rows"] * bk * 2
        # as many stages as fit in the 227 KiB of shared memory (less barriers), up to 6
        cfg.setdefault("num_stages", max(2, min(6, (227 * 1024 - 2048) // stage)))
        return GemmConfig(kernel="gluon", **cfg)
    bt = tile_rows_for(rows, num_experts)
    # 4 warps and 64 weight rows keep 2-4 CTAs per SM, whose conversion and MMA phases overlap
    # (Triton 3.6 waits for each wgmma); measured on the H200 (docs/perf-notes.md)
    cfg = dict(block_rows=bt, block_m=64, block_k=128 if bt <= 32 else 64, num_warps=4, num_stages=3)
    if fp8:  # one FP8 MMA per K32 block (its scale multiplies the partial sum); 8 warps hold both accumulators
        cfg.update(block_k=32, num_stages=4, num_warps=8 if bt == 128 else 4)
    cfg.update(override)
    if fp8 and cfg["block_k"] != 32:
        raise ValueError("W4A8 tiles are one K32 scale block deep (block_k=32)")
    while n % cfg["block_m"]:
        cfg["block_m"] //= 2
    while k % cfg["block_k"]:
        cfg["block_k"] //= 2
    return GemmConfig(**cfg)


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
        from ..op import register_workspace

        self.handle = register_workspace(self)  # what stands for it in the custom op's arguments
        device = torch.device(device) if device is not None else experts.device
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
        R = max_tokens * top_k
        caps = [route_pack_capacity(R, E, bt) for bt in TILE_ROWS + ((WIDE_ROWS,) if R > WIDE_FROM * E else ())]
        max_rows = max(c[0] for c in caps)
        max_tiles = max(c[1] for c in caps)
        i32 = dict(dtype=torch.int32, device=device)
        self.max_tokens, self.top_k, self.fp8 = max_tokens, top_k, fp8
        self.shape = (E, H, I)
        self.route_subs = ROUTE_SUBS
        self.counts = torch.zeros(ROUTE_SUBS * E, **i32)  # the pack's rank counters, [route_subs, E]
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
        shape = (experts.num_experts, experts.hidden_size, experts.intermediate_size)
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

    def for_call(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> "Workspace":
        """This workspace, checked for the call (the op resolves a handle this way, a plan's too)."""
        self.check(experts, tokens, top_k, fp8)
        return self

    def fits(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> bool:
        return not self.shortfalls(experts, tokens, top_k, fp8)

    def check(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> None:
        """Raise ``ValueError`` naming what this workspace lacks for the call, if anything."""
        wrong = self.shortfalls(experts, tokens, top_k, fp8)
        if wrong:
            raise ValueError("workspace does not fit this call: " + "; ".join(wrong))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.__dict__.values() if isinstance(t, torch.Tensor))

    def route_pack(self, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], block_rows: int, num_experts: int) -> RoutePack:
        """Launch the route-pack kernels into this workspace; returns views of the pack."""
        R = topk_ids.numel()
        max_rows, max_tiles = route_pack_capacity(R, num_experts, block_rows)
        if max_rows > self.sorted_routes.numel() or max_tiles > self.tile_expert.numel():
            raise ValueError(f"workspace: no room for a pack of {block_rows}-row tiles of {R} routes")
        sorted_routes = self.sorted_routes[:max_rows]
        n_global = num_experts if expert_map is None else expert_map.numel()
        emap = expert_map if expert_map is not None else self.counts
        e_block = triton.next_power_of_2(num_experts)
        if R <= ROUTE_BLOCK:  # decode, small batches: one launch
            # a block of the routes' size, not ROUTE_BLOCK: H200 graph replays, R=8: 5.0 -> 3.2 us, R=128: 5.0 ->
            # 3.4 us (docs/perf-notes.md step 15)
            block = max(16, triton.next_power_of_2(R))
            route_pack_small_kernel[(1,)](topk_ids, emap, self.expert_counts, self.offsets, self.tile_expert,
                                          self.tile_start, self.num_tiles, self.route_slot, sorted_routes, R, num_experts, n_global,
                                          max_rows, max_tiles, HAS_MAP=expert_map is not None, BT=block_rows,
                                          BLOCK=block, E_BLOCK=e_block, T_BLOCK=ROUTE_BLOCK, num_warps=4,
                                          **_pdl(topk_ids.device))
        else:
            self.counts.zero_()
            sorted_routes.fill_(-1)
            grid = (triton.cdiv(R, ROUTE_BLOCK),)
            route_count_kernel[grid](topk_ids, emap, self.counts, self.route_expert, self.route_rank, R, num_experts,
                                     n_global, HAS_MAP=expert_map is not None, BLOCK=ROUTE_BLOCK, SUBS=self.route_subs)
            route_offsets_kernel[(1,)](self.counts, self.expert_counts, self.offsets, self.sub_offsets,
                                       self.tile_expert, self.tile_start, self.num_tiles, num_experts, max_tiles,
                                       BT=block_rows, E_BLOCK=e_block, T_BLOCK=ROUTE_BLOCK, SUBS=self.route_subs)
            route_scatter_kernel[grid](self.route_expert, self.route_rank, self.sub_offsets, self.route_slot,
                                       sorted_routes, R, num_experts, BLOCK=ROUTE_BLOCK, SUBS=self.route_subs)
        return RoutePack(block_rows=block_rows, sorted_routes=sorted_routes, route_slot=self.route_slot[:R],
                         expert_counts=self.expert_counts, segment_offsets=self.offsets,
                         tile_expert=self.tile_expert[:max_tiles], tile_start=self.tile_start[:max_tiles],
                         num_tiles=self.num_tiles)


class WorkspacePlan:
    """Workspaces planned per device and expert shape, made (outside CUDA-graph capture) when a call first needs
    one and grown to the largest call seen; at least ``max_tokens`` x ``top_k``, with W4A8 scratch ahead of need for
    ``precision="w4a8"`` or ``"auto"`` with the threshold set. The op resolves a plan's handle when it runs, so a
    compiled graph plans at run time too. The module's plan and the library's default (no ``workspace=``)."""

    def __init__(self, max_tokens: int = 0, top_k: int = 0, precision: Optional[str] = None):
        from ..op import register_workspace

        self.max_tokens, self.top_k, self.precision = max_tokens or 0, top_k or 0, precision
        self.workspaces: dict = {}
        self.handle = register_workspace(self)

    def for_call(self, experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> Workspace:
        key = (experts.device, experts.num_experts, experts.hidden_size, experts.intermediate_size)
        ws = self.workspaces.get(key)
        if ws is not None and ws.fits(experts, tokens, top_k, fp8):
            return ws
        if experts.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError("workspace: no workspace large enough for this call during CUDA-graph capture; pass "
                             "workspace=mxmoe.Workspace(experts, max_tokens, top_k) or make the same call eagerly first")
        ahead = self.precision == "w4a8" or (self.precision == "auto" and fp8_min_rows() > 0)
        ws = Workspace(experts, max(tokens, self.max_tokens, ws.max_tokens if ws else 0),
                       max(top_k, self.top_k, ws.top_k if ws else 0), fp8=fp8 or ahead or bool(ws and ws.fp8))
        self.workspaces[key] = ws
        return ws


_DEFAULT_PLAN = WorkspacePlan()


def workspace_for(experts: PreparedExperts, tokens: int, top_k: int, fp8: bool) -> Workspace:
    """The library's cached workspace for a call without ``workspace=`` (:class:`WorkspacePlan`)."""
    return _DEFAULT_PLAN.for_call(experts, tokens, top_k, fp8)


def early_weights(gemm1: bool, cfg: GemmConfig) -> bool:
    """Whether a small-tile GEMM launched with PDL copies its first weight stages before its wait (GEMM2)."""
    return PDL and EARLY_WEIGHTS and not gemm1 and cfg.k_split == 1


def small_kernel_constexprs(cfg: GemmConfig, gemm1: bool, pdl: bool) -> dict:
    """The small-tile kernel's constexprs for ``cfg`` (its launch's, and ``sm90.compile_gemm``'s as launched with
    programmatic dependent launch). ``SPLIT_REGS``: the second warpgroup's registers per thread (K split, wide
    tiles), the launch's ``maxnreg`` as the first's (128 where none is set, the kernel's default)."""
    return dict(SCALE_WORDS=cfg.scale_words, KSPLIT=cfg.k_split, PAIR=cfg.pair, SPLIT_REGS=cfg.maxnreg or 128,
                K_PARTS=cfg.k_parts, WIDE=cfg.wide, SUB_TILES=cfg.sub_tiles, SPLIT_LOOP=cfg.split_loop,
                EARLY_WEIGHTS=pdl and early_weights(gemm1, cfg), PROMOTE=cfg.promote, PROMOTE_SMEM=cfg.promote_smem)


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(device: torch.device, kernel_arg: bool = True) -> dict:
    """Launch options for programmatic dependent launch (Hopper): the kernel may start while the previous one
    in the stream finishes, and waits for it with ``griddepcontrol.wait`` before touching memory."""
    if not PDL or interpreting() or not _has_pdl(device):
        return {}
    return dict(launch_pdl=True, **({"PDL": True} if kernel_arg else {}))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def direct_routes(tokens: int, num_routes: int, num_experts: int, fp8: bool, cfg1: GemmConfig, cfg2: GemmConfig) -> bool:
    """Whether a call runs without a route pack: up to ``DIRECT_MAX_TOKENS`` tokens (one token's routes go to
    distinct experts, so one 16-row tile per route is the pack's own tiling; with a few tokens an expert two
    of them share takes two tiles), W4A16 on the small-tile Gluon kernels, and the workspace's intermediate
    holds a tile per route. Saves the pack's launch (H200 decode: docs/perf-notes.md step 17)."""
    return (DIRECT_DECODE and tokens <= DIRECT_MAX_TOKENS and not fp8 and cfg1.kernel == cfg2.kernel == "gluon_small"
            and cfg1.block_rows == TILE_ROWS[0]
            and route_pack_capacity(num_routes, num_experts, TILE_ROWS[0])[0] >= num_routes * TILE_ROWS[0])


@dataclass(frozen=True)
class DirectRoutes:
    """The GEMMs' routing without a pack: route t is tile t (``direct_routes``); with ``sum_out``, GEMM2 also
    writes the top-k sum there (arrivals counted in ``counters``, one per (token, column block), zero between
    calls)."""
    topk_ids: torch.Tensor
    expert_map: Optional[torch.Tensor]
    num_global: int
    num_experts: int
    sum_out: Optional[torch.Tensor] = None
    counters: Optional[torch.Tensor] = None
    part_sums: Optional[torch.Tensor] = None  # GEMM1's K halves (GemmConfig.k_parts) and their arrivals
    part_counters: Optional[torch.Tensor] = None


def _gemm(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha,
          gemm1, swigluoai, fp8, cfg: GemmConfig, direct: Optional[DirectRoutes] = None, fold=None, all_fold=True):
    """One GEMM launch; W4A8 on the Gluon kernels: the fast (folded) kernel on the experts whose ``fold`` flag is 1 and,
    unless ``all_fold``, the exact unfolded kernel on the others (prepared per expert: ``prepare.fold_fits``)."""
    if fp8 and cfg.kernel != "triton":
        _launch_gemm(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha,
                     gemm1, swigluoai, fp8, cfg, direct, fold, True)
        if not all_fold:
            _launch_gemm(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit,
                         alpha, gemm1, swigluoai, fp8, unfolded_config(cfg, gemm1, k), direct, fold, False)
    else:
        _launch_gemm(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha,
                     gemm1, swigluoai, fp8, cfg, direct, fold, False)


def _launch_gemm(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha,
                 gemm1, swigluoai, fp8, cfg: GemmConfig, direct, fold, fold_path: bool):
    tiles = direct.topk_ids.numel() if direct else pack.tile_expert.numel() * cfg.sub_tiles
    persistent = cfg.kernel == "gluon" or cfg.wide  # at most one program per SM, walking the tiles
    width = cfg.block_m * (2 if cfg.pair or (cfg.wide and not gemm1) else 1)  # output columns per program (tile)
    grid = (n // width, tiles, cfg.k_parts)
    if persistent:
        grid = (min(grid[0] * grid[1], _sm_count(out.device)),)
    if cfg.kernel == "triton":
        kernel = moe_gemm_kernel
        extra = dict(PURE=interpreting())
    else:  # the Gluon kernels (no interpreter form)
        kernel = _gluon_kernel(cfg.kernel)
        extra = dict(OUT_I64=out.shape[0] * out.stride(0) >= 2**31)
        if cfg.kernel == "gluon":
            extra.update(LOADER_REGS=cfg.loader_regs, CONVERTER_REGS=cfg.converter_regs)
        if cfg.kernel == "gluon_small":
            pdl = _pdl(out.device, kernel_arg=False)
            extra.update(**pdl, **small_kernel_constexprs(cfg, gemm1, bool(pdl)))
            # the direct path's arguments, placeholders without it (the kernel takes them always)
            extra.update(ids_ptr=w_ref, expert_map_ptr=w_ref, num_global=0, num_experts=0, sum_out_ptr=out,
                         stride_sum_out=0, counters_ptr=w_ref, parts_ptr=direct.part_sums if direct else out,
                         fold_ptr=fold if fp8 else w_ref, FOLD=fold_path)
            if direct:
                extra.update(DIRECT=True, ids_ptr=direct.topk_ids, num_global=direct.num_global,
                             num_experts=direct.num_experts, HAS_MAP=direct.expert_map is not None,
                             expert_map_ptr=direct.expert_map if direct.expert_map is not None else direct.topk_ids)
                if direct.sum_out is not None and not gemm1:
                    extra.update(SUM_ROUTES=True, sum_out_ptr=direct.sum_out, stride_sum_out=direct.sum_out.stride(0),
                                 counters_ptr=direct.counters, TOP_K=top_k)
                if cfg.k_parts == 2:
                    extra.update(counters_ptr=direct.part_counters)
        if cfg.maxnreg:
            extra["maxnreg"] = cfg.maxnreg
    assert direct is None or cfg.kernel == "gluon_small"
    compiled = kernel[grid](
        a, a_scale if a_scale is not None else w_ref, a.stride(0),
        w, w_scale, w_ref, gscale if gscale is not None else w_ref, bias if bias is not None else w_ref,
        *((w_ref, w_ref, w_ref) if direct else (pack.sorted_routes, pack.tile_expert, pack.num_tiles)),
        out, out.stride(0), topk_weights,
        n, k, top_k, limit, alpha,
        GEMM1=gemm1, SWIGLUOAI=swigluoai, FP8=fp8, HAS_BIAS=bias is not None, HAS_GSCALE=gscale is not None,
        BM=cfg.block_m, BT=cfg.block_rows, BK=cfg.block_k, NUM_STAGES=cfg.num_stages, W_UNIT=row_block_unit(k),
        num_warps=cfg.num_warps, **extra,
    )
    if cfg.kernel == "gluon_small" and not (cfg.wide or direct or cfg.k_split > 1):
        _no_shared_preference(compiled)


_L1_SET: set = set()  # CUfunction handles _no_shared_preference has seen


def _no_shared_preference(compiled) -> None:
    """Triton loads a kernel of more than 48 KB of shared memory with CU_FUNC_CACHE_PREFER_SHARED, the largest
    carveout (an L1 of 28 KB on the H200). The small-tile GEMMs' scale-word loads hit in L1 (7 of 8 come from a
    32-B sector read two K steps before), so theirs goes back to no preference, and the driver sizes the carveout
    for the occupancy: H200, T=2048 (49,184 B, 3 programs per SM) GEMM1 -3 to -5 %, the call -2 to -3 %
    (docs/perf-notes.md step 27). Once per loaded kernel, outside any stream; a hint only: without libcuda, nothing."""
    function = getattr(compiled, "function", None)
    if function is None or function in _L1_SET:  # (every later launch of a kernel stops here)
        return
    _L1_SET.add(function)
    cuda = _libcuda()
    if compiled.metadata.shared > 48 * 1024 and cuda is not None:
        cuda.cuFuncSetCacheConfig(ctypes.c_void_p(function), 0)  # CU_FUNC_CACHE_PREFER_NONE


@functools.cache
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _quantize_rows(x, q, scale, row_valid=None):
    K = x.shape[1]
    quantize_rows_kernel[(x.shape[0],)](x, x.stride(0), q, q.stride(0), scale, row_valid if row_valid is not None else scale,
                                        K, CHECK_ROWS=row_valid is not None,
                                        BLOCK_K=min(triton.next_power_of_2(K), 2048), PURE=interpreting(), num_warps=4)


def gemm1_rows(x, experts: PreparedExperts, topk_weights, topk_ids, activation, limit, alpha, precision,
               expert_map=None, config_override: Optional[dict] = None) -> torch.Tensor:
    """GEMM1's output per route (route pack, [W4A8: x quantization], GEMM1 + activation; no GEMM2): ``[T * top_k,
    I]``, FP32 for W4A8 (before the intermediate's E4M3 quantization), BF16 for W4A16; masked routes' rows are
    zero. For checks of the GEMM alone (``mxmoe check``'s GEMM-level case): arguments as ``run_fused_moe``'s,
    already validated."""
    T, top_k = topk_ids.shape
    if T == 0:
        return torch.zeros(0, experts.intermediate_size, dtype=torch.float32 if precision == "w4a8" else torch.bfloat16,
                           device=x.device)
    inter, pack = _run(x, experts, topk_weights, topk_ids, activation, limit, alpha, expert_map, precision, None, None,
                       config_override, gemm2=False)
    rows = torch.zeros(T * top_k, experts.intermediate_size, dtype=inter.dtype, device=x.device)
    if pack is None:  # the direct path: route r in slot r * block_rows
        slots = torch.arange(T * top_k, device=x.device) * (inter.shape[0] // max(T * top_k, 1))
        ok = torch.ones_like(slots, dtype=torch.bool)
    else:
        slots = pack.route_slot.long()
        ok = slots >= 0
    rows[ok] = inter[slots[ok]]
    return rows


def run_fused_moe(x, experts: PreparedExperts, topk_weights, topk_ids, activation, limit, alpha, expert_map, precision,
                  out, workspace: Optional[Workspace], config_override: Optional[dict] = None):
    """The Triton path of :func:`mxmoe.fused_moe` (arguments already validated)."""
    return _run(x, experts, topk_weights, topk_ids, activation, limit, alpha, expert_map, precision, out, workspace,
                config_override)


def _run(x, experts: PreparedExperts, topk_weights, topk_ids, activation, limit, alpha, expert_map, precision,
         out, workspace: Optional[Workspace], config_override: Optional[dict] = None, gemm2: bool = True):
    T, top_k = topk_ids.shape
    if out is None:
        out = torch.empty_like(x)
    if T == 0:
        return out
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    fp8 = precision == "w4a8"
    if workspace is None:
        workspace = workspace_for(experts, T, top_k, fp8)
    else:
        workspace.check(experts, T, top_k, fp8)
    R = T * top_k
    # the Gluon kernel: whole 64-K stages; cp.async copies whole 16-byte pieces of the rows
    gluon_ok = not (H % 64 or I % 64 or x.data_ptr() % 16 or x.stride(0) % 8)
    sms = _sm_count(x.device) if x.device.type == "cuda" else 0
    cfg1 = gemm_config(R, E, I, H, fp8, config_override, kernel_choice(x.device, R, E, fp8, gluon_ok, gemm1=True),
                       gemm1=True, sm_count=sms)
    cfg2 = gemm_config(R, E, H, I, fp8, config_override, kernel_choice(x.device, R, E, fp8, gluon_ok, gemm1=False, n=H),
                       gemm1=False)
    assert cfg1.block_rows * cfg1.sub_tiles == cfg2.block_rows * cfg2.sub_tiles, "both GEMMs read one route pack"
    direct = None
    if direct_routes(T, R, E, fp8, cfg1, cfg2):
        n_global = E if expert_map is None else expert_map.numel()
        sums = (out, workspace.sum_counters) if DIRECT_SUM else (None, None)
        direct = DirectRoutes(topk_ids, expert_map, n_global, E, *sums, workspace.part_sums, workspace.part_counters)
        pack, max_rows = None, R * cfg1.block_rows
    else:
        cfg1 = replace(cfg1, k_parts=1)  # the K halves join per route: the direct path only
        pack = workspace.route_pack(topk_ids, expert_map, cfg1.block_rows * cfg1.sub_tiles, E)
        max_rows = pack.sorted_routes.numel()
    swigluoai = activation == "swigluoai"
    common = dict(topk_weights=topk_weights, top_k=top_k, limit=limit, alpha=alpha, swigluoai=swigluoai, fp8=fp8,
                  direct=direct)
    if fp8:
        x_q, x_scale = workspace.x_q[:T], workspace.x_scale[:T]
        _quantize_rows(x, x_q, x_scale)
        inter = workspace.intermediate[: max_rows * I * 4].view(torch.float32).view(max_rows, I)
        _gemm(x_q, x_scale, experts.w13, experts.w13_scale, experts.w13_ref, experts.w13_global_scale,
              experts.b13, pack, inter, n=I, k=H, gemm1=True, cfg=cfg1, fold=experts.w13_fold,
              all_fold=experts.all_fold, **common)
        if not gemm2:
            return inter, pack
        a2, a2_scale = workspace.inter_q[:max_rows], workspace.inter_scale[:max_rows]
        _quantize_rows(inter, a2, a2_scale, row_valid=pack.sorted_routes)
    else:
        inter = workspace.intermediate[: max_rows * I * 2].view(torch.bfloat16).view(max_rows, I)
        _gemm(x, None, experts.w13, experts.w13_scale, experts.w13_ref, experts.w13_global_scale,
              experts.b13, pack, inter, n=I, k=H, gemm1=True, cfg=cfg1, **common)
        a2, a2_scale = inter, None
    if not gemm2:
        return inter, pack
    routed = workspace.routed_out[:R]
    _gemm(a2, a2_scale, experts.w2, experts.w2_scale, experts.w2_ref, experts.w2_global_scale,
          experts.b2, pack, routed, n=H, k=I, gemm1=False, cfg=cfg2, fold=experts.w2_fold, all_fold=experts.all_fold,
          **common)
    block_h = min(triton.next_power_of_2(H), 1024)
    if direct and direct.sum_out is not None:
        return out  # GEMM2 summed the routes
    # without a pack GEMM2 wrote every route's row (zeros for masked ones): no slot list to check
    topk_sum_kernel[(T, triton.cdiv(H, block_h))](routed, pack.route_slot if pack else routed, out, H, top_k,
                                                  BLOCK_H=block_h, PURE=interpreting(), CHECK_SLOTS=pack is not None,
                                                  num_warps=4, **_pdl(x.device))
    return out
