"""Live findings (telemetry/analysis/live_findings.py): the sidecar, replaying a recording
through the Ingest a live sidecar runs, finds what `explain` finds in it (kind, engine,
opening iteration within one, cost within 5%), over every synthetic scenario and the
real-engine stories, in time; its window stays bounded; what it finds reaches /metrics and
/findings; a healthy engine with multi-second iterations yields no stall."""

from __future__ import annotations

import json
import logging
import re
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.analysis import live_findings
from telemetry.analysis.actions import episode_action
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.findings import episode_cost
from telemetry.analysis.live_findings import (
    FINDING_KINDS,
    LOOKBACK_S,
    EngineFindings,
    LiveFinding,
    finding_kind,
    rank_kinds,
)
from telemetry.analysis.timeline import NS_PER_S, build_timelines, read_timelines
from telemetry.lane.record import Heartbeat, IterationRecord, heartbeat, iteration_record
from telemetry.lane.recording import message_time_ns
from telemetry.sidecar.replay import replay
from telemetry.sidecar.sinks.log import LogSink
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from tests.helpers.findings import (
    Findings,
    assert_replay_agrees_with_explain,
    assert_same_actions,
    assert_same_findings,
    explained,
    replayed,
)
from tests.scenarios import real_engine
from tests.scenarios.synthetic import SCENARIOS, Simulator, arrivals

# How long after its condition began each kind may open, at most, before the 2 s the issue
# allows on top: the detector's own minimum (waiting 1 s; 10 iterations, well under 1 s in
# these scenarios) or the stall threshold's floor. A kind judged on the past (a long prefill,
# costly drafts, futile speculation) opens with the first iteration so judged.
MIN_TIME_S = {kind: 1.0 for kind in FINDING_KINDS} | {"stall": 5.0}


