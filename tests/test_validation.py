"""fused_moe input validation on CPU tensors (SPEC §7): errors name the argument, `out` untouched."""
from __future__ import annotations

import math
import re

import pytest
import torch

import mxmoe
from mxmoe import fused_moe, fused_moe_reference, prepare_weights
from mxmoe.selection import ENV_MIN_ROWS

E, H, I, T, TOP_K = 4, 64, 32, 5, 2
SENTINEL = 1234.0  # exactly representable in BF16


@pytest.fixture(autouse=True)
def cpu_reference_backend(no_triton_interpret, monkeypatch):
    monkeypatch.delenv(ENV_MIN_ROWS, raising=False)


@pytest.fixture
def experts(make_source):
    return prepare_weights(**make_source(E, H, I, seed=30, biases=True))


def valid_args(experts):
    g = torch.Generator().manual_seed(31)
    return dict(
        x=torch.randn(T, H, generator=g).to(torch.bfloat16),
        experts=experts,
        topk_weights=torch.rand(T, TOP_K, generator=g),
        topk_ids=torch.randint(0, E, (T, TOP_K), generator=g, dtype=torch.int32),
    )


def sentinel_out(shape=(T, H), dtype=torch.bfloat16):
    return torch.full(shape, SENTINEL, dtype=dtype)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape[::-1], dtype=t.dtype).t()
    out.copy_(t)
    assert not out.is_contiguous()
    return out


# (argument named in the message, exception, change to the valid arguments)
BAD = [
    ("x", TypeError, lambda a: dict(x=a["x"].float())),
    ("x", TypeError, lambda a: dict(x=a["x"].half())),
    ("x", TypeError, lambda a: dict(x=a["x"].tolist())),
    ("x", ValueError, lambda a: dict(x=a["x"][0])),
    ("x", ValueError, lambda a: dict(x=a["x"].unsqueeze(0))),
    ("x", ValueError, lambda a: dict(x=a["x"][:, :32].contiguous())),
    ("x", ValueError, lambda a: dict(x=non_contiguous(a["x"]))),
    ("x", ValueError, lambda a: dict(x=a["x"].to("meta"))),
    ("topk_ids", TypeError, lambda a: dict(topk_ids=a["topk_ids"].to(torch.int16))),
    ("topk_ids", TypeError, lambda a: dict(topk_ids=a["topk_ids"].float())),
    ("topk_ids", TypeError, lambda a: dict(topk_ids=a["topk_ids"].to(torch.uint8))),
    ("topk_ids", ValueError, lambda a: dict(topk_ids=a["topk_ids"].reshape(-1))),
    ("topk_ids", ValueError, lambda a: dict(topk_ids=a["topk_ids"][:-1].contiguous(), topk_weights=a["topk_weights"][:-1].contiguous())),
    ("topk_ids", ValueError, lambda a: dict(topk_ids=non_contiguous(a["topk_ids"]))),
    ("topk_ids", ValueError, lambda a: dict(topk_ids=a["topk_ids"][:, :0].contiguous(), topk_weights=a["topk_weights"][:, :0].contiguous())),
    ("topk_weights", TypeError, lambda a: dict(topk_weights=a["topk_weights"].half())),
    ("topk_weights", TypeError, lambda a: dict(topk_weights=a["topk_weights"].double())),
    ("topk_weights", ValueError, lambda a: dict(topk_weights=a["topk_weights"][:, :1].contiguous())),
    ("topk_weights", ValueError, lambda a: dict(topk_weights=a["topk_weights"].reshape(-1))),
    ("topk_weights", ValueError, lambda a: dict(topk_weights=non_contiguous(a["topk_weights"]))),
    ("expert_map", TypeError, lambda a: dict(expert_map=torch.arange(E, dtype=torch.int64))),
    ("expert_map", TypeError, lambda a: dict(expert_map=torch.arange(E).float())),
    ("expert_map", ValueError, lambda a: dict(expert_map=torch.arange(E, dtype=torch.int32).reshape(2, 2))),
    ("expert_map", ValueError, lambda a: dict(expert_map=torch.zeros(0, dtype=torch.int32))),
    ("activation", ValueError, lambda a: dict(activation="gelu")),
    ("activation", ValueError, lambda a: dict(activation="SiLU")),
    ("swiglu_limit", ValueError, lambda a: dict(swiglu_limit=-1.0)),
    ("swiglu_limit", ValueError, lambda a: dict(swiglu_limit=0.0)),
    ("swiglu_limit", ValueError, lambda a: dict(swiglu_limit=math.nan)),
    ("swiglu_limit", ValueError, lambda a: dict(swiglu_limit=math.inf)),
    ("swiglu_limit", ValueError, lambda a: dict(swiglu_limit="7")),
    ("swiglu_alpha", ValueError, lambda a: dict(swiglu_alpha=1.702)),  # with the default activation, silu
    ("swiglu_alpha", ValueError, lambda a: dict(activation="swigluoai", swiglu_alpha=math.nan)),
    ("out", ValueError, lambda a: dict(out=sentinel_out((T, H + 32)))),
    ("out", ValueError, lambda a: dict(out=sentinel_out((T + 1, H)))),
    ("out", ValueError, lambda a: dict(out=sentinel_out((T * H,)))),
    ("out", TypeError, lambda a: dict(out=sentinel_out(dtype=torch.float32))),
    ("out", TypeError, lambda a: dict(out=sentinel_out(dtype=torch.float16))),
    ("out", ValueError, lambda a: dict(out=non_contiguous(sentinel_out()))),
    ("out", ValueError, lambda a: dict(out=a["x"])),  # aliasing x
    ("experts", TypeError, lambda a: dict(experts=mxmoe.unprepare_weights(a["experts"]))),
    ("experts", TypeError, lambda a: dict(experts=None)),
    ("precision", ValueError, lambda a: dict(precision="fp8")),
    ("precision", ValueError, lambda a: dict(precision="W4A16")),
]


