"""``mxmoe bench``: time mxmoe's two paths and its peers against measured floors (SPEC §8).

Method
------
* Inputs: expert weights drawn at random and quantized with :func:`mxmoe.quantize_mxfp4`
  (:func:`mxmoe.testing.make_experts`); per token count fresh random BF16 activations and a
  uniform softmax-top-k routing (no masked routes).
* Each arm is warmed up, then (``T * top_k <= --graph-max-rows`` and the arm allows it)
  captured in a ``torch.cuda.CUDAGraph`` whose replays are timed; otherwise eager calls
  are timed. mxmoe's W4A8 arm is always timed eagerly: during capture mxmoe runs W4A16
  (SPEC §6).
* The arms are interleaved in three rounds, the order reversed every other round, with 30
  CUDA-event samples per arm per round; the median of the 90 is reported
  (:func:`interleaved_samples`).
* Floors, measured in the same run: cuBLAS BF16 and FP8 (``torch._scaled_mm``, scales 1)
  8192^3 products on random data, and a device-to-device copy (bytes read + written).
  Floor of an arm = ``max(FLOPs / rate, bytes / bandwidth)`` with ``FLOPs = T * top_k *
  (2*H*2I + 2*I*H)``, ``rate`` the BF16 rate for 16-bit-activation arms and the FP8 rate
  for 8-bit ones, and ``bytes`` = the MXFP4 weights and scales of each distinct expert the
  routing touches, once, plus the activations in and out. The floor is the problem's, not
  the arm's: peers that read BF16 or FP8 weights are held to the same byte count.
* GPU name, clocks and throttle reasons are recorded before, during (after each T) and
  after the run (pynvml if importable, else ``nvidia-smi``; absent is not an error).
* Peers whose GEMMs are kernels of their own (the Humming arms) also get their GEMM kernels
  alone (``gemm_ms``): after all timings, per T, the device time of the kernels whose names
  the arm's ``gemm_kernel`` matches, summed per call, by the torch profiler
  (:func:`kernel_times`, :func:`gemm_alone_ms`); routing, quantization, activation and the
  top-k sum are left out.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TextIO

import torch

from .. import check as checks, testing

from . import arms
from .arms import ARM_NAMES, Arm, HummingArm, HummingW4A8Arm, MxmoeArm, TorchGroupedMMArm, all_arms
from .problem import (DEFAULT_TOKENS, GRAPH_MAX_ROWS, PRESET_HELP, PRESETS, ROUNDS, SAMPLES, Inputs, Shape, _floor_ms,
                      make_inputs, parse_shape, parse_tokens)
from .timing import (HUMMING_GEMM_KERNEL, capture_graph, host_ms, lone_ms, collect_environment, cuda_event_sampler, gemm_alone_ms,
                     gpu_snapshot, interleaved_samples, kernel_times, measure_floors, median, position_medians,
                     round_orders)

__all__ = ["ARM_NAMES", "Arm", "BenchConfig", "DEFAULT_TOKENS", "GRAPH_MAX_ROWS", "HUMMING_GEMM_KERNEL", "HummingArm",
           "HummingW4A8Arm", "Inputs", "MxmoeArm", "PRESET_HELP", "PRESETS", "Progress", "ROUNDS", "SAMPLES", "Shape",
           "TorchGroupedMMArm", "all_arms", "arms", "capture_graph", "cuda_event_sampler", "gemm_alone_ms",
           "gpu_snapshot", "interleaved_samples", "kernel_times", "make_inputs", "measure_floors",
           "measure_gemms_alone", "median", "parse_shape", "parse_tokens", "plot", "position_medians", "print_table",
           "round_orders", "run_bench", "run_gpu_bench"]


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    shape: Shape = PRESETS["ref"]
    tokens: tuple = DEFAULT_TOKENS
    arms: Optional[tuple] = None  # names; None = all
    rounds: int = ROUNDS
    samples: int = SAMPLES
    warmup: int = 5
    graph_max_rows: int = GRAPH_MAX_ROWS
    floors: bool = True
    seed: int = 0
    json_path: Optional[str] = None
    plot_path: Optional[str] = None


class Progress:
    """One status line on stderr (rewritten in place on a terminal)."""

    def __init__(self, stream: Optional[TextIO] = None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last = ""

    def __call__(self, msg: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + msg)
        elif msg.split(":")[0] != self.last.split(":")[0]:  # one line per T when not a terminal
            self.stream.write(msg + "\n")
        self.stream.flush()
        self.last = msg

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run_gpu_bench(cfg: BenchConfig, device: torch.device, stream: Optional[TextIO] = None,
                  progress: Optional[Progress] = None) -> dict:
    """The full benchmark on a CUDA device; returns the JSON-able record and prints the table."""
    stream = stream or sys.stdout
    progress = progress or Progress()
    shape = cfg.shape
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    env = collect_environment(device)
    print(f"mxmoe bench on {env.get('gpu')} (SM {env.get('capability')}, {env.get('sm_count')} SMs), torch "
          f"{env['torch']}, triton {env['triton']}; shape {shape}; tokens {','.join(map(str, cfg.tokens))}", file=stream)
    print(f"clocks at start: {_fmt_clocks(env.get('clocks_start'))}", file=stream)
    record: dict = {"environment": env, "shape": dataclasses.asdict(shape), "tokens": list(cfg.tokens),
                    "method": {"rounds": cfg.rounds, "samples_per_round": cfg.samples, "warmup": cfg.warmup,
                               "graph_max_rows": cfg.graph_max_rows, "statistic": "median"},
                    "arms": {}, "results": []}
    floors = None
    if cfg.floors:
        progress("floors: cuBLAS BF16 / FP8 8192^3, device copy")
        floors = measure_floors()
        record["floors"] = floors
        print(f"floors: BF16 {_fmt(floors.get('bf16_tflops'), '.0f')} TFLOP/s, FP8 {_fmt(floors.get('fp8_tflops'), '.0f')} "
              f"TFLOP/s, copy {_fmt(floors.get('copy_gbps'), '.0f')} GB/s"
              + "".join(f"; {k}: {v}" for k, v in floors.items() if k.endswith("_error")), file=stream)

    progress("preparing weights")
    experts, _ = testing.make_experts(shape.E, shape.H, shape.I, seed=cfg.seed, device=device, gen_device=device)
    record["experts_memory"] = experts.memory()
    arms = _prepare_arms(cfg, experts, record, progress)
    for name, info in record["arms"].items():
        print(f"  {name:<28} {info['status']}", file=stream)
    rows = []
    for ti, T in enumerate(cfg.tokens):
        step = f"T={T} ({ti + 1}/{len(cfg.tokens)})"
        for m in _time_tokens(cfg, arms, T, floors, device, lambda what: progress(f"{step}: {what}")):
            rows.append(m)
            record["results"].append(m)
        record.setdefault("clocks_after_T", {})[str(T)] = gpu_snapshot(device.index or 0)
    measure_gemms_alone([a for a in arms if a.gemm_kernel is not None], rows, cfg, device, progress)
    progress.done()
    for arm in arms:
        arm.release()
    env["clocks_end"] = gpu_snapshot(device.index or 0)
    print_table(rows, stream)
    print("arms:", file=stream)
    for name, info in record["arms"].items():
        print(f"  {name:<28} {info['status']}{'; ' + info['note'] if info.get('note') else ''}\n"
              f"  {'':<28} {info['what']}", file=stream)
    print(f"clocks at end: {_fmt_clocks(env.get('clocks_end'))}", file=stream)
    return record


def _prepare_arms(cfg: BenchConfig, experts, record: dict, progress: Callable[[str], None]) -> list[Arm]:
    """The arms that run here, prepared for the shape; each one's status in ``record["arms"]``."""
    wanted = set(cfg.arms) if cfg.arms else None
    arms: list[Arm] = []
    for arm in all_arms():
        if wanted is not None and arm.name not in wanted:
            continue
        why = arm.unavailable()
        info = record["arms"][arm.name] = {"what": arm.what, "rate": arm.rate}
        if why:
            info["status"] = why
            continue
        try:
            progress(f"preparing {arm.name}")
            arm.prepare(experts, cfg.shape, max(cfg.tokens))
            info["status"] = "ok"
            if getattr(arm, "note", None):
                info["note"] = arm.note
            if arm.gemm_kernel is not None:
                info["gemm_kernels"] = (f"kernels matching {arm.gemm_kernel.pattern!r}: gemm_ms = their device "
                                        "time per call (torch profiler, median of 5 eager calls, after all timings)")
            arms.append(arm)
        except Exception as exc:
            info["status"] = f"error: {type(exc).__name__}: {exc}"
        torch.cuda.synchronize()
    return arms


