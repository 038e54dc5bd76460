"""`iterscope explain RECORDING.jsonl [MORE.jsonl ...]`: episodes and a summary from a recording.

A recording is what the sidecar's JSONL sink writes: one message per line, the msgspec JSON of
an IterationRecord or Heartbeat (tagged arrays). It may span rotated files (``rec.jsonl.1``,
... are read along with ``rec.jsonl``) and several engines; messages are grouped by engine and
ordered by record time, so files can be given in any order, and a message read twice counts
once. Lines that do not decode (a line cut by a crash, another schema version) are
counted and skipped. Dynamo's FPM recordings are read too (telemetry/sources/fpm_taps.py),
with lines saying how they were captured and what their iteration times are
(telemetry/analysis/fpm_recording.py).

``--follow`` reads the files as the sidecar writes them (rotated files created meanwhile
included) and prints each episode as it appears (and again when it ends), so a running engine
can be watched live; a repeat of a condition that comes and goes is one line, as the
sidecar's log folds it (live_findings.follows_closely). It keeps a trailing window of the
newest messages (FOLLOW_WINDOW_MESSAGES).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from telemetry.analysis.cli_time import parse_time
from telemetry.analysis.episodes import Episode, Thresholds, detect_episodes
from telemetry.analysis.explain_report import format_engine, format_episode, report_json
from telemetry.analysis.fpm_recording import (
    add_fpm_producer_argument,
    capture_json,
    capture_lines,
    wall_time_line,
)
from telemetry.analysis.live_findings import ALWAYS_SAID, PROMOTE_AFTER_S, follows_closely
from telemetry.analysis.liveness_flags import add_liveness_arguments, liveness_thresholds
from telemetry.analysis.timeline import (
    EngineTimeline,
    build_timelines,
    nothing_to_read,
    read_timelines,
)
from telemetry.analysis.words import plural
from telemetry.lane.recording import RecordingReader
from telemetry.sources.fpm_taps import is_tap

# --------------------------------------------------------------------------------------------
# Follow mode

# The trailing window --follow keeps, and searches again after every read that brought new
# messages: at 100 iterations per second that is about 8 minutes of one engine, about 35 MB of
# messages (measured ~0.7 KB each with milestones). Every detector needs far less history
# (seconds). An episode that began before the window is seen from the window's start on, so it
# is printed again, as new, with that later start.
FOLLOW_WINDOW_MESSAGES = 50_000


def _mark_ongoing(tl: EngineTimeline, episodes: list[Episode]) -> None:
    """An episode that lasts up to the newest message may still be going on."""
    for episode in episodes:
        episode.ongoing = episode.ongoing or episode.end_ns >= tl.last_ns


def follow(
    paths: list[Path],
    thresholds: Thresholds,
    interval_time: float,
    max_time: float | None,
    out=sys.stdout,
    engine_index: int | None = None,
    window_messages: int = FOLLOW_WINDOW_MESSAGES,
) -> int:
    """Print episodes as they appear and when they end, until interrupted or max_time.

    Only the newest ``window_messages`` messages are kept and searched (see
    FOLLOW_WINDOW_MESSAGES), and the closing summary covers them only.
    """
    if window_messages < 1:
        raise ValueError(f"window_messages must be >= 1, got {window_messages}")
    reader = RecordingReader(paths)
    messages: deque = deque(maxlen=window_messages)  # (repeats are dropped by build_timelines)
    shown: dict[tuple, Shown] = {}  # (engine, kind, start_ns) -> what was printed of it
    deadline = None if max_time is None else time.monotonic() + max_time
    print(f"following {', '.join(map(str, paths))} (Ctrl-C to stop)", file=out, flush=True)
    try:
        while deadline is None or time.monotonic() < deadline:
            new_messages = reader.read_new()
            if new_messages:
                messages.extend(new_messages)
                timelines = _only_engine(build_timelines(messages), engine_index)
                _show_new_episodes(timelines, thresholds, shown, out)
            time.sleep(interval_time)
    except KeyboardInterrupt:
        pass
    timelines = _only_engine(build_timelines(messages), engine_index)
    for line in (
        line
        for tl in timelines.values()
        for line in format_engine(tl, detect_episodes(tl, thresholds), thresholds)
    ):
        print(line, file=out)
    return 0


def _only_engine(timelines: dict[int, EngineTimeline], engine_index: int | None) -> dict:
    if engine_index is None:
        return timelines
    return {k: v for k, v in timelines.items() if k == engine_index}


@dataclass
class Shown:
    """What --follow printed of an episode: whether it was ongoing then, where it ended, and
    whether it was a repeat, said in its first line only."""

    ongoing: bool
    end_ns: int
    brief: bool


def _is_repeat(shown: dict[tuple, Shown], key: tuple, episode: Episode) -> bool:
    """One of its kind is ongoing, or the last one ended just before it (follows_closely)."""
    engine_index, kind, _ = key
    same = [s for k, s in shown.items() if k[0] == engine_index and k[1] == kind]
    if any(s.ongoing for s in same):
        return kind not in ALWAYS_SAID
    last_end_ns = max((s.end_ns for s in same), default=None)
    return follows_closely(kind, episode.start_ns, last_end_ns)


def _news(before: Shown | None, episode: Episode, is_repeat: bool) -> tuple[str, bool] | None:
    """What --follow says of ``episode`` now, as (status, brief), or None: nothing new. A
    repeat is said once, briefly, unless it lasts PROMOTE_AFTER_S (then in full, as the
    sidecar's log does)."""
    if before is None:
        return ("ongoing" if episode.ongoing else "new"), is_repeat
    if before.brief and episode.duration_time >= PROMOTE_AFTER_S:
        return ("ongoing" if episode.ongoing else "ended"), False
    if episode.ongoing or before.ongoing == episode.ongoing or before.brief:
        return None
    return "ended", False


def _show_new_episodes(timelines, thresholds, shown: dict[tuple, Shown], out) -> None:
    """Each new episode in full, and again when it ends; a repeat (a condition that comes and
    goes) in one line when it appears, its details being those of the one before."""
    for tl in timelines.values():
        episodes = detect_episodes(tl, thresholds)
        _mark_ongoing(tl, episodes)
        for episode in episodes:
            key = (tl.engine_index, episode.kind, episode.start_ns)
            before = shown.get(key)
            news = _news(before, episode, before is None and _is_repeat(shown, key, episode))
            brief = news[1] if news else before.brief
            shown[key] = Shown(episode.ongoing, episode.end_ns, brief)
            if news is None:
                continue
            status, brief = news
            lines = format_episode(tl, len(shown), episode)
            print(f"[engine {tl.engine_index}, {'again' if brief else status}]", file=out)
            for line in lines[:1] if brief else lines:
                print(line, file=out)
            out.flush()


# --------------------------------------------------------------------------------------------
# Command line


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
        type=Path,
        metavar="OUT.png",
        help="also draw KV usage, queues, tokens, iteration time; episodes shaded",
    )
    parser.add_argument("--engine", type=int, help="only this engine index")
    add_fpm_producer_argument(parser)
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep reading the files as they grow and print episodes live",
    )
    parser.add_argument(
        "--interval",
        type=parse_time,
        default=1.0,
        help="how often --follow reads the files (default 1s)",
    )
    parser.add_argument(
        "--max-time",
        type=parse_time,
        default=None,
        help="stop --follow after this long (default: until Ctrl-C)",
    )
    add_liveness_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    thresholds = liveness_thresholds(args)
    if args.follow:
        if any(p.is_file() and is_tap(p) for p in args.recordings):
            print("iterscope explain: --follow reads iterscope's recordings only", file=sys.stderr)
            return 2
        return follow(
            args.recordings, thresholds, args.interval, args.max_time, engine_index=args.engine
        )
    try:
        timelines, num_messages, num_bad = read_timelines(args.recordings, args.fpm_producer)
    except (FileNotFoundError, ValueError) as error:
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
        plot_timelines(timelines, episodes, args.plot)
        print(f"plot written to {os.fspath(args.plot)}", file=sys.stderr)
    return 0
