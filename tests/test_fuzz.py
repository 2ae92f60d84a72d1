"""``mxmoe check --fuzz``: what it draws, that it finds what it must, and a few cases through the kernels."""
from __future__ import annotations

import json
import math
import os
from collections import Counter

import pytest
import torch

from mxmoe import fuzz, testing
from mxmoe.cli import main


def test_a_case_is_the_same_in_every_run_and_seeds_differ():
    assert fuzz.draw_case(3, 17, False) == fuzz.draw_case(3, 17, False)
    assert fuzz.draw_case(3, 17, False) != fuzz.draw_case(4, 17, False)
    assert fuzz.draw_case(3, 17, False).index == 17


def test_full_size_draws_cover_every_category_within_the_budgets():
    cases = [fuzz.draw_case(0, i, False) for i in range(3000)]
    seen = Counter()
    for c in cases:
        assert 1 <= c.E <= 300 and 1 <= c.top_k <= 10 and 1 <= c.T <= 16384 + 4096
        assert c.H % 32 == 0 and c.I % 32 == 0 and 32 <= min(c.H, c.I) and max(c.H, c.I) <= 7168
        assert c.E * 3 * c.H * c.I <= fuzz.WEIGHT_BUDGET
        if c.T * c.top_k <= fuzz.BIG_ROWS:
            assert c.T * c.top_k * 3 * c.H * c.I <= fuzz.MAC_BUDGET
        for axis, values in fuzz.categories(c).items():
            for v in values if isinstance(values, list) else [values]:
                seen[axis, v] += 1
    for routing in fuzz.ROUTINGS:
        assert seen["routing", routing]
    for scales in fuzz.SCALES:
        assert seen["scales", scales]
    for key in [("ids_dtype", "int32"), ("ids_dtype", "int64"), ("activation", "silu"), ("activation", "swigluoai"),
                ("expert_map", "yes"), ("biases", "yes"), ("K tail", "32"), ("K tail", "64"), ("K tail", "none"),
                ("T", "T <= 16"), ("T", "T > 1024"), ("T", "rows > 2^17"), ("extras", "graph"), ("extras", "poison"),
                ("extras", "gemm-level"), ("extras", "duplicates"), ("extras", "masked tokens"),
                ("extras", "workspace")]:
        assert seen[key] >= 10, key
    assert min(c.E for c in cases) == 1 and max(c.E for c in cases) >= 250
    assert max(max(c.H, c.I) for c in cases) >= 4096
    assert {c.poison for c in cases} == {"", "x", "weight"}
    assert any(c.scales == "offset" and abs(c.shift13) > 80 and abs(c.shift2) > 80 for c in cases)


def test_routing_draws_every_masked_kind():
    base = dict(mask_fraction=0.4, masked_tokens=3, duplicates=True)
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    w, ids, emap, masked = testing.compose_routing(6, 400, 4, g(), **base, ids_dtype="int64", dropped=3)
    assert ids.dtype == torch.int64 and emap.numel() == 9 and int((emap < 0).sum()) == 3
    valid = (ids >= 0) & (ids < 9)
    mapped = torch.where(valid, emap.long()[ids.clamp(0, 8)], torch.full_like(ids, -1))
    assert torch.equal(masked, mapped < 0)  # every masked route is masked by one of the rules, and only those
    assert ((ids >= 1 << 32) & ((ids & 0xFFFFFFFF) < 9)).any()  # >= 2^32 with valid low bits
    assert ((ids >= 0) & (ids < 9) & masked).any()  # dropped globals
    assert int(masked.all(1).sum()) >= 3
    assert torch.isnan(w[masked]).any() and torch.isinf(w[masked]).any() and torch.isfinite(w[~masked]).all()
    w, ids, emap, masked = testing.compose_routing(6, 400, 4, g(), **base, ids_dtype="int32")
    assert emap is None and set(ids[masked].tolist()) >= {-1, -(2**31), 2**31 - 1}
    rows = [set(r) for r in ids.tolist()]
    assert any(len(r) < 4 for r, m in zip(rows, masked.tolist()) if not any(m))  # duplicates within a token
    one = testing.compose_routing(6, 400, 4, g(), routing="one_expert")[1]
    assert one.unique().numel() == 1


