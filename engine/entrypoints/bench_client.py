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
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine.entrypoints import arg_types
from engine.entrypoints.bench_backends import HttpBackend, InProcessBackend
from engine.entrypoints.bench_load import random_dataset, run_benchmark
from engine.entrypoints.bench_summary import format_summary, result_json, summarize


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host (and a port that is a number, if given)."""
    try:
        parts = urlsplit(text)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number
    except ValueError:
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(
            f"expected an http:// or https:// URL, e.g. http://127.0.0.1:8000, got {text!r}"
        )
    return text


def share_below_one(text: str) -> float:
    """A number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), e.g. 0.25, got {text!r}")
    return value


def writable_file(text: str) -> str:
    """A file path the run can write its result to, checked by opening it before any load is
    sent (so a typo in its folder does not lose a finished run). A file that was not there
    is removed again; one that was is left as it was."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"expected a file path in an existing folder, got {text!r} "
            f"(there is no folder {str(path.parent)!r})"
        )
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"expected a file path that can be written, got {text!r} ({error.strerror})"
        ) from None
    if not existed:
        path.unlink(missing_ok=True)
    return text


def build_parser() -> argparse.ArgumentParser:
    """Every bad value is refused here, naming the flag, the value and the form expected."""
    parser = argparse.ArgumentParser(prog="iterscope bench", description=__doc__.split("\n")[0])
    _add_target_arguments(parser.add_argument_group("target"))
    _add_load_arguments(parser.add_argument_group("load"))
    _add_output_arguments(parser.add_argument_group("output"))
    _add_in_process_arguments(parser)
    return parser


def _add_in_process_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's and its sidecar's options, as `serve` takes them: only --in-process
    starts either."""
    from engine.entrypoints.serve_args import add_engine_arguments, add_sidecar_shortcuts
    from telemetry.sidecar import process as sidecar_process

    add_engine_arguments(parser)
    sidecar_process.add_arguments(parser)
    add_sidecar_shortcuts(parser, metrics_port_default="a free one")


def _in_process_actions() -> list[argparse.Action]:
    options = argparse.ArgumentParser(add_help=False)
    _add_in_process_arguments(options)
    return options._actions


def in_process_options_given(args: argparse.Namespace) -> list[str]:
    """The engine and sidecar flags given a value other than their default: over HTTP the
    server runs with its own, so the bench refuses them there rather than ignore them."""
    return [
        action.option_strings[0]
        for action in _in_process_actions()
        if getattr(args, action.dest) != action.default
    ]


def result_settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """--result-file's settings: the flags that applied to this run (over HTTP not the engine's
    and sidecar's, whose defaults would name a model the server may not run) and ``model``,
    the one the load went to."""
    unused = set() if args.in_process else {action.dest for action in _in_process_actions()}
    settings = {
        name: json_number(value)
        for name, value in vars(args).items()
        if isinstance(value, (int, float, str)) and name not in unused
    }
    return {**settings, "model": model}


def sidecar_options(args: argparse.Namespace) -> str | None:
    """``args.sidecar_arg`` with serve's shortcuts added; what is wrong with them, or None.
    The sidecar started here serves /metrics on a free port unless a port is given: the
    default one is a running `serve`'s sidecar's, which the bench usually runs beside."""
    from engine.entrypoints.serve_args import sidecar_arguments
    from telemetry.sidecar import process as sidecar_process

    starts_sidecar = not (args.no_sidecar or args.telemetry_address)
    given = args.metrics_port is not None or any(
        arg.startswith("--metrics-port") for arg in args.sidecar_arg
    )
    if starts_sidecar and not given:
        args.metrics_port = 0
    args.sidecar_arg = sidecar_arguments(args)
    return sidecar_process.check_arguments(args)


def _add_target_arguments(target: argparse._ArgumentGroup) -> None:
    from engine.entrypoints.serve_args import API_KEY_ENV

    target.add_argument(
        "--base-url",
        metavar="URL",
        type=http_url,
        default="http://127.0.0.1:8000",
        help="the OpenAI-compatible server to load (default %(default)s)",
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help="sent as 'Authorization: Bearer KEY', for a server started with one (default: "
        f"${API_KEY_ENV} if set, as `serve` reads it, else none)",
    )
    target.add_argument(
        "--in-process",
        action="store_true",
        help="no HTTP: start the engine-core process here (engine options "
        "below) and send to it directly (default off)",
    )


