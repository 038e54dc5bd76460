"""`iterscope explain RECORDING.jsonl [MORE.jsonl ...]`: episodes and a summary from a recording.

A recording is what the sidecar's JSONL sink writes: one message per line, the msgspec JSON of
an IterationRecord or Heartbeat (tagged arrays). It may span rotated files (``rec.jsonl.1``,
... are read along with ``rec.jsonl``) and several engines; messages are grouped by engine and
ordered by record time, so files can be given in any order, and a message read twice counts
once. Lines that do not decode (a line cut by a crash, another schema version) are
counted and skipped.

``--follow`` reads the files as the sidecar writes them (rotated files created meanwhile
included) and prints each episode as it appears (and again when it ends), so a running engine
can be watched live; it keeps a trailing window of the newest messages
(FOLLOW_WINDOW_MESSAGES).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import textwrap
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

from telemetry.episodes import INFO, Episode, Thresholds, detect_episodes
from telemetry.recording import RecordingReader, read_recording
from telemetry.summary import format_summary, summarize
from telemetry.timeline import NS_PER_S, EngineTimeline, build_timelines

WRAP_COLUMNS = 100


def read_timelines(paths: list[str | Path]) -> tuple[dict[int, EngineTimeline], int, int]:
    """(timelines by engine index, number of messages, number of unreadable lines).

    A file's rotated predecessors (``rec.jsonl.1``, ...) are read too."""
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"no such recording file: {', '.join(missing)}")
    messages, num_bad_lines = [], 0
    for item in read_recording(paths):
        if isinstance(item, str):
            num_bad_lines += 1
        else:
            messages.append(item)
    return build_timelines(messages), len(messages), num_bad_lines


# --------------------------------------------------------------------------------------------
# Text output


def clock_text(tl: EngineTimeline, ts_ns: int, with_date: bool = False) -> str:
    """Local wall time of a record time, or seconds from the start without a clock anchor."""
    if not tl.has_clock_anchor():
        return f"+{(ts_ns - tl.first_ns) / NS_PER_S:.3f} s"
    wall = datetime.datetime.fromtimestamp(tl.to_wall_ns(ts_ns) / NS_PER_S)
    text = wall.strftime("%Y-%m-%d %H:%M:%S.%f" if with_date else "%H:%M:%S.%f")
    return text[:-3]


def engine_header(tl: EngineTimeline) -> str:
    facts = tl.facts
    parts = [f"Engine {tl.engine_index}"]
    if facts.get("model_name"):
        parts.append(f"model {facts['model_name']} on {facts.get('device_name') or '?'}")
    if tl.num_kv_blocks_total:
        parts.append(f"{tl.num_kv_blocks_total} KV blocks x {facts.get('block_size', '?')} tokens")
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if facts.get(name):
            parts.append(f"{name} {facts[name]}")
    return ", ".join(parts)


def _wrapped(label: str, text: str) -> list[str]:
    indent = " " * 6
    return textwrap.wrap(
        text,
        WRAP_COLUMNS,
        initial_indent=f"{indent}{label:<10}",
        subsequent_indent=indent + " " * 10,
    )


def format_episode(tl: EngineTimeline, number: int, episode: Episode) -> list[str]:
    until = "(ongoing)" if episode.ongoing else clock_text(tl, episode.end_ns)
    lines = [
        f"  {number}. {clock_text(tl, episode.start_ns)} -> {until} "
        f"({episode.duration_time:.2f} s)  {episode.title}"
    ]
    lines += _wrapped("evidence", episode.evidence)
    lines += _wrapped("why", episode.explanation)
    lines += _wrapped("change", episode.setting)
    return lines


def format_engine(tl: EngineTimeline, episodes: list[Episode]) -> list[str]:
    lines = [engine_header(tl)]
    if tl.records or tl.heartbeats:
        lines.append(f"  recorded {clock_text(tl, tl.first_ns, with_date=True)} -> "
                     f"{clock_text(tl, tl.last_ns)}")
    lines += [f"  {line}" for line in format_summary(summarize(tl))]
    problems = [e for e in episodes if e.severity != INFO]
    lines.append("")
    if not problems:
        lines.append("  No problem found: no saturation, preemption storm, sustained waiting, "
                     "stall, leak, telemetry gap or latency spike.")
    lines.append(f"  Episodes ({len(episodes)}):" if episodes else "  Episodes: none")
    for number, episode in enumerate(episodes, 1):
        lines += format_episode(tl, number, episode)
    return lines


def episode_json(tl: EngineTimeline, episode: Episode) -> dict:
    data = asdict(episode)
    if tl.has_clock_anchor():
        data["start_wall_ns"] = tl.to_wall_ns(episode.start_ns)
        data["end_wall_ns"] = tl.to_wall_ns(episode.end_ns)
    return data


