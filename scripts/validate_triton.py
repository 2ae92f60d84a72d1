"""Validate the Gluon kernels under another Triton on the GPU machine: the GPU suite, the fuzz and the bench.

The recipe for a new Triton release (``X.Y.Z``), a few minutes of work and of device time:

1. here (network): ``python scripts/carry_triton.py pack X.Y.Z --out .tritonXY`` (``/.tritonXY/`` ignored by git);
   ``pip download --no-deps --only-binary=:all: pytest-xdist execnet -d .whl`` (parallel pytest, optional);
2. add ``"X.Y"`` to ``config.GLUON_VALIDATED_TRITON`` in the working tree, so that ``auto`` picks the Gluon
   kernels under it (the suite and the fuzz then run what a user of that Triton would);
3. on the GPU machine, carrying ``.tritonXY`` and ``.whl`` (parts over consecutive calls if there are several)::

       python3 scripts/carry_triton.py unpack .tritonXY --target /tmp/tXY
       python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest_xdist-*.whl .whl/execnet-*.whl
       PYTHONPATH=/tmp/site python3 scripts/validate_triton.py --triton /tmp/tXY suite fuzz bench

   Each stage runs in subprocesses with ``PYTHONPATH=<triton tree>:<repo>:$PYTHONPATH`` (the machine's torch stays)
   and writes under ``$OUT`` (or ``--out``): ``suite.txt``; ``fuzz/shard_*.{txt,json}`` and the merged
   ``fuzz.json``; ``bench_<version>_<preset>.{txt,json}``, the bench once under the machine's own Triton and once
   under the carried one, the same arms and tokens, one after the other on the same card;
4. if every stage passed, commit the version in ``GLUON_VALIDATED_TRITON`` with the evidence in ``docs/``
   (perf-notes: date, card, counts, the bench table).

Stages: ``suite`` (``pytest -m gpu``, in ``--jobs`` xdist workers when pytest-xdist imports, tests spread over the workers),
``fuzz`` (``mxmoe check --fuzz`` in ``--fuzz-jobs`` processes of ``--fuzz-cases / --fuzz-jobs`` cases each, seed
``--seed``; case ``i`` is the same in any split), ``bench`` (``mxmoe bench`` per ``--presets``). The exit status is
1 when a stage failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stage_env(triton_dir: str | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = ([triton_dir] if triton_dir else []) + [REPO] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(paths)
    return env


def versions(env: dict) -> str:
    code = ("import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__} ({triton.__file__}),"
            " ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def run_suite(env: dict, out: str, jobs: int, timeout: float) -> bool:
    has_xdist = subprocess.run([sys.executable, "-c", "import xdist"], env=env, capture_output=True).returncode == 0
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs"]
    if has_xdist and jobs > 1:
        cmd += ["-n", str(jobs), "--dist", "load"]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text, rc = (exc.stdout or b"").decode() + f"\nTIMEOUT after {timeout:.0f} s", -1
    with open(os.path.join(out, "suite.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    print(f"suite: {lines[-1] if lines else 'no summary'} (rc {rc}, {time.perf_counter() - began:.0f} s wall)")
    for ln in text.splitlines():
        if ln.startswith(("FAILED", "ERROR")):
            print("  " + ln[:300])
    return rc == 0


def _worst(a, b):
    return a if b is None else b if a is None else max(a, b)


def merge_fuzz(summaries: list) -> dict:
    """The shards' ``summary`` objects (``mxmoe.fuzz.summarize``) as one: counts added, worst errors the largest."""
    merged = {}
    for summary in summaries:
        for prec, s in summary.items():
            m = merged.setdefault(prec, dict(cases=0, passed=0, failed=0, explained=0, worst={}, categories={}))
            for key in ("cases", "passed", "failed", "explained"):
                m[key] += s[key]
            for metric, v in s["worst"].items():
                m["worst"][metric] = _worst(m["worst"].get(metric), v)
            for axis, values in s["categories"].items():
                for value, c in values.items():
                    mc = m["categories"].setdefault(axis, {}).setdefault(value, dict(cases=0, failed=0))
                    for key, v in c.items():
                        mc[key] = mc.get(key, 0) + v if key in ("cases", "failed") else _worst(mc.get(key), v)
    return merged


