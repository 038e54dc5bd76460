"""Engine-core bookkeeping per iteration (schedule + update + record + publish), without a
model: a runner that returns a fixed token, so only the core's own cost is measured.

Side by side in one run, for decode batches of several sizes: telemetry off (NullPublisher)
versus on (ZmqPublisher over ipc to a PULL socket that another process drains, as the
sidecar would), so the ratio is the cost the telemetry lane adds to the loop. Noisy on a
shared 2-core machine: compare the ratios of one run.

    .venv/bin/python bench/engine_core_overhead.py
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.kv_planning import KvPlan  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from telemetry.lane.publisher import NullPublisher, ZmqPublisher  # noqa: E402

BATCH_SIZES = (1, 32, 256)
NUM_ITERATIONS = 2000
BLOCK_SIZE = 16


class ConstantRunner:
    def execute(self, scheduled):
        return [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in scheduled]


def make_core(batch_size: int, publisher) -> EngineCore:
    num_blocks = batch_size * (NUM_ITERATIONS // BLOCK_SIZE + 4)
    max_model_len = NUM_ITERATIONS + 64
    config = EngineConfig(
        max_num_seqs=batch_size,
        max_num_batched_tokens=max(2048, batch_size * 32),
        max_model_len=max_model_len,
    )
    plan = KvPlan(1, BLOCK_SIZE, num_blocks * BLOCK_SIZE, num_blocks, max_model_len)
    core = EngineCore(config, ConstantRunner(), plan, (), publisher)
    params = SamplingParams(max_tokens=NUM_ITERATIONS + 32, temperature=0, ignore_eos=True)
    for index in range(batch_size):
        core.add_request(Request(f"r{index}", [index + 1] * 24, params))
    core.step()  # the prefill; every later iteration is a decode of the whole batch
    return core


def time_steps(core: EngineCore) -> float:
    """Mean microseconds per iteration."""
    start = time.perf_counter_ns()
    for _ in range(NUM_ITERATIONS):
        core.step()
    return (time.perf_counter_ns() - start) / NUM_ITERATIONS / 1000


def drain(address: str, ready) -> None:
    """The stand-in sidecar: receive and discard until terminated."""
    socket = zmq.Context().socket(zmq.PULL)
    socket.bind(address)
    ready.set()
    while True:
        socket.recv()


def main() -> None:
    context = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp(prefix='iterscope-bench-')}/telemetry"
    ready = multiprocessing.Event()
    sidecar = multiprocessing.Process(target=drain, args=(address, ready), daemon=True)
    sidecar.start()
    ready.wait(10)
    results = {}
    print(f"{'decode batch':>12} {'telemetry off us':>17} {'telemetry on us':>16} {'ratio':>6}")
    for batch_size in BATCH_SIZES:
        off_us = time_steps(make_core(batch_size, NullPublisher()))
        publisher = ZmqPublisher(address, engine_index=0, context=context)
        on_us = time_steps(make_core(batch_size, publisher))
        publisher.close()
        print(f"{batch_size:>12} {off_us:>17.1f} {on_us:>16.1f} {on_us / off_us:>6.2f}")
        results[f"batch_{batch_size}"] = {
            "telemetry_off_us": round(off_us, 1),
            "telemetry_on_us": round(on_us, 1),
            "ratio": round(on_us / off_us, 3),
            "dropped": publisher.num_dropped_total,
        }
    sidecar.terminate()
    sidecar.join()
    context.term()
    print(json.dumps({"engine_core_overhead_per_iteration": results}))


if __name__ == "__main__":
    main()
