"""Path selection between W4A16 and W4A8 (SPEC §6)."""
from __future__ import annotations

import os

import pytest

from mxmoe import select_precision
from mxmoe.selection import ENV_MIN_ROWS

THRESHOLD = 4096


@pytest.fixture
def env(monkeypatch):
    def set_env(value):
        if value is None:
            monkeypatch.delenv(ENV_MIN_ROWS, raising=False)
        else:
            monkeypatch.setenv(ENV_MIN_ROWS, value)
    return set_env


def test_env_variable_name():
    assert ENV_MIN_ROWS == "MXMOE_FP8_PREFILL_MIN_ROWS"


@pytest.mark.parametrize("value", [None, "", "0", " 0 "])
@pytest.mark.parametrize("rows", [1, THRESHOLD, 10 ** 7])
def test_fp8_off_by_default(env, value, rows):
    env(value)
    assert select_precision(rows, capturing=False) == "w4a16"


@pytest.mark.parametrize("rows,expected", [(1, "w4a16"), (THRESHOLD - 1, "w4a16"), (THRESHOLD, "w4a8"), (THRESHOLD + 1, "w4a8")])
def test_threshold(env, rows, expected):
    env(str(THRESHOLD))
    assert select_precision(rows, capturing=False) == expected
    assert select_precision(rows, precision="auto", capturing=False) == expected


def test_threshold_one_turns_fp8_on_for_every_row_count(env):
    env("1")
    assert select_precision(1, capturing=False) == "w4a8"


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "1e3", "0x10", "4096 rows"])
@pytest.mark.parametrize("precision", ["auto", "w4a16"])
def test_malformed_env_is_an_error(env, value, precision):
    env(value)
    with pytest.raises(ValueError, match=ENV_MIN_ROWS):
        select_precision(THRESHOLD, precision=precision, capturing=False)


@pytest.mark.parametrize("value", [None, "0", "1", str(THRESHOLD)])
def test_capture_always_runs_w4a16(env, value):
    env(value)
    for precision in ("auto", "w4a16", "w4a8"):
        assert select_precision(10 ** 6, precision=precision, capturing=True) == "w4a16"


@pytest.mark.parametrize("value", [None, "0", "1", str(THRESHOLD)])
@pytest.mark.parametrize("rows", [1, THRESHOLD, 10 ** 6])
def test_explicit_precision_beats_env(env, value, rows):
    env(value)
    assert select_precision(rows, precision="w4a8", capturing=False) == "w4a8"
    assert select_precision(rows, precision="w4a16", capturing=False) == "w4a16"


def test_capturing_none_asks_the_stream_on_cpu(env):
    env("1")  # no CUDA here (or not capturing): auto decides from the environment
    assert select_precision(8, capturing=None) == "w4a8"


@pytest.mark.parametrize("precision", ["fp8", "W4A8", "", None, "w4a4"])
def test_bad_precision(env, precision):
    env(None)
    with pytest.raises(ValueError, match="precision"):
        select_precision(8, precision=precision, capturing=False)


@pytest.mark.parametrize("version,expected", [("3.6.0", True), ("3.6.1+git1234", True), ("3.7.0", False),
                                              ("3.8.0", False), ("3.9.0", True), ("3.9.1", True),
                                              ("3.5.1", False), ("4.0.0", False)])
def test_auto_kernel_takes_gluon_only_on_the_validated_triton(version, expected):
    """``MXMOE_KERNEL=auto`` picks the Gluon kernel only under the Triton release it was measured on."""
    from mxmoe._details.config import gluon_validated

    assert gluon_validated(version) is expected


def test_every_validated_triton_names_its_date_and_evidence():
    """Each release on the list says when it was validated and where the evidence is (a file in the repository)."""
    import re

    from mxmoe._details.config import GLUON_VALIDATED_TRITON

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for release, evidence in GLUON_VALIDATED_TRITON.items():
        assert re.fullmatch(r"\d+\.\d+", release), release
        assert re.match(r"\d{4}-\d{2}-\d{2}, ", evidence), evidence
        files = re.findall(r"docs/[\w./-]+\.(?:md|json)", evidence)
        assert files and all(os.path.exists(os.path.join(root, f)) for f in files), evidence


@pytest.mark.parametrize("value", ["fast", "GLUON", "gluon2"])
def test_malformed_kernel_choice_is_an_error(monkeypatch, value):
    import torch

    from mxmoe._details.config import kernel_choice

    monkeypatch.setenv("MXMOE_KERNEL", value)
    with pytest.raises(ValueError, match="MXMOE_KERNEL"):
        kernel_choice(torch.device("cpu"))


@pytest.mark.parametrize("value", ["", " ", "auto", "triton", "gluon"])
def test_kernel_choice_on_cpu_is_the_plain_template(monkeypatch, value):
    """Unset/empty means auto; CPU tensors (and the interpreter) always run the plain template."""
    import torch

    from mxmoe._details.config import kernel_choice

    monkeypatch.setenv("MXMOE_KERNEL", value)
    assert kernel_choice(torch.device("cpu"), rows=65536, num_experts=8) == "triton"