@pytest.mark.parametrize("name,exc,change", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_input_names_the_argument_and_leaves_out_untouched(experts, name, exc, change):
    args = valid_args(experts)
    args.update(change(args))
    out = args.setdefault("out", sentinel_out())
    out_before = out.clone()
    x_before = args["x"].clone() if isinstance(args["x"], torch.Tensor) else None
    with pytest.raises(exc) as info:
        fused_moe(**args)
    assert re.search(rf"\b{name}\b", str(info.value)), str(info.value)
    if out.device.type != "meta":
        assert torch.equal(out, out_before)
    if x_before is not None and args["x"].device.type != "meta":
        assert torch.equal(args["x"], x_before)


def test_valid_arguments_do_not_raise(experts):
    """The baseline every BAD case changes is itself valid (so each case tests one thing)."""
    args = valid_args(experts)
    out = sentinel_out()
    result = fused_moe(**args, out=out)
    assert result is out
    assert not torch.equal(out, sentinel_out())


def test_malformed_env_raises_before_writing(experts, monkeypatch):
    monkeypatch.setenv(ENV_MIN_ROWS, "many")
    out = sentinel_out()
    with pytest.raises(ValueError, match=ENV_MIN_ROWS):
        fused_moe(**valid_args(experts), out=out)
    assert torch.equal(out, sentinel_out())


# ----------------------------------------------------------------------------- accepted variants and return_precision


@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
def test_return_precision_explicit(experts, precision):
    args = valid_args(experts)
    out = sentinel_out()
    result, ran = fused_moe(**args, precision=precision, out=out, return_precision=True)
    assert ran == precision
    assert result is out
    ref = fused_moe_reference(args["x"], experts, args["topk_weights"], args["topk_ids"], mode=precision)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("env_value,expected", [(None, "w4a16"), ("0", "w4a16"), (str(T * TOP_K + 1), "w4a16"), (str(T * TOP_K), "w4a8")])
def test_return_precision_auto_follows_env(experts, monkeypatch, env_value, expected):
    if env_value is not None:
        monkeypatch.setenv(ENV_MIN_ROWS, env_value)
    args = valid_args(experts)
    result, ran = fused_moe(**args, return_precision=True)
    assert ran == expected
    assert result.dtype == torch.bfloat16 and result.shape == (T, H)
    ref = fused_moe_reference(args["x"], experts, args["topk_weights"], args["topk_ids"], mode=expected)
    assert torch.equal(result, ref)
    plain = fused_moe(**args)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, result)


