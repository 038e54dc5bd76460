"""How an engine setting is read from a flag and checked: one rule per kind of value.

EngineConfig (engine/config.py) names a kind for each setting in its field metadata
(``setting(...)``). The same kind then serves both ways in: `iterscope serve` reads the flag's
text with ``parse`` (engine/entrypoints/serve_args.py, which builds the flags from those
fields), and EngineConfig checks a value a Python caller gave with ``accepts``. So a rule is
stated once, and the CLI and the config refuse the same values, with the same words for what
is expected.

    field metadata    flag, help, kind, metavar, default_text (how the help names a None
                      default), negate (a switch given as --no-...)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

DTYPE_ALIASES = {
    "auto": "auto",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_memory_size(text: str) -> int:
    """'24GiB' -> bytes. Accepts B, KB/MB/GB/TB (powers of 10) and KiB/MiB/GiB/TiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 24GiB, 512MiB or 4.5GB")
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


class Kind:
    """A kind of setting value: what it expects (in words), reading it from text, checking it.
    ``parse`` raises ValueError("expected ..., got 'TEXT'")."""

    expected = ""

    def read(self, text: str) -> Any:
        """The value the text means, unchecked; ValueError if it means none."""
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        try:
            value = self.read(text)
        except ValueError:
            value = None
        if value is None or not self.accepts(value):
            raise ValueError(f"expected {self.expected}, got {text!r}")
        return value


@dataclass(frozen=True)
class WholeNumber(Kind):
    minimum: int
    maximum: int | None = None

    @property
    def expected(self) -> str:
        bound = (
            f">= {self.minimum}" if self.maximum is None else (f"in {self.minimum}..{self.maximum}")
        )
        return f"a whole number {bound}"

    def read(self, text: str) -> int:
        return int(text)

    def accepts(self, value: int) -> bool:
        return value >= self.minimum and (self.maximum is None or value <= self.maximum)


@dataclass(frozen=True)
class PowerOfTwo(Kind):
    maximum: int

    @property
    def expected(self) -> str:
        return f"a power of two up to {self.maximum} (e.g. 16)"

    def read(self, text: str) -> int:
        return int(text)

    def accepts(self, value: int) -> bool:
        return 0 < value <= self.maximum and not value & (value - 1)


@dataclass(frozen=True)
class Fraction(Kind):
    expected: str = "a fraction in (0, 1], e.g. 0.9"

    def read(self, text: str) -> float:
        return float(text)

    def accepts(self, value: float) -> bool:
        return 0 < value <= 1


@dataclass(frozen=True)
class MemorySize(Kind):
    expected: str = "a size with its unit, e.g. 512MiB, 4GiB or 4.5GB"

    def read(self, text: str) -> int:
        return parse_memory_size(text)

    def accepts(self, value: int) -> bool:
        return value >= 1


@dataclass(frozen=True)
class Choice(Kind):
    """One of ``names``; ``aliases`` maps other spellings to them (the canonical ones too)."""

    names: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict, hash=False)
    alias_text: str = ""  # e.g. "(or fp32, bf16, fp16, half)"

    @property
    def expected(self) -> str:
        names = ", ".join(self.names[:-1]) + f" or {self.names[-1]}"
        return f"{names} {self.alias_text}".strip()

    def read(self, text: str) -> str:
        return self.canonical(text) or text

    def accepts(self, value: str) -> bool:
        return self.canonical(value) is not None

    def canonical(self, value: str) -> str | None:
        """The canonical spelling of ``value``, None if it is no choice."""
        if self.aliases:
            return self.aliases.get(str(value).lower())
        return value if value in self.names else None


DTYPE = Choice(
    ("auto", "float32", "bfloat16", "float16"), DTYPE_ALIASES, "(or fp32, bf16, fp16, half)"
)


def setting(
    default: Any,
    flag: str | None = None,
    help: str = "",
    kind: Kind | None = None,
    metavar: str | None = None,
    default_text: str | None = None,
    negate: bool = False,
) -> Any:
    """A dataclass field with its flag's metadata (see the module docstring)."""
    metadata = {
        "flag": flag,
        "help": help,
        "kind": kind,
        "metavar": metavar,
        "default_text": default_text,
        "negate": negate,
    }
    return field(default=default, metadata=metadata)
