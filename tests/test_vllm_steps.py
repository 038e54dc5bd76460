"""The vLLM scheduler source's step mapping (telemetry/sources/vllm_steps.py) on stand-ins
shaped like vLLM 0.32's and 0.33's scheduler, SchedulerOutput and Request. The same mapping inside a
real vLLM scheduler runs in test_vllm_scheduler_live.py (the `.vllm-venv` check script and
a real `vllm serve`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from telemetry.lane.record import EVENT_FINISHED, EVENT_FIRST_TOKEN, FINISH_REASONS
from telemetry.sources.vllm_lane import scheduler_source_selected
from telemetry.sources.vllm_steps import StepReporter, prefills_held, waiting_queues


class Request:
    """A vLLM Request as the reporter reads it."""

    def __init__(self, request_id: str, num_prompt_tokens: int = 100) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.arrival_time = time.time() - 1.0
        self.trace_headers = {"traceparent": f"00-{request_id}"}
        self.finish_reason = None

    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def get_finished_reason(self):
        return self.finish_reason


class Scheduler:
    """The scheduler attributes the reporter reads; ``skipped_queue``: vLLM 0.29/0.30's waiting
    queues (vllm_steps.SKIPPED_QUEUE) instead of 0.31's."""

    def __init__(
        self,
        max_num_seqs: int = 4,
        max_tokens: int = 256,
        num_free: int = 10,
        skipped_queue: bool = False,
    ):
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        if skipped_queue:
            self.skipped_waiting: list[Request] = []
            self.max_num_running_reqs = max_num_seqs
        else:
            self.kv_holding_waiting: list[Request] = []
            self.deferred_waiting: set[Request] = set()
            self.max_num_active_reqs = max_num_seqs
        self.finished_req_ids: set[str] = set()
        self.max_num_scheduled_tokens = max_tokens
        self.num_waiting_for_streaming_input = 0
        self.pause_state = 0
        pool = SimpleNamespace(get_num_free_blocks=lambda: self.num_free)
        self.kv_cache_manager = SimpleNamespace(block_pool=pool)
        self.num_free = num_free


class Publisher:
    def __init__(self) -> None:
        self.records = []
        self.queues = []

    def publish(self, record) -> None:
        self.records.append(record)

    def note_queues(self, num_waiting: int, num_running: int, step_tokens: int = 0) -> None:
        self.queues.append((num_waiting, num_running))
        self.step_tokens = step_tokens


def output(new=(), cached=(), preempted=(), finished=()):
    """A SchedulerOutput: ``new`` [(request, tokens)], ``cached`` [(request, tokens)]."""
    num_scheduled = {r.request_id: n for r, n in [*new, *cached]}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id) for r, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _ in cached],
            num_output_tokens=[r.num_output_tokens for r, _ in cached],
        ),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        preempted_req_ids=set(preempted),
        finished_req_ids=set(finished),
    )


def core_outputs(*pairs):
    """EngineCoreOutputs by client: ``pairs`` of (request, new tokens)."""
    outs = [SimpleNamespace(request_id=r.request_id, new_token_ids=[1] * n) for r, n in pairs]
    return {0: SimpleNamespace(outputs=outs)}


@pytest.fixture
def setup():
    scheduler, publisher = Scheduler(), Publisher()
    return scheduler, publisher, StepReporter(3, 11, publisher)


def admit(scheduler, reporter, *requests):
    for request in requests:
        scheduler.waiting.append(request)
        reporter.added(scheduler, request)


def run_new(scheduler, reporter, request, tokens, cached_tokens=0):
    """vLLM admits ``request`` for a chunk of ``tokens`` after ``cached_tokens`` prefix hits."""
    scheduler.waiting.remove(request)
    scheduler.running.append(request)
    request.num_computed_tokens = cached_tokens + tokens  # schedule() advances it
    return (request, tokens)