def _time_tokens(cfg: BenchConfig, arms: Sequence[Arm], T: int, floors: Optional[dict], device: torch.device,
                 progress: Callable[[str], None]) -> list[dict]:
    """Every arm at T: interleaved timings (graph replays where the arm allows at small T, else eager calls), the
    error against the W4A16 arm, and each arm's host time of an eager call (``host_ms``) and one synchronized call
    (``lone_ms``). One row per arm."""
    shape = cfg.shape
    inp = make_inputs(shape, T, device, cfg.seed)
    # keep: each arm's eager callable and graph. A graph holds raw pointers into the tensors the
    # callable's closure owns (inputs, output, scratch); dropping the closure would free them
    # while replays still read and write there.
    calls, eager, meta, outputs, keep = {}, {}, {}, {}, []
    for arm in arms:
        m = meta[arm.name] = {"T": T, "arm": arm.name, "rate": arm.rate, "distinct_experts": inp.distinct_experts}
        try:
            progress(f"warm-up {arm.name}")
            fn = eager[arm.name] = arm.make_call(inp)
            for _ in range(cfg.warmup):
                res = fn()
            torch.cuda.synchronize()
            outputs[arm.name] = (res if isinstance(res, torch.Tensor) else None)
            if outputs[arm.name] is not None:
                outputs[arm.name] = outputs[arm.name].clone()
            m["mode"] = "eager"
            if getattr(arm, "ran", None):
                m["precision_ran"] = arm.ran
            if getattr(arm, "tiles", None):
                m["tiles"] = arm.tiles
            if arm.graphable and T * shape.top_k <= cfg.graph_max_rows:
                try:
                    graph = capture_graph(fn)
                    keep.append((fn, graph))
                    m["mode"] = "graph"
                    fn = graph.replay
                except Exception as exc:
                    m["graph_error"] = f"{type(exc).__name__}: {exc}"
                    torch.cuda.synchronize()
            calls[arm.name] = fn
        except Exception as exc:
            _record_error(m, "error", exc)
    samples = interleaved_samples(calls, cuda_event_sampler, rounds=cfg.rounds, samples=cfg.samples,
                                  progress=lambda r, name: progress(f"round {r + 1}/{cfg.rounds} {name}"))
    for name in calls:  # the host's side of an eager call, after the timings (the GPU kept busy meanwhile)
        progress(f"host time {name}")
        try:
            meta[name].update(host_ms=host_ms(eager[name]), lone_ms=lone_ms(eager[name]))
        except Exception as exc:
            _record_error(meta[name], "host_error", exc)
    base_name = next((n for n in ("mxmoe-w4a16", "torch-grouped-mm-bf16") if outputs.get(n) is not None), None)
    rows = []
    for arm in arms:
        m = meta[arm.name]
        if arm.name in samples:
            t = median(samples[arm.name])
            m.update(samples_ms=samples[arm.name], median_ms=t, tflops=shape.flops(T) / (t * 1e9))
            fl = _floor_ms(shape, inp, arm.rate, floors)
            if fl:
                m.update(floor_ms=fl, time_over_floor=t / fl)
            if base_name and arm.name != base_name and outputs.get(arm.name) is not None:
                from ..reference import relative_l2

                m["rel_l2_vs"] = base_name
                m["rel_l2"] = relative_l2(outputs[arm.name], outputs[base_name])
        rows.append(m)
    del calls, eager, outputs, keep
    torch.cuda.synchronize()
    return rows


