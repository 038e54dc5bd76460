"""The real `vllm bench serve` (.vllm-venv) against a real `iterscope serve` on the tiny model,
with the bench's default backend (openai: /v1/completions) and openai-chat: every request
succeeds and gets the output length it asked for. The bench makes its random prompts with
the exported SmolLM2's tokenizer; `make test` builds .vllm-venv and .models/smollm2-hf."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench.vllm_server import MODEL_DIR, VLLM, vllm_cpu_preload
from engine.entrypoints.serve import TINY_MODEL
from tests.helpers.serve import tiny_server

pytestmark = pytest.mark.timeout(600)

NUM_PROMPTS = 4
OUTPUT_LEN = 8
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def bench_command(backend: str, base_url: str, result_dir: str) -> list[str]:
    return [
        str(VLLM),
        "bench",
        "serve",
        "--backend",
        backend,
        "--endpoint",
        BACKENDS[backend],
        "--base-url",
        base_url,
        "--model",
        TINY_MODEL,
        "--tokenizer",
        str(MODEL_DIR),
        "--dataset-name",
        "random",
        "--random-input-len",
        "32",
        "--random-output-len",
        str(OUTPUT_LEN),
        "--num-prompts",
        str(NUM_PROMPTS),
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        f"{backend}.json",
    ]


def test_vllm_bench_serve_succeeds_with_both_openai_backends(tmp_path):
    assert VLLM.exists() and (MODEL_DIR / "config.json").exists(), (
        f"{VLLM} or {MODEL_DIR} is missing: run `make vllm`"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    # tiny_server checks, once the server has stopped, that it exited with 0 and that no
    # traceback is in its output.
    with tiny_server(tmp_path) as server:
        # Both at once: most of each run is importing vLLM.
        runs = {
            backend: subprocess.Popen(
                bench_command(backend, server.base_url, str(tmp_path)),
                env=env,
                stdout=open(tmp_path / f"{backend}.log", "w"),
                stderr=subprocess.STDOUT,
            )
            for backend in BACKENDS
        }
        for backend, run in runs.items():
            assert run.wait(300) == 0, (tmp_path / f"{backend}.log").read_text()[-3000:]
    for backend in BACKENDS:
        result = json.loads((tmp_path / f"{backend}.json").read_text())
        log = (tmp_path / f"{backend}.log").read_text()[-3000:]
        assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), log
        # The random dataset sets ignore_eos: every request generates exactly OUTPUT_LEN.
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, log


def test_the_preload_vllm_is_compared_with_loads():
    """bench/serving_vs_vllm.py runs vLLM with the preload its CPU docs ask for (tcmalloc and
    Intel's OpenMP runtime; `make test` installs both): a process started with it maps both."""
    preload = vllm_cpu_preload()["LD_PRELOAD"]
    maps = subprocess.run(
        [str(VLLM.parent / "python"), "-c", "print(open('/proc/self/maps').read())"],
        env={**os.environ, "LD_PRELOAD": preload},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "libtcmalloc_minimal" in maps.stdout and "libiomp5" in maps.stdout, maps.stderr
