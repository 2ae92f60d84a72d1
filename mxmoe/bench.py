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
import importlib
import importlib.util
import json
import math
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, TextIO

import torch

from . import check as checks, testing
from .workspace import Workspace
from .format import dequantize_mxfp4
from .moe import fused_moe
from .prepare import PreparedExperts
from .reference import FP8_MAX

# --------------------------------------------------------------------------------------
# Shapes and token lists
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    E: int
    H: int
    I: int
    top_k: int

    def flops(self, T: int) -> float:
        """FLOPs of the layer for ``T`` tokens: ``T*top_k*(2*H*2I + 2*I*H)``."""
        return float(T) * self.top_k * (2 * self.H * 2 * self.I + 2 * self.I * self.H)

    @property
    def expert_bytes(self) -> int:
        """MXFP4 bytes of one expert: packed E2M1 plus UE8M0 scales of w13 and w2."""
        weights = 3 * self.I * self.H  # 2I*H + H*I elements
        return weights // 2 + weights // 32

    def bytes(self, T: int, distinct_experts: int) -> float:
        """Bytes a perfect kernel moves: touched experts once + x in (BF16) + out (BF16) + routing."""
        return float(distinct_experts * self.expert_bytes + 2 * T * self.H * 2 + T * self.top_k * 8)

    def __str__(self) -> str:
        return f"E={self.E},H={self.H},I={self.I},top_k={self.top_k}"


PRESETS = {
    "ref": Shape(288, 4096, 1024, 8),
    "ktail": Shape(128, 2880, 2880, 4),
    "deepseek": Shape(256, 7168, 2048, 8),
}
DEFAULT_TOKENS = (1, 16, 64, 1024, 2048, 4096, 8192)
ROUNDS = 3
SAMPLES = 30
GRAPH_MAX_ROWS = 1024  # graph-replay timing when T * top_k <= this


def parse_shape(text: str) -> Shape:
    """``"E,H,I,top_k"`` -> :class:`Shape`; ``ValueError`` with the reason otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 4:
        raise ValueError(f"shape must be E,H,I,top_k (four integers), got {text!r}")
    try:
        E, H, I, k = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape must be E,H,I,top_k (four integers), got {text!r}") from None
    if min(E, H, I, k) < 1:
        raise ValueError(f"shape values must be positive, got {text!r}")
    if H % 32 or I % 32:
        raise ValueError(f"H and I must be multiples of 32 (the K32 block), got H={H}, I={I}")
    if k > E:
        raise ValueError(f"top_k ({k}) cannot exceed the number of experts ({E})")
    return Shape(E, H, I, k)


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``: positive integers, duplicates dropped, order kept."""
    out: list[int] = []
    for p in str(text).split(","):
        p = p.strip()
        if not p:
            continue
        try:
            t = int(p)
        except ValueError:
            raise ValueError(f"token counts must be positive integers, got {p!r}") from None
        if t < 1:
            raise ValueError(f"token counts must be positive integers, got {t}")
        if t not in out:
            out.append(t)
    if not out:
        raise ValueError("no token counts given")
    return tuple(out)


# --------------------------------------------------------------------------------------
# Timing method
# --------------------------------------------------------------------------------------

Sampler = Callable[[Callable[[], object], int], list]


def round_orders(names: Sequence[str], rounds: int = ROUNDS) -> list[list[str]]:
    """Arm order of each round: as given, reversed, as given, ..."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def interleaved_samples(arms: Mapping[str, Callable[[], object]], sampler: Sampler, *, rounds: int = ROUNDS,
                        samples: int = SAMPLES, progress: Optional[Callable[[int, str], None]] = None) -> dict:
    """Time ``arms`` interleaved: per round, each arm in that round's order takes ``samples``.

    ``sampler(fn, n)`` returns ``n`` times in ms of ``fn``. Returns name -> all samples
    (``rounds * samples``), in the order taken.
    """
    out: dict = {name: [] for name in arms}
    for r, order in enumerate(round_orders(list(arms), rounds)):
        for name in order:
            if progress:
                progress(r, name)
            times = list(sampler(arms[name], samples))
            if len(times) != samples:
                raise RuntimeError(f"sampler returned {len(times)} samples for {name}, expected {samples}")
            out[name].extend(float(t) for t in times)
    return out


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples)) if samples else float("nan")


def cuda_event_sampler(fn: Callable[[], object], n: int) -> list:
    """``n`` back-to-back calls of ``fn``, each between two CUDA events; times in ms."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Warm ``fn`` up on a side stream, then capture one call in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


