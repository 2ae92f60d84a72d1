"""racecheck on Gluon's warp specialization alone (developer tool, CUDA): a kernel whose two partitions each store
one value to global memory and touch no shared memory of their own, so any hazard racecheck reports is in the code
Triton generates around ``gl.warp_specialize`` (each worker warp's partition-state byte in shared memory, written by
the default warpgroup before named barrier 1, read by the workers after it). Shapes of mxmoe's wide kernels: the call
under a runtime branch, a worker with fewer registers (``setmaxnreg``), partitions with a barrier of their own, mbarriers initialized before the call.

    compute-sanitizer --tool racecheck python3 scripts/ws_race_probe.py
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier  # Triton 3.6 / 3.8 names


@gluon.jit
def _part(out_ptr, which: gl.constexpr, BARRIER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, 32 * gl.num_warps(), layout)
    if BARRIER:  # a partition-local barrier (named barrier of the partition's warps), as mxmoe's partitions have
        _barrier()
    gl.store(out_ptr + which * 32 * gl.num_warps() + offs, offs + which)


@gluon.jit
def probe_kernel(out_ptr, n, BRANCH: gl.constexpr, BARRIER: gl.constexpr, MBAR: gl.constexpr):
    base = out_ptr + gl.program_id(0) * 256
    if BRANCH:
        if gl.program_id(0) < n:
            if MBAR:  # mbarriers in shared memory initialized before the partitions start, as mxmoe's rings are
                bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
                for s in gl.static_range(4):
                    mbarrier.init(bars.index(s), count=1)
            gl.warp_specialize([(_part, (base, 0, BARRIER)), (_part, (base, 1, BARRIER))], [4], [96])
    else:
        gl.warp_specialize([(_part, (base, 0, BARRIER)), (_part, (base, 1, BARRIER))], [4], [96])


if __name__ == "__main__":
    out = torch.zeros(8 * 256, dtype=torch.int32, device="cuda")
    for branch, barrier, mbar in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        print(f"### probe branch={branch} barrier={barrier} mbarriers={mbar}", flush=True)
        probe_kernel[(8,)](out, 8, BRANCH=branch, BARRIER=barrier, MBAR=mbar, num_warps=4)
        torch.cuda.synchronize()
    expect = torch.arange(256, device="cuda", dtype=torch.int32) % 128 + (torch.arange(256, device="cuda") >= 128).int()
    print("### correct", bool((out.view(8, 256) == expect).all()), flush=True)
