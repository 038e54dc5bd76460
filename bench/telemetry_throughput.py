"""Engine throughput with telemetry and a sidecar on versus off, same run, alternating.

The real engine core on the embedded model (SmolLM2-135M), the same offline workload each
run (N prompts of random token ids, EOS ignored, greedy). "off" is the NullPublisher and no
sidecar; "on" is the engine's own publisher (engine/core_process.make_publisher, which on a
CPU sends every CPU_ENGINE_SEND_INTERVAL_S) to a sidecar subprocess with its default sinks
(log lines, /metrics on a free port) plus a JSONL recording. Runs alternate off, on, on, off, ... so
drift in machine load hits both sides alike; the figure is the ratio of the median output
tokens/s.

    .venv/bin/python bench/telemetry_throughput.py [--rounds 3 --num-prompts 16
        --input-len 64 --output-len 32 --max-num-seqs 16]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.core_process import make_publisher  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.startup import build_engine_core  # noqa: E402
from telemetry.sidecar.process import start_sidecar  # noqa: E402


def run_once(
    args: argparse.Namespace, model, prompts: list[list[int]], telemetry: bool, directory: str
) -> float:
    """Output tokens/s of one offline run."""
    sidecar = None
    if telemetry:
        sidecar = start_sidecar(
            ["--metrics-port", "0", "--record", f"{directory}/rec.jsonl"], stderr=subprocess.DEVNULL
        )
    config = EngineConfig(
        model="smollm2",
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len,
        enable_prefix_caching=False,
        telemetry_address=sidecar.address if sidecar else None,
    )
    core, _ = build_engine_core(config, load_model=lambda *a: model)
    core.publisher = make_publisher(config, core, "smollm2")  # as the engine process does
    if sidecar:
        time.sleep(0.2)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    try:
        start = time.perf_counter()
        for number, token_ids in enumerate(prompts):
            core.add_request(Request(f"bench-{number}", token_ids, params))
        num_output_tokens = 0
        while core.has_work:
            for output in core.step():
                num_output_tokens += len(output.new_token_ids)
        elapsed = time.perf_counter() - start
    finally:
        core.publisher.close()
        if sidecar is not None:
            sidecar.stop()
    return num_output_tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of (off, on) runs")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    model = load_model("smollm2", dtype=args.dtype)
    rng = random.Random(0)
    vocab_size = model.config.vocab_size
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as directory:
        run_once(args, model, prompts, False, directory)  # warm-up, not counted
        for round_number in range(args.rounds):
            order = ("off", "on") if round_number % 2 == 0 else ("on", "off")
            for mode in order:
                rate = run_once(args, model, prompts, mode == "on", directory)
                rates[mode].append(rate)
                print(f"round {round_number} telemetry {mode:>3}: {rate:.1f} output tokens/s")
    median_off = statistics.median(rates["off"])
    median_on = statistics.median(rates["on"])
    # Each round's two runs are back to back, so their ratio cancels the machine's drift.
    paired = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    figures = {
        "median_tokens_per_s_off": round(median_off, 1),
        "median_tokens_per_s_on": round(median_on, 1),
        "on_over_off": round(median_on / median_off, 4),
        "paired_on_over_off": [round(ratio, 4) for ratio in paired],
        "mean_paired_on_over_off": round(statistics.mean(paired), 4),
        "rates_off": [round(r, 1) for r in rates["off"]],
        "rates_on": [round(r, 1) for r in rates["on"]],
        "workload": f"{args.num_prompts}x({args.input_len} in, {args.output_len} out), "
        f"max_num_seqs {args.max_num_seqs}, {args.dtype}",
    }
    print(
        f"median: off {median_off:.1f}, on {median_on:.1f} output tokens/s, "
        f"on/off {figures['on_over_off']:.4f}; mean of the rounds' on/off "
        f"{figures['mean_paired_on_over_off']:.4f}"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
