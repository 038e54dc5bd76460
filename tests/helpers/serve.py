"""`iterscope serve` for tests: as a user runs it (a subprocess with its engine process and a
recording sidecar), the engine core it runs built in this process for reference outputs, and
the frontend over a scripted engine client (no engine at all)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import openai
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.core import RequestOutput
from engine.entrypoints.frontend import Frontend
from engine.entrypoints.routes import build_app
from engine.entrypoints.serve import load_tiny_model
from engine.entrypoints.serve_args import TINY_MODEL
from engine.model.chat_template import render_chat_template
from engine.model.tokenizer import ByteTokenizer
from engine.request import FinishReason
from engine.request_stream import RequestStream
from engine.startup import build_engine_core
from telemetry.lane.record import EVENT_FINISHED, IterationRecord
from telemetry.lane.recording import Line
from tests.helpers import REPO
from tests.helpers.processes import wait_for_log
from tests.helpers.wait import wait_until

KV_CACHE_MEMORY = "4MiB"  # 512 blocks of 16 tokens for the tiny model


class ServerProcess:
    """`iterscope serve --port 0` in a subprocess, with a sidecar recording to a JSONL file."""

    def __init__(self, tmp_path: Path, *extra_args: str, startup_timeout_s: float = 120) -> None:
        self.log_path = tmp_path / "serve.log"
        self.record_path = tmp_path / "recording.jsonl"
        sidecar = "--no-sidecar" not in extra_args  # else serve refuses the sidecar's flags
        command = [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "serve",
            "--port",
            "0",
            *(("--metrics-port", "0", "--record", str(self.record_path)) if sidecar else ()),
            *extra_args,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            self.base_url = self._wait_for(r"on (http://\S+)/v1\n", startup_timeout_s)
            if sidecar:
                self.metrics_url = self._wait_for(r"metrics on (http://\S+/metrics)", 10)
        except BaseException:
            self.stop()
            raise

    def _wait_for(self, pattern: str, timeout_s: float) -> str:
        return wait_for_log(self.log_path, pattern, self.process, timeout_s, 0.1).group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0)

    def records(self) -> list[IterationRecord]:
        decoder = msgspec.json.Decoder(Line)  # notes too: records kept
        data = self.record_path.read_bytes() if self.record_path.exists() else b""
        # whole lines only: the sidecar may be writing the last one as it is read
        lines = data[: data.rfind(b"\n") + 1].splitlines()
        messages = [decoder.decode(line) for line in lines if line.strip()]
        return [message for message in messages if isinstance(message, IterationRecord)]

    def wait_for_records(self, predicate, timeout_s: float = 20) -> list[IterationRecord]:
        """Records once ``predicate(records)`` holds (the sidecar writes about every 0.1 s)."""
        latest: list[list[IterationRecord]] = [[]]

        def holds() -> bool:
            latest[0] = self.records()
            return predicate(latest[0])

        self.wait_until(holds, timeout_s, "the recording to show it")
        return latest[0]

    def wait_until(self, condition, timeout_s: float, what: str):
        """tests.helpers.wait.wait_until, with the server's output in the failure."""
        return wait_until(
            condition, timeout_s, lambda: f"{what}; server output:\n{self.log()}", interval_s=0.1
        )

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
    return [
        m
        for record in records
        for m in record.milestones
        if m.request_id == request_id and m.event & EVENT_FINISHED
    ]


@contextlib.contextmanager
def tiny_server(
    directory: Path, *extra_args: str, dtype: str | None = None
) -> Iterator[ServerProcess]:
    """`serve` on the tiny model with a recording sidecar; it must stop cleanly, with no
    traceback in its output. ``dtype`` is passed as --dtype (None: serve's default, auto);
    tests comparing outputs with a reference computed here pin "float32" on both sides."""
    dtype_args = ("--dtype", dtype) if dtype is not None else ()
    server = ServerProcess(
        directory,
        "--model",
        TINY_MODEL,
        "--kv-cache-memory",
        KV_CACHE_MEMORY,
        "--cpu-threads",
        "1",
        *dtype_args,
        *extra_args,
    )
    try:
        yield server
    finally:
        status = server.stop()
    assert status == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


def tiny_engine_core(dtype: str = "auto"):
    """(core, model): the engine core a tiny_server runs (same model, same KV memory), built
    in this process for reference outputs. ``dtype`` as --dtype (auto, as `serve`'s default,
    is bfloat16 on a CPU with native bfloat16 and float32 elsewhere)."""
    config = EngineConfig(model=TINY_MODEL, kv_cache_memory_bytes=4 << 20, dtype=dtype)
    return build_engine_core(config, load_model=load_tiny_model)


# The frontend in this process, over a scripted engine client ---------------------------------


class ScriptedClient:
    """The part of EngineCoreClient the frontend uses; every request gets the same outputs,
    one per entry of `steps`, the last finished with "length". Aborts are recorded."""

    def __init__(self, steps: list[list[int]]) -> None:
        self.steps = steps
        self.ready = SimpleNamespace(max_model_len=1024, pid=os.getpid())
        self.is_alive = True
        self.aborted: list[str] = []
        self.abort_reasons: list[FinishReason] = []

    def add_request(self, prompt_ids, params, request_id, traceparent) -> RequestStream:
        stream = RequestStream(request_id)
        for index, token_ids in enumerate(self.steps):
            finished = index == len(self.steps) - 1
            stream.put(
                RequestOutput(request_id, token_ids, finished, "length" if finished else None)
            )
        return stream

    def abort(self, request_id: str, finish_reason: FinishReason = FinishReason.ABORT) -> None:
        self.aborted.append(request_id)
        self.abort_reasons.append(finish_reason)


class HangingClient(ScriptedClient):
    """Sends the first output of every request, then nothing more."""

    def add_request(self, prompt_ids, params, request_id, traceparent) -> RequestStream:
        stream = RequestStream(request_id)
        stream.put(RequestOutput(request_id, self.steps[0], False, None))
        return stream


class TemplateTokenizer(ByteTokenizer):
    """Bytes, with a real Jinja chat template rendered by the engine's renderer."""

    def __init__(self, chat_template: str) -> None:
        super().__init__(320)
        self.chat_template = chat_template

    def apply_chat_template(self, messages):
        return self.encode(render_chat_template(self.chat_template, messages))


PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
SCRIPTED_TEXT = "Hello, wörld! 😀 STOP and more"


def scripted_app(text: str = SCRIPTED_TEXT, template: str = PLAIN_TEMPLATE):
    """(TestClient, ScriptedClient): the engine answers `text`, one byte per output."""
    client = ScriptedClient([[byte] for byte in text.encode()])
    frontend = Frontend(client, TemplateTokenizer(template), TINY_MODEL)
    return TestClient(build_app(frontend)), client
