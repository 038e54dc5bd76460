"""Failures visible in /metrics: sink errors and lines lost per sink, the sidecar's own up,
start time and last write; a recording on a full disk, end to end."""

import resource
import signal
import subprocess
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.process import start_sidecar
from telemetry.sidecar.sink import Sink
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from tests.helpers.fake_engine import start_engine, stop_engine
from tests.helpers.lane import heartbeat, record
from tests.helpers.net import free_port
from tests.helpers.prom import metrics_text
from tests.helpers.wait import wait_until

RECORDING_LIMIT_BYTES = 64 << 10


def parse(text: str) -> dict[tuple[str, str], float]:
    """{(sample name, sink label): value} of the sidecar-level series."""
    return {
        (sample.name, sample.labels.get("sink", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("engine") == ""
    }


class BrokenDisk(Sink):
    """A writer whose output fails from the third message on, losing one line each time."""

    name = "broken"

    def __init__(self):
        self.num_messages = 0

    def on_iteration(self, record, engine):
        self.num_messages += 1
        if self.num_messages >= 3:
            self.num_lines_lost += 1
            raise OSError(28, "No space left on device")
        self.last_write_time = 1_700_000_000.0 + self.num_messages


def test_sink_failures_are_series_per_sink():
    registry = CollectorRegistry()
    prometheus, broken = PrometheusSink(registry), BrokenDisk()
    ingest = Ingest([prometheus, broken])  # attaches every sink to the others
    ingest.on_message(heartbeat(1), now_ns=1)
    for seq in range(2, 12):  # ten records: the last eight fail in the broken sink
        ingest.on_message(record(seq), now_ns=seq)
    samples = parse(generate_latest(registry).decode())
    assert samples[("iterscope_sink_errors_total", "broken")] == 8 == ingest.health.num_sink_errors
    assert samples[("iterscope_sink_errors_total", "prometheus")] == 0
    assert samples[("iterscope_sink_lines_lost_total", "broken")] == 8
    assert samples[("iterscope_sink_last_write_timestamp_seconds", "broken")] == 1_700_000_002.0
    assert ("iterscope_sink_last_write_timestamp_seconds", "prometheus") not in samples
    assert samples[("iterscope_sidecar_up", "")] == 1
    assert 0 < time.time() - samples[("iterscope_sidecar_start_time_seconds", "")] < 60


def limit_file_size() -> None:
    """In the sidecar's process: files may not grow beyond the limit (a full disk: writes
    fail with EFBIG), and the signal that would kill it for trying is ignored."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (RECORDING_LIMIT_BYTES, RECORDING_LIMIT_BYTES))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def sidecar_series(port: int) -> dict[tuple[str, str], float]:
    """The sidecar-level series of the /metrics page on ``port`` (see parse)."""
    return parse(metrics_text(port))


@pytest.mark.live
def test_a_recording_on_a_full_disk_shows_in_metrics(tmp_path):
    recording = tmp_path / "rec.jsonl"
    port = free_port()
    sidecar = start_sidecar(
        ["--record", str(recording), "--metrics-port", str(port), "--no-log"],
        preexec_fn=limit_file_size,
        stderr=subprocess.DEVNULL,
    )
    engine = start_engine(sidecar.address, tmp_path / "engine.json", "--iteration-time", "0.002")
    try:
        errors = ("iterscope_sink_errors_total", "jsonl")
        wait_until(
            lambda: sidecar_series(port).get(errors, 0) > 0,
            30,
            "the full disk to show in /metrics",
            interval_s=0.1,
        )
        full = sidecar_series(port)
        time.sleep(1.0)  # the time under test: a second of failing flushes, no write
        later = sidecar_series(port)
        stop_engine(engine, tmp_path / "engine.json")
    finally:
        engine.kill()
        sidecar.stop()
    assert recording.stat().st_size <= RECORDING_LIMIT_BYTES
    last_write = ("iterscope_sink_last_write_timestamp_seconds", "jsonl")
    assert later[errors] > full[errors] > 0  # every flush fails while the disk stays full
    assert later[last_write] == full[last_write] < time.time() - 1
    assert later[("iterscope_sink_lines_lost_total", "jsonl")] == 0  # held, up to 64 MiB