def report_json(timelines: dict[int, EngineTimeline], thresholds: Thresholds) -> dict:
    engines = []
    for tl in timelines.values():
        episodes = detect_episodes(tl, thresholds)
        engines.append({
            "engine_index": tl.engine_index,
            "facts": tl.facts,
            "summary": summarize(tl).to_dict(),
            "episodes": [episode_json(tl, e) for e in episodes],
        })
    return {"engines": engines}


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


def follow(paths: list[Path], thresholds: Thresholds, interval_time: float,
           max_time: float | None, out=sys.stdout, engine_index: int | None = None,
           window_messages: int = FOLLOW_WINDOW_MESSAGES) -> int:
    """Print episodes as they appear and when they end, until interrupted or max_time.

    Only the newest ``window_messages`` messages are kept and searched (see
    FOLLOW_WINDOW_MESSAGES), and the closing summary covers them only.
    """
    if window_messages < 1:
        raise ValueError(f"window_messages must be >= 1, got {window_messages}")
    reader = RecordingReader(paths)
    messages: deque = deque(maxlen=window_messages)  # (repeats are dropped by build_timelines)
    shown: dict[tuple, bool] = {}  # (engine, kind, start_ns) -> was ongoing when last shown
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
    for line in (line for tl in timelines.values() for line in
                 format_engine(tl, detect_episodes(tl, thresholds))):
        print(line, file=out)
    return 0


def _only_engine(timelines: dict[int, EngineTimeline], engine_index: int | None) -> dict:
    if engine_index is None:
        return timelines
    return {k: v for k, v in timelines.items() if k == engine_index}


def _show_new_episodes(timelines, thresholds, shown, out) -> None:
    for tl in timelines.values():
        episodes = detect_episodes(tl, thresholds)
        _mark_ongoing(tl, episodes)
        for episode in episodes:
            key = (tl.engine_index, episode.kind, episode.start_ns)
            if key in shown and (shown[key] == episode.ongoing or episode.ongoing):
                continue
            status = "ongoing" if episode.ongoing else ("ended" if key in shown else "new")
            shown[key] = episode.ongoing
            print(f"[engine {tl.engine_index}, {status}]", file=out)
            for line in format_episode(tl, len(shown), episode):
                print(line, file=out)
            out.flush()


# --------------------------------------------------------------------------------------------
# Command line


def parse_time(text: str) -> float:
    """'50ms', '2s', '1.5' (seconds) -> seconds."""
    text = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope explain",
        description="Find episodes (KV saturation, preemption storms, waiting, stalls, leaks, "
                    "idle, telemetry gaps, long prefill chunks) and summarise a recording.",
    )
    parser.add_argument("recordings", nargs="+", type=Path,
                        help="JSONL recording file(s) written by `iterscope sidecar --record`")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--plot", type=Path, metavar="OUT.png",
                        help="also draw KV usage, queues, tokens, iteration time; episodes shaded")
    parser.add_argument("--engine", type=int, help="only this engine index")
    parser.add_argument("--follow", action="store_true",
                        help="keep reading the files as they grow and print episodes live")
    parser.add_argument("--interval", type=parse_time, default=1.0,
                        help="how often --follow reads the files (default 1s)")
    parser.add_argument("--max-time", type=parse_time, default=None,
                        help="stop --follow after this long (default: until Ctrl-C)")
    parser.add_argument("--stall-after", type=parse_time, default=Thresholds.stall_min_time,
                        help="frozen loop with work queued for this long is a stall (default 2s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    thresholds = Thresholds(stall_min_time=args.stall_after)
    if args.follow:
        return follow(args.recordings, thresholds, args.interval, args.max_time,
                      engine_index=args.engine)
    try:
        timelines, num_messages, num_bad = read_timelines(args.recordings)
    except FileNotFoundError as error:
        print(f"iterscope explain: {error}", file=sys.stderr)
        return 2
    timelines = _only_engine(timelines, args.engine)
    if not timelines:
        print("iterscope explain: no telemetry message found in the recording", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report_json(timelines, thresholds), indent=2))
    else:
        print(f"iterscope explain: {len(args.recordings)} file(s), {num_messages} messages"
              f" ({num_bad} unreadable lines), {len(timelines)} engine(s)\n")
        for tl in timelines.values():
            print("\n".join(format_engine(tl, detect_episodes(tl, thresholds))) + "\n")
    if args.plot:
        from telemetry.plot import plot_timelines

        episodes = {k: detect_episodes(tl, thresholds) for k, tl in timelines.items()}
        plot_timelines(timelines, episodes, args.plot)
        print(f"plot written to {os.fspath(args.plot)}", file=sys.stderr)
    return 0
