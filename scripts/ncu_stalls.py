"""Where a kernel's warps wait, per loop and per SASS instruction, from ncu's source counters (developer tool).

    # on the device: profile the two GEMMs of the third fused_moe call (reference shape, T tokens)
    ncu --kernel-name regex:moe_gemm_small --launch-skip 4 --launch-count 2 --section WarpStateStats \\
        --section SourceCounters -o $OUT/prof python3 scripts/ncu_stalls.py run 1024 w4a16
    ncu -i $OUT/prof.ncu-rep --page source --csv --print-source sass > $OUT/prof.csv
    # anywhere: the report
    python3 scripts/ncu_stalls.py report prof.csv [--top 25]

``report``: per profiled kernel, the warp-state samples by stall reason, then each loop (a backward branch's body,
nested loops included in the outer ones) with its share of the samples and its top reasons, then the most sampled
instructions. ncu leaves some samples without a reason column (on the H200 most of those sit on `HGMMA`s), so a
row's reasons need not add up to its samples."""
import argparse
import collections
import csv
import re
import sys


def _kernels(path):
    kernels, cur = [], None
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            cur = {"name": row[1], "header": None, "rows": []}
            kernels.append(cur)
        elif row and row[0] == "Address" and cur is not None:
            cur["header"] = row
        elif cur is not None and cur["header"] and len(row) > 5:
            cur["rows"].append(row)
    return kernels


def report(path, top):
    for ki, k in enumerate(_kernels(path)):
        col = {n: i for i, n in enumerate(k["header"])}
        reasons = [n for n in k["header"] if n.startswith("stall_") and "Not Issued" not in n]
        rows = k["rows"]
        samples = [int(r[col["# Samples"]] or 0) for r in rows]
        total = sum(samples) or 1

        def by_reason(seg):
            c = collections.Counter()
            for r in seg:
                for n in reasons:
                    c[n[6:]] += int(r[col[n]] or 0)
            return c

        print(f"kernel {ki} ({k['name']}): {len(rows)} instructions, {total} samples")
        print("  " + ", ".join(f"{n} {100 * v / total:.1f}%" for n, v in by_reason(rows).most_common(10)))
        pos = {int(r[0], 16): i for i, r in enumerate(rows)}
        for i, r in enumerate(rows):
            m = re.search(r"BRA (0x[0-9a-f]+)", r[1])
            start = pos.get(int(m.group(1), 16)) if m else None
            if start is not None and start < i:
                share = sum(samples[start:i + 1])
                if share >= 0.01 * total:
                    print(f"  loop [{start}, {i}] ({i - start + 1} instructions): {100 * share / total:.1f}% of the "
                          "samples; " + ", ".join(f"{n} {100 * v / share:.0f}%"
                                                  for n, v in by_reason(rows[start:i + 1]).most_common(6)))
        for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
            worst = by_reason([rows[i]]).most_common(3)
            print(f"  {i:5d} {samples[i]:6d} {rows[i][1].strip()[:64]:64s} " + " ".join(f"{n}:{v}" for n, v in worst))


def run(tokens, prec):
    """Three fused_moe calls on the reference shape (seeded weights and routes), for ncu to profile."""
    import torch

    import mxmoe
    from _experts import random_experts, run
    E, H, I, k = 288, 4096, 1024, 8
    ex = random_experts(E, H, I)
    torch.manual_seed(0)
    x = torch.randn(tokens, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (tokens, k), device="cuda", dtype=torch.int32)
    w = torch.rand(tokens, k, device="cuda")
    ws, out = mxmoe.Workspace(ex, tokens, k, fp8=True), torch.empty_like(x)
    for _ in range(3):
        run(x, ex, w, ids, prec, out, ws)
    torch.cuda.synchronize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report")
    r.add_argument("csv")
    r.add_argument("--top", type=int, default=25)
    d = sub.add_parser("run")
    d.add_argument("tokens", type=int)
    d.add_argument("prec", nargs="?", default="w4a16")
    a = ap.parse_args(sys.argv[1:])
    if a.cmd == "report":
        report(a.csv, a.top)
    else:
        run(a.tokens, a.prec)
