"""argparse types whose errors say what a flag expects.

argparse prefixes a type's ArgumentTypeError with the flag, so a bad value reads
``argument --max-num-seqs: expected a whole number >= 1, got '0'``: the flag, the value and
the expected form, before anything starts. (A plain ValueError from a type function would
print only the function's name.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from engine.settings import DTYPE, Fraction, Kind, MemorySize, PowerOfTwo, WholeNumber
from telemetry.sidecar.arg_types import port as port  # the sidecar's rule, one for both


def of_kind(kind: Kind) -> Callable[[str], object]:
    """The argparse type of an engine setting's kind (engine/settings.py): the same rule the
    config checks values with, its error turned into argparse's."""

    def parse(text: str) -> object:
        try:
            return kind.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = type(kind).__name__
    return parse


def int_in_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number >= ``minimum`` (and <= ``maximum`` unless None)."""
    return of_kind(WholeNumber(minimum, maximum))


def power_of_two(maximum: int) -> Callable[[str], int]:
    """1, 2, 4, ... up to ``maximum``."""
    return of_kind(PowerOfTwo(maximum))


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, e.g. 10 or 2.5, got {text!r}")
    return value


fraction = of_kind(Fraction())  # a number in (0, 1]
memory_size = of_kind(MemorySize())  # bytes from a size with its unit: 512MiB, 4GiB, 4.5GB
dtype = of_kind(DTYPE)  # one of DTYPE's names, in its canonical spelling
