"""Device check and timing (developer tool): GEMM kernel variants against the plain-Triton template.

    python3 scripts/kernel_variants.py [check|time|all] ['[{"kernel": "gluon_small"}, {"kernel": "gluon_small", "num_stages": 6}]']

``check``: W4A16 outputs of each variant (config override dicts, ``_experts.variant``, as ``config.overrides`` takes
them) against the plain template on three shapes (K tail included), masked routes, wide scale spans,
both activations: relative L2, bitwise equality, unwritten (NaN) elements. ``time``: reference shape,
T from $TOKENS (default 1,4,16,64,256,1024), median CUDA-event µs (graph replays where T*top_k <= 1024).
Writes $OUT/small_<stage>.json; prints a summary last.
"""
import os, sys, json
import torch
import mxmoe
from _experts import random_experts, run, variant
from mxmoe.bench import cuda_event_sampler, median, capture_graph

OUT = os.environ.get("OUT", "/tmp")
def experts(E, H, I, wide=False):
    return random_experts(E, H, I, wide=wide, biases=True)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

def call(x, ex, w, ids, ws, out, v, act="silu"):
    with variant(v):
        run(x, ex, w, ids, "w4a16", out, ws, act)

rows = []
stage = sys.argv[1] if len(sys.argv) > 1 else "all"
small = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [{"kernel": "gluon_small"}]
if stage in ("all", "check"):
    cases = [((32, 1024, 512, 4), [1, 7, 64, 1000], False), ((128, 2880, 2880, 4), [1, 64], False),
             ((288, 4096, 1024, 8), [1, 64, 1000], False), ((32, 1024, 512, 4), [300], True)]
    for shape, Ts, wide in cases:
        E, H, I, k = shape
        ex = experts(E, H, I, wide=wide)
        for T in Ts:
            x = torch.randn(T, H, device="cuda").bfloat16()
            ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32)
            if T >= 7: ids[T // 2] = -1; ids[0, 0] = E + 3
            w = torch.rand(T, k, device="cuda")
            ws = mxmoe.Workspace(ex, T, k, fp8=True)
            for act in (("silu", "swigluoai") if wide else ("silu",)):
                a = torch.full_like(x, float("nan")); call(x, ex, w, ids, ws, a, {"kernel": "triton"}, act)
                for v in small:
                    b = torch.full_like(x, float("nan"))
                    try:
                        call(x, ex, w, ids, ws, b, v, act); torch.cuda.synchronize()
                        r = dict(shape=shape, T=T, act=act, v=v, rel=rel(b, a), bitwise=bool(torch.equal(a, b)), nan=int(torch.isnan(b).sum()))
                    except Exception as e:
                        r = dict(shape=shape, T=T, v=v, error=str(e)[-1200:])
                    print(r, flush=True); rows.append(r)
if stage in ("all", "time"):
    E, H, I, k = 288, 4096, 1024, 8
    ex = experts(E, H, I)
    variants = [{"kernel": "triton"}] + small
    for T in [int(t) for t in os.environ.get("TOKENS", "1,4,16,64,256,1024").split(",")]:
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).int()
        w = torch.rand(T, k, device="cuda")
        ws = mxmoe.Workspace(ex, T, k, fp8=True)
        out = torch.empty_like(x)
        for v in variants:
            v = dict(v)
            if T not in v.pop("T", [T]):
                continue
            fn = lambda: call(x, ex, w, ids, ws, out, v)
            try:
                if T * k <= 1024:
                    g = capture_graph(fn); f = g.replay
                else:
                    fn(); f = fn
                us = median(cuda_event_sampler(f, 30)) * 1e3
            except Exception as e:
                us = float("nan"); print("ERR", T, v, str(e)[-800:])
            r = dict(T=T, v=v, us=us)
            print(r, flush=True); rows.append(r)
json.dump(rows, open(os.path.join(OUT, f"small_{stage}.json"), "w"), indent=1, default=str)
print("\nSUMMARY")
for r in rows:
    print(" ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in r.items() if a != "error"), ("ERROR " + r["error"][-300:]) if "error" in r else "")
