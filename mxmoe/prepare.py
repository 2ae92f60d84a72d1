"""Prepared expert weights: the one representation both kernel paths read.

Layout (``PreparedExperts``):

* ``w13``  uint8 ``[E, 2I, H/2]``, rows normalized to ``[gate; up]``, K-contiguous, 16 bytes per K32 block
  as four little-endian 32-bit words (:func:`interleave_block_bits`): word q holds the 8 values
  K = 8j + 2q + c (j = 0..3, c = 0, 1), the values of a wgmma register operand held by lane
  ``q = lane % 4`` (BF16: the pairs (2q, 2q+1), (2q+8, 2q+9), ..; FP8: the same values in the activations'
  slot order, :func:`e4m3_slot_order`), one 32-bit load per thread and block. Inside the word the 32 bits
  are placed so that one masked shift per value pair gives its BF16 sign and ``eem`` bits
  (``_details/convert.py``).
  The rows are then stored in blocks of 64 (:func:`to_row_blocks`; an expert's last block may be shorter),
  and a block's bytes in units of U bytes of every row (U = 32, i.e. 64 K, where K % 64 == 0; else 16):
  unit 0 of all 64 rows, then unit 1, .. So the 64 rows x 64 K that a W4A16 pipeline stage copies are one
  contiguous 2-KB piece of memory instead of 64 pieces of 32 bytes, 2 KB apart (docs/perf-notes.md step 16),
  and a 128-K stage (W4A8) two adjacent ones, which the kernels keep in this order in shared memory
  (step 28: a 64-B unit, half of it per 64-K stage, streamed 25 % slower).
  The tensor keeps the shape ``[E, 2I, H/2]``, but row r's bytes are no longer at ``[e, r, :]``;
  :meth:`PreparedExperts.source_order_weights` undoes both steps.
* ``w13_scale`` uint8 ``[E, 2I, H/32]`` (row-major); ``w2`` uint8 ``[E, H, I/2]`` (same byte order and row
  blocks);
  ``w2_scale`` uint8 ``[E, H, I/32]``.
* A block of zeros whose scale byte is above the largest byte of its row's nonzero blocks gets that byte instead
  (:func:`kernel_scales`; the source's bytes are kept in ``w13_scale_restore`` / ``w2_scale_restore`` for
  :func:`unprepare_weights`).
* ``w13_ref`` / ``w2_ref`` int32 ``[E, rows]``: each row's reference exponent byte (its
  largest scale byte, so the largest of its nonzero blocks'). The W4A16 kernels fold ``2**(b - r)``, r = min(ref, 253), into the BF16
  weights (BF16 holds any fold exactly; ``_details.convert.FOLD_REF_MAX``) and apply ``2**(r - 127)``
  once per row in the FP32 epilogue. The W4A8 kernels fold ``2**(b - ref + 6)`` into the E4M3 weights
  (``_details/convert.py``: one byte-permute table per K32 block) and apply ``2**(ref - 133)`` per row after the
  MMA: exact where every block with a nonzero value has b >= ref - 11 (``FOLD_SPAN``).
* ``w13_fold`` / ``w2_fold`` int32 ``[E]``: 1 where every row of the expert folds (:func:`fold_fits`), so its tiles
  take the W4A8 fast path; 0 sends the expert's tiles to the exact slower path (one FP32 scale application per K32
  block), chosen here, never a clamp. :func:`fold_report` gives the fractions.

About 4.25 bits per weight plus 4 bytes of metadata per row (and 4 per expert); no second copy for FP8.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .activation import Activation
from .format import BLOCK_K, check_no_nan_scales, scales_as_uint8

W13_LAYOUTS = ("gate_up", "up_gate", "interleaved")
# the byte layout the kernels read; bumped when it changes (2: K32 blocks stored byte-transposed; 3: the bits
# of each block's values placed for shift-and-mask conversion, interleave_block_bits), so that
# experts prepared by another mxmoe version (e.g. unpickled) are refused instead of decoded wrongly; 4: rows in
# blocks of 64, unit-major inside a block, to_row_blocks; 5: 32-B units where K % 64 == 0, 64 B before where
# K % 128 == 0; 6: the per-expert W4A8 fold flags; 7: zero blocks' bytes lowered to their row's largest nonzero
# block's, kernel_scales)
LAYOUT_VERSION = 7
WEIGHT_BLOCK_ROWS = 64  # rows per block of the prepared weights (to_row_blocks)


@dataclass
class PreparedExperts:
    """Expert weights prepared once per model by :func:`prepare_weights`."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_ref: torch.Tensor
    w2_ref: torch.Tensor
    w13_fold: torch.Tensor
    w2_fold: torch.Tensor
    b13: Optional[torch.Tensor]
    b2: Optional[torch.Tensor]
    w13_global_scale: Optional[torch.Tensor]
    w2_global_scale: Optional[torch.Tensor]
    source_layout: str
    source_scale_dtypes: tuple  # (w13_scale, w2_scale) dtypes as given, for unprepare_weights
    all_fold: bool  # every expert folds in both GEMMs (w13_fold, w2_fold all 1): W4A8 launches no slower exact kernel
    w13_scale_restore: torch.Tensor  # int64 [n, 2]: (flat index, source byte) of the zero blocks' lowered bytes
    w2_scale_restore: torch.Tensor  # (kernel_scales; n = 0 for quantized weights)
    layout_version: int = LAYOUT_VERSION
    # the activation the weights belong to (prepare_weights' activation; the gpt-oss loaders set theirs): calls that
    # name none run it, calls that name another raise (activation.resolve_call_activation). None: not recorded (a
    # call's default is silu; also experts pickled before the field existed)
    activation: Optional[Activation] = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def memory(self) -> dict:
        """Bytes held, by part, and bits per weight."""
        parts = {
            "weights": self.w13.nbytes + self.w2.nbytes,
            "scales": self.w13_scale.nbytes + self.w2_scale.nbytes,
            "row_metadata": sum(t.nbytes for t in (self.w13_ref, self.w2_ref, self.w13_fold, self.w2_fold,
                                                   self.w13_scale_restore, self.w2_scale_restore)),
            "biases": sum(t.nbytes for t in (self.b13, self.b2, self.w13_global_scale, self.w2_global_scale) if t is not None),
        }
        n_weights = 2 * (self.w13.numel() + self.w2.numel())
        parts["total"] = sum(parts.values())
        parts["bits_per_weight"] = 8.0 * (parts["weights"] + parts["scales"]) / max(n_weights, 1)
        parts["bits_per_weight_all"] = 8.0 * parts["total"] / max(n_weights, 1)
        return parts

    def source_order_weights(self) -> tuple:
        """``(w13, w2)`` packed bytes in source order (``[gate; up]`` rows): what a plain MXFP4 decoder reads."""
        return _source_bytes(self.w13), _source_bytes(self.w2)

    def with_activation(self, activation: Optional[str], swiglu_limit: Optional[float] = None,
                        swiglu_alpha: Optional[float] = None) -> "PreparedExperts":
        """The same experts (the same tensors, not copied) remembering another activation (None: none)."""
        return replace(self, activation=None if activation is None else Activation.of(activation, swiglu_limit,
                                                                                       swiglu_alpha))

    def to(self, device) -> "PreparedExperts":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PreparedExperts(**{k: move(v) if isinstance(v, torch.Tensor) or v is None else v for k, v in self.__dict__.items()})


