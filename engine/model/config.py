"""ModelConfig: the shape of a Llama-family or Qwen3 decoder, read from an HF config.json.

Everything the engine plans with (layers, KV heads, head_dim, dtype) lives here, so KV memory
planning never needs the weights. RoPE settings are kept as given (`rope_theta` and the
`rope_scaling` / `rope_parameters` dict); engine/model/rope.py interprets them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'bfloat16' | 'float32' | 'float16' (or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen3"
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str, dtype: str | torch.dtype) -> ModelConfig:
        """Build from the dict of an HF config.json (transformers 4.x or 5.x spelling)."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = hf.get("architectures") or [model_type]
            raise ValueError(
                f"{name}: unsupported model_type {model_type!r} ({', '.join(archs)}); "
                f"iterscope runs {', '.join(SUPPORTED_ARCHITECTURES)} models"
            )
        if hf.get("use_sliding_window"):
            raise ValueError(f"{name}: sliding-window attention is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{name}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
        if hf.get("mlp_bias"):
            raise ValueError(f"{name}: mlp_bias is not supported")
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=model_type,
            name=name,
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            eos_token_ids=eos_ids,
            dtype=parse_dtype(dtype),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
        )
