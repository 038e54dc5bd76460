"""Dynamo's FPM recordings read by `iterscope explain` and `tune` (telemetry/sources/fpm_taps.py),
and `tune` on a recording made by the sidecar's FPM ingest.

The files under tests/data/dynamo_fpm were written by Dynamo's own recorders (ai-dynamo 1.6.1:
recv_forward_pass_metrics' receive loop for recv.jsonl, the Rust --fpm-trace sink for the
segments, full and sampled every 100 ms) from the workload of
tests/helpers/dynamo_fpm_recorder.py; tests/test_fpm_taps_live.py writes them again with the
wheels and checks they still read the same."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from telemetry.analysis import explain, tune
from telemetry.analysis.timeline import read_timelines
from telemetry.lane.record import Heartbeat
from telemetry.sidecar import explain_command
from telemetry.sidecar.fpm_engines import FpmEngines
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.sinks.jsonl import JsonlSink
from telemetry.sources.fpm_taps import read_tap
from tests.helpers import REPO
from tests.helpers.dynamo_fpm_recorder import BASE_S, DECODE_REQ_S, NUM_BUSY, PREFILL_TOKEN_S
from tests.helpers.fpm import fpm_frames

DATA = REPO / "tests" / "data" / "dynamo_fpm"
RECEIVED = DATA / "recv.jsonl"
FULL = next((DATA / "full").glob("*.jsonl.gz"))
SAMPLED = next((DATA / "sampled").glob("*.jsonl.gz"))
NUM_ITERATIONS = 2 * NUM_BUSY  # the workload's two busy phases, each followed by heartbeats


def engine_of(path: Path, producer: str = "unknown"):
    (timeline,) = read_timelines([path], producer)[0].values()
    return timeline


@pytest.mark.parametrize("path", [RECEIVED, FULL], ids=["recv-output", "full-trace"])
def test_every_message_of_a_full_recording_becomes_a_record_or_heartbeat(path):
    timeline = engine_of(path, "dynamo-vllm")
    assert timeline.num_iterations == NUM_ITERATIONS
    assert timeline.facts == {"model_name": "dynamo-w0", "source": "fpm-dynamo-vllm"}
    assert timeline.capture.mode in ("received", "full")
    assert (timeline.col("elapsed_ns") > 0).all()
    first = timeline.records[0]
    assert (first.num_decode_reqs, first.fpm.num_decode_kv_tokens) == (1, 300)
    assert sum(record.num_dropped for record in timeline.records) == 0


def test_a_sampled_trace_numbers_its_samples_without_losses():
    tap = read_tap([SAMPLED])
    records = [m for m in tap.messages if type(m) is not Heartbeat]
    assert tap.capture.mode == "sampled" and 5 < len(records) < NUM_ITERATIONS
    assert 0.09 < tap.capture.sample_interval_s < 0.2  # DYN_FPM_SAMPLE_INTERVAL_MS=100
    assert [m.msg_seq for m in tap.messages] == list(range(1, len(tap.messages) + 1))
    assert all(m.num_dropped == 0 for m in tap.messages)


def drop_lines(source: Path, target: Path, first: int, count: int) -> Path:
    lines = source.read_bytes().splitlines(keepends=True)
    target.write_bytes(b"".join(lines[:first] + lines[first + count :]))
    return target


def explain_json(capsys, *args: str) -> dict:
    assert explain.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_messages_missing_from_a_full_recording_are_a_telemetry_gap(tmp_path, capsys):
    report = explain_json(capsys, str(drop_lines(RECEIVED, tmp_path / "r.jsonl", 10, 5)))
    (engine,) = report["engines"]
    (gap,) = [f for f in engine["findings"] if f["kind"] == "telemetry_gap"]
    assert gap["worst"]["numbers"]["num_lost"] == 5
    assert report["fpm_recording"]["capture_mode"] == "received"


def test_explain_says_a_recording_is_sampled_and_what_that_means(capsys):
    report = explain_json(capsys, str(SAMPLED))
    (engine,) = report["engines"]
    assert not [f for f in engine["findings"] if f["kind"] == "telemetry_gap"]
    recording = report["fpm_recording"]
    assert recording["capture_mode"] == "sampled"
    assert recording["iterations_per_sample"] > 5  # 100 ms samples of 4-13 ms iterations
    assert explain.main([str(SAMPLED)]) == 0
    text = capsys.readouterr().out
    for words in ("Sampled Dynamo FPM recording", "count the sampled iterations only",
                  "scale them", "not losses"):  # fmt: skip
        assert words in text


def later(trace_line: bytes, ms: int) -> bytes:
    """The trace line observed ``ms`` later."""
    line = json.loads(trace_line)
    line["event"]["observed_at_unix_ms"] += ms
    return json.dumps(line).encode() + b"\n"


def test_a_restarted_producer_is_met_again_and_a_cut_segment_keeps_what_it_holds(tmp_path):
    lines = gzip.decompress(FULL.read_bytes()).splitlines(keepends=True)
    segment = tmp_path / "trace.p.000000.jsonl.gz"
    # the first 10 messages, again 10 s later (a restart: counter_id from 1 again), then a
    # gzip member cut short
    whole = gzip.compress(b"".join(lines[:10] + [later(line, 10_000) for line in lines[:10]]))
    segment.write_bytes(whole + gzip.compress(b"".join(lines[10:20]))[:40])
    tap = read_tap([segment])
    introductions = [m for m in tap.messages if type(m) is Heartbeat and m.msg_seq == 1]
    assert len(introductions) == 2 and tap.num_bad_lines == 1
    assert tap.num_fpm_messages == 20


def test_dynamo_recordings_are_read_alone(tmp_path, capsys):
    ours = tmp_path / "ours.jsonl"
    ours.write_text("")
    assert explain.main([str(RECEIVED), str(ours)]) == 2
    assert "read alone" in capsys.readouterr().err
    mixed = [str(RECEIVED), str(shutil.copy(FULL, tmp_path / FULL.name))]
    assert tune.main([*mixed, "--itl-target", "50ms"]) == 2
    assert explain_command.main([str(FULL), "--follow", "--max-time", "1s"]) == 2
    assert "--follow reads iterscope's recordings only" in capsys.readouterr().err


@pytest.mark.parametrize("path", [RECEIVED, FULL, SAMPLED], ids=["recv", "full", "sampled"])
def test_tune_fits_dynamos_recordings_to_the_workloads_costs(path, capsys):
    args = [str(path), "--itl-target", "50ms", "--fpm-producer", "dynamo-vllm", "--json"]
    assert tune.main(args) == 0
    (result,) = json.loads(capsys.readouterr().out)["engines"]
    fit = result["fit"]
    assert fit["base_time"] == pytest.approx(BASE_S, rel=1e-3)
    assert fit["coefficients"]["ctx_tokens"] == pytest.approx(PREFILL_TOKEN_S, rel=1e-3)
    assert fit["coefficients"]["gen_tokens"] == pytest.approx(DECODE_REQ_S, rel=1e-3)
    assert "update to update" in result["fpm_notes"][0]
    assert ("sampled" in " ".join(result["fpm_notes"])) == (path == SAMPLED)


def fpm_ingest_recording(
    path: Path, producer: str, kv_token_s: float = 0.0, varied_context: bool = True
) -> Path:
    """A recording made by the sidecar's FPM ingest (FpmEngines into Ingest and the JSONL
    sink), of 30 iterations whose wall_time is 3 ms + 10 us a prefill token + 0.2 ms a
    decode + ``kv_token_s`` a decode KV token (contexts of 100, 150 or 200 tokens; 150 each
    without ``varied_context``)."""
    recording = JsonlSink(str(path))
    ingest = Ingest([recording], live_findings=False)
    engines = FpmEngines(ingest, model_name="m", producer=producer)
    for seq in range(30):
        prefill, decode = 64 * (seq % 5), 1 + seq % 7
        decode_kv = decode * (100 + 50 * (seq % 3) if varied_context else 150)
        scheduled = {
            "num_prefill_requests": 1 if prefill else 0,
            "sum_prefill_tokens": prefill,
            "num_decode_requests": decode,
            "sum_decode_kv_tokens": decode_kv,
        }
        wall_time = 0.003 + 1e-5 * prefill + 2e-4 * decode + kv_token_s * decode_kv
        received_ns = (seq + 1) * 10**8
        engines.on_frames(fpm_frames(seq, scheduled=scheduled, wall_time=wall_time), received_ns)
    ingest.close()
    return path


@pytest.mark.parametrize(
    ("producer", "words"),
    [
        ("sglang", "lower bounds"),
        ("dynamo-vllm", "update to update"),
        ("unknown", "not named (--fpm-producer)"),
    ],
)
def test_tune_fits_an_fpm_ingest_recording_and_says_what_its_times_are(
    tmp_path, capsys, producer, words
):
    path = fpm_ingest_recording(tmp_path / "fpm.jsonl", producer)
    assert tune.main([str(path), "--itl-target", "40ms"]) == 0
    text = capsys.readouterr().out
    assert "3.000 ms + 10.00 us per prefill token, 200.00 us per decode token" in text
    assert words in text


def test_a_producer_met_mid_load_shows_no_phantom_gap(tmp_path, capsys):
    """Its introducing heartbeat is placed at the first iteration's start, before that
    iteration's record, so explain sees the messages in seq order."""
    path = fpm_ingest_recording(tmp_path / "fpm.jsonl", "sglang")
    (engine,) = explain_json(capsys, str(path))["engines"]
    assert not [f for f in engine["findings"] if f["kind"] == "telemetry_gap"]


