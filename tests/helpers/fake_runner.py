"""A deterministic stand-in for engine.runner.ModelRunner, with the same constructor and
execute() contract, that really goes through the paged KV bookkeeping.

It "writes K/V" by storing each computed token in its slot (block_ids[p // block_size],
p % block_size) and, when a request is caught up, "attends" by reading the whole history
back through the block table. The next token is a hash of what it read, so a wrong block
table, a block reused while still in use or a bad prefix-cache hit changes the output, and
recompute after preemption gives the same tokens as no preemption.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_planning import KvPlan
from engine.request import Request

VOCAB_SIZE = 64
EOS_TOKEN_ID = 0
BLOCK_SIZE = 4  # make_core's block size: small, so tests cross block boundaries often


class FakeDtype:
    itemsize = 4


@dataclass
class FakeModelConfig:
    name: str = "fake"
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8
    hidden_size: int = 16
    intermediate_size: int = 32
    vocab_size: int = VOCAB_SIZE
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,)
    dtype: FakeDtype = field(default_factory=FakeDtype)


@dataclass
class FakeModel:
    config: FakeModelConfig


def load_fake_model(name_or_dir: str, dtype: str, device: str) -> FakeModel:
    return FakeModel(FakeModelConfig(name=name_or_dir))


def next_token(history: list[int]) -> int:
    """The fake model: the next token is a function of the whole history."""
    value = 17
    for token in history:
        value = (value * 1_000_003 + token + 1) % (1 << 61)
    return value % VOCAB_SIZE


def reference_output(
    prompt: list[int],
    max_tokens: int,
    max_model_len: int,
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,),
    ignore_eos: bool = False,
) -> list[int]:
    """What one request alone, never preempted, generates with the stop rules of the engine."""
    tokens = list(prompt)
    output: list[int] = []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token in eos_token_ids and not ignore_eos:
            return output
        if len(output) >= max_tokens or len(tokens) >= max_model_len:
            return output


class FakeRunner:
    def __init__(self, model: FakeModel, num_blocks: int, block_size: int, device: str = "cpu"):
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.num_calls = 0

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """As ModelRunner's on a device without CUDA graphs: none captured."""
        return None

    def cpu_kernels_line(self) -> str:
        """As ModelRunner's: the start-up line naming the CPU kernels (a fake runs none)."""
        return "CPU kernels: none (a fake runner)"

    def _slot(self, request: Request, position: int) -> int:
        block_id = request.block_ids[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def execute(self, scheduled: list[tuple[Request, int]]) -> list[int | None]:
        self.num_calls += 1
        sampled: list[int | None] = []
        for request, num_new_tokens in scheduled:
            start = request.num_computed_tokens
            end = start + num_new_tokens
            if num_new_tokens < 1 or end > request.num_tokens:
                raise ValueError(f"bad range [{start}, {end}) for {request.num_tokens} tokens")
            if end > len(request.block_ids) * self.block_size:
                raise ValueError(f"request {request.request_id} has too few blocks for {end}")
            for position in range(start, end):
                self.slots[self._slot(request, position)] = request.token_ids[position]
            if end < request.num_tokens:
                sampled.append(None)
                continue
            history = [self.slots[self._slot(request, p)] for p in range(end)]
            sampled.append(next_token(history))
        return sampled


class RecordingPublisher:
    """Keeps every record, in place of the telemetry lane."""

    def __init__(self):
        self.records = []
        self.queue_notes = []

    def publish(self, record):
        self.records.append(record)

    def note_queues(self, num_waiting, num_running, step_tokens=0):
        self.queue_notes.append((num_waiting, num_running, step_tokens))

    def close(self):
        pass


def make_core(
    num_blocks: int,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    max_model_len: int | None = None,
    **settings,
) -> EngineCore:
    """An EngineCore on the fake runner with ``num_blocks`` blocks of BLOCK_SIZE tokens."""
    max_model_len = max_model_len or num_blocks * BLOCK_SIZE
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        **settings,
    )
    plan = KvPlan(1, BLOCK_SIZE, num_blocks * BLOCK_SIZE, num_blocks, max_model_len)
    runner = FakeRunner(FakeModel(FakeModelConfig()), num_blocks, BLOCK_SIZE)
    return EngineCore(config, runner, plan, (EOS_TOKEN_ID,), RecordingPublisher())


class PacedRunner(FakeRunner):
    """Each forward pass takes at least PACE_S, as a real model's does: a client's message
    then arrives while the request still runs, on however fast a machine."""

    PACE_S = 0.005

    def execute(self, scheduled):
        time.sleep(self.PACE_S)
        return super().execute(scheduled)


class FailingRunner(FakeRunner):
    """Fails in its first forward pass: the engine loop's error path."""

    def execute(self, scheduled):
        raise RuntimeError("injected runner failure")
