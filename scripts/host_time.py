"""Host time of one eager call, through each entry: ``fused_moe`` (validation + the custom op), the op through the
dispatcher, the op's Python body called directly (``op.fused_moe_op``: the op's cost is the difference), and the
launcher alone (``launch.run_layer``).

Method (``bench.timing.host_ms``): the GPU is kept busy by a long sleep kernel so that no launch waits on the device;
calls are issued back to back and each is timed on the host; the median over calls and rounds is reported.
``lone_ms``: one synchronized call, event-timed. Also the launch-plan counters (``launch.PLAN_STATS``).

    PYTHONPATH=$PWD python3 scripts/host_time.py [--tokens 1,64,1024,8192] [--json PATH]
"""
from __future__ import annotations

import argparse
import json

import torch

import mxmoe
from mxmoe import bench, testing
from mxmoe._details.config import overrides
from mxmoe._details.launch import PLAN_STATS, run_layer
from mxmoe.bench.timing import host_ms, lone_ms
from mxmoe.op import fused_moe_op
from mxmoe.op import workspace_handle
from mxmoe.prepare import expert_tensors

def _profile(fn, title: str, rounds: int = 10, per_round: int = 50) -> None:
    """cProfile of ``rounds`` x ``per_round`` calls, each round behind a sleep kernel (no launch waits)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(rounds):
        torch.cuda._sleep(300_000_000)
        prof.enable()
        for _ in range(per_round):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    calls = rounds * per_round
    print(f"--- {title}: {calls} calls, own time per call (us)")
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:14]
    for (file, line, name), (cc, nc, tt, ct, _) in top:
        print(f"{1e6 * tt / calls:8.2f} {1e6 * ct / calls:8.2f}  {nc / calls:5.1f}x  {name} ({file.split('/')[-1]}:{line})")


def _through_jit(fn):
    with overrides(pdl=True):  # any overrides set: the launcher keeps no plan
        return fn()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,1024,8192")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="cProfile 500 eager fused_moe calls per T and precision "
                    "(the GPU kept busy), top functions by own time")
    args = ap.parse_args()
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
                "body": lambda: fused_moe_op(inp.x, weights, extras, inp.topk_weights, inp.topk_ids, None, out, "silu",
                                             None, None, precision, all_fold, workspace_handle(ws)),
                "launcher": lambda: run_layer(inp.x, weights, extras, all_fold, inp.topk_weights, inp.topk_ids, None,
                                              out, plan, ws),
            }
            arms["jit"] = lambda: _through_jit(arms["fused_moe"])  # the A/B: no plan, every launch through the JIT
            row = {"T": T, "precision": precision}
            for name, fn in arms.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                row[f"{name}_host_ms"] = host_ms(fn)
            row["lone_ms"] = lone_ms(arms["fused_moe"])
            if args.profile:
                _profile(arms["fused_moe"], f"T={T} {precision}")
            rows.append(row)
            print(row, flush=True)
    print(f"plans: {PLAN_STATS}")
    print(f"{'T':>6} {'prec':>6} {'fused_moe':>10} {'op':>8} {'body':>8} {'launcher':>9} {'jit':>8} {'lone':>8}   (host "
          "ms; jit: fused_moe without plans; lone: event ms)")
    for r in rows:
        print(f"{r['T']:>6} {r['precision']:>6} {r['fused_moe_host_ms']:>10.3f} {r['op_host_ms']:>8.3f} "
              f"{r['body_host_ms']:>8.3f} {r['launcher_host_ms']:>9.3f} {r['jit_host_ms']:>8.3f} {r['lone_ms']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
