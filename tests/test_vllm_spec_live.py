"""Speculative decoding on a real vLLM (the CPU build, ngram drafts of up to 3 tokens) through
the scheduler source and, under `make test-vllm-versions`, the stat-logger plugin too: the
sidecar's draft counters equal vLLM's own /metrics, its 10-second log says vLLM's
SpecDecoding line, and `explain` and `tune` read the recording with the drafts in it. `make
test` builds .vllm-venv and .models/smollm2-hf. (The counts per step, the scheduler source's
and the plugin's mapping of vLLM's SpecDecodingStats, are checked against vLLM's own on every
tested version by tests/test_vllm_scheduler_live.py's real-scheduler checks; a serve costs
40-50 s on 2 cores, so `make test` serves the plugin without drafts only, in
tests/test_vllm_live.py.)"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.vllm_server import BEST_CPU_FLAGS, PLUGIN_FLAGS, start_vllm, stop_server
from telemetry.lane.record import is_clean_close
from telemetry.lane.recording import read_recording
from telemetry.sidecar.process import start_sidecar
from tests.helpers.ahead import ahead, take
from tests.helpers.findings import assert_replay_agrees_with_explain
from tests.helpers.net import free_port
from tests.helpers.prom import scrape, total
from tests.helpers.vllm import ALL_VERSIONS_ENV, POLL_S, VLLM_ENV, iterscope
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.timeout(600)

SPEC_CONFIG = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
)
SOURCE_FLAGS = {
    "scheduler": ("--scheduler-cls", "telemetry.sources.vllm_scheduler.IterscopeScheduler"),
    "plugin": PLUGIN_FLAGS,
}
SERVED_SOURCES = tuple(SOURCE_FLAGS) if os.environ.get(ALL_VERSIONS_ENV) == "1" else ("scheduler",)
# A prompt that repeats itself: greedy decoding continues the pattern, so ngram drafts from
# the prompt are often accepted, and sometimes not.
PROMPT = "Repeat after me: one two three four five six seven eight nine ten. " * 3
NUM_REQUESTS = 8


@ahead(fixture="spec_stack", tmp_name="vllm_spec")
@contextlib.contextmanager
def speculating_stack(tmp: Path, source: str, **vllm_kwargs) -> Iterator[dict]:
    """A recording sidecar and `vllm serve` speculating by ngram, with the source ``source``,
    after NUM_REQUESTS greedy requests."""
    metrics_port, api_port = free_port(), free_port()
    sidecar_log = open(tmp / "sidecar.log", "w")
    sidecar = start_sidecar(
        ["--metrics-port", str(metrics_port), "--record", str(tmp / "run.jsonl")]
        + ["--vllm-compatible-names"],
        stderr=sidecar_log,
    )
    server = None
    try:
        server = start_vllm(
            api_port,
            {"ITERSCOPE_TELEMETRY_ADDRESS": sidecar.address, **VLLM_ENV},
            tmp / "vllm.log",
            flags=(*BEST_CPU_FLAGS, *SOURCE_FLAGS[source], "--speculative-config", SPEC_CONFIG),
            **vllm_kwargs,
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none")

        def complete(_: int):
            return client.completions.create(
                model="smollm2", prompt=PROMPT, max_tokens=48, temperature=0
            )

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(complete, range(NUM_REQUESTS)))
        assert all(r.usage.completion_tokens > 0 for r in responses)
        yield {
            "source": source,
            "metrics_port": metrics_port,
            "api_port": api_port,
            "sidecar_log": tmp / "sidecar.log",
            "recording": tmp / "run.jsonl",
            "server": server,
        }
    finally:
        if server is not None:
            stop_server(server)
        sidecar.stop()
        sidecar_log.close()


@pytest.fixture(scope="module", params=SERVED_SOURCES)
def spec_stack(request, tmp_path_factory):
    """speculating_stack with the source ``request.param``, started ahead
    (tests/helpers/ahead.py)."""
    with take(speculating_stack, request.param, tmp_path_factory) as started:
        yield started


def draft_pairs(stack) -> dict[str, tuple[float, float]]:
    """(the sidecar's, vLLM's) draft counters, from one scrape of each; with
    --vllm-compatible-names the sidecar also serves each of vLLM's names, compared too."""
    ours, theirs = scrape(stack["metrics_port"]), scrape(stack["api_port"])
    pairs = {
        name: (
            total(ours, f"iterscope_spec_decode_{name}_total"),
            total(theirs, f"vllm:spec_decode_num_{name}_total"),
        )
        for name in ("drafts", "draft_tokens", "accepted_tokens")
    }
    for position in range(3):
        pairs[f"accepted at {position}"] = (
            total(
                ours,
                "iterscope_spec_decode_accepted_tokens_by_position_total",
                position=str(position),
            ),
            total(
                theirs, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)
            ),
        )
    return pairs


