"""Same-process A/B of mxmoe versions (developer tool): the call time of each version, alternating batches of calls
in one process so that all see the same clock and power state (the H200 slows ~10 % under sustained load, more than
most changes measured), with the output's hash (bit-identity across versions) and each kernel's time.

    git archive <rev> mxmoe | tar -x -C /tmp/base      # a version: a directory holding an ``mxmoe`` package
    python3 scripts/ab_versions.py 5120,8192 /tmp/base . [--rounds 12] [--batch 10] [--prec w4a16] [--shape E,H,I,k]

Reference shape unless ``--shape`` (e.g. 128,2880,2880,4: gpt-oss-120b), random weights (seeded) and uniform random
routing. Per T and version: the median per-call time over the rounds, the median of its per-round ratio to the first
version (rounds alternate the order), the output's hash and NaN count, then the torch-profiler time of each kernel
(us; with PDL a kernel's time includes its wait)."""
import argparse
import hashlib
import importlib
import os
import shutil
import statistics
import sys
import tempfile

import torch

from _experts import kernel_times  # (scripts/: the directory of this script is on the path)

ap = argparse.ArgumentParser()
ap.add_argument("tokens")
ap.add_argument("versions", nargs="+")
ap.add_argument("--rounds", type=int, default=12)
ap.add_argument("--batch", type=int, default=10)
ap.add_argument("--prec", default="w4a16")
ap.add_argument("--shape", default="288,4096,1024,8")
args = ap.parse_args()

root = tempfile.mkdtemp()
names = []
for i, v in enumerate(args.versions):  # each version's package under a name of its own, so all import side by side
    names.append(f"mxmoe_v{i}")
    shutil.copytree(os.path.join(v, "mxmoe"), os.path.join(root, names[-1]),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for dirpath, _, files in os.walk(os.path.join(root, names[-1])):  # each its own custom-op namespace
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    text = fh.read()
                renamed = (text.replace('Library("mxmoe"', f'Library("{names[-1]}"')
                           .replace('"mxmoe::', f'"{names[-1]}::').replace("torch.ops.mxmoe.", f"torch.ops.{names[-1]}."))
                if renamed != text:
                    with open(path, "w") as fh:
                        fh.write(renamed)
sys.path.insert(0, root)
mods = [importlib.import_module(n) for n in names]

E, H, I, k = (int(v) for v in args.shape.split(","))
g = torch.Generator(device="cuda").manual_seed(0)
w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8, device="cuda")
s13 = torch.randint(118, 123, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8, device="cuda")
w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8, device="cuda")
s2 = torch.randint(118, 123, (E, H, I // 32), generator=g, dtype=torch.uint8, device="cuda")
experts = [m.prepare_weights(w13, s13, w2, s2) for m in mods]


for T in [int(t) for t in args.tokens.split(",")]:
    gt = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=gt).bfloat16()
    ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32, generator=gt)
    w = torch.rand(T, k, device="cuda", generator=gt)
    fns, outs = [], []
    for m, ex in zip(mods, experts):  # (the public entry: stable across versions)
        ws, out = m.Workspace(ex, T, k, fp8=True), torch.empty_like(x)
        fns.append(lambda m=m, ex=ex, ws=ws, out=out: m.fused_moe(x, ex, w, ids, precision=args.prec, out=out,
                                                                 workspace=ws))
        outs.append(out)
    checks = []
    for fn, out in zip(fns, outs):
        out.fill_(float("nan"))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        checks.append((hashlib.md5(out.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:10],
                       int(out.isnan().sum())))
    times = [[] for _ in fns]
    for r in range(args.rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.batch):
                fns[j]()
            end.record()
            torch.cuda.synchronize()
            times[j].append(start.elapsed_time(end) * 1000 / args.batch)
    for j, v in enumerate(args.versions):
        ratio = statistics.median(a / b for a, b in zip(times[j], times[0]))
        kernels = " ".join(f"{name[:18]}:{d:.0f}" for name, d in kernel_times(fns[j]) if d > 1.5)
        print(f"T={T} {v}: median {statistics.median(times[j]):.1f} us, ratio to {args.versions[0]} {ratio:.4f} | "
              f"hash {checks[j][0]} nan {checks[j][1]} | {kernels}", flush=True)
