"""How fast the small-tile kernels' MMA step can run at all (developer tool, H200): one warpgroup per program, P
programs per SM, a loop of steps each issuing the small-tile W4A16 step's wgmmas (two accumulators, K = 64: 8 ×
HGMMA.64xNx16) and waiting for them, with no copies, barriers or scale words. Per step the A operand is

- RS: a register operand loaded once (the MMA alone),
- SS: shared memory,
- CONV: converted from E2M1 words each step by the kernels' asm (``sm90_operands._bf16_operand``),
- CONV+PIPE: the same with the wait one step later (``warpgroup_mma_wait(2)``): ptxas reuses the in-flight
  operand's registers, so its results are wrong; for timing only (what such an overlap could give).

    python3 scripts/mma_probe.py [N,... [P,...]]      # defaults 16,32,64,128 and 1,2,3,4

Prints ns per SM-step (one program's step; P programs share the SM) and ns per HGMMA. docs/perf-notes.md step 29."""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from mxmoe._details.sm90_operands import _bf16_operand, _fragment_words_layout, _small_mma_layout


@gluon.jit
def probe_kernel(out_ptr, steps, N: gl.constexpr, RS: gl.constexpr, CONV: gl.constexpr, PIPE: gl.constexpr):
    BM: gl.constexpr = 64
    BK: gl.constexpr = 64
    MMA: gl.constexpr = _small_mma_layout(N, False)
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = _fragment_words_layout(BM, BK)
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    b_s = gl.allocate_shared_memory(gl.bfloat16, [N, BK], gl.NVMMASharedLayout.get_default_for([N, BK], gl.bfloat16))
    a_s = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, BL))[None, :]
    b_s.store(((gl.arange(0, N, layout=gl.SliceLayout(1, BL))[:, None] * BK + cols) % 7).to(gl.bfloat16) * 0.001)
    a_s.store(((gl.arange(0, BM, layout=gl.SliceLayout(1, BL))[:, None] * BK + cols) % 5).to(gl.bfloat16) * 0.001)
    gl.thread_barrier()
    a_reg = a_s.load(DOT)
    words = gl.full([BM, BK // 32, 4], 0x11223344, gl.int32, WL) + gl.program_id(0)
    f = gl.full([BM, BK // 32], 0x3F803F80, gl.int32, gl.SliceLayout(2, WL))
    acc0 = gl.zeros((BM, N), gl.float32, MMA)
    acc1 = gl.zeros((BM, N), gl.float32, MMA)
    xb = b_s.permute((1, 0))
    for i in range(steps):
        if RS:
            op0 = a_reg
            op1 = a_reg
            if CONV:
                words = words ^ i
                op0 = _bf16_operand(words, f, BM, BK, WL, DOT)
                op1 = _bf16_operand(words ^ 0x5555, f, BM, BK, WL, DOT)
            acc0 = warpgroup_mma(op0, xb, acc0, is_async=True)
            acc1 = warpgroup_mma(op1, xb, acc1, is_async=True)
        else:
            acc0 = warpgroup_mma(a_s, xb, acc0, is_async=True)
            acc1 = warpgroup_mma(a_s, xb, acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(2 if PIPE else 0, deps=(acc0, acc1))
    acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc0 + acc1, axis=1), axis=0))


def ns_per_step(N, P, RS, CONV, PIPE, steps=4000):
    grid = torch.cuda.get_device_properties(0).multi_processor_count * P
    out = torch.empty(grid, device="cuda")
    run = lambda: probe_kernel[(grid, )](out, steps, N, RS, CONV, PIPE, num_warps=4)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e6)
    return sorted(times)[2] / (steps * P)


def main(argv):
    ns = [int(v) for v in argv[0].split(",")] if argv else [16, 32, 64, 128]
    ps = [int(v) for v in argv[1].split(",")] if len(argv) > 1 else [1, 2, 3, 4]
    forms = (("RS", 1, 0, 0), ("SS", 0, 0, 0), ("CONV", 1, 1, 0), ("CONV+PIPE", 1, 1, 1))
    print(f"{'N':>4} {'P':>2} " + " ".join(f"{name:>16}" for name, *_ in forms) + "   (ns per SM-step / per HGMMA)")
    for n in ns:
        for p in ps:
            cells = []
            for _, rs, conv, pipe in forms:
                t = ns_per_step(n, p, rs, conv, pipe)
                cells.append(f"{t:8.1f} / {t / 8:5.2f}")
            print(f"{n:4d} {p:2d} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
