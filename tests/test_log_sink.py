"""Log sink: the vLLM-compatible 10-second line, per-iteration lines, status and loss lines."""

import logging
import random
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.lane.record import Heartbeat, SpecDecodeCounts, make_encoder
from telemetry.lane.record import heartbeat as lane_heartbeat
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.sinks.log import LogSink
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from tests.helpers.lane import synthetic_record
from tests.helpers.sink_feed import conflict, health_of, lose, send

SECOND = 1_000_000_000
CLOCK_OFFSET_NS = 1_700_000_000 * SECOND  # wall - monotonic, as a heartbeat reports it


class Lines:
    def __init__(self):
        self.lines = []

    def __call__(self, level, text):
        self.lines.append((level, text))

    def texts(self, level=None):
        return [text for lvl, text in self.lines if level is None or lvl == level]


def heartbeat(engine_index, wall_s, running=0, waiting=0, device="GPU", msg_seq=1):
    wall_ns = int(wall_s * SECOND)
    return lane_heartbeat(
        engine_index,
        msg_seq,
        wall_ns - CLOCK_OFFSET_NS,
        wall_ns,
        num_waiting_reqs=waiting,
        num_running_reqs=running,
        device_name=device,
    )


def record(engine_index, wall_s, iteration=1, **fields):
    """An iteration that ends at wall time ``wall_s`` (10 ms long)."""
    end_ns = int(wall_s * SECOND) - CLOCK_OFFSET_NS
    message = synthetic_record(engine_index, iteration, end_ns - 10_000_000, 10_000_000)
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def design_messages(engine_index=0, start_s=100.0, device="GPU", preemptions=0):
    """Messages for one 10 s window giving the DESIGN.md example line, in time order."""
    messages = [heartbeat(engine_index, start_s - 1, device=device)]
    for step in range(10):
        messages.append(
            record(
                engine_index,
                start_s + step + 0.5,
                iteration=step + 1,
                num_prefill_tokens=600,
                num_decode_tokens=77 if step < 8 else 78,
                num_prefix_query_tokens=125,
                num_prefix_hit_tokens=124,
                num_running_reqs=5,
                num_waiting_reqs=0,
                num_kv_blocks_used=117,
                num_kv_blocks_free=883,
                num_preemptions=preemptions if step == 0 else 0,
            )
        )
    messages.append(heartbeat(engine_index, start_s + 10.2, running=5, device=device))
    return messages


def feed(sink, messages):
    send(sink, *messages)


def in_arrival_order(messages):
    """Several engines' messages interleaved by their wall time, as they arrive live."""
    return sorted(
        messages,
        key=lambda m: m.wall_ns if isinstance(m, Heartbeat) else m.start_ns + CLOCK_OFFSET_NS,
    )


def design_window(sink, **kwargs):
    feed(sink, design_messages(**kwargs))


def test_ten_second_line_is_the_vllm_line():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink)
    assert lines.texts() == [
        "Engine 000: Avg prompt throughput: 600.0 tokens/s, Avg generation throughput: "
        "77.2 tokens/s, Running: 5 reqs, Waiting: 0 reqs, GPU KV cache usage: 11.7%, "
        "Prefix cache hit rate: 99.2%"
    ]


def test_preemptions_are_added_when_non_zero_and_the_device_replaces_gpu():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink, device="CPU", preemptions=3)
    (line,) = lines.texts()
    assert ", CPU KV cache usage: 11.7%," in line
    assert line.endswith("Prefix cache hit rate: 99.2%, Preemptions: 3")


def test_an_engine_naming_no_device_gets_no_device_word():
    """A source whose heartbeat names no device (FPM producers) is not called a GPU."""
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink, device="")
    (line,) = lines.texts()
    assert ", Waiting: 0 reqs, KV cache usage: 11.7%," in line


