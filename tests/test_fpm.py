"""Forward-pass metrics (FPM) ingest: decoding the frames, the mapping to records, and the
per-producer numbering that feeds a real Ingest (telemetry/sources/fpm.py,
telemetry/sidecar/fpm_engines.py)."""

from __future__ import annotations

import math

import msgspec
import pytest
import zmq

from telemetry.lane.record import (
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_BLOCKS,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_MILESTONES,
    UNKNOWN_PREEMPTIONS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    Heartbeat,
    IterationRecord,
)
from telemetry.sidecar.engine_tracker import MAX_SEQ_JUMP
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.fpm_engines import FpmEngines
from telemetry.sidecar.fpm_socket import FpmSubscriber
from telemetry.sidecar.ingest import Ingest
from telemetry.sources.fpm import decode_frames, is_heartbeat, to_record
from tests.helpers.fpm import busy_frames, fpm_frames, idle_frames
from tests.helpers.wait import wait_until

S = 1_000_000_000
WALL_NS = 1_700_000_000 * S


class Captured:
    """A sink keeping every message it is handed (the sink interface's do-nothing defaults
    for the rest)."""

    def __init__(self):
        from telemetry.sidecar.sink import Sink

        self.sink = type("CaptureSink", (Sink,), {})()
        self.messages: list = []
        self.sink.on_iteration = lambda record, view: self.messages.append(record)
        self.sink.on_heartbeat = lambda heartbeat, view: self.messages.append(heartbeat)


def decoded(frames):
    result = decode_frames(frames)
    assert not isinstance(result, str), result
    return result


def feed(max_engines: int = 64, **engine_args):
    """A real Ingest with a capturing sink, and the FpmEngines feeding it."""
    captured = Captured()
    ingest = Ingest([captured.sink], dead_after_s=5.0, max_engines=max_engines, live_findings=False)
    engines = FpmEngines(ingest, wall_clock=lambda: WALL_NS, **engine_args)
    return ingest, engines, captured.messages


def test_a_busy_message_maps_to_a_record_of_its_batch_and_queues():
    seq, message = decoded(busy_frames(41, wall_time=0.025))
    assert seq == 41 and not is_heartbeat(message)
    record = to_record(message, engine_index=3, msg_seq=7, iteration=5, received_ns=10 * S)
    assert (record.engine_index, record.msg_seq, record.iteration) == (3, 7, 5)
    assert (record.num_prefill_reqs, record.num_prefill_tokens) == (1, 128)
    assert (record.num_decode_reqs, record.num_decode_tokens) == (6, 6)
    assert record.num_running_reqs == 7  # the batch
    assert record.num_waiting_reqs == 4  # 3 prefills + 1 decode queued
    assert record.num_kv_tokens == 32 + 128 + 600
    assert record.elapsed_ns == 25_000_000
    assert record.start_ns == 10 * S - 25_000_000  # it ended when it was received
    assert record.milestones == [] and record.num_preemptions == 0


def test_fields_fpm_does_not_carry_are_unknown_and_the_rest_known():
    record = to_record(decoded(busy_frames(0))[1], 0, 1, 1, S)
    unknown = (UNKNOWN_WAITING_REASONS, UNKNOWN_KV_BLOCKS, UNKNOWN_PREEMPTIONS, UNKNOWN_MILESTONES)
    for bit in unknown:
        assert record.unknown & bit
    for bit in (UNKNOWN_PREFILL_REQS, UNKNOWN_ELAPSED, UNKNOWN_KV_TOKENS):
        assert not record.unknown & bit


def test_wall_time_is_the_models_time_only_for_producers_that_measure_gpu_time():
    message = decoded(busy_frames(0, wall_time=0.01))[1]
    assert to_record(message, 0, 1, 1, S, producer="sglang").model_elapsed_ns == 10_000_000
    assert to_record(message, 0, 1, 1, S, producer="vllm").model_elapsed_ns == 10_000_000
    assert to_record(message, 0, 1, 1, S, producer="dynamo-vllm").model_elapsed_ns == 0
    assert to_record(message, 0, 1, 1, S).model_elapsed_ns == 0


def test_an_all_zero_message_is_a_heartbeat_and_any_count_makes_it_an_iteration():
    assert is_heartbeat(decoded(idle_frames(3))[1])
    assert not is_heartbeat(decoded(fpm_frames(3, queued={"num_prefill_requests": 1}))[1])
    assert not is_heartbeat(decoded(fpm_frames(3, scheduled={"sum_decode_kv_tokens": 9}))[1])


