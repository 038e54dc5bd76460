"""argparse types of the sidecar's flags (its sinks' too), whose errors say what a flag
expects: argparse prints ``argument --rcvhwm: expected a whole number >= 1, got '0'``, the
flag, the value and the form, before any sink opens a file or a port."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 meaning any free one."""
    return _port(text, 0, "a port number 0-65535 (0 picks a free one)")


def fixed_port(text: str) -> int:
    """A TCP port others connect to, so not 0 (which would pick one nobody knows)."""
    return _port(text, 1, "a port number 1-65535")


def _port(text: str, lowest: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value
