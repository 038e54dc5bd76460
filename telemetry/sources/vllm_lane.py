"""How a vLLM process reaches the sidecar: one environment variable, one publisher per engine.

Both vLLM sources use this: the scheduler subclass in vLLM's EngineCore process
(telemetry/sources/vllm_scheduler.py) and the stat-logger plugin in its API-server process
(telemetry/sources/vllm_stat_logger.py). Turned on by

    ITERSCOPE_TELEMETRY_ADDRESS=ipc:///tmp/iterscope-1000/telemetry.sock  (or "default":
    the address ``iterscope sidecar`` binds by default)

which vLLM's processes inherit from ``vllm serve``. Without it nothing is sent and the reason
is said once, in vLLM's log. No vLLM import here.

A vLLM on another host than its sidecar (``tcp://sidecar-host:5557``) authenticates and
encrypts the lane with ZMQ CURVE as our engine does (telemetry/lane/curve.py, docs/deploy.md):

    ITERSCOPE_CURVE_KEYS_DIR=/etc/iterscope/keys    server.key and NAME.key_secret
    ITERSCOPE_CURVE_ENGINE_NAME=gpu-host-1          NAME (default "engine")

Keys that cannot be read turn telemetry off, said in vLLM's log; vLLM serves on.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from telemetry.lane.curve import DEFAULT_ENGINE_NAME
from telemetry.lane.publisher import CPU_ENGINE_SEND_INTERVAL_S, ZmqPublisher, default_address

ADDRESS_ENV = "ITERSCOPE_TELEMETRY_ADDRESS"
CURVE_KEYS_ENV = "ITERSCOPE_CURVE_KEYS_DIR"
CURVE_NAME_ENV = "ITERSCOPE_CURVE_ENGINE_NAME"
TESTED_VLLM_VERSIONS = (
    "0.24.0",
    "0.25.1",
    "0.26.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
)
UNTESTED_ENV = "ITERSCOPE_VLLM_UNTESTED"  # =1: the scheduler source tries an untested vLLM
SCHEDULER_MODULE = "telemetry.sources.vllm_scheduler"  # the scheduler source's classes
logger = logging.getLogger("vllm.iterscope")  # vLLM's handler and format
_said_unconfigured: set[str] = set()


def start_publisher(engine_index: int, facts: dict[str, Any], what: str) -> ZmqPublisher | None:
    """A publisher to the address in ADDRESS_ENV, closed at exit; None (said once per
    ``what``, e.g. "the scheduler source") when the variable is unset or the address bad."""
    address = os.environ.get(ADDRESS_ENV, "").strip()
    if not address:
        if what not in _said_unconfigured:
            _said_unconfigured.add(what)
            logger.info(
                "iterscope: %s is installed but %s is not set, so it sends nothing "
                "(set it to the sidecar's address, or to 'default')",
                what,
                ADDRESS_ENV,
            )
        return None
    if address == "default":
        address = default_address()
    try:
        # vLLM's engine core spreads its OpenMP threads over every core, on a GPU host too.
        publisher = ZmqPublisher(
            address,
            engine_index,
            facts=facts,
            send_interval_s=CPU_ENGINE_SEND_INTERVAL_S,
            curve_keys_dir=os.environ.get(CURVE_KEYS_ENV) or None,
            curve_engine_name=os.environ.get(CURVE_NAME_ENV) or DEFAULT_ENGINE_NAME,
        )
    except Exception:  # a bad address must not stop vLLM from serving
        logger.exception("iterscope: cannot publish to %s; telemetry is off", address)
        return None
    atexit.register(publisher.close)
    logger.info(
        "iterscope: %s of engine %d publishes per-step records to %s (pid %d)",
        what,
        engine_index,
        address,
        os.getpid(),
    )
    return publisher


def release(version: str) -> str:
    """A vLLM version (``vllm.__version__``) without its local part, such as +cpu."""
    return version.split("+")[0]


def is_tested_version(version: str) -> bool:
    """Whether this vLLM version (a local part such as +cpu aside) is one the sources were
    checked against."""
    return release(version) in TESTED_VLLM_VERSIONS


def scheduler_source_runs_on(version: str) -> bool:
    """Whether the scheduler source reports on this vLLM version: a tested one, or any where
    the operator asked for it (UNTESTED_ENV=1). Decided alike in vLLM's two processes (the
    same version, the same environment): where it does not, the plugin reports instead."""
    return is_tested_version(version) or os.environ.get(UNTESTED_ENV) == "1"


def scheduler_source_selected(vllm_config: Any) -> bool:
    """Whether vLLM was started with one of iterscope's scheduler classes."""
    scheduler_cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    name = (
        scheduler_cls
        if isinstance(scheduler_cls, str)
        else getattr(scheduler_cls, "__module__", "")
    )
    return str(name or "").startswith(SCHEDULER_MODULE)
