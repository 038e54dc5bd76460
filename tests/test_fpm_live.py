"""A real `iterscope sidecar --fpm` process subscribed to a pyzmq PUB socket that publishes
hand-built FPM frames as SGLang does: /metrics, engine status from heartbeats and silence,
losses from seq gaps, and the recording read back by `iterscope explain`."""

from __future__ import annotations

import msgspec
import zmq

from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.lane.recording import Line  # the sidecar's notes too
from telemetry.sidecar.process import start_sidecar
from tests.helpers.fpm import busy_frames, idle_frames
from tests.helpers.processes import explain_engines
from tests.helpers.prom import scrape, total
from tests.helpers.wait import wait_until


def engine_state(url: str, state: str) -> float:
    return total(scrape(url), "iterscope_engine_state", engine="0", state=state)


def test_an_fpm_producer_becomes_an_engine_in_metrics_and_the_recording(tmp_path):
    endpoint = f"ipc://{tmp_path / 'fpm.sock'}"
    recording = tmp_path / "run.jsonl"
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    args = ["--fpm", endpoint, "--fpm-model", "qwen-fpm", "--fpm-producer", "sglang"]
    args += ["--record", str(recording), "--metrics-port", "0", "--no-log", "--dead-after", "2"]
    with open(tmp_path / "sidecar.log", "wb") as log:
        sidecar = start_sidecar(args, stderr=log)
    seq = 0

    def publish(frames_of) -> None:
        nonlocal seq
        publisher.send_multipart(frames_of(seq, worker_id="sglang-0"))
        seq += 1

    try:
        url = sidecar.metrics_url
        # PUB/SUB: what is published before the subscription is up is lost, so heartbeat
        # until the engine shows, as a producer does while idle.
        wait_until(
            lambda: publish(idle_frames) or engine_state(url, "idle") == 1,
            30,
            "the FPM engine to appear idle",
            interval_s=0.2,
        )
        for _ in range(20):
            publish(busy_frames)
        seq += 5  # five messages the sidecar never sees
        for _ in range(10):
            publish(busy_frames)
        samples = wait_until(
            lambda: (s := scrape(url)) and total(s, "iterscope_iterations_total") == 30 and s,
            10,
            "30 iterations in /metrics",
        )
        assert total(samples, "iterscope_requests_waiting", engine="0") == 4
        assert total(samples, "iterscope_records_dropped_total", engine="0") == 5
        assert total(samples, "iterscope_prompt_tokens_total", engine="0") == 30 * 128
        assert total(samples, "iterscope_engine_state", engine="0", state="running") == 1
        assert total(samples, "iterscope_fpm_decode_kv_tokens", engine="0") == 600
        assert total(samples, "iterscope_fpm_decode_kv_tokens_variance", engine="0") == 25.0
        assert total(samples, "iterscope_fpm_queued_prefill_tokens", engine="0") == 900
        wait_until(
            lambda: publish(idle_frames) or engine_state(url, "idle") == 1,
            10,
            "the engine idle again on heartbeats",
            interval_s=0.2,
        )
        publisher.close(linger=0)  # the producer goes away: silence
        wait_until(lambda: engine_state(url, "dead") == 1, 10, "the engine dead", interval_s=0.2)
    finally:
        publisher.close(linger=0)
        context.term()
        assert sidecar.stop() == 0
    messages = [msgspec.json.decode(line, type=Line) for line in recording.read_text().splitlines()]
    records = [m for m in messages if type(m) is IterationRecord]
    heartbeats = [m for m in messages if type(m) is Heartbeat]
    assert len(records) == 30
    assert {(r.fpm.num_decode_kv_tokens, r.fpm.num_queued_prefill_tokens) for r in records} == {
        (600, 900)
    }
    assert heartbeats[0].msg_seq == 1 and heartbeats[0].source == "fpm-sglang"
    assert {h.model_name for h in heartbeats} == {"qwen-fpm"}
    (engine,) = explain_engines(recording)
    assert engine["facts"] == {"model_name": "qwen-fpm", "source": "fpm-sglang"}
    assert engine["summary"]["num_iterations"] == 30
    assert engine["summary"]["num_context_tokens"] == 30 * 128
    assert engine["summary"]["max_waiting_reqs"] == 4
    (gap,) = [f for f in engine["findings"] if f["kind"] == "telemetry_gap"]
    assert gap["worst"]["numbers"]["num_lost"] == 5


def test_one_endpoint_per_data_parallel_rank_from_one_flag(tmp_path):
    """--fpm-dp-ranks 2: tcp://HOST:PORT and PORT+1, one producer bound on each."""
    from tests.helpers.net import free_port

    context = zmq.Context()
    while True:  # two free ports in a row
        port = free_port()
        publishers = []
        try:
            for rank in range(2):
                publishers.append(context.socket(zmq.PUB))
                publishers[-1].bind(f"tcp://127.0.0.1:{port + rank}")
            break
        except zmq.ZMQError:
            for socket in publishers:
                socket.close(linger=0)
    args = ["--fpm", f"tcp://127.0.0.1:{port}", "--fpm-dp-ranks", "2"]
    args += ["--metrics-port", "0", "--no-log"]
    with open(tmp_path / "sidecar.log", "wb") as log:
        sidecar = start_sidecar(args, stderr=log)
    seqs = [0, 0]

    def both_seen() -> bool:
        for rank, publisher in enumerate(publishers):
            publisher.send_multipart(idle_frames(seqs[rank], worker_id="w", dp_rank=rank))
            seqs[rank] += 1
        samples = scrape(sidecar.metrics_url)
        return all(
            total(samples, "iterscope_engine_state", engine=str(i), state="idle") == 1
            for i in range(2)
        )

    try:
        wait_until(both_seen, 30, "an engine per data-parallel rank", interval_s=0.2)
    finally:
        sidecar.stop()
        for socket in publishers:
            socket.close(linger=0)
        context.term()
