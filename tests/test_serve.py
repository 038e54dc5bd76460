"""`iterscope serve` as a user runs it: a subprocess with its engine process and sidecar.

The tiny random-weight model keeps it fast; "correct" means the text the official `openai`
client receives equals what the engine core produces in this process for the same prompt
(greedy). The sidecar records every telemetry message, so aborts, freed KV blocks and
traceparents are checked in the records themselves.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys

import httpx
import msgspec
import openai
import pytest
from fastapi.testclient import TestClient

from engine.entrypoints.frontend import Frontend
from engine.entrypoints.routes import build_app
from engine.entrypoints.serve_args import (
    TINY_MODEL,
    build_parser,
    engine_config,
    resolve_model_argument,
    sidecar_arguments,
)
from engine.request import FinishReason, Request, SamplingParams
from telemetry.lane.record import EVENT_FINISHED
from tests.helpers.serve import (
    KV_CACHE_MEMORY,
    PLAIN_TEMPLATE,
    SCRIPTED_TEXT,
    HangingClient,
    ServerProcess,
    TemplateTokenizer,
    finish_milestones,
    scripted_app,
    tiny_engine_core,
    tiny_server,
)
from tests.helpers.wait import wait_until

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# The server and the reference engine core in float32 on every CPU, so that exact greedy text
# is compared where rounding is the same whatever the CPU: bfloat16 (what --dtype auto picks on
# a CPU with native bfloat16) rounds each result to 8 bits, and a near tie between two tokens
# may then go either way with a different batch shape or thread count.
DTYPE = "float32"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("serve"), dtype=DTYPE) as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    """Greedy text of the engine core run here, one request at a time (same model, same KV,
    same dtype)."""
    core, model = tiny_engine_core(dtype=DTYPE)
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


@pytest.mark.live
def test_completions_with_the_openai_client(server, reference):
    client = server.openai_client()
    prompt = "The quick brown fox"
    text, num_tokens, reason = reference(reference.tokenizer.encode(prompt), 12)
    response = client.completions.create(
        model=TINY_MODEL, prompt=prompt, max_tokens=12, temperature=0
    )
    assert response.choices[0].text == text
    assert response.choices[0].finish_reason == reason
    assert response.usage.completion_tokens == num_tokens
    assert response.usage.prompt_tokens == len(prompt)  # bytes: one token per character

    stream = client.completions.create(
        model=TINY_MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == num_tokens


@pytest.mark.live
def test_token_id_prompt(server, reference):
    prompt_ids = [72, 105, 33, 300, 12]
    text, num_tokens, _ = reference(prompt_ids, 6)
    response = server.openai_client().completions.create(
        model=TINY_MODEL, prompt=prompt_ids, max_tokens=6, temperature=0
    )
    assert (response.choices[0].text, response.usage.completion_tokens) == (text, num_tokens)


@pytest.mark.live
def test_chat_completions_with_the_openai_client(server, reference):
    client = server.openai_client()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    text, num_tokens, reason = reference(reference.tokenizer.apply_chat_template(messages), 10)
    response = client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == reason
    assert response.usage.completion_tokens == num_tokens

    stream = client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_command_line_reaches_the_engine_config_and_the_sidecar():
    args = build_parser().parse_args(
        [
            "--model",
            TINY_MODEL,
            "--kv-cache-memory",
            "2MiB",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--no-prefix-caching",
            "--engine-index",
            "2",
            "--telemetry-curve-keys-dir",
            "/keys",
            "--telemetry-curve-engine-name",
            "gpu-host-1",
            "--metrics-port",
            "0",
            "--record",
            "run.jsonl",
            "--sidecar-arg=--log-iterations",
            "--telemetry-sndhwm",
            "100",
            "--telemetry-queue-capacity",
            "200",
            "--nvtx-markers",
        ]
    )
    config = engine_config(args, "ipc:///tmp/x")
    assert (config.telemetry_sndhwm, config.telemetry_queue_capacity) == (100, 200)
    assert config.nvtx_markers
    assert (config.kv_cache_memory_bytes, config.max_num_seqs) == (2 << 20, 4)
    assert (config.max_num_batched_tokens, config.enable_prefix_caching) == (64, False)
    assert (config.engine_index, config.telemetry_address) == (2, "ipc:///tmp/x")
    assert config.telemetry_curve_keys_dir == "/keys"
    assert config.telemetry_curve_engine_name == "gpu-host-1"
    assert sidecar_arguments(args) == ["--log-iterations", "--metrics-port=0", "--record=run.jsonl"]


def test_the_model_as_first_argument_and_the_served_name_as_vllm_serve_takes_them(capsys):
    parser = build_parser()
    args = parser.parse_args(
        [TINY_MODEL, "--served-model-name", "my-llm", "--vllm-compatible-names"]
    )
    resolve_model_argument(parser, args)
    config = engine_config(args, None)
    assert (config.model, config.served_model_name) == (TINY_MODEL, "my-llm")
    assert sidecar_arguments(args) == ["--vllm-compatible-names"]
    args = parser.parse_args([TINY_MODEL, "--fpm-port", "20380"])
    assert sidecar_arguments(args) == ["--fpm-port=20380"]
    args = parser.parse_args([TINY_MODEL, "--model", TINY_MODEL])
    resolve_model_argument(parser, args)
    assert args.model == TINY_MODEL
    args = parser.parse_args([])
    resolve_model_argument(parser, args)
    assert args.model == "smollm2"
    with pytest.raises(SystemExit):
        resolve_model_argument(parser, parser.parse_args([TINY_MODEL, "--model", "other"]))
    assert "the model is given twice" in capsys.readouterr().err


@pytest.mark.live
def test_served_model_name_labels_the_telemetry_series(tmp_path):
    server = ServerProcess(
        tmp_path,
        TINY_MODEL,
        "--served-model-name",
        "my-llm",
        "--vllm-compatible-names",
        "--kv-cache-memory",
        KV_CACHE_MEMORY,
        "--cpu-threads",
        "1",
    )
    try:
        server.openai_client().completions.create(model="my-llm", prompt="hi", max_tokens=2)
        server.wait_for_records(lambda records: len(records) > 0)
        series = 'vllm:num_requests_running{engine="0",model_name="my-llm"}'
        page = [""]

        def labelled() -> bool:
            page[0] = httpx.get(server.metrics_url, timeout=5).text
            return series in page[0]

        wait_until(labelled, 20, lambda: f"{series} in /metrics:\n{page[0][-2000:]}", 0.2)
        assert 'model_name="tiny-llama"' not in page[0]
    finally:
        server.stop()


@pytest.mark.live
def test_models_and_health(server):
    models = server.openai_client().models.list()
    assert [model.id for model in models.data] == [TINY_MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.live
@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        ({"prompt": "x" * 1020, "max_tokens": 10}, 400, "exceeds max_model_len"),
        ({"prompt": "hi", "max_tokens": 4000, "stream": True}, 400, "exceeds max_model_len"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "n": 2, "temperature": 0}, 400, "n must be 1 when using greedy"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
        ({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
        ({"prompt": "hi", "min_tokens": 20}, 400, "min_tokens (20) must not exceed"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs must be in [0, 20]"),
        ({"prompt": "hi", "logprobs": -1}, 400, "logprobs must be in [0, 20]"),
        ({"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs is not supported"),
        (
            {"prompt": "hi", "max_completion_tokens": 5},
            400,
            "max_completion_tokens is not supported",
        ),  # a chat field, as in vLLM
        ({"prompt": "hi", "no_such_field": 1}, 400, "no_such_field is not supported"),
        (
            {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            400,
            "continuous_usage_stats is not supported",
        ),
        (
            {"prompt": "hi", "stream": True, "stream_options": {"no_such_option": True}},
            400,
            "no_such_option",
        ),
        ({"prompt": "hi", "stop": ""}, 400, "must not be empty"),
        ({"prompt": "hi", "stop": ["a", ""]}, 400, "must not be empty"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4 stop strings"),
        ({"prompt": "hi", "stop": ["a", 7]}, 400, "stop"),
        ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
        ({"prompt": ""}, 400, "empty"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
        ({"prompt": "hi", "logit_bias": {"5": 100}}, 400, "logit_bias is not supported"),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
        ({"prompt": "hi", "top_k": 10**20}, 400, "top_k"),  # was a plain-text 500
        (
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "stream_options is only allowed when stream is true",
        ),
        ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
        ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer"),
        ({"prompt": "hi", "stream": 1}, 400, "stream: Input should be a valid boolean"),
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
    ok = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=30,
        json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def stop_string_in(text: str, start: int) -> str:
    """Two characters of `text` from about `start` on that are not U+FFFD (the tiny model's
    random bytes decode to many)."""
    for index in range(start, len(text) - 1):
        if "\ufffd" not in text[index : index + 2]:
            return text[index : index + 2]
    raise AssertionError(f"no stop string candidate in {text!r}")


@pytest.mark.live
def test_stop_strings_end_the_request_and_abort_it_in_the_engine(server, reference):
    prompt = "The quick brown fox"
    text, _, _ = reference(reference.tokenizer.encode(prompt), 60)  # the first 60 tokens
    stop = stop_string_in(text, 10)
    expected = text[: text.find(stop)]
    client = server.openai_client()
    # Without the stop string, 1,000 tokens would be generated; the first 60 are `text`.
    common = {
        "model": TINY_MODEL,
        "prompt": prompt,
        "max_tokens": 1000,
        "temperature": 0,
        "stop": [stop, "never in this text \u2603"],
        "extra_body": {"ignore_eos": True},
    }
    response = client.completions.create(**common)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")
    assert response.usage.completion_tokens < 60
    chunks = list(client.completions.create(**common, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    for request_id in (response.id, chunks[0].id):  # aborted in the engine: KV blocks freed
        records = server.wait_for_records(lambda rs, i=request_id: finish_milestones(rs, i))
        milestone = finish_milestones(records, request_id)[-1]
        # Recorded as "stop" (what the client got), not as an abort.
        assert milestone.finish_reason == FinishReason.STOP
        assert milestone.num_output_tokens < 1000


@pytest.mark.live
def test_bad_json_and_bad_chat_messages(server):
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages"):
        server.openai_client().chat.completions.create(model=TINY_MODEL, messages=[])


@pytest.mark.live
def test_client_disconnect_mid_stream_frees_the_kv_blocks(server):
    payload = {
        "prompt": "tell me everything",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/completions", json=payload) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = msgspec.json.decode(first[len("data: ") :])["id"]
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


@pytest.mark.live
def test_client_disconnect_before_a_whole_response_aborts_it(server):
    payload = {"prompt": "a long answer please", "max_tokens": 1000, "ignore_eos": True}
    before = {m.request_id for r in server.records() for m in r.milestones}
    # The client goes away once the engine runs the request, not after a fixed time: the
    # tiny model decodes 1,000 tokens in about 0.26 s here (a step well under 1 ms), so a
    # client timeout of that order races the finish (it lost once on CI).
    url = httpx.URL(server.base_url)
    with socket.create_connection((url.host, url.port)) as client:
        client.sendall(http_post(url, "/v1/completions", payload))
        wait_until(lambda: requests_running(server) == 1, 20, "the engine to run the request")
        answered, _, _ = select.select([client], [], [], 0)
        assert not answered, "the whole response came before the client went away"

    def aborted(records):
        return [
            m
            for r in records
            for m in r.milestones
            if m.request_id not in before and m.event & EVENT_FINISHED
        ]

    records = server.wait_for_records(aborted)
    milestone = aborted(records)[-1]
    assert milestone.finish_reason == 2 and milestone.num_output_tokens < 1000


def http_post(url: httpx.URL, path: str, payload: dict) -> bytes:
    """The bytes of an HTTP/1.1 POST of ``payload`` as JSON, for a client on a raw socket."""
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def requests_running(server) -> float:
    """The sidecar's iterscope_requests_running, as served on /metrics."""
    page = httpx.get(server.metrics_url, timeout=5).text
    line = next(
        line for line in page.splitlines() if line.startswith("iterscope_requests_running{")
    )
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.live
def test_traceparent_reaches_the_engine_request(server):
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": "trace me", "max_tokens": 2},
        headers={"traceparent": TRACEPARENT},
        timeout=30,
    )
    request_id = response.json()["id"]
    records = server.wait_for_records(lambda rs: finish_milestones(rs, request_id))
    assert finish_milestones(records, request_id)[-1].traceparent == TRACEPARENT


