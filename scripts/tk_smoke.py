"""GPU smoke test of the bench's triton_kernels arm (``mxmoe/bench/arms.py``, ``TritonKernelsArm``).

    python3 scripts/fetch_triton_kernels.py --git-dir <triton git dir>      # once, on a machine with the mirror
    PYTHONPATH=$PWD:$PWD/.triton_kernels python3 scripts/tk_smoke.py       # on the GPU machine

Per case (a small shape, gpt-oss-20b's E=32 H=I=2880 top_k=4 at T = 1, 64, 1024, plus a swigluoai and a
non-power-of-2 top_k case at the small shape): prepare the arm, run it, compare with mxmoe's PyTorch references (exact
FP32 and the W4A16 rounding model) by relative L2, check that an output poisoned with NaN is fully rewritten, time
eager calls and CUDA-graph replays (median of CUDA-event samples; mxmoe's W4A16 path timed the same way for scale),
and list the kernels of one call with their device times (torch profiler, last). Every stage is in its own try/except
and prints its traceback, so one run tells everything. Prints one table at the end; with ``$OUT`` set, writes
``$OUT/tk_smoke.json`` (everything) and ``$OUT/tk_smoke.txt`` (the log).
"""
from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time
import traceback

import torch

LOG = io.StringIO()


def log(*args):
    text = " ".join(str(a) for a in args)
    print(text, flush=True)
    LOG.write(text + "\n")


def stage(record: dict, key: str, fn):
    """Run ``fn()``; its result in ``record[key]``, or its error (traceback printed) in ``record[key + '_error']``."""
    try:
        record[key] = fn()
        return record[key]
    except Exception as exc:
        record[key + "_error"] = f"{type(exc).__name__}: {exc}"
        log(f"  [{key}] FAILED: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return None


def event_times(fn, n=30, warmup=3):
    from mxmoe.bench.timing import cuda_event_sampler

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return cuda_event_sampler(fn, n)


def environment():
    from mxmoe.bench.timing import collect_environment

    env = collect_environment(torch.device("cuda", 0))
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".triton_kernels", "SOURCE.json")
    try:
        import triton_kernels

        env["triton_kernels_file"] = triton_kernels.__file__
    except Exception as exc:
        env["triton_kernels_import_error"] = f"{type(exc).__name__}: {exc}"
    if os.path.exists(src):
        env["triton_kernels_source"] = json.load(open(src))
    return env


def run_case(name, E, H, I, top_k, tokens, activation=None, seed=0):
    from mxmoe import testing
    from mxmoe.bench import arms
    from mxmoe.bench.problem import Shape, make_inputs
    from mxmoe.bench.timing import capture_graph, gemm_alone_ms, kernel_times
    from mxmoe.reference import fused_moe_references, relative_l2

    dev = torch.device("cuda", 0)
    shape = Shape(E, H, I, top_k)
    case = {"case": name, "shape": str(shape), "activation": activation or "silu", "rows": []}
    log(f"== {name}: {shape}, activation {case['activation']}")
    experts = stage(case, "experts", lambda: testing.make_experts(E, H, I, seed=seed, device=dev, gen_device=dev)[0])
    if experts is None:
        return case
    case.pop("experts")
    if activation:
        experts = experts.with_activation(activation)
    arm = arms.TritonKernelsArm()
    case["unavailable"] = arm.unavailable()
    if case["unavailable"]:
        log(f"  unavailable: {case['unavailable']}")
        return case
    t0 = time.perf_counter()
    if stage(case, "prepare", lambda: arm.prepare(experts, shape, max(tokens)) or "ok") is None:
        return case
    torch.cuda.synchronize()
    case["prepare_s"] = time.perf_counter() - t0
    case["note"] = getattr(arm, "note", None)
    log(f"  prepared in {case['prepare_s']:.1f} s: {case['note']}")
    base = arms.MxmoeArm("w4a16")
    stage(case, "mxmoe_prepare", lambda: base.prepare(experts, shape, max(tokens)) or "ok")
    for T in tokens:
        row = {"T": T}
        case["rows"].append(row)
        inp = make_inputs(shape, T, dev, seed)
        fn = stage(row, "make_call", lambda: arm.make_call(inp))
        if fn is None:
            continue
        t0 = time.perf_counter()
        out = stage(row, "first_call", lambda: fn().clone())
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        if out is None:
            continue
        refs = stage(row, "references", lambda: fused_moe_references(inp.x, experts, inp.topk_weights,
                                                                      inp.topk_ids, modes=("exact", "w4a16")))
        if refs is not None:
            row.pop("references")
            row["rel_l2_exact"] = relative_l2(out, refs["exact"])
            row["rel_l2_w4a16_ref"] = relative_l2(out, refs["w4a16"])
            row["rel_l2_w4a16_ref_vs_exact"] = relative_l2(refs["w4a16"], refs["exact"])
            row["max_abs_vs_exact"] = float((out.float() - refs["exact"]).abs().max())

        def poisoned():
            res = fn()
            res.fill_(float("nan"))
            res = fn()
            torch.cuda.synchronize()
            return {"all_finite": bool(torch.isfinite(res).all()), "same_as_first": bool(torch.equal(res, out))}

        stage(row, "poison", poisoned)
        eager = stage(row, "eager_samples_ms", lambda: event_times(fn))
        if eager:
            row["eager_ms"] = statistics.median(eager)

        def graph():
            g = capture_graph(fn)
            row["_keep"] = (g, fn)
            res = fn()  # graph replays write the same buffer
            res.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            row["graph_output_matches"] = bool(torch.equal(res, out))
            return statistics.median(event_times(g.replay))

        row["graph_ms"] = stage(row, "graph", graph)
        row.pop("graph", None)
        if "mxmoe_prepare" in case:
            bfn = stage(row, "mxmoe_call", lambda: base.make_call(inp))
            if bfn is not None:
                row.pop("mxmoe_call")
                row["mxmoe_w4a16_eager_ms"] = stage(row, "mxmoe_eager", lambda: statistics.median(event_times(bfn)))
                row.pop("mxmoe_eager", None)
                bout = bfn().clone()
                row["rel_l2_vs_mxmoe_w4a16"] = relative_l2(out, bout)
        row["_kernels_fn"] = fn
        log(f"  T={T}: relL2 exact {row.get('rel_l2_exact', float('nan')):.3e}, poison {row.get('poison')}, "
            f"eager {row.get('eager_ms', float('nan')):.4f} ms, graph {row.get('graph_ms') or float('nan'):.4f} ms, "
            f"mxmoe w4a16 eager {row.get('mxmoe_w4a16_eager_ms') or float('nan'):.4f} ms")
    case["_kernel_times"] = (kernel_times, gemm_alone_ms, arm.gemm_kernel)
    return case


