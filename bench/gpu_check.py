"""The GPU path on a machine with one NVIDIA GPU: each step checked, timed and reported.

    bench/gpu_check.sh [--wheels DIR]        # sets up what is missing, then runs this
    python bench/gpu_check.py [--steps facts,tests,parity,throughput,decode,serve,nvtx]

Steps (each runs even when an earlier one failed; each reports ok or its error):
  facts       the GPU, driver, torch/Triton versions, the CPU; the card's copy bandwidth
              (torch device-to-device copy, bytes read + written per second)
  tests       the CUDA and Triton tests (tests/test_triton_paged.py runs its kernels compiled
              here, not interpreted) and the NVTX tests, with pytest
  parity      SmolLM2 greedy on the GPU (float32 and bfloat16, decode steps from CUDA graphs;
              float32 also eager) against the CPU in float32: tokens identical up to the
              first difference, per prompt
  throughput  bench/throughput.py on the GPU: our engine against transformers' generate
  decode      the decode step at batch 1, 16, 64 and 256, replayed from CUDA graphs and
              eager, against the bound the card's copy bandwidth sets for reading the weights
              and the KV cache once per step
  prefill     steps that carry prompts (eager: graphs cover decode-only steps) at a few
              shapes, with prompts attending through the batched-matmul path and through
              SDPA, and the operators that took the host's time in one of them
  mixed       the serve step's workload in process (closed loop, 64 at a time, 2048-token
              budget) with prompts through each attention path and set of SDPA backends
  serve       `iterscope serve --device cuda` with its sidecar under `iterscope bench` load:
              the 10 s log lines, /metrics, the recording and `iterscope explain` on it
  budgets     the serve step at --max-num-batched-tokens 2048 (the CUDA default) and 8192:
              whether fewer, larger iterations carrying prompts (each costs ~10 ms eager
              whatever its chunk) serve faster
  nvtx        the engine's and the sidecar's NVTX ranges under Nsight Systems (`nsys`), if
              installed; else said so

The last line is one JSON object: per step, ok and its figures or its error.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEPS = (
    "facts",
    "tests",
    "parity",
    "throughput",
    "decode",
    "prefill",
    "mixed",
    "serve",
    "budgets",
    "nvtx",
)
GPU_TESTS = (
    "tests/test_triton_paged.py",
    "tests/test_cuda_graphs.py",
    "tests/test_nvtx.py",
    "tests/test_kv_planning.py",
)
CLI = [sys.executable, "-m", "engine.entrypoints.cli"]


def copy_bandwidth_bytes_per_s(size_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy: bytes read plus bytes written per second (the best of 3 runs)."""
    import torch

    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best = max(best, 2 * size_bytes * repeats / (start.elapsed_time(end) / 1e3))
    return best


def step_facts(args: argparse.Namespace) -> dict:
    import torch
    import triton

    from bench.roofline import cpu_kind

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "gpu": props.name,
        "nvidia_smi": smi,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "cpu": cpu_kind()["cpu"],
        "cpu_count": os.cpu_count(),
        "copy_bandwidth_gb_per_s": round(copy_bandwidth_bytes_per_s() / 1e9, 1),
    }


def step_tests(args: argparse.Namespace) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *GPU_TESTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return {"ok": proc.returncode == 0, "summary": summary, **counts, "skipped_why": skipped}


def build_core(
    model,
    device: str,
    dtype: str,
    max_num_seqs: int,
    max_model_len: int,
    graphs: bool = True,
    max_num_batched_tokens: int = 8192,
):
    from engine.config import EngineConfig
    from engine.startup import build_engine_core

    config = EngineConfig(
        model="smollm2",
        dtype=dtype,
        device=device,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=8 << 30 if device == "cuda" else 1 << 30,
        cuda_graphs=graphs,
    )
    core, _ = build_engine_core(config, load_model=lambda *a: model)
    return core


