"""The command line of `iterscope serve`, and the engine-core options it shares with
`iterscope bench --in-process` (``add_engine_arguments``, made an EngineConfig by
``engine_config``). Each help names its default and each type's error names the form it
expects (engine/entrypoints/arg_types.py).
"""

from __future__ import annotations

import argparse
import os

from engine.config import MAX_BLOCK_SIZE, EngineConfig
from engine.core_client import DEFAULT_STALL_AFTER_S
from engine.entrypoints import api_metrics, arg_types
from engine.entrypoints.http_guard import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from telemetry.lane.publisher import DEFAULT_QUEUE_CAPACITY, DEFAULT_SNDHWM
from telemetry.lane.record import MAX_ENGINE_INDEX
from telemetry.sidecar.sinks.prometheus import DEFAULT_METRICS_PORT

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M GGUF
TINY_MODEL = "tiny-llama"  # a 2-layer random-weight model with a byte tokenizer (tests, smoke)
API_KEY_ENV = "ITERSCOPE_API_KEY"
DESCRIPTION = ("`iterscope serve`: an OpenAI-compatible HTTP frontend in front of the "
               "engine-core process.")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine-core options shared by `serve` and `bench --in-process`; each help names its
    default and each type's error names the form it expects (engine/entrypoints/arg_types.py)."""
    group = parser.add_argument_group("engine")
    _add_model_and_cache_arguments(group)
    _add_telemetry_and_process_arguments(group)


def _add_model_and_cache_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"HF directory, .gguf file, smollm2 or {TINY_MODEL} (default "
                       f"{DEFAULT_MODEL}); `serve` also takes it as its first argument")
    group.add_argument("--dtype", default="auto", type=arg_types.dtype,
                       help="auto, float32, bfloat16 or float16 (default auto: bfloat16 where "
                       "the CPU or GPU computes it natively, else float32 on CPU and float16 "
                       "on older GPUs; start-up says which)")
    group.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where the model runs (default %(default)s)")
    group.add_argument("--max-model-len", type=arg_types.int_in_range(1), default=None,
                       metavar="N", help="longest prompt + output in tokens (default: the "
                       "model's own limit)")
    group.add_argument("--max-num-seqs", type=arg_types.int_in_range(1), default=32,
                       metavar="N", help="most requests running at once (default %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=arg_types.int_in_range(1),
                       default=2048, metavar="N",
                       help="most tokens in one iteration (default %(default)s)")
    group.add_argument("--block-size", type=arg_types.power_of_two(MAX_BLOCK_SIZE), default=16,
                       metavar="N", help="tokens per KV cache block (default %(default)s)")
    group.add_argument("--kv-cache-memory", type=arg_types.memory_size, default=None,
                       metavar="SIZE", help="KV cache budget, e.g. 512MiB or 4GiB (default: "
                       "512MiB on CPU, --gpu-memory-utilization of the card on CUDA)")
    group.add_argument("--gpu-memory-utilization", type=arg_types.fraction, default=0.9,
                       metavar="FRACTION", help="share of the GPU's memory for weights, "
                       "activations and KV cache on CUDA (default %(default)s)")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="turn the prefix cache off (default on)")


def _add_telemetry_and_process_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--engine-index", type=arg_types.int_in_range(0, MAX_ENGINE_INDEX),
                       default=0, metavar="N", help="this engine's index in its telemetry "
                       "(the `engine` label; default %(default)s)")
    group.add_argument("--telemetry-curve-keys-dir", default=None, metavar="DIR",
                       help="CURVE keys for a tcp telemetry lane to a sidecar on another host "
                       "(python -m telemetry.lane.curve; docs/deploy.md; default none: ipc lane)")
    group.add_argument("--telemetry-curve-engine-name", default="engine", metavar="NAME",
                       help="which engine key pair in that directory (default %(default)s)")
    group.add_argument("--telemetry-sndhwm", type=arg_types.int_in_range(1),
                       default=DEFAULT_SNDHWM, metavar="N",
                       help="telemetry frames ZMQ may hold for a slow sidecar before dropping "
                       "(default %(default)s)")
    group.add_argument("--telemetry-queue-capacity", type=arg_types.int_in_range(1),
                       default=DEFAULT_QUEUE_CAPACITY, metavar="N",
                       help="records the engine queues for its telemetry sender thread before "
                       "dropping (default %(default)s)")
    group.add_argument("--nvtx-markers", action="store_true",
                       help="one NVTX range per iteration in the engine process, to pair with "
                       "the sidecar's --nvtx ranges in Nsight Systems (docs/profiling.md; "
                       "default off)")
    group.add_argument("--cpu-threads", type=arg_types.int_in_range(1), default=None,
                       metavar="N", help="torch threads of the engine process on CPU "
                       "(default: one per core; 1 is faster when the frontend, sidecar and a "
                       "load generator share a small machine)")


