"""vLLM's own scheduler, reporting from its engine core (telemetry/sources/vllm_scheduler.py):
first on vLLM's real scheduler without a model (tests/vllm_scheduler_check.py, run in
`.vllm-venv`), on every version of TESTED_VLLM_VERSIONS (bench/vllm_server.py vllm_env): each
admission limit (KV, --max-num-seqs, --max-num-batched-tokens), async scheduling, the prefill
cadence, speculative decoding and the version guard; then in a real `vllm serve
--scheduler-cls ...` (CPU build), on each version of SERVED_VLLM_VERSIONS (the newest
release, every tested one under `make test-vllm-versions`), with a real sidecar and
Prometheus: operator story 1 on vLLM, counters and TTFT equal to vLLM's own /metrics, the
sidecar's --fpm-port publishing FPM for that vLLM, a stopped, continued and killed engine
core. `make test` builds .vllm-venv, the other vLLM versions beside it and
.models/smollm2-hf."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from bench.vllm_server import (
    BEST_CPU_FLAGS,
    ROOT,
    engine_core_pid,
    start_vllm,
    stop_server,
    vllm_env,
)
from telemetry.lane.record import (
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
)
from telemetry.sidecar.process import start_sidecar
from telemetry.sources.vllm_lane import TESTED_VLLM_VERSIONS
from tests.helpers.ahead import ahead, take
from tests.helpers.findings import assert_replay_agrees_with_explain
from tests.helpers.fpm_stream import FpmStream, given_back, wait_recorded
from tests.helpers.net import free_port
from tests.helpers.prom import scrape, start_prometheus, total
from tests.helpers.vllm import (
    SERVED_VLLM_VERSIONS,
    VLLM_ENV,
    counter_pairs,
    engine_status,
    iterscope,
    plugin_gets_iteration_details,
    stop_and_continue,
    version_tuple,
)
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.timeout(900)

VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
CHECK_CASES = ("reasons", "async", "cadence", "spec", "guard")  # guard last: it changes the module
SCHEDULER = "telemetry.sources.vllm_scheduler.IterscopeScheduler"
# 8 blocks of 128 tokens (the CPU build's block size), one of them vLLM's null block: 7
# requests of up to 128 tokens fill the cache, so the 8th waits for KV capacity.
KV_FLAGS = (
    *BEST_CPU_FLAGS,
    "--scheduler-cls",
    SCHEDULER,
    "--num-gpu-blocks-override",
    "8",
    "--max-model-len",
    "512",
)
KV_ALERT = "IterscopeKVCacheSaturated"
FPM_WORKER_ID = "vllm-w"
# Between polls of the two /metrics pages: vLLM's competes with vLLM itself for the CPU.
POLL_S = 0.1


def run_checks(
    version: str, niceness: int = 0, timeout_s: float = 300.0
) -> subprocess.CompletedProcess:
    """Every case of tests/vllm_scheduler_check.py, in one run of vLLM ``version``."""
    return subprocess.run(
        [
            "nice",
            "-n",
            str(niceness),
            str(VLLM_PYTHON),
            str(ROOT / "tests" / "vllm_scheduler_check.py"),
        ]
        + list(CHECK_CASES),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "ITERSCOPE_TELEMETRY_ADDRESS": "ipc:///dev/null", **vllm_env(version)},
    )


@ahead(fixture="every_versions_checks", tmp_name="vllm_checks")
@contextlib.contextmanager
def versions_checks(
    _tmp: Path, _param: None, niceness: int = 0, ready_timeout_s: float = 300.0
) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """The checks of every tested version, two at a time (each run is mostly vLLM's import on
    one core: two side by side take the time of one on this 2-core machine), at
    ``niceness``, each within ``ready_timeout_s``."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(
            lambda version: run_checks(version, niceness, ready_timeout_s), TESTED_VLLM_VERSIONS
        )
        yield dict(zip(TESTED_VLLM_VERSIONS, runs, strict=True))


@pytest.fixture(scope="module")
def every_versions_checks(tmp_path_factory) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """versions_checks, started ahead (tests/helpers/ahead.py)."""
    with take(versions_checks, None, tmp_path_factory) as done:
        yield done


