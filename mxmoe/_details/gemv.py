"""Decode GEMVs (W4A16, a few tokens): the prepared words straight into registers, no shared memory, no MMA.

At T=1 a call reads each routed expert's weights once and does 2 FLOP per weight: bandwidth alone. The MMA kernels
spend a 16-row route tile per route and a ring of copies per program; here each program reads its rows' words with
plain vector loads (a thread's words of a row are contiguous inside the 64-row blocks' units), converts each word
with the W4A16 kernels' asm (the block scale folded, exact BF16), and does one FP32 FMA per value with x read in
place as BF16 pairs: about 4 to 5 instructions per weight value (docs/perf-notes.md steps 44, 46).

* ``moe_gemv_gate_up_kernel``: grid (I / BC, routes). A program's ``BC`` output columns: their gate and up rows,
  interleaved, then the activation -> intermediate[route, columns] (BF16). Masked routes write zeros.
* ``moe_gemv_down_sum_kernel``: grid (H / BN, tokens). A program's ``BN`` output columns of one token: each of the
  token's routes in order k = 0..top_k-1 (masked routes skipped), times its routing weight, rounded to BF16 (the
  routed rows of the other W4A16 kernels), summed in FP32 ->
  out[token, columns]. No top-k-sum launch, no counters, no atomics: deterministic.

Numerics are the W4A16 path's (design.md section 5): exact BF16 weights, FP32 products and sums, 2**(r - 127) per
row, then the global scale, bias and activation in FP32; only the order of the K sum differs from the MMA kernels'.
``PURE``: the plain-Triton twin of the asm (interpreter and CPU tests), bit-for-bit the same weight values.
"""
import triton
import triton.language as tl

from .convert import (E2M1X8_TO_BF16_KORDER_ASM, FOLD_REF_MAX, e2m1_to_bf16, fold_ref, fp32_to_bf16_rne, pow2,
                      store_rounded)
from .gemm import swiglu


@triton.jit
def _pair_bits(u, j: tl.constexpr):
    """Value pair j of each prepared word (``prepare.interleave_block_bits``): sign at bit 15 / 31, ``eem`` at
    bits 8..6 / 24..22 (the asm's four masked shifts)."""
    if j == 0:
        r = u & 0x81C081C0
    elif j == 1:
        r = (u << 4) & 0x81C081C0
    elif j == 2:
        r = ((u << 10) | (u >> 22)) & 0x81C081C0
    else:
        r = ((u << 6) & 0x80C080C0) | ((u >> 2) & 0x01000100)
    return r


@triton.jit
def _pure_value(u, d, j: tl.constexpr, c: tl.constexpr):
    lane = (_pair_bits(u, j) >> (16 * c)) & 0xFFFF
    codes = (((lane >> 12) & 8) | ((lane >> 6) & 7)).to(tl.int32)
    return e2m1_to_bf16(codes, d).to(tl.float32)


