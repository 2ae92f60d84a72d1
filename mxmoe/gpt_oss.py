"""gpt-oss: its checkpoints' expert tensors, its router, its activation.

gpt-oss (openai/gpt-oss-20b and -120b: E = 32 or 128, H = I = 2880, top_k = 4) stores each layer's experts as
MXFP4 blocks ``[E, N, K/32, 16]`` (uint8, two E2M1 values a byte, low nibble first) with UE8M0 scales
``[E, N, K/32]`` and BF16 biases; its first GEMM's rows interleave gate and up (even rows gate). Two naming schemes
exist: the original release's (``block.{i}.mlp.mlp1_weight.blocks``, ..) and Hugging Face transformers'
(``model.layers.{i}.mlp.experts.gate_up_proj_blocks``, ..). Its activation is ``swigluoai`` (alpha 1.702, limit 7),
and its router takes the top k of the router logits, then a softmax over those k.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from .activation import GPT_OSS_ACTIVATION
from .checkpoint import open_checkpoint
from .format import BLOCK_K, scales_as_uint8

# per scheme: the names after a layer's prefix (w13 blocks, w13 scales, b13, w2 blocks, w2 scales, b2) and the prefix
# of layer i
GPT_OSS_NAMES = {
    "hf": (("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales",
            "down_proj_bias"), "model.layers.{}.mlp.experts."),
    "original": (("mlp1_weight.blocks", "mlp1_weight.scales", "mlp1_bias", "mlp2_weight.blocks", "mlp2_weight.scales",
                  "mlp2_bias"), "block.{}.mlp."),
}
_ROLES = ("w13 blocks", "w13 scales", "b13", "w2 blocks", "w2 scales", "b2")


def layer_prefixes(layer: int) -> list:
    """The tensor-name prefixes of gpt-oss layer ``layer`` in each naming scheme."""
    return [fmt.format(layer) for _, fmt in GPT_OSS_NAMES.values()]


def load_gpt_oss_experts(source, prefix: Optional[str] = None, *, layer: Optional[int] = None, device=None) -> dict:
    """Read one layer's gpt-oss MXFP4 experts: keyword arguments for :func:`mxmoe.prepare_weights`.

    ``source``: a state dict, a :class:`mxmoe.checkpoint.SafetensorsCheckpoint`, or a path (a ``.safetensors``
    file, a checkpoint directory, an index file), read on demand: only this layer's tensors, across shards.
    ``prefix``: everything before the tensor names (``"model.layers.0.mlp.experts."``, ``"block.0.mlp."``), or
    ``layer``: the layer's index (either scheme). Blocks ``[E, N, K/32, 16]`` become packed ``[E, N, K/2]``; the
    result holds ``w13_layout="interleaved"``, the biases where the checkpoint has them, and gpt-oss's activation
    (swigluoai, alpha 1.702, limit 7), which the prepared experts then remember. ``device``: where the tensors go
    (default: where the source has them; a file's on the CPU). A missing tensor raises ``KeyError`` naming it; a
    tensor of the wrong dtype or shape ``ValueError``."""
    if (prefix is None) == (layer is None):
        raise TypeError("give one of prefix and layer")
    ckpt = open_checkpoint(source)
    prefixes = [prefix] if prefix is not None else layer_prefixes(layer)
    found = [(p, names) for p in prefixes for names, _ in GPT_OSS_NAMES.values() if p + names[0] in ckpt]
    if not found:
        looked = [p + names[0] for p in prefixes for names, _ in GPT_OSS_NAMES.values()]
        raise KeyError(f"no gpt-oss expert tensors in {_describe(ckpt)} (looked for {looked})")
    prefix, names = found[0]
    for role, name in zip(_ROLES, names):
        if role[0] == "w" and prefix + name not in ckpt:  # the biases are optional
            raise KeyError(f"{_describe(ckpt)} has {prefix + names[0]!r} but no {prefix + name!r} ({role}) for this "
                           "layer")
    blocks13, scales13, bias13, blocks2, scales2, bias2 = (ckpt.get(prefix + n) for n in names)

    def packed(blocks: torch.Tensor, name: str) -> torch.Tensor:
        if blocks.dim() != 4 or blocks.shape[-1] != BLOCK_K // 2 or blocks.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 [E, N, K/32, 16], got {blocks.dtype} {tuple(blocks.shape)}")
        return blocks.reshape(*blocks.shape[:2], -1).contiguous()

    out = dict(
        w13=packed(blocks13, prefix + names[0]), w13_scale=scales_as_uint8(scales13, prefix + names[1]),
        w2=packed(blocks2, prefix + names[3]), w2_scale=scales_as_uint8(scales2, prefix + names[4]),
        w13_layout="interleaved",
    )
    if bias13 is not None:
        out["b13"] = bias13
    if bias2 is not None:
        out["b2"] = bias2
    if device is not None:
        out = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    out["activation"], out["swiglu_limit"], out["swiglu_alpha"] = GPT_OSS_ACTIVATION.call_args
    return out


def _describe(ckpt: Mapping) -> str:
    path = getattr(ckpt, "path", None)
    return f"the checkpoint {path!r}" if path else "the state dict"


def gpt_oss_router(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing from router logits ``[T, E]``: ``(topk_weights float32 [T, top_k], topk_ids int32
    [T, top_k])``, the ids of the ``top_k`` largest logits (``torch.topk``) and the softmax
    of those ``top_k`` logits (not of all E), in float32. transformers rounds the weights to the logits' dtype
    (BF16); mxmoe's kernels read these in float32 (SPEC: router weights applied in FP32)."""
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point() or router_logits.dim() != 2:
        raise ValueError("router_logits must be a floating-point [T, E] tensor")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be an int in [1, E = {router_logits.shape[1]}], got {top_k!r}")
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), ids.to(torch.int32)
