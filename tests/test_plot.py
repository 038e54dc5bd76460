"""`explain --plot`: what the figure shows, read from matplotlib's Figure and Axes objects."""

import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_rgb
from scenarios import synthetic
from scenarios.synthetic import Cost, Simulator, arrivals

from telemetry.analysis.clock import clock_text
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.explain import main
from telemetry.analysis.findings import build_findings
from telemetry.analysis.plot import batch_kinds, draw_timelines
from telemetry.analysis.plot_time import TimeAxis
from telemetry.analysis.timeline import build_timelines
from telemetry.lane.record import IterationRecord

CLOCK = re.compile(r"^\d\d:\d\d:\d\d\.\d{3}$")


def long_prefills() -> Simulator:
    """Decoding requests (tens of ms per iteration) and two prompts whose chunks take ~1 s."""
    cost = Cost(base_time=0.010, context_token_time=500e-6, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=4000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests(arrivals(2, 20), num_prompt=32, num_output=150)
    sim.add_requests([5.0, 12.0], num_prompt=6000, num_output=10)
    return sim.run(22)


@pytest.fixture(scope="module")
def story2():
    return synthetic.story2_leak()


def drawn(sim: Simulator):
    timelines = build_timelines(sim.messages)
    episodes = {k: detect_episodes(tl) for k, tl in timelines.items()}
    figure = draw_timelines(timelines, episodes, Thresholds())
    figure.canvas.draw()
    return timelines, episodes, figure


@pytest.fixture
def close_figures():
    yield
    plt.close("all")


def artist_colours(ax) -> set[tuple]:
    colours = {to_rgb(line.get_color()) for line in ax.get_lines()}
    colours |= {to_rgb(patch.get_facecolor()) for patch in ax.patches}
    for collection in ax.collections:
        colours |= {tuple(c[:3]) for c in collection.get_facecolors()}
    return colours


def legend_colours(figure) -> set[tuple]:
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.axes if ax.get_legend()]
    colours = set()
    for legend in legends:
        for handle in legend.legend_handles:
            getter = getattr(handle, "get_color", None) or handle.get_facecolor
            colours.add(to_rgb(getter()))
    return colours


def finding_markers(figure) -> list:
    return [
        line
        for ax in figure.axes
        for line in ax.get_lines()
        if (line.get_gid() or "").startswith("finding")
    ]


def test_iteration_time_is_on_a_log_scale_spanning_ms_and_seconds(close_figures):
    timelines, _, figure = drawn(long_prefills())
    time_ax = figure.axes[3]
    assert time_ax.get_yscale() == "log"
    elapsed_s = timelines[0].col("elapsed_ns") / 1e9
    assert elapsed_s.min() < 0.05 and elapsed_s.max() > 0.5  # both are on the axis
    low, high = time_ax.get_ylim()
    assert low <= elapsed_s.min() and high >= elapsed_s.max()
    labels = [t.get_text() for t in time_ax.get_yticklabels() if t.get_text()]
    assert any(label.endswith(" ms") for label in labels)
    assert any(label.endswith(" s") and not label.endswith(" ms") for label in labels)


def test_every_colour_drawn_has_a_legend_entry(story2, close_figures):
    for sim in (story2, long_prefills()):
        _, _, figure = drawn(sim)
        drawn_colours = set().union(*(artist_colours(ax) for ax in figure.axes))
        missing = drawn_colours - legend_colours(figure)
        assert not missing, missing


def test_mixed_batches_have_their_own_colour_and_legend_entry(close_figures):
    sim = long_prefills()
    timelines, _, figure = drawn(sim)
    kinds = batch_kinds(timelines[0])
    records = [m for m in sim.messages if isinstance(m, IterationRecord)]
    mixed = [r.num_prefill_tokens > 0 and r.num_decode_tokens > 0 for r in records]
    assert (kinds == "mixed").tolist() == mixed and any(mixed)
    time_ax = figure.axes[3]
    by_label = dict(zip(*reversed(time_ax.get_legend_handles_labels()), strict=True))
    mixed_line = by_label["mixed: prefill + decode in one iteration"]
    assert len(mixed_line.get_xdata()) == sum(mixed)
    others = [line for label, line in by_label.items() if not label.startswith("mixed")]
    assert all(line.get_color() != mixed_line.get_color() for line in others)


