"""Hopper main loop of the MoE GEMM template in Gluon: warp-specialized, async wgmma.

Same contract and arguments as :func:`gemm.moe_gemm_kernel` (``W · Aᵀ``: weight rows are the
MMA's M, routed rows its N), for both precisions. Plain Triton 3.6 waits on every wgmma, so
conversion and MMA never overlap there; here three partitions run concurrently per program:

- loader (4 warps): ``cp.async`` of the packed E2M1 tiles (gate and up rows) and of the
  gathered activation rows into a ring of ``NUM_STAGES`` stages (no TMA gather on sm90);
- two converters (4 warps each, even and odd stages, so two stages convert at once): E2M1 -> BF16 with the K32 block scale folded (W4A16, as in
  ``gemm``) or -> E4M3 * 2**-6 (W4A8, exact), written to NVMMA-swizzled shared memory
  one K32 block per buffer; for W4A8 also each block's FP32 factor 2**(b - 121);
- MMA + epilogue (default partition): async ``warpgroup_mma`` on shared operands. W4A16
  chains every block into the FP32 accumulators and keeps one stage in flight. W4A8 runs
  each K32 block from zero and multiplies its partial sum by the block factor into the FP32
  accumulators while the next block's MMA runs (two partial sets, ping-pong): exact scales,
  and Hopper's reduced-precision FP8 accumulation never spans more than 32 products.

Barriers per stage: ``loaded`` (every loader thread's cp.async landed), ``converted``
(weights converted), ``consumed`` (the stage's MMAs finished: activation, converted and
packed buffers may be refilled).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_init

from .convert import E2M1X8_TO_BF16_ASM, E2M1X8_TO_E4M3_ASM

LOADER_WARPS = gl.constexpr(4)
CONVERTER_WARPS = gl.constexpr(4)


@gluon.jit
def _pow2(exp):
    """2.0**exp as FP32 for int32 exp in [-252, 254] (two normal factors; see ``convert.pow2``)."""
    lo = gl.minimum(gl.maximum(exp, -126), 127)
    hi = exp - lo
    return ((lo + 127) << 23).to(gl.float32, bitcast=True) * ((hi + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _column(tile, c):
    """Column ``c`` of an integer [rows, n] tile whose columns sit in one thread (selects, no shuffles)."""
    cols = gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, tile.type.layout))
    return gl.sum(gl.where(cols[None, :] == c, tile, 0), axis=1)


@gluon.jit
def _scale_group(ptrs, cols, j, K):
    """Scale bytes [rows, 16] of K32 blocks 16*j .. 16*j + 15 (0 past K)."""
    return gl.load(ptrs + j * 16, mask=(j * 16 + cols < K // 32)[None, :], other=0)


@gluon.jit
def _loader(w_ptr, a_ptr, stride_a, routes_ptr, slot0, top_k, w_row0, N, K, num_k,
            packed, act, loaded, consumed,
            GEMM1: gl.constexpr, NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
            NUM_STAGES: gl.constexpr):
    NC: gl.constexpr = BK // 32
    # packed rows: BK/2 bytes = NC chunks of 16 B (one K32 block each)
    PL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NC, NC], [gl.num_warps(), 1], [1, 0])
    # activation rows of one K32 block: 32 (FP8) or 64 (BF16) bytes
    EPV: gl.constexpr = 16 if FP8 else 8  # elements per 16-B copy
    AL: gl.constexpr = gl.BlockedLayout([1, EPV], [32 // (32 // EPV), 32 // EPV], [gl.num_warps(), 1], [1, 0])
    pm = gl.arange(0, BM, layout=gl.SliceLayout(1, PL))
    pk = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, PL))
    w_ptrs = w_ptr + (w_row0 + pm.to(gl.int64))[:, None] * (K // 2) + pk[None, :]
    # the gathered activation rows: GEMM1 the token of each route, GEMM2 the slot itself
    slots = slot0 + gl.arange(0, BT, layout=gl.SliceLayout(1, AL))
    routes = gl.load(routes_ptr + slots)
    ok = routes >= 0
    if GEMM1:
        rows = gl.where(ok, routes // top_k, 0).to(gl.int64)
    else:
        rows = slots.to(gl.int64)
    ak = gl.arange(0, 32, layout=gl.SliceLayout(0, AL))
    a_ptrs = a_ptr + rows[:, None] * stride_a + ak[None, :]
    for i in range(num_k):
        s = i % NUM_STAGES
        mbarrier.wait(consumed.index(s), ((i // NUM_STAGES) & 1) ^ 1)
        for h in gl.static_range(NH):
            async_copy.async_copy_global_to_shared(packed.index(s * NH + h), w_ptrs + h * N * (K // 2) + i * (BK // 2))
        for c in gl.static_range(NC):
            async_copy.async_copy_global_to_shared(act.index(s * NC + c), a_ptrs + (i * BK + c * 32), mask=ok[:, None])
        # every loader thread arrives once its own copies have landed (count = loader threads)
        async_copy.mbarrier_arrive(loaded.index(s), increment_count=False)


@gluon.jit
def _convert_stage(i, g: gl.constexpr, sc_g, sc_u, ref_g, ref_u, packed, wconv, factors, loaded, converted, consumed,
                   NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, NC: gl.constexpr, NUM_STAGES: gl.constexpr,
                   PL: gl.constexpr, WL: gl.constexpr):
    """Convert stage ``i``; its scale bytes are columns g*NC .. g*NC + NC-1 of the group tiles."""
    RL: gl.constexpr = gl.SliceLayout(1, WL)
    s = i % NUM_STAGES
    phase = (i // NUM_STAGES) & 1
    mbarrier.wait(loaded.index(s), phase)
    mbarrier.wait(consumed.index(s), phase ^ 1)
    for h in gl.static_range(NH):
        sc = sc_g
        ref = ref_g
        if h == 1:
            sc = sc_u
            ref = ref_u
        for c in gl.static_range(NC):
            p = packed.index(s * NH + h).slice(16 * c, 16, dim=1).load(PL)
            # a compile-time column of an in-thread tile: a register pick
            b = gl.convert_layout(_column(sc, g * NC + c), RL, assert_trivial=True).to(gl.int32)
            buf = (s * NH + h) * NC + c
            if FP8:
                lo, hi = gl.inline_asm_elementwise(E2M1X8_TO_E4M3_ASM, "=r,=r,r", [p], dtype=(gl.uint8, gl.uint8),
                                                   is_pure=True, pack=4)
                w = gl.convert_layout(gl.join(lo, hi).reshape(BM, 32), WL).to(gl.float8e4nv, bitcast=True)
                factors.index(buf).store(_pow2(b - 121))
            else:
                lo, hi = gl.inline_asm_elementwise(E2M1X8_TO_BF16_ASM, "=r,=r,=r,=r,r", [p],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
                w = gl.convert_layout(gl.join(lo, hi).reshape(BM, 32), WL)
                # BF16 2**(126 + b - ref) (0 where it underflows); times the 2**-126 placement: 2**(b - ref)
                f = (gl.maximum(253 + b - ref, 0) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
                w = w * f[:, None]
            wconv.index(buf).store(w)
    fence_async_shared()
    mbarrier.arrive(converted.index(s))


@gluon.jit
def _converter(s_ptr, ref_ptr, w_row0, N, K, num_k,
               packed, wconv, factors, loaded, converted, consumed,
               NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
               NUM_STAGES: gl.constexpr, PARITY: gl.constexpr):
    """Converts the stages ``i`` with ``i % 2 == PARITY`` (one stage's convert-store-fence-arrive chain is
    latency-bound; two partitions keep two stages in flight)."""
    NC: gl.constexpr = BK // 32
    CW: gl.constexpr = gl.num_warps()
    # one K32 block of BM rows: 16 packed bytes per row spread over the partition's threads
    BPT: gl.constexpr = BM * 16 // (32 * CW)  # packed bytes per thread (a multiple of 4: the asm's unit)
    PL: gl.constexpr = gl.BlockedLayout([1, BPT], [32 * BPT // 16, 16 // BPT], [CW, 1], [1, 0])
    WL: gl.constexpr = gl.BlockedLayout([1, 2 * BPT], [32 * BPT // 16, 16 // BPT], [CW, 1], [1, 0])
    RL: gl.constexpr = gl.SliceLayout(1, WL)
    # scale bytes in groups of 16 per row (G stages), the next group in flight while this one is used:
    # an exposed load latency per stage would throttle the pipeline; the stage loop is unrolled by G so
    # a stage's scale bytes are compile-time registers of the group tile
    GC: gl.constexpr = 16
    G: gl.constexpr = GC // NC
    SL: gl.constexpr = gl.BlockedLayout([1, GC], [32 * BPT // 16, 16 // BPT], [CW, 1], [1, 0])  # rows as WL
    sm = gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
    sc_cols = gl.arange(0, GC, layout=gl.SliceLayout(0, SL))
    s_ptrs = s_ptr + (w_row0 + sm.to(gl.int64))[:, None] * (K // 32) + sc_cols[None, :]
    up_off = N * (K // 32)
    ref_g = gl.load(ref_ptr + w_row0 + gl.arange(0, BM, layout=RL))
    ref_u = ref_g
    if NH == 2:
        ref_u = gl.load(ref_ptr + w_row0 + N + gl.arange(0, BM, layout=RL))
    nxt_g = _scale_group(s_ptrs, sc_cols, 0, K)
    nxt_u = nxt_g
    if NH == 2:
        nxt_u = _scale_group(s_ptrs + up_off, sc_cols, 0, K)
    for j in range(gl.cdiv(num_k, G)):
        cur_g = nxt_g
        cur_u = nxt_u
        nxt_g = _scale_group(s_ptrs, sc_cols, j + 1, K)
        if NH == 2:
            nxt_u = _scale_group(s_ptrs + up_off, sc_cols, j + 1, K)
        for g in gl.static_range(PARITY, G, 2):  # G is even
            i = j * G + g
            if i < num_k:
                _convert_stage(i, g, cur_g, cur_u, ref_g, ref_u, packed, wconv, factors, loaded, converted, consumed,
                               NH, FP8, BM, NC, NUM_STAGES, PL, WL)


@gluon.jit
def _issue_block(wg, wu, xb, pg, pu, NH: gl.constexpr):
    """Start one K32 block's FP8 MMAs from zero (gate, and up for GEMM1) into the partial set (pg, pu)."""
    pg = warpgroup_mma(wg, xb, pg, use_acc=False, is_async=True)
    if NH == 2:
        pu = warpgroup_mma(wu, xb, pu, use_acc=False, is_async=True)
    return pg, pu


