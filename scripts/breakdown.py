"""Per-kernel device times of one fused_moe call per config variant (developer tool; torch profiler,
median of 5 calls; the variants interleaved per T).

    python3 scripts/breakdown.py 2048,8192 [w4a16,w4a8] ['[{}, {"num_warps": 8}, {"g1": {"num_warps": 8}}]'] \
        [E,H,I,TOPK]

The reference shape unless E,H,I,TOPK is given (gpt-oss-120b: 128,2880,2880,4). Each variant is a config override
(``_experts.variant``): flat for both GEMMs, or ``{"g1": {...}, "g2": {...}}`` for each GEMM alone (applied on top of
what ``config.gemm_config`` picks; ``{}`` = the default selection). Also prints the relative L2 difference of each
variant's output from the first variant's (0 = bit-identical)."""
import json
import sys

import torch

import mxmoe
from _experts import kernel_times, random_experts, run, variant

E, H, I, k = (int(v) for v in sys.argv[4].split(",")) if len(sys.argv) > 4 else (288, 4096, 1024, 8)
ex = random_experts(E, H, I)
Ts = [int(t) for t in sys.argv[1].split(",")]
precs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["w4a16", "w4a8"]
variants = json.loads(sys.argv[3]) if len(sys.argv) > 3 else [{}]
if isinstance(variants, dict):
    variants = [variants]
for T in Ts:
    x = torch.randn(T, H, device="cuda").bfloat16(); ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32)
    w = torch.rand(T, k, device="cuda"); ws = mxmoe.Workspace(ex, T, k, fp8=True); out = torch.empty_like(x)
    for prec in precs:
        first = None
        for v in variants:
            def fn(v=v):
                with variant(v):
                    run(x, ex, w, ids, prec, out, ws)
            out.fill_(float("nan"))
            for _ in range(3): fn()
            torch.cuda.synchronize()
            res = out.clone()
            if first is None:
                first = res
            diff = ((res.float() - first.float()).norm() / first.float().norm()).item()
            rows = [(nm[:28], d) for nm, d in kernel_times(fn)]
            tot = sum(d for _, d in rows)
            gemms = [d for nm, d in rows if "gemm" in nm]
            print(f"T={T} {prec} {json.dumps(v)}: total {tot/1000:.3f} ms gemms " + " ".join(f"{d/1000:.3f}" for d in gemms)
                  + f" | rel {diff:.2e} nan {int(res.isnan().sum())} | " + " ".join(f"{nm}:{d/1000:.3f}" for nm, d in rows), flush=True)
