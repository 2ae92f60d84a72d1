"""Per-kernel device times of one fused_moe call (developer tool; torch profiler, median of 5 calls).

    python3 scripts/breakdown.py 2048,8192 [w4a16,w4a8] ['{"kernel": "gluon_small", "block_rows": 64}']

Reference shape; the optional JSON is a ``config_override`` for both GEMMs (default: the kernels
``MXMOE_KERNEL`` selects)."""
import json
import sys

import torch

import mxmoe
from _experts import random_experts
from mxmoe._details import launch
from torch.profiler import profile, ProfilerActivity
E, H, I, k = 288, 4096, 1024, 8
ex = random_experts(E, H, I)
Ts = [int(t) for t in sys.argv[1].split(",")]
precs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["w4a16", "w4a8"]
over = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
for T in Ts:
    x = torch.randn(T, H, device="cuda").bfloat16(); ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32)
    w = torch.rand(T, k, device="cuda"); ws = mxmoe.Workspace(ex, T, k); out = torch.empty_like(x)
    for prec in precs:
        fn = lambda: launch.run_fused_moe(x, ex, w, ids, "silu", float("inf"), 1.0, None, prec, out, ws, dict(over))
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5): fn()
            torch.cuda.synchronize()
        evs = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        n = len(evs) // 5
        rows = []
        for j in range(n):
            d = sorted(evs[i * n + j].device_time for i in range(5))[2]
            rows.append((evs[j].name[:40], d))
        tot = sum(d for _, d in rows)
        print(f"T={T} {prec}: total {tot/1000:.3f} ms  " + "  ".join(f"{nm}:{d/1000:.3f}" for nm, d in rows), flush=True)
