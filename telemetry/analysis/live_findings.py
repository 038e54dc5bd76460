"""Findings while they happen: `explain`'s own detectors, run by the sidecar over a bounded
window of each engine's newest messages (and by its replay of a recording, the same way).

One implementation of each rule: the window is searched with the episode detectors `explain`
runs over a whole recording (telemetry/analysis/episodes), costed with its cost rule and given
its action (telemetry/analysis/findings.py, actions.py). Two findings come from the sidecar's
engine status instead, itself decided by the rule `explain` replays (stall_rule.py): a stall
(no progress while work is in flight) and a dead engine (no message at all). A silence that
`explain` finds once the engine speaks again is that dead finding, seen as it happened.

A finding opens when its episode first appears in the window (each detector's minimum time or
count is its minimum: 10 iterations of KV >= 95%, waiting for 1 s and 10 iterations, ...) and
closes when the episode stopped growing for as long as `explain` would still merge a new
stretch into it (close_after: records and seconds per kind; a slowed decode's when its
slowdown is over), so one condition opens one finding. Requests waiting are one condition
whatever holds them: explain names its waiting episode by the main reason so far, so where
that changes, the open finding changes kind with it (a "changed" event, its action drawn
anew), rather than a second finding over the same waiting.
A closed finding that its episode later extends is not opened again: its cost is final.

Bounded memory, whatever the run's length: the window holds the newest WINDOW_MESSAGES
messages at most (the sidecar's --findings-window); it keeps LOOKBACK_S of history, and more
while a finding is open (back to its start) or a slowed decode goes on (back to the pace before
it: _keep_pace), so a finding is costed as `explain` costs it
unless it outlasts the window (then its cost is that of its newest part, a lower bound:
``truncated``). An engine whose messages come faster than the window holds LOOKBACK_S of them
is said once (``short_window_notice``): what is judged on the past may then not open live, and
actions are drawn from less of it; the window's span is a metric. An iteration judged on the
records before it (a long prefill, speculation's acceptance, a costly drafts step's fit:
HISTORY_JUDGED_KINDS) is judged first as it comes, with all that past in the window; judged
again later, on a past the window has partly dropped, it opens no finding. Searching costs time in
proportion to the window: an engine's window is searched every EVALUATE_INTERVAL_S at most,
and all engines' searches together take no more than MAX_EVALUATE_SHARE of the time (each
engine's next search waits as long as its last one took, times the number of engines, divided
by that share).

Invariant: one thread (the sidecar's ingest thread) calls everything here; a reader on another
thread (a /findings request, a scrape) reads ``snapshot``, a tuple built whole then swapped,
and ``totals``; the findings in it are updated in place, one number at a time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from telemetry.analysis.actions import (
    ACTION_HISTORY_S,
    SLOWED_FIRST_TEXT,
    episode_action,
    reads_whole_episode,
)
from telemetry.analysis.episodes import (
    INFO,
    Episode,
    Thresholds,
    detect_costly_drafts,
    detect_futile_speculation,
    detect_idle,
    detect_kv_cliff,
    detect_kv_leaks,
    detect_kv_saturation,
    detect_long_prefill,
    detect_preemption_storms,
    detect_slow_decode,
    detect_telemetry_gaps,
    detect_waiting,
    note_slowed_queues,
    search_slow_decode,
    secs,
)
from telemetry.analysis.episodes.kv import LEAK_MAX_GAP
from telemetry.analysis.episodes.liveness import (
    SILENCE_SETTING,
    detect_spinning,
    in_flight_text,
    stall_setting,
    work_text,
)
from telemetry.analysis.findings import (
    COST_LABELS,
    EVICTING_KINDS,
    FAULT_KINDS,
    episode_cost,
    eviction_baseline_row,
    is_silence,
    rank_key,
)
from telemetry.analysis.stall_rule import STALL_STEP_CAP_S
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.window_timeline import WindowTimeline
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.lane.recording import message_time_ns

WINDOW_MESSAGES = 20_000  # per engine: ~200 s at 100 iterations per second
MESSAGE_BYTES = 1000  # about what a message takes in the window: decoded, and in its columns
# History kept with no finding open: a leak's minute, and the past an iteration is judged on
# (a long prefill's baseline time, a futile speculation's window, a costly drafts step's window
# and the step: 40 s at most) with JUDGE_WITHIN_S to spare, so that an iteration first searched
# within that long of its record is judged on all explain judges it on.
LOOKBACK_S = 60.0
JUDGE_WITHIN_S = 20.0
EVALUATE_INTERVAL_S = 1.0
MAX_EVALUATE_SHARE = 0.1
RECENT_CLOSED = 32  # closed findings kept per engine, for /findings

# explain's detectors over the window; stalls from heartbeats and silences are the status's.
# Slowed decode's is run as search_slow_decode, which also says the pace it keeps (_keep_pace).
WINDOW_DETECTORS = (
    detect_kv_saturation,
    detect_kv_cliff,
    detect_preemption_storms,
    detect_waiting,
    detect_spinning,
    detect_kv_leaks,
    detect_telemetry_gaps,
    detect_long_prefill,
    detect_costly_drafts,
    detect_futile_speculation,
)
assert detect_idle not in WINDOW_DETECTORS  # information, never a finding
assert detect_slow_decode not in WINDOW_DETECTORS

STALL = "stall"
SPINNING = "spinning"
DEAD = "dead"
# Every kind a live finding can have (finding_kind, and the two from the status).
FINDING_KINDS = (
    "kv_saturation",
    "kv_cliff",
    "preemption_storm",
    "waiting_kv",
    "waiting_seq_limit",
    "waiting_budget",
    "waiting_other",
    "waiting",
    "long_prefill",
    "slow_decode",
    "costly_drafts",
    "futile_speculation",
    "kv_leak",
    "stall",
    "spinning",
    "dead",
    "telemetry_gap",
)
WAITING_KINDS = frozenset(kind for kind in FINDING_KINDS if kind.startswith("waiting"))
STATUS_KINDS = {"stalled": STALL, "dead": DEAD}  # the sidecar's engine status -> finding kind
# Kinds whose iterations are each judged on the records before them (the window's history):
# one judged again once the window has dropped part of its past is judged on less than explain
# judges it on, and opens no finding of its own (_judged_in_full). Every other kind is judged on
# its own stretch of records.
HISTORY_JUDGED_KINDS = frozenset(
    ("long_prefill", "slow_decode", "futile_speculation", "costly_drafts")
)
# Kinds whose episodes explain merges with an iteration that starts within close_after's
# seconds of their end (episodes.group_by_time over iteration spans). A slowed decode's is
# one slowdown instead (_has_ended).
SPAN_MERGED_KINDS = frozenset(("long_prefill", "costly_drafts", "futile_speculation"))

# A condition that comes and goes (KV usage around 95%, a long prefill every few seconds) is
# one finding or episode each time; where they are printed as they come (the sidecar's log,
# `explain --follow`), one of a kind that follows the last closely is said briefly: a repeat.
# Faults always count on their own.
REPEAT_WINDOW_S = 30.0
PROMOTE_AFTER_S = 10.0  # a repeat that lasts this long is no flicker: said in full
# so is one that costs this much (request-seconds) and twice what the last one said cost
PROMOTE_COST = 1.0
ALWAYS_SAID = frozenset((*FAULT_KINDS, STALL, SPINNING, DEAD))


def follows_closely(kind: str, start_ns: int, last_end_ns: int | None) -> bool:
    """A repeat: of a kind that is not a fault, starting within REPEAT_WINDOW_S after the end
    of the last one of its kind (None: none yet)."""
    return (
        kind not in ALWAYS_SAID
        and last_end_ns is not None
        and 0 <= start_ns - last_end_ns <= REPEAT_WINDOW_S * NS_PER_S
    )


def close_after(kind: str, th: Thresholds) -> tuple[int, float, bool]:
    """(records, seconds, idle ends it) for an episode of ``kind``: its finding closes after
    that many records and seconds past its last row without growth, as long as `explain`
    would still merge a new stretch into it; and, where the third is true, as soon as a
    heartbeat says nothing waits or runs (KV saturation and a leak are about the cache, which
    an idle engine does not change)."""
    if kind == "waiting":
        return 3, 0.0, True  # true_runs(max_gap=2)
    if kind == "kv_saturation":
        return 3, 0.0, False
    if kind == "kv_leak":  # a leak's excess dips while requests run: a minute without growth
        return LEAK_MAX_GAP + 1, LOOKBACK_S, False
    if kind in ("preemption_storm", "long_prefill", "telemetry_gap"):
        return 1, max(th.storm_window_time, th.gap_merge_time), True
    if kind in ("costly_drafts", "futile_speculation"):  # up to idle_min_time apart: one
        return 1, th.idle_min_time, True
    return 1, 0.0, True  # a KV cliff, a spinning stall: one row without it


def finding_kind(episode: Episode) -> str:
    """The finding's kind as /metrics and alerts name it: the episode's kind, and for waiting
    the reason (``waiting_kv``, ``waiting_seq_limit``, ``waiting_budget``, ``waiting_other``;
    plain ``waiting`` when the source says no reason); ``spinning`` for a stall of iterations
    that schedule nothing (a frozen loop is ``stall``, from the engine status); ``dead`` for
    a silence, which `explain` finds once the engine speaks again and the sidecar as the
    engine status dead."""
    if is_silence(episode):
        return DEAD
    if episode.kind == "waiting":
        return episode.numbers.get("reason") or "waiting"
    if episode.kind == STALL and "frozen_iteration" not in episode.numbers:
        return SPINNING
    return episode.kind


@dataclass
class LiveFinding:
    """One finding of one engine, open or closed. Times are record time (the engine's
    monotonic clock), but ``opened_ns``, the sidecar's clock when it opened."""

    engine_index: int
    kind: str
    title: str
    evidence: str
    action: str
    start_ns: int
    end_ns: int
    iteration: int  # the iteration it started at; 0 where none is known
    opened_ns: int
    start_wall_ns: int = 0  # 0: no clock anchor yet
    cost: float = 0.0  # request-seconds (findings.py); grows while open
    cost_label: str = "waiting"
    closed: bool = False
    truncated: bool = False  # outlasted the window: cost is its newest part's
    source_episode: Episode | None = field(default=None, repr=False)
    # A stall or death: the sidecar's clock minus the engine's when it opened, which its end
    # is converted with. The messages that end a silence may have waited in the engine's
    # sender all through it: their delay is no clock difference.
    skew_ns: int = 0
    restarted: bool = False  # a stall or death that ended with a new process of the engine

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine_index,
            "kind": self.kind,
            "title": self.title,
            "state": "closed" if self.closed else "open",
            "since_unix": self.start_wall_ns / NS_PER_S if self.start_wall_ns else None,
            "duration_s": round(self.duration_s, 3),
            "start_iteration": self.iteration,
            "cost_request_seconds": round(self.cost, 3),
            "cost_label": self.cost_label,
            "evidence": self.evidence,
            "action": self.action,
        }


