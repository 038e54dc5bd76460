"""`iterscope timeline`'s trace: size and write rate for one hour of a busy engine.

    .venv/bin/python bench/timeline_trace.py [--seconds 3600] [--rate 100] [--concurrency 32]
        [--repeat 3] [--before REV]

Synthetic records, built directly (no simulator, no recording file): ``--rate`` iterations
per second for ``--seconds``, ``--concurrency`` requests always running (each 512 prompt tokens
prefilled in one chunk, then 256 output tokens), so most iterations decode 32 requests and
every eighth also prefills the request that replaced a finished one; each request reports a
first-token and a finish milestone, as the engine does. Then the timeline (EngineTimeline) is
written as a Perfetto trace (telemetry/analysis/perfetto_trace.py, findings search included)
into a temporary file; the findings search (explain's detectors) is also timed alone.
Goals (issue #30): under 50 MB, at least 200,000 iterations/s.

Before and after, side by side: ``--before REV`` (default: the last commit whose writer built
protobuf objects with perfetto's TraceProtoBuilder) loads that commit's perfetto_trace.py from
git and writes the same timeline with it, alternating with the current writer ``--repeat``
times each; the median of each is reported (the machine may be shared: medians of alternating
runs compare two writers under the same load). ``--before ''`` skips it.

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

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
OBJECT_BUILT_WRITER = "14452ea"  # the last commit with the TraceProtoBuilder writer


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


def writer_at(rev: str) -> ModuleType:
    """perfetto_trace.py as it was at git revision ``rev``, loaded as a module of its own
    (over the current modules it imports: explain's detectors are today's)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:telemetry/analysis/perfetto_trace.py"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"perfetto_trace_{rev}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"perfetto_trace_{rev}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def timed_write(write, timeline: EngineTimeline) -> tuple[float, object]:
    """Seconds to write the timeline with ``write`` (write_trace) into a temporary file."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        counts = write({0: timeline}, out)
        return time.perf_counter() - started, counts


def figures_of(label: str, seconds: list[float], counts) -> dict:
    write_s = statistics.median(seconds)
    return {
        f"{label}trace_mb": counts.num_bytes / 1e6,
        f"{label}bytes_per_iteration": counts.num_bytes / counts.num_iterations,
        f"{label}write_s": write_s,
        f"{label}write_s_runs": seconds,
        f"{label}iterations_per_s": counts.num_iterations / write_s,
    }


def build_timeline(args: argparse.Namespace) -> EngineTimeline:
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
    return EngineTimeline(0, records, beats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--rate", type=float, default=100.0, help="iterations per second")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="writes of each writer")
    parser.add_argument("--before", default=OBJECT_BUILT_WRITER, metavar="REV")
    args = parser.parse_args()
    timeline = build_timeline(args)
    before = writer_at(args.before) if args.before else None
    seconds, before_seconds = [], []
    for _ in range(args.repeat):
        if before is not None:
            write_s, before_counts = timed_write(before.write_trace, timeline)
            before_seconds.append(write_s)
        write_s, counts = timed_write(write_trace, timeline)
        seconds.append(write_s)
    started = time.perf_counter()
    list(finding_slices(timeline, Thresholds()))
    findings_s = time.perf_counter() - started
    figures = {
        "iterations": counts.num_iterations,
        "requests": counts.num_requests,
        "counter_samples": counts.num_counter_samples,
        "findings": counts.num_findings,
        **figures_of("", seconds, counts),
        "findings_search_s": findings_s,
        "goal_mb": 50,
        "goal_iterations_per_s": 200_000,
    }
    if before is not None:
        figures |= {
            "before_rev": args.before,
            **figures_of("before_", before_seconds, before_counts),
        }
        print(
            f"before ({args.before}, object-built): {figures['before_trace_mb']:.1f} MB "
            f"({figures['before_bytes_per_iteration']:.0f} B/iteration), "
            f"{figures['before_iterations_per_s']:,.0f} iterations/s "
            f"(median of {args.repeat} writes: {figures['before_write_s']:.2f} s)"
        )
    print(
        f"{counts.num_iterations:,} iterations, {counts.num_requests:,} requests, "
        f"{counts.num_findings} findings: {figures['trace_mb']:.1f} MB "
        f"({figures['bytes_per_iteration']:.0f} B/iteration; goal < 50 MB), written in "
        f"{figures['write_s']:.2f} s = {figures['iterations_per_s']:,.0f} iterations/s "
        f"(median of {args.repeat}; goal >= 200,000), explain's findings search alone "
        f"{findings_s:.2f} s"
    )
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
