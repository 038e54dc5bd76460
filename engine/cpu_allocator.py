"""The memory allocator of a CPU engine process: tcmalloc where it is installed.

Every iteration allocates and frees tensors of a few kB (decode) to several MB (prefill
activations). glibc's malloc serves them slower than tcmalloc: `iterscope serve` made 3-4% more
output tok/s with tcmalloc in its engine process in alternating serving runs on a 2-core EPYC
with AVX-512 (docs/performance.md), and vLLM's CPU docs preload it for the same reason. A
process cannot change its allocator once started, so the client preloads tcmalloc into the
engine-core process it spawns (LD_PRELOAD in that process's environment only), and the engine
reports what it runs with from its own memory map: the start-up line is what is true of the
process, not what was asked for.

``ITERSCOPE_TCMALLOC=0`` keeps glibc's malloc. Debian and Ubuntu ship tcmalloc as
libtcmalloc-minimal4 (`make demo` and `make test` install it).
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

LIBRARY = "tcmalloc_minimal"
PACKAGE = "libtcmalloc-minimal4"
# tcmalloc prints a line for every allocation over 1 GiB by default (a large KV cache):
# keep such lines out of the engine's output.
LARGE_ALLOC_REPORT_ENV = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
NEVER_REPORT_BYTES = str(1 << 62)


def enabled() -> bool:
    return os.environ.get("ITERSCOPE_TCMALLOC", "1") != "0"


def find_tcmalloc() -> str | None:
    """The library's name as the dynamic loader finds it (libtcmalloc_minimal.so.4), or None."""
    return ctypes.util.find_library(LIBRARY)


def engine_environment(device: str, environ: dict[str, str]) -> dict[str, str]:
    """What to add to ``environ`` for an engine process on ``device``: tcmalloc first in
    LD_PRELOAD on a CPU, when installed and not turned off; nothing otherwise (or when the
    caller already preloads one)."""
    library = find_tcmalloc() if device == "cpu" and enabled() else None
    preload = environ.get("LD_PRELOAD", "")
    if library is None or "libtcmalloc" in preload:
        return {}
    added = {"LD_PRELOAD": f"{library}:{preload}" if preload else library}
    if LARGE_ALLOC_REPORT_ENV not in environ:
        added[LARGE_ALLOC_REPORT_ENV] = NEVER_REPORT_BYTES
    return added


def allocator_line(maps_path: str = "/proc/self/maps") -> str:
    """This process's allocator as a start-up line, read from its memory map."""
    try:
        maps = Path(maps_path).read_text()
    except OSError:
        return "memory allocator: unknown (no /proc/self/maps)"
    for line in maps.splitlines():
        if "libtcmalloc" in line:
            return f"memory allocator: tcmalloc ({line.split()[-1]})"
    if not enabled():
        return "memory allocator: glibc malloc (ITERSCOPE_TCMALLOC=0)"
    library = find_tcmalloc()
    if library is not None:  # an engine in a process that was not spawned with it
        return (
            "memory allocator: glibc malloc (tcmalloc is installed but not loaded in this "
            f"process: LD_PRELOAD={library} loads it)"
        )
    return (
        f"memory allocator: glibc malloc; tcmalloc is not installed (apt install {PACKAGE}: "
        "3-4% more output tok/s in docs/performance.md)"
    )
