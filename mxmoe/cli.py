"""The ``mxmoe`` command: argument parsing and dispatch to :mod:`mxmoe.check` and :mod:`mxmoe.bench`.

``mxmoe check``   synthetic numerical checks of both paths (exit 1 on any failure)
``mxmoe bench``   timings of both paths and peers against measured floors (SPEC §8)
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from . import bench, check, fuzz
from .selection import PATHS


def _arg_type(fn, what: str):
    """Wrap a parser raising ValueError so argparse prints the reason."""
    def parse(text):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = what
    return parse


def _names(text: str) -> tuple:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError("expected a comma-separated list of names")
    return names


def _choices(allowed: Sequence[str], what: str):
    def parse(text):
        names = _names(text)
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise ValueError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return names

    return parse


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise ValueError(f"must be >= 1, got {v}")
    return v


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError(f"must be >= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxmoe",
        description="Fused MXFP4 (E2M1-K32) MoE kernels for NVIDIA Hopper: numerical checks and benchmarks.")
    sub = parser.add_subparsers(dest="command", metavar="{check,bench,tune}")

    c = sub.add_parser(
        "check", help="synthetic numerical checks of W4A16 and W4A8 against the PyTorch references",
        description="Run synthetic cases (partial tiles, hot/empty experts, masked int32/int64 ids, zero and "
                    "wide-span scale bytes, K tails, biases, each activation) through both paths and compare "
                    "with the references. Exit status 1 on any failure. Without CUDA the cases run at small "
                    "shapes on the CPU, where fused_moe is the PyTorch emulation unless TRITON_INTERPRET=1.")
    c.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda or cuda:N")
    c.add_argument("--small", action="store_true", help="CPU-sized shapes also on a GPU (always on the CPU)")
    c.add_argument("--cases", type=_arg_type(_names, "case list"), default=None, metavar="NAME,...",
                   help="run only these cases (see --list)")
    c.add_argument("--list", action="store_true", help="list the cases and exit")
    c.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    c.add_argument("--json", dest="json_path", metavar="PATH", help="write every metric to a JSON file")
    c.add_argument("--fuzz", type=_arg_type(_positive, "count"), metavar="N",
                   help="instead of the cases: N randomized cases (shapes, routings, scale bytes, ids, biases, "
                        "activations, graph replay, poisoned tokens) against the references with SPEC §5's bounds; "
                        "each failure prints a one-line reproduction; --json writes the counts and the worst error "
                        "per category")
    c.add_argument("--start", type=_arg_type(_non_negative, "index"), default=0, metavar="I",
                   help="with --fuzz: the first case's index (default 0); case I of a seed is the same in any run")
    c.add_argument("--precision", type=_arg_type(_choices(PATHS, "precision"), "precision list"),
                   default=PATHS, metavar="P,...", help="with --fuzz: w4a16, w4a8 or both (default)")

    b = sub.add_parser(
        "bench", help="time both paths and the peers against measured floors",
        description="Benchmark mxmoe W4A16 and W4A8 and the peers that are installed (torch grouped GEMMs, "
                    "FlashInfer, Humming) with CUDA events: warm-up, three interleaved rounds of 30 samples per "
                    "arm in alternating order, median of 90; CUDA-graph replays for small T. Floors (cuBLAS "
                    "BF16/FP8 8192^3, device copy) are measured in the same run. Without CUDA nothing is timed: "
                    "numerical checks run at a small analog of the shape on the CPU instead.")
    shape = b.add_mutually_exclusive_group()
    shape.add_argument("--shape", type=_arg_type(bench.parse_shape, "shape"), metavar="E,H,I,TOPK",
                       help="problem shape (default: the reference shape 288,4096,1024,8)")
    shape.add_argument("--preset", choices=sorted(bench.PRESETS), help=bench.PRESET_HELP)
    b.add_argument("--tokens", type=_arg_type(bench.parse_tokens, "token list"), default=bench.DEFAULT_TOKENS,
                   metavar="T,...", help="token counts (default %s)" % ",".join(map(str, bench.DEFAULT_TOKENS)))
    b.add_argument("--arms", type=_arg_type(_choices(bench.ARM_NAMES, "arm(s)"), "arm list"), default=None,
                   metavar="NAME,...", help="only these arms: " + ", ".join(bench.ARM_NAMES))
    b.add_argument("--rounds", type=_arg_type(_positive, "count"), default=bench.ROUNDS, help="interleaved rounds (3)")
    b.add_argument("--samples", type=_arg_type(_positive, "count"), default=bench.SAMPLES,
                   help="CUDA-event samples per arm per round (30)")
    b.add_argument("--warmup", type=_arg_type(_positive, "count"), default=5, help="warm-up calls per arm and T (5)")
    b.add_argument("--graph-max-rows", type=_arg_type(_non_negative, "count"), default=bench.GRAPH_MAX_ROWS,
                   help="time CUDA-graph replays when T*top_k <= this (default %d; 0 = never)" % bench.GRAPH_MAX_ROWS)
    b.add_argument("--no-floors", action="store_true", help="skip the floor measurements")
    b.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda or cuda:N")
    b.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    b.add_argument("--json", dest="json_path", metavar="PATH", help="write every sample and the environment")
    b.add_argument("--plot", dest="plot_path", metavar="PATH.png",
                   help="log-log time vs T per arm with the floor, and the W4A8-over-W4A16 speedup (matplotlib)")

    t = sub.add_parser(
        "tune", help="measure tile configs for a shape on this GPU and write a tuned table",
        description="Time the call as the library runs it and candidate tile configs that change speed only (route "
                    "tile height, pipeline stages, K loop form, weight-block pairing) per path and token bucket; "
                    "keep a candidate only if its output is bitwise the default's; write the buckets where one won "
                    "into a JSON table. Point MXMOE_TUNED_CONFIGS at it to use it (it wins over the shipped tables).")
    tshape = t.add_mutually_exclusive_group(required=True)
    tshape.add_argument("--shape", type=_arg_type(bench.parse_shape, "shape"), metavar="E,H,I,TOPK")
    tshape.add_argument("--preset", choices=sorted(bench.PRESETS), help=bench.PRESET_HELP)
    t.add_argument("--tokens", type=_arg_type(_buckets, "token buckets"), default=None, metavar="T,...",
                   help="token buckets to tune (default: every bucket for w4a16, from 1024 for w4a8)")
    t.add_argument("--precision", type=_arg_type(_choices(PATHS, "precision"), "precision list"),
                   default=PATHS, metavar="P,...", help="w4a16, w4a8 or both (default)")
    t.add_argument("--out", default="mxmoe-tuned.json", metavar="PATH",
                   help="the table to write (merged into it if it exists; default mxmoe-tuned.json)")
    t.add_argument("--samples", type=_arg_type(_positive, "count"), default=25, help="CUDA-event samples (25)")
    t.add_argument("--device", default="auto", help="auto, cuda or cuda:N")
    return parser


def _buckets(text: str) -> tuple:
    from ._details.tuned import TOKEN_BUCKETS

    tokens = bench.parse_tokens(text)
    wrong = [t for t in tokens if t not in TOKEN_BUCKETS]
    if wrong:
        raise ValueError(f"{', '.join(map(str, wrong))} not a token bucket; the buckets: "
                         f"{', '.join(map(str, TOKEN_BUCKETS))}")
    return tokens


def _cmd_tune(args, parser) -> int:
    from .tune import run_tune

    device = _device(args.device, parser)
    shape = args.shape or bench.PRESETS[args.preset]
    return run_tune(shape, device, args.precision, args.tokens, args.out, samples=args.samples)


def _cmd_check(args, parser) -> int:
    device = _device(args.device, parser)
    small = args.small or device.type != "cuda"
    if args.fuzz is not None:
        if args.cases or args.list:
            parser.error("--fuzz runs random cases: it takes neither --cases nor --list")
        return fuzz.run_fuzz(args.fuzz, device, seed=args.seed, start=args.start, precisions=args.precision,
                             small=small, json_path=args.json_path)
    if args.start or args.precision != PATHS:
        parser.error("--start and --precision go with --fuzz")
    cases = check.default_cases(small)
    if args.list:
        for case in cases:
            print(f"{case.name:<18} {case.what} (E,H,I,top_k={case.shape}, T={case.T})")
        return 0
    try:
        cases = check.select_cases(cases, args.cases)
    except ValueError as exc:
        parser.error(str(exc))
    if device.type != "cuda":
        print("No CUDA device: running the cases at small shapes on the CPU.")
    return check.run_checks(cases, device, seed=args.seed, json_path=args.json_path)


def _cmd_bench(args, parser) -> int:
    device = _device(args.device, parser)
    shape = args.shape or bench.PRESETS[args.preset or "ref"]
    cfg = bench.BenchConfig(shape=shape, tokens=tuple(args.tokens), arms=args.arms, rounds=args.rounds,
                            samples=args.samples, warmup=args.warmup, graph_max_rows=args.graph_max_rows,
                            floors=not args.no_floors, seed=args.seed, json_path=args.json_path,
                            plot_path=args.plot_path)
    return bench.run_bench(cfg, device)


def _device(name: str, parser):
    try:
        return check.resolve_device(name)
    except (ValueError, RuntimeError) as exc:
        parser.error(f"--device: {exc}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``mxmoe`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:  # a command is required: help, and the usage-error status
        parser.print_help(sys.stderr)
        return 2
    sub = parser._subparsers._group_actions[0].choices[args.command]  # for errors that name the subcommand
    try:
        if args.command == "check":
            return _cmd_check(args, sub)
        if args.command == "tune":
            return _cmd_tune(args, sub)
        return _cmd_bench(args, sub)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
