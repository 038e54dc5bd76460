"""Reference computations for the sampling tests, written from each parameter's definition
(vLLM's) one token at a time, without the engine's code: the penalties, log_softmax, and the
model's own logits for a whole sequence computed in one pass."""

from __future__ import annotations

import math

import torch

from engine.request import Request, SamplingParams
from engine.runner import ModelRunner

BLOCK_SIZE = 16


def reference_penalized(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """Repetition penalty on tokens of the prompt or the output, then the frequency and
    presence penalties on the output's counts."""
    result = []
    for token, logit in enumerate(logits):
        count = output.count(token)
        if token in prompt or count:
            rp = params.repetition_penalty
            logit = logit / rp if logit > 0 else logit * rp
        logit -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        result.append(logit)
    return result


def reference_log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    log_sum = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_sum for x in logits]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def sequence_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The model's float32 logits [len(token_ids), vocab] at every position, in one prefill on
    a fresh KV cache (row i predicts token i + 1)."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE, "cpu")
    request = Request("reference", list(token_ids), SamplingParams())
    request.block_ids = list(range(num_blocks))
    return runner.compute_logits([(request, len(token_ids))])[0]


def reference_greedy(
    model, prompt: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...]
) -> list[int]:
    """Greedy decoding by definition: the argmax of the penalized logits, EOS and the stop ids
    out of reach until min_tokens; up to max_tokens tokens, or a stop id (or EOS unless
    ignore_eos)."""
    masked = (*eos_token_ids, *params.stop_token_ids)
    stops = params.stop_token_ids if params.ignore_eos else masked
    output: list[int] = []
    while len(output) < params.max_tokens:
        logits = sequence_logits(model, prompt + output)[-1].tolist()
        logits = reference_penalized(logits, prompt, output, params)
        if len(output) < params.min_tokens:
            for token in masked:
                logits[token] = -math.inf
        output.append(argmax(logits))
        if output[-1] in stops:
            break
    return output
