"""The synthetic engine of tests/helpers/fake_engine.py, as a process of its own: every seq it
sends is delivered or counted as dropped."""

from __future__ import annotations

import json

import msgspec
import pytest
import zmq

from telemetry.lane.record import IterationRecord, make_decoder
from tests.helpers.fake_engine import start_engine

pytestmark = pytest.mark.live


def test_synthetic_engine_sends_consecutive_seqs(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    engine = start_engine(address, tmp_path / "report.json", "--duration", "0.5")
    decoder = make_decoder()
    messages = []
    try:
        assert engine.wait(timeout=30) == 0
        while pull.poll(200):
            messages.append(decoder.decode(pull.recv()))
    finally:
        engine.kill()
        pull.close(linger=0)
    report = json.loads((tmp_path / "report.json").read_text())
    records = [m for m in messages if isinstance(m, IterationRecord)]
    assert records and report["num_iterations"] >= len(records)
    seqs = [m.msg_seq for m in messages]
    assert seqs == sorted(seqs) and seqs[-1] <= report["last_seq"]
    # Every seq is delivered or counted as dropped by the engine.
    assert len(set(seqs)) + report["num_dropped_total"] == report["last_seq"]
    assert msgspec.structs.asdict(records[0])["num_decode_tokens"] == 8
