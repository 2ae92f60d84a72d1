"""Hopper main loops of the MoE GEMM template in Gluon.

Same contract and arguments as :func:`gemm.moe_gemm_kernel` (``W · Aᵀ``: weight rows are the
MMA's M, routed rows its N; the small-tile kernel takes the direct path's arguments besides). Two kernels:

- ``moe_gemm_small_kernel`` (both precisions; every GEMM in the default selection but one case below):
  one warpgroup reads exactly its wgmma register-operand words of the prepared (``interleave_block_bits``)
  weights and converts them in registers; no shared-memory round trip for the converted weights (see
  below); two accumulator chains (GEMM1's gate and up halves, GEMM2's two row blocks with ``PAIR``) let
  one convert while the other's MMA runs; for decode grids smaller than the SM count, two warpgroups
  split the K steps; for a few W4A16 tokens (``launch.direct_routes``) no route pack (a tile per route,
  the experts from the top-k ids) and GEMM2 also does the top-k sum; for W4A16 prefill past ~132 rows per
  expert (``WIDE``) 256-row tiles on two warpgroups, one chain of 64 x 256 each, persistent (``_wide_gemm1``), and
  GEMM2 likewise (``_wide_gemm2``; or on the tiles' 128-row halves, ``SUB_TILES``).
- ``moe_gemm_ws_kernel`` (W4A16; in the default selection GEMM2 on 128-row tiles with N % 128 != 0): persistent,
  warp-specialized, async wgmma. Plain Triton 3.6 waits on every wgmma, so conversion and MMA never
  overlap there; here the partitions run concurrently, each walking the program's tiles:

  - loader (4 warps): 16-B ``cp.async`` of the packed E2M1 tiles (gate and up rows) and of the
    gathered activation rows into a ring of ``NUM_STAGES`` stages (no TMA gather on sm90);
  - converter (4 warps): E2M1 -> BF16 with the K32 block scale folded (as in ``gemm``; K order) by
    inline asm, stored as 32-bit words into the stage's NVMMA-swizzled tile;
  - MMA + epilogue (default partition, one or two warpgroups): async ``warpgroup_mma`` on shared
    operands chaining the stages into the FP32 accumulators with one stage in flight; a tile's
    epilogue runs while the other partitions fill the ring with the next tile's stages.

  Barriers per stage: ``loaded`` (every loader thread's cp.async landed), ``converted``
  (weights converted), ``consumed`` (the stage's MMAs finished: activation, converted and
  packed buffers may be refilled).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .convert import (E2M1X8_TO_BF16_HALVES_ASM, E2M1X8_TO_BF16_HALVES_HI_ASM, E2M1X8_TO_BF16_HALVES_LO_ASM,
                      E2M1X8_TO_BF16_KORDER_ASM, E2M1X8_TO_E4M3_TABLE_ASM, E4M3_TABLE_HI_BASE, E4M3_TABLE_LO_BASE,
                      E4M3_UNFOLDED_HI, E4M3_UNFOLDED_LO, FOLD_REF_MAX)

LOADER_WARPS = gl.constexpr(4)
CONVERTER_WARPS = gl.constexpr(4)
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier  # Triton 3.6 / 3.8 names
# Triton >= 3.9 renamed the cp.async copy (the old name raises there) and made shared-memory views' reinterpret public
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """``smem`` viewed as ``dtype`` ``shape`` in ``layout`` (the same bytes), on every Triton."""
    if _PUBLIC_REINTERPRET:
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _wait_for_previous_kernel():
    """``griddepcontrol.wait``: with programmatic dependent launch the kernel may start before the previous one
    in the stream finished; this waits for it and for its memory (a no-op on a plain launch)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _launch_dependents():
    """``griddepcontrol.launch_dependents``: the next kernel (launched with PDL) may start once every program of
    this one got here; only after this program's own wait, so that all kernels before this one are complete."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _pow2(exp):
    """2.0**exp as FP32 for int32 exp in [-252, 254] (two normal factors; see ``convert.pow2``)."""
    lo = gl.minimum(gl.maximum(exp, -126), 127)
    hi = exp - lo
    return ((lo + 127) << 23).to(gl.float32, bitcast=True) * ((hi + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _block_factor(b):
    """FP32 2**(b - 122) for scale bytes b in [0, 255] (W4A8's unfolded path: the partial sum of E2M1 * 2**-5 times it
    is the block's exact contribution): the exponent field b + 5 itself, inf from b = 250 on (where 2**(b - 122) times
    the largest E2M1 overflows anyway), two integer operations."""
    return (gl.minimum(b + 5, 255) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_addends(ref):
    """Per row, the addends of the W4A8 fast path's E4M3 table words from its reference byte ``ref``, its largest scale
    byte: b * 0x08080800 + lo and b * 0x08080808 + hi are a block's table words for scale byte b (o = b + 12 - ref,
    ``convert.E2M1X8_TO_E4M3_TABLE_ASM``); uint32, wrapping products."""
    o0 = (12 - ref).to(gl.uint32, bitcast=True)
    return o0 * 0x08080800 + E4M3_TABLE_LO_BASE, o0 * 0x08080808 + E4M3_TABLE_HI_BASE


@gluon.jit
def _times_row_fold(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH: gl.constexpr, BM: gl.constexpr, ROWS: gl.constexpr):
    """W4A8 fast-path accumulators times each weight row's 2**(ref - 133) (its blocks folded into E4M3 as 2**(b + 6 -
    ref), ``_e4m3_addends``); the second half's rows start ``half_rows`` after the first's."""
    offs_r = gl.arange(0, BM, layout=ROWS)
    acc_g = acc_g * _pow2(gl.load(ref_ptr + w_row0 + offs_r) - 133)[:, None]
    if NH == 2:
        acc_u = acc_u * _pow2(gl.load(ref_ptr + w_row0 + half_rows + offs_r) - 133)[:, None]
    return acc_g, acc_u


@gluon.jit
def _fold_ref(ref_ptrs):
    """The reference exponents the W4A16 blocks are folded relative to (``convert.FOLD_REF_MAX``)."""
    return gl.minimum(gl.load(ref_ptrs), FOLD_REF_MAX)


@gluon.jit
def _fold_addend(ref):
    """Per row, the addend of the W4A16 block factors' BF16x2 bits, from the folded reference ``ref`` (``_fold_ref``):
    (FOLD_REF_MAX + b - ref) * 0x00800080 = b * 0x00800080 + this, one multiply-add per (row, block) (per two blocks
    with ``_paired_factors``)."""
    return _opaque((FOLD_REF_MAX - ref) * 0x00800080)[:, None]


@gluon.jit
def _scale_word_rows(s_ptr, w_row0, rows, K):
    """Each weight row's scale bytes as 32-bit words (``SCALE_WORDS``: K % 128 == 0, so a row starts 4-byte aligned)."""
    return (s_ptr + (w_row0 + rows.to(gl.int64)) * (K // 32)).to(gl.pointer_type(gl.int32), bitcast=True)


@gluon.jit
def _opaque(x):
    """``x`` (int32) through an asm move: the compiler cannot factor it, so that ``b * c + _opaque(d * c)``
    stays one multiply-add instead of becoming ``(b + d) * c``, an add and a multiply."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _times_row_ref(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH: gl.constexpr, BM: gl.constexpr, ROWS: gl.constexpr):
    """W4A16 accumulators times each weight row's 2**(r - 127) (the blocks were folded relative to r,
    ``_fold_ref``); the second half's rows start ``half_rows`` after the first's."""
    offs_r = gl.arange(0, BM, layout=ROWS)
    acc_g = acc_g * _pow2(_fold_ref(ref_ptr + w_row0 + offs_r) - 127)[:, None]
    if NH == 2:
        acc_u = acc_u * _pow2(_fold_ref(ref_ptr + w_row0 + half_rows + offs_r) - 127)[:, None]
    return acc_g, acc_u


@gluon.jit
def _tile_origin(tile_expert_ptr, pid_t, pid_n, N, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr):
    """(expert, first output row n0, first weight row, first route-pack slot) of program (pid_n, pid_t), whose
    BM output rows are the pid_n-th of an expert's N (``NH`` * N weight rows per expert)."""
    return _origin(gl.load(tile_expert_ptr + pid_t).to(gl.int64), pid_t, pid_n, N, NH, BM, BT)


@gluon.jit
def _origin(expert, pid_t, pid_n, N, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr):
    n0 = pid_n * BM
    return expert, n0, expert * (NH * N) + n0, pid_t * BT


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
def _sum_routes_if_last(routed_ptr, stride_routed, out_ptr, stride_out, counters_ptr, pid_n, pid_t,
                        WIDTH: gl.constexpr, TOP_K: gl.constexpr):
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
            acc += gl.load(routed_ptr + (token * TOP_K + k) * stride_routed + cols, cache_modifier=".cg").to(gl.float32)
        gl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty))
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
def _tile_routes(routes_ptr, slots, BT: gl.constexpr, DIRECT: gl.constexpr):
    """The route of each slot (-1: padding). ``DIRECT``: no route pack; tile t holds route t in its first slot."""
    if DIRECT:
        return gl.where(slots % BT == 0, slots // BT, -1)
    else:
        return gl.load(routes_ptr + slots)


@gluon.jit
def _weight_pointers(w_ptr, w_row0, K, BM: gl.constexpr, BK: gl.constexpr, U: gl.constexpr, half_rows=0,
                     NH: gl.constexpr = 1, GATE_UP: gl.constexpr = False, col0=0):
    """The packed-weight half of ``_copy_pointers``: sources [NH BM, BK/2] of the first K step, and the row stride.
    ``GATE_UP`` (the wide GEMM1): the rows ``_gate_up_rows`` of the output columns from ``col0``, up rows
    ``half_rows`` after the gate rows (both inside their 64-row blocks: ``w_row0`` and ``half_rows`` are multiples
    of 64, and col0 + 32 <= 64)."""
    # 16-B chunks per row and warp: those of one 32-B unit where a stage spans several (the registers take the units,
    # and each warp's copy is one contiguous run)
    NC: gl.constexpr = BK // 32 if BK // 32 < 2 or U < 32 else U // 16
    PL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NC, NC], [gl.num_warps(), 1], [1, 0])
    row_bytes = (K // 32) * 16  # = K/2, written so that the 16-B alignment of every row is visible
    pm = gl.arange(0, NH * BM, layout=gl.SliceLayout(1, PL))
    pk = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, PL))
    # row block (pm // 64), unit (pk // U) of 64 rows x U bytes, row in the block, byte
    first = w_row0 + (pm // 64) * 64
    in_block = pm % 64
    if NH == 2:
        first = w_row0 + (pm // BM) * half_rows + ((pm % BM) // 64) * 64
    if GATE_UP:
        first = w_row0 + ((pm // 8) % 2) * half_rows
        in_block = col0 + 8 * (pm // 16) + pm % 8
    w_ptrs = (w_ptr + (first.to(gl.int64) * row_bytes + in_block * U)[:, None]
              + (pk + (pk // U) * (64 * U - U))[None, :])
    return w_ptrs, row_bytes


@gluon.jit
def _copy_pointers(w_ptr, a_ptr, stride_a, routes_ptr, slot0, top_k, w_row0, K,
                   GEMM1: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, U: gl.constexpr,
                   DIRECT: gl.constexpr = False, half_rows=0, NH: gl.constexpr = 1):
    """16-B ``cp.async`` sources of a tile's first K step, for the calling partition's warps: packed rows
    [BM, BK/2] (BK/2 bytes = BK/32 K32 blocks of 16 B) and the gathered activation rows [BT, BK] (GEMM1 the
    token of each route, GEMM2 the slot itself); ``ok`` marks rows holding a route. Also the packed row
    stride in bytes. The packed rows are in the prepared 64-row blocks of ``U``-byte units
    (``prepare.to_row_blocks``; ``w_row0`` and the rows per expert are multiples of 64): a step's [64, BK/2]
    bytes are one contiguous piece where BK/2 >= U (``_issue_stage`` adds the step's offset). ``NH`` = 2: the
    packed rows of both halves ([2 BM, BK/2], the second ``half_rows`` rows after the first), for one copy."""
    EPV: gl.constexpr = 128 // a_ptr.dtype.element_ty.primitive_bitwidth  # elements per 16-B copy
    CPR: gl.constexpr = BK // EPV
    AL: gl.constexpr = gl.BlockedLayout([1, EPV], [32 // CPR, CPR], [gl.num_warps(), 1], [1, 0])
    w_ptrs, row_bytes = _weight_pointers(w_ptr, w_row0, K, BM, BK, U, half_rows, NH)
    slots = slot0 + gl.arange(0, BT, layout=gl.SliceLayout(1, AL))
    routes = _tile_routes(routes_ptr, slots, BT, DIRECT)
    ok = routes >= 0
    if GEMM1:
        rows = gl.where(ok, routes // top_k, 0).to(gl.int64)
    else:
        rows = slots.to(gl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_a + gl.arange(0, BK, layout=gl.SliceLayout(0, AL))[None, :]
    return w_ptrs, a_ptrs, ok, row_bytes


@gluon.jit
def _step_offset(step, BK: gl.constexpr, U: gl.constexpr):
    """Bytes from K step 0 to K step ``step`` in the prepared row blocks (64 rows x U bytes per unit)."""
    if BK // 2 >= U:
        return step * (64 * BK // 2)
    else:  # G = 2U/BK steps per unit
        return (step // (2 * U // BK)) * (64 * U) + (step % (2 * U // BK)) * (BK // 2)


@gluon.jit
def _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, slot, step, NH: gl.constexpr,
                 BK: gl.constexpr, U: gl.constexpr, PART: gl.constexpr = 0, JOINED: gl.constexpr = False,
                 ACT_ROW0: gl.constexpr = 0):
    """``cp.async`` of K step ``step`` (pointers of ``_copy_pointers``) into ring slot ``slot``: the packed rows
    of each half (``half_rows`` apart) and the gathered activation rows; every calling thread then arrives on
    the slot's ``loaded`` barrier once its own copies have landed (count = the calling threads). ``PART`` 1:
    the packed rows only; 2: the rest (activation rows, arrive). ``JOINED``: ``w_ptrs`` cover both halves
    (``_copy_pointers`` with NH = 2), one copy into the slot's halves viewed as one [NH BM, BK/2] tile: Triton's
    shared-memory barrier pass puts a CTA barrier between two copies into one allocation (docs/perf-notes.md
    step 18). ``a_ptrs`` may cover part of the activation tile: its rows from ``ACT_ROW0`` (the wide tiles)."""
    if PART != 2 and JOINED:
        SLOTS: gl.constexpr = packed.shape[0] // NH
        ROWS: gl.constexpr = NH * packed.shape[1]
        ROW_BYTES: gl.constexpr = packed.shape[2]
        LAYOUT: gl.constexpr = _joined_layout(packed.layout, ROWS, ROW_BYTES, U, packed.shape[1])
        halves = _reinterpret(packed, gl.uint8, [SLOTS, ROWS, ROW_BYTES], LAYOUT)
        _async_load(halves.index(slot), w_ptrs + _step_offset(step, BK, U))
    if PART != 2 and not JOINED:
        for h in gl.static_range(NH):
            _async_load(packed.index(slot * NH + h), w_ptrs + h * half_rows * row_bytes + _step_offset(step, BK, U))
    if PART != 1:
        stage = act.index(slot)
        if a_ptrs.shape[0] != stage.shape[0]:
            stage = stage.slice(ACT_ROW0, a_ptrs.shape[0])
        if ok is None:  # every row (a slot of its own, written or not)
            _async_load(stage, a_ptrs + step * BK)
        else:
            _async_load(stage, a_ptrs + step * BK, mask=ok[:, None])
        async_copy.mbarrier_arrive(loaded.index(slot), increment_count=False)


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
def _epilogue(acc_g, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr, out_ptr, stride_out, topk_weights_ptr,
              expert, w_row0, n0, slot0, N, top_k, limit, alpha,
              GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr, HAS_BIAS: gl.constexpr,
              HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, OUT_I64: gl.constexpr, OUT: gl.constexpr,
              DIRECT: gl.constexpr = False):
    """Column scales, bias, activation (GEMM1) or routing weight (GEMM2) and the store, in the accumulator
    layout ``OUT``: no shared-memory round trip (its scratch would be as large as a pipeline stage); a
    warp's store covers 16-B pieces of 4 output rows, the L2 merges them."""
    y, out_rows, row_ok, offs_n = _epilogue_values(acc_g, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr,
                                                   topk_weights_ptr, expert, w_row0, n0, slot0, N, top_k, limit, alpha,
                                                   GEMM1, SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, BM, BT, OUT, DIRECT)
    if OUT_I64:  # 32-bit element offsets where the output allows: 64-bit pointers per element would spill
        out_ptrs = out_ptr + out_rows.to(gl.int64)[None, :] * stride_out + offs_n[:, None]
    else:
        out_ptrs = out_ptr + (out_rows[None, :] * stride_out + offs_n[:, None])
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_n < N)[:, None])


@gluon.jit
def _epilogue_values(acc_g, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, routes_ptr, topk_weights_ptr, expert, w_row0,
                     n0, slot0, N, top_k, limit, alpha, GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr,
                     FP8: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BM: gl.constexpr,
                     BT: gl.constexpr, OUT: gl.constexpr, DIRECT: gl.constexpr = False,
                     ALL_ROWS: gl.constexpr = False):
    """``_epilogue``'s FP32 results [BM, BT] in ``OUT``, their output rows, which rows to store and the output
    columns. ``ALL_ROWS`` (W4A16 GEMM1): every slot's row, padding included (its sums are zero; GEMM2 never stores
    a padding slot's column), so the routes are not read."""
    g = acc_g
    offs_n = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, OUT))
    slots = slot0 + gl.arange(0, BT, layout=gl.SliceLayout(0, OUT))
    gl.static_assert(not ALL_ROWS or (GEMM1 and not FP8))
    if ALL_ROWS:
        routes = slots
    else:
        routes = _tile_routes(routes_ptr, slots, BT, DIRECT)
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
    return y, out_rows, row_ok, offs_n


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
    OUT_I64: gl.constexpr = True, W_UNIT: gl.constexpr = 64,
):
    """The ``moe_gemm_kernel`` contract on sm90 for W4A16 (see the module docstring); requires
    ``N % BM == 0`` and ``K % BK == 0``. Persistent: a 1-D grid of at most one program per SM, each
    walking the (route tile, weight-row block) tiles ``program_id, + num_programs, ...`` with one
    stage ring across its tiles (a tile's epilogue overlaps the next tile's loads and conversion)."""
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


# ---------------------------------------------------------------------------------------------------
# Small route tiles (decode, small batches): one warpgroup converts straight into wgmma's register
# operand; no warp specialization.
# ---------------------------------------------------------------------------------------------------


@gluon.constexpr_function
def _fragment_words_layout(BM, BK):
    """Layout of a stage's packed tile as 32-bit words [BM, BK/32, 4] (row, K32 block, stored word q) in
    which thread ``q = lane % 4`` holds word q of each (row, block) of rows r and r+8: the prepared layout
    puts K pairs (2q, 2q+1), (2q+8, 2q+9), (2q+16, ..), (2q+24, ..) in it, the pairs of the wgmma m64k16
    BF16 register operand of that thread (K chunks 0 and 1 of the block)."""
    regs = [[8, 0, 0]] + [[0, 1 << j, 0] for j in range((BK // 32).bit_length() - 1)]
    lanes = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[16, 0, 0], [32, 0, 0]], [], [BM, BK // 32, 4])


@gluon.constexpr_function
def _fragment_bytes_layout(BM, BK):
    """The layout of ``_fragment_words_layout`` with each word as its 4 bytes: [BM, BK/32, 4 (q), 4 (i)],
    bytes i = 0..3 of stored word q in consecutive registers of lane q (one 32-bit shared load)."""
    regs = [[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0]] + [[0, 1 << j, 0, 0] for j in range((BK // 32).bit_length() - 1)]
    lanes = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[16, 0, 0, 0], [32, 0, 0, 0]], [], [BM, BK // 32, 4, 4])


@gluon.constexpr_function
def _packed_layout(rows, row_elems, unit_elems, block_rows=64, splits=()):
    """Shared layout of packed tiles [rows, row_elems] (elements of 1 or 4 bytes) as ``prepare.to_row_blocks`` orders
    them: row-major where one unit holds a row's elements of the stage, else each ``block_rows``-row block as
    [unit][row][unit_elems], so that a warp's 16-B copies of one unit's rows land in one contiguous run.
    ``splits``: the columns split into dimensions of these sizes (innermost last), e.g. (NB, 4, 4) for [rows, NB, 4, 4]."""
    if row_elems <= unit_elems:
        assert not splits
        return gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    log2 = lambda n: n.bit_length() - 1
    bases = [[0, 1 << i] for i in range(log2(unit_elems))]
    bases += [[1 << j, 0] for j in range(log2(block_rows))]
    bases += [[0, unit_elems << i] for i in range(log2(row_elems // unit_elems))]
    bases += [[block_rows << j, 0] for j in range(log2(rows // block_rows))]
    if splits:
        def split(col):
            out = []
            for size in reversed(splits):
                out.append(col % size)
                col //= size
            return out[::-1]
        bases = [[r] + split(c) for r, c in bases]
    return gl.SharedLinearLayout(bases)


@gluon.constexpr_function
def _joined_layout(layout, rows, row_bytes, unit, block_rows):
    """The layout of a slot's halves viewed as one [rows, row_bytes] tile (``_issue_stage``'s ``JOINED``)."""
    if isinstance(layout, gl.SwizzledSharedLayout):
        return layout
    return _packed_layout(rows, row_bytes, unit, block_rows)


@gluon.jit
def _fragment_bytes(packed_s, BM: gl.constexpr, BK: gl.constexpr, U: gl.constexpr = 32):
    """A stage's packed [BM, BK/2] E2M1 (shared, ``_packed_layout`` of unit ``U``) as the bytes of each thread's words
    [BM, BK/32, 4, 4] (``_fragment_bytes_layout``)."""
    NB: gl.constexpr = BK // 32
    if BK // 2 <= U:
        return packed_s.reshape([BM, NB, 4, 4]).load(_fragment_bytes_layout(BM, BK))
    else:  # the prepared order (``_packed_layout``)
        return _reinterpret(packed_s, gl.uint8, [BM, NB, 4, 4], _packed_layout(BM, BK // 2, U, 64, (NB, 4, 4))).load(
            _fragment_bytes_layout(BM, BK))


@gluon.jit
def _e4m3_operands(codes, b, lo, hi, BM: gl.constexpr, BK: gl.constexpr, DOT: gl.constexpr):
    """A stage's packed bytes (``_fragment_bytes``) -> one FP8 register operand [BM, 32] of wgmma per K32 block (a tuple
    of BK/32) in the activations' slot order (``prepare.e4m3_slot_order``): stored word q gives lane q's slots 4q ..
    4q+3 and 16 + 4q .. 16 + 4q + 3, each value looked up in its block's E4M3 table (``convert.E2M1X8_TO_E4M3_TABLE_ASM``)
    of scale byte ``b`` ([BM, BK/32] int32, any layout) with the row's addends ``lo``, ``hi`` ([BM] uint32)."""
    NB: gl.constexpr = BK // 32
    BL: gl.constexpr = _fragment_bytes_layout(BM, BK)
    SB: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, BL))  # [BM, NB]
    SR: gl.constexpr = gl.SliceLayout(1, SB)  # [BM]
    zero = gl.zeros([BM, NB, 4, 4], gl.int32, BL)
    zero_u = gl.zeros([BM, NB, 4, 4], gl.uint32, BL)
    zero_b = gl.zeros([BM, NB], gl.uint32, SB)
    b4 = gl.expand_dims(gl.expand_dims(gl.convert_layout(b, SB, assert_trivial=True), 2), 3) + zero
    lo2 = gl.convert_layout(lo, SR, assert_trivial=True)[:, None] + zero_b
    hi2 = gl.convert_layout(hi, SR, assert_trivial=True)[:, None] + zero_b
    lo4 = gl.expand_dims(gl.expand_dims(lo2, 2), 3) + zero_u
    hi4 = gl.expand_dims(gl.expand_dims(hi2, 2), 3) + zero_u
    x, y = gl.inline_asm_elementwise(E2M1X8_TO_E4M3_TABLE_ASM, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r", [codes, b4, lo4, hi4],
                                     dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    # [BM, NB, q, i, c] -> [BM, NB, c, q, i]: slot 16 c + 4 q + i of block b
    w = gl.join(x, y).permute((0, 1, 4, 2, 3)).reshape([BM, NB, 32]).to(gl.float8e4nv, bitcast=True)
    if NB == 1:
        return (gl.convert_layout(w.reshape([BM, 32]), DOT, assert_trivial=True), )
    elif NB == 2:
        w0, w1 = w.permute((0, 2, 1)).split()
        return (gl.convert_layout(w0, DOT, assert_trivial=True), gl.convert_layout(w1, DOT, assert_trivial=True))
    else:
        gl.static_assert(NB == 4)
        lo_b, hi_b = w.permute((0, 2, 1)).reshape([BM, 32, 2, 2]).split()  # blocks (0, 2) and (1, 3)
        w0, w2 = lo_b.split()
        w1, w3 = hi_b.split()
        return (gl.convert_layout(w0, DOT, assert_trivial=True), gl.convert_layout(w1, DOT, assert_trivial=True),
                gl.convert_layout(w2, DOT, assert_trivial=True), gl.convert_layout(w3, DOT, assert_trivial=True))


@gluon.jit
def _fp8_chain(ops, act_s, acc, NB: gl.constexpr, use_acc=True):
    """Issue one async FP8 wgmma per K32 block of a stage (``ops``: ``_e4m3_operands``) on the stage's activation slots
    ``act_s`` [BT, BK], chained into ``acc`` (its first from zero where ``use_acc`` is False)."""
    for b in gl.static_range(NB):
        xb = act_s.slice(32 * b, 32, dim=1).permute((1, 0))
        if b == 0:
            acc = warpgroup_mma(ops[b], xb, acc, use_acc=use_acc, is_async=True)
        else:
            acc = warpgroup_mma(ops[b], xb, acc, is_async=True)
    return acc


@gluon.jit
def _keep_alive(x):
    """An empty asm reading ``x`` (FP8, 4 values per register), placed after a wgmma wait: the registers of an async
    wgmma's FP8 register operand stay live until the MMA read them. (``warpgroup_mma_wait(deps=...)`` does this for
    16- and 32-bit operands; Triton 3.6 refuses 8-bit ones there.)"""
    gl.inline_asm_elementwise("// $1", "=r,r", [x], dtype=gl.uint8, is_pure=False, pack=4)


@gluon.jit
def _fp8_wait(acc_g, acc_u, ops_g, ops_u, NH: gl.constexpr, NB: gl.constexpr):
    """Wait for every wgmma in flight, the register operands kept live until then (``_keep_alive``)."""
    if NH == 2:
        acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
    else:
        acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
    for b in gl.static_range(NB):
        _keep_alive(ops_g[b])
        if NH == 2:
            _keep_alive(ops_u[b])
    return acc_g, acc_u


@gluon.jit
def _fragment_words(packed_s, BM: gl.constexpr, BK: gl.constexpr, WL: gl.constexpr, U: gl.constexpr = 32):
    """A stage's packed [BM, BK/2] E2M1 (shared, ``_packed_layout`` of unit ``U``) as int32 words [BM, BK/32, 4] in
    ``WL``."""
    if BK // 2 <= U:
        words: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        return _reinterpret(packed_s, gl.int32, [BM, BK // 8], words).reshape([BM, BK // 32, 4]).load(WL)
    else:
        return _reinterpret(packed_s, gl.int32, [BM, BK // 32, 4], _packed_layout(BM, BK // 8, U // 4, 64,
                                                                                    (BK // 32, 4))).load(WL)


@gluon.constexpr_function
def _pair_select(b0):
    """``prmt`` selector: bytes b0 and b0 + 1 of a word into bytes 0 and 2, zeros above each."""
    return "prmt.b32 $0, $1, 0, %d;" % (b0 | 4 << 4 | (b0 + 1) << 8 | 4 << 12)


@gluon.jit
def _paired_factors(word, first_block: gl.constexpr, fac0, NB: gl.constexpr, SC: gl.constexpr):
    """The BF16x2 block factors 2**(126 + b - r) of blocks ``first_block`` .. + NB - 1 of each row's scale word
    ``word`` ([BM], four blocks' bytes), two blocks per 32-bit word: entry j of the [BM, NB] result holds the factors of
    blocks first_block + 2 (j // 2) and first_block + 2 (j // 2) + 1 in its low and high half (``_bf16_operand`` with
    ``PAIRED``). One ``prmt``
    and one multiply-add per two blocks, against a byte extraction and a multiply-add per block (``fac0``:
    ``_fold_addend``, the same in both halves; each half's sum stays below 2**15)."""
    gl.static_assert(NB % 2 == 0)
    sb = gl.arange(0, NB, layout=gl.SliceLayout(0, SC))
    f = gl.zeros([word.shape[0], NB], gl.int32, SC)
    for p in gl.static_range(NB // 2):
        pair = gl.inline_asm_elementwise(_pair_select(first_block + 2 * p), "=r,r", [word], dtype=gl.int32,
                                         is_pure=True, pack=1)
        f = gl.where((sb // 2 == p)[None, :], pair[:, None] * 128 + fac0, f)
    return f


@gluon.jit
def _scale_word_factors(word, first_block: gl.constexpr, fac0, NB: gl.constexpr, SC: gl.constexpr):
    """W4A16's BF16x2 factors 2**(126 + b - r) of blocks ``first_block`` .. + NB - 1 of each row's scale word ``word``
    ([BM]) as ``_bf16_operand`` takes them with ``PAIRED = NB % 2 == 0``: two blocks per word where NB is even
    (``_paired_factors``), else each block's byte times 0x00800080 plus ``fac0`` (``_fold_addend``)."""
    if NB % 2 == 0:
        f = _paired_factors(word, first_block, fac0, NB, SC)
    else:
        shifts = 8 * (first_block + gl.arange(0, NB, layout=gl.SliceLayout(0, SC)))
        f = ((word[:, None] >> shifts[None, :]) & 0xFF) * 0x00800080 + fac0
    return f


@gluon.jit
def _bf16_operand(words, f, BM: gl.constexpr, BK: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr,
                  PAIRED: gl.constexpr = False):
    """Words [BM, BK/32, 4] (``_fragment_words``) -> the BF16 register operand [BM, BK] of wgmma, each K32
    block times its BF16x2 factor ``f`` ([BM, BK/32] int32 in ``SliceLayout(2, WL)``; ``PAIRED``: block j's factor in
    half j % 2 of its entry, ``_paired_factors``)."""
    NB: gl.constexpr = BK // 32
    f4 = gl.expand_dims(f, 2) + gl.zeros([BM, NB, 4], gl.int32, WL)
    # x_{2i+c} = value c of pair i of stored word q: K 8i + 2q + c of the block
    if PAIRED:  # even blocks take the factor's low half, odd blocks its high half (the block index is a register bit)
        we, wo = words.reshape([BM, NB // 2, 2, 4]).permute((0, 1, 3, 2)).split()
        fe, fo = f4.reshape([BM, NB // 2, 2, 4]).permute((0, 1, 3, 2)).split()
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_LO_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [we, fe], dtype=(gl.bfloat16, ) * 8,
            is_pure=True, pack=1)
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_HI_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wo, fo], dtype=(gl.bfloat16, ) * 8,
            is_pure=True, pack=1)
        x0 = _unsplit_blocks(e0, o0, BM, NB)
        x1 = _unsplit_blocks(e1, o1, BM, NB)
        x2 = _unsplit_blocks(e2, o2, BM, NB)
        x3 = _unsplit_blocks(e3, o3, BM, NB)
        x4 = _unsplit_blocks(e4, o4, BM, NB)
        x5 = _unsplit_blocks(e5, o5, BM, NB)
        x6 = _unsplit_blocks(e6, o6, BM, NB)
        x7 = _unsplit_blocks(e7, o7, BM, NB)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = gl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, f4], dtype=(gl.bfloat16, ) * 8,
            is_pure=True, pack=1)
    w = gl.join(gl.join(gl.join(x0, x1), gl.join(x2, x3)), gl.join(gl.join(x4, x5), gl.join(x6, x7)))
    # [BM, NB, q, c, i_lo, i_hi] -> [BM, NB, i_hi, i_lo, q, c]: K = 32 b + 16 i_hi + 8 i_lo + 2 q + c
    w = w.permute((0, 1, 5, 4, 2, 3)).reshape([BM, BK])
    return gl.convert_layout(w, DOT, assert_trivial=True)


@gluon.jit
def _unsplit_blocks(even, odd, BM: gl.constexpr, NB: gl.constexpr):
    """[BM, NB/2, 4] values of the even and odd blocks -> [BM, NB, 4] (the inverse of ``_bf16_operand``'s split)."""
    return gl.join(even, odd).permute((0, 1, 3, 2)).reshape([BM, NB, 4])


@gluon.constexpr_function
def _small_mma_layout(BT, FP8):
    """The small-tile kernel's accumulator layout: one warpgroup, BT routed rows as the MMA's N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 32 if FP8 else 16])


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
def _small_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0, slot0,
                 half_rows, K, top_k, first_step, num_steps, GEMM1: gl.constexpr, NH: gl.constexpr, FP8: gl.constexpr,
                 BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
                 SCALE_WORDS: gl.constexpr, U: gl.constexpr, EARLY_WEIGHTS: gl.constexpr = False,
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
    s_ptrs = s_ptr + (w_row0 + sm.to(gl.int64))[:, None] * (K // 32) + first_step * NB + sb[None, :]
    up_scales = half_rows * (K // 32)
    if FP8:  # the E4M3 tables' addends (the unfolded path: constant, scale byte 0)
        if FOLD:
            tlo_g, thi_g = _e4m3_addends(gl.load(ref_ptr + w_row0 + sm))
            tlo_u, thi_u = tlo_g, thi_g
            if NH == 2:
                tlo_u, thi_u = _e4m3_addends(gl.load(ref_ptr + w_row0 + half_rows + sm))
        else:
            tlo_g = gl.full([BM], E4M3_UNFOLDED_LO, gl.uint32, gl.SliceLayout(1, SC))
            thi_g = gl.full([BM], E4M3_UNFOLDED_HI, gl.uint32, gl.SliceLayout(1, SC))
            tlo_u, thi_u = tlo_g, thi_g
    else:
        fac0_g = _fold_addend(_fold_ref(ref_ptr + w_row0 + sm))
        fac0_u = fac0_g
        if NH == 2:
            fac0_u = _fold_addend(_fold_ref(ref_ptr + w_row0 + half_rows + sm))

    # prologue: stages 0 .. S-2 in flight (with EARLY_WEIGHTS their weights before the wait, the rest after it)
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

    zero = gl.zeros((BM, BT), gl.float32, MMA)
    acc_g = zero
    acc_u = zero
    pg = zero  # W4A8 with PROMOTE: the FP8 chains' sums since their last promotion
    pu = zero
    if PROMOTE_SMEM:  # ... and the FP32 sums of the earlier chains in shared memory (``pg``, ``pu`` the accumulators)
        # (2-float pieces swizzled by row: a warp's accumulator registers, 8 rows x 4 pieces, hit 8 different banks
        # pairs instead of one 8 ways)
        total = gl.allocate_shared_memory(gl.float32, [NH, BM, BT], gl.SwizzledSharedLayout(2, 1, 8, [1, 0]))
        for h in gl.static_range(NH):
            total.index(h).store(zero)
    # scale bytes: with SCALE_WORDS (K % 128 == 0: a row's bytes start 4-byte aligned) one 32-bit load per
    # row and G = 4/NB steps (one-byte loads per step crowd the memory-instruction queue, docs/perf-notes.md step 10),
    # W4A8 taking its bytes out by shifts, W4A16 its factors (``_scale_word_factors``: two blocks' per word where NB is
    # even, ``PAIRED``); without SCALE_WORDS NB bytes per row and step. Either is loaded one step (group of steps)
    # before it is used.
    G: gl.constexpr = 4 // NB if SCALE_WORDS else 1
    PAIRED: gl.constexpr = SCALE_WORDS and NB % 2 == 0
    w_rows = _scale_word_rows(s_ptr, w_row0, sm, K) + first_step // G
    up_words = half_rows * (K // 128)
    sc_g = gl.zeros([BM, NB], gl.int32, SC)
    sc_u = sc_g
    nxt_wg = gl.zeros([BM], gl.int32, gl.SliceLayout(1, SC))
    nxt_wu = nxt_wg
    if SCALE_WORDS:
        nxt_wg = gl.load(w_rows)
        if NH == 2:
            nxt_wu = gl.load(w_rows + up_words)
    else:
        sc_g = gl.load(s_ptrs).to(gl.int32)
        if NH == 2:
            sc_u = gl.load(s_ptrs + up_scales).to(gl.int32)
    # W4A16: a step's codes are loaded (shared) during the step before
    codes_g = gl.zeros([BM, NB, 4], gl.int32, WL)
    codes_u = codes_g
    if not FP8:
        mbarrier.wait(loaded.index(0), 0)
        codes_g = _fragment_words(packed.index(0), BM, BK, WL, U)
        if NH == 2:
            codes_u = _fragment_words(packed.index(1), BM, BK, WL, U)
    # ``SPLIT_LOOP``: the K loop in two parts, first the scale-word groups all of whose steps refill the ring, load the
    # next codes and the next scale word within these steps (no per-step tests: each costs instructions in every step),
    # then the last ones (at most NUM_STAGES - 1 steps, rounded up to a group), tested; else the tested loop alone
    n_main = gl.maximum((num_steps - NUM_STAGES + 1) // G, 0) if SPLIT_LOOP else 0
    for TAIL in gl.static_range(0 if SPLIT_LOOP else 1, 2):
        for jg in range(0 if TAIL == 0 else n_main, n_main if TAIL == 0 else gl.cdiv(num_steps, G)):
            cur_wg = nxt_wg
            cur_wu = nxt_wu
            if SCALE_WORDS:
                if TAIL == 0 or (jg + 1) * G < num_steps:
                    nxt_wg = gl.load(w_rows + jg + 1)
                    if NH == 2:
                        nxt_wu = gl.load(w_rows + up_words + jg + 1)
            for g in gl.static_range(G):
                i = jg * G + g
                if TAIL == 0 or i < num_steps:
                    s = i % NUM_STAGES
                    # refill the slot the previous step read (its MMA has completed: each step waits for it)
                    nxt = i + NUM_STAGES - 1
                    if TAIL == 0 or nxt < num_steps:
                        _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, half_rows, row_bytes, nxt % NUM_STAGES,
                                     first_step + nxt, NH, BK, U, 0, True)
                    if SCALE_WORDS and FP8:
                        shift = (8 * (g * NB + sb))[None, :]
                        sc_g = (cur_wg[:, None] >> shift) & 0xFF
                        sc_u = (cur_wu[:, None] >> shift) & 0xFF
                    cur_sg = sc_g
                    cur_su = sc_u
                    if not SCALE_WORDS and (TAIL == 0 or i + 1 < num_steps):
                        sc_g = gl.load(s_ptrs + (i + 1) * NB).to(gl.int32)
                        if NH == 2:
                            sc_u = gl.load(s_ptrs + up_scales + (i + 1) * NB).to(gl.int32)
                    if FP8:
                        mbarrier.wait(loaded.index(s), (i // NUM_STAGES) & 1)
                        act_s = act.index(s)
                        if FOLD:  # the blocks' scales in the E4M3 weights: one wgmma chain per half
                            ops_g = _e4m3_operands(_fragment_bytes(packed.index(s * NH), BM, BK, U), cur_sg, tlo_g,
                                                   thi_g, BM, BK, DOT)
                            if PROMOTE > 0:  # the FP8 chains restart every PROMOTE steps, added to FP32 at the end
                                chained = i % PROMOTE != 0  # (False: a chain starts from zero)
                                pg = _fp8_chain(ops_g, act_s, pg, NB, chained)
                            else:
                                acc_g = _fp8_chain(ops_g, act_s, acc_g, NB)
                            ops_u = ops_g
                            if NH == 2:  # (converted while the gate half's MMAs run)
                                ops_u = _e4m3_operands(_fragment_bytes(packed.index(s * NH + 1), BM, BK, U), cur_su,
                                                       tlo_u, thi_u, BM, BK, DOT)
                                if PROMOTE > 0:
                                    pu = _fp8_chain(ops_u, act_s, pu, NB, chained)
                                else:
                                    acc_u = _fp8_chain(ops_u, act_s, acc_u, NB)
                            if PROMOTE > 0:
                                pg, pu = _fp8_wait(pg, pu, ops_g, ops_u, NH, NB)
                                if PROMOTE_SMEM:  # the FP32 sums in shared memory (the chains' registers are all
                                    # there is room for); the last chain is added after the loop
                                    if ((i + 1) % PROMOTE == 0) & (i + 1 < num_steps):
                                        total.index(0).store(total.index(0).load(MMA) + pg)
                                        if NH == 2:
                                            total.index(1).store(total.index(1).load(MMA) + pu)
                                elif ((i + 1) % PROMOTE == 0) | (i + 1 == num_steps):
                                    acc_g += pg
                                    if NH == 2:
                                        acc_u += pu
                            else:
                                acc_g, acc_u = _fp8_wait(acc_g, acc_u, ops_g, ops_u, NH, NB)
                        else:  # unfolded (rows of wider spans): each block's partial sum times its scale in FP32
                            no_b = gl.zeros([BM, NB], gl.int32, SC)
                            ops_g = _e4m3_operands(_fragment_bytes(packed.index(s * NH), BM, BK, U), no_b, tlo_g, thi_g,
                                                   BM, BK, DOT)
                            ops_u = ops_g
                            if NH == 2:
                                ops_u = _e4m3_operands(_fragment_bytes(packed.index(s * NH + 1), BM, BK, U), no_b, tlo_u,
                                                       thi_u, BM, BK, DOT)
                            for b in gl.static_range(NB):
                                xb = act_s.slice(32 * b, 32, dim=1).permute((1, 0))
                                fac_g = gl.convert_layout(
                                    _block_factor(gl.sum(gl.where(sb[None, :] == b, cur_sg, 0), axis=1)), ROWS)
                                pg = warpgroup_mma(ops_g[b], xb, zero, use_acc=False, is_async=True)
                                if NH == 2:
                                    fac_u = gl.convert_layout(
                                        _block_factor(gl.sum(gl.where(sb[None, :] == b, cur_su, 0), axis=1)), ROWS)
                                    pu = warpgroup_mma(ops_u[b], xb, zero, use_acc=False, is_async=True)
                                    pg, pu = warpgroup_mma_wait(0, deps=(pg, pu))
                                    acc_u += pu * fac_u[:, None]
                                else:
                                    pg = warpgroup_mma_wait(0, deps=(pg, ))
                                acc_g += pg * fac_g[:, None]
                    else:
                        # BF16x2 2**(126 + b - r): one multiply-add per (row, block), or per two blocks with PAIRED; no
                        # clamp (the field is in [0, 254])
                        if SCALE_WORDS:
                            f_g = _scale_word_factors(cur_wg, g * NB, fac0_g, NB, SC)
                            f_u = _scale_word_factors(cur_wu, g * NB, fac0_u, NB, SC)
                        else:
                            f_g = cur_sg * 0x00800080 + fac0_g
                            f_u = cur_su * 0x00800080 + fac0_u
                        cur_g = codes_g
                        cur_u = codes_u
                        if TAIL == 0 or i + 1 < num_steps:
                            t = (i + 1) % NUM_STAGES
                            mbarrier.wait(loaded.index(t), ((i + 1) // NUM_STAGES) & 1)
                            codes_g = _fragment_words(packed.index(t * NH), BM, BK, WL, U)
                            if NH == 2:
                                codes_u = _fragment_words(packed.index(t * NH + 1), BM, BK, WL, U)
                        xb = act.index(s).permute((1, 0))
                        acc_g = warpgroup_mma(_bf16_operand(cur_g, f_g, BM, BK, WL, DOT, PAIRED), xb, acc_g,
                                              is_async=True)
                        if NH == 2:
                            acc_u = warpgroup_mma(_bf16_operand(cur_u, f_u, BM, BK, WL, DOT, PAIRED), xb, acc_u,
                                                  is_async=True)
                            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
                        else:
                            acc_g = warpgroup_mma_wait(0, deps=(acc_g, ))
    if PROMOTE_SMEM:
        acc_g = total.index(0).load(MMA) + pg
        if NH == 2:
            acc_u = total.index(1).load(MMA) + pu
    return acc_g, acc_u


@gluon.jit
def _first_half_steps(num_k, NB: gl.constexpr, SCALE_WORDS: gl.constexpr):
    """K steps of the first of two halves of ``num_k`` (the K split over two warpgroups or two programs), at whole
    scale-word groups (``_small_steps``: 4 / NB steps per word with ``SCALE_WORDS``)."""
    G: gl.constexpr = 4 // NB if SCALE_WORDS else 1
    return (num_k // (2 * G)) * G


@gluon.jit
def _small_steps_to_shared(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0, slot0,
                           half_rows, K, top_k, first_step, num_steps, partial, done, GEMM1: gl.constexpr,
                           NH: gl.constexpr, FP8: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                           NUM_STAGES: gl.constexpr, SCALE_WORDS: gl.constexpr, U: gl.constexpr,
                           DIRECT: gl.constexpr = False, SPLIT_LOOP: gl.constexpr = False, FOLD: gl.constexpr = False,
                           PROMOTE: gl.constexpr = 0):
    """``_small_steps`` on the second warpgroup of a K-split program: its accumulators go to ``partial``
    (shared), then one arrive on ``done``."""
    _wait_for_previous_kernel()  # (the default partition waited too; this partition's reads must not pass it)
    acc_g, acc_u = _small_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded, w_row0,
                                slot0, half_rows, K, top_k, first_step, num_steps, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES,
                                SCALE_WORDS, U, False, DIRECT, SPLIT_LOOP, FOLD, PROMOTE)
    partial.index(0).store(acc_g)
    if NH == 2:
        partial.index(1).store(acc_u)
    mbarrier.arrive(done)


@gluon.jit
def _gate_up_rows(rows, N, col0):
    """The weight row (from the tile's first gate row) of each row of a wide GEMM1 warpgroup's M tile: rows 16 w .. 16 w
    + 7 are gate columns ``col0 + 8 w ..``, rows 16 w + 8 .. 16 w + 15 the up columns of the same output columns (``N``
    rows further). The wgmma accumulator gives a thread rows r and r + 8 of its warp, so each thread holds the gate and
    up sums of the same outputs: no exchange between warpgroups before the activation. (``_weight_pointers`` with
    ``GATE_UP`` copies these rows.)"""
    return ((rows // 8) % 2) * N + col0 + 8 * (rows // 16) + rows % 8


@gluon.jit
def _wide_gemm1_half(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                     tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed, act, loaded, consumed, staging,
                     first, end, N, K, top_k, limit, alpha, SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr,
                     HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                     NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup of the persistent wide W4A16 GEMM1 (``_wide_gemm1``): of every tile the program walks (route tile
    ``tile // n_blocks``, BM output columns ``tile % n_blocks``), the gate and up rows of output columns ``HALF * BM/2
    ..`` (``_gate_up_rows``), one accumulator chain of BM x BT over all K steps, copying activation rows ``HALF * BT/2
    ..`` of the shared ring; then the epilogue of its BM/2 columns for all BT routed rows, from its own accumulator.
    The ring runs on across tiles (as ``_wide_gemm2_half``): a tile's last steps refill it with the next tile's first
    steps, whose copies land during the epilogue."""
    R: gl.constexpr = BT // 2
    C: gl.constexpr = BM // 2  # output columns
    NB: gl.constexpr = BK // 32
    S: gl.constexpr = NUM_STAGES
    gl.static_assert(NUM_STAGES >= 3 and BM == 64)
    MMA: gl.constexpr = _small_mma_layout(BT, False)
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    SC: gl.constexpr = gl.SliceLayout(2, WL)
    # the accumulator's gate (or up) rows: the MMA layout without its row + 8 register bit
    HL: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
    if HALF == 1:
        _wait_for_previous_kernel()  # (the default partition waited too; this partition's reads must not pass it)
    stride = gl.num_programs(0)
    n_blocks = N // BM
    num_k = K // BK
    col0 = HALF * C
    sm = _gate_up_rows(gl.arange(0, BM, layout=gl.SliceLayout(1, SC)), N, col0)
    acc_rows = _gate_up_rows(gl.arange(0, BM, layout=gl.SliceLayout(1, MMA)), N, col0)
    G: gl.constexpr = 4 // NB  # K steps per scale word
    AL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [4, 1], [1, 0])  # as _copy_pointers'
    a_rows = gl.arange(0, R, layout=gl.SliceLayout(1, AL))
    a_cols = gl.arange(0, BK, layout=gl.SliceLayout(0, AL))
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // C, C // 8], [4, 1], [1, 0])  # [BT, C]: 16-B pieces
    offs_t = gl.arange(0, BT, layout=gl.SliceLayout(1, OL))
    offs_o = gl.arange(0, C, layout=gl.SliceLayout(0, OL))
    # the first tile: its copies, its first scale word
    expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, first // n_blocks, first % n_blocks, N, 2, BM, BT)
    _, a_ptrs, ok, row_bytes = _copy_pointers(w_ptr, a_ptr, stride_a, sorted_routes_ptr, slot0 + HALF * R, top_k,
                                              w_row0, K, True, BM, R, BK, U)
    w_ptrs = _weight_pointers(w_ptr, w_row0, K, BM, BK, U, N, 1, True, col0)[0]
    for j in gl.static_range(S - 1):
        _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, 0, row_bytes, j, j, 1, BK, U, 0, True, HALF * R)
    w_rows = _scale_word_rows(s_ptr, w_row0, sm, K)
    nxt_w = gl.load(w_rows)
    fac0 = _fold_addend(_fold_ref(ref_ptr + w_row0 + sm))
    expert_n = gl.load(tile_expert_ptr + gl.minimum(first + stride, end - 1) // n_blocks).to(gl.int64)
    mbarrier.wait(loaded.index(0), 0)
    codes = _fragment_words(packed.index(0), BM, BK, WL)
    c = 0  # ring steps so far
    for tile in range(first, end, stride):
        # the next tile (the grid's last tile again where there is none): copy pointers, scale rows, row references;
        # the expert of the one after it
        has_next = tile + stride < end
        nt = gl.minimum(tile + stride, end - 1)
        expert_n, n0_n, w_row0_n, slot0_n = _origin(expert_n, nt // n_blocks, nt % n_blocks, N, 2, BM, BT)
        expert_nn = gl.load(tile_expert_ptr + gl.minimum(tile + 2 * stride, end - 1) // n_blocks).to(gl.int64)
        routes_n = gl.load(sorted_routes_ptr + slot0_n + HALF * R + a_rows)  # (its copy pointers: in the tail)
        ref_n = gl.load(ref_ptr + w_row0_n + sm)
        acc = gl.zeros((BM, BT), gl.float32, MMA)
        codes, acc, nxt_w = _wide_main_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c,
                                             0, num_k // G - _wide_tail_groups(BK, S), w_ptrs, a_ptrs, ok, row_bytes,
                                             BM, BK, S, U, HALF, WL, DOT)
        # the next tile's copy pointers for the tail's refills (made here: registers through the main steps spill)
        ok_n = routes_n >= 0
        a_ptrs_n = a_ptr + gl.where(ok_n, routes_n // top_k, 0).to(gl.int64)[:, None] * stride_a + a_cols[None, :]
        w_ptrs_n = _weight_pointers(w_ptr, w_row0_n, K, BM, BK, U, N, 1, True, col0)[0]
        w_rows_n = _scale_word_rows(s_ptr, w_row0_n, sm, K)
        codes, acc, nxt_w = _wide_tail_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c,
                                             num_k, w_ptrs, a_ptrs, ok, row_bytes, has_next, w_rows_n, w_ptrs_n,
                                             a_ptrs_n, ok_n, BM, BK, S, U, HALF, WL, DOT)
        c += num_k
        # each row times its 2**(r - 127) (as _times_row_ref), then the gate and up rows apart
        acc = acc * _pow2(_fold_ref(ref_ptr + w_row0 + acc_rows) - 127)[:, None]
        g, u = acc.reshape([BM // 16, 2, 8, BT]).permute((0, 2, 3, 1)).split()
        g = gl.convert_layout(g.reshape([C, BT]), HL, assert_trivial=True)
        u = gl.convert_layout(u.reshape([C, BT]), HL, assert_trivial=True)
        # the activation of every slot (a padding slot's row too: no routes to read) into ``staging`` [BT, C], then
        # whole 16-B pieces of its rows to the output (from the accumulator layout: one 2-byte store per value)
        y, out_rows, row_ok, offs_n = _epilogue_values(g, u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                                                       topk_weights_ptr, expert, w_row0 + col0, n0 + col0, slot0, N,
                                                       top_k, limit, alpha, True, SWIGLUOAI, False, HAS_BIAS,
                                                       HAS_GSCALE, C, BT, HL, False, True)
        staging.permute((1, 0)).store(y.to(out_ptr.dtype.element_ty))
        if OUT_I64:
            out_ptrs = out_ptr + (slot0 + offs_t).to(gl.int64)[:, None] * stride_out + (n0 + col0 + offs_o)[None, :]
        else:
            out_ptrs = out_ptr + ((slot0 + offs_t)[:, None] * stride_out + (n0 + col0 + offs_o)[None, :])
        gl.store(out_ptrs, staging.load(OL))
        expert = expert_n
        n0 = n0_n
        w_row0 = w_row0_n
        slot0 = slot0_n
        w_ptrs = w_ptrs_n
        a_ptrs = a_ptrs_n
        ok = ok_n
        w_rows = w_rows_n
        fac0 = _fold_addend(gl.minimum(ref_n, FOLD_REF_MAX))
        expert_n = expert_nn
    return ()


@gluon.jit
def _wide_gemm1(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                tile_expert_ptr, num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, top_k, limit, alpha,
                SWIGLUOAI: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BM: gl.constexpr,
                BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr,
                HALF_REGS: gl.constexpr):
    """W4A16 GEMM1 on wide route tiles (``BT`` = 256 rows, the MMA's N), persistent: a 1-D grid of at most one program
    per SM, each walking the (route tile, BM output columns) tiles ``program_id, + num_programs, ..``; two warpgroups
    (``_wide_gemm1_half``), each the gate and up rows of half the BM columns, one accumulator chain of 64 x 256
    converting while the other's MMA runs: half the conversion per MMA of the 128-row tiles' two chains of 64 x 128.
    They share the activation ring, each copying half of its rows; a slot is refilled once both warpgroups' MMAs on
    it completed (``consumed``), after this step's MMA went out (before it, each would wait for the other's MMA
    before converting). One program per SM: a program per tile would idle the SM through each tile's first loads."""
    gl.static_assert(BT == 256)
    first = gl.program_id(0)
    end = (N // BM) * gl.load(num_tiles_ptr)  # (the route pack is complete: the kernel waited for it)
    if first < end:
        act, packed_0, packed_1, loaded, consumed = _wide_ring(a_ptr.dtype.element_ty, BM, BT, BK, NUM_STAGES)
        # each warpgroup's BF16 results of a tile [BT, BM/2], stored from here in 16-B pieces of rows
        OUT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BM // 2], out_ptr.dtype.element_ty)
        staging_0 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BT, BM // 2], OUT_SL)
        staging_1 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BT, BM // 2], OUT_SL)
        gl.warp_specialize([
            (_wide_gemm1_half, (a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
                                sorted_routes_ptr, tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_0, act,
                                loaded, consumed, staging_0, first, end, N, K, top_k, limit, alpha, SWIGLUOAI, HAS_BIAS,
                                HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64, U, 0)),
            (_wide_gemm1_half, (a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
                                sorted_routes_ptr, tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_1, act,
                                loaded, consumed, staging_1, first, end, N, K, top_k, limit, alpha, SWIGLUOAI, HAS_BIAS,
                                HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64, U, 1)),
        ], [4], [HALF_REGS])


@gluon.jit
def _wide_ring(a_dtype: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The ``cp.async`` ring of a wide tile's two warpgroups: the shared activation rows, each warpgroup's packed
    weights, ``loaded`` (every thread of both arrives) and ``consumed`` (both warpgroups' MMAs on the slot
    completed)."""
    act = gl.allocate_shared_memory(a_dtype, [NUM_STAGES, BT, BK],
                                    gl.NVMMASharedLayout.get_default_for([BT, BK], a_dtype))
    packed_0 = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BM, BK // 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    packed_1 = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BM, BK // 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    loaded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(loaded.index(j), count=2 * 32 * 4)
        mbarrier.init(consumed.index(j), count=2)
    return act, packed_0, packed_1, loaded, consumed


@gluon.jit
def _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g: gl.constexpr, w_ptrs, a_ptrs, ok,
               refill_step, row_bytes, load_next, refill, BM: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
               U: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr):
    """Ring step ``c`` of one warpgroup of a wide W4A16 program (``_wide_gemm1_half``, ``_wide_gemm2_half``), the ``g``-th of
    its scale word ``cur_w``: the MMA of the codes loaded before (the next step's are loaded while it runs, if
    ``load_next``), then, if ``refill``, the slot step c - 1 read is refilled (once both warpgroups' MMAs on it
    completed: before this step's MMA went out, each would wait for the other's MMA before converting) with K step
    ``refill_step`` of ``w_ptrs``/``a_ptrs`` (rows ``ok``; None: all). The callers split their K loops so that these
    conditions are mostly compile-time constants: a runtime test per step costs instructions in every step."""
    NB: gl.constexpr = BK // 32
    s = c % S
    # BF16x2 2**(126 + b - r) per (row, block), two blocks per word where NB is even (as in _small_steps)
    f = _scale_word_factors(cur_w, g * NB, fac0, NB, gl.SliceLayout(2, WL))
    cur = codes
    if load_next:
        t = (c + 1) % S
        mbarrier.wait(loaded.index(t), ((c + 1) // S) & 1)
        codes = _fragment_words(packed.index(t), BM, BK, WL)
    acc = warpgroup_mma(_bf16_operand(cur, f, BM, BK, WL, DOT, NB % 2 == 0), act.index(s).permute((1, 0)), acc,
                        is_async=True)
    if refill:
        if c > 0:
            mbarrier.wait(consumed.index((c - 1) % S), ((c - 1) // S) & 1)
        _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, ok, 0, row_bytes, (c + S - 1) % S, refill_step, 1, BK, U, 0,
                     True, HALF * a_ptrs.shape[0])
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(consumed.index(s))
    return codes, acc


@gluon.jit
def _wide_main_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, jg0, jg1, w_ptrs,
                     a_ptrs, ok, row_bytes, BM: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, U: gl.constexpr,
                     HALF: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr):
    """Scale-word groups ``jg0 .. jg1 - 1`` of a wide tile's K loop (ring step ``c0`` = the tile's K step 0), all of
    whose steps refill the ring with a later step of the same tile (``_wide_tail_steps`` runs the last ones).
    Returns the codes loaded for the next step, the accumulator and the next scale word."""
    G: gl.constexpr = 4 // (BK // 32)  # K steps per scale word (scale words: K % 128 == 0)
    for jg in range(jg0, jg1):
        cur_w = nxt_w
        nxt_w = gl.load(w_rows + jg + 1)
        for g in gl.static_range(G):
            codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c0 + jg * G + g, g,
                                    w_ptrs, a_ptrs, ok, jg * G + g + S - 1, row_bytes, True, True, BM, BK, S, U, HALF,
                                    WL, DOT)
    return codes, acc, nxt_w


@gluon.jit
def _wide_tail_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, num_k, w_ptrs, a_ptrs,
                     ok, row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, ok_n, BM: gl.constexpr, BK: gl.constexpr,
                     S: gl.constexpr, U: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr):
    """The last ``_wide_tail_groups`` scale-word groups of a wide tile's K loop, unrolled: which of their steps refill
    the ring with the tile's last step and which (if ``has_next``; False and the ``_n`` arguments None where the
    program has one tile) with the next tile's first S - 1 steps (``w_rows_n`` etc.) is known at compile time."""
    G: gl.constexpr = 4 // (BK // 32)
    TG: gl.constexpr = _wide_tail_groups(BK, S)
    for tg in gl.static_range(TG):
        cur_w = nxt_w
        if tg + 1 < TG:
            nxt_w = gl.load(w_rows + num_k // G - TG + tg + 1)
        elif w_rows_n is not None:
            nxt_w = gl.load(w_rows_n)
        for g in gl.static_range(G):
            c = c0 + num_k - TG * G + tg * G + g
            # the step it refills, from the tile's end: tg * G + g + S - 1 - TG * G (a constexpr only inline)
            if tg * G + g + S - 1 < TG * G:
                codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g, w_ptrs,
                                        a_ptrs, ok, num_k + (tg * G + g + S - 1 - TG * G), row_bytes, True, True, BM,
                                        BK, S, U, HALF, WL, DOT)
            elif tg * G + g + 1 < TG * G:
                codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g, w_ptrs_n,
                                        a_ptrs_n, ok_n, tg * G + g + S - 1 - TG * G, row_bytes, True, has_next, BM, BK,
                                        S, U, HALF, WL, DOT)
            else:  # the tile's last step: the next tile's first codes
                codes, acc = _wide_step(packed, act, loaded, consumed, codes, acc, cur_w, fac0, c, g, w_ptrs_n,
                                        a_ptrs_n, ok_n, tg * G + g + S - 1 - TG * G, row_bytes, has_next, has_next, BM,
                                        BK, S, U, HALF, WL, DOT)
    return codes, acc, nxt_w


@gluon.jit
def _wide_k_loop(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, num_k, w_ptrs, a_ptrs, ok,
                 row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, ok_n, BM: gl.constexpr, BK: gl.constexpr,
                 S: gl.constexpr, U: gl.constexpr, HALF: gl.constexpr, WL: gl.constexpr, DOT: gl.constexpr):
    """A wide tile's K loop from ring step ``c0``: the steps that refill the ring with the tile's own steps
    (``_wide_main_steps``), then its last ones unrolled (``_wide_tail_steps``; the ``_n`` arguments: the next tile's).
    Returns the codes loaded for the next step, the accumulator and the next scale word."""
    G: gl.constexpr = 4 // (BK // 32)  # K steps per scale word (scale words: K % 128 == 0)
    codes, acc, nxt_w = _wide_main_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, 0,
                                         num_k // G - _wide_tail_groups(BK, S), w_ptrs, a_ptrs, ok, row_bytes, BM, BK,
                                         S, U, HALF, WL, DOT)
    return _wide_tail_steps(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c0, num_k, w_ptrs,
                            a_ptrs, ok, row_bytes, has_next, w_rows_n, w_ptrs_n, a_ptrs_n, ok_n, BM, BK, S, U, HALF,
                            WL, DOT)


@gluon.constexpr_function
def _wide_tail_groups(BK, S):
    """Scale-word groups (128 K each) of a wide tile's unrolled last steps (``config.wide_tail_steps``)."""
    from .config import wide_tail_steps  # (config imports this module lazily)
    return wide_tail_steps(BK, S) // (128 // BK)


@gluon.jit
def _wide_gemm2_half(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, tile_expert_ptr,
                     out_ptr, stride_out, topk_weights_ptr, packed, act, loaded, consumed, cols, staging, first, end, N,
                     K, HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr,
                     BK: gl.constexpr, NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr,
                     EARLY_WEIGHTS: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup of the persistent wide W4A16 GEMM2 (``_wide_gemm2``): of every tile the program walks (route tile
    ``tile // n_blocks``, 2 BM output columns ``tile % n_blocks``), the ``HALF``-th BM columns, one accumulator chain of
    BM x BT over all K steps, copying activation rows ``HALF * BT/2 ..`` of the shared ring. The ring runs on across
    tiles: a tile's last steps refill it with the next tile's first steps, whose copies land during the epilogue.

    The epilogue holds up the tensor core (both warpgroups reach it together), so it does little: what it reads from
    global memory is loaded a tile ahead or at the tile's start (each tile's expert, row factors, each slot's route and
    routing weight); routes and weights go through ``cols`` (by tile parity; in the accumulator's layout they would take
    128 registers), and the BF16 results through ``staging`` [BT, BM], so that each thread stores whole 16-B pieces
    of output rows (from the accumulator's layout: one 2-byte store per value, 128 per thread)."""
    R: gl.constexpr = BT // 2
    S: gl.constexpr = NUM_STAGES
    MMA: gl.constexpr = _small_mma_layout(BT, False)
    HM: gl.constexpr = _small_mma_layout(BT // 2, False)  # the epilogue's halves
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    SC: gl.constexpr = gl.SliceLayout(2, WL)
    ROWS: gl.constexpr = gl.SliceLayout(1, HM)
    EL: gl.constexpr = gl.BlockedLayout([BT // 128], [32], [4], [0])  # a tile's slots over the warpgroup
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BM, BM // 8], [4, 1], [1, 0])  # [BT, BM]: 16-B pieces
    stride = gl.num_programs(0)
    n_blocks = N // (2 * BM)
    num_k = K // BK
    sm = gl.arange(0, BM, layout=gl.SliceLayout(1, SC))
    offs_r = gl.arange(0, BM, layout=ROWS)
    offs_e = gl.arange(0, BT, layout=EL)
    offs_o = gl.arange(0, BM, layout=gl.SliceLayout(0, OL))

    # activation rows: this warpgroup's half of the tile's slots, all of them (the MMA's columns are independent, and
    # a padding slot's output column is not stored): one offset tensor for every tile, 32-bit
    AL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [4, 1], [1, 0])  # as _copy_pointers'
    a_off = ((HALF * R + gl.arange(0, R, layout=gl.SliceLayout(1, AL)))[:, None] * stride_a
             + gl.arange(0, BK, layout=gl.SliceLayout(0, AL))[None, :])
    # the first tile: its copies (weights before the wait for GEMM1 with EARLY_WEIGHTS), its first scale word
    expert, n0, w_row0, slot0 = _tile_origin(tile_expert_ptr, first // n_blocks, first % n_blocks, N, 1, 2 * BM, BT)
    w_row0 += HALF * BM
    w_ptrs, row_bytes = _weight_pointers(w_ptr, w_row0, K, BM, BK, U)
    a_ptrs = a_ptr + slot0.to(gl.int64) * stride_a + a_off
    for j in gl.static_range(S - 1):
        _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, None, 0, row_bytes, j, j, 1, BK, U,
                     1 if EARLY_WEIGHTS else 0, True, HALF * R)
    _wait_for_previous_kernel()
    if EARLY_WEIGHTS:
        for j in gl.static_range(S - 1):
            _issue_stage(packed, act, loaded, w_ptrs, a_ptrs, None, 0, row_bytes, j, j, 1, BK, U, 2, True, HALF * R)
    w_rows = _scale_word_rows(s_ptr, w_row0, sm, K)
    nxt_w = gl.load(w_rows)
    fac0 = _fold_addend(_fold_ref(ref_ptr + w_row0 + sm))
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
        expert_n, n0_n, w_row0_n, slot0_n = _origin(expert_n, nt // n_blocks, nt % n_blocks, N, 1, 2 * BM, BT)
        w_row0_n += HALF * BM
        expert_nn = gl.load(tile_expert_ptr + gl.minimum(tile + 2 * stride, end - 1) // n_blocks).to(gl.int64)
        w_ptrs_n = _weight_pointers(w_ptr, w_row0_n, K, BM, BK, U)[0]
        a_ptrs_n = a_ptr + slot0_n.to(gl.int64) * stride_a + a_off
        w_rows_n = _scale_word_rows(s_ptr, w_row0_n, sm, K)
        ref_n = gl.load(ref_ptr + w_row0_n + sm)
        e_routes_n = gl.load(sorted_routes_ptr + slot0_n + offs_e)
        acc = gl.zeros((BM, BT), gl.float32, MMA)
        codes, acc, nxt_w = _wide_k_loop(packed, act, loaded, consumed, codes, acc, w_rows, nxt_w, fac0, c,
                                         num_k, w_ptrs, a_ptrs, None, row_bytes, has_next, w_rows_n, w_ptrs_n,
                                         a_ptrs_n, None, BM, BK, S, U, HALF, WL, DOT)
        c += num_k
        # epilogue: W4A16 row factors (as _times_row_ref), global scale, bias and routing weight (as _epilogue), in
        # two halves of the routed rows, into ``staging``; then the routed rows' 16-B pieces to the output
        p = n_tiles & 1
        cols.index(2 * p).store(e_routes.to(gl.float32, bitcast=True))
        cols.index(2 * p + 1).store(e_weights)
        row_f = _pow2(gl.minimum(row_ref, FOLD_REF_MAX) - 127)
        lo, hi = acc.reshape([BM, 2, BT // 2]).permute((0, 2, 1)).split()
        for h in gl.static_range(2):
            part = gl.convert_layout(lo if h == 0 else hi, HM, assert_trivial=True)
            weights = cols.index(2 * p + 1).slice(h * R, R).load(gl.SliceLayout(0, HM))
            y = part * row_f[:, None] * gs
            if HAS_BIAS:
                y += bias[:, None]
            y = y * weights[None, :]
            staging.slice(h * R, R).permute((1, 0)).store(y.to(out_ptr.dtype.element_ty))
        routes = cols.index(2 * p).load(gl.SliceLayout(1, OL)).to(gl.int32, bitcast=True)
        row_ok = routes >= 0
        offs_n = n0 + HALF * BM + offs_o
        if OUT_I64:
            out_ptrs = out_ptr + gl.where(row_ok, routes, 0).to(gl.int64)[:, None] * stride_out + offs_n[None, :]
        else:
            out_ptrs = out_ptr + (gl.where(row_ok, routes, 0)[:, None] * stride_out + offs_n[None, :])
        gl.store(out_ptrs, staging.load(OL), mask=row_ok[:, None] & (offs_n < N)[None, :])
        n_tiles += 1
        expert = expert_n
        n0 = n0_n
        w_row0 = w_row0_n
        w_ptrs = w_ptrs_n
        a_ptrs = a_ptrs_n
        w_rows = w_rows_n
        fac0 = _fold_addend(gl.minimum(ref_n, FOLD_REF_MAX))
        expert_n = expert_nn
        e_routes = e_routes_n
    return ()


@gluon.jit
def _wide_gemm2(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, tile_expert_ptr,
                num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, HAS_BIAS: gl.constexpr,
                HAS_GSCALE: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                NUM_STAGES: gl.constexpr, OUT_I64: gl.constexpr, U: gl.constexpr, EARLY_WEIGHTS: gl.constexpr,
                HALF_REGS: gl.constexpr):
    """W4A16 GEMM2 on wide route tiles (``BT`` = 256 rows), persistent: a 1-D grid of at most one program per SM, each
    walking the (route tile, 2 BM output columns) tiles ``program_id, + num_programs, ..``; two warpgroups
    (``_wide_gemm2_half``), BM columns each, one accumulator chain of BM x BT converting while the other's MMA runs (as
    the wide GEMM1). With such short programs (K = I) a program per tile would leave the tensor core idle through
    every prologue and epilogue; here the next tile's first copies land during this tile's epilogue."""
    gl.static_assert(BT == 256 and NUM_STAGES >= 3)
    first = gl.program_id(0)
    end = (N // (2 * BM)) * gl.load(num_tiles_ptr)  # (the route pack is complete: GEMM1 waited for it)
    if first < end:
        act, packed_0, packed_1, loaded, consumed = _wide_ring(a_ptr.dtype.element_ty, BM, BT, BK, NUM_STAGES)
        # each warpgroup's routes and routing weights of its tiles, by tile parity (the barriers between a warpgroup's
        # stores and loads of them: Triton's shared-memory barrier pass)
        FL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        cols_0 = gl.allocate_shared_memory(gl.float32, [4, BT], FL)
        cols_1 = gl.allocate_shared_memory(gl.float32, [4, BT], FL)
        # each warpgroup's BF16 results of a tile, the routed rows' 16-B pieces then stored from here
        OUT_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BM], out_ptr.dtype.element_ty)
        staging_0 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BT, BM], OUT_SL)
        staging_1 = gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BT, BM], OUT_SL)
        gl.warp_specialize([
            (_wide_gemm2_half, (a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                                tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_0, act, loaded, consumed,
                                cols_0, staging_0, first, end, N, K, HAS_BIAS, HAS_GSCALE, BM, BT, BK, NUM_STAGES,
                                OUT_I64, U, EARLY_WEIGHTS, 0)),
            (_wide_gemm2_half, (a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                                tile_expert_ptr, out_ptr, stride_out, topk_weights_ptr, packed_1, act, loaded, consumed,
                                cols_1, staging_1, first, end, N, K, HAS_BIAS, HAS_GSCALE, BM, BT, BK, NUM_STAGES,
                                OUT_I64, U, EARLY_WEIGHTS, 1)),
        ], [4], [HALF_REGS])
    else:
        _wait_for_previous_kernel()  # (a kernel must not complete before the one it follows)


@gluon.jit
def moe_gemm_small_kernel(
    a_ptr, a_scale_ptr, stride_a,
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr,
    out_ptr, stride_out, topk_weights_ptr,
    N, K, top_k, limit, alpha,
    ids_ptr, expert_map_ptr, num_global, num_experts, sum_out_ptr, stride_sum_out, counters_ptr, parts_ptr, fold_ptr,
    GEMM1: gl.constexpr, SWIGLUOAI: gl.constexpr, FP8: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_GSCALE: gl.constexpr,
    BM: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, NUM_STAGES: gl.constexpr,
    OUT_I64: gl.constexpr = True, SCALE_WORDS: gl.constexpr = False, KSPLIT: gl.constexpr = 1,
    PAIR: gl.constexpr = False, EARLY_WEIGHTS: gl.constexpr = False, W_UNIT: gl.constexpr = 64,
    DIRECT: gl.constexpr = False, HAS_MAP: gl.constexpr = False, SUM_ROUTES: gl.constexpr = False,
    TOP_K: gl.constexpr = 0, SPLIT_REGS: gl.constexpr = 128, K_PARTS: gl.constexpr = 1, WIDE: gl.constexpr = False,
    SUB_TILES: gl.constexpr = 1, SPLIT_LOOP: gl.constexpr = False, FOLD: gl.constexpr = False,
    PROMOTE: gl.constexpr = 0, PROMOTE_SMEM: gl.constexpr = False,
):
    """The ``moe_gemm_kernel`` contract for small route tiles, one warpgroup (``num_warps=4``, ``BM = 64``):
    a ring of ``NUM_STAGES`` ``cp.async`` stages (packed weights of both halves and the gathered
    activation rows); each thread reads the packed bytes of exactly its wgmma register-operand words
    (``prepare.interleave_block_bits``) and converts them in registers. W4A16: BF16 with the block
    scale folded (K-ordered asm), one wgmma per half and step. W4A8 (``BK`` 32, 64 or 128): see ``FOLD``; without
    it E2M1 * 2**-5 in E4M3 (exact), one FP8 wgmma per K32 block from zero, its partial sum times the block's
    2**(b - 122) into the FP32 accumulators (exact for any span of scales). ``KSPLIT=2`` (decode grids smaller than the
    SM count): a second warpgroup runs the second half of the K steps on its own ring, with ``SPLIT_REGS``
    registers per thread (the launch's ``maxnreg``). ``PAIR`` (GEMM2): a
    program takes two 64-row weight blocks as GEMM1 takes its gate and up halves (two accumulators, one
    wgmma each per step), so one block's conversion runs while the other's MMA does. ``W_UNIT``: the prepared
    row blocks' unit, ``prepare.row_block_unit(K)``. ``ids_ptr`` .. ``parts_ptr``: the direct path's arguments
    (passed always, placeholders without it: Triton 3.8 refuses runtime arguments left to a default).
    ``DIRECT`` (a few tokens): no route pack; program column t takes route t alone (its expert from ``ids_ptr``, ``expert_map_ptr`` with ``HAS_MAP``, as the pack would mask
    it), in the first slot of a tile of its own; GEMM2 writes zeros for a masked route, so the top-k sum
    needs no slot list. ``SUM_ROUTES`` (direct GEMM2; ``TOP_K`` routes per token): the last program of each
    (token, column block) also sums the token's routed rows into ``sum_out_ptr`` (``_sum_routes_if_last``), so
    no top-k-sum launch follows. ``K_PARTS=2`` (direct GEMM1 whose grid fills the SMs unevenly): grid axis 2
    splits the K steps over two programs, joined by ``_join_k_parts`` in ``parts_ptr`` / ``counters_ptr``.
    W4A8 ``FOLD`` (the fast path, ``fold_ptr``: the experts' ``PreparedExperts.w13_fold`` / ``w2_fold``): each block's
    scale folded into its E4M3 weights (``convert.E2M1X8_TO_E4M3_TABLE_ASM``), the FP8 accumulator chained over K
    (``PROMOTE`` = P > 0: over P steps at a time, each such sum added to FP32 accumulators, in shared memory with
    ``PROMOTE_SMEM``), 2**(ref - 133) per row after it; only the tiles of
    experts whose flag is 1, and without ``FOLD`` only those whose flag is 0.
    ``WIDE`` (W4A16, ``BT`` = 256): persistent (a 1-D grid of at most one program per SM), two warpgroups
    (``SPLIT_REGS`` registers each): GEMM1 ``_wide_gemm1``, the gate and up rows of 32 output columns each; GEMM2
    ``_wide_gemm2``, 64 output columns each. ``SUB_TILES`` = 2 (GEMM2 on a pack of wide tiles): program column t takes rows
    ``t * BT ..`` of tile t // 2, and none where that half holds no routed row. ``SPLIT_LOOP`` (W4A16, not ``WIDE``): the
    K loop's steps that refill within the program run untested (``_small_steps``)."""
    gl.static_assert(BM == 64 and gl.num_warps() == 4)
    gl.static_assert(not FP8 or BK <= 128)
    gl.static_assert(not (PAIR and GEMM1))
    gl.static_assert(not SUM_ROUTES or (DIRECT and not GEMM1 and TOP_K > 0))
    gl.static_assert(K_PARTS == 1 or (K_PARTS == 2 and DIRECT and GEMM1 and KSPLIT == 1))
    gl.static_assert(not WIDE or (not FP8 and KSPLIT == 1 and K_PARTS == 1 and not DIRECT and BT == 256))
    gl.static_assert(not WIDE or (SCALE_WORDS and not PAIR and SUB_TILES == 1))
    gl.static_assert(not SPLIT_LOOP or not (FP8 or WIDE))
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
    if WIDE and not GEMM1:
        _wide_gemm2(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, tile_expert_ptr,
                    num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, HAS_BIAS, HAS_GSCALE, BM, BT, BK,
                    NUM_STAGES, OUT_I64, W_UNIT, EARLY_WEIGHTS, SPLIT_REGS)
    elif WIDE:
        _wide_gemm1(a_ptr, a_scale_ptr, stride_a, w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr,
                    tile_expert_ptr, num_tiles_ptr, out_ptr, stride_out, topk_weights_ptr, N, K, top_k, limit, alpha,
                    SWIGLUOAI, HAS_BIAS, HAS_GSCALE, BM, BT, BK, NUM_STAGES, OUT_I64, W_UNIT, SPLIT_REGS)
    else:
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
            NB: gl.constexpr = BK // 32
            NH: gl.constexpr = 2 if GEMM1 or PAIR else 1
            # GEMM1: gate rows, up rows N further; PAIR: 2 * BM consecutive rows
            expert, n0, w_row0, slot0 = _origin(expert, pid_t, pid_n, N, 2 if GEMM1 else 1, WIDTH, BT)
            half_rows = N if GEMM1 else BM
            num_k = K // BK
            MMA: gl.constexpr = _small_mma_layout(BT, FP8)
            a_dtype: gl.constexpr = a_ptr.dtype.element_ty
            packed, act, loaded = _small_ring(a_dtype, NH, BM, BT, BK, NUM_STAGES, W_UNIT)
            if KSPLIT == 1:
                first_k = 0
                steps = num_k
                if K_PARTS == 2:  # program (pid_n, pid_t, p) runs part p of the K steps
                    part = _first_half_steps(num_k, NB, SCALE_WORDS)
                    first_k = gl.program_id(2) * part
                    steps = part + gl.program_id(2) * (num_k - 2 * part)
                acc_g, acc_u = _small_steps(a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act,
                                            loaded, w_row0, slot0, half_rows, K, top_k, first_k, steps, GEMM1, NH, FP8,
                                            BM, BT, BK, NUM_STAGES, SCALE_WORDS, W_UNIT, EARLY_WEIGHTS, DIRECT,
                                            SPLIT_LOOP, FOLD, PROMOTE, PROMOTE_SMEM)
            else:
                # a second warpgroup runs the second half of the K steps on its own ring (decode: one program per
                # SM issues too few instructions per cycle); its sums are added after the first half's, in that order
                gl.static_assert(KSPLIT == 2)
                packed2, act2, loaded2 = _small_ring(a_dtype, NH, BM, BT, BK, NUM_STAGES, W_UNIT)
                partial = gl.allocate_shared_memory(gl.float32, [NH, BM, BT], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
                done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
                mbarrier.init(done, count=1)
                half = _first_half_steps(num_k, NB, SCALE_WORDS)
                acc_g, acc_u = gl.warp_specialize([
                    (_small_steps, (a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed, act, loaded,
                                    w_row0, slot0, half_rows, K, top_k, 0, half, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES,
                                    SCALE_WORDS, W_UNIT, False, DIRECT, SPLIT_LOOP, FOLD, PROMOTE)),
                    (_small_steps_to_shared, (a_ptr, stride_a, w_ptr, s_ptr, ref_ptr, sorted_routes_ptr, packed2, act2,
                                              loaded2, w_row0, slot0, half_rows, K, top_k, half, num_k - half, partial,
                                              done, GEMM1, NH, FP8, BM, BT, BK, NUM_STAGES, SCALE_WORDS, W_UNIT,
                                              DIRECT, SPLIT_LOOP, FOLD, PROMOTE)),
                ], [4], [SPLIT_REGS])
                mbarrier.wait(done, 0)
                acc_g = acc_g + partial.index(0).load(MMA)
                if NH == 2:
                    acc_u = acc_u + partial.index(1).load(MMA)
            last = True
            if K_PARTS == 2:  # the second of the two programs to finish adds the first's sums and does the epilogue
                acc_g, acc_u, last = _join_k_parts(acc_g, acc_u, parts_ptr, counters_ptr, pid_n, pid_t, BM, BT, MMA)
            if last:
                if not FP8:
                    acc_g, acc_u = _times_row_ref(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH, BM,
                                                  gl.SliceLayout(1, MMA))
                elif FOLD:
                    acc_g, acc_u = _times_row_fold(acc_g, acc_u, ref_ptr, w_row0, half_rows, NH, BM,
                                                   gl.SliceLayout(1, MMA))
                _epilogue(acc_g, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                          topk_weights_ptr, expert, w_row0, n0, slot0, N, top_k, limit, alpha, GEMM1, SWIGLUOAI, FP8,
                          HAS_BIAS, HAS_GSCALE, BM, BT, OUT_I64, MMA, DIRECT)
                if PAIR:  # the second block's rows
                    _epilogue(acc_u, acc_u, a_scale_ptr, gscale_ptr, bias_ptr, sorted_routes_ptr, out_ptr, stride_out,
                              topk_weights_ptr, expert, w_row0 + BM, n0 + BM, slot0, N, top_k, limit, alpha, GEMM1,
                              SWIGLUOAI, FP8, HAS_BIAS, HAS_GSCALE, BM, BT, OUT_I64, MMA, DIRECT)
        else:
            if EARLY_WEIGHTS:
                # a program without a tile waits too: a kernel must not complete before the one it follows (else the
                # next kernel's wait would not cover GEMM1, which may still be running)
                _wait_for_previous_kernel()
            if DIRECT and not GEMM1:  # a masked route's row of the routed output is zero (the top-k sum adds it)
                ZL: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
                cols = pid_n * WIDTH + gl.arange(0, WIDTH, layout=ZL)
                gl.store(out_ptr + pid_t.to(gl.int64) * stride_out + cols, gl.zeros_like(cols).to(out_ptr.dtype.element_ty))
        if SUM_ROUTES:
            _sum_routes_if_last(out_ptr, stride_out, sum_out_ptr, stride_sum_out, counters_ptr, pid_n, pid_t, WIDTH,
                                TOP_K)
