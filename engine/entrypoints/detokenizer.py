"""Output text for the frontend: incremental detokenization and stop strings.

IncrementalDetokenizer turns a growing list of output token ids into text deltas, decoding
only a short window of the latest tokens per step (the prefix-offset / read-offset scheme of
streaming detokenizers), so each token costs the same whatever the output length:

    token_ids:  t0 t1 ... | t_prefix ... t_read-1 | t_read ... t_last
                 emitted  |  emitted, kept as     |  not emitted yet
                          |  decoding context     |
                          ^ prefix_offset         ^ read_offset

    new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

The context tokens make the window decode the way the whole output does: decoders that treat
the first token specially (a SentencePiece leading space) see it only at the window's start,
where it is cancelled out. Text is held back while the window's decode ends with U+FFFD: the
last tokens may end inside a multi-byte UTF-8 character that the next token completes, so a
character split across tokens comes out whole and the stream never shows a stray U+FFFD. At
the end (finished) whatever is left is emitted as decoded.

The window is bounded by the emitted tokens of the last step plus the run of tokens since the
last decode that ended on a whole character (one to three tokens in real text). Only output
that never forms a whole character (a random-weight model's invalid bytes) makes it grow, and
then only until such a character comes, as in vLLM and HF tokenizers' DecodeStream.

StopStringMatcher cuts that text before the first stop string to complete and holds back any
tail that could be the start of one, so streamed text never shows part of a stop string.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decode yields for bytes that are not (yet) a character
MAX_STOP_STRINGS = 4  # the OpenAI API's limit


class IncrementalDetokenizer:
    """Text deltas of one request's output; ``tokenizer.decode(ids)`` is the only call made."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_token_ids: list[int], finished: bool) -> str:
        """The text the new tokens complete ("" while a character is unfinished); everything
        left once ``finished``. Joined, the deltas equal ``tokenizer.decode(token_ids)``."""
        self.token_ids.extend(new_token_ids)
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        window_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        incomplete = len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR)
        if incomplete and not finished:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return window_text[len(prefix_text) :]


def check_stop_strings(stop: str | list[str] | None) -> list[str]:
    """The request's stop strings as a list; ValueError names what is wrong."""
    if stop is None:
        return []
    stop_strings = [stop] if isinstance(stop, str) else list(stop)
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise ValueError(
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop_strings)}"
        )
    for stop_string in stop_strings:
        if not isinstance(stop_string, str):
            raise ValueError(f"stop strings must be strings, got {stop_string!r}")
        if not stop_string:
            raise ValueError("stop strings must not be empty")
    return stop_strings


class StopStringMatcher:
    """Cuts streamed text before the first stop string to appear in it.

    Invariant: text already returned never ends with the start of a stop string, so a stop
    string always begins inside ``pending`` (the held-back tail, shorter than the longest stop
    string) or the new text, and the search per step covers only those.
    """

    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = check_stop_strings(stop_strings)
        self.pending = ""
        self.stopped = False

    def add(self, text: str, finished: bool, can_stop: bool = True) -> str:
        """The part of ``text`` (after any held tail) that is decided not to belong to a stop
        string; once a stop string is found, the text before it and ``stopped`` is True.
        Only a stop string that ends in ``text`` counts, and none while ``can_stop`` is False
        (the text of the first min_tokens tokens), though a tail that could start one is
        still held back."""
        if self.stopped:
            return ""
        candidate = self.pending + text
        stop_at = self._first_stop(candidate, len(self.pending)) if can_stop else None
        if stop_at is not None:
            self.stopped, self.pending = True, ""
            return candidate[:stop_at]
        num_held = 0 if finished else self._num_held_chars(candidate)
        self.pending = candidate[len(candidate) - num_held :]
        return candidate[: len(candidate) - num_held]

    def _first_stop(self, text: str, num_old_chars: int) -> int | None:
        """Where the stop string that is complete first (then the longest) starts in text,
        among those that end after its first ``num_old_chars`` characters.

        The first to complete is where generation stops, however the text was split into
        deltas: stop strings ["b", "abc"] on "abc" stop at "b" (text "a")."""
        found = [
            (index + len(s), index)
            for s in self.stop_strings
            if (index := text.find(s, max(0, num_old_chars - len(s) + 1))) >= 0
        ]
        return min(found)[1] if found else None

    def _num_held_chars(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop_string in self.stop_strings:
            for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
                if text.endswith(stop_string[:length]):
                    longest = length
                    break
        return longest