def expert_tensors(experts: PreparedExperts) -> tuple[list, list, bool]:
    """``(weights, extras, all_fold)``: how ``experts`` crosses the custom op's boundary (``mxmoe.op``) and keys
    a launch plan."""
    weights = [experts.w13, experts.w13_scale, experts.w2, experts.w2_scale, experts.w13_ref, experts.w2_ref,
               experts.w13_fold, experts.w2_fold, experts.w13_scale_restore, experts.w2_scale_restore]
    extras = [experts.b13, experts.b2, experts.w13_global_scale, experts.w2_global_scale]
    return weights, extras, experts.all_fold


def experts_from_tensors(weights: list, extras: list, all_fold: bool) -> PreparedExperts:
    """The :class:`PreparedExperts` of :func:`expert_tensors`' output (the source layout and dtypes are not kept)."""
    w13, w13_scale, w2, w2_scale, w13_ref, w2_ref, w13_fold, w2_fold, restore13, restore2 = weights
    return PreparedExperts(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale, w13_ref=w13_ref, w2_ref=w2_ref,
                           w13_fold=w13_fold, w2_fold=w2_fold, b13=extras[0], b2=extras[1],
                           w13_global_scale=extras[2], w2_global_scale=extras[3], source_layout="gate_up",
                           source_scale_dtypes=(torch.uint8, torch.uint8), all_fold=all_fold,
                           w13_scale_restore=restore13, w2_scale_restore=restore2)


