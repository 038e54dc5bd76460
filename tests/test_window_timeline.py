"""The live window's timeline (telemetry/analysis/window_timeline.py): built from the records
kept since the last build and the new ones, it equals a timeline built from scratch, whatever
the window dropped and received in between, heartbeats and records out of start order
included; and it reads only the new records where the window kept the last build's."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from telemetry.analysis import window_timeline
from telemetry.analysis.timeline import EngineTimeline
from telemetry.analysis.window_timeline import WindowTimeline
from telemetry.lane.record import (
    Heartbeat,
    IterationRecord,
    SpecDecodeCounts,
    heartbeat,
    iteration_record,
)


def message(number: int, rng: random.Random, start_ns: int):
    if rng.random() < 0.1:
        return heartbeat(0, number, start_ns, start_ns + 10**18, num_running_reqs=rng.randint(0, 9))
    drafts = rng.randint(0, 3)
    return iteration_record(
        0,
        number,
        number,
        start_ns=start_ns,
        elapsed_ns=rng.randint(1, 10**7),
        num_decode_reqs=rng.randint(0, 9),
        num_prefill_tokens=rng.choice([0, 0, 256]),
        num_waiting_reqs=rng.randint(0, 3),
        spec_decode=SpecDecodeCounts(drafts, 3 * drafts, drafts, [drafts, 0, 0])
        if drafts
        else None,
    )


def assert_same(built: EngineTimeline, messages: deque) -> None:
    records = [m for m in messages if type(m) is IterationRecord]
    fresh = EngineTimeline(0, records, [m for m in messages if type(m) is Heartbeat])
    assert built.records == fresh.records
    assert built.heartbeats == fresh.heartbeats
    assert built.columns.keys() == fresh.columns.keys()
    for name, column in fresh.columns.items():
        np.testing.assert_array_equal(built.columns[name], column, err_msg=name)


@pytest.mark.parametrize("out_of_order", [0.0, 0.02])
def test_each_build_equals_a_timeline_built_from_scratch(out_of_order):
    rng = random.Random(7)
    window, builder, start_ns, number = deque(maxlen=300), WindowTimeline(0), 10**12, 0
    for _ in range(200):
        for _ in range(rng.choice([0, 1, 5, 40, 400])):  # 400: the window turns over
            number += 1
            start_ns += 10**6
            late = rng.random() < out_of_order
            window.append(message(number, rng, start_ns - (5 * 10**6 if late else 0)))
        for _ in range(rng.choice([0, 0, 3, 50])):  # dropped from the front, as _trim does
            if window:
                window.popleft()
        assert_same(builder.build(window), window)


def test_only_the_new_records_are_read(monkeypatch):
    rng = random.Random(3)
    window, builder = deque(), WindowTimeline(0)
    for number in range(1, 1001):
        window.append(message(number, rng, 10**12 + number * 10**6))
    builder.build(window)
    read = []
    monkeypatch.setattr(
        window_timeline,
        "record_columns",
        lambda records: read.append(len(records)) or EngineTimeline(0, records, []).columns,
    )
    for _ in range(100):
        window.popleft()
    new = [
        message(number, random.Random(number), 10**12 + number * 10**6)
        for number in range(1001, 1031)
    ]
    window.extend(new)
    assert_same(builder.build(window), window)
    assert read == [sum(type(m) is IterationRecord for m in new)]
