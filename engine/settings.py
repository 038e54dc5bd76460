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
_MEMORY_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
MEMORY_SIZE_FORM = "a size with its unit, e.g. 512MiB, 4GiB or 4.5GB"


def parse_memory_size(text: str) -> int:
    """'24GiB' -> bytes, for a size written on a command line.

    Takes B, KB/MB/GB/TB (powers of 10) and KiB/MiB/GiB/TiB (powers of 2), in any case. The
    unit is required, B included: a bare ``512`` could mean bytes or MiB, and as bytes it
    would start an engine that fails later. The size must be above 0 bytes. ValueError says
    ``expected a size with its unit, ..., got 'TEXT'`` and, where that is the trouble, that
    it has no unit, an unknown unit, or is not above 0 bytes.
    """
    match = _MEMORY_SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected {MEMORY_SIZE_FORM}, got {text!r}")
    number, unit = match.group(1), match.group(2)
    if not unit:
        raise ValueError(
            f"expected {MEMORY_SIZE_FORM}, got {text!r}: it has no unit (write {number}B for bytes)"
        )
    if unit.lower() not in _MEMORY_UNITS:
        raise ValueError(
            f"expected {MEMORY_SIZE_FORM}, got {text!r}: {unit!r} is not a unit; use B, "
            "KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    size = int(float(number) * _MEMORY_UNITS[unit.lower()])
    if size < 1:
        raise ValueError(f"expected {MEMORY_SIZE_FORM}, got {text!r}: it is not above 0 bytes")
    return size


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
    """Bytes. From a command line, text with its unit (``parse_memory_size``, whose error
    says what is wrong); from a Python caller or config (``EngineConfig(kv_cache_memory_bytes=
    4 << 20)``), a plain int of bytes, which ``accepts`` checks."""

    expected: str = f"a whole number of bytes above 0 (on a command line, {MEMORY_SIZE_FORM})"

    def read(self, text: str) -> int:
        return parse_memory_size(text)

    def accepts(self, value: int) -> bool:
        return value >= 1

    def parse(self, text: str) -> int:
        return parse_memory_size(text)


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
