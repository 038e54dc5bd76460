"""The summary says only what its recording shows (QA of explain's summary):

- iterations that scheduled nothing (an engine spinning while requests wait) do not make the
  requests that were scheduled look alone, and "too few arrived together" is not said where
  requests were left waiting;
- requests never scheduled (aborted while waiting, or still waiting at the end) are said
  beside the queue-time figures, which leave them out;
- with messages lost, the counts they could hide are "at least";
- with no iteration (or none timed), "no iteration", not times of 0 ms.
"""

from __future__ import annotations

from telemetry.analysis.summary import Summary, format_summary, summarize
from telemetry.analysis.timeline import build_timelines
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    FINISH_ABORT,
    UNKNOWN_ELAPSED,
    IterationRecord,
    RequestMilestone,
)
from tests.scenarios import synthetic
from tests.scenarios.synthetic import NS, Row, Simulator, arrivals

BATCHED = Row(0.020, running=4, waiting=0, blocks_used=40, gen_reqs=4)
SPINNING = Row(0.0001, running=0, waiting=4, blocks_used=96)  # schedules nothing


def summary_of(messages: list) -> tuple[Summary, str]:
    """The summary of engine 0's messages, and its text (verdict included)."""
    summary = summarize(build_timelines(messages)[0])
    return summary, "\n".join(format_summary(summary))


def milestone(arrival_s: float, scheduled_s: float, first_token_s: float, event: int):
    """A request's milestone, its times in seconds (0: not reached)."""
    return RequestMilestone(
        request_id=f"req-{arrival_s}",
        event=event,
        arrival_ns=int(arrival_s * NS),
        first_scheduled_ns=int(scheduled_s * NS),
        first_token_ns=int(first_token_s * NS),
        finished_ns=0,
        num_prompt_tokens=32,
        num_cached_tokens=0,
        num_output_tokens=int(first_token_s > 0),
        num_preemptions=0,
        finish_reason=-1,
    )


def aborted_unscheduled(arrival_s: float, finished_s: float) -> RequestMilestone:
    """A request aborted while it waited, never scheduled (as the engine sends it)."""
    aborted = milestone(arrival_s, 0, 0, EVENT_FINISHED)
    aborted.finished_ns, aborted.finish_reason = int(finished_s * NS), FINISH_ABORT
    return aborted


def with_requests(records: list[IterationRecord], num_unscheduled: int) -> list:
    """``records`` with 2 requests timed in the first (50 ms in queue) and
    ``num_unscheduled`` aborted in the last after waiting from the start, never scheduled
    (no longer waiting after it)."""
    start_s = records[0].start_ns / NS
    end_s = (records[-1].start_ns + records[-1].elapsed_ns) / NS
    records[0].milestones = [
        milestone(start_s - 0.05, start_s, start_s + 0.01, EVENT_FIRST_TOKEN) for _ in range(2)
    ]
    last = records[-1]
    last.milestones = [aborted_unscheduled(start_s, end_s) for _ in range(num_unscheduled)]
    num_waiting = max(0, last.num_waiting_reqs - num_unscheduled)
    last.num_waiting_reqs = last.num_waiting_kv_reqs = num_waiting
    return records


# ---- 1. batching: over the iterations that scheduled work


def test_spinning_iterations_do_not_make_a_batch_look_like_one_request_at_a_time():
    """4 requests decode together, then the engine spins 600 iterations that schedule
    nothing while 4 wait (s11): the mean over every iteration (0.07) read "mostly one at a
    time, too few arrived together to batch"; over the iterations that scheduled work it is 4."""
    summary, text = summary_of(synthetic.scripted([BATCHED] * 10 + [SPINNING] * 600))
    assert summary.num_empty_iterations == 600
    assert summary.mean_batch_reqs == 4.0 and summary.mean_batch_tokens == 4.0
    assert summary.verdict.startswith(
        "Batched: 4.0 requests shared each iteration on average (max 4) in the 10 iterations "
        "that scheduled any, 600 more scheduling none; and queued"
    )
    assert "too few arrived together" not in text
    assert (
        "batch: 4.0 requests and 4.0 tokens per iteration on average over the 10 that "
        "scheduled a request (600 scheduled nothing); decode-only 1.6%, prefill-only 0.0%, "
        "mixed 0.0% of all iterations"
    ) in text


def test_only_spinning_iterations_schedule_no_request():
    summary, _ = summary_of(synthetic.scripted([SPINNING] * 50))
    assert summary.verdict.startswith("No iteration scheduled a request (50 iterations ran);")


def test_requests_left_waiting_are_not_too_few_to_batch():
    """One request decoding while another waits for KV blocks: small batches, but because a
    limit held the other back, not because too few arrived together."""
    rows = [Row(0.020, running=1, waiting=1, blocks_used=90, gen_reqs=1)] * 20
    summary, _ = summary_of(synthetic.scripted(rows))
    assert summary.verdict.startswith("Mostly one at a time: 1.0 requests per iteration (max 1);")
    assert "too few arrived together" not in summary.verdict
    assert "and queued" in summary.verdict


def test_requests_that_came_one_at_a_time_are_still_said_to():
    rows = [Row(0.020, running=1, waiting=0, blocks_used=10, gen_reqs=1)] * 20
    summary, _ = summary_of(synthetic.scripted(rows))
    assert summary.verdict.startswith(
        "Mostly one at a time: 1.0 requests per iteration (max 1), too few arrived together "
        "to batch; not queued"
    )
    assert summary.num_empty_iterations == 0


# ---- 2. requests never scheduled, beside the queue time that leaves them out


