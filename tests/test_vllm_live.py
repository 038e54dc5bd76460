"""A real vLLM (CPU build, .vllm-venv; each version of SERVED_VLLM_VERSIONS: the newest
release, every tested one under `make test-vllm-versions`) with the iterscope plugin, a real
sidecar, the official openai client: the sidecar's numbers equal vLLM's own, its --fpm-port
publishes FPM for that vLLM, a hung engine core reads as stalled, and a dead sidecar does not
disturb vLLM. `make test` builds .vllm-venv, the other vLLM versions beside it and
.models/smollm2-hf."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.vllm_server import engine_core_pid, start_vllm, stop_server
from telemetry.lane.record import UNKNOWN_ELAPSED, UNKNOWN_KV_TOKENS, UNKNOWN_PREFILL_REQS
from telemetry.sidecar.process import start_sidecar
from telemetry.sources.fpm import is_heartbeat
from tests.helpers.ahead import ahead, take
from tests.helpers.findings import assert_replay_agrees_with_explain
from tests.helpers.fpm_stream import FpmStream, given_back, wait_recorded
from tests.helpers.net import free_port
from tests.helpers.prom import metrics_text, scrape, total
from tests.helpers.vllm import (
    SERVED_VLLM_VERSIONS,
    VLLM_ENV,
    counter_pairs,
    engine_status,
    iterscope,
    plugin_gets_iteration_details,
    run_iterscope,
    stop_and_continue,
)
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.timeout(900)

# Between polls of the two /metrics pages: vLLM's competes with vLLM itself for the CPU.
POLL_S = 0.2
FPM_WORKER_ID = "vllm-plugin"
# Four prompts of about 1,500 tokens go beyond vLLM's budget on CPU (2,048 tokens a step), so
# a request waits while the others' chunks fill the budget: waiting counts are checked too.
LONG_PROMPT_WORDS = 1500


@ahead(fixture="stack", tmp_name="vllm")
@contextlib.contextmanager
def plugin_stack(tmp: Path, version: str, **vllm_kwargs) -> Iterator[dict]:
    """A sidecar and `vllm serve` (vLLM ``version``) with the plugin."""
    metrics_port, api_port, fpm_port = free_port(), free_port(), free_port()
    sidecar_log = open(tmp / "sidecar.log", "w")
    sidecar = start_sidecar(
        [
            "--metrics-port",
            str(metrics_port),
            "--record",
            str(tmp / "run.jsonl"),
            "--stall-after",
            "2",
            "--log-iterations",
            "--vllm-compatible-names",
            "--fpm-port",
            str(fpm_port),
            "--fpm-worker-id",
            FPM_WORKER_ID,
        ],
        stderr=sidecar_log,
    )
    # Subscribed before vLLM starts, so it receives the stream from seq 0; its queue is
    # unbounded, so nothing is lost while the tests before the FPM one run.
    fpm = FpmStream(fpm_port)
    server = None
    try:
        server = start_vllm(
            api_port,
            {"ITERSCOPE_TELEMETRY_ADDRESS": sidecar.address, **VLLM_ENV},
            tmp / "vllm.log",
            version=version,
            **vllm_kwargs,
        )
        yield {
            "sidecar": sidecar,
            "server": server,
            "api_port": api_port,
            "metrics_port": metrics_port,
            "tmp": tmp,
            "fpm": fpm,
            "version": version,
        }
    finally:
        if server is not None:
            stop_server(server)
        sidecar.stop()
        sidecar_log.close()
        fpm.close()


@pytest.fixture(scope="module", params=SERVED_VLLM_VERSIONS)
def stack(request, tmp_path_factory):
    """plugin_stack on vLLM ``request.param``, started ahead (tests/helpers/ahead.py)."""
    with take(plugin_stack, request.param, tmp_path_factory) as started:
        yield started


def client(api_port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none", max_retries=0, timeout=120
    )


def send_requests(api_port: int, num_requests: int, max_tokens: int) -> list:
    """Completions and chat, eight at a time (a step of vLLM on CPU costs little more for 8
    sequences than for 4: 49 against 31 tokens/s on 2 cores), distinct prompts."""
    api = client(api_port)

    def one(i: int):
        if i % 2:
            return api.completions.create(
                model="smollm2",
                prompt=f"Request {i}: count to ten.",
                max_tokens=max_tokens,
                temperature=0,
            )
        return api.chat.completions.create(
            model="smollm2",
            max_tokens=max_tokens,
            temperature=0,
            messages=[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(num_requests)))


def status(stack) -> str | None:
    return engine_status(stack["metrics_port"])


def counters_agree(stack) -> dict | None:
    pairs = {
        name: pair
        for name, pair in counter_pairs(stack["metrics_port"], stack["api_port"]).items()
        if name in ("prompt tokens computed", "generation tokens", "finished requests")
    }
    return pairs if all(a == b > 0 for a, b in pairs.values()) else None


def test_vllm_steps_reach_every_sink_and_agree_with_vllm(stack):
    responses = send_requests(stack["api_port"], 32, max_tokens=24)
    assert len(responses) == 32 and all(r.usage.completion_tokens > 0 for r in responses)
    try:
        pairs = wait_until(
            lambda: counters_agree(stack), 15, "sidecar totals to equal vLLM's", interval_s=POLL_S
        )
    except AssertionError:
        raise AssertionError(f"ours vs vLLM's: {counters_agree_debug(stack)}") from None
    assert pairs["finished requests"][0] >= 32
    ours = scrape(stack["metrics_port"])
    vllm_log = (stack["tmp"] / "vllm.log").read_text()
    assert "iterscope: tested with vLLM" not in vllm_log  # a version the plugin was checked on
    num_vllm_steps = len(re.findall(r"Iteration\(\d+\): ", vllm_log))
    assert total(ours, "iterscope_iterations_total") == num_vllm_steps > 0
    assert total(ours, "iterscope_kv_blocks_capacity") > 0
    assert total(ours, "iterscope_requests_waiting_by_reason", reason="unknown") == 0
    assert total(ours, "iterscope_time_to_first_token_seconds_count") >= 32
    timed = plugin_gets_iteration_details(stack["version"])
    # where vLLM hands the plugin no step times, none is made up, and its log says why
    assert total(ours, "iterscope_iteration_duration_seconds_count") == (
        num_vllm_steps if timed else 0
    )
    durations = [key for key in ours if key[0] == "iterscope_iteration_duration_seconds_count"]
    assert bool(durations) is timed  # untimed: no series, not an empty one
    assert ("hands them to no stat logger" in vllm_log) is not timed
    sidecar_log = stack["tmp"] / "sidecar.log"
    wait_until(
        lambda: "Avg prompt throughput" in sidecar_log.read_text(),
        25,
        "a 10-second line from the sidecar",
        interval_s=POLL_S,
    )
    context_requests = r"\d+" if timed else "unknown"
    assert re.search(
        rf"Iteration\(\d+\): {context_requests} context requests, \d+ context tokens",
        sidecar_log.read_text(),
    )
    recording = str(stack["tmp"] / "run.jsonl")
    explain = iterscope("explain", recording)
    assert "engine 0" in explain.lower()
    if not timed:  # nothing to fit: tune says so, and what gives the times
        untimed = run_iterscope("tune", recording, "--itl-target", "30s")
        assert untimed.returncode != 0 and "vLLM 0.26 or later" in untimed.stderr
        return
    # a target any machine meets: this checks tune reads vLLM's times, not their speed
    tune = json.loads(iterscope("tune", recording, "--itl-target", "30s", "--json"))
    (engine,) = tune["engines"]
    assert engine["fit"]["num_iterations"] > 0 and engine["recommendation"]["max_num_seqs"] > 0


def ttft_pair(stack) -> tuple[tuple[float, float], tuple[float, float], float]:
    """((ours, vLLM's) TTFT count, (ours, vLLM's) TTFT sum, our finished requests)."""
    ours, theirs = scrape(stack["metrics_port"]), scrape(stack["api_port"])
    return (
        (
            total(ours, "iterscope_time_to_first_token_seconds_count"),
            total(theirs, "vllm:time_to_first_token_seconds_count"),
        ),
        (
            total(ours, "iterscope_time_to_first_token_seconds_sum"),
            total(theirs, "vllm:time_to_first_token_seconds_sum"),
        ),
        total(ours, "iterscope_requests_finished_total"),
    )


def test_ttfts_reach_the_sidecar_at_the_first_token_as_vllms_own(stack):
    """vLLM hands the plugin each TTFT when the first token comes (naming no request): the
    histogram has them while the requests still generate, and in the end vLLM's own values."""
    (count_before, _), _, finished_before = ttft_pair(stack)
    api = client(stack["api_port"])

    def long_request(i: int):
        return api.completions.create(
            model="smollm2",
            prompt=f"Story {i}: once upon a time",
            max_tokens=160,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_request, i) for i in range(4)]
        seen = wait_until(
            lambda: (pair := ttft_pair(stack))[0][0] >= count_before + 4 and pair,
            60,
            "four TTFTs in the sidecar's histogram",
            interval_s=POLL_S,
        )
        assert seen[2] == finished_before  # not one of the four had finished
        assert all(f.result().usage.completion_tokens == 160 for f in futures)
    (count, vllm_count), (ttft_sum, vllm_sum), _ = wait_until(
        lambda: (pair := ttft_pair(stack))[0][0] == pair[0][1] and pair,
        15,
        lambda: f"our TTFT count to equal vLLM's: {ttft_pair(stack)}",
        interval_s=POLL_S,
    )
    assert count >= count_before + 4
    assert abs(ttft_sum - vllm_sum) < 1e-6 * count  # vLLM's own values, to the nanosecond


