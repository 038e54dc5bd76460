"""The `iterscope` command: one console script, one module per subcommand.

Each subcommand lives in its own module as ``main(argv: list[str]) -> int``; it is imported
only when asked for, so `iterscope sidecar` never imports torch (`iterscope serve` does import
prometheus_client: its API port serves /metrics of its own, engine/entrypoints/api_metrics.py).
"""

from __future__ import annotations

import importlib
import os
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("engine.entrypoints.demo", "the whole product on the embedded default model"),
    "serve": ("engine.entrypoints.serve", "OpenAI-compatible HTTP server + engine core + sidecar"),
    "sidecar": ("telemetry.sidecar.cli", "ingest telemetry records: logs, /metrics, traces"),
    "bench": ("engine.entrypoints.bench_client", "load generator like `vllm bench serve`"),
    "explain": ("telemetry.sidecar.explain_command", "episodes and a summary from a recording"),
    "timeline": ("telemetry.analysis.timeline_command", "a recording as a Perfetto trace"),
    "top": ("telemetry.sidecar.top", "a running sidecar's engines and open findings, live"),
    "tune": ("telemetry.analysis.tune", "recommend max_num_batched_tokens / max_num_seqs"),
    "kv-plan": ("engine.entrypoints.kv_plan", "how many tokens and requests fit in KV memory"),
    "curve-keys": ("telemetry.lane.curve", "create CURVE keys for telemetry lanes across hosts"),
}


def usage() -> str:
    lines = ["usage: iterscope <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv:  # a command was expected: said on stderr, as argparse says a missing one
        print(usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"iterscope: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        status = int(module.main(rest) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()
    return status


def _stdout_closed() -> int:
    """The reader went away (`iterscope explain run.jsonl | head`): stop quietly.

    Python's documented way: stdout is pointed at devnull so the flush at interpreter exit
    does not raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    sys.exit(main())
