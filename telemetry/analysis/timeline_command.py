"""`iterscope timeline RECORDING... -o run.pftrace`: a recording drawn as a Perfetto trace.

Reads recordings as `explain` does (rotated files, several engines, every source; a line cut
by a crash is counted and skipped, so a cut recording converts up to the cut) and writes the
trace of telemetry/analysis/perfetto_trace.py. The trace is written to a temporary file beside
the output and renamed over it only when whole, so a failed run leaves an existing output
untouched. Open it at https://ui.perfetto.dev (Open trace file: the file is read in the
browser, nothing is uploaded).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from telemetry.analysis.episodes import Thresholds
from telemetry.analysis.liveness_flags import add_liveness_arguments, liveness_thresholds
from telemetry.analysis.perfetto_trace import TraceCounts, write_trace
from telemetry.analysis.timeline import EngineTimeline, nothing_to_read, read_timelines
from telemetry.analysis.words import plural

VIEWER_URL = "https://ui.perfetto.dev"


class TimelineError(Exception):
    """Input the command cannot draw; the message says why (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope timeline",
        description="Draw a recording as a Perfetto trace: a slice per iteration, counters "
        "(KV, queues, tokens, preemptions, iteration time), each request's phases and "
        f"explain's findings. Open it at {VIEWER_URL} (read in the browser, not uploaded).",
    )
    parser.add_argument(
        "recordings",
        nargs="+",
        type=Path,
        help="JSONL recording file(s) written by `iterscope sidecar --record`",
    )
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="OUT.pftrace", help="the trace"
    )
    parser.add_argument("--engine", type=int, help="only this engine index")
    add_liveness_arguments(parser)  # for the findings, as explain takes them
    return parser


def convert(
    recordings: list[Path],
    output: Path,
    thresholds: Thresholds | None = None,
    engine_index: int | None = None,
) -> tuple[TraceCounts, int]:
    """Write the trace of ``recordings`` to ``output``: (what it holds, unreadable lines).
    Raises TimelineError, leaving ``output`` as it was, when there is nothing to draw."""
    inputs = {path.resolve() for path in recordings}
    if output.resolve() in inputs:
        raise TimelineError(f"the output {output} is one of the recordings; choose another name")
    try:
        read, _, num_bad = read_timelines(recordings)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as error:
        raise TimelineError(str(error)) from None
    timelines = read
    if engine_index is not None:
        timelines = {k: v for k, v in timelines.items() if k == engine_index}
    if not timelines:
        raise TimelineError(nothing_to_read(read, num_bad, engine_index))
    return _write_whole(timelines, output, thresholds), num_bad


def _write_whole(
    timelines: dict[int, EngineTimeline], output: Path, thresholds: Thresholds | None
) -> TraceCounts:
    """The trace into a temporary file beside ``output``, renamed over it once complete."""
    directory = output.parent if str(output.parent) else Path(".")
    try:
        handle = tempfile.NamedTemporaryFile(
            dir=directory, prefix=f".{output.name}.", suffix=".tmp", delete=False
        )
    except OSError as error:
        raise TimelineError(f"cannot write to {directory}: {error.strerror}") from None
    try:
        with handle:
            counts = write_trace(timelines, handle, thresholds)
        os.replace(handle.name, output)
    except OSError as error:
        raise TimelineError(f"cannot write {output}: {error.strerror or error}") from None
    finally:
        if os.path.exists(handle.name):
            os.unlink(handle.name)
    return counts


def findings_text(counts: TraceCounts) -> str:
    """'1 finding (4 episodes)', as explain counts them; '0 findings'."""
    if not counts.num_findings:
        return plural(0, "finding")
    episodes = plural(counts.num_finding_episodes, "episode")
    return f"{plural(counts.num_findings, 'finding')} ({episodes})"


def summary(output: Path, counts: TraceCounts, num_bad: int) -> str:
    """The line that says what the trace at ``output`` holds."""
    return (
        f"iterscope timeline: wrote {output} ({counts.num_bytes / 1e6:.1f} MB): "
        f"{plural(counts.num_engines, 'engine')}, {plural(counts.num_iterations, 'iteration')}, "
        f"{plural(counts.num_requests, 'request')}, "
        f"{findings_text(counts)}"
        + (f"; {plural(num_bad, 'unreadable line')} skipped" if num_bad else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts, num_bad = convert(
            args.recordings, args.output, liveness_thresholds(args), args.engine
        )
    except TimelineError as error:
        print(f"iterscope timeline: {error}", file=sys.stderr)
        return 2
    print(summary(args.output, counts, num_bad))
    print(f"open it at {VIEWER_URL} (Open trace file; read in the browser, nothing is uploaded)")
    return 0
