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


SMALL = dict(kernel="gluon_small", block_rows=16, sub_tiles=1, k_split=1, k_parts=1)
KIND = (("gluon_small", 16, 1, 1, 1), ("gluon_small", 16, 1, 1, 1))


def _entry(tokens, gemm1=None, gemm2=None, precision="w4a16", shape=SHAPE, default=None, **more):
    return dict(shape=list(shape), precision=precision, tokens=tokens, gemm1=gemm1 or {}, gemm2=gemm2 or {},
                default=default or dict(gemm1=SMALL, gemm2=SMALL), **more)


def _fields(entry):
    return None if entry is None else (entry.gemm1, entry.gemm2)


def test_a_call_falls_in_the_smallest_bucket_at_or_above_its_tokens():
    assert [tuned.bucket(t) for t in (1, 2, 3, 5, 64, 65, 1024, 1025, 8192, 50000)] == \
        [1, 2, 4, 8, 64, 128, 1024, 2048, 8192, 8192]


def test_a_table_may_set_speed_fields_only():
    ok = tuned.check_table(_table([_entry(64, dict(num_stages=5), dict(pair=True))]))
    assert ok == {("NVIDIA H100 80GB HBM3", SHAPE, "w4a16", 64): tuned.Entry({"num_stages": 5}, {"pair": True}, KIND)}
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
    with pytest.raises(ValueError, match="default"):
        tuned.check_table(_table([_entry(64, default=dict(gemm1=SMALL))]))
    # W4A16 at up to DIRECT_MAX_TOKENS runs without a route pack: a tile height there would turn that path off
    with pytest.raises(ValueError, match="without a route pack"):
        tuned.check_table(_table([_entry(4, dict(block_rows=16), dict(block_rows=16))]))
    tuned.check_table(_table([_entry(4, dict(block_rows=16), dict(block_rows=16), precision="w4a8"),
                              _entry(8, dict(block_rows=16), dict(block_rows=16))]))


def test_lookup_keys_on_device_shape_path_and_bucket(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_table([_entry(16, dict(num_stages=3)), _entry(64, dict(num_stages=5))])))
    b.write_text(json.dumps(_table([_entry(64, dict(num_stages=6))])))
    entries = tuned.load_tables([str(a), str(b)])  # the later file wins
    name = "NVIDIA H100 80GB HBM3"
    assert _fields(tuned.lookup(name, SHAPE, "w4a16", 9, entries)) == ({"num_stages": 3}, {})
    assert _fields(tuned.lookup(name, SHAPE, "w4a16", 33, entries)) == ({"num_stages": 6}, {})
    assert tuned.lookup(name, SHAPE, "w4a8", 64, entries) is None
    assert tuned.lookup("NVIDIA H200", SHAPE, "w4a16", 64, entries) is None
    assert tuned.lookup(name, (128, 2880, 2880, 4), "w4a16", 64, entries) is None


def test_the_environment_names_an_extra_table(tmp_path, monkeypatch):
    extra = tmp_path / "mine.json"
    extra.write_text(json.dumps(_table([_entry(4, dict(num_stages=2))], device="Some GPU")))
    monkeypatch.setenv(tuned.ENV, str(extra))
    tuned.reload()
    try:
        assert _fields(tuned.lookup("Some GPU", SHAPE, "w4a16", 3)) == ({"num_stages": 2}, {})
    finally:
        monkeypatch.delenv(tuned.ENV)
        tuned.reload()
    assert tuned.lookup("Some GPU", SHAPE, "w4a16", 3) is None


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
    assert table["command"] == "first; second" and table["device"] == "GPU X"  # (the runs merged into it)
    assert write_table(path, "GPU X", [], "first")["command"] == "second; first"
    with pytest.raises(ValueError, match="GPU X"):
        write_table(path, "GPU Y", [], "third")
    with pytest.raises(ValueError, match="cannot write"):
        write_table(str(tmp_path / "no" / "such" / "t.json"), "GPU X", [], "fourth")
    (tmp_path / "old.json").write_text(json.dumps(dict(_table([]), format=1)))
    with pytest.raises(ValueError, match="cannot be merged"):
        write_table(str(tmp_path / "old.json"), "NVIDIA H100 80GB HBM3", [], "fifth")


