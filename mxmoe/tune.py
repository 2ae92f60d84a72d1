"""``mxmoe tune``: measure tile-config candidates for a layer shape on this GPU and write a tuned table.

For each path and token bucket (``_details/tuned.TOKEN_BUCKETS``) the tuner times the call as the library runs it
without tables (the heuristics of ``_details/config``), then candidates that change only
``tuned.SPEED_FIELDS``: the route-tile height of both GEMMs (``_height_candidate``), then each GEMM's pipeline
stages, its K loop's form, its pairing of weight blocks and (up to ``DECODE_ROWS`` routed rows) a register cap, one
knob at a time, keeping a change when it is faster. A candidate whose output is not bitwise the default's is
rejected (and reported): a table changes speed, never results. The best is timed against the default once more,
interleaved; an entry is written only when it wins by more than ``MIN_GAIN``.

Timing: every bucket as CUDA-graph replays, so that the GPU's time is what is compared (a tuned config changes no
host work, and candidates run under ``config.overrides``, where launch plans do not apply: eager calls would add the
JIT's host time); CUDA events, the median of ``samples`` back-to-back replays after a warm-up. Inputs as the bench's:
random MXFP4 codes (scale bytes 118-122) and a uniform routing.

An entry is measured at one T, its bucket's top, and records the kind of config the heuristics picked there
(``tuned.kind``: kernel family, route tiles and K split per GEMM): calls of the bucket whose heuristics pick another
kind do not take it. Tables apply to the Gluon kernels only; a bucket the library runs on the plain-Triton kernels is
not tuned.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence, TextIO

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from . import testing
from ._details import launch, tuned
from ._details.config import DIRECT_MAX_TOKENS, overrides, pack_tile_heights
from .bench.problem import Shape, make_inputs
from .bench.timing import capture_graph, cuda_event_sampler, median
from .prepare import prepare_weights
from .selection import plan_layer
from .workspace import Workspace

MIN_GAIN = 0.02  # an entry needs this much over the default in the final interleaved A/B
W4A8_FROM = 1024  # W4A8 is prefill: its buckets from here by default


def default_tokens(precision: str) -> tuple:
    return tuple(t for t in tuned.TOKEN_BUCKETS if precision == "w4a16" or t >= W4A8_FROM)


class _Problem:
    """One shape's experts and, per T, inputs, a workspace and an output buffer."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0):
        self.shape, self.device, self.seed = shape, device, seed
        src = testing.random_code_sources(shape.E, shape.H, shape.I, seed=seed, device=device, scale_lo=118,
                                          scale_hi=122)
        self.experts = prepare_weights(**src)

    def call(self, T: int, precision: str):
        inp = make_inputs(self.shape, T, self.device, self.seed)
        ws = Workspace(self.experts, T, self.shape.top_k, fp8=precision == "w4a8")
        out = torch.empty_like(inp.x)
        plan = plan_layer(inp.topk_ids.numel(), precision=precision, activation="silu", capturing=False)

        def run():
            launch.run_fused_moe(inp.x, self.experts, inp.topk_weights, inp.topk_ids, plan, None, out, ws)
            return out

        return inp, run


DECODE_ROWS = 256  # routed rows up to which DECODE_STAGES are tried (decode streams weights: bytes in flight per SM)
DECODE_STAGES = (2, 3, 4, 5, 6, 8, 10, 12)
DECODE_REGS = (80, 96)  # register caps tried there: more programs per SM (bytes in flight, a shorter last wave)


def _candidates_for(cfg, gemm1: bool, fp8: bool, routes: int) -> list:
    """One-knob changes of one GEMM's config (validity is checked when it is built)."""
    out = []
    stages = DECODE_STAGES if routes <= DECODE_ROWS else (cfg.num_stages - 1, cfg.num_stages + 1)
    for n in stages:
        if n >= 2 and n != cfg.num_stages and cfg.kernel != "gluon_ws8":  # (ws8: its stages fill the shared memory)
            out.append(dict(num_stages=n))
    if cfg.kernel == "gluon_small" and not fp8 and not cfg.wide:
        out.append(dict(split_loop=not cfg.split_loop))
    if cfg.kernel == "gluon_small" and not gemm1 and not cfg.wide:
        out.append(dict(pair=not cfg.pair))
    if cfg.kernel == "gluon_small" and not cfg.wide and routes <= DECODE_ROWS and not cfg.maxnreg:
        out += [dict(maxnreg=r) for r in DECODE_REGS]
    return out


def _height_candidate(bt: int, cfg1, cfg2) -> tuple[dict, dict]:
    """Both GEMMs' fields for route tiles of ``bt`` rows: ``block_rows`` for each, except for a small-tile GEMM
    beside the W4A8 prefill kernel's tiles of more than 128 rows, which the launcher gives that pack in sub-tiles
    (``config.tiles_beside``)."""
    beside_ws8 = bt > 128 and "gluon_ws8" in (cfg1.kernel, cfg2.kernel)
    return tuple({} if beside_ws8 and cfg.kernel != "gluon_ws8" else dict(block_rows=bt) for cfg in (cfg1, cfg2))


