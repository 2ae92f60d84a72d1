"""Device check (developer tool): the Gluon kernels against the plain-Triton template, then timing.

    GLUON=auto python3 scripts/gluon_check.py check      # the default selection (MXMOE_KERNEL=auto)
    GLUON=gluon_small python3 scripts/gluon_check.py check
    GLUON_JSON='{"w4a8": {...}, "w4a16": {...}}' python3 scripts/gluon_check.py check   # config overrides
    GLUON_JSON='{"w4a16": {"g2": {...}}, ...}' ...                                      # per GEMM ("g1", "g2")
    UNFOLD=1 PRECS=w4a8 GLUON=auto python3 scripts/gluon_check.py check  # W4A8's exact unfolded kernel on every expert
    python3 scripts/gluon_check.py time '[{"kernel": "gluon_small"}]'

``check``: 32 cases (three shapes with the K % 128 != 0 one, T from 1 to 8192, masked routes and
out-of-range ids, 30-binade scale spans, both activations, both precisions unless $PRECS says):
relative L2 to the plain template (0 = bit-identical) and unwritten (NaN) elements. W4A8's fast path (the default,
scales folded into E4M3, FP8 accumulator chains of 1024 K) is not bit-identical to the plain template (its per-block
FP32 rescale): it shows its difference (tests/test_gpu_moe.py bounds it against exact); ``UNFOLD=1`` sends every expert
to the exact unfolded Gluon kernel, which is. ``time``: reference
shape, T from $TOKENS, median CUDA-event ms of the plain template, the default selection and any
variants. Writes $OUT/ws_<stage>.json; prints a summary last."""
import os, sys, time, json
import torch
import mxmoe
from _experts import random_experts, run as run_launch, variant
from mxmoe.bench import cuda_event_sampler, median

OUT = os.environ.get("OUT", "/tmp")
torch.manual_seed(0)
def experts(E, H, I, wide=False):
    ex = random_experts(E, H, I, wide=wide, biases=True)
    if os.environ.get("UNFOLD"):  # no expert on W4A8's fast path
        ex.w13_fold.zero_()
        ex.w2_fold.zero_()
        ex.all_fold = False
    return ex


def run(kernel, x, ex, w, ids, prec, ws, act="silu"):
    out = torch.full_like(x, float("nan"))
    over = {} if kernel == "auto" else {"kernel": kernel}
    if kernel != "triton" and os.environ.get("GLUON_JSON"):
        over = json.loads(os.environ["GLUON_JSON"])[prec]
    with variant(over):
        run_launch(x, ex, w, ids, prec, out, ws, act)
    return out

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

rows = []
stage = sys.argv[1] if len(sys.argv) > 1 else "all"
if stage in ("all", "check"):
    for shape in [(32, 1024, 512, 4), (128, 2880, 2880, 4), (288, 4096, 1024, 8)]:
        E, H, I, k = shape
        ex = experts(E, H, I)
        for T in ({32: [1, 7, 64, 1000, 3000], 128: [1, 64, 1000, 4096]}.get(shape[0], [1, 64, 1000, 2048, 8192])):
            x = torch.randn(T, H, device="cuda").bfloat16()
            ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32)
            if T >= 7: ids[T // 2] = -1; ids[0, 0] = E + 3
            w = torch.rand(T, k, device="cuda")
            ws = mxmoe.Workspace(ex, T, k, fp8=True)
            for prec in os.environ.get("PRECS", "w4a16,w4a8").split(","):
                t0 = time.time()
                try:
                    a = run("triton", x, ex, w, ids, prec, ws)
                    b = run(os.environ.get("GLUON", "gluon"), x, ex, w, ids, prec, ws)
                    torch.cuda.synchronize()
                    r = dict(shape=shape, T=T, prec=prec, rel=rel(b, a), nan=int(torch.isnan(b).sum()), sec=time.time() - t0)
                except Exception as e:
                    r = dict(shape=shape, T=T, prec=prec, error=str(e)[-1500:])
                print(r, flush=True); rows.append(r)
    ex = experts(32, 1024, 512, wide=True)
    for prec in os.environ.get("PRECS", "w4a16,w4a8").split(","):
        for act in ("silu", "swigluoai"):
            T = 300; x = torch.randn(T, 1024, device="cuda").bfloat16(); ids = torch.randint(0, 32, (T, 4), device="cuda"); w = torch.rand(T, 4, device="cuda")
            ws = mxmoe.Workspace(ex, T, 4, fp8=True)
            a = run("triton", x, ex, w, ids, prec, ws, act); b = run(os.environ.get("GLUON", "gluon"), x, ex, w, ids, prec, ws, act)
            r = dict(shape="wide", prec=prec, act=act, rel=rel(b, a), nan=int(torch.isnan(b).sum())); print(r, flush=True); rows.append(r)
if stage in ("all", "time"):
    E, H, I, k = 288, 4096, 1024, 8
    ex = experts(E, H, I)
    for T in [int(t) for t in os.environ.get("TOKENS", "1,64,1024,2048,4096,8192").split(",")]:
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32); w = torch.rand(T, k, device="cuda")
        ws = mxmoe.Workspace(ex, T, k, fp8=True)
        out = torch.empty_like(x)
        for prec in os.environ.get("PRECS", "w4a16,w4a8").split(","):
            variants = [{"kernel": "triton"}, {}] + (json.loads(sys.argv[2]) if len(sys.argv) > 2 else [])
            for kern in variants:
                kern = dict(kern)
                if T not in kern.pop("T", [T]) or prec != kern.pop("prec", prec):
                    continue
                def fn(kern=kern):
                    with variant(kern):
                        run_launch(x, ex, w, ids, prec, out, ws)
                try:
                    fn(); ms = median(cuda_event_sampler(fn, 20))
                except Exception as e:
                    ms = float("nan"); print("ERR", T, prec, kern, str(e)[-800:])
                r = dict(T=T, prec=prec, kernel=kern, ms=ms, tflops=T * k * 6 * H * I / ms / 1e9)
                print(r, flush=True); rows.append(r)
json.dump(rows, open(os.path.join(OUT, f"ws_{stage}.json"), "w"), indent=1, default=str)
print("\nSUMMARY")
for r in rows:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "error"), ("ERROR " + r["error"][-200:]) if "error" in r else "")
