"""The Episode type, where patterns become episodes (Thresholds), and helpers detectors share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from telemetry.analysis.stall_rule import DEAD_AFTER_S
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.lane.record import UNKNOWN_KV_BLOCKS

PROBLEM = "problem"
INFO = "info"


@dataclass(frozen=True)
class Thresholds:
    """Where a pattern becomes an episode. Times in seconds, ratios in 0..1."""

    kv_saturated_ratio: float = 0.95
    kv_saturated_min_iterations: int = 10
    kv_cliff_high_ratio: float = 0.90
    kv_cliff_min_drop: float = 0.40  # usage falls by at least this much (of the whole cache)
    kv_cliff_max_iterations: int = 5
    storm_min_preemptions: int = 3
    storm_window_time: float = 1.0
    waiting_min_time: float = 1.0
    waiting_min_iterations: int = 10
    # A fixed stall threshold in seconds; None adapts it to the engine's own progress, as
    # the live sidecar does (telemetry/analysis/stall_rule.py).
    stall_after: float | None = None
    # No message for longer than this is a silence: the live sidecar's --dead-after.
    dead_after: float = DEAD_AFTER_S
    spin_min_iterations: int = 10
    leak_min_blocks: int = 2
    leak_min_iterations: int = 5
    idle_min_time: float = 5.0
    gap_merge_time: float = 1.0
    long_prefill_ratio: float = 3.0
    long_prefill_min_extra_time: float = 0.005
    long_prefill_min_baseline_iterations: int = 10
    long_prefill_baseline_time: float = 30.0  # an iteration's baseline: this long before it
    # A stretched iteration is a finding where decoding requests notice it: its pause beyond
    # the baseline is this long, or iterations stretched as much are this share of the
    # decoding requests' steps in the baseline time before it (1%: they set the p99
    # inter-token latency there).
    long_prefill_min_pause: float = 1.0
    long_prefill_min_share: float = 0.01
    # Decode-only iterations slowed by nothing in their batch: this many times the median of
    # the decode-only iterations of as many decoding requests or more in the baseline time
    # (long_prefill_baseline_time; at least long_prefill_min_baseline_iterations of them, else
    # that many of the most scaled up to its own), and noticed as a long prefill is.
    slow_decode_ratio: float = 3.0
    # less is no stutter a reader of the stream sees, and a loaded host's scheduling hiccups
    # beside sub-millisecond iterations (a tiny model) are about that size
    slow_decode_min_extra_time: float = 0.050
    slow_decode_min_pause: float = 1.0
    slow_decode_min_share: float = 0.01
    # Off pace: this many times the baseline or more and this much over it: left out of later
    # baselines, and what follows is judged on the pace before it (slow_decode.py).
    slow_decode_pace_ratio: float = 2.0
    slow_decode_pace_min_extra_time: float = 0.020
    # Costly drafts: each step of this many seconds (aligned to record time) is judged on the
    # fit over the window before it, with at least this many drafting iterations, where drafts
    # add this share of the time per output token at 2 errors.
    costly_drafts_step_time: float = 10.0
    costly_drafts_window_time: float = 30.0
    costly_drafts_min_iterations: int = 30
    costly_drafts_min_added: float = 0.10
    # Speculation that gains nothing: an iteration is judged on the decoding iterations of the
    # window before it (itself included), at least this many, accepting fewer tokens than this
    # share of their decoding requests.
    futile_speculation_window_time: float = 30.0
    futile_speculation_min_iterations: int = 100
    futile_speculation_max_accepted: float = 0.01


@dataclass
class Episode:
    """One finding. ``numbers`` holds the key figures of ``evidence`` for machines and tests."""

    kind: str
    engine_index: int
    start_ns: int
    end_ns: int
    title: str
    evidence: str
    explanation: str
    setting: str
    severity: str = PROBLEM
    ongoing: bool = False
    numbers: dict = field(default_factory=dict)

    @property
    def duration_time(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S


def span_episode(tl: EngineTimeline, first: int, last: int, **fields: Any) -> Episode:
    """An episode of ``tl`` from the start of record ``first`` to the end of record ``last``."""
    return Episode(
        engine_index=tl.engine_index,
        start_ns=int(tl.col("start_ns")[first]),
        end_ns=int(tl.col("end_ns")[last]),
        **fields,
    )


def past_bounds(
    tl: EngineTimeline, among: np.ndarray, rows: np.ndarray, within_s: float, itself: bool
) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``rows``, the [first, last) bounds, in the iterations ``among`` (a mask of
    tl's rows, taken in order), of those that started within ``within_s`` before it, and at its
    own start too where ``itself``: the past an iteration is judged on."""
    starts, row_starts = tl.col("start_ns")[among], tl.col("start_ns")[rows]
    firsts = starts.searchsorted(row_starts - int(within_s * NS_PER_S))
    lasts = starts.searchsorted(row_starts, side="right" if itself else "left")
    return firsts, lasts


def true_runs(mask: np.ndarray, max_gap: int = 0) -> list[tuple[int, int]]:
    """Inclusive (first, last) index pairs of True runs; runs split by <= max_gap False merge."""
    index = np.flatnonzero(mask)
    if not index.size:
        return []
    breaks = np.flatnonzero(np.diff(index) > max_gap + 1)
    firsts = np.r_[index[0], index[breaks + 1]]
    lasts = np.r_[index[breaks], index[-1]]
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def group_by_time(
    times_ns: list[int], window_ns: int, ends_ns: list[int] | None = None
) -> list[tuple[int, int]]:
    """Inclusive index ranges of sorted times where consecutive times are <= window_ns apart;
    with ``ends_ns`` (each time's end: iterations), apart from the end of the one before."""
    ends_ns = ends_ns or times_ns
    groups: list[tuple[int, int]] = []
    for i, t in enumerate(times_ns):
        if groups and t - ends_ns[groups[-1][1]] <= window_ns:
            groups[-1] = (groups[-1][0], i)
        else:
            groups.append((i, i))
    return groups


