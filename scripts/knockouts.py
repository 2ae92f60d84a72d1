"""Knockout timing of the W4A16 kernels' K step, wide and small tiles (developer tool, docs/perf-notes.md steps 25,
51 and 54): copies of the package with one part of the step removed, timed in one process beside the package itself.
Outputs of a knockout are wrong by construction; only its kernel times mean anything.

    python3 scripts/knockouts.py E,H,I,TOPK T ['{config override}']     # from the repository root, on a GPU

Knockouts: ``ko_act`` no activation copies (the ring's activation slots stay stale; their ``loaded`` arrivals and the
extra rows' copies stay),
``ko_conv`` a constant MMA operand instead of the weight conversion (the code loads go dead with it; wide and small
tiles), ``ko_w`` no weight copies (the ring's code slots stay stale, the wide extra rows' copies stay), ``ko_act_conv``
ko_act and ko_conv. The copies live in /tmp/mxmoe_knockouts (rebuilt each run; each registers its own custom-op namespace)."""
import importlib
import json
import os
import shutil
import sys

import torch

ROOT = "/tmp/mxmoe_knockouts"
KNOCKOUTS = {
    "ko_act": [("_details/sm90_pipeline.py",
                "            _async_load(stage, a_ptrs + step * BK)\n        else:\n"
                "            _async_load(stage, a_ptrs + step * BK, mask=ok[:, None])\n",
                "            pass\n        else:\n            pass\n")],
    "ko_conv": [("_details/sm90_wide.py", "_bf16_operand(cur, f, BM, BK, WL, DOT, NB % 2 == 0)" + after,
                 "gl.full([BM, BK], 1.0, gl.bfloat16, DOT)" + after)
                for after in (", rows.permute", ", acc,\n")]  # (the step's MMA, and with extra rows both MMAs')
    + [("_details/sm90_small.py", f"_bf16_operand(cur_{h}, f_{h}, BM, BK, WL, DOT, PAIRED)",
        "gl.full([BM, BK], 1.0, gl.bfloat16, DOT)") for h in "gu"],  # (the small tiles' W4A16 step)
    "ko_w": [("_details/sm90_pipeline.py",
              "        _async_load(halves.index(slot), w_ptrs + _step_offset(step, BK, U))\n",
              "        pass\n"),
             ("_details/sm90_pipeline.py",
              "            _async_load(packed.index(slot * NH + h), w_ptrs + h * half_rows * row_bytes + "
              "_step_offset(step, BK, U))\n",
              "            pass\n")],
}
KNOCKOUTS["ko_act_conv"] = KNOCKOUTS["ko_act"] + KNOCKOUTS["ko_conv"]


def build(name: str, patches: list) -> None:
    """``mxmoe`` copied to ``ROOT/name`` with ``patches`` (file, old, new; each old text must occur once)."""
    dst = os.path.join(ROOT, name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree("mxmoe", dst, ignore=shutil.ignore_patterns("__pycache__"))
    own_ops = [("op.py", 'Library("mxmoe", "DEF")', f'Library("{name}", "DEF")'),
               ("op.py", '"mxmoe::fused_moe"', f'"{name}::fused_moe"')]
    for path, old, new in patches + own_ops:
        full = os.path.join(dst, path)
        text = open(full).read()
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the patched text occurs {text.count(old)} times in {path}")
        open(full, "w").write(text.replace(old, new))


def main(argv):
    E, H, I, top_k = (int(v) for v in argv[0].split(","))
    T = int(argv[1])
    override = json.loads(argv[2]) if len(argv) > 2 else {}
    os.makedirs(ROOT, exist_ok=True)
    for name, patches in KNOCKOUTS.items():
        build(name, patches)
    sys.path.insert(0, ROOT)
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, top_k), device="cuda", dtype=torch.int32)
    w = torch.rand(T, top_k, device="cuda")
    calls = {}
    for name in ["mxmoe", *KNOCKOUTS]:
        pkg = importlib.import_module(name)
        launch = importlib.import_module(name + "._details.launch")
        config = importlib.import_module(name + "._details.config")
        testing = importlib.import_module(name + ".testing")
        plan = importlib.import_module(name + ".selection").plan_layer(ids.numel(), precision="w4a16", capturing=False)
        experts = pkg.prepare_weights(**testing.random_code_sources(E, H, I, device="cuda", scale_lo=118, scale_hi=122))
        workspace = pkg.Workspace(experts, T, top_k)
        out = torch.empty_like(x)

        def call(launch=launch, config=config, experts=experts, workspace=workspace, out=out, plan=plan):
            with config.overrides(gemm=override):
                launch.run_fused_moe(x, experts, w, ids, plan, None, out, workspace)
        for _ in range(3):
            call()
        calls[name] = call
    torch.cuda.synchronize()
    from mxmoe.bench import kernel_times  # (the profiler last: CUPTI slows later launches)

    for repeat in range(2):  # interleaved
        for name, call in calls.items():
            rows = kernel_times(call)
            gemms = " ".join(f"{us / 1000:.3f}" for nm, us in rows if "gemm" in nm)
            print(f"T={T} {json.dumps(override)} {name:12s} call {sum(us for _, us in rows) / 1000:.3f} ms, "
                  f"GEMMs {gemms}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
