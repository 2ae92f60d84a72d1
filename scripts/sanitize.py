"""compute-sanitizer over every kernel family, both precisions, with and without PDL (developer tool, CUDA).

    python3 scripts/sanitize.py                 # every tool, PDL on and off: a table of error counts
    TOOLS=memcheck,racecheck python3 scripts/sanitize.py
    python3 scripts/sanitize.py run [--no-pdl]  # the workloads alone (what each sanitizer run executes)
    python3 scripts/sanitize.py report DIR      # the table again from the logs of a run

Each workload is one small ``fused_moe`` call chosen to land on one family (the kernels it launched are listed):
the one-launch and the three-kernel route pack, the small-tile GEMMs (16- to 128-row tiles, W4A8's FP8 chains
promoted in registers and in shared memory), the wide W4A16 tiles, the warp-specialized W4A16 GEMM2, the decode K
split (two warpgroups, and two programs per tile), the direct decode path (GEMM2 sums the routes), W4A8's exact
unfolded kernel, the plain-Triton template (K tails the Gluon kernels do not take), the quantizers and the top-k
sum. The workloads first run without a sanitizer (Triton's cache then holds every kernel); each tool then runs them
all in one process with the CUDA caching allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every buffer a fresh
allocation, so initcheck sees reads of memory nobody wrote). Errors are attributed to the workload whose marker
line precedes them (the hazards displayed, up to ``--print-limit``; the tool's own total is printed below the table).
Writes ``$OUT/sanitize_<tool>_<pdl>.log`` and ``$OUT/sanitize.json``; exits 1 on any error.

On the H200 (2026-12-04, ``docs/sanitize-h200.txt``) every count is 0 except racecheck on the two persistent
warp-specialized families (the wide W4A16 tiles, the warp-specialized GEMM2). Every hazard it shows is on the
partition-state bytes that Triton's ``gl.warp_specialize`` lowering keeps in shared memory: the default warpgroup
stores them before CTA-wide named barrier 1, the worker warps load them after it (SASS: ``STS [state]`` →
``BAR.SYNC 0x1`` | ``BAR.SYNC 0x1`` → ``LDS.U8 [state + warp]``), none on mxmoe's own buffers.
``scripts/ws_race_probe.py`` reproduces it in a 20-line kernel with no shared data: racecheck reports the same pair
exactly when the default warps initialize mbarriers (and so pass a 128-thread ``bar.sync 0``) before the call.
"""
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT", "/tmp")
TOOLS = tuple(os.environ.get("TOOLS", "memcheck,racecheck,initcheck,synccheck").split(","))
MARK = "### workload "

# name: (what, E, H, I, T, top_k, precisions, scales)
WORKLOADS = {
    "pack1_small_tiles": ("one-launch route pack, 16/32-row small tiles, top-k sum, quantizers", 8, 256, 128, 37, 4,
                          ("w4a16", "w4a8"), "normal"),
    "pack3_wide": ("three-kernel route pack (1200 routes), W4A16 256-row wide tiles, W4A8 128-row tiles", 8, 512,
                   256, 300, 4, ("w4a16", "w4a8"), "normal"),
    "fp8_smem_promotion": ("W4A8 128-row tiles, FP8 chains over K=2048 promoted in shared memory", 4, 2048, 256, 600,
                           2, ("w4a8",), "normal"),
    "fp8_reg_promotion": ("W4A8 64-row tiles, FP8 chains promoted in registers", 8, 2048, 256, 128, 4, ("w4a8",),
                          "normal"),
    "ws_gemm2": ("W4A16 GEMM2 warp-specialized (128-row tiles, H % 128 != 0)", 4, 320, 128, 300, 2, ("w4a16",),
                 "normal"),
    "decode_direct": ("W4A16 T=2 without a route pack, GEMM2 sums the routes", 8, 512, 256, 2, 4, ("w4a16",),
                      "normal"),
    "decode_ksplit": ("T=1, GEMM1's K split over two warpgroups", 8, 512, 256, 1, 2, ("w4a16", "w4a8"), "normal"),
    "decode_kparts": ("W4A16 T=2, GEMM1 in two programs per tile (K halves joined per route)", 16, 512, 1024, 2, 5,
                      ("w4a16",), "normal"),
    "fp8_unfolded": ("W4A8's exact unfolded kernel beside the fast one (odd experts span 30 binades)", 8, 256, 128,
                     37, 4, ("w4a8",), "mixed_span"),
    "plain_template": ("the plain-Triton template (H, I multiples of 32, not of 64)", 4, 96, 160, 13, 2,
                       ("w4a16", "w4a8"), "normal"),
}


def run_workloads(pdl: bool) -> int:
    import torch

    from mxmoe import fused_moe, testing
    from mxmoe._details.config import overrides

    names = []
    from triton import knobs

    knobs.runtime.launch_enter_hook.add(lambda md: names.append(md.data["name"]))
    failed = 0
    for name, (what, E, H, I, T, top_k, precisions, scales) in WORKLOADS.items():
        experts, _ = testing.make_experts(E, H, I, seed=1, device="cuda", scales=scales, biases=True)
        weights, ids, _, _ = testing.make_routing("masked" if T > 4 else "uniform", T, E, top_k, seed=2, device="cuda")
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        for prec in precisions:
            print(f"{MARK}{name} {prec}", flush=True)
            names.clear()
            try:
                with overrides(pdl=pdl):
                    out = fused_moe(x, experts, weights, ids, precision=prec)
                torch.cuda.synchronize()
                ok = bool(torch.isfinite(out).all())
            except Exception as exc:  # report and go on: the sanitizer's counts are the point
                print(f"### error {type(exc).__name__}: {exc}", flush=True)
                failed += 1
                continue
            print(f"### kernels {','.join(dict.fromkeys(names))} finite={ok}", flush=True)
    print(f"{MARK}end", flush=True)
    return 1 if failed else 0


