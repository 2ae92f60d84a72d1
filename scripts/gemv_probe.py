"""Decode GEMV probe (developer tool; perf-notes step 44; not library code): one route per program column, the
prepared W4A16 words read straight into registers (no shared memory, no MMA), each word's 8 values placed as FP32
by masked shifts (value * 2**-126, a subnormal for code 1: needs no flush-to-zero), multiplied by x * 2**100 (so
products stay normal for |x| in [2**-100, 2**20]), summed per K32 block, times 2**(b - 101) per (row, block). Only
the GEMM (N = all weight rows, gate and up alike), no epilogue: how fast T=1's weight bytes go through conversion
and FMAs, next to the read-only floor of step 44.

    TRITON_INTERPRET=1 python3 scripts/gemv_probe.py check      # CPU: against dequantized weights
    python3 scripts/gemv_probe.py bench                          # GPU: configs x shapes, graphs, vs read-only kernels
    TRITON_INTERPRET=1 python3 scripts/gemv_probe.py bench --dry   # CPU: the bench's own code on a tiny shape

Two variants: ``shifts`` (``gemv_kernel``, above) and ``bf16`` (``gemv_bf16_kernel``: the library's W4A16 weights, BF16
with the block scale folded by the kernels' asm, unpacked to FP32; x read in place as BF16 pairs; the row's 2**(r - 127)
at the end; no range limit on x).
"""
import os, sys, json, statistics
import torch, triton, triton.language as tl
sys.path.insert(0, os.getcwd())
import mxmoe
from mxmoe import testing
from mxmoe.format import dequantize_mxfp4
from mxmoe._details import interpreting
from mxmoe._details.convert import E2M1X8_TO_BF16_KORDER_ASM, FOLD_REF_MAX, e2m1_to_bf16, fold_ref, pow2

M_PAIR: tl.constexpr = tl.constexpr(0x81C081C0)


@triton.jit
def _pair_bits(u, j: tl.constexpr):
    """Value pair j of each prepared word (``prepare.interleave_block_bits``): sign at bit 15 / 31, eem at 8..6 /
    24..22."""
    if j == 0:
        rj = u & M_PAIR
    elif j == 1:
        rj = (u << 4) & M_PAIR
    elif j == 2:
        rj = ((u << 10) | (u >> 22)) & M_PAIR
    else:
        rj = ((u << 6) & 0x80C080C0) | ((u >> 2) & 0x01000100)
    return rj


