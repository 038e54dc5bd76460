"""The measured activation peak that the CUDA KV budget subtracts (engine/activation_profile.py).

No GPU in CI: the worst-case batches run through the real ModelRunner on CPU (shapes and the
shared-block trick), and the peak arithmetic and its wiring into build_engine_core run
against a fake allocator standing in for torch.cuda's statistics.
"""

from __future__ import annotations

import pytest
import torch

from engine.activation_profile import MemoryProbe, measure_activation_peak_bytes, profile_batches
from engine.config import EngineConfig
from engine.kv_planning import kv_bytes_per_token
from engine.model.loader import build_tiny_model
from engine.runner import ModelRunner
from engine.startup import build_engine_core
from tests.helpers.fake_runner import FakeRunner, load_fake_model

GIB = 2**30


def test_decode_batch_fills_the_sequence_limit_at_full_context():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=40)
    decodes, _ = profile_batches(config, 16, [0, 1, 2, 3])
    assert [n for _, n in decodes] == [1] * 4
    assert all(r.num_computed_tokens == 15 and r.num_tokens == 16 for r, _ in decodes)
    assert len({r.request_id for r, _ in decodes}) == 4


def test_prefill_batch_spends_the_token_budget_in_max_length_chunks_on_a_prefix():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=40)
    _, prefills = profile_batches(config, 16, [0, 1, 2, 3])
    assert [n for _, n in prefills] == [16, 16, 8]
    for request, n in prefills:
        assert request.num_computed_tokens + n == request.num_tokens == 16


def test_small_token_budget_and_sequence_limit_bound_the_prefill_batch():
    few_tokens = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    decodes, prefills = profile_batches(few_tokens, 16, [0, 1, 2, 3])
    assert len(decodes) == 8 and [n for _, n in prefills] == [10]
    few_seqs = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    decodes, prefills = profile_batches(few_seqs, 16, [0, 1, 2, 3])
    assert len(decodes) == 2 and [n for _, n in prefills] == [16, 16]


@pytest.mark.parametrize("batch_index", [0, 1])
def test_the_real_runner_runs_the_profile_batches_on_shared_blocks(batch_index):
    model = build_tiny_model("llama")
    config = EngineConfig(block_size=4, max_num_seqs=3, max_num_batched_tokens=40)
    runner = ModelRunner(model, 4, 4, "cpu")
    batch = profile_batches(config, 16, [0, 1, 2, 3])[batch_index]
    tokens = runner.execute(batch)
    assert len(tokens) == len(batch)
    assert all(isinstance(t, int) and 0 <= t < model.config.vocab_size for t in tokens)


class FakeAllocator:
    """Counts bytes like torch.cuda's allocator statistics."""

    def __init__(self, allocated: int = 0):
        self.allocated = allocated
        self.peak = allocated
        self.num_resets = 0

    def allocate_temporarily(self, num_bytes: int) -> None:
        self.peak = max(self.peak, self.allocated + num_bytes)

    def reset_peak(self) -> None:
        self.num_resets += 1
        self.peak = self.allocated

    def probe(self) -> MemoryProbe:
        return MemoryProbe(
            allocated=lambda: self.allocated,
            peak=lambda: self.peak,
            reset_peak=self.reset_peak,
            synchronize=lambda: None,
        )


BYTES_PER_DECODE = 3 * 2**20  # the fake runner's scratch: decodes cost more than prefill tokens
BYTES_PER_PREFILL_TOKEN = 2**20
RUNNER_KV_BYTES_PER_BLOCK = 2**20


def allocating_runner(allocator: FakeAllocator):
    """FakeRunner whose KV cache and iteration scratch go through the fake allocator."""

    class AllocatingRunner(FakeRunner):
        def __init__(self, model, num_blocks, block_size, device="cpu"):
            super().__init__(model, num_blocks, block_size, device)
            allocator.allocated += num_blocks * RUNNER_KV_BYTES_PER_BLOCK

        def execute(self, scheduled):
            scratch = sum(
                BYTES_PER_DECODE if n == 1 else n * BYTES_PER_PREFILL_TOKEN for _, n in scheduled
            )
            allocator.allocate_temporarily(scratch)
            return [0] * len(scheduled)  # the profile's prefixes were never written

    return AllocatingRunner


def test_peak_is_the_largest_batch_above_the_baseline_with_the_profile_runner():
    allocator = FakeAllocator(allocated=5 * GIB)  # the weights, already loaded
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    model = load_fake_model("fake", "float32", "cpu")
    peak = measure_activation_peak_bytes(
        config, model, allocating_runner(allocator), 32, allocator.probe()
    )
    decode_scratch = 8 * BYTES_PER_DECODE
    prefill_scratch = 64 * BYTES_PER_PREFILL_TOKEN
    assert peak == max(decode_scratch, prefill_scratch) == prefill_scratch
    assert allocator.num_resets == 2  # one per batch: a peak never leaks into the next


def test_cuda_kv_budget_subtracts_weights_and_the_measured_peak(monkeypatch):
    weights_bytes = 2 * GIB
    total_bytes = 16 * GIB
    allocator = FakeAllocator(allocated=weights_bytes)
    probe = allocator.probe()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: probe.allocated())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: probe.peak())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: probe.reset_peak())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    class Properties:
        total_memory = total_bytes
        major, minor = 8, 0  # an Ampere card: --dtype auto is bfloat16

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Properties)
    config = EngineConfig(
        device="cuda",
        block_size=16,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=1024,
        gpu_memory_utilization=0.5,
    )
    core, model = build_engine_core(
        config, load_model=load_fake_model, runner_class=allocating_runner(allocator)
    )
    measured_peak = max(32 * BYTES_PER_DECODE, 512 * BYTES_PER_PREFILL_TOKEN)
    budget = int(total_bytes * 0.5) - weights_bytes - measured_peak
    cfg = model.config
    bytes_per_block = 16 * kv_bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype.itemsize
    )
    assert core.kv_plan.available_bytes == budget
    assert core.kv_plan.num_blocks == budget // bytes_per_block
