"""mxmoe under a Hugging Face transformers gpt-oss model (``pip install "mxmoe[hf]"``).

``use_mxmoe(model)`` replaces each decoder layer's experts (transformers' ``GptOssExperts``) by
:class:`GptOssMxmoeExperts`, which keeps transformers' calling convention, ``experts(hidden_states, router_indices,
routing_weights)``, and runs :func:`mxmoe.fused_moe`; the router, attention and everything else stay transformers'
own. So ``model.generate()`` runs its MoE layers on mxmoe (W4A16; W4A8 above the ``MXMOE_FP8_PREFILL_MIN_ROWS``
threshold, or with ``precision="w4a8"``).

Where the MXFP4 weights come from, per layer (the first that applies):

1. ``checkpoint`` (a path: a checkpoint directory, ``.safetensors`` file or index file; or a state dict): the layer's
   ``*_blocks`` / ``*_scales`` / ``*_bias`` tensors go straight to :func:`mxmoe.prepare_weights`, read lazily (only
   that layer's tensors, from whichever shards hold them);
2. the directory the model was loaded from (``model.name_or_path``), when it is a local checkpoint holding them;
3. the experts' own parameters (transformers dequantizes an MXFP4 checkpoint to BF16 where it has no MXFP4 kernels):
   quantized back with :func:`mxmoe.quantize_mxfp4`, which is exact for weights that were MXFP4; weights that are not
   MXFP4 values raise ``ValueError`` unless ``quantize=True`` (then rounded to MXFP4, lossy).

The replaced experts' parameters are dropped (their memory freed once nothing else holds them).
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch

from ..checkpoint import open_checkpoint
from ..format import dequantize_mxfp4, quantize_mxfp4
from ..gpt_oss import GPT_OSS_NAMES, layer_prefixes, load_gpt_oss_experts
from ..module import MoEExperts
from ..prepare import prepare_weights

__all__ = ["GptOssMxmoeExperts", "use_mxmoe", "experts_source"]


class GptOssMxmoeExperts(torch.nn.Module):
    """A gpt-oss layer's experts on mxmoe with transformers' ``GptOssExperts`` calling convention:
    ``forward(hidden_states [..., H], router_indices [..., top_k], routing_weights [..., top_k])`` returns
    ``[..., H]`` in ``hidden_states``' dtype (the kernels read BF16: other dtypes are converted on the way in and
    out). ``routing_weights`` may also be dense ``[..., E]`` scores (transformers 4.x's router), from which the
    ``top_k`` routes' weights are taken. ``self.moe`` is the :class:`mxmoe.MoEExperts` that runs."""

    def __init__(self, moe: MoEExperts):
        super().__init__()
        self.moe = moe
        self.hidden_size = moe.w2.shape[1]
        self.num_experts = moe.w13.shape[0]

    def forward(self, hidden_states: torch.Tensor, router_indices: Optional[torch.Tensor] = None,
                routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if router_indices is None or routing_weights is None:
            raise ValueError("GptOssMxmoeExperts needs router_indices and routing_weights (the router's output)")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        ids = router_indices.reshape(x.shape[0], -1)
        weights = routing_weights.reshape(x.shape[0], -1)
        if weights.shape[1] != ids.shape[1]:  # dense [T, E] scores
            weights = weights.gather(1, ids.long())
        if weights.dtype not in (torch.float32, torch.bfloat16):
            weights = weights.float()
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.long()
        out = self.moe(x.contiguous(), weights.contiguous(), ids.contiguous())
        return out.to(hidden_states.dtype).reshape(shape)


def _layer_index(name: str) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    if m is None:
        raise ValueError(f"cannot tell the layer index of experts module {name!r}")
    return int(m.group(1))


def _holds_gpt_oss_experts(ckpt, layer: int) -> bool:
    return any(p + names[0] in ckpt for p in layer_prefixes(layer) for names, _ in GPT_OSS_NAMES.values())


def _from_parameters(experts: torch.nn.Module, quantize: bool, name: str) -> dict:
    """prepare_weights' keyword arguments from transformers' BF16 ``GptOssExperts`` parameters (gate_up_proj
    ``[E, H, 2I]`` with gate and up interleaved along 2I, down_proj ``[E, I, H]``, biases)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
            or not gate_up.is_floating_point():
        raise ValueError(f"{name} ({type(experts).__name__}) holds no floating-point gate_up_proj / down_proj: pass "
                         "checkpoint= (the MXFP4 checkpoint it was loaded from)")
    out = {}
    with torch.no_grad():
        for key, w in (("w13", gate_up), ("w2", down)):
            rows = w.detach().transpose(1, 2)  # [E, N, K]
            packed, scales = quantize_mxfp4(rows)
            if not quantize and not torch.equal(dequantize_mxfp4(packed, scales), rows.float()):
                raise ValueError(f"{name}: {key.replace('w13', 'gate_up_proj').replace('w2', 'down_proj')} holds "
                                 "values that are not MXFP4 (E2M1 with one power-of-two scale per 32): pass "
                                 "checkpoint= (the MXFP4 checkpoint), or quantize=True to round them to MXFP4 (lossy)")
            out[key], out[key + "_scale"] = packed, scales
    for key, attr in (("b13", "gate_up_proj_bias"), ("b2", "down_proj_bias")):
        bias = getattr(experts, attr, None)
        if isinstance(bias, torch.Tensor):
            out[key] = bias.detach()
    limit, alpha = getattr(experts, "limit", 7.0), getattr(experts, "alpha", 1.702)
    out.update(w13_layout="interleaved", activation="swigluoai", swiglu_limit=float(limit), swiglu_alpha=float(alpha))
    return out


def experts_source(model: torch.nn.Module, checkpoint=None):
    """Where :func:`use_mxmoe` takes ``model``'s MXFP4 expert weights from: a checkpoint mapping (``checkpoint``, or
    the local directory the model was loaded from when it holds them), or None (the experts' own parameters)."""
    if checkpoint is not None:
        return open_checkpoint(checkpoint)
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if path and os.path.isdir(path):
        try:
            ckpt = open_checkpoint(path)
        except (FileNotFoundError, ValueError):
            return None
        if any(n.endswith(("_blocks", ".blocks")) for n in ckpt):
            return ckpt
    return None


def use_mxmoe(model: torch.nn.Module, checkpoint=None, *, device=None, precision: str = "auto",
              max_tokens: Optional[int] = None, quantize: bool = False) -> torch.nn.Module:
    """Run ``model``'s gpt-oss MoE experts on mxmoe: every transformers ``GptOssExperts`` module is replaced, in
    place, by a :class:`GptOssMxmoeExperts` (the module docstring says where its MXFP4 weights come from), prepared
    on ``device`` (default: where the replaced experts are; e.g. ``"cuda"`` for a model loaded on the CPU, which
    ``model.to("cuda")`` then follows). ``precision``, ``max_tokens``: :class:`mxmoe.MoEExperts`' (the workspace
    grows to the calls seen when ``max_tokens`` is None). Returns ``model``. Raises ``ValueError`` when the model has
    no such experts."""
    ckpt = experts_source(model, checkpoint)
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ == "GptOssExperts" or (name.endswith("mlp.experts") and
                                                              not isinstance(module, GptOssMxmoeExperts))]
    if not targets:
        raise ValueError("the model has no gpt-oss experts modules (transformers' GptOssExperts) to replace")
    for name, module in targets:
        params = list(module.parameters())
        where = torch.device(device) if device is not None else params[0].device if params else torch.device("cpu")
        layer = _layer_index(name)
        if ckpt is not None and _holds_gpt_oss_experts(ckpt, layer):
            src = load_gpt_oss_experts(ckpt, layer=layer, device=where)
        elif checkpoint is not None:
            raise KeyError(f"the checkpoint holds no gpt-oss expert tensors of layer {layer} ({layer_prefixes(layer)})")
        else:
            src = _from_parameters(module, quantize, name)
        src = {k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in src.items()}
        moe = MoEExperts(prepare_weights(**src), precision=precision, max_tokens=max_tokens, top_k=top_k)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, GptOssMxmoeExperts(moe))
    return model
