"""Helpers of the device scripts: random prepared experts (seeded: every script and run sees the same
weights), per-GEMM config overrides and per-kernel times."""
import torch

import mxmoe
from mxmoe._details import launch
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


def per_gemm_overrides():
    """Route ``launch.gemm_config`` through per-GEMM overrides; returns ``select(variant)``, which takes a
    variant (flat: one ``config_override`` for both GEMMs, as ``run_fused_moe`` applies it; or ``{"g1":
    {...}, "g2": {...}}``: each GEMM its own, on top of what ``gemm_config`` picks) and returns the
    ``config_override`` to pass to ``run_fused_moe``."""
    current: dict = {}
    default = launch.gemm_config

    def gemm_config(rows, num_experts, n, k, fp8, override=None, kernel="triton", gemm1=True, sm_count=0):
        if current:
            override = current.get("g1" if gemm1 else "g2")
        return default(rows, num_experts, n, k, fp8, dict(override or {}) or None, kernel=kernel, gemm1=gemm1,
                       sm_count=sm_count)

    def select(variant):
        current.clear()
        if "g1" in variant or "g2" in variant:
            current.update(variant)
            return {}
        return dict(variant)

    launch.gemm_config = gemm_config
    return select
