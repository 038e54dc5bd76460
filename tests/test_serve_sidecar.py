"""The sidecar that `iterscope serve` starts, through its failures: restarted on a new
--metrics-port 0 port, the API port's /metrics reads it there; left behind by a frontend that
was SIGKILLed, it exits and takes its private run directory with it."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from engine.entrypoints.serve_args import TINY_MODEL
from tests.helpers.prom import scrape
from tests.helpers.serve import KV_CACHE_MEMORY, ServerProcess, tiny_server

pytestmark = pytest.mark.live

SIDECAR_STARTED = re.compile(r"sidecar bound on ipc://(\S+)/telemetry\.sock \(pid (\d+)\)")


def sidecars_started(server: ServerProcess) -> list[tuple[str, int]]:
    """(run directory, pid) of each sidecar the server's output shows starting, in order."""
    return [
        (match.group(1), int(match.group(2))) for match in SIDECAR_STARTED.finditer(server.log())
    ]


def sidecar_start_time(api_url: str) -> float | None:
    """iterscope_sidecar_start_time_seconds in the API port's /metrics, None while its answer
    has no sidecar series (iterscope_api_sidecar_reachable 0)."""
    samples = scrape(f"{api_url}/metrics")
    api_up = [
        value for (name, _), value in samples.items() if name == "iterscope_api_sidecar_reachable"
    ]
    if api_up != [1]:
        return None
    [start_time] = [
        value
        for (name, _), value in samples.items()
        if name == "iterscope_sidecar_start_time_seconds"
    ]
    return start_time


def test_the_api_metrics_follow_a_restarted_sidecar_to_its_new_port(tmp_path):
    with tiny_server(tmp_path) as server:
        first_start = server.wait_until(
            lambda: sidecar_start_time(server.base_url), 10, "the sidecar's series on the API port"
        )
        [(_, first_pid)] = sidecars_started(server)
        os.kill(first_pid, signal.SIGKILL)
        server.wait_until(lambda: len(sidecars_started(server)) == 2, 30, "the sidecar's restart")
        later_start = server.wait_until(
            lambda: sidecar_start_time(server.base_url),
            10,
            "the restarted sidecar's series on the API port",
        )
        assert later_start > first_start  # the new sidecar's series, not the old port's
        completion = {"model": TINY_MODEL, "prompt": "hello", "max_tokens": 2}
        assert (
            httpx.post(f"{server.base_url}/v1/completions", json=completion, timeout=60).status_code
            == 200
        )


def has_exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (it no longer runs)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return True


def test_a_killed_frontends_sidecar_exits_and_removes_its_run_directory(tmp_path):
    server = ServerProcess(
        tmp_path, "--model", TINY_MODEL, "--kv-cache-memory", KV_CACHE_MEMORY, "--cpu-threads", "1"
    )
    try:
        [(run_dir, sidecar_pid)] = sidecars_started(server)
        assert os.path.isdir(run_dir)
        server.process.kill()
        server.process.wait()
        server.wait_until(lambda: has_exited(sidecar_pid), 30, "the orphaned sidecar's exit")
        server.wait_until(lambda: not os.path.exists(run_dir), 10, "the run directory's removal")
    finally:
        server.stop()
        if not has_exited(sidecar_pid):
            os.kill(sidecar_pid, signal.SIGKILL)
