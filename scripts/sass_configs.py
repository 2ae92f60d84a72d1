"""sm_90a SASS of the small-tile Gluon GEMMs per default config, compiled on the CPU (developer tool): registers,
spills, shared memory, instruction count and a hash of the instruction stream (addresses and line tables left out),
so that "the SASS of the other configs is identical" can be checked before and after a change.

    python3 scripts/sass_configs.py [PKGDIR] > after.json     # PKGDIR: a directory holding an ``mxmoe`` package
    python3 scripts/sass_configs.py --compare before.json after.json
    python3 scripts/sass_configs.py --dump 65536,1,0 > wide_gemm1.sass   # rows, GEMM1, FP8: one config's SASS

Reference shape (E=288, H=4096, I=1024), the configs ``gemm_config`` picks at 8 .. 65536 routed rows (decode with the
K split of a 132-SM grid), both GEMMs and precisions. Needs TRITON_INTERPRET unset."""
import hashlib
import json
import os
import re
import sys


def _kernel(rows, gemm1, fp8):
    from mxmoe._details.launch import gemm_config
    from mxmoe._details.sm90 import compile_gemm
    E, H, I = 288, 4096, 1024
    n, k = (I, H) if gemm1 else (H, I)
    cfg = gemm_config(rows, E, n, k, fp8, {}, kernel="gluon_small", gemm1=gemm1, sm_count=132)
    return compile_gemm(gemm1, fp8, cfg)


def main(argv):
    if argv[:1] == ["--compare"]:
        before, after = (json.load(open(p)) for p in argv[1:3])
        for key in sorted(set(before) | set(after)):
            b, a = before.get(key), after.get(key)
            same = b is not None and a is not None and b["hash"] == a["hash"]
            print(f"{key:16s} {'same' if same else 'DIFFERENT'}  {b and b['instructions']} -> {a and a['instructions']}"
                  f" instructions, {b and b['registers']} -> {a and a['registers']} registers")
        return
    if argv[:1] == ["--dump"]:
        from mxmoe._details.sm90 import sass_and_log
        rows, gemm1, fp8 = (int(v) for v in argv[1].split(","))
        print(sass_and_log(_kernel(rows, bool(gemm1), bool(fp8)))[0])
        return
    if argv:
        sys.path.insert(0, os.path.abspath(argv[0]))
    from mxmoe._details.sm90 import sass_and_log
    out = {}
    for rows in (8, 2048, 8192, 16384, 32768, 65536):
        for gemm1 in (True, False):
            for fp8 in (False, True):
                kernel = _kernel(rows, gemm1, fp8)
                sass, log = sass_and_log(kernel)
                ops = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
                ops = [op for op in ops if not op.startswith(".")]  # (line-table bytes name the source files)
                out[f"{rows}-{'g1' if gemm1 else 'g2'}-{'fp8' if fp8 else 'bf16'}"] = dict(
                    registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                    spill_bytes=sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)),
                    shared_bytes=kernel.metadata.shared, instructions=len(ops),
                    hash=hashlib.md5("\n".join(ops).encode()).hexdigest()[:12])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