def test_an_entry_applies_only_where_the_heuristics_pick_the_kind_it_was_measured_on():
    """An entry measured at its bucket's top on 32-row tiles of the small kernel does not reach a call of the same
    bucket whose heuristics pick 16-row tiles (its fields were not measured there)."""
    from types import SimpleNamespace as C

    def cfg(kernel="gluon_small", block_rows=32, k_split=1):
        return C(kernel=kernel, block_rows=block_rows, sub_tiles=1, k_split=k_split, k_parts=1)

    entry = tuned.Entry({"num_stages": 5}, {}, (tuned.kind(cfg()), tuned.kind(cfg())))
    assert entry.fits(cfg(), cfg())
    assert not entry.fits(cfg(block_rows=16), cfg(block_rows=16)) and not entry.fits(cfg(), cfg(block_rows=16))
    assert not entry.fits(cfg(kernel="gluon_ws8"), cfg())
    assert not entry.fits(cfg(k_split=2), cfg())  # (the K split: another form of the kernel)


def test_configs_take_a_fitting_entry_and_fall_back_to_the_heuristics_otherwise(monkeypatch):
    """``launch._configs`` (the CPU picks no Gluon kernel, so the kernel choice is stubbed to the small one): a
    fitting entry's fields arrive in the configs; an entry of another kind, or one whose fields this call cannot
    take, leaves the heuristics' configs."""
    from types import SimpleNamespace

    from mxmoe._details import launch

    E, H, I, top_k, T = SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[3], 64
    x = SimpleNamespace(device=SimpleNamespace(type="cuda"), data_ptr=lambda: 0, stride=lambda d: H, shape=(T, H))
    experts = SimpleNamespace(num_experts=E, hidden_size=H, intermediate_size=I)
    monkeypatch.setattr(launch, "kernel_choice", lambda *a, **k: "gluon_small")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    with overrides_off():
        base1, base2 = launch._configs(x, experts, top_k, T * top_k, False)
    kinds = (tuned.kind(base1), tuned.kind(base2))
    stages = base1.num_stages + 1
    for entry, expected in ((tuned.Entry({"num_stages": stages}, {}, kinds), stages),
                            (tuned.Entry({"num_stages": stages}, {}, (("gluon_small", 999, 1, 1, 1), kinds[1])),
                             base1.num_stages),
                            # (GEMM1 takes no pair: a ValueError, the heuristics' configs)
                            (tuned.Entry({"num_stages": stages, "pair": True}, {}, kinds), base1.num_stages)):
        monkeypatch.setattr(tuned, "lookup", lambda *a, _e=entry, **k: _e)
        cfg1, cfg2 = launch._configs(x, experts, top_k, T * top_k, False)
        assert cfg1.num_stages == expected and cfg2 == base2


