"""The command line of `iterscope serve`, and the engine-core options it shares with
`iterscope bench --in-process` (``add_engine_arguments``, made an EngineConfig by
``engine_config``). Each help names its default and each type's error names the form it
expects (engine/entrypoints/arg_types.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, fields

from engine.config import EngineConfig
from engine.core_client import DEFAULT_STALL_AFTER_S
from engine.entrypoints import api_metrics, arg_types
from engine.entrypoints.http_guard import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from telemetry.sidecar.sinks.prometheus import DEFAULT_METRICS_PORT

TINY_MODEL = "tiny-llama"  # a 2-layer random-weight model with a byte tokenizer (tests, smoke)
API_KEY_ENV = "ITERSCOPE_API_KEY"
DESCRIPTION = (
    "`iterscope serve`: an OpenAI-compatible HTTP frontend in front of the engine-core process."
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine-core options shared by `serve` and `bench --in-process`: one flag per
    EngineConfig field that names one (engine/config.py holds flag, help, kind and default),
    and --cpu-threads, which is the engine process's own."""
    group = parser.add_argument_group("engine")
    for setting in fields(EngineConfig):
        if setting.metadata.get("flag"):
            _add_setting_argument(group, setting)
    group.add_argument(
        "--cpu-threads",
        type=arg_types.int_in_range(1),
        default=None,
        metavar="N",
        help="torch threads of the engine process on CPU "
        "(default: one per core; 1 is faster when the frontend, sidecar and a "
        "load generator share a small machine)",
    )


def _add_setting_argument(group: argparse._ArgumentGroup, setting: Field) -> None:
    """The flag of one EngineConfig field: its value lands in ``args.<field name>``."""
    meta = setting.metadata
    if setting.type == "bool":  # a switch; --no-... turns a setting that is on by default off
        action = "store_false" if meta["negate"] else "store_true"
        default_text = meta["default_text"] or ("on" if setting.default else "off")
        group.add_argument(
            meta["flag"],
            dest=setting.name,
            action=action,
            help=f"{meta['help']} (default {default_text})",
        )
        return
    default_text = meta["default_text"] or setting.default
    kind = meta["kind"]
    group.add_argument(
        meta["flag"],
        dest=setting.name,
        default=setting.default,
        type=arg_types.of_kind(kind) if kind else None,
        metavar=meta["metavar"],
        help=f"{meta['help']} (default: {default_text})",
    )


def engine_config(args: argparse.Namespace, telemetry_address: str | None) -> EngineConfig:
    """The EngineConfig of the parsed engine flags (its own checks raise ValueError)."""
    values = {
        setting.name: getattr(args, setting.name)
        for setting in fields(EngineConfig)
        if setting.metadata.get("flag")
    }
    return EngineConfig(
        **values,
        served_model_name=getattr(args, "served_model_name", None),
        telemetry_address=telemetry_address,
    )


def build_parser() -> argparse.ArgumentParser:
    from telemetry.sidecar import process as sidecar_process

    parser = argparse.ArgumentParser(prog="iterscope serve", description=DESCRIPTION)
    _add_http_arguments(parser)
    add_engine_arguments(parser)
    sidecar_process.add_arguments(parser)
    api_metrics.add_arguments(parser)
    add_sidecar_shortcuts(parser)
    return parser


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    parser.add_argument(
        "--port",
        type=arg_types.port,
        default=8000,
        help="listen port, 0 picks a free one (default %(default)s)",
    )
    parser.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as with --model (as `vllm serve MODEL`)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients use, and the model_name label of every "
        "telemetry series (default: the model)",
    )
    parser.add_argument(
        "--access-log", action="store_true", help="log every HTTP request (default off)"
    )
    parser.add_argument(
        "--max-request-body",
        type=arg_types.memory_size,
        default="4MiB",
        metavar="SIZE",
        help="larger request bodies get 413 unread (default %(default)s)",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=arg_types.positive_float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a request body must arrive within this long, else 408 (default %(default)s)",
    )
    parser.add_argument(
        "--request-header-timeout",
        type=arg_types.positive_float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection whose request headers take longer is closed (default %(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=arg_types.positive_float,
        default=None,
        metavar="SECONDS",
        help="a request still generating after this long "
        "is aborted and answered 504 (default: no limit)",
    )
    parser.add_argument(
        "--engine-stall-timeout",
        type=arg_types.positive_float,
        default=DEFAULT_STALL_AFTER_S,
        metavar="SECONDS",
        help="/health says stalled (503) when requests are in flight and the "
        "engine has sent nothing for this long, or, while it still iterates, has given "
        "none of them a token for this long (longer while it may be prefilling the "
        "tokens in flight) (default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help="/v1/ requests need 'Authorization: Bearer KEY' (default: "
        f"${API_KEY_ENV} if set, else no key; prefer the variable, since "
        "command lines are visible to other users)",
    )


def add_sidecar_shortcuts(
    parser: argparse.ArgumentParser, metrics_port_default: str = str(DEFAULT_METRICS_PORT)
) -> None:
    """The sidecar options `serve` and `bench --in-process` take as their own flags
    (``sidecar_arguments`` turns them into the sidecar's); ``metrics_port_default``: what
    the help says the port is without --metrics-port."""
    group = parser.add_argument_group("sidecar shortcuts (passed to the sidecar started here)")
    group.add_argument(
        "--metrics-port",
        type=arg_types.port,
        default=None,
        metavar="PORT",
        help=f"the sidecar's /metrics port, 0 picks a free one (default {metrics_port_default})",
    )
    group.add_argument(
        "--record",
        default=None,
        metavar="PATH",
        help="the sidecar records every telemetry message to this JSONL file "
        "(default: no recording)",
    )
    group.add_argument(
        "--fpm-port",
        type=arg_types.port,
        default=None,
        metavar="PORT",
        help="the sidecar publishes forward-pass metrics (FPM, as SGLang and Dynamo do) on "
        "tcp://*:PORT for Dynamo's planner and other FPM consumers; docs/fpm.md (default off)",
    )
    group.add_argument(
        "--vllm-compatible-names",
        action="store_true",
        help="the sidecar's /metrics also has vLLM's series names "
        "(vllm:num_requests_running, ...) for vLLM's dashboards (default off)",
    )


def resolve_model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` are the same; both at once must agree."""
    positional = args.model_positional
    if positional is None:
        return
    if args.model not in (EngineConfig.model, positional):
        parser.error(f"the model is given twice: {positional!r} and --model {args.model!r}")
    args.model = positional


def sidecar_arguments(args: argparse.Namespace) -> list[str]:
    extra = list(args.sidecar_arg)
    if args.metrics_port is not None:
        extra.append(f"--metrics-port={args.metrics_port}")
    if args.record is not None:
        extra.append(f"--record={args.record}")
    if args.fpm_port is not None:
        extra.append(f"--fpm-port={args.fpm_port}")
    if args.vllm_compatible_names:
        extra.append("--vllm-compatible-names")
    return extra