def _break(monkeypatch, change):
    real = fuzz.fused_moe

    def broken(x, *args, precision="auto", out=None, **kw):
        res = real(x, *args, precision=precision, out=out, **kw)
        change(x, precision, res[0])
        return res

    monkeypatch.setattr(fuzz, "fused_moe", broken)


@pytest.mark.usefixtures("no_triton_interpret")
def test_a_wrong_path_fails_with_a_reproduction(capsys, monkeypatch, tmp_path):
    _break(monkeypatch, lambda x, p, y: y.mul_(1.05) if p == "w4a8" else None)
    path = tmp_path / "fuzz.json"
    assert main(["check", "--fuzz", "6", "--seed", "5", "--start", "10", "--device", "cpu", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL case 10 w4a8" in out and "w4a16" not in out.split("FAIL")[1].splitlines()[0]
    assert "reproduce: mxmoe check --fuzz 1 --start 10 --seed 5 --device cpu --precision w4a8" in out
    report = json.loads(path.read_text())
    assert report["summary"]["w4a16"]["failed"] == 0 and report["summary"]["w4a16"]["cases"] == 6
    assert report["summary"]["w4a8"]["failed"] >= 1 and report["failures"][0]["index"] == 10
    assert "categories" in report["summary"]["w4a8"] and report["bounds"]["w4a8_worst_token_excess"]["bound"] == 0.015


@pytest.mark.usefixtures("no_triton_interpret")
def test_a_poisoned_token_that_leaks_fails(capsys, monkeypatch):
    """A path that lets one token's NaN into every row fails the cases that poison a token, and only those."""
    def leak(x, precision, y):
        if not torch.isfinite(x).all():
            y.fill_(math.nan)

    _break(monkeypatch, leak)
    poisoned = [i for i in range(200) if fuzz.draw_case(0, i, True).poison == "x"][:2]
    for i in poisoned:
        assert main(["check", "--fuzz", "1", "--start", str(i), "--precision", "w4a16", "--device", "cpu"]) == 1
        assert "w4a16:poison_x_isolated" in capsys.readouterr().out
    clean = next(i for i in range(200) if not fuzz.draw_case(0, i, True).poison)
    assert main(["check", "--fuzz", "1", "--start", str(clean), "--device", "cpu"]) == 0


def test_fuzz_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--start", "3"])
    assert "--start and --precision go with --fuzz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["check", "--fuzz", "2", "--precision", "fp4"])
    assert "unknown precision fp4" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels in Triton's interpreter")
@pytest.mark.slow
def test_fuzz_cases_through_the_interpreted_kernels(capsys):
    """A few small cases through the Triton kernels (their plain forms), both precisions, each a different mix."""
    assert main(["check", "--fuzz", "3", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "3 cases (6 case-precisions), 0 failed" in out and "Triton's interpreter" in out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="reads the kernels' intermediate")
def test_token_excess_explanation_checks_the_kernels_own_intermediate():
    """explain_token_excess accepts the kernels' own output (codes within a half step plus 4x SPEC's GEMM error of
    the exact activation, GEMM2 of those codes matching), and refuses a token that GEMM2 got wrong."""
    case = fuzz.FuzzCase(seed=0, index=0, E=4, H=64, I=64, top_k=2, T=6, biases=True, activation="swigluoai")
    inp = fuzz.build(case, torch.device("cpu"))
    out = fuzz._call(inp, case, "w4a8", None)[2]
    good = fuzz.explain_token_excess(inp, case, out, range(case.T))
    assert good["ok"] and good["code_dev"] <= 1.0 and good["gemm2_token"] < 5e-3
    bad = out.clone()
    bad[2] *= 1.02
    # the rerun no longer matches the output it is asked to explain
    assert not fuzz.explain_token_excess(inp, case, bad, [2])["ok"]


def test_sharded_fuzz_summaries_merge_into_one():
    """scripts/validate_triton.py runs the fuzz in shards: their summaries merged are the summary of all the cases."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "validate_triton.py")
    spec = importlib.util.spec_from_file_location("validate_triton", path)
    validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(validate)
    device = torch.device("cpu")
    results = [r for i in range(6) for r in fuzz.run_one(fuzz.draw_case(7, i, True), device, ("w4a16", "w4a8"))]
    whole = fuzz.summarize(results)
    halves = [fuzz.summarize(results[:5]), fuzz.summarize(results[5:])]
    assert validate.merge_fuzz(halves) == whole
