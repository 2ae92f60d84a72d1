"""Hopper main loop of the MoE GEMM template in Gluon: warp-specialized, async wgmma.

Same contract and arguments as :func:`gemm.moe_gemm_kernel` (``W · Aᵀ``: weight rows are the
MMA's M, routed rows its N), for both precisions. Plain Triton 3.6 waits on every wgmma, so
conversion and MMA never overlap there; here the partitions run concurrently per program:

- loader (4 warps): 16-B ``cp.async`` of the packed E2M1 tiles (gate and up rows) and of the
  gathered activation rows into a ring of ``NUM_STAGES`` stages (no TMA gather on sm90);
- converter (4 warps): E2M1 -> BF16
  with the K32 block scale folded (W4A16, as in ``gemm``) or -> E4M3 * 2**-6 (W4A8, exact), in
  K order by inline asm, stored as 32-bit words into the stage's NVMMA-swizzled tile; for W4A8
  also each block's FP32 factor 2**(b - 121);
- MMA + epilogue (default partition, one or two warpgroups): async ``warpgroup_mma`` on shared
  operands. W4A16 chains the stages into the FP32 accumulators with one stage in flight. W4A8
  runs each K32 block from zero and multiplies its partial sum by the block factor into the FP32
  accumulators: exact scales, and Hopper's reduced-precision FP8 accumulation never spans more
  than 32 products. ptxas serializes a warpgroup's wgmma once other instructions read an
  accumulator inside its pipeline, so each block waits for its MMA; with two warpgroups one
  group's MMA runs while the other rescales.

Barriers per stage: ``loaded`` (every loader thread's cp.async landed), ``converted``
(weights converted), ``consumed`` (the stage's MMAs finished: activation, converted and
packed buffers may be refilled).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .convert import E2M1X8_TO_BF16_KORDER_ASM, E2M1X8_TO_E4M3_KORDER_ASM

LOADER_WARPS = gl.constexpr(4)
CONVERTER_WARPS = gl.constexpr(4)


@gluon.jit
def _pow2(exp):
    """2.0**exp as FP32 for int32 exp in [-252, 254] (two normal factors; see ``convert.pow2``)."""
    lo = gl.minimum(gl.maximum(exp, -126), 127)
    hi = exp - lo
    return ((lo + 127) << 23).to(gl.float32, bitcast=True) * ((hi + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _loader(w_ptr, a_ptr, stride_a, routes_ptr, slot0, top_k, w_row0, N, K, num_k,
            packed, act, loaded, consumed,
            GEMM1: gl.constexpr, NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
            NUM_STAGES: gl.constexpr):
    NC: gl.constexpr = BK // 32
    # packed rows: BK/2 bytes = NC chunks of 16 B; activation rows: BK elements in 16-B chunks
    PL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NC, NC], [gl.num_warps(), 1], [1, 0])
    EPV: gl.constexpr = 16 if FP8 else 8  # elements per 16-B copy
    CPR: gl.constexpr = BK // EPV
    AL: gl.constexpr = gl.BlockedLayout([1, EPV], [32 // CPR, CPR], [gl.num_warps(), 1], [1, 0])
    row_bytes = (K // 32) * 16  # = K/2, written so that the 16-B alignment of every row is visible
    pm = gl.arange(0, BM, layout=gl.SliceLayout(1, PL))
    pk = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, PL))
    w_ptrs = w_ptr + (w_row0 + pm.to(gl.int64))[:, None] * row_bytes + pk[None, :]
    # the gathered activation rows: GEMM1 the token of each route, GEMM2 the slot itself
    slots = slot0 + gl.arange(0, BT, layout=gl.SliceLayout(1, AL))
    routes = gl.load(routes_ptr + slots)
    ok = routes >= 0
    if GEMM1:
        rows = gl.where(ok, routes // top_k, 0).to(gl.int64)
    else:
        rows = slots.to(gl.int64)
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, AL))
    a_ptrs = a_ptr + rows[:, None] * stride_a + ak[None, :]
    for i in range(num_k):
        s = i % NUM_STAGES
        mbarrier.wait(consumed.index(s), ((i // NUM_STAGES) & 1) ^ 1)
        for h in gl.static_range(NH):
            async_copy.async_copy_global_to_shared(packed.index(s * NH + h), w_ptrs + h * N * row_bytes + i * (BK // 2))
        async_copy.async_copy_global_to_shared(act.index(s), a_ptrs + i * BK, mask=ok[:, None])
        # every loader thread arrives once its own copies have landed (count = loader threads)
        async_copy.mbarrier_arrive(loaded.index(s), increment_count=False)


@gluon.jit
def _load_packed(packed, i, NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                 PL: gl.constexpr):
    """Stage ``i``'s packed words [BM, BK/8] of both halves (once the loader's copies landed)."""
    s = i % NUM_STAGES
    words: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    p_g = packed.index(s * NH)._reinterpret(gl.int32, [BM, BK // 8], words).load(PL)
    p_u = p_g
    if NH == 2:
        p_u = packed.index(s * NH + 1)._reinterpret(gl.int32, [BM, BK // 8], words).load(PL)
    return p_g, p_u


@gluon.jit
def _scale_group(s_ptrs, gg, j, num_k, G: gl.constexpr, NC: gl.constexpr):
    """Scale bytes of stages j*G .. j*G + G-1 (0 past the last stage): [BM, G, NC] int32."""
    return gl.load(s_ptrs + j * G * NC, mask=(j * G + gg < num_k)[None, :, None], other=0).to(gl.int32)


@gluon.jit
def _converter(s_ptr, ref_ptr, w_row0, N, K, num_k,
               packed, wconv, factors, loaded, converted, consumed,
               NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
               NUM_STAGES: gl.constexpr, GROUP: gl.constexpr = 2):
    """Converts every stage's weights.

    Each thread converts whole K32 blocks: 4 words of packed codes (one 16-B shared load) -> 32 values in
    K order (64 or 32 contiguous bytes of a row of the NVMMA-swizzled stage tile, stored as 32-bit words),
    with one block scale. The next stage's packed words are loaded before this stage is converted, and
    the scale bytes come in groups of G stages: the proxy fence before each ``converted`` arrive waits
    for every outstanding global load, so a per-stage scale load would expose its latency every stage."""
    NC: gl.constexpr = BK // 32
    CW: gl.constexpr = gl.num_warps()
    G: gl.constexpr = GROUP  # stages per scale group
    WPB: gl.constexpr = 4 if FP8 else 8  # output words per 8 codes
    PL: gl.constexpr = gl.BlockedLayout([1, 4], [32 // NC, NC], [CW, 1], [1, 0])  # packed words [BM, BK/8]
    WL: gl.constexpr = gl.BlockedLayout([1, 2 * WPB], [32 // NC, NC], [CW, 1], [1, 0])  # converted words
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // NC, NC, 1], [CW, 1, 1], [2, 1, 0])  # [BM, NC, 4]
    SL: gl.constexpr = gl.SliceLayout(2, L3)  # one value per (row, K32 block): [BM, NC]
    GL: gl.constexpr = gl.BlockedLayout([1, G, 1], [32 // NC, 1, NC], [CW, 1, 1], [2, 1, 0])  # [BM, G, NC]
    conv_words: gl.constexpr = gl.NVMMASharedLayout(wconv.type.layout.swizzle_byte_width, 32, rank=2)
    gm = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, GL)))
    gg = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, GL)))
    gc = gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(1, GL)))
    s_ptrs = (s_ptr + (w_row0 + gm.to(gl.int64))[:, None, None] * (K // 32) + (gg * NC)[None, :, None]
              + gc[None, None, :])
    up_off = N * (K // 32)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
    ref_g = gl.load(ref_ptr + w_row0 + rows)[:, None]
    ref_u = ref_g
    if NH == 2:
        ref_u = gl.load(ref_ptr + w_row0 + N + rows)[:, None]
    nxt_g = _scale_group(s_ptrs, gg, 0, num_k, G, NC)
    nxt_u = nxt_g
    if NH == 2:
        nxt_u = _scale_group(s_ptrs + up_off, gg, 0, num_k, G, NC)
    # W4A16 loads the next stage's packed words while it converts this one (W4A8's stages are twice as
    # deep: the second set of words would not fit in the converter's registers)
    PREFETCH: gl.constexpr = not FP8
    p_g = gl.zeros([BM, BK // 8], gl.int32, PL)
    p_u = p_g
    if PREFETCH:
        mbarrier.wait(loaded.index(0), 0)
        p_g, p_u = _load_packed(packed, 0, NH, BM, BK, NUM_STAGES, PL)
    for j in range(gl.cdiv(num_k, G)):
        cur_g = nxt_g
        cur_u = nxt_u
        for g in gl.static_range(G):
            i = j * G + g
            if i < num_k:
                if g == 0:  # the next group, in flight behind this stage's fence
                    nxt_g = _scale_group(s_ptrs, gg, j + 1, num_k, G, NC)
                    if NH == 2:
                        nxt_u = _scale_group(s_ptrs + up_off, gg, j + 1, num_k, G, NC)
                s = i % NUM_STAGES
                mbarrier.wait(consumed.index(s), ((i // NUM_STAGES) & 1) ^ 1)
                q_g = p_g
                q_u = p_u
                if PREFETCH and i + 1 < num_k:  # the next stage's packed words, loaded while this one converts
                    mbarrier.wait(loaded.index((i + 1) % NUM_STAGES), ((i + 1) // NUM_STAGES) & 1)
                    q_g, q_u = _load_packed(packed, i + 1, NH, BM, BK, NUM_STAGES, PL)
                if not PREFETCH:
                    mbarrier.wait(loaded.index(s), (i // NUM_STAGES) & 1)
                    p_g, p_u = _load_packed(packed, i, NH, BM, BK, NUM_STAGES, PL)
                for h in gl.static_range(NH):
                    p = p_g
                    sc = cur_g
                    ref = ref_g
                    if h == 1:
                        p = p_u
                        sc = cur_u
                        ref = ref_u
                    # this stage's scale bytes: a compile-time column of the in-thread group tile
                    b = gl.convert_layout(gl.sum(gl.where((gg == g)[None, :, None], sc, 0), axis=1), SL)
                    if FP8:
                        o0, o1 = gl.inline_asm_elementwise(E2M1X8_TO_E4M3_KORDER_ASM, "=r,=r,r", [p],
                                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
                        w = gl.join(o0, o1).reshape(BM, BK // 4)
                        factors.index(s * NH + h).store(gl.permute(_pow2(b - 121), (1, 0)))
                    else:
                        # BF16x2 2**(126 + b - ref) (0 where it underflows) per block, beside every word of it
                        f = gl.maximum(253 + b - ref, 0) << 7
                        f2 = gl.convert_layout((gl.expand_dims(f | (f << 16), 2) + gl.zeros([BM, NC, 4], gl.int32, L3))
                                               .reshape(BM, BK // 8), PL)
                        o0, o1, o2, o3 = gl.inline_asm_elementwise(E2M1X8_TO_BF16_KORDER_ASM, "=r,=r,=r,=r,r,r",
                                                                   [p, f2], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                                   is_pure=True, pack=1)
                        w = gl.join(gl.join(o0, o2), gl.join(o1, o3)).reshape(BM, BK // 2)
                    wconv.index(s * NH + h)._reinterpret(gl.int32, [BM, BK * WPB // 16], conv_words).store(
                        gl.convert_layout(w, WL))
                fence_async_shared()
                mbarrier.arrive(converted.index(s))
                p_g = q_g
                p_u = q_u


@gluon.jit
def _mma_and_epilogue(a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                      expert, w_row0, n0, slot0, N, K, top_k, limit, alpha, num_k,
                      wconv, act, factors, loaded, converted, consumed,
                      GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr,
                      HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
                      BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                      OUT_I64: gl.constexpr):
    NC: gl.constexpr = BK // 32
    NH: gl.constexpr = 2 if GEMM1 else 1
    NW: gl.constexpr = gl.num_warps()
    WPM: gl.constexpr = NW if BM >= 16 * NW else BM // 16  # warps along the weight rows, the rest split the tokens
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WPM, NW // WPM],
                                                  instr_shape=[16, BT // (NW // WPM), 32 if FP8 else 16])
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    zero = gl.zeros((BM, BT), gl.float32, MMA)
    acc_g = zero
    acc_u = zero
    if FP8:
        # each K32 block's FP8 MMA starts from zero and its partial sum is multiplied by the block factor
        # into the FP32 accumulators: exact scales, and Hopper's reduced-precision FP8 accumulation never
        # spans more than 32 products. ptxas serializes a warpgroup's wgmma when other instructions read
        # an accumulator inside the pipeline, so each block waits for its MMA; with two MMA warpgroups one
        # group's MMA runs while the other scales.
        for i in range(num_k):
            s = i % NUM_STAGES
            phase = (i // NUM_STAGES) & 1
            mbarrier.wait(loaded.index(s), phase)
            mbarrier.wait(converted.index(s), phase)
            fence_async_shared()
            for c in gl.static_range(NC):
                xb = act.index(s).slice(32 * c, 32, dim=1).permute((1, 0))
                pg = warpgroup_mma(wconv.index(s * NH).slice(32 * c, 32, dim=1), xb, zero, use_acc=False,
                                   is_async=True)
                if NH == 2:
                    pu = warpgroup_mma(wconv.index(s * NH + 1).slice(32 * c, 32, dim=1), xb, zero, use_acc=False,
                                       is_async=True)
                    pg, pu = warpgroup_mma_wait(0, deps=(pg, pu))
                    acc_u += pu * factors.index(s * NH + 1).reshape([NC * BM]).slice(c * BM, BM).load(ROWS)[:, None]
                else:
                    pg = warpgroup_mma_wait(0, deps=(pg, ))
                acc_g += pg * factors.index(s * NH).reshape([NC * BM]).slice(c * BM, BM).load(ROWS)[:, None]
            mbarrier.arrive(consumed.index(s))
    else:
        for i in range(num_k):
            s = i % NUM_STAGES
            phase = (i // NUM_STAGES) & 1
            mbarrier.wait(loaded.index(s), phase)
            mbarrier.wait(converted.index(s), phase)
            fence_async_shared()
            xb = act.index(s).permute((1, 0))
            acc_g = warpgroup_mma(wconv.index(s * NH), xb, acc_g, is_async=True)
            if NH == 2:  # keep this stage's MMAs in flight; the previous stage's are done
                acc_u = warpgroup_mma(wconv.index(s * NH + 1), xb, acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(NH, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma_wait(NH, deps=(acc_g, ))
            mbarrier.arrive(consumed.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
        if NH == 2:
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
        else:
            acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
        offs_r = gl.arange(0, BM, layout=ROWS)
        acc_g = acc_g * _pow2(gl.load(ref_ptr + w_row0 + offs_r) - 127)[:, None]
        if NH == 2:
            acc_u = acc_u * _pow2(gl.load(ref_ptr + w_row0 + N + offs_r) - 127)[:, None]

    # epilogue in the accumulator layout: no shared-memory round trip (its scratch would be as large as a
    # pipeline stage); a warp's store covers 16-B pieces of 4 output rows, the L2 merges them
    OUT: gl.constexpr = MMA
    g = acc_g
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
        up = acc_u * col_scale[None, :]
        if HAS_BIAS:
            up += gl.load(bias_ptr + w_row0 + N + (offs_n - n0))[:, None]
        gate = gl.minimum(y, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        if SWIGLUOAI:
            y = gate / (1.0 + gl.exp(-alpha * gate)) * (up + 1.0)
        else:
            y = gate / (1.0 + gl.exp(-gate)) * up
        out_rows = slots
    else:
        y = y * gl.load(topk_weights_ptr + routes, mask=row_ok, other=0.0).to(gl.float32)[None, :]
        out_rows = gl.where(row_ok, routes, 0)
    if OUT_I64:  # 32-bit element offsets where the output allows: 64-bit pointers per element would spill
        out_ptrs = out_ptr + out_rows.to(gl.int64)[None, :] * stride_out + offs_n[:, None]
    else:
        out_ptrs = out_ptr + (out_rows[None, :] * stride_out + offs_n[:, None])
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
    LOADER_REGS: gl.constexpr = 48, CONVERTER_REGS: gl.constexpr = 112,
    OUT_I64: gl.constexpr = True,
):
    """The ``moe_gemm_kernel`` contract on sm90 (see the module docstring); requires
    ``N % BM == 0`` and ``K % BK == 0``."""
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
        a_dtype: gl.constexpr = a_ptr.dtype.element_ty
        packed = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES * NH, BM, BK // 2],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        wconv = gl.allocate_shared_memory(w_dtype, [NUM_STAGES * NH, BM, BK],
                                          gl.NVMMASharedLayout.get_default_for([BM, BK], w_dtype))
        act = gl.allocate_shared_memory(a_dtype, [NUM_STAGES, BT, BK],
                                        gl.NVMMASharedLayout.get_default_for([BT, BK], a_dtype))
        # W4A8: each K32 block's FP32 factor per weight row
        factors = gl.allocate_shared_memory(gl.float32, [NUM_STAGES * NH if FP8 else 1, NC, BM],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
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
                                 GEMM1, SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64)),
            (_loader, (w_ptr, a_ptr, stride_a, sorted_routes_ptr, slot0, top_k, w_row0, N, K, num_k,
                       packed, act, loaded, consumed, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES)),
            (_converter, (s_ptr, ref_ptr, w_row0, N, K, num_k, packed, wconv, factors, loaded, converted, consumed,
                          NH, FP8, BM, BK, NUM_STAGES)),
        ], [LOADER_WARPS, CONVERTER_WARPS], [LOADER_REGS, CONVERTER_REGS])