def check_layout_version(experts: "PreparedExperts") -> None:
    """Raise if ``experts`` was prepared with another byte layout than this mxmoe's."""
    # objects from before the field (unpickled) have the first layout; the class default must not stand in
    version = vars(experts).get("layout_version", 1)
    if version != LAYOUT_VERSION:
        raise ValueError(f"experts were prepared with layout version {version}, this mxmoe reads version "
                         f"{LAYOUT_VERSION}: unprepare them with the mxmoe that prepared them, or prepare the "
                         "source weights again with mxmoe.prepare_weights")


_PAIR_MASK = 0x81C081C0  # BF16 bits of two E2M1 values times 2**-126: sign at 15 (+16), eem at 8..6 (+16)
_CHUNK_BYTES = 1 << 22  # packed bytes per step of the bit placement (its int64 temporaries are ~70x that)
_EXPERT_CHUNK_BYTES = 1 << 26  # packed bytes of experts prepared (or decoded) per step


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) | (x >> (32 - n))) & 0xFFFFFFFF


def _by_row_chunks(packed: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` on chunks of ``_CHUNK_BYTES`` of the rows of ``packed [..., K/2]`` (uint8, same shape out; ``fn``
    takes and returns [n, K/2]): bounds the int64 temporaries of the bit placement."""
    shape = packed.shape
    flat = packed.reshape(-1, shape[-1])
    out = torch.empty_like(flat)
    rows = max(1, _CHUNK_BYTES // max(shape[-1], 1))
    for r0 in range(0, flat.shape[0], rows):
        out[r0:r0 + rows] = fn(flat[r0:r0 + rows])
    return out.reshape(shape)


def interleave_block_bits(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 ``[..., K/2]`` in source order (byte i = K 2i low nibble, K 2i + 1 high) -> the prepared
    order: per K32 block four little-endian 32-bit words, word q holding K = 8j + 2q + c (j = 0..3, c = 0, 1)
    with the bits placed so that the kernels' conversion of value pair j (sign to bit 15 + 16c, ``eem`` to bits
    8..6 + 16c) is: j = 0 the word masked, j = 1 shifted left by 4, j = 2 rotated left by 10, j = 3 shifted
    left by 6 (sign, e0, m) and right by 2 (e1); :func:`gather_block_bits` is the inverse."""
    def place(chunk):
        b = chunk.to(torch.int64)
        n = b.shape[0]
        codes = torch.stack((b & 15, b >> 4), -1).reshape(n, -1, 4, 4, 2)  # [row, block, j, q, c]
        lane = ((codes & 8) << 12) | ((codes & 7) << 6)
        pair = (lane[..., 0] | (lane[..., 1] << 16)).transpose(-1, -2)  # [row, block, q, j]
        p0, p1, p2, p3 = pair.unbind(-1)
        words = p0 | (p1 >> 4) | _rotl(p2, 22) | ((p3 & 0x80C080C0) >> 6) | ((p3 & 0x01000100) << 2)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        return words.reshape(n, -1).view(torch.uint8)
    return _by_row_chunks(packed, place)


def gather_block_bits(prepared: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_block_bits`: prepared ``[..., K/2]`` -> source-order packed E2M1."""
    def gather(chunk):
        n = chunk.shape[0]
        w = chunk.contiguous().view(torch.int32).to(torch.int64).reshape(n, -1, 4) & 0xFFFFFFFF  # [row, block, q]
        pair = torch.stack((w & _PAIR_MASK, (w << 4) & _PAIR_MASK, _rotl(w, 10) & _PAIR_MASK,
                            ((w << 6) & 0x80C080C0) | ((w >> 2) & 0x01000100)), -1)  # [row, block, q, j]
        lane = torch.stack((pair & 0xFFFF, pair >> 16), -1)  # [row, block, q, j, c]
        codes = ((lane >> 12) & 8) | ((lane >> 6) & 7)
        codes = codes.transpose(2, 3).reshape(n, -1, 2)  # K order: [row, K/2, nibble]
        return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return _by_row_chunks(prepared, gather)


def row_block_unit(k: int) -> int:
    """Bytes per row in a unit of the prepared row blocks for reduction length ``k`` (:func:`to_row_blocks`)."""
    return 32 if k % 64 == 0 else 16


def _permute_row_blocks(t: torch.Tensor, to_blocks: bool) -> torch.Tensor:
    if t.dim() != 3 or t.shape[-1] % 16:
        raise ValueError(f"expected packed weights [E, rows, K/2] with K a multiple of 32, got {tuple(t.shape)}")
    E, rows, kb = t.shape
    unit = row_block_unit(2 * kb)
    out = torch.empty_like(t)
    full = rows - rows % WEIGHT_BLOCK_ROWS
    # whole blocks: [E, block, 64 rows, unit, U bytes] <-> [E, block, unit, 64 rows, U bytes]; then the last,
    # shorter block of h rows the same way
    for r0, r1, h in ((0, full, WEIGHT_BLOCK_ROWS), (full, rows, rows - full)):
        if r1 <= r0:
            continue
        nb = (r1 - r0) // h
        region = t[:, r0:r1]
        if to_blocks:
            moved = region.reshape(E, nb, h, kb // unit, unit).transpose(2, 3)
        else:
            moved = region.reshape(E, nb, kb // unit, h, unit).transpose(2, 3)
        out[:, r0:r1] = moved.reshape(E, r1 - r0, kb)
    return out


def to_row_blocks(packed: torch.Tensor) -> torch.Tensor:
    """``[E, rows, K/2]`` row-major -> the prepared row blocks (same shape): each expert's rows in blocks of
    ``WEIGHT_BLOCK_ROWS`` (the last one shorter when rows % 64 != 0), each block's bytes ordered
    [unit][row in block][U bytes], U = :func:`row_block_unit` (K). So byte c of row r of expert e sits at
    element offset ``e * rows * K/2 + r0 * K/2 + (c // U) * h * U + (r - r0) * U + c % U``, r0 = 64 * (r // 64),
    h = min(64, rows - r0); :func:`from_row_blocks` is the inverse."""
    return _permute_row_blocks(packed, True)


def from_row_blocks(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_row_blocks`."""
    return _permute_row_blocks(blocked, False)


def _by_expert_chunks(t: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` on chunks of experts of ``t [E, rows, K/2]`` (same shape out): the peak memory is the result plus
    one chunk's temporaries."""
    out = torch.empty_like(t)
    E, rows, kb = t.shape
    experts = max(1, _EXPERT_CHUNK_BYTES // max(rows * kb, 1))
    for e0 in range(0, E, experts):
        out[e0:e0 + experts] = fn(t[e0:e0 + experts])
    return out


def _prepared_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Source-order packed E2M1 ``[E, rows, K/2]`` -> the prepared bytes (:func:`interleave_block_bits`, then
    :func:`to_row_blocks`); :func:`_source_bytes` is the inverse."""
    return _by_expert_chunks(packed, lambda c: to_row_blocks(interleave_block_bits(c)))


def _source_bytes(prepared: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_prepared_bytes`."""
    return _by_expert_chunks(prepared, lambda c: gather_block_bits(from_row_blocks(c)))


# the W4A8 activation slot of value 2j + c of a stored word q (K 8j + 2q + c of its block): 4q + this (the byte order of
# ``_details.convert.E2M1X8_TO_E4M3_TABLE_ASM``: lane q's registers hold slots 4q .. 4q+3 and 16 + 4q .. 16 + 4q + 3)
E4M3_VALUE_SLOT = (1, 3, 0, 2, 19, 17, 16, 18)


def _e4m3_slot_k() -> list:
    """K (in its block) of each W4A8 activation slot 0..31."""
    k_of = [0] * 32
    for q in range(4):
        for v, slot in enumerate(E4M3_VALUE_SLOT):
            k_of[4 * q + slot] = 8 * (v // 2) + 2 * q + v % 2
    return k_of


def e4m3_slot_order(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` (K a multiple of 32) with each K32 block in the order the W4A8 kernels read FP8
    activations: slot s of a block holds K ``_e4m3_slot_k()[s]`` (``E4M3_VALUE_SLOT``), the order in which the E4M3
    conversion of prepared word q lands in wgmma's FP8 register operand."""
    shape = x.shape
    k_of = torch.tensor(_e4m3_slot_k(), device=x.device)
    return x.reshape(*shape[:-1], shape[-1] // 32, 32)[..., k_of].reshape(shape).contiguous()


def _row_ref(scale_u8: torch.Tensor) -> torch.Tensor:
    """Per row: the reference exponent byte (the largest scale byte of the kernels' scales), int32."""
    return scale_u8.amax(dim=-1).to(torch.int32).contiguous()


def _nonzero_blocks(packed: torch.Tensor) -> torch.Tensor:
    """bool ``[E, rows, K/32]`` of source-order packed E2M1 ``[E, rows, K/2]``: the blocks holding a nonzero value."""
    E, rows, kb = packed.shape
    return ((packed & 0x77) != 0).reshape(E, rows, kb // 16, 16).any(-1)


def kernel_scales(packed: torch.Tensor, scale_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale bytes the kernels read, and what restores the source's: ``(scales, restore int64 [n, 2])``.

    A block of zeros is zero whatever its byte, but a row's reference exponent (its largest byte) would follow a zero
    block's large byte and leave the row's real blocks far below it: W4A16 folds them into BF16 subnormals (lost
    bits), W4A8 sends the expert to the slower unfolded path. So a zero block's byte above the largest byte of its
    row's nonzero blocks is lowered to that byte; ``restore`` holds each lowered byte's flat index and source value
    (for :func:`unprepare_weights`). In a row of zeros only, bytes above 127 are lowered to 127 (W4A8's exact path
    would scale its zeros by 2^(b - 127) and overflow). ``packed``: source order, rows as ``scale_u8``'s."""
    E, rows, nb = scale_u8.shape
    scales = scale_u8.clone()
    lowered = []
    step = max(1, _EXPERT_CHUNK_BYTES // max(rows * nb * 16, 1))
    for e0 in range(0, E, step):
        s = scales[e0:e0 + step]
        nonzero = _nonzero_blocks(packed[e0:e0 + step])
        ref = torch.where(nonzero, s.to(torch.int16), torch.full_like(s, -1, dtype=torch.int16)).amax(-1, keepdim=True)
        ref = torch.where(ref >= 0, ref, torch.full_like(ref, 127))  # a row of zeros: 2^0
        high = ~nonzero & (s.to(torch.int16) > ref)
        idx = high.flatten().nonzero().squeeze(1)
        if idx.numel():
            lowered.append(torch.stack((idx + e0 * rows * nb, s.flatten()[idx].long()), dim=1))
            s.copy_(torch.where(high, ref.expand_as(s).to(torch.uint8), s))
    restore = torch.cat(lowered) if lowered else torch.zeros(0, 2, dtype=torch.int64, device=scales.device)
    return scales, restore


def _restored(scales: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
    out = scales.clone()
    if restore.numel():
        out.view(-1)[restore[:, 0]] = restore[:, 1].to(torch.uint8)
    return out


def fold_fits(packed: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """Per expert of source-order packed E2M1 ``[E, rows, K/2]`` with scale bytes ``[E, rows, K/32]``: 1 (int32 ``[E]``)
    where W4A8 can fold every K32 scale of every row into its E4M3 weights exactly, i.e. each block holding a nonzero
    value has a scale byte at most ``FOLD_SPAN`` below its row's largest (the table's window, E4M3 normals; a block of
    zeros converts to zeros whatever its byte)."""
    from ._details.convert import FOLD_SPAN

    E, rows, kb = packed.shape
    out = torch.empty(E, dtype=torch.int32, device=packed.device)
    step = max(1, _EXPERT_CHUNK_BYTES // max(rows * kb, 1))
    for e0 in range(0, E, step):
        w = packed[e0:e0 + step]
        s = scale_u8[e0:e0 + step].to(torch.int32)
        nonzero = _nonzero_blocks(w)
        low = s < s.amax(dim=-1, keepdim=True) - FOLD_SPAN
        out[e0:e0 + step] = (~(nonzero & low)).flatten(1).all(-1).to(torch.int32)
    return out


def fold_report(experts: "PreparedExperts") -> dict:
    """The fraction of experts (so of W4A8 tiles, which each hold one expert's rows) on the fast (folded) path, per GEMM
    and both: ``{"w13": f, "w2": f, "both": f}``."""
    both = (experts.w13_fold & experts.w2_fold).float().mean().item()
    return dict(w13=experts.w13_fold.float().mean().item(), w2=experts.w2_fold.float().mean().item(), both=both)


def _check_packed(w, s, name, rows, k):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if w.dtype != torch.uint8:
        raise TypeError(f"{name} must be torch.uint8 (packed E2M1), got {w.dtype}")
    s = scales_as_uint8(s, f"{name}_scale")
    if w.dim() != 3 or (rows is not None and w.shape[1] != rows) or (k is not None and w.shape[2] * 2 != k):
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected [E, {rows}, {k}/2]")
    if (w.shape[2] * 2) % BLOCK_K:
        raise ValueError(f"{name}: K = {w.shape[2] * 2} is not a multiple of {BLOCK_K}")
    if s.shape != (w.shape[0], w.shape[1], w.shape[2] * 2 // BLOCK_K):
        raise ValueError(f"{name}_scale has shape {tuple(s.shape)}, expected {(w.shape[0], w.shape[1], w.shape[2] * 2 // BLOCK_K)}")
    if s.device != w.device:
        raise ValueError(f"{name}_scale is on {s.device}, {name} on {w.device}")
    check_no_nan_scales(s, f"{name}_scale")
    return s


def _to_gate_up(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Reorder dim 1 of a w13-shaped tensor from ``layout`` to [gate; up]."""
    if layout == "gate_up":
        return t.contiguous()
    if layout == "up_gate":
        half = t.shape[1] // 2
        return torch.cat((t[:, half:], t[:, :half]), dim=1).contiguous()
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


def _from_gate_up(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "gate_up":
        return t
    half = t.shape[1] // 2
    if layout == "up_gate":
        return torch.cat((t[:, half:], t[:, :half]), dim=1)
    return torch.stack((t[:, :half], t[:, half:]), dim=2).reshape(t.shape)


def prepare_weights(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    w13_layout: str = "gate_up",
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    w13_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    swiglu_limit: Optional[float] = None,
    swiglu_alpha: Optional[float] = None,
) -> PreparedExperts:
    """Prepare E2M1-K32 expert weights once per model for both kernel paths.

    ``w13`` uint8 ``[E, 2I, H/2]`` with scales ``[E, 2I, H/32]``, rows ordered by
    ``w13_layout`` (``gate_up``, ``up_gate`` or ``interleaved``: even rows gate, odd rows
    up); ``w2`` uint8 ``[E, H, I/2]`` with scales ``[E, H, I/32]``. Scales are uint8 or
    ``torch.float8_e8m0fnu``; byte 255 is rejected. Optional biases ``b13 [E, 2I]`` (same
    row order as ``w13``) and ``b2 [E, H]``, and per-expert FP32 global scales ``[E]``
    (default 1) multiplying each GEMM's output before its bias. ``activation`` (``"silu"`` or ``"swigluoai"``,
    with ``swiglu_limit`` / ``swiglu_alpha`` as :func:`mxmoe.fused_moe` takes them): the activation these weights
    belong to, remembered by the result, so that a call naming none runs it and a call naming another raises
    (None: none remembered; calls default to silu). :func:`mxmoe.load_gpt_oss_experts` gives gpt-oss's. Runs on
    the weights' device; call once at load time (it synchronizes with the host to validate).
    """
    remembered = None if activation is None else Activation.of(activation, swiglu_limit, swiglu_alpha)
    if activation is None and (swiglu_limit is not None or swiglu_alpha is not None):
        raise ValueError("swiglu_limit and swiglu_alpha need an activation")
    if w13_layout not in W13_LAYOUTS:
        raise ValueError(f"w13_layout must be one of {W13_LAYOUTS}, got {w13_layout!r}")
    s13 = _check_packed(w13, w13_scale, "w13", None, None)
    E, two_i, half_h = w13.shape
    if two_i % 2 or two_i == 0 or E == 0:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}; expected [E >= 1, 2*I >= 2, H/2]")
    H, I = half_h * 2, two_i // 2
    s2 = _check_packed(w2, w2_scale, "w2", H, I)
    if w2.shape[0] != E:
        raise ValueError(f"w2 has {w2.shape[0]} experts, w13 has {E}")
    if I % BLOCK_K:
        raise ValueError(f"w2: K = I = {I} is not a multiple of {BLOCK_K}")
    if w2.device != w13.device:
        raise ValueError(f"w2 is on {w2.device}, w13 on {w13.device}")

    def vector(t, name, shape):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.device != w13.device:
            raise ValueError(f"{name} is on {t.device}, w13 on {w13.device}")
        return t.float().contiguous()

    b13 = vector(b13, "b13", (E, two_i))
    b2 = vector(b2, "b2", (E, H))
    g13 = vector(w13_global_scale, "w13_global_scale", (E,))
    g2 = vector(w2_global_scale, "w2_global_scale", (E,))

    w13_n = _to_gate_up(w13, w13_layout)
    s13_n = _to_gate_up(s13, w13_layout)

    s13_k, restore13 = kernel_scales(w13_n, s13_n)
    s2_k, restore2 = kernel_scales(w2, s2)
    fold13, fold2 = fold_fits(w13_n, s13_k), fold_fits(w2, s2_k)
    return PreparedExperts(
        w13=_prepared_bytes(w13_n), w13_scale=s13_k.contiguous(), w2=_prepared_bytes(w2), w2_scale=s2_k.contiguous(),
        w13_ref=_row_ref(s13_k), w2_ref=_row_ref(s2_k), w13_fold=fold13, w2_fold=fold2,
        w13_scale_restore=restore13, w2_scale_restore=restore2,
        all_fold=bool(fold13.all()) and bool(fold2.all()),
        b13=None if b13 is None else _to_gate_up(b13.unsqueeze(-1), w13_layout).squeeze(-1),
        b2=b2, w13_global_scale=g13, w2_global_scale=g2,
        source_layout=w13_layout, source_scale_dtypes=(w13_scale.dtype, w2_scale.dtype), activation=remembered,
    )


def unprepare_weights(experts: PreparedExperts) -> dict:
    """Decode a :class:`PreparedExperts` back to the source tensors, bit for bit.

    Returns ``w13, w13_scale, w2, w2_scale`` in the source row layout and scale dtype
    (plus ``b13``/``b2`` as float32 when present) and ``w13_layout``, and the remembered activation (``activation``,
    ``swiglu_limit``, ``swiglu_alpha``) where there is one: keyword arguments of :func:`prepare_weights`.
    """
    def scale(t, dtype):
        return t.view(dtype) if dtype != torch.uint8 else t

    check_layout_version(experts)
    layout = experts.source_layout
    w13, w2 = experts.source_order_weights()
    out = dict(
        w13=_from_gate_up(w13, layout).contiguous(),
        w13_scale=scale(_from_gate_up(_restored(experts.w13_scale, experts.w13_scale_restore), layout).contiguous(),
                        experts.source_scale_dtypes[0]),
        w2=w2, w2_scale=scale(_restored(experts.w2_scale, experts.w2_scale_restore), experts.source_scale_dtypes[1]),
        w13_layout=layout,
    )
    if experts.b13 is not None:
        out["b13"] = _from_gate_up(experts.b13.unsqueeze(-1), layout).squeeze(-1).contiguous()
    if experts.b2 is not None:
        out["b2"] = experts.b2.clone()
    if experts.activation is not None:
        out.update(zip(("activation", "swiglu_limit", "swiglu_alpha"), experts.activation.call_args))
    return out