def pct(ratio: float) -> str:
    return f"{100 * ratio:.1f}%"


def kv_usage_at(tl: EngineTimeline, rows: slice | int) -> float | None:
    """The highest KV usage in ``rows``, None where the source does not report KV blocks
    there (FPM: its 0 is not a measured 0)."""
    if not bool(np.all(tl.known(UNKNOWN_KV_BLOCKS)[rows])):
        return None
    return float(np.max(tl.kv_usage[rows]))


def kv_usage_text(usage: float | None, label: str = "KV usage") -> str:
    """``KV usage peak 45.0%``, or ``KV usage not reported`` (the source names no KV blocks)."""
    return f"{label} {pct(usage)}" if usage is not None else "KV usage not reported"


def secs(time_ns: int | float) -> str:
    seconds = time_ns / NS_PER_S
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# How change lines name the KV cache's size, in the flags of the engine that was recorded
# (ours: engine/entrypoints/serve_args.py, where on CUDA without --kv-cache-memory the cache
# gets what --gpu-memory-utilization leaves; vLLM's `vllm serve` flags, and the environment
# variable its CPU build still reads, which replaces --kv-cache-memory-bytes where it is set:
# vllm/platforms/cpu.py), and the command that plans it. A FLAGS entry takes a factor ("to
# 2.0x the cache's size"); a TEXTS entry adds what sizes the cache only indirectly.
_VLLM_KV_SIZE = (
    "--kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE where it is set, which overrides "
    "the flag on vLLM's CPU build; or --num-gpu-blocks-override where one is set"
)
KV_MEMORY_FLAGS = {"iterscope": "--kv-cache-memory", "vllm": f"{_VLLM_KV_SIZE})"}
KV_MEMORY_TEXTS = {
    "iterscope": "--kv-cache-memory (on CUDA without it: a higher --gpu-memory-utilization)",
    "vllm": f"{_VLLM_KV_SIZE}; without any of them: a higher --gpu-memory-utilization)",
}
TUNE_TEXT = "`iterscope tune RECORDING --itl-target T`, with T your inter-token latency target,"


KV_PLAN_BLOCK_SIZE = 16  # kv-plan's default --block-size (serve's)


def kv_plan_text(timeline: EngineTimeline, request_len: str | None, holds: str) -> str:
    """kv-plan's command for the recorded engine's cache and what it shows (``holds``: of
    what, e.g. "requests a size holds"). kv-plan needs the engine's own --dtype and
    --max-model-len besides the memory (its defaults are serve's, not the engine's, and a
    max model length that SIZE cannot hold makes it exit 1): the values its heartbeats say,
    else DTYPE and LEN placeholders (a sender that predates them)."""
    length = f" --request-len {request_len}" if request_len else ""
    block_size = int(timeline.facts.get("block_size", 0))
    # kv-plan plans in blocks of 16 by default: the engine's own size where it is another
    # (vLLM's CPU build: 128; a request of 130 tokens then takes 2 blocks, not 9)
    if block_size and block_size != KV_PLAN_BLOCK_SIZE:
        length += f" --block-size {block_size}"
    dtype, max_model_len = timeline.facts.get("dtype"), timeline.facts.get("max_model_len")
    if dtype and max_model_len:
        return (
            f"`iterscope kv-plan --model DIR --memory SIZE --dtype {dtype} --max-model-len "
            f"{max_model_len}{length}` shows how many {holds}"
        )
    return (
        f"`iterscope kv-plan --model DIR --memory SIZE --dtype DTYPE --max-model-len LEN{length}`"
        f", with DTYPE and LEN the engine's --dtype and --max-model-len, shows how many {holds}"
    )


def kv_plan_hint(timeline: EngineTimeline) -> str:
    """kv-plan's command for requests of a length the reader gives (TOKENS)."""
    return kv_plan_text(timeline, "TOKENS", "requests of that length a size holds")


def engine_kind(timeline: EngineTimeline) -> str:
    """Whose flags an action names: "vllm" for a recording of vLLM (its heartbeats say so;
    older vLLM recordings say nothing but give no waiting reasons), else "iterscope"."""
    source = str(timeline.facts.get("source", ""))
    if source.startswith("vllm") or (not source and not timeline.waiting_reasons_known):
        return "vllm"
    return "iterscope"


def kv_memory_flag(timeline: EngineTimeline) -> str:
    """The flag that sizes the KV cache, in the recorded engine's words."""
    return KV_MEMORY_FLAGS[engine_kind(timeline)]


def kv_memory_text(timeline: EngineTimeline) -> str:
    """How to give the KV cache more memory, in the recorded engine's flags."""
    return KV_MEMORY_TEXTS[engine_kind(timeline)]


def flag_text(timeline: EngineTimeline, name: str) -> str:
    """The engine's flag for a limit it reports, with the value it ran with when known:
    ``--max-num-seqs (now 4)``, else just ``--max-num-seqs``."""
    flag = "--" + name.replace("_", "-")
    value = timeline.facts.get(name)
    return f"{flag} (now {value})" if value else flag