def test_heartbeats_during_a_step_say_the_queues_it_runs_with(setup):
    """The queues are noted when schedule() returns: a long prefill step's heartbeats show
    the requests it took in as running, not still waiting."""
    scheduler, publisher, reporter = setup
    requests = [Request(name, 100) for name in "abc"]
    admit(scheduler, reporter, *requests)
    assert publisher.queues[-1] == (3, 0)
    new = [run_new(scheduler, reporter, r, 100) for r in requests[:2]]
    reporter.scheduled(scheduler, output(new=new), time.monotonic_ns())
    assert publisher.queues[-1] == (1, 2)
    assert publisher.step_tokens == 200  # the step's size, for the stall rule


def test_a_prefill_then_decode_step_fills_every_field(setup):
    scheduler, publisher, reporter = setup
    a, b = Request("a", 100), Request("b", 50)
    admit(scheduler, reporter, a, b)
    assert publisher.queues[-1] == (2, 0)
    out = output(new=[run_new(scheduler, reporter, a, 84, cached_tokens=16)])
    reporter.scheduled(scheduler, out, time.monotonic_ns())
    a.num_output_tokens = 1
    scheduler.num_free = 7
    time.sleep(0.002)  # the forward pass
    reporter.updated(scheduler, out, core_outputs((a, 1)), time.monotonic_ns())
    (record,) = publisher.records
    assert (record.engine_index, record.iteration) == (3, 1)
    assert (record.num_prefill_reqs, record.num_prefill_tokens) == (1, 84)
    assert (record.num_decode_reqs, record.num_decode_tokens) == (0, 1)  # a's first token
    assert (record.num_prefix_query_tokens, record.num_prefix_hit_tokens) == (100, 16)
    assert (record.num_running_reqs, record.num_waiting_reqs) == (1, 1)
    assert (record.num_kv_blocks_used, record.num_kv_blocks_free) == (3, 7)  # 10 usable
    assert record.num_kv_tokens == 100 and record.unknown == 0
    assert 2_000_000 <= record.model_elapsed_ns <= record.elapsed_ns
    (first,) = record.milestones
    assert first.event == EVENT_FIRST_TOKEN and first.request_id == "a"
    assert first.first_scheduled_ns == record.start_ns
    assert first.first_token_ns == record.start_ns + record.elapsed_ns
    assert 0.9e9 < first.first_scheduled_ns - first.arrival_ns < 1.5e9  # arrived 1 s before
    assert first.num_cached_tokens == 16 and first.traceparent == "00-a"
    # next step: a decodes, b's prompt is chunked (no output yet: still prefill)
    out = output(new=[run_new(scheduler, reporter, b, 30)], cached=[(a, 1)])
    reporter.scheduled(scheduler, out, time.monotonic_ns())
    reporter.updated(scheduler, out, core_outputs((a, 1)), time.monotonic_ns())
    record = publisher.records[-1]
    assert (record.num_prefill_reqs, record.num_prefill_tokens) == (1, 30)
    assert (record.num_decode_reqs, record.num_decode_tokens) == (1, 1)
    assert record.milestones == []  # b has no token yet


def test_a_finish_carries_the_whole_lifecycle_once(setup):
    scheduler, publisher, reporter = setup
    a = Request("a", 20)
    admit(scheduler, reporter, a)
    out = output(new=[run_new(scheduler, reporter, a, 20)])
    reporter.scheduled(scheduler, out, time.monotonic_ns())
    a.num_output_tokens, a.finish_reason = 1, 1  # max_tokens=1: first token and finish
    scheduler.running.remove(a)
    scheduler.finished_req_ids = {"a"}
    reporter.updated(scheduler, out, core_outputs((a, 1)), time.monotonic_ns())
    (record,) = publisher.records
    (done,) = record.milestones
    assert done.event == EVENT_FIRST_TOKEN | EVENT_FINISHED
    assert FINISH_REASONS[done.finish_reason] == "length"
    assert done.finished_ns == done.first_token_ns > done.first_scheduled_ns > 0
    assert done.prefill_chunks == [(record.start_ns, done.first_token_ns, 20)]
    # vLLM passes the finished ids on to the next schedule(): not reported twice
    out = output(finished={"a"})
    reporter.scheduled(scheduler, out, time.monotonic_ns())
    reporter.updated(scheduler, out, {}, time.monotonic_ns())
    assert len(publisher.records) == 1  # an empty step is no record
    assert publisher.queues[-1] == (0, 0)


