"""Incremental detokenization and stop strings (engine/entrypoints/detokenizer.py).

Streamed pieces must join to the one-shot decode of the final ids, never show a U+FFFD for a
character split across tokens, and cost the same per token however long the output is; stop
strings cut the text before the first occurrence and never leak a part of one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from engine.entrypoints.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    check_stop_strings,
)
from engine.entrypoints.serve import TINY_MODEL, load_tokenizer
from engine.model.tokenizer import ByteTokenizer, Tokenizer

TEXTS = [
    "Hello, 你好 world! Ünïcödé 😀 emoji 🇫🇷 flags — ok",
    "  leading and trailing spaces  ",
    "日本語のテキスト、そして English.\nNew line 🎉🎉🎉",
    "plain ascii only",
]


def stream(tokenizer, token_ids: list[int], step: int = 1) -> list[str]:
    """The detokenizer's pieces for token_ids fed `step` at a time, the last one finished."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = []
    for start in range(0, len(token_ids), step):
        chunk = token_ids[start : start + step]
        pieces.append(detokenizer.add(chunk, finished=start + step >= len(token_ids)))
    return pieces


# `smollm2_tokenizer` is conftest.py's: one per session, shared with test_chat_special_tokens.py.


@pytest.fixture(scope="module")
def byte_tokenizer():
    """The tokenizer of the tiny model the fast serve tests use."""
    return load_tokenizer(TINY_MODEL)


