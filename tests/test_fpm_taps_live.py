"""Dynamo's own recorders (the ai-dynamo and ai-dynamo-runtime wheels `make fpm-wheels`
unpacks) write the workload of tests/helpers/dynamo_fpm_recorder.py again, full and sampled,
and the reader of telemetry/sources/fpm_taps.py finds in them what it finds in the files
committed under tests/data/dynamo_fpm (tests/test_fpm_taps.py), so those stay Dynamo's
format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from telemetry.lane.record import IterationRecord
from telemetry.sources.fpm_taps import read_tap
from tests.helpers import REPO
from tests.helpers.dynamo_fpm_recorder import NUM_BUSY, iteration
from tests.helpers.processes import child_pythonpath

FPM_WHEELS = REPO / ".cache" / "fpm-wheels"
RECORDER = REPO / "tests" / "helpers" / "dynamo_fpm_recorder.py"


def start_recorder(out: Path, mode: str) -> subprocess.Popen:
    """The recorder writing out/recv.jsonl and out/trace.<producer>.000000.jsonl.gz."""
    if not (FPM_WHEELS / "dynamo" / "_core.abi3.so").exists():
        raise AssertionError(f"{FPM_WHEELS} has no Dynamo runtime: `make fpm-wheels`")
    out.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join((str(FPM_WHEELS), child_pythonpath())),
        DYN_FILE_KV=str(out / "discovery"),
        DYN_FPM_TRACE="1",
        DYN_FPM_OUTPUT_PATH=str(out / "trace.jsonl.gz"),
        DYN_FPM_MODE=mode,
        DYN_FPM_SAMPLE_INTERVAL_MS="100",
    )
    log = open(out / "recorder.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, str(RECORDER), str(out / "recv.jsonl")], env=env, stdout=log, stderr=log
    )


def records(paths: list[Path]) -> list[IterationRecord]:
    return [m for m in read_tap(paths).messages if type(m) is IterationRecord]


def test_dynamos_recorders_write_what_the_reader_reads(tmp_path):
    full, sampled = tmp_path / "full", tmp_path / "sampled"
    recorders = {full: start_recorder(full, "full"), sampled: start_recorder(sampled, "sampled")}
    for out, recorder in recorders.items():
        assert recorder.wait(timeout=60) == 0, (out / "recorder.log").read_text()
    expected = [iteration(i)["scheduled_sum_prefill_tokens"] for i in range(2 * NUM_BUSY)]
    for paths in ([full / "recv.jsonl"], list(full.glob("trace.*.jsonl.gz"))):
        assert [r.num_prefill_tokens for r in records(paths)] == expected
    sampled_tap = read_tap(list(sampled.glob("trace.*.jsonl.gz")))
    assert sampled_tap.capture.mode == "sampled" and sampled_tap.num_bad_lines == 0
    assert 5 < len(records(list(sampled.glob("trace.*.jsonl.gz")))) < 2 * NUM_BUSY
