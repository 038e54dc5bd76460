"""`iterscope top`: the window arithmetic on hand-made buckets, frames from the Prometheus sink's
own exposition, the unreachable sidecar, and (live) the command against a real sidecar: one
replaying a recording whose finding stays open, one fed by a running engine."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.entrypoints.cli import main as iterscope
from telemetry.analysis.live_findings import RECENT_CLOSED
from telemetry.lane.record import (
    EVENT_FIRST_TOKEN,
    RequestMilestone,
    SpecDecodeCounts,
    heartbeat,
    iteration_record,
)
from telemetry.sidecar import top
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.scrape import (
    Scrape,
    bucket_increase,
    bucket_quantile,
    parse_metrics,
)
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from tests.helpers import REPO
from tests.helpers.fake_engine import start_engine, stop_engine
from tests.helpers.net import free_port
from tests.helpers.processes import (
    METRICS_URL_LINE,
    start_metrics_sidecar,
    stop_process,
    wait_for_log,
)
from tests.helpers.prom import scrape, total
from tests.helpers.sink_feed import send, set_status
from tests.helpers.wait import wait_until
from tests.scenarios.synthetic import SCENARIOS

MS = 1_000_000
INF = float("inf")
TOP_TIMEOUT_S = 60


# --------------------------------------------------------------------------------------------
# Buckets made by hand


def test_a_quantile_interpolates_within_the_bucket_its_rank_falls_in_as_prometheus_does():
    before = [(0.1, 10.0), (0.5, 10.0), (1.0, 10.0), (INF, 10.0)]
    after = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]
    window = bucket_increase(before, after)
    assert window == [(0.1, 0.0), (0.5, 20.0), (1.0, 30.0), (INF, 30.0)]
    # p50: rank 15 of 30 falls in (0.1, 0.5], 15 of its 20 -> 0.1 + 0.4 * 15/20
    assert bucket_quantile(0.5, window) == pytest.approx(0.4)
    # p99: rank 29.7 falls in (0.5, 1.0], 9.7 of its 10
    assert bucket_quantile(0.99, window) == pytest.approx(0.5 + 0.5 * 9.7 / 10)
    # The first bucket starts at 0.
    assert bucket_quantile(0.5, [(0.1, 4.0), (INF, 4.0)]) == pytest.approx(0.05)


def test_a_quantile_above_the_highest_bound_reads_as_that_bound():
    assert bucket_quantile(0.99, [(0.1, 1.0), (1.0, 2.0), (INF, 100.0)]) == 1.0


def test_a_window_without_new_observations_has_no_quantile():
    buckets = [(0.1, 3.0), (1.0, 5.0), (INF, 5.0)]
    window = bucket_increase(buckets, buckets)
    assert window == [(0.1, 0.0), (1.0, 0.0), (INF, 0.0)]
    assert bucket_quantile(0.5, window) is None
    assert bucket_quantile(0.5, []) is None


def test_a_bucket_that_went_down_is_a_reset_and_differing_bounds_no_difference():
    before = [(0.1, 50.0), (INF, 80.0)]
    after = [(0.1, 2.0), (INF, 4.0)]  # the engine came back: counts from 0 again
    assert bucket_increase(before, after) == after
    assert bucket_increase(before, [(0.2, 60.0), (INF, 90.0)]) is None
    assert bucket_increase([], after) is None


def test_a_quantile_outside_0_to_1_is_refused():
    with pytest.raises(ValueError):
        bucket_quantile(0.0, [(1.0, 1.0), (INF, 1.0)])


# --------------------------------------------------------------------------------------------
# Frames from the Prometheus sink's own exposition (so the series names are the sink's)


def decode_record(iteration: int, start_ms: int, *milestones: RequestMilestone):
    """A decode iteration of 8 requests lasting 8 ms; 3 requests wait for max_num_seqs."""
    return iteration_record(
        0,
        iteration + 1,
        iteration,
        start_ns=start_ms * MS,
        elapsed_ns=8 * MS,
        num_decode_reqs=8,
        num_decode_tokens=8,
        num_running_reqs=8,
        num_waiting_reqs=3,
        num_waiting_seq_limit_reqs=3,
        num_kv_blocks_used=25,
        num_kv_blocks_free=75,
        num_kv_tokens=390,
        milestones=list(milestones),
    )


def first_token(request_id: str, ttft_ms: int) -> RequestMilestone:
    return RequestMilestone(
        request_id, EVENT_FIRST_TOKEN, 1_000 * MS, 1_001 * MS, (1_000 + ttft_ms) * MS, 0,
        100, 0, 1, 0, -1,
    )  # fmt: skip


def scrape_of(sink: PrometheusSink, registry: CollectorRegistry, time_s: float, findings: dict):
    engines, model_names = parse_metrics(generate_latest(registry).decode())
    return Scrape(time_s, engines, model_names, findings)


FINDINGS = {
    "engines": [{"engine": 0, "model_name": "tiny", "status": "running", "live_findings": True}],
    "findings": [
        {
            "engine": 0,
            "kind": "waiting_seq_limit",
            "title": "Requests waiting: --max-num-seqs",
            "state": "open",
            "since_unix": 1_700_000_000.0,
            "duration_s": 12.5,
            "start_iteration": 3,
            "cost_request_seconds": 37.5,
            "cost_label": "waiting",
            "evidence": "waiting > 0 in 40 iterations",
            "action": "Set --max-num-seqs 16 (now 8).",
        },
        *[
            {
                "engine": 0,
                "kind": "kv_saturation",
                "title": f"closed number {number}",
                "state": "closed",
                "since_unix": 1_700_000_000.0 - number,
                "duration_s": 2.0,
                "start_iteration": 1,
                "cost_request_seconds": 0.004,
                "cost_label": "waiting",
                "evidence": "not shown for a closed finding",
                "action": "not shown for a closed finding",
            }
            for number in range(top.MAX_CLOSED_SHOWN + 2)
        ],
    ],
}


def two_scrapes(status: EngineStatus = EngineStatus.RUNNING) -> tuple[Scrape, Scrape]:
    """Iterations 0..9, 50 ms apart, with a first token after 5 s; two seconds later 10..29,
    10 ms apart, with first tokens after 30, 40 and 400 ms; the engine's status then."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(0, 0, 500 * MS, 1_700_000_000 * 10**9, model_name="tiny",
                         num_kv_blocks_total=100, pid=42))  # fmt: skip
    send(sink, *(decode_record(i, 1_000 + 50 * i) for i in range(10)))
    send(sink, decode_record(10, 1_460, first_token("old", 5_000)))
    set_status(sink, 0, EngineStatus.RUNNING, 0)
    before = scrape_of(sink, registry, 10.0, FINDINGS)
    send(sink, *(decode_record(i, 1_460 + 10 * (i - 10)) for i in range(11, 30)))
    send(
        sink,
        decode_record(30, 1_660, first_token("a", 30), first_token("b", 40), first_token("c", 400)),
    )
    set_status(sink, 0, status, 0)
    return before, scrape_of(sink, registry, 12.0, FINDINGS)


