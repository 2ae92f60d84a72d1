"""Hopper pipeline pieces shared by the Gluon kernels: programmatic dependent launch, tile origins, the
``cp.async`` ring (packed weights of both halves and the gathered activation rows per stage) and the epilogue (column
scales, bias, activation or routing weight, the store from the accumulator layout).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

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
def _tile_origin(tile_expert_ptr, pid_t, pid_n, N, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr):
    """(expert, first output row n0, first weight row, first route-pack slot) of program (pid_n, pid_t), whose
    BM output rows are the pid_n-th of an expert's N (``NH`` * N weight rows per expert)."""
    return _origin(gl.load(tile_expert_ptr + pid_t).to(gl.int64), pid_t, pid_n, N, NH, BM, BT)


@gluon.jit
def _origin(expert, pid_t, pid_n, N, NH: gl.constexpr, BM: gl.constexpr, BT: gl.constexpr):
    n0 = pid_n * BM
    return expert, n0, expert * (NH * N) + n0, pid_t * BT


@gluon.jit
def _tile_routes(routes_ptr, slots, BT: gl.constexpr, DIRECT: gl.constexpr):
    """The route of each slot (-1: padding). ``DIRECT``: no route pack; tile t holds route t in its first slot."""
    if DIRECT:
        return gl.where(slots % BT == 0, slots // BT, -1)
    else:
        return gl.load(routes_ptr + slots)


@gluon.jit
def _gate_up_rows(rows, N, col0):
    """The weight row (from the tile's first gate row) of each row of a GEMM1 warpgroup's M tile (the wide kernel;
    ``sm90_ws8`` with one m-tile per warpgroup): rows 16 w .. 16 w + 7 are gate columns ``col0 + 8 w ..``, rows 16 w +
    8 .. 16 w + 15 the up columns of the same output columns (``N`` rows further). The wgmma accumulator gives a thread
    rows r and r + 8 of its warp, so each thread holds the gate and up sums of the same outputs: no exchange between
    warpgroups before the activation. (``_weight_pointers`` with ``GATE_UP`` copies these rows.)"""
    return ((rows // 8) % 2) * N + col0 + 8 * (rows // 16) + rows % 8


@gluon.constexpr_function
def _gate_up_layout():
    """The layout of ``_gate_up_apart``'s halves: the wgmma accumulator's without its row + 8 register bit."""
    return gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])


@gluon.jit
def _gate_up_apart(acc):
    """An accumulator [BM, N] whose rows are in ``_gate_up_rows`` order as its gate sums and its up sums, each
    [BM/2, N] in ``_gate_up_layout`` (a split of each thread's registers: no data moves)."""
    BM: gl.constexpr = acc.shape[0]
    N: gl.constexpr = acc.shape[1]
    g, u = acc.reshape([BM // 16, 2, 8, N]).permute((0, 2, 3, 1)).split()
    return (gl.convert_layout(g.reshape([BM // 2, N]), _gate_up_layout(), assert_trivial=True),
            gl.convert_layout(u.reshape([BM // 2, N]), _gate_up_layout(), assert_trivial=True))


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


@gluon.constexpr_function
def _act_copy_layout(dtype, BK, num_warps):
    """The gathered activation rows [rows, BK] in 16-B pieces per thread, a row's pieces across neighbouring lanes."""
    epv = 128 // dtype.primitive_bitwidth  # elements per 16-B copy
    return gl.BlockedLayout([1, epv], [32 // (BK // epv), BK // epv], [num_warps, 1], [1, 0])


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
    AL: gl.constexpr = _act_copy_layout(a_ptr.dtype.element_ty, BK, gl.num_warps())
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
    step 18). ``a_ptrs`` may cover part of the activation tile: its rows from ``ACT_ROW0`` (the wide tiles; the halved
    small tiles' first half)."""
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