def test_an_entry_on_the_heuristics_256_row_tiles_keeps_them(monkeypatch):
    """W4A8 at the reference shape's T=8192, where the heuristics put GEMM1 on 256-row tiles (the kernel choice
    stubbed): an entry measured there with other fields keeps those tiles; one that sets the tiles has its own."""
    from types import SimpleNamespace

    from mxmoe._details import launch

    E, H, I, top_k, T = 288, 4096, 1024, 8, 8192
    x = SimpleNamespace(device=SimpleNamespace(type="cuda"), data_ptr=lambda: 0, stride=lambda d: H, shape=(T, H))
    experts = SimpleNamespace(num_experts=E, hidden_size=H, intermediate_size=I)
    monkeypatch.setattr(launch, "kernel_choice", lambda *a, k=0, **kw: "gluon_ws8" if k == H else "gluon_small")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    with overrides_off():
        base1, base2 = launch._configs(x, experts, top_k, T * top_k, True)
    assert (base1.block_rows, base2.block_rows, base2.sub_tiles) == (256, 128, 2)
    kinds = (tuned.kind(base1), tuned.kind(base2))
    for fields, rows in (({"num_stages": 3}, 256), ({"block_rows": 128}, 128)):
        monkeypatch.setattr(tuned, "lookup", lambda *a, _e=tuned.Entry(fields, {}, kinds), **k: _e)
        cfg1, cfg2 = launch._configs(x, experts, top_k, T * top_k, True)
        assert cfg1.block_rows == rows and cfg2.block_rows * cfg2.sub_tiles == rows
        assert cfg1.num_stages == fields.get("num_stages", cfg1.num_stages)


def test_the_tuners_height_candidates_beside_the_prefill_kernel(monkeypatch):
    """W4A8 at T=8192 (the kernel choice stubbed, as the CPU picks no Gluon kernel): on the reference shape GEMM1 runs
    the prefill kernel and GEMM2 the small-tile one, whose 256-row candidate is GEMM1's tiles only (the launcher gives
    GEMM2 the pack's 128-row halves; the height on both GEMMs is no config); where both GEMMs run the prefill kernel
    (gpt-oss-20b) both take it. At both, 256-row tiles are the heuristics' own kind, 128-row ones another."""
    from types import SimpleNamespace

    from mxmoe._details import launch, tuned
    from mxmoe._details.config import overrides, pack_shape
    from mxmoe.tune import _height_candidate

    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    for (E, H, I, top_k, T), gemm2_kernel in (((288, 4096, 1024, 8, 8192), "gluon_small"),
                                              ((32, 2880, 2880, 4, 8192), "gluon_ws8")):
        x = SimpleNamespace(device=SimpleNamespace(type="cuda"), data_ptr=lambda: 0, stride=lambda d: H, shape=(T, H))
        experts = SimpleNamespace(num_experts=E, hidden_size=H, intermediate_size=I)
        monkeypatch.setattr(launch, "kernel_choice",
                            lambda *a, k=0, _H=H, _g2=gemm2_kernel, **kw: "gluon_ws8" if k == _H else _g2)
        with overrides_off():
            base = launch._configs(x, experts, top_k, T * top_k, True)
        assert (base[0].kernel, base[1].kernel) == ("gluon_ws8", gemm2_kernel)
        kinds = {}
        for bt in (128, 256):
            g1, g2 = _height_candidate(bt, *base)
            with overrides(tuned=False, gemm1=g1, gemm2=g2):
                cfg1, cfg2 = launch._configs(x, experts, top_k, T * top_k, True)
            assert pack_shape(cfg1) == pack_shape(cfg2) == (bt, 0)
            kinds[bt] = (tuned.kind(cfg1), tuned.kind(cfg2))
        assert (cfg1.block_rows, cfg1.block_m) == (256, 128)
        assert (cfg2.block_rows, cfg2.sub_tiles) == ((128, 2) if gemm2_kernel == "gluon_small" else (256, 1))
        assert kinds[256] == (tuned.kind(base[0]), tuned.kind(base[1])) != kinds[128]
        if gemm2_kernel == "gluon_small":
            with overrides(tuned=False, gemm1=dict(block_rows=256), gemm2=dict(block_rows=256)), \
                    pytest.raises(ValueError):
                launch._configs(x, experts, top_k, T * top_k, True)


def overrides_off():
    from mxmoe._details.config import overrides

    return overrides(tuned=False)


