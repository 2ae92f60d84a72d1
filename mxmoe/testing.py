"""Synthetic experts and routings: the generators that ``mxmoe check``, ``mxmoe check --fuzz``, ``mxmoe bench``, the
tests and the scripts draw their problems from.

* :func:`random_code_sources`: source tensors of uniformly random E2M1 bytes (every code) and scale bytes in a range,
  with optional scale patterns (zero rows, 30-binade rows, odd experts only), zero up rows, biases, global scales:
  the kernel tests' and device scripts' weights.
* :func:`make_experts`: random prepared experts (weights drawn from a normal law and quantized with
  :func:`mxmoe.quantize_mxfp4`), optionally with scale-byte patterns (byte 0 in blocks, rows spanning ~30 binades),
  biases, global scales, zero up rows (the GEMM-level checks); :func:`source_tensors` gives the source tensors alone.
* :func:`make_routing`: routings of the fixed check cases (uniform, hot, empty experts, masked ids of every kind,
  an ``expert_map``); :func:`compose_routing`: the fuzz harness's, drawn from independent knobs.
* :func:`every_byte_scales`, :func:`shift_scale_bytes`: the fuzz harness's scale-byte patterns.

A seed gives the same problem on every device (random numbers are drawn on the CPU unless asked otherwise).
"""
from __future__ import annotations

import functools
import math

import torch

from .format import quantize_mxfp4
from .prepare import prepare_weights

CASE_ROUTINGS = ("uniform", "hot", "empty", "masked", "expert_map")
FUZZ_ROUTINGS = ("uniform", "one_expert", "half_empty", "hot")
SCALE_PATTERNS = ("normal", "zero_bytes", "wide_span", "mixed_span")
WIDE_SPAN_BINADES = 30  # block scales of one row span this many binades in the wide_span pattern
WIDE_SPAN_X_GAIN = 8  # binades of that span the activations compensate (FP8 E4M3 keeps them)