def test_a_frame_says_who_reports_and_which_engine_once_a_heartbeat_named_them():
    before, after = two_scrapes()
    assert not any(line.startswith("  source") for line in top.engine_lines(0, before, after, None))
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(0, 1, 500 * MS, 1_700_000_000 * 10**9, model_name="m", pid=7,
                         source="vllm-stat-logger", engine_version="vllm 0.34.0"))  # fmt: skip
    lines = top.engine_lines(0, None, scrape_of(sink, registry, 1.0, FINDINGS), None)
    assert lines[:2] == ["engine 000  m  idle", "  source      vllm-stat-logger, vllm 0.34.0"]


def test_a_frame_takes_rates_and_latencies_over_the_window_between_two_scrapes():
    before, after = two_scrapes()
    text = top.frame("http://sidecar:9470", before, after, width=None)
    lines = text.splitlines()
    assert lines[0].startswith("iterscope top  http://sidecar:9470") and "window 2.0 s" in lines[0]
    assert "engine 000  tiny  running" in lines
    assert "  iterations  10.0/s" in lines  # 20 iterations in 2 s
    assert "  batch       8 running, 8.0 decoding per iteration" in lines
    assert "  waiting     3 (seq_limit 3)" in lines
    assert "  KV cache    25.0% used" in lines
    # 20 x 8 inter-token intervals of 10 ms, all in the bucket (7.5 ms, 10 ms]
    assert quantiles_ms(lines, "ITL") == pytest.approx((8.75, 9.975), abs=0.06)  # printed to 0.1 ms
    # first tokens of 30, 40 and 400 ms: buckets (20 ms, 40 ms] twice, (250 ms, 500 ms] once
    p50 = 20 + 20 * 1.5 / 2  # rank 1.5 of the 2 in (20, 40]
    p99 = 250 + 250 * (0.99 * 3 - 2)  # rank 2.97: 0.97 of the 1 in (250, 500]
    assert quantiles_ms(lines, "TTFT") == pytest.approx((p50, p99), abs=0.06)  # printed to 0.1 ms