# --------------------------------------------------------------------------------------
# Kernel times (torch profiler)
# --------------------------------------------------------------------------------------


def kernel_times(fn: Callable[[], object], calls: int = 5, device_type: str = "cuda") -> list:
    """Device time of each kernel one call of ``fn`` launches, in launch order: ``[(name, us)]``, each the median
    over ``calls`` calls recorded by the torch profiler (CUPTI), names as it demangles them.

    One call before them runs with the profiler warming up and is not recorded (a session can lose the kernels
    at its start); the recorded calls run back to back, as the timed ones do (with PDL a kernel's time includes
    its wait for the one before). ``device_type="cpu"`` lists the CPU ops of ``fn`` instead (what the tests can
    run). Once the profiler has run, CUPTI stays attached to the process and later launches get slower: time
    everything else first.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    on_cuda = device_type == "cuda"
    kind = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    events: list = []

    def keep(prof):
        events.extend((e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == kind)

    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU],
                 schedule=schedule(wait=0, warmup=1, active=calls, repeat=1), on_trace_ready=keep) as prof:
        for i in range(1 + calls):
            fn()
            if i in (0, calls):  # the warm-up call done before recording starts, the last one before it stops
                sync()
            prof.step()
    return position_medians(events, calls)


def position_medians(events: Sequence[tuple], calls: int) -> list:
    """``calls`` calls' kernels in launch order, ``[(name, us)]`` -> the median of each position over the calls.

    Raises if the calls did not launch the same kernel sequence (a lost or extra event would pair one call's
    kernel with another kernel of the next)."""
    if calls < 1 or len(events) % calls:
        raise RuntimeError(f"{len(events)} kernels recorded in {calls} calls: not the same number per call")
    n = len(events) // calls
    out = []
    for j in range(n):
        names = {events[i * n + j][0] for i in range(calls)}
        if len(names) != 1:
            raise RuntimeError(f"kernel {j} of a call differs between calls: {sorted(name[:60] for name in names)}")
        out.append((events[j][0], median([events[i * n + j][1] for i in range(calls)])))
    return out


# Humming's GEMM kernel: its template ``humming<MmaOpClass, Shape<...>, ...>`` at global scope (humming/kernel/
# humming.py renders it; one launch per GEMM), as demangled ("void humming<...>(...)") or mangled ("_Z7humming...":
# 7 is the length of the name, so no longer name starting with "humming" matches). Its process-input kernel
# (activation, FP8 quantization) is "process_input_kernel<...>"; the other kernels of its arms are torch's.
HUMMING_GEMM_KERNEL = re.compile(r"^(?:void\s+)?humming(?:<|\(|$)|^_Z7humming")


def gemm_alone_ms(times: Sequence[tuple], gemm_kernel: "re.Pattern") -> tuple[float, int]:
    """``(ms, n)``: the summed time of the ``n`` kernels of ``times`` (:func:`kernel_times`) whose name
    ``gemm_kernel`` matches, per call."""
    gemms = [us for name, us in times if gemm_kernel.match(name)]
    if not gemms:
        longest = sorted(times, key=lambda nt: -nt[1])[:4]  # where the GEMMs would be, named as the profiler does
        raise RuntimeError(f"no kernel matches {gemm_kernel.pattern!r} among {len(times)}; the longest: "
                           + ", ".join(f"{name[:80]} ({us:.0f} us)" for name, us in longest))
    return sum(gemms) / 1000.0, len(gemms)


# --------------------------------------------------------------------------------------
# Floors and environment
# --------------------------------------------------------------------------------------


def _time_median(fn: Callable[[], object], sampler: Sampler, samples: int, warmup: int = 3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = sampler(fn, samples)
    return median(times), times


def _bf16_matmul(n, sampler, samples):
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    return _time_median(lambda: torch.matmul(a, b, out=c), sampler, samples)


def _fp8_matmul(n, sampler, samples):
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS FP8 wants
    one = torch.ones((), device="cuda", dtype=torch.float32)
    return _time_median(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                        sampler, samples)


def _device_copy(nbytes, sampler, samples):
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.int32).random_()
    dst = torch.empty_like(src)
    return _time_median(lambda: dst.copy_(src), sampler, samples)


def measure_floors(sampler: Sampler = cuda_event_sampler, n: int = 8192, samples: int = 20,
                   copy_bytes: int = 2 << 30) -> dict:
    """Matrix rates (TFLOP/s: cuBLAS BF16, FP8 via ``torch._scaled_mm``) on random ``n^3`` products
    and device copy bandwidth (GB/s, bytes read + written) on the current CUDA device."""
    res: dict = {"matmul_n": n, "copy_bytes": copy_bytes}
    for name, run, work in (("bf16", _bf16_matmul, 2.0 * n ** 3), ("fp8", _fp8_matmul, 2.0 * n ** 3),
                            ("copy", _device_copy, 2.0 * copy_bytes)):
        key = "copy_gbps" if name == "copy" else f"{name}_tflops"
        try:
            t, times = run(copy_bytes if name == "copy" else n, sampler, samples)
            res[key] = work / t / (1e6 if name == "copy" else 1e9)
            res[f"{name}_samples_ms"] = times
        except Exception as exc:
            res[key], res[f"{name}_error"] = None, f"{type(exc).__name__}: {exc}"
        torch.cuda.empty_cache()
    return res


_THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def _nvml_snapshot(index: int) -> dict:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        snap = {"source": "pynvml"}
        for key, fn in (("sm_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                        ("mem_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                        ("max_sm_clock_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
                        ("max_mem_clock_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                        ("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
                        ("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))):
            try:
                snap[key] = fn()
            except Exception:
                pass
        reasons = None
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if hasattr(pynvml, name):
                try:
                    reasons = int(getattr(pynvml, name)(h))
                    break
                except Exception:
                    pass
        if reasons is not None:
            snap["throttle_reasons_mask"] = hex(reasons)
            snap["throttle_reasons"] = [n for bit, n in _THROTTLE_BITS.items() if reasons & bit] or ["none"]
        return snap
    finally:
        pynvml.nvmlShutdown()


_SMI_FIELDS = (
    "name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu,"
    "clocks_event_reasons.active",
    "name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu,"
    "clocks_throttle_reasons.active",
    "name,driver_version,clocks.sm,clocks.mem",
)


def _smi_snapshot(index: int) -> dict:
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise FileNotFoundError("nvidia-smi not found")
    last = ""
    for fields in _SMI_FIELDS:
        p = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", str(index)],
                           capture_output=True, text=True, timeout=20)
        if p.returncode == 0 and p.stdout.strip():
            values = [v.strip() for v in p.stdout.strip().splitlines()[0].split(",")]
            snap = {"source": "nvidia-smi", **dict(zip(fields.split(","), values))}
            for key in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
                if key in snap:
                    try:
                        mask = int(snap[key], 16)
                        snap["throttle_reasons"] = [n for bit, n in _THROTTLE_BITS.items() if mask & bit] or ["none"]
                    except ValueError:
                        pass
            return snap
        last = (p.stderr or p.stdout).strip()
    raise RuntimeError(f"nvidia-smi query failed: {last}")


def gpu_snapshot(index: int = 0) -> dict:
    """Clocks, power, temperature and throttle reasons of GPU ``index``; never raises."""
    errors = []
    if importlib.util.find_spec("pynvml") is not None:
        try:
            return _nvml_snapshot(index)
        except Exception as exc:
            errors.append(f"pynvml: {type(exc).__name__}: {exc}")
    try:
        return _smi_snapshot(index)
    except Exception as exc:
        errors.append(f"nvidia-smi: {type(exc).__name__}: {exc}")
    return {"source": None, "errors": errors}


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        try:
            return getattr(importlib.import_module(module), "__version__", "?")
        except Exception:
            return None


def collect_environment(device: torch.device) -> dict:
    """Software versions and the GPU: name, capability, SMs, memory, clocks."""
    from . import __version__

    env = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": _version("triton"),
        "mxmoe": __version__, "device": str(device),
        "peers": {name: _version(name) for name in ("flashinfer-python", "humming-kernels")},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1))
        env["clocks_start"] = gpu_snapshot(device.index or 0)
    return env


# --------------------------------------------------------------------------------------
# Arms
# --------------------------------------------------------------------------------------


@dataclass
class Inputs:
    T: int
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    distinct_experts: int


class Arm:
    """One implementation being timed. Subclasses set the class attributes and methods."""

    name = "arm"
    rate = "bf16"  # which matrix rate its floor uses: "bf16" or "fp8"
    graphable = True  # may be timed as CUDA-graph replays
    what = ""  # what the timing includes and leaves out
    gemm_kernel: Optional["re.Pattern"] = None  # matches its GEMM kernels' names: their time alone is reported
    # Set by the methods where they apply, read by the bench: ``note`` (prepare: the path the arm took) and
    # ``tiles`` (make_call: the tile configs it uses for that call).

    def unavailable(self) -> Optional[str]:
        """Why this arm cannot run here ("not installed: ..."), or None."""
        return None

    def prepare(self, experts: PreparedExperts, shape: Shape, max_tokens: int) -> None:
        """One-time setup for the shape (weight conversion etc.)."""

    def make_call(self, inp: Inputs) -> Callable[[], torch.Tensor]:
        """A zero-argument callable computing the layer for ``inp`` (output buffer owned by the arm)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what prepare() allocated."""


class MxmoeArm(Arm):
    def __init__(self, precision: str):
        self.precision = precision
        self.name = f"mxmoe-{precision}"
        self.rate = "fp8" if precision == "w4a8" else "bf16"
        self.graphable = precision == "w4a16"  # capture always runs W4A16 (SPEC §6)
        self.what = ("mxmoe.fused_moe, everything included (route pack, both GEMMs, activation, top-k sum)"
                     + ("; timed eagerly since graph capture runs W4A16" if precision == "w4a8" else ""))
        self.workspace = None

    def prepare(self, experts, shape, max_tokens):
        self.experts = experts
        self.workspace = Workspace(experts, max_tokens, shape.top_k, fp8=True)  # planned scratch, as a server would

    def make_call(self, inp):
        out = torch.empty_like(inp.x)
        kw = dict(precision=self.precision, out=out, workspace=self.workspace)
        x, experts, w, ids = inp.x, self.experts, inp.topk_weights, inp.topk_ids
        _, ran = fused_moe(x, experts, w, ids, return_precision=True, **kw)
        self.ran = ran
        return lambda: fused_moe(x, experts, w, ids, **kw)

    def release(self):
        self.workspace = None


def _group_by_expert(flat_ids: torch.Tensor, num_experts: int, align: int, capacity: int):
    """Sort routes by expert without a host sync: ``(order, dest_row, group_ends int32)``.

    Route ``order[j]`` goes to row ``dest_row[j]`` of a buffer of ``capacity`` rows in which
    expert e's group spans ``[ends[e-1], ends[e])``, its length padded to ``align``.
    """
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts  # index in sorted order of each expert's first route
    rank = torch.arange(flat_ids.numel(), device=flat_ids.device) - first_sorted[sorted_ids]
    dest = (ends - padded)[sorted_ids] + rank
    return order, dest, ends.to(torch.int32)


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    half = h.shape[-1] // 2
    g, u = h[:, :half].float(), h[:, half:].float()
    return torch.nn.functional.silu(g) * u


def _rowwise_fp8(a: torch.Tensor):
    scale = a.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (a.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _dequantized(experts: PreparedExperts, dtype=torch.bfloat16, chunk_elems: int = 1 << 26):
    """Experts' weights decoded exactly (SPEC §2) to ``dtype``: ``(w13 [E, 2I, H], w2 [E, H, I])``."""
    def decode(w, s):
        out = torch.empty(*w.shape[:-1], w.shape[-1] * 2, dtype=dtype, device=w.device)
        step = max(1, chunk_elems // max(out[0].numel(), 1))
        for e0 in range(0, w.shape[0], step):
            out[e0:e0 + step] = dequantize_mxfp4(w[e0:e0 + step], s[e0:e0 + step], dtype=torch.float32).to(dtype)
        return out

    w13, w2 = experts.source_order_weights()
    return decode(w13, experts.w13_scale), decode(w2, experts.w2_scale)


class TorchGroupedMMArm(Arm):
    name = "torch-grouped-mm-bf16"
    rate = "bf16"
    what = ("torch._grouped_mm on BF16 weights dequantized once beforehand (3.76x the MXFP4 bytes); included: "
            "argsort/gather of routes, both grouped GEMMs, SiLU-and-mul as separate torch ops, un-permute and "
            "top-k sum; excluded: the one-time dequantization")
    align = 1

    def unavailable(self):
        return None if hasattr(torch, "_grouped_mm") else f"not installed: torch {torch.__version__} has no _grouped_mm"

    def prepare(self, experts, shape, max_tokens):
        self.shape = shape
        self.w13, self.w2 = _dequantized(experts)

    def _layout(self, inp):
        R = inp.T * self.shape.top_k
        flat = inp.topk_ids.reshape(-1).long()
        capacity = R + self.shape.E * (self.align - 1)
        return R, flat, capacity

    def make_call(self, inp):
        s, (R, flat, capacity) = self.shape, self._layout(inp)
        x, w = inp.x, inp.topk_weights.reshape(-1, 1).float()
        xs = torch.zeros(capacity, s.H, dtype=torch.bfloat16, device=x.device)
        out = torch.empty_like(x)
        w13t, w2t = self.w13.transpose(1, 2), self.w2.transpose(1, 2)

        def call():
            order, dest, ends = _group_by_expert(flat, s.E, self.align, capacity)
            xs[dest] = x[order // s.top_k]
            h = torch._grouped_mm(xs, w13t, offs=ends)
            a = _silu_mul(h).to(torch.bfloat16)
            y = torch._grouped_mm(a, w2t, offs=ends)
            routed = torch.empty(R, s.H, dtype=torch.float32, device=x.device)
            routed[order] = y[dest].float() * w[order]
            torch.sum(routed.view(inp.T, s.top_k, s.H), dim=1, out=out)  # out is BF16; sum in FP32 first
            return out

        return call

    def release(self):
        self.w13 = self.w2 = None


class TorchScaledGroupedMMArm(TorchGroupedMMArm):
    name = "torch-scaled-grouped-mm-fp8"
    rate = "fp8"
    what = ("torch._scaled_grouped_mm on FP8 E4M3 weights re-quantized once per output channel from MXFP4 (lossy: "
            "K32 block scales cannot be kept; 2x the MXFP4 bytes) with row-wise FP8 activations; included: per-row "
            "FP8 quantization of x and of the intermediate, argsort/gather, both GEMMs, SiLU-and-mul, un-permute and "
            "top-k sum; excluded: the one-time weight conversion; groups padded to 16 rows")
    align = 16

    def unavailable(self):
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"not installed: torch {torch.__version__} has no _scaled_grouped_mm"
        return None

    def prepare(self, experts, shape, max_tokens):
        self.shape = shape

        def fp8(w):  # [E, N, K] -> e4m3 [E, N, K], scale fp32 [E, N]
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            sc = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                q[e], sc[e] = _rowwise_fp8(w[e])
            return q, sc

        w13, w2 = _dequantized(experts)
        self.w13, self.s13 = fp8(w13)
        del w13
        self.w2, self.s2 = fp8(w2)

    def make_call(self, inp):
        s, (R, flat, capacity) = self.shape, self._layout(inp)
        x, w = inp.x, inp.topk_weights.reshape(-1, 1).float()
        xs = torch.zeros(capacity, s.H, dtype=torch.float8_e4m3fn, device=x.device)
        xs_scale = torch.ones(capacity, dtype=torch.float32, device=x.device)
        out = torch.empty_like(x)
        w13t, w2t = self.w13.transpose(1, 2), self.w2.transpose(1, 2)

        def call():
            order, dest, ends = _group_by_expert(flat, s.E, self.align, capacity)
            xq, xsc = _rowwise_fp8(x)
            tok = order // s.top_k
            xs[dest] = xq[tok]
            xs_scale[dest] = xsc[tok]
            h = torch._scaled_grouped_mm(xs, w13t, xs_scale, self.s13, offs=ends, out_dtype=torch.bfloat16)
            aq, asc = _rowwise_fp8(_silu_mul(h))
            y = torch._scaled_grouped_mm(aq, w2t, asc, self.s2, offs=ends, out_dtype=torch.bfloat16)
            routed = torch.empty(R, s.H, dtype=torch.float32, device=x.device)
            routed[order] = y[dest].float() * w[order]
            torch.sum(routed.view(inp.T, s.top_k, s.H), dim=1, out=out)
            return out

        return call

    def release(self):
        self.w13 = self.w2 = self.s13 = self.s2 = None


class FlashInferArm(Arm):
    name = "flashinfer-cutlass-mxfp4"
    rate = "bf16"
    what = ("flashinfer.fused_moe.cutlass_fused_moe, MXFP4 weights with BF16 activations (use_w4_group_scaling, "
            "SM90 mixed-input layout via FlashInfer's interleave helpers), SwiGLU with alpha=1, beta=0 = SiLU-and-mul; "
            "everything included")

    def unavailable(self):
        if importlib.util.find_spec("flashinfer") is None:
            return "not installed: flashinfer (pip install flashinfer-python)"
        return None

    def prepare(self, experts, shape, max_tokens):
        from flashinfer import fused_moe as fi  # noqa: F401

        self.fi = fi
        self.shape = shape
        half = shape.I
        w13, w2 = experts.source_order_weights()
        w13 = torch.cat((w13[:, half:], w13[:, :half]), dim=1).contiguous()  # [up; gate] = "w3w1"
        s13 = torch.cat((experts.w13_scale[:, half:], experts.w13_scale[:, :half]), dim=1).contiguous()
        s2 = experts.w2_scale
        if hasattr(fi, "interleave_moe_weights_for_sm90_mixed_gemm"):
            w13 = fi.interleave_moe_weights_for_sm90_mixed_gemm(w13, "fp4")
            w2 = fi.interleave_moe_weights_for_sm90_mixed_gemm(w2.contiguous(), "fp4")
            s13 = fi.interleave_moe_scales_for_sm90_mixed_gemm(s13, group_size=32)
            s2 = fi.interleave_moe_scales_for_sm90_mixed_gemm(s2.contiguous(), group_size=32)
        self.w13, self.w2, self.s13, self.s2 = w13, w2, s13, s2
        dev = experts.device
        self.alpha = torch.ones(shape.E, dtype=torch.float32, device=dev)
        self.beta = torch.zeros(shape.E, dtype=torch.float32, device=dev)

    def make_call(self, inp):
        from flashinfer.fused_moe.core import ActivationType

        out = torch.empty_like(inp.x)
        ids = inp.topk_ids.to(torch.int32)
        kw = dict(input=inp.x, token_selected_experts=ids, token_final_scales=inp.topk_weights,
                  fc1_expert_weights=self.w13, fc2_expert_weights=self.w2, output_dtype=torch.bfloat16,
                  quant_scales=[self.s13.view(torch.int32), self.s2.view(torch.int32)],
                  swiglu_alpha=self.alpha, swiglu_beta=self.beta, swiglu_limit=None,
                  use_w4_group_scaling=True, activation_type=ActivationType.Swiglu, output=out)

        def call():
            self.fi.cutlass_fused_moe(**kw)
            return out

        return call

    def release(self):
        self.w13 = self.w2 = self.s13 = self.s2 = None


def _align_routes(flat_ids: torch.Tensor, num_experts: int, block: int):
    """vLLM-style route alignment without a host sync: ``(sorted_ids, expert_ids, num_padded)`` (int32).

    ``sorted_ids`` lists the route ids expert by expert, each expert's run padded to ``block`` with the sentinel
    ``R = flat_ids.numel()``, in room for the worst case (``R + E * (block - 1)`` rounded up to a block);
    ``expert_ids`` gives each ``block``-row block's expert; ``num_padded`` ([1]) is the padded length in use (the
    kernels skip the blocks past it).
    """
    capacity = -(-(flat_ids.numel() + num_experts * (block - 1)) // block) * block
    order, dest, ends = _group_by_expert(flat_ids, num_experts, block, capacity)
    sorted_ids = torch.full((capacity,), flat_ids.numel(), dtype=torch.int32, device=flat_ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block, dtype=torch.int32, device=flat_ids.device)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:]


def humming_mxfp4_tensors(experts: PreparedExperts) -> tuple:
    """The experts as Humming's ``mxfp4`` weight schema takes them, one ``(tensors, shape_n, shape_k)`` per GEMM:
    ``weight`` the E2M1 bytes (uint8 ``[E, N, K/2]``, low nibble first) and ``weight_scale`` the UE8M0 bytes
    (uint8 ``[E, N, K/32]``) as given; w13's rows ``[gate; up]`` (its ``binary_split`` activation reads the gate
    half first)."""
    w13, w2 = experts.source_order_weights()
    H, I = experts.hidden_size, experts.intermediate_size
    return (({"weight": w13.contiguous(), "weight_scale": experts.w13_scale.contiguous()}, 2 * I, H),
            ({"weight": w2.contiguous(), "weight_scale": experts.w2_scale.contiguous()}, H, I))


def _humming_path(layer) -> str:
    """What Humming made of a transformed layer: activation type and quantization, scale handling, weight layout."""
    cfg = getattr(layer, "humming_config", None)

    def value(name):
        v = getattr(cfg, name, "?")
        return getattr(v, "value", v)  # enums by their value

    return (f"{value('a_dtype')} activations (quantization {value('input_quant_mode')}), fused E8M0 scales "
            f"{value('use_fused_e8m0_scale')}, weight_scale_2 {value('weight_scale_2_type')}, packed-K layout "
            f"{value('use_packed_k_layout')}")


class HummingArm(Arm):
    name = "humming"
    rate = "bf16"
    what = ("Humming (humming-kernels) indexed MoE GEMMs on the MXFP4 weights (its mxfp4 schema: the E2M1 bytes and "
            "E8M0 scales as given, transformed once) with BF16 activations, one tuning config per GEMM from its "
            "heuristics for the call's routed rows; included: the route alignment to its M block (torch ops, no host "
            "sync), both GEMMs, SiLU-and-mul by its process-input kernel, the weighted top-k sum as one batched "
            "matmul (router weights in BF16); excluded: the one-time weight transform and kernel compilation")
    gemm_kernel = HUMMING_GEMM_KERNEL  # its GEMM kernels alone are reported next to the call (gemm_ms)
    input_config: Optional[dict] = None  # Humming's input schema; None: activations in the layer's dtype (BF16)

    def unavailable(self):
        if importlib.util.find_spec("humming") is None:
            return "not installed: humming (pip install humming-kernels)"
        return None

    def prepare(self, experts, shape, max_tokens):
        from humming.layer import HummingLayer

        self.shape = shape

        def layer(tensors, n, k):
            # a copy of input_config: HummingLayer fills the missing keys into the dict it is given
            lay = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "mxfp4"},
                               input_config=dict(self.input_config) if self.input_config else None,
                               num_experts=shape.E, torch_dtype=torch.bfloat16).to(experts.device)
            lay.load_from_tensors(tensors)
            lay.transform()
            return lay

        self.l13, self.l2 = (layer(*gemm) for gemm in humming_mxfp4_tensors(experts))
        self.note = "GEMM1: " + _humming_path(self.l13) + "; GEMM2: " + _humming_path(self.l2)

    def make_call(self, inp):
        from humming.layer import HummingMethod
        from humming.tune import get_heuristics_config

        s = self.shape
        flat = inp.topk_ids.reshape(-1).long()
        w = inp.topk_weights.view(inp.T, 1, s.top_k)
        out = torch.empty_like(inp.x)
        compute = {"gemm_type": "indexed"}
        # each GEMM's tile config from Humming's heuristics for the routed rows; its M block sets the route alignment
        t13, t2 = (get_heuristics_config(lay.humming_metas[""], shape_m=inp.T * s.top_k, gemm_type="indexed",
                                         device=inp.x.device) for lay in (self.l13, self.l2))
        self.tiles = {"gemm1": t13, "gemm2": t2}
        b13, b2 = t13["block_shape"][0], t2["block_shape"][0]
        keys = ("sorted_ids", "expert_ids", "num_tokens_padded")  # _align_routes's outputs as Humming's arguments

        def call():
            routes = {block: dict(zip(keys, _align_routes(flat, s.E, block))) for block in {b13, b2}}
            # [R, 2I]; with 8-bit activations Humming quantizes x per token first (its process-input kernel)
            h = self.l13(inp.x, **routes[b13], top_k=s.top_k, compute_config=compute, tuning_config=t13)
            # SiLU(gate) * up in FP32 from the two halves, one kernel (as vLLM's silu_and_mul); with 8-bit
            # activations the same kernel quantizes each routed row and returns its scale (else None)
            a, _, a_scale = HummingMethod.may_process_input(self.l2, h, activation_type="binary_split",
                                                            activation_impl="a / (1.0f + expf(-a)) * b")
            y = self.l2(a, input_scale=a_scale, **routes[b2], top_k=1, compute_config=compute,
                        tuning_config=t2)  # [R, H], route order
            torch.bmm(w.to(y.dtype), y.view(inp.T, s.top_k, s.H), out=out.view(inp.T, 1, s.H))
            return out

        return call

    def release(self):
        self.l13 = self.l2 = None


