"""`iterscope timeline`'s trace: size and write rate for one hour of a busy engine.

    .venv/bin/python bench/timeline_trace.py [--seconds 3600] [--rate 100] [--concurrency 32]

Synthetic records, built directly (no simulator, no recording file): ``--rate`` iterations
per second for ``--seconds``, ``--concurrency`` requests always running (each 512 prompt tokens
prefilled in one chunk, then 256 output tokens), so most iterations decode 32 requests and
every eighth also prefills the request that replaced a finished one; each request reports a
first-token and a finish milestone, as the engine does. Then the timeline (EngineTimeline) is
written as a Perfetto trace (telemetry/analysis/perfetto_trace.py, findings search included)
into a temporary file; the findings search (explain's detectors) is also timed alone.
Goals (issue #30): under 50 MB, at least 200,000 iterations/s.

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from telemetry.analysis.episodes import Thresholds  # noqa: E402
from telemetry.analysis.perfetto_trace import finding_slices, write_trace  # noqa: E402
from telemetry.analysis.timeline import EngineTimeline  # noqa: E402
from telemetry.lane.record import (  # noqa: E402
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    IterationRecord,
    RequestMilestone,
    heartbeat,
    iteration_record,
)

PROMPT_TOKENS = 512
OUTPUT_TOKENS = 256
BLOCK_SIZE = 16
NUM_BLOCKS = 2048


def _milestone(request_id: str, arrival_ns: int, first_ns: int, now_ns: int, done: bool):
    return RequestMilestone(
        request_id,
        EVENT_FINISHED if done else EVENT_FIRST_TOKEN,
        arrival_ns,
        first_ns,
        first_ns + 9_000_000,
        now_ns if done else 0,
        PROMPT_TOKENS,
        0,
        OUTPUT_TOKENS if done else 1,
        0,
        0 if done else -1,
        prefill_chunks=[(first_ns, first_ns + 9_000_000, PROMPT_TOKENS)] if done else [],
    )


def build_records(seconds: float, rate: float, concurrency: int) -> list[IterationRecord]:
    """Back-to-back iterations; request i (slot i % concurrency) is admitted when its slot's
    previous request finishes, its admissions staggered so they spread evenly."""
    period_ns = int(1e9 / rate)
    num_iterations = int(seconds * rate)
    slots = [None] * concurrency  # (request_id, arrival_ns, first_ns, num_output)
    records, next_id = [], 0
    for it in range(num_iterations):
        start_ns = 1_000 * 1_000_000_000 + it * period_ns
        milestones, prefill = [], 0
        slot = it % concurrency
        if it % 8 == 0 or slots[slot] is None:
            held = slots[slot]
            if held is not None:
                milestones.append(_milestone(held[0], held[1], held[2], start_ns, True))
            slots[slot] = [f"req-{next_id}", start_ns - 5_000_000, start_ns, 0]
            next_id += 1
            prefill = PROMPT_TOKENS
        decoding = [s for s in slots if s is not None and s[2] < start_ns]
        for s in decoding:
            s[3] += 1
            if s[3] == 1:
                milestones.append(_milestone(s[0], s[1], s[2], start_ns, False))
        used = sum((PROMPT_TOKENS + s[3]) // BLOCK_SIZE + 1 for s in slots if s is not None)
        records.append(
            iteration_record(
                0,
                it + 1,
                it + 1,
                start_ns=start_ns,
                elapsed_ns=period_ns - 200_000,
                num_prefill_reqs=1 if prefill else 0,
                num_prefill_tokens=prefill,
                num_decode_reqs=len(decoding),
                num_decode_tokens=len(decoding),
                num_running_reqs=concurrency,
                num_kv_blocks_used=used,
                num_kv_blocks_free=NUM_BLOCKS - used,
                num_kv_tokens=used * BLOCK_SIZE,
                milestones=milestones,
            )
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--rate", type=float, default=100.0, help="iterations per second")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    records = build_records(args.seconds, args.rate, args.concurrency)
    beats = [
        heartbeat(
            0,
            0,
            records[0].start_ns,
            1_700_000_000_000_000_000,
            model_name="synthetic",
            device_name="CPU",
            block_size=BLOCK_SIZE,
            num_kv_blocks_total=NUM_BLOCKS,
        )
    ]
    timeline = EngineTimeline(0, records, beats)
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        counts = write_trace({0: timeline}, out)
        write_s = time.perf_counter() - started
    started = time.perf_counter()
    list(finding_slices(timeline, Thresholds()))
    findings_s = time.perf_counter() - started
    figures = {
        "iterations": counts.num_iterations,
        "requests": counts.num_requests,
        "counter_samples": counts.num_counter_samples,
        "findings": counts.num_findings,
        "trace_mb": counts.num_bytes / 1e6,
        "bytes_per_iteration": counts.num_bytes / counts.num_iterations,
        "write_s": write_s,
        "iterations_per_s": counts.num_iterations / write_s,
        "findings_search_s": findings_s,
        "goal_mb": 50,
        "goal_iterations_per_s": 200_000,
    }
    print(
        f"{counts.num_iterations:,} iterations, {counts.num_requests:,} requests, "
        f"{counts.num_findings} findings: {figures['trace_mb']:.1f} MB "
        f"({figures['bytes_per_iteration']:.0f} B/iteration; goal < 50 MB), written in "
        f"{write_s:.1f} s = {figures['iterations_per_s']:,.0f} iterations/s (goal >= 200,000), "
        f"of which explain's findings search {findings_s:.1f} s"
    )
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