@gluon.jit
def _retire_block(num_outstanding: gl.constexpr, pg, pu, acc_g, acc_u, fg, fu, NH: gl.constexpr):
    """Wait until at most ``num_outstanding`` MMAs run (the older partial set is done), then add it,
    times its block factors, into the FP32 accumulators."""
    if NH == 2:
        pg, pu = warpgroup_mma_wait(num_outstanding, deps=(pg, pu))
        acc_u += pu * fu[:, None]
    else:
        pg = warpgroup_mma_wait(num_outstanding, deps=(pg, ))
    acc_g += pg * fg[:, None]
    return pg, pu, acc_g, acc_u


@gluon.jit
def _mma_and_epilogue(a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                      expert, w_row0, n0, slot0, N, K, top_k, limit, alpha, num_k,
                      wconv, act, factors, loaded, converted, consumed,
                      GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr,
                      HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
                      BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr):
    NC: gl.constexpr = BK // 32
    NH: gl.constexpr = 2 if GEMM1 else 1
    NW: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                  instr_shape=[16, BT // (NW // 4), 32 if FP8 else 16])
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    zero = gl.zeros((BM, BT), gl.float32, MMA)
    acc_g = zero
    acc_u = zero
    if FP8:
        # partial sums of one K32 block, ping-pong: set 0 for even blocks, set 1 for odd ones
        pg0 = zero
        pu0 = zero
        pg1 = warpgroup_mma_init(zero)
        pu1 = warpgroup_mma_init(zero)
        fg = gl.zeros((BM,), gl.float32, ROWS)
        fu = fg
        for i in range(num_k):
            s = i % NUM_STAGES
            phase = (i // NUM_STAGES) & 1
            mbarrier.wait(loaded.index(s), phase)
            mbarrier.wait(converted.index(s), phase)
            fence_async_shared()
            for c in gl.static_range(NC):
                xb = act.index(s * NC + c).permute((1, 0))
                wg = wconv.index((s * NH) * NC + c)
                wu = wconv.index((s * NH + NH - 1) * NC + c)
                if c % 2 == 0:
                    pg0, pu0 = _issue_block(wg, wu, xb, pg0, pu0, NH)
                    pg1, pu1, acc_g, acc_u = _retire_block(NH, pg1, pu1, acc_g, acc_u, fg, fu, NH)
                else:
                    pg1, pu1 = _issue_block(wg, wu, xb, pg1, pu1, NH)
                    pg0, pu0, acc_g, acc_u = _retire_block(NH, pg0, pu0, acc_g, acc_u, fg, fu, NH)
                if c == 0:  # the previous stage's last MMA has finished: its buffers are free
                    mbarrier.arrive(consumed.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
                fg = factors.index((s * NH) * NC + c).load(ROWS)
                if NH == 2:
                    fu = factors.index((s * NH + 1) * NC + c).load(ROWS)
        pg1, pu1, acc_g, acc_u = _retire_block(0, pg1, pu1, acc_g, acc_u, fg, fu, NH)
    else:
        for i in range(num_k):
            s = i % NUM_STAGES
            phase = (i // NUM_STAGES) & 1
            mbarrier.wait(loaded.index(s), phase)
            mbarrier.wait(converted.index(s), phase)
            fence_async_shared()
            for c in gl.static_range(NC):
                xb = act.index(s * NC + c).permute((1, 0))
                acc_g = warpgroup_mma(wconv.index((s * NH) * NC + c), xb, acc_g, is_async=True)
                if NH == 2:
                    acc_u = warpgroup_mma(wconv.index((s * NH + 1) * NC + c), xb, acc_u, is_async=True)
            if NH == 2:  # keep this stage's MMAs in flight; the previous stage's are done
                acc_g, acc_u = warpgroup_mma_wait(NH * NC, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma_wait(NH * NC, deps=(acc_g, ))
            mbarrier.arrive(consumed.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
        if NH == 2:
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
        else:
            acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
        offs_r = gl.arange(0, BM, layout=ROWS)
        acc_g = acc_g * _pow2(gl.load(ref_ptr + w_row0 + offs_r) - 127)[:, None]
        if NH == 2:
            acc_u = acc_u * _pow2(gl.load(ref_ptr + w_row0 + N + offs_r) - 127)[:, None]

    # epilogue in a store-friendly layout: 8 consecutive output columns (weight rows) per thread
    OUT: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, NW], [0, 1])
    g = gl.convert_layout(acc_g, OUT)
    offs_n = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, OUT))
    slots = slot0 + gl.arange(0, BT, layout=gl.SliceLayout(0, OUT))
    routes = gl.load(routes_ptr + slots)
    row_ok = routes >= 0
    col_scale = gl.full((BT,), 1.0, gl.float32, gl.SliceLayout(0, OUT))
    if FP8:
        if GEMM1:
            col_scale = gl.load(a_scale_ptr + gl.where(row_ok, routes // top_k, 0), mask=row_ok, other=0.0)
        else:
            col_scale = gl.load(a_scale_ptr + slots, mask=row_ok, other=0.0)
    if HAS_GSCALE:
        col_scale = col_scale * gl.load(gscale_ptr + expert)
    y = g * col_scale[None, :]
    if HAS_BIAS:
        y += gl.load(bias_ptr + w_row0 + (offs_n - n0))[:, None]
    if GEMM1:
        up = gl.convert_layout(acc_u, OUT) * col_scale[None, :]
        if HAS_BIAS:
            up += gl.load(bias_ptr + w_row0 + N + (offs_n - n0))[:, None]
        gate = gl.minimum(y, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        if SWIGLUOAI:
            y = gate / (1.0 + gl.exp(-alpha * gate)) * (up + 1.0)
        else:
            y = gate / (1.0 + gl.exp(-gate)) * up
        out_rows = slots.to(gl.int64)
    else:
        y = y * gl.load(topk_weights_ptr + routes, mask=row_ok, other=0.0).to(gl.float32)[None, :]
        out_rows = gl.where(row_ok, routes, 0).to(gl.int64)
    out_ptrs = out_ptr + out_rows[None, :] * stride_out + offs_n[:, None]
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_n < N)[:, None])


@gluon.jit
def moe_gemm_ws_kernel(
    a_ptr, a_scale_ptr, stride_a,
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr,
    out_ptr, stride_out, topk_weights_ptr,
    N, K, top_k, limit, alpha,
    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
    BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
    LOADER_REGS: gl.constexpr = 64, CONVERTER_REGS: gl.constexpr = 96,
):
    """The ``moe_gemm_kernel`` contract on sm90 (see the module docstring); requires
    ``N % BM == 0``, ``K % BK == 0`` and, for W4A8, an even number of K32 blocks per stage."""
    pid_n = gl.program_id(0)
    pid_t = gl.program_id(1)
    if pid_t < gl.load(num_tiles_ptr):
        NC: gl.constexpr = BK // 32
        NH: gl.constexpr = 2 if GEMM1 else 1
        expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
        n0 = pid_n * BM
        w_row0 = expert * (NH * N) + n0
        slot0 = pid_t * BT
        num_k = K // BK

        w_dtype: gl.constexpr = gl.float8e4nv if FP8 else gl.bfloat16
        packed = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES * NH, BM, BK // 2],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        wconv = gl.allocate_shared_memory(w_dtype, [NUM_STAGES * NH * NC, BM, 32],
                                          gl.NVMMASharedLayout.get_default_for([BM, 32], w_dtype))
        act = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [NUM_STAGES * NC, BT, 32],
                                        gl.NVMMASharedLayout.get_default_for([BT, 32], a_ptr.dtype.element_ty))
        factors = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * NH * NC if FP8 else 1, BM],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
        loaded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        converted = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        consumed = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(loaded.index(s), count=32 * LOADER_WARPS)
            mbarrier.init(converted.index(s), count=1)
            mbarrier.init(consumed.index(s), count=1)

        gl.warp_specialize([
            (_mma_and_epilogue, (a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                                 topk_weights_ptr, expert, w_row0, n0, slot0, N, K, top_k, limit, alpha, num_k,
                                 wconv, act, factors, loaded, converted, consumed,
                                 GEMM1, SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, BM, BT, BK, NUM_STAGES)),
            (_loader, (w_ptr, a_ptr, stride_a, sorted_routes_ptr, slot0, top_k, w_row0, N, K, num_k,
                       packed, act, loaded, consumed, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES)),
            (_converter, (s_ptr, ref_ptr, w_row0, N, K, num_k, packed, wconv, factors, loaded, converted, consumed,
                          NH, FP8, BM, BK, NUM_STAGES, 0)),
            (_converter, (s_ptr, ref_ptr, w_row0, N, K, num_k, packed, wconv, factors, loaded, converted, consumed,
                          NH, FP8, BM, BK, NUM_STAGES, 1)),
        ], [LOADER_WARPS, CONVERTER_WARPS, CONVERTER_WARPS], [LOADER_REGS, CONVERTER_REGS, CONVERTER_REGS])