def test_an_engine_that_scores_drafts_shows_their_acceptance_over_the_window():
    """No drafts line for an engine that never drafted; for one that does, the window's own
    drafts, counted from 0 where its counters first appear inside the window; a dash for a
    window without drafts."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(0, 0, 500 * MS, 1_700_000_000 * 10**9, model_name="tiny",
                         num_kv_blocks_total=100, pid=42))  # fmt: skip
    send(sink, decode_record(0, 1_000))
    plain = scrape_of(sink, registry, 10.0, FINDINGS)
    assert not any("drafts" in line for line in top.frame("u", None, plain, None).splitlines())

    def drafts_line(before: Scrape, iteration: int, counts: SpecDecodeCounts):
        """The frame's drafts line after one more record scoring ``counts``, and the scrape."""
        drafting = decode_record(iteration, 1_000 + 10 * iteration)
        drafting.spec_decode = counts
        send(sink, drafting)
        after = scrape_of(sink, registry, before.time_s + 1, FINDINGS)
        (line,) = [
            line for line in top.frame("u", before, after, None).splitlines() if "drafts" in line
        ]
        return line, after

    line, first = drafts_line(plain, 1, SpecDecodeCounts(4, 12, 3, [2, 1, 0]))
    assert line == "  drafts      25.0% of draft tokens accepted, mean acceptance length 1.75"
    assert "  drafts      n/a" in top.frame("u", None, first, None).splitlines()
    line, second = drafts_line(first, 2, SpecDecodeCounts(2, 6, 6, [2, 2, 2]))
    assert line == "  drafts      100.0% of draft tokens accepted, mean acceptance length 4.00"
    quiet = top.frame("u", Scrape(11.0, second.engines, {}, FINDINGS), second, None).splitlines()
    assert "  drafts      –" in quiet


def quantiles_ms(lines: list[str], name: str) -> tuple[float, float]:
    """(p50, p99) in ms from a frame's line ``  NAME  p50 X ms  p99 Y ms``."""
    (line,) = [line for line in lines if line.startswith(f"  {name} ")]
    words = line.split()
    assert words[1::3] == ["p50", "p99"] and words[3::3] == ["ms", "ms"], line
    return float(words[2]), float(words[5])


def test_a_dead_engines_gauges_say_they_are_what_it_last_reported():
    before, after = two_scrapes(EngineStatus.DEAD)
    lines = top.frame("u", before, after, width=None).splitlines()
    assert "engine 000  tiny  dead" in lines
    stale = "  (last reported, before it went silent)"
    assert f"  waiting     3 (seq_limit 3){stale}" in lines
    assert f"  KV cache    25.0% used{stale}" in lines
    assert "  waiting     3 (seq_limit 3)" in top.frame("u", *two_scrapes(), None).splitlines()


def test_a_stalled_engine_whose_iterations_go_on_is_said_to_spin():
    """Stalled (no progress) while iterations go on scheduling nothing: "spinning", never
    "stalled" beside an iteration rate (QA: "stalled" next to "iterations 95.4/s")."""
    lines = top.frame("u", *two_scrapes(EngineStatus.STALLED), width=None).splitlines()
    assert "engine 000  tiny  stalled: spinning, its iterations schedule nothing" in lines
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(0, 0, 500 * MS, 1_700_000_000 * 10**9, model_name="tiny", pid=42))
    send(sink, decode_record(1, 1_000))
    set_status(sink, 0, EngineStatus.STALLED, 0)
    frozen = scrape_of(sink, registry, 10.0, FINDINGS)
    lines = top.frame("u", frozen, scrape_of(sink, registry, 12.0, FINDINGS), None).splitlines()
    assert "engine 000  tiny  stalled" in lines  # no iteration between the scrapes: frozen


