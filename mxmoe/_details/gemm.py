"""The MoE GEMM kernel template: GEMM1 + activation and GEMM2 + routing weight, W4A16 and W4A8.

Computed as ``W · Aᵀ``: expert weight rows are the MMA's M dimension (converted in
registers: operand A of wgmma), routed rows (tokens) the N dimension, so a decode tile can
be 16 rows wide. One program computes ``BM`` weight rows for one route-pack tile of ``BT``
slots. W4A16 folds ``2**(b - ref)`` of each K32 block into the BF16 weights (exact, see
``convert``; relative to r = ``convert.fold_ref(ref)``) and applies ``2**(r - 127)`` per row in FP32 after
the K loop. W4A8 (this template: the exact
path for every span of scales) runs one FP8 MMA per K32 block on E2M1 * 2**-5 (exact in E4M3) and scales each
partial sum by the block's ``2**(b - 122)`` in FP32; the activation row scale is applied in the epilogue.
"""
import triton
import triton.language as tl

from .convert import (E2M1X8_TO_BF16_HALVES_ASM, E2M1X8_TO_E4M3_TABLE_WORD_ASM, E4M3_UNFOLDED_HI, E4M3_UNFOLDED_LO,
                      FOLD_REF_MAX, e2m1_to_bf16, e2m1_to_e4m3, expand_blocks, fold_ref, pow2, prepared_codes,
                      slot_k, store_rounded)