def test_unknown_fields_are_ignored_at_every_level():
    frames = fpm_frames(
        1,
        scheduled={"num_decode_requests": 2, "sum_decode_kv_tokens_prefix_cached": 5},
        queued={"something_new": [1, 2]},
        new_top_level={"a": 1},
    )
    assert decoded(frames)[1].scheduled_requests.num_decode_requests == 2


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        (fpm_frames(1, version=2), "version"),
        (
            [b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"version": 2, "wall_time": "x"})],
            "version",
        ),
        ([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"worker_id": "w"})], "malformed"),
        (fpm_frames(1)[1:], "malformed"),  # two frames
        ([*fpm_frames(1), b""], "malformed"),  # four
        ([b"", b"\x00" * 7, fpm_frames(1)[2]], "malformed"),  # a 7-byte seq
        ([b"", (1).to_bytes(8, "big"), b"\xc1garbage"], "malformed"),  # not msgpack
        ([b"", (1).to_bytes(8, "big"), fpm_frames(1)[2][:20]], "truncated"),
        ([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1, "w", 0])], "malformed"),
        (fpm_frames(1, scheduled={"num_decode_requests": -1}), "malformed"),
        (fpm_frames(1, wall_time=math.nan), "malformed"),
        (fpm_frames(1, wall_time=-0.5), "malformed"),
        ([b"", (1).to_bytes(8, "big"), b"\x00" * (1 << 17)], "oversized"),
    ],
)
def test_bad_frames_are_refused_with_a_reason(frames, reason):
    assert decode_frames(frames) == reason


def test_a_first_record_is_introduced_by_a_synthesized_heartbeat_with_the_facts():
    ingest, engines, messages = feed(model_name="qwen3-8b", producer="sglang")
    engines.on_frames(busy_frames(12), 5 * S)  # first seq seen 12: the rest was never ours
    assert [type(m) for m in messages] == [Heartbeat, IterationRecord]
    assert [m.msg_seq for m in messages] == [1, 2]
    view = ingest.engines[0].view
    assert (view.model_name, view.source) == ("qwen3-8b", "fpm-sglang")
    assert view.num_dropped_total == 0
    assert view.clock_offset_ns == WALL_NS - 5 * S
    assert view.totals.num_prefill_tokens == 128


def test_the_worker_id_names_the_model_when_no_flag_does():
    ingest, engines, _ = feed()
    engines.on_frames(idle_frames(0, worker_id="decode-7"), S)
    assert (ingest.engines[0].view.model_name, ingest.engines[0].view.source) == (
        "decode-7",
        "fpm",
    )


def test_each_worker_and_dp_rank_is_an_engine_numbered_in_the_order_met():
    ingest, engines, _ = feed()
    for worker, rank in [("b", 0), ("a", 1), ("a", 0), ("b", 0)]:
        engines.on_frames(busy_frames(0, worker_id=worker, dp_rank=rank), S)
    names = {i: state.view.model_name for i, state in ingest.engines.items()}
    assert names == {0: "b", 1: "a", 2: "a"}
    assert engines.num_producers == 3


def test_an_idle_producers_heartbeats_keep_it_idle_and_silence_makes_it_dead():
    ingest, engines, messages = feed()
    for seq in range(3):
        engines.on_frames(idle_frames(seq), seq * S)
    assert all(type(m) is Heartbeat for m in messages) and len(messages) == 3
    ingest.tick(3 * S)
    assert ingest.engines[0].view.status is EngineStatus.IDLE
    ingest.tick(8 * S)  # 6 s after the last message, dead after 5
    assert ingest.engines[0].view.status is EngineStatus.DEAD


def test_a_seq_gap_is_counted_as_lost_by_ingest_exactly_once():
    ingest, engines, messages = feed()
    engines.on_frames(busy_frames(5), S)
    engines.on_frames(busy_frames(6), 2 * S)
    engines.on_frames(busy_frames(10), 3 * S)  # 7, 8, 9 lost
    engines.on_frames(busy_frames(11), 4 * S)
    view = ingest.engines[0].view
    assert view.num_dropped_total == 3
    assert [m.msg_seq for m in messages] == [1, 2, 3, 7, 8]
    assert ingest.health.num_rejected_total == 0


