"""Sampling parameters through the engine core on the tiny model, batched together, against
references computed from the model's own logits (tests/helpers/sampling_reference.py):
penalties and min_tokens change what greedy decoding picks exactly as defined, logprobs are
log_softmax of the raw logits, and seeds replay."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.request import Request, SamplingParams
from tests.helpers.sampling_reference import (
    reference_greedy,
    reference_log_softmax,
    sequence_logits,
)
from tests.helpers.serve import tiny_engine_core

PROMPT = [*b"The penalty for repeating is", 239, 128, 243, 47]


@pytest.fixture(scope="module")
def engine():
    # float32 on every CPU: in bfloat16 (what auto picks on a CPU with native bfloat16) the
    # engine's steps and the reference's whole-sequence forward round differently, and greedy
    # tokens and logprobs part ways after a few tokens.
    return tiny_engine_core(dtype="float32")


def run(core, params: list[SamplingParams], prompt: list[int] = PROMPT) -> list[list]:
    """The outputs of one request per params, all in the same batches."""
    outputs = defaultdict(list)
    for index, sp in enumerate(params):
        core.add_request(Request(f"r{index}-{id(sp)}", list(prompt), sp))
    names = [f"r{index}-{id(sp)}" for index, sp in enumerate(params)]
    while core.has_work:
        for output in core.step():
            outputs[output.request_id].append(output)
    return [outputs[name] for name in names]


def tokens_of(outputs: list) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def test_penalties_and_min_tokens_pick_what_their_definition_picks(engine):
    core, model = engine
    eos = tuple(model.config.eos_token_ids)
    plain = SamplingParams(max_tokens=10, temperature=0)
    (plain_outputs,) = run(core, [plain])
    first, second = tokens_of(plain_outputs)[:2]
    params = [
        plain,
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.8),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=0.6),
        SamplingParams(max_tokens=10, temperature=0, presence_penalty=-2.0),
        SamplingParams(max_tokens=10, temperature=0, presence_penalty=-2.0, frequency_penalty=0.5),
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(first,)),
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(first, second), min_tokens=3),
        SamplingParams(
            max_tokens=10, temperature=0, min_tokens=4, ignore_eos=True, stop_token_ids=(second,)
        ),
    ]
    got = [tokens_of(outputs) for outputs in run(core, params)]
    expected = [reference_greedy(model, PROMPT, sp, eos) for sp in params]
    assert got == expected
    # Each parameter made a difference here (this prompt was chosen so that it would).
    assert got[0] != got[1] and got[0] != got[2] and got[0] != got[3] and got[3] != got[4]
    assert got[5] == [first]  # the stop id ends it at once without min_tokens
    assert len(got[6]) >= 3 and first not in got[6][:3] and second not in got[6][:3]


def check_logprobs(model, prompt: list[int], outputs: list, num_top: int) -> None:
    tokens = tokens_of(outputs)
    logits = sequence_logits(model, prompt + tokens)
    entries = [entry for output in outputs for entry in output.logprobs]
    assert [entry.token_id for entry in entries] == tokens
    for position, entry in enumerate(entries):
        reference = reference_log_softmax(logits[len(prompt) - 1 + position].tolist())
        assert entry.logprob == pytest.approx(reference[entry.token_id], abs=1e-4)
        assert len(entry.top_token_ids) == num_top
        assert entry.top_logprobs == pytest.approx(
            [reference[token] for token in entry.top_token_ids], abs=1e-4
        )
        others = [
            value for token, value in enumerate(reference) if token not in entry.top_token_ids
        ]
        assert min(entry.top_logprobs, default=0.0) >= max(others) - 1e-4  # the most likely
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


def test_logprobs_are_the_log_softmax_of_the_model_logits(engine):
    core, model = engine
    params = [
        SamplingParams(max_tokens=6, temperature=0, logprobs=4),
        SamplingParams(
            max_tokens=6, temperature=1.5, repetition_penalty=1.4, logprobs=2, seed=11
        ),  # still the raw logits: before penalties and temperature
        SamplingParams(max_tokens=6, temperature=0.8, logprobs=0, seed=2),
        SamplingParams(max_tokens=6),
    ]
    outputs = run(core, params)
    for sp, request_outputs in zip(params[:3], outputs, strict=False):
        check_logprobs(model, PROMPT, request_outputs, sp.logprobs)
    assert all(output.logprobs is None for output in outputs[3])


def test_seeded_sampling_replays_and_each_seed_differs(engine):
    core, _ = engine

    def seeded(seed):
        return SamplingParams(max_tokens=12, temperature=1.0, top_k=50, min_p=0.01, seed=seed)

    first = [tokens_of(outputs) for outputs in run(core, [seeded(3), seeded(4)])]
    again = [tokens_of(outputs) for outputs in run(core, [seeded(4), SamplingParams(), seeded(3)])]
    assert (again[2], again[0]) == (first[0], first[1])
    assert first[0] != first[1]