def assert_timely(live: list[LiveFinding]) -> None:
    """Each finding opened within its minimum time + 2 s of its condition starting (the
    replay's clock is record time)."""
    for finding in live:
        late_s = (finding.opened_ns - finding.start_ns) / NS_PER_S
        assert late_s <= MIN_TIME_S[finding.kind] + 2.0, (finding.kind, late_s)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_replayed_sidecar_finds_what_explain_finds(name, tmp_path):
    make, truth = SCENARIOS[name]
    path = make().write(tmp_path / "recording.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    live = replayed(path)
    assert_same_findings(explained(timeline), live)
    assert_same_actions(timeline, live)
    assert_timely(live)
    if truth is None:  # a healthy run, fast or slow: no finding at all, none flapping
        assert live == []


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_finding_1_is_the_true_cause_live_and_in_explain(name, tmp_path):
    """The live ranking is explain's (findings.rank_key); both name the scenario's true top
    cause first (bench/findings_accuracy.py prints the share, real stories included)."""
    from telemetry.analysis.findings import build_findings

    make, truth = SCENARIOS[name]
    path = make().write(tmp_path / "recording.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    explained_first = [
        finding_kind(f.worst)
        for f in build_findings(timeline, detect_episodes(timeline), Thresholds())
    ][:1]
    assert rank_kinds(replayed(path))[:1] == explained_first == ([truth] if truth else [])


def frozen(sim, at_s: float, for_s: float) -> list:
    """The simulator's messages as if its whole process froze at ``at_s`` for ``for_s``:
    every message sent later comes that much later, none lost (seq continuous)."""
    at_ns, shift_ns = sim.at(at_s), int(for_s * NS_PER_S)
    for message in sim.messages:
        if type(message) is Heartbeat and message.ts_ns >= at_ns:
            message.ts_ns += shift_ns
            message.wall_ns += shift_ns
        elif type(message) is IterationRecord and message.start_ns >= at_ns:
            message.start_ns += shift_ns
    messages = sorted(sim.messages, key=message_time_ns)  # sent in time order, numbered so
    for seq, message in enumerate(messages, start=messages[0].msg_seq):
        message.msg_seq = seq
    return messages


@pytest.mark.parametrize("dead_after_s", [2.5, 5.0])
def test_a_silence_is_dead_live_and_in_explain_at_the_same_dead_after(dead_after_s, tmp_path):
    """A healthy engine frozen whole for 4 s: dead for a sidecar run with the default
    --dead-after (2.5 s) and a silence for explain's default; neither for 5 s, given to both
    (explain --dead-after, the sidecar's --dead-after through its replay)."""
    make, _ = SCENARIOS["healthy"]
    sim = make()
    sim.messages = frozen(sim, at_s=10.0, for_s=4.0)
    path = sim.write(tmp_path / "frozen.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    live = replayed(path, dead_after_s=dead_after_s)
    assert_same_findings(explained(timeline, Thresholds(dead_after=dead_after_s)), live)
    assert ("dead" in {finding.kind for finding in live}) == (dead_after_s < 4)


@pytest.fixture(scope="module")
def real_stories(real_story) -> dict[str, Path]:
    """The real-engine stories, recorded through a real sidecar (shared with
    scenarios/test_real_stories.py: tests/conftest.py real_story)."""
    names = ("story1", "story2", "stall", "story3-queued", "healthy-but-slow")
    return {name: real_story(name) for name in names}


@pytest.mark.live
@pytest.mark.parametrize("name", ["story1", "story2", "stall", "story3-queued"])
def test_the_replayed_sidecar_finds_what_explain_finds_on_the_real_engine(name, real_stories):
    (timeline,) = read_timelines([real_stories[name]])[0].values()
    live = replayed(real_stories[name])
    assert_same_findings(explained(timeline), live)
    assert_timely(live)
    assert live, "each of these stories has a cause to find"


@pytest.mark.live
def test_a_healthy_engine_with_multi_second_iterations_is_not_stalled(real_stories):
    path = real_stories["healthy-but-slow"]
    (timeline,) = read_timelines([path])[0].values()
    elapsed = timeline.col("elapsed_ns") / NS_PER_S
    assert len(elapsed) >= 3 and elapsed.min() > 2.0  # every iteration took seconds
    assert replayed(path) == [] and explained(timeline) == []
    # a fixed 2 s threshold (explain's old default) calls each of them a stall: this
    # recording is the case the shared adaptive rule exists for
    assert {kind for kind, _, _ in explained(timeline, Thresholds(stall_after=2.0))} == {"stall"}
    # and the live sidecar that recorded it said nothing either
    log = (path.parent / "sidecar.log").read_text()
    assert "stalled" not in log and "WARNING" not in log, log


@pytest.mark.live
def test_the_live_sidecar_logged_the_stall_while_it_happened(real_stories):
    """The sidecar that recorded the real stall (not a replay) logged it with its action."""
    log = (real_stories["stall"].parent / "sidecar.log").read_text()
    opened = [line for line in log.splitlines() if "Engine stalled since" in line]
    assert len(opened) == 1 and "WARNING" in opened[0] and "py-spy dump --pid" in opened[0]
    assert "Engine stalled: ended after" in log


def test_a_finding_longer_than_the_window_is_costed_from_its_newest_part(tmp_path):
    make, _ = SCENARIOS["story3 sequence limit"]
    path = make().write(tmp_path / "recording.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    ((kind, iteration, cost),) = explained(timeline)
    (finding,) = replayed(path, findings_window=300)  # ~6 s of this engine
    assert (finding.kind, finding.iteration) == (kind, iteration)
    assert finding.truncated and 0 < finding.cost < cost


def records(num: int, every_s: float, start_s: float = 100.0) -> list:
    return [
        iteration_record(
            engine_index=0,
            msg_seq=i + 1,
            iteration=i + 1,
            start_ns=int((start_s + i * every_s) * NS_PER_S),
            elapsed_ns=1000,
            num_decode_reqs=1,
            num_decode_tokens=1,
            num_running_reqs=1,
            num_kv_blocks_used=1,
            num_kv_blocks_free=99,
        )
        for i in range(num)
    ]


def test_the_window_is_bounded_in_messages_and_time():
    findings = EngineFindings(0)
    for record in records(live_findings.WINDOW_MESSAGES + 500, every_s=0.001):
        findings.messages.append(record)
    assert len(findings.messages) == live_findings.WINDOW_MESSAGES
    findings = EngineFindings(0)
    for record in records(200, every_s=1.0):  # 200 s of one iteration a second
        findings.messages.append(record)
    assert findings.evaluate(300 * NS_PER_S) == []  # healthy: nothing found
    kept_s = [(r.start_ns - findings.messages[0].start_ns) / NS_PER_S for r in findings.messages]
    assert len(findings.messages) == LOOKBACK_S + 1 and kept_s[-1] == LOOKBACK_S
    assert findings.num_searches == 1


def test_a_window_that_holds_less_than_the_lookback_is_said_once(tmp_path, caplog):
    """An engine whose messages come faster than the window holds LOOKBACK_S of (~21 a
    second into 300 messages: ~14 s): the log says so once, with what it costs and the
    --findings-window that holds LOOKBACK_S, and the window's span is a metric. What it warns
    of: the drafts that stop paying at 40 s, judged on the 30 s before each step, open no
    finding live; with the default window they do, and nothing is said."""
    make, truth = SCENARIOS["drafts that stop paying"]
    path = make().write(tmp_path / "recording.jsonl")
    sink = PrometheusSink(CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="iterscope.sidecar"):
        short = [f.kind for f in replayed(path, findings_window=300)]
        replay(path, [sink], findings_window=300)
    notices = [r.getMessage() for r in caplog.records if "window is full" in r.getMessage()]
    assert len(notices) == 2  # once in each replay
    span_s = float(re.search(r"full at 300 messages, ([\d.]+) s of", notices[0]).group(1))
    assert 10 < span_s < 18, notices[0]
    assert f"less than the {LOOKBACK_S:g} s it keeps" in notices[0]
    assert "--findings-window 10000 would hold 60 s at this rate (about 10 MB" in notices[0]
    families = text_string_to_metric_families(generate_latest(sink.registry).decode())
    (window,) = [f for f in families if f.name == "iterscope_findings_window_seconds"]
    assert 10 < window.samples[0].value < 18
    assert truth not in short
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="iterscope.sidecar"):
        assert truth in [f.kind for f in replayed(path)]
    assert not [r for r in caplog.records if "window is full" in r.getMessage()]


def test_the_window_notice_is_the_line_the_docs_quote():
    """docs/diagnosis.md quotes the notice of a default window full at 14.8 s (1,351 records a
    second): the sidecar says it word for word, and only once."""
    findings = EngineFindings(0)
    num = live_findings.WINDOW_MESSAGES
    for record in records(num, every_s=14.8 / (num - 1)):
        findings.messages.append(record)
    findings.evaluate(200 * NS_PER_S)
    notice = findings.short_window_notice()
    doc = (Path(__file__).parents[1] / "docs" / "diagnosis.md").read_text()
    assert f"Engine 000: {notice}\n" in doc
    assert findings.short_window_notice() is None


def test_the_findings_window_is_a_sidecar_flag_of_positive_messages(capsys):
    from telemetry.sidecar.cli import build_parser, load_sink_modules
    from telemetry.sidecar.ingest import Ingest

    parser = build_parser(load_sink_modules())
    assert parser.parse_args([]).findings_window == live_findings.WINDOW_MESSAGES
    assert parser.parse_args(["--findings-window", "90000"]).findings_window == 90000
    with pytest.raises(SystemExit):
        parser.parse_args(["--findings-window", "0"])
    assert "--findings-window" in capsys.readouterr().err
    with pytest.raises(ValueError, match="findings_window"):
        Ingest([], findings_window=0)


def test_findings_reach_metrics_and_the_findings_endpoint(tmp_path):
    make, _ = SCENARIOS["stall"]
    path = make().write(tmp_path / "recording.jsonl")
    sink = PrometheusSink(CollectorRegistry())
    replay(path, [sink])
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(sink.registry).decode())
    }
    active = {s.labels["kind"]: s.value for s in families["iterscope_finding_active"].samples}
    assert set(active) == set(FINDING_KINDS) and not any(active.values())  # both closed
    opened = {
        s.labels["kind"]: s.value
        for s in families["iterscope_findings"].samples
        if s.name.endswith("_total")
    }
    assert opened == {"stall": 1, "waiting_seq_limit": 1}
    costs = {
        s.labels["kind"]: s.value
        for s in families["iterscope_finding_cost_request_seconds"].samples
        if s.name.endswith("_total")
    }
    port = sink.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/findings", timeout=5) as answer:
            body = json.load(answer)
    finally:
        sink.close()
    assert body["engines"] == [
        {"engine": 0, "model_name": "sim", "status": "idle", "live_findings": True}
    ]
    by_kind = {f["kind"]: f for f in body["findings"]}
    assert set(by_kind) == {"stall", "waiting_seq_limit"}
    stall = by_kind["stall"]
    assert stall["state"] == "closed" and "py-spy dump" in stall["action"]
    assert stall["cost_request_seconds"] == pytest.approx(costs["stall"], abs=0.001)
    assert 7.5 < stall["duration_s"] < 8.5 and stall["since_unix"] > 1e9