class Tuner:
    def __init__(self, shape: Shape, device: torch.device, samples: int = 25, stream: Optional[TextIO] = None):
        self.problem = _Problem(shape, device)
        self.shape, self.samples = shape, samples
        self.stream = stream or sys.stdout
        self.rejected: list = []

    def _timer(self, run, g1: dict, g2: dict):
        """The call's output under the candidate and a zero-argument callable replaying it (a captured graph)."""
        with overrides(tuned=False, gemm1=g1, gemm2=g2):
            out = run().clone()
            return out, capture_graph(run).replay

    def _time(self, fn) -> float:
        for _ in range(3):
            fn()
        return median(cuda_event_sampler(fn, self.samples))

    def tune(self, T: int, precision: str) -> dict:
        began = time.perf_counter()
        shape = self.shape
        inp, run = self.problem.call(T, precision)
        routes = T * shape.top_k
        with overrides(tuned=False):
            cfg1, cfg2 = launch._configs(inp.x, self.problem.experts, shape.top_k, routes, precision == "w4a8")
        untuned = {g: dict(zip(tuned.KIND_FIELDS, tuned.kind(c))) for g, c in (("gemm1", cfg1), ("gemm2", cfg2))}
        if "gluon" not in cfg1.kernel or "gluon" not in cfg2.kernel:
            self._say(T, precision, "skipped", f"runs the plain-Triton kernels here ({cfg1.kernel}, {cfg2.kernel}): "
                      "tables apply to the Gluon kernels only")
            return None
        ref, fn = self._timer(run, {}, {})
        best = dict(gemm1={}, gemm2={}, ms=self._time(fn))
        default_ms, tried = best["ms"], 1

        def attempt(g1, g2):
            nonlocal best, tried
            try:
                out, fn = self._timer(run, g1, g2)
            except (ValueError, OutOfResources, CompilationError, PTXASError) as exc:  # not valid, or no compile
                return f"not run: {type(exc).__name__}: {str(exc)[:80]}"
            # (anything else, a CUDA fault say, ends the run: the GPU's state is no longer to be trusted)
            tried += 1
            if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
                self.rejected.append(dict(T=T, precision=precision, gemm1=g1, gemm2=g2))
                return "changes bits: rejected"
            ms = self._time(fn)
            if ms < best["ms"]:
                best = dict(gemm1=g1, gemm2=g2, ms=ms)
            return f"{ms:.4f} ms"

        direct = precision == "w4a16" and T <= DIRECT_MAX_TOKENS  # (no route pack: tile heights do not apply)
        if not direct:
            kinds = (tuned.kind(cfg1), tuned.kind(cfg2))
            for bt in pack_tile_heights(routes, shape.E):
                g1, g2 = _height_candidate(bt, cfg1, cfg2)
                if bt >= 16 and self._kinds(inp.x, routes, precision, g1, g2) != kinds:  # (the default's: timed)
                    self._say(T, precision, f"block_rows={bt}", attempt(g1, g2))
        with overrides(tuned=False, gemm1=best["gemm1"], gemm2=best["gemm2"]):
            cfg1, cfg2 = launch._configs(inp.x, self.problem.experts, shape.top_k, routes, precision == "w4a8")
        for gemm, cfg in (("gemm1", cfg1), ("gemm2", cfg2)):
            for change in _candidates_for(cfg, gemm == "gemm1", precision == "w4a8", routes):
                g = {"gemm1": dict(best["gemm1"]), "gemm2": dict(best["gemm2"])}
                g[gemm].update(change)
                self._say(T, precision, f"{gemm} {change}", attempt(g["gemm1"], g["gemm2"]))
        entry = dict(shape=[shape.E, shape.H, shape.I, shape.top_k], precision=precision, tokens=tuned.bucket(T),
                     gemm1=best["gemm1"], gemm2=best["gemm2"], default=untuned)
        if best["gemm1"] or best["gemm2"]:  # the winner against the default, interleaved
            _, fn_best = self._timer(run, best["gemm1"], best["gemm2"])
            _, fn_default = self._timer(run, {}, {})
            a, b = [], []
            for _ in range(3):
                a += cuda_event_sampler(fn_default, self.samples)
                b += cuda_event_sampler(fn_best, self.samples)
            default_ms, best["ms"] = median(a), median(b)
        entry.update(ms=round(best["ms"], 5), default_ms=round(default_ms, 5), candidates=tried,
                     seconds=round(time.perf_counter() - began, 1))
        won = best["ms"] < default_ms * (1 - MIN_GAIN)
        self._say(T, precision, "result", f"default {default_ms:.4f} ms, best {best['ms']:.4f} ms "
                  f"{best['gemm1'] or ''} {best['gemm2'] or ''} -> {'entry' if won else 'no entry'}")
        entry["kept"] = won
        return entry

    def _kinds(self, x, routes: int, precision: str, g1: dict, g2: dict):
        """Both GEMMs' kinds of config (``tuned.kind``) under the fields, None where they are no config."""
        try:
            with overrides(tuned=False, gemm1=g1, gemm2=g2):
                cfgs = launch._configs(x, self.problem.experts, self.shape.top_k, routes, precision == "w4a8")
        except ValueError:
            return None
        return tuple(tuned.kind(cfg) for cfg in cfgs)

    def _say(self, T, precision, what, result):
        print(f"  T={T:<6} {precision:<6} {what:<40} {result}", file=self.stream, flush=True)


