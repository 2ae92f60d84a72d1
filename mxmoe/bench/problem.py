"""Bench problems: shapes, token lists, inputs and the floor of an arm on them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import testing



# --------------------------------------------------------------------------------------
# Shapes and token lists
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    E: int
    H: int
    I: int
    top_k: int

    def flops(self, T: int) -> float:
        """FLOPs of the layer for ``T`` tokens: ``T*top_k*(2*H*2I + 2*I*H)``."""
        return float(T) * self.top_k * (2 * self.H * 2 * self.I + 2 * self.I * self.H)

    @property
    def expert_bytes(self) -> int:
        """MXFP4 bytes of one expert: packed E2M1 plus UE8M0 scales of w13 and w2."""
        weights = 3 * self.I * self.H  # 2I*H + H*I elements
        return weights // 2 + weights // 32

    def bytes(self, T: int, distinct_experts: int) -> float:
        """Bytes a perfect kernel moves: touched experts once + x in (BF16) + out (BF16) + routing."""
        return float(distinct_experts * self.expert_bytes + 2 * T * self.H * 2 + T * self.top_k * 8)

    def __str__(self) -> str:
        return f"E={self.E},H={self.H},I={self.I},top_k={self.top_k}"


PRESETS = {
    "ref": Shape(288, 4096, 1024, 8),
    "gpt-oss-120b": Shape(128, 2880, 2880, 4),
    "gpt-oss-20b": Shape(32, 2880, 2880, 4),
    "deepseek": Shape(256, 7168, 2048, 8),
    "ktail": Shape(128, 2880, 2880, 4),  # gpt-oss-120b's, by its K tail (2880 is not a multiple of 128)
}
PRESET_HELP = ("ref: E=288,H=4096,I=1024,top_k=8; gpt-oss-120b (alias ktail): 128,2880,2880,4; gpt-oss-20b: "
               "32,2880,2880,4; deepseek: 256,7168,2048,8")
DEFAULT_TOKENS = (1, 16, 64, 1024, 2048, 4096, 8192)
ROUNDS = 3
SAMPLES = 30
GRAPH_MAX_ROWS = 1024  # graph-replay timing when T * top_k <= this


def parse_shape(text: str) -> Shape:
    """``"E,H,I,top_k"`` -> :class:`Shape`; ``ValueError`` with the reason otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 4:
        raise ValueError(f"shape must be E,H,I,top_k (four integers), got {text!r}")
    try:
        E, H, I, k = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape must be E,H,I,top_k (four integers), got {text!r}") from None
    if min(E, H, I, k) < 1:
        raise ValueError(f"shape values must be positive, got {text!r}")
    if H % 32 or I % 32:
        raise ValueError(f"H and I must be multiples of 32 (the K32 block), got H={H}, I={I}")
    if k > E:
        raise ValueError(f"top_k ({k}) cannot exceed the number of experts ({E})")
    return Shape(E, H, I, k)


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``: positive integers, duplicates dropped, order kept."""
    out: list[int] = []
    for p in str(text).split(","):
        p = p.strip()
        if not p:
            continue
        try:
            t = int(p)
        except ValueError:
            raise ValueError(f"token counts must be positive integers, got {p!r}") from None
        if t < 1:
            raise ValueError(f"token counts must be positive integers, got {t}")
        if t not in out:
            out.append(t)
    if not out:
        raise ValueError("no token counts given")
    return tuple(out)



@dataclass
class Inputs:
    T: int
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    distinct_experts: int


def make_inputs(shape: Shape, T: int, device: torch.device, seed: int) -> Inputs:
    """Fresh random activations and a uniform softmax-top-k routing for ``T`` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + T)
    x = torch.randn(T, shape.H, generator=gen, device=device).to(torch.bfloat16)
    w, ids, _, _ = testing.make_routing("uniform", T, shape.E, shape.top_k, seed=seed + T, device=device)
    return Inputs(T=T, x=x, topk_weights=w, topk_ids=ids, distinct_experts=int(torch.unique(ids).numel()))


def _floor_ms(shape: Shape, inp: Inputs, rate: str, floors: Optional[dict]) -> Optional[float]:
    if not floors:
        return None
    tflops = floors.get(f"{rate}_tflops") or floors.get("bf16_tflops")
    bw = floors.get("copy_gbps")
    if not tflops or not bw:
        return None
    return max(shape.flops(inp.T) / (tflops * 1e9), shape.bytes(inp.T, inp.distinct_experts) / (bw * 1e6))