def measure_gemms_alone(arms: Sequence[Arm], rows: Sequence[dict], cfg: BenchConfig, device: torch.device,
                        progress: Callable[[str], None]) -> None:
    """Adds ``gemm_ms`` (and ``gemm_kernels``, their number per call) to each row of ``arms`` that was timed:
    :func:`gemm_alone_ms` of the arm's ``gemm_kernel`` on :func:`kernel_times` of a fresh eager call on the same
    inputs. Runs after every timing, since the profiler leaves later launches slower."""
    by_key = {(m["T"], m["arm"]): m for m in rows}
    for ti, T in enumerate(cfg.tokens if arms else ()):
        inp = make_inputs(cfg.shape, T, device, cfg.seed)  # the timed inputs: same seed
        for arm in arms:
            m = by_key.get((T, arm.name))
            if m is None or "median_ms" not in m:
                continue
            progress(f"GEMM kernels T={T} ({ti + 1}/{len(cfg.tokens)}): {arm.name}, torch profiler")
            try:
                m["gemm_ms"], m["gemm_kernels"] = gemm_alone_ms(kernel_times(arm.make_call(inp)), arm.gemm_kernel)
            except Exception as exc:
                _record_error(m, "gemm_error", exc)


def _record_error(m: dict, key: str, exc: Exception) -> None:
    """An arm's failure into its row, then a synchronize (itself allowed to fail) so the next arm starts clean."""
    m[key] = f"{type(exc).__name__}: {exc}"
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _fmt_clocks(snap: Optional[dict]) -> str:
    if not snap:
        return "-"
    if snap.get("source") is None:
        return "unavailable (" + "; ".join(snap.get("errors", [])) + ")"
    sm = snap.get("sm_clock_mhz", snap.get("clocks.sm"))
    mem = snap.get("mem_clock_mhz", snap.get("clocks.mem"))
    reasons = ",".join(snap.get("throttle_reasons", ["?"]))
    return f"SM {sm} MHz, memory {mem} MHz, throttle reasons: {reasons} ({snap['source']})"


