"""Compile the GEMM kernels for sm_90a on the CPU: tensor-core MMA (wgmma) in the SASS, no spills, no
serialized wgmma pipeline.

Configs are the ones ``gemm_config`` picks for the reference shape, decode and prefill (plain
template), W4A8 prefill for the warp-specialized Gluon kernel and decode, small batches and prefill
for the small-tile Gluon kernel, with both scale-load forms, W4A16 on one K32 block per step, the decode K split,
GEMM2's two-block form and the wide W4A16 tiles
(``MXMOE_KERNEL=auto`` picks the Gluon kernels there). The
compile runs in a subprocess without TRITON_INTERPRET (which the CPU test session sets, and
which makes the kernels interpreter objects at import).
"""
import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "mxmoe._details.sm90"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the kernels ask for FP fusion themselves (Triton 3.9 warns when it is left to the default, 3.10 turns it off)
    assert "TRITON_DEFAULT_FP_FUSION" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # (the module's compile of every config: ~40 s)
def test_every_kind_of_config_is_compiled(reports):
    """The configs ``gemm_config`` picks over the token counts cover every kernel family and knob (properties, not a
    count: a new config adds to them)."""
    assert {r["kernel"] for r in reports} == {"gluon_small", "gluon_ws8", "triton"}  # (the plain template
    # too: its fallback)
    small = [r for r in reports if r["kernel"] == "gluon_small"]
    # the one-token path without a route pack (both GEMMs, and GEMM1 with its K steps over two programs)
    assert {r["config"]["k_parts"] for r in small if r["direct"]} == {1, 2}
    assert {r["gemm1"] for r in small if r["direct"]} == {True, False}
    assert {r["config"]["block_rows"] for r in small} >= {16, 64, 128, 256}
    # the wide tiles (prefill): GEMM1 and the persistent GEMM2 on two warpgroups, GEMM2 also on their halves
    wide = {(r["gemm1"], r["config"]["wide"], r["config"]["sub_tiles"]) for r in small
            if r["config"]["block_rows"] == 256 or r["config"]["sub_tiles"] == 2}
    assert wide >= {(True, True, 1), (False, True, 1), (False, False, 2)}
    # ... and with their extra rows (both GEMMs), at both scale-load sizes
    assert {(r["gemm1"], r["config"]["scale_words"]) for r in small if r["config"]["extra_rows"]} == \
        {(g, w) for g in (True, False) for w in (True, False)}
    # ... and the 128 + 32-slot wide tiles the heuristics pick (130 rows per expert), both GEMMs, both sizes
    assert {(r["gemm1"], r["config"]["scale_words"]) for r in small
            if r["config"]["extra_rows"] and r["config"]["block_rows"] == 128 and r["config"]["wide"]} == \
        {(g, w) for g in (True, False) for w in (True, False)}
    # ... both also with 16-bit scale loads (K % 128 == 64, gpt-oss's 2880)
    assert {r["gemm1"] for r in small if r["config"]["wide"] and not r["config"]["scale_words"]} == {True, False}
    # GEMM2's two 64-row blocks per program where N % 128 == 64 (the last program's second block a repeat): in pairs
    # and on the wide tiles
    assert {r["config"]["wide"] for r in small if not r["gemm1"] and r["n"] % 128 == 64
            and (r["config"]["pair"] or r["config"]["wide"])} == {True, False}
    assert {r["config"]["scale_words"] for r in small} == {True, False}
    # W4A16 with scale words on one K32 block per step (per-block factors) and on two or four (paired factors)
    assert {r["config"]["block_k"] for r in small if not r["fp8"] and r["config"]["scale_words"]} >= {32, 64, 128}
    assert {r["config"]["k_split"] for r in small} == {1, 2}
    # W4A16 small tiles of 32+ rows also run a tile on its first half (both GEMMs); decode tiles do not
    assert {r["gemm1"] for r in small if r["config"]["half_tiles"]} == {True, False}
    assert {r["config"]["half_tiles"] for r in small} == {True, False}
    assert {r["config"]["pair"] for r in small} == {True, False}
    assert {r["fp8"] for r in small} == {True, False}
    # the W4A8 prefill kernel: both GEMMs, 64- and 128-row tiles, the tests' 1024-K chains, a K tail (K = 2880)
    ws8 = [r for r in reports if r["kernel"] == "gluon_ws8"]
    assert {(r["gemm1"], r["config"]["block_rows"]) for r in ws8} >= {(g, bt) for g in (True, False) for bt in (64, 128)}
    assert {r["config"]["promote"] for r in ws8} >= {0, 8} and {r["k"] % 128 for r in ws8} == {0, 64}


