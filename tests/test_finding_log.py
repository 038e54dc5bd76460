"""The live findings' log lines: a condition that comes and goes is said once, then summed."""

import logging
import re

import pytest

from telemetry.analysis.live_findings import FindingEvent, LiveFinding
from telemetry.sidecar.sinks.finding_log import PROMOTE_AFTER_S, REPEAT_WINDOW_S, FindingLog
from telemetry.sidecar.sinks.log import LogSink
from tests.helpers.sink_feed import send
from tests.test_log_sink import CLOCK_OFFSET_NS, SECOND, Lines, heartbeat


def finding(kind="kv_saturation", start_s=100.0, end_s=101.0, cost=2.0, anchored=True):
    """A finding of engine 0 from wall time ``start_s`` to ``end_s``."""
    start_ns = int(start_s * SECOND) - CLOCK_OFFSET_NS
    return LiveFinding(
        engine_index=0,
        kind=kind,
        title=f"{kind} title",
        evidence="evidence",
        action=f"{kind} action",
        start_ns=start_ns,
        end_ns=start_ns + int((end_s - start_s) * SECOND),
        iteration=7,
        opened_ns=0,
        start_wall_ns=int(start_s * SECOND) if anchored else 0,
        cost=cost,
    )


def come_and_go(log, found, kind="kv_saturation", first_s=100.0, every_s=2.0, times=90):
    """``times`` findings of ``kind``, 1 s long every ``every_s``; the lines, with the log
    window's close (``due``) every 10 s of wall time as the log sink calls it."""
    lines = []
    next_window_s = (first_s // 10 + 1) * 10
    for number in range(times):
        start_s = first_s + number * every_s
        while start_s >= next_window_s:
            lines += log.due(int(next_window_s * SECOND))
            next_window_s += 10
        one = finding(kind, start_s, start_s + 1.0, cost=0.5)
        found.append(one)
        lines += log.on_finding(FindingEvent("opened", one))
        lines += log.on_finding(FindingEvent("closed", one))
    return lines


def said_times(text):
    match = re.search(r"again: (\d+) more times?", text)
    return int(match.group(1)) if match else 0


def test_a_condition_that_comes_and_goes_is_said_once_then_summed_now_and_then():
    log, found = FindingLog(), []
    lines = come_and_go(log, found)  # 90 findings in 180 s
    lines += log.flush()
    levels = [level for level, _ in lines]
    texts = [text for _, text in lines]
    assert texts[0].startswith("Engine 000: kv_saturation title since ")
    assert "Action: kv_saturation action" in texts[0] and levels[0] == logging.WARNING
    assert texts[1].startswith("Engine 000: kv_saturation title: ended after 1.0 s")
    summaries = texts[2:]
    # one per REPEAT_WINDOW_S of the 180 s, at a window's close, and the rest at the end
    assert 180 / REPEAT_WINDOW_S - 1 <= len(summaries) <= 180 / REPEAT_WINDOW_S + 1, texts
    assert all(level == logging.WARNING for level in levels[2:])
    assert all("Action: kv_saturation action" in text for text in summaries)
    # every finding is said: the first on its own, the others in the sums, once each
    assert 1 + sum(said_times(text) for text in summaries) == len(found)
    costs = [float(re.search(r"cost ([\d.]+) request-s", text).group(1)) for text in summaries]
    assert abs(sum(costs) - 0.5 * (len(found) - 1)) < 0.01


def test_a_repeat_after_a_quiet_spell_is_said_in_full_and_sums_are_spaced():
    log, found = FindingLog(), []
    lines = come_and_go(log, found, times=3)
    assert len(lines) == 2  # the first; two repeats wait for their line
    later = 104.0 + 1.0 + REPEAT_WINDOW_S + 1.0
    assert log.due(int(later * SECOND)) and not log.due(int((later + 10) * SECOND))
    again = finding(start_s=later + 5, end_s=later + 6)
    (opened,) = log.on_finding(FindingEvent("opened", again))
    assert opened[0] == logging.WARNING and " since " in opened[1] and "again" not in opened[1]


def test_faults_and_findings_without_a_clock_anchor_always_print():
    for kind, anchored in (
        ("stall", True),
        ("dead", True),
        ("kv_leak", True),
        ("waiting_kv", False),
    ):
        log = FindingLog()
        lines = []
        for number in range(5):
            one = finding(kind, 100.0 + 2 * number, 101.0 + 2 * number, anchored=anchored)
            lines += log.on_finding(FindingEvent("opened", one))
            lines += log.on_finding(FindingEvent("closed", one))
        assert len(lines) == 10 and log.flush() == [], kind


def test_a_repeat_that_lasts_is_said_on_its_own_while_it_lasts():
    """A long, costly episode right after a short one of its kind is not flicker: it gets
    its WARNING at the first window's close PROMOTE_AFTER_S into it, and its INFO."""
    log = FindingLog()
    first = finding(start_s=100.0, end_s=101.0)
    log.on_finding(FindingEvent("opened", first))
    log.on_finding(FindingEvent("closed", first))
    long = finding(start_s=105.0, end_s=106.0, cost=3.0)
    assert log.on_finding(FindingEvent("opened", long)) == []
    assert log.due(int(110 * SECOND)) == []  # 1 s old as the window closes: a repeat so far
    long.end_ns += int((PROMOTE_AFTER_S - 1.0) * SECOND)  # live_findings extends it in place
    (said,) = log.due(int(120 * SECOND))
    assert said[0] == logging.WARNING and " since " in said[1] and "again" not in said[1]
    assert f"{PROMOTE_AFTER_S:.1f} s so far, " in said[1]
    assert log.due(int(130 * SECOND)) == []  # said once
    (closed,) = log.on_finding(FindingEvent("closed", long))
    assert closed[0] == logging.INFO and "ended after" in closed[1]
    assert log.flush() == []  # nothing left to sum: it was said on its own


def test_a_repeat_far_costlier_than_the_one_said_is_said_on_its_own_at_once():
    """A warm-up blip said first (0.11 request-s), then the real episode 3 s later: once it
    costs PROMOTE_COST and twice the blip, it is said at the next window's close, not after
    the load, in a sum (the live log said nothing of an 8.6 s, 49.7 request-s episode)."""
    log = FindingLog()
    blip = finding(start_s=100.0, end_s=100.2, cost=0.11)
    log.on_finding(FindingEvent("opened", blip))
    log.on_finding(FindingEvent("closed", blip))
    real = finding(start_s=103.0, end_s=104.0, cost=0.15)
    assert log.on_finding(FindingEvent("opened", real)) == []
    real.cost = 0.2  # cheap so far: a repeat
    assert log.due(int(104 * SECOND)) == []
    real.end_ns += 3 * SECOND  # live_findings extends it in place, cost growing
    real.cost = 12.0
    (said,) = log.due(int(110 * SECOND))
    assert said[0] == logging.WARNING and " since " in said[1] and "again" not in said[1]
    (closed,) = log.on_finding(FindingEvent("closed", real))
    assert closed[0] == logging.INFO and "ended after 4.0 s" in closed[1]


def test_one_that_opens_while_another_of_its_kind_is_open_is_a_repeat():
    log = FindingLog()
    first, second = finding(start_s=100.0, end_s=103.0), finding(start_s=102.0, end_s=104.0)
    assert len(log.on_finding(FindingEvent("opened", first))) == 1
    assert log.on_finding(FindingEvent("opened", second)) == []
    assert len(log.on_finding(FindingEvent("closed", first))) == 1
    assert log.on_finding(FindingEvent("closed", second)) == []
    (summary,) = log.flush()
    assert said_times(summary[1]) == 1


def test_a_removed_engine_is_forgotten_its_repeats_said():
    """An evicted engine's open finding never closes: a new engine under its index must not
    have its findings folded as repeats of it."""
    log = FindingLog()
    stuck, repeat = finding(start_s=100.0, end_s=101.0), finding(start_s=102.0, end_s=103.0)
    for one in (stuck, repeat):
        log.on_finding(FindingEvent("opened", one))
    log.on_finding(FindingEvent("closed", repeat))
    (summary,) = log.forget(0)
    assert said_times(summary[1]) == 1 and log.flush() == []
    newcomer = finding(start_s=104.0, end_s=105.0)
    assert len(log.on_finding(FindingEvent("opened", newcomer))) == 1


def test_kinds_and_engines_fold_apart():
    log = FindingLog()
    first, other_kind = finding("waiting_kv"), finding("long_prefill", 101.5, 102.0)
    for one in (first, other_kind):
        assert len(log.on_finding(FindingEvent("opened", one))) == 1
        assert len(log.on_finding(FindingEvent("closed", one))) == 1
    other_engine = finding("waiting_kv", 102.0, 103.0)
    other_engine.engine_index = 1
    assert len(log.on_finding(FindingEvent("opened", other_engine))) == 1


def test_the_log_sink_sums_repeats_at_its_window_close_and_at_exit():
    lines = Lines()
    sink = LogSink(emit=lines)
    for second in range(100, 200):
        send(sink, heartbeat(0, second))
        if second % 2 == 0:
            one = finding("waiting_kv", second + 0.1, second + 1.0, cost=1.0)
            sink.on_finding(FindingEvent("opened", one), None)
            sink.on_finding(FindingEvent("closed", one), None)
    sums = [text for text in lines.texts(logging.WARNING) if " again: " in text]
    assert len(sums) >= 2 and said_times(sums[0]) >= 10, lines.texts()
    sink.close()
    sums_at_exit = [text for text in lines.texts(logging.WARNING) if " again: " in text]
    assert len(sums_at_exit) == len(sums) + 1
    assert sum(said_times(text) for text in sums_at_exit) == 49


def test_a_repeat_that_changes_to_a_kind_with_no_recent_finding_is_said_then():
    """Waiting for the sequence limit 10 s after the last such finding is a repeat (folded);
    when the token budget becomes its main reason and no budget finding came before, it is
    no repeat of that kind: said at the change (it was said 15 s late, at a promotion). A
    second change within REPEAT_WINDOW_S is not said again."""
    log = FindingLog()
    first = finding("waiting_seq_limit", 100.0, 101.0)
    assert log.on_finding(FindingEvent("opened", first))
    assert log.on_finding(FindingEvent("closed", first))
    second = finding("waiting_seq_limit", 111.0, 112.0)
    assert log.on_finding(FindingEvent("opened", second)) == []  # a repeat: folded
    previous = (second.kind, second.title)
    second.kind, second.title = "waiting_budget", "waiting_budget title"
    ((level, text),) = log.on_finding(FindingEvent("changed", second, previous))
    assert level == logging.WARNING
    assert text.startswith("Engine 000: waiting_budget title since ")
    assert 'until now "waiting_seq_limit title"' in text
    second.kind, second.title = "waiting_seq_limit", "waiting_seq_limit title"
    back = ("waiting_budget", "waiting_budget title")
    assert log.on_finding(FindingEvent("changed", second, back)) == []  # said 0 s ago
    ((_, closing),) = log.on_finding(FindingEvent("closed", second))
    assert closing.startswith("Engine 000: waiting_seq_limit title: ended after")


@pytest.mark.parametrize("kind", ["long_prefill", "slow_decode"])
def test_a_cheap_latency_finding_is_said_at_info_and_a_costly_one_warns(kind):
    """A 100-token prompt beside one decoding request on a CPU stretches its token by 0.1 s:
    a WARNING every 30 s of healthy load (QA, vLLM 0.32); a slowed decode's blips on a loaded
    host came as WARNINGs of 0.3 request-s. Under 1 request-s it is INFO, the repeats' line
    too while they cost under that in all; a costly one still warns."""
    log = FindingLog()
    cheap = finding(kind, cost=0.12)
    ((level, _),) = log.on_finding(FindingEvent("opened", cheap))
    assert level == logging.INFO
    log.on_finding(FindingEvent("closed", cheap))
    costly = finding(kind, start_s=200.0, end_s=201.0, cost=8.0)
    ((level, _),) = log.on_finding(FindingEvent("opened", costly))
    assert level == logging.WARNING
    ((level, _),) = log.on_finding(FindingEvent("opened", finding("kv_saturation", cost=0.1)))
    assert level == logging.WARNING  # only the quiet kinds


@pytest.mark.parametrize(("every_s", "level"), [(25.0, logging.INFO), (2.0, logging.WARNING)])
def test_long_prefill_repeats_are_summed_at_info_while_cheap(every_s, level):
    """Repeats of 0.5 request-s each: a summary of one costs under 1 request-s in all (INFO),
    one of several does not (WARNING)."""
    log = FindingLog()
    lines = come_and_go(log, [], kind="long_prefill", every_s=every_s, times=12)
    lines += log.flush()
    summaries = [line for line in lines if " again: " in line[1]]
    for said, text in summaries:
        cost = float(re.search(r"cost ([\d.]+) request-s", text)[1])
        assert said == (logging.INFO if cost < 1.0 else logging.WARNING), text
    assert level in {said for said, _ in summaries}, summaries
