"""A request's life inside the engine core: its tokens, its KV blocks and its milestones.

The runner reads a request through these fields only:

    token_ids            prompt + output so far            [p0 p1 ... pN-1 o0 o1 ...]
    prompt_token_ids     the prompt part of it (penalties tell the two apart)
    num_computed_tokens  how many of token_ids have K/V in the cache (a prefix of them)
    block_ids            the request's block table: position p lives in block
                         block_ids[p // block_size], slot p % block_size
    sampling_params      how to pick the next token

and writes one: sampled_logprobs, with each token it samples for a request that asked for
logprobs.

Invariant: num_computed_tokens <= len(token_ids) and the blocks in block_ids cover at
least num_computed_tokens positions. An iteration that schedules `n` new tokens for a
request computes positions [num_computed_tokens, num_computed_tokens + n); when that
range reaches len(token_ids) the request is caught up and one token is sampled.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprobs

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason(enum.IntEnum):
    """Why a request finished; the names are the ones the OpenAI API reports."""

    STOP = 0  # EOS or a stop token id
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # the client went away or asked to stop

    @property
    def text(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, with vLLM's meanings and bounds.

    temperature < SAMPLING_EPS is greedy; top_k == 0, top_p == 1 and min_p == 0 turn those off.
    Penalties change the logits before the token is picked, greedy or not:
    repetition_penalty (1 = off) divides positive and multiplies negative logits of every
    token in the prompt or the output; frequency_penalty and presence_penalty subtract
    ``frequency * count + presence * (count > 0)`` for each token's count in the output.
    Until the output has min_tokens tokens, EOS and stop_token_ids cannot be picked.
    logprobs (None = off) asks for the sampled token's log-probability and that many of
    the most likely alternatives, from the model's raw logits.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (or None for none), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass(eq=False)
class Request:
    """One generation request. Timestamps are the engine's time.monotonic_ns(); 0 = not yet."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_ns: int = 0
    traceparent: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    finished_ns: int = 0
    num_preemptions: int = 0
    preempted_ns: list[int] = field(default_factory=list)
    # (start_ns, end_ns, num_tokens) of each prefill chunk, appended after the iteration ran.
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    # The logprobs of the token sampled last, when sampling_params.logprobs asks for them: set
    # by the runner with the token, sent by the core with that step's output.
    sampled_logprobs: TokenLogprobs | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
