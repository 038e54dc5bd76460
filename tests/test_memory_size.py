"""Memory sizes on command lines carry their unit (B for bytes, written out) and are above 0;
a Python caller's or config's plain int of bytes is still a size (engine/settings.py)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.entrypoints import demo, serve_args
from engine.settings import MemorySize
from tests.helpers.flags import refusal

FORM = "expected a size with its unit, e.g. 512MiB, 4GiB or 4.5GB"


@pytest.mark.parametrize("build_parser", [serve_args.build_parser, demo.build_parser])
@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("512", "it has no unit (write 512B for bytes)"),
        ("0MiB", "it is not above 0 bytes"),
        ("4 megs", "'megs' is not a unit"),
    ],
)
def test_kv_cache_memory_on_a_command_line_needs_a_unit_and_a_size(
    build_parser, value, reason, capsys
):
    message = refusal(build_parser(), ["--kv-cache-memory", value], capsys)
    assert f"argument --kv-cache-memory: {FORM}, got {value!r}: {reason}" in message


def test_serve_takes_bytes_written_as_bytes_and_request_bodies_with_a_unit(capsys):
    args = serve_args.build_parser().parse_args(["--kv-cache-memory", "4096B"])
    assert args.kv_cache_memory_bytes == 4096
    message = refusal(serve_args.build_parser(), ["--max-request-body", "4096"], capsys)
    assert "argument --max-request-body:" in message and "it has no unit" in message


def test_a_config_takes_a_plain_int_of_bytes_above_0():
    assert EngineConfig(kv_cache_memory_bytes=4 << 20).kv_cache_memory_bytes == 4 << 20
    with pytest.raises(ValueError, match="must be a whole number of bytes above 0"):
        EngineConfig(kv_cache_memory_bytes=0)
    assert MemorySize().accepts(1) and not MemorySize().accepts(0)