def test_the_first_frame_says_n_a_and_a_quiet_window_says_dash():
    before, after = two_scrapes()
    first = top.frame("u", None, after, width=None).splitlines()
    assert "window n/a" in first[0]
    assert "  iterations  n/a" in first and "  TTFT        p50 n/a  p99 n/a" in first
    assert "  waiting     3 (seq_limit 3)" in first  # gauges need no window
    quiet = top.frame("u", Scrape(11.0, after.engines, {}, FINDINGS), after, width=None)
    assert "  iterations  0.0/s" in quiet.splitlines()
    assert "  TTFT        p50 –  p99 –" in quiet.splitlines()
    assert "  batch       8 running, – decoding per iteration" in quiet.splitlines()


def test_a_frame_shows_open_findings_whole_and_the_newest_closed_ones_briefly():
    before, after = two_scrapes()
    lines = top.frame("u", before, after, width=None).splitlines()
    assert "  open findings: 1" in lines
    opened = lines.index("  open findings: 1") + 1
    assert lines[opened].startswith("    ! Requests waiting: --max-num-seqs  since ")
    assert lines[opened].endswith("(12.5 s), 37.5 request-s waiting")
    assert lines[opened + 1] == "      evidence: waiting > 0 in 40 iterations"
    assert lines[opened + 2] == "      action: Set --max-num-seqs 16 (now 8)."
    closed = [line for line in lines if line.startswith("    - ")]
    assert len(closed) == top.MAX_CLOSED_SHOWN  # the newest, in the order /findings gives
    for number, line in enumerate(closed):
        assert line.startswith(f"    - closed number {number}  "), line
    assert closed[0].endswith("lasted 2.0 s, < 0.01 request-s waiting")
    assert "not shown" not in "\n".join(lines)


def test_closed_findings_of_one_title_are_one_line():
    """A condition that came and went many times: one line, as the log sums it."""
    findings = [
        {
            "title": title,
            "state": "closed",
            "since_unix": 1_700_000_000.0 - number,
            "duration_s": 0.5,
            "cost_request_seconds": 1.5,
            "cost_label": "waiting",
        }
        for number, title in enumerate(["KV cache saturated", "Long prefill"] * 3 + ["Old"])
    ]
    lines = top.finding_lines(findings, width=None)
    assert lines[2].startswith("    - KV cache saturated  3 times, the last ")
    assert lines[2].endswith("(lasted 0.5 s), 4.5 request-s waiting in all")
    assert lines[3].startswith("    - Long prefill  3 times, ")
    assert lines[4].startswith("    - Old  ") and lines[4].endswith(
        "lasted 0.5 s, 1.5 request-s waiting"
    )
    # the sidecar keeps the newest RECENT_CLOSED: with that many, a count is a lower bound
    kept = [{**findings[0], "since_unix": 1_700_000_000.0 - n} for n in range(RECENT_CLOSED)]
    lines = top.finding_lines(kept, width=None)
    assert lines[2].startswith(f"    - KV cache saturated  {RECENT_CLOSED} times or more, ")


def test_long_finding_lines_wrap_to_the_terminal_and_findings_off_says_so():
    before, after = two_scrapes()
    long_action = dict(FINDINGS["findings"][0], action="word " * 40)
    after.findings = {"engines": FINDINGS["engines"], "findings": [long_action]}
    lines = top.frame("u", before, after, width=60).splitlines()
    action = [line for line in lines if line.strip().startswith(("action:", "word"))]
    assert len(action) > 2 and all(len(line) <= 60 for line in action)
    after.findings = {"engines": [dict(FINDINGS["engines"][0], live_findings=False)]}
    assert (
        "  findings    off (the sidecar runs --no-live-findings)"
        in top.frame("u", before, after, width=None).splitlines()
    )


class FakeTerminal(StringIO):
    def isatty(self) -> bool:
        return True