@pytest.mark.slow
def test_every_config_uses_wgmma_without_spills(reports):
    assert reports
    for r in reports:
        _uses_wgmma_without_spills(r)


def _uses_wgmma_without_spills(r):
    expected = "QGMMA" if r["fp8"] else "HGMMA"
    assert r["mma_ops"] and all(op.startswith(expected) for op in r["mma_ops"]), r
    if r["fp8"]:
        assert all(".E4M3.E4M3" in op for op in r["mma_ops"]), r
    # Spill budgets were measured on the Tritons the Gluon kernels are validated on; other releases compile the
    # warp-specialized kernel differently and `auto` does not pick it there.
    import triton

    from mxmoe._details.config import gluon_validated

    # W4A8 GEMM2 in pairs on 128-row tiles with 128-K stages (the fastest form measured, docs/perf-notes.md step 31)
    # spills 24 bytes at 255 registers, outside its K loop
    # W4A16 GEMM2 in pairs on 128-row tiles at K % 128 != 0 (gpt-oss's 2880: per-block scale bytes) spills 16 bytes
    # under Triton 3.9 (0 under 3.6), outside its K loop
    pairs_128 = r["config"]["pair"] and r["config"]["block_rows"] == 128 and (r["fp8"] or r["k"] % 128)
    # The W4A8 prefill kernel's consumers spill in their epilogue (GEMM2's two m-tiles, up to 236 bytes at K = 2880, at
    # 216-224 registers; 8-64 with one m-tile on 256-row tiles), once per tile, never in the K loop (asserted below)
    # The wide W4A16 tiles with extra rows (a second accumulator) spill outside the K loop: 24 / 48 bytes (GEMM1 /
    # GEMM2) at K = 2880, 120 / 160 with scale words (the reference shape) under Triton 3.6; 3.9: 24 / 40, 88 / 184;
    # on 128 + 32-slot tiles none under 3.6
    extra_rows = r["config"]["extra_rows"] > 0
    budget = {"gluon_ws8": 256}.get(r["kernel"], 192 if extra_rows else 32 if pairs_128 else 0)
    if r["kernel"] != "gluon_ws8" or gluon_validated(triton.__version__):
        assert r["spill_bytes"] <= budget, r
    assert r["k_loop_length"] > 0 and r["k_loop_local"] == 0, r
    # ptxas serializes the asynchronous wgmma pipeline (C7515) when it cannot prove the accumulators and
    # register operands untouched in flight: correct, but the MMAs stop overlapping anything
    assert not r["wgmma_serialized"], r
    # and it does not keep a wgmma's register operand alive until the wait: no instruction may write one of an
    # issued wgmma's operand registers before the wait that retires it (a race the GPU would not report)
    assert not r["operand_overwrites"], r
    assert r["async_copies"] > 0, f"the K loop's loads were not pipelined: {r}"


