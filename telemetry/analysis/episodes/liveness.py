"""Liveness episodes: stalls (frozen or spinning loop), idle stretches, telemetry gaps and
silences (lost messages, a frozen or restarted process)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from telemetry.analysis.episodes.episode import (
    INFO,
    Episode,
    Thresholds,
    group_by_time,
    kv_usage_at,
    kv_usage_text,
    secs,
    span_episode,
    true_runs,
)
from telemetry.analysis.stall_rule import StallRule
from telemetry.analysis.timeline import NS_PER_S, WAIT_REASONS, EngineTimeline
from telemetry.analysis.words import not_reported, plural
from telemetry.lane.record import (
    SOURCE_VLLM_SCHEDULER,
    SOURCE_VLLM_STAT_LOGGER,
    Heartbeat,
    is_clean_close,
)
from telemetry.lane.recording import message_time_ns

SILENCE_SETTING = (
    "Check the engine's logs and exit status (alert and runbook: IterscopeEngineDown)."
)
# A silence with seq continuous: the same process stopped whole and went on.
FROZEN_SETTING = (
    "Not a tuning setting: the whole process stopped and went on (SIGSTOP, a debugger, the "
    "host swapping or starved of CPU, a native call holding the interpreter): check the "
    "host's memory and CPU pressure and what signals the process (alert and runbook: "
    "IterscopeEngineDown)."
)
SEQ_RESTART_SLACK = 64  # a seq this far below the highest seen means the engine restarted


def detect_stalls(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    return detect_frozen_stalls(tl, th) + detect_spinning(tl, th)


def detect_frozen_stalls(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Busy heartbeats whose last_iteration stayed frozen for longer than the stall threshold
    the live sidecar held at that moment (StallRule, fed the recording in time order)."""
    candidates = []
    idle_before = None  # sorted on first use: most recordings have no frozen heartbeats
    for group in _heartbeat_groups(tl, busy=True):
        if len(group) < 2:
            continue
        last_iteration = group[0].last_iteration
        since_ns = _iteration_end_ns(tl, last_iteration, before_ns=group[0].ts_ns)
        idle_before = idle_before or _IdleBefore(tl)
        if since_ns is None or idle_before(group[0].ts_ns):
            since_ns = group[0].ts_ns  # work came after an idle spell: the wait starts here
        # Progress: the first later iteration to end after it, whether in flight then (begun
        # before the first busy heartbeat, as an engine schedules before its next heartbeat
        # says so) or begun after.
        progress = (tl.col("iteration") > last_iteration) & (tl.col("end_ns") > since_ns)
        next_rows = np.flatnonzero(progress)
        next_row = int(next_rows[0]) if next_rows.size else tl.num_iterations
        ongoing = next_row >= tl.num_iterations
        until_ns = group[-1].ts_ns if ongoing else int(tl.col("end_ns")[next_row])
        candidates.append((group, since_ns, until_ns, ongoing, next_row))
    stall_after_ns = int(th.stall_after * NS_PER_S) if th.stall_after else 0
    dead_after_ns = int(th.dead_after * NS_PER_S)
    thresholds = stall_thresholds(tl, [c[2] for c in candidates], stall_after_ns, dead_after_ns)
    episodes = []
    for (group, since_ns, until_ns, ongoing, next_row), threshold_ns in zip(
        candidates, thresholds, strict=True
    ):
        if until_ns - since_ns <= threshold_ns:
            continue
        inside = not ongoing and tl.col("start_ns")[next_row] - since_ns < (until_ns - since_ns) / 2
        episodes.append(
            _stall_episode(tl, group, since_ns, until_ns, ongoing, inside, threshold_ns)
        )
    return episodes