def test_frames_redraw_with_ansi_codes_only_on_a_terminal_cut_to_its_size(monkeypatch):
    plain = StringIO()
    top.write_frame(plain, "a\nb", redraw=False)
    assert plain.getvalue() == "a\nb\n\n"
    terminal = FakeTerminal()
    top.write_frame(terminal, "a\nb", redraw=True)
    assert terminal.getvalue() == "\x1b[Ha\x1b[K\nb\x1b[K\n\x1b[J"
    monkeypatch.setenv("COLUMNS", "5")
    monkeypatch.setenv("LINES", "3")  # two lines of frame, the cursor on the third
    small = FakeTerminal()
    top.write_frame(small, "abcdefgh\nb\nc", redraw=True)
    assert small.getvalue() == "\x1b[Habcde\x1b[K\nb\x1b[K\n\x1b[J"


# --------------------------------------------------------------------------------------------
# A sidecar that cannot be read


def test_an_unreachable_sidecar_exits_2_with_a_message_and_no_traceback(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert iterscope(["top", "--once", "--interval", "0.01", "--url", url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"iterscope top: cannot read the sidecar: {url}/metrics: ")
    assert "--metrics-port" in captured.err and "Traceback" not in captured.err


class NotASidecar(BaseHTTPRequestHandler):
    """Serves /metrics (empty) but no /findings, as an API server's port does."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_port_that_is_not_a_sidecars_exits_2_naming_what_answered(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotASidecar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"127.0.0.1:{server.server_port}/metrics/"  # as the sidecar logs it
        assert top.main(["--once", "--interval", "0.01", "--url", url]) == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{server.server_port}/findings answered HTTP 404" in err


# --------------------------------------------------------------------------------------------
# Live: the command against a real sidecar


def run_top(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "top", "--once", "--url", url, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TOP_TIMEOUT_S,
    )


@pytest.mark.live
def test_top_once_shows_a_replayed_engine_its_waiting_reason_and_open_finding(tmp_path):
    recording = SCENARIOS["story3 sequence limit"][0]().write(tmp_path / "run.jsonl")
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log_file:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "engine.entrypoints.cli", "sidecar", "--replay",
             str(recording), "--serve-after-replay", "--metrics-port", "0"],
            cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        port = wait_for_log(log_path, METRICS_URL_LINE, sidecar, timeout_s=30)[1]
        wait_for_log(log_path, "replay done; serving", sidecar, timeout_s=60)
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{url}/findings", timeout=10) as response:
            (finding,) = json.load(response)["findings"]
        result = run_top(url, "--interval", "0.2")
    finally:
        stop_process(sidecar)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert finding["state"] == "open" and finding["kind"] == "waiting_seq_limit"
    assert "engine 000  sim  running" in lines
    assert "  iterations  0.0/s" in lines  # a replay stands still: nothing new in the window
    assert any(line.startswith("  waiting     ") and "(seq_limit " in line for line in lines)
    assert f"    ! {finding['title']}  since " in result.stdout
    assert f"      action: {finding['action']}" in lines
    assert "\x1b" not in result.stdout  # not a terminal: no redraw codes


@pytest.mark.live
def test_top_once_shows_a_running_engines_iteration_rate_and_inter_token_latency(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    sidecar, port = start_metrics_sidecar(tmp_path, address)
    engine = start_engine(address, tmp_path / "engine.json", "--iteration-time", "0.005")
    try:
        wait_until(
            lambda: total(scrape(port), "iterscope_iterations_total") > 0,
            30,
            "the sidecar to count the engine's first iterations",
            interval_s=0.2,
        )
        result = run_top(f"http://127.0.0.1:{port}", "--interval", "1")
    finally:
        stop_engine(engine, tmp_path / "engine.json")
        stop_process(sidecar)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "engine 000  synthetic  running" in lines, result.stdout
    (rate,) = [line for line in lines if line.startswith("  iterations  ")]
    assert float(rate.split()[1].removesuffix("/s")) > 10, rate  # ~150/s at 5 ms each
    assert "  batch       8 running, 8.0 decoding per iteration" in lines
    assert "  waiting     2 (kv_capacity 2)" in lines
    (itl,) = [line for line in lines if line.startswith("  ITL ")]
    assert " ms" in itl and "–" not in itl and "n/a" not in itl, itl


def test_the_command_is_listed_by_iterscope_help(capsys):
    assert iterscope(["--help"]) == 0
    assert "  top " in capsys.readouterr().out
