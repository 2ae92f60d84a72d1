"""Tensor and expert parallelism (mxmoe.distributed) on CPU with gloo, 2 and 4 processes.

One ``torch.multiprocessing.spawn`` per world size (module-scoped fixture) runs every
scenario and saves what each rank saw; the tests below assert on those results. The
single-process reference is ``mxmoe.fused_moe`` on the full weights (on CPU: the
PyTorch emulation of the chosen path).
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import traceback

import pytest
import torch

pytestmark = pytest.mark.slow  # (a process group per world size: ~20 s)

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import mxmoe  # noqa: E402
from mxmoe.distributed import ExpertParallelMoE, TensorParallelMoE, ep_expert_map, tp_shard_weights  # noqa: E402

E, H, I = 8, 64, 128  # I/world is a multiple of 32 for world 2 and 4
TOP_K = 2
TP_TOL = 1e-2  # BF16 partials summed in FP32 vs one fused BF16 result
TP_TOL_W4A8 = 4e-2  # plus per-(row, I-slice) FP8 scales of the intermediate (FP8 noise is ~3.5% vs exact)


# ----------------------------------------------------------------------------- data


def make_weights(seed=0, e=E, h=H, i=I, biases=True, global_scales=False, layout="gate_up"):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w2 = torch.randn(e, h, i, generator=g) * 0.1
    w13[:, :, :32] *= 8.0  # scale spread between K32 blocks
    p13, s13 = mxmoe.quantize_mxfp4(w13)
    p2, s2 = mxmoe.quantize_mxfp4(w2)
    kw = dict(w13=p13, w13_scale=s13, w2=p2, w2_scale=s2)
    if biases:
        kw["b13"] = torch.randn(e, 2 * i, generator=g) * 0.1
        kw["b2"] = torch.randn(e, h, generator=g) * 0.1
    if global_scales:
        kw["w13_global_scale"] = torch.rand(e, generator=g) + 0.5
        kw["w2_global_scale"] = torch.rand(e, generator=g) + 0.5
    if layout != "gate_up":  # re-order gate_up rows into the requested source layout
        def to_layout(t):
            gate, up = t[:, :i], t[:, i:]
            if layout == "up_gate":
                return torch.cat((up, gate), 1).contiguous()
            return torch.stack((gate, up), 2).reshape(t.shape).contiguous()

        kw["w13"], kw["w13_scale"] = to_layout(kw["w13"]), to_layout(kw["w13_scale"])
        if "b13" in kw:
            kw["b13"] = to_layout(kw["b13"].unsqueeze(-1)).squeeze(-1)
    kw["w13_layout"] = layout
    return kw


def make_tokens(seed, t, e=E, top_k=TOP_K, ids_dtype=torch.int32, masked=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(t, e, generator=g).topk(top_k, dim=1).indices
    w = torch.softmax(torch.randn(t, top_k, generator=g), dim=1)
    if masked and t >= 3:
        ids[0, top_k - 1] = -1
        ids[2, 0] = e + 3  # out of range: masked
        if t >= 5:
            ids[4, :] = -1  # a token with every route masked
    return x, w.contiguous(), ids.to(ids_dtype).contiguous()


def tokens_for_all_ranks(seed, counts, **kw):
    """Every rank's tokens (same on every process), and their concatenation."""
    parts = [make_tokens(seed + 100 * r, t, **kw) for r, t in enumerate(counts)]
    cat = tuple(torch.cat([p[j] for p in parts]) for j in range(3))
    return parts, cat


# ----------------------------------------------------------------------------- worker


