"""W4A8 fast path on the device (developer tool): GEMM-level and layer accuracy, then a timing sweep of tile configs.

    python3 scripts/w4a8_fold.py [acc] [layer] [time] [ab=<dir of a base mxmoe>]   (default: all three)

``acc``: each GEMM's FP32 output against float64 of the same E4M3 operands (SPEC §5: <= 1.5e-3; ``accuracy.gemm_level``)
on the three SPEC shapes at several T (so every route-tile height), with the default FP8 chain length or
``promote=<steps,...>`` (``d``: the default). (Step 31's bias figures came from this script's form in commit c8d73fc.) ``layer``: the whole call against the exact FP32
reference and the FP8 emulation, whole and per token (SPEC §5 bounds), Gaussian and Student-t (3) weights, wide scale
spans (the exact slower path), masked routes. ``time``: reference shape, per-kernel torch-profiler times and the call's
CUDA-event time of config variants; with ``ab=`` also the same call of another mxmoe version in the same process.
Prints a short table last; details in $OUT/w4a8_fold.json."""
import importlib
import json
import os
import shutil
import sys
import tempfile

import torch

import mxmoe
from _experts import kernel_times, run, variant
from mxmoe import accuracy, reference, testing
from mxmoe._details.config import overrides
from mxmoe.bench import cuda_event_sampler, median
from mxmoe.prepare import fold_report

OUT = os.environ.get("OUT", "/tmp")
args = sys.argv[1:]
CPU = "cpu" in args  # a dry run of the script's own logic at small shapes (TRITON_INTERPRET=1: the plain template)
args = [a for a in args if a != "cpu"]
dev = torch.device("cpu" if CPU else "cuda")
torch.manual_seed(0)
stages = [a for a in args if "=" not in a] or ["acc", "layer", "time"]
opts = dict(a.split("=", 1) for a in args if "=" in a)
rows_out = []
summary = []


def emit(r, short=None):
    print(json.dumps(r, default=str), flush=True)
    rows_out.append(r)
    if short:
        summary.append(short)