@triton.jit
def _pair_fp32(r):
    """A register of two values (sign at 15 / 31, eem at 8..6 / 24..22) -> (lo, hi) FP32 of value * 2**-126."""
    hi = (r & 0xFFFF0000).to(tl.float32, bitcast=True)
    lo = (r << 16).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _gemv_step(acc, w_ptr, s_ptr, x_row, row_base, rows, e, N, KW, nblk, k0, BN: tl.constexpr, KB: tl.constexpr,
               U: tl.constexpr, MASKED: tl.constexpr):
    """Words k0 .. k0 + 4 KB of the program's rows into the per-(row, block slot) sums ``acc`` [BN, KB]; ``MASKED``
    only for the last, partial step (K tail)."""
    W: tl.constexpr = KB * 4
    w = k0 + tl.arange(0, W)
    ok = w < KW
    wofs = (w // (U // 4)) * 64 * (U // 4) + w % (U // 4)
    if MASKED:
        u = tl.load(w_ptr + row_base[:, None] + wofs[None, :], mask=ok[None, :], other=0)
    else:
        u = tl.load(w_ptr + row_base[:, None] + wofs[None, :])
    u = u.to(tl.uint32, bitcast=True)
    for j in tl.static_range(4):
        lo, hi = _pair_fp32(_pair_bits(u, j))
        if MASKED:
            x0 = tl.load(x_row + (2 * j) * KW + w, mask=ok, other=0.0)
            x1 = tl.load(x_row + (2 * j + 1) * KW + w, mask=ok, other=0.0)
        else:
            x0 = tl.load(x_row + (2 * j) * KW + w)
            x1 = tl.load(x_row + (2 * j + 1) * KW + w)
        if j == 0:
            part = lo * x0[None, :]
        else:
            part = part + lo * x0[None, :]
        part = part + hi * x1[None, :]
    kb = k0 // 4 + tl.arange(0, KB)
    s_ptrs = s_ptr + e * N * nblk + rows[:, None].to(tl.int64) * nblk + kb[None, :]
    if MASKED:
        b = tl.load(s_ptrs, mask=(kb < nblk)[None, :], other=0)
    else:
        b = tl.load(s_ptrs)
    fac = (b.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 67108864.0  # 2**(b - 127) * 2**26 (b >= 1)
    return acc + tl.sum(part.reshape(BN, KB, 4), axis=2) * fac


@triton.jit
def gemv_kernel(w_ptr, s_ptr, xp_ptr, ids_ptr, out_ptr, N, K, top_k,
                BN: tl.constexpr, KB: tl.constexpr, U: tl.constexpr):
    """``xp``: x * 2**100 in FP32, planar by the words' value slots: xp[t, 2 j + c, w] = x[t, K of slot (j, c) of
    word w] (``planar_x``), so that each slot's values of a thread's consecutive words are one vector load."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    e = tl.load(ids_ptr + r).to(tl.int64)
    token = r // top_k
    KW = K // 8  # int32 words per row
    W: tl.constexpr = KB * 4  # words per row and step
    rows = pid_n * BN + tl.arange(0, BN)
    # word offset of (row, word w): expert, 64-row block, unit (U bytes = U/4 words of the block's 64 rows), row,
    # offset in the unit
    row_base = e * N * KW + (rows // 64).to(tl.int64) * 64 * KW + (rows % 64) * (U // 4)
    acc = tl.zeros([BN, KB], tl.float32)  # per (row, block slot): one cross-thread sum at the end
    nblk = K // 32
    x_row = xp_ptr + token.to(tl.int64) * K
    full = KW - KW % W
    for k0 in range(0, full, W):
        acc = _gemv_step(acc, w_ptr, s_ptr, x_row, row_base, rows, e, N, KW, nblk, k0, BN, KB, U, False)
    if full < KW:
        acc = _gemv_step(acc, w_ptr, s_ptr, x_row, row_base, rows, e, N, KW, nblk, full, BN, KB, U, True)
    tl.store(out_ptr + r.to(tl.int64) * N + rows, tl.sum(acc, axis=1))


@triton.jit
def _slot_value(u, d, j: tl.constexpr, c: tl.constexpr):
    """The plain twin of one asm output: value (j, c) of each word as FP32 of E2M1 times 2**d (BF16 rules)."""
    lane = (_pair_bits(u, j) >> (16 * c)) & 0xFFFF
    codes = (((lane >> 12) & 8) | ((lane >> 6) & 7)).to(tl.int32)
    return e2m1_to_bf16(codes, d).to(tl.float32)


@triton.jit
def _bf16_slots(u, f, d, PURE: tl.constexpr):
    """Words [BN, W] -> their 8 values (slot 2j + c: K 8j + 2q + c) as FP32 of the library's W4A16 BF16 weights, E2M1
    times 2**d (the asm: BF16x2 factor f = 2**(126 + d) per word; PURE: the plain twin, codes from the same shifts)."""
    if PURE:
        return (_slot_value(u, d, 0, 0), _slot_value(u, d, 0, 1), _slot_value(u, d, 1, 0), _slot_value(u, d, 1, 1),
                _slot_value(u, d, 2, 0), _slot_value(u, d, 2, 1), _slot_value(u, d, 3, 0), _slot_value(u, d, 3, 1))
    else:  # the asm's four BF16x2 products as 32-bit registers: each half to FP32 by one mask or shift
        t0, t1, t2, t3 = tl.inline_asm_elementwise(E2M1X8_TO_BF16_KORDER_ASM, "=r,=r,=r,=r,r,r", [u, f],
                                                   dtype=(tl.uint32, ) * 4, is_pure=True, pack=1)
        return ((t0 << 16).to(tl.float32, bitcast=True), (t0 & 0xFFFF0000).to(tl.float32, bitcast=True),
                (t1 << 16).to(tl.float32, bitcast=True), (t1 & 0xFFFF0000).to(tl.float32, bitcast=True),
                (t2 << 16).to(tl.float32, bitcast=True), (t2 & 0xFFFF0000).to(tl.float32, bitcast=True),
                (t3 << 16).to(tl.float32, bitcast=True), (t3 & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _bf16_step(acc, w_ptr, s_ptr, x_row, row_base, rows, ref, e, N, KW, nblk, k0, BN: tl.constexpr, KB: tl.constexpr,
               U: tl.constexpr, PURE: tl.constexpr, MASKED: tl.constexpr):
    """Words k0 .. k0 + 4 KB of the program's rows into ``acc`` [BN, 4 KB]; ``MASKED`` only for the K tail."""
    W: tl.constexpr = KB * 4
    w = k0 + tl.arange(0, W)
    ok = w < KW
    wofs = (w // (U // 4)) * 64 * (U // 4) + w % (U // 4)
    kb = k0 // 4 + tl.arange(0, KB)
    s_ptrs = s_ptr + e * N * nblk + rows[:, None].to(tl.int64) * nblk + kb[None, :]
    if MASKED:
        u = tl.load(w_ptr + row_base[:, None] + wofs[None, :], mask=ok[None, :], other=0)
        b = tl.load(s_ptrs, mask=(kb < nblk)[None, :], other=0)
    else:
        u = tl.load(w_ptr + row_base[:, None] + wofs[None, :])
        b = tl.load(s_ptrs)
    u = u.to(tl.uint32, bitcast=True)
    d = b.to(tl.int32) - ref[:, None]  # [BN, KB]
    f = (FOLD_REF_MAX + d) << 7
    f = (f | (f << 16)).to(tl.uint32, bitcast=True)
    d = tl.broadcast_to(d[:, :, None], (BN, KB, 4)).reshape(BN, W)
    f = tl.broadcast_to(f[:, :, None], (BN, KB, 4)).reshape(BN, W)
    v = _bf16_slots(u, f, d, PURE)
    # the pair of slot j of word 4 kb + q: int32 16 kb + 4 j + q of the row, 4 words of a block contiguous
    xi = 16 * kb[:, None] + tl.arange(0, 4)[None, :]
    for j in tl.static_range(4):
        idx = tl.max_contiguous(tl.multiple_of((xi + 4 * j).reshape(W), 4), 4)
        if MASKED:
            x2 = tl.load(x_row + idx, mask=ok, other=0)
        else:
            x2 = tl.load(x_row + idx)
        x_lo = (x2 << 16).to(tl.float32, bitcast=True)
        x_hi = (x2 & -65536).to(tl.float32, bitcast=True)
        acc += v[2 * j] * x_lo[None, :]
        acc += v[2 * j + 1] * x_hi[None, :]
    return acc


@triton.jit
def gemv_bf16_kernel(w_ptr, s_ptr, ref_ptr, x_ptr, ids_ptr, out_ptr, N, K, top_k,
                     BN: tl.constexpr, KB: tl.constexpr, U: tl.constexpr, PURE: tl.constexpr):
    """The W4A16 weights of the library (BF16, the block's 2**(b - r) folded, r = fold_ref(row ref); 2**(r - 127) per
    row at the end) by the kernels' asm, times x read in place as BF16 pairs, FP32 FFMAs."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    e = tl.load(ids_ptr + r).to(tl.int64)
    token = r // top_k
    KW = K // 8
    W: tl.constexpr = KB * 4
    rows = pid_n * BN + tl.arange(0, BN)
    row_base = e * N * KW + (rows // 64).to(tl.int64) * 64 * KW + (rows % 64) * (U // 4)
    ref = fold_ref(tl.load(ref_ptr + e * N + rows))
    acc = tl.zeros([BN, W], tl.float32)
    nblk = K // 32
    x_row = x_ptr + token.to(tl.int64) * (K // 2)  # int32 pairs
    full = KW - KW % W
    for k0 in range(0, full, W):
        acc = _bf16_step(acc, w_ptr, s_ptr, x_row, row_base, rows, ref, e, N, KW, nblk, k0, BN, KB, U, PURE, False)
    if full < KW:
        acc = _bf16_step(acc, w_ptr, s_ptr, x_row, row_base, rows, ref, e, N, KW, nblk, full, BN, KB, U, PURE, True)
    tl.store(out_ptr + r.to(tl.int64) * N + rows, tl.sum(acc, axis=1) * pow2(ref - 127))


def _launch_shape(w, ids, BN):
    """``(grid, N, K, U)`` of a probe launch over weights ``w [E, N, K/2]``: BN rows per program, a route per
    column."""
    E, N, KH = w.shape
    if N % BN or (BN < 64 and 64 % BN):
        raise ValueError(f"BN={BN} must divide N={N}")
    return (N // BN, ids.numel()), N, 2 * KH, mxmoe.prepare.row_block_unit(2 * KH)


def gemv_bf16(w, s, ref, x, ids, out, BN=32, KB=8, num_warps=4, num_stages=2):
    grid, N, K, U = _launch_shape(w, ids, BN)
    gemv_bf16_kernel[grid](w.view(torch.int32), s, ref, x.view(torch.int32), ids.view(-1), out, N, K, ids.shape[-1],
                           BN=BN, KB=KB, U=U, PURE=interpreting(), num_warps=num_warps, num_stages=num_stages)


def planar_x(x):
    """x [T, K] -> FP32 x * 2**100 [T, 8, K/8]: slot (j, c) of word w = 4 blk + q holds K 32 blk + 8 j + 2 q + c."""
    T, K = x.shape
    v = x.float().mul(2.0 ** 100).view(T, K // 32, 4, 4, 2)  # [T, blk, j, q, c]
    return v.permute(0, 2, 4, 1, 3).reshape(T, 8, K // 8).contiguous()


def gemv(w, s, xp, ids, out, BN=32, KB=8, num_warps=4, num_stages=2):
    grid, N, K, U = _launch_shape(w, ids, BN)
    gemv_kernel[grid](w.view(torch.int32), s, xp, ids.view(-1), out, N, K, ids.shape[-1], BN=BN, KB=KB, U=U,
                      num_warps=num_warps, num_stages=num_stages)


@triton.jit
def rd(w_ptr, s_ptr, ids, out, W_WORDS, S_WORDS, BLOCK: tl.constexpr):
    """Read-only twin (step 44): one BLOCK of int32 words of a route's expert weights or scales per program."""
    pid = tl.program_id(0)
    r = tl.program_id(1)
    e = tl.load(ids + r).to(tl.int64)
    nw = tl.cdiv(W_WORDS, BLOCK)
    offs = tl.arange(0, BLOCK)
    if pid < nw:
        idx = pid * BLOCK + offs
        v = tl.load(w_ptr + e * W_WORDS + idx, mask=idx < W_WORDS, other=0)
    else:
        idx = (pid - nw) * BLOCK + offs
        v = tl.load(s_ptr + e * S_WORDS + idx, mask=idx < S_WORDS, other=0)
    tl.store(out + r * tl.num_programs(0) + pid, tl.xor_sum(v, axis=0))


def words(t):
    return t.reshape(t.shape[0], -1).view(torch.int32)


def reference(ex, w, s, x, ids, which):
    src = ex.source_order_weights()[which]  # [E, N, K/2] source order
    out = []
    for r, e in enumerate(ids.view(-1).tolist()):
        W = dequantize_mxfp4(src[e], s[e], torch.float64)
        out.append(W @ x[r // ids.shape[-1]].double())
    return torch.stack(out)


def check():
    torch.manual_seed(0)
    for (E, H, I, top_k, T) in ((4, 128, 64, 2, 1), (3, 96, 64, 2, 2), (5, 2880 // 10 + 32, 320, 3, 1)):
        ex = mxmoe.prepare_weights(**testing.random_code_sources(E, H, I, seed=1))
        ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).int()
        x = torch.randn(T, H).bfloat16()
        x2 = torch.randn(T, I).bfloat16()
        for which, (w, s, xin) in enumerate(((ex.w13, ex.w13_scale, x), (ex.w2, ex.w2_scale, x2))):
            N = w.shape[1]
            ref = reference(ex, w, s, xin, ids, which)
            row_ref = ex.w13_ref if which == 0 else ex.w2_ref
            for variant in ("shifts", "bf16"):
                out = torch.full((ids.numel(), N), float("nan"))
                if variant == "shifts":
                    gemv(w, s, planar_x(xin), ids, out, BN=32 if N % 32 == 0 else 16, KB=4)
                else:
                    gemv_bf16(w, s, row_ref, xin, ids, out, BN=32 if N % 32 == 0 else 16, KB=4)
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                print(f"E={E} H={H} I={I} T={T} {'w13' if which == 0 else 'w2'} {variant}: rel {rel:.2e}, "
                      f"nan {out.isnan().sum().item()}")
                assert rel < 1e-6 and not out.isnan().any()


class _CpuGraph:
    """``bench --dry`` on the CPU (interpreter): a "graph" that calls its function, so the script's own code runs."""
    def __init__(self, fn):
        self.fn = fn
        fn()

    def replay(self):
        self.fn()


def bench(dry: bool = False):
    """GPU: both variants' configs on gpt-oss-120b and the reference shape at T=1. ``dry``: the same code on tiny
    shapes on the CPU under the interpreter (catches the script's own errors before device time is spent)."""
    import time
    from mxmoe.bench import capture_graph
    dev = "cpu" if dry else "cuda"
    res = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "rows": []}
    print(res["device"])
    graph = _CpuGraph if dry else capture_graph

    def replay_us(g, reps=100):
        if dry:
            t0 = time.perf_counter()
            g.replay()
            return (time.perf_counter() - t0) * 1e6
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record(); torch.cuda.synchronize()
        return a.elapsed_time(b) / reps * 1e3

    def graphs_us(f1, f2):
        """Both kernels in one graph, then each in its own: medians of 3 timings of each graph, µs."""
        return {key: statistics.median(replay_us(gr) for _ in range(3))
                for key, gr in (("both_us", graph(lambda: (f1(), f2()))), ("g1_us", graph(f1)), ("g2_us", graph(f2)))}

    shapes = [("tiny", (4, 128, 64, 2))] if dry else [("gpt-oss-120b", (128, 2880, 2880, 4)),
                                                     ("ref", (288, 4096, 1024, 8))]
    for name, (E, H, I, top_k) in shapes:
        ex = mxmoe.prepare_weights(**testing.random_code_sources(E, H, I, device=dev, scale_lo=118, scale_hi=122))
        g = torch.Generator(device=dev).manual_seed(1)
        ids = torch.randperm(E, device=dev, generator=g)[:top_k].view(1, top_k).int()
        x1 = torch.randn(1, H, device=dev).bfloat16()
        x2 = torch.randn(1, I, device=dev).bfloat16()
        xp1, xp2 = planar_x(x1), planar_x(x2)
        o1 = torch.empty(top_k, 2 * I, device=dev); o2 = torch.empty(top_k, H, device=dev)
        ref1 = reference(ex, ex.w13, ex.w13_scale, x1, ids, 0).float()
        ref2 = reference(ex, ex.w2, ex.w2_scale, x2, ids, 1).float()
        # the same bytes read only (step 44's kernel), in this run
        flat = ids.view(-1)
        sink = torch.empty(1 << 20, dtype=torch.int32, device=dev)

        def reader(wt, st, block=2048):
            ww, ss = words(wt), words(st)
            grid = (triton.cdiv(ww.shape[1], block) + triton.cdiv(ss.shape[1], block), top_k)
            return lambda: rd[grid](ww, ss, flat, sink, ww.shape[1], ss.shape[1], BLOCK=block, num_warps=4)
        r1, r2 = reader(ex.w13, ex.w13_scale), reader(ex.w2, ex.w2_scale)
        res["rows"].append(dict(shape=name, read_only=True, **graphs_us(r1, r2)))
        print(name, "read only", json.dumps(res["rows"][-1]))
        calls = {
            "shifts": lambda cfg: (lambda: gemv(ex.w13, ex.w13_scale, xp1, ids, o1, **cfg),
                                   lambda: gemv(ex.w2, ex.w2_scale, xp2, ids, o2, **cfg)),
            "bf16": lambda cfg: (lambda: gemv_bf16(ex.w13, ex.w13_scale, ex.w13_ref, x1, ids, o1, **cfg),
                                 lambda: gemv_bf16(ex.w2, ex.w2_scale, ex.w2_ref, x2, ids, o2, **cfg)),
        }
        configs = [(32, 4, 4, 1), (64, 4, 8, 2)] if dry else [
            (bn, kb, nw, ns) for bn in (32, 64, 128) for kb in (4, 8) for nw in (4, 8) for ns in (1, 2)]
        for variant, make in calls.items():
            for BN, KB, nw, ns in configs:
                cfg = dict(BN=BN, KB=KB, num_warps=nw, num_stages=ns)
                try:
                    o1.fill_(float("nan")); o2.fill_(float("nan"))
                    times = graphs_us(*make(cfg))
                    err = max(((o1 - ref1).norm() / ref1.norm()).item(), ((o2 - ref2).norm() / ref2.norm()).item())
                    row = dict(shape=name, variant=variant, **cfg, **times, rel=err)
                except Exception as exc:
                    row = dict(shape=name, variant=variant, **cfg, error=repr(exc)[:120])
                    print(name, variant, cfg, row["error"])
                res["rows"].append(row)
            print(name, variant, "best", json.dumps(_best(res["rows"], name, variant)))
        # today's whole T=1 call (both GEMMs, activation, top-k sum), graph, same run
        ws = mxmoe.Workspace(ex, 1, top_k)
        tw = torch.rand(1, top_k, device=dev)
        out = torch.empty_like(x1)
        call = graph(lambda: mxmoe.fused_moe(x1, ex, tw, ids, workspace=ws, out=out))
        call_us = statistics.median(replay_us(call) for _ in range(3))
        res["rows"].append(dict(shape=name, mxmoe_call=True, both_us=call_us))
        print(name, "mxmoe T=1 call", res["rows"][-1]["both_us"])
    if os.environ.get("OUT"):
        json.dump(res, open(os.path.join(os.environ["OUT"], "gemv_probe.json"), "w"), indent=1)
    print("| shape | read only: both / GEMM1 / GEMM2 us | GEMV shifts: best both (config) | GEMV bf16 "
          "| mxmoe T=1 call |")
    for name in dict.fromkeys(r["shape"] for r in res["rows"]):
        read = next(r for r in res["rows"] if r["shape"] == name and r.get("read_only"))
        call = next(r for r in res["rows"] if r["shape"] == name and r.get("mxmoe_call"))
        cells = []
        for variant in ("shifts", "bf16"):
            b = _best(res["rows"], name, variant)
            cells.append("-" if b is None else f"{b['both_us']:.1f} ({b['g1_us']:.1f} + {b['g2_us']:.1f}; BN {b['BN']} "
                         f"KB {b['KB']} w{b['num_warps']} s{b['num_stages']}; rel {b['rel']:.1e})")
        print(f"| {name} | {read['both_us']:.1f} / {read['g1_us']:.1f} / {read['g2_us']:.1f} | {cells[0]} "
              f"| {cells[1]} | {call['both_us']:.1f} |")


def _best(rows, shape, variant):
    """The fastest measured config of ``variant`` on ``shape`` (None where none ran)."""
    ok = [r for r in rows if r["shape"] == shape and r.get("variant") == variant and "both_us" in r]
    return min(ok, key=lambda r: r["both_us"], default=None)

if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        check()
    else:
        bench(dry="--dry" in sys.argv[1:])
