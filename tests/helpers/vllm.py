"""What the tests of a real `vllm serve` with iterscope share: the sidecar's counters against
vLLM's own, the engine status the sidecar serves, and an `iterscope` command to run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from telemetry.sources.vllm_lane import TESTED_VLLM_VERSIONS
from tests.helpers import REPO
from tests.helpers.prom import scrape, total
from tests.helpers.wait import wait_until

POLL_S = 0.2  # a vLLM engine shares 2 cores with the sidecar: scrape it gently
# A `vllm serve`'s environment beside the lane address: a 1 GiB CPU KV cache and iterscope's
# plugin loaded (the plugin steps aside where the scheduler source runs).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "iterscope"}


def version_tuple(version: str) -> tuple[int, ...]:
    """A vLLM release as numbers, to compare: "0.31.0" -> (0, 31, 0)."""
    return tuple(int(part) for part in version.split("."))


def plugin_gets_iteration_details(version: str) -> bool:
    """Whether vLLM ``version`` hands its stat loggers each step's iteration details (time,
    batch split) when asked (--enable-logging-iteration-details): from 0.26.0; before, only its
    engine core logs them, and the plugin's records have neither."""
    return version_tuple(version) >= (0, 26, 0)


# The versions the tests of a real `vllm serve` with each source (tests/test_vllm_live.py,
# tests/test_vllm_scheduler_live.py) run on. Every version of TESTED_VLLM_VERSIONS runs vLLM's
# real scheduler through tests/vllm_scheduler_check.py in `make test`; a serve costs 35-55 s a
# source and version on 2 cores (more without native bf16, where vLLM runs float32), so `make
# test` serves the newest release there, the CPU build serves the scheduler source with drafts
# (tests/test_vllm_spec_live.py) and Dynamo's scheduler, and `make test-vllm-versions`
# (ALL_VERSIONS_ENV=1) serves every version, and the plugin with drafts too.
ALL_VERSIONS_ENV = "ITERSCOPE_TEST_ALL_VLLM_VERSIONS"
SERVED_VLLM_VERSIONS = (
    TESTED_VLLM_VERSIONS
    if os.environ.get(ALL_VERSIONS_ENV) == "1"
    else (max(TESTED_VLLM_VERSIONS, key=version_tuple),)
)


def counter_pairs(metrics_port: int, api_port: int) -> dict[str, tuple[float, float]]:
    """(the sidecar's, vLLM's) for each counter both keep, from one scrape of each."""
    ours, theirs = scrape(metrics_port), scrape(api_port)
    return {
        "prompt tokens computed": (
            total(ours, "iterscope_prompt_tokens_total"),
            total(theirs, "vllm:prompt_tokens_by_source_total", source="local_compute"),
        ),
        "generation tokens": (
            total(ours, "iterscope_generation_tokens_total"),
            total(theirs, "vllm:generation_tokens_total"),
        ),
        "finished requests": (
            total(ours, "iterscope_requests_finished_total"),
            total(theirs, "vllm:request_success_total"),
        ),
        "preemptions": (
            total(ours, "iterscope_preemptions_total"),
            total(theirs, "vllm:num_preemptions_total"),
        ),
        "TTFT count": (
            total(ours, "iterscope_time_to_first_token_seconds_count"),
            total(theirs, "vllm:time_to_first_token_seconds_count"),
        ),
    }


def engine_status(metrics_port: int) -> str | None:
    """The state the sidecar's iterscope_engine_state says is current, None before one."""
    samples = scrape(metrics_port)
    states = [
        dict(labels)["state"]
        for (name, labels), value in samples.items()
        if name == "iterscope_engine_state" and value == 1
    ]
    return states[0] if states else None


def runs_requests(metrics_port: int) -> bool:
    """The sidecar says the engine is running and has requests running now (one scrape): not
    a status left over from work that has just drained (idle shows within a heartbeat)."""
    samples = scrape(metrics_port)
    running = [
        dict(labels)["state"]
        for (name, labels), value in samples.items()
        if name == "iterscope_engine_state" and value == 1
    ] == ["running"]
    return running and total(samples, "iterscope_requests_running") > 0


def stop_and_continue(
    core_pid: int, metrics_port: int, within_s: float, poll_s: float = POLL_S
) -> tuple[str, float]:
    """SIGSTOP vLLM's engine core once the sidecar shows it running requests, wait (up to
    ``within_s``) for the sidecar's status to leave running, SIGCONT it, and wait for running
    again. Returns (the status it left running for, seconds after the stop it did)."""
    wait_until(lambda: runs_requests(metrics_port), 30, "the engine to run them", interval_s=poll_s)
    os.kill(core_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_until(
            lambda: engine_status(metrics_port) not in ("running", None),
            within_s,
            "the stopped engine core to leave running",
            interval_s=poll_s,
        )
        seconds = time.monotonic() - stopped_at
        left = engine_status(metrics_port)
    finally:
        os.kill(core_pid, signal.SIGCONT)
    wait_until(
        lambda: engine_status(metrics_port) == "running",
        10,
        "running after SIGCONT",
        interval_s=poll_s,
    )
    return left, seconds


def iterscope(*args: str) -> str:
    """Run an iterscope command; its stdout, after checking it succeeded."""
    done = run_iterscope(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_iterscope(*args: str) -> subprocess.CompletedProcess:
    """Run an iterscope command, whatever its exit status."""
    return subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
