"""The CPU engine's allocator: tcmalloc preloaded into the spawned engine, and reported as the
engine process itself finds it (tests/test_core_process.py checks a spawned engine)."""

from __future__ import annotations

import pytest

from engine import cpu_allocator
from engine.cpu_allocator import LARGE_ALLOC_REPORT_ENV, allocator_line, engine_environment

LIBRARY = "libtcmalloc_minimal.so.4"


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.delenv("ITERSCOPE_TCMALLOC", raising=False)
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: LIBRARY)


def test_a_cpu_engine_gets_tcmalloc_first_in_its_preload(installed):
    assert engine_environment("cpu", {}) == {
        "LD_PRELOAD": LIBRARY,
        LARGE_ALLOC_REPORT_ENV: cpu_allocator.NEVER_REPORT_BYTES,
    }
    added = engine_environment("cpu", {"LD_PRELOAD": "libother.so", LARGE_ALLOC_REPORT_ENV: "1"})
    assert added == {"LD_PRELOAD": f"{LIBRARY}:libother.so"}  # the caller's setting is kept


@pytest.mark.parametrize(
    "device, environ",
    [
        ("cuda", {}),  # host allocations are not what a GPU engine waits on
        ("cpu", {"LD_PRELOAD": "/opt/libtcmalloc.so"}),  # the caller preloads one already
        ("cpu", {"ITERSCOPE_TCMALLOC": "0"}),
    ],
)
def test_nothing_is_added_where_it_is_not_wanted(installed, monkeypatch, device, environ):
    for name, value in environ.items():
        if name == "ITERSCOPE_TCMALLOC":
            monkeypatch.setenv(name, value)
    assert engine_environment(device, environ) == {}


def test_without_tcmalloc_installed_nothing_is_added(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: None)
    assert engine_environment("cpu", {}) == {}


def write_maps(tmp_path, *libraries: str) -> str:
    path = tmp_path / "maps"
    lines = [f"7f00-7f01 r-xp 00000000 fe:00 1 {library}" for library in libraries]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_line_says_what_the_process_has_loaded(tmp_path, installed):
    loaded = write_maps(tmp_path, "/usr/lib/libc.so.6", f"/usr/lib/{LIBRARY}.5.10")
    assert allocator_line(loaded) == f"memory allocator: tcmalloc (/usr/lib/{LIBRARY}.5.10)"
    not_loaded = write_maps(tmp_path, "/usr/lib/libc.so.6")
    assert allocator_line(not_loaded) == (
        "memory allocator: glibc malloc (tcmalloc is installed but not loaded in this "
        f"process: LD_PRELOAD={LIBRARY} loads it)"
    )


def test_the_line_says_why_glibc(tmp_path, monkeypatch):
    maps = write_maps(tmp_path, "/usr/lib/libc.so.6")
    monkeypatch.setattr(cpu_allocator, "find_tcmalloc", lambda: None)
    assert "tcmalloc is not installed (apt install libtcmalloc-minimal4" in allocator_line(maps)
    monkeypatch.setenv("ITERSCOPE_TCMALLOC", "0")
    assert allocator_line(maps) == "memory allocator: glibc malloc (ITERSCOPE_TCMALLOC=0)"
    assert allocator_line(str(tmp_path / "missing")).startswith("memory allocator: unknown")
