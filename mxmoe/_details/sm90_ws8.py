"""The warp-specialized W4A8 prefill kernel (``moe_gemm_ws8_kernel``; both GEMMs, the folded fast path): persistent,
a producer warpgroup and two consumer warpgroups.

- Tiles: ``M_TILES`` m64 tiles (wgmma's M) per consumer warpgroup x ``BT`` routed rows (its N), ``BK`` = 128 K per
  stage. ``M_TILES`` = 2: 256 weight rows per program, BT 64 or 128; GEMM1: a warpgroup holds the gate rows and the up
  rows of the same 64 output columns in its two m-tiles, so each thread has the gate and up sums of the same outputs
  (no exchange before the activation), 128 output columns per program; GEMM2: 128 consecutive rows per warpgroup.
  ``M_TILES`` = 1: 128 weight rows per program, BT up to 256 (at 256 half the conversions per MAC); GEMM1: a
  warpgroup's m-tile holds the gate and up rows of 32 output columns in 8-row slabs (``_gate_up_rows``: a thread
  again holds both sums of its outputs), 64 columns per program; GEMM2: 64 rows per warpgroup.
- Producer (4 warps, ``PRODUCER_REGS`` registers): per stage ``cp.async`` of the 2 ``M_TILES`` 64-row blocks' packed
  E2M1 bytes (each one contiguous piece of the prepared row blocks) and of the gathered FP8 activation rows (GEMM1:
  each route's token row of x; GEMM2: the slot's intermediate row) into a ring of ``NUM_STAGES``; every producer thread
  arrives on the stage's ``loaded`` barrier once its copies landed. It runs ahead across tiles, so a tile's first
  stages land during the previous tile's epilogue.
- Consumers (default partition and one worker, ``CONSUMER_REGS`` registers): per stage and m-tile, each thread loads
  exactly its register-operand bytes, converts them through the E4M3 byte table with the block's scale folded
  (``sm90_operands._e4m3_operands``) and issues one async FP8 wgmma per K32 block on the stage's activations; the
  conversion of m-tile 1 runs while m-tile 0's MMAs do, and the other warpgroup's MMAs keep the tensor core busy while
  one converts (``PINGPONG``: the two issue their MMAs in strict turns, step by step). Each step's scale words are
  loaded a step before their use. A stage is released (``consumed``, one arrival per warpgroup) once its m-tiles' MMAs
  completed. The FP8 accumulator chains over the whole K (SPEC §5 allows 4096 K); ``PROMOTE`` = P > 0 cuts the chains
  at every P steps, each chain's sums added to FP32 registers (the tests' 1024-K chains; registers for both only at
  ``M_TILES`` x ``BT`` <= 128). Then the tile's epilogue (``sm90_pipeline._epilogue``).
- ``K_TAIL`` = K % BK (a multiple of 64): a last stage of that many K (gpt-oss: K = 2880). Output columns past N
  (GEMM2, N % (128 ``M_TILES``) != 0) are computed on zeroed or stale weights and never stored.
- Experts whose scales do not fold (``fold_ptr`` 0) are skipped: the exact unfolded small-tile kernel takes them.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .sm90_operands import (_e4m3_addends, _e4m3_operands, _fp8_chain, _fp8_wait, _fragment_bytes,
                            _fragment_bytes_layout, _pow2, _scale_word_rows, _small_mma_layout)
from .sm90_pipeline import (_async_load, _epilogue, _gate_up_apart, _gate_up_layout, _gate_up_rows, _joined_layout,
                            _launch_dependents, _packed_layout, _reinterpret, _step_offset, _tile_origin,
                            _tile_routes,
                            _wait_for_previous_kernel, _weight_pointers)

BM = gl.constexpr(64)  # rows of one m-tile (wgmma's M per warpgroup)


@gluon.constexpr_function
def _columns(GEMM1, MT):
    """Output columns per program: GEMM1 64 MT (the gate and up rows of 2 x 32 MT), GEMM2 128 MT."""
    return 64 * MT if GEMM1 else 128 * MT


@gluon.jit
def _block_rows(expert, n0, N, GEMM1: gl.constexpr):
    """The first weight row of each pair of 64-row blocks of a tile (``M_TILES`` = 2: blocks 2p and 2p + 1, warpgroup
    p's m-tiles) and the second block's distance from the first: GEMM1 (warpgroup p: gate rows n0 + 64 p.., up rows N
    further), GEMM2 (rows n0 + 128 p .., the second 64 further; ``M_TILES`` = 1: the first pair only)."""
    if GEMM1:
        return expert * (2 * N) + n0, expert * (2 * N) + n0 + 64, N
    else:
        return expert * N + n0, expert * N + n0 + 128, 64


@gluon.jit
def _m_tile_rows(expert, n0, N, sm, WG: gl.constexpr, GEMM1: gl.constexpr, MT: gl.constexpr):
    """The weight rows of rows ``sm`` (0 .. 63, any layout) of warpgroup ``WG``'s m-tiles, as ``_pair_sources`` copies
    them: m-tile 0's first row (int64), each row's offset from it (int32: the pointers stay a scalar base plus 32-bit
    offsets) and m-tile 1's first row (``MT`` = 1: m-tile 0's). GEMM2's rows past N (the last program at N % 128 == 64)
    read the expert's last row's scales: their sums are never stored."""
    if MT == 2:
        row_a, row_b, half = _block_rows(expert, n0, N, GEMM1)
        row0 = row_a if WG == 0 else row_b
        return row0, sm, row0 + half
    elif GEMM1:
        row0 = expert * (2 * N) + n0
        return row0, _gate_up_rows(sm, N, (BM // 2) * WG), row0
    else:
        return expert * N, gl.minimum(n0 + BM * WG + sm, N - 1), expert * N


@gluon.jit
def _pair_sources(w_ptr, expert, n0, N, K, pair: gl.constexpr, GEMM1: gl.constexpr, BK: gl.constexpr,
                  U: gl.constexpr, MT: gl.constexpr):
    """The packed-byte sources [128, BK/2] of a tile's first K step for the stage's blocks ``MT`` pair, + 1 (``MT`` = 2:
    warpgroup ``pair``'s m-tiles; 1: both warpgroups' m-tile), which rows to copy (output columns below N) and the row
    stride: the rows ``_m_tile_rows`` gives the consumers."""
    if MT == 1 and GEMM1:  # the gate and up rows of 64 columns in ``_gate_up_rows`` order, 32 columns per block
        w, row_bytes = _weight_pointers(w_ptr, expert * (2 * N) + n0, K, 2 * BM, BK, U, N, 1, True)
        r = gl.arange(0, 2 * BM, layout=gl.SliceLayout(1, w.type.layout))
        return w, r < 2 * BM, row_bytes  # (all: N % 64 == 0, so a program's 64 columns are below N)
    row_a, row_b, half = _block_rows(expert, n0, N, GEMM1)
    w, row_bytes = _weight_pointers(w_ptr, row_a if pair == 0 else row_b, K, BM, BK, U, half, 2)
    r = gl.arange(0, 2 * BM, layout=gl.SliceLayout(1, w.type.layout))
    if GEMM1:  # (both blocks of a pair hold the same columns)
        return w, n0 + BM * pair + r % BM < N, row_bytes
    return w, n0 + 2 * BM * pair + r < N, row_bytes


@gluon.jit
def _has_tile(fold_ptr, tile_expert_ptr, tile, n_blocks):
    """Whether ``tile`` runs here: its expert's scales fold (the others take the exact unfolded kernel)."""
    return gl.load(fold_ptr + gl.load(tile_expert_ptr + tile // n_blocks)) != 0


# --------------------------------------------------------------------------------------------------------- producer


@gluon.jit
def _issue_weights(packed, w_ptrs, row_ok, pair: gl.constexpr, row_bytes, s, i, BK: gl.constexpr, U: gl.constexpr,
                   KB: gl.constexpr, MT: gl.constexpr):
    """``cp.async`` of K step ``i``'s packed bytes of one pair of 64-row blocks (``w_ptrs`` [128, BK/2], rows
    ``row_ok``) into ring slot ``s``; ``KB`` < BK: the tail step, only its first KB K."""
    ROWS: gl.constexpr = 2 * BM
    halves = _reinterpret(packed, gl.uint8, [packed.shape[0] // 2, ROWS, BK // 2],
                          _joined_layout(packed.layout, ROWS, BK // 2, U, BM))
    mask = row_ok[:, None]
    if KB < BK:
        cols = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, w_ptrs.type.layout))
        mask = mask & (cols < KB // 2)[None, :]
    _async_load(halves.index(MT * s + pair), w_ptrs + _step_offset(i, BK, U), mask=mask)


@gluon.jit
def _producer(a_ptr, stride_a, w_ptr, routes_ptr, tile_expert_ptr, fold_ptr, first, end, stride, n_blocks, N, K,
              top_k, num_full, packed, act, loaded, consumed, GEMM1: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
              NUM_STAGES: gl.constexpr, U: gl.constexpr, K_TAIL: gl.constexpr, MT: gl.constexpr):
    """The producer partition: every stage of every tile the program walks, into the ring."""
    _wait_for_previous_kernel()  # (the route pack and the activations are the previous kernels' output)
    EPV: gl.constexpr = 16  # FP8 values per 16-B copy
    AL: gl.constexpr = gl.BlockedLayout([1, EPV], [32 // (BK // EPV), BK // EPV], [gl.num_warps(), 1], [1, 0])
    a_cols = gl.arange(0, BK, layout=gl.SliceLayout(0, AL))
    COLS: gl.constexpr = _columns(GEMM1, MT)
    c = 0  # ring steps so far
    for tile in range(first, end, stride):
        if _has_tile(fold_ptr, tile_expert_ptr, tile, n_blocks):
            expert, n0, _, slot0 = _tile_origin(tile_expert_ptr, tile // n_blocks, tile % n_blocks, N, 1, COLS, BT)
            # rows of output columns past N (a program's last columns when N % COLS != 0): not copied
            w_a, ok_a, row_bytes = _pair_sources(w_ptr, expert, n0, N, K, 0, GEMM1, BK, U, MT)
            w_b, ok_b = w_a, ok_a
            if MT == 2:
                w_b, ok_b, _ = _pair_sources(w_ptr, expert, n0, N, K, 1, GEMM1, BK, U, MT)
            slots = slot0 + gl.arange(0, BT, layout=gl.SliceLayout(1, AL))
            routes = _tile_routes(routes_ptr, slots, BT, False)
            ok = routes >= 0
            rows = gl.where(ok, routes // top_k, 0) if GEMM1 else slots
            a_ptrs = a_ptr + rows.to(gl.int64)[:, None] * stride_a + a_cols[None, :]
            for i in range(num_full + (1 if K_TAIL > 0 else 0)):
                s = c % NUM_STAGES
                mbarrier.wait(consumed.index(s), ((c // NUM_STAGES) & 1) ^ 1)
                if i < num_full:
                    _issue_weights(packed, w_a, ok_a, 0, row_bytes, s, i, BK, U, BK, MT)
                    if MT == 2:
                        _issue_weights(packed, w_b, ok_b, 1, row_bytes, s, i, BK, U, BK, MT)
                    _async_load(act.index(s), a_ptrs + i * BK, mask=ok[:, None])
                else:  # the last K_TAIL of K
                    _issue_weights(packed, w_a, ok_a, 0, row_bytes, s, i, BK, U, K_TAIL, MT)
                    if MT == 2:
                        _issue_weights(packed, w_b, ok_b, 1, row_bytes, s, i, BK, U, K_TAIL, MT)
                    _async_load(act.index(s), a_ptrs + i * BK, mask=ok[:, None] & (a_cols < K_TAIL)[None, :])
                async_copy.mbarrier_arrive(loaded.index(s), increment_count=False)
                c += 1


# -------------------------------------------------------------------------------------------------------- consumers


@gluon.jit
def _stage_ops(packed, s, blk: gl.constexpr, sc, lo, hi, BK: gl.constexpr, U: gl.constexpr, KB: gl.constexpr,
               DOT: gl.constexpr, MT: gl.constexpr):
    """One m-tile's FP8 register operands of ring slot ``s`` (block ``blk`` of the stage's 2 ``MT``), one per K32 block
    of the step's ``KB`` K, the scale bytes ``sc`` [BM, BK/32] folded in."""
    p = packed.index(2 * MT * s + blk)
    if KB < BK:  # the tail step: the stage's first unit, row-major [BM, KB/2] bytes as [BM, KB/32, 4, 4]
        gl.static_assert(KB // 2 == U)
        units = _reinterpret(p, gl.uint8, [(BK // 2) // U * BM, KB // 32, 4, 4],
                             gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
        codes = units.slice(0, BM).load(_fragment_bytes_layout(BM, KB))
    else:
        codes = _fragment_bytes(p, BM, KB, U)
    return _e4m3_operands(codes, sc, lo, hi, BM, KB, DOT)


@gluon.jit
def _scale_sources(s_ptr, row0, offs, K, SCALE_WORDS: gl.constexpr, NB: gl.constexpr, SC: gl.constexpr):
    """The first K step's scale sources of an m-tile's weight rows ``row0 + offs`` (``offs`` [BM], SliceLayout(1,
    ``SC``)): with ``SCALE_WORDS`` a 32-bit word pointer per row, else NB byte pointers per row ([BM, NB])."""
    if SCALE_WORDS:
        return _scale_word_rows(s_ptr, row0, offs, K)
    else:
        sb = gl.arange(0, NB, layout=gl.SliceLayout(0, SC))
        return s_ptr + (row0 + offs.to(gl.int64))[:, None] * (K // 32) + sb[None, :]


@gluon.jit
def _scale_load(src, i, SCALE_WORDS: gl.constexpr, NB: gl.constexpr):
    """Issue the loads of K step ``i``'s scale bytes of an m-tile's rows: with ``SCALE_WORDS`` one 32-bit word per row
    (128 K), else NB bytes. The loaded values cross the loop's back edge as they are, unpacked at their use a step
    later (``_scale_unpack``): unpacked here, the loads' latency stalled every step (perf-notes step 55)."""
    if SCALE_WORDS:
        return gl.load(src + i)
    else:
        return gl.load(src + i * NB)


@gluon.jit
def _scale_ring(src0, src1, i, SCALE_WORDS: gl.constexpr, NB: gl.constexpr, MT: gl.constexpr):
    """Both m-tiles' scale loads of K step ``i``."""
    nxt0 = _scale_load(src0, i, SCALE_WORDS, NB)
    nxt1 = nxt0
    if MT == 2:
        nxt1 = _scale_load(src1, i, SCALE_WORDS, NB)
    return nxt0, nxt1


@gluon.jit
def _scale_unpack(loaded, SCALE_WORDS: gl.constexpr, NB: gl.constexpr, SC: gl.constexpr):
    """``_scale_load``'s values as scale bytes [BM, NB] (int32, ``SC``)."""
    if SCALE_WORDS:
        sb = gl.arange(0, NB, layout=gl.SliceLayout(0, SC))
        return (loaded[:, None] >> (8 * sb)[None, :]) & 0xFF
    else:
        return loaded.to(gl.int32)


@gluon.jit
def _stage_ready(loaded, c, NUM_STAGES: gl.constexpr):
    """Wait until ring step ``c``'s copies landed; its slot. (The caller issues the next step's scale loads after this:
    the proxy fence compiles to a ``MEMBAR``, which would wait for loads issued before it.)"""
    s = c % NUM_STAGES
    mbarrier.wait(loaded.index(s), (c // NUM_STAGES) & 1)
    fence_async_shared()  # (the producer's cp.async wrote the activations; the wgmma reads them through the async
    return s  # proxy)


@gluon.jit
def _consumer_step(packed, act, consumed, turn, s, c, acc0, acc1, sc0, sc1, lo0, hi0, lo1, hi1, WG: gl.constexpr,
                   BK: gl.constexpr, U: gl.constexpr, KB: gl.constexpr, DOT: gl.constexpr, MT: gl.constexpr,
                   PINGPONG: gl.constexpr, use_acc):
    """Ring slot ``s`` (``KB`` K of it, its copies landed: ``_stage_ready``; ring step ``c``): m-tile 0 converted and its
    MMAs issued, (``MT`` = 2) m-tile 1 converted while they run and its MMAs issued; then wait for all and release the
    slot. (MMAs left in flight across the K loop's iterations make ptxas serialize every wgmma, C7512, for want of
    registers: the other warpgroup's MMAs fill the tensor core while this one converts.) ``PINGPONG``: the step's
    operands all converted first, then the MMAs issued in turns, warpgroup 0's of step c before 1's, 1's before 0's of
    step c + 1 (``turn``), so that one warpgroup converts while the other's MMAs run."""
    NBS: gl.constexpr = KB // 32
    act_s = act.index(s)  # (the tail step's MMAs read its first KB columns)
    ops0 = _stage_ops(packed, s, MT * WG, sc0, lo0, hi0, BK, U, KB, DOT, MT)
    if PINGPONG:
        if MT == 2:
            ops1 = _stage_ops(packed, s, 2 * WG + 1, sc1, lo1, hi1, BK, U, KB, DOT, MT)
        mbarrier.wait(turn.index(WG), (c + 1 - WG) & 1)  # (warpgroup 0's first wait passes on the fresh barrier)
        acc0 = _fp8_chain(ops0, act_s, acc0, NBS, use_acc)
        if MT == 2:
            acc1 = _fp8_chain(ops1, act_s, acc1, NBS, use_acc)
        mbarrier.arrive(turn.index(1 - WG))
    else:
        acc0 = _fp8_chain(ops0, act_s, acc0, NBS, use_acc)
        if MT == 2:
            ops1 = _stage_ops(packed, s, 2 * WG + 1, sc1, lo1, hi1, BK, U, KB, DOT, MT)
            acc1 = _fp8_chain(ops1, act_s, acc1, NBS, use_acc)
    acc0, acc1 = _fp8_wait(acc0, acc1, MT)
    mbarrier.arrive(consumed.index(s))
    return acc0, acc1


@gluon.jit
def _consumer(a_scale_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, routes_ptr, tile_expert_ptr, fold_ptr, out_ptr,
              stride_out, topk_weights_ptr, first, end, stride, n_blocks, N, K, top_k, limit, alpha, num_full,
              packed, act, loaded, consumed, turn, GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr,
              HAS_GSCALE: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
              U: gl.constexpr, K_TAIL: gl.constexpr, PROMOTE: gl.constexpr, OUT_I64: gl.constexpr, MT: gl.constexpr,
              PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup ``WG``: its ``MT`` m-tiles of every tile the program walks (module docstring)."""
    _wait_for_previous_kernel()  # (the activations' scales, the route pack)
    NB: gl.constexpr = BK // 32
    MMA: gl.constexpr = _small_mma_layout(BT, True)
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    SC: gl.constexpr = _scale_layout(BK)
    SCALE_WORDS: gl.constexpr = K_TAIL == 0  # (K % 128 == 0: each row's bytes start 4-byte aligned)
    COLS: gl.constexpr = _columns(GEMM1, MT)
    STEPS_TAIL: gl.constexpr = 1 if K_TAIL > 0 else 0
    sm = gl.arange(0, BM, layout=gl.SliceLayout(1, SC))
    c = 0
    for tile in range(first, end, stride):
        if _has_tile(fold_ptr, tile_expert_ptr, tile, n_blocks):
            expert, n0, _, slot0 = _tile_origin(tile_expert_ptr, tile // n_blocks, tile % n_blocks, N, 1, COLS, BT)
            row0, offs, row1 = _m_tile_rows(expert, n0, N, sm, WG, GEMM1, MT)
            lo0, hi0 = _e4m3_addends(gl.load(ref_ptr + row0 + offs))
            lo1, hi1 = _e4m3_addends(gl.load(ref_ptr + row1 + offs))  # (MT = 1: unused)
            src0 = _scale_sources(s_ptr, row0, offs, K, SCALE_WORDS, NB, SC)
            half = N if GEMM1 else BM  # (MT = 2: m-tile 1's rows from m-tile 0's)
            if SCALE_WORDS:
                src1 = _scale_sources(s_ptr, row1, offs, K, SCALE_WORDS, NB, SC)
            else:
                src1 = src0 + half * (K // 32)
            zero = gl.zeros((BM, BT), gl.float32, MMA)
            acc0 = zero
            acc1 = zero
            tot0 = zero  # PROMOTE: the FP32 sums of the chains done
            tot1 = zero
            nxt0, nxt1 = _scale_ring(src0, src1, 0, SCALE_WORDS, NB, MT)
            for i in range(num_full):
                s = _stage_ready(loaded, c, NUM_STAGES)
                cur0 = _scale_unpack(nxt0, SCALE_WORDS, NB, SC)
                cur1 = _scale_unpack(nxt1, SCALE_WORDS, NB, SC)
                if i + 1 < num_full:  # the next step's scale bytes, in flight through this one
                    nxt0, nxt1 = _scale_ring(src0, src1, i + 1, SCALE_WORDS, NB, MT)
                use_acc = True
                if PROMOTE > 0:
                    use_acc = i % PROMOTE != 0  # (False: a chain starts from zero)
                acc0, acc1 = _consumer_step(packed, act, consumed, turn, s, c, acc0, acc1, cur0, cur1, lo0, hi0, lo1,
                                            hi1, WG, BK, U, BK, DOT, MT, PINGPONG, use_acc)
                if PROMOTE > 0:
                    if ((i + 1) % PROMOTE == 0) & (i + 1 < num_full + STEPS_TAIL):  # (the last chain: below)
                        tot0 += acc0
                        if MT == 2:
                            tot1 += acc1
                c += 1
            if K_TAIL > 0:
                SCT: gl.constexpr = _scale_layout(K_TAIL)
                NBT: gl.constexpr = K_TAIL // 32
                tm = gl.arange(0, BM, layout=gl.SliceLayout(1, SCT))
                tb = gl.arange(0, NBT, layout=gl.SliceLayout(0, SCT))
                t_row0, t_offs, _ = _m_tile_rows(expert, n0, N, tm, WG, GEMM1, MT)
                t_ptrs0 = s_ptr + (t_row0 + t_offs.to(gl.int64))[:, None] * (K // 32) + (num_full * NB + tb)[None, :]
                tail0 = gl.load(t_ptrs0).to(gl.int32)
                tail1 = tail0
                if MT == 2:
                    tail1 = gl.load(t_ptrs0 + half * (K // 32)).to(gl.int32)
                use_acc = True
                if PROMOTE > 0:
                    use_acc = num_full % PROMOTE != 0
                s = _stage_ready(loaded, c, NUM_STAGES)
                acc0, acc1 = _consumer_step(packed, act, consumed, turn, s, c, acc0, acc1, tail0, tail1, lo0, hi0, lo1,
                                            hi1, WG, BK, U, K_TAIL, DOT, MT, PINGPONG, use_acc)
                c += 1
            if PROMOTE > 0:
                acc0 = tot0 + acc0
                acc1 = tot1 + acc1
            # each row times 2**(ref - 133), its blocks folded into E4M3 as 2**(b + 6 - ref) (``_e4m3_addends``)
            e_row0, e_offs, e_row1 = _m_tile_rows(expert, n0, N, gl.arange(0, BM, layout=gl.SliceLayout(1, MMA)), WG,
                                                  GEMM1, MT)
            acc0 = acc0 * _pow2(gl.load(ref_ptr + e_row0 + e_offs) - 133)[:, None]
            if MT == 2:
                acc1 = acc1 * _pow2(gl.load(ref_ptr + e_row1 + e_offs) - 133)[:, None]
            _tile_epilogue(acc0, acc1, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out,
                           topk_weights_ptr, expert, n0, slot0, N, top_k, limit, alpha, GEMM1, SWIGLUOAI, HAS_BIAS,
                           HAS_GSCALE, BT, OUT_I64, MT, WG, MMA)


@gluon.jit
def _tile_epilogue(acc0, acc1, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                   expert, n0, slot0, N, top_k, limit, alpha, GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BT: gl.constexpr, OUT_I64: gl.constexpr,
                   MT: gl.constexpr, WG: gl.constexpr, MMA: gl.constexpr):
    """Warpgroup ``WG``'s part of a tile's epilogue (``sm90_pipeline._epilogue``) from its row-folded accumulators:
    GEMM1 the gate and up sums of its output columns, GEMM2 its m-tiles' rows; 256-row route tiles in four pieces of
    64 routed rows (the whole tile's values and pointers at once spill; two pieces still spill 350-400 bytes in GEMM2
    under Triton 3.9)."""
    PIECES: gl.constexpr = 4 if BT > 128 else 1
    PT: gl.constexpr = BT // PIECES
    if GEMM1 and MT == 2:  # gate rows (acc0) and up rows (acc1) of output columns n0 + 64 WG ..
        _epilogue(acc0, acc1, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                  expert, expert * (2 * N) + n0 + BM * WG, n0 + BM * WG, slot0, N, top_k, limit, alpha, True,
                  SWIGLUOAI, True, HAS_BIAS, HAS_GSCALE, BM, BT, OUT_I64, MMA)
    elif GEMM1:  # the gate and up rows of output columns n0 + 32 WG .. apart (``_gate_up_rows``)
        HL: gl.constexpr = _gate_up_layout()
        g, u = _gate_up_apart(acc0)
        c0 = n0 + (BM // 2) * WG
        for h in gl.static_range(PIECES):
            _epilogue(_piece(g, h, PIECES, HL), _piece(u, h, PIECES, HL), a_scale_ptr, gscale_ptr, bias_ptr,
                      routes_ptr, out_ptr, stride_out, topk_weights_ptr, expert, expert * (2 * N) + c0, c0,
                      slot0 + h * PT, N, top_k, limit, alpha, True, SWIGLUOAI, True, HAS_BIAS, HAS_GSCALE, BM // 2, PT,
                      OUT_I64, HL)
    else:  # rows n0 + 64 (MT WG + m) .. of m-tile m
        PL: gl.constexpr = _small_mma_layout(PT, True)
        for m in gl.static_range(MT):
            c0 = n0 + BM * (MT * WG + m)
            for h in gl.static_range(PIECES):
                y = _piece(acc0 if m == 0 else acc1, h, PIECES, PL)
                _epilogue(y, y, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
                          expert, expert * N + c0, c0, slot0 + h * PT, N, top_k, limit, alpha, False, SWIGLUOAI, True,
                          HAS_BIAS, HAS_GSCALE, BM, PT, OUT_I64, PL)


@gluon.jit
def _piece(x, h: gl.constexpr, PIECES: gl.constexpr, L: gl.constexpr):
    """Columns h BT/PIECES .. of ``x`` [rows, BT] in layout ``L`` (PIECES 1, 2 or 4: a split of registers, no data
    moves)."""
    if PIECES > 1:
        lo, hi = x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute((0, 2, 1)).split()
        x = lo if h < PIECES // 2 else hi
        if PIECES == 4:
            lo, hi = x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute((0, 2, 1)).split()
            x = lo if h % 2 == 0 else hi
        x = gl.convert_layout(x, L, assert_trivial=True)
    return x


@gluon.constexpr_function
def _scale_layout(BK):
    """One value per (row, K32 block) of an m-tile's register-operand bytes of a BK-deep step ([BM, BK/32])."""
    return gl.SliceLayout(2, gl.SliceLayout(3, _fragment_bytes_layout(64, BK)))


# ------------------------------------------------------------------------------------------------------------ entry


@gluon.jit
def moe_gemm_ws8_kernel(
    a, w, pack, out, dims, fold_ptr,
    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
    BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr, W_UNIT: gl.constexpr, K_TAIL: gl.constexpr,
    PROMOTE: gl.constexpr = 0, OUT_I64: gl.constexpr = True, PRODUCER_REGS: gl.constexpr = 64,
    CONSUMER_REGS: gl.constexpr = 224, M_TILES: gl.constexpr = 2,
    PINGPONG: gl.constexpr = False,
):
    """The ``moe_gemm_kernel`` contract for W4A8 prefill (module docstring): ``num_warps=4`` (the first consumer
    warpgroup), persistent (a 1-D grid of at most one program per SM walking the (route tile, column block) tiles
    ``program_id, + num_programs, ..``, route-tile-major: a route tile's column blocks run side by side, its
    activation rows read from the L2); requires K % 64 == 0, N % 64 == 0 and ``K_TAIL`` = K % BK. Arguments in the
    bundles of ``config.ARG_BUNDLES``, then the experts' fold flags."""
    a_ptr, a_scale_ptr, stride_a = a
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr = pack
    out_ptr, stride_out, topk_weights_ptr = out
    N, K, top_k, limit, alpha = dims
    gl.static_assert(gl.num_warps() == 4 and BK == 128 and (M_TILES == 1 or M_TILES == 2))
    gl.static_assert(BT == 64 or BT == 128 or (BT == 256 and M_TILES == 1))
    gl.static_assert(K_TAIL % 64 == 0 and K_TAIL < BK)
    gl.static_assert(PROMOTE == 0 or M_TILES * BT <= 128)  # (the promoted sums' registers)
    _wait_for_previous_kernel()
    if GEMM1:
        _launch_dependents()
    n_blocks = gl.cdiv(N, _columns(GEMM1, M_TILES))
    first = gl.program_id(0)
    stride = gl.num_programs(0)
    end = n_blocks * gl.load(num_tiles_ptr)
    num_full = K // BK
    if first < end:
        packed = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES * 2 * M_TILES, BM, BK // 2],
                                           _packed_layout(BM, BK // 2, W_UNIT))
        act = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BT, BK],
                                        gl.NVMMASharedLayout.get_default_for([BT, BK], gl.float8e4nv))
        loaded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        consumed = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(loaded.index(s), count=32 * 4)
            mbarrier.init(consumed.index(s), count=2)
        turn = loaded  # (unused without PINGPONG)
        if PINGPONG:  # whose turn it is to issue its MMAs: one barrier per consumer warpgroup
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for g in gl.static_range(2):
                mbarrier.init(turn.index(g), count=1)
        gl.warp_specialize([
            (_consumer, (a_scale_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, tile_expert_ptr,
                         fold_ptr, out_ptr, stride_out, topk_weights_ptr, first, end, stride, n_blocks, N, K, top_k,
                         limit, alpha, num_full, packed, act, loaded, consumed, turn, GEMM1, SWIGLUOAI, HAS_BIAS,
                         HAS_GSCALE, BT, BK, NUM_STAGES, W_UNIT, K_TAIL, PROMOTE, OUT_I64, M_TILES,
                         PINGPONG, 0)),
            (_consumer, (a_scale_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, tile_expert_ptr,
                         fold_ptr, out_ptr, stride_out, topk_weights_ptr, first, end, stride, n_blocks, N, K, top_k,
                         limit, alpha, num_full, packed, act, loaded, consumed, turn, GEMM1, SWIGLUOAI, HAS_BIAS,
                         HAS_GSCALE, BT, BK, NUM_STAGES, W_UNIT, K_TAIL, PROMOTE, OUT_I64, M_TILES,
                         PINGPONG, 1)),
            (_producer, (a_ptr, stride_a, w_ptr, sorted_routes_ptr, tile_expert_ptr, fold_ptr, first, end, stride,
                         n_blocks, N, K, top_k, num_full, packed, act, loaded, consumed, GEMM1, BT, BK, NUM_STAGES,
                         W_UNIT, K_TAIL, M_TILES)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
