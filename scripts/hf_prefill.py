"""A transformers gpt-oss prefill with transformers' own experts against mxmoe's (``use_mxmoe``), same card, same run.

A few decoder layers of the real gpt-oss-20b shape (H = I = 2880, 32 experts, top-4, 64 heads of 64, 8 KV heads,
vocab 201088) with random weights whose experts are MXFP4 values; the decoder stack (``model.model``, no LM head)
timed on a prompt of ``--tokens`` tokens with CUDA events, the arms interleaved in rounds (order reversed every other
round), the median reported. Arms: transformers' experts implementations (``grouped_mm``, its default on CUDA here,
and ``eager``) and mxmoe's W4A16 and W4A8 (``precision``). Also the MoE blocks alone (router + experts of every
layer, on the inputs they got in the first arm's prefill), timed the same way, and the largest relative L2 of a block's
output against transformers' ``grouped_mm`` on the same input.

    python3 scripts/hf_prefill.py --layers 4 --tokens 512,2048,8192 [--json $OUT/hf_prefill.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
import mxmoe  # noqa: E402
from mxmoe.integrations.transformers import GptOssMxmoeExperts, use_mxmoe  # noqa: E402


def build(layers: int, experts: int, seed: int):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)  # gpt-oss-20b's shape
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(seed)
    ckpt = {}
    E, H, I = experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            ex = layer.mlp.experts
            for name, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
                packed = torch.randint(0, 256, (E, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
                scales = torch.randint(118, 123, (E, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
                getattr(ex, name).copy_(mxmoe.dequantize_mxfp4(packed, scales, torch.bfloat16).transpose(1, 2))
                ckpt[p + name + "_blocks"] = packed.reshape(E, n, k // 32, 16)
                ckpt[p + name + "_scales"] = scales
                ckpt[p + name + "_bias"] = getattr(ex, name + "_bias").detach().clone()
    return model, ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, ckpt = build(args.layers, args.experts, args.seed)
    own = {i: layer.mlp.experts for i, layer in enumerate(model.model.layers)}
    use_mxmoe(model, checkpoint=ckpt, precision="w4a16")  # (the MXFP4 tensors as a checkpoint mapping)
    mine = {"w4a16": {i: layer.mlp.experts for i, layer in enumerate(model.model.layers)}}
    assert all(isinstance(m, GptOssMxmoeExperts) for m in mine["w4a16"].values())
    mine["w4a8"] = {i: GptOssMxmoeExperts(mxmoe.MoEExperts(m.moe.experts, precision="w4a8"))
                    for i, m in mine["w4a16"].items()}  # (the same prepared tensors)

    def arm(kind: str):
        def setup():
            for i, layer in enumerate(model.model.layers):
                if kind in ("grouped_mm", "eager"):
                    layer.mlp.experts = own[i]
                    own[i].config._experts_implementation = kind
                else:
                    layer.mlp.experts = mine[kind][i]
        return setup

    arms = {"hf grouped_mm": arm("grouped_mm"), "hf eager": arm("eager"), "mxmoe w4a16": arm("w4a16"),
            "mxmoe w4a8": arm("w4a8")}
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, {args.layers} layers of gpt-oss-20b's shape ({args.experts} experts)")
    record = {"gpu": gpu, "layers": args.layers, "experts": args.experts, "results": []}
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
        times = {name: [] for name in arms}
        with torch.no_grad():
            for name, setup in arms.items():  # warm-up
                setup()
                for _ in range(2):
                    model.model(ids, use_cache=False)
            for r in range(args.rounds):
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                for name in order:
                    arms[name]()
                    for _ in range(args.samples):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        model.model(ids, use_cache=False)
                        b.record()
                        b.synchronize()
                        times[name].append(a.elapsed_time(b))
        # the MoE blocks alone, on the inputs each layer's block got in the first arm's run: time and output vs that
        # arm's (the hidden states after several random layers amplify any rounding difference: not a yardstick)
        inputs = []
        hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().clone()))
                 for layer in model.model.layers]
        with torch.no_grad():
            arms["hf grouped_mm"]()
            model.model(ids, use_cache=False)
        for h in hooks:
            h.remove()
        moe_out, moe_times = {}, {name: [] for name in arms}
        with torch.no_grad():
            for name, setup in arms.items():
                setup()
                moe_out[name] = [layer.mlp(h)[0].float() for layer, h in zip(model.model.layers, inputs)]
            for r in range(args.rounds):
                for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    arms[name]()
                    for _ in range(args.samples):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        for layer, h in zip(model.model.layers, inputs):
                            layer.mlp(h)
                        b.record()
                        b.synchronize()
                        moe_times[name].append(a.elapsed_time(b))
        base = moe_out["hf grouped_mm"]
        row = {"tokens": T}
        line = f"T={T}:"
        for name in arms:
            ms = statistics.median(times[name])
            moe_ms = statistics.median(moe_times[name])
            err = max(float((o - b).norm() / b.norm()) for o, b in zip(moe_out[name], base))
            row[name] = {"prefill_ms": ms, "moe_blocks_ms": moe_ms, "moe_rel_l2_vs_hf_grouped_mm": err}
            line += f"  {name} {ms:.2f} ms (MoE blocks {moe_ms:.2f} ms, {err:.1e})"
        print(line, flush=True)
        record["results"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