@triton.jit
def _bf16_weights(words, d, BM: tl.constexpr, BK: tl.constexpr, PURE: tl.constexpr):
    """Prepared words [BM, BK/8] -> [BM, BK] BF16 values times 2**d (d per K32 block, [BM, BK/32], <= 1)."""
    if PURE:  # plain Triton bit construction, per element
        return e2m1_to_bf16(prepared_codes(words, BM, BK), expand_blocks(d, BM, BK))
    else:  # the Gluon kernels' asm: masked shifts, one BF16 multiply by 2**(126 + d) per value pair
        f = (FOLD_REF_MAX + d) << 7  # the factor's exponent field, in [0, 254]
        f = tl.broadcast_to((f | (f << 16))[:, :, None], (BM, BK // 32, 4)).reshape(BM, BK // 8)
        x0, x1, x2, x3, x4, x5, x6, x7 = tl.inline_asm_elementwise(
            E2M1X8_TO_BF16_HALVES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, f], dtype=(tl.bfloat16, ) * 8,
            is_pure=True, pack=1)
        w = tl.join(tl.join(tl.join(x0, x1), tl.join(x2, x3)), tl.join(tl.join(x4, x5), tl.join(x6, x7)))
        # x_{2j+c} = K 8j + 2q + c, j = 2a + b; [BM, block, q, c, b, a] -> [BM, block, a, b, q, c]
        return w.reshape(BM, BK // 32, 4, 2, 2, 2).permute(0, 1, 5, 4, 2, 3).reshape(BM, BK)


@triton.jit
def _e4m3_weights(words, BM: tl.constexpr, PURE: tl.constexpr):
    """Prepared words [BM, 4] (one K32 block) -> [BM, 32] E4M3 values E2M1 * 2**-5 (exact, unfolded: the block scale
    multiplies the partial sum), in the activations' slot order (``prepare.e4m3_slot_order``)."""
    if PURE:
        k = slot_k(tl.arange(0, 32))
        codes = tl.gather(prepared_codes(words, BM, 32), tl.broadcast_to(k[None, :], (BM, 32)), 1)
        return e2m1_to_e4m3(codes, 1).to(tl.float8e4nv, bitcast=True)
    else:  # the Gluon kernels' asm with the unfolded table: word q -> slots 4q .. 4q+3 and 16 + 4q .. 16 + 4q + 3
        zero = tl.zeros_like(words)
        lo, hi = tl.inline_asm_elementwise(E2M1X8_TO_E4M3_TABLE_WORD_ASM, "=r,=r,r,r,r,r",
                                           [words, zero, zero + E4M3_UNFOLDED_LO, zero + E4M3_UNFOLDED_HI],
                                           dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        regs = tl.join(lo, hi)  # [BM, q, h]
        shift = (tl.arange(0, 4) * 8).to(tl.uint32)
        b = (regs[:, :, :, None] >> shift[None, None, None, :]) & 0xFF  # [BM, q, h, i]
        return b.permute(0, 2, 1, 3).reshape(BM, 32).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _tile_mma(acc, w_ptrs, s_ptrs, a, ref, FP8: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              PURE: tl.constexpr):
    """acc += one [BM, BK] weight tile · a, every K32 block scale applied exactly.

    W4A16: blocks folded into BF16 relative to the row's reference exponent (BF16 holds any
    fold); the reference is applied after the K loop. W4A8 (BK = 32, one block per tile):
    E2M1 * 2**-5 is exact in E4M3 with no fold at all, and the block scale 2**(b - 122)
    multiplies the FP8 MMA's partial sum into the FP32 accumulator: exact for any span of
    scales, and Hopper's reduced-precision FP8 accumulation never runs past 32 products.
    """
    words = tl.load(w_ptrs).permute(1, 0, 2).reshape(BM, BK // 8)  # [block, row, word] -> [row, K words]
    sc = tl.load(s_ptrs).to(tl.int32)
    if FP8:  # the activations come in slot order (the row quantizer), so the weights go the same way
        w = _e4m3_weights(words, BM, PURE)
        if PURE:  # the interpreter's bf16/fp8 dot is wrong: multiply exact FP32 copies instead
            part = tl.dot(w.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w, a)
        return acc + part * pow2(tl.sum(sc, axis=1) - 122)[:, None]
    else:
        w = _bf16_weights(words, sc - ref[:, None], BM, BK, PURE)
        if PURE:
            return tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(w, a, acc)


@triton.jit
def _retire(acc):
    """``acc`` through an opaque move: Triton waits for every wgmma in flight before it. Without it the W4A16 K loop
    leaves its last wgmmas in flight into the next step (``wgmma.wait_group 7``) and ptxas gives that step's converted
    operand their A registers, which they may still read (``sm90.operand_races``, docs/perf-notes.md step 29)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _row_block_words(w_e, row0, n_rows, K, k0, BM: tl.constexpr, BK: tl.constexpr, U: tl.constexpr):
    """int32 pointers [BK/32, BM, 4] to the prepared words of K step ``k0`` (K32 block, row, word) of an
    expert's weight rows row0 .. row0 + BM - 1 (of ``n_rows``; BM divides 64 and row0, so the rows share one
    block) in the 64-row blocks of ``prepare.to_row_blocks``: a block of h rows is [unit][row][U bytes]."""
    r0 = (row0 // 64) * 64
    h = tl.minimum(n_rows - r0, 64)
    c = k0 // 2 + tl.arange(0, BK // 32) * 16  # byte of each K32 block in its row
    byte = r0 * (K // 2) + (c // U) * (h * U) + c % U
    return (w_e.to(tl.pointer_type(tl.int32), bitcast=True) + (byte // 4)[:, None, None]
            + ((row0 - r0 + tl.arange(0, BM)) * (U // 4))[None, :, None] + tl.arange(0, 4)[None, None, :])


@triton.jit
def _gemm_tile(a_ptr, a_row, row_ok, stride_a, w_e, n_rows, n0, s_base, ref_base, up_off, K,
               GLU: tl.constexpr, FP8: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               PURE: tl.constexpr, NUM_STAGES: tl.constexpr, U: tl.constexpr):
    """FP32 [BM, BT] tiles W[rows] · A[a_row]ᵀ (and the up rows' for GLU), every weight scale applied: the
    weight rows n0 .. n0 + BM - 1 (and ``up_off`` further) of the expert's ``n_rows`` at ``w_e``."""
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    ref_g = fold_ref(tl.load(ref_base + offs_m))
    ref_u = ref_g
    if GLU:
        ref_u = fold_ref(tl.load(ref_base + up_off + offs_m))
    acc_g = tl.zeros((BM, BT), dtype=tl.float32)
    acc_u = tl.zeros((BM, BT), dtype=tl.float32)
    a_ptrs = a_ptr + a_row[None, :] * stride_a + offs_k[:, None]
    s_ptrs = s_base + offs_m[:, None] * (K // 32) + tl.arange(0, BK // 32)[None, :]
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
        # the packed weights as 32-bit words (``prepare.interleave_block_bits``) in their 64-row blocks
        w_ptrs = _row_block_words(w_e, n0, n_rows, K, k0, BM, BK, U)
        acc_g = _tile_mma(acc_g, w_ptrs, s_ptrs, a, ref_g, FP8, BM, BK, PURE)
        if GLU:  # the up rows, ``up_off`` rows further, share the activation tile
            u_ptrs = _row_block_words(w_e, n0 + up_off, n_rows, K, k0, BM, BK, U)
            acc_u = _tile_mma(acc_u, u_ptrs, s_ptrs + up_off * (K // 32), a, ref_u, FP8, BM, BK, PURE)
        if not (FP8 or PURE):  # the step's wgmmas retire before the next step converts (``_retire``)
            if GLU:
                acc_u = _retire(acc_u)
            else:
                acc_g = _retire(acc_g)
        a_ptrs += BK
        s_ptrs += BK // 32
    if FP8:
        return acc_g, acc_u
    return acc_g * pow2(ref_g - 127)[:, None], acc_u * pow2(ref_u - 127)[:, None]


@triton.jit
def moe_gemm_kernel(
    a_ptr, a_scale_ptr, stride_a,
    w_ptr, s_ptr, ref_ptr, gscale_ptr, bias_ptr,
    sorted_routes_ptr, tile_expert_ptr, num_tiles_ptr,
    out_ptr, stride_out, topk_weights_ptr,
    N, K, top_k, limit, alpha,
    GEMM1: tl.constexpr, SWIGLUOAI: tl.constexpr, FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_GSCALE: tl.constexpr,
    BM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    PURE: tl.constexpr, NUM_STAGES: tl.constexpr, W_UNIT: tl.constexpr,
):
    """GEMM1 (``GEMM1``): rows of x gathered by route, gate and up halves of W13, bias,
    activation -> intermediate[slot, :N] (BF16, or FP32 for W4A8's row requantization).
    GEMM2: intermediate[slot] · W2ᵀ, bias, routing weight -> y[route, :N] (BF16).
    ``N`` is the output width (I for GEMM1, H for GEMM2); the weight has N rows (2N for GEMM1), in the
    prepared 64-row blocks of ``W_UNIT``-byte units (``prepare.row_block_unit``).
    """
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    if pid_t >= tl.load(num_tiles_ptr):
        return
    expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    slots = pid_t * BT + tl.arange(0, BT)  # segments are padded to whole tiles
    routes = tl.load(sorted_routes_ptr + slots)
    row_ok = routes >= 0
    if GEMM1:
        a_row = tl.where(row_ok, routes // top_k, 0).to(tl.int64)
        n_weight_rows = 2 * N
    else:
        a_row = slots.to(tl.int64)
        n_weight_rows = N
    w_e = w_ptr + expert * n_weight_rows * (K // 2)
    s_e = s_ptr + expert * n_weight_rows * (K // 32)
    ref_e = ref_ptr + expert * n_weight_rows
    n0 = pid_n * BM
    offs_n = n0 + tl.arange(0, BM)
    col_scale = tl.full((BT,), 1.0, tl.float32)
    if FP8:
        col_scale = tl.load(a_scale_ptr + a_row, mask=row_ok, other=0.0)
    if HAS_GSCALE:
        col_scale = col_scale * tl.load(gscale_ptr + expert)

    g, u = _gemm_tile(a_ptr, a_row, row_ok, stride_a, w_e, n_weight_rows, n0, s_e + n0 * (K // 32), ref_e + n0,
                      N, K, GEMM1, FP8, BM, BT, BK, PURE, NUM_STAGES, W_UNIT)
    y = g * col_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert * n_weight_rows + offs_n)[:, None]
    if GEMM1:
        up = u * col_scale[None, :]
        if HAS_BIAS:
            up += tl.load(bias_ptr + expert * n_weight_rows + N + offs_n)[:, None]
        gate = tl.minimum(y, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        if SWIGLUOAI:
            y = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
        else:
            y = gate * tl.sigmoid(gate) * up
        out_rows = slots.to(tl.int64)
    else:
        y = y * tl.load(topk_weights_ptr + routes, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        out_rows = tl.where(row_ok, routes, 0).to(tl.int64)
    out_ptrs = out_ptr + out_rows[None, :] * stride_out + offs_n[:, None]
    store_rounded(out_ptrs, y, row_ok[None, :] & (offs_n < N)[:, None], PURE)