def greedy(core, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    from engine.request import Request, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        tokens[f"p{i}"] = []
        core.add_request(Request(f"p{i}", ids, params))
    while core.has_work:
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before their first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def step_parity(args: argparse.Namespace) -> dict:
    import torch

    from bench.throughput import random_prompts
    from engine.model.loader import load_model

    prompts = random_prompts(8, 64, 49152, seed=1)
    tokenizer = load_model("smollm2", dtype="float32").tokenizer
    prompts[0] = tokenizer.encode("The capital of France is")
    runs = {}
    setups = [("cpu", "float32", False), ("cuda", "float32", True), ("cuda", "bfloat16", True)]
    for device, dtype, graphs in [*setups, ("cuda", "float32", False)]:
        model = load_model("smollm2", dtype=dtype, device=device)
        core = build_core(model, device, dtype, 8, 256, graphs)
        key = f"{device}_{dtype}" + ("_eager" if device == "cuda" and not graphs else "")
        runs[key] = greedy(core, prompts, max_tokens=32)
        runs[f"{key}_backend"] = model.decoder.attention.decode_backend
        del core, model
        torch.cuda.empty_cache()
    reference = runs["cpu_float32"]
    figures = {"prompt_0_text_cuda_bfloat16": tokenizer.decode(runs["cuda_bfloat16"]["p0"])}
    for key in ("cuda_float32", "cuda_bfloat16", "cuda_float32_eager"):
        figures[f"{key}_same_tokens"] = [
            same_prefix(reference[rid], runs[key][rid]) for rid in reference
        ]
        figures[f"{key}_decode_backend"] = runs[f"{key}_backend"]
    same = figures["cuda_float32_same_tokens"]  # float32 on both: near-ties may still differ
    figures["graphs_equal_eager"] = runs["cuda_float32"] == runs["cuda_float32_eager"]
    figures["ok"] = (
        sum(same) >= 0.75 * 32 * len(same)
        and figures["cuda_float32_decode_backend"] == "triton"
        and figures["graphs_equal_eager"]
    )
    return figures


def step_throughput(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "throughput.py"), "--device", "cuda"]
    cmd += ["--num-prompts", "256", "--max-num-seqs", "128", "--hf-batch-size", "64"]
    cmd += ["--max-num-batched-tokens", "8192"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    print(proc.stdout[-2000:], proc.stderr[-2000:] if proc.returncode else "", sep="\n")
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-1500:]}
    return {"ok": True, **json.loads(proc.stdout.strip().splitlines()[-1])}


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.itemsize


def time_decode_steps(
    model, batch: int, prompt_len: int, steps: int, graphs: bool
) -> tuple[float, int]:
    """(median seconds per decode-only step, context length at the middle step)."""
    import statistics

    import torch

    from engine.request import Request, SamplingParams

    core = build_core(model, "cuda", "bfloat16", batch, prompt_len + steps + 8, graphs)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i, ids in enumerate(random_ids(batch, prompt_len)):
        core.add_request(Request(f"d{i}", ids, params))
    started: set[str] = set()
    while len(started) < batch:  # prefill (and the first token) of every request
        started.update(out.request_id for out in core.step())
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    while core.has_work:
        core.step()
    return statistics.median(times), prompt_len + steps // 2


def random_ids(num: int, length: int) -> list[list[int]]:
    from bench.throughput import random_prompts

    return random_prompts(num, length, 49152, seed=7)


def step_decode(args: argparse.Namespace) -> dict:
    """A decode step reads at the least every weight once (the tied embedding once, as the
    output projection) and each sequence's whole KV cache: that many bytes at the card's copy
    bandwidth is the step's bound."""
    import torch

    from engine.model.loader import load_model

    bandwidth = copy_bandwidth_bytes_per_s()
    allocated = torch.cuda.memory_allocated()
    model = load_model("smollm2", dtype="bfloat16", device="cuda")
    weight_bytes = torch.cuda.memory_allocated() - allocated
    rows = []
    for batch in (1, 16, 64, 256):
        step_s, context = time_decode_steps(model, batch, 512, 32, graphs=True)
        eager_s, _ = time_decode_steps(model, batch, 512, 32, graphs=False)
        step_bytes = weight_bytes + kv_bytes_per_token(model) * context * batch
        bound_s = step_bytes / bandwidth
        rows.append(
            {
                "batch": batch,
                "step_ms": round(step_s * 1e3, 3),
                "eager_step_ms": round(eager_s * 1e3, 3),
                "bound_ms": round(bound_s * 1e3, 4),
                "share_of_bound": round(bound_s / step_s, 4),
                "eager_share_of_bound": round(bound_s / eager_s, 4),
                "tokens_per_s": round(batch / step_s, 1),
            }
        )
        print(f"decode batch {batch:3d}: {rows[-1]}")
    return {
        "ok": True,
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "rows": rows,
    }


