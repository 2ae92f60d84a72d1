"""How the bench times (interleaved CUDA-event samples, graph replays, per-kernel profiler times), its floors
(cuBLAS BF16 / FP8 and a device copy) and the environment record (GPU, clocks, versions)."""
from __future__ import annotations

import importlib
import importlib.util
import platform
import re
import shutil
import statistics
import subprocess
import time
from typing import Callable, Mapping, Optional, Sequence

import torch


from .problem import ROUNDS, SAMPLES


# --------------------------------------------------------------------------------------
# Timing method
# --------------------------------------------------------------------------------------

Sampler = Callable[[Callable[[], object], int], list]


HOST_CALLS = 12  # eager calls per host-time round: well under the launch queue's depth (no launch waits)
HOST_ROUNDS = 5


def host_ms(fn: Callable[[], object], calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> float:
    """Median host wall time of one eager call of ``fn`` (ms), with the GPU kept busy by a 25-50 ms sleep kernel so
    that no launch waits on the device: ``calls`` calls back to back per round, each timed with ``perf_counter``."""
    samples = []
    for _ in range(rounds):
        torch.cuda._sleep(50_000_000)  # 50 M cycles: 25-50 ms of GPU time at 1-2 GHz
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return 1e3 * statistics.median(samples)


def lone_ms(fn: Callable[[], object], n: int = 10) -> float:
    """Median event time of one call of ``fn`` issued after a synchronize (ms): the host's launch time shows."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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
    from .. import __version__

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