def _add_load_arguments(load: argparse._ArgumentGroup) -> None:
    whole = arg_types.int_in_range
    load.add_argument(
        "--num-prompts",
        metavar="N",
        type=whole(1),
        default=100,
        help="requests to send (default %(default)s)",
    )
    load.add_argument(
        "--random-input-len",
        metavar="N",
        type=whole(1),
        default=128,
        help="prompt tokens per request (default %(default)s)",
    )
    load.add_argument(
        "--random-output-len",
        metavar="N",
        type=whole(1),
        default=64,
        help="output tokens per request, exact: ignore_eos (default %(default)s)",
    )
    load.add_argument(
        "--random-range-ratio",
        metavar="R",
        type=share_below_one,
        default=0.0,
        help="lengths vary uniformly by +- this share, in [0, 1) (default 0: exact)",
    )
    load.add_argument(
        "--seed",
        metavar="N",
        type=whole(0),
        default=0,
        help="seeds the prompts, their lengths and the arrivals (default %(default)s)",
    )
    load.add_argument(
        "--request-rate",
        metavar="RATE",
        type=arg_types.positive_float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument(
        "--max-concurrency",
        metavar="N",
        type=whole(1),
        default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    load.add_argument(
        "--vocab-size",
        metavar="N",
        type=whole(1),
        default=None,
        help="token ids are drawn below this (default: from /v1/models or the model's tokenizer)",
    )


def _add_output_arguments(out: argparse._ArgumentGroup) -> None:
    out.add_argument(
        "--result-file",
        type=writable_file,
        default=None,
        metavar="PATH",
        help="write a JSON result here; its folder must exist (default: none)",
    )
    out.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: a progress bar)"
    )


def json_number(value: Any) -> Any:
    """``inf`` (the default --request-rate) as the text "inf", as vLLM's result files have it:
    JSON has no Infinity, and strict readers refuse the file."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write --result-file; a failure (the folder went away meanwhile, a full disk) is a
    RuntimeError in one line that names the flag and the file."""
    text = json.dumps(result)
    try:
        Path(path).write_text(text)
    except OSError as error:
        raise RuntimeError(
            f"could not write --result-file {path!r}: {error.strerror or error} "
            "(the summary printed above is this run's result)"
        ) from None


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
        settings = result_settings(args, getattr(backend, "model", None) or args.model)
        write_result(args.result_file, result_json(metrics, settings, results))
    return metrics


def card_vocab_size(card: dict[str, Any]) -> int | None:
    """The vocabulary size a /v1/models card gives: ours says it; vLLM's does not, but its
    ``root`` is the model's directory, whose config.json does when it is on this machine.
    None when neither gives a whole number >= 1."""
    if card.get("vocab_size"):
        return _vocab_size(card["vocab_size"])
    config = Path(str(card.get("root") or "")) / "config.json"
    if not card.get("root") or not config.is_file():
        return None
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return _vocab_size(settings.get("vocab_size")) if isinstance(settings, dict) else None


def _vocab_size(value: Any) -> int | None:
    return value if type(value) is int and value >= 1 else None


async def _bench_http(args: argparse.Namespace) -> dict[str, Any]:
    backend = HttpBackend(args.base_url, api_key=args.api_key)
    try:
        card = await backend.model_card()
        backend.model = card["id"]
        vocab_size = args.vocab_size or card_vocab_size(card)
        if vocab_size is None:
            raise ValueError(
                f"the server reports no vocab_size and its model {card.get('root')!r} is not a "
                "directory here with a config.json that gives one: give --vocab-size (the "
                "model's config.json says it)"
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

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.in_process and (given := in_process_options_given(args)):
        parser.error(
            f"{', '.join(given)}: options of the engine and sidecar that --in-process starts; "
            "over HTTP the server runs with its own (give them to `iterscope serve`)"
        )
    if args.in_process and (problem := sidecar_options(args)) is not None:
        parser.error(problem)
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        metrics = _bench_in_process(args) if args.in_process else asyncio.run(_bench_http(args))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"iterscope bench: {exc}", file=sys.stderr)
        return 1
    return 0 if metrics["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
