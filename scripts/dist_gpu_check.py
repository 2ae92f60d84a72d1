#!/usr/bin/env python3
"""NCCL check of mxmoe.distributed (tensor and expert parallelism) on a multi-GPU host.

Launch on a machine with >= 2 GPUs, either

    torchrun --nproc_per_node 2 scripts/dist_gpu_check.py
    python scripts/dist_gpu_check.py --world 2          # torch.multiprocessing.spawn

For each arm (TP; EP with route dispatch; EP with token dispatch) and each precision
(w4a16, w4a8) it

* checks the output against single-GPU ``mxmoe.fused_moe`` on the full weights for the
  same tokens (TP: every rank's replicated tokens; EP: each rank's own tokens): relative
  L2, max |diff|, whether it is bitwise equal, whether a second run is bitwise equal,
  whether every rank got the same TP output, and which precision ran;
* times one layer with CUDA events (``--iters`` samples after ``--warmup``, ranks
  aligned by a barrier before each sample, median per rank, then the max over ranks),
  with the communication time (stage marks of ``profile=True``) shown separately, next
  to the single-GPU time for the same tokens.

Default shape: the reference shape E=288, H=4096, I=1024, top_k=8, T=8192 tokens per
rank (EP: every rank has its own 8192 tokens; TP: the same 8192 tokens on every rank).
Weights are random E2M1 bytes with scale bytes in [118, 122] (generated on rank 0 and
broadcast, so every rank holds the same full weights). TP runs with
``check_inputs=False`` for timing (the serving configuration: no host sync); one
checked call is made first. Output: a short table on rank 0.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): set below, before torch or NCCL initialize.
"""
from __future__ import annotations

import os

# Before importing torch and before any process group exists.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if os.environ["NCCL_NVLS_ENABLE"] != "0":  # never run with NVLink multicast on this host
    print(f"dist_gpu_check: overriding NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']!r} with '0'")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mxmoe  # noqa: E402
from mxmoe.distributed import ExpertParallelMoE, TensorParallelMoE  # noqa: E402

ARMS = ("tp", "ep-route", "ep-token")
CPU_RUN = False  # --cpu: gloo on CPU tensors (a dry run of this script's logic)
PRECISIONS = ("w4a16", "w4a8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=None, help="processes to spawn when not under torchrun (default: all GPUs)")
    p.add_argument("--E", type=int, default=288)
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--I", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inject-failure", type=int, default=None, metavar="RANK",
                   help="failure check: RANK raises in its first arm, after the first checked call, while the other "
                        "ranks go on into the next collective; passes when every rank has ended, with the error "
                        "reported, within --failure-timeout seconds")
    p.add_argument("--failure-timeout", type=float, default=120.0,
                   help="with --inject-failure: seconds within which every rank must have ended (also the process "
                        "group's collective timeout, so a rank blocked in a collective errors out by then)")
    p.add_argument("--cpu", action="store_true",
                   help="dry run of the script's logic on CPU with gloo (PyTorch emulation, wall-clock timing, no "
                        "stage split); use small shapes, e.g. --E 16 --H 256 --I 128 --top-k 4 --tokens 16 --iters 2")
    return p.parse_args(argv)


def log(rank, *msg):
    if rank == 0:
        print(*msg, flush=True)


# ----------------------------------------------------------------------------- data


