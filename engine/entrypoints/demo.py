"""`iterscope demo` (`make demo`): the whole product on the embedded default model, in ~2 min.

    iterscope serve (SmolLM2-135M on CPU, a deliberately small KV cache)
      + its sidecar: 10 s log lines here, live findings as they open and close (WARNING:
      why requests wait or slow down, and what to change), /metrics, a JSONL recording
    iterscope bench's load, concurrency ramping 1 -> 2 -> 4 -> 8 until the KV cache is full
      and requests wait for it
    then: the bench summary, `iterscope explain` on the recording (its finding 1 is one
      the sidecar reported live), and `iterscope timeline`'s Perfetto trace of the recording,
      written next to it (docs/timeline.md)

The server's and the sidecar's output is shown as it comes, prefixed with "| ".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from engine.entrypoints import arg_types, bench_backends, bench_load, bench_summary
from telemetry.sidecar.process import terminate

REPO = Path(__file__).resolve().parents[1]
SEND_SHARE = 0.8  # of --duration spent sending (ramp included); the rest lets requests finish


class ServerOutput:
    """Echoes the server's output with a prefix and remembers its URLs."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.base_url: str | None = None
        self.metrics_url: str | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._read, name="iterscope-demo-echo", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            print(f"| {line}", end="", flush=True)
            if match := re.search(r"metrics on (http://\S+/metrics)", line):
                self.metrics_url = match.group(1)
            if match := re.search(r" on (http://\S+)/v1$", line.rstrip()):
                self.base_url = match.group(1)
                self.ready.set()
        self.ready.set()  # the server exited


def start_server(
    args: argparse.Namespace, record_path: Path
) -> tuple[subprocess.Popen, ServerOutput]:
    command = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        "0",
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory",
        f"{args.kv_cache_memory}B",
        "--cpu-threads",
        str(args.cpu_threads),
        "--metrics-port",
        str(args.metrics_port),
        "--record",
        str(record_path),
        f"--sidecar-arg=--log-interval={args.log_interval}",
    ]
    if args.vllm_compatible_names:
        command.append("--vllm-compatible-names")
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return process, ServerOutput(process)


