"""The ``mxmoe`` command on the CPU: check, bench's CPU fallback, the timing method, arguments."""
from __future__ import annotations

import json

import pytest
import torch

import mxmoe
from mxmoe import accuracy, bench, check, testing
from mxmoe.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("no_triton_interpret")


# ---------------------------------------------------------------- the commands on the CPU


def test_no_arguments_prints_help(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: mxmoe" in err and "check" in err and "bench" in err


@pytest.mark.parametrize("command", ["check", "bench"])
def test_an_unknown_device_names_the_accepted_ones(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--device", "tpu"])
    assert e.value.code == 2
    assert "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err


@pytest.mark.slow
def test_check_runs_every_case_on_cpu(capsys, tmp_path):
    path = tmp_path / "check.json"
    assert main(["check", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "No CUDA device" in out and "CPU" in out and "emulation" in out
    assert "0 failed on cpu" in out
    for case in check.default_cases(small=True):
        assert case.name in out
    assert "GEMM-level" in out and "a8 tok excess" in out and "gemm1~f64" in out
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and len(data["results"]) == len(check.default_cases(small=True))
    assert set(data["metrics"]) == set(accuracy.METRICS) and data["reference_shape"] == [288, 4096, 1024, 8]
    assert data["metrics"]["w4a8_vs_emulation"]["reference_shape_only"] is True
    r = data["results"][0]
    assert set(r["metrics"]) == set(accuracy.metric_names("layer")) and r["passed"]
    assert r["checks"]["a8:written"] and r["checks"]["a16:deterministic"] and r["checks"]["a8:zero_where_exact_zero"]
    assert r["tolerances"]["w4a8_vs_emulation"] is None and r["tolerances"]["w4a8_worst_token_excess"] == 0.015
    # the emulation against itself on the CPU: no excess
    assert r["metrics"]["w4a8_excess_over_emulation"] == 0.0 and r["metrics"]["w4a8_worst_token_excess"] == 0.0
    gemm = [r for r in data["results"] if r["case"]["kind"] == "gemm"]
    assert len(gemm) == 5 and all(set(g["metrics"]) == set(accuracy.metric_names("gemm")) for g in gemm)
    assert all(0 < g["metrics"]["w4a8_gemm1_vs_f64"] < 1e-6 and g["passed"] for g in gemm)


def test_check_list_and_unknown_case(capsys):
    assert main(["check", "--list"]) == 0
    assert "wide_scale_span" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["check", "--cases", "no_such_case"])
    assert e.value.code == 2
    assert "unknown case" in capsys.readouterr().err


def _w4a8_changed(monkeypatch, change):
    real = check.fused_moe

    def changed(*args, precision="auto", out=None, **kw):
        res = real(*args, precision=precision, out=out, **kw)
        y = res[0] if isinstance(res, tuple) else res
        if precision == "w4a8":
            change(y)
        return res

    monkeypatch.setattr(check, "fused_moe", changed)


def test_check_fails_on_a_wrong_w4a8_path(capsys, monkeypatch):
    # 5 % off everywhere: ~2 points above the emulation's ~4.5 % vs exact (2 % would add only ~0.4: errors add in
    # quadrature, and SPEC §5 bounds the excess, not the distance from the emulation, away from the reference shape)
    _w4a8_changed(monkeypatch, lambda y: y.mul_(1.05))
    assert main(["check", "--cases", "partial_tiles"]) == 1
    out = capsys.readouterr().out
    verdict = out.split("FAIL")[1].splitlines()[0]
    assert "a8 excess" in verdict and "a8 tok excess" in verdict and "a8~emu" not in verdict and "1 failed" in out


def test_check_fails_on_one_wrong_w4a8_token(capsys, monkeypatch):
    # one token of 40 10 % off: ~6.5 points above the emulation there, ~0.05 over the whole output
    _w4a8_changed(monkeypatch, lambda y: y[5].mul_(1.1))
    assert main(["check", "--cases", "hot_experts"]) == 1
    out = capsys.readouterr().out
    verdict = out.split("FAIL")[1].splitlines()[0]
    assert "a8 tok excess" in verdict and "1 failed" in out
    assert "a8 excess" not in verdict.replace("a8 tok excess", "")  # the whole output's excess stays in bounds


def test_check_fails_on_a_nonzero_row_whose_exact_reference_is_zero(capsys, monkeypatch):
    # masked_int32: tokens 0 and T // 2 have every route masked (their exact rows are zero)
    _w4a8_changed(monkeypatch, lambda y: y[0].fill_(1e-3))
    assert main(["check", "--cases", "masked_int32"]) == 1
    verdict = capsys.readouterr().out.split("FAIL")[1].splitlines()[0]
    assert "a8:zero_where_exact_zero" in verdict and "a8:masked_rows_zero" in verdict


def test_check_fails_when_out_is_not_written(capsys, monkeypatch):
    real = check.fused_moe

    def skips_row_zero(*args, out=None, **kw):
        res = real(*args, out=out, **kw)
        if out is not None:
            out[0] = float("nan")  # as if a kernel never wrote token 0
        return res

    monkeypatch.setattr(check, "fused_moe", skips_row_zero)
    assert main(["check", "--cases", "decode_t1"]) == 1
    out = capsys.readouterr().out
    assert "a16:written" in out and "a8:finite" in out


def test_check_reports_a_crashing_path_as_failure(capsys, monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(check, "fused_moe", broken)
    assert main(["check", "--cases", "top1"]) == 1
    assert "kernel exploded" in capsys.readouterr().out


def test_bench_without_cuda_runs_checks_and_says_timings_need_a_gpu(capsys):
    assert main(["bench", "--preset", "ktail", "--tokens", "1,16,4096"]) == 0
    out = capsys.readouterr().out
    assert "No CUDA device" in out and "timings need a GPU" in out and "on the CPU" in out
    assert "96" in out  # the small analog keeps ktail's K tail (2880 is not a multiple of 128)
    assert "0 failed on cpu" in out


# ---------------------------------------------------------------- timing method (fake timer)


def test_round_orders_alternate():
    assert bench.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert bench.round_orders(["a"], 2) == [["a"], ["a"]]


def test_interleaved_samples_with_fake_timer():
    calls, clock = [], iter(range(1, 10_000))

    def fake_sampler(fn, n):
        name = fn()
        calls.append((name, n))
        return [float(next(clock)) for _ in range(n)]

    arms = {name: (lambda name=name: name) for name in ("w4a16", "w4a8", "peer")}
    seen = []
    samples = bench.interleaved_samples(arms, fake_sampler, rounds=3, samples=30, progress=lambda r, n: seen.append((r, n)))
    assert [c[0] for c in calls] == ["w4a16", "w4a8", "peer", "peer", "w4a8", "w4a16", "w4a16", "w4a8", "peer"]
    assert all(n == 30 for _, n in calls)
    assert seen[0] == (0, "w4a16") and seen[3] == (1, "peer")
    assert {k: len(v) for k, v in samples.items()} == {"w4a16": 90, "w4a8": 90, "peer": 90}
    # w4a16 took the samples 1..30, 151..180 and 181..210: the median of the 90 is their middle
    assert samples["w4a16"][:3] == [1.0, 2.0, 3.0]
    assert bench.median(samples["w4a16"]) == pytest.approx((165 + 166) / 2)
    assert bench.median([3.0, 1.0, 2.0]) == 2.0


def test_interleaved_samples_rejects_a_short_sampler():
    with pytest.raises(RuntimeError, match="expected 30"):
        bench.interleaved_samples({"a": lambda: None}, lambda fn, n: [1.0] * (n - 1))


# ---------------------------------------------------------------- arguments


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_tune_arguments(capsys):
    a = parse("tune", "--preset", "gpt-oss-20b", "--tokens", "1,64", "--precision", "w4a16", "--out", "t.json")
    assert (a.preset, a.tokens, a.precision, a.out) == ("gpt-oss-20b", (1, 64), ("w4a16",), "t.json")
    assert parse("tune", "--shape", "32,2880,2880,4").tokens is None  # every bucket of each path
    with pytest.raises(SystemExit):
        parse("tune", "--preset", "ref", "--tokens", "3")
    assert "not a token bucket" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("tune")  # a shape is required
    assert main(["tune", "--preset", "ref", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_bench_defaults():
    a = parse("bench")
    assert a.shape is None and a.preset is None and a.tokens == (1, 16, 64, 1024, 2048, 4096, 8192)
    assert a.rounds == 3 and a.samples == 30 and a.graph_max_rows == 1024


def test_shape_preset_and_tokens():
    assert parse("bench", "--shape", "288,4096,1024,8").shape == bench.PRESETS["ref"]
    assert parse("bench", "--shape", " 128, 2880,2880 ,4").shape == bench.Shape(128, 2880, 2880, 4)
    assert parse("bench", "--preset", "deepseek").preset == "deepseek"
    assert bench.PRESETS["ktail"] == bench.PRESETS["gpt-oss-120b"] == bench.Shape(128, 2880, 2880, 4)
    assert bench.PRESETS["gpt-oss-20b"] == bench.Shape(32, 2880, 2880, 4)
    assert bench.PRESETS["deepseek"] == bench.Shape(256, 7168, 2048, 8)
    assert parse("bench", "--tokens", "4,4,1,8192").tokens == (4, 1, 8192)
    assert parse("bench", "--arms", "mxmoe-w4a16,mxmoe-w4a8").arms == ("mxmoe-w4a16", "mxmoe-w4a8")


@pytest.mark.parametrize("argv, message", [
    (["--shape", "1,2,3"], "four integers"),
    (["--shape", "8,100,64,2"], "multiples of 32"),
    (["--shape", "4,64,64,8"], "cannot exceed"),
    (["--shape", "0,64,64,1"], "positive"),
    (["--shape", "a,b,c,d"], "four integers"),
    (["--preset", "huge"], "invalid choice"),
    (["--preset", "ref", "--shape", "8,64,64,2"], "not allowed with"),
    (["--tokens", "1,x"], "positive integers"),
    (["--tokens", "0"], "positive integers"),
    (["--tokens", ","], "no token counts"),
    (["--arms", "mxmoe-w4a16,cutlass"], "unknown arm"),
    (["--rounds", "0"], "must be >= 1"),
])
def test_bad_bench_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse("bench", *argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_command_and_device(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["check", "--device", "cuda"])
        assert e.value.code == 2
        assert "no CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------- floors, helpers, output


def test_floor_arithmetic_matches_spec():
    ref = bench.PRESETS["ref"]
    assert ref.flops(1) / ref.top_k == pytest.approx(25.17e6, rel=1e-3)  # 25.2 MFLOP per routed row
    assert ref.flops(8192) == pytest.approx(1.65e12, rel=1e-2)
    assert ref.expert_bytes == 6_684_672  # 6.68 MB per expert
    assert 288 * ref.expert_bytes == pytest.approx(1.93e9, rel=1e-2)
    inp = bench.Inputs(T=1, x=None, topk_weights=None, topk_ids=None, distinct_experts=8)
    floors = {"bf16_tflops": 763.0, "fp8_tflops": 1350.0, "copy_gbps": 4300.0}
    # one token: bytes-bound, 8 experts' weights at 4.3 TB/s
    assert bench._floor_ms(ref, inp, "bf16", floors) == pytest.approx(ref.bytes(1, 8) / 4300e6)
    big = bench.Inputs(T=8192, x=None, topk_weights=None, topk_ids=None, distinct_experts=288)
    assert bench._floor_ms(ref, big, "fp8", floors) == pytest.approx(max(ref.flops(8192) / 1350e9, ref.bytes(8192, 288) / 4300e6))
    assert bench._floor_ms(ref, big, "fp8", None) is None


def test_group_by_expert_pads_groups():
    ids = torch.tensor([3, 0, 3, 1, 3, 0])
    order, dest, ends = bench.arms._group_by_expert(ids, 4, align=4, capacity=6 + 4 * 3)
    assert ends.tolist() == [4, 8, 8, 12]
    assert ids[order].tolist() == [0, 0, 1, 3, 3, 3]
    assert dest.tolist() == [0, 1, 4, 8, 9, 10]
    order1, dest1, ends1 = bench.arms._group_by_expert(ids, 4, align=1, capacity=6)
    assert dest1.tolist() == list(range(6)) and ends1.tolist() == [2, 3, 3, 6]


def test_align_routes_for_indexed_peers():
    ids = torch.tensor([3, 0, 3, 1, 3, 0])  # 6 routes, 4 experts, blocks of 2 rows
    sorted_ids, expert_ids, used = bench.arms._align_routes(ids, 4, 2)  # room for 6 + 4 * 1
    # expert 0: routes 1, 5; expert 1: route 3 + one pad; expert 2: nothing; expert 3: 0, 2, 4 + one pad
    assert sorted_ids.tolist() == [1, 5, 3, 6, 0, 2, 4, 6, 6, 6]
    assert used.tolist() == [8]
    assert expert_ids[:4].tolist() == [0, 1, 3, 3]  # the blocks in use; past them a valid id, never read
    assert sorted_ids.dtype == expert_ids.dtype == used.dtype == torch.int32


def test_torch_grouped_mm_peer_matches_reference_on_cpu():
    shape = bench.Shape(4, 64, 32, 2)
    experts, _ = testing.make_experts(shape.E, shape.H, shape.I, seed=3)
    inp = bench.make_inputs(shape, 9, torch.device("cpu"), seed=1)
    arm = bench.TorchGroupedMMArm()
    if arm.unavailable():
        pytest.skip(arm.unavailable())
    arm.prepare(experts, shape, 9)
    try:
        out = arm.make_call(inp)()
    except (RuntimeError, NotImplementedError) as exc:  # torch without a CPU _grouped_mm
        pytest.skip(f"torch._grouped_mm on the CPU: {exc}")
    ref = mxmoe.fused_moe_reference(inp.x, experts, inp.topk_weights, inp.topk_ids, mode="w4a16")
    assert mxmoe.relative_l2(out, ref) < 0.01


def test_routing_generators():
    w, ids, emap, masked = testing.make_routing("masked", 20, 8, 4, ids_dtype=torch.int64)
    assert ids.dtype == torch.int64 and bool((ids >= 2**32).any()) and bool((ids == -1).any())
    assert {0, 10} <= set(masked.tolist())
    w, ids, emap, masked = testing.make_routing("masked", 20, 8, 4, ids_dtype=torch.int32)
    assert ids.dtype == torch.int32 and int(ids.min()) == -(2**31) and int(ids.max()) == 2**31 - 1
    w, ids, emap, masked = testing.make_routing("expert_map", 16, 8, 2)
    assert emap.shape == (16,) and 0 in masked.tolist()
    assert bool((emap.long()[ids.long()[masked]] < 0).all())
    w, ids, _, _ = testing.make_routing("hot", 64, 8, 2)
    counts = torch.bincount(ids.long().flatten(), minlength=8)
    assert counts[:2].sum() > 0.9 * 64 * 2 * 0.9 and counts[4:].sum() == 0
    w, ids, _, _ = testing.make_routing("empty", 32, 8, 2)
    assert set(ids.flatten().tolist()) <= {5, 6, 7}
    w, ids, _, _ = testing.make_routing("uniform", 8, 8, 2)
    assert set(ids.flatten().tolist()) == set(range(8))  # every expert covered
    assert torch.allclose(w.sum(1), torch.ones(8)) and bool((ids.sort(1).values.diff(dim=1) != 0).all())


def test_same_problem_on_every_device():
    case = check.default_cases(small=True)[0]
    a, b = check.build_problem(case, "cpu", seed=5), check.build_problem(case, "cpu", seed=5)
    assert torch.equal(a.x, b.x) and torch.equal(a.experts.w13, b.experts.w13)


def test_output_helpers_without_gpu(capsys, tmp_path):
    rows = [
        dict(T=1, arm="mxmoe-w4a16", rate="bf16", mode="graph", median_ms=0.1, floor_ms=0.05, time_over_floor=2.0,
             tflops=1.0, precision_ran="w4a16"),
        dict(T=1, arm="mxmoe-w4a8", rate="fp8", mode="eager", median_ms=0.12, floor_ms=0.05, time_over_floor=2.4,
             tflops=0.8, precision_ran="w4a8", rel_l2_vs="mxmoe-w4a16", rel_l2=0.046),
        dict(T=1, arm="torch-grouped-mm-bf16", rate="bf16", error="RuntimeError: boom"),
    ]
    bench.print_table(rows, stream=None)
    out = capsys.readouterr().out
    assert "mxmoe-w4a8" in out and "4.600" in out and "RuntimeError: boom" in out
    record = {"results": rows, "shape": {"E": 8, "H": 64, "I": 64, "top_k": 2}, "environment": {"gpu": "fake"}}
    png = tmp_path / "bench.png"
    wrote = bench.plot(record, str(png))
    assert wrote == png.exists()
    snap = bench.gpu_snapshot(0)  # never raises, with or without a GPU
    assert "source" in snap


def test_progress_line_per_token_count_when_not_a_tty(capsys):
    import io

    buf = io.StringIO()
    p = bench.Progress(buf)
    p("T=1 (1/2): warm-up a")
    p("T=1 (1/2): round 1/3 a")
    p("T=16 (2/2): round 1/3 a")
    p.done()
    assert buf.getvalue().splitlines() == ["T=1 (1/2): warm-up a", "T=16 (2/2): round 1/3 a"]