def _expect_error(fn):
    """Run a collective call that should fail; return the exception type name (None if it did not raise)."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e).__name__
    return None


def _scenarios(rank, world, res):
    full = make_weights(seed=1)
    single = mxmoe.prepare_weights(**full)
    fp = dict(w13_layout=full["w13_layout"], b13=full["b13"], b2=full["b2"])
    packed = (full["w13"], full["w13_scale"], full["w2"], full["w2_scale"])

    # ---------------- EP, route dispatch: bitwise the single-process result
    ep = ExpertParallelMoE(*packed, **fp)
    counts = [7, 5, 0, 3][:world] if world > 2 else [7, 5]
    for ids_dtype in (torch.int32, torch.int64):
        parts, (xa, wa, ia) = tokens_for_all_ranks(10, counts, ids_dtype=ids_dtype)
        x, w, ids = parts[rank]
        lo = sum(counts[:rank])
        for prec in ("w4a16", "w4a8"):
            got, ran = ep(x, w, ids, precision=prec, return_precision=True)
            ref_all = mxmoe.fused_moe(xa, single, wa, ia, precision=prec)[lo:lo + counts[rank]]
            ref_own = mxmoe.fused_moe(x, single, w, ids, precision=prec) if counts[rank] else ref_all
            key = f"ep_route_{prec}_{str(ids_dtype)[-5:]}"
            res[key] = dict(ran=ran, shape=tuple(got.shape), dtype=str(got.dtype),
                            equal_all=torch.equal(got, ref_all), equal_own=torch.equal(got, ref_own),
                            rel=mxmoe.relative_l2(got, ref_all) if got.numel() else 0.0)
    # out= and a second run (determinism)
    parts, (xa, wa, ia) = tokens_for_all_ranks(20, counts)
    x, w, ids = parts[rank]
    first = ep(x, w, ids, precision="w4a16")
    out = torch.full_like(x, 7.0)
    second = ep(x, w, ids, precision="w4a16", out=out)
    res["ep_route_repeat"] = dict(equal=torch.equal(first, second), is_out=second is out)

    # ---------------- EP, token dispatch: small error, deterministic
    ep_tok = ExpertParallelMoE(*packed, dispatch="token", **fp)
    for prec in ("w4a16", "w4a8"):
        # top_k = 4: a token's routes split over ranks in groups of several, so the BF16 partials differ
        parts, (xa, wa, ia) = tokens_for_all_ranks(30, counts, ids_dtype=torch.int64, top_k=4)
        x, w, ids = parts[rank]
        lo = sum(counts[:rank])
        got = ep_tok(x, w, ids, precision=prec)
        again = ep_tok(x, w, ids, precision=prec)
        ref = mxmoe.fused_moe(xa, single, wa, ia, precision=prec)[lo:lo + counts[rank]]
        route = ep(x, w, ids, precision=prec)
        res[f"ep_token_{prec}"] = dict(rel=mxmoe.relative_l2(got, ref) if got.numel() else 0.0,
                                      repeat=torch.equal(got, again), shape=tuple(got.shape),
                                      rel_route=mxmoe.relative_l2(got, route) if got.numel() else 0.0)

    # ---------------- EP, swigluoai + global scales, top_k = 3
    full_g = make_weights(seed=2, global_scales=True, layout="interleaved")
    single_g = mxmoe.prepare_weights(**full_g)
    ep_g = ExpertParallelMoE(full_g.pop("w13"), full_g.pop("w13_scale"), full_g.pop("w2"), full_g.pop("w2_scale"), **full_g)
    parts, (xa, wa, ia) = tokens_for_all_ranks(40, [6] * world, top_k=3)
    x, w, ids = parts[rank]
    got = ep_g(x, w, ids, activation="swigluoai", precision="w4a16")
    ref = mxmoe.fused_moe(xa, single_g, wa, ia, activation="swigluoai", precision="w4a16")[6 * rank:6 * rank + 6]
    res["ep_swigluoai"] = dict(equal=torch.equal(got, ref), rel=mxmoe.relative_l2(got, ref))

    # ---------------- EP, "auto" decided on the global row count
    # rank 0 has 7 tokens, every other rank 1: local rows 2*1 = 2 < threshold <= global rows
    auto_counts = [7] + [1] * (world - 1)
    threshold = 2 * sum(auto_counts)
    parts, (xa, wa, ia) = tokens_for_all_ranks(50, auto_counts)
    x, w, ids = parts[rank]
    os.environ["MXMOE_FP8_PREFILL_MIN_ROWS"] = str(threshold)
    try:
        got, ran = ep(x, w, ids, return_precision=True)
        local_choice = mxmoe.select_precision(x.shape[0] * TOP_K)
    finally:
        del os.environ["MXMOE_FP8_PREFILL_MIN_ROWS"]
    lo = sum(auto_counts[:rank])
    ref = mxmoe.fused_moe(xa, single, wa, ia, precision="w4a8")[lo:lo + auto_counts[rank]]
    res["ep_auto"] = dict(ran=ran, local_choice=local_choice, equal=torch.equal(got, ref))

    # ---------------- TP: every layout, biases, global scales, expert_map pass-through
    for layout in ("gate_up", "up_gate", "interleaved"):
        full_l = make_weights(seed=3, layout=layout, global_scales=(layout == "up_gate"))
        single_l = mxmoe.prepare_weights(**full_l)
        shard_args = {k: v for k, v in full_l.items() if k not in ("w13", "w13_scale", "w2", "w2_scale")}
        tp = TensorParallelMoE(full_l["w13"], full_l["w13_scale"], full_l["w2"], full_l["w2_scale"], **shard_args)
        for ids_dtype in (torch.int32, torch.int64):
            x, w, ids = make_tokens(60, 7, ids_dtype=ids_dtype)  # same tokens on every rank
            emap = torch.arange(E, dtype=torch.int32)
            emap[3] = -1  # expert 3 masked through expert_map
            for prec in ("w4a16", "w4a8"):
                for act in ("silu", "swigluoai"):
                    kw = dict(precision=prec, activation=act, expert_map=emap if ids_dtype == torch.int64 else None)
                    got, ran = tp(x, w, ids, return_precision=True, **kw)
                    ref = mxmoe.fused_moe(x, single_l, w, ids, **kw)
                    exact = mxmoe.fused_moe_reference(x, single_l, w, ids, mode="exact", activation=act,
                                                      expert_map=kw["expert_map"])
                    res[f"tp_{layout}_{prec}_{act}_{str(ids_dtype)[-5:]}"] = dict(
                        ran=ran, rel=mxmoe.relative_l2(got, ref), rel_exact=mxmoe.relative_l2(got, exact),
                        rel_single_exact=mxmoe.relative_l2(ref, exact), out=got, repeat=torch.equal(got, tp(x, w, ids, **kw)))
    # the rank's slice, with b2 only on rank 0
    shard = tp_shard_weights(*packed, rank=rank, world_size=world, **fp)
    res["tp_shard"] = dict(b2=shard["b2"] is not None, w13=tuple(shard["w13"].shape), w2=tuple(shard["w2"].shape),
                           w2_scale=tuple(shard["w2_scale"].shape))
    # auto precision with a threshold: same decision as one GPU with these T * top_k rows
    x, w, ids = make_tokens(61, 7)
    os.environ["MXMOE_FP8_PREFILL_MIN_ROWS"] = str(7 * TOP_K)
    try:
        _, ran = tp(x, w, ids, return_precision=True)
    finally:
        del os.environ["MXMOE_FP8_PREFILL_MIN_ROWS"]
    res["tp_auto"] = ran
    # a sync-free TP forward (no input check) gives the same result
    tp_nocheck = TensorParallelMoE(*packed, check_inputs=False, **fp)
    tp_check = TensorParallelMoE(*packed, **fp)
    res["tp_nocheck_equal"] = torch.equal(tp_nocheck(x, w, ids), tp_check(x, w, ids))

    # ---------------- errors: every rank raises
    errors = {}
    bad_e = make_weights(seed=4, e=world * 2 + 1, biases=False)  # E not divisible by world
    errors["ep_bad_world"] = _expect_error(lambda: ExpertParallelMoE(bad_e["w13"], bad_e["w13_scale"], bad_e["w2"], bad_e["w2_scale"]))
    bad_i = make_weights(seed=4, i=32 * world // 2, biases=False)  # I/world = 16, not a multiple of 32
    errors["tp_bad_slice"] = _expect_error(lambda: TensorParallelMoE(bad_i["w13"], bad_i["w13_scale"], bad_i["w2"], bad_i["w2_scale"]))
    # ranks given different weights: caught by the construction exchange
    diff = make_weights(seed=5, e=E if rank == 0 else 2 * E, biases=False)
    errors["ep_weights_differ"] = _expect_error(lambda: ExpertParallelMoE(diff["w13"], diff["w13_scale"], diff["w2"], diff["w2_scale"]))
    errors["tp_weights_differ"] = _expect_error(lambda: TensorParallelMoE(diff["w13"], diff["w13_scale"], diff["w2"], diff["w2_scale"]))
    nan_scale = make_weights(seed=6, biases=False)
    if rank == world - 1:
        nan_scale["w2_scale"][0, 0, -1] = 255  # in this rank's I-slice; rejected by prepare_weights on this rank only
    errors["tp_prepare_fails_one_rank"] = _expect_error(
        lambda: TensorParallelMoE(nan_scale["w13"], nan_scale["w13_scale"], nan_scale["w2"], nan_scale["w2_scale"]))

    x, w, ids = make_tokens(70, 5)
    # EP: top_k differs across ranks
    x3, w3, ids3 = make_tokens(71, 5, top_k=3)
    errors["ep_topk_differs"] = _expect_error(lambda: ep(x, w, ids) if rank else ep(x3, w3, ids3))
    # EP: one rank's x has the wrong hidden size (its own local check fails)
    x_bad = torch.zeros(5, H // 2, dtype=torch.bfloat16)
    errors["ep_bad_x_one_rank"] = _expect_error(lambda: ep(x_bad if rank == 0 else x, w, ids))
    # EP: one rank passes float ids (TypeError there, ValueError elsewhere)
    errors["ep_bad_ids_dtype"] = _expect_error(lambda: ep(x, w, ids.float() if rank == 1 else ids))
    # EP: precision argument differs
    errors["ep_precision_differs"] = _expect_error(lambda: ep(x, w, ids, precision="w4a8" if rank == 1 else "w4a16"))
    # EP: caller passed an expert_map
    errors["ep_expert_map"] = _expect_error(lambda: ep(x, w, ids, expert_map=torch.arange(E, dtype=torch.int32)))
    # EP: malformed FP8 threshold on one rank
    def malformed_env():
        if rank == 0:
            os.environ["MXMOE_FP8_PREFILL_MIN_ROWS"] = "lots"
        try:
            ep(x, w, ids)
        finally:
            os.environ.pop("MXMOE_FP8_PREFILL_MIN_ROWS", None)
    errors["ep_bad_env_one_rank"] = _expect_error(malformed_env)
    # TP: T differs, precision differs, bad activation on one rank
    errors["tp_t_differs"] = _expect_error(lambda: tp_check(x[: 5 - rank % 2], w[: 5 - rank % 2], ids[: 5 - rank % 2]))
    errors["tp_precision_differs"] = _expect_error(lambda: tp_check(x, w, ids, precision="w4a8" if rank == 0 else "auto"))
    errors["tp_bad_activation_one_rank"] = _expect_error(lambda: tp_check(x, w, ids, activation="gelu" if rank == 1 else "silu"))
    res["errors"] = errors
    # the group is still usable after all of that, and gives the same answer as before
    parts, _ = tokens_for_all_ranks(20, counts)
    res["after_errors_equal"] = torch.equal(ep(*parts[rank], precision="w4a16"), first)

    # expert map helper
    res["ep_map"] = ep_expert_map(E, rank, world).tolist()


def _worker(rank, world, init_file, out_dir):
    # the PyTorch emulation, as the module docstring says (the parent's TRITON_INTERPRET=1 would run the kernels in the
    # interpreter here, 270 s for both worlds: the kernels are tested elsewhere, these tests are about the sharding)
    os.environ["TRITON_INTERPRET"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    res = {}
    try:
        _scenarios(rank, world, res)
    except BaseException:
        res["crash"] = traceback.format_exc()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _run(world, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"dist{world}")
    torch.multiprocessing.spawn(_worker, args=(world, str(d / "init"), str(d)), nprocs=world, join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory)


# ----------------------------------------------------------------------------- tests


def test_ep_route_is_bitwise_single_process(ranks):
    for r, res in enumerate(ranks):
        for key in [k for k in res if k.startswith("ep_route_w4")]:
            got = res[key]
            prec = key.split("_")[2]
            assert got["ran"] == prec, (r, key)
            assert got["dtype"] == "torch.bfloat16"
            assert got["equal_all"], (r, key, got["rel"])
        assert res["ep_route_repeat"] == dict(equal=True, is_out=True), r
        assert res["ep_swigluoai"]["equal"], (r, res["ep_swigluoai"])


def test_ep_token_dispatch_close_and_deterministic(ranks):
    for r, res in enumerate(ranks):
        for prec in ("w4a16", "w4a8"):
            got = res[f"ep_token_{prec}"]
            assert got["repeat"], (r, prec)
            assert got["rel"] <= (TP_TOL if prec == "w4a16" else TP_TOL_W4A8), (r, prec, got["rel"])


def test_ep_empty_rank(ranks):
    if len(ranks) == 4:  # counts [7, 5, 0, 3]
        assert ranks[2]["ep_route_w4a16_int32"]["shape"] == (0, H)
        assert ranks[2]["ep_token_w4a16"]["shape"] == (0, H)


def test_ep_auto_precision_uses_global_rows(ranks):
    for r, res in enumerate(ranks):
        assert res["ep_auto"]["ran"] == "w4a8", r
        assert res["ep_auto"]["equal"], r
    assert ranks[1]["ep_auto"]["local_choice"] == "w4a16"  # the rank alone would have chosen differently


def test_tp_close_to_single_process(ranks):
    world = len(ranks)
    keys = [k for k in ranks[0] if k.startswith("tp_") and isinstance(ranks[0][k], dict) and "rel" in ranks[0][k]]
    assert len(keys) == 3 * 2 * 2 * 2
    for key in keys:
        for r, res in enumerate(ranks):
            got = res[key]
            prec = "w4a8" if "w4a8" in key else "w4a16"
            assert got["ran"] == prec
            assert got["repeat"], (r, key)
            assert got["rel"] <= (TP_TOL_W4A8 if prec == "w4a8" else TP_TOL), (world, r, key, got["rel"])
            # TP is about as close to the exact (FP32) result as one GPU is
            assert got["rel_exact"] <= 1.15 * got["rel_single_exact"] + 4e-3, (r, key, got["rel_exact"], got["rel_single_exact"])
            assert torch.equal(got["out"], ranks[0][key]["out"]), (r, key)  # identical on every rank


def test_tp_shard_and_auto(ranks):
    world = len(ranks)
    for r, res in enumerate(ranks):
        assert res["tp_shard"] == dict(b2=(r == 0), w13=(E, 2 * I // world, H // 2), w2=(E, H, I // world // 2),
                                       w2_scale=(E, H, I // world // 32))
        assert res["tp_auto"] == "w4a8"
        assert res["tp_nocheck_equal"]


def test_errors_raise_on_every_rank(ranks):
    world = len(ranks)
    names = ranks[0]["errors"].keys()
    for name in names:
        seen = [res["errors"][name] for res in ranks]
        assert all(s is not None for s in seen), (name, seen)
    # the rank with a wrong dtype re-raises its own TypeError, the others a ValueError
    assert ranks[1]["errors"]["ep_bad_ids_dtype"] == "TypeError"
    assert all(res["errors"]["ep_bad_ids_dtype"] == "ValueError" for r, res in enumerate(ranks) if r != 1)
    for name in names:
        if name != "ep_bad_ids_dtype":
            assert all(res["errors"][name] == "ValueError" for res in ranks), name
    for res in ranks:
        assert res["after_errors_equal"]
    assert world in (2, 4)


def test_ep_expert_map(ranks):
    world = len(ranks)
    n = E // world
    for r, res in enumerate(ranks):
        expect = [-1] * E
        expect[r * n:(r + 1) * n] = list(range(n))
        assert res["ep_map"] == expect


# ----------------------------------------------------------------------------- no process group needed


def test_tp_shard_layouts_reassemble():
    """The slices of every layout prepare to the matching I-columns of the full preparation."""
    for layout in ("gate_up", "up_gate", "interleaved"):
        full = make_weights(seed=8, layout=layout)
        whole = mxmoe.prepare_weights(**full)
        packed = [full.pop(k) for k in ("w13", "w13_scale", "w2", "w2_scale")]
        for world in (1, 2, 4):
            n = I // world
            for r in range(world):
                part = mxmoe.prepare_weights(**tp_shard_weights(*packed, rank=r, world_size=world, **full))
                # in source byte and row order (the prepared bytes are in 64-row blocks of each part's rows)
                (w13_whole, w2_whole), (w13_part, w2_part) = whole.source_order_weights(), part.source_order_weights()
                gate, up = w13_whole[:, r * n:(r + 1) * n], w13_whole[:, I + r * n:I + (r + 1) * n]
                assert torch.equal(w13_part, torch.cat((gate, up), 1)), (layout, world, r)
                assert torch.equal(part.b13, torch.cat((whole.b13[:, r * n:(r + 1) * n], whole.b13[:, I + r * n:I + (r + 1) * n]), 1))
                assert torch.equal(w2_part, w2_whole[:, :, r * n // 2:(r + 1) * n // 2])
                assert torch.equal(part.w2_scale, whole.w2_scale[:, :, r * n // 32:(r + 1) * n // 32])
                assert (part.b2 is not None) == (r == 0)


def test_bad_world_sizes_raise_without_process_group():
    full = make_weights(seed=9, biases=False)
    packed = [full[k] for k in ("w13", "w13_scale", "w2", "w2_scale")]
    with pytest.raises(ValueError, match="multiple of 32"):
        tp_shard_weights(*packed, rank=0, world_size=8)  # 128 / 8 = 16
    with pytest.raises(ValueError, match="does not divide"):
        tp_shard_weights(*packed, rank=0, world_size=3)
    with pytest.raises(ValueError, match="does not divide"):
        ep_expert_map(E, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        ep_expert_map(E, 4, 4)


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "dist_gpu_check.py")
SMALL = ["--cpu", "--E", "16", "--H", "256", "--I", "128", "--top-k", "4", "--tokens", "16", "--iters", "2",
         "--warmup", "1"]


def _emulation_env() -> dict:
    """The script's CPU run on the PyTorch emulation (the interpreter would only make it slower)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.parametrize("arm, rank", [("tp", 1), ("ep-route", 0)])
def test_the_multi_gpu_script_ends_every_rank_when_one_fails(arm, rank):
    """scripts/dist_gpu_check.py's failure check, gloo on CPU processes: one rank raises mid-run while the other waits
    in a collective; the run ends with the error within the stated timeout, no hang."""
    cmd = [sys.executable, SCRIPT, *SMALL, "--world", "2", "--arms", arm, "--inject-failure", str(rank),
           "--failure-timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_emulation_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "after the injected failure" in proc.stdout and "RESULT: PASS" in proc.stdout


def test_the_multi_gpu_script_runs_its_checks_on_one_rank():
    """The script's one-rank dry run (what a one-GPU machine can run): every arm and precision passes its checks."""
    proc = subprocess.run([sys.executable, SCRIPT, *SMALL, "--world", "1"], capture_output=True, text=True,
                          timeout=180, env=_emulation_env())
    assert proc.returncode == 0 and "RESULT: PASS" in proc.stdout, proc.stdout + proc.stderr
