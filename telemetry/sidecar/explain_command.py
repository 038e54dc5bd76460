"""`iterscope explain`: explain's analysis of a recording (telemetry/analysis/explain.py), or,
with ``--follow``, the recording read as the sidecar writes it and said as the live sidecar says
it (follow.py). The command lives in the sidecar's layer because --follow runs the sidecar's
ingest, which the analysis layer never imports; without --follow it is explain's own main."""

from __future__ import annotations

import argparse
import sys

from telemetry.analysis import explain
from telemetry.analysis.cli_time import positive_time
from telemetry.analysis.liveness_flags import liveness_thresholds
from telemetry.sidecar.follow import follow


def build_parser() -> argparse.ArgumentParser:
    """explain's flags, and --follow's."""
    parser = explain.build_parser()
    live = parser.add_argument_group("live (--follow)")
    live.add_argument(
        "--follow",
        action="store_true",
        help="keep reading the files as they grow and print what the live sidecar printed "
        "(findings as they open and close, its 10 s lines), then the summary (default off)",
    )
    live.add_argument(
        "--interval",
        type=positive_time,
        default=1.0,
        help="how often --follow reads the files (default 1s)",
    )
    live.add_argument(
        "--max-time",
        type=positive_time,
        default=None,
        help="stop --follow after this long (default: until Ctrl-C)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.follow:
        return explain.run(args)
    if explain.fpm_taps(args.recordings):
        print("iterscope explain: --follow reads iterscope's recordings only", file=sys.stderr)
        return 2
    return follow(
        args.recordings,
        liveness_thresholds(args),
        args.interval,
        args.max_time,
        engine_index=args.engine,
    )