def print_table(rows: Sequence[dict], stream: Optional[TextIO] = None) -> None:
    stream = stream or sys.stdout
    # GEMMs ms: the arm's GEMM kernels alone per call (gemm_ms; arms that name their GEMM kernels)
    # host ms: host wall time of one eager call with the GPU busy; lone ms: one synchronized eager call, event-timed
    print(f"{'T':>6} {'arm':<28} {'mode':<6} {'median ms':>10} {'GEMMs ms':>9} {'floor ms':>9} {'x floor':>8} "
          f"{'TFLOP/s':>8} {'relL2 %':>8} {'host ms':>8} {'lone ms':>8}  note", file=stream)
    last_T = None
    for m in rows:
        if last_T is not None and m["T"] != last_T:
            print("", file=stream)
        last_T = m["T"]
        note = m.get("error") or ""
        if m.get("precision_ran") and m["precision_ran"] not in m["arm"]:
            note = f"ran {m['precision_ran']} " + note
        if m.get("graph_error"):
            note += f" (no graph: {m['graph_error'][:60]})"
        if m.get("gemm_error"):
            note += f" (GEMMs alone: {m['gemm_error'][:60]})"
        if m.get("rel_l2_vs"):
            note = f"vs {m['rel_l2_vs']} " + note
        rel = m.get("rel_l2")
        print(f"{m['T']:>6} {m['arm']:<28} {m.get('mode', '-'):<6} {_fmt(m.get('median_ms'), '10.4f')} "
              f"{_fmt(m.get('gemm_ms'), '9.4f')} {_fmt(m.get('floor_ms'), '9.4f')} "
              f"{_fmt(m.get('time_over_floor'), '8.2f')} {_fmt(m.get('tflops'), '8.1f')} "
              f"{_fmt(None if rel is None else 100 * rel, '8.3f')} {_fmt(m.get('host_ms'), '8.3f')} "
              f"{_fmt(m.get('lone_ms'), '8.3f')}  {note.strip()}", file=stream)


