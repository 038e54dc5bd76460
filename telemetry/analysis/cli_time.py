"""Durations on command lines: '50ms', '2s', '1.5' (seconds); latencies always with a unit."""

from __future__ import annotations

import argparse
import math


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


def latency(text: str) -> float:
    """A latency above 0 written with its unit ('50ms', '0.05s', '50000us') -> seconds.
    A bare number is refused, not read as seconds: '50' meant as milliseconds would otherwise
    ask for a target a thousand times too loose (argparse names the flag and says why)."""
    if _is_number(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit: give the latency with one, e.g. 50ms (or 0.05s, 50000us)"
        )
    try:
        seconds = parse_time(text)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a latency above 0 (e.g. 50ms)")
    return seconds


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