def test_the_aggregated_line_names_a_device_only_where_every_engine_runs_on_it():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink, engine_index=0, device="GPU")
    lines.lines.clear()
    both = design_messages(0, start_s=110, device="GPU")
    both += design_messages(1, start_s=110, device="CPU")
    feed(sink, in_arrival_order(both))
    engine_0, engine_1, aggregated = lines.texts()
    assert ", GPU KV cache usage: " in engine_0 and ", CPU KV cache usage: " in engine_1
    assert ", Waiting: 0 reqs, KV cache usage: 11.7%," in aggregated


def test_idle_engine_is_silent_and_a_waiting_one_is_not():
    lines = Lines()
    sink = LogSink(emit=lines)
    for second in range(60):
        send(sink, heartbeat(0, 100 + second))
    assert lines.texts() == []
    for second in range(60, 81):  # work waits, nothing runs: the line says so
        send(sink, heartbeat(0, 100 + second, waiting=4))
    assert len(lines.texts()) == 2
    assert all(
        "Avg prompt throughput: 0.0 tokens/s" in t and "Waiting: 4 reqs" in t for t in lines.texts()
    )


def test_a_window_that_only_a_long_step_ran_in_says_the_step_under_way():
    """One 25 s step of 7,000 prompt tokens: a window inside it ends no iteration, so its
    line reads 0 tokens/s with requests running; the heartbeats say the step's size, and the
    line says it is under way and for how long (QA: such lines read "0.0 tokens/s, Running: 3
    reqs" twice, as though nothing ran). A source that does not say the size adds nothing."""
    lines = Lines()
    sink = LogSink(emit=lines)
    send(sink, heartbeat(0, 99.0, running=3), record(0, 101.0, iteration=1))
    for second in range(102, 127):  # the step: 101 s to 126 s, its record at its end
        beat = heartbeat(0, second, running=3)
        beat.step_tokens = 7000
        send(sink, beat)
    step = record(0, 126.0, iteration=2, num_prefill_tokens=7000, elapsed_ns=25 * SECOND)
    step.start_ns = 101 * SECOND - CLOCK_OFFSET_NS
    send(sink, step, heartbeat(0, 131.0, running=3))
    texts = lines.texts()
    under_way = [t for t in texts if "Iteration under way" in t]
    # windows of wall time 100-110 (the first record in it), 110-120 and 120-130 (the step's
    # record in it): one line inside the step, its heartbeats the view's until then
    assert [t.split("Iteration under way: ")[1] for t in under_way] == [
        "7000 tokens scheduled, 18.0 s so far"  # the heartbeat of 119 s, 18 s after 101 s
    ]
    assert all("Avg prompt throughput: 0.0 tokens/s" in t for t in under_way)
    assert "Iteration under way" not in texts[-1]  # the window the step ended in
    unsaid = Lines()
    sink = LogSink(emit=unsaid)
    send(sink, heartbeat(0, 99.0, running=3), record(0, 101.0, iteration=1))
    for second in range(102, 127):
        send(sink, heartbeat(0, second, running=3))  # step_tokens 0: not said
    assert unsaid.texts() and not any("under way" in t for t in unsaid.texts())


def test_several_engines_get_an_aggregated_line():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink, engine_index=0)
    assert len(lines.texts()) == 1  # engine 1 not seen yet
    lines.lines.clear()
    both = design_messages(0, start_s=110) + design_messages(1, start_s=110)
    feed(sink, in_arrival_order(both))
    texts = lines.texts()
    assert texts[0].startswith("Engine 000: Avg prompt throughput: 600.0 tokens/s")
    assert texts[1].startswith("Engine 001: Avg prompt throughput: 600.0 tokens/s")
    assert texts[2] == (
        "2 Engines Aggregated: Avg prompt throughput: 1200.0 tokens/s, Avg generation "
        "throughput: 154.4 tokens/s, Running: 10 reqs, Waiting: 0 reqs, GPU KV cache usage: "
        "11.7%, Prefix cache hit rate: 99.2%"
    )


def test_first_window_is_measured_from_when_the_engine_was_first_seen():
    lines = Lines()
    sink = LogSink(emit=lines)
    send(sink, heartbeat(0, 105.0, running=1))
    send(sink, record(0, 106.0, num_decode_tokens=50))
    send(sink, heartbeat(0, 110.5, running=1))
    assert "Avg generation throughput: 10.0 tokens/s" in lines.texts()[0]  # 50 tokens / 5 s