@pytest.fixture(scope="module", params=TESTED_VLLM_VERSIONS)
def checks(request, every_versions_checks) -> dict:
    """Every case of tests/vllm_scheduler_check.py on vLLM ``request.param``."""
    done = every_versions_checks[request.param]
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == request.param
    return result


def test_vllms_own_scheduler_names_each_admission_limit(checks):
    result = checks["reasons"]
    for limit, reason in (("seq_limit", "seq_limit"), ("budget", "budget"), ("kv", "kv")):
        case = result[limit]
        assert case["scheduler_class"] == "IterscopeScheduler"  # async scheduling off
        assert case["num_finished"] == 6, (limit, case)
        assert case["waiting"][reason] == case["num_waiting"] > 0, (limit, case)
    assert result["seq_limit"]["num_output_tokens"] == 6 * 8
    assert result["kv"]["num_output_tokens"] == 6 * 40
    assert result["kv"]["num_preemptions"] > 0  # 5 blocks at their peak, 8 in the pool
    assert result["kv"]["max_blocks_used"] == result["kv"]["num_kv_blocks_total"] == 8


def test_the_async_scheduler_pairs_each_step_with_its_own_output(checks):
    """With --async-scheduling vLLM schedules a step before the last one's output is back."""
    (case,) = checks["async"].values()
    # IterscopeScheduler, built with async scheduling on, is vLLM's async scheduler: a
    # synchronous one would schedule nothing while a step is in flight.
    assert case["scheduler_class"] == "IterscopeAsyncScheduler"
    assert case["num_steps"] < 400 and case["all_timed"]
    iterations = case["iterations"]  # a step that scheduled nothing makes no record
    assert iterations == sorted(set(iterations)) and iterations[0] == 1
    assert case["num_finished"] == case["num_first_tokens"] == 6
    assert case["num_output_tokens"] == 6 * 40 and case["num_preemptions"] > 0
    assert case["waiting"]["kv"] == case["num_waiting"] > 0


def test_prefills_held_for_vllms_prefill_cadence_wait_as_held_back_not_for_kv(checks):
    """Requests waiting while vLLM holds prefills (a data-parallel engine core's throttle;
    from vLLM 0.33 also a single engine's --prefill-schedule-interval) wait for no limit of
    KV, sequences or tokens: 'held back by the engine'."""
    result = checks["cadence"]
    held = ["throttled"] + (["interval"] if result["local_cadence"] else [])
    assert result["local_cadence"] is (version_tuple(checks["version"]) >= (0, 33))
    for name in held:
        case = result[name]
        assert case["other"] == case["num_waiting"] > 0, (name, case)
    # the cadence reaches the heartbeats from vLLM's own config (explain's action names it)
    assert result["throttled"]["interval_fact"] == 0 and result["interval"]["interval_fact"] == 4


def test_speculative_decoding_drafts_count_as_vllms_own_stats_of_the_step(checks):
    """Each step that scored drafts carries the counts vLLM's SpecDecodingStats of that step
    has (drafts of 3 tokens, 0, 1, 2, 3 of them accepted in turn), from the scheduler source
    and as the stat-logger plugin maps those stats, and a decoding request's accepted tokens
    are output tokens of that step."""
    result = checks["spec"]
    assert result["ours"] == result["vllm"] == result["plugin"]
    accepted = [step[2] for step in result["ours"]]
    assert {0, 3, 6, 9} <= set(accepted)  # three requests, 0 to 3 tokens accepted each
    assert all(step[:2] == [3, 9] for step in result["ours"])  # 3 drafts of 3 tokens
    assert sum(tokens for _, tokens in result["num_decode"]) == result["num_output_tokens"] == 72
    assert any(tokens > requests for requests, tokens in result["num_decode"])


def test_an_untested_vllm_or_a_missing_attribute_schedules_plainly_and_says_so(checks):
    result = checks["guard"]
    assert result["untested_reporter"] is False and result["untested_finished"] is True
    assert result["missing_reporter"] is False
    # the plugin steps aside for the scheduler source, and reports where it does not run
    assert result["plugin_reports"] == {"scheduler_runs": False, "scheduler_refuses": True}
    # whether this vLLM's stats carry iteration details, as the plugin decides it
    assert result["stats_carry_iteration_details"] is plugin_gets_iteration_details(
        checks["version"]
    )
    untested, *plugin_said, missing = result["said"]
    assert "schedules as plain vLLM and sends nothing" in untested
    assert "ITERSCOPE_VLLM_UNTESTED=1" in untested
    assert "the stat-logger plugin, where vLLM loads it, reports this engine instead" in untested
    assert any("the stat-logger plugin reports this engine instead" in m for m in plugin_said)
    assert "no_such_attribute" in missing


