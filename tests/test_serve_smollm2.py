"""`iterscope serve` on the embedded SmolLM2-135M: the official `openai` client gets the right
answers, streamed or not (greedy, so both must be the same text), accented characters whole,
and text cut at stop strings."""

from __future__ import annotations

import pytest
from test_serve import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("smollm2"), "--model", "smollm2",
                           "--max-model-len", "512", "--kv-cache-memory", "32MiB",
                           "--cpu-threads", "1", "--no-sidecar")
    yield server
    assert server.stop() == 0, server.log()


def test_chat_completion_answers_the_question(server):
    client = server.openai_client()
    response = client.chat.completions.create(model="smollm2", messages=QUESTION,
                                              max_tokens=12, temperature=0)
    answer = response.choices[0].message.content
    assert "Paris" in answer
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION,
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == answer


def test_completion_continues_the_text(server):
    client = server.openai_client()
    response = client.completions.create(model="smollm2", prompt="The capital of France is",
                                         max_tokens=4, temperature=0)
    assert "Paris" in response.choices[0].text
    assert response.usage.completion_tokens == 4 or response.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="smollm2", prompt="The capital of France is",
                                       max_tokens=4, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == response.choices[0].text


def test_accented_text_streams_whole_and_stops_at_a_multibyte_stop_string(server):
    client = server.openai_client()
    request = {"model": "smollm2", "prompt": "Le café est", "max_tokens": 20, "temperature": 0}
    text = client.completions.create(**request).choices[0].text
    accented = [char for char in text if ord(char) > 127]
    assert accented and "\ufffd" not in text, text  # SmolLM2 answers in French here
    pieces = [chunk.choices[0].text for chunk in client.completions.create(**request,
                                                                           stream=True)]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)

    stop = accented[0]  # two bytes, so possibly split across tokens
    response = client.completions.create(**request, stop=stop)
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**request, stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stop_string(server):
    client = server.openai_client()
    request = {"model": "smollm2", "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    answer = client.chat.completions.create(**request).choices[0].message.content
    response = client.chat.completions.create(**request, stop=["Paris"])
    assert response.choices[0].message.content == answer[: answer.index("Paris")]
    assert response.choices[0].finish_reason == "stop"
