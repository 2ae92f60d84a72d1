"""Device tuning sweep (developer tool): time GEMM tile configs of both paths on the reference shape.

    python3 scripts/tune.py [--tokens 1,64,1024,8192] [--configs '[null, {"block_rows": 32}]']

Prints one row per (T, precision, config): median CUDA-event ms over 30 samples, and the
default config's time; full numbers go to $OUT/tune.json when OUT is set.
"""
import argparse
import json
import os

import torch

import mxmoe
from _experts import random_experts, run
from mxmoe._details.config import overrides
from mxmoe.bench import cuda_event_sampler, median


def timed(fn, n=30):
    fn()
    return median(cuda_event_sampler(fn, n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,1024,2048,8192")
    ap.add_argument("--shape", default="288,4096,1024,8")
    ap.add_argument("--configs", default="", help="JSON list of override dicts")
    args = ap.parse_args()
    E, H, I, top_k = map(int, args.shape.split(","))
    ex = random_experts(E, H, I)
    configs = json.loads(args.configs) if args.configs else [None]
    rows = []
    for T in map(int, args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.randint(0, E, (T, top_k), device="cuda", dtype=torch.int32)
        w = torch.rand(T, top_k, device="cuda")
        ws = mxmoe.Workspace(ex, T, top_k, fp8=True)
        out = torch.empty_like(x)
        for prec in ("w4a16", "w4a8"):
            for cfg in configs:
                def call(cfg=cfg):
                    with overrides(gemm=cfg):
                        run(x, ex, w, ids, prec, out, ws)
                try:
                    ms = timed(call)
                except Exception as e:  # report, keep sweeping
                    ms = float("nan")
                    print("error", T, prec, cfg, str(e)[:300])
                flops = T * top_k * 6 * H * I
                rows.append(dict(T=T, precision=prec, config=cfg, ms=ms, tflops=flops / ms / 1e9))
                print(f"T={T:6d} {prec:6s} {str(cfg):60s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    if os.environ.get("OUT"):
        json.dump(rows, open(os.path.join(os.environ["OUT"], "tune.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
