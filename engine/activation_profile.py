"""Measuring the forward pass's activation peak before the KV cache is sized (CUDA).

The KV budget on CUDA is gpu_memory_utilization x the card's memory, minus the weights,
minus the most memory one iteration needs on top of them: activations, attention scratch
(the decode gather buffers, masks, scores), logits, sampling. That last term is measured,
not guessed: a throwaway runner with a tiny KV cache runs the worst iterations the
scheduler can produce under this config, and the allocator's peak above the baseline is
the answer.

The worst iterations (each is measured; the largest peak wins):

- decode-heavy: max_num_seqs single-token decodes, each with
  max_model_len - 1 tokens of context (biggest gather buffers, most logits);
- prefill-heavy: the token budget as prefill chunks of at most max_model_len tokens, each
  ending at max_model_len on top of a cached prefix (biggest masks and scores), at most
  max_num_seqs of them.

Every profile request points at the same few blocks (a sequence of max_model_len needs
ceil(max_model_len / block_size) of them): what attention reads is garbage, but the shapes,
and therefore the memory, are exactly those of a real iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.request import Request, SamplingParams

ScheduledBatch = list[tuple[Request, int]]
PROFILE_PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@dataclass
class MemoryProbe:
    """The allocator's view: current bytes, peak bytes since reset, and a reset."""

    allocated: Callable[[], int]
    peak: Callable[[], int]
    reset_peak: Callable[[], None]
    synchronize: Callable[[], None]


def cuda_probe() -> MemoryProbe:
    import torch

    return MemoryProbe(
        allocated=torch.cuda.memory_allocated,
        peak=torch.cuda.max_memory_allocated,
        reset_peak=torch.cuda.reset_peak_memory_stats,
        synchronize=torch.cuda.synchronize,
    )


def profile_batches(
    config: EngineConfig, max_model_len: int, block_ids: list[int]
) -> list[ScheduledBatch]:
    """The worst-case iterations for this config (see the module docstring)."""
    decodes = [  # the config guarantees max_num_seqs <= max_num_batched_tokens
        (_profile_request(f"profile-decode-{i}", max_model_len, 1, block_ids), 1)
        for i in range(config.max_num_seqs)
    ]
    prefills: ScheduledBatch = []
    budget = config.max_num_batched_tokens
    while budget > 0 and len(prefills) < config.max_num_seqs:
        chunk = min(budget, max_model_len)
        request_id = f"profile-prefill-{len(prefills)}"
        prefills.append((_profile_request(request_id, max_model_len, chunk, block_ids), chunk))
        budget -= chunk
    return [decodes, prefills]


def _profile_request(
    request_id: str, num_tokens: int, num_new_tokens: int, block_ids: list[int]
) -> Request:
    """A request of num_tokens whose last num_new_tokens are still to compute."""
    request = Request(request_id, [1] * num_tokens, PROFILE_PARAMS)
    request.num_computed_tokens = num_tokens - num_new_tokens
    request.block_ids = list(block_ids)
    return request


def measure_activation_peak_bytes(
    config: EngineConfig,
    model: Any,
    runner_class: Any,
    max_model_len: int,
    probe: MemoryProbe,
) -> int:
    """Bytes one iteration needs beyond the weights: the largest allocator peak over the
    profile batches, above the baseline with a throwaway runner's tiny KV cache in place."""
    blocks_per_seq = -(-max_model_len // config.block_size)
    runner = runner_class(model, blocks_per_seq, config.block_size, config.device)
    probe.synchronize()
    baseline = probe.allocated()
    peak = 0
    for batch in profile_batches(config, max_model_len, list(range(blocks_per_seq))):
        probe.reset_peak()
        runner.execute(batch)
        probe.synchronize()
        peak = max(peak, probe.peak() - baseline)
    return peak
