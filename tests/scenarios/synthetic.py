"""A small simulated engine that writes recordings shaped like the user stories.

It schedules like the real engine (continuous batching, chunked prefill, a token budget, a
sequence limit, a paged KV cache with preemption by recompute), times each iteration with a
known linear cost (so `tune` can be checked against the truth), sends a heartbeat every
simulated second, and can inject the faults of the stories: a KV cliff without counted
preemptions, a stall, a block leak, lost messages.

Everything is deterministic for a given seed; nothing sleeps.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
    SpecDecodeCounts,
    heartbeat,
    iteration_record,
)

NS = 1_000_000_000


@dataclass(eq=False)
class SimRequest:
    request_id: str
    arrival_ns: int
    num_prompt_tokens: int
    num_output_tokens_wanted: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    chunks: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass
class Cost:
    """Iteration time = base + per context token + per generation token (+ a fixed cost for
    an iteration that carries prompt tokens: a GPU engine's outside its CUDA graphs), times
    (1 + noise)."""

    base_time: float = 0.004
    context_token_time: float = 20e-6
    generation_token_time: float = 300e-6
    noise: float = 0.02
    draft_token_time: float = 0.0  # per draft token scored (Simulator.num_spec_tokens)
    prompt_step_time: float = 0.0  # per iteration with prompt tokens


class Simulator:
    def __init__(
        self,
        *,
        num_blocks: int = 512,
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        cost: Cost | None = None,
        seed: int = 0,
        engine_index: int = 0,
        start_s: float = 1000.0,
        num_spec_tokens: int = 0,
        accept_one_in: int = 1,
        drafting_share: float | None = None,
    ) -> None:
        """``num_spec_tokens``: speculative decoding's drafts on the records (_drafts), of
        which only one request's in ``accept_one_in`` accepts any token; ``drafting_share``:
        the chance that a decoding request drafts (None: all but every third); the requests
        themselves still advance one token per iteration."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost = cost or Cost()
        self.rng = random.Random(seed)
        self.engine_index = engine_index
        self.start_ns = self.now_ns = int(start_s * NS)
        self.wall_offset_ns = 1_763_000_000 * NS - self.now_ns
        self.pending: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.messages: list[IterationRecord | Heartbeat] = []
        self.msg_seq = 0
        self.iteration = 0
        self.next_heartbeat_ns = self.now_ns
        self.num_free_blocks = num_blocks
        self.num_dropped_pending = 0
        self.leak_blocks_per_finish = 0
        self.lose_windows: list[tuple[int, int, bool]] = []
        self.stalls: list[tuple[int, int]] = []
        self.slowdowns: list[tuple[int, int, float, int]] = []
        self.last_working_iteration = 0  # the last iteration that scheduled work
        self.cliffs: list[tuple[int, float]] = []
        self.closed_loop: list[tuple[int, int]] = []  # (prompt, output) still to send
        self.num_spec_tokens = num_spec_tokens
        self.accept_one_in = accept_one_in
        self.drafting_share = drafting_share

    # ---- set-up

    def at(self, seconds: float) -> int:
        return self.start_ns + int(seconds * NS)

    def add_requests(self, arrival_times_s: list[float], num_prompt: int, num_output: int) -> None:
        for t in arrival_times_s:
            request_id = f"req-{len(self.pending) + len(self.waiting) + self.iteration}-{t:.3f}"
            self.pending.append(SimRequest(request_id, self.at(t), num_prompt, num_output))
        self.pending.sort(key=lambda r: r.arrival_ns)

    def add_stall(self, at_s: float, duration_s: float) -> None:
        self.stalls.append((self.at(at_s), int(duration_s * NS)))

    def add_slowdown(self, from_s: float, to_s: float, factor: float, every: int = 1) -> None:
        """Every ``every``-th iteration that starts between the two times takes ``factor``
        times as long: another job on the engine's cores."""
        self.slowdowns.append((self.at(from_s), self.at(to_s), factor, every))

    def add_closed_loop(
        self,
        num_requests: int,
        concurrency: int,
        num_prompt: int,
        num_output: int,
        start_s: float = 0.5,
    ) -> None:
        """A client keeping `concurrency` requests in flight until num_requests were sent."""
        first = min(concurrency, num_requests)
        self.add_requests([start_s] * first, num_prompt, num_output)
        self.closed_loop = [(num_prompt, num_output)] * (num_requests - first)

    def add_cliff(self, at_s: float, min_usage: float = 0.0) -> None:
        """From at_s, once KV usage >= min_usage: evict every running request to waiting,
        freeing its blocks, without counting a preemption."""
        self.cliffs.append((self.at(at_s), min_usage))

    def add_message_loss(self, from_s: float, to_s: float, by_engine: bool = True) -> None:
        self.lose_windows.append((self.at(from_s), self.at(to_s), by_engine))

    # ---- running

    def run(self, until_s: float) -> Simulator:
        end_ns = self.at(until_s)
        while self.now_ns < end_ns:
            self._admit_arrivals()
            self._heartbeats_until(self.now_ns)
            if self._inject_faults():
                continue
            if not self.running and not self.waiting:
                next_ns = self.pending[0].arrival_ns if self.pending else end_ns
                self._advance(min(next_ns, end_ns))
                continue
            self._step()
        return self

    def write(self, path: Path) -> Path:
        encoder = msgspec.json.Encoder()
        with open(path, "wb") as f:
            for message in self.messages:
                f.write(encoder.encode(message) + b"\n")
        return path

    # ---- internals

    def _admit_arrivals(self) -> None:
        while self.pending and self.pending[0].arrival_ns <= self.now_ns:
            self.waiting.append(self.pending.pop(0))

    def _advance(self, to_ns: int) -> None:
        self._heartbeats_until(to_ns)
        self.now_ns = max(self.now_ns, to_ns)

    def close(self, stop_requested: bool = False) -> Simulator:
        """The publisher's close: a last heartbeat, now, that says so (and whether the engine
        was told to stop)."""
        self._heartbeat(self.now_ns, closing=True, stop_requested=stop_requested)
        return self

    def _heartbeats_until(self, to_ns: int) -> None:
        while self.next_heartbeat_ns <= to_ns:
            self._heartbeat(self.next_heartbeat_ns)
            self.next_heartbeat_ns += NS

    def _heartbeat(self, ts_ns: int, closing: bool = False, stop_requested: bool = False) -> None:
        self._send(
            heartbeat(
                self.engine_index,
                0,
                ts_ns,
                ts_ns + self.wall_offset_ns,
                last_iteration=self.last_working_iteration,
                num_waiting_reqs=len(self.waiting),
                num_running_reqs=len(self.running),
                model_name="sim",
                device_name="CPU",
                block_size=self.block_size,
                num_kv_blocks_total=self.num_blocks,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                pid=4242,
                num_speculative_tokens=self.num_spec_tokens,
                closing=closing,
                stop_requested=stop_requested,
            ),
            ts_ns,
        )

    def _send(self, message, send_ns: int) -> None:
        self.msg_seq += 1
        for start_ns, end_ns, by_engine in self.lose_windows:
            if start_ns <= send_ns < end_ns:
                self.num_dropped_pending += by_engine
                return
        message.msg_seq = self.msg_seq
        message.num_dropped = self.num_dropped_pending
        self.num_dropped_pending = 0
        self.messages.append(message)

    def _inject_faults(self) -> bool:
        for stall in list(self.stalls):
            if stall[0] <= self.now_ns:
                self.stalls.remove(stall)
                self._advance(self.now_ns + stall[1])
                return True
        usage = 1 - self.num_free_blocks / self.num_blocks
        for cliff in list(self.cliffs):
            if cliff[0] <= self.now_ns and usage >= cliff[1]:
                self.cliffs.remove(cliff)
                for request in reversed(self.running):
                    self._evict(request)
                self.running.clear()
                return True
        return False

    def _evict(self, request: SimRequest) -> None:
        self.num_free_blocks += request.num_blocks
        request.num_blocks = 0
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _blocks_for(self, request: SimRequest, num_new_tokens: int) -> int:
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - request.num_blocks)

    def _step(self) -> None:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        num_preemptions = 0
        for request in list(self.running):
            if request not in self.running or budget == 0:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self._blocks_for(request, num_new) > self.num_free_blocks:
                victim = self.running.pop()
                victim.num_preemptions += 1
                num_preemptions += 1
                scheduled = [(r, n) for r, n in scheduled if r is not victim]
                self._evict(victim)
                if victim is request:
                    break
            if request not in self.running:
                continue
            self._allocate(request, num_new)
            scheduled.append((request, num_new))
            budget -= num_new
        reason = self._admit_waiting(scheduled, budget)
        self._run_iteration(scheduled, reason, num_preemptions)

    def _allocate(self, request: SimRequest, num_new: int) -> None:
        num_blocks = self._blocks_for(request, num_new)
        self.num_free_blocks -= num_blocks
        request.num_blocks += num_blocks

    def _admit_waiting(self, scheduled: list, budget: int) -> str:
        while self.waiting:
            if len(self.running) >= self.max_num_seqs:
                return "seq_limit"
            if budget == 0:
                return "budget"
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._blocks_for(request, num_new) > self.num_free_blocks:
                return "kv"
            self.waiting.popleft()
            request.first_scheduled_ns = request.first_scheduled_ns or self.now_ns
            self._allocate(request, num_new)
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return ""

    def _run_iteration(self, scheduled: list, reason: str, num_preemptions: int) -> None:
        is_generation = [
            r.num_output_tokens > 0 and n == 1 and r.num_computed_tokens + 1 == r.num_tokens
            for r, n in scheduled
        ]
        pairs = list(zip(scheduled, is_generation, strict=True))
        num_ctx_tokens = sum(n for (_, n), gen in pairs if not gen)
        num_gen_tokens = sum(n for (_, n), gen in pairs if gen)
        elapsed = self.cost.base_time + num_ctx_tokens * self.cost.context_token_time
        elapsed += num_gen_tokens * self.cost.generation_token_time
        elapsed += self.cost.prompt_step_time if num_ctx_tokens else 0.0
        drafts = self._drafts(num_gen_tokens)
        if drafts is not None:
            elapsed += drafts.num_draft_tokens * self.cost.draft_token_time
        elapsed *= self._slowdown_factor()
        elapsed_ns = int(elapsed * (1 + self.cost.noise * self.rng.gauss(0, 1)) * NS)
        start_ns = self.now_ns
        self.now_ns += max(elapsed_ns, 1000)
        self.iteration += 1
        if scheduled:  # what a heartbeat's last_iteration says (record.py)
            self.last_working_iteration = self.iteration
        milestones = [m for r, n in scheduled if (m := self._update(r, n, start_ns)) is not None]
        num_waiting = len(self.waiting)
        record = iteration_record(
            self.engine_index,
            0,
            self.iteration,
            start_ns=start_ns,
            elapsed_ns=self.now_ns - start_ns,
            num_prefill_reqs=is_generation.count(False),
            num_prefill_tokens=num_ctx_tokens,
            num_decode_reqs=is_generation.count(True),
            num_decode_tokens=num_gen_tokens + (drafts.num_accepted_tokens if drafts else 0),
            num_running_reqs=len(self.running),
            num_waiting_reqs=num_waiting,
            num_waiting_kv_reqs=num_waiting if reason == "kv" else 0,
            num_waiting_seq_limit_reqs=num_waiting if reason == "seq_limit" else 0,
            num_waiting_budget_reqs=num_waiting if reason == "budget" else 0,
            num_kv_blocks_used=self.num_blocks - self.num_free_blocks,
            num_kv_blocks_free=self.num_free_blocks,
            num_kv_tokens=sum(r.num_computed_tokens for r in self.running),
            num_preemptions=num_preemptions,
            milestones=milestones,
            spec_decode=drafts,
        )
        self._heartbeats_until(start_ns + (self.now_ns - start_ns) // 2)
        self._send(record, self.now_ns)

    def _slowdown_factor(self) -> float:
        for from_ns, to_ns, factor, every in self.slowdowns:
            if from_ns <= self.now_ns < to_ns and self.iteration % every == 0:
                return factor
        return 1.0

    def _drafts(self, num_decodes: int) -> SpecDecodeCounts | None:
        """The drafts of an iteration's ``num_decodes`` decoding requests: every third drafts
        nothing (an n-gram without a match; with a ``drafting_share``, each drafts by that
        chance), the others num_spec_tokens tokens each, of
        which the i-th accepts n % (num_spec_tokens + 1) with n = (iteration + i) //
        accept_one_in, where (iteration + i) % accept_one_in is 0, and none elsewhere."""
        k = self.num_spec_tokens
        drafting = num_decodes - num_decodes // 3
        if self.drafting_share is not None:
            drafting = sum(self.rng.random() < self.drafting_share for _ in range(num_decodes))
        if not k or not drafting:
            return None
        accepted = [
            (self.iteration + i) // self.accept_one_in % (k + 1)
            if (self.iteration + i) % self.accept_one_in == 0
            else 0
            for i in range(drafting)
        ]
        per_pos = [sum(a > position for a in accepted) for position in range(k)]
        return SpecDecodeCounts(drafting, k * drafting, sum(accepted), per_pos)

    def _update(self, request: SimRequest, num_new: int, start_ns: int):
        was_prefill = not (
            request.num_output_tokens > 0
            and num_new == 1
            and request.num_computed_tokens + 1 == request.num_tokens
        )
        if was_prefill:
            request.chunks.append((start_ns, self.now_ns, num_new))
        request.num_computed_tokens += num_new
        if request.num_computed_tokens < request.num_tokens:
            return None
        request.num_output_tokens += 1
        event = 0
        if request.num_output_tokens == 1:
            request.first_token_ns = self.now_ns
            event |= EVENT_FIRST_TOKEN
        finished = request.num_output_tokens >= request.num_output_tokens_wanted
        if finished:
            event |= EVENT_FINISHED
            self.running.remove(request)
            leaked = min(self.leak_blocks_per_finish, request.num_blocks)
            self.num_free_blocks += request.num_blocks - leaked
            request.num_blocks = 0
            if self.closed_loop:
                num_prompt, num_output = self.closed_loop.pop()
                self.pending.append(
                    SimRequest(f"{request.request_id}+", self.now_ns, num_prompt, num_output)
                )
        if not event:
            return None
        return RequestMilestone(
            request_id=request.request_id,
            event=event,
            arrival_ns=request.arrival_ns,
            first_scheduled_ns=request.first_scheduled_ns,
            first_token_ns=request.first_token_ns,
            finished_ns=self.now_ns if finished else 0,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=0,
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            finish_reason=1 if finished else -1,
            prefill_chunks=list(request.chunks) if finished else [],
        )


def arrivals(rate_per_s: float, duration_s: float, start_s: float = 0.5, seed: int = 0):
    """Poisson arrival times."""
    rng = random.Random(seed)
    times, t = [], start_s
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= start_s + duration_s:
            return times
        times.append(t)


def long_prompt_bursts(
    starts_s: tuple[float, ...] = (5.0, 12.0, 16.0), count: int = 8, every_s: float = 0.25
) -> list[float]:
    """Arrival times of long prompts in bursts: ``count`` prompts ``every_s`` apart from each
    of ``starts_s``. Beside decoding requests their chunks stretch over 1% of the decoding
    steps (a long prefill finding; one such prompt every few seconds is none), and bursts
    further apart than gap_merge_time are episodes of their own."""
    return [start + number * every_s for start in starts_s for number in range(count)]


# --------------------------------------------------------------------------------------------
# The stories, at small scale. Each returns a finished Simulator; .write(path) records it.

# A GPU-like cost: 20 ms per iteration plus 20 us per context and 1 ms per generation token.
STORY_COST = Cost(base_time=0.020, context_token_time=20e-6, generation_token_time=1e-3)


def healthy(seed: int = 0) -> Simulator:
    """6 requests/s of short prompts, well within every limit."""
    sim = Simulator(
        num_blocks=800, max_num_seqs=32, max_num_batched_tokens=1024, cost=STORY_COST, seed=seed
    )
    sim.add_requests(arrivals(6, 30, seed=seed), num_prompt=96, num_output=60)
    return sim.run(33)


def story1_kv_cliff() -> Simulator:
    """Long prompts at a concurrency sized to fill the cache; then every running request is
    evicted to waiting at once without a counted preemption, and the engine keeps iterating."""
    sim = Simulator(
        num_blocks=18 * 55, max_num_seqs=128, max_num_batched_tokens=4096, cost=STORY_COST
    )
    sim.add_closed_loop(num_requests=60, concurrency=18, num_prompt=800, num_output=80)
    sim.add_cliff(at_s=2.0, min_usage=0.95)
    return sim.run(25)


def story2_leak() -> Simulator:
    """Every finished request leaves 3 blocks behind: usage climbs with few requests running."""
    sim = Simulator(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=1024, cost=STORY_COST)
    sim.leak_blocks_per_finish = 3
    sim.add_requests(arrivals(3, 60), num_prompt=64, num_output=30)
    return sim.run(62)


def stalled() -> Simulator:
    """Healthy load, then the loop hangs for 8 s with work queued (heartbeats go on): past the
    5 s floor of the stall threshold the live sidecar and `explain` share, mid-stall too."""
    sim = Simulator(num_blocks=800, max_num_seqs=32, max_num_batched_tokens=1024, cost=STORY_COST)
    sim.add_requests(arrivals(6, 30), num_prompt=96, num_output=60)
    sim.add_stall(at_s=10.0, duration_s=8.0)
    return sim.run(33)


def story3_bursty(max_num_seqs: int) -> Simulator:
    """6 requests/s; batched with room to spare, queued when max_num_seqs is small."""
    sim = Simulator(
        num_blocks=2000, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, cost=STORY_COST
    )
    sim.add_requests(arrivals(6, 30, seed=3), num_prompt=200, num_output=100)
    return sim.run(33)


# A CPU-like cost: 0.5 s per 500-token prefill, 60 ms per decode iteration.
SLOW_COST = Cost(base_time=0.060, context_token_time=1e-3, generation_token_time=2e-3)


def kv_capacity() -> Simulator:
    """Requests that fit a few at a time in a small cache: the rest wait for KV blocks."""
    sim = Simulator(num_blocks=60, max_num_seqs=64, max_num_batched_tokens=4096, cost=STORY_COST)
    sim.add_requests(arrivals(8, 20), num_prompt=160, num_output=40)
    return sim.run(25)


def token_budget() -> Simulator:
    """Long prompts behind a small budget, no chunked prefill room: they wait for the budget."""
    sim = Simulator(num_blocks=4000, max_num_seqs=64, max_num_batched_tokens=256, cost=STORY_COST)
    sim.add_requests(arrivals(16, 20), num_prompt=1000, num_output=20)
    return sim.run(25)


def preemption_storm() -> Simulator:
    """Requests admitted together outgrow the cache and evict one another: 24 requests of
    440 tokens at most, 7 of which fit in the cache at their peak (28 preemptions)."""
    sim = Simulator(num_blocks=200, max_num_seqs=64, max_num_batched_tokens=4096, cost=STORY_COST)
    sim.add_requests([0.5] * 24, num_prompt=40, num_output=400)
    return sim.run(30)


def idle() -> Simulator:
    """A few requests, then nothing for half a minute."""
    sim = Simulator(num_blocks=800, max_num_seqs=32, max_num_batched_tokens=1024, cost=STORY_COST)
    sim.add_requests([1.0, 1.5, 2.0], num_prompt=64, num_output=20)
    return sim.run(35)


def drafting(draft_token_time: float, accept_one_in: int, duration_s: float = 30) -> Simulator:
    """Healthy load with speculative decoding, drafts of 3 tokens: costly where a draft token
    costs what a request's own token does (compute-bound) and few are accepted, paying where
    draft tokens are nearly free (memory-bound) and half of them are accepted. Not yet run:
    requests arrive for ``duration_s``."""
    cost = Cost(
        base_time=STORY_COST.base_time,
        context_token_time=STORY_COST.context_token_time,
        generation_token_time=STORY_COST.generation_token_time,
        draft_token_time=draft_token_time,
    )
    sim = Simulator(
        num_blocks=800,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        cost=cost,
        num_spec_tokens=3,
        accept_one_in=accept_one_in,
        drafting_share=0.6,
    )
    sim.add_requests(arrivals(4, duration_s, seed=5), num_prompt=96, num_output=60)
    return sim


DRAFTS_CHANGE_S = 40.0  # drafts_that_change: when the traffic changes


def drafts_that_change(accept_one_in_before: int, accept_one_in_after: int) -> Simulator:
    """Speculative decoding whose draft tokens cost what a request's own token does, under
    traffic whose drafts are accepted one request in ``accept_one_in_before`` until
    DRAFTS_CHANGE_S, then one in ``accept_one_in_after`` (prompts that the drafts match, then
    prompts they do not), for 80 s in all."""
    sim = drafting(1e-3, accept_one_in_before, duration_s=80).run(DRAFTS_CHANGE_S)
    sim.accept_one_in = accept_one_in_after
    return sim.run(83)


def futile_speculation(drafting_share: float = 0.03) -> Simulator:
    """Healthy load with speculative decoding that gains nothing: drafts of up to 3 tokens,
    proposed for ``drafting_share`` of the decoding requests (an n-gram that rarely matches),
    none accepted. The heartbeats say the engine speculates, so it is seen with no draft too."""
    sim = Simulator(
        num_blocks=800,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        num_spec_tokens=3,
        accept_one_in=10**9,  # never: the draft of (iteration + i) == 0 accepts 0 tokens too
        drafting_share=drafting_share,
    )
    sim.add_requests(arrivals(4, 30, seed=5), num_prompt=96, num_output=60)
    return sim.run(33)


def healthy_but_slow() -> Simulator:
    """A CPU-speed engine, one request at a time: multi-second requests, nothing wrong."""
    sim = Simulator(num_blocks=800, max_num_seqs=8, max_num_batched_tokens=2048, cost=SLOW_COST)
    sim.add_requests([1.0 + 8.0 * i for i in range(6)], num_prompt=500, num_output=40)
    return sim.run(50)


# Each scenario with its true top cause (bench/findings_accuracy.py, tests/test_live_findings.py):
# scenario -> (make, true top cause): a finding kind as the live sidecar names it
# (live_findings.finding_kind: waiting with its reason, e.g. "waiting_kv"), or None (no problem)
def another_job(
    every: int = 3, factor: float = 6.0, lasting_s: float = 10.0, rate_per_s: float = 6.0
) -> Simulator:
    """Healthy load, then for ``lasting_s`` another job takes the engine's cores: every
    ``every``-th iteration takes ``factor`` times as long, whatever it computes."""
    sim = Simulator(num_blocks=800, max_num_seqs=32, max_num_batched_tokens=1024, cost=STORY_COST)
    sim.add_requests(arrivals(rate_per_s, 20 + lasting_s), num_prompt=96, num_output=60)
    sim.add_slowdown(from_s=12.0, to_s=12.0 + lasting_s, factor=factor, every=every)
    return sim.run(23 + lasting_s)


def long_prompts(arrival_times: list[float]) -> Simulator:
    """Short requests decoding (2 a second, 150 tokens each) beside 2,000-token prompts that
    arrive at ``arrival_times``, each a chunk of its own at a budget of 2,048: iterations of
    ~110 ms against ~12 ms decode-only ones."""
    cost = Cost(base_time=0.010, context_token_time=50e-6, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests(arrivals(2, 20), num_prompt=32, num_output=150)
    sim.add_requests(arrival_times, num_prompt=2000, num_output=10)
    return sim.run(22)


SCENARIOS: dict[str, tuple[Callable[[], Simulator], str | None]] = {
    "healthy": (healthy, None),
    "story1 KV cliff": (story1_kv_cliff, "kv_cliff"),
    "story2 leak": (story2_leak, "kv_leak"),
    "stall": (stalled, "stall"),
    "story3 sequence limit": (lambda: story3_bursty(4), "waiting_seq_limit"),
    "KV capacity": (kv_capacity, "waiting_kv"),
    "token budget": (token_budget, "waiting_budget"),
    "preemption storm": (preemption_storm, "preemption_storm"),
    "idle": (idle, None),
    "healthy but slow": (healthy_but_slow, None),
    "drafts that cost": (lambda: drafting(1e-3, accept_one_in=4).run(33), "costly_drafts"),
    "drafts that pay": (lambda: drafting(0.1e-3, accept_one_in=1).run(33), None),
    "drafts that stop paying": (lambda: drafts_that_change(1, 8), "costly_drafts"),
    "speculation that gains nothing": (futile_speculation, "futile_speculation"),
    "long prompts in bursts": (lambda: long_prompts(long_prompt_bursts()), "long_prefill"),
    "another job on the cores": (another_job, "slow_decode"),
    # longer than the baseline's 30 s: judged against the pace before it began throughout
    "another job for a minute and a half": (lambda: another_job(3, 6.0, 90.0, 3), "slow_decode"),
    # every other iteration 5x slower for 90 s: requests queue at the sequence limit, the
    # queue costs most, and its action says to free the engine first (episodes/related.py)
    "another job, the queue grows": (lambda: another_job(2, 5.0, 90.0), "waiting_seq_limit"),
    # every iteration 4x slower for 90 s: the batch grows from ~13 requests to the limit of
    # 32, past what the pace before can be scaled to but in proportion (an upper bound)
    "another job slows every iteration": (lambda: another_job(1, 4.0, 90.0), "waiting_seq_limit"),
    # under 1% of the decoding steps stretched: no finding (the p99 inter-token latency is not
    # theirs), where each had opened one, and with one a minute an alert
    "a long prompt now and then": (lambda: long_prompts([5.0, 12.0, 16.0]), None),
}
# --------------------------------------------------------------------------------------------
# Scripted recordings: every iteration given by hand, for costs that can be worked out on paper.


@dataclass
class Row:
    """One scripted iteration: how long it took and the engine's counts after its scheduling.
    Every waiting request waits for KV capacity; generation tokens equal ``gen_reqs``."""

    elapsed_s: float
    running: int
    waiting: int
    blocks_used: int
    gen_reqs: int = 0
    ctx_tokens: int = 0
    preemptions: int = 0
    pause_before_s: float = 0.0  # silence before the iteration starts (no message at all)


def scripted(
    rows: list[Row], num_blocks: int = 100, start_s: float = 1000.0
) -> list[IterationRecord]:
    """The records of ``rows``, back to back (each starts when the one before ends, after its
    pause), numbered from iteration 1 and seq 1, without heartbeats."""
    records, now_ns = [], int(start_s * NS)
    for number, row in enumerate(rows, 1):
        now_ns += int(row.pause_before_s * NS)
        elapsed_ns = int(row.elapsed_s * NS)
        records.append(
            iteration_record(
                0,
                number,
                number,
                start_ns=now_ns,
                elapsed_ns=elapsed_ns,
                num_prefill_reqs=int(row.ctx_tokens > 0),
                num_prefill_tokens=row.ctx_tokens,
                num_decode_reqs=row.gen_reqs,
                num_decode_tokens=row.gen_reqs,
                num_running_reqs=row.running,
                num_waiting_reqs=row.waiting,
                num_waiting_kv_reqs=row.waiting,
                num_kv_blocks_used=row.blocks_used,
                num_kv_blocks_free=num_blocks - row.blocks_used,
                num_preemptions=row.preemptions,
            )
        )
        now_ns += elapsed_ns
    return records


# A KV cliff scripted by hand, iterations of 10 ms back to back: 2 requests fill the cache; one
# is preempted (iteration 5) and waits 6 iterations (60 ms); iteration 11 admits it again and
# recomputes its 500-token prompt beside the other's decode in 40 ms (a long prefill: 30 ms
# beyond the 10 ms decode-only median, for 1 decoding request); then 4 s of silence.
SCRIPTED_CLIFF = (
    [Row(0.010, running=2, waiting=0, blocks_used=100, gen_reqs=2)] * 4
    + [Row(0.010, running=1, waiting=1, blocks_used=50, gen_reqs=1, preemptions=1)]
    + [Row(0.010, running=1, waiting=1, blocks_used=50, gen_reqs=1)] * 5
    + [Row(0.040, running=2, waiting=0, blocks_used=100, gen_reqs=1, ctx_tokens=500)]
    + [Row(0.010, running=1, waiting=0, blocks_used=30, gen_reqs=1, pause_before_s=4.0)]
    + [Row(0.010, running=1, waiting=0, blocks_used=30, gen_reqs=1)] * 9
)


def write_records(records: list[IterationRecord], path: Path) -> Path:
    """A recording file of ``records``, as the sidecar's JSONL sink writes it."""
    encoder = msgspec.json.Encoder()
    path.write_bytes(b"".join(encoder.encode(record) + b"\n" for record in records))
    return path
