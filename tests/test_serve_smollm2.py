"""`iterscope serve` on the embedded SmolLM2-135M: the official `openai` client gets the right
answers, streamed or not (greedy, so both must be the same text)."""

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
