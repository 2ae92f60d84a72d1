"""Tuned tables (``mxmoe._details.tuned``, ``mxmoe tune``): buckets, what a table may hold, which entry a call gets,
and on a GPU that a table changes speed only (the call's output bitwise the untuned one's)."""
from __future__ import annotations

import json

import pytest
import torch

from mxmoe._details import tuned
from mxmoe.tune import write_table

SHAPE = (32, 2880, 2880, 4)


def _table(entries, device="NVIDIA H100 80GB HBM3"):
    return dict(format=tuned.FORMAT, device=device, entries=entries)


def _entry(tokens, gemm1=None, gemm2=None, precision="w4a16", shape=SHAPE, **more):
    return dict(shape=list(shape), precision=precision, tokens=tokens, gemm1=gemm1 or {}, gemm2=gemm2 or {}, **more)


def test_a_call_falls_in_the_smallest_bucket_at_or_above_its_tokens():
    assert [tuned.bucket(t) for t in (1, 2, 3, 5, 64, 65, 1024, 1025, 8192, 50000)] == \
        [1, 2, 4, 8, 64, 128, 1024, 2048, 8192, 8192]


def test_a_table_may_set_speed_fields_only():
    ok = tuned.check_table(_table([_entry(64, dict(num_stages=5), dict(pair=True))]))
    assert ok == {("NVIDIA H100 80GB HBM3", SHAPE, "w4a16", 64): ({"num_stages": 5}, {"pair": True})}
    for fields in (dict(k_split=2), dict(promote=4), dict(kernel="gluon"), dict(block_k=128)):
        with pytest.raises(ValueError, match="may set only"):
            tuned.check_table(_table([_entry(64, fields)]))
    with pytest.raises(ValueError, match="both GEMMs"):
        tuned.check_table(_table([_entry(64, dict(block_rows=32))]))
    with pytest.raises(ValueError, match="not a bucket"):
        tuned.check_table(_table([_entry(63)]))
    with pytest.raises(ValueError, match="format"):
        tuned.check_table(dict(_table([]), format=0))
    with pytest.raises(ValueError, match="precision"):
        tuned.check_table(_table([_entry(64, precision="fp8")]))


def test_lookup_keys_on_device_shape_path_and_bucket(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_table([_entry(16, dict(num_stages=3)), _entry(64, dict(num_stages=5))])))
    b.write_text(json.dumps(_table([_entry(64, dict(num_stages=6))])))
    entries = tuned.load_tables([str(a), str(b)])  # the later file wins
    name = "NVIDIA H100 80GB HBM3"
    assert tuned.lookup(name, SHAPE, "w4a16", 9, entries) == ({"num_stages": 3}, {})
    assert tuned.lookup(name, SHAPE, "w4a16", 33, entries) == ({"num_stages": 6}, {})
    assert tuned.lookup(name, SHAPE, "w4a8", 64, entries) == ({}, {})
    assert tuned.lookup("NVIDIA H200", SHAPE, "w4a16", 64, entries) == ({}, {})
    assert tuned.lookup(name, (128, 2880, 2880, 4), "w4a16", 64, entries) == ({}, {})


def test_the_environment_names_an_extra_table(tmp_path, monkeypatch):
    extra = tmp_path / "mine.json"
    extra.write_text(json.dumps(_table([_entry(4, dict(num_stages=2))], device="Some GPU")))
    monkeypatch.setenv(tuned.ENV, str(extra))
    tuned.reload()
    try:
        assert tuned.lookup("Some GPU", SHAPE, "w4a16", 3) == ({"num_stages": 2}, {})
    finally:
        monkeypatch.delenv(tuned.ENV)
        tuned.reload()
    assert tuned.lookup("Some GPU", SHAPE, "w4a16", 3) == ({}, {})


def test_an_unreadable_table_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (str(bad), str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="cannot be read"):
            tuned.load_tables([path])


def test_the_shipped_tables_are_valid():
    files = tuned._table_files()
    tuned.load_tables(files)  # raises on anything a table may not hold
    for path in files:
        assert json.load(open(path))["entries"], f"{path}: an empty shipped table"


def test_write_table_merges_the_buckets_measured_now(tmp_path):
    path = str(tmp_path / "t.json")
    write_table(path, "GPU X", [_entry(16, dict(num_stages=3), kept=True, ms=1.0, default_ms=1.1),
                                _entry(64, kept=False, ms=1.0, default_ms=1.0)], "first")
    table = write_table(path, "GPU X", [_entry(16, kept=False), _entry(64, dict(num_stages=5), kept=True)], "second")
    assert [(e["tokens"], e["gemm1"]) for e in table["entries"]] == [(64, {"num_stages": 5})]  # 16 measured: no win
    assert table["command"] == "second" and table["device"] == "GPU X"
    with pytest.raises(ValueError, match="GPU X"):
        write_table(path, "GPU Y", [], "third")


@pytest.mark.gpu
def test_the_shipped_entries_of_this_gpu_change_speed_only():
    """Every shipped entry of this GPU: the call at its bucket bitwise the call with the tables off, and the entry's
    fields in the configs the call ran."""
    from mxmoe import prepare_weights, testing
    from mxmoe._details import launch
    from mxmoe._details.config import overrides
    from mxmoe.bench.problem import Shape, make_inputs
    from mxmoe.selection import plan_layer
    from mxmoe.workspace import Workspace

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    mine = [(key, fields) for key, fields in tuned.load_tables(tuned._table_files()).items() if key[0] == name]
    if not mine:
        pytest.skip(f"no shipped entries for {name}")
    experts = {}
    for (_, shape, precision, T), (g1, g2) in mine:
        if shape not in experts:
            experts.clear()
            experts[shape] = prepare_weights(**testing.random_code_sources(*shape[:3], seed=1, device=device))
        ex = experts[shape]
        inp = make_inputs(Shape(*shape), T, device, seed=2)
        plan = plan_layer(inp.topk_ids.numel(), precision=precision, activation="silu", capturing=False)
        ws = Workspace(ex, T, shape[3], fp8=True)
        outs = []
        for on in (True, False):
            out = torch.full_like(inp.x, float("nan"))
            with overrides(tuned=on):
                launch.run_fused_moe(inp.x, ex, inp.topk_weights, inp.topk_ids, plan, None, out, ws)
                cfg1, cfg2 = launch._configs(inp.x, ex, shape[3], T * shape[3], precision == "w4a8")
            if on:
                for cfg, fields in ((cfg1, g1), (cfg2, g2)):
                    assert all(getattr(cfg, f) == v for f, v in fields.items() if f != "block_rows"), (cfg, fields)
            outs.append(out)
        assert not outs[0].isnan().any()
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (shape, precision, T, g1, g2)