def experts_for(E, H, I, seed=0, dist="normal"):
    if dist == "normal":
        return testing.make_experts(E, H, I, seed=seed, device=dev, gen_device=dev)[0]
    t3 = torch.distributions.StudentT(torch.tensor(3.0, device=dev))

    def quant(N, K, std):
        w = torch.empty(E, N, K // 2, dtype=torch.uint8, device=dev)
        s = torch.empty(E, N, K // 32, dtype=torch.uint8, device=dev)
        for e in range(E):
            w[e], s[e] = mxmoe.quantize_mxfp4(t3.sample((N, K)) * std)
        return w, s
    w13, s13 = quant(2 * I, H, 2.0 / H ** 0.5)
    w2, s2 = quant(H, I, 1.0 / I ** 0.5)
    return mxmoe.prepare_weights(w13, s13, w2, s2)


def routing(T, top_k, E, masked=True, seed=1):
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, E, (T, top_k), generator=g, device=dev, dtype=torch.int32)
    if masked and T >= 4:
        ids[T // 3, : top_k // 2] = -1
        ids[T // 3, top_k // 2:] = E + 5
        ids[1, 0] = -1
    w = torch.rand(T, top_k, generator=g, device=dev)
    return ids, w


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()




if "acc" in stages:
    shapes = (((288, 4096, 1024, 8), (16, 256, 2048, 8192)), ((256, 7168, 2048, 8), (1024, 4096)),
              ((128, 2880, 2880, 4), (1024,)))
    if "acc_tokens" in opts:
        shapes = tuple((sh, [int(t) for t in opts["acc_tokens"].split(",")]) for sh, _ in shapes[:int(opts.get("acc_shapes", 3))])
    if CPU:
        shapes = (((8, 128, 64, 2), (3, 40)), ((4, 96, 160, 3), (5,)))
    for (E, H, I, top_k), Ts in shapes:
        ex = testing.make_experts(E, H, I, seed=0, device=dev, gen_device=dev, zero_up=True)[0]
        for T in Ts:
            ids, w = routing(T, top_k, E)
            x = torch.randn(T, H, device=dev).bfloat16()
            for promote in [None if p == "d" else int(p) for p in opts.get("promote", "d").split(",")]:
                with overrides(gemm={} if promote is None else dict(promote=promote)):
                    m, _ = accuracy.gemm_level(x, ex, w, ids)
                e1, e2 = m["w4a8_gemm1_vs_f64"], m["w4a8_gemm2_vs_f64"]
                emit(dict(stage="acc", shape=(E, H, I, top_k), T=T, promote=promote, gemm1=e1, gemm2=e2),
                     f"acc {E},{H},{I},{top_k} T={T} promote={'default' if promote is None else promote}: "
                     f"GEMM1 {e1:.2e} GEMM2 {e2:.2e}")

if "layer" in stages:
    cases = (((288, 4096, 1024, 8), 512, "normal", "normal"),
                                             ((64, 1024, 512, 4), 300, "t3", "normal"),
                                             ((64, 1024, 512, 4), 300, "normal", "zero_bytes"),
                                             ((32, 1024, 512, 4), 200, "normal", "wide_span"),
                                             ((128, 2880, 2880, 4), 200, "normal", "normal"),
                                             ((16, 96, 160, 3), 20, "normal", "normal"),
                                             ((16, 256, 64, 3), 21, "normal", "normal"))
    if CPU:
        cases = (((8, 128, 64, 2), 9, "t3", "normal"), ((8, 128, 64, 2), 9, "normal", "wide_span"))
    for (E, H, I, top_k), T, dist, scales in cases:
        x_exp = None
        if dist == "t3":
            ex = experts_for(E, H, I, dist="t3")
        else:
            ex, x_exp = testing.make_experts(E, H, I, seed=5, device=dev, gen_device=dev, scales=scales)
        ids, w = routing(T, top_k, E)
        x = torch.randn(T, H, device=dev)
        if x_exp is not None:
            x = x * torch.pow(2.0, x_exp.clamp(max=8).float().repeat_interleave(32))[None, :]
        x = x.bfloat16()
        out = torch.full_like(x, float("nan"))
        mxmoe.fused_moe(x, ex, w, ids, precision="w4a8", out=out)
        exact = reference.fused_moe_reference(x, ex, w, ids, mode="exact")
        emu = reference.fused_moe_reference(x, ex, w, ids, mode="w4a8")
        nz = exact.norm(dim=1) > 0
        tok = lambda o: ((o.double() - exact.double()).norm(dim=1)[nz] / exact.double().norm(dim=1)[nz])  # noqa: E731
        ex_whole = rel(out, exact) - rel(emu, exact)
        ex_tok = (tok(out) - tok(emu)).max().item()
        r = dict(stage="layer", shape=(E, H, I, top_k), T=T, dist=dist, scales=scales, vs_exact=rel(out, exact),
                 emu_vs_exact=rel(emu, exact), vs_emu=rel(out, emu), excess_whole=ex_whole, excess_token=ex_tok,
                 nan=int(out.isnan().sum()), masked_rows_zero=bool((out[~nz] == 0).all()), fold=fold_report(ex))
        emit(r, f"layer {E},{H},{I},{top_k} T={T} {dist}/{scales}: exact {r['vs_exact']:.4f} (emu {r['emu_vs_exact']:.4f}) "
                f"excess {ex_whole * 100:+.2f}pp tok {ex_tok * 100:+.2f}pp vs_emu {r['vs_emu']:.4f} nan {r['nan']} "
                f"fold {r['fold']['both']:.2f}")

if "time" in stages:
    E, H, I, top_k = 288, 4096, 1024, 8
    ex = testing.make_experts(E, H, I, seed=0, device=dev, gen_device=dev)[0]
    base = None
    if "ab" in opts:  # another version, imported under a name of its own
        root = tempfile.mkdtemp()
        shutil.copytree(os.path.join(opts["ab"], "mxmoe"), os.path.join(root, "mxmoe_base"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        sys.path.insert(0, root)
        base = importlib.import_module("mxmoe_base")
        ex_base = base.prepare_weights(**mxmoe.unprepare_weights(ex))
    variants = json.loads(opts.get("variants", "[{}]"))
    for T in [int(t) for t in opts.get("tokens", "1024,2048,4096,8192").split(",")]:
        ids, w = routing(T, top_k, E, masked=False)
        x = torch.randn(T, H, device=dev).bfloat16()
        out = torch.empty_like(x)
        ws = mxmoe.Workspace(ex, T, top_k, fp8=True)
        calls = {}
        def call(v, precision):
            with variant(v):
                run(x, ex, w, ids, precision, out, ws)

        for v in variants:
            calls[json.dumps(v)] = lambda v=v: call(v, "w4a8")
        calls["w4a16"] = lambda: call({}, "w4a16")
        if base is not None:
            ws_b = base.Workspace(ex_base, T, top_k, fp8=True)
            calls["base w4a8"] = lambda: base.fused_moe(x, ex_base, w, ids, precision="w4a8", out=out, workspace=ws_b)
        for name, fn in calls.items():
            try:
                fn()
                torch.cuda.synchronize()
                ms = median(cuda_event_sampler(fn, 30))
                kt = kernel_times(fn)
            except Exception as e:  # a config that does not compile or launch: report, go on
                emit(dict(stage="time", T=T, variant=name, error=str(e)[-600:]), f"time T={T} {name}: ERROR {str(e)[-120:]}")
                continue
            gem = [d / 1000 for nm, d in kt if "gemm" in nm]
            emit(dict(stage="time", T=T, variant=name, ms=ms, kernels=kt),
                 f"time T={T} {name}: call {ms:.3f} ms, GEMMs " + " + ".join(f"{g:.3f}" for g in gem)
                 + f", kernels {sum(d for _, d in kt) / 1000:.3f}")

json.dump(rows_out, open(os.path.join(OUT, "w4a8_fold.json"), "w"), indent=1, default=str)
print("\nSUMMARY")
print("\n".join(summary))