@triton.jit
def _word_values(u, b, ref, PURE: tl.constexpr):
    """Words ``u`` [BN, KB, 4] (uint32; K32 block, stored word q) with their blocks' scale bytes ``b`` [BN, KB] ->
    the 8 values of each word as FP32 (value 2j + c: K 8j + 2q + c of the block), E2M1 times 2**(b - r), r = ``ref``
    [BN] (already folded)."""
    d = (b.to(tl.int32) - ref[:, None])[:, :, None]
    if PURE:
        return (_pure_value(u, d, 0, 0), _pure_value(u, d, 0, 1), _pure_value(u, d, 1, 0), _pure_value(u, d, 1, 1),
                _pure_value(u, d, 2, 0), _pure_value(u, d, 2, 1), _pure_value(u, d, 3, 0), _pure_value(u, d, 3, 1))
    f = (FOLD_REF_MAX + d) << 7  # the BF16x2 factor 2**(126 + d) in both halves
    f = tl.broadcast_to((f | (f << 16)).to(tl.uint32, bitcast=True), u.shape)
    t0, t1, t2, t3 = tl.inline_asm_elementwise(E2M1X8_TO_BF16_KORDER_ASM, "=r,=r,=r,=r,r,r", [u, f],
                                               dtype=(tl.uint32, ) * 4, is_pure=True, pack=1)
    # each BF16 half to FP32 by one shift or mask
    return ((t0 << 16).to(tl.float32, bitcast=True), (t0 & 0xFFFF0000).to(tl.float32, bitcast=True),
            (t1 << 16).to(tl.float32, bitcast=True), (t1 & 0xFFFF0000).to(tl.float32, bitcast=True),
            (t2 << 16).to(tl.float32, bitcast=True), (t2 & 0xFFFF0000).to(tl.float32, bitcast=True),
            (t3 << 16).to(tl.float32, bitcast=True), (t3 & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _load_step(w_rows, s_rows, x_pairs, kb0, nblk, KB: tl.constexpr, U: tl.constexpr):
    """K32 blocks kb0 .. kb0 + KB of each row (those below ``nblk``; zeros past it): the words [BN, KB, 4] (block,
    stored word q), the scale bytes [BN, KB] and x's BF16 pairs of the 4 value slots [KB, 4] each. Shaped so that a
    block's 4 words (16 contiguous bytes in the row blocks' units) and a slot's 4 pairs are one vector load each."""
    kb = kb0 + tl.arange(0, KB)
    q = tl.arange(0, 4)
    ok = kb < nblk
    # block kb of a row: in unit kb // (U / 16) of its 64-row block (64 rows of U bytes: 16 U words), at word
    # (kb % (U / 16)) * 4 of the row's U bytes there
    blk = (kb // (U // 16)) * (16 * U) + (kb % (U // 16)) * 4
    u = tl.load(w_rows[:, None, None] + blk[None, :, None] + q[None, None, :], mask=ok[None, :, None], other=0)
    b = tl.load(s_rows[:, None] + kb[None, :], mask=ok[None, :], other=0)
    # x of value (j, c) of word q of block kb: the BF16 pair (int32) 16 kb + 4 j + q of the row, its half c
    x_ptrs = x_pairs + 16 * kb[:, None] + q[None, :]
    x0 = tl.load(x_ptrs, mask=ok[:, None], other=0)
    x1 = tl.load(x_ptrs + 4, mask=ok[:, None], other=0)
    x2 = tl.load(x_ptrs + 8, mask=ok[:, None], other=0)
    x3 = tl.load(x_ptrs + 12, mask=ok[:, None], other=0)
    return u, b, x0, x1, x2, x3


@triton.jit
def _fma_step(acc, u, b, x0, x1, x2, x3, ref, PURE: tl.constexpr):
    """``acc`` [BN, KB, 4] (one FP32 sum per row, block and stored word) plus one step's products."""
    v = _word_values(u.to(tl.uint32, bitcast=True), b, ref, PURE)
    xs = (x0, x1, x2, x3)
    for j in tl.static_range(4):
        acc += v[2 * j] * (xs[j] << 16).to(tl.float32, bitcast=True)[None, :, :]
        acc += v[2 * j + 1] * (xs[j] & -65536).to(tl.float32, bitcast=True)[None, :, :]
    return acc


@triton.jit
def _gemv_rows(w_e, s_e, ref_e, rows, x_pairs, K, BN: tl.constexpr, KB: tl.constexpr, U: tl.constexpr,
               PURE: tl.constexpr):
    """FP32 [BN]: weight rows ``rows`` of one expert (``w_e`` int32 words, ``s_e`` scale bytes, ``ref_e`` row
    references; 64-row blocks whole) times the BF16 row at ``x_pairs`` (int32 pairs), every scale applied. The next
    step's loads are issued before this step's FMAs (a program's only latency hiding: its loads go to registers)."""
    nblk = K // 32
    w_rows = w_e + (rows // 64).to(tl.int64) * (64 * (K // 8)) + (rows % 64) * (U // 4)
    s_rows = s_e + rows.to(tl.int64) * nblk
    ref = fold_ref(tl.load(ref_e + rows))
    acc = tl.zeros([BN, KB, 4], tl.float32)
    u, b, x0, x1, x2, x3 = _load_step(w_rows, s_rows, x_pairs, 0, nblk, KB, U)
    for kb0 in tl.range(KB, nblk, KB, loop_unroll_factor=2):  # (unrolled: the swap below needs no moves)
        nu, nb, n0, n1, n2, n3 = _load_step(w_rows, s_rows, x_pairs, kb0, nblk, KB, U)
        acc = _fma_step(acc, u, b, x0, x1, x2, x3, ref, PURE)
        u, b, x0, x1, x2, x3 = nu, nb, n0, n1, n2, n3
    acc = _fma_step(acc, u, b, x0, x1, x2, x3, ref, PURE)
    return tl.sum(tl.sum(acc, axis=2), axis=1) * pow2(ref - 127)


@triton.jit
def _bf16_round(v, PURE: tl.constexpr):
    """FP32 ``v`` rounded to the nearest BF16 (ties to even), as FP32."""
    if PURE:
        return fp32_to_bf16_rne(v).to(tl.float32)
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _route_expert(ids_ptr, expert_map_ptr, route, num_global, num_experts, HAS_MAP: tl.constexpr):
    """The local expert of ``route`` from the top-k ids, -1 where masked (``routing_kernels._local_experts``' rules:
    ids outside [0, num_global) and ids the map sends to -1)."""
    e = tl.load(ids_ptr + route).to(tl.int64)
    valid = (e >= 0) & (e < num_global)
    if HAS_MAP:
        e = tl.load(expert_map_ptr + tl.where(valid, e, 0)).to(tl.int64)
    valid = valid & (e >= 0) & (e < num_experts)
    return tl.where(valid, e, -1)


@triton.jit
def moe_gemv_gate_up_kernel(x_ptr, stride_x, w, routes, out_ptr, stride_out, dims,
                            SWIGLUOAI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GSCALE: tl.constexpr,
                            HAS_MAP: tl.constexpr, BC: tl.constexpr, KB: tl.constexpr, U: tl.constexpr,
                            PURE: tl.constexpr, PDL: tl.constexpr = False):
    """GEMM1 + activation of one route: intermediate[route, c0 .. c0 + BC) (BF16) from the gate rows c and up rows
    I + c of its expert. ``w``: (words, scale bytes, row refs, global scales, bias); ``routes``: (top-k ids,
    expert map, number of global ids, of local experts); ``dims``: (I, K = H, top_k, limit, alpha)."""
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    ids_ptr, expert_map_ptr, num_global, num_experts = routes
    N, K, top_k, limit, alpha = dims
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_c = tl.program_id(0)
    route = tl.program_id(1)
    cols = pid_c * BC + tl.arange(0, BC)
    out_ptrs = out_ptr + route.to(tl.int64) * stride_out + cols
    e = _route_expert(ids_ptr, expert_map_ptr, route, num_global, num_experts, HAS_MAP)
    if e < 0:
        tl.store(out_ptrs, tl.zeros([BC], out_ptr.dtype.element_ty))
        return
    # rows 2i, 2i + 1 of the program: gate row c, up row I + c of column c = c0 + i
    i = tl.arange(0, 2 * BC)
    rows = pid_c * BC + i // 2 + (i % 2) * N
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (route // top_k).to(tl.int64) * (stride_x // 2)
    w_e = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + e * (2 * N) * (K // 8)
    y = _gemv_rows(w_e, s_ptr + e * (2 * N) * (K // 32), ref_ptr + e * (2 * N), rows, x_pairs, K, 2 * BC, KB, U,
                   PURE)
    if HAS_GSCALE:
        y = y * tl.load(gscale_ptr + e)
    if HAS_BIAS:
        y += tl.load(bias_ptr + e * (2 * N) + rows).to(tl.float32)
    gate, up = tl.split(y.reshape(BC, 2))
    store_rounded(out_ptrs, swiglu(gate, up, limit, alpha, SWIGLUOAI), cols < N, PURE)


@triton.jit
def moe_gemv_down_sum_kernel(a_ptr, stride_a, w, routes, out, dims,
                             HAS_BIAS: tl.constexpr, HAS_GSCALE: tl.constexpr, HAS_MAP: tl.constexpr,
                             BN: tl.constexpr, KB: tl.constexpr, U: tl.constexpr, PURE: tl.constexpr,
                             PDL: tl.constexpr = False):
    """GEMM2 and the top-k sum of one token: out[token, n0 .. n0 + BN) = sum over its routes k in order of
    topk_weight[k] * (W2[expert k] rows · intermediate[route k]), in FP32, stored once (BF16). ``out``: (output, its row
    stride, routing weights); ``dims``: (H, K = I, top_k)."""
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr = w
    ids_ptr, expert_map_ptr, num_global, num_experts = routes
    out_ptr, stride_out, topk_weights_ptr = out
    N, K, top_k = dims
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    total = tl.zeros([BN], tl.float32)
    for k in range(top_k):
        route = token * top_k + k
        e = _route_expert(ids_ptr, expert_map_ptr, route, num_global, num_experts, HAS_MAP)
        if e >= 0:
            x_pairs = a_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + route * (stride_a // 2)
            w_e = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + e * N * (K // 8)
            y = _gemv_rows(w_e, s_ptr + e * N * (K // 32), ref_ptr + e * N, rows, x_pairs, K, BN, KB, U, PURE)
            if HAS_GSCALE:
                y = y * tl.load(gscale_ptr + e)
            if HAS_BIAS:
                y += tl.load(bias_ptr + e * N + rows).to(tl.float32)
            # each route's weighted row rounded to BF16 first, as the other W4A16 kernels store it
            total += _bf16_round(y * tl.load(topk_weights_ptr + route).to(tl.float32), PURE)
    store_rounded(out_ptr + token * stride_out + rows, total, rows < N, PURE)
