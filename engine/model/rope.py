"""Rotary position embeddings, in the rotate-half layout HF Llama and Qwen3 use.

The head is split in halves (x1, x2); position p rotates pair (x1[i], x2[i]) by p * inv_freq[i].
Supported `rope_scaling` types: default, linear, llama3 (others fail at load time).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """float32 [head_dim // 2] angular frequencies, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope_scaling)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each [num_tokens, 1, head_dim], computed once per step in fp32:
    cos = [cos | cos] and sin = [-sin | sin] over the two halves, as apply_rope uses them."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    cos_full = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
    sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
    return cos_full, sin_signed


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] -> rotated copy of the same shape:
    [x1 | x2] * cos + [x2 | x1] * sin = [x1 cos - x2 sin | x2 cos + x1 sin] (three ops)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)
