"""Start and stop a real `vllm serve` (CPU build, .vllm-venv) on the exported SmolLM2, for the
benchmarks and the live tests. `make vllm` builds both the environment and the model."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".vllm-venv" / "bin" / "vllm"
MODEL_DIR = ROOT / ".models" / "smollm2-hf"
SERVED_MODEL_NAME = "smollm2"
# Both cores for the model, as vLLM's CPU backend is fastest here; no hub, no usage reports.
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def start_vllm(port: int, env: dict[str, str], log_path: Path,
               ready_timeout_s: float = 300.0) -> subprocess.Popen:
    """`vllm serve` on 127.0.0.1:port with iteration details on; returns once /health
    answers. ``env`` is added to this process's environment. Raises RuntimeError with the
    log's tail if vLLM exits or is not ready in time."""
    if not VLLM.exists() or not (MODEL_DIR / "config.json").exists():
        raise RuntimeError(f"{VLLM} or {MODEL_DIR} is missing: run `make vllm`")
    command = [str(VLLM), "serve", str(MODEL_DIR), "--served-model-name", SERVED_MODEL_NAME,
               "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
               "--enable-logging-iteration-details", "--host", "127.0.0.1",
               "--port", str(port)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env={**os.environ, **CPU_ENV, **env}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_vllm(server)
    raise RuntimeError(f"vllm serve not ready after {ready_timeout_s} s; see {log_path}")


def stop_vllm(server: subprocess.Popen) -> None:
    """SIGTERM to the whole process group (API server and engine core), SIGKILL after 30 s;
    a stopped (SIGSTOP) engine core is continued first so it can exit."""
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
