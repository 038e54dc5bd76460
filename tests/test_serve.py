"""`iterscope serve` as a user runs it: a subprocess with its engine process and sidecar.

The tiny random-weight model keeps it fast; "correct" means the text the official `openai`
client receives equals what the engine core produces in this process for the same prompt
(greedy). The sidecar records every telemetry message, so aborts, freed KV blocks and
traceparents are checked in the records themselves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from engine.config import EngineConfig
from engine.core import build_engine_core
from engine.request import Request, SamplingParams
from engine.serve import (
    TINY_MODEL,
    build_parser,
    engine_config,
    load_tiny_model,
    sidecar_arguments,
)
from telemetry.record import EVENT_FINISHED, IterationRecord, Message

REPO = Path(__file__).resolve().parents[1]
KV_CACHE_MEMORY = "4MiB"  # 512 blocks of 16 tokens for the tiny model
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class ServerProcess:
    """`iterscope serve --port 0` in a subprocess, with a sidecar recording to a JSONL file."""

    def __init__(self, tmp_path: Path, *extra_args: str, startup_timeout_s: float = 120) -> None:
        self.log_path = tmp_path / "serve.log"
        self.record_path = tmp_path / "recording.jsonl"
        command = [
            sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--metrics-port", "0",
            "--record", str(self.record_path), *extra_args,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=REPO)
        try:
            self.base_url = self._wait_for(r"on (http://\S+)/v1\n", startup_timeout_s)
            if "--no-sidecar" not in extra_args:
                self.metrics_url = self._wait_for(r"metrics on (http://\S+/metrics)", 10)
        except BaseException:
            self.stop()
            raise

    def _wait_for(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited ({self.process.returncode}):\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"no {pattern!r} in the server's output:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0)

    def records(self) -> list[IterationRecord]:
        decoder = msgspec.json.Decoder(Message)
        lines = self.record_path.read_bytes().splitlines() if self.record_path.exists() else []
        messages = [decoder.decode(line) for line in lines if line.strip()]
        return [message for message in messages if isinstance(message, IterationRecord)]

    def wait_for_records(self, predicate, timeout_s: float = 20) -> list[IterationRecord]:
        """Records once ``predicate(records)`` holds (the sidecar writes about every 0.1 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = self.records()
            if predicate(records):
                return records
            time.sleep(0.1)
        raise AssertionError(f"the recording never showed it; server output:\n{self.log()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def finish_milestones(records: list[IterationRecord], request_id: str) -> list:
    return [m for record in records for m in record.milestones
            if m.request_id == request_id and m.event & EVENT_FINISHED]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("serve"), "--model", TINY_MODEL,
                           "--kv-cache-memory", KV_CACHE_MEMORY, "--cpu-threads", "1")
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


@pytest.fixture(scope="module")
def reference():
    """Greedy text of the engine core run here, one request at a time (same model, same KV)."""
    config = EngineConfig(model=TINY_MODEL, kv_cache_memory_bytes=4 << 20)
    core, model = build_engine_core(config, load_model=load_tiny_model)
    cache: dict[tuple, tuple[str, int, str]] = {}

    def generate(prompt_ids: list[int], max_tokens: int) -> tuple[str, int, str]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            request_id = f"ref-{len(cache)}"
            core.add_request(Request(request_id, prompt_ids, SamplingParams(max_tokens, 0.0)))
            tokens, reason = [], None
            while core.has_work:
                for output in core.step():
                    tokens += output.new_token_ids
                    reason = output.finish_reason
            cache[key] = (model.tokenizer.decode(tokens), len(tokens), reason)
        return cache[key]

    generate.tokenizer = model.tokenizer
    return generate


def test_completions_with_the_openai_client(server, reference):
    client = server.openai_client()
    prompt = "The quick brown fox"
    text, num_tokens, reason = reference(reference.tokenizer.encode(prompt), 12)
    response = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=12,
                                         temperature=0)
    assert response.choices[0].text == text
    assert response.choices[0].finish_reason == reason
    assert response.usage.completion_tokens == num_tokens
    assert response.usage.prompt_tokens == len(prompt)  # bytes: one token per character

    stream = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == num_tokens


def test_token_id_prompt(server, reference):
    prompt_ids = [72, 105, 33, 300, 12]
    text, num_tokens, _ = reference(prompt_ids, 6)
    response = server.openai_client().completions.create(
        model=TINY_MODEL, prompt=prompt_ids, max_tokens=6, temperature=0)
    assert (response.choices[0].text, response.usage.completion_tokens) == (text, num_tokens)