@pytest.mark.live
def test_dead_engine_gets_503(server):
    """Runs last in this file: it kills the shared server's engine process."""
    engine_pid = int(httpx.get(f"{server.base_url}/health").json()["engine_pid"])
    os.kill(engine_pid, signal.SIGKILL)
    wait_until(
        lambda: httpx.get(f"{server.base_url}/health").status_code == 503, 10, "/health to turn 503"
    )
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503
    assert "engine" in response.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        server.openai_client().chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "hi"}]
        )


# The frontend in this process, over a scripted engine client ---------------------------------


def sse_bodies(response) -> list[dict]:
    datas = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(data) for data in datas[:-1]]


def test_stop_string_cuts_a_whole_response_and_aborts_the_engine_request():
    http, client = scripted_app()
    response = http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stop": ["STOP", "xyz"]}
    )
    body = response.json()
    assert body["choices"][0]["text"] == "Hello, wörld! 😀 "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("Hello, wörld! 😀 STOP".encode())
    assert client.aborted == [body["id"]]
    assert client.abort_reasons == [FinishReason.STOP]


def test_streamed_text_holds_back_what_could_start_a_stop_string():
    http, client = scripted_app()
    payload = {"prompt": "hi", "max_tokens": 100, "stop": "STOP", "stream": True}
    with http.stream("POST", "/v1/completions", json=payload) as response:
        chunks = sse_bodies(response)
    pieces = [chunk["choices"][0]["text"] for chunk in chunks]
    assert "".join(pieces) == "Hello, wörld! 😀 "
    assert not any(piece.endswith(("S", "ST", "STO")) for piece in pieces)  # never a part
    assert "ö" in pieces and "😀" in pieces  # multi-byte characters come out whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert client.aborted == [chunks[0]["id"]]