def test_an_open_finding_is_served_with_its_action_while_it_lasts(tmp_path):
    make, _ = SCENARIOS["story3 sequence limit"]
    path = make().write(tmp_path / "recording.jsonl")
    sink = PrometheusSink(CollectorRegistry())
    replay(path, [sink])
    (finding,) = sink.findings_json()["findings"]
    assert finding["state"] == "open" and finding["kind"] == "waiting_seq_limit"
    assert "--max-num-seqs" in finding["action"]
    text = generate_latest(sink.registry).decode()
    (info,) = [
        s
        for f in text_string_to_metric_families(text)
        if f.name == "iterscope_finding_info"
        for s in f.samples
    ]
    assert info.labels["kind"] == "waiting_seq_limit" and info.value == 1
    assert info.labels["action"] == finding["action"]


def test_turned_off_there_is_no_window_and_no_series(tmp_path):
    make, _ = SCENARIOS["stall"]
    path = make().write(tmp_path / "recording.jsonl")
    sink, findings = PrometheusSink(CollectorRegistry()), Findings()
    ingest = replay(path, [sink, findings], live_findings=False)
    assert findings.events == []
    assert all(state.findings is None for state in ingest.engines.values())
    text = generate_latest(sink.registry).decode()
    assert "iterscope_finding_active{" not in text


