"""Knockout timing of the W4A16 kernels' K step, wide and small tiles (developer tool, docs/perf-notes.md steps 25,
51 and 54): copies of the package with one part of the step removed, timed in one process beside the package itself.
Outputs of a knockout are wrong by construction; only its kernel times mean anything.

    python3 scripts/knockouts.py E,H,I,TOPK T ['{config override}'] [--prec w4a8] [--only ko_a,ko_b]
    # from the repository root, on a GPU

Knockouts: ``ko_act`` no activation copies (the ring's activation slots stay stale; their ``loaded`` arrivals and the
extra rows' copies stay),
``ko_conv`` a constant MMA operand instead of the weight conversion (the code loads go dead with it; wide and small
tiles), ``ko_w`` no weight copies (the ring's code slots stay stale, the wide extra rows' copies stay), ``ko_act_conv``
ko_act and ko_conv. W4A8 (``--prec w4a8``; every W4A8 kernel's E4M3 table conversion,
``convert._e4m3_table_asm``):
``ko8_conv`` keeps the two table multiply-adds and xors them with the word (4 instructions per word instead of 15: every
input stays live), ``ko8_cheap`` the 9-instruction form a W4A8-first layout would allow (perf-notes step 45: ``eem`` in
each nibble's low bits, the signs at the nibble tops where one shift puts them on the byte tops). W4A16's price for such
a layout: ``ko16_plus3`` / ``ko16_plus6``, 3 / 6 more instructions per prepared word in every BF16 conversion (16 and 19
instead of 13). The copies live in /tmp/mxmoe_knockouts/<pid> (rebuilt each run: processes side by side do not share
them; each registers its own custom-op namespace)."""
import argparse
import importlib
import json
import os
import shutil
import sys

import torch

ROOT = f"/tmp/mxmoe_knockouts/{os.getpid()}"
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
_E4M3_LOOKUP = ("        shr.b32 t, $2, 2; shl.b32 u, $2, 8; lop3.b32 v, u, $2, 0x03000300, 0xE4; "
                "prmt.b32 n, t, v, 0x7520;\n"
                "        and.b32 s, n, 0x77777777; prmt.b32 $0, ta, tb, s; shr.b32 h, s, 16; prmt.b32 $1, ta, tb, h;\n"
                "        shl.b32 m, n, 4; prmt.b32 s, n, m, 0xBFAE; prmt.b32 h, n, m, 0xC9D8;\n"
                "        lop3.b32 $0, $0, s, 0x80808080, 0xF8; lop3.b32 $1, $1, h, 0x80808080, 0xF8;\n")
KNOCKOUTS_W4A8 = {
    "ko8_conv": [("_details/convert.py", _E4M3_LOOKUP, "        xor.b32 $0, ta, $2; xor.b32 $1, tb, $2;\n")],
    "ko8_cheap": [("_details/convert.py", _E4M3_LOOKUP,
                   "        and.b32 s, $2, 0x77777777; prmt.b32 $0, ta, tb, s; shr.b32 h, s, 16; "
                   "prmt.b32 $1, ta, tb, h;\n"
                   "        lop3.b32 $0, $0, $2, 0x80808080, 0xF8; shl.b32 m, $2, 4; "
                   "lop3.b32 $1, $1, m, 0x80808080, 0xF8;\n")],
}
KNOCKOUTS.update(KNOCKOUTS_W4A8)
# W4A16's price for another layout: more instructions per prepared word in every W4A16 conversion
# (``convert._bf16_halves_asm``)
_BF16_PAIRS = ("        and.b32 t, $8, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$0, $1}, t;\n"
               "        shl.b32 t, $8, 4; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$2, $3}, t;\n"
               "        shf.l.wrap.b32 t, $8, $8, 10; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; "
               "mov.b32 {$4, $5}, t;\n")
KNOCKOUTS.update({
    "ko16_plus3": [("_details/convert.py", _BF16_PAIRS,  # 16 per word: one shift, a bit-select in 2 pairs
                    "        shr.b32 u, $8, 3; and.b32 t, $8, 0x81C081C0; lop3.b32 t, t, u, 0x80008000, 0xF8; "
                    "mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$0, $1}, t;\n"
                    "        shl.b32 t, $8, 4; and.b32 t, t, 0x81C081C0; lop3.b32 t, t, u, 0x80008000, 0xF8; "
                    "mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$2, $3}, t;\n"
                    "        shf.l.wrap.b32 t, $8, $8, 10; and.b32 t, t, 0x81C081C0; mul.rn.bf16x2 t, t, %(f)s; "
                    "mov.b32 {$4, $5}, t;\n")],
    "ko16_plus6": [("_details/convert.py", _BF16_PAIRS,  # 19 per word: a second shift and a bit-select in 3 pairs
                    "        shr.b32 u, $8, 3; and.b32 t, $8, 0x81C081C0; lop3.b32 t, t, u, 0x80008000, 0xF8; "
                    "mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$0, $1}, t;\n"
                    "        shl.b32 t, $8, 4; shr.b32 u, $8, 5; and.b32 t, t, 0x81C081C0; "
                    "lop3.b32 t, t, u, 0x80008000, 0xF8; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$2, $3}, t;\n"
                    "        shf.l.wrap.b32 t, $8, $8, 10; shr.b32 u, $8, 7; and.b32 t, t, 0x81C081C0; "
                    "lop3.b32 t, t, u, 0x80008000, 0xF8; mul.rn.bf16x2 t, t, %(f)s; mov.b32 {$4, $5}, t;\n")],
})


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
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("tokens", type=int)
    ap.add_argument("override", nargs="?", default="{}")
    ap.add_argument("--prec", default="w4a16", choices=("w4a16", "w4a8"))
    ap.add_argument("--only", default="", help="comma-separated knockouts (default: every one of the precision's)")
    a = ap.parse_args(argv)
    E, H, I, top_k = (int(v) for v in a.shape.split(","))
    T, override, fp8 = a.tokens, json.loads(a.override), a.prec == "w4a8"
    names = a.only.split(",") if a.only else [n for n in KNOCKOUTS if n.startswith("ko8_") == fp8]
    os.makedirs(ROOT, exist_ok=True)
    for name in names:
        build(name, KNOCKOUTS[name])
    sys.path.insert(0, ROOT)
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, top_k), device="cuda", dtype=torch.int32)
    w = torch.rand(T, top_k, device="cuda")
    calls = {}
    for name in ["mxmoe", *names]:
        pkg = importlib.import_module(name)
        launch = importlib.import_module(name + "._details.launch")
        config = importlib.import_module(name + "._details.config")
        testing = importlib.import_module(name + ".testing")
        plan = importlib.import_module(name + ".selection").plan_layer(ids.numel(), precision=a.prec, capturing=False)
        experts = pkg.prepare_weights(**testing.random_code_sources(E, H, I, device="cuda", scale_lo=118, scale_hi=122))
        workspace = pkg.Workspace(experts, T, top_k, fp8=fp8)
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
            print(f"{a.prec} T={T} {json.dumps(override)} {name:12s} call {sum(us for _, us in rows) / 1000:.3f} ms, "
                  f"GEMMs {gemms}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
