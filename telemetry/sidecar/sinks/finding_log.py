"""The live findings' log lines, with a condition that comes and goes folded into one line.

KV usage swinging around 95%, or a long prefill chunk every few seconds, opens and closes a
finding each time: each is a finding of its own on /findings, /metrics and in `explain`
(which groups them by kind: "KV cache saturated: 14 times"), but a WARNING and an INFO for
every one of them would drown the log (83 lines in 40 s of a vLLM run with a small cache).
So, per engine and kind:

- a finding prints as it happens: a WARNING when it opens (what, since when, the evidence,
  the action; INFO for a long prefill that cost under PROMOTE_COST request-seconds: on a CPU
  each 100-token prompt beside a decoding request is one), an INFO when it closes (how long,
  what it cost); a waiting finding whose main
  reason changes prints a WARNING with its new title and action, at most once in
  REPEAT_WINDOW_S;
- unless it opens while one of its kind is open, or within REPEAT_WINDOW_S of the end of
  the kind's previous one: a repeat prints nothing of its own; the repeats are summed and
  said in one WARNING (how many, since when, time and cost in all, the newest action), at the
  first log window that closes REPEAT_WINDOW_S or more after the kind's last line, and at the
  sidecar's exit. A condition that keeps coming back thus prints a line every half minute,
  and one after it stopped;
- but a repeat still open PROMOTE_AFTER_S after it began, or that already cost PROMOTE_COST
  request-seconds and twice what the kind's last said finding cost, is no flicker: at the
  next log window's close it is said as any finding is (its WARNING then, its INFO when it
  closes), so a long or costly episode is never left unsaid while it lasts behind a small one
  said first.

Faults (an engine stalled, spinning or dead, a KV leak) always print: each one matters.
Decisions follow record time (the findings' engine times and the log clock), not the
sidecar's clock, so a replay folds what it finds as the live run did (when a finding opens
may differ by a search: the window is searched about once a second of the sidecar's clock).
A finding whose engine had no clock anchor yet (no heartbeat) is never folded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from telemetry.analysis.findings import cost_phrase
from telemetry.analysis.live_findings import (
    ALWAYS_SAID,
    PROMOTE_AFTER_S,
    PROMOTE_COST,
    REPEAT_WINDOW_S,
    FindingEvent,
    LiveFinding,
    follows_closely,
)
from telemetry.analysis.timeline import NS_PER_S

Line = tuple[int, str]  # (logging level, text)


def clock_text(wall_ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall_ns / 1e9)) if wall_ns else "?"


def end_wall_ns(finding: LiveFinding) -> int:
    return finding.start_wall_ns + finding.end_ns - finding.start_ns if finding.start_wall_ns else 0


def _with_word(cost: str) -> str:
    """``cost 4.0 request-s waiting``; ``cost not measurable`` as it is."""
    return cost if cost.startswith("cost ") else f"cost {cost}"


# Kinds said at INFO, not WARNING, while they cost under PROMOTE_COST request-seconds (a
# finding, or a repeats' line in all): on a CPU a 100-token prompt beside one decoding request
# stretches its token by 0.1 s, and the long-prefill WARNINGs came every 30 s of healthy load
# (QA, vLLM 0.32); a slowed decode's blips on a loaded CPU host came as WARNINGs of 0.3
# request-s. /findings, /metrics and explain list them as before.
QUIET_KINDS = frozenset(("long_prefill", "slow_decode"))


def finding_line(event: FindingEvent) -> Line:
    """A live finding's opening or change (WARNING; INFO for a kind of QUIET_KINDS that cost
    under PROMOTE_COST) or closing (INFO) line."""
    finding = event.finding
    head = f"Engine {finding.engine_index:03d}: {finding.title}"
    since = clock_text(finding.start_wall_ns)
    where = f"iteration {finding.iteration}, " if finding.iteration else ""
    cost = cost_phrase(finding.cost, finding.cost_label)
    if event.what != "closed":
        was = f'until now "{event.previous[1]}"; ' if event.what == "changed" else ""
        quiet = finding.kind in QUIET_KINDS and finding.cost < PROMOTE_COST
        return logging.INFO if quiet else logging.WARNING, (
            f"{head} since {since} ({was}{where}{finding.duration_s:.1f} s so far, {cost}): "
            f"{finding.evidence}. Action: {finding.action}"
        )
    lower_bound = " at least (it outlasted the window)" if finding.truncated else ""
    restarted = ": the engine restarted (a new process)" if finding.restarted else ""
    return logging.INFO, (
        f"{head}: ended after {finding.duration_s:.1f} s (since {since}){restarted}, "
        f"{_with_word(cost)}{lower_bound}"
    )


@dataclass
class Repeats:
    """One engine's findings of one kind: when the last ended, the repeats not said yet."""

    last_end_ns: int | None = None  # engine time: the end of the newest one closed
    last_line_wall_ns: int = 0  # when the kind's last line was about (wall time)
    said: set[int] = field(default_factory=set)  # id() of those open now that were said
    folded: dict[int, LiveFinding] = field(default_factory=dict)  # the repeats open now, by id
    num_closed: int = 0  # repeats closed since the last line
    duration_s: float = 0.0
    cost: float = 0.0
    first_start_wall_ns: int = 0
    last_closed: LiveFinding | None = None
    said_cost: float = 0.0  # what the kind's last said finding cost, at its close

    def is_repeat(self, finding: LiveFinding) -> bool:
        """One of its kind is open, or ended less than REPEAT_WINDOW_S before it began."""
        if finding.kind in ALWAYS_SAID or not finding.start_wall_ns:
            return False
        if self.said or self.folded:
            return True
        return follows_closely(finding.kind, finding.start_ns, self.last_end_ns)

    def add_closed(self, finding: LiveFinding) -> None:
        if not self.num_closed:
            self.first_start_wall_ns = finding.start_wall_ns
        self.num_closed += 1
        self.duration_s += finding.duration_s
        self.cost += finding.cost
        self.last_closed = finding

    def promote(self) -> list[Line]:
        """The open repeats that lasted PROMOTE_AFTER_S, or cost PROMOTE_COST and twice what
        the last said one of the kind did: said now, and from now on as any."""
        costly = max(PROMOTE_COST, 2 * self.said_cost)
        lasting = [
            finding
            for finding in self.folded.values()
            if not finding.closed
            and (finding.duration_s >= PROMOTE_AFTER_S or finding.cost >= costly)
        ]
        for finding in lasting:
            del self.folded[id(finding)]
            self.said.add(id(finding))
        return [finding_line(FindingEvent("opened", finding)) for finding in lasting]

    def summary(self) -> Line:
        """The repeats closed since the kind's last line, in one WARNING (INFO for a kind of
        QUIET_KINDS whose repeats cost under PROMOTE_COST in all)."""
        last = self.last_closed
        assert last is not None
        times = "1 more time" if self.num_closed == 1 else f"{self.num_closed} more times"
        now = ", one open now" if self.folded else ""
        text = (
            f"Engine {last.engine_index:03d}: {last.title} again: {times} since "
            f"{clock_text(self.first_start_wall_ns)} (the last ended "
            f"{clock_text(end_wall_ns(last))}{now}), {self.duration_s:.1f} s in all, "
            f"{_with_word(cost_phrase(self.cost, last.cost_label))}. Action: {last.action}"
        )
        quiet = last.kind in QUIET_KINDS and self.cost < PROMOTE_COST
        self.num_closed, self.duration_s, self.cost = 0, 0.0, 0.0
        return logging.INFO if quiet else logging.WARNING, text


