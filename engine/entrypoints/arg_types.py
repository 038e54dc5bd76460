"""argparse types whose errors say what a flag expects.

argparse prefixes a type's ArgumentTypeError with the flag, so a bad value reads
``argument --max-num-seqs: expected a whole number >= 1, got '0'``: the flag, the value and
the expected form, before anything starts. (A plain ValueError from a type function would
print only the function's name.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from engine.config import DTYPE_ALIASES, parse_memory_size


def int_in_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number >= ``minimum`` (and <= ``maximum`` unless None)."""
    expected = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected a whole number {expected}, got {text!r}")
        return value

    return parse


def power_of_two(maximum: int) -> Callable[[str], int]:
    """1, 2, 4, ... up to ``maximum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 0 < value <= maximum or value & (value - 1):
            raise argparse.ArgumentTypeError(
                f"expected a power of two up to {maximum} (e.g. 16), got {text!r}")
        return value

    return parse


def port(text: str) -> int:
    """A TCP port, 0 meaning any free one."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port number 0-65535 (0 picks a free one), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, e.g. 10 or 2.5, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.9, got {text!r}")
    return value


def memory_size(text: str) -> int:
    """Bytes from a size with its unit: 512MiB, 4GiB, 4.5GB."""
    try:
        return parse_memory_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size with its unit, e.g. 512MiB, 4GiB or 4.5GB, got {text!r}"
        ) from None


def dtype(text: str) -> str:
    """One of DTYPE_ALIASES, in its canonical spelling."""
    canonical = DTYPE_ALIASES.get(text.lower())
    if canonical is None:
        raise argparse.ArgumentTypeError(
            f"expected auto, float32, bfloat16 or float16 (or fp32, bf16, fp16, half), "
            f"got {text!r}")
    return canonical