def test_the_shipped_w4a16_entries_fit_the_heuristics_of_a_132_sm_card():
    """An entry applies only where the heuristics pick the kind of config it was measured on, so one they no longer
    pick (a heuristic changed after the tuning) is dead: retune or delete it. W4A16 on the small-tile kernel, whose
    kind depends on the shape, the rows and the SM count only (H100 SXM and H200: 132)."""
    from mxmoe._details.config import gemm_config

    checked = 0
    for (name, shape, precision, top), entry in tuned.load_tables(tuned._table_files()).items():
        if precision != "w4a16" or {k[0] for k in entry.default} != {"gluon_small"}:
            continue
        E, H, I, top_k = shape
        kinds = tuple(tuned.kind(gemm_config(top * top_k, E, n, k, False, {}, "gluon_small", gemm1=gemm1, sm_count=132))
                      for gemm1, n, k in ((True, I, H), (False, H, I)))
        assert kinds == entry.default, (name, shape, top, kinds, entry.default)
        checked += 1
    assert checked


@pytest.mark.gpu
def test_the_shipped_entries_of_this_gpu_change_speed_only():
    """Every shipped entry of this GPU: the calls at its bucket's top and lowest T bitwise the calls with the tables
    off, and at the top (where it was measured) the entry's fields in the configs the call ran."""
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
    for (_, shape, precision, top), entry in mine:
        g1, g2 = entry.gemm1, entry.gemm2
        if shape not in experts:
            experts.clear()
            experts[shape] = prepare_weights(**testing.random_code_sources(*shape[:3], seed=1, device=device))
        ex = experts[shape]
        lowest = tuned.TOKEN_BUCKETS[tuned.TOKEN_BUCKETS.index(top) - 1] + 1 if top > 1 else 1
        for T in sorted({top, lowest}):  # (the bucket's top, where it was measured, and its lowest T)
            inp = make_inputs(Shape(*shape), T, device, seed=2)
            plan = plan_layer(inp.topk_ids.numel(), precision=precision, activation="silu", capturing=False)
            ws = Workspace(ex, T, shape[3], fp8=True)
            outs = []
            for on in (True, False):
                out = torch.full_like(inp.x, float("nan"))
                with overrides(tuned=on):
                    launch.run_fused_moe(inp.x, ex, inp.topk_weights, inp.topk_ids, plan, None, out, ws)
                    cfg1, cfg2 = launch._configs(inp.x, ex, shape[3], T * shape[3], precision == "w4a8")
                if on and T == top:
                    for cfg, fields in ((cfg1, g1), (cfg2, g2)):
                        assert all(getattr(cfg, f) == v for f, v in fields.items() if f != "block_rows"), (cfg, fields)
                outs.append(out)
            assert not outs[0].isnan().any()
            assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (shape, precision, T, g1, g2)


def test_a_tuning_run_stopped_part_way_keeps_the_buckets_it_finished(tmp_path, monkeypatch):
    """``mxmoe tune`` writes its table after every bucket: an interrupted hour of tuning keeps what it measured."""
    from mxmoe import tune
    from mxmoe.bench.problem import Shape

    class Tuner:  # (the GPU's measurements stubbed: bucket 16 wins, 64 does not, the run stops at 256)
        def __init__(self, *a, **k):
            self.rejected = []

        def tune(self, T, precision):
            if T == 256:
                raise KeyboardInterrupt
            return _entry(T, dict(num_stages=3), kept=T == 16, ms=1.0, default_ms=1.1)

    monkeypatch.setattr(tune, "Tuner", Tuner)
    monkeypatch.setattr(tuned, "device_name", lambda device: "GPU X")
    path = str(tmp_path / "t.json")
    with pytest.raises(KeyboardInterrupt):
        tune.run_tune(Shape(*SHAPE), torch.device("cuda"), ["w4a16"], [16, 64, 256], path)
    table = json.load(open(path))
    assert [(e["tokens"], e["gemm1"]) for e in table["entries"]] == [(16, {"num_stages": 3})]
    assert table["device"] == "GPU X" and "--tokens 16,64,256" in table["command"]
