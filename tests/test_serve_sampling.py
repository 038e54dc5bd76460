"""`iterscope serve` with the sampling and request extensions vLLM's clients send: the bodies
of `vllm bench serve`'s two OpenAI backends, logprobs in both response shapes, n > 1, seeds,
penalties, min_tokens. The expectations come from the tiny model itself, run here: its logits
(log_softmax, greedy decoding by definition) and the engine core for seeded draws, which
depend only on the seed and the tokens so far."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import msgspec
import pytest

from engine.entrypoints.serve_args import TINY_MODEL
from engine.request import Request, SamplingParams
from tests.helpers.sampling_reference import (
    reference_greedy,
    reference_log_softmax,
    sequence_logits,
)
from tests.helpers.serve import finish_milestones, scripted_app, tiny_engine_core, tiny_server

PROMPT = "Sampling, as vLLM's clients ask for it:"
OUTPUT_LEN = 8


# The server and the reference engine core in float32 on every CPU: in bfloat16 (what --dtype
# auto picks on a CPU with native bfloat16) the engine's steps and the references' whole-
# sequence forward (sequence_logits) round differently, so greedy tokens and logprobs part
# ways after a few tokens.
DTYPE = "float32"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("serve"), dtype=DTYPE) as server:
        yield server


@pytest.fixture(scope="module")
def engine():
    """The engine core and model the server runs, in this process."""
    return tiny_engine_core(dtype=DTYPE)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        datas = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(data) for data in datas[:-1]]


def engine_tokens(core, params: SamplingParams, prompt_ids: list[int]) -> list[int]:
    request_id = f"ref-{core.iteration}"
    core.add_request(Request(request_id, prompt_ids, params))
    tokens = []
    while core.has_work:
        tokens += [t for output in core.step() for t in output.new_token_ids]
    return tokens


# The bodies `vllm bench serve` sends (vllm/benchmarks/lib/endpoint_request_func.py) ---------


def bench_completions_body(stream: bool, extra_body: dict) -> dict:
    """backend "openai" (the default): /v1/completions; a random dataset sets ignore_eos, and
    the --temperature / --top-p / ... flags and --extra-body are merged in last."""
    body = {
        "model": TINY_MODEL,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": OUTPUT_LEN,
        "logprobs": extra_body.pop("logprobs", None),
        "stream": stream,
        "ignore_eos": True,
        **extra_body,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def bench_chat_body(stream: bool, extra_body: dict) -> dict:
    """backend "openai-chat": /v1/chat/completions, the prompt as one text part."""
    body = {
        "model": TINY_MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": OUTPUT_LEN,
        "stream": stream,
        "ignore_eos": True,
        **extra_body,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


BENCH_SAMPLING_FLAGS = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "repetition_penalty": 1.1,
}


# What the bench adds: nothing, its sampling flags, or logprobs (--logprobs N for the
# completions backend, which the chat backend does not send: there --extra-body does).
EXTRA_BODIES = {
    "defaults": ({}, {}),
    "greedy": ({"temperature": 0.0}, {"temperature": 0.0}),
    "flags": (BENCH_SAMPLING_FLAGS, BENCH_SAMPLING_FLAGS),
    "logprobs": ({"logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
}


@pytest.mark.live
@pytest.mark.parametrize("extra", list(EXTRA_BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_bodies_get_200_and_exact_usage(server, engine, backend, stream, extra):
    tokenizer = engine[1].tokenizer
    extra_body = dict(EXTRA_BODIES[extra][backend == "openai-chat"])
    if backend == "openai":
        path, body = "/v1/completions", bench_completions_body(stream, extra_body)
        num_prompt_tokens = len(tokenizer.encode(PROMPT))
    else:
        path, body = "/v1/chat/completions", bench_chat_body(stream, extra_body)
        num_prompt_tokens = len(
            tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        )
    expected = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": OUTPUT_LEN,
        "total_tokens": num_prompt_tokens + OUTPUT_LEN,
    }
    if not stream:
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"] == expected
        return
    chunks = stream_chunks(server, path, body)
    # What the bench reads: text or delta content from chunks with choices, usage from the
    # last one, which has none.
    assert all(chunk["choices"] for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected


# Logprobs ------------------------------------------------------------------------------------


def reference_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[list[float]]:
    """log_softmax of the model's logits at each output position."""
    logits = sequence_logits(model, prompt_ids + tokens)
    return [
        reference_log_softmax(logits[len(prompt_ids) - 1 + i].tolist()) for i in range(len(tokens))
    ]