def test_accepted_variants(experts):
    """int64 ids, BF16 weights, expert_map and swigluoai parameters all run."""
    args = valid_args(experts)
    args["topk_ids"] = args["topk_ids"].long()
    args["topk_weights"] = args["topk_weights"].to(torch.bfloat16)
    expert_map = torch.tensor([3, -1, 0, 1, 2, -1], dtype=torch.int32)
    out = fused_moe(**args, activation="swigluoai", swiglu_limit=5, swiglu_alpha=1.5, expert_map=expert_map)
    ref = fused_moe_reference(args["x"], experts, args["topk_weights"], args["topk_ids"], activation="swigluoai",
                              swiglu_limit=5, swiglu_alpha=1.5, expert_map=expert_map, mode="w4a16")
    assert torch.equal(out, ref)


def test_bool_limit_and_overlapping_out_rejected(no_triton_interpret):
    from mxmoe.format import quantize_mxfp4

    E, H, I = 2, 64, 32
    p13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, H))
    p2, s2 = quantize_mxfp4(torch.randn(E, H, I))
    ex = mxmoe.prepare_weights(p13, s13, p2, s2)
    buf = torch.randn(5, H).bfloat16()
    x = buf[:4]
    ids = torch.zeros(4, 1, dtype=torch.int32)
    w = torch.ones(4, 1)
    with pytest.raises(ValueError, match="swiglu_limit"):
        mxmoe.fused_moe(x, ex, w, ids, swiglu_limit=True)
    with pytest.raises(ValueError, match="out"):
        mxmoe.fused_moe(x, ex, w, ids, out=buf[1:5])  # shares rows 1..3 with x


@pytest.mark.parametrize("change, names", [
    (dict(max_tokens=T - 1), f"it holds {T - 1} tokens, this call has {T}"),
    (dict(top_k=1), "it holds top_k 1, this call has top_k 2"),
])
def test_too_small_workspace_raises_on_the_emulation_path_too(experts, change, names):
    """The CPU emulation reads no workspace, but a call that would not fit it on the kernels raises the same
    ValueError, naming what is too small and nothing else (not ``fp8=``), before writing ``out``."""
    a = valid_args(experts)
    x, w, ids = a["x"], a["topk_weights"], a["topk_ids"]
    kw = dict(max_tokens=T, top_k=ids.shape[1])
    kw.update(change)
    ws = mxmoe.Workspace(experts, kw.pop("max_tokens"), kw.pop("top_k"))
    out = sentinel_out()
    with pytest.raises(ValueError) as err:
        fused_moe(x, experts, w, ids, workspace=ws, out=out)
    assert str(err.value) == "workspace does not fit this call: " + names
    assert "fp8" not in str(err.value)
    assert torch.equal(out, sentinel_out())
    fused_moe(x[: T - 1], experts, w[: T - 1, :1].contiguous(), ids[: T - 1, :1].contiguous(), workspace=ws)  # fits


def test_workspace_without_w4a8_scratch_names_it(experts):
    a = valid_args(experts)
    x, w, ids = a["x"], a["topk_weights"], a["topk_ids"]
    ws = mxmoe.Workspace(experts, T, ids.shape[1], fp8=False)
    fused_moe(x, experts, w, ids, workspace=ws, precision="w4a16")
    with pytest.raises(ValueError, match=r"^workspace does not fit this call: this call runs W4A8 and it has no W4A8"):
        fused_moe(x, experts, w, ids, workspace=ws, precision="w4a8")
    with pytest.raises(TypeError, match="workspace must be a mxmoe.Workspace"):
        fused_moe(x, experts, w, ids, workspace=object())