class FindingLog:
    """The lines to print for live findings, repeats folded (see the module docstring)."""

    def __init__(self) -> None:
        self._repeats: dict[tuple[int, str], Repeats] = {}
        # id() of each said finding whose change was said -> its end then (engine time)
        self._change_said_ns: dict[int, int] = {}

    def on_finding(self, event: FindingEvent) -> list[Line]:
        finding = event.finding
        repeats = self._repeats.setdefault((finding.engine_index, finding.kind), Repeats())
        if event.what == "changed":
            return self._on_change(event, repeats)
        if event.what == "opened":
            if repeats.is_repeat(finding):
                repeats.folded[id(finding)] = finding
                return []
            repeats.said.add(id(finding))
            repeats.last_line_wall_ns = finding.start_wall_ns
            return [finding_line(event)]
        if repeats.last_end_ns is None or finding.end_ns > repeats.last_end_ns:
            repeats.last_end_ns = finding.end_ns  # of those closed, the one that ended last
        repeats.said.discard(id(finding))
        self._change_said_ns.pop(id(finding), None)
        if repeats.folded.pop(id(finding), None) is not None:
            repeats.add_closed(finding)
            return []
        repeats.said_cost = finding.cost
        repeats.last_line_wall_ns = end_wall_ns(finding)
        return [finding_line(event)]

    def _on_change(self, event: FindingEvent, repeats: Repeats) -> list[Line]:
        """A waiting finding's main reason changed: it moves to its new kind's repeats. Said
        if it was said, or if it was folded as a repeat of its old kind but is none of its
        new kind (a waiting stretch opened as a repeat of the sequence limit's and became
        the token budget's was said 15 s late), at most once in REPEAT_WINDOW_S (a share
        near half can flip at every search); its closing line names the reason it ended
        with."""
        finding, key = event.finding, id(event.finding)
        before = self._repeats.setdefault((finding.engine_index, event.previous[0]), Repeats())
        if before.folded.pop(key, None) is not None:
            if repeats.is_repeat(finding):  # a repeat of its new kind too: still folded
                repeats.folded[key] = finding
                return []
            # no repeat of its new kind: said now, as it would have been had it opened so
        before.said.discard(key)
        repeats.said.add(key)
        said_ns = self._change_said_ns.get(key)
        if said_ns is not None and finding.end_ns - said_ns < REPEAT_WINDOW_S * NS_PER_S:
            return []
        self._change_said_ns[key] = finding.end_ns
        return [finding_line(event)]

    def forget(self, engine_index: int) -> list[Line]:
        """An engine no longer tracked: its repeats not said yet, and nothing kept of it
        (its open findings never close; a new engine under its index starts afresh)."""
        keys = [key for key in self._repeats if key[0] == engine_index]
        lines = [self._repeats[key].summary() for key in keys if self._repeats[key].num_closed]
        for key in keys:
            del self._repeats[key]
        return lines

    def due(self, now_wall_ns: int) -> list[Line]:
        """The lines to say at a log window's close: repeats open PROMOTE_AFTER_S, each on
        its own; the sums of kinds whose last line is REPEAT_WINDOW_S old."""
        lines = []
        for repeats in self._repeats.values():
            promoted = repeats.promote()
            if promoted:
                repeats.last_line_wall_ns = now_wall_ns
            lines += promoted
            old = now_wall_ns - repeats.last_line_wall_ns >= REPEAT_WINDOW_S * NS_PER_S
            if repeats.num_closed and old:
                lines.append(repeats.summary())
                repeats.last_line_wall_ns = now_wall_ns
        return lines

    def flush(self) -> list[Line]:
        """Every repeat not said yet (at the sidecar's exit)."""
        return [repeats.summary() for repeats in self._repeats.values() if repeats.num_closed]
