"""Continuous batching: which requests compute how many tokens in the next iteration.

Each iteration, under a token budget (max_num_batched_tokens) and a sequence limit
(max_num_seqs):

1. Running requests first, in admission order: a decode (1 token) or the next chunk of a
   long prompt. When blocks run out, the most recently admitted running request is
   preempted by recompute (blocks freed, computed tokens forgotten, requeued at the front of
   the waiting queue) until the request fits or is itself the victim.
2. Then waiting requests, first come first served, unless something was preempted: prefix
   cache hits skip computation; the rest of the prompt (or a chunk of it) is scheduled.
   Admission stops at the first request that does not fit; the reason (KV capacity,
   sequence limit, token budget) is reported, and with FCFS every request still waiting is
   waiting for that reason.

After the forward pass, ``update`` advances computed tokens, appends sampled tokens and
finishes requests on EOS, stop tokens, max_tokens or max_model_len.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.kv_planning import cdiv
from engine.request import FinishReason, Request, RequestStatus


class RequestRejectedError(ValueError):
    """A request that can never run; raised at submission, never left waiting."""


class WaitReason(enum.IntEnum):
    NONE = 0
    KV_CAPACITY = 1
    SEQ_LIMIT = 2
    TOKEN_BUDGET = 3


@dataclass
class SchedulerOutput:
    """What one iteration computes: (request, num_new_tokens) pairs and the counts about them."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_reqs: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    wait_reason: WaitReason = WaitReason.NONE

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.scheduled.append((request, num_new_tokens))
        if is_decode(request, num_new_tokens):
            self.num_decode_reqs += 1
            self.num_decode_tokens += num_new_tokens
        else:
            self.num_prefill_reqs += 1
            self.num_prefill_tokens += num_new_tokens


def is_decode(request: Request, num_new_tokens: int) -> bool:
    """A decode step computes exactly the last sampled token of a caught-up request."""
    return (
        num_new_tokens == 1
        and request.num_output_tokens > 0
        and request.num_computed_tokens == request.num_tokens - 1
    )


def check_request_fits(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Raise RequestRejectedError for a request that could never run: longer than
    max_model_len, or needing more KV blocks than the whole cache."""
    num_tokens = num_prompt_tokens + max_tokens
    if num_tokens > max_model_len:
        raise RequestRejectedError(
            f"request {request_id!r}: prompt ({num_prompt_tokens} tokens) + max_tokens "
            f"({max_tokens}) = {num_tokens} tokens exceeds max_model_len ({max_model_len}); "
            "shorten the prompt or lower max_tokens"
        )
    num_blocks_needed = cdiv(num_tokens, block_size)
    if num_blocks_needed > num_blocks:
        raise RequestRejectedError(
            f"request {request_id!r}: {num_tokens} tokens need {num_blocks_needed} KV blocks "
            f"but the whole cache has {num_blocks}; shorten the prompt, lower max_tokens or "
            "give the KV cache more memory"
        )


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        enable_chunked_prefill: bool = True,
    ):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_kv_tokens = 0  # computed tokens the running requests hold in KV

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_request(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejectedError for a request that could never run."""
        check_request_fits(
            request_id,
            num_prompt_tokens,
            max_tokens,
            self.max_model_len,
            self.pool.block_size,
            self.pool.num_blocks,
        )

    def add_request(self, request: Request) -> None:
        self.check_request(
            request.request_id, request.num_prompt_tokens, request.sampling_params.max_tokens
        )
        self.waiting.append(request)

    def abort_request(
        self, request: Request, now_ns: int, reason: FinishReason = FinishReason.ABORT
    ) -> None:
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            return
        self._finish(request, reason, now_ns)

    def schedule(self, now_ns: int) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, now_ns)
        if output.num_preemptions:
            output.wait_reason = WaitReason.KV_CAPACITY
        else:
            self._schedule_waiting(output, budget, now_ns)
        return output

    def _schedule_running(self, output: SchedulerOutput, now_ns: int) -> int:
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.pool.allocate_slots(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim, now_ns)
                output.num_preemptions += 1
                if victim is request:
                    return budget
            output.add(request, num_new_tokens)
            budget -= num_new_tokens
            index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, now_ns: int) -> None:
        while self.waiting:
            if budget == 0:
                output.wait_reason = WaitReason.TOKEN_BUDGET
                return
            if len(self.running) >= self.max_num_seqs:
                output.wait_reason = WaitReason.SEQ_LIMIT
                return
            request = self.waiting[0]
            hit_block_ids = self._prefix_hits(request)
            num_hit_tokens = len(hit_block_ids) * self.pool.block_size
            num_new_tokens = request.num_tokens - num_hit_tokens
            if num_new_tokens > budget:
                if not self.enable_chunked_prefill:
                    output.wait_reason = WaitReason.TOKEN_BUDGET
                    return
                num_new_tokens = budget
            if not self.pool.admit(request, hit_block_ids, num_new_tokens):
                output.wait_reason = WaitReason.KV_CAPACITY
                return
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if not request.first_scheduled_ns:
                request.first_scheduled_ns = now_ns
                request.num_cached_tokens = num_hit_tokens
            self.num_kv_tokens += num_hit_tokens
            if self.pool.enable_prefix_caching:  # off: no cache was queried
                output.num_prefix_query_tokens += request.num_tokens
                output.num_prefix_hit_tokens += num_hit_tokens
            output.add(request, num_new_tokens)
            budget -= num_new_tokens

    def _prefix_hits(self, request: Request) -> list[int]:
        if not self.pool.enable_prefix_caching:
            return []
        # At least one token must be computed to sample from, so the last one never hits.
        max_blocks = (request.num_tokens - 1) // self.pool.block_size
        return self.pool.match_prefix(request.token_ids, max_blocks)

    def _preempt(self, request: Request, now_ns: int) -> None:
        self.num_kv_tokens -= request.num_computed_tokens
        self.pool.free_request(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.preempted_ns.append(now_ns)
        self.waiting.appendleft(request)

    def update(
        self,
        scheduled: list[tuple[Request, int]],
        sampled: list[int | None],
        start_ns: int,
        end_ns: int,
    ) -> list[Request]:
        """Apply one forward pass; returns the requests that got a token, finished ones too."""
        if len(sampled) != len(scheduled):
            raise ValueError(f"runner returned {len(sampled)} tokens for {len(scheduled)} requests")
        updated: list[Request] = []
        num_finished = 0
        for (request, num_new_tokens), token in zip(scheduled, sampled, strict=True):
            if not is_decode(request, num_new_tokens):
                request.prefill_chunks.append((start_ns, end_ns, num_new_tokens))
            num_computed_before = request.num_computed_tokens
            request.num_computed_tokens += num_new_tokens
            self.num_kv_tokens += num_new_tokens
            self.pool.cache_computed_blocks(request, num_computed_before)
            if token is None:
                continue
            request.token_ids.append(token)
            if not request.first_token_ns:
                request.first_token_ns = end_ns
            finish_reason = self._stop_reason(request, token)
            if finish_reason is not None:
                self._finish(request, finish_reason, end_ns)
                num_finished += 1
            updated.append(request)
        if num_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return updated

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, now_ns: int) -> None:
        """Mark finished and release blocks; the caller takes it off the running list."""
        self.num_kv_tokens -= request.num_computed_tokens
        self.pool.free_request(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_ns = now_ns