def stop_server(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM: the server shuts its engine down and the sidecar flushes the recording."""
    terminate(process, timeout_s)


class Ramp:
    """Concurrency as a step function of elapsed seconds; announces each new step."""

    def __init__(self, steps: list[int], step_time: float) -> None:
        self.steps = steps
        self.step_time = step_time
        self.announced = -1

    def __call__(self, elapsed_time: float) -> int:
        index = min(int(elapsed_time / self.step_time), len(self.steps) - 1)
        if index != self.announced:
            self.announced = index
            count = self.steps[index]
            print(
                f">>> load: up to {count} request{'s' if count != 1 else ''} at once "
                f"(t = {elapsed_time:.0f} s)",
                flush=True,
            )
        return self.steps[index]


QUESTION = "What is the capital of France?"


def show_one_answer(base_url: str, model: str) -> None:
    """One chat completion before the load, to show the model really answers."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    answer = response.json()["choices"][0]["message"]["content"].strip()
    print(f">>> chat: {QUESTION}\n>>> {model}: {answer}", flush=True)


async def drive_load(args: argparse.Namespace, base_url: str) -> dict:
    backend = bench_backends.HttpBackend(base_url)
    try:
        card = await backend.model_card()
        backend.model = card["id"]
        requests = bench_load.random_dataset(
            10_000, args.input_len, args.output_len, card["vocab_size"], seed=0, range_ratio=0.25
        )
        send_time = args.duration * SEND_SHARE
        ramp = Ramp(args.ramp, send_time / len(args.ramp))
        results, duration_time = await bench_load.run_benchmark(
            backend,
            requests,
            concurrency_at=ramp,
            progress=False,
            stop_sending_after=send_time,
        )
    finally:
        await backend.close()
    return bench_summary.summarize(results, duration_time)


EPISODE_HEADLINE = re.compile(r"^\s+\d+\. ")


def explain(record_path: Path) -> None:
    """`iterscope explain`'s summary, with its episodes cut to one headline each."""
    if importlib.util.find_spec("telemetry.analysis.explain") is None:
        return
    from telemetry.analysis import explain as explain_command

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        explain_command.main([str(record_path)])
    print(f"\n$ iterscope explain {record_path}   (episode details cut here)", flush=True)
    in_episodes = False
    for line in text.getvalue().splitlines():
        in_episodes = in_episodes or line.strip().startswith("Episodes")
        if not in_episodes or line.strip().startswith("Episodes") or EPISODE_HEADLINE.match(line):
            print(line)


def timeline(record_path: Path) -> None:
    """`iterscope timeline`: the recording as a Perfetto trace next to it, and how to open it."""
    from telemetry.analysis.timeline_command import (
        VIEWER_URL,
        TimelineError,
        convert,
        findings_text,
    )

    trace_path = record_path.with_suffix(".pftrace")
    try:
        counts, _ = convert([record_path], trace_path)
    except TimelineError as error:
        print(f"\n>>> no timeline: {error}", flush=True)
        return
    print(
        f"\n>>> timeline written to {trace_path} ({counts.num_iterations} iterations, "
        f"{counts.num_requests} requests, {findings_text(counts)}): open {VIEWER_URL} "
        "and drop the file on it (the browser reads it locally; nothing is uploaded)",
        flush=True,
    )


def parse_ramp(text: str) -> list[int]:
    try:
        steps = [int(step) for step in text.split(",") if step.strip()]
    except ValueError:
        steps = []
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(
            f"expected concurrency steps as whole numbers >= 1 separated by commas, e.g. "
            f"1,2,4,8, got {text!r}"
        )
    return steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterscope demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--duration",
        type=arg_types.positive_float,
        default=90.0,
        metavar="SECONDS",
        help="seconds of load after start-up (default %(default)s)",
    )
    parser.add_argument(
        "--ramp",
        type=parse_ramp,
        default=[1, 2, 4, 8],
        metavar="STEPS",
        help="concurrency steps, equally long (default 1,2,4,8)",
    )
    parser.add_argument(
        "--input-len",
        type=arg_types.int_in_range(1),
        default=96,
        metavar="N",
        help="mean prompt tokens (default %(default)s)",
    )
    parser.add_argument(
        "--output-len",
        type=arg_types.int_in_range(1),
        default=64,
        metavar="N",
        help="mean output tokens (default %(default)s)",
    )
    parser.add_argument(
        "--model", default="smollm2", help="the model to serve, as `serve`'s (default %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        type=arg_types.dtype,
        default="float32",
        help="the model's dtype (default %(default)s: the demo's answer and "
        "its cache sizes are the same on every CPU; auto picks bfloat16 where "
        "the CPU computes it natively, which doubles what the cache holds)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default="24MiB",
        metavar="SIZE",
        type=arg_types.memory_size,
        help="small on purpose: about 3 requests fit (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=arg_types.int_in_range(1),
        default=256,
        metavar="N",
        help="longest prompt + output (default %(default)s)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=arg_types.int_in_range(1),
        default=1,
        metavar="N",
        help="torch threads of the engine (default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=arg_types.port,
        default=9470,
        metavar="PORT",
        help="the sidecar's /metrics port, 0 picks a free one (default %(default)s)",
    )
    parser.add_argument(
        "--log-interval",
        type=arg_types.positive_float,
        default=10.0,
        metavar="SECONDS",
        help="seconds per sidecar log line (default %(default)s)",
    )
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="PATH",
        help="JSONL recording path (default: a new temporary directory)",
    )
    parser.add_argument(
        "--vllm-compatible-names",
        action="store_true",
        help="/metrics also has vLLM's series names (default off)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record_path = args.record or Path(tempfile.mkdtemp(prefix="iterscope-demo-")) / "demo.jsonl"
    print(
        f">>> starting iterscope serve on {args.model} with a sidecar; recording to {record_path}",
        flush=True,
    )
    process, output = start_server(args, record_path)
    try:
        output.ready.wait()
        if output.base_url is None:
            print(
                "iterscope demo: the server did not start (see its output above)", file=sys.stderr
            )
            return 1
        show_one_answer(output.base_url, args.model)
        print(
            f">>> server {output.base_url}/v1, metrics {output.metrics_url}; ramping the "
            f"load for {args.duration:.0f} s",
            flush=True,
        )
        metrics = asyncio.run(drive_load(args, output.base_url))
    except KeyboardInterrupt:
        return 130
    finally:
        stop_server(process)
        output.thread.join(timeout=5)
    print("\n" + bench_summary.format_summary(metrics), flush=True)
    explain(record_path)
    timeline(record_path)
    print(
        f"\n>>> recording kept at {record_path}: replay it with `iterscope sidecar --replay "
        f"{record_path}`, analyse it with `iterscope explain` or `iterscope tune`",
        flush=True,
    )
    return 0 if metrics["num_failed"] == 0 else 1
