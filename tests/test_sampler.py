"""Sampler: greedy, temperature, top-k, top-p, min-p, penalties, min_tokens, logprobs, and
per-request seeds without per-request state. Each processed value is checked against a plain
Python reference written from the parameter's definition (vLLM's), token by token."""

from __future__ import annotations

import pytest
import torch

from engine.logits_processing import process_logits
from engine.request import Request, SamplingParams
from engine.sampler import Sampler, draw, draw_rows, is_plain, sample_row
from tests.helpers.sampling_reference import reference_log_softmax, reference_penalized

VOCAB = 50
EOS = 7


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    full = torch.full((VOCAB,), 1e-9)
    full[: len(probs)] = torch.tensor(probs)
    return full.log()


def make_request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    name: str = "r",
) -> Request:
    prompt = prompt if prompt is not None else [1, 2, 3]
    return Request(name, prompt, params, token_ids=prompt + (output or []))


def requests_of(params: list[SamplingParams], num_tokens: list[int]) -> list[Request]:
    """A request per params with `num_tokens` prompt tokens (what seeded draws depend on)."""
    return [
        make_request(p, list(range(n)), name=f"r{i}")
        for i, (p, n) in enumerate(zip(params, num_tokens, strict=True))
    ]


def tokens_of(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return sampler.sample(logits, requests)[0]


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    requests = requests_of([SamplingParams(temperature=0)] * 4, [5] * 4)
    assert tokens_of(Sampler(), logits, requests) == logits.argmax(-1).tolist()


def test_a_tiny_temperature_is_greedy_instead_of_overflowing():
    """logits / 1e-40 overflows to inf and softmax to NaN, which multinomial refuses."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-6)]
    assert tokens_of(Sampler(), logits, requests_of(params, [5, 5])) == logits.argmax(-1).tolist()


def test_seeded_draws_depend_only_on_seed_and_length():
    logits = torch.zeros(3, VOCAB)  # uniform: any token is possible
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    first = tokens_of(Sampler(seed=1), logits, requests_of([seeded, other, seeded], [7, 3, 8]))
    # A different sampler, batch order and neighbour give the same seeded tokens.
    second = tokens_of(Sampler(seed=2), logits[:2], requests_of([seeded, seeded], [8, 7]))
    assert (first[0], first[2]) == (second[1], second[0])


def test_seeded_draws_vary_from_step_to_step_and_from_seed_to_seed():
    logits = torch.zeros(1, VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=7)
    tokens = [tokens_of(Sampler(), logits, requests_of([seeded], [n]))[0] for n in range(1, 40)]
    assert len(set(tokens)) > 10
    neighbour = SamplingParams(temperature=1.0, seed=8)
    others = [tokens_of(Sampler(), logits, requests_of([neighbour], [n]))[0] for n in range(1, 40)]
    assert others != tokens


def test_top_k_keeps_only_the_k_most_likely():
    logits = logits_from_probs([0.3, 0.25, 0.2, 0.15, 0.1])
    params = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(0)
    assert {sample_row(logits, params, gen) for _ in range(300)} == {0, 1}


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    gen = torch.Generator().manual_seed(0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.8)  # 0.5 + 0.3 reaches 0.8
    assert {sample_row(logits, nucleus, gen) for _ in range(300)} == {0, 1}
    wider = SamplingParams(temperature=1.0, top_p=0.85)
    assert {sample_row(logits, wider, gen) for _ in range(300)} == {0, 1, 2}
    tiny = SamplingParams(temperature=1.0, top_p=0.01)  # the top token is always kept
    assert {sample_row(logits, tiny, gen) for _ in range(50)} == {0}


@pytest.mark.parametrize(("min_p", "temperature"), [(0.3, 1.0), (0.6, 1.0), (0.6, 2.0)])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, temperature):
    probs = [0.4, 0.25, 0.15, 0.11, 0.09]
    logits = logits_from_probs(probs)
    # Reference: the distribution after temperature, then the min_p cut (at 0.6 it keeps two
    # tokens at temperature 1, three at 2).
    tempered = torch.softmax(logits / temperature, dim=-1).tolist()
    kept = {t for t, p in enumerate(tempered) if p >= min_p * max(tempered)}
    assert 1 < len(kept) < len(probs)  # the cut is between tokens here
    params = SamplingParams(temperature=temperature, min_p=min_p)
    gen = torch.Generator().manual_seed(0)
    assert {sample_row(logits, params, gen) for _ in range(400)} == kept


PENALTIES = [
    SamplingParams(temperature=0, repetition_penalty=1.3),
    SamplingParams(temperature=0, repetition_penalty=0.7),
    SamplingParams(temperature=0, frequency_penalty=0.9),
    SamplingParams(temperature=0, presence_penalty=-1.5),
    SamplingParams(
        temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=1.1
    ),
]


@pytest.mark.parametrize("params", PENALTIES)
def test_penalties_equal_their_definition(params):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, VOCAB, generator=gen) * 3
    prompt, output = [4, 9, 9, 20], [9, 31, 31, 31, 2]
    plain = make_request(SamplingParams(temperature=0), prompt, output)
    penalized = make_request(params, prompt, output)
    processed = process_logits(logits, [plain, penalized], ())
    expected = reference_penalized(logits[1].tolist(), prompt, output, params)
    assert torch.allclose(processed[1], torch.tensor(expected), atol=1e-5)
    assert torch.equal(processed[0], logits[0])  # the row that did not ask is untouched


def test_penalties_change_what_greedy_picks():
    logits = logits_from_probs([0.5, 0.3, 0.2]).unsqueeze(0)
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    repeated = make_request(params, [5], [0])  # token 0 is already in the output
    expected = max(
        range(VOCAB), key=reference_penalized(logits[0].tolist(), [5], [0], params).__getitem__
    )
    assert expected == 1
    assert tokens_of(Sampler(), logits, [repeated]) == [expected]
    assert tokens_of(Sampler(), logits, [make_request(params, [5], [])]) == [0]


def test_a_batch_without_penalties_is_left_as_it_is():
    logits = torch.randn(3, VOCAB)
    requests = requests_of([SamplingParams(temperature=0), SamplingParams(min_tokens=0)], [2, 3])
    assert process_logits(logits, requests, (EOS,)) is logits


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 11], logits[0, 12] = 9.0, 8.0, 7.0  # EOS, then stop id 11, then 12
    sampler = Sampler(eos_token_ids=(EOS,))
    for ignore_eos in (False, True):  # as in vLLM, EOS is masked with ignore_eos too
        params = SamplingParams(
            temperature=0, min_tokens=3, stop_token_ids=(11,), ignore_eos=ignore_eos
        )
        picked = [
            tokens_of(sampler, logits, [make_request(params, [1], [12] * n)])[0] for n in range(5)
        ]
        assert picked == [12, 12, 12, EOS, EOS]
    sampled = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(11,))
    draws = {tokens_of(sampler, logits, [make_request(sampled, [1], [])])[0] for _ in range(200)}
    assert EOS not in draws and 11 not in draws


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.7, top_k=3, logprobs=0, seed=1),
        SamplingParams(temperature=1.3, repetition_penalty=1.5, presence_penalty=2.0, logprobs=3),
    ],
)
def test_logprobs_are_the_log_softmax_of_the_raw_logits(params):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    requests = [
        make_request(SamplingParams(), name="plain"),
        make_request(params, [1, 2], [3, 3], name="asks"),
    ]
    tokens, logprobs = Sampler(seed=4).sample(logits, requests)
    assert logprobs[0] is None
    entry = logprobs[1]
    reference = reference_log_softmax(logits[1].tolist())  # before penalties and temperature
    assert entry.token_id == tokens[1]
    assert entry.logprob == pytest.approx(reference[tokens[1]], abs=1e-5)
    ranked = sorted(range(VOCAB), key=lambda t: -reference[t])[: params.logprobs]
    assert entry.top_token_ids == ranked
    assert entry.top_logprobs == pytest.approx([reference[t] for t in ranked], abs=1e-5)


def test_mismatched_inputs_raise():
    with pytest.raises(ValueError, match="logit rows"):
        Sampler().sample(torch.zeros(2, VOCAB), [make_request(SamplingParams())])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_out_of_range_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_draws_follow_the_distribution_and_never_pick_zero_mass():
    """The inverse-CDF draw: frequencies of 40,000 draws within 4 standard errors of the
    probabilities (unnormalised input), and a token of zero mass never comes."""

    weights = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.5, 0.0, 5.5, 0.0])
    probabilities = weights / weights.sum()
    generator = torch.Generator().manual_seed(11)
    num_draws = 40_000
    counts = torch.bincount(
        torch.tensor([draw(weights, generator) for _ in range(num_draws)]), minlength=len(weights)
    ).double()
    assert counts[weights == 0].sum() == 0
    frequencies = counts / num_draws
    standard_errors = (probabilities * (1 - probabilities) / num_draws).sqrt()
    assert ((frequencies - probabilities).abs() <= 4 * standard_errors + 1e-12).all()


def test_rows_drawn_together_follow_their_own_temperatures():
    """The batched draw of plain rows (no seed, min_p, top-k or top-p): each row's frequencies
    over 10,000 draws within 4 standard errors of softmax(logits / T) of that row, and a
    token of zero probability (-inf) never comes."""
    logits = torch.tensor(
        [
            [0.0, 1.0, float("-inf"), 2.0, 0.5],
            [2.0, 0.0, 1.0, float("-inf"), -1.0],
            [0.0, 1.0, float("-inf"), 2.0, 0.5],  # the first row, hotter
        ]
    )
    temperatures = [1.0, 0.5, 3.0]
    expected = torch.softmax(logits / torch.tensor(temperatures)[:, None], dim=-1).double()
    generator = torch.Generator().manual_seed(5)
    num_draws = 10_000
    drawn = torch.tensor([draw_rows(logits, temperatures, generator) for _ in range(num_draws)])
    for row in range(3):
        counts = torch.bincount(drawn[:, row], minlength=5).double()
        assert counts[logits[row].isinf()].sum() == 0
        frequencies, probabilities = counts / num_draws, expected[row]
        standard_errors = (probabilities * (1 - probabilities) / num_draws).sqrt()
        assert ((frequencies - probabilities).abs() <= 4 * standard_errors + 1e-12).all()


def test_a_mixed_batch_gives_each_row_its_own_kind_of_pick():
    """Greedy, plain (drawn together), seeded and top-k rows in one batch: greedy takes the
    argmax, the seeded row replays its draw from a batch of its own, top-k stays in the top k
    and the plain rows stay in their support."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[3, 10:] = float("-inf")  # a plain row that can only pick below 10
    seeded = SamplingParams(temperature=1.0, seed=9)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        seeded,
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    tokens = tokens_of(Sampler(seed=4), logits, requests_of(params, [4, 5, 6, 7, 8]))
    assert tokens[0] == int(logits[0].argmax())
    alone = tokens_of(Sampler(seed=5), logits[2:3], requests_of([seeded], [6]))
    assert tokens[2] == alone[0]
    assert tokens[3] < 10
    assert tokens[4] in logits[4].topk(3).indices.tolist()
    assert 0 <= tokens[1] < VOCAB


@pytest.mark.parametrize(
    ("fields", "plain"),
    [
        ({"temperature": 1.0}, True),
        ({"temperature": 0.5}, True),
        ({"temperature": 1.0, "seed": 1}, False),
        ({"temperature": 1.0, "top_k": 5}, False),
        ({"temperature": 1.0, "top_p": 0.9}, False),
        ({"temperature": 1.0, "min_p": 0.1}, False),
    ],
)
def test_which_rows_are_drawn_together(fields, plain):
    assert is_plain(SamplingParams(**fields)) is plain
