"""`iterscope explain --plot out.png`: the recording over time, episodes shaded, findings marked.

Four panels share the time axis: KV cache usage, running and waiting requests, context and
generation tokens per iteration, iteration time. The time axis reads in local wall-clock time,
tick labels formatted exactly as the text of explain prints times (TimeAxis), so a time read
off the plot can be found in the text. Iteration time is on a log scale, so decode iterations
(milliseconds) and long prefills (seconds) are both readable; its points are coloured by what
the iteration ran: decode only, prefill only, or both (a mixed batch). Each episode is a band
across all panels, one colour per kind; each finding of the text is a numbered marker at its
worst instance, numbered and worded as in the text. Every colour drawn has a legend entry.
Uses matplotlib's Agg backend, so it needs no display.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from telemetry.analysis.clock import clock_text  # noqa: E402
from telemetry.analysis.episodes import Episode, Thresholds  # noqa: E402
from telemetry.analysis.findings import build_findings  # noqa: E402
from telemetry.analysis.plot_time import TimeAxis  # noqa: E402
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline  # noqa: E402

GAP_MIN_TIME = 0.05  # seconds without an iteration drawn as a gap in the lines
ENGINE_MARKERS = (".", "x", "+", "1", "2", "3")  # one marker per engine where colours are fixed
FINDING_COLOUR = "black"

# kind -> (colour, legend text); the legend text is the episode's title in explain's text.
EPISODE_STYLES = {
    "kv_saturation": ("tab:red", "KV cache saturated"),
    "kv_cliff": ("darkred", "KV cache cliff"),
    "preemption_storm": ("tab:orange", "Preemption storm"),
    "waiting": ("gold", "Requests waiting"),
    "stall": ("tab:purple", "Engine stalled / spinning"),
    "kv_leak": ("tab:brown", "KV blocks leaking"),
    "idle": ("lightgrey", "Idle"),
    "telemetry_gap": ("slategrey", "Telemetry gap / engine silent"),
    "long_prefill": ("tab:cyan", "Long prefill chunks"),
    "slow_decode": ("tab:gray", "Decode slowed from outside"),
    "costly_drafts": ("tab:pink", "Drafts cost more than they save"),
    "futile_speculation": ("tab:olive", "Speculative decoding gains nothing"),
}

# What an iteration ran -> (colour, legend text). A mixed batch has its own colour: its
# decoding requests waited for the prefill chunk beside them.
BATCH_STYLES = {
    "decode": ("tab:blue", "decode only"),
    "prefill": ("tab:green", "prefill only"),
    "mixed": ("magenta", "mixed: prefill + decode in one iteration"),
    "empty": ("tab:grey", "nothing scheduled"),
}


def draw_timelines(
    timelines: dict[int, EngineTimeline],
    episodes: dict[int, list[Episode]],
    thresholds: Thresholds,
) -> Figure:
    """Every engine's series, episodes (detected with ``thresholds``) and findings on one
    figure (not saved, not closed)."""
    axis = TimeAxis(timelines)
    figure, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    kv_ax, queue_ax, token_ax, time_ax = axes
    for number, tl in enumerate(timelines.values()):
        suffix = f" (engine {tl.engine_index})" if len(timelines) > 1 else ""
        marker = ENGINE_MARKERS[number % len(ENGINE_MARKERS)]
        t = axis.x(tl, tl.col("end_ns"))
        for ax, values, label in (
            (kv_ax, 100 * tl.kv_usage, "KV usage"),
            (queue_ax, tl.col("num_running_reqs"), "running"),
            (queue_ax, tl.col("num_waiting_reqs"), "waiting"),
        ):
            ax.plot(*_broken_at_gaps(t, values), label=label + suffix, lw=1, drawstyle="steps-post")
        _plot_tokens(token_ax, t, tl, marker, suffix)
        _plot_iteration_times(time_ax, t, tl, marker, suffix)
    _label_axes(axes, axis)  # before the findings' markers, which go in the figure's legend
    kinds = _shade_episodes(axes, axis, timelines, episodes)
    findings = _mark_findings(axes, axis, timelines, episodes, thresholds)
    _figure_legends(figure, kinds, findings)
    return figure


def plot_timelines(
    timelines: dict[int, EngineTimeline],
    episodes: dict[int, list[Episode]],
    thresholds: Thresholds,
    path: Path,
) -> Path:
    """Draw every engine's series on one figure and save it as PNG (or any matplotlib format)."""
    figure = draw_timelines(timelines, episodes, thresholds)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def batch_kinds(tl: EngineTimeline) -> np.ndarray:
    """Per iteration: 'decode', 'prefill', 'mixed' or 'empty' (BATCH_STYLES' keys)."""
    has_prefill, has_decode = tl.col("num_prefill_tokens") > 0, tl.col("num_decode_tokens") > 0
    return np.select(
        [has_prefill & has_decode, has_prefill, has_decode],
        ["mixed", "prefill", "decode"],
        default="empty",
    )


def _plot_tokens(ax, t: np.ndarray, tl: EngineTimeline, marker: str, suffix: str) -> None:
    for column, batch, label in (
        ("num_prefill_tokens", "prefill", "prefill tokens"),
        ("num_decode_tokens", "decode", "decode tokens"),
    ):
        ax.plot(
            t,
            tl.col(column),
            marker,
            ms=2,
            ls="none",
            color=BATCH_STYLES[batch][0],
            label=label + suffix,
        )


