"""`iterscope sidecar`: ingest the telemetry lane (or replay a recording) into the sinks.

Sinks are plug-ins by convention: each module in SINK_MODULES offers
``add_arguments(parser)`` and ``build(args) -> Sink | None`` (None = that sink is off). A
module that does not exist is skipped, so the sidecar runs with whatever sinks are present.
Ingest then attaches every sink (``Sink.attach``: its PipelineHealth and the list of sinks,
through which the Prometheus sink reads the others' health and ``sidecar_counters()``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import signal
import stat
import sys
import threading
import time
from types import ModuleType

import zmq

from telemetry.analysis.cli_time import positive_time
from telemetry.analysis.live_findings import LOOKBACK_S, MESSAGE_BYTES, WINDOW_MESSAGES
from telemetry.analysis.stall_rule import STALL_FACTOR, STALL_FLOOR_S, STALL_WINDOW_S
from telemetry.lane.publisher import default_address
from telemetry.sidecar.arg_types import positive_int
from telemetry.sidecar.engine_roster import DEFAULT_MAX_ENGINES, EVICT_AFTER_S
from telemetry.sidecar.fpm_engines import FpmEngines
from telemetry.sidecar.fpm_socket import FpmSubscriber, endpoints_by_rank
from telemetry.sidecar.ingest import DEAD_AFTER_S, Ingest
from telemetry.sidecar.lane_loop import DEFAULT_RCVHWM, LaneLoop, check_address
from telemetry.sidecar.sink import Sink
from telemetry.sources.fpm import PRODUCERS

SINK_MODULES = (
    "telemetry.sidecar.sinks.log",
    "telemetry.sidecar.sinks.jsonl",
    "telemetry.sidecar.sinks.prometheus",
    "telemetry.sidecar.sinks.otel",
    "telemetry.sidecar.sinks.nvtx_ranges",
    "telemetry.sidecar.sinks.perfetto_timeline",
    "telemetry.sidecar.sinks.fpm_publisher",
)
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
LOG_DATE_FORMAT = "%m-%d %H:%M:%S"

logger = logging.getLogger("iterscope.sidecar")


def load_sink_modules(names: tuple[str, ...] = SINK_MODULES) -> list[ModuleType]:
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ModuleNotFoundError as error:
            if error.name != name:  # the sink exists but one of its imports is missing
                raise
    return modules


def build_parser(sink_modules: list[ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope sidecar", description="Ingest per-iteration telemetry records."
    )
    lane = parser.add_argument_group("telemetry lane")
    lane.add_argument(
        "--address",
        default=None,
        help=f"ZMQ address of the lane (default: {default_address()}); tcp:// only if asked",
    )
    mode = lane.add_mutually_exclusive_group()
    mode.add_argument(
        "--bind",
        dest="bind",
        action="store_true",
        default=True,
        help="bind the address; engines connect (default)",
    )
    mode.add_argument(
        "--connect",
        dest="bind",
        action="store_false",
        help="connect to the address instead of binding it",
    )
    lane.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow binding a tcp address reachable from other hosts",
    )
    lane.add_argument(
        "--curve-keys-dir",
        metavar="DIR",
        help="accept only engines with CURVE keys listed in DIR/clients (see iterscope curve-keys)",
    )
    lane.add_argument(
        "--rcvhwm",
        type=positive_int,
        default=DEFAULT_RCVHWM,
        metavar="N",
        help="messages queued before the lane drops (default: %(default)s)",
    )
    lane.add_argument(
        "--max-engines",
        type=positive_int,
        default=DEFAULT_MAX_ENGINES,
        metavar="N",
        help="engines tracked at most; a new engine takes the place of one "
        "dead for --evict-after, else its heartbeats are counted and "
        "rejected (default: %(default)s)",
    )
    lane.add_argument(
        "--replay",
        metavar="FILE",
        help="feed a JSONL recording through the sinks instead of listening "
        "(/metrics stays off, so a replay never collides with a live sidecar)",
    )
    lane.add_argument(
        "--serve-after-replay",
        action="store_true",
        help="with --replay: serve /metrics of the replayed state until Ctrl-C",
    )
    add_fpm_arguments(parser)
    status = parser.add_argument_group("engine status")
    status.add_argument(
        "--dead-after",
        type=positive_time,
        default=DEAD_AFTER_S,
        metavar="S",
        help="no message for this long: dead (default: %(default)s)",
    )
    status.add_argument(
        "--stall-after",
        type=positive_time,
        default=None,
        metavar="S",
        help="work in flight, no iteration for this long: stalled (default: "
        f"{STALL_FACTOR} x the engine's longest progress interval of the "
        f"last {STALL_WINDOW_S / 60:.0f} minutes, at least "
        f"{STALL_FLOOR_S:g} s)",
    )
    status.add_argument(
        "--no-live-findings",
        dest="live_findings",
        action="store_false",
        help="do not search each engine's newest messages for findings (KV capacity, "
        "stalls, leaks, ...: the log's finding lines, iterscope_finding_* and /findings)",
    )
    status.add_argument(
        "--findings-window",
        type=positive_int,
        default=WINDOW_MESSAGES,
        metavar="N",
        help="messages of each engine the live findings search at most (about "
        f"{MESSAGE_BYTES} bytes each): enough for the {LOOKBACK_S:g} s they keep, up to "
        f"N / {LOOKBACK_S:g} messages a second; the log says when an engine's come faster "
        "(default: %(default)s)",
    )
    status.add_argument(
        "--evict-after",
        type=positive_time,
        default=EVICT_AFTER_S,
        metavar="S",
        help="a dead engine silent this long gives its place to a new engine "
        "when --max-engines are tracked; a live one never does (default: "
        "%(default)s)",
    )
    parser.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    # The private directory that process made for this sidecar (telemetry/sidecar/run_dirs.py).
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    for module in sink_modules:
        module.add_arguments(parser)
    return parser


def add_fpm_arguments(parser: argparse.ArgumentParser) -> None:
    """Forward-pass metrics producers as engines (docs/fpm.md)."""
    fpm = parser.add_argument_group("forward-pass metrics (FPM: SGLang, Dynamo; docs/fpm.md)")
    fpm.add_argument(
        "--fpm",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="subscribe to an FPM producer's PUB socket (tcp://HOST:PORT or ipc://PATH); "
        "each (worker_id, dp_rank) becomes an engine (repeatable; default none)",
    )
    fpm.add_argument(
        "--fpm-dp-ranks",
        type=positive_int,
        default=1,
        metavar="N",
        help="each tcp:// --fpm endpoint is the first of N ports, one per data-parallel rank "
        "(PORT, PORT+1, ...), for producers that bind one per rank (default: %(default)s)",
    )
    fpm.add_argument(
        "--fpm-model",
        default="",
        metavar="NAME",
        help="the model name of the FPM engines (default: each one's worker id)",
    )
    fpm.add_argument(
        "--fpm-producer",
        choices=list(PRODUCERS),
        default="unknown",
        help="who publishes the FPM messages, which says what their wall_time measures "
        "(kept in each engine's source; default: %(default)s)",
    )


def build_fpm_subscribers(args: argparse.Namespace, ingest: Ingest) -> list[FpmSubscriber]:
    """The FPM subscriber feeding ``ingest``, if --fpm names any endpoint."""
    if not args.fpm:
        return []
    endpoints = endpoints_by_rank(args.fpm, args.fpm_dp_ranks)
    engines = FpmEngines(ingest, args.fpm_model, args.fpm_producer)
    subscriber = FpmSubscriber(endpoints, engines, rcvhwm=args.rcvhwm)
    logger.info("subscribed to FPM producers on %s", ", ".join(endpoints))
    return [subscriber]


def build_sinks(sink_modules: list[ModuleType], args: argparse.Namespace) -> list[Sink]:
    return [sink for module in sink_modules if (sink := module.build(args)) is not None]


def known_last_seqs(sinks: list[Sink]) -> dict[int, int]:
    last_seqs: dict[int, int] = {}
    for sink in sinks:
        for engine_index, seq in sink.known_last_seqs().items():
            last_seqs[engine_index] = max(seq, last_seqs.get(engine_index, 0))
    return last_seqs


def check_private_directory(directory: str) -> None:
    """The directory of the lane's socket, made 0700 if new; ValueError if it is someone
    else's or others may write to it: whoever controls it can replace the socket and read
    or forge every record."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(
            f"the lane's directory {directory} is not a directory (a link?); "
            "remove it or choose another --address"
        )
    if info.st_uid != os.getuid():
        raise ValueError(
            f"the lane's directory {directory} belongs to uid {info.st_uid}, not "
            f"to you (uid {os.getuid()}); remove it or choose another --address"
        )
    if info.st_mode & 0o022:
        raise ValueError(
            f"the lane's directory {directory} is writable by others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); chmod 700 it or choose another "
            "--address"
        )


