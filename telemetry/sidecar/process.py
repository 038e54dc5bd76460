"""Run a sidecar next to an engine: the engine/serve/demo commands start one by default.

    sidecar = start_from_args(args)            # None with --no-sidecar or --telemetry-address
    address = telemetry_address(args, sidecar)  # None: telemetry off, use NullPublisher
    ...
    if sidecar: sidecar.stop()

Each sidecar gets a fresh private directory holding its ipc socket, so two engines started
side by side never share a lane by accident (telemetry/sidecar/run_dirs.py: making it, its
``pids`` file, and sweeping those left by killed runs). The sidecar runs in a session of its
own (a Ctrl-C meant for the engine does not cut its telemetry short); it is stopped with
SIGTERM by ``stop()``, which removes the directory, and stops itself if the process that
started it goes away (removing the directory then, since that process can no longer).

A sidecar started by ``start_from_args`` is supervised: a thread notices when it exits
without ``stop()``, logs it, and starts it again on the same address and arguments after a
backoff (1 s, doubling up to RESTART_BACKOFF_MAX_S; back to 1 s once one has run for
STABLE_AFTER_S). The engine's publisher reconnects by itself; the messages it could not send
meanwhile are counted by the engine and reported by the new sidecar as dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from telemetry.sidecar.lane_loop import check_address
from telemetry.sidecar.run_dirs import SOCKET_FILE, make_private_run_dir, write_pids

METRICS_URL_FILE = "metrics_url"  # in the run directory: where the sidecar serves /metrics
WATCH_INTERVAL_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0

logger = logging.getLogger("iterscope.telemetry")


class SidecarProcess:
    """A sidecar subprocess bound to ``address``; a context manager that stops it.

    ``process`` is the current one: a supervised sidecar replaces it on each restart (under
    ``_lock``, which ``stop()`` takes too, so a restart never races a stop).
    """

    def __init__(
        self,
        command: list[str],
        address: str,
        run_dir: str,
        popen_kwargs: dict,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.run_dir = run_dir
        self.num_restarts = 0
        self._command = command
        self._popen_kwargs = popen_kwargs
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._metrics_url_path = os.path.join(run_dir, METRICS_URL_FILE)
        self._metrics_url: str | None = None
        self.process = self._launch(ready_timeout_s)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str | None:
        """Where the current sidecar serves /metrics (the port it bound), None with
        --no-metrics. Read once per launch, so asking costs no I/O; a sidecar restarted on
        --metrics-port 0 has a new one."""
        return self._metrics_url

    def _read_metrics_url(self) -> str | None:
        """The sidecar writes the file before it listens on its lane, so once its socket
        exists the file is the current sidecar's."""
        try:
            with open(self._metrics_url_path) as file:
                return file.read().strip()
        except FileNotFoundError:
            return None

    @property
    def socket_path(self) -> str:
        return self.address.removeprefix("ipc://")

    def _launch(self, ready_timeout_s: float = 30.0) -> subprocess.Popen:
        """Start the sidecar command; return once its socket exists. RuntimeError if it
        exits or does not listen within ``ready_timeout_s``."""
        for stale in (self.socket_path, self._metrics_url_path):  # left by a killed sidecar
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        process = subprocess.Popen(self._command, start_new_session=True, **self._popen_kwargs)
        write_pids(self.run_dir, [os.getpid(), process.pid])
        deadline = time.monotonic() + ready_timeout_s
        while not os.path.exists(self.socket_path):
            exited = process.poll() is not None
            if exited or time.monotonic() > deadline:
                terminate(process, timeout_s=1)
                why = (
                    f"exited (status {process.returncode}; its error is above)"
                    if exited
                    else f"did not start within {ready_timeout_s:g} s"
                )
                raise RuntimeError(
                    f"the sidecar {why} before listening on {self.address}; "
                    f"command: {' '.join(self._command)}"
                )
            time.sleep(0.02)
        self._metrics_url = self._read_metrics_url()
        return process

    def supervise(self) -> None:
        """Restart the sidecar, with backoff, each time it exits until ``stop()``."""
        self._watcher = threading.Thread(
            target=self._watch, name="iterscope-sidecar-watch", daemon=True
        )
        self._watcher.start()

    def _watch(self) -> None:
        num_failures = 0
        started = time.monotonic()
        while not self._stopping.wait(WATCH_INTERVAL_S):
            status = self.process.poll()
            if status is None:
                if time.monotonic() - started > STABLE_AFTER_S:
                    num_failures = 0
                continue
            delay_s = min(RESTART_BACKOFF_MAX_S, 2.0**num_failures)
            logger.warning(
                "the sidecar (pid %d) exited with status %d: telemetry is lost "
                "until it runs again; restarting it in %g s",
                self.process.pid,
                status,
                delay_s,
            )
            num_attempts = 0
            while True:  # until one starts: each failed start says why, then waits longer
                if self._stopping.wait(delay_s):
                    return
                num_failures += 1
                num_attempts += 1
                if self._restart(num_attempts):
                    break
                delay_s = min(RESTART_BACKOFF_MAX_S, 2.0**num_failures)
                logger.warning("trying again in %g s", delay_s)
            started = time.monotonic()

    def _restart(self, num_attempts: int) -> bool:
        """Start the sidecar again; whether it runs (a failed start is logged with its
        cause, the sidecar's own error above it)."""
        with self._lock:
            if self._stopping.is_set():
                return True
            try:
                self.process = self._launch()
            except (RuntimeError, OSError) as error:
                logger.error("restarting the sidecar failed: %s", error)
                return False
            self.num_restarts += 1
        attempts = f", after {num_attempts} attempts" if num_attempts > 1 else ""
        logger.info(
            "the sidecar runs again (pid %d, restart %d%s) on %s",
            self.process.pid,
            self.num_restarts,
            attempts,
            self.address,
        )
        return True

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (the sidecar flushes its sinks), SIGKILL after ``timeout_s``; exit status."""
        self._stopping.set()
        with self._lock:
            status = terminate(self.process, timeout_s)
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return status

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def terminate(process: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, SIGKILL after ``timeout_s``; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def start_sidecar(
    extra_args: Sequence[str] = (), ready_timeout_s: float = 30.0, **popen_kwargs: object
) -> SidecarProcess:
    """Start `iterscope sidecar` bound to a fresh ipc address; return once it listens.

    ``extra_args`` go to the sidecar's command line (e.g. ``["--record", "run.jsonl"]``);
    ``popen_kwargs`` to subprocess.Popen (e.g. ``stderr=...``). Raises RuntimeError if the
    sidecar exits or does not listen within ``ready_timeout_s``.
    """
    run_dir = make_private_run_dir()
    address = f"ipc://{os.path.join(run_dir, SOCKET_FILE)}"
    command = [
        sys.executable,
        "-m",
        "telemetry.sidecar.cli",
        "--address",
        address,
        "--bind",
        "--parent-pid",
        str(os.getpid()),
        "--run-dir",
        run_dir,
        "--metrics-url-file",
        os.path.join(run_dir, METRICS_URL_FILE),
        *extra_args,
    ]
    try:
        return SidecarProcess(command, address, run_dir, popen_kwargs, ready_timeout_s)
    except RuntimeError:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The telemetry options of the engine/serve/demo commands."""
    group = parser.add_argument_group("telemetry")
    group.add_argument(
        "--no-sidecar",
        action="store_true",
        help="run the engine alone: no sidecar, telemetry off (default: start a sidecar)",
    )
    group.add_argument(
        "--telemetry-address",
        metavar="ADDR",
        help="send telemetry to a sidecar that already runs (e.g. `iterscope sidecar`'s "
        "address) instead of starting one (default: start one)",
    )
    group.add_argument(
        "--sidecar-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to the sidecar started here, e.g. --sidecar-arg=--record=run.jsonl "
        "(repeatable; default none)",
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the telemetry options, before anything starts, or None: the
    sidecar's options (``args.sidecar_arg``) where no sidecar is started here would be
    ignored (a recording never made), and an address the lane cannot take would fail only
    once the model is loaded."""
    if args.no_sidecar and args.telemetry_address:
        return "--no-sidecar turns telemetry off and --telemetry-address sends it on: give one"
    if args.sidecar_arg and (args.no_sidecar or args.telemetry_address):
        flag = "--no-sidecar" if args.no_sidecar else "--telemetry-address"
        elsewhere = (
            "drop --no-sidecar to start one"
            if args.no_sidecar
            else "give them to the sidecar at that address (`iterscope sidecar ...`)"
        )
        return (
            f"{' '.join(args.sidecar_arg)}: options of the sidecar started here, and "
            f"{flag} starts none; {elsewhere}"
        )
    if args.telemetry_address:
        try:
            check_address(args.telemetry_address, bind=False, what="--telemetry-address")
        except ValueError as error:
            return str(error)
    return None


def start_from_args(args: argparse.Namespace) -> SidecarProcess | None:
    """Start the default sidecar, supervised, unless --no-sidecar or --telemetry-address
    says otherwise."""
    if args.no_sidecar or args.telemetry_address:
        return None
    sidecar = start_sidecar(args.sidecar_arg)
    sidecar.supervise()
    return sidecar


def telemetry_address(args: argparse.Namespace, sidecar: SidecarProcess | None) -> str | None:
    """Where the engine publishes; None means telemetry off (use the NullPublisher)."""
    if args.no_sidecar:
        return None
    return sidecar.address if sidecar is not None else args.telemetry_address
