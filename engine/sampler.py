"""Pick the next token of each request from its logits, and report logprobs where asked.

Per step, in vLLM's order:

    raw logits --> logprobs (log_softmax; only rows asking, before anything below)
        |
        +--> min_tokens mask, penalties (engine/logits_processing.py; only rows asking)
               +--> greedy rows: one batched argmax
               +--> plain rows (no seed, min_p, top-k, top-p: the API's defaults): one
               |    batched draw from softmax(logits / temperature)
               +--> other rows: / temperature -> min_p -> top_k -> top_p -> draw

A request with a seed draws from its own torch.Generator seeded by (seed, len(token_ids)), so the
same request replays the same tokens whatever it is batched with or preempted by, and the sampler
keeps no per-request state. Requests without a seed draw from the sampler's generator.
Stop conditions (EOS, stop ids, max_tokens) are the engine's job, not the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.logits_processing import process_logits
from engine.logprobs import TokenLogprobs
from engine.request import Request, SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: neighbouring steps get unrelated seeds
_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, num_tokens: int) -> int:
    """The generator seed for a request with `num_tokens` tokens so far."""
    return (seed * _SEED_MIX + num_tokens) & _SEED_MASK


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        """``eos_token_ids`` are masked with the stop ids until a request has min_tokens."""
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [N, vocab] (float32), a row per request -> (a token per request, its
        logprobs where the request asked for them, else None)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        if not requests:
            return [], []
        processed = process_logits(logits, requests, self.eos_token_ids)
        tokens = [0] * len(requests)
        greedy_rows, plain_rows = [], []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if params.greedy:
                greedy_rows.append(row)
            elif is_plain(params):
                plain_rows.append(row)
            else:
                generator = self._generator(params.seed, request.num_tokens)
                tokens[row] = sample_row(processed[row], params, generator)
        if greedy_rows:  # one batched argmax covers them all
            picked = processed[greedy_rows].argmax(dim=-1).tolist()
            for row, token in zip(greedy_rows, picked, strict=True):
                tokens[row] = token
        if plain_rows:  # one batched draw covers them all
            temperatures = [requests[row].sampling_params.temperature for row in plain_rows]
            picked = draw_rows(processed[plain_rows], temperatures, self.generator)
            for row, token in zip(plain_rows, picked, strict=True):
                tokens[row] = token
        return tokens, token_logprobs(logits, requests, tokens)

    def _generator(self, seed: int | None, num_tokens: int) -> torch.Generator:
        if seed is None:
            return self.generator
        return torch.Generator().manual_seed(step_seed(seed, num_tokens))


def is_plain(params: SamplingParams) -> bool:
    """A draw from softmax(logits / T) alone, from the sampler's generator: no seed of its
    own, no min_p, top-k or top-p. Such rows (the API's defaults) are drawn together."""
    return params.seed is None and params.min_p == 0 and params.top_k <= 0 and params.top_p >= 1


def draw_rows(
    logits: torch.Tensor, temperatures: list[float], generator: torch.Generator
) -> list[int]:
    """One draw per row from softmax(logits[row] / temperatures[row]), all rows in a few
    batched ops (the inverse CDF of ``draw``, row-wise): 16 rows of a 49k vocabulary took
    ~3.5 ms one by one and take ~0.7 ms here."""
    device = logits.device  # the draws come from the CPU generator, the rest stays there
    scale = torch.tensor(temperatures, dtype=torch.float32, device=device)[:, None]
    cdf = torch.softmax(logits.float() / scale, dim=-1).cumsum(dim=-1)
    uniform = torch.rand(len(temperatures), 1, generator=generator).to(device)
    targets = uniform * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True)[:, 0]
    return picked.clamp_(max=logits.shape[1] - 1).tolist()


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from softmax(logits / T) restricted by min_p, the top-k and the top-p nucleus."""
    scaled = logits.float().cpu() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
    return draw(probs, generator)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the distribution ``probs`` (not necessarily summing to 1) by inverting
    its CDF at a uniform draw: the first token whose cumulative mass exceeds it, so a token of
    zero mass is never drawn. torch.multinomial draws the same distribution but costs about
    1.3 ms per 49k-token row on a CPU; this is about 0.05 ms."""
    cdf = probs.cumsum(0)
    target = torch.rand(1, generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, target, right=True).item()), probs.shape[0] - 1)


def token_logprobs(
    logits: torch.Tensor, requests: Sequence[Request], tokens: list[int]
) -> list[TokenLogprobs | None]:
    """For each request that asked (sampling_params.logprobs = N), log_softmax of its raw
    logits at the sampled token and at the N most likely tokens; None for the others."""
    results: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not rows:
        return results
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    num_top = min(max(requests[row].sampling_params.logprobs for row in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    sampled_ids = torch.tensor([tokens[row] for row in rows], device=logprobs.device)
    sampled_values = logprobs.gather(1, sampled_ids[:, None])[:, 0].tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for i, row in enumerate(rows):
        num = requests[row].sampling_params.logprobs
        results[row] = TokenLogprobs(
            tokens[row], sampled_values[i], top_ids[i][:num], top_values[i][:num]
        )
    return results
