"""Durations on command lines: '50ms', '2s', '1.5' (seconds)."""

from __future__ import annotations

import argparse


def parse_time(text: str) -> float:
    """'50ms', '2s', '1.5' (seconds) -> seconds."""
    text = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def positive_time(text: str) -> float:
    """parse_time, refusing a duration that is not above 0 (argparse says why)."""
    seconds = parse_time(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
    return seconds