def make_full_weights(args, device, rank):
    """Random packed E2M1 weights, identical on every rank (rank 0 draws, then broadcast)."""
    E, H, I = args.E, args.H, args.I
    shapes = dict(w13=(E, 2 * I, H // 2), w13_scale=(E, 2 * I, H // 32), w2=(E, H, I // 2), w2_scale=(E, H, I // 32))
    out = {}
    g = torch.Generator(device=device).manual_seed(args.seed)
    for name, shape in shapes.items():
        if rank == 0:
            lo, hi = (118, 123) if name.endswith("scale") else (0, 256)
            t = torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8, device=device)
        else:
            t = torch.empty(shape, dtype=torch.uint8, device=device)
        dist.broadcast(t, src=0)
        out[name] = t
    return out


def make_tokens(args, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    T, E, k = args.tokens, args.E, args.top_k
    x = torch.randn(T, args.H, generator=g, device=device).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=g, device=device)
    ids = scores.topk(k, dim=1).indices.to(torch.int32).contiguous()
    w = torch.softmax(torch.randn(T, k, generator=g, device=device), dim=1).contiguous()
    return x, w, ids


# ----------------------------------------------------------------------------- timing


def time_arm(fn, timeline, stages, iters, warmup):
    """Median ms of the whole call and of each stage (``stages``: name -> [(mark_a, mark_b), ...])."""
    cuda = not CPU_RUN
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    total, parts = [], {name: [] for name in stages}
    for _ in range(iters):
        dist.barrier()
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            total.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            total.append(1e3 * (time.perf_counter() - t0))
        for name, spans in stages.items():
            ok = cuda and timeline is not None
            parts[name].append(sum(timeline.elapsed_ms(a, b) for a, b in spans) if ok else float("nan"))
    return statistics.median(total), {name: statistics.median(v) for name, v in parts.items()}


def gather_rows(t, world):
    """Concatenate every rank's ``t`` (same shape on every rank) along dim 0; bytes travel as uint8."""
    raw = t.contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(parts, raw)
    return torch.cat(parts).view(t.dtype)


def max_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def min_over_ranks(flag: bool, device) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ----------------------------------------------------------------------------- main


def run(rank, world, local_rank, args):
    if CPU_RUN:
        device = torch.device("cpu")
        where = "CPU (gloo dry run)"
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        nccl = torch.cuda.nccl.version()
        where = f"GPU {torch.cuda.get_device_name(device)}, NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}"
    rows = []
    full = make_full_weights(args, device, rank)
    single = mxmoe.prepare_weights(**full)
    log(rank, f"world {world}, {where}, torch {torch.__version__}, E={args.E} H={args.H} I={args.I} "
              f"top_k={args.top_k} T={args.tokens}/rank, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    arms = [a for a in args.arms.split(",") if a]
    precisions = [p for p in args.precisions.split(",") if p]
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; choose from {ARMS}")
        if arm == "tp":
            layer = TensorParallelMoE(**full, device=device, profile=True, check_inputs=True)
            x, w, ids = make_tokens(args, device, seed=args.seed + 1)  # same tokens on every rank
            stages = {"comm": [("computed", "reduced")], "compute": [("start", "computed")]}
        else:
            layer = ExpertParallelMoE(**full, device=device, profile=True, dispatch=arm.split("-")[1])
            x, w, ids = make_tokens(args, device, seed=args.seed + 1000 + rank)  # each rank's own tokens
            stages = {"comm": [("start", "dispatched"), ("computed", "combined")], "compute": [("dispatched", "computed")],
                      "host_sync": [("start", "header")]}
        for prec in precisions:
            out, ran = layer(x, w, ids, precision=prec, return_precision=True)  # checked call (TP: with input check)
            if args.inject_failure == rank:
                stamp = os.environ.get(FAILED_AT_ENV)
                if stamp:  # (the failure check times from here, not from the ranks' start)
                    with open(stamp, "w") as f:
                        f.write(repr(time.time()))
                raise RuntimeError(f"injected failure on rank {rank} (--inject-failure)")
            if arm == "tp":
                layer.check_inputs = False
            again = layer(x, w, ids, precision=prec)
            if arm == "tp":
                ref = mxmoe.fused_moe(x, single, w, ids, precision=prec)
            else:  # one GPU on every rank's tokens (the same rows per expert as EP), this rank's slice
                xa, wa, ia = (gather_rows(t, world) for t in (x, w, ids))
                ref = mxmoe.fused_moe(xa, single, wa, ia, precision=prec)[rank * args.tokens:(rank + 1) * args.tokens]
                del xa, wa, ia
            rel = mxmoe.relative_l2(out, ref)
            max_diff = float((out.float() - ref.float()).abs().max())
            bitwise = min_over_ranks(torch.equal(out, ref), device)
            repeat = min_over_ranks(torch.equal(out, again), device)
            same_on_ranks = True
            if arm == "tp":
                r0 = out.clone()
                dist.broadcast(r0, src=0)
                same_on_ranks = min_over_ranks(torch.equal(out, r0), device)
            # (the arm's tensors bound as defaults: the loop deletes them at the end of each arm)
            ms, parts = time_arm(lambda layer=layer, x=x, w=w, ids=ids, prec=prec: layer(x, w, ids, precision=prec),
                                 layer.timeline, stages, args.iters, args.warmup)
            one_gpu = lambda x=x, w=w, ids=ids, prec=prec: mxmoe.fused_moe(x, single, w, ids, precision=prec)  # noqa: E731
            ms_1gpu, _ = time_arm(one_gpu, None, {}, args.iters, args.warmup)
            names = sorted(parts)
            worst = max_over_ranks([ms, ms_1gpu, rel, max_diff] + [parts[n] for n in names], device)
            ms, ms_1gpu, rel, max_diff = worst[:4]
            parts = dict(zip(names, worst[4:]))
            rows.append(dict(arm=arm, prec=prec, ran=ran, ms=ms, comm=parts["comm"], compute=parts["compute"],
                             host=parts.get("host_sync"), ms_1gpu=ms_1gpu, rel=rel, max_diff=max_diff, bitwise=bitwise,
                             repeat=repeat, same=same_on_ranks))
            if arm == "tp":
                layer.check_inputs = True
            del out, again, ref
        del layer, x, w, ids
        if not CPU_RUN:
            torch.cuda.empty_cache()

    if rank == 0:
        print()
        print("times: median of the samples on each rank, max over ranks; comm = NCCL stages (EP: routing + header "
              "exchange/host read + dispatch + combine; TP: the FP32 all_reduce); 1-GPU = fused_moe on the full weights, "
              "same tokens per GPU.\nerrors vs 1-GPU fused_moe on the full weights (EP: on all ranks' tokens at once, "
              "so each expert sees the same rows); bitwise is expected for ep-route only (TP and ep-token sum BF16 "
              "partials)")
        hdr = (f"{'arm':9} {'prec':6} {'ran':6} {'total ms':>9} {'comm ms':>8} {'compute':>8} {'1-GPU ms':>9} "
               f"{'relL2 vs 1-GPU':>15} {'max|diff|':>10} {'bitwise':>7} {'repeat':>6} {'ranks=':>6}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            print(f"{r['arm']:9} {r['prec']:6} {r['ran']:6} {r['ms']:9.3f} {r['comm']:8.3f} {r['compute']:8.3f} "
                  f"{r['ms_1gpu']:9.3f} {r['rel']:15.2e} {r['max_diff']:10.3g} {str(r['bitwise']):>7} "
                  f"{str(r['repeat']):>6} {str(r['same']):>6}")
        ep_host = [r["host"] for r in rows if r["host"] is not None]
        if ep_host and not CPU_RUN:
            print(f"EP routing + header exchange (incl. its one host read), part of comm: "
                  f"{min(ep_host):.3f}-{max(ep_host):.3f} ms")
        ok = all(r["repeat"] and r["same"] and r["ran"] == r["prec"] for r in rows)
        ok &= all(r["rel"] <= (1e-2 if r["prec"] == "w4a16" else 5e-2) for r in rows)
        print("RESULT:", "PASS" if ok else "FAIL",
              "(deterministic, same on every rank, requested precision ran, relL2 <= 1e-2 (w4a16) / 5e-2 (w4a8))")
    return rows


FAILED_AT_ENV = "MXMOE_DIST_CHECK_FAILED_AT"  # file the failing rank stamps with its failure's time


def pg_timeout(args) -> datetime.timedelta:
    """The collectives' timeout: 10 minutes, or the failure check's (a rank left waiting on a dead peer errors out)."""
    if args.inject_failure is None:
        return datetime.timedelta(minutes=10)
    return datetime.timedelta(seconds=args.failure_timeout)


def worker(local_rank, world, args, init_file):
    """Entry for torch.multiprocessing.spawn (one process per GPU, or per CPU rank with --cpu)."""
    global CPU_RUN
    CPU_RUN = args.cpu
    if not CPU_RUN:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo" if CPU_RUN else "nccl", init_method=f"file://{init_file}", rank=local_rank,
                            world_size=world, timeout=pg_timeout(args))
    try:
        run(local_rank, world, local_rank, args)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    global CPU_RUN
    args = parse_args(argv)
    CPU_RUN = args.cpu
    if not CPU_RUN and not torch.cuda.is_available():
        raise SystemExit("dist_gpu_check needs CUDA GPUs (or --cpu for a dry run)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if not CPU_RUN:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("gloo" if CPU_RUN else "nccl", timeout=pg_timeout(args))
        try:  # (under torchrun a failed rank ends the others through torchrun's agent)
            run(dist.get_rank(), dist.get_world_size(), local_rank, args)
        finally:
            dist.destroy_process_group()
        return
    available = 64 if CPU_RUN else torch.cuda.device_count()
    world = args.world or (2 if CPU_RUN else available)
    if world < 1 or world > available:  # (1: a one-GPU dry run of every part, the collectives on one rank)
        raise SystemExit(f"need 1 <= world <= {available} GPUs, got world={world}")
    if args.inject_failure is not None and not 0 <= args.inject_failure < world:
        raise SystemExit(f"--inject-failure takes a rank in 0..{world - 1}")
    with tempfile.TemporaryDirectory() as d:
        stamp = os.environ[FAILED_AT_ENV] = os.path.join(d, "failed_at")  # (the ranks inherit it)
        try:
            torch.multiprocessing.spawn(worker, args=(world, args, os.path.join(d, "init")), nprocs=world, join=True)
        except Exception as exc:  # torch.multiprocessing.ProcessRaisedException / ProcessExitedException
            if args.inject_failure is None:
                raise
            failed_at = float(open(stamp).read()) if os.path.exists(stamp) else None
            report_failure(args, exc, failed_at)
    if args.inject_failure is not None:
        print("RESULT: FAIL (the injected failure did not end the run with an error)")
        raise SystemExit(1)


def report_failure(args, exc: Exception, failed_at) -> None:
    """The failure check's verdict: the run ended with an error within ``--failure-timeout`` of the injected one."""
    if failed_at is None:
        print(f"RESULT: FAIL (the run ended before the injected failure: {type(exc).__name__}: {exc})")
        raise SystemExit(1)
    seconds = time.time() - failed_at
    first = "the injected error" if "injected failure" in str(exc) else "a peer's error (its link to the failed rank)"
    ok = seconds <= args.failure_timeout
    print(f"failure check: every rank ended {seconds:.1f} s after the injected failure, first {first}: "
          f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}")
    print("RESULT:", "PASS" if ok else "FAIL", f"(the run ended with an error, every rank gone, within "
          f"{args.failure_timeout:g} s of the failure)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
