"""The E2M1-K32 (OCP MXFP4) weight format: quantize, dequantize (gpt-oss checkpoints: ``mxmoe.gpt_oss``).

Element: E2M1, 4 bits = sign (bit 3), exponent (bits 2..1, bias 1), mantissa (bit 0).
Magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the negatives.
Packing: two K-adjacent elements per byte, low nibble = even k.
Scale: one UE8M0 byte per 32 K-elements of a row, byte b means 2**(b - 127).
Byte 255 (NaN in OCP) is rejected with a ValueError; byte 0 (2**-127) is legal.
"""
from __future__ import annotations

import torch

BLOCK_K = 32  # elements sharing one scale byte
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_NAN_BYTE = 255

# Round-to-nearest-even onto the E2M1 magnitudes: code = number of thresholds passed.
# A tie goes to the even code, so ties at 0.25/1.25/2.5/5 round down and 0.75/1.75/3.5 up.
_RNE_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def scales_as_uint8(scales: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """View UE8M0 scales (uint8 or torch.float8_e8m0fnu) as their uint8 bytes."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype == torch.uint8:
        return scales
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scales.view(torch.uint8)
    raise TypeError(f"{name} must be torch.uint8 or torch.float8_e8m0fnu, got {scales.dtype}")


def check_no_nan_scales(scales_u8: torch.Tensor, name: str = "scales") -> None:
    """Reject the OCP NaN scale byte 255 (one host sync: call at load/prepare time only)."""
    if scales_u8.numel() and bool((scales_u8 == SCALE_NAN_BYTE).any()):
        raise ValueError(f"{name} contains byte 255, the OCP NaN scale, which mxmoe rejects")


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale, |v| <= 6) to E2M1 codes, RNE."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, tie_up in _RNE_THRESHOLDS:
        code += (a >= threshold if tie_up else a > threshold).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize floats ``[..., N, K]`` to E2M1-K32: ``(packed uint8 [..., N, K/2], scales uint8 [..., N, K/32])``.

    Scale rule: for each block of 32 K-elements the scale is the smallest power of two
    ``2**e`` with ``amax / 2**e <= 6`` (so nothing is clipped), ``e`` limited to the UE8M0
    range [-127, 127]; an all-zero block gets ``2**0``. Each element is then ``w / 2**e``
    rounded to the nearest E2M1 value, ties to the even code. Non-finite input is rejected.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError("w must be a floating-point torch.Tensor")
    if w.dim() < 2 or w.shape[-1] % BLOCK_K:
        raise ValueError(f"w must be [..., N, K] with K a multiple of {BLOCK_K}, got shape {tuple(w.shape)}")
    wf = w.double() if w.dtype == torch.float64 else w.float()  # float64 stays float64: no double rounding
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("w contains NaN or Inf")
    blocks = wf.reshape(*wf.shape[:-1], wf.shape[-1] // BLOCK_K, BLOCK_K)
    amax = blocks.abs().amax(dim=-1)
    if bool((amax > E2M1_MAX * 2.0 ** 127).any()):
        raise ValueError("w has values beyond the E2M1-K32 range (6 * 2**127)")
    # smallest e with amax / 2**e <= 6; frexp gives amax/6 = m * 2**p with m in [0.5, 1)
    mant, p = torch.frexp(amax / E2M1_MAX)
    exp = torch.where(mant == 0.5, p - 1, p)  # exact powers of two need no headroom
    # amax > 0 but amax/6 underflowed to 0 (amax of a few float32 subnormal ulps): smallest scale
    exp = torch.where(mant == 0, torch.full_like(exp, -127), exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)
    # amax/6 may round up in float32; recheck so the scale never clips
    exp = torch.where(amax / torch.ldexp(torch.ones_like(amax), exp) > E2M1_MAX, exp + 1, exp).clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(amax), exp).unsqueeze(-1)
    codes = _e2m1_codes(scaled).reshape(wf.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> E2M1 codes uint8 ``[..., K]`` (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode E2M1-K32 to floats ``[..., N, K]``: exactly ``e2m1 * 2**(b - 127)`` (exact in float32 and float64)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError("packed must be a torch.uint8 tensor")
    scales_u8 = scales_as_uint8(scales)
    if scales_u8.shape != (*packed.shape[:-1], packed.shape[-1] * 2 // BLOCK_K) or packed.shape[-1] * 2 % BLOCK_K:
        raise ValueError(f"scales shape {tuple(scales_u8.shape)} does not match packed shape {tuple(packed.shape)}")
    check_no_nan_scales(scales_u8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    values = lut[unpack_e2m1(packed).long()]
    values = values.reshape(*values.shape[:-1], -1, BLOCK_K)
    exp = scales_u8.to(torch.int32) - 127
    scale = torch.ldexp(torch.ones(exp.shape, dtype=torch.float64, device=packed.device), exp)
    return (values * scale.unsqueeze(-1)).reshape(*packed.shape[:-1], -1).to(dtype)