def random_mxfp4(E: int, N: int, K: int, std: float, gen: torch.Generator, device, chunk_elems: int = 1 << 27):
    """Random normal weights ``[E, N, K]`` of standard deviation ``std``, quantized to E2M1-K32.

    Quantizes a few experts at a time so large shapes stay within memory.
    Returns ``(packed uint8 [E, N, K/2], scales uint8 [E, N, K/32])``.
    """
    packed = torch.empty(E, N, K // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(E, N, K // 32, dtype=torch.uint8, device=device)
    step = max(1, chunk_elems // max(N * K, 1))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        w = torch.randn(e1 - e0, N, K, generator=gen, device=device) * std
        packed[e0:e1], scales[e0:e1] = quantize_mxfp4(w)
    return packed, scales


def _zero_scale_bytes(scales: torch.Tensor, gen: torch.Generator) -> None:
    """Byte 0 (2^-127) in ~12% of blocks, in the first three rows of expert 0 and all of the last expert."""
    blocks = torch.rand(scales.shape, generator=gen, device=scales.device) < 0.12
    scales[blocks] = 0
    scales[0, :3] = 0
    scales[-1] = 0


def _spread(n: int, span: int, gen: torch.Generator, device) -> torch.Tensor:
    """``n`` offsets covering ``[0, span]`` (both ends present when n >= 2), in random order."""
    if n == 1:
        return torch.zeros(1, dtype=torch.int16, device=device)
    d = torch.linspace(0, span, n, device=device).round().to(torch.int16)
    return d[torch.randperm(n, generator=gen, device=device)]


def _wide_span_w13(scales: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Lower K-block ``k`` of every w13 row by ``d_k`` binades (``d`` spans 30); returns ``d``.

    The pattern is shared by all rows so the activations can compensate part of it: block
    ``k`` of ``x`` is multiplied by ``2**min(d_k, 8)``, so blocks 9-16 binades below a row's
    largest scale still carry a visible share of the dot product (a kernel that clamps them
    to 2^-11 of the row's largest scale, or drops them, fails ``a8~emu``).
    """
    d = _spread(scales.shape[-1], WIDE_SPAN_BINADES, gen, scales.device)
    scales.copy_((scales.to(torch.int16) - d).clamp(1, 254).to(torch.uint8))
    return d


def _wide_span_rows(scales: torch.Tensor, gen: torch.Generator) -> None:
    """Each row of w2 gets its own random block offsets spanning ~30 binades."""
    nb = scales.shape[-1]
    d = torch.randint(0, WIDE_SPAN_BINADES + 1, scales.shape, generator=gen, device=scales.device, dtype=torch.int16)
    if nb >= 2:
        d[..., 0] = 0
        d[..., -1] = WIDE_SPAN_BINADES
    scales.copy_((scales.to(torch.int16) - d).clamp(1, 254).to(torch.uint8))


def make_experts(E: int, H: int, I: int, *, seed: int = 0, device="cpu", gen_device=None, scales: str = "normal",
                 biases: bool = False, global_scales: bool = False, gain: float = 2.0, zero_up: bool = False):
    """Random prepared experts on ``device``: ``(PreparedExperts, x_block_exponents or None)``.

    w13 entries ~ N(0, (gain/sqrt(H))^2) so gate/up values have standard deviation about
    ``gain`` for unit inputs (limits and clamps are exercised); w2 ~ N(0, 1/I).
    ``scales``: ``"normal"`` (what quantization gives), ``"zero_bytes"``, ``"wide_span"``
    or ``"mixed_span"`` (see :func:`_zero_scale_bytes`, :func:`_wide_span_w13`,
    :func:`_wide_span_rows`). For ``wide_span`` the second value holds the per-K-block
    exponents (int) to multiply the activations by.
    ``zero_up``: every up row of w13 is E2M1 code 0 (their scale bytes stay as drawn), for the
    GEMM-level checks (:func:`gemm_level`).
    Random numbers are drawn on ``gen_device`` (default the CPU, so a seed gives the same
    weights on every device; pass the GPU for large shapes).
    """
    if scales not in SCALE_PATTERNS:
        raise ValueError(f"scales must be one of {SCALE_PATTERNS}, got {scales!r}")
    device = torch.device(device)
    gen_device = torch.device(gen_device if gen_device is not None else "cpu")
    if gen_device.type == "cpu":
        src, x_exp = _cpu_source(E, H, I, seed, scales, biases, global_scales, gain)
    else:
        src, x_exp = _source(E, H, I, seed, scales, biases, global_scales, gain, gen_device)
    src = {k: v.to(device) for k, v in src.items()}
    if zero_up:  # (a copy: the CPU source is cached)
        src["w13"] = src["w13"].clone()
        src["w13"][:, I:] = 0  # gate_up rows: the up half
    return prepare_weights(w13_layout="gate_up", **src), None if x_exp is None else x_exp.to(device)


def _source(E, H, I, seed, scales, biases, global_scales, gain, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    return source_tensors(E, H, I, gen, scales, biases, global_scales, gain, device)


def source_tensors(E, H, I, gen: torch.Generator, scales: str, biases: bool, global_scales: bool, gain: float, device):
    """Random source tensors (:func:`prepare_weights`' keywords, ``gate_up``) drawn from ``gen`` on ``device``, and
    the wide-span pattern's per-K-block exponents for x (None for the others); see :func:`make_experts`."""
    w13, s13 = random_mxfp4(E, 2 * I, H, gain / math.sqrt(H), gen, device)
    w2, s2 = random_mxfp4(E, H, I, 1.0 / math.sqrt(I), gen, device)
    x_exp = None
    if scales == "zero_bytes":
        _zero_scale_bytes(s13, gen)
        _zero_scale_bytes(s2, gen)
    elif scales == "wide_span":
        x_exp = _wide_span_w13(s13, gen).clamp(max=WIDE_SPAN_X_GAIN)
        _wide_span_rows(s2, gen)
    elif scales == "mixed_span":  # the odd experts' rows span ~30 binades (W4A8: their tiles take the exact path)
        _wide_span_rows(s13[1::2], gen)
        _wide_span_rows(s2[1::2], gen)
    src = dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    if biases:
        src["b13"] = 0.5 * torch.randn(E, 2 * I, generator=gen, device=device)
        src["b2"] = 0.2 * torch.randn(E, H, generator=gen, device=device)
    if global_scales:
        src["w13_global_scale"] = 0.5 + 1.5 * torch.rand(E, generator=gen, device=device)
        src["w2_global_scale"] = 0.5 + 1.5 * torch.rand(E, generator=gen, device=device)
    return src, x_exp


@functools.lru_cache(maxsize=4)
def _cpu_source(E, H, I, seed, scales, biases, global_scales, gain):
    """CPU source tensors, cached: most check cases share one set of weights."""
    return _source(E, H, I, seed, scales, biases, global_scales, gain, torch.device("cpu"))


def _topk_distinct(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.topk(scores, top_k, dim=-1).indices


def make_routing(kind: str, T: int, E: int, top_k: int, *, seed: int = 0, device="cpu",
                 ids_dtype: torch.dtype = torch.int32):
    """Routing ``(topk_weights fp32 [T,k], topk_ids [T,k], expert_map or None, masked_rows)``.

    ``kind``:

    * ``uniform``: k distinct experts per token from random scores; the first tokens cover
      every expert when ``T*k >= E``.
    * ``hot``: experts 0 and 1 take almost every token, a few others share the rest, the
      upper half of the experts is empty.
    * ``empty``: only the last ``k+1`` experts are used (empty segments come first).
    * ``masked``: uniform, then ~25% of routes get id -1 and ~10% an id past the experts
      (for int64 ids values >= 2^32 whose low 32 bits are a valid id); tokens 0 and T//2 are
      all masked (int32: the last token's first id is INT32_MIN). Masked routes keep a large
      weight: they must contribute zero anyway.
    * ``expert_map``: ids over ``2E`` global experts; ``expert_map`` sends even globals to
      local ``g // 2`` and odd ones to -1; token 0 is all masked.

    Weights are a softmax over the chosen scores (positive, summing to 1 per token).
    """
    if kind not in CASE_ROUTINGS:
        raise ValueError(f"routing must be one of {CASE_ROUTINGS}, got {kind!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    n_global = 2 * E if kind == "expert_map" else E
    scores = torch.randn(T, n_global, generator=gen, device=device)
    if kind == "hot":
        eligible = min(E, max(top_k + 2, E // 2))
        bias = torch.full((n_global,), -1e9, device=device)
        bias[:eligible] = 0.0
        bias[:2] = 8.0
        scores = scores + bias
    elif kind == "empty":
        eligible = min(E, top_k + 1)
        bias = torch.full((n_global,), -1e9, device=device)
        bias[E - eligible:] = 0.0
        scores = scores + bias
    elif T * top_k >= n_global:
        # cover every expert: token t's scores favour a slice of a random permutation
        perm = torch.randperm(n_global, generator=gen, device=device)
        for t in range(-(-n_global // top_k)):
            chosen = perm[t * top_k:(t + 1) * top_k]
            scores[t, chosen] += 1e6
    ids = _topk_distinct(scores, top_k)
    weights = torch.softmax(torch.gather(scores.clamp(min=-30.0, max=30.0), 1, ids), dim=-1).float()
    ids = ids.to(torch.int64)
    expert_map = None
    masked = torch.zeros(T, top_k, dtype=torch.bool, device=device)
    if kind == "masked":
        r = torch.rand(T, top_k, generator=gen, device=device)
        minus_one = r < 0.25
        past = (r >= 0.25) & (r < 0.35)
        if ids_dtype == torch.int64:
            far = torch.where(torch.arange(top_k, device=device) % 2 == 0, (1 << 32) + ids % E, torch.full_like(ids, E))
        else:
            far = torch.where(torch.arange(top_k, device=device) % 2 == 0, torch.full_like(ids, 2**31 - 1), torch.full_like(ids, E))
        ids = torch.where(minus_one, torch.full_like(ids, -1), torch.where(past, far, ids))
        for t in {0, T // 2}:
            if t < T:
                ids[t] = torch.tensor([-1 if k % 2 == 0 else E + k for k in range(top_k)], device=device)
        if ids_dtype == torch.int32:
            ids[T - 1:, :1] = -(2**31)  # most negative int32
        weights = torch.where(ids < 0, torch.full_like(weights, 10.0), weights)
        masked = (ids < 0) | (ids >= E)
    elif kind == "expert_map":
        expert_map = torch.where(torch.arange(n_global, device=device) % 2 == 0,
                                 torch.arange(n_global, device=device) // 2, torch.full((n_global,), -1, device=device))
        expert_map = expert_map.to(torch.int32)
        ids[0] = torch.arange(top_k, device=device) * 2 + 1  # odd globals: all masked
        masked = expert_map.long()[ids] < 0
    masked_rows = masked.all(dim=1).nonzero().squeeze(1)
    return weights.contiguous(), ids.to(ids_dtype).contiguous(), expert_map, masked_rows


def shift_scale_bytes(scales: torch.Tensor, shift: int) -> None:
    scales.copy_((scales.to(torch.int16) + shift).clamp(0, 252).to(torch.uint8))


def every_byte_scales(packed: torch.Tensor, scales: torch.Tensor, gen: torch.Generator) -> None:
    """Bytes 0..254 over ~1 % of the blocks (at least 255 of them where there are that many, all 255 values then).
    A block given a byte above its own has its codes zeroed (its values would leave FP32's range); one given a byte
    below keeps its codes (a smaller block)."""
    flat_s = scales.view(-1)
    blocks = packed.view(-1, 16)
    n = flat_s.numel()
    count = min(n, max(255, n // 100))
    where = torch.randperm(n, generator=gen, device=scales.device)[:count]
    new = (torch.arange(count, device=scales.device) % 255).to(torch.uint8)
    raised = new > flat_s[where]
    blocks[where[raised]] = 0
    flat_s[where] = new


_MASKED_INT32 = (-1, -(2**31), 2**31 - 1)


def compose_routing(E: int, T: int, top_k: int, gen: torch.Generator, *, routing: str = "uniform",
                    mask_fraction: float = 0.0, masked_tokens: int = 0, duplicates: bool = False,
                    ids_dtype: str = "int32", dropped: int = 0):
    """The fuzz harness's routings, drawn from ``gen`` on the CPU: ``(topk_weights, topk_ids, expert_map, masked [T,
    top_k] bool)``. ``routing``: uniform, one_expert, half_empty or hot (:data:`FUZZ_ROUTINGS`); then ``mask_fraction``
    of the routes and ``masked_tokens`` whole tokens masked with ids of every kind (-1, just past the globals, far
    past, INT32_MIN/MAX or int64 >= 2^32 with valid low bits, dropped globals) and weights of 10, Inf or NaN;
    ``duplicates``: a repeated id in ~30 % of the tokens; ``dropped`` > 0: an ``expert_map`` over ``E + dropped``
    globals."""
    k = top_k
    p = torch.ones(E)
    if routing == "one_expert":
        p = torch.zeros(E)
        p[int(torch.randint(E, (1,), generator=gen))] = 1.0
    elif routing == "half_empty" and E >= 2:
        p[torch.randperm(E, generator=gen)[: E // 2]] = 0.0
    elif routing == "hot":
        hot = torch.randperm(E, generator=gen)[: min(E, 2)]
        p[hot] = 10.0 * E
    distinct = int((p > 0).sum()) >= k
    local = torch.multinomial(p.expand(T, E), k, replacement=not distinct, generator=gen)
    if duplicates:
        rows = torch.rand(T, generator=gen) < 0.3
        col = torch.randint(1, k, (T,), generator=gen)
        local[rows, col[rows]] = local[rows, 0]
    expert_map = None
    ids = local
    n_global = E + dropped
    if dropped:
        perm = torch.randperm(n_global, generator=gen)
        expert_map = torch.full((n_global,), -1, dtype=torch.int32)
        expert_map[perm[:E]] = torch.arange(E, dtype=torch.int32)
        ids = perm[:E][local]
    masked = torch.rand(T, k, generator=gen) < mask_fraction
    if masked_tokens:
        masked[torch.randperm(T, generator=gen)[:masked_tokens]] = True
    # masked ids of every kind: -1, just past the globals, far past, extremes of the dtype, dropped globals
    choices = [torch.full_like(ids, -1), torch.full_like(ids, n_global), ids + n_global]
    if ids_dtype == "int32":
        choices += [torch.full_like(ids, v) for v in _MASKED_INT32[1:]]
    else:
        choices += [ids + (1 << 32), torch.full_like(ids, -(1 << 40))]  # >= 2^32 with valid low bits
    if dropped:
        choices.append(perm[E:][torch.randint(dropped, ids.shape, generator=gen)])
    pick = torch.randint(len(choices), ids.shape, generator=gen)
    bad = torch.stack(choices)[pick, torch.arange(T)[:, None], torch.arange(k)[None, :]]
    ids = torch.where(masked, bad, ids)
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    odd = torch.tensor([10.0, math.inf, math.nan])[torch.randint(3, (T, k), generator=gen)]
    weights = torch.where(masked, odd, weights)
    dtype = torch.int32 if ids_dtype == "int32" else torch.int64
    return weights.float().contiguous(), ids.to(dtype).contiguous(), expert_map, masked


def random_code_sources(E: int, H: int, I: int, *, seed: int = 0, device="cpu", scale_lo: int = 120,
                        scale_hi: int = 124, biases: bool = False, global_scales: bool = False,
                        zero_scale_rows: bool = False, wide_span: bool = False, mixed_span: bool = False,
                        zero_up: bool = False) -> dict:
    """Source tensors (``prepare_weights``'s keywords, ``gate_up`` layout) of uniformly random E2M1 bytes and scale
    bytes in [scale_lo, scale_hi], drawn on ``device`` in a fixed order (a seed gives the same tensors per device).
    ``zero_scale_rows``: every 7th w13 row and 5th w2 block at byte 0; ``wide_span``: every row's blocks span 30
    binades (126 + {0, -10, -20, -30} by block); ``mixed_span``: the odd experts' rows only (W4A8 runs those on its
    exact path); ``zero_up``: w13's up rows all code 0 (the GEMM-level check)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8, device=device)
    s13 = torch.randint(scale_lo, scale_hi + 1, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8, device=device)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8, device=device)
    s2 = torch.randint(scale_lo, scale_hi + 1, (E, H, I // 32), generator=g, dtype=torch.uint8, device=device)
    if zero_scale_rows:
        s13[:, ::7, :] = 0
        s2[:, :, ::5] = 0
    offs = torch.tensor([0, -10, -20, -30], dtype=torch.int16, device=device)
    span13 = (126 + offs[torch.arange(H // 32, device=device) % 4]).to(torch.uint8)
    span2 = (126 + offs[torch.arange(I // 32, device=device) % 4]).to(torch.uint8)
    if wide_span:
        s13 = span13.expand(E, 2 * I, H // 32).contiguous()
        s2 = span2.expand(E, H, I // 32).contiguous()
    if mixed_span:
        s13[1::2] = span13
        s2[1::2] = span2
    if zero_up:
        w13[:, I:] = 0
    src = dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    if biases:
        src.update(b13=torch.randn(E, 2 * I, generator=g, device=device), b2=torch.randn(E, H, generator=g, device=device))
    if global_scales:
        src.update(w13_global_scale=torch.rand(E, generator=g, device=device) + 0.5,
                   w2_global_scale=torch.rand(E, generator=g, device=device) + 0.5)
    return src
