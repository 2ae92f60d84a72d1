"""The small-tile Gluon kernel (``moe_gemm_small_kernel``; both precisions; every GEMM of the default selection
except the wide W4A16 tiles and one warp-specialized case): one warpgroup reads exactly its wgmma register-operand
words of the prepared weights and converts them in registers, no shared-memory round trip for the converted
weights; two accumulator chains (GEMM1's gate and up halves, GEMM2's two row blocks with ``PAIR``) let one convert
while the other's MMA runs; for decode grids smaller than the SM count two warpgroups split the K steps; for a few
W4A16 tokens no route pack (a tile per route, the experts from the top-k ids) and GEMM2 also does the top-k sum.

The entry kernel ``moe_gemm_small_kernel``: the ``moe_gemm_kernel`` contract for small route tiles, one warpgroup
(``num_warps=4``, ``BM = 64``): a ring of ``NUM_STAGES`` ``cp.async`` stages (packed weights of both halves and the
gathered activation rows); each thread reads the packed bytes of exactly its wgmma register-operand words
(``prepare.interleave_block_bits``) and converts them in registers. W4A16: BF16 with the block scale folded (K-ordered
asm), one wgmma per half and step. W4A8 (``BK`` 32, 64 or 128): see ``FOLD``; without it E2M1 * 2**-5 in E4M3 (exact),
one FP8 wgmma per K32 block from zero, its partial sum times the block's 2**(b - 122) into the FP32 accumulators
(exact for any span of scales). ``KSPLIT=2`` (decode grids smaller than the SM count): a second warpgroup runs the
second half of the K steps on its own ring, with ``SPLIT_REGS`` registers per thread (the launch's ``maxnreg``).
``PAIR`` (GEMM2): a program takes two 64-row weight blocks as GEMM1 takes its gate and up halves (two accumulators,
one wgmma each per step), so one block's conversion runs while the other's MMA does. ``W_UNIT``: the prepared row
blocks' unit, ``prepare.row_block_unit(K)``. Arguments in the bundles of ``config.ARG_BUNDLES`` and
``SMALL_ARG_BUNDLES`` (``direct``, ``joins``: the direct path's and the K parts' arguments, passed always,
placeholders where they do not apply: Triton 3.8 refuses runtime arguments left to a default). ``DIRECT`` (a few
tokens): no route pack; program column t takes route t alone (its expert from ``ids_ptr``, ``expert_map_ptr`` with
``HAS_MAP``, as the pack would mask it), in the first slot of a tile of its own; GEMM2 writes zeros for a masked
route, so the top-k sum needs no slot list. ``SUM_ROUTES`` (direct GEMM2; ``TOP_K`` routes per token): the last
program of each (token, column block) also sums the token's routed rows into ``sum_out_ptr``
(``_sum_routes_if_last``), so no top-k-sum launch follows. ``K_PARTS=2`` (direct GEMM1 whose grid fills the SMs
unevenly): grid axis 2 splits the K steps over two programs, joined by ``_join_k_parts`` in ``parts_ptr`` /
``counters_ptr``. W4A8 ``FOLD`` (the fast path, ``fold_ptr``: the experts' ``PreparedExperts.w13_fold`` /
``w2_fold``): each block's scale folded into its E4M3 weights (``convert.E2M1X8_TO_E4M3_TABLE_ASM``), the FP8
accumulator chained over K (``PROMOTE`` = P > 0: over P steps at a time, each such sum added to FP32 accumulators, in
shared memory with ``PROMOTE_SMEM``), 2**(ref - 133) per row after it; only the tiles of experts whose flag is 1, and
without ``FOLD`` only those whose flag is 0. ``SUB_TILES`` = 2 (GEMM2 on a pack of the wide GEMM1's 256-row tiles):
program column t takes rows ``t * BT ..`` of tile t // 2, and none where that half holds no routed row. ``SPLIT_LOOP``
(W4A16): the K loop's steps that refill within the program run untested (``_small_steps``). ``HALF_TILES`` (W4A16
tiles of 32 rows or more, with a route pack): a tile whose second half holds no route runs its K loop, MMAs (N = BT/2)
and activation copies on its first half (``_small_tile``, one instance per height). ``SCALE_BYTES``: the scale bytes
per row and load, 4 (K % 128 == 0) or 2.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .convert import E4M3_UNFOLDED_HI, E4M3_UNFOLDED_LO
from .sm90_operands import (_bf16_operand, _block_factor, _e4m3_addends, _e4m3_operands, _fold_addend, _fold_ref,
                            _fp8_chain, _fp8_wait, _fragment_bytes, _fragment_words, _fragment_words_layout,
                            _scale_word_factors, _scale_word_rows, _small_mma_layout, _times_row_fold, _times_row_ref)
from .sm90_pipeline import (_copy_pointers, _cta_barrier, _epilogue, _issue_stage, _launch_dependents, _origin,
                            _packed_layout, _wait_for_previous_kernel)


@gluon.jit
def _direct_expert(ids_ptr, expert_map_ptr, route, num_global, num_experts, HAS_MAP: gl.constexpr):
    """Local expert of route ``route`` straight from the (contiguous) top-k ids (int64; -1 where masked), by the rules of
    ``routing_kernels._local_experts``: ids outside [0, num_global) and ids the map sends to -1 are masked."""
    e = gl.load(ids_ptr + route).to(gl.int64)
    valid = (e >= 0) & (e < num_global)
    if HAS_MAP:
        e = gl.load(expert_map_ptr + gl.where(valid, e, 0)).to(gl.int64)
    valid = valid & (e >= 0) & (e < num_experts)
    return gl.where(valid, e, -1)


@gluon.jit
def _last_arrival(counter, ARRIVALS: gl.constexpr):
    """Whether this program is the last of ``ARRIVALS`` to arrive on ``counter`` (int32 in global memory): a CTA
    barrier, then one thread's GPU-scope acq_rel increment (its release covers every thread's earlier stores, as
    a semaphore release after ``__syncthreads``; its acquire, the last program's reads of the others' stores).
    The caller's last program resets the counter for the next call, which stream order puts after this kernel."""
    _cta_barrier()
    return gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == ARRIVALS - 1