def rank_kinds(findings: list[LiveFinding]) -> list[str]:
    """The kinds of ``findings``, ranked as `explain` ranks its findings (findings.rank_key:
    faults first, then by the request-seconds all findings of the kind cost)."""
    groups: dict[str, list] = {}
    for finding in findings:
        group = groups.setdefault(finding.kind, [0.0, 0.0, finding.cost_label])
        group[0] += finding.cost
        group[1] += finding.duration_s

    def key(kind: str) -> tuple:
        cost, total_time, cost_label = groups[kind]
        is_fault = kind in FAULT_KINDS or kind == SPINNING  # a spinning loop is a stall
        return rank_key(is_fault, cost, cost_label, total_time)

    return sorted(groups, key=key, reverse=True)


@dataclass
class FindingEvent:
    """A finding opened, changed or closed (``what``), for the sinks. "changed": a waiting
    finding whose main reason changed; ``previous``: its kind and title before."""

    what: str  # "opened" | "changed" | "closed"
    finding: LiveFinding
    previous: tuple[str, str] = ("", "")


class EngineFindings:
    """One engine's window of messages and its findings (see the module docstring)."""

    def __init__(
        self,
        engine_index: int,
        thresholds: Thresholds | None = None,
        window_messages: int = WINDOW_MESSAGES,
    ) -> None:
        self.engine_index = engine_index
        self.thresholds = thresholds or Thresholds()
        self.messages: deque[IterationRecord | Heartbeat] = deque(maxlen=window_messages)
        # The record time the window holds after its last search (a scrape reads it), and
        # whether that was less than LOOKBACK_S with the window full (said once).
        self.window_span_s = 0.0
        self._short_window = False
        self._short_window_said = False
        self.open: list[LiveFinding] = []
        self.closed: deque[LiveFinding] = deque(maxlen=RECENT_CLOSED)
        # Every closed finding the window may still show, oldest first, so that its episode
        # is not opened again: as many as the window holds, whatever RECENT_CLOSED is.
        self._closed_in_window: deque[LiveFinding] = deque()
        self.snapshot: tuple[LiveFinding, ...] = ()  # open, then closed newest first
        # kind -> [findings opened, request-seconds they cost]: only grow (Prometheus counters)
        self.totals: dict[str, list[float]] = {}
        self.num_searches = 0
        self.search_time_s = 0.0
        # Of the thread's time, what this engine's searches may take: MAX_EVALUATE_SHARE
        # divided among the engines one sidecar tracks (its Ingest sets it).
        self.search_share = MAX_EVALUATE_SHARE
        self._newest_searched: object = None
        self._next_search_ns = 0
        self._busy_max = (0, 0)  # (waiting, running) at most during a stall
        # What an iteration is judged on before it (a long prefill's baseline, the window of
        # a futile speculation, a costly drafts step's window and the step): kept before each
        # open finding, and within LOOKBACK_S for any iteration judged in time.
        th = self.thresholds
        history_s = max(
            th.long_prefill_baseline_time,
            th.futile_speculation_window_time,
            th.costly_drafts_window_time + th.costly_drafts_step_time,
        )
        self._history_ns = int(history_s * NS_PER_S)
        assert history_s + JUDGE_WITHIN_S <= LOOKBACK_S
        self._dropped = False  # whether the window has dropped any message yet
        # Where the past of a slowdown still going on, or ended within the baseline time,
        # begins: its iterations are judged on the pace before it began (_keep_pace)
        self._pace_since_ns: int | None = None
        self._window_timeline = WindowTimeline(engine_index)

    # ---------------------------------------------------------------------------------------
    # The window

    def evaluate(self, now_ns: int, skew_ns: int = 0, force: bool = False) -> list[FindingEvent]:
        """Search the window if it has news and it is time (``force``: now, e.g. at the end
        of a replay); returns the findings opened and closed, in that order. ``now_ns`` is
        the sidecar's clock, ``skew_ns`` that clock minus the engine's (findings keep engine
        time; the two differ for an engine on another host)."""
        self._extend_status_findings(now_ns)
        events: list[FindingEvent] = []
        newest = self.messages[-1] if self.messages else None
        if newest is self._newest_searched or (now_ns < self._next_search_ns and not force):
            return events
        started = time.perf_counter()
        events += self._search(now_ns)
        took_s = time.perf_counter() - started
        self._newest_searched = newest
        self.num_searches += 1
        self.search_time_s += took_s
        wait_s = max(EVALUATE_INTERVAL_S, took_s / self.search_share)
        self._next_search_ns = now_ns + int(wait_s * NS_PER_S)
        if events:
            self._publish()
        return events

    def _trim(self) -> None:
        """Drop messages older than LOOKBACK_S before the newest message, the newest record's
        start and the start of any record not searched yet that took over half of
        JUDGE_WITHIN_S, or than the oldest open finding's start (the deque's maxlen bounds
        the rest). The records' starts: a 45 s step's record comes 45 s after it began, and
        its judgment needs the history before that (dropped, the step never opened a finding
        live); for a step of STALL_STEP_CAP_S at most."""
        messages = self.messages
        newest_ns = message_time_ns(messages[-1])
        long_ns = int(JUDGE_WITHIN_S * NS_PER_S) // 2  # a shorter step's past is within reach
        since_ns, newest_record, searched = newest_ns, True, False
        for message in reversed(messages):
            searched = searched or message is self._newest_searched  # and all before it
            if type(message) is IterationRecord and (
                newest_record or (not searched and message.elapsed_ns > long_ns)
            ):
                since_ns, newest_record = min(since_ns, message.start_ns), False
            if searched and not newest_record:
                break
        since_ns = max(since_ns, newest_ns - int(STALL_STEP_CAP_S * NS_PER_S))
        keep_from = since_ns - int(LOOKBACK_S * NS_PER_S)  # the history, JUDGE_WITHIN_S to spare
        for finding in self.open:  # with the history its first iteration was judged on
            keep_from = min(keep_from, finding.start_ns - self._history_ns)
        if self._pace_since_ns is not None:  # and the judgments of that pace's iterations
            keep_from = min(keep_from, self._pace_since_ns - self._history_ns)
        while messages and message_time_ns(messages[0]) < keep_from:
            messages.popleft()
            self._dropped = True
        full = len(messages) == messages.maxlen  # full: the oldest ones make room
        self._dropped = self._dropped or full
        span_ns = message_time_ns(messages[-1]) - message_time_ns(messages[0])
        self.window_span_s = span_ns / NS_PER_S
        self._short_window = full and self.window_span_s < LOOKBACK_S
        closed = self._closed_in_window
        while closed and messages and closed[0].end_ns < message_time_ns(messages[0]):
            closed.popleft()  # no episode in the window can overlap it any more

    def short_window_notice(self) -> str | None:
        """Once, the first time the window was full with less than LOOKBACK_S in it: what
        that costs and the --findings-window that would hold LOOKBACK_S at this rate."""
        if not self._short_window or self._short_window_said:
            return None
        self._short_window_said = True
        held, span_s = len(self.messages), self.window_span_s
        needed = math.ceil(held * LOOKBACK_S / max(span_s, 1e-3) / 10_000) * 10_000
        history_s = self._history_ns / NS_PER_S
        return (
            f"the live findings' window is full at {held:,} messages, {span_s:.1f} s of this "
            f"engine's, less than the {LOOKBACK_S:g} s it keeps: an iteration judged on the "
            f"{history_s:g} s before it (a long prefill, costly drafts, futile speculation) opens "
            f"a finding only while the window holds that past, and an action is drawn from what "
            f"it holds of the {ACTION_HISTORY_S:g} s before its episode, so live findings may "
            f"miss or differ from what `explain` finds in a recording; --findings-window "
            f"{needed} would hold {LOOKBACK_S:g} s at this rate (about "
            f"{needed * MESSAGE_BYTES / 1e6:.0f} MB for this engine)"
        )

    def _timeline(self) -> EngineTimeline:
        return self._window_timeline.build(self.messages)

    def _search(self, now_ns: int) -> list[FindingEvent]:
        self._trim()
        tl = self._timeline()
        th = self.thresholds
        slowdowns = search_slow_decode(tl, th)
        found = [episode for detector in WINDOW_DETECTORS for episode in detector(tl, th)]
        episodes = sorted(
            (
                episode
                for episode in found + slowdowns.episodes
                if episode.severity != INFO and not is_silence(episode)
            ),
            key=lambda e: (e.start_ns, e.kind),
        )
        note_slowed_queues(episodes)
        self._keep_pace(tl, episodes, slowdowns.ongoing_since_ns)
        opened, seen = [], set()
        for episode in episodes:
            kind = finding_kind(episode)
            finding = self._match(self.open, kind, episode)
            if finding is None:
                if self._match(self._closed_in_window, kind, episode) is not None:
                    continue  # reported and closed: its cost is final
                if not self._judged_in_full(episode):
                    continue
                finding = self._open_from(tl, episode, kind, now_ns)
                opened.append(FindingEvent("opened", finding))
            elif finding.kind != kind:
                opened.append(self._change_kind(tl, finding, episode, kind))
            self._follow(tl, finding, episode)
            seen.add(id(finding))
        closed = [
            FindingEvent("closed", finding)
            for finding in list(self.open)
            if finding.kind not in (STALL, DEAD)
            and (id(finding) not in seen or self._has_ended(tl, finding))
        ]
        for event in closed:
            self._close(event.finding)
        return opened + closed

    def _keep_pace(
        self, tl: EngineTimeline, episodes: list[Episode], ongoing_since_ns: int | None
    ) -> None:
        """Where the past of the slowed-decode episodes begins that still go on or ended
        within the baseline time before the newest record (their iterations, left out of
        later baselines, are part of the past being judged on), and that of a slowdown going
        on but not noticed yet (``ongoing_since_ns``): the window keeps it (_trim), so a
        slowdown's later iterations, and those just after it, are judged on the pace before
        it began, as explain judges them (the window had dropped it after a minute: a CPU
        hog's later iterations were judged live on the slowed pace, 248-321 ms against 21)."""
        recent_ns = tl.last_ns - int(self.thresholds.long_prefill_baseline_time * NS_PER_S)
        since = [
            episode.numbers["pace_since_ns"]
            for episode in episodes
            if episode.kind == "slow_decode" and (episode.ongoing or episode.end_ns >= recent_ns)
        ]
        if ongoing_since_ns is not None:
            since.append(ongoing_since_ns)
        self._pace_since_ns = min(since, default=None)

    def _judged_in_full(self, episode: Episode) -> bool:
        """Whether the window holds all the past the episode's first iteration was judged on
        (HISTORY_JUDGED_KINDS): it does while it has dropped nothing (from the engine's first
        message on, as explain reads the recording), and for an iteration within the window's
        last LOOKBACK_S less that history, which is when each iteration is judged first."""
        if episode.kind not in HISTORY_JUDGED_KINDS or not self._dropped:
            return True
        since_ns = episode.numbers.get("pace_since_ns", episode.start_ns - self._history_ns)
        return since_ns >= message_time_ns(self.messages[0])

    @staticmethod
    def _match(findings, kind: str, episode: Episode) -> LiveFinding | None:
        """The finding this episode of ``kind`` is: of its kind, or of any waiting kind for
        a waiting episode (explain finds one waiting episode for a stretch of waiting, named
        by its main reason so far), and overlapping it in time."""
        waiting = kind in WAITING_KINDS
        for finding in findings:
            if (
                (finding.kind == kind or (waiting and finding.kind in WAITING_KINDS))
                and episode.start_ns <= finding.end_ns
                and episode.end_ns >= finding.start_ns
            ):
                return finding
        return None

    def _change_kind(
        self, tl: EngineTimeline, finding: LiveFinding, episode: Episode, kind: str
    ) -> FindingEvent:
        """The waiting episode's main reason changed: the finding takes the new kind, title
        and action (explain, reading the recording up to now, would name it so). Its cost so
        far stays counted under the kind it had; what it costs from now on, under the new."""
        event = FindingEvent("changed", finding, (finding.kind, finding.title))
        finding.kind, finding.title = kind, episode.title
        finding.action = episode_action(tl, episode, self.thresholds)
        self.totals.setdefault(kind, [0, 0.0])[0] += 1
        return event

    def _open_from(self, tl: EngineTimeline, episode: Episode, kind: str, now_ns: int):
        row = int(tl.col("start_ns").searchsorted(episode.start_ns))
        iteration = int(tl.col("iteration")[row]) if row < tl.num_iterations else 0
        action = episode_action(tl, episode, self.thresholds)
        finding = LiveFinding(
            engine_index=self.engine_index,
            kind=kind,
            title=episode.title,
            evidence=episode.evidence,
            action=action,
            start_ns=episode.start_ns,
            end_ns=episode.end_ns,
            iteration=iteration,
            opened_ns=now_ns,
            start_wall_ns=self._wall_ns(episode.start_ns),
            cost_label=COST_LABELS.get(episode.kind, "waiting"),
        )
        self._add_open(finding)
        return finding

    def _follow(self, tl: EngineTimeline, finding: LiveFinding, episode: Episode) -> None:
        """The finding's episode as the window shows it now: its end, evidence and cost."""
        finding.end_ns = max(finding.end_ns, episode.end_ns)
        finding.title, finding.evidence = episode.title, episode.evidence
        finding.source_episode = episode
        if reads_whole_episode(episode) or (  # a KV size: drawn from the episode so far
            episode.numbers.get("began_slowed") and not finding.action.startswith(SLOWED_FIRST_TEXT)
        ):  # or a queue found to have formed in a slowdown that was noticed after it began
            finding.action = episode_action(tl, episode, self.thresholds)
        cost = episode_cost(tl, episode, self.thresholds)
        if episode.start_ns > finding.start_ns:  # the window no longer holds its start
            finding.truncated = True
            cost = max(cost, finding.cost)
        self._set_cost(finding, cost)

    def _has_ended(self, tl: EngineTimeline, finding: LiveFinding) -> bool:
        """No growth for as long as explain would still merge (close_after), or (for the
        kinds about requests) nothing in flight since, as the latest heartbeat says. A KV
        cliff or a preemption storm grows no more but still costs until the requests it
        evicted are back (findings.py): it ends then, or when the engine is idle."""
        episode = finding.source_episode
        kind = episode.kind if episode else finding.kind
        if kind == "slow_decode" and episode is not None:
            # one slowdown, as explain's episode is (slow_decode.py): over once the engine's
            # decode-only iterations ran on pace for gap_merge_time, whatever came between
            # (prompt chunks, an idle spell); or after LOOKBACK_S without one off pace
            return not episode.ongoing or tl.last_ns - finding.end_ns > LOOKBACK_S * NS_PER_S
        rows, seconds, idle_ends = close_after(kind, self.thresholds)
        last_heartbeat = tl.heartbeats[-1] if tl.heartbeats else None
        # A span-merged kind's idle ends it only past the time explain still merges in: an
        # iteration after the idle starts later still (idle for a moment between two bursts,
        # a slowed decode had closed live and gone on in explain)
        merge_ns = int(seconds * NS_PER_S) if kind in SPAN_MERGED_KINDS else 0
        if (
            idle_ends
            and last_heartbeat is not None
            and last_heartbeat.ts_ns > finding.end_ns + merge_ns
            and last_heartbeat.num_waiting_reqs + last_heartbeat.num_running_reqs == 0
        ):
            return True
        if episode is not None and episode.kind in EVICTING_KINDS:
            row = eviction_baseline_row(tl, episode)
            waiting = tl.col("num_waiting_reqs")
            if row < tl.num_iterations and waiting[-1] > waiting[row]:
                return False
        starts = tl.col("start_ns")
        if kind in SPAN_MERGED_KINDS:
            # explain merges an iteration that starts within `seconds` of the episode's end,
            # and an iteration's record comes at its end: ended once one starting later came
            # (records come in order), or after LOOKBACK_S without one
            started_after = tl.num_iterations and starts[-1] - finding.end_ns > seconds * NS_PER_S
            return bool(started_after) or tl.last_ns - finding.end_ns > LOOKBACK_S * NS_PER_S
        num_after = tl.num_iterations - int(starts.searchsorted(finding.end_ns, side="right"))
        return num_after >= rows and tl.last_ns - finding.end_ns > seconds * NS_PER_S

    # ---------------------------------------------------------------------------------------
    # Status: stalled and dead

    def note_status(
        self,
        status: str,
        now_ns: int,
        since_ns: int,
        busy: tuple[int, int],
        last_iteration: int,
        pid: int,
        skew_ns: int = 0,
        source: str = "",
        restarted_ns: int = 0,
    ) -> list[FindingEvent]:
        """The engine's status changed (the sidecar's: "running", "stalled", "dead", ...): a
        stall or death opens a finding, leaving it closes that finding. ``since_ns``: the last
        progress (stalled) or the last message (dead), on ``now_ns``'s clock (the sidecar's;
        ``skew_ns``: it minus the engine's); ``busy``: (waiting, running) now;
        ``last_iteration``: the last that made progress; ``pid`` and ``source``: the
        process that sends the engine's telemetry, and how (record.SOURCES); ``restarted_ns``:
        when a new process of the engine was last seen (0: never), on the sidecar's clock."""
        opened_ns, now_ns, since_ns = now_ns, now_ns - skew_ns, since_ns - skew_ns
        kind = STATUS_KINDS.get(status)
        # Stalled, yet iterations go on scheduling nothing: the loop spins, a finding of the
        # window's (detect_spinning), as explain calls it; a stall finding beside it would say
        # the loop is frozen and name one condition twice.
        spinning = kind == STALL and self._spun_since(since_ns)
        events = [
            FindingEvent("closed", finding)
            for finding in list(self.open)
            if finding.kind in STATUS_KINDS.values() and finding.kind != kind
        ]
        for event in events:
            event.finding.end_ns = opened_ns - event.finding.skew_ns
            event.finding.restarted = restarted_ns >= event.finding.opened_ns
            self._update_busy_cost(event.finding)
            self._close(event.finding)
        if kind and not spinning and not any(finding.kind == kind for finding in self.open):
            self._busy_max = busy
            finding = self._open_status(kind, now_ns, since_ns, last_iteration, pid, source)
            finding.opened_ns = opened_ns
            finding.skew_ns = skew_ns
            events.append(FindingEvent("opened", finding))
        if events:
            self._publish()
        return events

    def _spun_since(self, since_ns: int) -> bool:
        """Whether the window holds an iteration that began after ``since_ns`` (engine time)
        and scheduled nothing (one that did ends the stall: its record may be what said it)."""
        for message in reversed(self.messages):
            if message_time_ns(message) <= since_ns:
                return False
            if (
                type(message) is IterationRecord
                and message.start_ns > since_ns
                and not message.num_prefill_tokens + message.num_decode_tokens
            ):
                return True
        return False

    def note_busy(self, waiting: int, running: int) -> None:
        """Requests in flight while stalled (a stall's cost: the most of each at once)."""
        self._busy_max = (max(self._busy_max[0], waiting), max(self._busy_max[1], running))

    def _open_status(
        self, kind: str, now_ns: int, since_ns: int, last_iteration: int, pid: int, source: str
    ) -> LiveFinding:
        stalled = kind == STALL
        finding = LiveFinding(
            engine_index=self.engine_index,
            kind=STALL if stalled else DEAD,
            title="Engine stalled" if stalled else "Engine down",
            evidence="",
            action=stall_setting(pid, source) if stalled else SILENCE_SETTING,
            start_ns=since_ns,
            end_ns=now_ns,
            iteration=last_iteration,
            opened_ns=now_ns,
            start_wall_ns=self._wall_ns(since_ns),
            cost_label=COST_LABELS["stall" if stalled else "silence"],
        )
        self._add_open(finding)
        self._update_busy_cost(finding)
        self._status_evidence(finding)
        return finding

    def _extend_status_findings(self, now_ns: int) -> None:
        """Open stalls and deaths last until ``now_ns`` (the sidecar's clock)."""
        for finding in self.open:
            if finding.kind in (STALL, DEAD):
                finding.end_ns = now_ns - finding.skew_ns
                self._update_busy_cost(finding)
                self._status_evidence(finding)

    def _update_busy_cost(self, finding: LiveFinding) -> None:
        """findings.py: (waiting + running) x the stall's length, the most of each at once
        while it lasted; for a dead engine, what its last message said (a silence's cost)."""
        if finding.kind in (STALL, DEAD):
            self._set_cost(finding, sum(self._busy_max) * finding.duration_s)

    def _status_evidence(self, finding: LiveFinding) -> None:
        busy = work_text(*self._busy_max)
        if finding.kind == STALL:
            finding.evidence = (
                f"last_iteration stayed at {finding.iteration} for "
                f"{secs(finding.end_ns - finding.start_ns)} "
                f"{f'while up to {busy}' if busy else 'with no request waiting or running'}; "
                "heartbeats continue, so the process is alive"
            )
        else:
            finding.evidence = (
                f"no message for {secs(finding.end_ns - finding.start_ns)} (heartbeats come "
                "every second): the engine process is gone, frozen whole, or cut off from the "
                f"lane; {in_flight_text(sum(self._busy_max))} at its last message"
            )

    # ---------------------------------------------------------------------------------------
    # Bookkeeping

    def _add_open(self, finding: LiveFinding) -> None:
        self.open.append(finding)
        self.totals.setdefault(finding.kind, [0, 0.0])[0] += 1

    def _set_cost(self, finding: LiveFinding, cost: float) -> None:
        """The finding's cost now; the kind's total only grows (a counter)."""
        if cost > finding.cost:
            self.totals[finding.kind][1] += cost - finding.cost
        finding.cost = cost

    def _close(self, finding: LiveFinding) -> None:
        finding.closed = True
        self.open.remove(finding)
        self.closed.appendleft(finding)
        self._closed_in_window.append(finding)

    def _publish(self) -> None:
        self.snapshot = (*self.open, *self.closed)

    def _wall_ns(self, ts_ns: int) -> int:
        """Wall time of an engine time, from the newest heartbeat's anchor; 0 without one."""
        for message in reversed(self.messages):
            if type(message) is Heartbeat:
                return ts_ns + message.wall_ns - message.ts_ns
        return 0