def profile_kernels(cases):
    """Last (the profiler slows later launches): each row's kernels and its GEMM kernels' time."""
    for case in cases:
        tools = case.pop("_kernel_times", None)
        for row in case["rows"]:
            fn = row.pop("_kernels_fn", None)
            row.pop("_keep", None)
            if fn is None or tools is None:
                continue
            kernel_times, gemm_alone_ms, pattern = tools
            times = stage(row, "kernels", lambda: kernel_times(fn))
            if times:
                row["kernels"] = [(name[:160], us) for name, us in times]
                stage(row, "gemm_ms", lambda: gemm_alone_ms(times, pattern)[0])


def fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def main() -> int:
    record = {"argv": sys.argv}
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to smoke-test")
        return 1
    stage(record, "environment", environment)
    env = record.get("environment", {})
    log(f"GPU {env.get('gpu')} (SM {env.get('capability')}), torch {env.get('torch')}, triton {env.get('triton')}, "
        f"triton_kernels {env.get('triton_kernels_file', env.get('triton_kernels_import_error'))} "
        f"(commit {env.get('triton_kernels_source', {}).get('commit')})")
    cases = []
    for args in (("small", 8, 256, 256, 4, (1, 64)),
                 ("small-swigluoai", 8, 256, 256, 4, (64,), "swigluoai"),
                 ("small-top3", 8, 256, 256, 3, (64,)),
                 ("gpt-oss-20b", 32, 2880, 2880, 4, (1, 64, 1024))):
        case = None
        try:
            case = run_case(*args)
        except Exception as exc:
            log(f"case {args[0]} FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            case = {"case": args[0], "error": f"{type(exc).__name__}: {exc}", "rows": []}
        cases.append(case)
        torch.cuda.empty_cache()
    try:
        profile_kernels(cases)
    except Exception as exc:
        log(f"kernel profile FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    record["cases"] = cases

    log("")
    log(f"{'case':<16} {'T':>5} {'relL2 exact %':>13} {'ref w4a16 %':>11} {'poison ok':>9} {'eager ms':>9} "
        f"{'graph ms':>9} {'GEMMs ms':>9} {'mxmoe ms':>9}  error")
    for case in cases:
        if not case["rows"]:
            log(f"{case['case']:<16} {'-':>5}  {case.get('unavailable') or case.get('error') or case.get('prepare_error') or case.get('experts_error')}")
        for row in case["rows"]:
            err = next((f"{k}: {v}" for k, v in row.items() if k.endswith("_error")), "")
            poison = row.get("poison") or {}
            rel = row.get("rel_l2_exact")
            ref = row.get("rel_l2_w4a16_ref_vs_exact")
            log(f"{case['case']:<16} {row['T']:>5} {fmt(None if rel is None else 100 * rel, '13.4f')} "
                f"{fmt(None if ref is None else 100 * ref, '11.4f')} {str(poison.get('all_finite', '-')):>9} "
                f"{fmt(row.get('eager_ms'), '9.4f')} {fmt(row.get('graph_ms'), '9.4f')} {fmt(row.get('gemm_ms'), '9.4f')} "
                f"{fmt(row.get('mxmoe_w4a16_eager_ms'), '9.4f')}  {err[:100]}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "tk_smoke.json"), "w") as f:
            # (objects as their type only: printing a CUDA tensor after a device fault raises mid-file)
            json.dump(record, f, indent=1, default=lambda o: f"<{type(o).__name__}>")
        with open(os.path.join(out_dir, "tk_smoke.txt"), "w") as f:
            f.write(LOG.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