def stall_thresholds(
    tl: EngineTimeline, times_ns: list[int], stall_after_ns: int, dead_after_ns: int
) -> list[int]:
    """The stall threshold the live sidecar held just before each of ``times_ns``: the
    engine's messages fed in time order (records at their end, heartbeats at ts_ns) to a
    StallRule as Ingest feeds it (``stall_after_ns``: its fixed threshold, 0 adapts; a message
    after ``dead_after_ns`` of silence starts the wait for progress again, so no interval
    spanning the silence is learnt, even from a record that follows that message), with
    record time as the clock, as a replay runs."""
    rule = StallRule(stall_after_ns)
    order = sorted(range(len(times_ns)), key=times_ns.__getitem__)
    thresholds = [0] * len(times_ns)
    if not times_ns:
        return thresholds
    # A message at or after the last time asked cannot change an answer (each is answered
    # before the first message at its time): the replay stops there.
    last_ns, ends = max(times_ns), tl.col("end_ns")
    rows = np.flatnonzero(ends < last_ns)
    events = sorted(
        [(end, 0, row) for row, end in zip(rows.tolist(), ends[rows].tolist(), strict=True)]
        + [(h.ts_ns, 1, index) for index, h in enumerate(tl.heartbeats) if h.ts_ns < last_ns]
    )
    # Python lists: the loop reads one element at a time, which numpy makes slow.
    scheduled = (tl.col("num_prefill_tokens") + tl.col("num_decode_tokens")).tolist()
    elapsed = tl.col("elapsed_ns").tolist()
    in_flight = (tl.col("num_waiting_reqs") + tl.col("num_running_reqs")).tolist()
    iterations = tl.col("iteration").tolist()
    had_work, last_iteration, last_message_ns, next_query = False, 0, None, 0
    for time_ns, is_heartbeat, index in events:
        while next_query < len(order) and times_ns[order[next_query]] <= time_ns:
            thresholds[order[next_query]] = rule.threshold_ns(times_ns[order[next_query]])
            next_query += 1
        was_silent = last_message_ns is not None and time_ns - last_message_ns > dead_after_ns
        if was_silent:  # heard again after a silence: the wait starts here, as in Ingest
            rule.restart(time_ns)
        num_tokens = elapsed_ns = 0
        if is_heartbeat:
            heartbeat = tl.heartbeats[index]
            progress = heartbeat.last_iteration > last_iteration
            last_iteration = max(last_iteration, heartbeat.last_iteration)
            work_after = heartbeat.num_waiting_reqs + heartbeat.num_running_reqs > 0
        else:
            num_tokens, elapsed_ns = scheduled[index], elapsed[index]
            progress = bool(num_tokens)
            if progress:
                last_iteration = max(last_iteration, iterations[index])
            work_after = bool(in_flight[index])
        if progress:
            rule.note_progress(time_ns, had_work, was_silent, num_tokens, elapsed_ns)
        elif not had_work:
            rule.restart(time_ns)
        if is_heartbeat:
            rule.note_step(heartbeat.step_tokens)
        had_work, last_message_ns = work_after, time_ns
    for query in order[next_query:]:
        thresholds[query] = rule.threshold_ns(times_ns[query])
    return thresholds


def stall_setting(pid: int, source: str = "") -> str:
    """What to do about a stalled engine whose telemetry comes from process ``pid`` (0: not
    known). vLLM's engine core runs the model in worker processes, its children (a hang can be
    in either: SIGSTOP of a worker stalls it); its stat-logger plugin runs in the API server,
    so its pid is the API server's, and the engine core that stalls is its child, titled
    EngineCore (EngineCore_DPn). The plugin cannot say how big the step under way is, so a long
    prompt's step reads as a stall until it ends: said, with how to tell."""
    pid_text = pid or "PID"
    caveat = ""
    if source == SOURCE_VLLM_STAT_LOGGER:
        process = (
            f"vLLM's engine core process, a child of the API server (pid {pid_text}) that "
            f"sends this telemetry (e.g. `py-spy dump --pid $(pgrep -P {pid_text} -f "
            "EngineCore)`), and of its workers, the engine core's children"
        )
        caveat = (
            " The plugin cannot tell a hang from a long step (a prompt of thousands of tokens "
            "may take this long): a dump inside the model's forward pass with the step's "
            "prompt still being computed is no hang; the scheduler source tells them apart."
        )
    elif source == SOURCE_VLLM_SCHEDULER:
        process = (
            f"vLLM's engine core (e.g. `py-spy dump --pid {pid_text}`) and of its workers, "
            f"its children (`pgrep -P {pid_text}`), which run the model"
        )
    else:
        process = f"the engine process (e.g. `py-spy dump --pid {pid_text}`)"
    return (
        f"Not a tuning setting: take a stack dump of {process}, check the device, restart "
        f"the engine if it does not recover (alert and runbook: IterscopeEngineStalled).{caveat}"
    )