def test_an_abort_before_scheduling_is_a_finish_without_a_first_token(setup):
    scheduler, publisher, reporter = setup
    a, b = Request("a"), Request("b")
    admit(scheduler, reporter, a, b)
    scheduler.waiting.remove(b)
    b.finish_reason = 2  # aborted between steps: vLLM lists it in the next output
    out = output(new=[run_new(scheduler, reporter, a, 100)], finished={"b"})
    reporter.scheduled(scheduler, out, time.monotonic_ns())
    reporter.updated(scheduler, out, core_outputs(), time.monotonic_ns())
    (aborted,) = publisher.records[-1].milestones
    assert aborted.request_id == "b" and aborted.event == EVENT_FINISHED
    assert FINISH_REASONS[aborted.finish_reason] == "abort"
    assert aborted.first_scheduled_ns == aborted.first_token_ns == 0


@pytest.mark.parametrize(
    "case, reason",
    [
        ("seq_limit", "num_waiting_seq_limit_reqs"),
        ("budget", "num_waiting_budget_reqs"),
        ("kv", "num_waiting_kv_reqs"),
        ("preempted", "num_waiting_kv_reqs"),
        ("paused", "num_waiting_other_reqs"),
        ("prefills_held", "num_waiting_other_reqs"),
    ],
)
@pytest.mark.parametrize("skipped_queue", [False, True], ids=["vllm-0.31+", "vllm-0.29-0.30"])
def test_why_requests_wait_follows_the_documented_rule(case, reason, skipped_queue):
    scheduler = Scheduler(max_num_seqs=2, max_tokens=64, skipped_queue=skipped_queue)
    publisher = Publisher()
    reporter = StepReporter(0, 11, publisher, waiting_queues(scheduler))
    requests = [Request(f"r{i}", 32) for i in range(5)]
    admit(scheduler, reporter, *requests)
    blocked = requests[4]  # e.g. a grammar still compiling
    if skipped_queue:
        scheduler.waiting.remove(blocked)
        scheduler.skipped_waiting.append(blocked)
    else:
        scheduler.deferred_waiting.add(blocked)
    admitted = {"seq_limit": 2, "budget": 1, "kv": 1, "preempted": 0}.get(case, 1)
    tokens = 64 if case == "budget" else 16
    new = [run_new(scheduler, reporter, r, tokens) for r in requests[:admitted]]
    if case == "paused":
        scheduler.pause_state = 1  # PAUSED_NEW: running requests go on, none is admitted
    preempted = {"x"} if case == "preempted" else set()
    out = output(new=new, preempted=preempted)
    reporter.scheduled(scheduler, out, time.monotonic_ns(), prefills_held=case == "prefills_held")
    reporter.updated(scheduler, out, core_outputs(), time.monotonic_ns())
    (record,) = publisher.records
    num_waiting = 5 - admitted
    counts = {
        name: getattr(record, name)
        for name in (
            "num_waiting_kv_reqs",
            "num_waiting_seq_limit_reqs",
            "num_waiting_budget_reqs",
            "num_waiting_other_reqs",
        )
    }
    assert record.num_waiting_reqs == num_waiting == sum(counts.values())
    expected = {name: 0 for name in counts}
    expected["num_waiting_other_reqs"] = 1  # the deferred request
    expected[reason] += num_waiting - 1
    assert counts == expected


def cadence_scheduler(decoding: bool = True, **state) -> Scheduler:
    """A scheduler with one running request (decoding or prefilling) and vLLM's prefill
    cadence state ``state`` (none: vLLM 0.32, which keeps no cadence of its own)."""
    scheduler = Scheduler()
    request = Request("r")
    request.is_prefill_chunk = not decoding
    scheduler.running.append(request)
    scheduler.prefill_capacity_bound = False
    for name, value in state.items():
        setattr(scheduler, name, value)
    return scheduler


LOCAL_CADENCE = {"local_prefill_interval": 4, "last_prefill_step": 4}