@pytest.mark.live
def test_completion_logprobs_are_the_models_log_softmax(server, engine):
    _, model = engine
    tokenizer = model.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    body = {
        "prompt": PROMPT,
        "max_tokens": OUTPUT_LEN,
        "temperature": 0,
        "logprobs": 3,
        "ignore_eos": True,
    }
    expected_tokens = reference_greedy(
        model, prompt_ids, SamplingParams(OUTPUT_LEN, 0.0, ignore_eos=True), ()
    )
    reference = reference_logprobs(model, prompt_ids, expected_tokens)
    logprobs = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    texts = [tokenizer.decode([token]) for token in expected_tokens]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == pytest.approx(
        [ref[token] for ref, token in zip(reference, expected_tokens, strict=True)], abs=1e-4
    )
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for top, ref in zip(logprobs["top_logprobs"], reference, strict=True):
        ranked = sorted(range(len(ref)), key=lambda t, ref=ref: -ref[t])[:3]
        expected_top = {tokenizer.decode([t]): ref[t] for t in ranked}
        assert set(expected_top) <= set(top) and len(top) <= 4  # the top 3 and the sampled one
        for text, value in top.items():  # texts of several tokens can coincide
            assert any(
                abs(ref[t] - value) < 1e-4 for t in range(len(ref)) if tokenizer.decode([t]) == text
            )
    chunks = stream_chunks(server, "/v1/completions", {**body, "stream": True})
    streamed = defaultdict(list)
    for chunk in chunks:
        for key, values in chunk["choices"][0]["logprobs"].items():
            streamed[key] += values
    assert dict(streamed) == logprobs


@pytest.mark.live
def test_chat_logprobs_are_the_models_log_softmax(server, engine):
    _, model = engine
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = model.tokenizer.apply_chat_template(messages)
    expected_tokens = reference_greedy(
        model, prompt_ids, SamplingParams(6, 0.0, ignore_eos=True), ()
    )
    reference = reference_logprobs(model, prompt_ids, expected_tokens)
    body = {
        "messages": messages,
        "max_completion_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    content = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(expected_tokens)
    for entry, token, ref in zip(content, expected_tokens, reference, strict=True):
        assert entry["token"] == model.tokenizer.decode([token])
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(ref[token], abs=1e-4)
        assert [top["logprob"] for top in entry["top_logprobs"]] == pytest.approx(
            sorted(ref, reverse=True)[:2], abs=1e-4
        )
    chunks = stream_chunks(server, "/v1/chat/completions", {**body, "stream": True})
    streamed = [
        entry
        for chunk in chunks
        if chunk["choices"] and chunk["choices"][0]["logprobs"]
        for entry in chunk["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    without = post(server, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0})
    assert without.json()["choices"][0]["logprobs"] is None


@pytest.mark.live
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs set to true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling"),
        ({"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens (9) must not exceed"),
    ],
)
def test_bad_chat_sampling_requests_name_the_field(server, body, message):
    response = post(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body}
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"]


# n > 1 and seeds -----------------------------------------------------------------------------


def choice_tokens(choice: dict) -> list[str]:
    return choice["logprobs"]["tokens"]


def assert_same_tokens(choice: dict, other: dict) -> None:
    """The same tokens: the byte tokenizer decodes many ids alike, their logprobs tell them
    apart."""
    assert choice_tokens(choice) == choice_tokens(other)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        other["logprobs"]["token_logprobs"], abs=1e-4
    )


def assert_choice_is(choice: dict, model, prompt_ids: list[int], tokens: list[int]) -> None:
    reference = reference_logprobs(model, prompt_ids, tokens)
    assert choice_tokens(choice) == [model.tokenizer.decode([t]) for t in tokens]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [ref[t] for ref, t in zip(reference, tokens, strict=True)], abs=1e-4
    )


