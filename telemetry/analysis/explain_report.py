"""What `iterscope explain` prints for one engine: its text (header, ranked findings within one
screen, summary, every episode with --all) and the same as JSON for scripts.

The top finding is always shown whole within the first MAX_FINDING_LINES lines. The JSON keys
are what scripts read; they do not change with the text's wording.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict

from telemetry.analysis.actions import episode_action, finding_action
from telemetry.analysis.clock import clock_text, wall_clock_text
from telemetry.analysis.episodes import Episode, Thresholds, detect_episodes
from telemetry.analysis.findings import Finding, build_findings, cost_phrase
from telemetry.analysis.live_findings import finding_kind
from telemetry.analysis.summary import format_summary, summarize
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.words import not_reported, plural
from telemetry.lane.record import Heartbeat
from telemetry.lane.recording import SidecarNote, message_time_ns

WRAP_COLUMNS = 100


def engine_header(tl: EngineTimeline) -> str:
    facts = tl.facts
    parts = [f"Engine {tl.engine_index}"]
    if facts.get("model_name"):
        device = facts.get("device_name")
        parts.append(
            f"model {facts['model_name']} on {device}"
            if device
            else f"model {facts['model_name']}, device {not_reported(facts.get('source'))}"
        )
    if tl.num_kv_blocks_total:
        parts.append(f"{tl.num_kv_blocks_total} KV blocks x {facts.get('block_size', '?')} tokens")
    for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_schedule_interval"):
        if facts.get(name):
            parts.append(f"--{name.replace('_', '-')} {facts[name]}")
    if facts.get("num_speculative_tokens"):
        parts.append(f"speculating {facts['num_speculative_tokens']} tokens ahead")
    if facts.get("engine_version"):
        parts.append(f"{facts['engine_version']} ({facts.get('source', 'source not said')})")
    return ", ".join(parts)


def _wrapped(label: str, text: str, max_lines: int | None = None) -> list[str]:
    indent = " " * 6
    return textwrap.wrap(
        text,
        WRAP_COLUMNS,
        initial_indent=f"{indent}{label:<10}",
        subsequent_indent=indent + " " * 10,
        max_lines=max_lines,
        placeholder=" [...]",
        break_on_hyphens=False,  # flags (--max-num-seqs) stay whole, to be copied
    )


def format_episode(
    tl: EngineTimeline, number: int, episode: Episode, thresholds: Thresholds
) -> list[str]:
    """An episode with its evidence, why, and the change its live finding gave (an episode of
    waiting for the sequence limit said "raise it, KV had room" under a finding that said to
    keep it: the detector's generic setting, not the action)."""
    until = "(ongoing)" if episode.ongoing else clock_text(tl, episode.end_ns)
    lines = [
        f"  {number}. {clock_text(tl, episode.start_ns)} -> {until} "
        f"({episode.duration_time:.2f} s)  {episode.title}"
    ]
    lines += _wrapped("evidence", episode.evidence)
    lines += _wrapped("why", episode.explanation)
    lines += _wrapped("change", episode_action(tl, episode, thresholds))
    return lines


MAX_FINDING_LINES = 15  # the ranked findings fit on one screen above the summary
# A finding's block is its headline, 2 lines of its worst instance and its action: with the
# list's first line and a "... more" line, the top finding always fits whole.
MAX_ACTION_LINES = MAX_FINDING_LINES - 5


def headline(number: int, finding: Finding) -> str:
    """A finding in one line: what, how often, how long, what it cost."""
    cost = cost_phrase(finding.cost, finding.cost_label)
    return (
        f"  {number}. {finding.title}: {plural(finding.count, 'time')}, "
        f"{finding.total_time:.2f} s in all, {cost}"
    )


def format_finding(tl: EngineTimeline, number: int, finding: Finding, action: str) -> list[str]:
    """Headline, worst instance with its figures, and the action (wrapped)."""
    worst = finding.worst
    lines = [headline(number, finding)]
    lines += _wrapped(
        "worst",
        f"{clock_text(tl, worst.start_ns)} ({worst.duration_time:.2f} s): {worst.evidence}",
        max_lines=2,
    )
    lines += _wrapped("do", action, max_lines=MAX_ACTION_LINES)
    return lines


def format_findings(
    tl: EngineTimeline, findings: list[Finding], thresholds: Thresholds
) -> list[str]:
    """The findings in rank order (faults, then the costliest), in at most MAX_FINDING_LINES
    lines: whole while they fit (the first always, so the top finding is never cut), then
    the others' headlines while there is room, so every finding is named on the first screen
    as far as it goes."""
    if not findings:
        return [
            "  No problem found: no KV saturation or cliff, preemption storm, sustained "
            "waiting, stall, leak, telemetry gap, long prefill chunk, slowed decode or costly "
            "speculation.",
        ]
    num_episodes = sum(f.count for f in findings)
    order = (
        "faults first, then costliest first"
        if any(f.is_fault for f in findings)
        else "costliest first"
    )
    lines = [
        f"  {plural(len(findings), 'finding')} from {plural(num_episodes, 'episode')}, {order}:"
    ]
    shown = 0
    for finding in findings:
        block = format_finding(tl, shown + 1, finding, finding_action(tl, finding, thresholds))
        if len(lines) + len(block) > MAX_FINDING_LINES - 1 and shown:
            break
        lines += block
        shown += 1
    rest = findings[shown:]
    if rest:
        room = max(0, MAX_FINDING_LINES - 1 - len(lines))  # the last line is the pointer
        lines += [headline(number, f) for number, f in enumerate(rest[:room], shown + 1)]
        unnamed = len(rest) - min(room, len(rest))
        more = f"{plural(unnamed, 'more finding')}; " if unnamed else ""
        lines.append(f"  ... {more}--all lists every episode, with its evidence and action.")
    return lines


def _ends_mid_work(tl: EngineTimeline) -> list[str]:
    """Where the recording's last message has work in flight, that it stops mid-work (the
    findings alone, or "No problem found", read as the whole story of a run that ended
    there), and why, where the sidecar's notes after that message say it: the live sidecar
    found the engine dead (nothing came after, not even a heartbeat: EngineTimeline.
    death_at_end, its "Engine down" finding too), or it closed the recording while the engine
    still worked (the recording stopped); a death is said even of an idle engine. Without
    notes (a recording from before them) it cannot tell the two.
    Where the last message is a closing heartbeat, the engine closed its lane there: said so,
    and whether it was told to stop (a shutdown) or not (a failure)."""
    last = tl.last_message()
    if last is None:
        return []
    running, waiting = last.num_running_reqs, last.num_waiting_reqs
    if type(last) is Heartbeat and last.closing:  # the engine said it closed its lane
        return [_closed_lane_text(tl, last, running, waiting)]
    in_flight = f"{plural(running, 'request')} running and {waiting} waiting"
    death = tl.death_at_end()
    if death is not None:
        dead, closed = death
        silent_s = (dead.wall_ns - tl.to_wall_ns(message_time_ns(last))) / NS_PER_S
        until = f" before it closed the recording at {_wall_text(closed)}" if closed else ""
        return [
            f"  It ends with the engine's death: the live sidecar called it dead at "
            f"{_wall_text(dead)}, {silent_s:.1f} s after its last message (with {in_flight}), "
            f"and heard nothing more of it{until}: the process died or its lane broke (its "
            "log says which; the kernel's log, for the OOM killer)."
        ]
    if running + waiting == 0:
        return []
    closed = next((n for n in tl.notes_after(message_time_ns(last)) if n.closing), None)
    if closed is not None:
        return [
            f"  It ends mid-work, with {in_flight}: the sidecar stopped recording at "
            f"{_wall_text(closed)} while the engine was {closed.status} (not dead)."
        ]
    return [
        f"  It ends mid-work, with {in_flight}: the recording stopped (or is still being "
        "written) while the engine worked, or the engine died there (the sidecar's log says "
        "'Engine down' if it did)."
    ]


def _closed_lane_text(tl: EngineTimeline, last: Heartbeat, running: int, waiting: int) -> str:
    at = clock_text(tl, last.ts_ns)
    if running + waiting == 0:
        return f"  It ends as the engine closed its telemetry lane at {at}: a shutdown."
    closed = (
        f"  It ends as the engine closed its telemetry lane at {at} with "
        f"{plural(running, 'request')} running and {waiting} waiting"
    )
    if last.stop_requested:
        return f"{closed}: it was told to stop, and the shutdown cut them off."
    return (
        f"{closed}, not told to stop: its loop failed or its telemetry stopped (no token "
        "came for them after; the engine's log says which; the live sidecar called it "
        "dead)."
    )


def _wall_text(note: SidecarNote) -> str:
    return wall_clock_text(note.wall_ns / NS_PER_S)


def format_engine(
    tl: EngineTimeline, episodes: list[Episode], thresholds: Thresholds, show_all: bool = False
) -> list[str]:
    """Header, ranked findings, summary; with show_all every episode in time order after."""
    lines = [engine_header(tl)]
    if tl.records or tl.heartbeats:
        lines.append(
            f"  recorded {clock_text(tl, tl.first_ns, with_date=True)} -> "
            f"{clock_text(tl, tl.last_ns)}"
        )
    lines += format_findings(tl, build_findings(tl, episodes, thresholds), thresholds)
    lines += _ends_mid_work(tl)
    lines.append("")
    lines += [f"  {line}" for line in format_summary(summarize(tl))]
    if show_all:
        lines.append("")
        lines.append(f"  Episodes ({len(episodes)}):" if episodes else "  Episodes: none")
        for number, episode in enumerate(episodes, 1):
            lines += format_episode(tl, number, episode, thresholds)
    return lines


def episode_json(tl: EngineTimeline, episode: Episode) -> dict:
    data = asdict(episode)
    if tl.has_clock_anchor():
        data["start_wall_ns"] = tl.to_wall_ns(episode.start_ns)
        data["end_wall_ns"] = tl.to_wall_ns(episode.end_ns)
    return data


def finding_json(tl: EngineTimeline, finding: Finding, thresholds: Thresholds) -> dict:
    return {
        "kind": finding.kind,
        # the kind as the live sidecar, /metrics and the alerts name it (waiting_kv, dead...)
        "live_kind": finding_kind(finding.worst),
        "title": finding.title,
        "count": finding.count,
        "total_time_s": finding.total_time,
        "cost_request_s": finding.cost,
        "cost_label": finding.cost_label,
        "action": finding_action(tl, finding, thresholds),
        "worst": episode_json(tl, finding.worst),
    }


def report_json(timelines: dict[int, EngineTimeline], thresholds: Thresholds) -> dict:
    engines = []
    for tl in timelines.values():
        episodes = detect_episodes(tl, thresholds)
        engines.append(
            {
                "engine_index": tl.engine_index,
                "facts": tl.facts,
                "summary": summarize(tl).to_dict(),
                "findings": [
                    finding_json(tl, f, thresholds)
                    for f in build_findings(tl, episodes, thresholds)
                ],
                "episodes": [episode_json(tl, e) for e in episodes],
            }
        )
    return {"engines": engines}
