"""Run a sidecar next to an engine: the engine/serve/demo commands start one by default.

    sidecar = start_from_args(args)            # None with --no-sidecar or --telemetry-address
    address = telemetry_address(args, sidecar)  # None: telemetry off, use NullPublisher
    ...
    if sidecar: sidecar.stop()

Each sidecar gets a fresh private directory holding its ipc socket, so two engines started
side by side never share a lane by accident. The sidecar runs in a session of its own (a
Ctrl-C meant for the engine does not cut its telemetry short); it is stopped with SIGTERM by
``stop()`` and stops itself if the process that started it goes away.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

MAX_IPC_PATH = 100  # sockaddr_un holds 107 bytes
METRICS_URL_FILE = "metrics_url"  # in the run directory: where the sidecar serves /metrics


class SidecarProcess:
    """A sidecar subprocess bound to ``address``; a context manager that stops it."""

    def __init__(self, process: subprocess.Popen, address: str, run_dir: str) -> None:
        self.process = process
        self.address = address
        self.run_dir = run_dir

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str | None:
        """Where this sidecar serves /metrics (the port it bound), None with --no-metrics.
        The sidecar writes it before it listens on its lane, so before start_sidecar returns."""
        try:
            with open(os.path.join(self.run_dir, METRICS_URL_FILE)) as file:
                return file.read().strip()
        except FileNotFoundError:
            return None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (the sidecar flushes its sinks), SIGKILL after ``timeout_s``; exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _private_run_dir() -> str:
    run_dir = tempfile.mkdtemp(prefix="iterscope-")
    if len(run_dir) + len("/telemetry.sock") > MAX_IPC_PATH:  # a long TMPDIR
        os.rmdir(run_dir)
        run_dir = tempfile.mkdtemp(prefix="iterscope-", dir="/tmp")
    return run_dir


def start_sidecar(
    extra_args: Sequence[str] = (), ready_timeout_s: float = 30.0, **popen_kwargs: object
) -> SidecarProcess:
    """Start `iterscope sidecar` bound to a fresh ipc address; return once it listens.

    ``extra_args`` go to the sidecar's command line (e.g. ``["--record", "run.jsonl"]``);
    ``popen_kwargs`` to subprocess.Popen (e.g. ``stderr=...``). Raises RuntimeError if the
    sidecar exits or does not listen within ``ready_timeout_s``.
    """
    run_dir = _private_run_dir()
    socket_path = os.path.join(run_dir, "telemetry.sock")
    address = f"ipc://{socket_path}"
    command = [
        sys.executable, "-m", "telemetry.sidecar_cli", "--address", address, "--bind",
        "--parent-pid", str(os.getpid()),
        "--metrics-url-file", os.path.join(run_dir, METRICS_URL_FILE), *extra_args,
    ]
    process = subprocess.Popen(command, start_new_session=True, **popen_kwargs)
    sidecar = SidecarProcess(process, address, run_dir)
    deadline = time.monotonic() + ready_timeout_s
    while not os.path.exists(socket_path):
        if process.poll() is not None or time.monotonic() > deadline:
            sidecar.stop(timeout_s=1)
            raise RuntimeError(
                f"the sidecar did not start listening on {address} "
                f"(exit status {process.returncode}); command: {' '.join(command)}"
            )
        time.sleep(0.02)
    return sidecar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The telemetry options of the engine/serve/demo commands."""
    group = parser.add_argument_group("telemetry")
    group.add_argument(
        "--no-sidecar", action="store_true",
        help="run the engine alone: no sidecar, telemetry off (default: start a sidecar)",
    )
    group.add_argument(
        "--telemetry-address", metavar="ADDR",
        help="send telemetry to a sidecar that already runs (e.g. `iterscope sidecar`'s "
             "address) instead of starting one (default: start one)",
    )
    group.add_argument(
        "--sidecar-arg", action="append", default=[], metavar="ARG",
        help="pass ARG to the sidecar started here, e.g. --sidecar-arg=--record=run.jsonl "
             "(repeatable; default none)",
    )


def start_from_args(args: argparse.Namespace) -> SidecarProcess | None:
    """Start the default sidecar unless --no-sidecar or --telemetry-address says otherwise."""
    if args.no_sidecar or args.telemetry_address:
        return None
    return start_sidecar(args.sidecar_arg)


def telemetry_address(args: argparse.Namespace, sidecar: SidecarProcess | None) -> str | None:
    """Where the engine publishes; None means telemetry off (use the NullPublisher)."""
    if args.no_sidecar:
        return None
    return sidecar.address if sidecar is not None else args.telemetry_address