@gluon.jit
def _store_columns(ptrs, values, cols, N, REPEAT_LAST: gl.constexpr):
    """A program's output columns ``cols``; with ``REPEAT_LAST`` (a pair at N % 128 == 64) those below N only (the
    last pair's second block is past N); else unmasked, as every column is the GEMM's."""
    if REPEAT_LAST:
        gl.store(ptrs, values, mask=cols < N)
    else:
        gl.store(ptrs, values)


@gluon.jit
def _sum_routes_if_last(routed_ptr, stride_routed, out_ptr, stride_out, counters_ptr, pid_n, pid_t, N,
                        WIDTH: gl.constexpr, TOP_K: gl.constexpr, REPEAT_LAST: gl.constexpr):
    """The top-k sum inside GEMM2 (``DIRECT``: program column t wrote route t's routed row; token t // TOP_K):
    each program arrives on its (token, column block) counter (``_last_arrival``); the last to arrive adds the
    token's ``TOP_K`` routed rows of the block in route order in FP32 (as ``elementwise.topk_sum_kernel``: the
    same bits; L2 reads, other SMs wrote them)."""
    token = pid_t // TOP_K
    counter = counters_ptr + token * gl.num_programs(0) + pid_n
    if _last_arrival(counter, TOP_K):
        L: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        cols = pid_n * WIDTH + gl.arange(0, WIDTH, layout=L)
        acc = gl.zeros([WIDTH], gl.float32, L)
        for k in gl.static_range(TOP_K):
            if REPEAT_LAST:  # (the last pair's second block: past N)
                acc += gl.load(routed_ptr + (token * TOP_K + k) * stride_routed + cols, mask=cols < N, other=0.0,
                               cache_modifier=".cg").to(gl.float32)
            else:
                acc += gl.load(routed_ptr + (token * TOP_K + k) * stride_routed + cols, cache_modifier=".cg").to(
                    gl.float32)
        _store_columns(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), cols, N, REPEAT_LAST)
        gl.store(counter, 0)


@gluon.jit
def _join_k_parts(acc_g, acc_u, parts_ptr, counters_ptr, pid_n, pid_t, BM: gl.constexpr, BT: gl.constexpr,
                  MMA: gl.constexpr):
    """``K_PARTS`` = 2 (direct GEMM1): programs (pid_n, pid_t, 0) and (pid_n, pid_t, 1) summed halves of the K
    steps. Each stores its FP32 sums of the tile's route (slot 0) in ``parts_ptr`` and arrives on the (route,
    column block) counter (``_last_arrival``); the second to arrive adds the other half's sums (a + b: the same
    bits whichever program is second) and returns ``last`` = True, so it alone runs the epilogue. Other slots
    hold no route and are left as they are."""
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    at = rows[:, None] + 0 * cols[None, :]  # [BM, BT]: each row's slot-0 sum, stored from column 0 only
    first_col = (cols == 0)[None, :] & (rows >= 0)[:, None]
    tile = pid_t * gl.num_programs(0) + pid_n
    mine = parts_ptr + (tile * 4 + gl.program_id(2) * 2).to(gl.int64) * BM + at
    gl.store(mine, acc_g, mask=first_col)
    gl.store(mine + BM, acc_u, mask=first_col)
    last = _last_arrival(counters_ptr + tile, 2)
    if last:
        other = parts_ptr + (tile * 4 + (1 - gl.program_id(2)) * 2).to(gl.int64) * BM + at
        acc_g = acc_g + gl.load(other, mask=first_col, other=0.0, cache_modifier=".cg")
        acc_u = acc_u + gl.load(other + BM, mask=first_col, other=0.0, cache_modifier=".cg")
        gl.store(counters_ptr + tile, 0)
    return acc_g, acc_u, last


@gluon.jit
def _small_ring(a_dtype: gl.constexpr, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                NUM_STAGES: gl.constexpr, U: gl.constexpr = 32):
    """One warpgroup's ``cp.async`` ring: packed weight tiles of each half (``_packed_layout`` of unit ``U``), gathered
    activation rows and a ``loaded`` barrier per stage (every thread of the warpgroup arrives)."""
    packed = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES * NH, BM, BK // 2], _packed_layout(BM, BK // 2, U))
    act = gl.allocate_shared_memory(a_dtype, [NUM_STAGES, BT, BK], gl.NVMMASharedLayout.get_default_for([BT, BK], a_dtype))
    loaded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(loaded.index(j), count=32 * 4)
    return packed, act, loaded


@gluon.jit
def _act_stage(act, s, BT: gl.constexpr):
    """Stage ``s`` of the activation ring, its first ``BT`` rows (a halved tile: ``HALF_TILES``)."""
    stage = act.index(s)
    if stage.shape[0] != BT:
        stage = stage.slice(0, BT)
    return stage


