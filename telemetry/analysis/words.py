"""Counts in words, for every sentence the analysis prints."""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``count`` and the noun agreeing with it: ``1 iteration``, ``2 iterations``;
    ``many`` is the plural where adding an s is wrong (``plural(n, "request-s", "request-s")``)."""
    return f"{count} {noun if count == 1 else (many or noun + 's')}"


def were(count: int) -> str:
    """The past of "to be" agreeing with ``count`` things: ``was`` for one, else ``were``."""
    return "was" if count == 1 else "were"


def not_reported(source: str | None) -> str:
    """What a figure the recording's source does not give reads as, never a measured value:
    ``not reported by the source (fpm-sglang)``."""
    return "not reported by the source" + (f" ({source})" if source else "")
