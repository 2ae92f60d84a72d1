"""Row-wise kernels around the GEMMs: per-row E4M3 quantization and the top-k route sum."""
import triton
import triton.language as tl

from .convert import fp32_to_e4m3_rne, slot_k, store_rounded


@triton.jit
def _slot_values(x_row, k0, K, BLOCK_K: tl.constexpr):
    """Slots ``k0 ..`` of a row (consecutive per thread: its stores are whole 16-B pieces) and the FP32 x value each
    holds (``convert.slot_k``: the loads stay inside one 16-K half)."""
    slots = k0 + tl.arange(0, BLOCK_K)
    return slots, tl.load(x_row + slot_k(slots), mask=slots < K, other=0.0).to(tl.float32)


@triton.jit
def _store_quantized(q_row, slots, x, scale, K, PURE: tl.constexpr):
    safe = tl.where(scale > 0, scale, 1.0)
    v = tl.where(scale > 0, tl.math.div_rn(x, safe), 0.0)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if PURE:
        q = fp32_to_e4m3_rne(v).to(tl.float8e4nv, bitcast=True)
    else:
        q = v.to(tl.float8e4nv)
    tl.store(q_row + slots, q, mask=slots < K)


@triton.jit
def quantize_rows_kernel(x_ptr, stride_x, q_ptr, stride_q, scale_ptr, row_valid_ptr, K,
                         CHECK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PURE: tl.constexpr):
    """q[row] = RNE(x[row] / s) saturated to +-448 as E4M3, s = amax(|x[row]|) / 448 (0 for a zero row),
    each K32 block stored in the W4A8 kernels' slot order (``prepare.e4m3_slot_order``; K % 32 == 0). A row of at most
    ``BLOCK_K`` values is read once (the amax of its slot-ordered values), a longer one twice.

    With ``CHECK_ROWS`` rows whose ``row_valid`` entry is negative (route-pack padding) are skipped.
    """
    row = tl.program_id(0)
    if CHECK_ROWS:
        if tl.load(row_valid_ptr + row) < 0:
            return
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if K <= BLOCK_K:
        slots, x = _slot_values(x_row, 0, K, BLOCK_K)
        scale = tl.max(tl.maximum(amax, tl.abs(x)), axis=0) / 448.0
        _store_quantized(q_row, slots, x, scale, K, PURE)
    else:
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
        scale = tl.max(amax, axis=0) / 448.0
        for k0 in range(0, K, BLOCK_K):
            slots, x = _slot_values(x_row, k0, K, BLOCK_K)
            _store_quantized(q_row, slots, x, scale, K, PURE)
    tl.store(scale_ptr + row, scale)


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