@gluon.jit
def _e4m3_row_addends(ref_ptr, w_row0, half_rows, sm, NH: gl.constexpr, FOLD: gl.constexpr, BM: gl.constexpr,
                      SC: gl.constexpr):
    """The E4M3 tables' addends of each row of both halves (the unfolded path: constant, scale byte 0)."""
    if FOLD:
        tlo_g, thi_g = _e4m3_addends(gl.load(ref_ptr + w_row0 + sm))
        tlo_u, thi_u = tlo_g, thi_g
        if NH == 2:
            tlo_u, thi_u = _e4m3_addends(gl.load(ref_ptr + w_row0 + half_rows + sm))
    else:
        tlo_g = gl.full([BM], E4M3_UNFOLDED_LO, gl.uint32, gl.SliceLayout(1, SC))
        thi_g = gl.full([BM], E4M3_UNFOLDED_HI, gl.uint32, gl.SliceLayout(1, SC))
        tlo_u, thi_u = tlo_g, thi_g
    return tlo_g, thi_g, tlo_u, thi_u


@gluon.jit
def _prologue(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, first_step, num_steps,
              NH: gl.constexpr, BK: gl.constexpr, U: gl.constexpr, NUM_STAGES: gl.constexpr,
              EARLY_WEIGHTS: gl.constexpr):
    """Stages 0 .. S-2 in flight (with ``EARLY_WEIGHTS`` their weights before the wait for the previous kernel, the
    rest after it)."""
    for j in gl.static_range(NUM_STAGES - 1):
        if j < num_steps:
            _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, j, first_step + j, NH, BK, U,
                         1 if EARLY_WEIGHTS else 0, True)
    if EARLY_WEIGHTS:
        _wait_for_previous_kernel()
        for j in gl.static_range(NUM_STAGES - 1):
            if j < num_steps:
                _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, j, first_step + j, NH,
                             BK, U, 2, True)


@gluon.jit
def _bf16_row_addends(ref_ptr, w_row0, half_rows, sm, NH: gl.constexpr):
    """W4A16's per-row addend of the block factors (``_fold_addend``) of both halves."""
    fac0_g = _fold_addend(_fold_ref(ref_ptr + w_row0 + sm))
    fac0_u = fac0_g
    if NH == 2:
        fac0_u = _fold_addend(_fold_ref(ref_ptr + w_row0 + half_rows + sm))
    return fac0_g, fac0_u


@gluon.jit
def _promoted_sums(zero, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr):
    """Shared memory for W4A8's FP32 sums of the promoted chains, zeroed (2-float pieces swizzled by row: a warp's
    accumulator registers, 8 rows x 4 pieces, hit 8 different bank pairs instead of one 8 ways)."""
    total = gl.allocate_shared_memory(gl.float32, [NH, BM, BT], gl.SwizzledSharedLayout(2, 1, 8, [1, 0]))
    for h in gl.static_range(NH):
        total.index(h).store(zero)
    return total


@gluon.jit
def _first_codes(packed, loaded, NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                 U: gl.constexpr, WL: gl.constexpr):
    """W4A16: the first step's codes of both halves (a step's codes are loaded during the step before); W4A8: none."""
    NB: gl.constexpr = BK // 32
    codes_g = gl.zeros([BM, NB, 4], gl.int32, WL)
    codes_u = codes_g
    if not FP8:
        mbarrier.wait(loaded.index(0), 0)
        codes_g = _fragment_words(packed.index(0), BM, BK, WL, U)
        if NH == 2:
            codes_u = _fragment_words(packed.index(1), BM, BK, WL, U)
    return codes_g, codes_u


