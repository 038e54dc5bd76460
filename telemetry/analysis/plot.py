"""`iterscope explain --plot out.png`: the recording over time, episodes shaded.

Four panels sharing the time axis (seconds from the start of the recording): KV cache usage,
running and waiting requests, context and generation tokens per iteration, iteration time.
Each episode is a shaded band across all panels, one colour per kind. Uses matplotlib's Agg
backend, so it needs no display.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from telemetry.analysis.episodes import Episode  # noqa: E402
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline  # noqa: E402

GAP_MIN_TIME = 0.05  # seconds without an iteration drawn as a gap in the lines

EPISODE_COLOURS = {
    "kv_saturation": "tab:red",
    "kv_cliff": "darkred",
    "preemption_storm": "tab:orange",
    "waiting": "gold",
    "stall": "tab:purple",
    "kv_leak": "tab:brown",
    "idle": "lightgrey",
    "telemetry_gap": "black",
    "long_prefill": "tab:cyan",
}


def plot_timelines(
    timelines: dict[int, EngineTimeline], episodes: dict[int, list[Episode]], path: Path
) -> Path:
    """Draw every engine's series on one figure and save it as PNG (or any matplotlib format)."""
    t0_ns = min(tl.first_ns for tl in timelines.values())
    figure, axes = plt.subplots(4, 1, figsize=(12, 10), sharex=True)
    kv_ax, queue_ax, token_ax, time_ax = axes
    for tl in timelines.values():
        suffix = f" (engine {tl.engine_index})" if len(timelines) > 1 else ""
        t = (tl.col("end_ns") - t0_ns) / NS_PER_S
        for ax, values, label in (
            (kv_ax, 100 * tl.kv_usage, "KV usage"),
            (queue_ax, tl.col("running"), "running"),
            (queue_ax, tl.col("waiting"), "waiting"),
        ):
            ax.plot(*_broken_at_gaps(t, values), label=label + suffix, lw=1,
                    drawstyle="steps-post")
        token_ax.plot(t, tl.col("ctx_tokens"), ".", ms=2, label=f"context tokens{suffix}")
        token_ax.plot(t, tl.col("gen_tokens"), ".", ms=2, label=f"generation tokens{suffix}")
        timed = tl.timed
        time_ax.plot(t[timed], tl.col("elapsed_ns")[timed] / 1e6, ".", ms=2,
                     label=f"iteration time{suffix}")
    kinds = _shade_episodes(axes, episodes, t0_ns)
    kv_ax.set_ylabel("KV cache usage (%)")
    kv_ax.set_ylim(-2, 102)
    queue_ax.set_ylabel("requests")
    token_ax.set_ylabel("tokens / iteration")
    time_ax.set_ylabel("iteration time (ms)")
    time_ax.set_xlabel("seconds from the start of the recording (record time)")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=7)
        ax.grid(alpha=0.3)
    if kinds:
        handles = [Patch(color=EPISODE_COLOURS.get(k, "grey"), alpha=0.3, label=k) for k in kinds]
        figure.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def _broken_at_gaps(t: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Insert a gap (NaN) where no iteration ran for a while, so idle time is not drawn as a
    line from the last value to the next one."""
    if len(t) < 2:
        return t, values.astype(float)
    steps = np.diff(t)
    gap_at = np.flatnonzero(steps > max(GAP_MIN_TIME, 20 * float(np.median(steps)))) + 1
    return (np.insert(t, gap_at, t[gap_at - 1] + 1e-9),
            np.insert(values.astype(float), gap_at, np.nan))


def _shade_episodes(axes, episodes: dict[int, list[Episode]], t0_ns: int) -> list[str]:
    kinds: list[str] = []
    for engine_episodes in episodes.values():
        for episode in engine_episodes:
            colour = EPISODE_COLOURS.get(episode.kind, "grey")
            start, end = (episode.start_ns - t0_ns) / NS_PER_S, (episode.end_ns - t0_ns) / NS_PER_S
            for ax in axes:
                ax.axvspan(start, max(end, start + 1e-3), color=colour, alpha=0.2, lw=0)
            if episode.kind not in kinds:
                kinds.append(episode.kind)
    return kinds
