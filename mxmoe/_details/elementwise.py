"""Row-wise kernels around the GEMMs: per-row E4M3 quantization and the top-k route sum."""
import triton
import triton.language as tl

from .convert import fp32_to_e4m3_rne, slot_k, store_rounded


@triton.jit
def _slot_values(x_rows, live, k0, K, BLOCK_K: tl.constexpr):
    """Slots ``k0 ..`` of rows ``x_rows`` [ROWS, 1] (consecutive per thread: its stores are whole 16-B pieces) and the
    FP32 x value each holds (``convert.slot_k``: the loads stay inside one 16-K half)."""
    slots = k0 + tl.arange(0, BLOCK_K)[None, :]
    return slots, tl.load(x_rows + slot_k(slots), mask=live & (slots < K), other=0.0).to(tl.float32)


@triton.jit
def _store_quantized(q_rows, live, slots, x, scale, K, PURE: tl.constexpr):
    safe = tl.where(scale > 0, scale, 1.0)
    v = tl.where(scale > 0, tl.math.div_rn(x, safe), 0.0)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if PURE:
        q = fp32_to_e4m3_rne(v).to(tl.float8e4nv, bitcast=True)
    else:
        q = v.to(tl.float8e4nv)
    tl.store(q_rows + slots, q, mask=live & (slots < K))


@triton.jit
def quantize_rows_kernel(x_ptr, stride_x, q_ptr, stride_q, scale_ptr, row_valid_ptr, M, K,
                         CHECK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, PURE: tl.constexpr):
    """q[row] = RNE(x[row] / s) saturated to +-448 as E4M3, s = amax(|x[row]|) / 448 (0 for a zero row),
    each K32 block stored in the W4A8 kernels' slot order (``prepare.e4m3_slot_order``; K % 32 == 0), for the ``M``
    rows, ``ROWS`` per program. A row of at most ``BLOCK_K`` values is read once (the amax of its slot-ordered
    values), a longer one twice.

    With ``CHECK_ROWS`` rows whose ``row_valid`` entry is negative (route-pack padding) are skipped, and a program
    whose rows are all padding returns at once.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < M
    if CHECK_ROWS:
        live &= tl.load(row_valid_ptr + rows, mask=live, other=-1) >= 0
        if tl.max(live.to(tl.int32), axis=0) == 0:
            return
    live = live[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    amax = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    if K <= BLOCK_K:
        slots, x = _slot_values(x_rows, live, 0, K, BLOCK_K)
        scale = tl.max(tl.maximum(amax, tl.abs(x)), axis=1) / 448.0
        _store_quantized(q_rows, live, slots, x, scale[:, None], K, PURE)
    else:
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)[None, :]
            amax = tl.maximum(amax, tl.abs(tl.load(x_rows + offs, mask=live & (offs < K), other=0.0).to(tl.float32)))
        scale = tl.max(amax, axis=1) / 448.0
        for k0 in range(0, K, BLOCK_K):
            slots, x = _slot_values(x_rows, live, k0, K, BLOCK_K)
            _store_quantized(q_rows, live, slots, x, scale[:, None], K, PURE)
    tl.store(scale_ptr + rows, scale, mask=live.reshape(ROWS))


@triton.jit
def topk_sum_kernel(y_ptr, route_slot_ptr, out_ptr, H, top_k, BLOCK_H: tl.constexpr, PURE: tl.constexpr,
                    CHECK_SLOTS: tl.constexpr = True, PDL: tl.constexpr = False):
    """out[t] = sum over k = 0..top_k-1 (in order, FP32) of y[t*top_k + k], masked routes (slot -1) skipped;
    without ``CHECK_SLOTS`` every route's row is read (masked routes' rows hold zeros)."""
    if PDL:  # launched with programmatic dependent launch: wait for the routed rows
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(top_k):
        route = t * top_k + k
        ok = in_row
        if CHECK_SLOTS:
            slot = tl.zeros((BLOCK_H,), tl.int32) + tl.load(route_slot_ptr + route)  # a tensor mask (Triton 3.9 interpreter)
            ok &= slot >= 0
        acc += tl.load(y_ptr + route * H + offs, mask=ok, other=0.0).to(tl.float32)
    store_rounded(out_ptr + t * H + offs, acc, in_row, PURE)
