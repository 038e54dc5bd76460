"""vLLM's real scheduler without a model, for the checks and the benchmark of the scheduler
source: run with the vLLM environment's python (`.vllm-venv`, built by `make vllm`).

    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=512)
    add_requests(scheduler, 6, prompt_len=16, max_tokens=8)
    while scheduler.has_requests():
        run_step(scheduler)         # or run_pipelined(scheduler, ...) as async scheduling does

The scheduler is telemetry.sources.vllm_scheduler.IterscopeScheduler (or vLLM's own class) on
a VllmConfig for the exported SmolLM2 (.models/smollm2-hf) and a KV pool of the given size,
prefix caching off; a step's model output is made up (one token for each request whose prompt
is done), so every scheduling decision is vLLM's. With ``num_speculative_tokens`` the config
speculates by ngram and ``run_step(..., accept=N)`` plays the drafter and the rejection
sampler: every decoding request drafts that many tokens for the next step and has the first N
of its last draft accepted.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from telemetry.sources.vllm_scheduler import IterscopeScheduler

MODEL_DIR = Path(__file__).resolve().parents[1] / ".models" / "smollm2-hf"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
_request_ids = itertools.count()


def make_scheduler(
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    scheduler_class: type = IterscopeScheduler,
    async_scheduling: bool = False,
    num_speculative_tokens: int = 0,
    **scheduler_options: object,
) -> Scheduler:
    """``async_scheduling``: as vLLM settles it on a GPU (its CPU platform turns it off).
    ``num_speculative_tokens``: > 0 speculates by ngram, drafts of at most that many tokens.
    ``scheduler_options``: more of vLLM's SchedulerConfig fields (prefill_schedule_interval)."""
    model = ModelConfig(
        model=str(MODEL_DIR), dtype="float32", max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True
    )
    speculative = None
    if num_speculative_tokens:
        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=2,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
        )
    config = VllmConfig(
        speculative_config=speculative,
        model_config=model,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            **scheduler_options,
        ),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    config.scheduler_config.async_scheduling = async_scheduling
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16, dtype=torch.float32
    )
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return scheduler_class(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def add_requests(scheduler: Scheduler, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    for _ in range(num_requests):
        scheduler.add_request(
            Request(
                f"r{next(_request_ids)}",
                list(range(1, prompt_len + 1)),
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                None,
            )
        )


def run_step(scheduler: Scheduler, throttle_prefills: bool = False, accept: int = 0) -> dict:
    """One schedule() + update_from_output(), a made-up token for each request whose prompt
    is done (and the first ``accept`` tokens of its draft, where it had one); then, where
    the config speculates, a new draft for each decoding request. ``throttle_prefills``: as
    vLLM's data-parallel engine core asks on the steps off its prefill cadence. Returns
    update_from_output's EngineCoreOutputs by client."""
    output = scheduler.schedule(throttle_prefills)
    outputs = scheduler.update_from_output(output, made_up_output(scheduler, output, accept))
    if scheduler.num_spec_tokens:
        decoding = [r.request_id for r in scheduler.running if not r.is_prefill_chunk]
        drafts = [[7] * scheduler.num_spec_tokens for _ in decoding]
        scheduler.update_draft_token_ids(DraftTokenIds(decoding, drafts))
    return outputs


def run_pipelined(scheduler: Scheduler, max_steps: int) -> int:
    """Steps as vLLM's engine core runs them with async scheduling: each step is scheduled
    before the previous one's output comes back. Returns the number of steps."""
    pending = None
    for step in range(max_steps):
        if not scheduler.has_requests():
            if pending is not None:
                scheduler.update_from_output(*pending)
            return step
        output = scheduler.schedule()
        if pending is not None:
            scheduler.update_from_output(*pending)
        pending = (output, made_up_output(scheduler, output))
    return max_steps


def made_up_output(scheduler: Scheduler, output, accept: int = 0) -> ModelRunnerOutput:
    """What a model would return for ``output``: a token for each request whose prompt is
    done (read right after schedule(), which marks the chunks still prefilling), after the
    first ``accept`` tokens of its draft where this step scored one."""
    req_ids = list(output.num_scheduled_tokens)
    drafts = output.scheduled_spec_decode_tokens
    sampled = [
        []
        if scheduler.requests[r].is_prefill_chunk
        else [7] * (1 + min(accept, len(drafts.get(r, ()))))
        for r in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