@pytest.mark.parametrize("producer", ["sglang", "dynamo-vllm"])
def test_explain_says_the_device_is_not_reported_by_fpm(tmp_path, capsys, producer):
    """FPM names no device: the header says so, never "on ?"; --json leaves device_name out
    of the facts, as every fact the source does not give."""
    path = fpm_ingest_recording(tmp_path / "fpm.jsonl", producer)
    assert explain.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert f"Engine 0, model m, device not reported by the source (fpm-{producer})\n" in text
    assert " on ?" not in text
    (engine,) = explain_json(capsys, str(path))["engines"]
    assert engine["facts"] == {"model_name": "m", "source": f"fpm-{producer}"}


def test_tune_fits_the_decode_context_of_fpm_engines_and_predicts_with_its_mean(tmp_path, capsys):
    path = fpm_ingest_recording(tmp_path / "fpm.jsonl", "dynamo-vllm", kv_token_s=1e-6)
    assert tune.main([str(path), "--itl-target", "40ms", "--min-chunk", "256", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["engines"]
    fit, recommendation = result["fit"], result["recommendation"]
    assert fit["coefficients"]["decode_kv_tokens"] == pytest.approx(1e-6, rel=1e-3)
    assert fit["coefficients"]["gen_tokens"] == pytest.approx(2e-4, rel=1e-3)
    context = fit["decode_context_tokens"]
    assert 100 < context < 200
    decode_request_s = 2e-4 + 1e-6 * context  # its token and its context
    room_s = 0.040 - 0.003 - 1e-5 * 256
    assert recommendation["max_num_seqs"] == int(room_s // decode_request_s)


def test_tune_predicts_at_a_decode_context_the_operator_names(tmp_path, capsys):
    """--decode-context puts that context behind each decoding request, at the fitted cost
    of a decode KV token (1 us here): a longer context than recorded allows fewer decodes."""
    path = fpm_ingest_recording(tmp_path / "fpm.jsonl", "dynamo-vllm", kv_token_s=1e-6)
    args = [str(path), "--itl-target", "40ms", "--min-chunk", "256"]
    assert tune.main([*args, "--decode-context", "4000", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["engines"]
    fit, recommendation = result["fit"], result["recommendation"]
    assert result["decode_context_refused"] is None
    assert fit["target_decode_context_tokens"] == 4000
    assert 100 < fit["decode_context_tokens"] < 200  # the recorded mean, still said
    decode_request_s = 2e-4 + 1e-6 * 4000
    room_s = 0.040 - 0.003 - 1e-5 * 256
    max_num_seqs = int(room_s // decode_request_s)
    assert recommendation["max_num_seqs"] == max_num_seqs == 8
    assert recommendation["decode_iteration_time"] == pytest.approx(
        0.003 + max_num_seqs * decode_request_s, rel=1e-3
    )
    assert any("--decode-context 4000 is extrapolated" in n for n in recommendation["notes"])
    assert tune.main([*args, "--decode-context", "0"]) == 0
    text = capsys.readouterr().out
    assert "predictions put --decode-context 0 KV tokens behind each decoding request" in text
    assert f"--max-num-seqs {int(room_s // 2e-4)} " in text  # no context: the token's cost
    assert "extrapolated" not in text.split("Recommended")[1].split("note:")[0]


@pytest.mark.parametrize(
    ("recording", "why"),
    [
        ("iterscope", "the recording holds no decoding request's context"),
        ("fpm", "the fit found no cost of the decoding requests' context apart"),
    ],
)
def test_tune_says_when_a_decode_context_cannot_be_honoured(tmp_path, capsys, recording, why):
    """Our engine's records hold no decode context; an FPM engine whose decodes each hold 150
    KV tokens has the context's cost inside a decode's."""
    if recording == "iterscope":
        from scenarios import synthetic

        path = synthetic.story3_bursty(16).write(tmp_path / "bursty.jsonl")
    else:
        path = fpm_ingest_recording(tmp_path / "fpm.jsonl", "sglang", 1e-6, varied_context=False)
    args = [str(path), "--itl-target", "50ms", "--decode-context", "4000"]
    assert tune.main(args) == 0
    text = capsys.readouterr().out
    assert f"--decode-context not honoured: {why}" in text
    assert "the predictions and limits below are for the recorded contexts" in text
    assert tune.main([*args, "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["engines"]
    assert why in result["decode_context_refused"]
    assert result["fit"]["target_decode_context_tokens"] is None
    assert tune.main([str(path), "--itl-target", "50ms", "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)["engines"]
    assert plain["decode_context_refused"] is None
    assert plain["recommendation"] == result["recommendation"]


@pytest.mark.parametrize(
    ("value", "error"),
    [("-5", "a context is 0 tokens or more, not -5"), ("4k", "not a whole number of tokens")],
)
def test_a_bad_decode_context_is_an_argparse_error(capsys, value, error):
    with pytest.raises(SystemExit) as exit_:
        tune.main([str(RECEIVED), "--itl-target", "50ms", "--decode-context", value])
    assert exit_.value.code == 2
    assert f"argument --decode-context: {error}" in capsys.readouterr().err


def in_component(trace_line: bytes, component: str, ms: int) -> bytes:
    """The trace line from another component of the same process, ``ms`` later."""
    line = json.loads(later(trace_line, ms))
    line["event"]["source"]["component"] = component
    return json.dumps(line).encode() + b"\n"


def test_two_components_with_one_worker_id_are_two_engines(tmp_path):
    """Dynamo keys a trace's stream by its component too (a process may serve two)."""
    lines = gzip.decompress(FULL.read_bytes()).splitlines(keepends=True)
    segment = tmp_path / "trace.p.000000.jsonl.gz"
    other = [in_component(line, "prefill", 1) for line in lines]
    interleaved = [line for pair in zip(lines, other, strict=True) for line in pair]
    segment.write_bytes(gzip.compress(b"".join(interleaved)))
    timelines = read_timelines([segment])[0]
    assert sorted(tl.facts["model_name"] for tl in timelines.values()) == [
        "iterscope.prefill/dynamo-w0",
        "iterscope.worker/dynamo-w0",
    ]
    assert [tl.num_iterations for tl in timelines.values()] == [NUM_ITERATIONS] * 2


def test_a_waiting_episode_of_a_dynamo_recording_says_kv_usage_is_not_reported(capsys):
    """FPM reports no KV blocks: the waiting finding says so and draws nothing from a 0%."""
    assert explain.main([str(RECEIVED), "--fpm-producer", "dynamo-vllm"]) == 0
    text = capsys.readouterr().out
    findings = text.split("\n\n")[2]
    assert "1. Requests waiting: reason not reported" in findings
    assert "running mean 4.3; KV usage not reported\n" in findings
    assert "do        KV usage is not reported by the source (fpm-dynamo-vllm) either, so" in text
    assert "0.0%" not in findings and "peaked at" not in findings
    (engine,) = explain_json(capsys, str(RECEIVED), "--fpm-producer", "dynamo-vllm")["engines"]
    (waiting,) = [f for f in engine["findings"] if f["kind"] == "waiting"]
    assert waiting["worst"]["numbers"]["peak_usage"] is None
