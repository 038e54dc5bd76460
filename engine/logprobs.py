"""Log-probabilities of sampled tokens: what the engine sends, and OpenAI's two shapes of them.

The sampler reports, for each token it picks for a request that asked (``logprobs`` = N),
one TokenLogprobs: the token's log-probability and the N most likely tokens', all from
log_softmax of the model's raw logits (before penalties, temperature and the top-k / top-p /
min-p filters, as vLLM reports them by default). The frontend renders them per choice:

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: lp}],
                  "text_offset": [...]}      top_logprobs: the sampled token and the top N
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
                                             top_logprobs: the top N, most likely first

A token's text is its own decode; ``text_offset`` is where it starts in the concatenation of
the choice's token texts. -inf, which JSON cannot hold, is reported as -9999.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM report in place of -inf
MAX_LOGPROBS = 20  # the most alternatives a request may ask for (vLLM's --max-logprobs default)

TokenText = Callable[[int], str]


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One sampled token: its log-probability and the most likely tokens', most likely
    first (top_token_ids and top_logprobs have the length the request asked for)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    entries: list[TokenLogprobs], token_text: TokenText, first_offset: int = 0
) -> dict[str, Any]:
    """The completions API's logprobs object for consecutive tokens of one choice, the first
    of which starts at ``first_offset``."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = first_offset
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        top = {text: _finite(entry.logprob)}
        top.update(
            (token_text(token_id), _finite(logprob))
            for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
        )
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {
        "token": text,
        "logprob": _finite(logprob),
        "bytes": list(text.encode("utf-8", errors="replace")),
    }


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    """The chat API's logprobs object for consecutive tokens of one choice."""
    content = []
    for entry in entries:
        item = _chat_entry(token_text(entry.token_id), entry.logprob)
        item["top_logprobs"] = [
            _chat_entry(token_text(token_id), logprob)
            for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
        ]
        content.append(item)
    return {"content": content}


class LogprobsFormatter:
    """The logprobs object of each chunk (or whole choice) of one response; for completions
    it remembers where each choice's next token text starts."""

    def __init__(self, token_text: TokenText, chat: bool) -> None:
        self.token_text = token_text
        self.chat = chat
        self.next_offsets: dict[int, int] = {}

    def __call__(self, index: int, entries: list[TokenLogprobs] | None) -> dict | None:
        """None when the request did not ask for logprobs."""
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        body = completion_logprobs(entries, self.token_text, self.next_offsets.get(index, 0))
        if entries:
            self.next_offsets[index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body
