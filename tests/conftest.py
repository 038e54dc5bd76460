"""Fixtures shared by several test files, and the `live` tier.

`live` (registered in pyproject.toml) marks the tests that start processes or load the real
SmolLM2 model; `make test-fast` runs the rest (`-m "not live"`). Each module marks its own
(`pytestmark = pytest.mark.live`, or per test). Two rules below make sure of the obvious
ones: a module named test_*_live.py is live as a whole (the vLLM ones, which start
`vllm serve`, included), and so is every test that uses the smollm2 or smollm2_tokenizer
fixture.

Reading the embedded SmolLM2 GGUF costs seconds each time (most of it parsing the 49k-token
vocabulary), and recording a real-engine story seconds too, so what several files read is
read or recorded once per session here. Each object
is only read by the tests that use it: no test mutates it, so sharing it cannot carry state
from one test into another.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REAL_MODEL_FIXTURES = {"smollm2", "smollm2_tokenizer"}


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).stem.endswith("_live") or REAL_MODEL_FIXTURES & set(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="session", autouse=True)
def slow_stacks_started_ahead(request, tmp_path_factory):
    """The slowest set-ups the selected tests use (`vllm serve` stacks, vLLM's real-scheduler
    checks) start now, in the background, while the fast tests run (tests/helpers/ahead.py);
    those no fixture took stop with the session."""
    from tests.helpers import ahead

    ahead.start_ahead(request.session.items, tmp_path_factory)
    yield
    ahead.stop_untaken()


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


@pytest.fixture(scope="session")
def real_story(tmp_path_factory):
    """``real_story(name)``: the recording of a real-engine story (tests/scenarios/real_engine.py
    SCENARIOS: the real engine core through a real sidecar, seconds each), made once per
    session: scenarios/test_real_stories.py checks what explain says of it,
    test_live_findings.py what a replayed sidecar finds in it. Safe to share: recordings are
    only read."""
    recordings: dict[str, Path] = {}

    def record(name: str) -> Path:
        if name not in recordings:
            from tests.scenarios import real_engine

            recordings[name] = real_engine.SCENARIOS[name](tmp_path_factory.mktemp(name))
        return recordings[name]

    return record


@pytest.fixture
def onednn_linears(monkeypatch):
    """Linear layers take oneDNN's packed (or widened) weights, not the CPU matmul kernel's
    panels, whatever this CPU's kind: not one measured (engine/model/kernels/cpu_matmul.py
    measured_kind), and not timed (engine/model/matmul_choice.py)."""
    from engine.model import matmul_choice
    from engine.model.kernels import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "measured_kind", lambda vendor, flags: False)
    monkeypatch.setattr(matmul_choice, "calibration", lambda dtype: None)