PROMPT_NUMBERS = itertools.count()  # request ids unique across the cores of one run
PREFILL_SHAPES = ((1, 256, 0), (8, 256, 0), (1, 2048, 0), (2, 256, 64))  # prompts, len, decoding


def prefill_core(model, decoding: int):
    """An eager engine core on the GPU with ``decoding`` requests of 512-token prompts already
    decoding."""
    from engine.request import Request, SamplingParams

    core = build_core(model, "cuda", "bfloat16", 128, 4096, graphs=False)
    background = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i, ids in enumerate(random_ids(decoding, 512)):
        core.add_request(Request(f"bg{i}", ids, background))
    while core.scheduler.waiting:
        core.step()
    core.step()  # every background request decoding
    return core


def time_prefill_steps(core, prompts: int, length: int, repeats: int = 5) -> list[float]:
    """Seconds of each step that prefills ``prompts`` fresh prompts of ``length`` tokens (one
    output token each) beside the core's decoding requests; the first (warm-up) left out."""
    import torch

    from engine.request import Request, SamplingParams

    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):
        for ids in random_ids(prompts, length):
            core.add_request(Request(f"p{next(PROMPT_NUMBERS)}", ids, once))
        torch.cuda.synchronize()
        start = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def top_host_operators(model, prompts: int, length: int, rows: int = 20) -> list[dict]:
    """torch.profiler over two prefill steps (after a warm-up): the operators with the most
    host (self CPU) time, and how many times each ran."""
    from torch.profiler import ProfilerActivity, profile

    core = prefill_core(model, 0)
    time_prefill_steps(core, prompts, length, repeats=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_prefill_steps(core, prompts, length, repeats=1)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    return [
        {"op": e.key[:60], "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
        for e in events[:rows]
    ]


def step_prefill(args: argparse.Namespace) -> dict:
    """Steps that carry prompts run eager: the median step per shape and attention path."""
    import statistics

    from engine.model.loader import load_model

    model = load_model("smollm2", dtype="bfloat16", device="cuda")
    rows = []
    for prompts, length, decoding in PREFILL_SHAPES:
        row = {"prompts": prompts, "length": length, "decoding": decoding}
        for path in ("matmul", "sdpa_flash_or_math"):
            with prompt_path(model.decoder.attention, path):
                times = time_prefill_steps(prefill_core(model, decoding), prompts, length)
            row[f"{path}_ms"] = round(statistics.median(times) * 1e3, 2)
        rows.append(row)
        print(f"prefill step: {row}")
    return {
        "ok": True,
        "default_plain_prefill_max_len": model.decoder.attention.plain_prefill_max_len,
        "rows": rows,
        "top_host_operators_8x256": top_host_operators(model, 8, 256),
    }


def prompt_paths() -> dict[str, tuple[int, list | None]]:
    """Prompts' attention paths on CUDA: (plain_prefill_max_len, SDPA backends allowed)."""
    from torch.nn.attention import SDPBackend

    from engine.model.attention import CUDA_PROMPT_SDPA_BACKENDS

    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return {
        "matmul": (1 << 30, None),
        "sdpa_any_backend": (0, None),
        "sdpa_no_cudnn": (0, no_cudnn),
        "sdpa_flash_or_math": (0, CUDA_PROMPT_SDPA_BACKENDS),
    }


@contextlib.contextmanager
def prompt_path(attention, path: str) -> Iterator[None]:
    """Prompts through ``path`` (prompt_paths) inside the block, the engine's own after."""
    default = (attention.plain_prefill_max_len, attention.sdpa_backends)
    attention.plain_prefill_max_len, attention.sdpa_backends = prompt_paths()[path]
    try:
        yield
    finally:
        attention.plain_prefill_max_len, attention.sdpa_backends = default


def closed_loop(model, requests: int = 256, concurrency: int = 64) -> dict:
    """256-token prompts, 128 tokens out, ``concurrency`` at a time (a new one as each
    finishes), on a core set up as `serve` is: output tok/s and the step-time spread."""
    import statistics

    from engine.request import Request, SamplingParams

    core = build_core(model, "cuda", "bfloat16", 256, 1024, max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompts = iter(random_ids(requests, 256))
    for ids in itertools.islice(prompts, concurrency):
        core.add_request(Request(f"s{next(PROMPT_NUMBERS)}", ids, params))
    steps = []
    start = time.perf_counter()
    while core.has_work:
        step_start = time.perf_counter()
        outputs = core.step()
        steps.append(time.perf_counter() - step_start)
        for ids in itertools.islice(prompts, sum(out.finished for out in outputs)):
            core.add_request(Request(f"s{next(PROMPT_NUMBERS)}", ids, params))
    elapsed = time.perf_counter() - start
    quantiles = statistics.quantiles(steps, n=100)
    return {
        "output_tokens_per_s": round(requests * 128 / elapsed, 1),
        "step_ms_p50_p90_p99_max": [
            round(x * 1e3, 1) for x in (quantiles[49], quantiles[89], quantiles[98], max(steps))
        ],
        "steps_over_20ms": sum(step > 0.02 for step in steps),
    }


def step_mixed(args: argparse.Namespace) -> dict:
    """The serve step's workload in process per prompt path, two rounds alternating: the
    first pass meets each prompt shape for the first time."""
    from engine.model.loader import load_model

    model = load_model("smollm2", dtype="bfloat16", device="cuda")
    closed_loop(model, requests=64)  # warm-up: kernels compiled
    runs: dict[str, list[dict]] = {path: [] for path in prompt_paths()}
    for _ in range(2):
        for path, path_runs in runs.items():
            with prompt_path(model.decoder.attention, path):
                path_runs.append(closed_loop(model))
            print(f"mixed {path}: {path_runs[-1]}", flush=True)
    return {"ok": True, "runs": runs}


def http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def metric_value(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def step_serve(args: argparse.Namespace) -> dict:
    return serve_under_load(Path(args.out), "serve", num_prompts=256)


def step_budgets(args: argparse.Namespace) -> dict:
    """Two serves, each budget once, under the serve step's load: the figures `bench` gives
    (their logs and recordings in a temporary folder: what comes back from a lent machine is
    a few files)."""
    figures = {}
    out = Path(tempfile.mkdtemp(prefix="iterscope-budgets-"))
    for budget in (2048, 8192):
        served = serve_under_load(
            out, f"budget_{budget}", 256, (), "--max-num-batched-tokens", str(budget)
        )
        figures[str(budget)] = {
            key: served[key]
            for key in ("ok", "output_tokens_per_s", "mean_ttft_ms", "mean_tpot_ms")
        }
    figures["ok"] = all(run["ok"] for run in figures.values())
    return figures


def serve_under_load(
    out: Path, name: str, num_prompts: int, wrapper: list[str] = (), *serve_args: str
) -> dict:
    """`iterscope serve --device cuda` (under ``wrapper``, e.g. nsys) loaded by `iterscope
    bench`; its log lines, /metrics and `iterscope explain` on its recording. Under a wrapper
    the stop waits longer: nsys writes its report then."""
    record = out / f"{name}.jsonl"
    port = 18123
    serve_cmd = [*wrapper, *CLI, "serve", "--device", "cuda", "--port", str(port)]
    serve_cmd += ["--record", str(record), *serve_args]
    log_path = out / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            serve_cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=180)
            bench = subprocess.run(
                [
                    *CLI, "bench", "--base-url", f"http://127.0.0.1:{port}",
                    "--num-prompts", str(num_prompts), "--random-input-len", "256",
                    "--random-output-len", "128", "--max-concurrency", "64",
                    "--result-file", str(out / f"{name}_bench.json"), "--no-progress",
                ],
                cwd=REPO, capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            time.sleep(11)  # one more 10 s log line after the load
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                metrics = r.read().decode()
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=180 if wrapper else 60)
    log_text = log_path.read_text()
    explain = subprocess.run(
        [*CLI, "explain", str(record)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    result = json.loads((out / f"{name}_bench.json").read_text()) if bench.returncode == 0 else {}
    figures = {
        "bench_rc": bench.returncode,
        "bench_error": bench.stderr[-1000:] if bench.returncode else "",
        "output_tokens_per_s": result.get("output_throughput"),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "mean_tpot_ms": result.get("mean_tpot_ms"),
        "log_lines": len(re.findall(r"Avg prompt throughput", log_text)),
        "iterations_on_metrics": metric_value(metrics, "iterscope_iterations_total"),
        "explain_rc": explain.returncode,
        "explain_head": explain.stdout.splitlines()[:12],
    }
    print(log_text[-3000:])
    figures["ok"] = (
        bench.returncode == 0
        and explain.returncode == 0
        and figures["log_lines"] > 0
        and figures["iterations_on_metrics"] > 0
    )
    return figures


NSYS_PLACES = (  # Nsight Systems' own layouts, then the nsys Nsight Compute bundles
    "opt/nvidia/*/bin/nsys",
    "opt/nvidia/*/*/bin/nsys",
    "opt/nvidia/*/*/target-linux-x64/nsys",
    "opt/nvidia/*/*/host/target-linux-x64/nsys",
)


def find_nsys() -> str | None:
    """nsys on PATH, else one bundled with an Nsight install, where its install has the
    QdstrmImporter that turns a capture into a report: the lent H200s' Nsight Compute ships
    an nsys without one, which wrote a capture, made no report and had not exited a minute
    after the stop (2026-11-26), device time spent for nothing."""
    found = shutil.which("nsys")
    if found:
        return found
    for pattern in NSYS_PLACES:
        for path in sorted(Path("/").glob(pattern)):
            if next(path.parent.parent.glob("**/QdstrmImporter"), None) is not None:
                return str(path)
    return None


def step_nvtx(args: argparse.Namespace) -> dict:
    """The serve step again, shorter, under `nsys profile`: the engine's --nvtx-markers ranges
    and the sidecar's NvtxSink ranges (on when a tool is attached) next to the kernels."""
    nsys = find_nsys()
    if nsys is None:
        why = "none that makes reports: the NVTX ranges were checked by the tests step's "
        return {"ok": None, "nsys": why + "capture tool (tests/test_nvtx.py), not by nsys"}
    report = Path(args.out) / "serve_nvtx"
    wrapper = [nsys, "profile", "-t", "cuda,nvtx", "-o", str(report), "--force-overwrite=true"]
    served = serve_under_load(Path(args.out), "nvtx", 32, wrapper, "--nvtx-markers")
    reports = sorted(Path(args.out).glob("serve_nvtx*"))
    stats = subprocess.run(
        [nsys, "stats", "-r", "nvtx_sum", f"{report}.nsys-rep"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return {
        "ok": stats.returncode == 0 and "iteration" in stats.stdout.lower(),
        "nsys": nsys,
        "serve_ok": served["ok"],
        "reports": [p.name for p in reports],
        "nvtx_sum": stats.stdout[-2000:] or stats.stderr[-800:],
    }


def run_step(name: str, args: argparse.Namespace) -> dict:
    print(f"== {name}", flush=True)
    start = time.monotonic()
    try:
        figures = globals()[f"step_{name}"](args)
        figures.setdefault("ok", True)
    except Exception as error:  # noqa: BLE001 - every step reports, whatever broke
        traceback.print_exc()
        figures = {"ok": False, "error": f"{type(error).__name__}: {error}"[:1500]}
    figures["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps({name: figures}), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated, in order")
    parser.add_argument("--out", default="/tmp/iterscope-gpu-check")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    steps = [s for s in args.steps.split(",") if s]
    unknown = set(steps) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; steps: {', '.join(STEPS)}")
    results = {name: run_step(name, args) for name in steps}
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