def _stall_where(tl: EngineTimeline, since_ns: int, ongoing: bool, inside: bool) -> str:
    """Where the time went, from the next record. A frozen last_iteration cannot tell a step
    that hung from a legitimately long one: only that none finished."""
    if ongoing:
        return "none had finished when the recording ended"
    row = int(np.searchsorted(tl.col("start_ns"), since_ns, side="left"))
    gap_ns = int(tl.col("start_ns")[row]) - since_ns
    spent = "inside that iteration" if inside else "between iterations"
    prompt_tokens = int(tl.col("num_prefill_tokens")[row])
    decoding = int(tl.col("num_decode_reqs")[row])
    size = ", ".join(
        part
        for part in (
            f"{prompt_tokens:,} prompt tokens" if prompt_tokens else "",
            f"{decoding} decoding" if decoding else "",
        )
        if part
    )
    return (
        f"the next iteration started {secs(gap_ns)} after the last one ended and took "
        f"{secs(tl.col('elapsed_ns')[row])}{f' ({size})' if size else ''}: most of the time "
        f"went {spent}"
    )


def work_text(num_waiting: int, num_running: int) -> str:
    """``2 requests waited and 1 ran``, leaving out a count of 0 (one is not 0 in a busy group)."""
    parts = [
        f"{plural(num_waiting, 'request')} waited" if num_waiting else "",
        (f"{num_running} ran" if num_waiting else f"{plural(num_running, 'request')} ran")
        if num_running
        else "",
    ]
    return " and ".join(part for part in parts if part)


def _stall_episode(tl, group, since_ns, until_ns, ongoing, inside, threshold_ns) -> Episode:
    max_waiting = max(h.num_waiting_reqs for h in group)
    max_running = max(h.num_running_reqs for h in group)
    where = _stall_where(tl, since_ns, ongoing, inside)
    return Episode(
        kind="stall",
        engine_index=tl.engine_index,
        start_ns=since_ns,
        end_ns=until_ns,
        title="Engine stalled" + (" (still stalled at the end)" if ongoing else ""),
        evidence=(
            f"last_iteration stayed at {group[0].last_iteration} for {secs(until_ns - since_ns)} "
            f"across {plural(len(group), 'heartbeat')} with {plural(max_waiting, 'request')} "
            f"waiting and {max_running} running (at most; pid {group[0].pid or '?'}); the "
            f"stall threshold then was {secs(threshold_ns)}"
        ),
        explanation=(
            f"No iteration finished for {secs(until_ns - since_ns)} while up to "
            f"{work_text(max_waiting, max_running)}; "
            "heartbeats continued, so the process was alive: a forward pass or the loop was "
            f"stuck or very slow ({where}). Clients got no token meanwhile."
        ),
        setting=stall_setting(group[0].pid, group[0].source),
        ongoing=ongoing,
        numbers={
            "frozen_iteration": group[0].last_iteration,
            "stall_time_s": (until_ns - since_ns) / NS_PER_S,
            "max_waiting_reqs": max_waiting,
            "max_running_reqs": max_running,
            "inside_iteration": bool(inside),
            "stall_threshold_s": threshold_ns / NS_PER_S,
        },
    )


def _heartbeat_groups(tl: EngineTimeline, busy: bool) -> list[list[Heartbeat]]:
    """Consecutive heartbeats of one process with the same last_iteration and busy state."""
    groups: list[list[Heartbeat]] = []
    for heartbeat in tl.heartbeats:
        is_busy = heartbeat.num_waiting_reqs + heartbeat.num_running_reqs > 0
        if is_busy != busy:
            groups.append([])
            continue
        previous = groups[-1][-1] if groups and groups[-1] else None
        if (
            previous is not None
            and previous.pid == heartbeat.pid
            and previous.last_iteration == heartbeat.last_iteration
        ):
            groups[-1].append(heartbeat)
        else:
            groups.append([heartbeat])
    return [g for g in groups if g]


class _IdleBefore:
    """Whether the engine's latest message before a time (a record at its end, or a
    heartbeat) said nothing waited or ran: the live sidecar starts waiting for progress again
    at the next message (Ingest: no work before it), so an idle spell is no stall (a real
    vLLM idle for 3 s after iteration 403, then 2 requests and a 2.7 s step: explain had
    called 5.8 s from 403's end a stall, the live sidecar rightly none). Sorted once, then a
    binary search per question."""

    def __init__(self, tl: EngineTimeline) -> None:
        self.tl = tl
        ends = tl.col("end_ns")
        self.by_end = np.argsort(ends, kind="stable")
        self.ends = ends[self.by_end]
        self.beats = np.fromiter((h.ts_ns for h in tl.heartbeats), np.int64, len(tl.heartbeats))

    def __call__(self, ts_ns: int) -> bool:
        record = int(np.searchsorted(self.ends, ts_ns)) - 1  # the latest to end before it
        beat = int(np.searchsorted(self.beats, ts_ns)) - 1
        if beat >= 0 and (record < 0 or self.beats[beat] >= self.ends[record]):
            latest = self.tl.heartbeats[beat]
        elif record >= 0:
            latest = self.tl.records[int(self.by_end[record])]
        else:
            return False
        return latest.num_waiting_reqs + latest.num_running_reqs == 0


