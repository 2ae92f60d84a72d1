"""The launch sequence of the Triton path (configs from ``config``, scratch from ``mxmoe.workspace``), and the
cached launch plans that replay it (``launch_plan``).

Run path (no allocation once the workspace exists, no host sync, capturable):
route pack (one kernel up to 1024 routes, else two) -> [W4A8: quantize x rows] -> GEMM1 + activation -> [W4A8:
quantize intermediate rows] -> GEMM2 + routing weight -> top-k sum. Up to ``DIRECT_MAX_TOKENS`` W4A16 tokens
(``direct_routes``): GEMM1 -> GEMM2 + routing weight + top-k sum, no pack.

``describe`` lists a call's launches; ``run_layer`` (the custom op's body) looks the call up among the launch plans
(``plan_key``) and launches the compiled kernels directly, or describes the call, runs it through the JIT and keeps
the plan.
"""
from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton

from ..prepare import PreparedExperts, expert_tensors, experts_from_tensors, row_block_unit
from ..routing import route_pack_capacity, route_pack_launches
from ..selection import LayerPlan
from ..workspace import default_plan, held_workspace, workspace_for
from . import cdiv, env_get, interpreting, next_pow2, tuned  # (interpreter: plain-Triton forms, no inline asm)
from .config import (DEFAULT_OVERRIDES, DIRECT_MAX_TOKENS, TILE_ROWS, GemmConfig, bundled, current_overrides,
                     gemm_config, gluon_kernel, gluon_validated, kernel_choice, pack_shape, pack_tile_heights,
                     pdl_launch, small_kernel_constexprs, tiles_beside, unfolded_config, w4a8_tall_tiles,
                     ws8_m_tiles)
