"""int8 / int4 KV-cache quantization: K and V stored as integers with one scale per (token, head).

Each token's keys and values are quantized on their own, symmetric, along the head dimension
(scale = max|x| / (2^(bits−1) − 1)), and dequantized when attention reads them. Because a token's stored
form depends on that token alone, plain and speculative decoding see bit-identical caches: verification is
exactly lossless with respect to the quantized-cache model (KIVI's per-channel key scales would depend on
which tokens share a group, and so on how many tokens a forward appends). int4 packs two values per byte.
Memory: int8 ≈ 1/4 of fp32 (+ a 4-byte scale per 64-dim head), int4 ≈ 1/8.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D] (int4: [..., D/2] packed), scale float32 [..., 1])."""
    qmax = 2 ** (bits - 1) - 1
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-8) / qmax
    codes = torch.round(x.float() / scale).clamp(-qmax, qmax).to(torch.int8)
    if bits == 4:
        lo, hi = codes[..., 0::2] & 0x0F, codes[..., 1::2] & 0x0F
        codes = (lo | (hi << 4)).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize (up to rounding)."""
    if bits == 4:
        lo = (codes << 4) >> 4  # sign-extend the low nibble
        hi = codes >> 4
        codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    return (codes.float() * scale).to(dtype)


class QuantizedLayer(DynamicLayer):
    """A DynamicLayer that keeps K/V as int8 or packed int4 codes plus per-(token, head) scales."""

    def __init__(self, bits: int = 8) -> None:
        if bits not in (4, 8):
            raise ValueError("KV quantization supports 8 or 4 bits")
        super().__init__()
        self.bits = bits
        self.k_codes = self.v_codes = self.k_scale = self.v_scale = None
        self.out_dtype = torch.float32

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Quantize the new K/V, append, return the dequantized full K/V for attention."""
        kc, ks = quantize(key_states, self.bits)
        vc, vs = quantize(value_states, self.bits)
        if self.k_codes is None:
            self.out_dtype = key_states.dtype
            self.k_codes, self.k_scale, self.v_codes, self.v_scale = kc, ks, vc, vs
            self.is_initialized = True
            self.dtype, self.device = key_states.dtype, key_states.device
        else:
            self.k_codes = torch.cat([self.k_codes, kc], -2)
            self.k_scale = torch.cat([self.k_scale, ks], -2)
            self.v_codes = torch.cat([self.v_codes, vc], -2)
            self.v_scale = torch.cat([self.v_scale, vs], -2)
        return self.keys, self.values

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """Dequantized keys [B, H, T, D]."""
        return None if self.k_codes is None else dequantize(self.k_codes, self.k_scale, self.bits, self.out_dtype)

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("set keys through update(); use select() to drop slots")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """Dequantized values [B, H, T, D]."""
        return None if self.v_codes is None else dequantize(self.v_codes, self.v_scale, self.bits, self.out_dtype)

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("set values through update(); use select() to drop slots")

    def get_seq_length(self) -> int:
        """Cached tokens."""
        return 0 if self.k_codes is None else self.k_codes.shape[-2]

    def select(self, slots: torch.Tensor) -> None:
        """Keep only these slots (int64 [n], increasing)."""
        for name in ("k_codes", "k_scale", "v_codes", "v_scale"):
            setattr(self, name, getattr(self, name).index_select(-2, slots))

    def nbytes(self) -> int:
        """Bytes held by the stored codes and scales."""
        if self.k_codes is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.k_scale, self.v_codes, self.v_scale))