class HummingW4A8Arm(HummingArm):
    name = "humming-w4a8"
    rate = "fp8"
    what = ("Humming (humming-kernels) W4A8: the same MXFP4 bytes as the humming arm, transformed once for FP8 E4M3 "
            "activations (on SM90 its fused-E8M0 path: each K32 scale folded into the weights, converted to E4M3, "
            "with one factor per expert or channel in the epilogue); per call: x quantized per token to E4M3 "
            "(dynamic, FP32 scales) by its process-input kernel, the route alignment to each GEMM's M block (torch "
            "ops), its indexed GEMM1 with the heuristics' tile config, SiLU-and-mul and per-routed-row E4M3 "
            "quantization in one process-input kernel, its indexed GEMM2, the weighted top-k sum as one batched "
            "matmul; excluded: the one-time weight transform and kernel compilation")
    # the names are Humming's (humming/schema/humming.py, HummingInputSchema): dtype aliases a_dtype
    input_config = {"quant_method": "humming", "dtype": "float8e4m3", "input_quant_mode": "dynamic_token"}

    def unavailable(self):
        why = super().unavailable()
        if why:
            return why
        try:
            from humming.schema import BaseInputSchema, is_humming_schema_compatible
            from humming.schema.mxfp4 import Mxfp4WeightSchema

            weights = Mxfp4WeightSchema().to_humming_schema(torch.bfloat16)
            activations = BaseInputSchema.from_config(dict(self.input_config))
            supported = is_humming_schema_compatible(activations, weights, torch.bfloat16)
        except Exception as exc:
            return f"humming could not check its W4A8 path here: {type(exc).__name__}: {exc}"
        if not supported:
            major, minor = torch.cuda.get_device_capability()
            return (f"unsupported on this device: Humming has no E4M3-activation path for MXFP4 weights on "
                    f"SM{major}{minor}")
        return None


