"""Fixtures shared by several test files.

Reading the embedded SmolLM2 GGUF costs seconds each time (most of it parsing the 49k-token
vocabulary), so what several files read from it is read once per session here. Each object
is only read by the tests that use it: no test mutates it, so sharing it cannot carry state
from one test into another.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded from its GGUF in float32 (engine.model.loader.load_model), as
    test_smollm2.py and test_hf_export.py compare it. Safe to share: the weights are only read
    (each ModelRunner or engine core built on it allocates its own KV cache)."""
    from engine.model.loader import load_model

    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer as `serve`'s frontend loads it (without the weights), for
    test_detokenizer.py and test_chat_special_tokens.py. Safe to share: encoding and decoding
    keep no state (its two cached properties are pure functions of the vocabulary)."""
    from engine.entrypoints.serve import load_tokenizer

    return load_tokenizer("smollm2")