def test_per_iteration_lines_in_the_design_format():
    lines = Lines()
    sink = LogSink(emit=lines, log_iterations=True)
    fields = dict(
        num_prefill_reqs=0,
        num_prefill_tokens=0,
        num_decode_reqs=50,
        num_decode_tokens=50,
        num_kv_blocks_used=3500,
        num_kv_blocks_free=65459,
        num_kv_tokens=56000,
    )
    message = record(0, 100, iteration=188, **fields)
    message.elapsed_ns = 10_250_000
    send(sink, message)
    send(sink, record(2, 100, iteration=7, **fields))
    assert lines.texts() == [
        "Iteration(188): 0 context requests, 0 context tokens, 50 generation requests, "
        "50 generation tokens, iteration elapsed time: 10.25 ms, "
        "kv cache: 5.1% (3500/68959 blocks, 56000 tokens)",
        "Engine 002: Iteration(7): 0 context requests, 0 context tokens, 50 generation "
        "requests, 50 generation tokens, iteration elapsed time: 10.00 ms, "
        "kv cache: 5.1% (3500/68959 blocks, 56000 tokens)",
    ]
    assert LogSink(emit=lines).log_iterations is False


def test_stalled_and_dead_are_logged_once_each_and_a_dead_engine_goes_quiet():
    lines = Lines()
    sink = LogSink(emit=lines)
    ingest = Ingest([sink], dead_after_s=2.5, stall_after_s=5)
    ingest.on_message(heartbeat(0, 100, running=2, msg_seq=1), now_ns=100 * SECOND)
    ingest.on_message(record(0, 100.5, msg_seq=2), now_ns=int(100.5 * SECOND))
    for second in range(101, 112):  # heartbeats, work, but no iteration
        ingest.on_message(heartbeat(0, second, running=2, msg_seq=second - 98), second * SECOND)
        ingest.tick(second * SECOND + 1)
    for tenth in range(1, 100):
        ingest.tick(111 * SECOND + tenth * SECOND // 10)
    warnings = lines.texts(logging.WARNING)
    assert [text for text in warnings if "->" in text] == [
        "Engine 000: running -> stalled (0 waiting, 2 running, last iteration 1)",
        "Engine 000: running -> stalled (0 waiting, 2 running, last iteration 1)".replace(
            "running -> stalled", "stalled -> dead"
        ),
    ]
    # and the live findings, each with its action: the stall (closed when it died), the death
    stall, dead = [text for text in warnings if "->" not in text]
    assert stall.startswith("Engine 000: Engine stalled since ") and "py-spy dump" in stall
    assert "last_iteration stayed at 1 " in stall and "while up to 2 requests ran" in stall
    assert dead.startswith("Engine 000: Engine down since ") and "IterscopeEngineDown" in dead
    assert lines.texts(logging.INFO)[0] == "Engine 000: connected, running"
    before = len(lines.lines)
    sink.on_iteration(record(0, 130), ingest.engines[0].view)  # late, from the dead engine
    assert len(lines.lines) == before


@pytest.mark.parametrize(
    ("source", "dump"),
    [
        ("iterscope", "`py-spy dump --pid 4242`"),
        (
            "vllm-scheduler",
            "`py-spy dump --pid 4242`) and of its workers, its children (`pgrep -P 4242`)",
        ),
        (
            "vllm-stat-logger",
            "`py-spy dump --pid $(pgrep -P 4242 -f EngineCore)`), and of its workers",
        ),
    ],
)
def test_a_stall_says_which_process_to_dump_live_and_in_explain(source, dump, tmp_path):
    """vLLM's stat-logger plugin sends from the API server: the engine core that stalled is
    its child. The live sidecar (a replay through it) and explain say the same."""
    from telemetry.analysis.episodes import detect_episodes
    from telemetry.analysis.timeline import build_timelines
    from telemetry.sidecar.replay import replay
    from tests.scenarios import synthetic

    sim = synthetic.stalled()
    for message in sim.messages:
        if isinstance(message, Heartbeat):
            message.source, message.pid = source, 4242
    lines = Lines()
    replay(sim.write(tmp_path / "stalled.jsonl"), [LogSink(emit=lines)])
    (stall,) = [text for text in lines.texts(logging.WARNING) if "Engine stalled since" in text]
    assert dump in stall
    long_step = "The plugin cannot tell a hang from a long step"
    assert (long_step in stall) == (source == "vllm-stat-logger")
    (timeline,) = build_timelines(sim.messages).values()
    (episode,) = [e for e in detect_episodes(timeline) if e.kind == "stall"]
    assert dump in episode.setting


def test_a_death_ends_when_the_engine_is_heard_again_though_its_first_message_is_old():
    """A stopped engine's sender sends first what it queued before the stop: that record's
    delay is no clock difference, and the close line says the whole silence (it said 0.0 s)."""
    lines = Lines()
    ingest = Ingest([LogSink(emit=lines)], dead_after_s=2.5)
    seq = 0
    for second in range(100, 106):
        seq += 1
        ingest.on_message(heartbeat(0, second, running=1, msg_seq=seq), second * SECOND + 1000)
        seq += 1
        ingest.on_message(record(0, second + 0.5, seq, msg_seq=seq), int((second + 0.5) * SECOND))
        ingest.tick(int((second + 0.6) * SECOND))
    for tenth in range(61, 160):  # stopped from 105.6 s to 121 s: dead after 2.5 s
        ingest.tick(100 * SECOND + tenth * SECOND // 10)
    seq += 1
    queued = record(0, 105.55, seq, msg_seq=seq)  # made just before the stop, sent after it
    ingest.on_message(queued, 121 * SECOND)
    seq += 1
    ingest.on_message(heartbeat(0, 121, running=1, msg_seq=seq), 121 * SECOND + 1000)
    ended = [text for text in lines.texts(logging.INFO) if "Engine down: ended after" in text]
    assert len(ended) == 1 and ended[0].startswith("Engine 000: Engine down: ended after 15.5 s")
    assert "restarted" not in ended[0]  # the same process, resumed


def test_a_frozen_engine_that_resumes_is_down_then_running_not_stalled():
    """SIGSTOP for 10 s with requests running: the silence is the death's finding; when the
    engine is heard again its first message must not make it stalled since before the stop
    (the live log said "Engine stalled ... heartbeats continue" after the fact; explain, on
    the same recording, only the silence)."""
    lines = Lines()
    ingest = Ingest([LogSink(emit=lines)], dead_after_s=2.5)
    seq = 0
    for second in range(100, 106):
        seq += 1
        ingest.on_message(heartbeat(0, second, running=4, msg_seq=seq), second * SECOND)
        seq += 1
        ingest.on_message(
            record(0, second + 0.5, seq, msg_seq=seq, num_running_reqs=4, num_decode_reqs=4),
            int((second + 0.5) * SECOND),
        )
        ingest.tick(int((second + 0.6) * SECOND))
    for tenth in range(56, 156):  # stopped: dead after 2.5 s
        ingest.tick(100 * SECOND + tenth * SECOND // 10)
    seq += 1  # resumed: a heartbeat still at the iteration before the stop, then progress
    ingest.on_message(heartbeat(0, 115.6, running=4, msg_seq=seq), int(115.6 * SECOND))
    ingest.tick(int(115.61 * SECOND))
    seq += 1
    ingest.on_message(
        record(0, 115.7, seq, msg_seq=seq, num_running_reqs=4, num_decode_reqs=4),
        int(115.7 * SECOND),
    )
    texts = lines.texts()
    assert not [text for text in texts if "stalled" in text], texts
    assert "Engine 000: dead -> running" in texts


def test_a_death_that_ends_with_a_new_process_says_the_engine_restarted():
    """Live as explain ("restarted"): a new pid and seq from 1 after the silence."""
    lines = Lines()
    ingest = Ingest([LogSink(emit=lines)], dead_after_s=2.5)
    for seq, second in enumerate(range(100, 104), 1):
        beat = heartbeat(0, second, running=1, msg_seq=seq)
        beat.pid = 111
        ingest.on_message(beat, second * SECOND)
        ingest.tick(second * SECOND + 1)
    for tenth in range(31, 100):
        ingest.tick(100 * SECOND + tenth * SECOND // 10)
    beat = heartbeat(0, 110, running=0, msg_seq=1)
    beat.pid = 222
    ingest.on_message(beat, 110 * SECOND)
    (ended,) = [text for text in lines.texts(logging.INFO) if "Engine down: ended after" in text]
    assert ": the engine restarted (a new process), cost " in ended


def test_a_stall_names_the_last_iteration_that_scheduled_work():
    """An engine spinning on empty iterations (story 2's leak) is stalled at the last one
    that did something, not at the latest empty one."""
    lines = Lines()
    sink = LogSink(emit=lines)
    feed(sink, [heartbeat(0, 100, running=2), record(0, 100.5, iteration=7)])
    for iteration in range(8, 60):  # schedules nothing
        feed(
            sink,
            [
                record(
                    0,
                    101 + iteration / 100,
                    iteration=iteration,
                    num_prefill_reqs=0,
                    num_decode_reqs=0,
                    num_prefill_tokens=0,
                    num_decode_tokens=0,
                )
            ],
        )
    sink.on_status(0, EngineStatus.STALLED, 0)
    assert "last iteration 7)" in lines.texts(logging.WARNING)[0]


def test_losses_are_reported_at_most_once_per_interval():
    """Ingest counts them (the engine's view, the pipeline's health); the sink reports what
    is new since it last did."""
    lines = Lines()
    sink = LogSink(emit=lines, interval_s=10)
    health = health_of(sink)
    lose(sink, 3, 5)
    send(sink, heartbeat(3, 100.0))
    for reason in ("version", "malformed", "version"):
        health.num_undecodable[reason] += 1
    sink.tick(1 * SECOND)
    lose(sink, 3, 2)
    sink.tick(2 * SECOND)
    assert lines.texts(logging.WARNING) == [
        "Engine 003: 5 telemetry messages lost (sequence gaps), 5 in total",
        "Sidecar: 3 undecodable frames (malformed: 1, version: 2), 3 in total",
    ]
    sink.tick(11 * SECOND)
    assert lines.texts(logging.WARNING)[-1] == (
        "Engine 003: 2 telemetry messages lost (sequence gaps), 7 in total"
    )


def test_an_engine_index_conflict_is_an_error_line_at_most_once_per_interval():
    lines = Lines()
    sink = LogSink(emit=lines, interval_s=10)
    send(sink, heartbeat(0, 100.0))
    conflict(sink, 0, (100, 200))
    sink.tick(1 * SECOND)
    conflict(sink, 0, (100, 200))
    sink.tick(2 * SECOND)  # within the interval: not repeated yet
    expected = (
        "Engine 000: two engine processes (pids 100 and 200) publish as engine 0; its "
        "numbers mix both. Give each its own --engine-index"
    )
    assert lines.texts(logging.ERROR) == [expected]
    sink.tick(12 * SECOND)
    assert lines.texts(logging.ERROR) == [expected, expected]


def test_status_values_are_the_sink_contract():
    assert [status.value for status in EngineStatus] == [
        "idle",
        "running",
        "stalled",
        "dead",
        "closed",
    ]


def closed_engine_lines(running: int = 0, waiting: int = 0, stop_requested: bool = False):
    """The log of an engine that runs, then closes its lane with ``running`` and ``waiting``
    requests in flight, then stays silent for 10 s."""
    lines = Lines()
    ingest = Ingest([LogSink(emit=lines)], dead_after_s=2.5)
    ingest.on_message(heartbeat(0, 100, msg_seq=1), now_ns=100 * SECOND)
    ingest.on_message(
        record(0, 100.5, msg_seq=2, num_running_reqs=running), now_ns=int(100.5 * SECOND)
    )
    closing = lane_heartbeat(
        0,
        3,
        101 * SECOND,
        101 * SECOND,
        closing=True,
        stop_requested=stop_requested,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
    )
    ingest.on_message(closing, now_ns=101 * SECOND)
    for tenth in range(1, 100):
        ingest.tick(101 * SECOND + tenth * SECOND // 10)
    return lines


def test_a_clean_close_is_an_info_line_and_the_window_is_printed_at_once():
    """An engine that closed its lane with nothing in flight: "closed" at INFO, not "dead"
    at WARNING, and its last iterations' line comes now, as a dead engine's does."""
    lines = closed_engine_lines()
    assert lines.texts(logging.WARNING) == []
    assert [text for text in lines.texts(logging.INFO) if "->" in text] == [
        "Engine 000: running -> closed (it closed its telemetry lane with nothing in flight: a "
        "shutdown, not a death; last iteration 1)"
    ]
    assert any("Avg generation throughput" in text for text in lines.texts(logging.INFO))


def test_a_stop_that_cuts_requests_off_says_so_at_info():
    """vLLM told to stop under load closes its lane with requests in flight: "closed" at INFO,
    with what the shutdown cut off, not "dead" at WARNING."""
    lines = closed_engine_lines(running=3, waiting=1, stop_requested=True)
    assert lines.texts(logging.WARNING) == []
    assert [text for text in lines.texts(logging.INFO) if "->" in text] == [
        "Engine 000: running -> closed (it was told to stop and closed its telemetry lane with 3 "
        "running and 1 waiting, cut off by the shutdown: not a death; last iteration 1)"
    ]


def test_close_prints_the_open_window_so_every_record_is_in_a_line():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink)
    feed(
        sink,
        [record(0, 110.5 + step, iteration=11 + step, num_decode_tokens=40) for step in range(3)],
    )
    assert len(lines.texts()) == 1  # the second window is still open
    sink.close()
    assert len(lines.texts()) == 2
    # 120 generation tokens over the 2.5 s the window was open (110.0 .. 112.5)
    assert "Avg generation throughput: 48.0 tokens/s" in lines.texts()[1]


def test_the_connected_line_names_the_source_engine_version_and_pid():
    lines = Lines()
    ingest = Ingest([LogSink(emit=lines)])
    beat = lane_heartbeat(
        0, 1, 5, 6, source="vllm-scheduler", engine_version="vllm 0.29.0", pid=4242
    )
    ingest.on_message(beat, now_ns=SECOND)
    assert lines.texts(logging.INFO) == [
        "Engine 000: connected, idle (source vllm-scheduler, vllm 0.29.0, pid 4242)"
    ]


def test_idle_running_flips_are_debug_lines_other_transitions_stand_out():
    """Under light load an engine flips idle <-> running with every request: those lines
    would drown the throughput lines at INFO."""
    lines = Lines()
    sink = LogSink(emit=lines)
    for status in (
        EngineStatus.IDLE,
        EngineStatus.RUNNING,
        EngineStatus.IDLE,
        EngineStatus.RUNNING,
        EngineStatus.STALLED,
        EngineStatus.RUNNING,
        EngineStatus.DEAD,
        EngineStatus.IDLE,
    ):
        sink.on_status(0, status, 0)
    assert lines.texts(logging.INFO) == [
        "Engine 000: connected, idle",
        "Engine 000: stalled -> running",
        "Engine 000: dead -> idle",
    ]
    assert lines.texts(logging.DEBUG) == [
        "Engine 000: idle -> running",
        "Engine 000: running -> idle",
        "Engine 000: idle -> running",
    ]
    assert [text.split(" (")[0] for text in lines.texts(logging.WARNING)] == [
        "Engine 000: running -> stalled",
        "Engine 000: running -> dead",
    ]


def test_a_dead_engine_still_gets_the_line_of_its_last_iterations():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink)
    feed(sink, [record(0, 110.5, iteration=11, num_decode_tokens=40)])
    sink.on_status(0, EngineStatus.DEAD, 0)
    feed(sink, [heartbeat(1, 121.0)])  # another engine's clock closes the window
    # 40 tokens in the 0.5 s it was there (from the window's start to its last record)
    assert any(
        "Engine 000: Avg prompt throughput" in text and "80.0 tokens/s" in text
        for text in lines.texts()[1:]
    ), lines.texts()


def test_a_lone_engine_that_dies_gets_its_last_line_at_once():
    """No other engine moves the log clock: the line comes when the engine is declared
    dead, not when the sidecar exits."""
    lines = Lines()
    sink = LogSink(emit=lines)
    feed(sink, [heartbeat(0, 99.0), record(0, 105.5, num_decode_tokens=40, num_running_reqs=2)])
    assert lines.texts(logging.INFO) == []
    sink.on_status(0, EngineStatus.DEAD, 0)
    throughput = [text for text in lines.texts(logging.INFO) if "throughput" in text]
    # 40 tokens in the 5.5 s from the window's start to the last record: the window ends
    # where the engine's messages did, as a replay's does at its end
    assert len(throughput) == 1 and "Avg generation throughput: 7.3 tokens/s" in throughput[0]
    sink.close()  # nothing is printed twice
    assert len([text for text in lines.texts() if "throughput" in text]) == 1
    replayed = Lines()
    sink = LogSink(emit=replayed)
    feed(sink, [heartbeat(0, 99.0), record(0, 105.5, num_decode_tokens=40, num_running_reqs=2)])
    sink.close()
    assert [text for text in replayed.texts() if "throughput" in text] == throughput


def test_a_wall_clock_stepped_back_keeps_the_lines_coming():
    """NTP steps the clock back 60 s: lines go on from the new time, and a bogus far-future
    heartbeat cannot silence them for good."""
    lines = Lines()
    sink = LogSink(emit=lines)
    feed(sink, [heartbeat(0, 99.0)])
    for second in range(100, 130):
        feed(sink, [record(0, second + 0.5, num_decode_tokens=80)])
    assert len(lines.texts()) == 2  # the windows ending at 110 and 120
    feed(sink, [heartbeat(0, 2.0**62 / SECOND)])  # a bogus time
    for second in range(70, 100):  # then the clock is 60 s behind the highest time seen
        feed(sink, [heartbeat(0, second + 0.1), record(0, second + 0.5, num_decode_tokens=80)])
    throughput = [text for text in lines.texts() if "throughput" in text]
    assert len(throughput) >= 5
    assert all(
        "Avg generation throughput: 80.0 tokens/s" in text
        for text in throughput[:2] + throughput[3:]
    )


DESIGN_LINE = (
    "Engine 000: Avg prompt throughput: 600.0 tokens/s, Avg generation throughput: "
    "77.2 tokens/s, Running: 5 reqs, Waiting: 0 reqs, GPU KV cache usage: 11.7%, "
    "Prefix cache hit rate: 99.2%"
)


def with_drafts(messages, *per_record_pos):
    """The design window's messages, the first records scoring 6 drafts of 3 tokens each,
    accepted by position as given (one list per record); the other records score none."""
    records = [m for m in messages if not isinstance(m, Heartbeat)]
    for message, per_pos in zip(records[: len(per_record_pos)], per_record_pos, strict=True):
        message.spec_decode = SpecDecodeCounts(6, 18, sum(per_pos), list(per_pos))
    return messages


def test_a_window_that_scored_drafts_gets_vllms_spec_decoding_line_after_its_own():
    """8 records of 6 drafts (48 drafts, 144 draft tokens), 32, 24 and 24 tokens accepted by
    position, 2 records without drafts, in a 10 s window: vLLM's figures and words."""
    lines = Lines()
    sink = LogSink(emit=lines)
    feed(sink, with_drafts(design_messages(), *[[4, 3, 3]] * 8))
    assert lines.texts(logging.INFO) == [
        DESIGN_LINE,
        "Engine 000: SpecDecoding metrics: Mean acceptance length: 2.67, Accepted throughput: "
        "8.00 tokens/s, Drafted throughput: 14.40 tokens/s, Accepted: 80 tokens, Drafted: 144 "
        "tokens, Per-position acceptance rate: 0.667, 0.500, 0.500, Avg Draft acceptance rate: "
        "55.6%",
    ]


def test_a_window_without_drafts_gets_no_spec_decoding_line():
    """The next window counts its own drafts only: none, so no line, though the engine's
    totals hold the drafts of the window before."""
    lines = Lines()
    sink = LogSink(emit=lines)
    feed(sink, with_drafts(design_messages(start_s=100.0), [6, 6, 6]))
    assert len(lines.texts()) == 2
    lines.lines.clear()
    feed(sink, design_messages(start_s=110.0))
    assert lines.texts() == [DESIGN_LINE]
    lines.lines.clear()
    feed(sink, with_drafts(design_messages(start_s=120.0), [6, 0, 0], [0, 0, 0]))
    assert lines.texts()[1] == (
        "Engine 000: SpecDecoding metrics: Mean acceptance length: 1.50, Accepted throughput: "
        "0.60 tokens/s, Drafted throughput: 3.60 tokens/s, Accepted: 6 tokens, Drafted: 36 "
        "tokens, Per-position acceptance rate: 0.500, 0.000, 0.000, Avg Draft acceptance rate: "
        "16.7%"
    )


def test_each_engine_has_its_spec_decoding_line_under_its_own_and_none_is_aggregated():
    lines = Lines()
    sink = LogSink(emit=lines)
    design_window(sink, engine_index=0)
    lines.lines.clear()
    both = with_drafts(design_messages(0, start_s=110), [3, 2, 1]) + design_messages(1, start_s=110)
    feed(sink, in_arrival_order(both))
    labels = [text.split(": Avg")[0].split(": Spec")[0] for text in lines.texts()]
    assert labels == ["Engine 000", "Engine 000", "Engine 001", "2 Engines Aggregated"]
    assert lines.texts()[1].startswith("Engine 000: SpecDecoding metrics: Mean acceptance length:")


def test_spec_decoding_lines_add_up_to_the_prometheus_counters_through_ingest():
    """Encoded frames through Ingest into both sinks: the drafted and accepted tokens of every
    window's line sum to the counters, and the window without drafts prints no such line."""
    rng = random.Random(3)
    lines = Lines()
    log_sink = LogSink(emit=lines)
    registry = CollectorRegistry()
    ingest = Ingest([log_sink, PrometheusSink(registry)], dead_after_s=2.5, stall_after_s=5)
    encode = make_encoder().encode
    start_s = CLOCK_OFFSET_NS // SECOND + 100  # monotonic 100 s, a window boundary
    seq = 0
    for second in range(40):
        seq += 1
        message = heartbeat(0, start_s + second, running=8, msg_seq=seq)
        ingest.on_frame(encode(message), second * SECOND)
        for tenth in range(10):
            seq += 1
            message = record(0, start_s + second + 0.05 + tenth / 10, iteration=seq, msg_seq=seq)
            if 10 <= second < 20 or rng.random() < 0.3:  # the second window: no drafts at all
                message.spec_decode = None
            else:
                per_pos = sorted((rng.randint(0, 4) for _ in range(3)), reverse=True)
                message.spec_decode = SpecDecodeCounts(4, 12, sum(per_pos), per_pos)
            ingest.on_frame(encode(message), int((second + 0.06 + tenth / 10) * SECOND))
    log_sink.close()
    window_lines = [text for text in lines.texts() if "throughput" in text]  # not status
    is_spec = [" SpecDecoding metrics: " in text for text in window_lines]
    assert is_spec == [False, True, False, False, True, False, True]  # 4 windows, 3 drafted
    shown = [
        re.search(r"Accepted: (\d+) tokens, Drafted: (\d+) tokens", text)
        for text, spec in zip(window_lines, is_spec, strict=True)
        if spec
    ]
    counters = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name.startswith("iterscope_spec_decode") and "position" not in sample.labels
    }
    assert counters["iterscope_spec_decode_drafts_total"] > 0
    accepted = sum(int(match[1]) for match in shown)
    assert accepted == counters["iterscope_spec_decode_accepted_tokens_total"]
    drafted = sum(int(match[2]) for match in shown)
    assert drafted == counters["iterscope_spec_decode_draft_tokens_total"]