@pytest.mark.parametrize(
    "scheduler, throttle_prefills, held",
    [
        (cadence_scheduler(), True, True),  # a data-parallel engine core's throttled step
        (cadence_scheduler(), False, False),
        (cadence_scheduler(**LOCAL_CADENCE, num_executed_steps=5), False, True),  # 2 of 4
        (cadence_scheduler(**LOCAL_CADENCE, num_executed_steps=7), False, False),  # 4 of 4
        (cadence_scheduler(decoding=False), True, False),  # nothing decodes: no hold
        (cadence_scheduler(prefill_capacity_bound=True), True, False),  # the last left waiting
        (cadence_scheduler(local_prefill_interval=1, num_executed_steps=5), False, False),
    ],
)
def test_prefills_are_held_where_vllms_schedule_holds_them(scheduler, throttle_prefills, held):
    """The state read just before ``schedule()``, as vLLM 0.29 to 0.33 decide on it; the
    real schedulers' decisions are checked in test_vllm_scheduler_live.py."""
    assert prefills_held(scheduler, throttle_prefills) is held


def test_steps_pair_by_their_output_under_async_scheduling(setup):
    scheduler, publisher, reporter = setup
    a, b = Request("a"), Request("b")
    admit(scheduler, reporter, a, b)
    first = output(new=[run_new(scheduler, reporter, a, 100)])
    reporter.scheduled(scheduler, first, time.monotonic_ns())
    second = output(new=[run_new(scheduler, reporter, b, 100)])
    reporter.scheduled(scheduler, second, time.monotonic_ns())  # before the first's update
    reporter.updated(scheduler, first, core_outputs(), time.monotonic_ns())
    reporter.updated(scheduler, second, core_outputs(), time.monotonic_ns())
    assert [r.iteration for r in publisher.records] == [1, 2]
    assert publisher.records[0].start_ns < publisher.records[1].start_ns
    # an output this reporter never saw scheduled: ignored, no error
    reporter.updated(scheduler, output(), {}, time.monotonic_ns())
    assert len(publisher.records) == 2


def test_preemptions_are_counted_and_timed_on_the_request(setup):
    scheduler, publisher, reporter = setup
    a = Request("a")
    admit(scheduler, reporter, a)
    out = output(new=[run_new(scheduler, reporter, a, 100)])
    reporter.scheduled(scheduler, out, time.monotonic_ns())
    reporter.updated(scheduler, out, core_outputs((a, 1)), time.monotonic_ns())
    a.num_output_tokens = 1
    preempt_at = time.monotonic_ns()
    out = output(preempted={"a"})
    reporter.scheduled(scheduler, out, preempt_at)
    reporter.updated(scheduler, out, core_outputs(), time.monotonic_ns())
    assert publisher.records[-1].num_preemptions == 1
    assert reporter.requests["a"].preempted_ns == [preempt_at]


def test_the_plugin_knows_when_the_scheduler_source_is_selected():
    def config(scheduler_cls):
        return SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls))

    assert scheduler_source_selected(config("telemetry.sources.vllm_scheduler.IterscopeScheduler"))
    assert not scheduler_source_selected(config(None))
    assert not scheduler_source_selected(config("vllm.v1.core.sched.scheduler.Scheduler"))


def test_the_vllm_versions_said_tested_are_the_ones_make_builds():
    """TESTED_VLLM_VERSIONS (the sources' version guard), the versions `make vllm` builds and
    the one bench/vllm_server.py runs without a directory of its own are one list."""
    import re
    from pathlib import Path

    from bench.vllm_server import CPU_BUILD_VERSION
    from telemetry.sources.vllm_lane import TESTED_VLLM_VERSIONS
    from tests.helpers.vllm import version_tuple

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    built = dict(re.findall(r"^(VLLM_VER|VLLM_OTHER_VERS)\s*:=\s*(.+)$", makefile, re.M))
    assert CPU_BUILD_VERSION == built["VLLM_VER"]
    versions = [built["VLLM_VER"], *built["VLLM_OTHER_VERS"].split()]
    assert TESTED_VLLM_VERSIONS == tuple(sorted(versions, key=version_tuple))
