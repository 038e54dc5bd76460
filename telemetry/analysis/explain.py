"""`iterscope explain RECORDING.jsonl [MORE.jsonl ...]`: episodes and a summary from a recording.

A recording is what the sidecar's JSONL sink writes: one message per line, the msgspec JSON of
an IterationRecord or Heartbeat (tagged arrays), and the sidecar's notes (SidecarNote: an
engine it found dead, its status as the recording closed). It may span rotated files
(``rec.jsonl.1``, ... are read along with ``rec.jsonl``) and several engines; messages are
grouped by engine and ordered by record time, so files can be given in any order, and a
message read twice counts once. Lines that do not decode (a line cut by a crash, another
schema version) are counted and skipped. Dynamo's FPM recordings are read too
(telemetry/sources/fpm_taps.py), with lines saying how they were captured and what their
iteration times are (telemetry/analysis/fpm_recording.py).

``iterscope explain --follow`` reads the files as the sidecar writes them and prints what the
live sidecar printed, through its own ingest, live findings and log: the command
(telemetry/sidecar/explain_command.py) adds that to this module's flags, in the sidecar's
layer, which this one never imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from telemetry.analysis.episodes import detect_episodes
from telemetry.analysis.explain_report import format_engine, report_json
from telemetry.analysis.fpm_recording import (
    add_fpm_producer_argument,
    capture_json,
    capture_lines,
    wall_time_line,
)
from telemetry.analysis.liveness_flags import add_liveness_arguments, liveness_thresholds
from telemetry.analysis.timeline import (
    EngineTimeline,
    nothing_to_read,
    read_timelines,
)
from telemetry.analysis.words import plural
from telemetry.sources.fpm_taps import is_tap


def fpm_taps(paths: list[Path]) -> list[Path]:
    """Which of ``paths`` are Dynamo's FPM recordings (read here; not by --follow)."""
    return [path for path in paths if path.is_file() and is_tap(path)]


def _only_engine(timelines: dict[int, EngineTimeline], engine_index: int | None) -> dict:
    if engine_index is None:
        return timelines
    return {k: v for k, v in timelines.items() if k == engine_index}


# --------------------------------------------------------------------------------------------
# Command line

PLOT_FORMATS = (".png", ".svg", ".pdf")


def plot_path(text: str) -> Path:
    """Where --plot writes: a file of a format it draws, in a folder that exists."""
    path = Path(text)
    if path.suffix.lower() not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending {', '.join(PLOT_FORMATS)}, got {text!r}"
        )
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"there is no folder {str(folder)!r} for {text!r}")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope explain",
        description="Find episodes (KV saturation, preemption storms, waiting, stalls, leaks, "
        "idle, telemetry gaps, long prefill chunks) and summarise a recording.",
    )
    parser.add_argument(
        "recordings",
        nargs="+",
        type=Path,
        help="JSONL recording file(s) written by `iterscope sidecar --record`",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list every episode in time order, with its explanation",
    )
    parser.add_argument(
        "--plot",
        type=plot_path,
        metavar="OUT.png",
        help="also draw KV usage, queues, tokens, iteration time; episodes shaded",
    )
    parser.add_argument("--engine", type=int, help="only this engine index")
    add_fpm_producer_argument(parser)
    add_liveness_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The analysis of ``args.recordings`` (build_parser's flags), printed; the exit status."""
    thresholds = liveness_thresholds(args)
    try:
        timelines, num_messages, num_bad = read_timelines(args.recordings, args.fpm_producer)
    except (OSError, ValueError) as error:
        print(f"iterscope explain: {error}", file=sys.stderr)
        return 2
    chosen = _only_engine(timelines, args.engine)
    if not chosen:
        why = nothing_to_read(timelines, num_bad, args.engine)
        print(f"iterscope explain: {why}", file=sys.stderr)
        return 2  # input it cannot use, as an unreadable file (and timeline, tune)
    timelines = chosen
    capture = next(iter(timelines.values())).capture
    if args.json:
        report = report_json(timelines, thresholds)
        if capture is not None:
            report["fpm_recording"] = capture_json(capture, list(timelines.values()))
        print(json.dumps(report, indent=2))
    else:
        print(
            f"iterscope explain: {plural(len(args.recordings), 'file')}, "
            f"{plural(num_messages, 'message')} ({plural(num_bad, 'unreadable line')}), "
            f"{plural(len(timelines), 'engine')}\n"
        )
        if capture is not None:
            print("\n".join(capture_lines(capture, list(timelines.values()))) + "\n")
        for tl in timelines.values():
            episodes = detect_episodes(tl, thresholds)
            lines = format_engine(tl, episodes, thresholds, args.all)
            time_line = wall_time_line(tl)
            print("\n".join(lines + ([f"  note: {time_line}"] if time_line else [])) + "\n")
    if args.plot:
        from telemetry.analysis.plot import plot_timelines

        episodes = {k: detect_episodes(tl, thresholds) for k, tl in timelines.items()}
        try:
            plot_timelines(timelines, episodes, thresholds, args.plot)
        except OSError as error:
            print(f"iterscope explain: cannot write --plot {args.plot}: {error}", file=sys.stderr)
            return 1
        print(f"plot written to {os.fspath(args.plot)}", file=sys.stderr)
    return 0