def check_status_arguments(args: argparse.Namespace) -> None:
    """ValueError, in the flags' words, where the engine-status flags disagree."""
    if args.evict_after < args.dead_after:
        raise ValueError(
            f"--evict-after ({args.evict_after:g} s) must be at least --dead-after "
            f"({args.dead_after:g} s): only a dead engine gives up its place"
        )


def check_live_arguments(args: argparse.Namespace) -> str:
    """The lane's address, checked with the FPM endpoints before any sink starts a server or
    opens a file; ValueError names the first that is wrong."""
    address = args.address or default_address()
    check_address(address, args.bind, args.allow_remote or bool(args.curve_keys_dir))
    for endpoint in endpoints_by_rank(args.fpm or [], args.fpm_dp_ranks):
        check_address(endpoint, bind=False, what="an --fpm endpoint")
    return address


def run_live(args: argparse.Namespace, sinks: list[Sink]) -> int:
    address = check_live_arguments(args)
    if address.startswith("ipc://") and args.bind:
        check_private_directory(os.path.dirname(address[len("ipc://") :]) or ".")
    ingest = Ingest(
        sinks,
        args.dead_after,
        args.stall_after,
        known_last_seqs=known_last_seqs(sinks),
        max_engines=args.max_engines,
        evict_after_s=args.evict_after,
        live_findings=args.live_findings,
        findings_window=args.findings_window,
    )
    if address.startswith("tcp://") and args.allow_remote and not args.curve_keys_dir:
        logger.warning(
            "the telemetry lane %s is neither authenticated nor encrypted; "
            "consider --curve-keys-dir",
            address,
        )
    sidecar = LaneLoop(
        address,
        ingest,
        bind=args.bind,
        rcvhwm=args.rcvhwm,
        curve_keys_dir=args.curve_keys_dir,
        subscribers=build_fpm_subscribers(args, ingest),
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sidecar.stop())
    if args.parent_pid:
        stop_when_parent_exits(args.parent_pid, sidecar)
    logger.info(
        "sidecar %s on %s (pid %d)", "bound" if args.bind else "connected", address, os.getpid()
    )
    try:
        sidecar.run()
    finally:
        ingest.close()
        remove_run_dir_if_orphaned(args.run_dir, args.parent_pid)
    stats = ingest.health
    dropped = {
        index: state.view.num_dropped_total for index, state in sorted(ingest.engines.items())
    }
    logger.info(
        "sidecar stopped: %d frames, %d messages, %d undecodable, %d rejected, "
        "dropped per engine %s",
        stats.num_frames,
        stats.num_messages,
        stats.num_undecodable_total,
        stats.num_rejected_total,
        dropped,
    )
    return 0


def wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM (the sinks' servers keep serving meanwhile)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    logger.info("replay done; serving until Ctrl-C")
    while not stop.wait(1.0):
        pass


def stop_when_parent_exits(parent_pid: int, sidecar: LaneLoop) -> None:
    """Stop the sidecar once the process that started it is gone (checked twice a second)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        sidecar.stop()

    threading.Thread(target=watch, name="iterscope-parent-watch", daemon=True).start()


def remove_run_dir_if_orphaned(run_dir: str | None, parent_pid: int) -> None:
    """A parent that was killed (SIGKILL) could not remove the private directory it made for
    this sidecar; the sidecar, its last user, does. A live parent removes it itself."""
    if run_dir and parent_pid and os.getppid() != parent_pid:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    sink_modules = load_sink_modules()
    args = build_parser(sink_modules).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
    try:
        if args.replay and not args.serve_after_replay and hasattr(args, "no_metrics"):
            args.no_metrics = True
        if args.replay and (args.fpm or args.fpm_port is not None):
            raise ValueError(
                "--fpm and --fpm-port serve live engines: they cannot go with --replay"
            )
        check_status_arguments(args)
        if not args.replay:
            check_live_arguments(args)
        sinks = build_sinks(sink_modules, args)
        if args.replay:
            from telemetry.sidecar.replay import replay

            ingest = replay(
                args.replay,
                sinks,
                args.dead_after,
                args.stall_after,
                max_engines=args.max_engines,
                live_findings=args.live_findings,
                findings_window=args.findings_window,
                close_sinks=not args.serve_after_replay,
            )
            stats = ingest.health
            logger.info(
                "replayed %d messages, %d undecodable lines",
                stats.num_messages,
                stats.num_undecodable_total,
            )
            if args.serve_after_replay:
                wait_for_stop_signal()
                ingest.close()
            return 0
        return run_live(args, sinks)
    except (ValueError, OSError, zmq.ZMQError) as error:
        print(f"iterscope sidecar: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