def test_chat_stop_string_streamed():
    http, client = scripted_app()
    payload = {"messages": [{"role": "user", "content": "hi"}], "stop": ["!"], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=payload) as response:
        chunks = sse_bodies(response)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hello, wörld"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(client.aborted) == 1


def test_without_a_stop_string_the_whole_text_and_no_abort():
    http, client = scripted_app()
    response = http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stop": ["never"]}
    )
    body = response.json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (
        SCRIPTED_TEXT,
        "length",
    )
    assert client.aborted == []


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}",
            "System role not supported",
        ),
        ("{{ messages[1]['content'] }}", "no element 1"),  # expects two messages
        ("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", "concatenate"),
        ("{{ messages[0]['tool_calls'][0] }}", "tool_calls"),  # a shape it assumes
    ],
)
def test_chat_template_errors_are_client_errors(template, message):
    http, client = scripted_app(template=template)
    messages = [{"role": "system", "content": "Be brief."}]
    response = http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "messages",
        400,
    )
    ok = scripted_app()[0].post("/v1/chat/completions", json={"messages": messages})
    assert ok.status_code == 200


@pytest.mark.parametrize("template", ["{% if %}", "{{ messages | no_such_filter }}"])
def test_a_chat_template_that_does_not_compile_is_a_server_error(template):
    http, _ = scripted_app(template=template)
    response = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 500
    assert "chat template does not compile" in response.json()["error"]["message"]