def families(port: int) -> dict:
    return {family.name: family for family in text_string_to_metric_families(metrics_text(port))}


def label_names(family) -> set[str]:
    return {name for sample in family.samples for name in sample.labels} - {"le"}


def test_vllm_compatible_names_are_vllms_own(stack):
    """Every vllm: series of the sidecar is one vLLM exposes, with its type and labels."""
    ours, theirs = families(stack["metrics_port"]), families(stack["api_port"])
    aliases = {name: family for name, family in ours.items() if name.startswith("vllm:")}
    assert len(aliases) >= 20
    assert {name: (family.type, label_names(family)) for name, family in aliases.items()} == {
        name: (theirs[name].type, label_names(theirs[name])) for name in aliases if name in theirs
    }


def test_the_sidecars_fpm_port_publishes_what_it_records_of_the_plugin(stack):
    """docs/fpm.md's "vLLM with iterscope's sources", the stat-logger plugin: `iterscope
    sidecar --fpm-port` beside a real `vllm serve` with the plugin, read by iterscope's own
    FPM decoder after the tests before it and four long requests of its own: one stream (the
    engine's index as dp_rank) numbered from 0, counter_id the seq, a message per record the
    sidecar recorded, in order, giving back its counts as docs/fpm.md's mapping says; all-zero
    heartbeats about a second apart once idle.

    The case covered: this module runs vLLM with --enable-logging-iteration-details
    (bench.vllm_server.PLUGIN_FLAGS), so every record has its time and batch split, and the
    plugin marks unknown only what vLLM never gives it, the KV tokens held: FPM has no
    unknown, so the message says the batch held no KV before the iteration and a consumer
    reads the iteration's prefill tokens as the KV held. Without the flag (time and prefill
    requests unknown: wall_time 0, num_prefill_requests 0) only tests/test_fpm_publisher.py
    checks the mapping, and on vLLM before 0.26, which hands stat loggers no iteration details
    even with the flag, this test."""
    fpm = stack["fpm"]
    fpm.drain()  # what the tests before this one were sent
    api = client(stack["api_port"])

    def long_request(i: int):
        words = " ".join(["apple", "river", "stone"][j % 3] for j in range(LONG_PROMPT_WORDS))
        return api.completions.create(
            model="smollm2", prompt=f"Request {i}: {words}", max_tokens=2, temperature=0
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(long_request, range(4)))
    assert all(r.usage.prompt_tokens > 1024 for r in responses)
    fpm.wait_idle_after_work()
    fpm.check_one_stream(FPM_WORKER_ID)
    busy = fpm.iterations()
    records = wait_recorded(stack["tmp"] / "run.jsonl", len(busy))
    assert len(records) == len(busy) > 0
    # the case covered (docstring): every record's time and batch split known, KV tokens not
    unknown = UNKNOWN_KV_TOKENS
    if not plugin_gets_iteration_details(stack["version"]):
        unknown |= UNKNOWN_ELAPSED | UNKNOWN_PREFILL_REQS
    assert {
        r.unknown & (UNKNOWN_ELAPSED | UNKNOWN_PREFILL_REQS | UNKNOWN_KV_TOKENS) for r in records
    } == {unknown}
    assert any(r.num_waiting_reqs for r in records)  # not only zeros compared
    for seq, (message, record) in enumerate(zip(busy, records, strict=True)):
        assert not is_heartbeat(message), (seq, message, record)
        back = given_back(message, record, seq)
        # the KV tokens held, unknown to the plugin: 0 on the wire, where FPM cannot say
        # unknown, so a consumer reads the iteration's prefill tokens as the KV held
        scheduled = message.scheduled_requests
        assert scheduled.sum_prefill_kv_tokens == scheduled.sum_decode_kv_tokens == 0
        assert back.num_kv_tokens == record.num_prefill_tokens
    fpm.check_idle_heartbeats()


