"""Host time of one eager call, through each entry: ``fused_moe`` (validation + the custom op), the op alone, and the
launcher alone (``run_fused_moe``, what ran before the op existed).

Method: the GPU is kept busy by a long sleep kernel so that no launch waits on the device; then ``CALLS`` calls are
issued back to back and each is timed on the host (``time.perf_counter``); the median over calls and rounds is
reported. ``CALLS`` stays well under the launch queue's depth. ``lone_ms``: one synchronized call, event-timed.

    PYTHONPATH=$PWD python3 scripts/host_time.py [--tokens 1,64,1024,8192] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mxmoe
from mxmoe import bench, testing
from mxmoe.op import expert_tensors, workspace_handle

CALLS = 12
ROUNDS = 5


def host_ms(fn, calls: int = CALLS, rounds: int = ROUNDS) -> float:
    samples = []
    for _ in range(rounds):
        torch.cuda._sleep(int(2e9) // 1000 * 50)  # ~50 ms of GPU time at ~2 GHz
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return 1e3 * statistics.median(samples)


def lone_ms(fn, n: int = 10) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,1024,8192")
    ap.add_argument("--json")
    args = ap.parse_args()
    from mxmoe._details.launch import run_fused_moe
    from mxmoe.selection import plan_layer

    shape = bench.PRESETS["ref"]
    dev = torch.device("cuda")
    experts, _ = testing.make_experts(shape.E, shape.H, shape.I, seed=0, device=dev, gen_device=dev)
    tokens = bench.parse_tokens(args.tokens)
    ws = mxmoe.Workspace(experts, max(tokens), shape.top_k, fp8=True)
    weights, extras, all_fold = expert_tensors(experts)
    rows = []
    for T in tokens:
        inp = bench.make_inputs(shape, T, dev, 0)
        out = torch.empty_like(inp.x)
        for precision in ("w4a16", "w4a8"):
            plan = plan_layer(T * shape.top_k, precision=precision)
            arms = {
                "fused_moe": lambda: mxmoe.fused_moe(inp.x, experts, inp.topk_weights, inp.topk_ids, out=out,
                                                     precision=precision, workspace=ws),
                "op": lambda: torch.ops.mxmoe.fused_moe(inp.x, weights, extras, inp.topk_weights, inp.topk_ids, None,
                                                        out, "silu", None, None, precision, all_fold,
                                                        workspace_handle(ws)),
                "launcher": lambda: run_fused_moe(inp.x, experts, inp.topk_weights, inp.topk_ids, plan, None, out, ws),
            }
            row = {"T": T, "precision": precision}
            for name, fn in arms.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                row[f"{name}_host_ms"] = host_ms(fn)
            row["lone_ms"] = lone_ms(arms["fused_moe"])
            rows.append(row)
            print(row, flush=True)
    print(f"{'T':>6} {'prec':>6} {'fused_moe':>10} {'op':>8} {'launcher':>9} {'lone':>8}   (host ms; lone: event ms)")
    for r in rows:
        print(f"{r['T']:>6} {r['precision']:>6} {r['fused_moe_host_ms']:>10.3f} {r['op_host_ms']:>8.3f} "
              f"{r['launcher_host_ms']:>9.3f} {r['lone_ms']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