from .elementwise import quantize_rows_kernel, topk_sum_kernel
from .gemm import moe_gemm_kernel
from .launch_plan import KernelLaunch, LaunchPlan, run_launches


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def direct_routes(tokens: int, num_routes: int, num_experts: int, fp8: bool, cfg1: GemmConfig, cfg2: GemmConfig) -> bool:
    """Whether a call runs without a route pack: up to ``DIRECT_MAX_TOKENS`` tokens (one token's routes go to
    distinct experts, so one 16-row tile per route is the pack's own tiling; with a few tokens an expert two
    of them share takes two tiles), W4A16 on the small-tile Gluon kernels, and the workspace's intermediate
    holds a tile per route. Saves the pack's launch (H200 decode: docs/perf-notes.md step 17)."""
    return (current_overrides().direct_decode and tokens <= DIRECT_MAX_TOKENS and not fp8 and cfg1.kernel == cfg2.kernel == "gluon_small"
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


def _gemm_launches(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha,
                   gemm1, swigluoai, fp8, cfg: GemmConfig, direct: Optional[DirectRoutes] = None, fold=None,
                   all_fold=True) -> list:
    """One GEMM's launches; W4A8 on the Gluon kernels: the fast (folded) kernel on the experts whose ``fold`` flag is 1
    and, unless ``all_fold``, the exact unfolded kernel on the others (prepared per expert: ``prepare.fold_fits``)."""
    common = (a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha, gemm1,
              swigluoai, fp8)
    if fp8 and cfg.kernel != "triton":
        launches = [_gemm_launch(*common, cfg, direct, fold, True)]
        if not all_fold:
            launches.append(_gemm_launch(*common, unfolded_config(cfg, gemm1, k), direct, fold, False))
        return launches
    return [_gemm_launch(*common, cfg, direct, fold, False)]


def _gemm_launch(a, a_scale, w, w_scale, w_ref, gscale, bias, pack, out, topk_weights, n, k, top_k, limit, alpha,
                 gemm1, swigluoai, fp8, cfg: GemmConfig, direct, fold, fold_path: bool) -> KernelLaunch:
    assert direct is None or (cfg.kernel == "gluon_small" and not cfg.wide)
    tiles = direct.topk_ids.numel() if direct else pack.tile_expert.numel() * cfg.sub_tiles
    width = cfg.block_m * (2 if cfg.pair or (cfg.wide and not gemm1) else 1)  # output columns per program (tile)
    if cfg.kernel == "gluon_ws8":  # GEMM1: the gate and up rows of 128 columns per program
        width = cfg.block_m // 2 if gemm1 else cfg.block_m
    grid = (cdiv(n, width), tiles, cfg.k_parts)
    if cfg.kernel == "gluon_ws8" or cfg.wide:  # persistent: at most one program per SM, walking the tiles
        grid = (min(grid[0] * grid[1], _sm_count(out.device)),)
    meta = dict(GEMM1=gemm1, SWIGLUOAI=swigluoai, HAS_BIAS=bias is not None, HAS_GSCALE=gscale is not None,
                BM=cfg.block_m, BT=cfg.block_rows, BK=cfg.block_k, NUM_STAGES=cfg.num_stages, W_UNIT=row_block_unit(k),
                num_warps=cfg.num_warps)
    meta.update(FP8=fp8)
    args = [a, a_scale if a_scale is not None else w_ref, a.stride(0),
            w, w_scale, w_ref, gscale if gscale is not None else w_ref, bias if bias is not None else w_ref,
            *((w_ref, w_ref, w_ref) if direct else (pack.sorted_routes, pack.tile_expert, pack.num_tiles)),
            out, out.stride(0), topk_weights,
            n, k, top_k, limit, alpha]
    if cfg.kernel == "triton":
        kernel = moe_gemm_kernel
        meta.update(PURE=interpreting())
    else:  # the Gluon kernels (no interpreter form), their arguments in bundles (config.ARG_BUNDLES)
        kernel = gluon_kernel(cfg.kernel, cfg.wide)
        args = bundled(args)
        meta.update(OUT_I64=out.shape[0] * out.stride(0) >= 2**31)
        if cfg.maxnreg:
            meta.update(maxnreg=cfg.maxnreg)
        if cfg.kernel == "gluon_ws8":
            del meta["BM"], meta["FP8"]
            meta.update(K_TAIL=k % cfg.block_k, PROMOTE=cfg.promote, PRODUCER_REGS=cfg.loader_regs,
                        CONSUMER_REGS=cfg.converter_regs, M_TILES=ws8_m_tiles(cfg), PINGPONG=cfg.pingpong,
                        **pdl_launch(out.device, kernel_arg=False))
            args.append(fold)
        else:
            pdl = pdl_launch(out.device, kernel_arg=False)
            meta.update(**pdl, **small_kernel_constexprs(cfg, gemm1, bool(pdl), n))
            if not cfg.wide:
                small_args, small_meta = _small_tile_args(out, w_ref, top_k, gemm1, fp8, cfg, direct, fold, fold_path)
                args += small_args
                meta.update(small_meta)
    loaded = _no_shared_preference if cfg.kernel == "gluon_small" and not (cfg.wide or direct or cfg.k_split > 1) else None
    return KernelLaunch(kernel, grid, tuple(args), meta, loaded)


def _small_tile_args(out, w_ref, top_k, gemm1, fp8, cfg: GemmConfig, direct: Optional[DirectRoutes], fold,
                     fold_path: bool) -> tuple[list, dict]:
    """The small-tile kernel's bundles of the direct path and the K parts (``config.SMALL_ARG_BUNDLES``; placeholders
    where they do not apply: the kernel takes them always), W4A8's fold flags, and their constexprs."""
    routes = (w_ref, w_ref, 0, 0)
    joins = [out, 0, w_ref, direct.part_sums if direct else out]
    meta = dict(FOLD=fold_path)
    if direct:
        emap = direct.expert_map if direct.expert_map is not None else direct.topk_ids
        routes = (direct.topk_ids, emap, direct.num_global, direct.num_experts)
        meta.update(DIRECT=True, HAS_MAP=direct.expert_map is not None)
        if direct.sum_out is not None and not gemm1:
            joins[0:3] = direct.sum_out, direct.sum_out.stride(0), direct.counters
            meta.update(SUM_ROUTES=True, TOP_K=top_k)
        if cfg.k_parts == 2:
            joins[2] = direct.part_counters
    return [routes, tuple(joins), fold if fp8 else w_ref], meta


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


def _quantize_rows(x, q, scale, row_valid=None) -> KernelLaunch:
    K = x.shape[1]
    return KernelLaunch(quantize_rows_kernel, (x.shape[0],),
                        (x, x.stride(0), q, q.stride(0), scale, row_valid if row_valid is not None else scale, K),
                        dict(CHECK_ROWS=row_valid is not None, BLOCK_K=min(next_pow2(K), 4096),
                             PURE=interpreting(), num_warps=4))


def gemm1_rows(x, experts: PreparedExperts, topk_weights, topk_ids, plan: LayerPlan, expert_map=None) -> torch.Tensor:
    """GEMM1's output per route (route pack, [W4A8: x quantization], GEMM1 + activation; no GEMM2): ``[T * top_k,
    I]``, FP32 for W4A8 (before the intermediate's E4M3 quantization), BF16 for W4A16; masked routes' rows are
    zero. For checks of the GEMM alone (``mxmoe check``'s GEMM-level case): arguments as ``run_fused_moe``'s,
    already validated; launched through the JIT (no plan)."""
    T, top_k = topk_ids.shape
    if T == 0:
        return torch.zeros(0, experts.intermediate_size, dtype=torch.float32 if plan.fp8 else torch.bfloat16,
                           device=x.device)
    workspace = workspace_for(experts, T, top_k, plan.fp8)
    launches, inter, pack = describe(x, experts, topk_weights, topk_ids, plan, expert_map, None, workspace,
                                     gemm2=False)
    run_launches(launches)
    rows = torch.zeros(T * top_k, experts.intermediate_size, dtype=inter.dtype, device=x.device)
    if pack is None:  # the direct path: route r in slot r * block_rows
        slots = torch.arange(T * top_k, device=x.device) * (inter.shape[0] // max(T * top_k, 1))
        ok = torch.ones_like(slots, dtype=torch.bool)
    else:
        slots = pack.route_slot.long()
        ok = slots >= 0
    rows[ok] = inter[slots[ok]]
    return rows


def run_fused_moe(x, experts: PreparedExperts, topk_weights, topk_ids, plan: LayerPlan, expert_map, out,
                  workspace):
    """The Triton path of :func:`mxmoe.fused_moe` for a :class:`PreparedExperts` (arguments already validated;
    ``config.overrides`` apply; ``workspace``: a Workspace, a WorkspacePlan or None): :func:`run_layer`."""
    weights, extras, all_fold = expert_tensors(experts)
    if out is None:
        out = torch.empty_like(x)
    return run_layer(x, weights, extras, all_fold, topk_weights, topk_ids, expert_map, out, plan, workspace)


def _configs(x, experts: PreparedExperts, top_k: int, routes: int, fp8: bool) -> tuple[GemmConfig, GemmConfig]:
    """Both GEMMs' configs (on one route pack) for ``routes`` routed rows of ``x``'s tokens under the current
    overrides: the heuristics', or with the tuned tables' fields (``tuned``) where the call's bucket has an entry
    measured on the same kind of configs (``tuned.Entry.fits``)."""
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    # the Gluon kernels: whole 64-K stages; cp.async copies whole 16-byte pieces of the rows
    gluon_ok = not (H % 64 or I % 64 or x.data_ptr() % 16 or x.stride(0) % 8)
    sms = _sm_count(x.device) if x.device.type == "cuda" else 0
    changes = current_overrides()
    kernels = (kernel_choice(x.device, routes, E, fp8, gluon_ok, k=H),
               kernel_choice(x.device, routes, E, fp8, gluon_ok, k=I))

    def config(gemm1: bool, fields: dict) -> GemmConfig:  # (the overrides win over the fields)
        if gemm1:
            return gemm_config(routes, E, I, H, fp8, {**fields, **changes.gemm1}, kernels[0], gemm1=True, sm_count=sms)
        return gemm_config(routes, E, H, I, fp8, {**fields, **changes.gemm2}, kernels[1], gemm1=False, sm_count=sms)

    def build(table1: dict, table2: dict) -> tuple[GemmConfig, GemmConfig]:
        if fp8 and not any(f in fields for fields in (table1, table2, changes.gemm1, changes.gemm2)
                           for f in ("block_rows", "sub_tiles")):  # (tiles set by a table or overrides: theirs)
            tall = w4a8_tall_tiles(routes, E, H, I, kernels)
            table1, table2 = ({"block_rows": 256, **t} if high else t for t, high in zip((table1, table2), tall))
        cfg1, cfg2 = config(True, table1), config(False, table2)
        # a small-tile GEMM beside the W4A8 prefill kernel on that kernel's pack
        ws8 = [cfg for cfg in (cfg1, cfg2) if cfg.kernel == "gluon_ws8"]
        if len(ws8) == 1 and pack_shape(cfg1) != pack_shape(cfg2):
            if ws8[0] is cfg1:
                cfg2 = config(False, {**table2, **tiles_beside(cfg1)})
            else:
                cfg1 = config(True, {**table1, **tiles_beside(cfg2)})
        if pack_shape(cfg1) != pack_shape(cfg2):  # (overrides that set one GEMM's tiles only)
            raise ValueError(f"both GEMMs read one route pack: GEMM1's tiles {pack_shape(cfg1)} and GEMM2's "
                             f"{pack_shape(cfg2)} (slots, extra rows) differ; set both GEMMs' block_rows")
        return cfg1, cfg2

    untuned = build({}, {})
    if changes.tuned and x.device.type == "cuda" and "gluon" in kernels[0] and "gluon" in kernels[1]:
        entry = tuned.lookup(x.device, (E, H, I, top_k), "w4a8" if fp8 else "w4a16", x.shape[0])
        heights = pack_tile_heights(routes, E)  # (a workspace's)
        if entry is not None and entry.fits(*untuned) and all(
                fields.get("block_rows", TILE_ROWS[0]) * fields.get("sub_tiles", 1) in heights
                for fields in (entry.gemm1, entry.gemm2)):
            try:
                return build(entry.gemm1, entry.gemm2)
            except ValueError:  # fields this call's shape of work does not take (a bucket's lower T): untuned
                pass
    return untuned


def describe(x, experts: PreparedExperts, topk_weights, topk_ids, plan: LayerPlan, expert_map, out, workspace,
             gemm2: bool = True) -> tuple[list, torch.Tensor, object]:
    """The launches of a call (T >= 1, ``workspace`` a Workspace that fits it), in order, with GEMM1's output
    (``[rows, I]`` in the workspace) and the route pack (None on the direct path). ``gemm2=False``: up to GEMM1."""
    T, top_k = topk_ids.shape
    fp8, R = plan.fp8, T * top_k
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    cfg1, cfg2 = _configs(x, experts, top_k, R, fp8)
    direct, launches = None, []
    if direct_routes(T, R, E, fp8, cfg1, cfg2):
        n_global = E if expert_map is None else expert_map.numel()
        sums = (out, workspace.sum_counters) if current_overrides().direct_sum and gemm2 else (None, None)
        direct = DirectRoutes(topk_ids, expert_map, n_global, E, *sums, workspace.part_sums, workspace.part_counters)
        pack, max_rows = None, R * cfg1.block_rows
    else:
        cfg1 = replace(cfg1, k_parts=1)  # the K halves join per route: the direct path only
        slots, extra = pack_shape(cfg1)
        pack, launches = route_pack_launches(workspace, topk_ids, expert_map, slots, E, extra)
        max_rows = pack.sorted_routes.numel()
    common = dict(topk_weights=topk_weights, top_k=top_k, limit=plan.limit, alpha=plan.alpha,
                  swigluoai=plan.activation == "swigluoai", fp8=fp8, direct=direct)
    if fp8:
        x_q, x_scale = workspace.x_q[:T], workspace.x_scale[:T]
        launches.append(_quantize_rows(x, x_q, x_scale))
        inter = workspace.intermediate[: max_rows * I * 4].view(torch.float32).view(max_rows, I)
        launches += _gemm_launches(x_q, x_scale, experts.w13, experts.w13_scale, experts.w13_ref,
                                   experts.w13_global_scale, experts.b13, pack, inter, n=I, k=H, gemm1=True, cfg=cfg1,
                                   fold=experts.w13_fold, all_fold=experts.all_fold, **common)
        if not gemm2:
            return launches, inter, pack
        a2, a2_scale = workspace.inter_q[:max_rows], workspace.inter_scale[:max_rows]
        launches.append(_quantize_rows(inter, a2, a2_scale, row_valid=pack.sorted_routes))
    else:
        inter = workspace.intermediate[: max_rows * I * 2].view(torch.bfloat16).view(max_rows, I)
        launches += _gemm_launches(x, None, experts.w13, experts.w13_scale, experts.w13_ref, experts.w13_global_scale,
                                   experts.b13, pack, inter, n=I, k=H, gemm1=True, cfg=cfg1, **common)
        a2, a2_scale = inter, None
    if not gemm2:
        return launches, inter, pack
    routed = workspace.routed_out[:R]
    launches += _gemm_launches(a2, a2_scale, experts.w2, experts.w2_scale, experts.w2_ref, experts.w2_global_scale,
                               experts.b2, pack, routed, n=H, k=I, gemm1=False, cfg=cfg2, fold=experts.w2_fold,
                               all_fold=experts.all_fold, **common)
    if direct and direct.sum_out is not None:
        return launches, inter, pack  # GEMM2 summed the routes
    # without a pack GEMM2 wrote every route's row (zeros for masked ones): no slot list to check
    block_h = min(next_pow2(H), 1024)
    launches.append(KernelLaunch(topk_sum_kernel, (T, cdiv(H, block_h)),
                                 (routed, pack.route_slot if pack else routed, out, H, top_k),
                                 dict(BLOCK_H=block_h, PURE=interpreting(), CHECK_SLOTS=pack is not None, num_warps=4,
                                      **pdl_launch(x.device))))
    return launches, inter, pack


# ------------------------------------------------------------------------------------------------- launch plans

MAX_PLANS = 4096  # launch plans kept (one per T and kind of call, shared by layers and workspaces); oldest out first
_PLANS: dict = {}  # plan_key -> LaunchPlan
_BUFFER_POINTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Workspace -> its buffers' addresses
PLAN_STATS = {"hits": 0, "recorded": 0}  # (read by tests and the bench)


def run_layer(x, weights: list, extras: list, all_fold: bool, topk_weights, topk_ids, expert_map, out,
              plan: LayerPlan, scratch) -> torch.Tensor:
    """The layer into ``out`` (the custom op's body on the kernels' path; arguments validated; ``weights``, ``extras``,
    ``all_fold``: ``prepare.expert_tensors``; ``scratch``: a Workspace, a WorkspacePlan or None, the library's).

    A call whose :func:`plan_key` has a plan launches its compiled kernels directly with the call's pointer table
    (call tensors, experts, workspace). Otherwise the call is described and run through the JIT, and the plan kept,
    where plans apply (:func:`_plans_apply`). A plan is recorded again only when evicted (``MAX_PLANS``)."""
    T, top_k = topk_ids.shape
    w13 = weights[0]
    shape = (w13.shape[0], x.shape[1], w13.shape[1] // 2)
    workspace = held_workspace(scratch, x.device, shape, T, top_k, plan.fp8)
    experts = None
    if workspace is None:  # grow a plan's workspace, or raise naming what this one lacks
        experts = experts_from_tensors(weights, extras, all_fold)
        workspace = (scratch or default_plan()).for_call(experts, T, top_k, plan.fp8)
    if T == 0:
        return out
    key = None
    if _plans_apply(x):
        buffers = _BUFFER_POINTERS.get(workspace)
        if buffers is None:
            buffers = _BUFFER_POINTERS[workspace] = tuple(0 if t is None else t.data_ptr() for t in workspace.tensors())
        pointers = (x.data_ptr(), topk_weights.data_ptr(), topk_ids.data_ptr(),
                    0 if expert_map is None else expert_map.data_ptr(), out.data_ptr(),
                    *[t.data_ptr() for t in weights], *[0 if t is None else t.data_ptr() for t in extras], *buffers)
        key = plan_key(pointers, (x.stride(0), out.stride(0)), weights, extras, all_fold, topk_weights, topk_ids,
                       expert_map, plan, workspace)
        found = _PLANS.get(key)
        if found is not None:
            PLAN_STATS["hits"] += 1
            found.run(pointers, torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()))
            return out
    if experts is None:
        experts = experts_from_tensors(weights, extras, all_fold)
    launches = describe(x, experts, topk_weights, topk_ids, plan, expert_map, out, workspace)[0]
    if key is None:
        run_launches(launches)
        return out
    call = [x, topk_weights, topk_ids, expert_map, out, *weights, *extras]
    recorded = LaunchPlan.record(launches, call + workspace.tensors(), views_from=len(call))
    if recorded is not None:
        PLAN_STATS["recorded"] += 1
        if len(_PLANS) >= MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = recorded
    return out


def plan_key(pointers, strides: tuple, weights, extras, all_fold, topk_weights, topk_ids, expert_map,
             plan: LayerPlan, workspace) -> tuple:
    """What a launch plan depends on besides the pointer table's values: T and top_k (every grid and count), x's and
    out's row strides (validated contiguous by ``fused_moe``; unchecked callers of ``run_fused_moe`` too), the layer
    plan (path, activation), the call tensors' dtypes, every pointer's 16-byte alignment (the JIT specializes on
    both), the experts' shapes and which optional tensors they have, expert_map's length, the workspace's kind (W4A8
    buffers, rank counters), the kernel choice (``MXMOE_KERNEL``) and the current device."""
    return (topk_ids.shape, strides, plan, all_fold, topk_weights.dtype, topk_ids.dtype,
            -1 if expert_map is None else expert_map.numel(), tuple([p % 16 for p in pointers]),
            weights[0].shape, weights[2].shape, tuple([t is None for t in extras]), workspace.fp8,
            workspace.route_subs, env_get("MXMOE_KERNEL"), torch._C._cuda_getDevice())


def _plans_apply(x) -> bool:
    """Plans apply on CUDA, on a Triton release the kernels were validated on (``launch_plan._launcher`` calls each
    compiled kernel's launcher in that release's form), with the library's own settings (``config.overrides`` unset:
    tools and tests launch through the JIT), and while no Triton launch hook listens (a profiler gets every launch's
    metadata)."""
    return current_overrides() is DEFAULT_OVERRIDES and _direct_launches(x) and not _launch_hooks()


def _direct_launches(x) -> bool:
    """Whether compiled kernels can be launched directly here: CUDA tensors, compiled (not interpreted) kernels, the
    validated Triton."""
    return x.is_cuda and _COMPILED_KERNELS and gluon_validated(triton.__version__)


_COMPILED_KERNELS = not interpreting()  # (Triton chose compiled or interpreted kernels when they were defined)


def _launch_hooks() -> bool:
    hook = getattr(triton.knobs.runtime, "launch_enter_hook", None)
    return bool(getattr(hook, "calls", hook))
