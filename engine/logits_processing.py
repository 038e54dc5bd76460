"""What changes a request's logits before its token is picked, greedy or not: the min_tokens
mask and the repetition, frequency and presence penalties (vLLM's order and meanings).

    min_tokens          while the output is shorter, EOS and stop_token_ids get -inf
    repetition_penalty  tokens seen in the prompt or the output: a positive logit is divided
                        by it, a negative one multiplied (1 = off)
    frequency_penalty   logit -= frequency_penalty * count in the output
    presence_penalty    logit -= presence_penalty * (count in the output > 0)

Only the rows that ask pay: a batch where none does returns the same tensor untouched, and
the work per row is whole-vocabulary tensor operations, never a Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request


def needs_processing(request: Request) -> bool:
    params = request.sampling_params
    if params.min_tokens and request.num_output_tokens < params.min_tokens:
        return True
    return params.penalized


def process_logits(
    logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """logits [N, vocab] of one step, a row per request; a new tensor if any row changes."""
    rows = [row for row, request in enumerate(requests) if needs_processing(request)]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        request = requests[row]
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            stop_ids = [*eos_token_ids, *params.stop_token_ids]
            logits[row, stop_ids] = float("-inf")
        if params.penalized:
            logits[row] = penalize(logits[row], request)
    return logits


def penalize(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """One request's logits [vocab] after its repetition, frequency and presence penalties."""
    params = request.sampling_params
    vocab_size, device = logits.shape[-1], logits.device
    output_ids = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
    counts = torch.bincount(output_ids, minlength=vocab_size).to(logits.dtype)
    in_output = counts > 0
    if params.repetition_penalty != 1.0:
        seen = in_output.clone()
        seen[torch.tensor(request.prompt_token_ids, dtype=torch.long, device=device)] = True
        penalized = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits = torch.where(seen, penalized, logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * in_output
