"""The warp-specialized Gluon kernel (``moe_gemm_ws_kernel``; W4A16; in the default selection GEMM2 on 128-row
tiles with N % 128 != 0): persistent, async wgmma on shared operands, the partitions running concurrently, each
walking the program's tiles:

- loader (4 warps): 16-B ``cp.async`` of the packed E2M1 tiles (gate and up rows) and of the gathered activation
  rows into a ring of ``NUM_STAGES`` stages (no TMA gather on sm90);
- converter (4 warps): E2M1 -> BF16 with the K32 block scale folded (as in ``gemm``; K order) by inline asm, stored
  as 32-bit words into the stage's NVMMA-swizzled tile;
- MMA + epilogue (default partition, one or two warpgroups): async ``warpgroup_mma`` chaining the stages into the
  FP32 accumulators with one stage in flight; a tile's epilogue runs while the other partitions fill the ring.

Barriers per stage: ``loaded`` (every loader thread's cp.async landed), ``converted`` (weights converted),
``consumed`` (the stage's MMAs finished: activation, converted and packed buffers may be refilled).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .convert import E2M1X8_TO_BF16_KORDER_ASM, FOLD_REF_MAX
from .sm90_operands import _fold_ref, _times_row_ref
from .sm90_pipeline import _copy_pointers, _epilogue, _issue_stage, _reinterpret, _tile_origin

LOADER_WARPS = gl.constexpr(4)
CONVERTER_WARPS = gl.constexpr(4)


@gluon.jit
def _loader(w_ptr, a_ptr, stride_a, routes_ptr, tile_expert_ptr, first, end, stride, top_k, N, K, num_k,
            packed, act, loaded, consumed,
            GEMM1: gl.constexpr, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
            NUM_STAGES: gl.constexpr, U: gl.constexpr):
    n_blocks = N // BM
    c0 = 0  # ring steps of the program's earlier tiles
    for tile in range(first, end, stride):
        expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, tile // n_blocks, tile % n_blocks, N, NH, BM, BT)
        w_ptrs, a_ptrs, ok, row_bytes = _copy_pointers(w_ptr, a_ptr, stride_a, routes_ptr, slot0, top_k, w_row0, K,
                                                       GEMM1, BM, BT, BK, U)
        for i in range(num_k):
            c = c0 + i
            s = c % NUM_STAGES
            mbarrier.wait(consumed.index(s), ((c // NUM_STAGES) & 1) ^ 1)
            _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, N, row_bytes, s, i, NH, BK, U)
        c0 += num_k


@gluon.jit
def _load_packed(packed, i, NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                 PL: gl.constexpr):
    """Stage ``i``'s packed words [BM, BK/8] of both halves (once the loader's copies landed)."""
    s = i % NUM_STAGES
    words: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    p_g = _reinterpret(packed.index(s * NH), gl.int32, [BM, BK // 8], words).load(PL)
    p_u = p_g
    if NH == 2:
        p_u = _reinterpret(packed.index(s * NH + 1), gl.int32, [BM, BK // 8], words).load(PL)
    return p_g, p_u


@gluon.jit
def _scale_group(s_ptrs, gg, j, num_k, G: gl.constexpr, NC: gl.constexpr):
    """Scale bytes of stages j*G .. j*G + G-1 (0 past the last stage): [BM, G, NC] int32."""
    return gl.load(s_ptrs + j * G * NC, mask=(j * G + gg < num_k)[None, :, None], other=0).to(gl.int32)


@gluon.jit
def _converter(s_ptr, ref_ptr, tile_expert_ptr, first, end, stride, N, K, num_k,
               packed, wconv, loaded, converted, consumed,
               NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
               GROUP: gl.constexpr = 2):
    """Converts every stage's weights.

    Each thread converts whole K32 blocks: 4 words of packed codes (one 16-B shared load) -> 32 BF16 values
    in K order (64 contiguous bytes of a row of the NVMMA-swizzled stage tile, stored as 32-bit words),
    with one block scale. The next stage's packed words are loaded before this stage is converted, and
    the scale bytes come in groups of G stages: the proxy fence before each ``converted`` arrive waits
    for every outstanding global load, so a per-stage scale load would expose its latency every stage."""
    NC: gl.constexpr = BK // 32
    CW: gl.constexpr = gl.num_warps()
    G: gl.constexpr = GROUP  # stages per scale group
    PL: gl.constexpr = gl.BlockedLayout([1, 4], [32 // NC, NC], [CW, 1], [1, 0])  # packed words [BM, BK/8]
    WL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NC, NC], [CW, 1], [1, 0])  # converted words
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // NC, NC, 1], [CW, 1, 1], [2, 1, 0])  # [BM, NC, 4]
    SL: gl.constexpr = gl.SliceLayout(2, L3)  # one value per (row, K32 block): [BM, NC]
    GL: gl.constexpr = gl.BlockedLayout([1, G, 1], [32 // NC, 1, NC], [CW, 1, 1], [2, 1, 0])  # [BM, G, NC]
    conv_words: gl.constexpr = gl.NVMMASharedLayout(wconv.type.layout.swizzle_byte_width, 32, rank=2)
    gm = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, GL)))
    gg = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, GL)))
    gc = gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(1, GL)))
    n_blocks = N // BM
    c0 = 0  # ring steps of the program's earlier tiles
    for tile in range(first, end, stride):
        expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, tile // n_blocks, tile % n_blocks, N, NH, BM, 1)
        s_ptrs = (s_ptr + (w_row0 + gm.to(gl.int64))[:, None, None] * (K // 32) + (gg * NC)[None, :, None]
                  + gc[None, None, :])
        up_off = N * (K // 32)
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
        ref_g = _fold_ref(ref_ptr + w_row0 + rows)[:, None]
        ref_u = ref_g
        if NH == 2:
            ref_u = _fold_ref(ref_ptr + w_row0 + N + rows)[:, None]
        nxt_g = _scale_group(s_ptrs, gg, 0, num_k, G, NC)
        nxt_u = nxt_g
        if NH == 2:
            nxt_u = _scale_group(s_ptrs + up_off, gg, 0, num_k, G, NC)
        # the next stage's packed words are loaded while this one converts
        mbarrier.wait(loaded.index(c0 % NUM_STAGES), (c0 // NUM_STAGES) & 1)
        p_g, p_u = _load_packed(packed, c0, NH, BM, BK, NUM_STAGES, PL)
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
                    s = (c0 + i) % NUM_STAGES
                    mbarrier.wait(consumed.index(s), (((c0 + i) // NUM_STAGES) & 1) ^ 1)
                    q_g = p_g
                    q_u = p_u
                    if i + 1 < num_k:
                        mbarrier.wait(loaded.index((c0 + i + 1) % NUM_STAGES), ((c0 + i + 1) // NUM_STAGES) & 1)
                        q_g, q_u = _load_packed(packed, c0 + i + 1, NH, BM, BK, NUM_STAGES, PL)
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
                        # BF16x2 2**(126 + b - ref) per block (field in [0, 254]), beside every word of it
                        f = (FOLD_REF_MAX + b - ref) << 7
                        f2 = gl.convert_layout((gl.expand_dims(f | (f << 16), 2) + gl.zeros([BM, NC, 4], gl.int32, L3))
                                               .reshape(BM, BK // 8), PL)
                        o0, o1, o2, o3 = gl.inline_asm_elementwise(E2M1X8_TO_BF16_KORDER_ASM, "=r,=r,=r,=r,r,r",
                                                                   [p, f2], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                                   is_pure=True, pack=1)
                        # output j of stored word q is K pair 4j + q of the block (K 8j + 2q, + 1)
                        w = gl.join(gl.join(o0, o2), gl.join(o1, o3)).reshape(BM, NC, 4, 4).permute((0, 1, 3, 2))
                        w = w.reshape(BM, BK // 2)
                        _reinterpret(wconv.index(s * NH + h), gl.int32, [BM, BK // 2], conv_words).store(
                            gl.convert_layout(w, WL))
                    fence_async_shared()
                    mbarrier.arrive(converted.index(s))
                    p_g = q_g
                    p_u = q_u
        c0 += num_k


@gluon.jit
def _mma_and_epilogue(ref_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                      tile_expert_ptr, first, end, stride, N, top_k, limit, alpha, num_k,
                      wconv, act, loaded, converted, consumed,
                      GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
                      BM: gl.constexpr, BT: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr):
    NH: gl.constexpr = 2 if GEMM1 else 1
    NW: gl.constexpr = gl.num_warps()
    WPM: gl.constexpr = NW if BM >= 16 * NW else BM // 16  # warps along the weight rows, the rest split the tokens
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WPM, NW // WPM],
                                                  instr_shape=[16, BT // (NW // WPM), 16])
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    n_blocks = N // BM
    c0 = 0  # ring steps of the program's earlier tiles
    for tile in range(first, end, stride):
        expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, tile // n_blocks, tile % n_blocks, N, NH, BM, BT)
        acc_g = gl.zeros((BM, BT), gl.float32, MMA)
        acc_u = acc_g
        for i in range(num_k):
            s = (c0 + i) % NUM_STAGES
            phase = ((c0 + i) // NUM_STAGES) & 1
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
            mbarrier.arrive(consumed.index((c0 + i + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
        if NH == 2:
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
        else:
            acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
        mbarrier.arrive(consumed.index((c0 + num_k - 1) % NUM_STAGES))  # the tile's last stage
        acc_g, acc_u = _times_row_ref(acc_g, acc_u, ref_ptr, w_row0, N, NH, BM, ROWS)
        _epilogue(acc_g, acc_u, ref_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                  expert, w_row0, n0, slot0, N, top_k, limit, alpha, GEMM1, SWIGLUOAI, False, HAS_BIAS, HAS_GSCALE,
                  BM, BT, OUT_I64, MMA)
        c0 += num_k


@gluon.jit
def moe_gemm_ws_kernel(
    a, w, pack, out, dims,
    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
    BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
    LOADER_REGS: gl.constexpr = 48, CONVERTER_REGS: gl.constexpr = 112,
    OUT_I64: gl.constexpr = True, W_UNIT: gl.constexpr = 64,
):
    """The ``moe_gemm_kernel`` contract on sm90 for W4A16 (see the module docstring); requires
    ``N % BM == 0`` and ``K % BK == 0``. Persistent: a 1-D grid of at most one program per SM, each
    walking the (route tile, weight-row block) tiles ``program_id, + num_programs, ...`` with one
    stage ring across its tiles (a tile's epilogue overlaps the next tile's loads and conversion). Arguments in the
    bundles of ``config.ARG_BUNDLES``."""
    a_ptr, a_scale_ptr, stride_a = a
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr = pack
    out_ptr, stride_out, topk_weights_ptr = out
    N, K, top_k, limit, alpha = dims
    gl.static_assert(not FP8)
    first = gl.program_id(0)
    stride = gl.num_programs(0)
    end = (N // BM) * gl.load(num_tiles_ptr)
    if first < end:
        NH: gl.constexpr = 2 if GEMM1 else 1
        num_k = K // BK
        packed = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES * NH, BM, BK // 2],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        wconv = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES * NH, BM, BK],
                                          gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
        act = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BT, BK],
                                        gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16))
        loaded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        converted = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        consumed = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(loaded.index(s), count=32 * LOADER_WARPS)
            mbarrier.init(converted.index(s), count=1)
            mbarrier.init(consumed.index(s), count=1)

        gl.warp_specialize([
            (_mma_and_epilogue, (ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                                 topk_weights_ptr, tile_expert_ptr, first, end, stride, N, top_k, limit, alpha, num_k,
                                 wconv, act, loaded, converted, consumed,
                                 GEMM1, SWIGLUOAI, HAS_BIAS, HAS_GSCALE, BM, BT, NUM_STAGES, OUT_I64)),
            (_loader, (w_ptr, a_ptr, stride_a, sorted_routes_ptr, tile_expert_ptr, first, end, stride, top_k, N, K, num_k,
                       packed, act, loaded, consumed, GEMM1, NH, BM, BT, BK, NUM_STAGES, W_UNIT)),
            (_converter, (s_ptr, ref_ptr, tile_expert_ptr, first, end, stride, N, K, num_k, packed, wconv,
                          loaded, converted, consumed, NH, BM, BK, NUM_STAGES)),
        ], [LOADER_WARPS, CONVERTER_WARPS], [LOADER_REGS, CONVERTER_REGS])