@pytest.mark.parametrize("env,version,fp8,rows,n,expected", [
    ("auto", "3.6.0", False, 8, 4096, ("gluon_small", "gluon_small")),          # W4A16 decode: the small-tile kernel
    ("auto", "3.6.0", False, 288 * 64, 4096, ("gluon_small", "gluon_small")),   # 64 rows per expert: small tiles
    ("auto", "3.6.0", False, 288 * 200, 4096, ("gluon_small", "gluon_small")),  # prefill: GEMM2 in two-block form
    ("auto", "3.6.0", False, 288 * 130, 2880, ("gluon_small", "gluon_small")),  # N % 128 == 64: pairs at 128 rows
    ("auto", "3.6.0", False, 288 * 200, 2880, ("gluon_small", "gluon_small")),  # past 132 rows per expert: wide tiles
    ("auto", "3.6.0", True, 8, 4096, ("gluon_small", "gluon_small")),           # W4A8: the small-tile kernel always
    ("auto", "3.6.0", True, 288 * 200, 2880, ("gluon_ws8", "gluon_small")),     # W4A8 prefill at K % 128 != 0
    ("auto", "3.6.0", True, 288 * 20, 2880, ("gluon_small", "gluon_small")),    # ... below 32 rows per expert
    ("auto", "3.7.0", False, 8, 4096, ("triton", "triton")),                    # not validated on this Triton
    ("gluon", "3.7.0", False, 288 * 130, 2880, ("gluon_small", "gluon_small")),  # forced
    ("gluon", "3.6.0", True, 8, 4096, ("gluon_small", "gluon_small")),
    ("triton", "3.6.0", False, 288 * 200, 2880, ("triton", "triton")),
])
def test_kernel_choice_on_hopper(monkeypatch, env, version, fp8, rows, n, expected):
    """The choice on an sm90 device (capability, Gluon availability and Triton version stubbed: no GPU needed);
    ``n`` is GEMM2's N (the hidden size, GEMM1's K), GEMM1's N and GEMM2's K are 1024."""
    import torch

    from mxmoe._details import config

    monkeypatch.setenv("MXMOE_KERNEL", env)
    monkeypatch.setattr(config, "interpreting", lambda: False)
    monkeypatch.setattr(config, "gluon_kernel", lambda name="gluon_small": object())
    monkeypatch.setattr(config.triton, "__version__", version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for gemm1, kernel in zip((True, False), expected):
        k = n if gemm1 else 1024
        assert config.kernel_choice(torch.device("cuda"), rows=rows, num_experts=288, fp8=fp8, k=k) == kernel
        assert config.kernel_choice(torch.device("cuda"), rows=rows, num_experts=288, fp8=fp8, shapes_ok=False,
                                    k=k) == "triton"
    # both GEMMs read one route pack: their configs agree on its tile height
    cfgs = [config.gemm_config(rows, 288, gn, k, fp8, kernel=kernel, gemm1=g1)
            for (gn, k, g1), kernel in zip(((1024, n, True), (n, 1024, False)), expected)]
    assert cfgs[0].block_rows * cfgs[0].sub_tiles == cfgs[1].block_rows * cfgs[1].sub_tiles


@pytest.mark.parametrize("rows,fp8,gemm1,n,pair", [
    (288 * 32, False, False, 4096, True),    # W4A16 GEMM2 from 32-row tiles
    (288 * 100, False, False, 4096, True),   # 128-row tiles
    (288 * 130, False, False, 4096, False),  # 128 + 32-slot wide tiles (test_wide_tiles)
    (288 * 12, False, False, 4096, False),   # 16-row tiles: measured slower
    (288 * 200, True, False, 4096, True),    # W4A8 (its fast path) on every tile: measured faster
    (288 * 32, True, False, 4096, True),
    (288 * 12, True, False, 4096, True),
    (8, True, False, 4096, True),
    (288 * 200, False, False, 2880, False),  # N % 128 == 64: the wide tiles (no pairs)
    (288 * 100, False, False, 2880, True),   # ... 128-row tiles: pairs, the last one's second block a repeat
    (288 * 50, False, False, 2880, False),   # ... 64-row tiles: single blocks measured faster
    (288 * 100, True, False, 2880, False),   # ... W4A8: not measured
    (288 * 200, False, True, 1024, False),   # GEMM1 has its gate and up halves already
])
def test_gemm2_two_block_form(rows, fp8, gemm1, n, pair):
    from mxmoe._details.config import gemm_config

    cfg = gemm_config(rows, 288, n, 1024, fp8, kernel="gluon_small", gemm1=gemm1)
    assert cfg.pair is pair
    if gemm1 or cfg.wide:
        with pytest.raises(ValueError, match="pair"):
            gemm_config(rows, 288, n, 1024, fp8, {"pair": True}, kernel="gluon_small", gemm1=gemm1)
    else:  # an override wins (N % 128 == 64 too)
        assert gemm_config(rows, 288, n, 1024, fp8, {"pair": not pair}, kernel="gluon_small", gemm1=gemm1).pair is not pair


@pytest.mark.parametrize("tokens,top_k,E,fp8,kernel,direct", [
    (1, 8, 288, False, "gluon_small", True),   # decode: no route pack
    (4, 8, 288, False, "gluon_small", True),   # up to DIRECT_MAX_TOKENS
    (5, 8, 288, False, "gluon_small", False),  # measured slower from T=8: the pack
    (1, 8, 288, True, "gluon_small", False),   # W4A8 keeps the pack (its intermediate quantizer reads it)
    (1, 8, 288, False, "triton", False),       # the plain template (CPU, interpreter) always packs
    (4, 8, 8, False, "gluon_small", False),    # 32 routes on 8 experts: a tile per route does not fit
    (2, 4, 8, False, "gluon_small", True),     # 8 routes on 8 experts fit
])
def test_direct_routes(tokens, top_k, E, fp8, kernel, direct):
    """Which calls run without a route pack (``launch.direct_routes``)."""
    from mxmoe._details import launch
    from mxmoe._details.config import gemm_config, overrides
    from mxmoe.routing import route_pack_capacity

    R = tokens * top_k
    cfg1 = gemm_config(R, E, 1024, 4096, fp8, kernel=kernel, gemm1=True)
    cfg2 = gemm_config(R, E, 4096, 1024, fp8, kernel=kernel, gemm1=False)
    assert launch.direct_routes(tokens, R, E, fp8, cfg1, cfg2) is direct
    if direct:  # the workspace's intermediate holds a tile per route
        assert route_pack_capacity(R, E, cfg1.block_rows)[0] >= R * cfg1.block_rows
    with overrides(direct_decode=False):
        assert not launch.direct_routes(tokens, R, E, fp8, cfg1, cfg2)


@pytest.mark.parametrize("rows,n,k,gemm1,sm_count,split", [
    (8, 1024, 4096, True, 132, 2),      # reference shape T=1: 16 x 8 programs fit on 132 SMs
    (16, 1024, 4096, True, 132, 1),     # T=2: up to 256 programs
    (8, 4096, 1024, False, 132, 1),     # reference shape GEMM2 T=1: 512 programs (measured slower split)
    (4, 2880, 2880, False, 132, 2),     # gpt-oss GEMM2 T=1: 180 programs, up to 1.5 per SM (W4A16 only)
    (8, 2880, 2880, False, 132, 1),     # ... T=2: 360
    (8, 1024, 4096, True, 0, 1),        # SM count unknown
    (4, 2880, 2880, True, 132, 1),      # second shape T=1: 45 x 4 programs
    (8, 1024, 256, True, 132, 1),       # too few K steps to split
])
def test_decode_k_split(rows, n, k, gemm1, sm_count, split):
    """The small-tile kernel splits K over two warpgroups only where its decode grid fits on the SMs: GEMM1 up to
    one program per SM, W4A16 GEMM2 up to 1.5."""
    from mxmoe._details.config import gemm_config

    for fp8 in (False, True):
        want = 1 if fp8 and not gemm1 else split
        cfg = gemm_config(rows, 288, n, k, fp8, kernel="gluon_small", gemm1=gemm1, sm_count=sm_count)
        assert cfg.k_split == want and cfg.maxnreg == (128 if want == 2 else 0)
    # an override wins
    assert gemm_config(rows, 288, n, k, False, {"k_split": 1}, kernel="gluon_small", gemm1=gemm1,
                       sm_count=sm_count).k_split == 1
    with pytest.raises(ValueError, match="k_split"):
        gemm_config(rows, 288, n, k, False, {"k_split": 3}, kernel="gluon_small", gemm1=gemm1)
    with pytest.raises(ValueError, match="K steps"):  # each warpgroup needs whole scale-word groups of steps
        gemm_config(rows, 288, n, 128, False, {"k_split": 2}, kernel="gluon_small", gemm1=gemm1)


@pytest.mark.parametrize("rows,E,n,k,gemm1,fp8,sm_count,parts", [
    (4, 128, 2880, 2880, True, False, 132, 2),   # E=128, H=I=2880, top_k=4, T=1: 180 GEMM1 programs on 132 SMs
    (4, 32, 2880, 2880, True, False, 132, 2),    # E=32, the same grid
    (8, 128, 2880, 2880, True, False, 132, 1),   # T=2: 360 programs, even enough
    (8, 288, 1024, 4096, True, False, 132, 1),   # reference shape T=1: the in-program split instead
    (4, 128, 2880, 2880, False, False, 132, 1),  # GEMM2 (measured no faster)
    (4, 128, 2880, 2880, True, True, 132, 1),    # W4A8 (never without a route pack)
    (4, 128, 2880, 2880, True, False, 0, 1),     # SM count unknown
])
def test_decode_k_parts(rows, E, n, k, gemm1, fp8, sm_count, parts):
    """Decode GEMM1 grids of 1 to 1.5 programs per SM split their K steps over two programs (``k_parts``)."""
    from mxmoe._details.config import gemm_config

    cfg = gemm_config(rows, E, n, k, fp8, kernel="gluon_small", gemm1=gemm1, sm_count=sm_count)
    assert cfg.k_parts == parts
    assert parts == 1 or cfg.k_split == 1
    with pytest.raises(ValueError, match="k_parts"):  # GEMM1 of W4A16 only, not with the in-program split
        gemm_config(rows, E, n, k, fp8, {"k_parts": 2, "k_split": 2}, kernel="gluon_small", gemm1=gemm1)
    with pytest.raises(ValueError, match="k_parts"):
        gemm_config(rows, E, k, n, False, {"k_parts": 2}, kernel="gluon_small", gemm1=False)


@pytest.mark.parametrize("rows,fp8,gemm1,k,block_k,stages", [
    (8, False, False, 1024, 128, 6),        # decode W4A16 GEMM2: 16-row tiles, 128-K stages, 6 for one token's
    (16, False, False, 1024, 128, 4),       # routes (8 K steps), else 4
    (288 * 12, False, False, 1024, 128, 4),
    (288 * 32, False, False, 1024, 64, 4),  # 32-row tiles: 64
    (8, False, True, 4096, 64, 4),          # W4A16 GEMM1: 64
    (8, True, False, 1024, 128, 3),         # W4A8: 128-K stages (4 K32 blocks), 3 of them up to 32-row tiles
    (288 * 32, True, True, 4096, 128, 3),
    (288 * 64, True, True, 4096, 128, 4),
    (288 * 64, True, False, 1024, 128, 4),
    (288 * 128, True, True, 4096, 64, 4),   # W4A8 GEMM1 on 128-row tiles: its FP32 sums in shared memory
    (288 * 128, True, False, 1024, 128, 3),
    (8, True, True, 2880, 64, 4),           # K % 128 != 0
    (8, False, False, 2880, 64, 4),
])
def test_small_tile_stage_depth(rows, fp8, gemm1, k, block_k, stages):
    from mxmoe._details.config import gemm_config

    cfg = gemm_config(rows, 288, 4096 if not gemm1 else 1024, k, fp8, kernel="gluon_small", gemm1=gemm1)
    assert (cfg.block_k, cfg.num_stages) == (block_k, stages)
    assert cfg.maxnreg == 0  # (the register caps of the exact unfolded W4A8 kernel: config.unfolded_config)
    assert gemm_config(rows, 288, 1024, k, fp8, {"maxnreg": 168}, kernel="gluon_small", gemm1=True).maxnreg == 168


@pytest.mark.parametrize("override,n,match", [
    ({"block_m": 128}, 4096, "block_m=64"),
    ({"num_warps": 8}, 4096, "num_warps=4"),
])
def test_small_tile_kernel_rejects_configs_it_cannot_run(override, n, match):
    """A config the kernel would run wrong (rows left out of the grid) or not at all is an error up front."""
    from mxmoe._details.config import gemm_config

    with pytest.raises(ValueError, match=match):
        gemm_config(288 * 64, 288, n, 1024, False, override, kernel="gluon_small", gemm1=False)


@pytest.mark.parametrize("per_expert,small,plain", [(1, 16, 16), (12, 16, 16), (12.5, 32, 16), (16, 32, 16),
                                                    (17, 32, 32), (32, 32, 32), (33, 64, 64), (150, 128, 128),
                                                    (200, 128, 128)])
def test_route_tile_height(per_expert, small, plain):
    """The small-tile Gluon kernel leaves 16-row tiles at 12 rows per expert on average (measured), the plain
    template at 16; both take the smallest tile above the average from 32 rows on, up to 128 rows (W4A8 too: its
    fast path holds no per-block partial sums)."""
    from mxmoe._details.config import gemm_config, tile_rows_for

    rows = int(per_expert * 288)
    assert tile_rows_for(rows, 288) == plain
    for fp8 in (False, True):
        cfg = gemm_config(rows, 288, 1024, 4096, fp8, kernel="gluon_small", gemm1=True)
        # W4A16's wide tiles (test_wide_tiles): 128 + 32 slots at 150 rows per expert, 256 at 200
        wide = {150: 128, 200: 256}.get(per_expert, 0) if not fp8 else 0
        assert cfg.block_rows == (wide or min(small, 128)) and cfg.wide is (wide > 0)


@pytest.mark.parametrize("per_expert,E,H,fp8,bt", [
    (228, 288, 4096, False, 256),   # T=8192 on the reference shape: wide tiles (H200: -9.8 % with the wide GEMM2)
    (171, 288, 4096, False, 256),   # T=6144 (H200: -10 %)
    (160, 288, 4096, False, 256),   # T=5760 (H200: -3.5 %)
    (142, 288, 4096, False, 128),   # T=5120: 128 + 32-slot wide tiles (expected tiles 1.06 per expert)
    (135, 288, 4096, False, 128),   # T=4864 (H100: -17 % against the 256-row tiles, step 53)
    (132, 288, 4096, False, 128),
    (128, 288, 4096, False, 128),   # T=4608 (the 256-row tiles: H200 +11.7 %)
    (114, 288, 4096, False, 0),     # T=4096: one 128-row tile for 91 % of the experts (128 + 32: H100 -4 %)
    (96, 288, 4096, False, 0),      # T=3456 (128 + 32: H100 -1.5 %)
    (228, 288, 4096, True, 0),      # W4A8: its 64-row tiles
    (512, 128, 2880, False, 256),   # gpt-oss-120b at T=16384: H % 128 == 64, scales in 16-bit loads (step 49)
    (160, 128, 2880, False, 256),   # gpt-oss-120b T=5120 (128 + 32: H100 +13 %)
    (144, 128, 2880, False, 128),   # T=4608 (H100 -10 %)
    (128, 128, 2880, False, 128),   # T=4096 (H100 -14 %)
    (112, 128, 2880, False, 0),     # T=3584 (128 + 32: H100 +6 %)
])
def test_wide_tiles(per_expert, E, H, fp8, bt):
    """W4A16 prefill on wide tiles (``wide_pack``): 256-row route tiles past 132 rows per expert, GEMM1 persistent on
    two warpgroups, GEMM2 persistent on two warpgroups (or on the tiles' 128-row halves with its two-block form);
    128 + 32-slot tiles where they cost less (experts of ~115-155 rows), both GEMMs on the wide kernel, 6 stages;
    both GEMMs read one pack."""
    from mxmoe._details.config import WIDE_EXTRA, WIDE_ROWS, gemm_config, pack_shape

    rows = int(per_expert * E)
    g1 = gemm_config(rows, E, 1024, H, fp8, kernel="gluon_small", gemm1=True)
    g2 = gemm_config(rows, E, H, 1024, fp8, kernel="gluon_small", gemm1=False)
    assert g1.wide is (bt > 0) and g2.wide is (bt > 0) and g1.block_rows == (bt or min(128, g1.block_rows))
    assert pack_shape(g1) == pack_shape(g2)
    if bt == 128:
        assert pack_shape(g1) == (128 + WIDE_EXTRA, WIDE_EXTRA) and (g1.num_stages, g2.num_stages) == (6, 6)
        # GEMM2 of too few K steps for the wide kernel (I = 128): not these tiles (the 128-row small tiles, or the
        # 256-row ones with GEMM2 on their halves)
        assert pack_shape(gemm_config(rows, E, 128, H, fp8, kernel="gluon_small", gemm1=True))[1] == 0
    wide = bt == WIDE_ROWS
    if wide:
        # GEMM1 persistent too, 5 stages (4 with the extra rows' ring), 255 registers (232 spill the next tile's
        # copy state)
        assert g1.maxnreg == 255 and g1.num_stages == (4 if g1.extra_rows else 5)
        # GEMM2 persistent on the wide tiles (H % 128 == 64: its last program's second half repeats the first)
        assert g2.wide and g2.block_rows == WIDE_ROWS and g2.sub_tiles == 1 and not g2.pair and g2.maxnreg == 255
        with pytest.raises(ValueError, match="no pair"):
            gemm_config(rows, E, H, 1024, fp8, {"pair": True}, kernel="gluon_small", gemm1=False)
        # its ring needs 3 K steps per tile: I = 128 (e.g. I = 1024 at 8-way tensor parallelism) takes the halves
        for inter, wide2 in ((1088, True), (2880, True), (128, False), (192, True), (256, True)):
            g2i = gemm_config(rows, E, H, inter, fp8, kernel="gluon_small", gemm1=False)
            assert g2i.wide is wide2 and g2i.block_rows * g2i.sub_tiles == WIDE_ROWS
            assert g2i.scale_words is (inter % 128 == 0)  # else 16-bit scale loads
            if not wide2:
                assert g2i.block_rows == 128 and g2i.sub_tiles == 2 and g2i.pair
        # tiles it cannot take: 5 stages (with its output staging past the shared memory), 2, 128-K stages
        for bad in ({"num_stages": 5}, {"num_stages": 2}, {"block_k": 128}):
            with pytest.raises(ValueError, match="the wide GEMM2|shared memory"):
                gemm_config(rows, E, H, 1024, fp8, bad, kernel="gluon_small", gemm1=False)
        # an explicit tile height wins
        assert not gemm_config(rows, E, 1024, H, fp8, {"block_rows": 128}, kernel="gluon_small", gemm1=True).wide
    with pytest.raises(ValueError, match="wide"):
        gemm_config(rows, E, 1024, H, fp8, {"block_rows": 64, "wide": True}, kernel="gluon_small", gemm1=True)


def test_wide_tiles_need_k_steps_for_their_unrolled_tail():
    """The wide kernels unroll a tile's last num_stages - 1 K steps (whole scale words): H below WIDE_MIN_K keeps
    the 128-row tiles, and an explicit wide config with fewer K steps is refused."""
    from mxmoe._details.config import WIDE_MIN_K, gemm_config, wide_tail_steps

    assert wide_tail_steps(64, 5) == 4 and wide_tail_steps(64, 6) == 6 and wide_tail_steps(64, 4) == 4
    assert wide_tail_steps(64, 3) == 2 and wide_tail_steps(128, 5) == 4
    # 16-bit scale loads (K % 128 == 64): one per 64-K step, so the tail is num_stages - 1 steps exactly
    assert wide_tail_steps(64, 5, 2) == 4 and wide_tail_steps(64, 4, 2) == 3 and wide_tail_steps(32, 4, 2) == 4
    rows = 228 * 288
    for H in (128, 256, WIDE_MIN_K):
        g1 = gemm_config(rows, 288, 1024, H, False, kernel="gluon_small", gemm1=True)
        g2 = gemm_config(rows, 288, H, 1024, False, kernel="gluon_small", gemm1=False)
        assert g1.wide is (H >= WIDE_MIN_K) and g1.block_rows * g1.sub_tiles == g2.block_rows * g2.sub_tiles
    wide = {"block_rows": 256, "wide": True, "maxnreg": 232}
    assert gemm_config(rows, 288, 1024, 256, False, dict(wide, num_stages=5), kernel="gluon_small", gemm1=True).wide
    with pytest.raises(ValueError, match="the wide GEMM1"):
        gemm_config(rows, 288, 1024, 256, False, dict(wide, num_stages=6), kernel="gluon_small", gemm1=True)
    with pytest.raises(ValueError, match="the wide GEMM1"):
        gemm_config(rows, 288, 1024, 128, False, dict(wide, num_stages=5), kernel="gluon_small", gemm1=True)
    # 16-bit scale loads: 4 steps at 5 stages; a 128-K step would span two loads (either kernel)
    assert gemm_config(rows, 288, 1024, 320, False, dict(wide, num_stages=5), kernel="gluon_small", gemm1=True).wide
    for tiles in (wide, {}):
        with pytest.raises(ValueError, match="a scale load's K"):
            gemm_config(rows, 288, 1024, 1024, False, dict(tiles, block_k=128, scale_words=False),
                        kernel="gluon_small", gemm1=True)


def test_wide_tiles_take_w4a16_on_128_or_256_rows():
    """The wide kernels run W4A16 on 256- or 128-row tiles (with or without extra rows); their W4A8 form and 64-row
    tiles were measured slower and deleted (docs/perf-notes.md steps 52-53), and other tile heights are refused."""
    from mxmoe._details.config import gemm_config, pack_shape

    rows = 8192 * 4
    for fp8, bt in ((True, 256), (True, 128), (False, 64), (False, 32)):
        with pytest.raises(ValueError, match="wide takes W4A16"):
            gemm_config(rows, 128, 2880, 2880, fp8, dict(block_rows=bt, wide=True), kernel="gluon_small")
    for bt in (128, ):
        for extra in (0, 32):
            for gemm1 in (True, False):
                cfg = gemm_config(rows, 128, 2880, 2880, False, dict(block_rows=bt, wide=True, extra_rows=extra),
                                  kernel="gluon_small", gemm1=gemm1)
                assert cfg.wide and pack_shape(cfg) == (bt + extra, extra)


def test_small_w4a16_tiles_split_their_k_loop_from_16_steps():
    """W4A16 on small tiles splits its K loop (an untested main part, then the tested last steps) where each warpgroup
    runs at least SPLIT_LOOP_MIN_STEPS K steps; W4A8 and the wide tiles never (they are refused)."""
    from mxmoe._details.config import SPLIT_LOOP_MIN_STEPS, gemm_config

    def cfg(rows, n, k, fp8=False, gemm1=True, override=None):
        return gemm_config(rows, 288, n, k, fp8, override, kernel="gluon_small", gemm1=gemm1, sm_count=132)

    for rows in (8, 128, 8192, 16384, 32768):
        g1, g2 = cfg(rows, 1024, 4096), cfg(rows, 4096, 1024, gemm1=False)
        assert g1.split_loop and (g1.k_split == 2 or g1.block_k * SPLIT_LOOP_MIN_STEPS <= 4096)
        # (16-row GEMM2 tiles take 128-K steps: 8, not split)
        assert g2.split_loop is (1024 // g2.block_k >= SPLIT_LOOP_MIN_STEPS)
        assert not cfg(rows, 1024, 4096, fp8=True).split_loop
        assert not cfg(rows, 4096, 1024, fp8=True, gemm1=False).split_loop
    assert not cfg(128, 4096, 1024, gemm1=False).split_loop  # 16-row tiles, 8 steps of 128 K
    assert cfg(8192, 4096, 1024, gemm1=False).split_loop  # 32-row tiles, 16 steps of 64 K
    assert not cfg(8, 1024, 512).split_loop  # decode: K split over two warpgroups of 4 steps each
    assert not cfg(65536, 1024, 4096).split_loop and cfg(65536, 1024, 4096).wide  # the wide tiles split their own
    assert cfg(8192, 4096, 1024, gemm1=False, override={"split_loop": False}).split_loop is False
    with pytest.raises(ValueError, match="split_loop"):
        cfg(8192, 1024, 4096, fp8=True, override={"split_loop": True})


def test_small_tile_kernels_over_48_kb_get_no_shared_preference(monkeypatch):
    """Triton loads kernels of more than 48 KB of shared memory preferring shared memory (the smallest L1);
    ``_no_shared_preference`` sets such a kernel back to no preference once per loaded kernel, leaves smaller
    ones alone, and does nothing without a loaded function or without libcuda."""
    from types import SimpleNamespace

    from mxmoe._details import launch

    calls = []

    class FakeCuda:
        def cuFuncSetCacheConfig(self, function, config):
            calls.append((function.value, config))
            return 0

    monkeypatch.setattr(launch, "_libcuda", lambda: FakeCuda())
    monkeypatch.setattr(launch, "_L1_SET", set())

    def kernel(function, shared):
        return SimpleNamespace(function=function, metadata=SimpleNamespace(shared=shared))

    launch._no_shared_preference(kernel(0x1000, 49184))
    launch._no_shared_preference(kernel(0x1000, 49184))  # the same kernel again: once
    launch._no_shared_preference(kernel(0x2000, 32800))  # under 48 KB: as Triton loaded it
    launch._no_shared_preference(kernel(None, 81952))  # not loaded (e.g. the interpreter)
    launch._no_shared_preference(kernel(0x3000, 81952))
    assert calls == [(0x1000, 0), (0x3000, 0)]
    monkeypatch.setattr(launch, "_libcuda", lambda: None)
    launch._no_shared_preference(kernel(0x4000, 81952))  # no libcuda: nothing, no error
    assert calls == [(0x1000, 0), (0x3000, 0)]


@pytest.mark.parametrize("T", [1, 64, 1024, 2048, 4096, 8192])
@pytest.mark.parametrize("H, I", [(4096, 1024), (2880, 2880), (7168, 2048)])
def test_w4a8_chains_stay_within_the_promotion_length(T, H, I):
    """The W4A8 fast path's FP8 accumulator chains never run over more than ``PROMOTE_K`` of K (SPEC §5's GEMM
    bound), and their FP32 sums go to shared memory exactly where two 64-row chains of 128 routed rows fill the
    registers; the exact unfolded kernel of the same pack takes at most 64 rows per program."""
    from mxmoe._details.config import PROMOTE_K, gemm_config, unfolded_config

    for gemm1, n, k in ((True, I, H), (False, H, I)):
        cfg = gemm_config(T * 8, 256, n, k, True, kernel="gluon_small", gemm1=gemm1, sm_count=132)
        per_chain = (cfg.promote or k // cfg.block_k) * cfg.block_k
        if cfg.k_split == 1:
            assert per_chain <= max(PROMOTE_K, k) if k <= PROMOTE_K else per_chain <= PROMOTE_K
        assert cfg.promote_smem == (cfg.promote > 0 and cfg.block_rows == 128 and (gemm1 or cfg.pair))
        slow = unfolded_config(cfg, gemm1, k)
        assert slow.block_rows <= 64 and slow.block_rows * slow.sub_tiles == cfg.block_rows * cfg.sub_tiles
        assert slow.promote == 0 and not slow.promote_smem


def test_overrides_nest_reset_and_size_workspaces():
    """``config.overrides``: the one way to change the library's choices; nested contexts add, leaving restores."""
    from mxmoe._details.config import Overrides, current_overrides, overrides, pack_tile_heights

    assert current_overrides() == Overrides()
    assert max(pack_tile_heights(8, 288)) == 128
    with overrides(gemm={"block_k": 32}, gemm2={"num_stages": 3}) as outer:
        assert outer.gemm1 == {"block_k": 32} and outer.gemm2 == {"block_k": 32, "num_stages": 3}
        with overrides(pdl=False, gemm1={"block_rows": 256}) as inner:
            assert not inner.pdl and inner.gemm2 == outer.gemm2 and inner.gemm1 == {"block_rows": 256}
            assert max(pack_tile_heights(8, 288)) == 256  # a workspace made here holds the tiles asked for
        assert current_overrides() is outer
    assert current_overrides() == Overrides()


def test_the_layer_plan_resolves_path_and_activation_once(monkeypatch):
    from mxmoe.selection import plan_layer

    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "64")
    plan = plan_layer(64, activation="swigluoai")
    assert (plan.path, plan.fp8, plan.limit, plan.alpha) == ("w4a8", True, 7.0, 1.702)
    plan = plan_layer(63, swiglu_limit=5)
    assert (plan.path, plan.activation, plan.limit, plan.alpha) == ("w4a16", "silu", 5.0, 1.0)
    assert plan_layer(1).limit == float("inf")
    assert plan_layer(10 ** 6, precision="w4a8", capturing=True).path == "w4a16"


def test_environment_reads_follow_os_environ(monkeypatch):
    """``env_get`` (the per-call reads of the threshold and ``MXMOE_KERNEL``) sees every change made through
    ``os.environ`` as ``os.environ.get`` does: set, changed, empty, non-ASCII, removed."""
    from mxmoe._details import env_get
    from mxmoe.selection import fp8_min_rows

    name = "MXMOE_TEST_ENV_READ"
    monkeypatch.delenv(name, raising=False)
    assert env_get(name) is None and env_get(name, "d") == "d"
    for value in ("1", "two words", "", "ünï"):
        monkeypatch.setenv(name, value)
        assert env_get(name, "d") == value == os.environ.get(name, "d")
    monkeypatch.delenv(name)
    assert env_get(name, "d") == "d"
    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "64")
    assert fp8_min_rows() == 64
    monkeypatch.setenv("MXMOE_FP8_PREFILL_MIN_ROWS", "128")
    assert fp8_min_rows() == 128
    monkeypatch.delenv("MXMOE_FP8_PREFILL_MIN_ROWS")
    assert fp8_min_rows() == 0


@pytest.mark.parametrize("E,T,top_k,H,I,extra", [
    (128, 8192, 4, 2880, 2880, True),    # gpt-oss-120b: 256 +- 16 rows per expert (H100: -18 to -20 %, step 52)
    (32, 4096, 4, 2880, 2880, True),     # gpt-oss-20b: 512 +- 22 (-6 %)
    (32, 2048, 4, 2880, 2880, True),     # 256 +- 16
    (32, 8192, 4, 2880, 2880, False),    # 1024 +- 32: few tiles saved (+1 to +3 % with them)
    (288, 8192, 8, 4096, 1024, False),   # the reference shape: 228 rows (+5 % with them)
    (128, 6144, 4, 2880, 2880, False),   # 192 rows: one tile per expert either way
    (128, 8192, 4, 2880, 128, False),    # I = 128: GEMM2 on the tiles' 128-row halves (one pack: none for GEMM1)
])
def test_wide_extra_rows_where_tiles_drop(E, T, top_k, H, I, extra):
    """The wide tiles' 32 extra rows (W4A16) where uniform routing puts experts' rows just past a multiple of 256
    (``wide_extra_rows``); both GEMMs read one pack; W4A8 and 128-row tiles never take them, and an override asking
    for them there is refused."""
    from mxmoe._details.config import WIDE_EXTRA, gemm_config, pack_shape

    rows = T * top_k
    g1 = gemm_config(rows, E, I, H, False, kernel="gluon_small", gemm1=True)
    g2 = gemm_config(rows, E, H, I, False, kernel="gluon_small", gemm1=False)
    assert g1.wide and pack_shape(g1) == pack_shape(g2)
    assert g1.extra_rows == (WIDE_EXTRA if extra else 0)
    if extra:
        assert pack_shape(g1) == (256 + WIDE_EXTRA, WIDE_EXTRA) and g1.num_stages == 4 and g2.num_stages == 4
    assert gemm_config(rows, E, I, H, False, {"extra_rows": 0}, kernel="gluon_small").extra_rows == 0
    for bad in ({"extra_rows": 32, "block_rows": 128}, {"extra_rows": 16}):
        with pytest.raises(ValueError, match="extra_rows"):
            gemm_config(rows, E, I, H, False, bad, kernel="gluon_small")
    with pytest.raises(ValueError, match="wide takes W4A16"):  # (W4A8 has no wide tiles)
        gemm_config(rows, E, I, H, True, {"extra_rows": 32, "block_rows": 256, "wide": True}, kernel="gluon_small")


def test_workspaces_reserve_the_extra_rows_pack_only_where_a_call_may_take_it():
    """A workspace holds the 288-slot pack of the wide tiles' extra rows where some call it fits takes them (or the
    overrides ask for them): not for the reference shape up to T=8192 (228 rows per expert) nor gpt-oss-120b up to
    T=6144, yes for gpt-oss-120b from about T=7550 (236 rows per expert: the extra rows' first band); the 160-slot
    pack of the 128 + 32-slot tiles from their band's first call (~119 rows per expert)."""
    from mxmoe._details.config import WIDE_EXTRA, WIDE_ROWS, overrides, pack_shapes, wide_extra_rows, wide_pack

    extra = (WIDE_ROWS + WIDE_EXTRA, WIDE_EXTRA)
    assert extra not in pack_shapes(8192 * 8, 288)
    assert extra not in pack_shapes(6144 * 4, 128)
    assert extra in pack_shapes(7680 * 4, 128) and extra in pack_shapes(16384 * 4, 128)
    # the first rows per expert that take them, and the workspace's answer on both sides of it
    first = next(m for m in range(133, 600) if wide_extra_rows(m * 128, 128))
    assert 230 <= first <= 245
    assert extra in pack_shapes((first - 1) * 128, 128) and extra not in pack_shapes((first - 2) * 128, 128)
    # every call a workspace fits finds its pack there: a workspace of T_max tokens reserves it once any T <= T_max
    # takes the extra rows (the first such T, then workspaces of every size above it, also past the band's end)
    for E, top_k in ((128, 4), (32, 4), (288, 16)):
        first_t = next(T for T in range(1, 40000) if wide_extra_rows(T * top_k, E))
        assert all(extra in pack_shapes(T * top_k, E) for T in range(first_t, 40000, 53)), (E, top_k)
    with overrides(gemm1=dict(extra_rows=WIDE_EXTRA)):
        assert extra in pack_shapes(64, 128)
    # the 128 + 32-slot tiles (experts of ~119-152 rows): from the band's first call on, past its end too
    extra_128 = (128 + WIDE_EXTRA, WIDE_EXTRA)
    first = next(m for m in range(65, 256) if wide_pack(m * 128, 128) == (128, WIDE_EXTRA))
    assert 110 <= first <= 125
    assert extra_128 not in pack_shapes((first - 2) * 128, 128) and extra_128 in pack_shapes((first - 1) * 128, 128)
    assert extra_128 in pack_shapes(8192 * 8, 288) and extra_128 not in pack_shapes(3072 * 4, 128)
