"""Drive vLLM's real scheduler, subclassed by iterscope, without a model: run in `.vllm-venv`
by tests/test_vllm_scheduler_live.py (`.vllm-venv/bin/python tests/vllm_scheduler_check.py
CASE`), it prints one JSON line with what the case needs checked.

The scheduler is vLLM 0.32's own (telemetry.sources.vllm_scheduler.IterscopeScheduler on a
VllmConfig for the exported SmolLM2 and a KV pool of a chosen size); a step's model output is
made up (one token per request that finished its prompt), so every decision the waiting
rule reads is vLLM's. The publisher is swapped for a list, so the records are those the lane
would carry.

Cases:
    reasons     one scheduler per admission limit: which reason each step's waiting got
    guard       an untested vLLM version, and a missing scheduler attribute: plain vLLM
                scheduling, nothing reported, a warning in vLLM's log
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from telemetry.sources import vllm_scheduler  # noqa: E402
from telemetry.sources.vllm_scheduler import IterscopeScheduler  # noqa: E402

BLOCK_SIZE = 16
REASON_FIELDS = {"kv": "num_waiting_kv_reqs", "seq_limit": "num_waiting_seq_limit_reqs",
                 "budget": "num_waiting_budget_reqs", "other": "num_waiting_other_reqs"}


class ListPublisher:
    def __init__(self) -> None:
        self.records: list = []

    def publish(self, record) -> None:
        self.records.append(record)

    def note_queues(self, num_waiting: int, num_running: int) -> None:
        pass

    def close(self) -> None:
        pass


def make_scheduler(num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int):
    model = ModelConfig(model=str(ROOT / ".models" / "smollm2-hf"), dtype="float32",
                        max_model_len=512, skip_tokenizer_init=True)
    config = VllmConfig(
        model_config=model, device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=512, is_encoder_decoder=False, enable_chunked_prefill=True),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16,
                             dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return IterscopeScheduler(vllm_config=config, kv_cache_config=kv_cache,
                              structured_output_manager=StructuredOutputManager(config),
                              block_size=BLOCK_SIZE, log_stats=True)


def add_requests(scheduler, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    for i in range(num_requests):
        scheduler.add_request(Request(
            f"r{i}", list(range(1, prompt_len + 1)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True), None))


def run_step(scheduler) -> None:
    """One schedule + update_from_output, with a made-up token for every request whose
    prompt is done."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[7] if not scheduler.requests[r].is_prefill_chunk else [] for r in req_ids]
    runner_output = ModelRunnerOutput(req_ids=req_ids,
                                      req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                      sampled_token_ids=sampled)
    scheduler.update_from_output(output, runner_output)


def reasons_case() -> dict:
    """Per limit: the waiting counts by reason of the steps, summed, and the preemptions."""
    cases = {  # limit -> (num_blocks, max_num_seqs, max_num_batched_tokens, prompt, output)
        "seq_limit": (64, 2, 512, 16, 8),  # 6 requests, 2 run at a time
        "budget": (64, 8, 64, 48, 8),      # 64 tokens a step: one 48-token prompt at a time
        "kv": (9, 8, 512, 40, 40),         # 8 usable blocks, 5 per request at their peak
    }
    result = {}
    for limit, (num_blocks, max_num_seqs, budget, prompt, output_len) in cases.items():
        scheduler = make_scheduler(num_blocks, max_num_seqs, budget)
        publisher = ListPublisher()
        scheduler._iterscope.publisher = publisher
        add_requests(scheduler, 6, prompt, output_len)
        for _ in range(400):
            if not scheduler.has_requests():
                break
            run_step(scheduler)
        records = publisher.records
        result[limit] = {
            "waiting": {name: sum(getattr(r, field) for r in records)
                        for name, field in REASON_FIELDS.items()},
            "num_waiting": sum(r.num_waiting_reqs for r in records),
            "num_preemptions": sum(r.num_preemptions for r in records),
            "num_finished": sum(1 for r in records for m in r.milestones if m.event & 2),
            "num_output_tokens": sum(r.num_decode_tokens for r in records),
            "max_blocks_used": max(r.num_kv_blocks_used for r in records),
            "num_kv_blocks_total": records[0].num_kv_blocks_used + records[0].num_kv_blocks_free,
        }
    return result


def guard_case() -> dict:
    """An untested version and a missing attribute: each a plain scheduler that still runs."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vllm.iterscope").addHandler(handler)
    result = {}
    is_tested_version = vllm_scheduler.is_tested_version
    vllm_scheduler.is_tested_version = lambda version: False
    scheduler = make_scheduler(64, 4, 512)
    vllm_scheduler.is_tested_version = is_tested_version
    result["untested_reporter"] = scheduler._iterscope is not None
    add_requests(scheduler, 3, 16, 4)
    for _ in range(20):
        run_step(scheduler)
    result["untested_finished"] = not scheduler.has_requests()
    vllm_scheduler.SCHEDULER_ATTRIBUTES += ("no_such_attribute",)  # as a later vLLM might
    scheduler = make_scheduler(64, 4, 512)
    result["missing_reporter"] = scheduler._iterscope is not None
    result["said"] = said
    return result


if __name__ == "__main__":
    case = sys.argv[1]
    print(json.dumps({"reasons": reasons_case, "guard": guard_case}[case]()))
