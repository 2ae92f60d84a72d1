"""mxmoe under Hugging Face transformers' gpt-oss (issue: a gpt-oss user's path): the lazy checkpoint loader,
experts that remember their activation, the router helper, ``use_mxmoe`` against transformers' own experts (the MoE
block in both precisions, greedy ``generate()``).

The model is a small random gpt-oss (2 layers, E=8, H=64, I=96: I is not a multiple of 64, a K tail for GEMM2) with
MXFP4 expert weights, written as an MXFP4 checkpoint the way openai/gpt-oss-* are (``*_blocks`` / ``*_scales``,
sharded, an index file, ``quantization_config: mxfp4``), which transformers loads by dequantizing to BF16 where it
has no MXFP4 kernels. Each test runs on the CPU and, marked ``gpu``, on CUDA.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

import mxmoe  # noqa: E402
from mxmoe.accuracy import excess_over_emulation  # noqa: E402
from mxmoe.checkpoint import SafetensorsCheckpoint  # noqa: E402
from mxmoe.integrations.transformers import GptOssMxmoeExperts, use_mxmoe  # noqa: E402

CONFIG = dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=128, hidden_size=64,
              intermediate_size=96, head_dim=32, num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# the residual stream: token embeddings of unit scale, expert outputs about 5 % of it. So the experts' BF16 rounding
# (transformers' own rounds GEMM1's output to BF16, mxmoe does not) moves the logits by far less than the gap between
# a greedy step's two best tokens, while a wrong activation (the silent silu) still changes tokens
EMBED_STD, DOWN_STD = 1.0, 0.05


def _config():
    return transformers.GptOssConfig(**CONFIG)


def _expert_tensors(seed: int) -> dict:
    """An MXFP4 checkpoint's expert tensors of every layer (HF names), Gaussian weights quantized, BF16 biases."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    out = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        for name, (n, k), std in (("gate_up_proj", (2 * I, H), 1.0), ("down_proj", (H, I), DOWN_STD)):
            packed, scales = mxmoe.quantize_mxfp4(torch.randn(E, n, k, generator=g) * std / k ** 0.5)
            out[p + name + "_blocks"] = packed.reshape(E, n, k // 32, 16)
            out[p + name + "_scales"] = scales
            out[p + name + "_bias"] = (0.1 * torch.randn(E, n, generator=g)).to(torch.bfloat16)
    return out


def write_checkpoint(path, seed: int = 0, garbage_shard: bool = False) -> dict:
    """A sharded MXFP4 gpt-oss checkpoint at ``path`` (a directory); returns every tensor written. Layer 0's experts
    sit in two shards (gate_up in the first, down in the second). With ``garbage_shard`` the index also lists a
    third shard, for a tensor no layer needs, whose file is not a safetensors file."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(_config())
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD)
    model = model.to(torch.bfloat16)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias",
                                  "experts.down_proj_bias"))}
    tensors.update(_expert_tensors(seed))
    first = [k for k in tensors if ".layers.0.mlp.experts.gate_up" in k or "embed" in k]
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": [k for k in tensors if k not in first]}
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    if garbage_shard:
        with open(os.path.join(path, "model-garbage.safetensors"), "wb") as f:
            f.write(b"not a safetensors file")
        weight_map["model.unused.weight"] = "model-garbage.safetensors"
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = _config().to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt-oss-tiny"))
    return path, write_checkpoint(path)


def load_model(path, device):
    """transformers' own model from the checkpoint, experts dequantized to BF16 (asked for: where the ``kernels``
    package is installed, transformers would otherwise fetch its MXFP4 kernels from the hub)."""
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)).to(device).eval()


# ------------------------------------------------------------------------------------------------ loading


def test_loader_reads_only_the_layer_asked_for_across_shards(tmp_path):
    tensors = write_checkpoint(str(tmp_path), seed=3, garbage_shard=True)
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    assert ckpt.shard("model.layers.0.mlp.experts.gate_up_proj_blocks") != ckpt.shard(
        "model.layers.0.mlp.experts.down_proj_blocks")  # the layer spans two shards
    for source in (str(tmp_path), tmp_path / "model.safetensors.index.json", ckpt):
        for layer in range(CONFIG["num_hidden_layers"]):
            p = f"model.layers.{layer}.mlp.experts."
            src = mxmoe.load_gpt_oss_experts(source, layer=layer)
            assert torch.equal(src["w13"], tensors[p + "gate_up_proj_blocks"].flatten(2))
            assert torch.equal(src["w2_scale"], tensors[p + "down_proj_scales"])
            assert torch.equal(src["b2"], tensors[p + "down_proj_bias"])
            by_prefix = mxmoe.load_gpt_oss_experts(source, prefix=p)
            assert all(torch.equal(v, by_prefix[k]) if isinstance(v, torch.Tensor) else v == by_prefix[k]
                       for k, v in src.items())
    # the garbage shard was never opened: only the shards of the tensors asked for are
    assert all(not f.endswith("garbage.safetensors") for f in ckpt._open)
    with pytest.raises(Exception):
        ckpt["model.unused.weight"]


def test_loader_names_a_missing_tensor(tmp_path):
    write_checkpoint(str(tmp_path), seed=4)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.mlp.experts.down_proj_blocks"]
    index.write_text(json.dumps(data))
    mxmoe.load_gpt_oss_experts(str(tmp_path), layer=0)
    with pytest.raises(KeyError, match="model.layers.1.mlp.experts.down_proj_blocks"):
        mxmoe.load_gpt_oss_experts(str(tmp_path), layer=1)
    with pytest.raises(KeyError, match="layers.7"):
        mxmoe.load_gpt_oss_experts(str(tmp_path), layer=7)


def test_loader_on_a_single_file_and_a_directory_without_index(tmp_path):
    tensors = _expert_tensors(5)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for source in (str(tmp_path), str(tmp_path / "model.safetensors")):
        src = mxmoe.load_gpt_oss_experts(source, layer=1)
        assert torch.equal(src["w2"], tensors["model.layers.1.mlp.experts.down_proj_blocks"].flatten(2))


# ------------------------------------------------------------------------------------- the activation


def _routing(T, E, top_k, seed, device):
    g = torch.Generator().manual_seed(seed)
    w, ids = mxmoe.gpt_oss_router(torch.randn(T, E, generator=g), top_k)
    return w.to(device), ids.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_loaded_experts_remember_the_gpt_oss_activation(checkpoint, device, no_triton_interpret):
    path, _ = checkpoint
    experts = mxmoe.prepare_weights(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                       for k, v in mxmoe.load_gpt_oss_experts(path, layer=0).items()})
    assert experts.activation == mxmoe.activation.GPT_OSS_ACTIVATION
    torch.manual_seed(0)
    x = torch.randn(16, CONFIG["hidden_size"], device=device).to(torch.bfloat16)
    w, ids = _routing(16, CONFIG["num_local_experts"], 2, 1, device)
    out = mxmoe.fused_moe(x, experts, w, ids)  # no activation named: the experts' (swigluoai, limit 7, alpha 1.702)
    named = mxmoe.fused_moe(x, experts, w, ids, activation="swigluoai", swiglu_limit=7.0, swiglu_alpha=1.702)
    assert torch.equal(out, named)
    silu = mxmoe.fused_moe(x, experts.with_activation("silu"), w, ids)  # the documented override
    assert mxmoe.relative_l2(silu, out) > 0.1  # (what a silent silu would have given)
    for bad in (dict(activation="silu"), dict(swiglu_limit=5.0), dict(swiglu_alpha=1.0)):
        with pytest.raises(ValueError, match="differs from the experts' activation"):
            mxmoe.fused_moe(x, experts, w, ids, **bad)
        with pytest.raises(ValueError, match="differs from the experts' activation"):
            mxmoe.MoEExperts(experts, **bad)
    assert mxmoe.MoEExperts(experts).activation == "swigluoai"
    # the module's state keeps it; unprepare gives it back as prepare_weights' arguments
    again = mxmoe.prepare_weights(**mxmoe.unprepare_weights(experts))
    assert again.activation == experts.activation
    # experts that remember none run what the call names, silu by default (as before)
    plain = experts.with_activation(None)
    assert torch.equal(mxmoe.fused_moe(x, plain, w, ids, activation="swigluoai"), out)
    assert torch.equal(mxmoe.fused_moe(x, plain, w, ids), silu)


def test_router_is_gpt_oss_top_k_then_softmax():
    torch.manual_seed(0)
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(_config())
    torch.nn.init.normal_(router.weight)
    h = torch.randn(50, CONFIG["hidden_size"])
    logits, scores, ids = router(h)
    w, ids_mx = mxmoe.gpt_oss_router(logits, CONFIG["num_experts_per_tok"])
    assert ids_mx.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids_mx.long(), ids)
    assert torch.allclose(w, scores.float(), rtol=1e-6, atol=1e-7)
    # not a softmax over all experts first (the README's example did that): those weights do not sum to 1
    assert torch.allclose(w.sum(-1), torch.ones(50))
    with pytest.raises(ValueError):
        mxmoe.gpt_oss_router(logits, 0)


# ------------------------------------------------------------------------------------------ use_mxmoe


def _block_input(device, T=48, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, T // 2, CONFIG["hidden_size"], generator=g).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["w4a16", "w4a8"])
@torch.no_grad()
def test_moe_block_against_transformers(checkpoint, device, precision):
    """transformers' GptOssExperts in float32 with the same (MXFP4-exact) weights and routing is the exact reference;
    mxmoe's experts (on the CPU the kernels run in Triton's interpreter) meet SPEC §5 against it. The whole block
    (transformers' router, mxmoe's experts) runs as transformers calls it."""
    path, _ = checkpoint
    ref = load_model(path, device)
    mx = use_mxmoe(load_model(path, device), precision=precision)
    assert isinstance(mx.model.layers[0].mlp.experts, GptOssMxmoeExperts)
    x = _block_input(device)
    x2 = x.reshape(-1, x.shape[-1])
    for layer in range(CONFIG["num_hidden_layers"]):
        _, w, ids = ref.model.layers[layer].mlp.router.float()(x2.float())
        exact = ref.model.layers[layer].mlp.experts.float()(x2.float(), ids, w)
        mine = mx.model.layers[layer].mlp.experts
        out = mine(x2, ids, w)
        assert out.dtype == torch.bfloat16 and out.shape == x2.shape
        # mxmoe's own exact reference is transformers' float32 experts (the loading and the activation are right)
        experts = mine.moe.experts
        assert mxmoe.relative_l2(mxmoe.fused_moe_reference(x2, experts, w, ids, mode="exact"), exact) < 1e-5
        err = mxmoe.relative_l2(out, exact)
        if precision == "w4a16":
            assert err < 5e-3, err
        else:
            emu = mxmoe.fused_moe_reference(x2, experts, w, ids, mode="w4a8")
            whole, worst, _ = excess_over_emulation(out, emu, exact)
            assert whole <= 0.005 and worst <= 0.015, (err, whole, worst)
            assert 0.005 < err < 0.1, err  # the FP8 format's error, present
        block, scores = mx.model.layers[layer].mlp(x)  # transformers' block with mxmoe's experts
        _, w16, ids16 = mx.model.layers[layer].mlp.router(x2)
        assert torch.equal(block.reshape(x2.shape), mine(x2, ids16, w16))


@pytest.mark.parametrize("device", DEVICES)
def test_generate_matches_transformers_greedy(checkpoint, device, no_triton_interpret):
    """Greedy generate(): the same token ids with transformers' own experts and with mxmoe's (W4A16), on a few
    prompts; with the wrong activation they differ (the comparison can fail)."""
    path, _ = checkpoint
    ref = load_model(path, device)
    mx = use_mxmoe(load_model(path, device))  # MXFP4 tensors from the checkpoint the model was loaded from
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, CONFIG["vocab_size"], (4, 9), generator=g).to(device)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = ref.generate(prompts, **kw)
    # the reference's greedy steps are not decided by BF16 rounding: transformers in float32 picks the same tokens
    assert torch.equal(load_model(path, device).float().generate(prompts, **kw), want)
    got = mx.generate(prompts, **kw)
    assert torch.equal(got, want), (got, want)
    for layer in mx.model.layers:  # the silent-silu failure of the issue
        moe = layer.mlp.experts.moe
        layer.mlp.experts = GptOssMxmoeExperts(mxmoe.MoEExperts(moe.experts.with_activation("silu")))
    assert not torch.equal(mx.generate(prompts, **kw), want)


@pytest.mark.parametrize("device", DEVICES)
def test_use_mxmoe_from_the_models_own_parameters(checkpoint, device, no_triton_interpret):
    """No checkpoint: the experts' BF16 parameters (MXFP4 values, dequantized by transformers) are quantized back,
    exactly; weights that are not MXFP4 values are refused unless quantize=True."""
    path, tensors = checkpoint
    model = load_model(path, device)
    model.name_or_path = ""  # (no local checkpoint to find)
    model.config._name_or_path = ""
    use_mxmoe(model)
    for layer in range(CONFIG["num_hidden_layers"]):
        experts = model.model.layers[layer].mlp.experts.moe.experts
        p = f"model.layers.{layer}.mlp.experts."
        src = mxmoe.unprepare_weights(experts)
        want = mxmoe.dequantize_mxfp4(tensors[p + "gate_up_proj_blocks"].flatten(2), tensors[p + "gate_up_proj_scales"])
        assert torch.equal(mxmoe.dequantize_mxfp4(src["w13"], src["w13_scale"]).cpu(), want)
        assert src["w13_layout"] == "interleaved" and experts.activation.name == "swigluoai"
    bf16 = load_model(path, device)
    bf16.name_or_path = bf16.config._name_or_path = ""
    with torch.no_grad():
        bf16.model.layers[1].mlp.experts.down_proj.mul_(1.01)  # no longer MXFP4 values
    with pytest.raises(ValueError, match="not MXFP4"):
        use_mxmoe(bf16)
    use_mxmoe(bf16, quantize=True)
    assert isinstance(bf16.model.layers[1].mlp.experts, GptOssMxmoeExperts)


@pytest.mark.parametrize("device", DEVICES)
def test_experts_module_calling_convention(checkpoint, device, no_triton_interpret):
    path, _ = checkpoint
    model = use_mxmoe(load_model(path, device))
    experts = model.model.layers[0].mlp.experts
    x = _block_input(device)
    T, H = x.shape[0] * x.shape[1], x.shape[2]
    w, ids = _routing(T, CONFIG["num_local_experts"], 2, 4, device)
    flat = experts(x.reshape(T, H), ids.long(), w.to(torch.bfloat16))
    assert flat.dtype == torch.bfloat16 and flat.shape == (T, H)
    batched = experts(x, ids.reshape(2, -1, 2), w.to(torch.bfloat16).reshape(2, -1, 2))  # leading dims kept
    assert torch.equal(batched.reshape(T, H), flat)
    dense = torch.zeros(T, CONFIG["num_local_experts"], device=device).scatter(1, ids.long(), w)
    assert torch.equal(experts(x.reshape(T, H), ids, dense.to(torch.bfloat16)), flat)  # transformers 4.x's scores
    as_f32 = experts(x.reshape(T, H).float(), ids, w.to(torch.bfloat16))
    assert as_f32.dtype == torch.float32 and torch.equal(as_f32, flat.float())
    with pytest.raises(ValueError, match="router_indices"):
        experts(x)


def test_experts_from_before_the_activation_field_still_load(no_triton_interpret):
    """A PreparedExperts pickled before experts remembered an activation (no ``activation`` in its fields) loads and
    runs as then: the call's activation, silu by default."""
    import pickle

    src = mxmoe.load_gpt_oss_experts({k: v for k, v in _expert_tensors(6).items()}, layer=0)
    experts = mxmoe.prepare_weights(**src)
    del experts.__dict__["activation"]
    old = pickle.loads(pickle.dumps(experts))
    assert "activation" not in vars(old) and old.activation is None
    x = torch.randn(4, CONFIG["hidden_size"]).to(torch.bfloat16)
    w, ids = _routing(4, CONFIG["num_local_experts"], 2, 0, "cpu")
    assert torch.equal(mxmoe.fused_moe(x, old, w, ids),
                       mxmoe.fused_moe(x, experts.with_activation("silu"), w, ids))