@pytest.mark.live
def test_the_frontend_reads_tokenizers_without_importing_torch():
    """The frontend never runs the model: loading its tokenizer must not cost torch's import
    (about 1.5 s and 180 MiB)."""
    script = (
        "import sys\n"
        "from engine.entrypoints.serve import TINY_MODEL, load_tokenizer\n"
        "for name in (TINY_MODEL, 'smollm2'):\n"
        "    assert load_tokenizer(name).encode('hi'), name\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "torch" not in result.stdout.strip().splitlines()[-1], result.stdout


def test_null_means_the_default_as_in_the_openai_api():
    http, _ = scripted_app("ok")
    response = http.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "n": None,
            "stream": None,
            "presence_penalty": None,
            "frequency_penalty": None,
            "stop_token_ids": None,
            "ignore_eos": None,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "ok"


def test_chat_message_fields_the_template_would_lose_are_refused():
    http, _ = scripted_app("ok")
    named = {"role": "user", "content": "hi", "name": "alice"}
    assert http.post("/v1/chat/completions", json={"messages": [named]}).status_code == 200
    tool_turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    response = http.post("/v1/chat/completions", json={"messages": [named, tool_turn]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "messages: tool_calls is not supported"


def test_unknown_paths_wrong_methods_and_internal_errors_get_openai_error_bodies(monkeypatch):
    http, client = scripted_app("ok")
    for method, path, status in (("GET", "/v1/nothing", 404), ("POST", "/health", 405)):
        response = http.request(method, path)
        assert response.status_code == status
        assert response.json()["error"]["code"] == status
    monkeypatch.setattr(client, "add_request", lambda *args, **kwargs: 1 / 0)
    http = TestClient(http.app, raise_server_exceptions=False)
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("internal error: ZeroDivisionError")


def test_a_stream_past_its_request_timeout_ends_with_an_error_event_and_an_abort():
    client = HangingClient([[ord("h")], [ord("i")]])
    frontend = Frontend(
        client, TemplateTokenizer(PLAIN_TEMPLATE), TINY_MODEL, request_timeout_s=0.3
    )
    http = TestClient(build_app(frontend))
    body = {"prompt": "hi", "max_tokens": 5, "stream": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    bodies = [
        json.loads(line[len("data: ") :])
        for line in response.iter_lines()
        if line.startswith("data: ")
    ]  # no [DONE]: the stream ends with the error
    assert bodies[0]["choices"][0]["text"] == "h"
    assert (
        bodies[-1]["error"]["code"] == 504 and "--request-timeout" in bodies[-1]["error"]["message"]
    )
    assert len(client.aborted) == 1


def test_a_body_that_is_not_json_is_said_so_with_the_parser_s_reason():
    """It read '1: JSON decode error'."""
    http, _ = scripted_app()
    response = http.post(
        "/v1/completions", content=b"{bad json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("the request body is not valid JSON: "), message
    assert "(at character 1)" in message
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert response.json()["error"]["message"].startswith("max_tokens: "), response.text