def test_x_ticks_read_as_the_text_of_explain(story2, tmp_path, capsys, close_figures):
    path = story2.write(tmp_path / "story2.jsonl")
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    timelines, _, figure = drawn(story2)
    tl = timelines[0]
    time_ax = figure.axes[3]
    formatter = time_ax.xaxis.get_major_formatter()
    (x_last,) = TimeAxis(timelines).x(tl, [tl.last_ns])
    assert f"-> {formatter(x_last)}\n" in text  # the "recorded FIRST -> LAST" line
    labels = [t.get_text() for t in time_ax.get_xticklabels() if t.get_text()]
    assert len(labels) >= 3 and all(CLOCK.match(label) for label in labels), labels
    first = text.split("recorded ")[1].split(" -> ")[0].split()[1]
    inside = [
        label
        for label, x in zip(labels, time_ax.get_xticks(), strict=False)
        if time_ax.get_xlim()[0] <= x <= time_ax.get_xlim()[1]
    ]
    assert all(first <= label <= formatter(x_last) for label in inside)


def test_one_marker_per_finding_at_its_worst_time_as_in_the_text(
    story2, tmp_path, capsys, close_figures
):
    path = story2.write(tmp_path / "story2.jsonl")
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    timelines, episodes, figure = drawn(story2)
    tl = timelines[0]
    findings = build_findings(tl, episodes[0], Thresholds())
    markers = finding_markers(figure)
    assert len(findings) >= 3 and len(markers) == len(findings)
    (top_legend,) = [g for g in figure.legends if "findings" in g.get_title().get_text()]
    assert [t.get_text() for t in top_legend.get_texts()] == [m.get_label() for m in markers]
    axis = TimeAxis(timelines)
    lines, whole = text.splitlines(), []
    for number, (finding, marker) in enumerate(zip(findings, markers, strict=True), 1):
        worst_text = clock_text(tl, finding.worst.start_ns)
        assert marker.get_label() == f"{number}. {finding.title} (worst {worst_text})"
        assert marker.get_xdata()[0] == axis.x(tl, [finding.worst.start_ns])[0]
        headline = next(
            (i for i, line in enumerate(lines) if line.startswith(f"  {number}. ")), None
        )
        if headline is not None and lines[headline + 1].startswith("      worst"):  # shown whole
            assert lines[headline + 1].startswith(f"      worst     {worst_text} (")
            whole.append(number)
    assert whole[:1] == [1]  # the top finding always is


def test_a_healthy_run_has_no_finding_marker(close_figures):
    _, _, figure = drawn(synthetic.healthy())
    assert finding_markers(figure) == [] and figure.legends == []


def test_without_a_clock_anchor_ticks_count_seconds_as_the_text_does(close_figures):
    sim = synthetic.healthy()
    sim.messages = [m for m in sim.messages if isinstance(m, IterationRecord)]  # no heartbeat
    timelines, _, figure = drawn(sim)
    time_ax = figure.axes[3]
    labels = [t.get_text() for t in time_ax.get_xticklabels() if t.get_text()]
    assert labels and all(re.match(r"^\+-?\d+\.\d{3} s$", label) for label in labels), labels
    tl = timelines[0]
    (x_last,) = TimeAxis(timelines).x(tl, [tl.last_ns])
    assert time_ax.xaxis.get_major_formatter()(x_last) == clock_text(tl, tl.last_ns)
    assert np.isclose(x_last, (tl.last_ns - tl.first_ns) / 1e9)
