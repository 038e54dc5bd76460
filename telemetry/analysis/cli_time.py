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
    """parse_time, refusing what is not a duration above 0 (argparse says why)."""
    try:
        seconds = parse_time(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration above 0 (e.g. 2.5s, 500ms)")
    return seconds
