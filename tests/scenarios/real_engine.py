"""Run the real engine core at small scale and record it through the real sidecar.

The engine core (engine.core.EngineCore with the real scheduler, block pool and model runner
on a tiny random-weight Llama) runs in this process, driven by a list of arrivals; it
publishes through the real ZmqPublisher to an `iterscope sidecar --record FILE` subprocess, so
the recording is exactly what a user would get. Faults are injected from outside the engine
(tests/helpers/faults.py): a runner that hangs in one forward pass, a scheduler that leaks
blocks.

    recording = run_scenario(tmp_path, arrivals, max_num_seqs=8, num_kv_blocks=64)

Also runnable as a script to write a recording for the docs:

    python tests/scenarios/real_engine.py story1 out.jsonl
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.startup import build_engine_core  # noqa: E402
from telemetry.lane.publisher import ZmqPublisher  # noqa: E402
from telemetry.sidecar.process import start_sidecar  # noqa: E402
from tests.helpers.faults import leak_blocks_per_finish, slowed, stalling  # noqa: E402

# K and V x 2 layers x 2 KV heads x 16 x fp32: the scenarios run in float32 whatever the CPU
# (--dtype auto picks bfloat16 where the CPU has it, which would double every KV size here)
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Arrival:
    at_s: float
    num_prompt_tokens: int
    max_tokens: int


def load_tiny_model(name: str, dtype: str, device: str):
    from engine.model.loader import build_tiny_model

    return build_tiny_model("llama", seed=0, dtype=dtype, device=device)


def bursty(
    rate_per_s: float, duration_s: float, num_prompt: int, max_tokens: int, seed: int = 0
) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return arrivals
        arrivals.append(Arrival(t, num_prompt, max_tokens))


def run_scenario(
    out_dir: Path,
    arrivals: list[Arrival],
    *,
    num_kv_blocks: int = 256,
    tail_s: float = 1.5,
    deadline_s: float = 60.0,
    leak_blocks: int = 0,
    stall_at_call: int = 0,
    stall_s: float = 0.0,
    slow_s: float = 0.0,
    metrics_port: int = 0,
    **config: object,
) -> Path:
    """Run the arrivals to completion (then ``tail_s`` idle); return the recording's path.

    ``leak_blocks``: every finished request keeps that many blocks; ``stall_at_call``: that
    forward pass first sleeps ``stall_s`` (0 = no fault); ``slow_s``: every forward pass
    takes that much longer (a slow device, healthy); ``metrics_port``: the sidecar serves
    /metrics and /findings there (0: it serves nothing)."""
    recording = out_dir / "recording.jsonl"
    sidecar_log = open(out_dir / "sidecar.log", "wb")  # noqa: SIM115 - closed below
    sidecar = start_sidecar(
        [
            "--record",
            str(recording),
            *(["--metrics-port", str(metrics_port)] if metrics_port else ["--no-metrics"]),
            "--log-interval",
            "2",
        ],
        stdout=sidecar_log,
        stderr=sidecar_log,
    )
    publisher = None
    num_threads = torch.get_num_threads()
    try:
        engine_config = EngineConfig(
            model="tiny-llama",
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=num_kv_blocks * BLOCK_SIZE * TINY_KV_BYTES_PER_TOKEN,
            max_model_len=1024,
            **{"dtype": "float32", **config},
        )
        torch.set_num_threads(1)  # 2 shared cores: threads only fight over them
        runner_class = stalling(ModelRunner, stall_at_call, stall_s) if stall_at_call else None
        if slow_s:
            runner_class = slowed(ModelRunner, slow_s)
        core, _ = build_engine_core(
            engine_config, load_model=load_tiny_model, runner_class=runner_class
        )
        if leak_blocks:
            leak_blocks_per_finish(core, leak_blocks)
        publisher = ZmqPublisher(
            sidecar.address, engine_config.engine_index, facts=core.facts("tiny-llama")
        )
        core.publisher = publisher
        time.sleep(0.3)  # the lane connects (ZMQ_IMMEDIATE drops until it does)
        drive(core, arrivals, deadline_s)
        time.sleep(tail_s)
    finally:
        torch.set_num_threads(num_threads)
        if publisher is not None:
            publisher.close()
        time.sleep(0.3)  # the sidecar writes what it received at its next tick
        sidecar.stop()
        sidecar_log.close()
    return recording


def drive(core, arrivals: list[Arrival], deadline_s: float) -> None:
    """Submit each arrival at its time and step while there is work, like the engine loop."""
    pending = sorted(arrivals, key=lambda a: a.at_s)
    rng = random.Random(1)
    t0 = time.monotonic()
    while pending or core.has_work:
        now_s = time.monotonic() - t0
        if now_s > deadline_s:
            raise TimeoutError(f"scenario still running after {deadline_s} s")
        while pending and pending[0].at_s <= now_s:
            arrival = pending.pop(0)
            prompt = [rng.randrange(3, 250) for _ in range(arrival.num_prompt_tokens)]
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0, ignore_eos=True)
            core.add_request(Request(f"r{len(core.requests)}-{now_s:.3f}", prompt, params))
        if core.has_work:
            core.step()
        elif pending:
            time.sleep(min(0.01, max(0.0, pending[0].at_s - now_s)))


# --------------------------------------------------------------------------------------------
# The stories on the real engine


def story1_kv_cliff(out_dir: Path) -> Path:
    """Two long requests that fit at the start but not at their peak: the newest is evicted."""
    arrivals = [Arrival(0.0, 500, 60), Arrival(0.0, 500, 60), Arrival(0.5, 500, 60)]
    return run_scenario(
        out_dir,
        arrivals,
        num_kv_blocks=66,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )


def story2_leak(out_dir: Path) -> Path:
    """Every finished request keeps 2 blocks: usage climbs while few requests run."""
    return run_scenario(out_dir, bursty(20, 4.0, 48, 16), num_kv_blocks=256, leak_blocks=2)


def stalled(out_dir: Path, **options: object) -> Path:
    """The loop sleeps 6 s inside one iteration while requests wait (heartbeats go on): past
    the 5 s floor of the stall threshold the live sidecar and `explain` share."""
    return run_scenario(out_dir, bursty(20, 3.0, 32, 64), stall_at_call=40, stall_s=6.0, **options)


def healthy_but_slow(out_dir: Path) -> Path:
    """Every forward pass takes 2.5 s more: a healthy engine on a slow device (iterations of
    seconds, as vLLM's CPU build prefilling long prompts); nothing waits."""
    arrivals = [Arrival(0.0, 32, 2), Arrival(0.0, 32, 2), Arrival(5.5, 32, 2)]
    return run_scenario(out_dir, arrivals, slow_s=2.5, tail_s=2.5)


def story3_bursty(out_dir: Path, max_num_seqs: int, **options: object) -> Path:
    """6 requests at the start of each second for 3 s: batched with room to spare (this is
    also the healthy run), queued when max_num_seqs is 2. Each forward pass takes 15 ms more,
    a GPU's pace: the tiny model alone takes well under a millisecond, and queued requests
    would wait too briefly for a waiting episode (1 s)."""
    arrivals = [Arrival(second, 64, 30) for second in range(3) for _ in range(6)]
    return run_scenario(out_dir, arrivals, max_num_seqs=max_num_seqs, slow_s=0.015, **options)


def story4_sweep(out_dir: Path) -> Path:
    """Bursts of growing size and prompt length, so `tune` sees iterations of many shapes."""
    arrivals = [Arrival(0.6 * k, 48 * (k + 1), 24) for k in range(8) for _ in range(3 * k + 1)]
    return run_scenario(out_dir, arrivals, max_num_batched_tokens=1024)


SCENARIOS = {
    "story4": story4_sweep,
    "story1": story1_kv_cliff,
    "story2": story2_leak,
    "stall": stalled,
    "story3-batched": lambda out_dir: story3_bursty(out_dir, 32),
    "story3-queued": lambda out_dir: story3_bursty(out_dir, 2),
    "healthy-but-slow": healthy_but_slow,
}


if __name__ == "__main__":
    name, out = sys.argv[1], Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    work_dir = out.parent / f".{out.name}.d"
    work_dir.mkdir(exist_ok=True)
    SCENARIOS[name](work_dir).replace(out)
    (work_dir / "sidecar.log").replace(out.with_suffix(".sidecar.log"))
    work_dir.rmdir()
