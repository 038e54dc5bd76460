"""`iterscope serve`: an OpenAI-compatible HTTP frontend in front of the engine-core process.

    client --HTTP--> this process (FastAPI + uvicorn) --lossless ZMQ lanes--> engine core
                                                       (EngineCoreClient spawns it)
    engine core --telemetry lane--> sidecar (started here unless --no-sidecar)

This module starts them, in order: the sidecar, the tokenizer, the engine core, the listening
socket, then uvicorn; and on the way out (Ctrl-C or SIGTERM) stops the engine and the sidecar.
The pieces: the command line in engine/entrypoints/serve_args.py, the routes and error bodies
in routes.py, the two generation endpoints as data in endpoints.py, and what a request does
with the engine (tokenize, fan out, detokenize, stop strings, abort on disconnect or
--request-timeout) in frontend.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from typing import Any

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.entrypoints import api_metrics
from engine.entrypoints.frontend import Frontend
from engine.entrypoints.http_guard import HttpLimits, header_timeout_protocol
from engine.entrypoints.routes import build_app
from engine.entrypoints.serve_args import (
    TINY_MODEL,
    build_parser,
    engine_config,
    resolve_model_argument,
    sidecar_arguments,
)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own starting value


def load_tiny_model(name: str, dtype: str, device: str) -> Any:
    """EngineCoreClient's load_model for TINY_MODEL (module level, so it pickles for spawn)."""
    from engine.model.loader import build_tiny_model

    return build_tiny_model(dtype=dtype, device=device)


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer alone, without its weights (the frontend never runs the model)."""
    from engine.model.paths import TINY_VOCAB_SIZE, resolve_model_path
    from engine.model.tokenizer import ByteTokenizer, build_gguf_tokenizer, load_hf_tokenizer

    if model == TINY_MODEL:
        return ByteTokenizer(TINY_VOCAB_SIZE)
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        from engine.model.gguf_file import gguf_tokenizer_fields, open_gguf

        return build_gguf_tokenizer(gguf_tokenizer_fields(open_gguf(path)))
    return load_hf_tokenizer(path)


def start_engine(config: EngineConfig, cpu_threads: int | None = None) -> EngineCoreClient:
    """Spawn the engine-core process. ``cpu_threads`` sets OMP_NUM_THREADS, which the spawned
    process inherits and torch reads when it starts (None: torch's default, one per core)."""
    if cpu_threads is not None:
        if cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {cpu_threads}")
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads)
    load_model = load_tiny_model if config.model == TINY_MODEL else None
    return EngineCoreClient(config, load_model=load_model)


def bound_socket(host: str, port: int) -> socket.socket:
    """Bound before the model loads, so that a port in use or a bad host is said at once,
    naming the flags. The caller listens once the engine runs (connections before that are
    refused) and before uvicorn starts, so port 0 can be reported and connections made before
    uvicorn accepts simply wait in the backlog.

    The protocol is named (IPPROTO_TCP, not 0): asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on connections whose socket says TCP, and with it on, a streamed
    response's first event waited for the client's delayed ACK of the headers: ~40 ms more
    time to first token, seen by every streaming client under load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        reason = error.strerror or str(error)
        raise OSError(f"cannot listen on {host}:{port} (--host, --port): {reason}") from None
    return sock


def keep_large_blocks_mapped() -> bool:
    """Make glibc give every block of MMAP_THRESHOLD_BYTES or more its own mapping, returned
    to the system when freed; True if this C library took the setting.

    glibc raises its mmap threshold to the size of the largest mapped block freed (up to
    32 MiB). After one multi-megabyte prompt (its body, its text, its token-id list), later
    ones are carved from the heaps of the threads that tokenize them, and those pages are
    kept: the frontend stayed ~50 MiB above its resting size for good. A fixed threshold
    turns that adjustment off. Only this process: the engine is spawned afresh."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library symbol of that name: not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from telemetry.sidecar import process as sidecar_process

    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_argument(parser, args)
    args.sidecar_arg = sidecar_arguments(args)
    if (problem := sidecar_process.check_arguments(args)) is not None:
        parser.error(problem)
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    # uvicorn re-raises SIGTERM once it has shut down: make that unwind through `finally`.
    signal.signal(signal.SIGTERM, _interrupt)
    keep_large_blocks_mapped()
    sidecar = client = None
    try:
        sock = bound_socket(args.host, args.port)
        tokenizer = load_tokenizer(args.model)  # a wrong model starts nothing
        sidecar = sidecar_process.start_from_args(args)
        sidecar_metrics_url = api_metrics.sidecar_metrics_url(args, sidecar)
        config = engine_config(args, sidecar_process.telemetry_address(args, sidecar))
        client = start_engine(config, args.cpu_threads)
        frontend = Frontend(
            client,
            tokenizer,
            args.served_model_name or args.model,
            args.engine_stall_timeout,
            args.request_timeout,
        )
        sock.listen(2048)
        limits = HttpLimits(args.max_request_body, args.request_body_timeout, args.api_key)
        uv_config = uvicorn.Config(
            build_app(frontend, limits, sidecar_metrics_url),
            log_level="warning",
            http=header_timeout_protocol(args.request_header_timeout),
            access_log=args.access_log,
            lifespan="off",
        )
        print(
            f"iterscope serve: {frontend.model_name} on http://{args.host}:"
            f"{sock.getsockname()[1]}/v1",
            flush=True,
        )
        uvicorn.Server(uv_config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"iterscope serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.shutdown()
        if sidecar is not None:
            sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
