"""Dynamo's own FPM recorders writing a small workload, for tests/test_fpm_taps*.py.

    DYN_FILE_KV=DIR DYN_FPM_TRACE=1 DYN_FPM_OUTPUT_PATH=OUT/trace.jsonl.gz DYN_FPM_MODE=full \\
        PYTHONPATH=.cache/fpm-wheels python tests/helpers/dynamo_fpm_recorder.py OUT/recv.jsonl

Runs in a process of its own with the ai-dynamo and ai-dynamo-runtime wheels (`make
fpm-wheels`) on its path: a DistributedRuntime with file discovery, Dynamo's
FpmDirectPublisher publishing WORKLOAD (the Rust side writes its dynamo.fpm.trace.v1 trace as
the DYN_FPM_* variables say, and heartbeats while idle), and Dynamo's own
recv_forward_pass_metrics receive loop writing its ``--output`` JSONL. Iteration i takes
``wall_time(i)`` by a linear cost, so `tune` has a known answer to find.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

BASE_S, PREFILL_TOKEN_S, DECODE_REQ_S = 0.004, 2e-5, 5e-4  # the workload's cost model
NUM_BUSY = 24  # iterations before and after an idle second


def iteration(i: int) -> dict[str, int | float]:
    """Iteration i's counts, FpmDirectPublisher.publish's keywords."""
    prefill_tokens = (i % 4) * 96
    decode_reqs = 1 + i % 6
    return {
        "scheduled_num_prefill_requests": 1 if prefill_tokens else 0,
        "scheduled_sum_prefill_tokens": prefill_tokens,
        "scheduled_sum_prefill_kv_tokens": 16 if prefill_tokens else 0,
        "scheduled_num_decode_requests": decode_reqs,
        "scheduled_sum_decode_kv_tokens": 300 * decode_reqs + i,
        "queued_num_prefill_requests": i % 3,
        "queued_sum_prefill_tokens": 200 * (i % 3),
        "queued_num_decode_requests": 0,
        "queued_sum_decode_kv_tokens": 0,
        "wall_time_secs": BASE_S + PREFILL_TOKEN_S * prefill_tokens + DECODE_REQ_S * decode_reqs,
    }


async def publish(publisher) -> None:
    for phase in range(2):
        for i in range(phase * NUM_BUSY, (phase + 1) * NUM_BUSY):
            publisher.publish(dp_rank=0, **iteration(i))
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.5)  # idle: the publisher heartbeats after a second


async def record(output: Path) -> None:
    from dynamo.common.recv_forward_pass_metrics import _run_recv
    from dynamo.llm import FpmDirectPublisher, FpmEventSubscriber
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("iterscope.worker.generate")
    subscriber = FpmEventSubscriber(endpoint)
    args = argparse.Namespace(output=output, flush_interval=0.2, save_plot=None, log_metrics=False)
    receiving = asyncio.create_task(_run_recv(subscriber, args))
    publisher = FpmDirectPublisher(endpoint, "dynamo-w0", dp_size=1)
    await asyncio.sleep(0.5)  # the subscriber finds the publisher through discovery
    await publish(publisher)
    publisher.shutdown()  # flushes the trace
    subscriber.shutdown()
    await asyncio.wait_for(receiving, 10)
    runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(record(Path(sys.argv[1])))
