"""mxmoe: fused MXFP4 (E2M1-K32) Mixture-of-Experts kernels for Hopper.

Data flow, one module per stage: ``format`` (E2M1-K32) -> ``prepare`` (PreparedExperts)
-> ``routing`` (route pack) -> FP8 rows, GEMM1 + activation, GEMM2, top-k sum (the kernels in ``_details``, in a
``workspace``), behind the public entry ``fused_moe`` in ``moe`` (which calls the custom op
``torch.ops.mxmoe.fused_moe`` of ``op``) and the module ``MoEExperts`` in ``module``.
"""
from .format import dequantize_mxfp4, quantize_mxfp4
from .gpt_oss import gpt_oss_router, load_gpt_oss_experts
from .moe import fused_moe
from .module import MoEExperts
from .prepare import PreparedExperts, prepare_weights, unprepare_weights
from .reference import fused_moe_reference, relative_l2
from .routing import RoutePack, local_expert_ids, route_pack
from .selection import select_precision
from .workspace import Workspace

__version__ = "0.1.0"

__all__ = [
    "MoEExperts", "PreparedExperts", "RoutePack", "Workspace", "dequantize_mxfp4", "fused_moe", "fused_moe_reference", "gpt_oss_router",
    "load_gpt_oss_experts",
    "local_expert_ids", "prepare_weights", "quantize_mxfp4", "relative_l2", "route_pack", "select_precision",
    "unprepare_weights",
]