def plot(record: dict, path: str, stream: Optional[TextIO] = None) -> bool:
    """Log-log time vs T per arm with the floors, and W4A8-over-W4A16 speedup; False without matplotlib."""
    stream = stream or sys.stdout
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)", file=stream)
        return False
    by_arm: dict = {}
    for m in record["results"]:
        if m.get("median_ms") is not None:
            by_arm.setdefault(m["arm"], []).append((m["T"], m["median_ms"], m.get("floor_ms"), m["rate"],
                                                    m.get("mode", "eager")))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name, pts in by_arm.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for rate, style in (("bf16", "k--"), ("fp8", "k:")):
        fl = sorted({(p[0], p[2]) for pts in by_arm.values() for p in pts if p[3] == rate and p[2]})
        if fl:
            ax.plot([f[0] for f in fl], [f[1] for f in fl], style, label=f"floor ({rate.upper()} rate)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("median time (ms)")
    s = record["shape"]
    ax.set_title(f"E={s['E']} H={s['H']} I={s['I']} top_k={s['top_k']} on {record['environment'].get('gpu', '?')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    a16 = {p[0]: p for p in by_arm.get("mxmoe-w4a16", [])}
    a8 = {p[0]: p for p in by_arm.get("mxmoe-w4a8", [])}
    common = sorted(set(a16) & set(a8))
    speedup = [a16[t][1] / a8[t][1] for t in common]
    ax2.plot(common, speedup, marker="o", label="t_w4a16 / t_w4a8")
    mixed = [(t, v) for t, v in zip(common, speedup) if a16[t][4] != a8[t][4]]
    if mixed:  # small T: W4A16 as graph replays, W4A8 eagerly (capture runs W4A16)
        ax2.plot([m[0] for m in mixed], [m[1] for m in mixed], "rx", markersize=10,
                 label="W4A16 graph replay vs W4A8 eager")
        ax2.legend(fontsize=8)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_xlabel("tokens T")
    ax2.set_ylabel("speedup of W4A8 over W4A16 (t_w4a16 / t_w4a8)")
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", file=stream)
    return True


def small_analog(shape: Shape) -> Shape:
    """A CPU-sized shape keeping what matters for correctness: K tails and top_k vs E."""
    E = min(shape.E, 8)
    k = min(shape.top_k, 4, E)
    H = 128 if shape.H % 128 == 0 else 96
    I = 128 if shape.I % 128 == 0 else 96
    return Shape(E, H, I, k)


def cpu_cases(shape: Shape, tokens: Sequence[int]) -> list[checks.Case]:
    """check-style cases at the small analog of ``shape``: uniform, hot and masked routing."""
    s = small_analog(shape)
    Ts = sorted({min(t, 64) for t in tokens})[:3]
    base = dict(E=s.E, H=s.H, I=s.I, top_k=s.top_k)
    cases = [checks.Case(f"bench_uniform_t{T}", "bench routing", T=T, **base) for T in Ts]
    cases.append(checks.Case("bench_hot", "hot experts", T=max(Ts), routing="hot", **base))
    cases.append(checks.Case("bench_masked", "masked routes", T=max(Ts), routing="masked", **base))
    return cases


def run_bench(cfg: BenchConfig, device: torch.device, stream: Optional[TextIO] = None) -> int:
    """``mxmoe bench``: timings on CUDA; on the CPU, numerical checks at a small shape instead."""
    stream = stream or sys.stdout
    if device.type != "cuda":
        s = small_analog(cfg.shape)
        print(f"No CUDA device: timings need a GPU, so nothing is timed. Running check-style numerical checks "
              f"at a small analog of {cfg.shape} (E={s.E},H={s.H},I={s.I},top_k={s.top_k}) on the CPU instead.",
              file=stream)
        return checks.run_checks(cpu_cases(cfg.shape, cfg.tokens), device, seed=cfg.seed, stream=stream)
    record = run_gpu_bench(cfg, device, stream)
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print(f"samples and environment written to {cfg.json_path}", file=stream)
    if cfg.plot_path:
        plot(record, cfg.plot_path, stream)
    return 0
