"""`iterscope bench`: a load generator in the manner of `vllm bench serve`.

    random dataset (seeded)  ->  arrivals (Poisson at --request-rate, or all at once)
                             ->  concurrency limit (--max-concurrency, or a ramp for the demo)
                             ->  backend: the HTTP server (/v1/completions, streamed) or the
                                 engine-core process directly (--in-process)
                             ->  per-request TTFT, inter-token gaps, end-to-end latency
                             ->  summary table + JSON result file

Prompts are random token ids (so input lengths are exact) and requests set ignore_eos (so
output lengths are exact); sampling is greedy. Token counts come from the server's own usage
report, so they can be checked against the sidecar's counters for the same run.

Definitions: TTFT = send -> first token; ITL = gap between consecutive streamed tokens; TPOT
= (e2e - TTFT) / (output tokens - 1) per request; e2e = send -> last token.

This module is the command line; the dataset and the run are in bench_load.py, the backends
in bench_backends.py, the figures and the table in bench_summary.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from engine.entrypoints.bench_backends import HttpBackend, InProcessBackend
from engine.entrypoints.bench_load import random_dataset, run_benchmark
from engine.entrypoints.bench_summary import format_summary, result_json, summarize


def build_parser() -> argparse.ArgumentParser:
    from engine.entrypoints.serve_args import add_engine_arguments
    from telemetry.sidecar import process as sidecar_process

    parser = argparse.ArgumentParser(prog="iterscope bench", description=__doc__.split("\n")[0])
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server to load (default %(default)s)",
    )
    target.add_argument(
        "--in-process",
        action="store_true",
        help="no HTTP: start the engine-core process here (engine options "
        "below) and send to it directly",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--random-input-len", type=int, default=128)
    load.add_argument("--random-output-len", type=int, default=64)
    load.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly by +- this share (default 0: exact)",
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    load.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids are drawn below this (default: from /v1/models or the model's tokenizer)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--result-file", default=None, metavar="PATH", help="write a JSON result")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)
    sidecar_process.add_arguments(parser)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")


async def _bench(args: argparse.Namespace, backend: Any, vocab_size: int) -> dict[str, Any]:
    requests = random_dataset(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        vocab_size,
        args.seed,
        args.random_range_ratio,
    )
    limit = args.max_concurrency
    results, duration_time = await run_benchmark(
        backend,
        requests,
        args.request_rate,
        (lambda _: limit) if limit else None,
        args.seed,
        progress=not args.no_progress,
    )
    metrics = summarize(results, duration_time)
    print(format_summary(metrics), flush=True)
    failures = [r.error for r in results if not r.success]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if args.result_file:
        settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}
        with open(args.result_file, "w") as file:
            json.dump(result_json(metrics, settings, results), file)
    return metrics


def card_vocab_size(card: dict[str, Any]) -> int | None:
    """The vocabulary size a /v1/models card gives: ours says it; vLLM's does not, but its
    ``root`` is the model's directory, whose config.json does when it is on this machine."""
    if card.get("vocab_size"):
        return int(card["vocab_size"])
    config = Path(str(card.get("root") or "")) / "config.json"
    if not card.get("root") or not config.is_file():
        return None
    size = json.loads(config.read_text()).get("vocab_size")
    return int(size) if size else None


async def _bench_http(args: argparse.Namespace) -> dict[str, Any]:
    backend = HttpBackend(args.base_url)
    try:
        card = await backend.model_card()
        backend.model = card["id"]
        vocab_size = args.vocab_size or card_vocab_size(card)
        if not vocab_size:
            raise ValueError(
                f"the server reports no vocab_size and its model {card.get('root')!r} is not a "
                "directory here with a config.json: give --vocab-size (the model's "
                "config.json says it)"
            )
        return await _bench(args, backend, vocab_size)
    finally:
        await backend.close()


def _bench_in_process(args: argparse.Namespace) -> dict[str, Any]:
    from engine.entrypoints.serve import load_tokenizer, start_engine
    from engine.entrypoints.serve_args import engine_config
    from telemetry.sidecar import process as sidecar_process

    sidecar = client = None
    try:
        sidecar = sidecar_process.start_from_args(args)
        config = engine_config(args, sidecar_process.telemetry_address(args, sidecar))
        vocab_size = args.vocab_size or load_tokenizer(args.model).vocab_size
        client = start_engine(config, args.cpu_threads)
        return asyncio.run(_bench(args, InProcessBackend(client), vocab_size))
    finally:
        if client is not None:
            client.shutdown()
        if sidecar is not None:
            sidecar.stop()


def main(argv: list[str] | None = None) -> int:
    import logging

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        _check_args(args)
        metrics = _bench_in_process(args) if args.in_process else asyncio.run(_bench_http(args))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"iterscope bench: {exc}", file=sys.stderr)
        return 1
    return 0 if metrics["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
