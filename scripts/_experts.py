"""Helpers of the device scripts: random prepared experts (seeded: every script and run sees the same
weights), config variants as overrides and per-kernel times."""
import torch

import mxmoe
from mxmoe._details import launch
from mxmoe._details.config import overrides
from mxmoe.selection import plan_layer
# the device scripts' per-kernel times: the bench's (torch profiler, median per kernel over 5 calls after an
# unrecorded one; raises if the calls launched different kernels)
from mxmoe.bench import kernel_times  # noqa: F401


def random_experts(E, H, I, lo=118, hi=122, wide=False, biases=False):
    """Random E2M1 bytes, scale bytes uniform in [lo, hi]; ``wide``: each row's blocks span 30 binades
    (byte 126 + {0, -10, -20, -30} by block); ``biases``: random b13 and b2."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8, device="cuda")
    s13 = torch.randint(lo, hi + 1, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8, device="cuda")
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8, device="cuda")
    s2 = torch.randint(lo, hi + 1, (E, H, I // 32), generator=g, dtype=torch.uint8, device="cuda")
    if wide:
        offs = torch.tensor([0, -10, -20, -30], dtype=torch.int16, device="cuda")
        s13 = (126 + offs[torch.arange(H // 32, device="cuda") % 4]).to(torch.uint8).expand(E, 2 * I, H // 32).contiguous()
        s2 = (126 + offs[torch.arange(I // 32, device="cuda") % 4]).to(torch.uint8).expand(E, H, I // 32).contiguous()
    kw = {}
    if biases:
        kw = dict(b13=torch.randn(E, 2 * I, generator=g, device="cuda"), b2=torch.randn(E, H, generator=g, device="cuda"))
    return mxmoe.prepare_weights(w13, s13, w2, s2, **kw)


def variant(v):
    """The config overrides of a variant, as a context: flat (``{...}``: both GEMMs) or ``{"g1": {...}, "g2":
    {...}}`` (each GEMM its own), on top of what ``config.gemm_config`` picks."""
    if "g1" in v or "g2" in v:
        return overrides(gemm1=v.get("g1", {}), gemm2=v.get("g2", {}))
    return overrides(gemm=v)


def run(x, experts, w, ids, precision, out, workspace, activation="silu"):
    """``launch.run_fused_moe`` (no validation, the current overrides) on ``precision`` (w4a16 / w4a8) with
    ``activation``'s default limit and alpha."""
    plan = plan_layer(ids.numel(), precision=precision, activation=activation)
    launch.run_fused_moe(x, experts, w, ids, plan, None, out, workspace)