@gluon.jit
def _fp8_step(packed, act, loaded, s, i, num_steps, cur_sg, cur_su, tlo_g, thi_g, tlo_u, thi_u, acc_g, acc_u, pg, pu,
              total, zero, sb, NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
              U: gl.constexpr, DOT: gl.constexpr, ROWS: gl.constexpr, SC: gl.constexpr, MMA: gl.constexpr,
              FOLD: gl.constexpr, PROMOTE: gl.constexpr, PROMOTE_SMEM: gl.constexpr):
    """One W4A8 K step from ring stage ``s``: the fast path (``_folded_step``; with ``PROMOTE`` its chains' sums go
    to the FP32 accumulators every P steps, in shared memory ``total`` with ``PROMOTE_SMEM``, where the chains'
    registers are all there is room for: the last chain is added after the loop), else the exact one."""
    mbarrier.wait(loaded.index(s), (i // NUM_STAGES) & 1)
    act_s = _act_stage(act, s, acc_g.shape[1])
    if FOLD:  # the blocks' scales in the E4M3 weights: one wgmma chain per half
        acc_g, acc_u, pg, pu = _folded_step(packed, act_s, s, i, cur_sg, cur_su, tlo_g, thi_g, tlo_u, thi_u, acc_g,
                                            acc_u, pg, pu, NH, BM, BK, U, DOT, PROMOTE)
        if PROMOTE > 0:
            if PROMOTE_SMEM:
                if ((i + 1) % PROMOTE == 0) & (i + 1 < num_steps):
                    total.index(0).store(total.index(0).load(MMA) + pg)
                    if NH == 2:
                        total.index(1).store(total.index(1).load(MMA) + pu)
            elif ((i + 1) % PROMOTE == 0) | (i + 1 == num_steps):
                acc_g += pg
                if NH == 2:
                    acc_u += pu
    else:  # unfolded (rows of wider spans): each block's partial sum times its scale in FP32
        acc_g, acc_u, pg, pu = _unfolded_step(packed, act_s, s, cur_sg, cur_su, tlo_g, thi_g, tlo_u, thi_u, acc_g,
                                              acc_u, zero, sb, NH, BM, BK, U, DOT, ROWS, SC)
    return acc_g, acc_u, pg, pu


@gluon.jit
def _folded_step(packed, act_s, s, i, cur_sg, cur_su, tlo_g, thi_g, tlo_u, thi_u, acc_g, acc_u, pg, pu,
                 NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, U: gl.constexpr, DOT: gl.constexpr,
                 PROMOTE: gl.constexpr):
    """One K step of W4A8's fast path: the blocks' scales folded into the E4M3 weights, one wgmma chain per half
    (the up half converted while the gate half's MMAs run); with ``PROMOTE`` = P > 0 into the chains ``pg`` / ``pu``
    that restart every P steps (the caller adds them to FP32), else into the accumulators."""
    NB: gl.constexpr = BK // 32
    ops_g = _e4m3_operands(_fragment_bytes(packed.index(s * NH), BM, BK, U), cur_sg, tlo_g, thi_g, BM, BK, DOT)
    if PROMOTE > 0:
        chained = i % PROMOTE != 0  # (False: a chain starts from zero)
        pg = _fp8_chain(ops_g, act_s, pg, NB, chained)
    else:
        acc_g = _fp8_chain(ops_g, act_s, acc_g, NB)
    if NH == 2:
        ops_u = _e4m3_operands(_fragment_bytes(packed.index(s * NH + 1), BM, BK, U), cur_su, tlo_u, thi_u, BM, BK, DOT)
        if PROMOTE > 0:
            pu = _fp8_chain(ops_u, act_s, pu, NB, chained)
        else:
            acc_u = _fp8_chain(ops_u, act_s, acc_u, NB)
    if PROMOTE > 0:
        pg, pu = _fp8_wait(pg, pu, NH)
    else:
        acc_g, acc_u = _fp8_wait(acc_g, acc_u, NH)
    return acc_g, acc_u, pg, pu


@gluon.jit
def _unfolded_step(packed, act_s, s, cur_sg, cur_su, tlo_g, thi_g, tlo_u, thi_u, acc_g, acc_u, zero, sb,
                   NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, U: gl.constexpr, DOT: gl.constexpr,
                   ROWS: gl.constexpr, SC: gl.constexpr):
    """One K step of W4A8's exact path: one wgmma per K32 block from zero, its partial sum times the block's factor
    into the FP32 accumulators."""
    NB: gl.constexpr = BK // 32
    no_b = gl.zeros([BM, NB], gl.int32, SC)
    ops_g = _e4m3_operands(_fragment_bytes(packed.index(s * NH), BM, BK, U), no_b, tlo_g, thi_g, BM, BK, DOT)
    if NH == 2:
        ops_u = _e4m3_operands(_fragment_bytes(packed.index(s * NH + 1), BM, BK, U), no_b, tlo_u, thi_u, BM, BK, DOT)
    pg = zero
    pu = zero
    for b in gl.static_range(NB):
        xb = act_s.slice(32 * b, 32, dim=1).permute((1, 0))
        fac_g = gl.convert_layout(_block_factor(gl.sum(gl.where(sb[None, :] == b, cur_sg, 0), axis=1)), ROWS)
        pg = warpgroup_mma(ops_g[b], xb, zero, use_acc=False, is_async=True)
        if NH == 2:
            fac_u = gl.convert_layout(_block_factor(gl.sum(gl.where(sb[None, :] == b, cur_su, 0), axis=1)), ROWS)
            pu = warpgroup_mma(ops_u[b], xb, zero, use_acc=False, is_async=True)
            pg, pu = warpgroup_mma_wait(0, deps=(pg, pu))
            acc_u += pu * fac_u[:, None]
        else:
            pg = warpgroup_mma_wait(0, deps=(pg, ))
        acc_g += pg * fac_g[:, None]
    return acc_g, acc_u, pg, pu


@gluon.jit
def _bf16_step(packed, act, loaded, s, i, num_steps, codes_g, codes_u, cur_wg, cur_wu, fac0_g, fac0_u, acc_g, acc_u,
               g: gl.constexpr, TAIL: gl.constexpr, NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
               NUM_STAGES: gl.constexpr, U: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr, SC: gl.constexpr):
    """One K step of W4A16 (step ``g`` of its scale load's group): the next step's codes loaded (shared) while this
    step's, converted with the block factors, go to the MMA; returns the accumulators and the next codes."""
    NB: gl.constexpr = BK // 32
    PAIRED: gl.constexpr = NB % 2 == 0
    # BF16x2 2**(126 + b - r): one multiply-add per (row, block), or per two blocks where NB is even (``PAIRED``); no
    # clamp (the field is in [0, 254])
    f_g = _scale_word_factors(cur_wg, g * NB, fac0_g, NB, SC)
    f_u = _scale_word_factors(cur_wu, g * NB, fac0_u, NB, SC)
    cur_g = codes_g
    cur_u = codes_u
    if TAIL == 0 or i + 1 < num_steps:
        t = (i + 1) % NUM_STAGES
        mbarrier.wait(loaded.index(t), ((i + 1) // NUM_STAGES) & 1)
        codes_g = _fragment_words(packed.index(t * NH), BM, BK, WL, U)
        if NH == 2:
            codes_u = _fragment_words(packed.index(t * NH + 1), BM, BK, WL, U)
    xb = _act_stage(act, s, acc_g.shape[1]).permute((1, 0))
    acc_g = warpgroup_mma(_bf16_operand(cur_g, f_g, BM, BK, WL, DOT, PAIRED), xb, acc_g, is_async=True)
    if NH == 2:
        acc_u = warpgroup_mma(_bf16_operand(cur_u, f_u, BM, BK, WL, DOT, PAIRED), xb, acc_u, is_async=True)
        acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
    return acc_g, acc_u, codes_g, codes_u


@gluon.jit
def _small_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0, slot0,
                 half_rows, K, top_k, first_step, num_steps, GEMM1: gl.constexpr, NH: gl.constexpr, FP8: gl.constexpr,
                 BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                 SCALE_BYTES: gl.constexpr, U: gl.constexpr, EARLY_WEIGHTS: gl.constexpr = False,
                 DIRECT: gl.constexpr = False, SPLIT_LOOP: gl.constexpr = False, FOLD: gl.constexpr = False,
                 PROMOTE: gl.constexpr = 0, PROMOTE_SMEM: gl.constexpr = False):
    """K steps ``first_step .. first_step + num_steps - 1`` of a small-tile program on one warpgroup's ring
    (``packed``, ``act``, ``loaded``): returns the FP32 accumulators of the ``NH`` halves, whose weight rows
    start ``half_rows`` apart (W4A16: still to be multiplied by 2**(r - 127) per row, ``_times_row_ref``; W4A8 with
    ``FOLD``: by 2**(ref - 133), ``_times_row_fold``). ``EARLY_WEIGHTS``:
    the first stages' weight copies go out before the wait for the previous kernel (whose output the
    activation rows are), the rest after it. ``SPLIT_LOOP`` (W4A16): the K loop in an untested and a tested part
    (see the loop). W4A8: ``FOLD`` (the fast path) each block's scale in its E4M3 weights, the FP8 accumulator chained
    over the blocks of a step and, with ``PROMOTE`` = P > 0, over P steps, then added to the FP32 accumulators (P = 0:
    over all steps; ``PROMOTE_SMEM``: those in shared memory, for tiles whose chains take all the registers); else one wgmma per block from zero, times its 2**(b - 122) into the FP32 accumulators."""
    NB: gl.constexpr = BK // 32
    MMA: gl.constexpr = _small_mma_layout(BT, FP8)
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4 if FP8 else 2)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    SC: gl.constexpr = gl.SliceLayout(2, WL)  # [BM, NB]: one value per (row, block)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    w_ptrs, a_ptrs, ok, row_bytes = _copy_pointers(w_ptr, a_ptr, stride_a, sorted_routes_ptr, slot0, top_k, w_row0, K,
                                                   GEMM1, BM, BT, BK, U, DIRECT, half_rows, NH)

    # scale bytes, one value per (row, block) of the thread's operand, and W4A16's per-row addend of the block
    # factors (``_fold_addend``)
    sm = gl.arange(0, BM, layout=gl.SliceLayout(1, SC))
    sb = gl.arange(0, NB, layout=gl.SliceLayout(0, SC))
    if FP8:
        tlo_g, thi_g, tlo_u, thi_u = _e4m3_row_addends(ref_ptr, w_row0, half_rows, sm, NH, FOLD, BM, SC)
    else:
        fac0_g, fac0_u = _bf16_row_addends(ref_ptr, w_row0, half_rows, sm, NH)
    _prologue(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, first_step, num_steps, NH, BK, U,
              NUM_STAGES, EARLY_WEIGHTS)

    zero = gl.zeros((BM, BT), gl.float32, MMA)
    acc_g = zero
    acc_u = zero
    pg = zero  # W4A8 with PROMOTE: the FP8 chains' sums since their last promotion
    pu = zero
    total = zero  # (a placeholder: shared memory only with PROMOTE_SMEM)
    if PROMOTE_SMEM:  # ... and the FP32 sums of the earlier chains in shared memory (``pg``, ``pu`` the accumulators)
        total = _promoted_sums(zero, NH, BM, BT)
    # scale bytes: one load of SCALE_BYTES per row (4: K % 128 == 0, a row's bytes start 4-byte aligned; 2: K % 64 ==
    # 0, gpt-oss's 2880) for G = SCALE_BYTES / NB steps, loaded one group before its use (byte loads per step crowd
    # the memory-instruction queue: docs/perf-notes.md steps 10 and 54); W4A8 takes its bytes out by shifts, W4A16 its
    # factors (``_scale_word_factors``: two blocks' per word where NB is even). 16-bit loads come
    # sign-extended: both read their two bytes only
    G: gl.constexpr = SCALE_BYTES // NB
    w_rows = _scale_word_rows(s_ptr, w_row0, sm, K, SCALE_BYTES) + first_step // G
    up_words = half_rows * (K // (32 * SCALE_BYTES))
    nxt_wg = gl.load(w_rows).to(gl.int32)
    nxt_wu = nxt_wg
    if NH == 2:
        nxt_wu = gl.load(w_rows + up_words).to(gl.int32)
    codes_g, codes_u = _first_codes(packed, loaded, NH, FP8, BM, BK, U, WL)
    # ``SPLIT_LOOP``: the K loop in two parts, first the scale-word groups all of whose steps refill the ring, load the
    # next codes and the next scale word within these steps (no per-step tests: each costs instructions in every step),
    # then the last ones (at most NUM_STAGES - 1 steps, rounded up to a group), tested; else the tested loop alone
    n_main = gl.maximum((num_steps - NUM_STAGES + 1) // G, 0) if SPLIT_LOOP else 0
    for TAIL in gl.static_range(0 if SPLIT_LOOP else 1, 2):
        for jg in range(0 if TAIL == 0 else n_main, n_main if TAIL == 0 else gl.cdiv(num_steps, G)):
            cur_wg = nxt_wg
            cur_wu = nxt_wu
            if TAIL == 0 or (jg + 1) * G < num_steps:
                nxt_wg = gl.load(w_rows + jg + 1).to(gl.int32)
                if NH == 2:
                    nxt_wu = gl.load(w_rows + up_words + jg + 1).to(gl.int32)
            for g in gl.static_range(G):
                i = jg * G + g
                if TAIL == 0 or i < num_steps:
                    s = i % NUM_STAGES
                    # refill the slot the previous step read (its MMA has completed: each step waits for it)
                    nxt = i + NUM_STAGES - 1
                    if TAIL == 0 or nxt < num_steps:
                        _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, nxt % NUM_STAGES,
                                     first_step + nxt, NH, BK, U, 0, True)
                    if FP8:
                        shift = (8 * (g * NB + sb))[None, :]
                        cur_sg = (cur_wg[:, None] >> shift) & 0xFF
                        cur_su = (cur_wu[:, None] >> shift) & 0xFF
                        acc_g, acc_u, pg, pu = _fp8_step(packed, act, loaded, s, i, num_steps, cur_sg, cur_su, tlo_g,
                                                         thi_g, tlo_u, thi_u, acc_g, acc_u, pg, pu, total, zero, sb,
                                                         NH, BM, BK, NUM_STAGES, U, DOT, ROWS, SC, MMA, FOLD, PROMOTE,
                                                         PROMOTE_SMEM)
                    else:
                        acc_g, acc_u, codes_g, codes_u = _bf16_step(packed, act, loaded, s, i, num_steps, codes_g,
                                                                    codes_u, cur_wg, cur_wu, fac0_g, fac0_u,
                                                                    acc_g, acc_u, g, TAIL, NH, BM, BK, NUM_STAGES,
                                                                    U, WL, DOT, SC)
    if PROMOTE_SMEM:
        acc_g = total.index(0).load(MMA) + pg
        if NH == 2:
            acc_u = total.index(1).load(MMA) + pu
    return acc_g, acc_u


@gluon.jit
def _first_half_steps(num_k, NB: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """K steps of the first of two halves of ``num_k`` (the K split over two warpgroups or two programs), at whole
    scale-load groups (``_small_steps``: SCALE_BYTES / NB steps per load)."""
    G: gl.constexpr = SCALE_BYTES // NB
    return (num_k // (2 * G)) * G


@gluon.jit
def _small_steps_to_shared(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0, slot0,
                           half_rows, K, top_k, first_step, num_steps, partial, done, GEMM1: gl.constexpr,
                           NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                           NUM_STAGES: gl.constexpr, SCALE_BYTES: gl.constexpr, U: gl.constexpr,
                           DIRECT: gl.constexpr = False, SPLIT_LOOP: gl.constexpr = False, FOLD: gl.constexpr = False,
                           PROMOTE: gl.constexpr = 0):
    """``_small_steps`` on the second warpgroup of a K-split program: its accumulators go to ``partial``
    (shared), then one arrive on ``done``."""
    _wait_for_previous_kernel()  # (the default partition waited too; this partition's reads must not pass it)
    acc_g, acc_u = _small_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0,
                                slot0, half_rows, K, top_k, first_step, num_steps, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES,
                                SCALE_BYTES, U, False, DIRECT, SPLIT_LOOP, FOLD, PROMOTE)
    partial.index(0).store(acc_g)
    if NH == 2:
        partial.index(1).store(acc_u)
    mbarrier.arrive(done)


@gluon.jit
def _split_k_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0, slot0,
                   half_rows, K, top_k, num_k, GEMM1: gl.constexpr, NH: gl.constexpr, FP8: gl.constexpr,
                   BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                   SCALE_BYTES: gl.constexpr, U: gl.constexpr, DIRECT: gl.constexpr, SPLIT_LOOP: gl.constexpr,
                   FOLD: gl.constexpr, PROMOTE: gl.constexpr, SPLIT_REGS: gl.constexpr, MMA: gl.constexpr):
    """``KSPLIT=2``: a second warpgroup runs the second half of the K steps on its own ring (decode: one program per
    SM issues too few instructions per cycle); its sums are added after the first half's, in that order."""
    NB: gl.constexpr = BK // 32
    packed2, act2, loaded2 = _small_ring(a_ptr.dtype.element_ty, NH, BM, BT, BK, NUM_STAGES, U)
    partial = gl.allocate_shared_memory(gl.float32, [NH, BM, BT], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done, count=1)
    half = _first_half_steps(num_k, NB, SCALE_BYTES)
    acc_g, acc_u = gl.warp_specialize([
        (_small_steps, (a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0, slot0,
                        half_rows, K, top_k, 0, half, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES, SCALE_BYTES, U, False,
                        DIRECT, SPLIT_LOOP, FOLD, PROMOTE)),
        (_small_steps_to_shared, (a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed2, act2, loaded2,
                                  w_row0, slot0, half_rows, K, top_k, half, num_k - half, partial, done, GEMM1, NH,
                                  FP8, BM, BT, BK, NUM_STAGES, SCALE_BYTES, U, DIRECT, SPLIT_LOOP, FOLD, PROMOTE)),
    ], [4], [SPLIT_REGS])
    mbarrier.wait(done, 0)
    acc_g = acc_g + partial.index(0).load(MMA)
    if NH == 2:
        acc_u = acc_u + partial.index(1).load(MMA)
    return acc_g, acc_u


@gluon.jit
def _small_epilogue(acc_g, acc_u, a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                    topk_weights_ptr, expert, w_row0, n0, slot0, half_rows, N, top_k, limit, alpha,
                    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr, HAS_BIAS: gl.constexpr,
                    HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, OUT_I64: gl.constexpr,
                    MMA: gl.constexpr, DIRECT: gl.constexpr, NH: gl.constexpr, PAIR: gl.constexpr,
                    FOLD: gl.constexpr):
    """The row exponents (W4A16: 2**(r - 127); W4A8 folded: 2**(ref - 133)) and the epilogue of the tile's rows,
    with ``PAIR`` of both blocks."""
    if not FP8:
        acc_g, acc_u = _times_row_ref(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH, BM, gl.SliceLayout(1, MMA))
    elif FOLD:
        acc_g, acc_u = _times_row_fold(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH, BM, gl.SliceLayout(1, MMA))
    _epilogue(acc_g, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
              topk_weights_ptr, expert, w_row0, n0, slot0, N, top_k, limit, alpha, GEMM1, SWIGLUOAI, FP8, HAS_BIAS,
              HAS_GSCALE, BM, BT, OUT_I64, MMA, DIRECT)
    if PAIR:  # the second block's rows
        _epilogue(acc_u, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                  topk_weights_ptr, expert, w_row0 + half_rows, n0 + BM, slot0, N, top_k, limit, alpha, GEMM1,
                  SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, BM, BT, OUT_I64, MMA, DIRECT)


@gluon.jit
def _small_tile(a, w, pack, out, dims, joins, packed, act, loaded, tile, BT: gl.constexpr, GEMM1: gl.constexpr,
                SWIGLUOAI: gl.constexpr, FP8: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
                NH: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr,
                SCALE_BYTES: gl.constexpr, KSPLIT: gl.constexpr, PAIR: gl.constexpr, EARLY_WEIGHTS: gl.constexpr,
                W_UNIT: gl.constexpr, DIRECT: gl.constexpr, SPLIT_REGS: gl.constexpr, K_PARTS: gl.constexpr,
                SPLIT_LOOP: gl.constexpr, FOLD: gl.constexpr, PROMOTE: gl.constexpr, PROMOTE_SMEM: gl.constexpr):
    """A program's tile (``tile``: its expert, first output column, weight row, slot and the halves' distance, the
    program ids) on ``BT`` routed rows as the MMAs' N, the entry kernel's tile height or its first half (the ring's
    activation stages then copied and read on their first ``BT`` rows): the K steps, the K parts' join and the
    epilogue."""
    a_ptr, a_scale_ptr, stride_a = a
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr = pack
    out_ptr, stride_out, topk_weights_ptr = out
    N, K, top_k, limit, alpha = dims
    sum_out_ptr, stride_sum_out, counters_ptr, parts_ptr = joins
    expert, n0, w_row0, slot0, half_rows, pid_n, pid_t = tile
    NB: gl.constexpr = BK // 32
    num_k = K // BK
    MMA: gl.constexpr = _small_mma_layout(BT, FP8)
    if KSPLIT == 1:
        first_k = 0
        steps = num_k
        if K_PARTS == 2:  # program (pid_n, pid_t, p) runs part p of the K steps
            part = _first_half_steps(num_k, NB, SCALE_BYTES)
            first_k = gl.program_id(2) * part
            steps = part + gl.program_id(2) * (num_k - 2 * part)
        acc_g, acc_u = _small_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act,
                                    loaded, w_row0, slot0, half_rows, K, top_k, first_k, steps, GEMM1, NH, FP8,
                                    BM, BT, BK, NUM_STAGES, SCALE_BYTES, W_UNIT, EARLY_WEIGHTS, DIRECT,
                                    SPLIT_LOOP, FOLD, PROMOTE, PROMOTE_SMEM)
    else:
        acc_g, acc_u = _split_k_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded,
                                      w_row0, slot0, half_rows, K, top_k, num_k, GEMM1, NH, FP8, BM, BT, BK,
                                      NUM_STAGES, SCALE_BYTES, W_UNIT, DIRECT, SPLIT_LOOP, FOLD, PROMOTE,
                                      SPLIT_REGS, MMA)
    last = True
    if K_PARTS == 2:  # the second of the two programs to finish adds the first's sums and does the epilogue
        acc_g, acc_u, last = _join_k_parts(acc_g, acc_u, parts_ptr, counters_ptr, pid_n, pid_t, BM, BT, MMA)
    if last:
        _small_epilogue(acc_g, acc_u, a_scale_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr,
                        stride_out, topk_weights_ptr, expert, w_row0, n0, slot0, half_rows, N, top_k, limit, alpha,
                        GEMM1, SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, BM, BT, OUT_I64, MMA, DIRECT, NH, PAIR, FOLD)