def test_a_seq_that_goes_back_is_a_restart_not_two_to_the_64_lost():
    ingest, engines, messages = feed()
    for seq in range(1000, 1004):
        engines.on_frames(busy_frames(seq), seq * S)
    engines.on_frames(busy_frames(0), 2000 * S)  # the producer restarted
    engines.on_frames(busy_frames(1), 2001 * S)
    view = ingest.engines[0].view
    assert view.num_dropped_total == 0
    assert [type(m) for m in messages[-3:]] == [Heartbeat, IterationRecord, IterationRecord]
    assert [m.msg_seq for m in messages[-3:]] == [1, 2, 3]
    assert view.last_iteration == messages[-1].iteration  # progress counted from the restart
    assert ingest.health.num_rejected_total == 0


def test_a_forged_huge_seq_is_rejected_and_the_real_stream_goes_on_unharmed():
    ingest, engines, messages = feed()
    engines.on_frames(busy_frames(0), S)
    engines.on_frames(busy_frames(2**64 - 1), 2 * S)
    engines.on_frames(busy_frames(1 + MAX_SEQ_JUMP + 1), 2 * S)  # just beyond the bound
    assert ingest.health.num_rejected["seq_jump"] == 2
    engines.on_frames(busy_frames(1), 3 * S)
    assert ingest.engines[0].view.num_dropped_total == 0
    assert [m.msg_seq for m in messages] == [1, 2, 3]


def test_a_gap_at_the_bound_is_believed_and_counted():
    ingest, engines, _ = feed()
    engines.on_frames(busy_frames(0), S)
    engines.on_frames(busy_frames(1 + MAX_SEQ_JUMP), 2 * S)
    assert ingest.engines[0].view.num_dropped_total == MAX_SEQ_JUMP
    assert ingest.health.num_rejected_total == 0


def test_bad_frames_are_counted_by_reason_and_ingest_goes_on():
    ingest, engines, messages = feed()
    engines.on_frames(fpm_frames(0, version=3), S)
    engines.on_frames([b"junk"], S)
    engines.on_frames(busy_frames(1), S)
    assert ingest.health.num_undecodable["version"] == 1
    assert ingest.health.num_undecodable["malformed"] == 1
    assert [type(m) for m in messages] == [Heartbeat, IterationRecord]


def test_a_thousand_worker_ids_are_bounded_by_max_engines():
    ingest, engines, _ = feed(max_engines=8)
    for worker in range(1000):
        engines.on_frames(busy_frames(0, worker_id=f"w{worker}"), S)
        engines.on_frames(busy_frames(1, worker_id=f"w{worker}"), S)
    assert sorted(ingest.engines) == list(range(8))
    assert engines.num_producers == 8
    assert ingest.health.num_rejected["engine_limit"] == 2 * (1000 - 8)
    assert ingest.health.num_rejected["unknown_engine"] == 0
    assert ingest.engines[7].view.totals.num_iterations == 2


def test_a_producer_ingest_let_go_is_met_again_with_a_fresh_numbering():
    ingest, engines, messages = feed(max_engines=1)
    engines.on_frames(busy_frames(0, worker_id="old"), S)
    ingest.tick(400 * S)  # dead for longer than --evict-after: its place may be taken
    engines.on_frames(busy_frames(0, worker_id="new"), 400 * S)
    assert [s.view.model_name for s in ingest.engines.values()] == ["new"]
    engines.on_frames(busy_frames(5, worker_id="new"), 401 * S)
    assert engines.num_producers == 1
    assert ingest.engines[1].view.num_dropped_total == 4


def test_the_sidecar_refuses_an_fpm_endpoint_it_cannot_subscribe_to(tmp_path, capsys):
    from telemetry.sidecar.cli import main

    lane = f"ipc://{tmp_path / 'lane'}"
    argv = ["--address", lane, "--no-metrics", "--no-log", "--fpm", "http://127.0.0.1:1"]
    assert main(argv) == 2
    assert "ipc://PATH or tcp://HOST:PORT" in capsys.readouterr().err
    assert main(["--replay", str(tmp_path / "r.jsonl"), "--fpm", "tcp://127.0.0.1:1"]) == 2
    assert "cannot go with --replay" in capsys.readouterr().err


def test_requests_queued_with_nothing_scheduled_make_the_engine_stalled():
    captured = Captured()
    ingest = Ingest([captured.sink], dead_after_s=5.0, stall_after_s=2.0, live_findings=False)
    engines = FpmEngines(ingest, wall_clock=lambda: WALL_NS)
    engines.on_frames(busy_frames(0), S)
    for seq in range(1, 5):  # one a second: alive, work queued, no token scheduled
        engines.on_frames(fpm_frames(seq, queued={"num_prefill_requests": 2}), (1 + seq) * S)
        ingest.tick((1 + seq) * S)
    assert ingest.engines[0].view.status is EngineStatus.STALLED