def all_arms() -> list[Arm]:
    return [MxmoeArm("w4a16"), MxmoeArm("w4a8"), TorchGroupedMMArm(), TorchScaledGroupedMMArm(), FlashInferArm(),
            HummingArm(), HummingW4A8Arm()]


ARM_NAMES = tuple(a.name for a in all_arms())


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


def make_inputs(shape: Shape, T: int, device: torch.device, seed: int) -> Inputs:
    """Fresh random activations and a uniform softmax-top-k routing for ``T`` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + T)
    x = torch.randn(T, shape.H, generator=gen, device=device).to(torch.bfloat16)
    w, ids, _, _ = testing.make_routing("uniform", T, shape.E, shape.top_k, seed=seed + T, device=device)
    return Inputs(T=T, x=x, topk_weights=w, topk_ids=ids, distinct_experts=int(torch.unique(ids).numel()))


def _floor_ms(shape: Shape, inp: Inputs, rate: str, floors: Optional[dict]) -> Optional[float]:
    if not floors:
        return None
    tflops = floors.get(f"{rate}_tflops") or floors.get("bf16_tflops")
    bw = floors.get("copy_gbps")
    if not tflops or not bw:
        return None
    return max(shape.flops(inp.T) / (tflops * 1e9), shape.bytes(inp.T, inp.distinct_experts) / (bw * 1e6))


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
    mem = experts.memory()
    record["experts_memory"] = mem
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
            arm.prepare(experts, shape, max(cfg.tokens))
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
    for name, info in record["arms"].items():
        print(f"  {name:<28} {info['status']}", file=stream)

    rows = []
    for ti, T in enumerate(cfg.tokens):
        inp = make_inputs(shape, T, device, cfg.seed)
        # keep: each arm's eager callable and graph. A graph holds raw pointers into the tensors the
        # callable's closure owns (inputs, output, scratch); dropping the closure would free them
        # while replays still read and write there.
        calls, meta, outputs, keep = {}, {}, {}, []
        for arm in arms:
            m = meta[arm.name] = {"T": T, "arm": arm.name, "rate": arm.rate, "distinct_experts": inp.distinct_experts}
            try:
                progress(f"T={T} ({ti + 1}/{len(cfg.tokens)}): warm-up {arm.name}")
                fn = arm.make_call(inp)
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
        samples = interleaved_samples(
            calls, cuda_event_sampler, rounds=cfg.rounds, samples=cfg.samples,
            progress=lambda r, name: progress(f"T={T} ({ti + 1}/{len(cfg.tokens)}): round {r + 1}/{cfg.rounds} {name}"))
        base_name = next((n for n in ("mxmoe-w4a16", "torch-grouped-mm-bf16") if outputs.get(n) is not None), None)
        for arm in arms:
            m = meta[arm.name]
            if arm.name in samples:
                t = median(samples[arm.name])
                m.update(samples_ms=samples[arm.name], median_ms=t, tflops=shape.flops(T) / (t * 1e9))
                fl = _floor_ms(shape, inp, arm.rate, floors)
                if fl:
                    m.update(floor_ms=fl, time_over_floor=t / fl)
                if base_name and arm.name != base_name and outputs.get(arm.name) is not None:
                    from .reference import relative_l2

                    m["rel_l2_vs"] = base_name
                    m["rel_l2"] = relative_l2(outputs[arm.name], outputs[base_name])
            rows.append(m)
            record["results"].append(m)
        record.setdefault("clocks_after_T", {})[str(T)] = gpu_snapshot(device.index or 0)
        del calls, outputs, keep
        torch.cuda.synchronize()
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
    print(f"{'T':>6} {'arm':<28} {'mode':<6} {'median ms':>10} {'GEMMs ms':>9} {'floor ms':>9} {'x floor':>8} "
          f"{'TFLOP/s':>8} {'relL2 %':>8}  note", file=stream)
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
              f"{_fmt(None if rel is None else 100 * rel, '8.3f')}  {note.strip()}", file=stream)


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