@gluon.jit
def moe_gemm_small_kernel(
    a, w, pack, out, dims, direct, joins, fold_ptr,
    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
    BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
    OUT_I64: gl.constexpr = True, SCALE_BYTES: gl.constexpr = 4, KSPLIT: gl.constexpr = 1,
    PAIR: gl.constexpr = False, EARLY_WEIGHTS: gl.constexpr = False, W_UNIT: gl.constexpr = 64,
    DIRECT: gl.constexpr = False, HAS_MAP: gl.constexpr = False, SUM_ROUTES: gl.constexpr = False,
    TOP_K: gl.constexpr = 0, SPLIT_REGS: gl.constexpr = 128, K_PARTS: gl.constexpr = 1,
    SUB_TILES: gl.constexpr = 1, SPLIT_LOOP: gl.constexpr = False, FOLD: gl.constexpr = False,
    PROMOTE: gl.constexpr = 0, PROMOTE_SMEM: gl.constexpr = False, REPEAT_LAST: gl.constexpr = False,
    HALF_TILES: gl.constexpr = False,
):
    """The ``moe_gemm_kernel`` contract for small route tiles on one warpgroup; its flags: the module docstring."""
    a_ptr, a_scale_ptr, stride_a = a
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr = pack
    out_ptr, stride_out, topk_weights_ptr = out
    N, K, top_k, limit, alpha = dims
    ids_ptr, expert_map_ptr, num_global, num_experts = direct
    sum_out_ptr, stride_sum_out, counters_ptr, parts_ptr = joins
    gl.static_assert(BM == 64 and gl.num_warps() == 4)
    gl.static_assert(not FP8 or BK <= 128)
    gl.static_assert(not (PAIR and GEMM1))
    gl.static_assert(not REPEAT_LAST or PAIR)
    gl.static_assert(not SUM_ROUTES or (DIRECT and not GEMM1 and TOP_K > 0))
    gl.static_assert(K_PARTS == 1 or (K_PARTS == 2 and DIRECT and GEMM1 and KSPLIT == 1))
    gl.static_assert(BT <= 128)  # (the 256-row tiles: sm90_wide.moe_gemm_wide_kernel)
    gl.static_assert(not SPLIT_LOOP or not FP8)
    gl.static_assert(not HALF_TILES or (KSPLIT == 1 and K_PARTS == 1 and SUB_TILES == 1 and BT >= 16))
    gl.static_assert(not PROMOTE_SMEM or (FOLD and PROMOTE > 0 and KSPLIT == 1))
    # programmatic dependent launch: wait for the previous kernel before reading what it wrote, on every path.
    # GEMM2 with ``EARLY_WEIGHTS`` reads the route pack and copies its first weight stages first: the kernel
    # before it is either a plain launch (W4A8's row quantizer) or GEMM1, which lets it launch only after its
    # own wait (so the pack is complete) once all GEMM1 programs run, and the copies overlap GEMM1's tail
    gl.static_assert(not EARLY_WEIGHTS or (KSPLIT == 1 and not GEMM1))
    if not EARLY_WEIGHTS:
        _wait_for_previous_kernel()
    if GEMM1:
        _launch_dependents()
    pid_n = gl.program_id(0)
    pid_t = gl.program_id(1)
    if DIRECT:
        expert = _direct_expert(ids_ptr, expert_map_ptr, pid_t, num_global, num_experts, HAS_MAP)
        has_tile = expert >= 0
    else:
        expert = gl.load(tile_expert_ptr + pid_t // SUB_TILES).to(gl.int64)
        has_tile = pid_t // SUB_TILES < gl.load(num_tiles_ptr)
        if SUB_TILES > 1:  # a pack of SUB_TILES * BT-row tiles, BT rows per program: skip the parts without a row
            has_tile = has_tile & (gl.load(sorted_routes_ptr + pid_t * BT) >= 0)
        if FP8:  # the fast path takes the experts that fold, the exact slower path the others
            has_tile = has_tile & ((gl.load(fold_ptr + gl.where(has_tile, expert, 0)) != 0) == FOLD)
    WIDTH: gl.constexpr = 2 * BM if PAIR else BM  # output columns per program
    if has_tile:
        NH: gl.constexpr = 2 if GEMM1 or PAIR else 1
        # GEMM1: gate rows, up rows N further; PAIR: 2 * BM consecutive rows
        expert, n0, w_row0, slot0 = _origin(expert, pid_t, pid_n, N, 2 if GEMM1 else 1, WIDTH, BT)
        half_rows = N if GEMM1 else BM
        if REPEAT_LAST:  # PAIR at N % 128 == 64 (gpt-oss's 2880): the last program's second block repeats its first,
            half_rows = gl.minimum(BM, N - BM - n0)  # unstored
        a_dtype: gl.constexpr = a_ptr.dtype.element_ty
        packed, act, loaded = _small_ring(a_dtype, NH, BM, BT, BK, NUM_STAGES, W_UNIT)
        tile = (expert, n0, w_row0, slot0, half_rows, pid_n, pid_t)
        # HALF_TILES: a tile whose second half holds no route runs its MMAs and activation copies on its first half
        # (without a route pack every tile holds one route: DIRECT takes the full height)
        HEIGHTS: gl.constexpr = 2 if HALF_TILES and not DIRECT else 1
        halved = False
        if HEIGHTS == 2:
            halved = gl.load(sorted_routes_ptr + slot0 + BT // 2) < 0
        for h in gl.static_range(HEIGHTS):  # (one instance per height, the tile runs one)
            if halved == (h == 1):
                _small_tile(a, w, pack, out, dims, joins, packed, act, loaded, tile, BT >> h,
                            GEMM1, SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, NH, BM, BK, NUM_STAGES, OUT_I64, SCALE_BYTES,
                            KSPLIT, PAIR, EARLY_WEIGHTS, W_UNIT, DIRECT, SPLIT_REGS, K_PARTS, SPLIT_LOOP, FOLD, PROMOTE,
                            PROMOTE_SMEM)
    else:
        if EARLY_WEIGHTS:
            # a program without a tile waits too: a kernel must not complete before the one it follows (else the
            # next kernel's wait would not cover GEMM1, which may still be running)
            _wait_for_previous_kernel()
        if DIRECT and not GEMM1:  # a masked route's row of the routed output is zero (the top-k sum adds it)
            ZL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            cols = pid_n * WIDTH + gl.arange(0, WIDTH, layout=ZL)
            _store_columns(out_ptr + pid_t.to(gl.int64) * stride_out + cols,
                           gl.zeros_like(cols).to(out_ptr.dtype.element_ty), cols, N, REPEAT_LAST)
    if SUM_ROUTES:
        _sum_routes_if_last(out_ptr, stride_out, sum_out_ptr, stride_sum_out, counters_ptr, pid_n, pid_t, N, WIDTH,
                            TOP_K, REPEAT_LAST)