def run_fuzz(env: dict, out: str, cases: int, jobs: int, seed: int, timeout: float) -> bool:
    folder = os.path.join(out, "fuzz")
    os.makedirs(folder, exist_ok=True)
    per = -(-cases // jobs)
    began, procs = time.perf_counter(), []
    for k in range(jobs):
        start, count = k * per, min(per, cases - k * per)
        if count <= 0:
            break
        stale = os.path.join(folder, f"shard_{k}.json")
        if os.path.exists(stale):  # (an earlier run's result must not count as this one's)
            os.remove(stale)
        log = open(os.path.join(folder, f"shard_{k}.txt"), "w")
        cmd = [sys.executable, "-m", "mxmoe.cli", "check", "--fuzz", str(count), "--start", str(start),
               "--seed", str(seed), "--json", os.path.join(folder, f"shard_{k}.json")]
        procs.append((k, subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, ok, shards = began + timeout, True, []
    for k, proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"fuzz shard {k}: TIMEOUT")
        log.close()
        path = os.path.join(folder, f"shard_{k}.json")
        if os.path.exists(path):
            shards.append(json.load(open(path)))
        else:
            ok = False
            print(f"fuzz shard {k}: no result (rc {proc.returncode}); its log: fuzz/shard_{k}.txt")
    merged = merge_fuzz([s["summary"] for s in shards])
    failures = [f for s in shards for f in s["failures"]]
    record = dict(command=f"{jobs} processes: mxmoe check --fuzz {per} --start {per}*k --seed {seed}",
                  backend=shards[0]["backend"] if shards else None, cases=sum(s["count"] for s in shards),
                  wall_s=round(time.perf_counter() - began, 1), summary=merged, failures=failures)
    json.dump(record, open(os.path.join(out, "fuzz.json"), "w"), indent=1)
    for prec, s in merged.items():
        worst = ", ".join(f"{m} {100 * v:.3f} %" for m, v in s["worst"].items() if v is not None)
        print(f"fuzz {prec}: {s['cases']} cases, {s['passed']} passed ({s['explained']} explained), "
              f"{s['failed']} failed; worst: {worst}")
    for f in failures[:20]:
        print(f"  FAIL {f['precision']} {','.join(f['failures'])}: {f['reproduce']}")
    print(f"fuzz: {record['cases']} cases in {record['wall_s']} s wall")
    return ok and not failures


def run_bench(env: dict, base_env: dict, out: str, presets: list, tokens: str, arms: str, rounds: int,
              timeout: float) -> bool:
    ok = True
    for label, e in (("base", base_env), ("carried", env)):
        version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=e,
                                 capture_output=True, text=True).stdout.strip()
        for preset in presets:
            name = f"bench_{version}_{preset}"
            cmd = [sys.executable, "-m", "mxmoe.cli", "bench", "--preset", preset, "--tokens", tokens, "--arms", arms,
                   "--rounds", str(rounds), "--json", os.path.join(out, name + ".json")]
            try:
                proc = subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True, timeout=timeout)
                text, rc = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                text, rc = (exc.stdout or b"").decode() + "\nTIMEOUT", -1
            open(os.path.join(out, name + ".txt"), "w").write(text)
            ok &= rc == 0
            print(f"bench {label} Triton {version} {preset} (rc {rc}):")
            rows = [ln for ln in text.splitlines() if re.match(r"\s*\d+ mxmoe", ln) or "median ms" in ln]
            print("\n".join(ln[:100] for ln in rows) or text[-2000:])
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stages", nargs="+", choices=("suite", "fuzz", "bench"))
    ap.add_argument("--triton", help="a PYTHONPATH tree holding the Triton to validate (carry_triton.py unpack)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--jobs", type=int, default=6, help="xdist workers (14 ran out of an 80 GB card's memory)")
    ap.add_argument("--fuzz-cases", type=int, default=600)
    ap.add_argument("--fuzz-jobs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--presets", default="ref,ktail")
    ap.add_argument("--tokens", default="1,64,1024,8192")
    ap.add_argument("--arms", default="mxmoe-w4a16,mxmoe-w4a8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=480, help="seconds per stage (per bench run)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env, base_env = stage_env(args.triton), stage_env(None)
    print("validating:", versions(env))
    ok = True
    for stage in args.stages:
        if stage == "suite":
            ok &= run_suite(env, args.out, args.jobs, args.timeout)
        elif stage == "fuzz":
            ok &= run_fuzz(env, args.out, args.fuzz_cases, args.fuzz_jobs, args.seed, args.timeout)
        else:
            ok &= run_bench(env, base_env, args.out, args.presets.split(","), args.tokens, args.arms, args.rounds,
                            args.timeout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
