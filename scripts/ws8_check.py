"""The W4A8 prefill kernel (``sm90_ws8``) on the device (developer tool): bit-identity against the small-tile kernel
with the same FP8 chains, SPEC §5 accuracy, a same-process timing of the whole call and of each kernel.

    python3 scripts/ws8_check.py [check] [acc] [time] [shapes=ref,oss120] [tokens=1024,4096,8192]
        [variants='[{"kernel": "gluon_ws8", "num_stages": 5}]']

``check``: both GEMMs on the new kernel against both on the small-tile kernel on the same route tiles (64 rows: the
tests' 1024-K chains on both; 128 rows: one chain over all of K on both, the small kernel's promotion overridden
off), masked routes, biases, swigluoai, experts with scale bytes of 0 (some take the exact unfolded kernel): outputs
bitwise equal, every element written, a second run equal. ``acc``: ``accuracy.gemm_level`` (each GEMM vs float64
of the same E4M3 operands: <= 1.2e-2 by default, <= 1.5e-3 with 1024-K chains) and the layer vs exact and vs the
FP8 emulation (SPEC §5 excess). ``time``: the whole eager call, arms interleaved in rounds, then each kernel's time
(torch profiler). Prints a table last; rows in $OUT/ws8_check.json.
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import mxmoe  # noqa: E402
from _experts import kernel_times, run  # noqa: E402
from mxmoe import accuracy, reference, testing  # noqa: E402
from mxmoe._details.config import overrides  # noqa: E402
from mxmoe.bench import cuda_event_sampler, median, round_orders  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"ref": (288, 4096, 1024, 8), "oss120": (128, 2880, 2880, 4), "oss20": (32, 2880, 2880, 4)}
WS8 = {"kernel": "gluon_ws8"}
args = sys.argv[1:]
stages = [a for a in args if "=" not in a] or ["check", "acc", "time"]
opts = dict(a.split("=", 1) for a in args if "=" in a)
shapes = opts.get("shapes", "ref,oss120").split(",")
tokens = [int(t) for t in opts.get("tokens", "1024,4096,8192").split(",")]
extra = json.loads(opts.get("variants", "[]"))
rows, summary = [], []


def emit(r, line):
    rows.append(r)
    summary.append(line)
    print(line, flush=True)


def routing(T, E, top_k, seed, masked=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:top_k] for _ in range(T)]).int()
    if masked:
        drop = torch.rand(T, top_k, device="cuda", generator=g)
        ids[drop < 0.05] = -1
        ids[(drop >= 0.05) & (drop < 0.08)] = E + 3
        ids[T // 3] = -1  # a token with every route masked
    return ids, torch.rand(T, top_k, device="cuda", generator=g)


def call(x, ex, w, ids, prec, ws, variant, **kw):
    out = torch.full_like(x, float("nan"))
    with overrides(gemm=variant):
        mxmoe.fused_moe(x, ex, w, ids, precision=prec, out=out, workspace=ws, **kw)
    return out


if "check" in stages:
    for name in shapes:
        E, H, I, top_k = SHAPES[name]
        for scales in ("normal", "zero_bytes"):
            ex = testing.make_experts(E, H, I, seed=3, device="cuda", gen_device="cuda", scales=scales, biases=True)[0]
            fold = mxmoe.prepare.fold_report(ex)["both"]
            for T in tokens:
                ids, w = routing(T, E, top_k, seed=T)
                x = torch.randn(T, H, device="cuda").bfloat16()
                ws = mxmoe.Workspace(ex, T, top_k, fp8=True)
                kw = dict(activation="swigluoai")
                for bt, small, new in ((64, {"block_rows": 64}, dict(WS8, block_rows=64, promote=8)),
                                       (128, {"kernel": "gluon_small", "block_rows": 128, "promote": 0, "promote_smem": False},
                                        dict(WS8, block_rows=128))):
                    a = call(x, ex, w, ids, "w4a8", ws, small, **kw)
                    b = call(x, ex, w, ids, "w4a8", ws, new, **kw)
                    b2 = call(x, ex, w, ids, "w4a8", ws, new, **kw)
                    torch.cuda.synchronize()
                    same = accuracy.bitwise_equal(a, b)
                    diff = (a.float() - b.float()).abs().max().item()
                    r = dict(stage="check", shape=name, scales=scales, fold=fold, T=T, bt=bt, bitwise=same,
                             max_abs_diff=diff, nan=int(b.isnan().sum()), deterministic=accuracy.bitwise_equal(b, b2),
                             rel_vs_small=mxmoe.relative_l2(b, a))
                    emit(r, f"check {name} {scales} (fold {fold:.2f}) T={T} bt={bt}: bitwise={same} "
                            f"maxdiff={diff:.3g} rel={r['rel_vs_small']:.2e} nan={r['nan']} det={r['deterministic']}")

if "acc" in stages:
    for name in shapes:
        E, H, I, top_k = SHAPES[name]
        ex0 = testing.make_experts(E, H, I, seed=0, device="cuda", gen_device="cuda", zero_up=True)[0]
        ex = testing.make_experts(E, H, I, seed=5, device="cuda", gen_device="cuda")[0]
        for T in tokens:
            ids, w = routing(T, E, top_k, seed=7, masked=True)
            x = torch.randn(T, H, device="cuda").bfloat16()
            for label, v in (("default", WS8), ("1024-K chains", dict(WS8, block_rows=64, promote=8)),
                             ("small kernel", {"kernel": "gluon_small"})):
                with overrides(gemm=v):
                    m, checks = accuracy.gemm_level(x, ex0, w, ids)
                emit(dict(stage="acc", shape=name, T=T, variant=label, **m, checks=checks),
                     f"acc {name} T={T} {label}: GEMM1 {m['w4a8_gemm1_vs_f64']:.2e} GEMM2 {m['w4a8_gemm2_vs_f64']:.2e} "
                     f"checks {all(checks.values())}")
            exact = reference.fused_moe_reference(x, ex, w, ids, mode="exact")
            emu = reference.fused_moe_reference(x, ex, w, ids, mode="w4a8")
            a16 = call(x, ex, w, ids, "w4a16", None, {})
            for label, v in (("default", WS8), ("small kernel", {"kernel": "gluon_small"})):
                out = call(x, ex, w, ids, "w4a8", None, v)
                m = accuracy.w4a8_layer_metrics(out, emu, exact)
                d16 = mxmoe.relative_l2(out, a16)
                emit(dict(stage="layer", shape=name, T=T, variant=label, vs_w4a16=d16,
                          **{k: v for k, v in m.items()}),
                     f"layer {name} T={T} {label}: {accuracy.describe_w4a8(m)}; vs W4A16 {100 * d16:.3f}%")

def timing_problems():
    """``(shape name, T, experts, ids, weights, x, workspace, out)`` of the timings, experts made once per shape."""
    for name in shapes:
        E, H, I, top_k = SHAPES[name]
        ex = testing.make_experts(E, H, I, seed=0, device="cuda", gen_device="cuda")[0]
        for T in tokens:
            ids, w = routing(T, E, top_k, seed=T, masked=False)
            x = torch.randn(T, H, device="cuda").bfloat16()
            yield name, T, ex, ids, w, x, mxmoe.Workspace(ex, T, top_k, fp8=True), torch.empty_like(x)


if "time" in stages:
    problems = list(timing_problems())
    for name, T, ex, ids, w, x, ws, out in problems:
        arms = {"w4a16": ("w4a16", {}), "w4a8 small": ("w4a8", {"kernel": "gluon_small"}), "w4a8 ws8": ("w4a8", WS8),
                "w4a8 default": ("w4a8", {})}
        for v in extra:
            arms[f"w4a8 {json.dumps(v)}"] = ("w4a8", v)
        fns, results = {}, {}
        for label, (prec, v) in arms.items():
            def fn(prec=prec, v=v):
                with overrides(gemm=v):
                    run(x, ex, w, ids, prec, out, ws)
            fn()
            torch.cuda.synchronize()
            results[label] = out.clone()
            fns[label] = fn
        for label in list(arms)[4:]:  # the extra variants: the same bits as the default kernel's?
            emit(dict(stage="variant_bits", shape=name, T=T, arm=label,
                      bitwise=accuracy.bitwise_equal(results[label], results["w4a8 ws8"])),
                 f"bits {name} T={T} {label}: bitwise vs w4a8 ws8 "
                 f"{accuracy.bitwise_equal(results[label], results['w4a8 ws8'])}")
        times = {label: [] for label in arms}
        for order in round_orders(list(arms), 4):
            for label in order:
                times[label].append(median(cuda_event_sampler(fns[label], 20)))
        base = statistics.median(times["w4a8 small"])
        for label in arms:
            ms = statistics.median(times[label])
            emit(dict(stage="time", shape=name, T=T, arm=label, ms=ms),
                 f"time {name} T={T} {label}: {ms:.3f} ms ({100 * (ms / base - 1):+.1f} % vs w4a8 small)")
    for name, T, ex, ids, w, x, ws, out in problems:  # kernel times last: the profiler slows later launches
        for label, v in (("small", {"kernel": "gluon_small"}), ("ws8", WS8)):
            with overrides(gemm=v):
                ks = kernel_times(lambda: run(x, ex, w, ids, "w4a8", out, ws))
            emit(dict(stage="kernels", shape=name, T=T, arm=label, kernels=ks),
                 f"kernels {name} T={T} {label}: " + " ".join(f"{n.split('(')[0][-24:]}={d:.0f}" for n, d in ks))

with open(os.path.join(OUT, "ws8_check.json"), "w") as f:
    json.dump(rows, f, indent=1, default=str)
print("\n" + "\n".join(summary))