def test_requests_never_scheduled_are_said_beside_the_queue_time():
    """4 requests waited until aborted, never scheduled (s11): the queue-time median was of
    the 2 others only, as if everyone's."""
    records = with_requests(synthetic.scripted([BATCHED] * 10 + [SPINNING] * 300), 4)
    summary, text = summary_of(records)
    assert (summary.num_timed_reqs, summary.num_unscheduled_reqs) == (2, 4)
    assert summary.num_waiting_at_end == 0
    waited = (300 * SPINNING.elapsed_s + 10 * BATCHED.elapsed_s) * NS
    assert abs(summary.max_unscheduled_wait * NS - waited) < 1e3
    never = "4 requests never scheduled (aborted after waiting up to 230.0 ms)"
    assert f"(2 requests); {never}, not in these figures" in text
    assert summary.verdict.endswith(
        f"median queue time 50.0 ms, p90 50.0 ms (of the 2 requests with a first token); {never}."
    )


def test_requests_never_scheduled_without_a_first_token_recorded():
    records = synthetic.scripted([SPINNING] * 20)
    records[-1].milestones = [aborted_unscheduled(1000.0, 1000.5)]
    _, text = summary_of(records)
    assert (
        "no first token recorded, so no queue time or TTFT; 1 request never scheduled "
        "(aborted after waiting up to 500.0 ms)"
    ) in text


def test_requests_still_waiting_at_the_end_are_said():
    """The recording ends with 4 waiting: not in the queue-time figures, so said; and not
    "too few arrived together" where it was not queued long enough to count as queued."""
    records = with_requests(synthetic.scripted([BATCHED] * 100 + [SPINNING]), 0)
    summary, text = summary_of(records)
    assert summary.num_waiting_at_end == 4 and summary.waiting_share < 0.05
    assert "(2 requests); 4 requests still waiting when the recording ended" in text
    assert summary.verdict.endswith("; 4 requests still waiting when the recording ended.")


def test_a_run_where_every_request_was_scheduled_says_nothing_of_it():
    records = with_requests(synthetic.scripted([BATCHED] * 10), 0)
    summary, text = summary_of(records)
    assert (summary.num_unscheduled_reqs, summary.num_waiting_at_end) == (0, 0)
    assert "never scheduled" not in text and "still waiting" not in text
    assert "(2 requests)\n" in text


# ---- 3. lost messages: counts they could hide are lower bounds


def lossy(lose: bool) -> Simulator:
    """Healthy load; with ``lose``, the engine drops every message it sends from 5 s to 6 s."""
    sim = Simulator(cost=synthetic.STORY_COST)
    sim.add_requests(arrivals(4, 10), num_prompt=64, num_output=20)
    if lose:
        sim.add_message_loss(5.0, 6.0, by_engine=True)
    return sim.run(12)


def test_with_messages_lost_the_counts_are_at_least():
    """54 messages lost and "requests: 36 finished" where the client saw 40 (s12)."""
    sim = lossy(lose=True)
    num_lost = sim.msg_seq - len(sim.messages)
    assert num_lost > 0
    summary, text = summary_of(sim.messages)
    assert summary.num_lost_msgs == num_lost
    assert f"at least {summary.num_iterations} iterations in " in text
    assert f"; {num_lost} messages lost); iteration time p50" in text
    assert f"tokens: at least {summary.num_prefill_tokens} prefill (" in text
    assert f"at least {summary.num_decode_tokens} decode (" in text
    assert f"requests: at least {summary.num_finished_reqs} finished" in text
    assert summary.to_dict()["num_lost_msgs"] == num_lost


def test_without_lost_messages_counts_are_plain():
    summary, text = summary_of(lossy(lose=False).messages)
    assert summary.num_lost_msgs == 0
    assert "at least" not in text and "lost" not in text
    assert f"requests: {summary.num_finished_reqs} finished" in text


# ---- 4. no iteration: said, not 0 ms


def test_a_recording_without_iterations_says_so_not_zero_times():
    """Heartbeats only (idle.jsonl): "iteration time p50 0.00 ms, p99 0.00 ms, max 0.00 ms"
    for 0 iterations."""
    sim = Simulator(cost=synthetic.STORY_COST).run(4.5)
    summary, text = summary_of(sim.messages)
    assert summary.num_iterations == 0
    assert format_summary(summary)[0] == "no iteration in 4.0 s: no batch, token or queue figure"
    assert "0.00 ms" not in text and "0.0 tokens/s" not in text
    assert "from the first iteration to the last" not in text


def test_iterations_without_a_measured_time_give_no_time():
    """A source that reports no iteration time (vLLM without iteration details)."""
    records = synthetic.scripted([BATCHED] * 10)
    for record in records:
        record.unknown |= UNKNOWN_ELAPSED
    summary, text = summary_of(records)
    assert summary.num_timed_iterations == 0
    assert "iteration time not reported by the source" in text
    assert "0.00 ms" not in text


def test_prefill_tokens_and_prefix_hits_say_what_preemptions_add_to_them():
    """After preemptions the prefill tokens include prompts computed again, and a preempted
    request admitted again finds its own blocks as prefix hits (QA: 7,731 prefill tokens where
    clients sent 1,920, and a 31.8% hit rate on unique prompts): the lines say so; a run
    without preemptions says neither."""
    stormy = summarize(build_timelines(synthetic.preemption_storm().messages)[0])
    assert stormy.num_preemptions
    stormy.prefix_hit_rate = 0.318
    text = "\n".join(format_summary(stormy))
    assert "prefill (" in text and "(prompts computed again after preemptions included)" in text
    assert "31.8% (a preempted request admitted again finds its own blocks: hits too)" in text
    calm = summarize(build_timelines(synthetic.healthy().messages)[0])
    assert calm.num_preemptions == 0
    calm.prefix_hit_rate = 0.318
    text = "\n".join(format_summary(calm))
    assert "computed again" not in text and "its own blocks" not in text
