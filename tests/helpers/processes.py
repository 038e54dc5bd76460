"""Processes a test starts: waiting for a line in their log, stopping them, and a live
`iterscope sidecar` serving /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.helpers.wait import wait_until


def wait_for_log(
    log_path: Path,
    pattern: str,
    process: subprocess.Popen | None,
    timeout_s: float,
    interval_s: float = 0.05,
) -> re.Match:
    """The first match of the regular expression ``pattern`` in the file ``log_path``, once
    it is there. Fails at once, with the log, if ``process`` exits first; after
    ``timeout_s`` with the log too."""

    def log() -> str:
        return log_path.read_text(errors="replace") if log_path.exists() else ""

    def matched() -> re.Match | None:
        match = re.search(pattern, log())
        if match is None and process is not None and process.poll() is not None:
            raise AssertionError(
                f"the process exited ({process.returncode}) before "
                f"{pattern!r} appeared in its log:\n{log()[-3000:]}"
            )
        return match

    return wait_until(
        matched, timeout_s, lambda: f"{pattern!r} in the log:\n{log()[-3000:]}", interval_s
    )


def stop_process(process: subprocess.Popen, timeout_s: float = 10) -> int:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; the exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout_s)
    return process.returncode


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (/proc/PID/statm)."""
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


METRICS_URL_LINE = r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics"


def explain_engines(recording: Path) -> list[dict]:
    """`iterscope explain RECORDING --json` run as a user runs it; its engines."""
    import json

    explain = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "explain", str(recording), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert explain.returncode == 0, explain.stderr
    return json.loads(explain.stdout)["engines"]


def child_pythonpath() -> str:
    """A child process's PYTHONPATH: the repository first, then whatever PYTHONPATH already
    names (where the packages are on a machine that installs them with --target, as
    bench/gpu_check.sh does)."""
    return os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))


def start_metrics_sidecar(
    tmp_path: Path, address: str, *extra_args: str
) -> tuple[subprocess.Popen, int]:
    """`iterscope sidecar` on the lane with /metrics on a free port; (process, port)."""
    log_path = tmp_path / "sidecar.log"
    env = dict(os.environ, OTEL_SDK_DISABLED="true", PYTHONPATH=child_pythonpath())
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.entrypoints.cli",
                "sidecar",
                "--address",
                address,
                "--metrics-port",
                "0",
                "--no-log",
                *extra_args,
            ],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        match = wait_for_log(log_path, METRICS_URL_LINE, process, timeout_s=30, interval_s=0.1)
    except BaseException:
        stop_process(process)
        raise
    return process, int(match[1])