@pytest.mark.live
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_pieces_join_to_the_whole_decode(smollm2_tokenizer, text):
    token_ids = smollm2_tokenizer.encode(text)
    pieces = stream(smollm2_tokenizer, token_ids)
    assert "".join(pieces) == smollm2_tokenizer.decode(token_ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


@pytest.mark.live
def test_smollm2_splits_characters_across_tokens(smollm2_tokenizer):
    """What makes the test above meaningful: alone, some tokens decode to U+FFFD."""
    token_ids = smollm2_tokenizer.encode(TEXTS[0])
    assert any(smollm2_tokenizer.decode([i]).endswith(REPLACEMENT_CHAR) for i in token_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_pieces_join_to_the_whole_decode(byte_tokenizer, text):
    assert isinstance(byte_tokenizer, ByteTokenizer)
    token_ids = byte_tokenizer.encode(text)
    for step in (1, 2, 3):
        pieces = stream(byte_tokenizer, token_ids, step)
        assert "".join(pieces) == text
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_a_multibyte_character_comes_out_whole(byte_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    euro = list("€".encode())  # three tokens
    assert detokenizer.add([ord("a")], finished=False) == "a"
    assert detokenizer.add([euro[0]], finished=False) == ""
    assert detokenizer.add([euro[1]], finished=False) == ""
    assert detokenizer.add([euro[2]], finished=False) == "€"


def test_an_unfinished_character_is_emitted_as_decoded_at_the_end(byte_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    assert detokenizer.add([ord("a")], finished=False) == "a"
    assert detokenizer.add([0xE2, 0x82], finished=False) == ""
    assert detokenizer.add([], finished=True) == REPLACEMENT_CHAR


@settings(max_examples=200, deadline=None)
@given(token_ids=st.lists(st.integers(0, 319), max_size=60), step=st.integers(1, 4))
def test_any_byte_tokens_join_to_the_whole_decode(token_ids, step):
    """Random bytes (a random-weight model's output), special ids and invalid UTF-8 included."""
    tokenizer = ByteTokenizer(320)
    assert "".join(stream(tokenizer, token_ids, step)) == tokenizer.decode(token_ids)


def test_the_window_keeps_a_leading_space_that_a_first_token_would_lose():
    """Metaspace (SentencePiece) decoders drop the space of the first token decoded: the
    window's context tokens keep the spaces between words."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(backend, None)
    assert tokenizer.decode([2]) == "world"
    assert "".join(stream(tokenizer, [1, 2, 2, 3])) == "Hello world world!"


class CountingTokenizer:
    """Records how many ids each decode call is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids)


def decode_work_per_token(tokenizer, token_ids: list[int]) -> tuple[int, int]:
    """(most ids in one decode call, decode calls) when streaming token_ids one at a time."""
    counting = CountingTokenizer(tokenizer)
    stream(counting, token_ids)
    return max(counting.decoded_lengths), len(counting.decoded_lengths)


@pytest.mark.parametrize(
    "tokenizer_name", [pytest.param("smollm2", marks=pytest.mark.live), TINY_MODEL]
)
def test_decode_work_per_token_does_not_grow_with_the_output(tokenizer_name, request):
    # The fixture is asked for here, so the tiny model's case does not read SmolLM2's GGUF.
    fixture = "smollm2_tokenizer" if tokenizer_name == "smollm2" else "byte_tokenizer"
    tokenizer = request.getfixturevalue(fixture)
    token_ids = tokenizer.encode(TEXTS[0])
    short = decode_work_per_token(tokenizer, token_ids * 2)
    long = decode_work_per_token(tokenizer, token_ids * 50)
    assert short[0] == long[0] <= 8  # the longest window: a few tokens, whatever the length
    assert long[1] <= 2 * len(token_ids) * 50  # at most two decode calls per token


# Stop strings --------------------------------------------------------------------------------


def feed(matcher: StopStringMatcher, deltas: list[str]) -> list[str]:
    return [matcher.add(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]


def test_text_before_a_stop_string_split_across_deltas():
    matcher = StopStringMatcher(["world"])
    assert matcher.add("Hello wor", finished=False) == "Hello "  # "wor" could start "world"
    assert not matcher.stopped
    assert matcher.add("ld and more", finished=False) == ""
    assert matcher.stopped
    assert matcher.add("ignored", finished=True) == ""


def test_held_text_is_released_once_it_cannot_start_a_stop_string():
    matcher = StopStringMatcher(["world"])
    assert matcher.add("Hello wo", finished=False) == "Hello "
    assert matcher.add("ndrous", finished=False) == "wondrous"
    assert matcher.add(" wor", finished=True) == " wor"  # the end decides
    assert not matcher.stopped


def test_the_stop_string_complete_first_wins():
    matcher = StopStringMatcher(["cd", "bcde", "\n"])
    assert feed(matcher, ["ab", "cdef"]) == ["a", "b"]  # "cd" is complete before "bcde"
    assert matcher.stopped
    matcher = StopStringMatcher(["bc", "abc"])
    assert feed(matcher, ["xabcd"]) == ["x"]  # complete together: the longest


def test_a_stop_string_overlapping_a_held_prefix():
    matcher = StopStringMatcher(["aab"])
    assert feed(matcher, ["xa", "a", "a", "b", "tail"]) == ["x", "", "a", "", ""]
    assert matcher.stopped


def test_a_stop_string_must_end_where_stopping_is_allowed():
    """While can_stop is False (the first min_tokens tokens) a stop string in the text does
    not count, but one that starts there and ends later does."""
    matcher = StopStringMatcher(["ab", "xyz"])
    assert matcher.add("ab-x", finished=False, can_stop=False) == "ab-"  # "x" could start "xyz"
    assert matcher.add("yz and more", finished=False) == ""
    assert matcher.stopped
    matcher = StopStringMatcher(["b", "abc"])
    assert matcher.add("ab", finished=False, can_stop=False) == ""  # held: could start "abc"
    assert matcher.add("-b", finished=False) == "ab-"  # the "b" that was held does not count
    assert matcher.stopped


def test_no_stop_strings_pass_text_through():
    assert feed(StopStringMatcher([]), ["a", "b"]) == ["a", "b"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_stop_strings_cut_the_text_wherever_the_deltas_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    matcher = StopStringMatcher(stops)
    seen, emitted = "", ""
    for index, delta in enumerate(deltas):
        finished = index == len(deltas) - 1
        seen += delta
        emitted += matcher.add(delta, finished)
        if not (finished or matcher.stopped):  # a tail that may start a stop string is held
            undecided = [k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])]
            assert len(emitted) <= len(seen) - max(undecided, default=0)
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert emitted == (text[: min(found)[1]] if found else text)
    assert matcher.stopped == bool(found)


@pytest.mark.parametrize(
    ("stop", "message"),
    [("", "empty"), (["a", ""], "empty"), (["a"] * 5, "at most 4"), ([1], "must be strings")],
)
def test_bad_stop_strings_are_refused(stop, message):
    with pytest.raises(ValueError, match=message):
        check_stop_strings(stop)


def test_stop_given_as_one_string_or_none():
    assert check_stop_strings("\n") == ["\n"]
    assert check_stop_strings(None) == []