def test_more_closed_findings_than_are_served_are_not_opened_again(tmp_path, monkeypatch):
    """A saturated engine closes many short findings a minute; those the window still shows
    stay closed however few of them /findings keeps."""
    make, _ = SCENARIOS["KV capacity"]  # 15 KV saturation episodes, 3 storms, a cliff
    path = make().write(tmp_path / "recording.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    monkeypatch.setattr(live_findings, "RECENT_CLOSED", 2)
    live = replayed(path)
    assert_same_findings(explained(timeline), live)


def test_an_engine_on_another_host_is_stalled_on_its_own_clock():
    """The sidecar's clock and a remote engine's monotonic clock share no origin: a stall
    (judged on the sidecar's clock) is placed on the engine's, like every other finding."""
    from telemetry.lane.record import heartbeat
    from telemetry.sidecar.ingest import Ingest

    engine_s, sidecar_s, wall_s = 5_000_000.0, 100.0, 1_700_000_000.0  # three clocks
    sink = Findings()
    ingest = Ingest([sink])

    def at(second: float, message) -> None:
        ingest.on_message(message, int((sidecar_s + second) * NS_PER_S))
        ingest.tick(int((sidecar_s + second) * NS_PER_S) + 1)

    def beat(seq: int, second: float):
        ts = int((engine_s + second) * NS_PER_S)
        return heartbeat(0, seq, ts, ts + int((wall_s - engine_s) * NS_PER_S), num_running_reqs=2)

    at(0.0, beat(1, 0.0))
    (record,) = records(1, every_s=1.0, start_s=engine_s + 0.5)
    record.msg_seq = 2
    at(0.5, record)
    for second in range(1, 12):  # heartbeats with work, no iteration: stalled after 5 s
        at(second, beat(second + 2, second))
    (stall,) = [f for f in sink.findings if f.kind == "stall"]
    assert stall.start_ns == pytest.approx((engine_s + 0.5) * NS_PER_S, abs=1e7)
    assert stall.start_wall_ns == pytest.approx((wall_s + 0.5) * NS_PER_S, abs=1e7)
    assert stall.end_ns == pytest.approx((engine_s + 11) * NS_PER_S, abs=1e7)
    assert stall.iteration == 1 and stall.cost == pytest.approx(2 * 10.5, rel=0.02)


def test_the_search_budget_is_shared_by_the_engines_and_paces_the_searches():
    from telemetry.lane.record import heartbeat
    from telemetry.sidecar.ingest import Ingest

    ingest = Ingest([])
    for index in range(4):
        ingest.on_message(heartbeat(index, 1, NS_PER_S, NS_PER_S), NS_PER_S)
    shares = [state.findings.search_share for state in ingest.engines.values()]
    assert shares == [live_findings.MAX_EVALUATE_SHARE / 4] * 4
    findings = EngineFindings(0)
    findings.search_share = 1e-12  # any search took far longer than this share allows
    batch = records(20, every_s=0.1)
    findings.messages.extend(batch[:10])
    findings.evaluate(200 * NS_PER_S)
    findings.messages.extend(batch[10:])
    findings.evaluate(300 * NS_PER_S)  # new messages, 100 s later: still too soon
    assert findings.num_searches == 1
    findings.evaluate(300 * NS_PER_S, force=True)
    assert findings.num_searches == 2


class FindingsWatcher:
    """Polls a live sidecar's /findings every 50 ms from a thread: when each finding (kind,
    since) was first served, in wall time."""

    def __init__(self, port: int) -> None:
        import threading

        self.url = f"http://127.0.0.1:{port}/findings"
        self.first_seen: dict[tuple[str, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import time

        while not self._stop.wait(0.05):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    body = json.load(answer)
            except OSError:
                continue  # not serving yet, or gone
            now = time.time()
            for finding in body["findings"]:
                self.first_seen.setdefault((finding["kind"], finding["since_unix"]), now)

    def stop(self) -> dict[tuple[str, float], float]:
        self._stop.set()
        self._thread.join(5)
        return self.first_seen


@pytest.mark.live
@pytest.mark.parametrize(
    ("story", "kind"),
    [
        (lambda out, port: real_engine.stalled(out, metrics_port=port), "stall"),
        (
            lambda out, port: real_engine.story3_bursty(out, 2, metrics_port=port),
            "waiting_seq_limit",
        ),
    ],
    ids=["stall", "story3-queued"],
)
def test_a_live_sidecar_opens_the_finding_in_time_on_the_real_engine(story, kind, tmp_path):
    """Injected into the real engine, a stall and a queue behind --max-num-seqs are served on
    /findings within their minimum time + 2 s of the condition starting (its since time)."""
    from tests.helpers.net import free_port

    port = free_port()
    watcher = FindingsWatcher(port)
    try:
        story(tmp_path, port)
    finally:
        first_seen = watcher.stop()
    delays = {key: seen - key[1] for key, seen in first_seen.items() if key[0] == kind}
    assert len(delays) == 1, first_seen
    (delay,) = delays.values()
    assert 0 < delay <= MIN_TIME_S[kind] + 2.0, delay


def test_an_iteration_judged_again_on_part_of_its_past_opens_no_finding():
    """tests/data/vllm_0.28_plugin_stall.jsonl: vLLM 0.28 on its CPU build through the
    stat-logger plugin (tests/test_vllm_live.py, under `make test-vllm-versions`), 0.3 s
    steps, a hung engine core. The window keeps 60 s: an iteration is first judged with the 30
    s before it in the window, and judged again at every search until it leaves it, the last
    30 s of those on a past the window has partly dropped. So judged, iterations 38 and 65
    passed for long prefills, 46 and 56 s late: the sidecar opens only what explain finds,
    each as its record comes (the one inside the stall ends 6.7 s after it starts). Iteration
    262, decode-only with 2 requests, took 2.2 s against ~70 ms: a slowed decode, live too."""
    path = Path(__file__).parent / "data" / "vllm_0.28_plugin_stall.jsonl"
    live = assert_replay_agrees_with_explain(path)
    kinds = sorted(f.kind for f in live)
    assert kinds == ["long_prefill", "long_prefill", "slow_decode", "stall"]
    assert all(f.opened_ns - f.start_ns < 10 * NS_PER_S for f in live)


def test_a_spinning_engine_is_one_finding_live_as_in_explain(tmp_path):
    """Leaked blocks leave requests waiting while nothing runs; the engine iterates on,
    scheduling nothing, and its heartbeats' last_iteration stays at the last that scheduled
    work (record.py). The sidecar's status is stalled (no progress), but the loop runs: live
    and explain say "Engine spinning" once; live had opened "Engine stalled" beside it, whose
    action (a stack dump of a frozen loop) does not fit a loop that runs."""
    from tests.scenarios.synthetic import STORY_COST

    sim = Simulator(num_blocks=60, max_num_seqs=8, max_num_batched_tokens=512, cost=STORY_COST)
    sim.leak_blocks_per_finish = 12
    sim.add_requests(arrivals(2, 10), num_prompt=64, num_output=20)
    path = sim.run(30).write(tmp_path / "spinning.jsonl")
    live = assert_replay_agrees_with_explain(path)
    assert "spinning" in [f.kind for f in live] and "stall" not in [f.kind for f in live]


def bursts_slowed_with_idle_between() -> list:
    """Bursts of 0.6 s of one request decoding in 10 ms iterations, every fifth 200 ms, with
    0.5 s between bursts in which a heartbeat says nothing waits or runs; before them 40 s
    of steady decoding (the baseline)."""
    messages, seq, iteration, now_ns = [], 0, 0, 100 * NS_PER_S

    def beat(waiting_running: tuple[int, int]) -> None:
        nonlocal seq
        seq += 1
        waiting, running = waiting_running
        messages.append(
            heartbeat(0, seq, now_ns, now_ns, last_iteration=iteration, pid=5,
                      num_waiting_reqs=waiting, num_running_reqs=running)
        )  # fmt: skip

    def step(elapsed_ns: int) -> None:
        nonlocal seq, iteration, now_ns
        seq, iteration = seq + 1, iteration + 1
        messages.append(
            iteration_record(0, seq, iteration, start_ns=now_ns, elapsed_ns=elapsed_ns,
                             num_decode_reqs=1, num_decode_tokens=1, num_running_reqs=1,
                             num_kv_blocks_used=1, num_kv_blocks_free=99)
        )  # fmt: skip
        now_ns += elapsed_ns

    beat((0, 1))
    for number in range(4000):
        step(10_000_000)
        if number % 100 == 0:
            beat((0, 1))
    for _ in range(10):
        for number in range(20):
            step(200_000_000 if number % 5 == 0 else 10_000_000)
        now_ns += 250_000_000
        beat((0, 0))  # idle, for a moment
        now_ns += 250_000_000
    return messages


def test_a_slowed_decode_over_moments_of_idle_is_one_finding_live_as_in_explain(tmp_path):
    """explain merges the slowed iterations of bursts 0.5 s apart into one episode; the live
    finding closed at the first idle heartbeat between them and was not opened again, costed
    at a tenth of explain's (a real engine's leak story under CPU load)."""
    path = tmp_path / "bursts.jsonl"
    path.write_bytes(
        b"".join(msgspec.json.encode(m) + b"\n" for m in bursts_slowed_with_idle_between())
    )
    live = assert_replay_agrees_with_explain(path)
    assert [f.kind for f in live] == ["slow_decode"]


def test_a_stall_just_over_its_threshold_is_stalled_live_though_no_tick_fell_in_it():
    """tests/data/vllm_0.32_plugin_stall_at_threshold.jsonl: vLLM 0.32 through the stat-logger
    plugin, its engine core stopped until the live sidecar said stalled (tests/test_vllm_live.py
    under `make test-vllm-versions`, where this replay once missed it): iteration 253 held for
    5.05 s against a 5 s threshold. A replay ticks every 0.1 s on its own grid, which may miss
    the 52 ms over; the record of the next iteration says it: stalled, as explain calls it."""
    path = Path(__file__).parent / "data" / "vllm_0.32_plugin_stall_at_threshold.jsonl"
    live = assert_replay_agrees_with_explain(path)
    (stall,) = [f for f in live if f.kind == "stall"]
    assert stall.iteration == 253 and stall.closed


def test_a_silence_just_over_dead_after_is_dead_live_though_no_tick_fell_in_it():
    """tests/data/vllm_0.28_scheduler_stopped.jsonl: vLLM 0.28 through the scheduler source,
    its engine core stopped until the live sidecar said dead (tests/test_vllm_scheduler_live.py
    under `make test-vllm-versions`): 2.56 s without a message. A replay ticks every 0.1 s on
    its own grid, which may miss the 60 ms over 2.5 s; the message after the silence says
    it: dead, as explain calls the silence."""
    path = Path(__file__).parent / "data" / "vllm_0.28_scheduler_stopped.jsonl"
    live = assert_replay_agrees_with_explain(path)
    assert "dead" in {finding.kind for finding in live}


def test_a_real_vllm_whose_drafts_cost_more_than_they_save_is_told_so_live_and_in_explain():
    """A recording of vLLM 0.32 (CPU build, the scheduler source) drafting by ngram with few
    drafts accepted (bench/drafts_payoff_vllm.py: the same load without drafts measured 2.46x
    faster per output token): the replayed sidecar opens explain's findings, the drafts in
    time, at the same iteration and cost, and both rank them first; no stall (vLLM's first
    steps are long, and in progress when the first busy heartbeat comes)."""
    path = Path(__file__).parent / "data" / "vllm_costly_drafts.jsonl"
    (timeline,) = read_timelines([path])[0].values()
    live = assert_replay_agrees_with_explain(path)
    (drafts,) = [finding for finding in live if finding.kind == "costly_drafts"]
    ((_, iteration, cost),) = [row for row in explained(timeline) if row[0] == "costly_drafts"]
    assert abs(drafts.iteration - iteration) <= 1
    assert drafts.cost == pytest.approx(cost, rel=0.05)
    assert_timely([drafts])
    assert rank_kinds(live)[0] == "costly_drafts"
    assert "stall" not in {finding.kind for finding in live}


def waiting_that_changes_reason() -> list:
    """Two requests wait 3 s for the sequence limit, then 12 s for the token budget, with
    no break in between: one stretch of waiting, mostly for the budget."""
    start_ns, step_ns = 100 * NS_PER_S, NS_PER_S // 10
    messages = [heartbeat(0, 1, start_ns, start_ns, num_running_reqs=2, max_num_seqs=2, pid=9)]
    for i in range(200):
        reason = (
            {}
            if i >= 150
            else {"num_waiting_seq_limit_reqs": 2}
            if i < 30
            else {"num_waiting_budget_reqs": 2}
        )
        messages.append(
            iteration_record(
                0,
                i + 2,
                i + 1,
                start_ns=start_ns + i * step_ns,
                elapsed_ns=step_ns - 1000,
                num_decode_reqs=2,
                num_decode_tokens=2,
                num_running_reqs=2,
                num_waiting_reqs=2 if reason else 0,
                num_kv_blocks_used=10,
                num_kv_blocks_free=90,
                **reason,
            )
        )
    return messages


def test_waiting_whose_main_reason_changes_is_one_finding_as_in_explain(tmp_path, caplog):
    """Live, the waiting opens as the sequence limit's and becomes the budget's as that
    reason takes over: one finding with explain's kind, cost and action (it was two, the
    same waiting counted twice, with opposite actions), and a log line saying the change."""
    path = tmp_path / "recording.jsonl"
    path.write_bytes(
        b"".join(msgspec.json.encode(m) + b"\n" for m in waiting_that_changes_reason())
    )
    (timeline,) = read_timelines([path])[0].values()
    sink = Findings()
    with caplog.at_level(logging.WARNING):
        replay(path, [sink, LogSink()])
    assert [(what, finding.kind) for what, finding in sink.events] == [
        ("opened", "waiting_budget"),
        ("changed", "waiting_budget"),
        ("closed", "waiting_budget"),
    ]
    assert sink.events[1][1] is sink.events[0][1]  # the one finding, changed in place
    live = sink.findings
    assert explained(timeline)[0][0] == "waiting_budget"
    assert_same_findings(explained(timeline), live)
    assert_same_actions(timeline, live)
    (changed,) = [r.message for r in caplog.records if "until now" in r.message]
    assert changed.startswith("Engine 000: Requests waiting: --max-num-batched-tokens since ")
    assert 'until now "Requests waiting: --max-num-seqs"' in changed


def frozen_mid_iteration(sim, after_s: float, for_s: float) -> list:
    """The simulator's messages as if its process froze for ``for_s`` inside the first
    iteration after ``after_s`` that carries a prompt chunk beside decoding requests: that
    iteration takes ``for_s`` longer, every message after its start comes that much later."""
    records = [m for m in sim.messages if type(m) is IterationRecord]
    frozen = next(
        r
        for r in records
        if r.start_ns >= sim.at(after_s) and r.num_prefill_tokens and r.num_decode_reqs
    )
    shift_ns = int(for_s * NS_PER_S)
    for message in sim.messages:
        if type(message) is Heartbeat and message.ts_ns > frozen.start_ns:
            message.ts_ns += shift_ns
            message.wall_ns += shift_ns
        elif type(message) is IterationRecord and message.start_ns > frozen.start_ns:
            message.start_ns += shift_ns
    frozen.elapsed_ns += shift_ns
    frozen.model_elapsed_ns += shift_ns
    messages = sorted(sim.messages, key=message_time_ns)
    for seq, message in enumerate(messages, start=messages[0].msg_seq):
        message.msg_seq = seq
    return messages


def test_an_iteration_frozen_mid_way_is_the_silence_s_not_a_long_prefill(tmp_path):
    """A SIGSTOP inside a prompt chunk made that chunk an 11.5 s "long prefill", ranked above
    the silence and charged the same request-seconds twice, and the waiting across it counted
    again: the freeze is the silence's alone, live and in explain."""
    make, _ = SCENARIOS["story3 sequence limit"]
    messages = frozen_mid_iteration(make(), after_s=5.0, for_s=11.0)
    path = tmp_path / "frozen.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in messages))
    (timeline,) = read_timelines([path])[0].values()
    episodes = detect_episodes(timeline, Thresholds())
    (silence,) = [e for e in episodes if "silent_time_s" in e.numbers]
    assert silence.numbers["silent_time_s"] >= 10.9
    assert not [e for e in episodes if e.kind == "long_prefill" and e.numbers["max_elapsed_s"] > 10]
    # the waiting across the freeze costs what it did unfrozen, give or take the second
    # between the last message and the stop (it was 11 s x the requests waiting more)
    unfrozen = build_timelines(make().messages)[0]
    frozen_cost, unfrozen_cost = (
        sum(episode_cost(tl, e, Thresholds()) for e in detect_episodes(tl) if e.kind == "waiting")
        for tl in (timeline, unfrozen)
    )
    most_waiting = int(timeline.col("num_waiting_reqs").max())
    assert unfrozen_cost > 0 and abs(frozen_cost - unfrozen_cost) <= most_waiting * 1.1
    live = replayed(path)
    assert_same_findings(explained(timeline), live)


def test_the_waiting_cost_takes_out_silences_by_the_run_s_dead_after():
    """A 4 s freeze is a silence at the default dead_after (2.5 s), and the waiting across it
    is the silence's cost; with --dead-after 5 it is no silence, and the waiting it held is
    the waiting's cost (episode_cost took silences out at the default whatever the run's)."""
    make, _ = SCENARIOS["story3 sequence limit"]
    timeline = build_timelines(frozen_mid_iteration(make(), after_s=5.0, for_s=4.0))[0]

    def waiting_cost(thresholds: Thresholds) -> float:
        episodes = detect_episodes(timeline, thresholds)
        return sum(episode_cost(timeline, e, thresholds) for e in episodes if e.kind == "waiting")

    frozen_row = int(timeline.col("elapsed_ns").argmax())
    waiting_across = int(timeline.col("num_waiting_reqs")[frozen_row])
    assert waiting_across > 0
    by_default, patient = waiting_cost(Thresholds()), waiting_cost(Thresholds(dead_after=5.0))
    assert patient - by_default == pytest.approx(waiting_across * 4.0, rel=0.1)


def test_a_kv_finding_s_action_follows_its_episode_and_ends_as_explain_s(tmp_path):
    """A KV size reads the requests that run in the episode (actions.kv_action_basis): the
    live finding opened on a warm-up's short requests ("at least", a bound) and, as requests
    of the episode finish, says what explain says of the whole episode."""
    sim = Simulator(num_blocks=34, max_num_seqs=32, max_num_batched_tokens=1024)
    sim.add_requests([0.5, 0.6], num_prompt=16, num_output=15)  # the warm-up
    sim.add_requests(arrivals(4, 30, start_s=5), num_prompt=100, num_output=200)
    path = sim.run(60).write(tmp_path / "kv.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    (episode,) = [e for e in detect_episodes(timeline) if e.kind == "waiting"]
    (live,) = [f for f in replayed(path) if f.kind == "waiting_kv"]
    assert live.action == episode_action(timeline, episode, Thresholds())
    assert "(it holds 1 request of 300 tokens" in live.action


def decoding_then_a_long_step(step_s: float) -> list:
    """Two requests decoding in 30 ms iterations for 100 s (heartbeats every second), then
    an 8,000-token prompt computed beside them in one step of ``step_s``, then decoding."""
    messages, seq, now_ns, iteration = [], 0, 10 * NS_PER_S, 0
    next_beat_ns = now_ns

    def beats_until(end_ns: int, step_tokens: int) -> None:
        nonlocal seq, next_beat_ns
        while next_beat_ns < end_ns:
            seq += 1
            messages.append(
                heartbeat(
                    0,
                    seq,
                    next_beat_ns,
                    next_beat_ns,
                    last_iteration=iteration,
                    num_running_reqs=3,
                    pid=5,
                    block_size=16,
                    num_kv_blocks_total=1000,
                    step_tokens=step_tokens,
                )
            )
            next_beat_ns += NS_PER_S

    def step(elapsed_ns: int, prompt_tokens: int = 0) -> None:
        nonlocal seq, now_ns, iteration
        beats_until(now_ns + elapsed_ns, prompt_tokens + 2)
        iteration += 1
        seq += 1
        messages.append(
            iteration_record(
                0,
                seq,
                iteration,
                start_ns=now_ns,
                elapsed_ns=elapsed_ns,
                num_prefill_reqs=int(bool(prompt_tokens)),
                num_prefill_tokens=prompt_tokens,
                num_decode_reqs=2,
                num_decode_tokens=2,
                num_running_reqs=3,
                num_kv_blocks_used=100,
                num_kv_blocks_free=900,
                num_kv_tokens=1600,
            )
        )
        now_ns += elapsed_ns

    for _ in range(int(100 / 0.03)):
        step(30_000_000)
    step(int(step_s * NS_PER_S), prompt_tokens=8000)
    for _ in range(200):
        step(30_000_000)
    return messages


def test_a_step_longer_than_the_lookback_less_its_history_opens_live(tmp_path):
    """A 45 s step of an engine older than LOOKBACK_S: its record comes 45 s after it began,
    and the 30 s before it that it is judged on had been dropped from the window: explain
    found it, live (and a replay) never did."""
    path = tmp_path / "long_step.jsonl"
    messages = decoding_then_a_long_step(45.0)
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in messages))
    (timeline,) = read_timelines([path])[0].values()
    expected = explained(timeline)
    assert [kind for kind, _, _ in expected] == ["long_prefill"]
    assert_same_findings(expected, replayed(path))