_NOT_ERRORS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application")


def parse(log: str) -> dict:
    """``{(workload, precision): {"errors": n, "first": line, "kernels": str}}`` plus ``"summary"``: the sanitizer's
    own total (``ERROR SUMMARY``), to cross-check the attribution."""
    current = ("(start)", "")
    rows = {}
    summary = None
    for line in log.splitlines():
        if line.startswith(MARK):
            parts = line[len(MARK):].split()
            current = (parts[0], parts[1] if len(parts) > 1 else "")
            rows.setdefault(current, dict(errors=0, first="", kernels=""))
        elif line.startswith("### kernels "):
            rows[current]["kernels"] = line[len("### kernels "):]
        elif line.startswith("### error "):
            rows.setdefault(current, dict(errors=0, first="", kernels=""))["kernels"] = line
        elif line.startswith("========= ") and not line.startswith("=========  "):
            text = line[len("========= "):]
            m = re.match(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error)", text)
            if m:
                summary = int(m.group(1) or m.group(2))
            elif text.strip() and not text.startswith(_NOT_ERRORS) and ("Warning" not in text[:12]):
                r = rows.setdefault(current, dict(errors=0, first="", kernels=""))
                r["errors"] += 1
                r["first"] = r["first"] or text
    return dict(rows=rows, summary=summary)


def main() -> int:
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    me = [sys.executable, os.path.abspath(__file__), "run"]
    warm = subprocess.run(me, capture_output=True, text=True, env=dict(os.environ))  # compile outside the sanitizer
    print(warm.stdout[-3000:] + warm.stderr[-3000:])
    results = {}
    for tool in TOOLS:
        for pdl in (True, False):
            tag = f"{tool}_{'pdl' if pdl else 'nopdl'}"
            cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "200"]
            if tool == "racecheck":
                cmd += ["--racecheck-report", "all"]
            start = time.time()
            try:
                p = subprocess.run(cmd + me + ([] if pdl else ["--no-pdl"]), capture_output=True, text=True, env=env,
                                   timeout=int(os.environ.get("SANITIZE_TIMEOUT", "400")))
                log, rc = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as exc:
                log, rc = (exc.stdout or b"").decode() + (exc.stderr or b"").decode() + "\n### TIMEOUT", -1
            with open(os.path.join(OUT, f"sanitize_{tag}.log"), "w") as f:
                f.write(log)
            results[tag] = dict(parse(log), rc=rc, seconds=round(time.time() - start, 1))
            print(f"{tag}: rc={rc} {results[tag]['seconds']} s", flush=True)
    return report(results)


def report(results: dict) -> int:
    """Print the table of ``results`` (``{tool_pdl: parse(log) + rc}``), write ``$OUT/sanitize.json``; 1 on any
    error, timeout or incomplete run."""
    for r in results.values():
        r["complete"] = ("end", "") in r["rows"]
    rows = sorted({k for r in results.values() for k in r["rows"]} - {("(start)", ""), ("end", "")},
                  key=lambda k: (list(WORKLOADS).index(k[0]) if k[0] in WORKLOADS else 99, k[1]))
    with open(os.path.join(OUT, "sanitize.json"), "w") as f:
        json.dump({tag: dict(r, rows={f"{a} {b}": v for (a, b), v in r["rows"].items()}) for tag, r in
                   results.items()}, f, indent=1)
    print("\nerrors displayed per workload, PDL on / off")
    print(f"{'workload':<30}" + "".join(f"{t:>14}" for t in TOOLS) + "  kernels")
    bad = 0
    for key in rows:
        cells = []
        for tool in TOOLS:
            on = results.get(f"{tool}_pdl", {}).get("rows", {}).get(key, {}).get("errors", "-")
            off = results.get(f"{tool}_nopdl", {}).get("rows", {}).get(key, {}).get("errors", "-")
            cells.append(f"{on}/{off}")
            bad += sum(v for v in (on, off) if isinstance(v, int))
        kernels = next((r["rows"][key]["kernels"] for r in results.values() if r["rows"].get(key, {}).get("kernels")),
                       "")
        print(f"{key[0] + ' ' + key[1]:<30}" + "".join(f"{c:>14}" for c in cells) + f"  {kernels}")
    for tag, r in results.items():
        outside = r["rows"].get(("(start)", ""), {}).get("errors", 0)
        first = next((v["first"] for v in r["rows"].values() if v["first"]), "")
        print(f"{tag}: the tool's total {r['summary']}, outside the workloads {outside}, rc {r.get('rc')}, "
              f"complete {r['complete']}" + (f", first: {first[:160]}" if first else ""))
        bad += outside + (0 if r["complete"] else 1)
    return 1 if bad else 0


def report_logs(directory: str) -> int:
    """``report`` again from the logs a run left in ``directory`` (``sanitize_<tool>_<pdl>.log``)."""
    results = {}
    for tool in TOOLS:
        for pdl in ("pdl", "nopdl"):
            path = os.path.join(directory, f"sanitize_{tool}_{pdl}.log")
            if os.path.exists(path):
                results[f"{tool}_{pdl}"] = parse(open(path).read())
    return report(results)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        sys.exit(run_workloads(pdl="--no-pdl" not in sys.argv[2:]))
    if len(sys.argv) > 2 and sys.argv[1] == "report":
        sys.exit(report_logs(sys.argv[2]))
    sys.exit(main())