def tune_shape(shape: Shape, tokens: dict, device: torch.device, samples: int = 25,
               stream: Optional[TextIO] = None, measured: Optional[Callable] = None) -> list:
    """Entries (kept and not) for ``shape``; ``tokens``: ``{precision: [T, ...]}``; ``measured(entries)`` after
    each bucket (the entries so far)."""
    tuner = Tuner(shape, device, samples, stream)
    entries = []
    for precision, ts in tokens.items():
        for T in ts:
            entry = tuner.tune(T, precision)
            if entry is not None:
                entries.append(entry)
                if measured is not None:
                    measured(entries)
    for r in tuner.rejected:
        print(f"  rejected (output not bitwise the default's): {r}", file=tuner.stream)
    return entries


def _existing_table(path: str, name: str) -> dict:
    """The table at ``path`` to merge into (a new one if there is none); ``ValueError`` when it cannot be: another
    GPU's, unreadable or invalid, or a place that cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or (os.path.exists(path)
                                                                        and not os.access(path, os.W_OK)):
        raise ValueError(f"{path}: cannot write there")
    if not os.path.exists(path):
        return dict(format=tuned.FORMAT, device=name, entries=[])
    try:
        with open(path) as f:
            table = json.load(f)
        tuned.check_table(table, where=path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be merged into: {exc}") from None
    if table.get("device") != name:
        raise ValueError(f"{path} holds {table.get('device')!r}'s entries, this is {name!r}")
    return table


def write_table(path: str, name: str, entries: Sequence[dict], command: str) -> dict:
    """Merge the kept entries of a tuning run on the GPU called ``name`` into the table at ``path`` (created if
    missing; the same GPU's): its buckets measured now replace the table's; ``command`` joins the commands of the runs
    merged into the table before (``; ``-separated, the latest last)."""
    table = _existing_table(path, name)
    key = lambda e: (tuple(e["shape"]), e["precision"], e["tokens"])  # noqa: E731
    fresh = {key(e): {k: v for k, v in e.items() if k != "kept"} for e in entries if e["kept"]}
    measured = {key(e) for e in entries}
    table["entries"] = sorted([e for e in table["entries"] if key(e) not in measured] + list(fresh.values()),
                              key=key)
    earlier = [c for c in table.get("command", "").split("; ") if c and c != command]  # (every run merged in)
    table.update(triton=triton.__version__, torch=torch.__version__,
                 measured=datetime.date.today().isoformat(), command="; ".join(earlier + [command]))
    tuned.check_table(table, where=path)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    return table


def run_tune(shape: Shape, device: torch.device, precisions: Sequence[str], tokens: Optional[Sequence[int]],
             out: str, samples: int = 25, stream: Optional[TextIO] = None) -> int:
    stream = stream or sys.stdout
    if device.type != "cuda":
        print("mxmoe tune measures kernels: it needs a CUDA GPU", file=stream)
        return 2
    try:
        _existing_table(out, tuned.device_name(device))  # (before an hour of tuning, not after)
    except ValueError as exc:
        print(f"mxmoe tune: {exc}", file=stream)
        return 2
    began = time.perf_counter()
    plan = {p: list(tokens) if tokens else list(default_tokens(p)) for p in precisions}
    print(f"tuning {shape} on {tuned.device_name(device)} (Triton {triton.__version__}): "
          + "; ".join(f"{p} T={','.join(map(str, ts))}" for p, ts in plan.items()), file=stream, flush=True)
    command = "mxmoe tune --shape {} --precision {} --tokens {}".format(
        f"{shape.E},{shape.H},{shape.I},{shape.top_k}", ",".join(precisions),
        ",".join(str(t) for t in sorted({t for ts in plan.values() for t in ts})))
    # the table is written after every bucket: a run stopped part way keeps the buckets it finished
    entries = tune_shape(shape, plan, device, samples, stream,
                         measured=lambda done: write_table(out, tuned.device_name(device), done, command))
    if not entries:
        print("nothing tuned: the Gluon kernels do not run these calls here (Triton, GPU or MXMOE_KERNEL)", file=stream)
        return 2
    kept = sum(e["kept"] for e in entries)
    print(f"{kept} of {len(entries)} buckets faster than the default by > {100 * MIN_GAIN:g} %: written to {out} "
          f"({time.perf_counter() - began:.0f} s)", file=stream)
    print(f"{'precision':<9} {'T':>6} {'default ms':>11} {'tuned ms':>9}  fields", file=stream)
    for e in entries:
        fields = f"{e['gemm1'] or ''} {e['gemm2'] or ''}" if e["kept"] else "(default)"
        print(f"{e['precision']:<9} {e['tokens']:>6} {e['default_ms']:>11.4f} {e['ms']:>9.4f}  {fields}", file=stream)
    return 0
