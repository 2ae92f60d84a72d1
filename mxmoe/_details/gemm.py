"""The MoE GEMM kernel template: GEMM1 + activation and GEMM2 + routing weight, W4A16 and W4A8.

Computed as ``W · Aᵀ``: expert weight rows are the MMA's M dimension (converted in
registers: operand A of wgmma), routed rows (tokens) the N dimension, so a decode tile can
be 16 rows wide. One program computes ``BM`` weight rows for one route-pack tile of ``BT``
slots. W4A16 folds ``2**(b - ref)`` of each K32 block into the BF16 weights (exact, see
``convert``) and applies ``2**(ref - 127)`` per row in FP32 after the K loop. W4A8 runs one
FP8 MMA per K32 block on E2M1 * 2**-6 (exact in E4M3) and scales each partial sum by the
block's ``2**(b - 121)`` in FP32, so any span of scales is exact; the activation row scale
is applied in the epilogue.
"""
import triton
import triton.language as tl

from .convert import (bf16_block_factor, e2m1_to_bf16, e2m1_to_e4m3_scaled_by_2pow_minus6, e2m1x8_to_bf16_scaled_by_2pow126,
                      e2m1x8_to_e4m3_scaled_by_2pow_minus6, expand_blocks, pow2, store_rounded, unpack_nibbles)


@triton.jit
def _bf16_weights(packed, d, BM: tl.constexpr, BK: tl.constexpr, PURE: tl.constexpr):
    """[BM, BK/2] packed E2M1 -> [BM, BK] BF16 values times 2**d (d per K32 block, [BM, BK/32], <= 0)."""
    if PURE:  # plain Triton bit construction, per element
        return e2m1_to_bf16(unpack_nibbles(packed, BM, BK), expand_blocks(d, BM, BK))
    else:  # bit placement (value * 2**-126), then one BF16 multiply by 2**(126 + d) per element pair
        lo, hi = e2m1x8_to_bf16_scaled_by_2pow126(packed)
        w = tl.join(lo, hi).reshape(BM, BK // 32, 32) * bf16_block_factor(d)[:, :, None]
        return w.reshape(BM, BK)


@triton.jit
def _e4m3_weights(packed, BM: tl.constexpr, PURE: tl.constexpr):
    """[BM, 16] packed E2M1 (one K32 block) -> [BM, 32] E4M3 values times 2**-6 (exact)."""
    if PURE:
        codes = unpack_nibbles(packed, BM, 32)
        return e2m1_to_e4m3_scaled_by_2pow_minus6(codes).to(tl.float8e4nv, bitcast=True)
    else:
        lo, hi = e2m1x8_to_e4m3_scaled_by_2pow_minus6(packed)
        return tl.join(lo, hi).reshape(BM, 32).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _source_order(packed, BM: tl.constexpr, BK: tl.constexpr):
    """A packed tile [BM, BK/2] as stored (the bytes of each K32 block transposed, ``prepare``) -> source
    byte order (byte j = K 2j, 2j+1)."""
    return packed.reshape(BM, BK // 32, 4, 4).permute(0, 1, 3, 2).reshape(BM, BK // 2)


@triton.jit
def _slot_order(packed, BM: tl.constexpr):
    """A stored K32 block [BM, 16] -> its bytes in the FP8 activations' slot order (``prepare.e4m3_slot_order``):
    stored byte 4q + 2 i1 + i0 (K 8i + 2q, + 1) to byte 8 i1 + 2q + i0."""
    return packed.reshape(BM, 4, 2, 2).permute(0, 2, 1, 3).reshape(BM, 16)


@triton.jit
def _tile_mma(acc, w_ptrs, s_ptrs, a, ref, FP8: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              PURE: tl.constexpr):
    """acc += one [BM, BK] weight tile · a, every K32 block scale applied exactly.

    W4A16: blocks folded into BF16 relative to the row's reference exponent (BF16 holds any
    fold); the reference is applied after the K loop. W4A8 (BK = 32, one block per tile):
    E2M1 * 2**-6 is exact in E4M3 with no fold at all, and the block scale 2**(b - 121)
    multiplies the FP8 MMA's partial sum into the FP32 accumulator: exact for any span of
    scales, and Hopper's reduced-precision FP8 accumulation never runs past 32 products.
    """
    packed = tl.load(w_ptrs)
    sc = tl.load(s_ptrs).to(tl.int32)
    if FP8:  # the activations come in slot order (the row quantizer), so the weights go the same way
        w = _e4m3_weights(_slot_order(packed, BM), BM, PURE)
        if PURE:  # the interpreter's bf16/fp8 dot is wrong: multiply exact FP32 copies instead
            part = tl.dot(w.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w, a)
        return acc + part * pow2(tl.sum(sc, axis=1) - 121)[:, None]
    else:
        w = _bf16_weights(_source_order(packed, BM, BK), sc - ref[:, None], BM, BK, PURE)
        if PURE:
            return tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(w, a, acc)


@triton.jit
def _gemm_tile(a_ptr, a_row, row_ok, stride_a, w_base, s_base, ref_base, up_off, K,
               GLU: tl.constexpr, FP8: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               PURE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """FP32 [BM, BT] tiles W[rows] · A[a_row]ᵀ (and the up rows' for GLU), every weight scale applied."""
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    ref_g = tl.load(ref_base + offs_m)
    ref_u = ref_g
    if GLU:
        ref_u = tl.load(ref_base + up_off + offs_m)
    acc_g = tl.zeros((BM, BT), dtype=tl.float32)
    acc_u = tl.zeros((BM, BT), dtype=tl.float32)
    a_ptrs = a_ptr + a_row[None, :] * stride_a + offs_k[:, None]
    w_ptrs = w_base + offs_m[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
    s_ptrs = s_base + offs_m[:, None] * (K // 32) + tl.arange(0, BK // 32)[None, :]
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
        acc_g = _tile_mma(acc_g, w_ptrs, s_ptrs, a, ref_g, FP8, BM, BK, PURE)
        if GLU:  # the up rows, ``up_off`` rows further, share the activation tile
            acc_u = _tile_mma(acc_u, w_ptrs + up_off * (K // 2), s_ptrs + up_off * (K // 32), a, ref_u,
                              FP8, BM, BK, PURE)
        a_ptrs += BK
        w_ptrs += BK // 2
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
    PURE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """GEMM1 (``GEMM1``): rows of x gathered by route, gate and up halves of W13, bias,
    activation -> intermediate[slot, :N] (BF16, or FP32 for W4A8's row requantization).
    GEMM2: intermediate[slot] · W2ᵀ, bias, routing weight -> y[route, :N] (BF16).
    ``N`` is the output width (I for GEMM1, H for GEMM2); the weight has N rows (2N for GEMM1).
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

    g, u = _gemm_tile(a_ptr, a_row, row_ok, stride_a, w_e + n0 * (K // 2), s_e + n0 * (K // 32), ref_e + n0,
                      N, K, GEMM1, FP8, BM, BT, BK, PURE, NUM_STAGES)
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
