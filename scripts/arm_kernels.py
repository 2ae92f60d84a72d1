"""Per-kernel device times of one `mxmoe bench` arm's call (developer tool; torch profiler, median of 5 calls).

    python3 scripts/arm_kernels.py humming 1,64,1024,8192 [--min-us 5]

Reference shape, the bench's weights and inputs (same seeds). Prints, per T, the number of kernels, their summed time,
for arms that name their GEMM kernels (the Humming ones) those alone as `mxmoe bench` reports them (gemm_ms), and each
kernel above ``--min-us``, longest first: how much of a peer's call is its GEMMs and how much the glue around them."""
import argparse

import torch

from mxmoe import bench, testing

ap = argparse.ArgumentParser()
ap.add_argument("arm", choices=bench.ARM_NAMES)
ap.add_argument("tokens")
ap.add_argument("--min-us", type=float, default=5.0)
args = ap.parse_args()

shape = bench.Shape(288, 4096, 1024, 8)
device = torch.device("cuda")
experts, _ = testing.make_experts(shape.E, shape.H, shape.I, seed=0, device=device, gen_device=device)
arm = next(a for a in bench.all_arms() if a.name == args.arm)
if arm.unavailable():
    raise SystemExit(arm.unavailable())
tokens = [int(t) for t in args.tokens.split(",")]
arm.prepare(experts, shape, max(tokens))
if getattr(arm, "note", None):
    print(arm.note)
for T in tokens:
    fn = arm.make_call(bench.make_inputs(shape, T, device, seed=0))  # the bench's inputs (its default seed)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = bench.kernel_times(fn)
    gemms = ""
    if arm.gemm_kernel is not None:
        ms, n = bench.gemm_alone_ms(times, arm.gemm_kernel)
        gemms = f"; its {n} GEMM kernels {1000 * ms:.1f} us"
    print(f"T={T}: {len(times)} kernels, {sum(t for _, t in times):.0f} us in all{gemms}; "
          + ", ".join(f"{name[:48]} {t:.1f}" for name, t in sorted(times, key=lambda nt: -nt[1]) if t >= args.min_us),
          flush=True)
