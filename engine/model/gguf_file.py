"""Read a llama.cpp GGUF file: config, HF-named dequantized weights and tokenizer fields.

llama.cpp's converter stores the Q and K projections of Llama models with the rows of each head
reordered for its own RoPE kernel (pairs interleaved instead of split in halves):

    HF rows of one head:   [r0 r1 ... r(d/2-1) | r(d/2) ... r(d-1)]      (rotate-half layout)
    GGUF rows:             [r0 r(d/2) r1 r(d/2+1) ...]                   (interleaved pairs)

`unpermute_rope_rows` puts them back, so the weights run in the same decoder as HF checkpoints.
Qwen3 files are stored unpermuted.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.model.gguf_reader import GGUFFile

GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file (tensors memory-mapped); pass it to the functions below."""
    try:
        from engine.model.gguf_reader import read_gguf
    except ImportError as exc:  # a runtime dependency, but say what is missing
        raise ImportError("reading GGUF files needs the `gguf` package") from exc
    return read_gguf(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key, default)
    # a fresh list per call, as GGUFReader's contents() gave: a caller's edit stays its own
    return list(value) if isinstance(value, list) else value


def read_gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """The scalar and string fields (token lists excluded) as a plain dict."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    return {k: _field(reader, k) for k in reader.fields if k not in skip}


def gguf_hf_config(reader: GGUFFile) -> dict[str, Any]:
    """An HF config.json-style dict built from the file's metadata."""
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen3)")
    num_heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // num_heads)
    config = {
        "model_type": arch,
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "hidden_size": hidden,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"]),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    rope_scaling = gguf_rope_scaling(meta, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """The file's RoPE scaling as an HF ``rope_scaling`` dict; None when it has none. A kind
    we cannot honour is refused: running it unscaled would give wrong tokens silently."""
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"GGUF RoPE scaling {scaling_type!r} is not supported (only linear)")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K rows (see the module docstring)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def load_gguf_state_dict(reader: GGUFFile, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 and name it as transformers would."""
    import torch  # here, not at the top: the frontend reads GGUF tokenizers without torch
    from gguf.quants import dequantize

    permuted = config["model_type"] == "llama"
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if permuted and name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        if not array.flags.writeable:  # float32 tensors come straight from the memory map
            array = array.copy()
        state_dict[name] = torch.from_numpy(np.ascontiguousarray(array))
    if "lm_head.weight" not in state_dict:
        config["tie_word_embeddings"] = True
    return state_dict


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{name}.{weight|bias}
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "this GGUF carries per-frequency RoPE factors (rope_freqs, Llama 3.1 style), "
            "which the GGUF loader does not support; load the HF directory instead"
        )
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"


def gguf_tokenizer_fields(reader: GGUFFile) -> dict[str, Any]:
    """tokens, token types, merges, special ids and chat template, as stored."""
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": _field(reader, "tokenizer.ggml.tokens"),
        "token_type": _field(reader, "tokenizer.ggml.token_type", []),
        "merges": _field(reader, "tokenizer.ggml.merges", []),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