def _iteration_end_ns(tl: EngineTimeline, iteration: int, before_ns: int) -> int | None:
    rows = np.flatnonzero((tl.col("iteration") == iteration) & (tl.col("end_ns") <= before_ns))
    return int(tl.col("end_ns")[rows[-1]]) if rows.size else None


def detect_spinning(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    scheduled = tl.col("num_prefill_tokens") + tl.col("num_decode_tokens")
    mask = (scheduled == 0) & (tl.col("num_waiting_reqs") + tl.col("num_running_reqs") > 0)
    episodes = []
    for first, last in true_runs(mask):
        if last - first + 1 < th.spin_min_iterations:
            continue
        span = slice(first, last + 1)
        kv_usage = kv_usage_at(tl, last)
        episodes.append(
            span_episode(
                tl,
                first,
                last,
                kind="stall",
                title="Engine spinning: iterations schedule nothing",
                evidence=(
                    f"{plural(last - first + 1, 'iteration')} scheduled no request while up to "
                    f"{int(tl.col('num_waiting_reqs')[span].max())} waited and "
                    f"{int(tl.col('num_running_reqs')[span].max())} ran; waiting by reason at the "
                    f"end: {waiting_reasons_text(tl, last)}; {kv_usage_text(kv_usage)}"
                ),
                explanation=(
                    "The loop is alive but admits nothing: the first waiting request cannot be "
                    "admitted (e.g. it needs more free KV blocks than exist) and nothing running "
                    "will free them."
                ),
                setting=_spinning_setting(kv_usage is not None),
                numbers={"num_iterations": last - first + 1},
            )
        )
    return episodes


def waiting_reasons_text(tl: EngineTimeline, row: int) -> str:
    """The requests waiting after record ``row`` by reason, leaving out a count of 0:
    ``KV capacity 33, --max-num-seqs 2``; ``none`` when no reason holds any."""
    if not tl.waiting_reasons_known:
        return not_reported(tl.facts.get("source"))
    counts = [(r.limit, int(tl.col(r.field)[row])) for r in WAIT_REASONS.values()]
    return ", ".join(f"{limit} {count}" for limit, count in counts if count) or "none"


def _spinning_setting(kv_reported: bool) -> str:
    if kv_reported:
        return "Check for leaked KV blocks (kv_leak) and requests larger than the cache."
    return (
        "Check the engine's own KV metrics for leaked blocks (the source reports none, so "
        "kv_leak cannot be found here) and for requests larger than the cache."
    )


def detect_idle(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    episodes = []
    for group in _heartbeat_groups(tl, busy=False):
        since_ns = _iteration_end_ns(tl, group[0].last_iteration, before_ns=group[0].ts_ns)
        since_ns = group[0].ts_ns if since_ns is None else since_ns
        until_ns = group[-1].ts_ns
        if until_ns - since_ns < th.idle_min_time * NS_PER_S:
            continue
        episodes.append(
            Episode(
                kind="idle",
                engine_index=tl.engine_index,
                start_ns=since_ns,
                end_ns=until_ns,
                title="Idle",
                evidence=(
                    f"{plural(len(group), 'heartbeat')} with nothing waiting or running, "
                    f"no iteration for {secs(until_ns - since_ns)}"
                ),
                explanation="Nothing to do: no request was waiting or running.",
                setting="None needed.",
                severity=INFO,
                numbers={"idle_time_s": (until_ns - since_ns) / NS_PER_S},
            )
        )
    return episodes


def detect_telemetry_gaps(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Holes in seq (lost messages) and silences (no message, not even a heartbeat). Messages
    in time order (an iteration at its end; records before heartbeats at the same time) are
    split where seq starts again (a restarted engine); within a piece, seq order shows the
    holes; between any two messages in time order, a silence longer than the live sidecar
    waits before it calls the engine dead is one, unless messages were lost there or the
    message before it closed the lane cleanly (record.is_clean_close: a shutdown)."""
    messages = [*tl.records, *tl.heartbeats]
    beat_times = np.fromiter((h.ts_ns for h in tl.heartbeats), np.int64, len(tl.heartbeats))
    times = np.concatenate([tl.col("end_ns"), beat_times])
    order = np.argsort(times, kind="stable")
    times = times[order]
    seqs = np.fromiter((m.msg_seq for m in messages), np.int64, len(messages))[order]
    starts = _seq_restarts(seqs)
    holes = []
    for first, stop in pairwise([*starts, len(seqs)]):
        by_seq = np.argsort(seqs[first:stop], kind="stable") + first
        gaps = np.diff(seqs[by_seq])
        for k in np.flatnonzero(gaps > 1).tolist():
            before, after = messages[order[by_seq[k]]], messages[order[by_seq[k + 1]]]
            holes.append((before, after, int(gaps[k]) - 1))
    is_start = np.zeros(len(seqs) + 1, dtype=bool)
    is_start[starts] = True
    silences = [
        (messages[order[i]], messages[order[i + 1]], bool(is_start[i + 1]))
        for i in np.flatnonzero(np.diff(times) > int(th.dead_after * NS_PER_S)).tolist()
        if (is_start[i + 1] or seqs[i + 1] <= seqs[i] + 1)  # else messages were lost: a hole
        and not is_clean_close(messages[order[i]])
    ]
    episodes = _hole_episodes(tl, holes, th) + [_silence_episode(tl, *s) for s in silences]
    return episodes + _death_at_end(tl, th)


def _death_at_end(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """The silence after the last message where the live sidecar found the engine dead and
    heard nothing more of it (its notes: EngineTimeline.death_at_end), until it closed the
    recording (or, not closed, until it found it dead), where longer than ``dead_after`` as
    any silence: the "Engine down" it said live, which a recording alone had read as the
    run's end ("No problem found" for a killed engine)."""
    death = tl.death_at_end()
    if death is None:
        return []
    dead, closed = death
    before = tl.last_message()
    start_ns = message_time_ns(before)
    end_ns = tl.from_wall_ns((closed or dead).wall_ns)
    if end_ns - start_ns <= int(th.dead_after * NS_PER_S):
        return []
    in_flight = before.num_waiting_reqs + before.num_running_reqs
    until = "it closed the recording" if closed else "the recording's end"
    return [
        Episode(
            kind="telemetry_gap",
            engine_index=tl.engine_index,
            start_ns=start_ns,
            end_ns=end_ns,
            title="Engine down",  # the live finding's title
            evidence=(
                f"no message for {secs(end_ns - start_ns)} (heartbeats are ~1 s apart), until "
                f"{until}: the live sidecar found it dead and heard nothing more of it; "
                f"{in_flight_text(in_flight)} at its last message"
            ),
            explanation=(
                "The engine process died (killed, crashed) or its telemetry lane broke: no "
                "heartbeat came after, while the sidecar recording it ran on."
            ),
            setting=SILENCE_SETTING,
            numbers={
                "silent_time_s": (end_ns - start_ns) / NS_PER_S,
                "restarted": False,
                "in_flight_reqs": in_flight,
            },
        )
    ]


def _seq_restarts(seqs: np.ndarray) -> list[int]:
    """Where seq starts again in time-ordered messages: 0, and each index whose seq is over
    SEQ_RESTART_SLACK below the highest since the last such index, or is 1 after a higher one."""
    starts = [0] if len(seqs) else []
    while starts:
        first = starts[-1]
        highest_before = np.r_[0, np.maximum.accumulate(seqs[first:])[:-1]]
        restarted = (seqs[first:] + SEQ_RESTART_SLACK < highest_before) | (
            (seqs[first:] == 1) & (highest_before > 1)
        )
        found = np.flatnonzero(restarted[1:])
        if not found.size:
            return starts
        starts.append(first + 1 + int(found[0]))
    return starts


def conflicting_pids(heartbeats: list[Heartbeat]) -> tuple[int, int] | None:
    """Two processes that publish as one engine: its heartbeats (in time order) switch back to
    a pid seen before another, as the sidecar's conflict check says (a restart changes the
    pid once); the two pids, else None."""
    seen: list[int] = []
    for heartbeat in heartbeats:
        pid = heartbeat.pid
        if not pid or (seen and seen[-1] == pid):
            continue
        if pid in seen:
            return min(pid, seen[-1]), max(pid, seen[-1])
        seen.append(pid)
    return None


def _hole_episodes(tl: EngineTimeline, holes: list, th: Thresholds) -> list[Episode]:
    times = [message_time_ns(before) for before, _, _ in holes]
    conflict = conflicting_pids(tl.heartbeats)
    if conflict is not None:
        return [_conflict_episode(tl, holes, times, conflict)] if holes else []
    episodes = []
    for first, last in group_by_time(times, int(th.gap_merge_time * NS_PER_S)):
        group = holes[first : last + 1]
        num_lost = sum(n for _, _, n in group)
        num_dropped = sum(min(after.num_dropped, n) for _, after, n in group)
        start_ns, end_ns = message_time_ns(group[0][0]), message_time_ns(group[-1][1])
        episodes.append(
            Episode(
                kind="telemetry_gap",
                engine_index=tl.engine_index,
                start_ns=start_ns,
                end_ns=end_ns,
                title="Telemetry gap: messages lost",
                evidence=(
                    f"{plural(num_lost, 'message')} missing (seq holes: {len(group)}); "
                    f"{num_dropped} of them "
                    f"dropped by the engine because its send queue was full or no sidecar was "
                    f"connected, {num_lost - num_dropped} lost after sending"
                ),
                explanation=(
                    "The recording misses part of this stretch, so counts here are lower bounds; "
                    "the engine itself was not slowed (telemetry never blocks it)."
                ),
                setting=(
                    "Keep the sidecar running and keeping up (bench/sidecar_ingest.py), raise the "
                    "publisher's send high-water mark, and pass every rotated recording file "
                    "(runbook: IterscopeTelemetryDropping)."
                ),
                numbers={"num_lost": num_lost, "num_dropped_by_engine": num_dropped},
            )
        )
    return episodes


def _conflict_episode(
    tl: EngineTimeline, holes: list, times: list[int], pids: tuple[int, int]
) -> Episode:
    """Seq holes that two processes' interleaved numbering makes: nothing need be lost."""
    start_ns, end_ns = times[0], message_time_ns(holes[-1][1])
    return Episode(
        kind="telemetry_gap",
        engine_index=tl.engine_index,
        start_ns=start_ns,
        end_ns=end_ns,
        title="Telemetry mixed: two engine processes publish as one",
        evidence=(
            f"heartbeats switch between pids {pids[0]} and {pids[1]}; "
            f"{plural(len(holes), 'seq hole')} where each one's messages fall between the "
            "other's numbers"
        ),
        explanation=(
            f"Two engine processes publish as engine {tl.engine_index}: their records mix, so "
            "this engine's figures and findings are of both, and the holes in its seq are each "
            "other's messages, not lost ones."
        ),
        setting=(
            "Give each engine process its own --engine-index (runbook: "
            "IterscopeEngineIndexConflict); no send high-water mark helps."
        ),
        numbers={"num_lost": 0, "num_dropped_by_engine": 0, "conflicting_pids": list(pids)},
    )


def in_flight_text(num_in_flight: int) -> str:
    """``4 requests in flight`` (waiting or running), ``no request in flight``."""
    return (
        f"{plural(num_in_flight, 'request')} in flight" if num_in_flight else "no request in flight"
    )


def _silence_episode(tl: EngineTimeline, before, after, restarted: bool) -> Episode:
    start_ns, end_ns = message_time_ns(before), message_time_ns(after)
    in_flight = before.num_waiting_reqs + before.num_running_reqs
    if restarted:
        what = "then the engine started again (seq restarted)"
        why = "The engine process died or was restarted: no heartbeat came while it was gone."
    else:
        what = "with no message lost (seq continuous)"
        why = (
            "The whole engine process was frozen, heartbeat thread included (suspended, or "
            "a native call holding the interpreter), then resumed."
        )
    return Episode(
        kind="telemetry_gap",
        engine_index=tl.engine_index,
        start_ns=start_ns,
        end_ns=end_ns,
        title="Engine down" + (": restarted" if restarted else ""),  # the live finding's title
        evidence=(
            f"no message for {secs(end_ns - start_ns)} (heartbeats are ~1 s apart), {what}; "
            f"{in_flight_text(in_flight)} at the last message before it"
        ),
        explanation=why,
        setting=SILENCE_SETTING if restarted else FROZEN_SETTING,
        numbers={
            "silent_time_s": (end_ns - start_ns) / NS_PER_S,
            "restarted": restarted,
            # what the last message before it said was in flight: no token for them meanwhile
            "in_flight_reqs": in_flight,
        },
    )
