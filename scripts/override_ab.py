"""Same-process A/B of launch overrides (developer tool): whole-call CUDA-graph replays (``--eager``: eager calls, each
under its variant's overrides; they include the JIT's host work, which launch plans do not cover under overrides, so
they time the GPU only where its call outlasts that: large T), alternating rounds, with bit-identity against the first
variant and each kernel's time (torch profiler, last).

    python3 scripts/override_ab.py 16,1024,8192 '[{}, {"pdl": false}]' [--prec w4a16] [--rounds 6] [--shape E,H,I,k]
                                   [--eager]

Each variant is keyword arguments of ``mxmoe._details.config.overrides`` (e.g. ``{"gemm": {"half_tiles": false}}``)
and gets a workspace sized under it (overrides may change what a call needs, e.g. the wide tiles' pack). Reference
shape unless ``--shape`` (gpt-oss-120b: 128,2880,2880,4), seeded random weights, uniform random routing; then, per T,
the same on ids with masked routes (-1 and >= E) for bit-identity only."""
import argparse
import json
import statistics

import torch

import mxmoe
from _experts import kernel_times, random_experts, run
from mxmoe._details.config import overrides
from mxmoe.bench import capture_graph, cuda_event_sampler, median, round_orders

ap = argparse.ArgumentParser()
ap.add_argument("tokens")
ap.add_argument("variants")
ap.add_argument("--prec", default="w4a16")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--shape", default="288,4096,1024,8")
ap.add_argument("--eager", action="store_true")
args = ap.parse_args()
variants = json.loads(args.variants)
E, H, I, top_k = (int(v) for v in args.shape.split(","))
experts = random_experts(E, H, I)


def under(variant: dict, fn):
    """``fn`` called under the variant's overrides (an eager call reads them when it launches; a graph keeps the
    launches captured under them)."""
    def call():
        with overrides(**variant):
            return fn()
    return call


rows = []
for T in [int(t) for t in args.tokens.split(",")]:
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = torch.rand(T, top_k, device="cuda", generator=g)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:top_k] for _ in range(T)]).int()
    masked = ids.clone()
    drop = torch.rand(T, top_k, device="cuda", generator=g)
    drop[:, 0] = 1  # every token keeps its first route (a token with all routes masked: the GPU tests)
    masked[drop < 0.2] = -1
    masked[(drop >= 0.2) & (drop < 0.3)] = E + 5
    masked[T // 2] = ids[T // 2]  # (a token with none masked, whatever T)
    outs, timed, kept, same, same_masked = [], [], [], [], []
    for v in variants:
        out = torch.full_like(x, float("nan"))
        with overrides(**v):
            ws = mxmoe.Workspace(experts, T, top_k, fp8=args.prec == "w4a8")
            run(x, experts, w, masked, args.prec, out, ws)
            torch.cuda.synchronize()
            out_masked = out.clone()
            out.fill_(float("nan"))
            fn = (lambda out=out, ws=ws: run(x, experts, w, ids, args.prec, out, ws))
            fn()
            torch.cuda.synchronize()
            outs.append((out.clone(), out_masked))
            # (a graph replays into this variant's workspace and out: kept alive, or the next variant's buffers take
            # their memory and the replay reads another layout's route pack)
            kept.append((ws, out))
            timed.append(under(v, fn) if args.eager else capture_graph(fn).replay)
        same.append(torch.equal(outs[-1][0], outs[0][0]))
        same_masked.append(torch.equal(outs[-1][1], outs[0][1]))
    times = [[] for _ in variants]
    for order in round_orders(list(range(len(variants))), args.rounds):  # as given, reversed, ...
        for i in order:
            times[i].append(median(cuda_event_sampler(timed[i], 40)) * 1000)
    base = statistics.median(times[0])
    for i, v in enumerate(variants):
        t = statistics.median(times[i])
        nan = int(outs[i][0].isnan().sum())
        rows.append((T, json.dumps(v), t, t / base - 1, same[i], same_masked[i], nan))
        print(f"T={T} {json.dumps(v)}: {t:.1f} us ({100 * (t / base - 1):+.1f} %) bitwise={same[i]} "
              f"masked bitwise={same_masked[i]} nan={nan}", flush=True)
    del timed, kept
for T in [int(t) for t in args.tokens.split(",")]:  # kernel times last: the profiler slows later launches
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda")[:top_k] for _ in range(T)]).int()
    w = torch.rand(T, top_k, device="cuda")
    out = torch.empty_like(x)
    for v in variants:
        with overrides(**v):
            ws = mxmoe.Workspace(experts, T, top_k, fp8=args.prec == "w4a8")
            ks = kernel_times(lambda: run(x, experts, w, ids, args.prec, out, ws))
        print(f"T={T} {json.dumps(v)} kernels us: " + " ".join(f"{d:.1f}" for _, d in ks), flush=True)
print("\n| T | variant | call us | vs first | bitwise | masked bitwise | NaN |")
for T, v, t, d, s, sm, nan in rows:
    print(f"| {T} | {v} | {t:.1f} | {100 * d:+.1f} % | {s} | {sm} | {nan} |")