def engine_config(args: argparse.Namespace, telemetry_address: str | None) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, engine_index=args.engine_index,
        telemetry_address=telemetry_address,
        telemetry_curve_keys_dir=args.telemetry_curve_keys_dir,
        telemetry_curve_engine_name=args.telemetry_curve_engine_name,
        nvtx_markers=args.nvtx_markers,
        telemetry_sndhwm=args.telemetry_sndhwm,
        telemetry_queue_capacity=args.telemetry_queue_capacity,
    )


def build_parser() -> argparse.ArgumentParser:
    from telemetry.sidecar import process as sidecar_process

    parser = argparse.ArgumentParser(prog="iterscope serve", description=DESCRIPTION)
    _add_http_arguments(parser)
    add_engine_arguments(parser)
    sidecar_process.add_arguments(parser)
    api_metrics.add_arguments(parser)
    _add_sidecar_shortcuts(parser)
    return parser


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    parser.add_argument("--port", type=arg_types.port, default=8000,
                        help="listen port, 0 picks a free one (default %(default)s)")
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model (as `vllm serve MODEL`)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients use, and the model_name label of every "
                        "telemetry series (default: the model)")
    parser.add_argument("--access-log", action="store_true",
                        help="log every HTTP request (default off)")
    parser.add_argument("--max-request-body", type=arg_types.memory_size, default="4MiB",
                        metavar="SIZE", help="larger request bodies get 413 unread "
                        "(default %(default)s)")
    parser.add_argument("--request-body-timeout", type=arg_types.positive_float,
                        default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                        help="a request body must arrive within this long, else 408 "
                        "(default %(default)s)")
    parser.add_argument("--request-header-timeout", type=arg_types.positive_float,
                        default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                        help="a connection whose request headers take longer is closed "
                        "(default %(default)s)")
    parser.add_argument("--request-timeout", type=arg_types.positive_float, default=None,
                        metavar="SECONDS", help="a request still generating after this long "
                        "is aborted and answered 504 (default: no limit)")
    parser.add_argument("--engine-stall-timeout", type=arg_types.positive_float,
                        default=DEFAULT_STALL_AFTER_S, metavar="SECONDS",
                        help="/health says stalled (503) when requests are in flight and the "
                        "engine has sent nothing for this long (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                        help="/v1/ requests need 'Authorization: Bearer KEY' (default: "
                        f"${API_KEY_ENV} if set, else no key; prefer the variable, since "
                        "command lines are visible to other users)")


def _add_sidecar_shortcuts(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sidecar shortcuts (passed to the sidecar started here)")
    group.add_argument("--metrics-port", type=arg_types.port, default=None, metavar="PORT",
                       help="the sidecar's /metrics port, 0 picks a free one (default "
                       f"{DEFAULT_METRICS_PORT})")
    group.add_argument("--record", default=None, metavar="PATH",
                       help="the sidecar records every telemetry message to this JSONL file "
                       "(default: no recording)")
    group.add_argument("--vllm-compatible-names", action="store_true",
                       help="the sidecar's /metrics also has vLLM's series names "
                       "(vllm:num_requests_running, ...) for vLLM's dashboards (default off)")


def resolve_model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` are the same; both at once must agree."""
    positional = args.model_positional
    if positional is None:
        return
    if args.model not in (DEFAULT_MODEL, positional):
        parser.error(f"the model is given twice: {positional!r} and --model {args.model!r}")
    args.model = positional


def sidecar_arguments(args: argparse.Namespace) -> list[str]:
    extra = list(args.sidecar_arg)
    if args.metrics_port is not None:
        extra.append(f"--metrics-port={args.metrics_port}")
    if args.record is not None:
        extra.append(f"--record={args.record}")
    if args.vllm_compatible_names:
        extra.append("--vllm-compatible-names")
    return extra
