"""Per-GEMM config variants at decode and small-batch T (developer tool; W4A16, reference shape).

    python3 scripts/gemm_variants.py 1,16,64 '[{}, {"g2": {"block_k": 128}}, {"g1": {"k_split": 2, "maxnreg": 128}}]'

Each variant is a config override (``_experts.variant``) for GEMM1 (``g1``) and/or GEMM2 (``g2``) alone, applied on top of
what ``config.gemm_config`` picks (``_experts.variant``). Prints,
per T and variant: the median CUDA-graph replay time of the whole call, the per-kernel device times
(torch profiler, median of 5 calls, launch order: route pack, GEMM1, GEMM2, top-k sum) and the relative
L2 difference of the output from the first variant's (0 = bit-identical)."""
import json
import sys

import torch

import mxmoe
from _experts import kernel_times, random_experts, run, variant
from mxmoe.bench import capture_graph, cuda_event_sampler, median

E, H, I, top_k = 288, 4096, 1024, 8
experts = random_experts(E, H, I)
for T in [int(t) for t in sys.argv[1].split(",")]:
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, top_k), device="cuda", dtype=torch.int32)
    w = torch.rand(T, top_k, device="cuda")
    ws, out, first = mxmoe.Workspace(experts, T, top_k, fp8=True), torch.empty_like(x), None
    for v in json.loads(sys.argv[2]):
        def fn(v=v):
            with variant(v):
                run(x, experts, w, ids, "w4a16", out, ws)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        first = out.clone() if first is None else first
        rel = ((out.float() - first.float()).norm() / first.float().norm()).item()
        kernels = [d for _, d in kernel_times(fn)]
        graph = capture_graph(fn)
        replay_ms = median(cuda_event_sampler(graph.replay, 60))
        print(f"T={T} {json.dumps(v)}: graph {replay_ms * 1000:.1f} us  kernels "
              + " ".join(f"{d:.1f}" for d in kernels) + f"  rel={rel:.2e}", flush=True)