def test_chat_completions_with_the_openai_client(server, reference):
    client = server.openai_client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    text, num_tokens, reason = reference(reference.tokenizer.apply_chat_template(messages), 10)
    response = client.chat.completions.create(model=TINY_MODEL, messages=messages,
                                              max_tokens=10, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == reason
    assert response.usage.completion_tokens == num_tokens

    stream = client.chat.completions.create(model=TINY_MODEL, messages=messages,
                                            max_completion_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_command_line_reaches_the_engine_config_and_the_sidecar():
    args = build_parser().parse_args([
        "--model", TINY_MODEL, "--kv-cache-memory", "2MiB", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64", "--no-prefix-caching", "--engine-index", "2",
        "--telemetry-curve-keys-dir", "/keys", "--telemetry-curve-engine-name", "gpu-host-1",
        "--metrics-port", "0", "--record", "run.jsonl", "--sidecar-arg=--log-iterations",
        "--telemetry-sndhwm", "100", "--telemetry-queue-capacity", "200", "--nvtx-markers",
    ])
    config = engine_config(args, "ipc:///tmp/x")
    assert (config.telemetry_sndhwm, config.telemetry_queue_capacity) == (100, 200)
    assert config.nvtx_markers
    assert (config.kv_cache_memory_bytes, config.max_num_seqs) == (2 << 20, 4)
    assert (config.max_num_batched_tokens, config.enable_prefix_caching) == (64, False)
    assert (config.engine_index, config.telemetry_address) == (2, "ipc:///tmp/x")
    assert config.telemetry_curve_keys_dir == "/keys"
    assert config.telemetry_curve_engine_name == "gpu-host-1"
    assert sidecar_arguments(args) == ["--log-iterations", "--metrics-port=0",
                                       "--record=run.jsonl"]


def test_models_and_health(server):
    models = server.openai_client().models.list()
    assert [model.id for model in models.data] == [TINY_MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        ({"prompt": "x" * 1020, "max_tokens": 10}, 400, "exceeds max_model_len"),
        ({"prompt": "hi", "max_tokens": 4000, "stream": True}, 400, "exceeds max_model_len"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "n": 2}, 400, "n=1"),
        ({"prompt": "hi", "stop": ["\n"]}, 400, "stop_token_ids"),
        ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
        ({"prompt": ""}, 400, "empty"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
        ({"prompt": "hi", "logit_bias": {"5": 100}}, 400, "logit_bias is not supported"),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server, payload, status, message
):
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] and error["code"] == status
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_json_and_bad_chat_messages(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages"):
        server.openai_client().chat.completions.create(model=TINY_MODEL, messages=[])


def test_client_disconnect_mid_stream_frees_the_kv_blocks(server):
    payload = {"prompt": "tell me everything", "max_tokens": 1000, "ignore_eos": True,
               "stream": True}
    with httpx.Client(timeout=30) as http, \
            http.stream("POST", f"{server.base_url}/v1/completions", json=payload) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = msgspec.json.decode(first[len("data: "):])["id"]
        for _ in range(5):
            next(lines)
    # The connection is closed here, long before 1,000 tokens.
    records = server.wait_for_records(lambda rs: finish_milestones(rs, request_id))
    milestone = finish_milestones(records, request_id)[-1]
    assert milestone.finish_reason == 2  # abort
    assert 0 < milestone.num_output_tokens < 1000
    finished_at = next(i for i, r in enumerate(records) if finish_milestones([r], request_id))
    assert records[finished_at].num_kv_blocks_used == 0  # nothing else runs now
    assert records[finished_at].num_running_reqs == 0


def test_client_disconnect_before_a_whole_response_aborts_it(server):
    payload = {"prompt": "a long answer please", "max_tokens": 1000, "ignore_eos": True}
    before = {m.request_id for r in server.records() for m in r.milestones}
    # The client gives up and closes the connection long before 1,000 tokens (which take
    # over 1 s here: an iteration of the tiny model costs more than 1 ms).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=0.25)

    def aborted(records):
        return [m for r in records for m in r.milestones
                if m.request_id not in before and m.event & EVENT_FINISHED]

    records = server.wait_for_records(aborted)
    milestone = aborted(records)[-1]
    assert milestone.finish_reason == 2 and milestone.num_output_tokens < 1000


def test_traceparent_reaches_the_engine_request(server):
    response = httpx.post(f"{server.base_url}/v1/completions",
                          json={"prompt": "trace me", "max_tokens": 2},
                          headers={"traceparent": TRACEPARENT}, timeout=30)
    request_id = response.json()["id"]
    records = server.wait_for_records(lambda rs: finish_milestones(rs, request_id))
    assert finish_milestones(records, request_id)[-1].traceparent == TRACEPARENT


def test_dead_engine_gets_503(server):
    """Runs last in this file: it kills the shared server's engine process."""
    engine_pid = int(httpx.get(f"{server.base_url}/health").json()["engine_pid"])
    os.kill(engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/health").status_code != 503:
        assert time.monotonic() < deadline, "health never turned 503"
        time.sleep(0.05)
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503
    assert "engine" in response.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        server.openai_client().chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "hi"}])
