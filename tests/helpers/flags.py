"""Checks of command-line flags: what a parser refuses, and which flags' help states no default."""

from __future__ import annotations

import argparse

import pytest


def refusal(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    """The error line ``parser`` exits with (status 2) on ``argv``."""
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every flag of ``parser`` but --help."""
    return [
        action
        for action in parser._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]


def flags_without_default(parser: argparse.ArgumentParser) -> list[str]:
    """The flags whose help does not say their default."""
    return [a.option_strings[-1] for a in options(parser) if "default" not in (a.help or "")]