def test_what_fpm_does_not_report_is_said_so_not_shown_as_zero(tmp_path):
    """KV blocks, preemptions and the prefix cache: absent from /metrics, "not reported" in
    the log line and in explain's summary, never 0% or 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    from telemetry.analysis.summary import format_summary, summarize
    from telemetry.analysis.timeline import read_timelines
    from telemetry.sidecar.sinks.jsonl import JsonlSink
    from telemetry.sidecar.sinks.prometheus import PrometheusSink
    from telemetry.sidecar.sinks.throughput_line import engine_figures, format_engine_line

    prometheus = PrometheusSink(CollectorRegistry())
    recording = JsonlSink(str(tmp_path / "rec.jsonl"))
    ingest = Ingest([prometheus, recording], live_findings=False)
    engines = FpmEngines(ingest, wall_clock=lambda: WALL_NS, producer="sglang")
    for seq in range(5):
        engines.on_frames(busy_frames(seq), (seq + 1) * S)
    ingest.close()
    text = generate_latest(prometheus.registry).decode()
    for name in (
        "kv_cache_usage_ratio",
        "kv_blocks_used",
        "preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ):
        assert f"iterscope_{name}{{" not in text, name
    assert 'iterscope_iterations_total{engine="0"' in text
    view = ingest.engines[0].view
    line = format_engine_line(engine_figures(view, view.totals, 10.0))
    assert "KV cache usage: not reported, Prefix cache hit rate: not reported" in line
    (timeline,) = read_timelines([tmp_path / "rec.jsonl"])[0].values()
    summary_text = "\n".join(format_summary(summarize(timeline)))
    assert (
        "KV cache: not reported by the source; preemptions not reported; "
        "prefix cache hit rate not reported"
    ) in summary_text


def test_every_fpm_message_counts_as_a_frame_decodable_or_not():
    ingest, engines, _ = feed()
    engines.on_frames(busy_frames(0), S)
    engines.on_frames([b"", b"\x00" * 8, b"not msgpack"], S)
    assert ingest.health.num_frames == 2 and ingest.health.num_undecodable_total == 1


def test_data_parallel_ranks_are_consecutive_ports_of_tcp_endpoints(tmp_path, capsys):
    from telemetry.sidecar.cli import main
    from telemetry.sidecar.fpm_socket import endpoints_by_rank

    assert endpoints_by_rank(["tcp://h:5557", "tcp://[::1]:6000"], 2) == [
        "tcp://h:5557",
        "tcp://h:5558",
        "tcp://[::1]:6000",
        "tcp://[::1]:6001",
    ]
    assert endpoints_by_rank(["ipc:///x"], 1) == ["ipc:///x"]
    for endpoints, ranks, words in (
        (["ipc:///x"], 2, "needs tcp://HOST:PORT"),
        (["tcp://h:65535"], 2, "past port 65535"),
        (["tcp://h:1"], 0, "at least 1"),
    ):
        with pytest.raises(ValueError, match=words):
            endpoints_by_rank(endpoints, ranks)
    lane = f"ipc://{tmp_path / 'lane'}"
    argv = ["--address", lane, "--no-metrics", "--no-log", "--fpm", "ipc:///x"]
    assert main([*argv, "--fpm-dp-ranks", "4"]) == 2
    assert "needs tcp://HOST:PORT" in capsys.readouterr().err


def test_messages_of_any_frame_count_are_received_whole_over_a_real_socket(tmp_path):
    """The subscriber reads each message's frames by their own more flag: one of 1 frame and
    one of 5 are refused whole, and the message after them is read from its first frame."""
    ingest, engines, messages = feed()

    def record_after(subscriber) -> bool:
        subscriber.receive_batch(S)
        return type(messages[-1]) is IterationRecord

    endpoint = f"ipc://{tmp_path / 'fpm.sock'}"
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    subscriber = FpmSubscriber([endpoint], engines, context)
    try:
        wait_until(
            lambda: publisher.send_multipart(idle_frames(0)) or subscriber.receive_batch(S),
            10,
            "the subscription to join",
        )
        publisher.send_multipart([b"junk"])
        publisher.send_multipart([b"", b"1" * 8, b"a", b"b", b"c"])
        publisher.send_multipart(busy_frames(1))
        wait_until(lambda: record_after(subscriber), 10, "the record after the bad frames")
    finally:
        subscriber.close()
        publisher.close(linger=0)
        context.term()
    assert ingest.health.num_undecodable["malformed"] == 2
    assert type(messages[-1]) is IterationRecord and messages[-1].num_prefill_tokens == 128


GARBAGE_SHAPES = [
    [b""],
    [b"", b""],
    [b"", b"", b""],
    [b"", b"\x00" * 8],
    [b"", b"\x00" * 8, b""],
    [b"", b"\x00" * 8, b"", b""],
    [b"", b"\x00" * 8, b"", b"\x00" * 8],
    [b"", b"\x00" * 8, b"not a map", b"x"],
    [b"", b"junk"],
    [b"junk"],
    [b"\x00" * 8],
    [b"junk", b"\x00" * 8, b"not a map"],
]


def test_every_well_formed_message_is_read_whole_after_any_malformed_one(tmp_path):
    """The subscriber reads copies without each frame's more flag (fpm_socket.receive_frames):
    messages of every wrong shape, each before a well-formed one, in a seeded random order;
    every well-formed message arrives (consecutive seqs: none counted lost) and every
    malformed one is refused."""
    import random

    ingest, engines, messages = feed()
    endpoint = f"ipc://{tmp_path / 'fpm.sock'}"
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    subscriber = FpmSubscriber([endpoint], engines, context)
    shapes = GARBAGE_SHAPES * 4
    random.Random(29).shuffle(shapes)
    try:
        wait_until(
            lambda: publisher.send_multipart(idle_frames(0)) or subscriber.receive_batch(S),
            10,
            "the subscription to join",
        )
        first_seq = 1_000
        for number, shape in enumerate(shapes):
            publisher.send_multipart(shape)
            publisher.send_multipart(busy_frames(first_seq + number))
        records = lambda: [m for m in messages if type(m) is IterationRecord]  # noqa: E731
        wait_until(
            lambda: subscriber.receive_batch(S) * 0 or len(records()) >= len(shapes),
            10,
            "every well-formed message",
        )
    finally:
        subscriber.close()
        publisher.close(linger=0)
        context.term()
    assert len(records()) == len(shapes)
    assert all(record.num_prefill_tokens == 128 for record in records())
    seqs = [record.msg_seq for record in records()]
    assert seqs == list(range(seqs[0], seqs[0] + len(shapes)))  # none lost between them
    assert ingest.engines[0].view.num_dropped_total == first_seq - 1  # before the first only
    num_refused = ingest.health.num_undecodable["malformed"]
    assert len(shapes) <= num_refused <= 2 * len(shapes)


def test_a_heartbeat_says_idle_only_from_a_producer_that_heartbeats_only_while_idle():
    """SGLang heartbeats only while idle; Dynamo's thread after any second without a message,
    busy or not, so its heartbeat keeps what the last iteration left queued (busy_frames
    leaves 3 prefills and 1 decode), and a restart forgets it."""
    waiting = {}
    for producer in ("sglang", "dynamo-vllm", "unknown"):
        _, engines, messages = feed(producer=producer)
        engines.on_frames(busy_frames(0), S)
        engines.on_frames(idle_frames(1), 2 * S)
        assert type(messages[-1]) is Heartbeat
        waiting[producer] = messages[-1].num_waiting_reqs
        engines.on_frames(idle_frames(0), 3 * S)  # restarted: nothing of the last process
        assert messages[-1].num_waiting_reqs == 0 and messages[-1].msg_seq == 1
    assert waiting == {"sglang": 0, "dynamo-vllm": 4, "unknown": 4}


def test_a_spinning_fpm_engine_says_kv_usage_and_reasons_are_not_reported():
    """Requests queued and nothing scheduled: the stall's evidence says FPM reports neither why
    they wait nor KV usage, never a measured 0% (docs/fpm.md, What is unknown)."""
    from telemetry.analysis.episodes import detect_episodes
    from telemetry.analysis.timeline import build_timelines

    _, engines, messages = feed(producer="sglang")
    engines.on_frames(busy_frames(0), S)
    for seq in range(1, 13):
        engines.on_frames(fpm_frames(seq, queued={"num_prefill_requests": 2}), (1 + seq) * S)
    timeline = build_timelines(messages)[0]
    (spinning,) = [e for e in detect_episodes(timeline) if e.title.startswith("Engine spinning")]
    assert spinning.evidence.endswith(
        "waiting by reason at the end: not reported by the source (fpm-sglang); "
        "KV usage not reported"
    )
    assert "%" not in spinning.evidence
    assert "kv_leak cannot be found here" in spinning.setting