def counters_agree_debug(stack) -> dict:
    ours, theirs = scrape(stack["metrics_port"]), scrape(stack["api_port"])
    return {
        name: value
        for name, value in {**ours, **theirs}.items()
        if "tokens_total" in name[0] or "request_success" in name[0] or "finished_total" in name[0]
    }


# Output tokens of each request the stall test stops and continues: the core is stopped
# within a poll (0.2 s) of the first iteration, a few tokens in, and recovery shows at the
# first iteration after SIGCONT, so the requests run long before and after either moment
# (vLLM makes about 10 tokens/s per request on 2 cores; 400 tokens took 40 s of CI's time).
STALL_TEST_OUTPUT_LEN = 128


def test_a_hung_engine_core_reads_as_stalled_then_recovers(stack):
    core_pid = engine_core_pid(stack["server"].pid)
    api = client(stack["api_port"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [
            pool.submit(
                api.completions.create,
                model="smollm2",
                prompt="Tell a story.",
                max_tokens=STALL_TEST_OUTPUT_LEN,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for _ in range(2)
        ]
        left, seconds = stop_and_continue(core_pid, stack["metrics_port"], 5)
        # stalled, not dead: the API server's heartbeats go on while its engine core is stopped
        assert left == "stalled" and seconds <= 5
        for future in pending:
            assert future.result(timeout=120).usage.completion_tokens == (STALL_TEST_OUTPUT_LEN)
    log = (stack["tmp"] / "sidecar.log").read_text()
    assert "-> stalled" in log and "stalled -> running" in log


def test_the_replayed_sidecar_finds_what_explain_finds(stack, tmp_path):
    """One implementation of each rule: on this real vLLM's recording through the plugin (a
    hung engine core in it), the sidecar replaying the recording opens explain's findings
    (kind, iteration within one, cost within 5%)."""
    recording = shutil.copy(stack["tmp"] / "run.jsonl", tmp_path / "run.jsonl")
    assert_replay_agrees_with_explain(recording)


def test_killing_the_sidecar_leaves_vllm_serving(stack):
    stack["sidecar"].process.kill()
    stack["sidecar"].process.wait()
    responses = send_requests(stack["api_port"], 4, max_tokens=8)
    assert all(r.usage.completion_tokens > 0 for r in responses)
    assert stack["server"].poll() is None