@ahead(fixture="kv_stack", tmp_name="vllm_scheduler")
@contextlib.contextmanager
def scheduler_stack(tmp: Path, version: str, **vllm_kwargs) -> Iterator[dict]:
    """A sidecar, `vllm serve` (vLLM ``version``) with the scheduler source and a KV cache of
    8 blocks, and Prometheus."""
    metrics_port, api_port, fpm_port = free_port(), free_port(), free_port()
    sidecar_log = open(tmp / "sidecar.log", "w")
    sidecar = start_sidecar(
        ["--metrics-port", str(metrics_port), "--record", str(tmp / "run.jsonl")]
        + ["--fpm-port", str(fpm_port), "--fpm-worker-id", FPM_WORKER_ID],
        stderr=sidecar_log,
    )
    # Subscribed before vLLM starts, so it receives the stream from seq 0; its queue is
    # unbounded, so nothing is lost while the tests before the FPM one run.
    fpm = FpmStream(fpm_port)
    server = prometheus = None
    try:
        server = start_vllm(
            api_port,
            {"ITERSCOPE_TELEMETRY_ADDRESS": sidecar.address, **VLLM_ENV},
            tmp / "vllm.log",
            flags=KV_FLAGS,
            version=version,
            **vllm_kwargs,
        )
        prometheus = start_prometheus(tmp, [f"127.0.0.1:{metrics_port}"])
        yield {
            "version": version,
            "sidecar": sidecar,
            "server": server,
            "api_port": api_port,
            "tmp": tmp,
            "metrics_port": metrics_port,
            "prometheus": prometheus,
            "fpm": fpm,
        }
    finally:
        if prometheus is not None:
            prometheus.stop()
        if server is not None:
            stop_server(server)
        sidecar.stop()
        sidecar_log.close()
        fpm.close()


@pytest.fixture(scope="module", params=SERVED_VLLM_VERSIONS)
def kv_stack(request, tmp_path_factory):
    """scheduler_stack on vLLM ``request.param``, started ahead (tests/helpers/ahead.py)."""
    with take(scheduler_stack, request.param, tmp_path_factory) as started:
        yield started


def prompt(index: int, num_words: int) -> str:
    return f"Request {index}: " + " ".join(
        ["apple", "river", "stone"][i % 3] for i in range(num_words)
    )


