"""The Llama / Qwen3 decoder over a flat batch of tokens, reading and writing a paged KV cache.

Weights come in as an HF-named state dict (`model.layers.{i}.self_attn.q_proj.weight`, ...);
q/k/v and gate/up are fused into one matrix each so a layer runs four matmuls. Qwen3 differs
from Llama only by an RMSNorm over each head of q and k before RoPE (and an explicit head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model import matmul_choice
from engine.model.attention import PagedAttention
from engine.model.attention_metadata import AttentionMetadata
from engine.model.config import ModelConfig
from engine.model.kernels import (
    cpu_build,
    cpu_matmul,
    cpu_paged_decode,
    cpu_prefill_attention,
    cpu_rms_norm,
    cpu_rope_store,
)
from engine.model.linear import Linear
from engine.model.rope import apply_rope, inverse_frequencies, rope_cos_sin


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_proj: Linear  # hidden -> q_size + 2 * kv_size
    o_proj: Linear
    post_attention_norm: torch.Tensor
    gate_up_proj: Linear  # hidden -> silu(gate) * up, intermediate (gated)
    down_proj: Linear
    q_norm: torch.Tensor | None  # Qwen3 only: [head_dim]
    k_norm: torch.Tensor | None


class Decoder:
    """forward(tokens) -> final hidden states; compute_logits(hidden) -> float32 logits."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], device: str):
        self.config = config
        self.device = torch.device(device)
        weights = _WeightReader(state_dict, config.dtype, self.device)
        self.embed_tokens = weights.take("model.embed_tokens.weight")
        self.layers = [self._layer_weights(weights, i) for i in range(config.num_layers)]
        self.final_norm = weights.take("model.norm.weight")
        if config.tie_word_embeddings or "lm_head.weight" not in state_dict:
            self.lm_head = Linear(self.embed_tokens)
        else:
            self.lm_head = Linear(weights.take("lm_head.weight"))
        weights.check_all_used(config.name)
        self.inv_freq = inverse_frequencies(
            config.head_dim, config.rope_theta, config.rope_scaling
        ).to(self.device)
        self.attention = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, config.dtype, self.device
        )
        # The norm after each residual add: the next layer's input norm, the final one last.
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        self.norm_kernel = None  # the CPU residual-add + RMSNorm kernel, where it applies
        if self.device.type == "cpu" and cpu_rms_norm.supports(config.dtype, config.hidden_size):
            self.norm_kernel = cpu_rms_norm.KERNEL.load()
        # RoPE and the K/V store in one CPU kernel, where attention reads keys and values from
        # the cache alone (the rotated keys then exist nowhere else).
        self.rope_kernel = None
        if self.attention.reads_only_the_cache and cpu_rope_store.supports(
            config.dtype, config.head_dim
        ):
            self.rope_kernel = cpu_rope_store.KERNEL.load()
        self._rope_fused = False  # this step's RoPE runs in the kernel
        self._rope_threads = 1  # of this step's rope kernel calls

    def cpu_kernels_line(self) -> str:
        """The start-up line: the CPU kernels this model runs, and why any other does not
        (torch's ops run in its place, slower: docs/performance.md)."""
        kernels = {
            "paged decode": (self.attention.cpu_kernel, cpu_paged_decode.KERNEL),
            "prefill attention": (self.attention.prefill_kernel, cpu_prefill_attention.KERNEL),
            "RMSNorm": (self.norm_kernel, cpu_rms_norm.KERNEL),
            "RoPE + K/V store": (self.rope_kernel, cpu_rope_store.KERNEL),
            "matmul": (self.lm_head.kernel, cpu_matmul.KERNEL),
        }
        if not cpu_build.kernels_enabled():
            return "CPU kernels: none (ITERSCOPE_CPU_KERNELS=0): torch's ops run"
        used = [name for name, (library, _) in kernels.items() if library is not None]
        if self.lm_head.kernel is not None:  # chosen by a timing on a kind not measured before
            used[used.index("matmul")] += matmul_choice.note_here(self.config.dtype)
        why_not = {
            name: kernel.build_error() or "not for this dtype or these shapes"
            for name, (library, kernel) in kernels.items()
            if library is None
        }
        if self.rope_kernel is None and not self.attention.reads_only_the_cache:
            why_not["RoPE + K/V store"] = "needs both attention kernels"  # its own condition
        if self.lm_head.kernel is None and not cpu_matmul.KERNEL.build_error():
            why_not["matmul"] = matmul_choice.why_not_here(
                self.config.dtype, self.lm_head.in_features
            )
        line = f"CPU kernels: {', '.join(used) or 'none'}"
        if not why_not:
            return line
        return line + "; torch's ops for " + "; ".join(f"{n}: {why}" for n, why in why_not.items())

    def _layer_weights(self, weights: _WeightReader, i: int) -> LayerWeights:
        prefix = f"model.layers.{i}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv_names = [attn + n for n in ("q_proj", "k_proj", "v_proj")]
        qkv_bias = o_bias = None
        if self.config.attention_bias:
            qkv_bias = torch.cat([weights.take(n + ".bias") for n in qkv_names])
            o_bias = weights.take(attn + "o_proj.bias")
        qwen3 = self.config.architecture == "qwen3"
        gate_up = [weights.take(mlp + "gate_proj.weight"), weights.take(mlp + "up_proj.weight")]
        return LayerWeights(
            input_norm=weights.take(prefix + "input_layernorm.weight"),
            qkv_proj=Linear(torch.cat([weights.take(n + ".weight") for n in qkv_names]), qkv_bias),
            o_proj=Linear(weights.take(attn + "o_proj.weight"), o_bias),
            post_attention_norm=weights.take(prefix + "post_attention_layernorm.weight"),
            gate_up_proj=Linear(torch.cat(gate_up), gated=True),
            down_proj=Linear(weights.take(mlp + "down_proj.weight")),
            q_norm=weights.take(attn + "q_norm.weight") if qwen3 else None,
            k_norm=weights.take(attn + "k_norm.weight") if qwen3 else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> normed hidden states [T, hidden].

        kv_cache is [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim].
        """
        cfg = self.config
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, cfg.dtype)
        self.attention.begin_step(meta, kv_cache[0, 0])
        # per step: attention's kernels can be turned off after load (tests)
        self._rope_fused = self.rope_kernel is not None and self.attention.reads_only_the_cache
        if self._rope_fused:
            cpu_rope_store.check_slots(
                meta.slot_blocks, meta.slot_offsets, kv_cache.shape[2], kv_cache.shape[4]
            )
            self._rope_threads = torch.get_num_threads()
        num_tokens = input_ids.shape[0]
        x = self._add_rms_norm(hidden, None, self.layers[0].input_norm)
        for layer, layer_cache, next_norm in zip(
            self.layers, kv_cache, self.next_norms, strict=True
        ):
            qkv = layer.qkv_proj(x).view(num_tokens, -1, cfg.head_dim)  # heads: q | k | v
            q_and_k = qkv[:, : cfg.num_heads + cfg.num_kv_heads]
            v = qkv[:, cfg.num_heads + cfg.num_kv_heads :]
            if layer.q_norm is not None:
                q_and_k = torch.cat(
                    (
                        self._rms_norm(q_and_k[:, : cfg.num_heads], layer.q_norm),
                        self._rms_norm(q_and_k[:, cfg.num_heads :], layer.k_norm),
                    ),
                    dim=1,
                )
            q, k, v = self._rope(q_and_k, v, cos, sin, layer_cache, meta)
            attn = self.attention(q, k, v, layer_cache[0], layer_cache[1], meta)
            x = self._add_rms_norm(hidden, layer.o_proj(attn), layer.post_attention_norm)
            x = self._add_rms_norm(hidden, layer.down_proj(layer.gate_up_proj(x)), next_norm)
        return x

    def _rope(
        self,
        q_and_k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The rotated queries, and the rotated keys and the values for attention to store;
        with the CPU kernel, which stores those two itself, (queries, None, None)."""
        num_heads = self.config.num_heads
        if not self._rope_fused:
            q_and_k = apply_rope(q_and_k, cos, sin)  # one call rotates both
            return q_and_k[:, :num_heads], q_and_k[:, num_heads:], v
        q = cpu_rope_store.rope_store(
            self.rope_kernel,
            q_and_k[:, :num_heads],
            q_and_k[:, num_heads:],
            v,
            cos,
            sin,
            layer_cache[0],
            layer_cache[1],
            meta.slot_blocks,
            meta.slot_offsets,
            self._rope_threads,
        )
        return q, None, None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def _add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """``hidden += delta`` (in place: the residual stream is this forward's own tensor),
        then the RMSNorm of hidden: in one pass with the CPU kernel, else torch's ops, which
        round the same way."""
        if self.norm_kernel is not None:
            return cpu_rms_norm.add_rms_norm(
                self.norm_kernel, hidden, delta, weight, self.config.rms_norm_eps
            )
        if delta is not None:
            hidden.add_(delta)
        return self._rms_norm(hidden, weight)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)


class _WeightReader:
    """Hands out state-dict tensors in the model dtype and device, and reports unknown names."""

    def __init__(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.state_dict = state_dict
        self.dtype = dtype
        self.device = device
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.state_dict:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        self.used.add(name)
        return self.state_dict[name].to(device=self.device, dtype=self.dtype).contiguous()

    def check_all_used(self, model_name: str) -> None:
        ignorable = ("rotary_emb.inv_freq", "lm_head.weight")
        unused = [n for n in self.state_dict if n not in self.used and not n.endswith(ignorable)]
        if unused:
            raise ValueError(f"{model_name}: unexpected weights {unused[:5]} ({len(unused)} total)")