def _plot_iteration_times(ax, t: np.ndarray, tl: EngineTimeline, marker: str, suffix: str) -> None:
    """One colour per batch kind; untimed iterations and zero times (no log) are left out."""
    elapsed_s = tl.col("elapsed_ns") / NS_PER_S
    drawable = tl.timed & (elapsed_s > 0)
    kinds = batch_kinds(tl)
    for kind, (colour, label) in BATCH_STYLES.items():
        rows = drawable & (kinds == kind)
        if rows.any():
            ax.plot(
                t[rows],
                elapsed_s[rows],
                marker,
                ms=3,
                ls="none",
                color=colour,
                label=label + suffix,
            )
    ax.set_yscale("log")


def _time_tick_text(seconds: float, _position=None) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"


def _label_axes(axes, axis: TimeAxis) -> None:
    kv_ax, queue_ax, token_ax, time_ax = axes
    kv_ax.set_ylabel("KV cache usage (%)")
    kv_ax.set_ylim(-2, 102)
    queue_ax.set_ylabel("requests")
    token_ax.set_ylabel("tokens / iteration")
    time_ax.set_ylabel("iteration time (log scale)")
    time_ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    time_ax.yaxis.set_major_formatter(FuncFormatter(_time_tick_text))
    time_ax.yaxis.set_minor_formatter(NullFormatter())
    time_ax.set_xlabel(axis.title)
    time_ax.xaxis.set_major_formatter(FuncFormatter(axis.tick_text))
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=7)
        ax.grid(alpha=0.3)


def _broken_at_gaps(t: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Insert a gap (NaN) where no iteration ran for a while, so idle time is not drawn as a
    line from the last value to the next one."""
    if len(t) < 2:
        return t, values.astype(float)
    steps = np.diff(t)
    gap_at = np.flatnonzero(steps > max(GAP_MIN_TIME, 20 * float(np.median(steps)))) + 1
    return (
        np.insert(t, gap_at, t[gap_at - 1] + 1e-9),
        np.insert(values.astype(float), gap_at, np.nan),
    )


def _shade_episodes(
    axes, axis: TimeAxis, timelines: dict[int, EngineTimeline], episodes: dict[int, list[Episode]]
) -> list[str]:
    """A band per episode on every panel; returns the kinds drawn, in order of appearance."""
    kinds: list[str] = []
    for engine_index, engine_episodes in episodes.items():
        tl = timelines[engine_index]
        for episode in engine_episodes:
            colour = EPISODE_STYLES.get(episode.kind, ("grey", episode.kind))[0]
            start, end = axis.x(tl, [episode.start_ns, episode.end_ns])
            for ax in axes:
                ax.axvspan(start, max(end, start + 1e-3), color=colour, alpha=0.2, lw=0)
            if episode.kind not in kinds:
                kinds.append(episode.kind)
    return kinds


def _mark_findings(
    axes,
    axis: TimeAxis,
    timelines: dict[int, EngineTimeline],
    episodes: dict[int, list[Episode]],
    thresholds: Thresholds,
) -> list[Line2D]:
    """A numbered marker above the top panel, and a dotted line through every panel, at each
    finding's worst instance; numbered and timed as in explain's text (costliest first)."""
    top_ax = axes[0]
    markers = []
    for engine_index, engine_episodes in episodes.items():
        tl = timelines[engine_index]
        prefix = f"engine {engine_index}, " if len(timelines) > 1 else ""
        for number, finding in enumerate(build_findings(tl, engine_episodes, thresholds), 1):
            (x,) = axis.x(tl, [finding.worst.start_ns])
            for ax in axes:
                ax.axvline(x, color=FINDING_COLOUR, ls=":", lw=1)
            label = (
                f"{prefix}{number}. {finding.title} "
                f"(worst {clock_text(tl, finding.worst.start_ns)})"
            )
            (marker,) = top_ax.plot(
                [x],
                [1.0],
                "v",
                color=FINDING_COLOUR,
                ms=8,
                clip_on=False,
                transform=top_ax.get_xaxis_transform(),
                label=label,
                gid=f"finding {engine_index}.{number}",
            )
            top_ax.annotate(
                f"{number}",
                (x, 1.0),
                xycoords=top_ax.get_xaxis_transform(),
                xytext=(0, 7),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color=FINDING_COLOUR,
            )
            markers.append(marker)
    return markers


def _figure_legends(figure: Figure, kinds: list[str], findings: list[Line2D]) -> None:
    """Episode colours at the top, finding markers (as numbered in the text) at the bottom."""
    top = 0.96
    if kinds:
        handles = [
            Patch(
                color=EPISODE_STYLES.get(k, ("grey", k))[0],
                alpha=0.3,
                label=EPISODE_STYLES.get(k, ("grey", k))[1],
            )
            for k in kinds
        ]
        figure.legend(handles=handles, loc="upper center", ncol=min(len(handles), 5), fontsize=8)
        top -= 0.025 * ((len(handles) - 1) // 5)
    bottom = 0.0
    if findings:
        figure.legend(
            handles=findings,
            loc="lower center",
            ncol=1,
            fontsize=8,
            title="findings (as numbered in the text), at the worst instance",
        )
        bottom = 0.03 + 0.022 * len(findings)
    figure.tight_layout(rect=(0, bottom, 1, top))
