"""Helpers of the device scripts: random prepared experts (seeded: every script and run sees the same
weights), config variants as overrides and per-kernel times."""

import mxmoe
from mxmoe import testing
from mxmoe._details import launch
from mxmoe._details.config import overrides
from mxmoe.selection import plan_layer
# the device scripts' per-kernel times: the bench's (torch profiler, median per kernel over 5 calls after an
# unrecorded one; raises if the calls launched different kernels)
from mxmoe.bench import kernel_times

__all__ = ["kernel_times", "random_experts", "run", "variant"]


def random_experts(E, H, I, lo=118, hi=122, wide=False, biases=False):
    """``testing.random_code_sources`` on the GPU (seed 0), scale bytes in [lo, hi], prepared; ``wide``: each row's
    blocks span 30 binades; ``biases``: random b13 and b2."""
    return mxmoe.prepare_weights(**testing.random_code_sources(E, H, I, device="cuda", scale_lo=lo, scale_hi=hi,
                                                               wide_span=wide, biases=biases))


def variant(v):
    """The config overrides of a variant, as a context: flat (``{...}``: both GEMMs) or ``{"g1": {...}, "g2":
    {...}}`` (each GEMM its own), on top of what ``config.gemm_config`` picks."""
    if "g1" in v or "g2" in v:
        return overrides(gemm1=v.get("g1", {}), gemm2=v.get("g2", {}))
    return overrides(gemm=v)


def run(x, experts, w, ids, precision, out, workspace, activation="silu"):
    """``launch.run_fused_moe`` (no validation, the current overrides) on ``precision`` (w4a16 / w4a8) with
    ``activation``'s default limit and alpha, also under graph capture (where the library's entries run W4A16)."""
    plan = plan_layer(ids.numel(), precision=precision, activation=activation, capturing=False)
    launch.run_fused_moe(x, experts, w, ids, plan, None, out, workspace)