def complete(api_port: int, prompts: list[str], max_tokens: int) -> list:
    api = openai.OpenAI(
        base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none", max_retries=0, timeout=300
    )

    def one(text: str):
        return api.completions.create(
            model="smollm2",
            prompt=text,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


class KvWaitWatch:
    """Polls of the sidecar's kv_capacity waiting and vLLM's waiting count during a burst of
    requests: each side must be seen above 0 before the burst ends. A burst that ends first, or
    fails, ends the wait at once with every poll in the message (a CI run once timed out here
    with nothing to say which side never saw the wait)."""

    def __init__(self, stack, burst: concurrent.futures.Future) -> None:
        self.stack, self.burst = stack, burst
        self.polls: list[tuple[float, float, float]] = []  # (seconds, ours, vLLM's)
        self.started = time.monotonic()

    def both_seen(self) -> bool:
        finished = self.burst.done()
        ours, theirs = scrape(self.stack["metrics_port"]), scrape(self.stack["api_port"])
        self.polls.append(
            (
                round(time.monotonic() - self.started, 2),
                total(ours, "iterscope_requests_waiting_by_reason", reason="kv_capacity"),
                total(theirs, "vllm:num_requests_waiting"),
            )
        )
        seen = all(any(poll[side] > 0 for poll in self.polls) for side in (1, 2))
        if finished and not seen:
            self.burst.result()  # a failed request raises here
            raise AssertionError(f"the burst ended before both saw it wait: {self.describe()}")
        return seen

    def describe(self) -> str:
        return f"(seconds, sidecar kv_capacity, vLLM waiting) polls: {self.polls}"


def status(stack) -> str | None:
    return engine_status(stack["metrics_port"])


def counters_agree(stack, num_finished: int) -> dict | None:
    pairs = counter_pairs(stack["metrics_port"], stack["api_port"])
    agree = all(a == b for a, b in pairs.values())
    return pairs if agree and pairs["finished requests"][0] >= num_finished else None


def test_story1_on_vllm_requests_wait_for_kv_capacity_and_explain_says_so(kv_stack):
    api_port = kv_stack["api_port"]
    # 16 requests of ~70 + 40 tokens: 7 fit in the 7 usable blocks, the rest wait for KV
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        pending = background.submit(complete, api_port, [prompt(i, 60) for i in range(16)], 40)
        watch = KvWaitWatch(kv_stack, pending)
        wait_until(
            watch.both_seen,
            60,
            lambda: f"kv_capacity waiting in the sidecar and in vLLM's count: {watch.describe()}",
            interval_s=POLL_S,
        )
        responses = pending.result(timeout=300)
    assert all(r.usage.completion_tokens == 40 for r in responses)
    prometheus = kv_stack["prometheus"]
    rules = yaml.safe_load((ROOT / "dashboards" / "alerts" / "kv_cache.yml").read_text())
    (expr,) = [
        rule["expr"]
        for group in rules["groups"]
        for rule in group["rules"]
        if rule.get("alert") == KV_ALERT
    ]
    prometheus.wait_until(lambda: prometheus.query(expr), 30, f"{KV_ALERT}'s expression")
    pairs = wait_until(
        lambda: counters_agree(kv_stack, 16), 15, "counters equal to vLLM's", interval_s=POLL_S
    )
    assert pairs["prompt tokens computed"][0] > 16 * 60
    ours, theirs = scrape(kv_stack["metrics_port"]), scrape(kv_stack["api_port"])
    ttft_sum = total(ours, "iterscope_time_to_first_token_seconds_sum")
    vllm_ttft_sum = total(theirs, "vllm:time_to_first_token_seconds_sum")
    # ours ends at the engine core's update, vLLM's when the API server has the output
    assert 0.95 * vllm_ttft_sum <= ttft_sum <= vllm_ttft_sum * 1.01, (ttft_sum, vllm_ttft_sum)
    (info,) = [
        dict(labels)
        for (name, labels), value in ours.items()
        if name == "iterscope_engine_info" and value == 1
    ]
    assert info["source"] == "vllm-scheduler"
    assert info["version"] == f"vllm {kv_stack['version']}"
    assert int(info["pid"]) == engine_core_pid(kv_stack["server"].pid)
    report = json.loads(iterscope("explain", str(kv_stack["tmp"] / "run.jsonl"), "--json"))
    (engine,) = report["engines"]
    # The cause first: requests waiting for KV capacity, or the saturated cache they wait on
    # (which of the two costs more request-seconds depends on the run's timing: either came
    # first on this machine), with the waiting reason among the findings either way.
    titles = [finding["title"] for finding in engine["findings"]]
    first = engine["findings"][0]
    assert first["title"] in ("Requests waiting: KV capacity", "KV cache saturated"), titles
    assert "Requests waiting: KV capacity" in titles, titles
    assert "--kv-cache-memory-bytes" in first["action"]
    assert "--kv-cache-memory " not in first["action"] + " "  # our engine's flag, not vLLM's
    assert not [f for f in engine["findings"] if f["kind"] == "stall"]
    # The live sidecar said so as it happened, in vLLM's flags, and nothing was stalled. It
    # searches its window about once a second, and waiting counts once it has lasted a
    # second: found up to ~2 s after it began, which the checks above can outrun.
    url = f"http://127.0.0.1:{kv_stack['metrics_port']}/findings"
    live: list = []

    def waiting_found() -> list:
        live[:] = json.loads(urllib.request.urlopen(url, timeout=10).read())["findings"]
        return [f for f in live if f["kind"] == "waiting_kv"]

    waiting = wait_until(
        waiting_found, 10, lambda: f"a live waiting_kv finding: {live}", interval_s=0.2
    )
    for finding in waiting:
        assert "--kv-cache-memory-bytes" in finding["action"], finding
        assert "--kv-cache-memory " not in finding["action"] + " "
    assert not [f for f in live if f["kind"] in ("stall", "spinning", "dead", "kv_leak")], live


def test_preemptions_and_tokens_equal_vllms_counters(kv_stack):
    # two requests of 300 + 180 tokens: 3 blocks each at first, 4 at their peak (8 > 7)
    responses = complete(kv_stack["api_port"], [prompt(100 + i, 290) for i in range(2)], 180)
    assert all(r.usage.completion_tokens == 180 for r in responses)
    pairs = wait_until(
        lambda: counters_agree(kv_stack, 18), 15, "counters equal to vLLM's", interval_s=POLL_S
    )
    assert pairs["preemptions"][0] > 0, pairs


def test_the_sidecars_fpm_port_publishes_what_it_records_of_a_real_vllm(kv_stack):
    """docs/fpm.md's "vLLM with iterscope's sources": `iterscope sidecar --fpm-port` beside a
    real `vllm serve --scheduler-cls ...IterscopeScheduler`. Read by iterscope's own FPM
    decoder: one stream (the engine's index as dp_rank) numbered from 0, counter_id the seq,
    a message per record the sidecar recorded, in order, giving back its counts (but vLLM's
    produced tokens); all-zero heartbeats about a second apart while idle. Whatever the tests
    before it served is in it too."""
    fpm = kv_stack["fpm"]
    fpm.drain()  # what the tests before this one were sent
    responses = complete(kv_stack["api_port"], [prompt(300 + i, 20) for i in range(2)], 8)
    assert all(r.usage.completion_tokens == 8 for r in responses)
    fpm.wait_idle_after_work()
    fpm.check_one_stream(FPM_WORKER_ID)
    busy = fpm.iterations()
    records = wait_recorded(kv_stack["tmp"] / "run.jsonl", len(busy))
    assert len(records) == len(busy) > 0
    for seq, (message, record) in enumerate(zip(busy, records, strict=True)):
        assert not record.unknown & (UNKNOWN_ELAPSED | UNKNOWN_PREFILL_REQS | UNKNOWN_KV_TOKENS)
        assert given_back(message, record, seq).num_kv_tokens == record.num_kv_tokens
    fpm.check_idle_heartbeats()


def test_a_stopped_engine_core_leaves_running_within_3_s_and_comes_back(kv_stack):
    log = kv_stack["tmp"] / "sidecar.log"
    # the healthy runs before, with their prefills of hundreds of tokens, never left running
    assert "-> stalled" not in log.read_text() and "-> dead" not in log.read_text()
    core_pid = engine_core_pid(kv_stack["server"].pid)
    with concurrent.futures.ThreadPoolExecutor(1) as background:
        pending = background.submit(
            complete, kv_stack["api_port"], [prompt(200 + i, 20) for i in range(2)], 120
        )
        left, seconds = stop_and_continue(core_pid, kv_stack["metrics_port"], 5, poll_s=POLL_S)
        assert left == "dead" and seconds <= 3.0  # a stopped process sends no heartbeat
        assert kv_stack["server"].poll() is None
        assert all(r.usage.completion_tokens == 120 for r in pending.result(timeout=300))


def test_the_replayed_sidecar_finds_what_explain_finds(kv_stack, tmp_path):
    """One implementation of each rule: on this real vLLM's recording through the scheduler
    source (requests waiting for KV, a stopped engine core in it), the sidecar replaying the
    recording opens explain's findings (kind, iteration within one, cost within 5%)."""
    recording = shutil.copy(kv_stack["tmp"] / "run.jsonl", tmp_path / "run.jsonl")
    assert_replay_agrees_with_explain(recording)


def test_a_killed_engine_core_is_dead_within_3_s(kv_stack):
    """Last of kv_stack's tests: its engine core is gone after it."""
    os.kill(engine_core_pid(kv_stack["server"].pid), signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: status(kv_stack) == "dead", 5, "dead after kill -9", interval_s=POLL_S)
    assert time.monotonic() - killed_at <= 3.0
    # The engine core's own heartbeats stopped: dead, whatever the API server does (vLLM's
    # shuts itself down a second or two after its engine core dies).
