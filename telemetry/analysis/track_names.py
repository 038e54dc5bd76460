"""The names a timeline is drawn under, shared by the NVTX ranges (Nsight Systems) and the
Perfetto trace, so an Nsight report and a trace read alike: the domain, one category (NVTX) or
process (Perfetto) per engine, and the counters both draw. Users filter on these names: never
rename them.
"""

from __future__ import annotations

DOMAIN = "iterscope"
KV_USAGE = "KV cache usage (%)"
RUNNING = "running requests"
WAITING = "waiting requests"


def engine_category(engine_index: int) -> str:
    return f"engine {engine_index}"


def counter_name(engine_index: int, what: str) -> str:
    return f"{engine_category(engine_index)}: {what}"