def distinct(choices: list[dict]) -> bool:
    keys = [
        tuple(zip(choice_tokens(c), c["logprobs"]["token_logprobs"], strict=True)) for c in choices
    ]
    return len(set(keys)) == len(keys)


@pytest.mark.live
def test_n_choices_are_distinct_reproducible_and_seeded_as_vllm_does(server, engine):
    core, model = engine
    prompt_ids = model.tokenizer.encode(PROMPT)
    body = {
        "prompt": PROMPT,
        "max_tokens": OUTPUT_LEN,
        "temperature": 1.0,
        "seed": 7,
        "n": 3,
        "ignore_eos": True,
        "logprobs": 0,
    }
    response = post(server, "/v1/completions", body).json()
    choices = response["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2]
    assert distinct(choices)
    assert response["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 3 * OUTPUT_LEN,
        "total_tokens": len(prompt_ids) + 3 * OUTPUT_LEN,
    }
    # Choice i is what one request with seed 7 + i draws, as in vLLM.
    for index, choice in enumerate(choices):
        params = SamplingParams(OUTPUT_LEN, 1.0, seed=7 + index, ignore_eos=True)
        assert_choice_is(choice, model, prompt_ids, engine_tokens(core, params, prompt_ids))
    again = post(server, "/v1/completions", body).json()["choices"]
    for choice, replayed in zip(choices, again, strict=True):
        assert_same_tokens(choice, replayed)

    chunks = stream_chunks(
        server,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    texts, finish_reasons = defaultdict(str), {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finish_reasons[choice["index"]] = choice["finish_reason"]
    assert dict(texts) == {c["index"]: c["text"] for c in choices}
    assert finish_reasons == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * OUTPUT_LEN

    unseeded = post(server, "/v1/completions", {**body, "seed": None}).json()["choices"]
    assert distinct(unseeded)


@pytest.mark.live
def test_chat_n_choices_streamed(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "seed": 1,
    }
    chunks = stream_chunks(server, "/v1/chat/completions", body)
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    finished = sorted(
        c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length"
    )
    assert finished == [0, 1]
    whole = post(server, "/v1/chat/completions", {**body, "stream": False}).json()
    for choice in whole["choices"]:
        streamed = "".join(
            c["choices"][0]["delta"]["content"]
            for c in chunks
            if c["choices"][0]["index"] == choice["index"]
        )
        assert streamed == choice["message"]["content"]


@pytest.mark.live
def test_a_disconnect_aborts_every_choice(server):
    body = {
        "prompt": "tell me everything",
        "max_tokens": 1000,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = msgspec.json.decode(first[len("data: ") :])["id"]
        for _ in range(6):
            next(lines)
    for index in range(2):
        records = server.wait_for_records(
            lambda rs, i=index: finish_milestones(rs, f"{request_id}-{i}")
        )
        milestone = finish_milestones(records, f"{request_id}-{index}")[-1]
        assert milestone.finish_reason == 2 and milestone.num_output_tokens < 1000


@pytest.mark.live
def test_the_same_seed_gives_the_same_text_and_another_seed_another(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "logprobs": 0}
    choices = [
        post(server, "/v1/completions", {**body, "seed": seed}).json()["choices"][0]
        for seed in (5, 5, 6)
    ]
    assert_same_tokens(choices[0], choices[1])
    assert distinct([choices[0], choices[2]])


# Penalties, filters and min_tokens reach the engine ------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0, "repetition_penalty": 0.6},
        {"temperature": 0, "presence_penalty": -2.0, "frequency_penalty": 0.5},
        {"temperature": 0, "min_tokens": 4, "stop_token_ids": [124, 187, 200]},
    ],
)
def test_greedy_with_penalties_and_min_tokens_equals_its_definition(server, engine, fields):
    _, model = engine
    prompt_ids = [*model.tokenizer.encode("The penalty for repeating is"), 239, 128, 243, 47]
    body = {"prompt": prompt_ids, "max_tokens": 10, "logprobs": 0, **fields}
    params = SamplingParams(
        10, **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    )
    expected = reference_greedy(model, prompt_ids, params, tuple(model.config.eos_token_ids))
    assert_choice_is(
        post(server, "/v1/completions", body).json()["choices"][0], model, prompt_ids, expected
    )


@pytest.mark.live
def test_a_stop_token_ends_the_output_and_is_left_out_of_its_text(server, engine):
    _, model = engine
    prompt_ids = [*model.tokenizer.encode("The penalty for repeating is"), 239, 128, 243, 47]
    tokens = reference_greedy(model, prompt_ids, SamplingParams(3, 0.0), ())
    body = {
        "prompt": prompt_ids,
        "max_tokens": 10,
        "temperature": 0,
        "stop_token_ids": [tokens[2]],
        "logprobs": 0,
    }
    response = post(server, "/v1/completions", body).json()
    choice = response["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (model.tokenizer.decode(tokens[:2]), "stop")
    assert response["usage"]["completion_tokens"] == 3  # counted, and in the logprobs
    assert_choice_is(choice, model, prompt_ids, tokens)


@pytest.mark.live
def test_sampling_filters_reach_the_engine(server, engine):
    """Seeded draws depend only on the seed and the tokens so far: the server's equal the
    engine core's here for the same parameters, and differ once one of them changes."""
    core, model = engine
    prompt_ids = model.tokenizer.encode(PROMPT)
    fields = {
        "temperature": 1.3,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.02,
        "seed": 3,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    tokens = engine_tokens(core, SamplingParams(**fields), prompt_ids)
    served = post(server, "/v1/completions", {"prompt": PROMPT, "logprobs": 0, **fields})
    assert_choice_is(served.json()["choices"][0], model, prompt_ids, tokens)
    tighter = post(
        server, "/v1/completions", {"prompt": PROMPT, "logprobs": 0, **fields, "min_p": 0.3}
    )
    assert distinct([served.json()["choices"][0], tighter.json()["choices"][0]])


@pytest.mark.live
def test_chat_max_completion_tokens_wins_over_max_tokens(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "max_completion_tokens": 5,
        "ignore_eos": True,
    }
    assert post(server, "/v1/chat/completions", body).json()["usage"]["completion_tokens"] == 5
    del body["max_completion_tokens"]
    assert post(server, "/v1/chat/completions", body).json()["usage"]["completion_tokens"] == 3


def test_a_stop_string_must_end_after_the_first_min_tokens():
    """The scripted engine answers "Hello, ..." one byte per output."""
    http, _ = scripted_app()
    body = {"prompt": "hi", "max_tokens": 100, "stop": "l"}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == "He"
    # The first "l" is the third token: with min_tokens 3 only the second one can stop.
    late = http.post("/v1/completions", json={**body, "min_tokens": 3}).json()
    assert (late["choices"][0]["text"], late["choices"][0]["finish_reason"]) == ("Hel", "stop")


@pytest.mark.live
def test_the_openai_client_reads_choices_and_logprobs(server):
    client = server.openai_client()
    chat = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        n=2,
        seed=9,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [choice.index for choice in chat.choices] == [0, 1]
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert chat.usage.completion_tokens == 8
    completion = client.completions.create(
        model=TINY_MODEL,
        prompt="hi",
        max_tokens=4,
        logprobs=2,
        extra_body={"ignore_eos": True, "min_p": 0.1},
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 4
