"""sm_90a SASS of every default GEMM config, compiled on the CPU (developer tool): registers, spills, shared memory,
instruction count and a hash of the instruction stream (addresses and line tables left out), so that "the SASS is
identical" can be checked before and after a change.

    python3 scripts/sass_configs.py [PKGDIR] > after.json     # PKGDIR: a directory holding an ``mxmoe`` package
    python3 scripts/sass_configs.py --compare before.json after.json
    python3 scripts/sass_configs.py --dump CASE > case.sass    # one case's SASS (names as in the JSON)

The cases are ``sm90.default_cases`` (with 2048 and 8192 rows besides): the configs ``gemm_config`` picks on the
reference shape for every kernel family and knob (the CPU compile test's), and W4A8's exact unfolded kernel. Needs TRITON_INTERPRET unset.
"""
import hashlib
import json
import os
import re
import sys


def _compiled(pkgdir=None):
    if pkgdir:
        sys.path.insert(0, os.path.abspath(pkgdir))
    from mxmoe._details.sm90 import compile_gemm, default_cases
    for name, gemm1, fp8, cfg, kw in default_cases(small_rows=(8, 2048, 8192, 16384, 32768, 65536), unfolded=True):
        yield name, compile_gemm(gemm1, fp8, cfg, **kw)


def _instructions(sass: str) -> list:
    ops = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    return [op for op in ops if not op.startswith(".")]  # (line-table bytes name the source files)


def main(argv):
    if argv[:1] == ["--compare"]:
        before, after = (json.load(open(p)) for p in argv[1:3])
        different = 0
        for key in sorted(set(before) | set(after)):
            b, a = before.get(key), after.get(key)
            same = b is not None and a is not None and b["hash"] == a["hash"]
            different += not same
            print(f"{key:56s} {'same' if same else 'DIFFERENT'}  {b and b['instructions']} -> "
                  f"{a and a['instructions']} instructions, {b and b['registers']} -> {a and a['registers']} registers")
        print(f"{len(set(before) | set(after))} cases, {different} different")
        sys.exit(1 if different else 0)
    if argv and argv[0] not in ("--dump", "--compare"):
        sys.path.insert(0, os.path.abspath(argv[0]))  # (before the first import of mxmoe)
    from mxmoe._details.sm90 import sass_and_log
    if argv[:1] == ["--dump"]:
        for name, kernel in _compiled():
            if name == argv[1]:
                print(sass_and_log(kernel)[0])
        return
    out = {}
    for name, kernel in _compiled(argv[0] if argv else None):
        sass, log = sass_and_log(kernel)
        ops = _instructions(sass)
        out[name] = dict(registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                         spill_bytes=sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)),
                         shared_bytes=kernel.metadata.shared, instructions=len(ops),
                         hash=hashlib.md5("\n".join(ops).encode()).hexdigest()[:12])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
