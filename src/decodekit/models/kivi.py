"""The quantised part of a KIVI cache (kv caches ``int4`` and ``int2``; Liu et al., 2024, "KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache").

KIVI's observation: keys have outlier *channels* and values do not, so keys are quantised per
channel over a group of tokens and values per token. Both are asymmetric (a scale and a minimum,
``x ≈ scale * code + min`` with codes ``0 .. 2**bits - 1``), rounded to nearest even. The most
recent tokens stay in float32 (the residual, in the backend's ordinary cache); :class:`KiviStore`
holds the codes of the tokens before it, a whole group at a time. Which positions a query reads
quantised is a function of its own position (:meth:`..kv_policy.KiviPolicy.quantised_end`), so a
token's logits do not depend on how the sequence was cut into passes.

Codes are packed 8 / bits to a byte, 16 channels in 2 * bits bytes: with ``n = 2 * bits`` bytes a
chunk, byte ``b`` holds channels ``b, b + n, b + 2n, ...`` from its lowest bits up (4 bits: channel
``b`` in the low nibble, ``b + 8`` in the high one), what ``attention.c``'s ``load_codes`` unpacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (uint8 below ``2**bits``; D a multiple of 16) packed into ``[..., D * bits / 8]`` bytes."""
    per_byte, width = 8 // bits, 2 * bits
    chunks = codes.reshape(*codes.shape[:-1], -1, per_byte, width)
    packed = chunks[..., 0, :].clone()
    for k in range(1, per_byte):
        packed |= chunks[..., k, :] << (bits * k)
    return packed.reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`."""
    per_byte, width, mask = 8 // bits, 2 * bits, (1 << bits) - 1
    chunks = packed.reshape(*packed.shape[:-1], -1, width)
    return torch.stack([(chunks >> (bits * k)) & mask for k in range(per_byte)], dim=-2).reshape(*packed.shape[:-1], -1)


def _codes(x: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int) -> torch.Tensor:
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # a constant span: every code 0
    return ((x - low) * inverse).round().clamp(0, (1 << bits) - 1).to(torch.uint8)


def quantise_keys(keys: torch.Tensor, group: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[..., n, D]`` (n a multiple of ``group``) per channel over groups of ``group`` tokens:
    packed codes ``[..., n, D * bits / 8]`` and parameters ``[..., n / group, 2, D]`` (scales, minima)."""
    x = keys.float().reshape(*keys.shape[:-2], -1, group, keys.shape[-1])
    low, high = x.amin(dim=-2, keepdim=True), x.amax(dim=-2, keepdim=True)
    scale = (high - low) / ((1 << bits) - 1)
    codes = pack_codes(_codes(x, scale, low, bits), bits).reshape(*keys.shape[:-1], -1)
    return codes, torch.cat([scale, low], dim=-2)


def quantise_values(values: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[..., n, D]`` per token: packed codes ``[..., n, D * bits / 8]`` and parameters
    ``[..., n, 2]`` (scale, minimum)."""
    x = values.float()
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    scale = (high - low) / ((1 << bits) - 1)
    return pack_codes(_codes(x, scale, low, bits), bits), torch.cat([scale, low], dim=-1)


def dequantise_keys(codes: torch.Tensor, params: torch.Tensor, group: int, bits: int = 4) -> torch.Tensor:
    """float32 keys ``[..., n, D]`` from :func:`quantise_keys`' output."""
    x = unpack_codes(codes, bits).float()
    scale, low = (p.repeat_interleave(group, dim=-2) for p in params.unbind(dim=-2))
    return x * scale + low


def dequantise_values(codes: torch.Tensor, params: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """float32 values ``[..., n, D]`` from :func:`quantise_values`' output."""
    return unpack_codes(codes, bits).float() * params[..., :1] + params[..., 1:]


@dataclass
class KiviView:
    """What a pass over an int4 or int2 cache reads besides its float residual: the codes of every layer,
    the position of the residual's slot 0, and per row of the pass the position its float keys
    start at."""

    store: "KiviStore"
    base: int
    qend: torch.Tensor


class KiviStore:
    """Every layer's quantised keys and values for positions ``0 .. tokens - 1`` (a multiple of
    ``group``), grown by doubling."""

    def __init__(self, num_layers: int, n_kv_heads: int, head_dim: int, group: int, bits: int = 4):
        if head_dim % 16 or bits not in BITS:
            raise ValueError(f"a KIVI cache needs a head size that is a multiple of 16 and {' or '.join(map(str, BITS))} bits")
        self.shape, self.group, self.bits, self.tokens = (num_layers, n_kv_heads), group, bits, 0
        self.head_dim = head_dim
        self._allocate(0)

    def _allocate(self, capacity: int) -> None:
        L, H = self.shape
        D, G = self.head_dim, self.group
        self.k_codes = torch.zeros(L, H, capacity, D * self.bits // 8, dtype=torch.uint8)
        self.v_codes = torch.zeros(L, H, capacity, D * self.bits // 8, dtype=torch.uint8)
        self.k_params = torch.zeros(L, H, capacity // G, 2, D)
        self.v_params = torch.zeros(L, H, capacity, 2)

    @property
    def capacity(self) -> int:
        return self.k_codes.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantise the next ``n`` positions' keys and values ``[L, H_kv, n, D]`` (n a multiple of group)."""
        n, G = keys.shape[2], self.group
        if n % G:
            raise ValueError(f"a KIVI cache quantises whole groups of {G} tokens, got {n}")
        end = self.tokens + n
        if end > self.capacity:
            old = (self.k_codes, self.v_codes, self.k_params, self.v_params)
            self._allocate(max(end, 2 * self.capacity, 4 * G))
            held, g = self.tokens, self.tokens // G
            self.k_codes[:, :, :held], self.v_codes[:, :, :held] = old[0][:, :, :held], old[1][:, :, :held]
            self.k_params[:, :, :g], self.v_params[:, :, :held] = old[2][:, :, :g], old[3][:, :, :held]
        k_codes, k_params = quantise_keys(keys, G, self.bits)
        v_codes, v_params = quantise_values(values, self.bits)
        span = slice(self.tokens, end)
        self.k_codes[:, :, span], self.v_codes[:, :, span], self.v_params[:, :, span] = k_codes, v_codes, v_params
        self.k_params[:, :, self.tokens // G : end // G] = k_params
        self.tokens = end

    def nbytes(self) -> int:
        """Bytes the quantised tokens take (codes and parameters; capacity not counted)."""
        L, H = self.shape
        per_token = 2 * self.head_dim * self.bits / 8 + 2 * 4 + 2 * self.head_dim * 4 / self.group  # codes, params
        return int(L * H * self.tokens * per_token)