def test_operand_race_check_flags_writes_before_the_wait():
    """``sm90.operand_races`` on hand-written SASS: a write into an issued wgmma's A registers (R152..R155) before
    the wait that retires its group is flagged (also through a 128-bit load's register span); writes to other
    registers, and to those after the wait, are not."""
    from mxmoe._details.sm90 import operand_races

    def sass(*lines):
        return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines))

    issue = ("WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16], R24",
             "HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR20], R24, gsb0")
    assert operand_races(sass(*issue, "LOP3.LUT R153, R20, 0x81c081c0, RZ, 0xc0, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert operand_races(sass(*issue, "@P0 LDS.128 R150, [R2]", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    second = ("WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R88, R168, gdesc[UR16], R88, gsb0",
              "WARPGROUP.DEPBAR.LE gsb0, 0x1")  # the first group retired, the second (R168..R171) in flight
    assert operand_races(sass(*issue, *second, "HMUL2.BF16_V2 R169, R10, R11"))
    assert not operand_races(sass(*issue, *second, "HMUL2.BF16_V2 R158, R10, R11"))
    assert not operand_races(sass(*issue, "LOP3.LUT R160, R20, 0x81c081c0, RZ, 0xc0, !PT", "STG.E [R2.64], R153",
                                  "WARPGROUP.DEPBAR.LE gsb0, 0x0", "LOP3.LUT R153, R20, 0x81c081c0, RZ, 0xc0, !PT"))


def test_operand_race_check_follows_a_loop_back_edge():
    """A group left in flight at a loop's back edge (``WARPGROUP.DEPBAR.LE gsb0, 0x1`` before the branch) is still
    reading its A registers when the next iteration starts: a write to them at the loop's top is flagged; with the
    loop's wait at 0 it is not."""
    from mxmoe._details.sm90 import operand_races

    def sass(wait):
        lines = ["MOV R152, RZ", ".L_x_1:", "LOP3.LUT R153, R20, 0x81c081c0, RZ, 0xc0, !PT", "WARPGROUP.ARRIVE",
                 "HGMMA.64x32x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0", f"WARPGROUP.DEPBAR.LE gsb0, {wait}",
                 "@P0 BRA `(.L_x_1)", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
        out, i = [], 0
        for line in lines:
            if line.endswith(":"):
                out.append(line)
            else:
                out.append(f"        /*{16 * i:04x}*/                   {line} ;")
                i += 1
        return "\n".join(out)

    assert operand_races(sass("0x1")) == ["/*0010*/ LOP3.LUT R153, R20, 0x81c081c0, RZ, 0xc0, !PT"]
    assert not operand_races(sass("0x0"))


@pytest.mark.parametrize("rows,unit,row_bytes", [(64, 32, 64), (128, 32, 64), (64, 16, 32), (128, 16, 64)])
def test_packed_layout_is_the_prepared_order(rows, unit, row_bytes):
    """Stages wider than a prepared unit (W4A8's 128 K, W4A16 GEMM2 on 16-row tiles) keep their packed bytes in
    shared memory in the prepared order (``prepare.to_row_blocks``: per 64-row block, unit-major), so that a warp's
    copy of 16 rows of one unit is one contiguous run there as in memory: the byte, word and split views the
    small-tile kernel writes and reads through (``sm90_pipeline._packed_layout``) must all map offset o to the same
    (row, byte)."""
    pytest.importorskip("triton.experimental.gluon")
    from mxmoe._details.sm90_pipeline import _packed_layout

    def coords(layout):  # offset -> logical coordinates (the bases of a linear map over GF(2))
        out = []
        for o in range(1 << len(layout.offset_bases)):
            c = [0] * len(layout.offset_bases[0])
            for bit, basis in enumerate(layout.offset_bases):
                if o >> bit & 1:
                    c = [a ^ b for a, b in zip(c, basis)]
            out.append(c)
        return out

    def prepared(r, byte):  # to_row_blocks' byte order within one stage of `rows` rows
        return (r // 64) * 64 * row_bytes + (byte // unit) * 64 * unit + (r % 64) * unit + byte % unit

    as_bytes = coords(_packed_layout(rows, row_bytes, unit))
    assert len(as_bytes) == rows * row_bytes
    assert [prepared(r, c) for r, c in as_bytes] == list(range(rows * row_bytes))
    as_words = coords(_packed_layout(rows, row_bytes // 4, unit // 4))  # int32 words, offsets in words
    assert [prepared(r, 4 * w) for r, w in as_words] == list(range(0, rows * row_bytes, 4))
    nb = row_bytes // 16
    as_split = coords(_packed_layout(rows, row_bytes, unit, 64, (nb, 4, 4)))  # [rows, K32 block, word, byte]
    assert [prepared(r, 16 * b + 4 * q + i) for r, b, q, i in as_split] == list(range(rows * row_bytes))
    # a stage that one unit holds stays row-major (the 64-K stages)
    assert not hasattr(_packed_layout(rows, unit, unit), "offset_bases")