def test_the_sidecars_draft_counters_equal_vllms_own(spec_stack):
    latest: list[dict] = [{}]

    def agree() -> bool:
        latest[0] = draft_pairs(spec_stack)
        return all(ours == theirs for ours, theirs in latest[0].values())

    wait_until(agree, 15, lambda: f"draft counters to agree: {latest[0]}", interval_s=POLL_S)
    pairs = latest[0]
    drafts, draft_tokens, accepted = (
        pairs[n][0] for n in ("drafts", "draft_tokens", "accepted_tokens")
    )
    # drafts were scored and tokens of them accepted (how many depends on the machine's
    # dtype: a greedy continuation of the repeated prompt can accept nearly all)
    assert 0 < accepted <= draft_tokens <= 3 * drafts


def test_the_log_says_the_spec_decoding_line_as_vllm_does(spec_stack):
    def said() -> str | None:
        lines = spec_stack["sidecar_log"].read_text().splitlines()
        return next((line for line in lines if "SpecDecoding metrics:" in line), None)

    line = wait_until(said, 15, "the sidecar's SpecDecoding line", interval_s=POLL_S)
    assert "Engine 000: SpecDecoding metrics: Mean acceptance length: " in line
    assert "Per-position acceptance rate: " in line and "Avg Draft acceptance rate: " in line


def test_explain_and_tune_read_the_drafts_the_sidecar_counted(spec_stack):
    """The recording's drafts, as explain sums them, are the sidecar's counters (the last
    test waited for them to agree with vLLM's), and tune sizes the budget for vLLM's drafts
    of 3 (a target any machine meets: this checks what tune reads, not the machine's speed;
    whether it prices a draft token apart depends on the machine's noise, so not checked)."""
    ours = scrape(spec_stack["metrics_port"])
    counts = {
        name: int(total(ours, f"iterscope_spec_decode_{name}_total"))
        for name in ("drafts", "draft_tokens", "accepted_tokens")
    }
    recording = str(spec_stack["recording"])
    explain = json.loads(iterscope("explain", recording, "--json"))
    (engine,) = explain["engines"]
    drafts = engine["summary"]["spec_decode"]
    assert (drafts["num_drafts"], drafts["num_draft_tokens"], drafts["num_accepted_tokens"]) == (
        counts["drafts"],
        counts["draft_tokens"],
        counts["accepted_tokens"],
    )
    text = iterscope("explain", recording)
    assert "speculative decoding: " in text
    # the heartbeats say vLLM's num_speculative_tokens, which the engine's header names
    assert ", speculating 3 tokens ahead, vllm " in text
    tune = json.loads(iterscope("tune", recording, "--itl-target", "30s", "--json"))
    (engine,) = tune["engines"]
    assert engine["spec_decode"]["max_draft_tokens"] == 3
    recommendation = engine["recommendation"]
    assert recommendation["max_num_batched_tokens"] >= 4 * recommendation["max_num_seqs"]


def test_the_replayed_sidecar_finds_what_explain_finds(spec_stack, tmp_path):
    """One implementation of each rule: on this real vLLM's recording with drafts, the sidecar
    replaying the recording opens explain's findings (kind, iteration within one, cost
    within 5%)."""
    recording = shutil.copy(spec_stack["recording"], tmp_path / "run.jsonl")
    assert_replay_agrees_with_explain(recording)


def test_a_vllm_stopped_by_its_operator_is_closed_not_dead(spec_stack):
    """Last of spec_stack's tests: vLLM stopped as an operator stops it (SIGTERM to its
    process group) while requests run sends its source's closing heartbeat, saying it was
    told to stop: the sidecar says "closed" at once, with the requests the shutdown cut off,
    never "dead" (a shutdown was "Engine down", a finding and an alert; under load, with the
    scheduler source, still so until the heartbeat said it was told to stop), and the
    recording ends with that heartbeat, which explain reads as a shutdown."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{spec_stack['api_port']}/v1", api_key="none", max_retries=0
    )

    def long_request(_: int):
        with contextlib.suppress(openai.OpenAIError):  # cut off by the stop
            client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2000)

    def running() -> float:
        return total(scrape(spec_stack["metrics_port"]), "iterscope_requests_running")

    # the fixture's requests ended (the sidecar may hear of it a step late), then these run
    wait_until(lambda: running() == 0, 30, "the fixture's requests done", interval_s=POLL_S)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        for number in range(4):
            pool.submit(long_request, number)
        wait_until(lambda: running() > 0, 60, "requests running", interval_s=POLL_S)
        stop_server(spec_stack["server"])
    finally:
        pool.shutdown(wait=True)
    log = spec_stack["sidecar_log"]
    wait_until(lambda: "-> closed" in log.read_text(), 15, "the closed line", interval_s=POLL_S)
    text = log.read_text()
    assert "-> dead" not in text and "Engine down" not in text and "stalled" not in text, text
    assert "cut off by the shutdown" in text, text

    def last_message():
        return [m for m in read_recording(spec_stack["recording"]) if not isinstance(m, str)][-1]

    # the recording is flushed as the sidecar writes it (at most a second later)
    wait_until(lambda: is_clean_close(last_message()), 5, "the closing heartbeat recorded")
    assert last_message().stop_requested
