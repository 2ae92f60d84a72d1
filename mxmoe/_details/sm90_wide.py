"""The wide Gluon kernel (``moe_gemm_wide_kernel``): W4A16 prefill past ~119 routed rows per expert, route tiles of
``BT`` = 256 (or 128) rows on two warpgroups, one chain of 64 x BT each, persistent (a program per SM walking the
tiles); GEMM1 the gate and up rows of 32 output columns per warpgroup (``_wide_gemm1``), GEMM2 64 output columns each
(``_wide_gemm2``). The ring runs on across tiles: a tile's last steps refill it with the next tile's first steps. Any
K and N multiple of 64 (gpt-oss's 2880: 16-bit scale loads; GEMM2's last block repeats a half). With extra rows
(``EXTRA_ROWS``) a tile is BT + 32 route-pack slots, the last 32 multiplied only on tiles that hold them.

Measured and deleted (docs/perf-notes.md steps 50-53): a W4A8 form (E4M3 operands, FP8 chains), 64-row tiles.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .convert import FOLD_REF_MAX
from .sm90_operands import (_bf16_operand, _fold_addend, _fragment_words, _fragment_words_layout, _pow2,
                            _scale_word_factors, _scale_word_rows, _small_mma_layout)
from .sm90_pipeline import (_act_copy_layout, _async_load, _copy_pointers, _epilogue, _epilogue_values, _gate_up_apart,
                            _gate_up_layout, _gate_up_rows, _issue_stage, _launch_dependents, _origin, _tile_origin,
                            _wait_for_previous_kernel, _weight_pointers)


@gluon.jit
def _wide_gemm1_half(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                     tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed, act, loaded, consumed, staging,
                     first, end, N, K, top_k, limit, alpha, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr,
                     HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                     NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr, SB: gl.constexpr,
                     HALF: gl.constexpr, XR: gl.constexpr):
    """One warpgroup of the persistent wide GEMM1 (``_wide_gemm1``): of every tile the program walks (route tile
    ``tile // n_blocks``, BM output columns ``tile % n_blocks``), the gate and up rows of output columns ``HALF * BM/2
    ..`` (``_gate_up_rows``), one accumulator chain of BM x BT over all K steps, copying activation rows ``HALF * BT/2
    ..`` of the shared ring; then the epilogue of its BM/2 columns for all BT routed rows, from its own accumulator.
    The ring runs on across tiles (as ``_wide_gemm2_half``): a tile's last steps refill it with the next tile's first
    steps, whose copies land during the epilogue. ``XR`` extra rows: a tile is BT + XR slots, the last XR multiplied
    only where its slot BT holds a route (``_wide_mma_extra``); this warpgroup copies half of them."""
    R: gl.constexpr = BT // 2
    TS: gl.constexpr = BT + XR  # route-pack slots per tile
    C: gl.constexpr = BM // 2  # output columns
    S: gl.constexpr = NUM_STAGES
    gl.static_assert(NUM_STAGES >= 3 and BM == 64)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    SC: gl.constexpr = gl.SliceLayout(2, WL)
    if HALF == 1:
        _wait_for_previous_kernel()  # (the default partition waited too; this partition's reads must not pass it)
    stride = gl.num_programs(0)
    n_blocks = N // BM
    num_k = K // BK
    col0 = HALF * C
    sm = _gate_up_rows(gl.arange(0, BM, layout=gl.SliceLayout(1, SC)), N, col0)
    AL: gl.constexpr = _act_copy_layout(a_ptr.dtype.element_ty, BK, 4)
    a_rows = gl.arange(0, R, layout=gl.SliceLayout(1, AL))
    a_cols = gl.arange(0, BK, layout=gl.SliceLayout(0, AL))
    # the first tile: its copies, its first scale word
    expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, first // n_blocks, first % n_blocks, N, 2, BM, TS)
    _, a_ptrs, ok, row_bytes = _copy_pointers(w_ptr, a_ptr, stride_a, sorted_routes_ptr, slot0 + HALF * R, top_k,
                                              w_row0, K, True, BM, R, BK, U)
    extra = None
    if XR > 0:  # (pairs: ``_wide_copy``)
        extra = gl.load(sorted_routes_ptr + slot0 + BT) >= 0
        ok_x, ax_ptrs = _extra_rows(a_ptr, stride_a, gl.load(sorted_routes_ptr + slot0 + BT + HALF * (XR // 2)
                                                             + _extra_slots(a_ptr.dtype.element_ty, BK, XR)),
                                    top_k, BK)
        a_ptrs = (a_ptrs, ax_ptrs)
        ok = (ok, ok_x)
    w_ptrs = _weight_pointers(w_ptr, w_row0, K, BM, BK, U, N, 1, True, col0)[0]
    for j in gl.static_range(S - 1):
        _wide_copy(packed, act, loaded, w_ptrs, a_ptrs, ok, row_bytes, j, j, BK, U, HALF, XR)
    w_rows = _scale_word_rows(s_ptr, w_row0, sm, K, SB)
    nxt_w = _scale_load(w_rows)
    fac0 = _row_addends(gl.load(ref_ptr + w_row0 + sm))
    expert_n = gl.load(tile_expert_ptr + gl.minimum(first + stride, end - 1) // n_blocks).to(gl.int64)
    mbarrier.wait(loaded.index(0), 0)
    codes = _fragment_words(packed.index(0), BM, BK, WL)
    c = 0  # ring steps so far
    for tile in range(first, end, stride):
        # the next tile (the grid's last tile again where there is none): copy pointers, scale rows, row references;
        # the expert of the one after it
        has_next = tile + stride < end
        nt = gl.minimum(tile + stride, end - 1)
        expert_n, n0_n, w_row0_n, slot0_n = _origin(expert_n, nt // n_blocks, nt % n_blocks, N, 2, BM, TS)
        expert_nn = gl.load(tile_expert_ptr + gl.minimum(tile + 2 * stride, end - 1) // n_blocks).to(gl.int64)
        routes_n = gl.load(sorted_routes_ptr + slot0_n + HALF * R + a_rows)  # (its copy pointers: in the tail)
        extra_n = None
        if XR > 0:
            extra_n = gl.load(sorted_routes_ptr + slot0_n + BT) >= 0
            routes_n = (routes_n, gl.load(sorted_routes_ptr + slot0_n + BT + HALF * (XR // 2)
                                          + _extra_slots(a_ptr.dtype.element_ty, BK, XR)))
        ref_n = gl.load(ref_ptr + w_row0_n + sm)
        codes, nxt_w, w_ptrs, a_ptrs, ok, w_rows = _wide_gemm1_tile(
            a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr,
            stride_out, packed, act, loaded, consumed, staging, codes, w_rows, nxt_w, fac0, c, num_k, w_ptrs, a_ptrs,
            ok, row_bytes, has_next, routes_n, w_row0_n, expert, n0, w_row0, slot0, col0, sm, a_cols, N, K, top_k,
            limit, alpha, SWIGLUOAI, HAS_BIAS, HAS_GSCALE, BM, BT, BK, S, OUT_I64, U, SB, HALF, extra, XR)
        c += num_k
        if XR > 0:
            extra = extra_n
        expert = expert_n
        n0 = n0_n
        w_row0 = w_row0_n
        slot0 = slot0_n
        fac0 = _row_addends(ref_n)
        expert_n = expert_nn
    return ()


@gluon.jit
def _wide_gemm1_tile(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                     out_ptr, stride_out, packed, act, loaded, consumed, staging, codes, w_rows, nxt_w, fac0, c,
                     num_k, w_ptrs, a_ptrs, ok, row_bytes, has_next, routes_n, w_row0_n, expert, n0, w_row0, slot0,
                     col0, sm, a_cols, N, K, top_k, limit, alpha, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr,
                     HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
                     OUT_I64: gl.constexpr, U: gl.constexpr, SB: gl.constexpr, HALF: gl.constexpr, extra=None,
                     XR: gl.constexpr = 0):
    """One tile of ``_wide_gemm1_half`` from ring step ``c``: its K loop, whose last steps refill the ring with the next
    tile's first ones, then the epilogue of its ``BT`` slots (and, where it holds them, its ``XR`` extra slots:
    ``routes_n`` and the copy pointers are pairs then). Returns the codes loaded for the next step, the next scale load
    and the next tile's copy pointers and scale rows."""
    C: gl.constexpr = BM // 2  # output columns
    G: gl.constexpr = SB // (BK // 32)  # K steps per scale load
    MMA: gl.constexpr = _small_mma_layout(BT, False)
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    HL: gl.constexpr = _gate_up_layout()  # the accumulator's gate (or up) rows
    OL: gl.constexpr = _out_piece_layout(out_ptr.dtype.element_ty, C)  # [BT, C]: 16-B pieces
    acc = gl.zeros((BM, BT), gl.float32, MMA)
    if XR > 0:
        acc = (acc, gl.zeros((BM, XR), gl.float32, _small_mma_layout(XR, False)))
    codes, acc, nxt_w = _wide_main_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c,
                                         0, num_k // G - _wide_tail_groups(BK, S, SB), w_ptrs, a_ptrs, ok,
                                         row_bytes, BM, BK, S, U, SB, HALF, WL, DOT, extra, XR)
    # the next tile's copy pointers for the tail's refills (made here: registers through the main steps spill)
    if XR > 0:
        ok_n = routes_n[0] >= 0
        a_ptrs_n = a_ptr + gl.where(ok_n, routes_n[0] // top_k, 0).to(gl.int64)[:, None] * stride_a + a_cols[None, :]
        ok_xn, ax_ptrs_n = _extra_rows(a_ptr, stride_a, routes_n[1], top_k, BK)
        a_ptrs_n = (a_ptrs_n, ax_ptrs_n)
        ok_n = (ok_n, ok_xn)
    else:
        ok_n = routes_n >= 0
        a_ptrs_n = a_ptr + gl.where(ok_n, routes_n // top_k, 0).to(gl.int64)[:, None] * stride_a + a_cols[None, :]
    w_ptrs_n = _weight_pointers(w_ptr, w_row0_n, K, BM, BK, U, N, 1, True, col0)[0]
    w_rows_n = _scale_word_rows(s_ptr, w_row0_n, sm, K, SB)
    codes, acc, nxt_w = _wide_tail_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c,
                                         num_k, w_ptrs, a_ptrs, ok, row_bytes, has_next, w_rows_n, w_ptrs_n,
                                         a_ptrs_n, ok_n, BM, BK, S, U, SB, HALF, WL, DOT, extra, XR)
    if XR > 0:
        acc, acc_x = acc
        if extra:  # the extra slots: from the accumulator's layout (XR values per thread and column: no staging)
            _wide_gemm1_extra_out(acc_x, a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr,
                                  stride_out, expert, n0, w_row0, slot0 + BT, col0, N, top_k, limit, alpha, SWIGLUOAI,
                                  HAS_BIAS, HAS_GSCALE, BM, XR, OUT_I64)
    # each row times its factor (``_row_factors``), then the gate and up rows apart
    acc_rows = _gate_up_rows(gl.arange(0, BM, layout=gl.SliceLayout(1, MMA)), N, col0)
    acc = acc * _row_factors(gl.load(ref_ptr + w_row0 + acc_rows))[:, None]
    g, u = _gate_up_apart(acc)
    # the activation of every slot (a padding slot's row too, no routes to read) into ``staging`` [BT, C], then whole
    # 16-B pieces of its rows to the output (from the accumulator layout: one store per value)
    y, out_rows, row_ok, offs_n = _epilogue_values(g, u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                                                   sorted_routes_ptr, expert, w_row0 + col0, n0 + col0, slot0, N,
                                                   top_k, limit, alpha, True, SWIGLUOAI, False, HAS_BIAS,
                                                   HAS_GSCALE, C, BT, HL, False, True)
    tile_staging = staging.slice(0, BT)
    tile_staging.permute((1, 0)).store(y.to(out_ptr.dtype.element_ty))
    offs_t = gl.arange(0, BT, layout=gl.SliceLayout(1, OL))
    offs_o = gl.arange(0, C, layout=gl.SliceLayout(0, OL))
    if OUT_I64:
        out_ptrs = out_ptr + (slot0 + offs_t).to(gl.int64)[:, None] * stride_out + (n0 + col0 + offs_o)[None, :]
    else:
        out_ptrs = out_ptr + ((slot0 + offs_t)[:, None] * stride_out + (n0 + col0 + offs_o)[None, :])
    gl.store(out_ptrs, tile_staging.load(OL))
    return codes, nxt_w, w_ptrs_n, a_ptrs_n, ok_n, w_rows_n


@gluon.constexpr_function
def _out_piece_layout(dtype, C):
    """[rows, C] output values in 16-B pieces of rows, over one warpgroup."""
    epv = 128 // dtype.primitive_bitwidth
    return gl.BlockedLayout([1, epv], [32 * epv // C, C // epv], [4, 1], [1, 0])


@gluon.constexpr_function
def _extra_slots_layout(dtype, BK):
    """A warpgroup's half of the extra rows in ``_act_copy_layout``."""
    return gl.SliceLayout(1, _act_copy_layout(dtype, BK, 4))


@gluon.jit
def _extra_slots(a_dtype: gl.constexpr, BK: gl.constexpr, XR: gl.constexpr):
    """0 .. XR/2 - 1: a warpgroup's half of a tile's extra rows, in the layout of their copy."""
    return gl.arange(0, XR // 2, layout=_extra_slots_layout(a_dtype, BK))


@gluon.jit
def _extra_rows(a_ptr, stride_a, routes, top_k, BK: gl.constexpr):
    """(rows holding a route, ``cp.async`` sources of K step 0) of a wide GEMM1's extra rows ``routes`` (each
    route's token)."""
    ok = routes >= 0
    AL: gl.constexpr = _act_copy_layout(a_ptr.dtype.element_ty, BK, 4)
    ptrs = (a_ptr + gl.where(ok, routes // top_k, 0).to(gl.int64)[:, None] * stride_a
            + gl.arange(0, BK, layout=gl.SliceLayout(0, AL))[None, :])
    return ok, ptrs


@gluon.jit
def _wide_gemm1_extra_out(acc_x, a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                          expert, n0, w_row0, slot0, col0, N, top_k, limit, alpha, SWIGLUOAI: gl.constexpr,
                          HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BM: gl.constexpr, XR: gl.constexpr,
                          OUT_I64: gl.constexpr):
    """A wide GEMM1 warpgroup's epilogue of the extra slots ``slot0 ..`` (W4A16): row factors, the gate and up rows
    apart (as the tile's), then ``_epilogue``'s activation and store of the slots holding a route."""
    MMA_X: gl.constexpr = _small_mma_layout(XR, False)
    HL: gl.constexpr = _gate_up_layout()
    C: gl.constexpr = BM // 2
    rows = _gate_up_rows(gl.arange(0, BM, layout=gl.SliceLayout(1, MMA_X)), N, col0)
    acc_x = acc_x * _row_factors(gl.load(ref_ptr + w_row0 + rows))[:, None]
    g, u = _gate_up_apart(acc_x)
    _epilogue(g, u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out, sorted_routes_ptr,
              expert, w_row0 + col0, n0 + col0, slot0, N, top_k, limit, alpha, True, SWIGLUOAI, False, HAS_BIAS,
              HAS_GSCALE, C, XR, OUT_I64, HL)


@gluon.jit
def _row_addends(ref):
    """Per weight row, from its reference byte ``ref`` (the largest scale byte): the addend of its BF16x2 block
    factors (``_fold_addend`` of ``_fold_ref``)."""
    return _fold_addend(gl.minimum(ref, FOLD_REF_MAX))


@gluon.jit
def _row_factors(ref):
    """Each weight row's factor after the K loop: 2**(r - 127) (blocks folded relative to r = ``_fold_ref``)."""
    return _pow2(gl.minimum(ref, FOLD_REF_MAX) - 127)


@gluon.jit
def _wide_gemm1(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                tile_expert_ptr, num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, top_k, limit, alpha,
                SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BM: gl.constexpr,
                BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr,
                SB: gl.constexpr, HALF_REGS: gl.constexpr, XR: gl.constexpr):
    """GEMM1 on wide route tiles (``BT`` = 256 or 128 rows, the MMA's N), persistent: a 1-D grid of at most one program
    per SM, each walking the (route tile, BM output columns) tiles ``program_id, + num_programs, ..``; two warpgroups
    (``_wide_gemm1_half``), each the gate and up rows of half the BM columns, one accumulator chain of 64 x 256
    converting while the other's MMA runs: half the conversion per MMA of the 128-row tiles' two chains of 64 x 128.
    They share the activation ring, each copying half of its rows; a slot is refilled once both warpgroups' MMAs on
    it completed (``consumed``), after this step's MMA went out (before it, each would wait for the other's MMA
    before converting). One program per SM: a program per tile would idle the SM through each tile's first loads."""
    first = gl.program_id(0)
    end = (N // BM) * gl.load(num_tiles_ptr)  # (the route pack is complete: the kernel waited for it)
    if first < end:
        act, packed_0, packed_1, loaded, consumed = _wide_ring(a_ptr.dtype.element_ty, BM, BT, BK, NUM_STAGES, XR)
        # each warpgroup's BF16 results of a tile [BT, BM/2], stored from here in 16-B pieces of rows
        OUT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BM // 2], out_ptr.dtype.element_ty)
        staging_0 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BT, BM // 2], OUT_SL)
        staging_1 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BT, BM // 2], OUT_SL)
        gl.warp_specialize([
            (_wide_gemm1_half, (a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
                                sorted_routes_ptr, tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_0, act,
                                loaded, consumed, staging_0, first, end, N, K, top_k, limit, alpha, SWIGLUOAI, HAS_BIAS,
                                HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64, U, SB, 0, XR)),
            (_wide_gemm1_half, (a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
                                sorted_routes_ptr, tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_1, act,
                                loaded, consumed, staging_1, first, end, N, K, top_k, limit, alpha, SWIGLUOAI, HAS_BIAS,
                                HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64, U, SB, 1, XR)),
        ], [4], [HALF_REGS])


@gluon.jit
def _wide_ring(a_dtype: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
               XR: gl.constexpr = 0):
    """The ``cp.async`` ring of a wide tile's two warpgroups: the shared activation rows, each warpgroup's packed
    weights, ``loaded`` (every thread of both arrives) and ``consumed`` (both warpgroups' MMAs on the slot
    completed). ``XR`` extra rows: the activations are a pair, the BT rows' ring and the extra rows' (an allocation of
    its own: Triton's barrier pass puts a CTA barrier between two copies into one allocation)."""
    act = gl.allocate_shared_memory(a_dtype, [NUM_STAGES, BT, BK],
                                    gl.NVMMASharedLayout.get_default_for([BT, BK], a_dtype))
    if XR > 0:
        act = (act, gl.allocate_shared_memory(a_dtype, [NUM_STAGES, XR, BK],
                                              gl.NVMMASharedLayout.get_default_for([XR, BK], a_dtype)))
    packed_0 = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BM, BK // 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    packed_1 = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BM, BK // 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    loaded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(loaded.index(j), count=2 * 32 * 4)
        mbarrier.init(consumed.index(j), count=2)
    return act, packed_0, packed_1, loaded, consumed


@gluon.jit
def _wide_copy(packed, act, loaded, w_ptrs, a_ptrs, ok, row_bytes, slot, step, BK: gl.constexpr, U: gl.constexpr,
               HALF: gl.constexpr, XR: gl.constexpr, PART: gl.constexpr = 0):
    """``_issue_stage`` of one warpgroup of a wide tile: K step ``step`` into ring slot ``slot`` (``PART`` as there).
    With ``XR`` extra rows ``act``, ``a_ptrs`` and ``ok`` are pairs (``ok`` None: every row): this warpgroup's half of
    the extra rows is copied too, before the arrival (which waits for all of the thread's copies)."""
    if XR > 0:
        if PART != 1:
            rows_x = act[1].index(slot).slice(HALF * (XR // 2), XR // 2)
            if ok is None:
                _async_load(rows_x, a_ptrs[1] + step * BK)
            else:
                _async_load(rows_x, a_ptrs[1] + step * BK, mask=ok[1][:, None])
        _issue_stage(packed, act[0], loaded, w_ptrs, a_ptrs[0], None if ok is None else ok[0], 0, row_bytes, slot,
                     step, 1, BK, U, PART, True, HALF * a_ptrs[0].shape[0])
    else:
        _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, 0, row_bytes, slot, step, 1, BK, U, PART, True,
                     HALF * a_ptrs.shape[0])


@gluon.jit
def _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g: gl.constexpr, w_ptrs, a_ptrs, ok,
               refill_step, row_bytes, load_next, refill, BM: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
               U: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr, extra=None,
               XR: gl.constexpr = 0):
    """Ring step ``c`` of one warpgroup of a wide program (``_wide_gemm1_half``, ``_wide_gemm2_half``), the ``g``-th of
    its scale word ``cur_w``: the MMA of the codes loaded before (the next step's are
    loaded while it runs, if ``load_next``), then, if ``refill``, the slot step c - 1 read is refilled (once both
    warpgroups' MMAs on it completed: before this step's MMA went out, each would wait for the other's MMA before
    converting) with K step ``refill_step`` of ``w_ptrs``/``a_ptrs`` (rows ``ok``; None: all). The callers split their
    K loops so that these conditions are mostly compile-time constants: a runtime test per step costs instructions in
    every step. ``XR`` extra rows (W4A16): ``act``, ``a_ptrs``, ``ok`` and ``acc`` are pairs (``_wide_copy``), and
    where the tile holds them (``extra``) a second MMA multiplies the same converted operand by them."""
    NB: gl.constexpr = BK // 32
    s = c % S
    # BF16x2 2**(126 + b - r) per (row, block), two blocks per word where NB is even (as in _small_steps)
    f = _scale_word_factors(cur_w, g * NB, fac0, NB, gl.SliceLayout(2, WL))
    cur = codes
    if load_next:
        t = (c + 1) % S
        mbarrier.wait(loaded.index(t), ((c + 1) // S) & 1)
        codes = _fragment_words(packed.index(t), BM, BK, WL)
    if XR > 0:
        acc = _wide_mma_extra(packed, act, loaded, consumed, _bf16_operand(cur, f, BM, BK, WL, DOT, NB % 2 == 0), acc,
                              extra, c, w_ptrs, a_ptrs, ok, refill_step, row_bytes, refill, BK, S, U, HALF, XR)
    else:
        rows = act.index(s)
        acc = warpgroup_mma(_bf16_operand(cur, f, BM, BK, WL, DOT, NB % 2 == 0), rows.permute((1, 0)), acc,
                            is_async=True)
        if refill:
            _wide_refill(packed, act, loaded, consumed, w_ptrs, a_ptrs, ok, c, refill_step, row_bytes, BK, S, U, HALF,
                         XR)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(consumed.index(s))
    return codes, acc


@gluon.jit
def _wide_refill(packed, act, loaded, consumed, w_ptrs, a_ptrs, ok, c, refill_step, row_bytes, BK: gl.constexpr,
                 S: gl.constexpr, U: gl.constexpr, HALF: gl.constexpr, XR: gl.constexpr):
    """``_wide_step``'s refill: the slot step c - 1 read, once both warpgroups' MMAs on it completed."""
    if c > 0:
        mbarrier.wait(consumed.index((c - 1) % S), ((c - 1) // S) & 1)
    _wide_copy(packed, act, loaded, w_ptrs, a_ptrs, ok, row_bytes, (c + S - 1) % S, refill_step, BK, U, HALF, XR)


@gluon.jit
def _wide_mma_extra(packed, act, loaded, consumed, op, acc, extra, c, w_ptrs, a_ptrs, ok, refill_step, row_bytes,
                    refill, BK: gl.constexpr, S: gl.constexpr, U: gl.constexpr, HALF: gl.constexpr,
                    XR: gl.constexpr):
    """``_wide_step``'s MMAs with ``XR`` extra rows (W4A16): the BF16 operand ``op`` times the slot's BT rows and, where
    the tile holds extra rows (``extra``, the same for every step of a tile), times its extra rows into the second
    accumulator; the refill between issue and wait as without them. Each branch waits for its own MMAs (an async
    result does not leave a branch)."""
    s = c % S
    MMA_X: gl.constexpr = _small_mma_layout(XR, False)
    DOT_X: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_X, k_width=2)
    acc_m, acc_x = acc
    if extra:
        acc_m = warpgroup_mma(op, act[0].index(s).permute((1, 0)), acc_m, is_async=True)
        acc_x = warpgroup_mma(gl.convert_layout(op, DOT_X, assert_trivial=True), act[1].index(s).permute((1, 0)),
                              acc_x, is_async=True)
        if refill:
            _wide_refill(packed, act, loaded, consumed, w_ptrs, a_ptrs, ok, c, refill_step, row_bytes, BK, S, U, HALF,
                         XR)
        acc_m, acc_x = warpgroup_mma_wait(0, deps=(acc_m, acc_x))
    else:
        acc_m = warpgroup_mma(op, act[0].index(s).permute((1, 0)), acc_m, is_async=True)
        if refill:
            _wide_refill(packed, act, loaded, consumed, w_ptrs, a_ptrs, ok, c, refill_step, row_bytes, BK, S, U, HALF,
                         XR)
        acc_m = warpgroup_mma_wait(0, deps=(acc_m, ))
    return acc_m, acc_x


@gluon.jit
def _wide_main_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, jg0, jg1, w_ptrs,
                     a_ptrs, ok, row_bytes, BM: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, U: gl.constexpr,
                     SB: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr,
                     extra=None, XR: gl.constexpr = 0):
    """Scale-load groups ``jg0 .. jg1 - 1`` (``SB`` K32 blocks each) of a wide tile's K loop (ring step ``c0`` = the
    tile's K step 0), all of whose steps refill the ring with a later step of the same tile (``_wide_tail_steps`` runs
    the last ones). Returns the codes loaded for the next step, the accumulator and the next scale load."""
    G: gl.constexpr = SB // (BK // 32)  # K steps per scale load
    for jg in range(jg0, jg1):
        cur_w = nxt_w
        nxt_w = _scale_load(w_rows + jg + 1)
        for g in gl.static_range(G):
            codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c0 + jg * G + g, g,
                                    w_ptrs, a_ptrs, ok, jg * G + g + S - 1, row_bytes, True, True, BM, BK, S, U, HALF,
                                    WL, DOT, extra, XR)
    return codes, acc, nxt_w


@gluon.jit
def _wide_tail_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, num_k, w_ptrs, a_ptrs,
                     ok, row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, ok_n, BM: gl.constexpr, BK: gl.constexpr,
                     S: gl.constexpr, U: gl.constexpr, SB: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr,
                     DOT: gl.constexpr, extra=None, XR: gl.constexpr = 0):
    """The last ``_wide_tail_groups`` scale-load groups of a wide tile's K loop, unrolled: which of their steps refill
    the ring with the tile's last step and which (if ``has_next``; False and the ``_n`` arguments None where the
    program has one tile) with the next tile's first S - 1 steps (``w_rows_n`` etc.) is known at compile time."""
    G: gl.constexpr = SB // (BK // 32)
    TG: gl.constexpr = _wide_tail_groups(BK, S, SB)
    for tg in gl.static_range(TG):
        cur_w = nxt_w
        if tg + 1 < TG:
            nxt_w = _scale_load(w_rows + num_k // G - TG + tg + 1)
        elif w_rows_n is not None:
            nxt_w = _scale_load(w_rows_n)
        for g in gl.static_range(G):
            c = c0 + num_k - TG * G + tg * G + g
            # the step it refills, from the tile's end: tg * G + g + S - 1 - TG * G (a constexpr only inline)
            if tg * G + g + S - 1 < TG * G:
                codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g, w_ptrs,
                                        a_ptrs, ok, num_k + (tg * G + g + S - 1 - TG * G), row_bytes, True, True, BM,
                                        BK, S, U, HALF, WL, DOT, extra, XR)
            elif tg * G + g + 1 < TG * G:
                codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g, w_ptrs_n,
                                        a_ptrs_n, ok_n, tg * G + g + S - 1 - TG * G, row_bytes, True, has_next, BM, BK,
                                        S, U, HALF, WL, DOT, extra, XR)
            else:  # the tile's last step: the next tile's first codes
                codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g, w_ptrs_n,
                                        a_ptrs_n, ok_n, tg * G + g + S - 1 - TG * G, row_bytes, has_next, has_next, BM,
                                        BK, S, U, HALF, WL, DOT, extra, XR)
    return codes, acc, nxt_w


@gluon.jit
def _wide_k_loop(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, num_k, w_ptrs, a_ptrs, ok,
                 row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, ok_n, BM: gl.constexpr, BK: gl.constexpr,
                 S: gl.constexpr, U: gl.constexpr, SB: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr,
                 DOT: gl.constexpr, extra=None, XR: gl.constexpr = 0):
    """A wide tile's K loop from ring step ``c0``: the steps that refill the ring with the tile's own steps
    (``_wide_main_steps``), then its last ones unrolled (``_wide_tail_steps``; the ``_n`` arguments: the next tile's).
    Returns the codes loaded for the next step, the accumulator and the next scale load."""
    G: gl.constexpr = SB // (BK // 32)  # K steps per scale load
    codes, acc, nxt_w = _wide_main_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, 0,
                                         num_k // G - _wide_tail_groups(BK, S, SB), w_ptrs, a_ptrs, ok, row_bytes, BM,
                                         BK, S, U, SB, HALF, WL, DOT, extra, XR)
    return _wide_tail_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, num_k, w_ptrs,
                            a_ptrs, ok, row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, ok_n, BM, BK, S, U, SB,
                            HALF, WL, DOT, extra, XR)


@gluon.constexpr_function
def _wide_tail_groups(BK, S, SB):
    """Scale-load groups (``SB`` K32 blocks each) of a wide tile's unrolled last steps (``wide_tail_steps``)."""
    from . import wide_tail_steps  # (here: the JIT refuses a plain function among a kernel's globals)

    return wide_tail_steps(BK, S, SB) // (32 * SB // BK)


@gluon.jit
def _column_blocks(N, W: gl.constexpr, REPEAT_LAST: gl.constexpr):
    """A wide GEMM2's blocks of ``W`` output columns; ``REPEAT_LAST`` (N % 128 == 64): one more, whose second half
    repeats its first (``_second_half``)."""
    if REPEAT_LAST:
        return gl.cdiv(N, W)
    else:
        return N // W


@gluon.jit
def _second_half(HALF: gl.constexpr, BM: gl.constexpr, N, n0, REPEAT_LAST: gl.constexpr):
    """The weight rows of warpgroup ``HALF`` from its block's first (``n0``): BM for the second, 0 for the first; with
    ``REPEAT_LAST`` 0 also for the second of the last block (N % 128 == 64: its columns are not stored)."""
    if REPEAT_LAST:
        return gl.minimum(HALF * BM, N - BM - n0)
    else:
        return HALF * BM


@gluon.jit
def _scale_load(ptrs):
    """A scale load of ``_scale_word_rows`` as int32 (``SB`` = 2: the 16-bit halves sign-extended; the factors read
    only their two bytes)."""
    return gl.load(ptrs).to(gl.int32)


@gluon.jit
def _wide_gemm2_half(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                     tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed, act, loaded, consumed, cols,
                     staging, first, end, N, K, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BM: gl.constexpr,
                     BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr,
                     U: gl.constexpr, SB: gl.constexpr, EARLY_WEIGHTS: gl.constexpr, REPEAT_LAST: gl.constexpr,
                     HALF: gl.constexpr, XR: gl.constexpr):
    """One warpgroup of the persistent wide GEMM2 (``_wide_gemm2``): of every tile the program walks (route tile
    ``tile // n_blocks``, 2 BM output columns ``tile % n_blocks``), the ``HALF``-th BM columns, one accumulator chain of
    BM x BT over all K steps, copying activation rows ``HALF * BT/2 ..`` of the shared ring. The ring runs on across
    tiles: a tile's last steps refill it with the next tile's first steps, whose copies land during the epilogue.

    The epilogue holds up the tensor core (both warpgroups reach it together), so it does little: what it reads from
    global memory is loaded a tile ahead or at the tile's start (each tile's expert, row factors, each slot's route and
    routing weight); routes and weights go through ``cols`` (by tile parity; in the accumulator's layout they would take
    128 registers), and the BF16 results through ``staging`` [BT, BM], so that each thread stores whole 16-B pieces
    of output rows (from the accumulator's layout: one 2-byte store per value, 128 per thread). ``XR`` extra rows: a
    tile is BT + XR slots, the last XR multiplied only where its slot BT holds a route (``_wide_mma_extra``) and stored
    from the accumulator's layout; ``staging`` then holds half a tile (``_wide_gemm2_tile``)."""
    R: gl.constexpr = BT // 2
    TS: gl.constexpr = BT + XR  # route-pack slots per tile
    S: gl.constexpr = NUM_STAGES
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    SC: gl.constexpr = gl.SliceLayout(2, WL)
    ROWS: gl.constexpr = gl.SliceLayout(1, _small_mma_layout(BT // 2, False))  # (the epilogue's pieces of 128 rows)
    EL: gl.constexpr = gl.BlockedLayout([BT // 128], [32], [4], [0])  # a tile's slots over the warpgroup
    stride = gl.num_programs(0)
    n_blocks = _column_blocks(N, 2 * BM, REPEAT_LAST)
    num_k = K // BK
    sm = gl.arange(0, BM, layout=gl.SliceLayout(1, SC))
    offs_r = gl.arange(0, BM, layout=ROWS)
    offs_e = gl.arange(0, BT, layout=EL)

    # activation rows: this warpgroup's half of the tile's slots, all of them (the MMA's columns are independent, and
    # a padding slot's output column is not stored): one offset tensor for every tile, 32-bit
    AL: gl.constexpr = _act_copy_layout(a_ptr.dtype.element_ty, BK, 4)
    a_off = ((HALF * R + gl.arange(0, R, layout=gl.SliceLayout(1, AL)))[:, None] * stride_a
             + gl.arange(0, BK, layout=gl.SliceLayout(0, AL))[None, :])
    # the first tile: its copies (weights before the wait for GEMM1 with EARLY_WEIGHTS), its first scale word
    expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, first // n_blocks, first % n_blocks, N, 1, 2 * BM, TS)
    w_row0 += _second_half(HALF, BM, N, n0, REPEAT_LAST)
    w_ptrs, row_bytes = _weight_pointers(w_ptr, w_row0, K, BM, BK, U)
    a_ptrs = a_ptr + slot0.to(gl.int64) * stride_a + a_off
    extra = None
    if XR > 0:  # (pairs: ``_wide_copy``) the extra rows' offsets, as ``a_off``
        ax_off = ((BT + HALF * (XR // 2) + _extra_slots(a_ptr.dtype.element_ty, BK, XR))[:, None] * stride_a
                  + gl.arange(0, BK, layout=gl.SliceLayout(0, AL))[None, :])
        a_ptrs = (a_ptrs, a_ptr + slot0.to(gl.int64) * stride_a + ax_off)
        extra = gl.load(sorted_routes_ptr + slot0 + BT) >= 0
    for j in gl.static_range(S - 1):
        _wide_copy(packed, act, loaded, w_ptrs, a_ptrs, None, row_bytes, j, j, BK, U, HALF, XR,
                   1 if EARLY_WEIGHTS else 0)
    _wait_for_previous_kernel()
    if EARLY_WEIGHTS:
        for j in gl.static_range(S - 1):
            _wide_copy(packed, act, loaded, w_ptrs, a_ptrs, None, row_bytes, j, j, BK, U, HALF, XR, 2)
    w_rows = _scale_word_rows(s_ptr, w_row0, sm, K, SB)
    nxt_w = _scale_load(w_rows)
    fac0 = _row_addends(gl.load(ref_ptr + w_row0 + sm))
    expert_n = gl.load(tile_expert_ptr + gl.minimum(first + stride, end - 1) // n_blocks).to(gl.int64)
    e_routes = gl.load(sorted_routes_ptr + slot0 + offs_e)
    mbarrier.wait(loaded.index(0), 0)
    codes = _fragment_words(packed.index(0), BM, BK, WL)
    c = 0  # ring steps so far
    n_tiles = 0  # tiles so far
    for tile in range(first, end, stride):
        # loaded now, used at the epilogue: the row references, the routing weights (each slot's route was loaded a
        # tile ahead: ptxas computes the weight's address where the route arrives)
        row_ref = gl.load(ref_ptr + w_row0 + offs_r)
        bias = gl.zeros([BM], gl.float32, ROWS)
        if HAS_BIAS:
            bias = gl.load(bias_ptr + w_row0 + offs_r)
        gs = 1.0
        if HAS_GSCALE:
            gs = gl.load(gscale_ptr + expert)
        e_weights = gl.load(topk_weights_ptr + e_routes, mask=e_routes >= 0, other=0.0)  # (its routes: a tile ago)
        # the next tile (the grid's last tile again where there is none): copy pointers, scale row, row references
        # (used at the end of this tile), its slots' routes; the expert of the one after it
        has_next = tile + stride < end
        nt = gl.minimum(tile + stride, end - 1)
        expert_n, n0_n, w_row0_n, slot0_n = _origin(expert_n, nt // n_blocks, nt % n_blocks, N, 1, 2 * BM, TS)
        w_row0_n += _second_half(HALF, BM, N, n0_n, REPEAT_LAST)
        expert_nn = gl.load(tile_expert_ptr + gl.minimum(tile + 2 * stride, end - 1) // n_blocks).to(gl.int64)
        w_ptrs_n = _weight_pointers(w_ptr, w_row0_n, K, BM, BK, U)[0]
        a_ptrs_n = a_ptr + slot0_n.to(gl.int64) * stride_a + a_off
        extra_n = None
        if XR > 0:
            a_ptrs_n = (a_ptrs_n, a_ptr + slot0_n.to(gl.int64) * stride_a + ax_off)
            extra_n = gl.load(sorted_routes_ptr + slot0_n + BT) >= 0
        w_rows_n = _scale_word_rows(s_ptr, w_row0_n, sm, K, SB)
        ref_n = gl.load(ref_ptr + w_row0_n + sm)
        e_routes_n = gl.load(sorted_routes_ptr + slot0_n + offs_e)
        # (with extra rows: where their epilogue reads the routes and weights)
        extra_out = (sorted_routes_ptr, topk_weights_ptr, slot0 + BT) if XR > 0 else None
        codes, nxt_w = _wide_gemm2_tile(a_ptr, w_ptr, s_ptr, out_ptr, stride_out, packed, act, loaded, consumed, cols,
                                        staging, codes, w_rows, nxt_w, fac0, c, num_k, w_ptrs, a_ptrs, row_bytes,
                                        has_next, w_rows_n, w_ptrs_n, a_ptrs_n, row_ref, bias, gs, e_routes, e_weights,
                                        n0, n_tiles & 1, N, HAS_BIAS, BM, BT, BK, S, OUT_I64, U, SB, HALF, extra,
                                        extra_out, XR)
        if XR > 0:
            extra = extra_n
        c += num_k
        n_tiles += 1
        expert = expert_n
        n0 = n0_n
        w_row0 = w_row0_n
        slot0 = slot0_n  # (W4A8's row scales)
        w_ptrs = w_ptrs_n
        a_ptrs = a_ptrs_n
        w_rows = w_rows_n
        fac0 = _row_addends(ref_n)
        expert_n = expert_nn
        e_routes = e_routes_n
    return ()


@gluon.jit
def _wide_gemm2_tile(a_ptr, w_ptr, s_ptr, out_ptr, stride_out, packed, act, loaded, consumed, cols, staging, codes,
                     w_rows, nxt_w, fac0, c, num_k, w_ptrs, a_ptrs, row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n,
                     row_ref, bias, gs, e_routes, e_weights, n0, p, N, HAS_BIAS: gl.constexpr,
                     BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, OUT_I64: gl.constexpr,
                     U: gl.constexpr, SB: gl.constexpr, HALF: gl.constexpr, extra=None,
                     extra_out=None, XR: gl.constexpr = 0):
    """One tile of ``_wide_gemm2_half`` from ring step ``c``: its K loop, whose last steps refill the ring with the next
    tile's first ones, then the epilogue of its ``BT`` slots (routes and routing weights in ``cols`` at tile parity
    ``p``): row factors, global scale ``gs``, bias and routing weight (as _epilogue), in pieces of at most 128 routed
    rows, into ``staging``; then the routed rows' 16-B pieces to the output (piece by piece where ``staging`` holds one
    piece: with ``XR`` extra rows; those, where the tile holds them, from the accumulator's layout with the routes and
    weights at ``extra_out``). Returns the codes loaded for the next step and the next scale load."""
    PIECES: gl.constexpr = 2 if BT > 128 else 1
    PR: gl.constexpr = BT // PIECES
    MMA: gl.constexpr = _small_mma_layout(BT, False)
    HM: gl.constexpr = _small_mma_layout(PR, False)
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    ROWS: gl.constexpr = gl.SliceLayout(1, HM)
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BM, BM // 8], [4, 1], [1, 0])  # [BT, BM]: 16-B pieces
    acc = gl.zeros((BM, BT), gl.float32, MMA)
    if XR > 0:
        acc = (acc, gl.zeros((BM, XR), gl.float32, _small_mma_layout(XR, False)))
    codes, acc, nxt_w = _wide_k_loop(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c, num_k, w_ptrs,
                                     a_ptrs, None, row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, None, BM, BK, S,
                                     U, SB, HALF, WL, DOT, extra, XR)
    if XR > 0:
        acc, acc_x = acc
        if extra:
            _wide_gemm2_extra_out(acc_x, extra_out[0], extra_out[1], out_ptr, stride_out, row_ref, bias, gs,
                                  extra_out[2], n0 + HALF * BM, N, HAS_BIAS, BM, XR, OUT_I64)
    cols.index(2 * p).store(e_routes.to(gl.float32, bitcast=True))
    cols.index(2 * p + 1).store(e_weights)
    row_f = gl.convert_layout(_row_factors(row_ref), ROWS)
    if HAS_BIAS:
        bias = gl.convert_layout(bias, ROWS)
    if PIECES == 2:
        lo, hi = acc.reshape([BM, 2, PR]).permute((0, 2, 1)).split()
    else:
        lo = acc
        hi = acc
    for h in gl.static_range(PIECES):
        part = gl.convert_layout(lo if h == 0 else hi, HM, assert_trivial=True)
        weights = cols.index(2 * p + 1).slice(h * PR, PR).load(gl.SliceLayout(0, HM))
        y = part * row_f[:, None] * gs
        if HAS_BIAS:
            y += bias[:, None]
        y = y * weights[None, :]
        if staging.shape[0] < BT:  # this piece's rows out before the next piece takes ``staging``
            staging.permute((1, 0)).store(y.to(out_ptr.dtype.element_ty))
            _staged_rows_out(staging, cols.index(2 * p).slice(h * PR, PR), out_ptr, stride_out, n0 + HALF * BM, N, BM,
                             OUT_I64, OL)
        else:
            staging.slice(h * PR, PR).permute((1, 0)).store(y.to(out_ptr.dtype.element_ty))
    if staging.shape[0] == BT:
        _staged_rows_out(staging, cols.index(2 * p).slice(0, BT), out_ptr, stride_out, n0 + HALF * BM, N, BM, OUT_I64,
                         OL)
    return codes, nxt_w


@gluon.jit
def _staged_rows_out(staging, routes_s, out_ptr, stride_out, n0, N, BM: gl.constexpr, OUT_I64: gl.constexpr,
                     OL: gl.constexpr):
    """A wide GEMM2's staged results [rows, BM] to their routes' output rows (``routes_s``: the routes as FP32 bits,
    -1 for padding), output columns ``n0 ..`` below N, in 16-B pieces of rows."""
    routes = routes_s.load(gl.SliceLayout(1, OL)).to(gl.int32, bitcast=True)
    row_ok = routes >= 0
    offs_n = n0 + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
    if OUT_I64:
        out_ptrs = out_ptr + gl.where(row_ok, routes, 0).to(gl.int64)[:, None] * stride_out + offs_n[None, :]
    else:
        out_ptrs = out_ptr + (gl.where(row_ok, routes, 0)[:, None] * stride_out + offs_n[None, :])
    gl.store(out_ptrs, staging.load(OL), mask=row_ok[:, None] & (offs_n < N)[None, :])


@gluon.jit
def _wide_gemm2_extra_out(acc_x, sorted_routes_ptr, topk_weights_ptr, out_ptr, stride_out, row_ref, bias, gs, slot0,
                          n0, N, HAS_BIAS: gl.constexpr, BM: gl.constexpr, XR: gl.constexpr, OUT_I64: gl.constexpr):
    """A wide GEMM2 warpgroup's epilogue of the extra slots ``slot0 ..`` (W4A16; output columns ``n0 ..``): row factors,
    global scale, bias and routing weight as the tile's, stored from the accumulator's layout."""
    MMA_X: gl.constexpr = _small_mma_layout(XR, False)
    ROWS_X: gl.constexpr = gl.SliceLayout(1, MMA_X)
    routes = gl.load(sorted_routes_ptr + slot0 + gl.arange(0, XR, layout=gl.SliceLayout(0, MMA_X)))
    row_ok = routes >= 0
    weights = gl.load(topk_weights_ptr + routes, mask=row_ok, other=0.0)
    y = acc_x * gl.convert_layout(_row_factors(row_ref), ROWS_X)[:, None] * gs
    if HAS_BIAS:
        y += gl.convert_layout(bias, ROWS_X)[:, None]
    y = y * weights[None, :]
    offs_n = n0 + gl.arange(0, BM, layout=ROWS_X)
    if OUT_I64:
        out_ptrs = out_ptr + gl.where(row_ok, routes, 0).to(gl.int64)[None, :] * stride_out + offs_n[:, None]
    else:
        out_ptrs = out_ptr + (gl.where(row_ok, routes, 0)[None, :] * stride_out + offs_n[:, None])
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_n < N)[:, None])


@gluon.jit
def _wide_gemm2(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                tile_expert_ptr, num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, HAS_BIAS: gl.constexpr,
                HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr, SB: gl.constexpr,
                EARLY_WEIGHTS: gl.constexpr, REPEAT_LAST: gl.constexpr, HALF_REGS: gl.constexpr,
                XR: gl.constexpr):
    """GEMM2 on wide route tiles (``BT`` = 256 or 128 rows), persistent: a 1-D grid of at most one program per SM, each
    walking the (route tile, 2 BM output columns) tiles ``program_id, + num_programs, ..``; two warpgroups
    (``_wide_gemm2_half``), BM columns each, one accumulator chain of BM x BT converting while the other's MMA runs (as
    the wide GEMM1). With such short programs (K = I) a program per tile would leave the tensor core idle through
    every prologue and epilogue; here the next tile's first copies land during this tile's epilogue."""
    gl.static_assert(NUM_STAGES >= 3)
    first = gl.program_id(0)
    # (the route pack is complete: GEMM1 waited for it)
    end = _column_blocks(N, 2 * BM, REPEAT_LAST) * gl.load(num_tiles_ptr)
    if first < end:
        act, packed_0, packed_1, loaded, consumed = _wide_ring(a_ptr.dtype.element_ty, BM, BT, BK, NUM_STAGES, XR)
        # each warpgroup's routes and routing weights of its tiles, by tile parity (the barriers between a warpgroup's
        # stores and loads of them: Triton's shared-memory barrier pass)
        FL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        cols_0 = gl.allocate_shared_memory(gl.float32, [4, BT], FL)
        cols_1 = gl.allocate_shared_memory(gl.float32, [4, BT], FL)
        # each warpgroup's BF16 results of a tile (with extra rows: of half a tile, for their ring's shared memory),
        # the routed rows' 16-B pieces then stored from here
        SR: gl.constexpr = BT if XR == 0 or BT == 128 else BT // 2
        OUT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SR, BM], out_ptr.dtype.element_ty)
        staging_0 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [SR, BM], OUT_SL)
        staging_1 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [SR, BM], OUT_SL)
        gl.warp_specialize([
            (_wide_gemm2_half, (a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
                                sorted_routes_ptr, tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_0,
                                act, loaded, consumed, cols_0, staging_0, first, end, N, K, HAS_BIAS, HAS_GSCALE, BM,
                                BT, BK, NUM_STAGES, OUT_I64, U, SB, EARLY_WEIGHTS, REPEAT_LAST, 0, XR)),
            (_wide_gemm2_half, (a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
                                sorted_routes_ptr, tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_1,
                                act, loaded, consumed, cols_1, staging_1, first, end, N, K, HAS_BIAS, HAS_GSCALE, BM,
                                BT, BK, NUM_STAGES, OUT_I64, U, SB, EARLY_WEIGHTS, REPEAT_LAST, 1, XR)),
        ], [4], [HALF_REGS])
    else:
        _wait_for_previous_kernel()  # (a kernel must not complete before the one it follows)


@gluon.jit
def moe_gemm_wide_kernel(
    a, w, pack, out, dims,
    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
    BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr,
    W_UNIT: gl.constexpr, EARLY_WEIGHTS: gl.constexpr, SPLIT_REGS: gl.constexpr, SCALE_BYTES: gl.constexpr,
    REPEAT_LAST: gl.constexpr = False, FP8: gl.constexpr = False, EXTRA_ROWS: gl.constexpr = 0,
):
    """The ``moe_gemm_kernel`` contract on wide route tiles (``BT`` = 256 or 128; W4A16 only: ``FP8`` False),
    persistent: a 1-D grid of at most one program per SM, two warpgroups (``SPLIT_REGS`` registers each): GEMM1
    ``_wide_gemm1``, the gate and up rows of 32 output columns each; GEMM2 ``_wide_gemm2``, 64 output columns each.
    ``EARLY_WEIGHTS`` (GEMM2 launched with PDL): its first weight stages copy before it waits for GEMM1 (as
    ``moe_gemm_small_kernel``'s).
    ``SCALE_BYTES``: the scale bytes per load, 4 (a word, K % 128 == 0) or 2 (K % 128 == 64: a row's bytes start 2-byte
    aligned). ``REPEAT_LAST`` (GEMM2 at N % 128 == 64): the last column block's second warpgroup repeats the first's
    rows, unstored. Arguments in the bundles of ``sm90_pipeline``: ``a`` the activations, ``w`` the weights, ``pack``
    the route pack, ``out`` the output, ``dims`` the sizes and activation parameters. ``EXTRA_ROWS``: each tile is BT
    + EXTRA_ROWS route-pack slots, the extra rows multiplied by the same converted weights in a second MMA where the
    tile holds them (``_wide_mma_extra``): an expert of up to BT + 32 rows takes one tile, not two."""
    a_ptr, a_scale_ptr, stride_a = a
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr = pack
    out_ptr, stride_out, topk_weights_ptr = out
    N, K, top_k, limit, alpha = dims
    gl.static_assert(BM == 64 and (BT == 256 or BT == 128) and gl.num_warps() == 4 and not FP8)
    gl.static_assert(not EARLY_WEIGHTS or not GEMM1)
    gl.static_assert(EXTRA_ROWS == 0 or EXTRA_ROWS == 32)
    if not EARLY_WEIGHTS:
        _wait_for_previous_kernel()
    if GEMM1:
        _launch_dependents()
        _wide_gemm1(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                    tile_expert_ptr, num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, top_k, limit, alpha,
                    SWIGLUOAI, HAS_BIAS, HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64, W_UNIT, SCALE_BYTES, SPLIT_REGS,
                    EXTRA_ROWS)
    else:
        _wide_gemm2(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                    tile_expert_ptr, num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, HAS_BIAS, HAS_GSCALE,
                    BM, BT, BK, NUM_STAGES, OUT_I64, W_UNIT, SCALE_BYTES, EARLY_WEIGHTS, REPEAT_LAST, SPLIT_REGS,
                    EXTRA_ROWS)
