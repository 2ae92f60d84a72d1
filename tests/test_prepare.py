"""prepare_weights / unprepare_weights / PreparedExperts (SPEC §2 prepared representation)."""
from __future__ import annotations

import re

import pytest
import torch

from mxmoe import PreparedExperts, prepare_weights, quantize_mxfp4, unprepare_weights

E, H, I = 3, 64, 64
LAYOUTS = ["gate_up", "up_gate", "interleaved"]


def to_layout(gate: torch.Tensor, up: torch.Tensor, layout: str) -> torch.Tensor:
    """Build a source w13-shaped tensor (dim 1 = rows) from its gate and up halves."""
    if layout == "gate_up":
        return torch.cat((gate, up), dim=1)
    if layout == "up_gate":
        return torch.cat((up, gate), dim=1)
    out = torch.empty((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), dtype=gate.dtype)
    out[:, 0::2], out[:, 1::2] = gate, up
    return out


def source_in_layout(layout: str, seed: int = 0, biases: bool = True):
    """Random source tensors in ``layout`` plus the gate/up halves they were built from."""
    g = torch.Generator().manual_seed(seed)
    halves = dict(
        w=(torch.randint(0, 256, (E, I, H // 2), generator=g, dtype=torch.uint8),
           torch.randint(0, 256, (E, I, H // 2), generator=g, dtype=torch.uint8)),
        s=(torch.randint(100, 150, (E, I, H // 32), generator=g, dtype=torch.uint8),
           torch.randint(100, 150, (E, I, H // 32), generator=g, dtype=torch.uint8)),
        b=(torch.randn(E, I, generator=g), torch.randn(E, I, generator=g)),
    )
    src = dict(
        w13=to_layout(*halves["w"], layout), w13_scale=to_layout(*halves["s"], layout),
        w2=torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8),
        w2_scale=torch.randint(100, 150, (E, H, I // 32), generator=g, dtype=torch.uint8),
    )
    if biases:
        src["b13"] = to_layout(*halves["b"], layout)
        src["b2"] = torch.randn(E, H, generator=g)
    return src, halves


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.itemsize == 1:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    else:
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu])
@pytest.mark.parametrize("biases", [False, True])
def test_unprepare_round_trips_bit_exact(layout, scale_dtype, biases):
    src, _ = source_in_layout(layout, seed=1, biases=biases)
    src["w13_scale"] = src["w13_scale"].view(scale_dtype)
    src["w2_scale"] = src["w2_scale"].view(scale_dtype)
    experts = prepare_weights(**src, w13_layout=layout)
    back = unprepare_weights(experts)
    assert back["w13_layout"] == layout
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert_bits_equal(back[name], src[name])
    if biases:
        assert torch.equal(back["b13"], src["b13"])
        assert torch.equal(back["b2"], src["b2"])
    else:
        assert "b13" not in back and "b2" not in back


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prepared_w13_is_gate_then_up(layout, decode_f64):
    src, halves = source_in_layout(layout, seed=2)
    experts = prepare_weights(**src, w13_layout=layout)
    gate_w, up_w = halves["w"]
    gate_s, up_s = halves["s"]
    w13, w2 = experts.source_order_weights()
    assert torch.equal(w13, torch.cat((gate_w, up_w), dim=1))
    assert torch.equal(experts.w13_scale.view(torch.uint8), torch.cat((gate_s, up_s), dim=1))
    assert torch.equal(experts.b13, torch.cat(halves["b"], dim=1))
    # decoded values: prepared rows [0, I) are the source's gate rows, [I, 2I) its up rows
    decoded = decode_f64(w13, experts.w13_scale)
    source = decode_f64(src["w13"], src["w13_scale"])
    assert torch.equal(decoded[:, :I], decode_f64(gate_w, gate_s))
    assert torch.equal(decoded[:, I:], decode_f64(up_w, up_s))
    if layout == "interleaved":
        assert torch.equal(decoded[:, :I], source[:, 0::2]) and torch.equal(decoded[:, I:], source[:, 1::2])
    elif layout == "up_gate":
        assert torch.equal(decoded[:, :I], source[:, I:]) and torch.equal(decoded[:, I:], source[:, :I])
    # w2 keeps its rows
    assert torch.equal(w2, src["w2"]) and torch.equal(experts.w2_scale, src["w2_scale"])


def test_prepared_words_place_each_value_pair_for_one_masked_shift():
    """Word q of each prepared K32 block holds K 8j + 2q + c (j = 0..3, c = 0, 1); value pair j's BF16 sign and
    eem bits (sign at 15 + 16c, eem at 8..6 + 16c) are the word masked (j = 0), shifted left by 4 (j = 1),
    rotated left by 10 (j = 2), or shifted left by 6 and right by 2 (j = 3), as the kernels' conversion
    reads them; every bit of the block is used once, and gather_block_bits undoes it."""
    from mxmoe.prepare import from_row_blocks, gather_block_bits, interleave_block_bits

    src, _ = source_in_layout("gate_up", seed=5)
    experts = prepare_weights(**src)
    w = src["w2"]
    rows_major = from_row_blocks(experts.w2)
    assert torch.equal(gather_block_bits(rows_major), w) and torch.equal(interleave_block_bits(w), rows_major)
    codes = torch.stack((w & 15, w >> 4), -1).reshape(*w.shape[:-1], -1)  # K order
    words = rows_major.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mask = 0x81C081C0
    regs = [words & mask, (words << 4) & mask, ((words << 10) | (words >> 22)) & mask,
            ((words << 6) & 0x80C080C0) | ((words >> 2) & 0x01000100)]
    for q in range(4):
        for j in range(4):
            for c in range(2):
                lane = (regs[j][..., q::4] >> (16 * c)) & 0xFFFF
                got = ((lane >> 12) & 8) | ((lane >> 6) & 7)
                assert torch.equal(got.to(torch.uint8), codes[..., 8 * j + 2 * q + c::32])
    for bit in range(128):  # a single source bit lands on a single prepared bit
        one = torch.zeros(1, 16, dtype=torch.uint8)
        one[0, bit // 8] = 1 << (bit % 8)
        assert sum(bin(int(b)).count("1") for b in interleave_block_bits(one)[0]) == 1


def test_row_blocks_place_each_byte_at_its_documented_offset():
    """to_row_blocks puts byte c of row r of expert e at e*rows*K/2 + r0*K/2 + (c//U)*h*U + (r-r0)*U + c%U
    (r0 = 64*(r//64), h = min(64, rows - r0): the last block of an expert may be shorter; U = 32 bytes where
    K % 64 == 0, else 16), which is how the kernels address it; from_row_blocks
    inverts it; rows that fill whole blocks and rows that do not, every unit width."""
    from mxmoe.prepare import from_row_blocks, row_block_unit, to_row_blocks

    assert [row_block_unit(k) for k in (128, 4096, 2880, 64, 96, 32)] == [32, 32, 32, 32, 16, 16]
    for E_, rows, kb in ((2, 128, 48), (3, 100, 32), (1, 40, 16), (2, 64, 16), (2, 130, 64), (1, 70, 192)):
        src = torch.arange(E_ * rows * kb, dtype=torch.int64)
        t = (src % 251).to(torch.uint8).reshape(E_, rows, kb)
        blocked = to_row_blocks(t)
        assert blocked.shape == t.shape and torch.equal(from_row_blocks(blocked), t)
        flat = blocked.reshape(-1)
        e, r, c = torch.meshgrid(torch.arange(E_), torch.arange(rows), torch.arange(kb), indexing="ij")
        r0 = (r // 64) * 64
        h = torch.clamp(rows - r0, max=64)
        u = row_block_unit(2 * kb)
        off = e * rows * kb + r0 * kb + (c // u) * h * u + (r - r0) * u + c % u
        assert torch.equal(flat[off.reshape(-1)], t.reshape(-1)), (E_, rows, kb)


def test_prepared_properties_and_global_scales():
    src, _ = source_in_layout("gate_up", seed=3)
    g13, g2 = torch.rand(E) + 0.5, torch.rand(E) + 0.5
    experts = prepare_weights(**src, w13_global_scale=g13, w2_global_scale=g2)
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (E, H, I)
    assert experts.device == torch.device("cpu")
    assert torch.equal(experts.w13_global_scale, g13) and torch.equal(experts.w2_global_scale, g2)
    moved = experts.to("cpu")
    assert isinstance(moved, PreparedExperts) and torch.equal(moved.w13, experts.w13)
    assert moved.source_layout == "gate_up"


# ----------------------------------------------------------------------------- memory


def test_memory_reports_4_25_bits_per_weight():
    src, _ = source_in_layout("gate_up", seed=4, biases=False)
    mem = prepare_weights(**src).memory()
    n_weights = E * (2 * I * H + H * I)
    assert mem["weights"] == n_weights // 2
    assert mem["scales"] == n_weights // 32
    assert mem["bits_per_weight"] == pytest.approx(4.25)
    assert mem["row_metadata"] == E * (2 * I + H) * 4 + 2 * E * 4  # an int32 reference per row, 2 fold flags per expert
    assert 4.25 < mem["bits_per_weight_all"] < 5.5
    assert mem["total"] == mem["weights"] + mem["scales"] + mem["row_metadata"] + mem["biases"]


# ----------------------------------------------------------------------------- row spans


@pytest.mark.parametrize("span", [0, 1, 14, 15, 30, 100])
def test_row_ref_for_hand_made_spans(span):
    # K = 128: four scale blocks per row, so the span sits between blocks 1 and 3
    h, i = 128, 128
    w13 = torch.full((1, 2 * i, h // 2), 0x22, dtype=torch.uint8)  # nonzero blocks: their bytes set the reference
    w2 = torch.full((1, h, i // 2), 0x22, dtype=torch.uint8)
    s13 = torch.full((1, 2 * i, h // 32), 120, dtype=torch.uint8)
    s2 = torch.full((1, h, i // 32), 120, dtype=torch.uint8)
    lo = 60
    # interleaved source row 5 is up row 2 -> prepared row i + 2
    s13[0, 5] = lo
    s13[0, 5, 3] = lo + span
    s13[0, 5, 0] = lo + span // 2  # an interior value changes nothing
    s2[0, 7] = lo
    s2[0, 7, 1] = lo + span
    experts = prepare_weights(w13, s13, w2, s2, w13_layout="interleaved")
    assert experts.w13_ref.dtype == torch.int32 and experts.w2_ref.dtype == torch.int32
    assert experts.w13_ref[0, i + 2].item() == lo + span
    assert experts.w2_ref[0, 7].item() == lo + span
    others = torch.ones(2 * i, dtype=torch.bool)
    others[i + 2] = False
    assert (experts.w13_ref[0, others] == 120).all()


def _one_row_experts(blocks: list, codes: int = 0x22, experts: int = 2):
    """Experts whose w2 row 0 of expert 0 has the given per-block (scale byte, nonzero?) pairs; everything else folds."""
    h, i = 64, 32 * len(blocks)
    w13 = torch.full((experts, 2 * i, h // 2), codes, dtype=torch.uint8)
    s13 = torch.full((experts, 2 * i, h // 32), 120, dtype=torch.uint8)
    w2 = torch.full((experts, h, i // 2), codes, dtype=torch.uint8)
    s2 = torch.full((experts, h, i // 32), 120, dtype=torch.uint8)
    for blk, (byte, nonzero) in enumerate(blocks):
        s2[0, 0, blk] = byte
        w2[0, 0, 16 * blk:16 * blk + 16] = codes if nonzero else 0x88  # 0x88: two negative zeros
    return prepare_weights(w13, s13, w2, s2)


@pytest.mark.parametrize("span, folds", [(0, True), (11, True), (12, False), (30, False)])
def test_fold_flag_follows_the_e4m3_window(span, folds):
    """An expert folds (W4A8 fast path) while every nonzero block is at most 11 binades below its row's largest scale
    (E4M3 normals hold E2M1 * 2**d for d in [-5, 6])."""
    from mxmoe.prepare import fold_report

    ex = _one_row_experts([(200, True), (200 - span, True), (199, True)])
    assert ex.w2_fold.tolist() == [int(folds), 1]
    assert ex.w13_fold.tolist() == [1, 1]
    assert ex.all_fold == folds
    assert fold_report(ex) == dict(w13=1.0, w2=0.5 + 0.5 * folds, both=0.5 + 0.5 * folds)


def test_fold_flag_ignores_blocks_of_zeros():
    """A block of (signed) zeros converts exactly whatever its scale byte, also byte 0 beside byte 254."""
    ex = _one_row_experts([(254, True), (0, False), (120, False)])
    assert ex.w2_fold.tolist() == [1, 1] and ex.all_fold
    ex = _one_row_experts([(254, True), (0, True)])
    assert ex.w2_fold.tolist() == [0, 1] and not ex.all_fold


def test_zero_blocks_bytes_do_not_set_the_row_reference():
    """Found by ``mxmoe check --fuzz``: a block of zeros with a large byte (252) set its row's reference, leaving the
    row's real blocks ~130 binades below it (W4A16: BF16 subnormals, 3-6 % wrong; W4A8: the expert off the fast path).
    Its byte is lowered to the row's largest nonzero block's; a row of zeros gets at most 127 (W4A8's exact path
    scaled the zeros by 2^124 and overflowed). Unprepare still gives the source bytes."""
    ex = _one_row_experts([(120, True), (252, False), (118, True), (0, False)])
    assert ex.w2_scale[0, 0].tolist() == [120, 120, 118, 0]
    assert ex.w2_ref[0, 0].item() == 120
    assert ex.w2_fold.tolist() == [1, 1] and ex.all_fold
    zeros = _one_row_experts([(244, False), (251, False), (100, False)])
    assert zeros.w2_scale[0, 0].tolist() == [127, 127, 100] and zeros.w2_ref[0, 0].item() == 127
    for experts, source in ((ex, [120, 252, 118, 0]), (zeros, [244, 251, 100])):
        back = unprepare_weights(experts)
        assert back["w2_scale"][0, 0].tolist() == source
        assert experts.w2_scale_restore.shape[1] == 2 and experts.w13_scale_restore.numel() == 0


def test_zero_block_bytes_are_restored_in_every_w13_layout():
    """The lowered bytes of w13 come back at their source rows whatever the row layout."""
    gen = torch.Generator().manual_seed(3)
    for layout in ("gate_up", "up_gate", "interleaved"):
        w13 = torch.randint(0, 256, (2, 64, 32), generator=gen, dtype=torch.uint8)
        s13 = torch.randint(110, 130, (2, 64, 2), generator=gen, dtype=torch.uint8)
        w13[1, 5, :16] = 0x80  # a zero block (one negative zero)
        s13[1, 5, 0] = 250
        w2 = torch.full((2, 64, 16), 0x22, dtype=torch.uint8)
        s2 = torch.full((2, 64, 1), 120, dtype=torch.uint8)
        ex = prepare_weights(w13, s13, w2, s2, w13_layout=layout)
        assert ex.w13_scale_restore.shape[0] == 1 and int(ex.w13_scale.max()) < 250
        back = unprepare_weights(ex)
        assert torch.equal(back["w13_scale"], s13) and torch.equal(back["w13"], w13)


def test_gaussian_and_heavy_tailed_weights_fold():
    """The issue's realistic cases: weights quantized from Gaussian rows and from Student-t (3 degrees of freedom) rows
    with outlier columns all take the fast path."""
    gen = torch.Generator().manual_seed(0)
    t3 = torch.distributions.StudentT(3.0)
    for make in (lambda *s: torch.randn(*s, generator=gen), lambda *s: t3.sample(s)):
        w13, s13 = quantize_mxfp4(make(4, 128, 256))
        w2, s2 = quantize_mxfp4(make(4, 256, 64))
        assert prepare_weights(w13, s13, w2, s2).all_fold


def test_row_ref_is_largest_scale_byte():
    src, _ = source_in_layout("up_gate", seed=5)
    experts = prepare_weights(**src, w13_layout="up_gate")
    assert torch.equal(experts.w13_ref, experts.w13_scale.amax(-1).to(torch.int32))
    assert torch.equal(experts.w2_ref, src["w2_scale"].amax(-1).to(torch.int32))


# ----------------------------------------------------------------------------- errors


def _bad(**changes):
    def make():
        src, _ = source_in_layout("gate_up", seed=6)
        src.update({k: (v(src) if callable(v) else v) for k, v in changes.items()})
        return src
    return make


def _with_255(t):
    t = t.clone()
    t[1, 2, 0] = 255
    return t


BAD_INPUTS = [
    ("w13", TypeError, _bad(w13=lambda s: s["w13"].numpy())),
    ("w13", TypeError, _bad(w13=lambda s: s["w13"].to(torch.int8))),
    ("w13", ValueError, _bad(w13=lambda s: s["w13"][0])),
    ("w13", ValueError, _bad(w13=lambda s: s["w13"][:, :, :12].contiguous(), w13_scale=lambda s: s["w13_scale"][:, :, :1].contiguous())),  # K = 24
    ("w13", ValueError, _bad(w13=lambda s: s["w13"][:, :-1].contiguous(), w13_scale=lambda s: s["w13_scale"][:, :-1].contiguous())),  # odd rows
    ("w13_scale", ValueError, _bad(w13_scale=lambda s: s["w13_scale"][:, :, :1].contiguous())),
    ("w13_scale", TypeError, _bad(w13_scale=lambda s: s["w13_scale"].float())),
    ("w13_scale", ValueError, _bad(w13_scale=lambda s: _with_255(s["w13_scale"]))),
    ("w2", TypeError, _bad(w2=lambda s: s["w2"].to(torch.int16))),
    ("w2", ValueError, _bad(w2=lambda s: s["w2"][:, :-1].contiguous(), w2_scale=lambda s: s["w2_scale"][:, :-1].contiguous())),
    ("w2", ValueError, _bad(w2=lambda s: s["w2"][:-1].contiguous(), w2_scale=lambda s: s["w2_scale"][:-1].contiguous())),
    ("w2", ValueError, _bad(w2=lambda s: s["w2"][:, :, :16].contiguous(), w2_scale=lambda s: s["w2_scale"][:, :, :1].contiguous())),
    ("w2_scale", ValueError, _bad(w2_scale=lambda s: s["w2_scale"][:, :, :1].contiguous())),
    ("w2_scale", ValueError, _bad(w2_scale=lambda s: _with_255(s["w2_scale"]))),
    ("w2_scale", ValueError, _bad(w2_scale=lambda s: _with_255(s["w2_scale"]).view(torch.float8_e8m0fnu))),
    ("b13", ValueError, _bad(b13=lambda s: s["b13"][:, :-1])),
    ("b13", TypeError, _bad(b13=lambda s: s["b13"].long())),
    ("b2", ValueError, _bad(b2=lambda s: s["b2"][:-1])),
    ("w13_global_scale", ValueError, _bad(w13_global_scale=torch.ones(E + 1))),
    ("w2_global_scale", TypeError, _bad(w2_global_scale=torch.ones(E, dtype=torch.int32))),
]


@pytest.mark.parametrize("name,exc,make", BAD_INPUTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_INPUTS)])
def test_prepare_errors_name_the_argument(name, exc, make):
    with pytest.raises(exc) as info:
        prepare_weights(**make())
    assert re.search(rf"\b{name}\b", str(info.value)), str(info.value)


def test_prepare_rejects_k_not_multiple_of_32_in_w2():
    # I = 48: w13 rows are fine (H = 64), w2's K = I is not a multiple of 32
    w13 = torch.zeros(1, 96, 32, dtype=torch.uint8)
    s13 = torch.full((1, 96, 2), 127, dtype=torch.uint8)
    w2 = torch.zeros(1, 64, 24, dtype=torch.uint8)
    s2 = torch.full((1, 64, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\bw2\b.*32"):
        prepare_weights(w13, s13, w2, s2)


def test_prepare_rejects_unknown_layout():
    src, _ = source_in_layout("gate_up", seed=7)
    with pytest.raises(ValueError, match=r"\bw13_layout\b"):
        prepare_weights(**src, w13_layout="gate-up")


def test_experts_of_another_layout_version_are_refused():
    """A PreparedExperts from another byte layout (e.g. unpickled from an older mxmoe) is refused by
    fused_moe and unprepare_weights, before any work."""
    import dataclasses
    import pickle

    import mxmoe
    from mxmoe.prepare import LAYOUT_VERSION

    src, _ = source_in_layout("gate_up", seed=6)
    experts = prepare_weights(**src)
    assert experts.layout_version == LAYOUT_VERSION
    assert pickle.loads(pickle.dumps(experts)).layout_version == LAYOUT_VERSION
    old = dataclasses.replace(experts, layout_version=LAYOUT_VERSION - 1)
    x = torch.randn(2, experts.hidden_size).bfloat16()
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="layout version"):
        mxmoe.fused_moe(x, old, torch.ones(2, 1), ids)
    with pytest.raises(ValueError, match="layout version"):
        unprepare_weights(old)
    del old.__dict__["layout_version"]  # as unpickled from before the field existed
    with pytest.raises(ValueError, match="layout version 1"):
        unprepare_weights(old)
