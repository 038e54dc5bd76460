"""The detectors' liveness thresholds on the command lines that run them (`explain`,
`timeline`): the live sidecar's --stall-after and --dead-after, so that a recording read with
the values its sidecar ran with gives the findings it found live."""

from __future__ import annotations

import argparse

from telemetry.analysis.cli_time import positive_time
from telemetry.analysis.episodes import Thresholds
from telemetry.analysis.stall_rule import DEAD_AFTER_S


def add_liveness_arguments(parser: argparse.ArgumentParser) -> None:
    """--stall-after and --dead-after, as `iterscope sidecar` takes them."""
    parser.add_argument(
        "--stall-after",
        type=positive_time,
        default=None,
        help="a fixed stall threshold: a frozen loop with work queued for this long is a "
        "stall (default: the live sidecar's adaptive threshold, twice the engine's longest "
        "recent progress interval, at least 5s)",
    )
    parser.add_argument(
        "--dead-after",
        type=positive_time,
        default=DEAD_AFTER_S,
        help="no message for longer than this is a silence, as the live sidecar's "
        f"--dead-after calls the engine dead (default {DEAD_AFTER_S:g}s)",
    )


def liveness_thresholds(args: argparse.Namespace) -> Thresholds:
    """The detectors' thresholds with add_liveness_arguments' values."""
    return Thresholds(stall_after=args.stall_after, dead_after=args.dead_after)
