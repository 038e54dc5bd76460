"""Pick the next token of each request from its logits: greedy, temperature, top-k, top-p.

A request with a seed draws from its own torch.Generator seeded by (seed, len(token_ids)), so the
same request replays the same tokens whatever it is batched with or preempted by, and the sampler
keeps no per-request state. Requests without a seed draw from the sampler's generator.
Stop conditions (EOS, stop ids, max_tokens) are the engine's job, not the sampler's.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: neighbouring steps get unrelated seeds
_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, num_tokens: int) -> int:
    """The generator seed for a request with `num_tokens` tokens so far."""
    return (seed * _SEED_MIX + num_tokens) & _SEED_MASK


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], num_tokens: list[int]
    ) -> list[int]:
        """logits [N, vocab] (float32); params and num_tokens (len(token_ids)) per row."""
        if logits.shape[0] != len(params) or len(params) != len(num_tokens):
            raise ValueError(
                f"{logits.shape[0]} logit rows for {len(params)} params "
                f"and {len(num_tokens)} requests"
            )
        if not params:
            return []
        tokens = logits.argmax(dim=-1).tolist()  # one batched op covers every greedy row
        for row, sp in enumerate(params):
            if not sp.greedy:
                generator = self._generator(sp.seed, num_tokens[row])
                tokens[row] = sample_row(logits[row], sp, generator)
        return tokens

    def _generator(self, seed: int | None, num_tokens: int) -> torch.Generator:
        if seed is None:
            return self.generator
        return torch.Generator().manual_seed(step_seed(seed, num_tokens))


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from softmax(logits / T) restricted to the top-k and the top-p nucleus."""
    scaled = logits.float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[0]:
        kth_value = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_value, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it
        # already does. The most likely token is always kept.
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
