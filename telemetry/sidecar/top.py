"""`iterscope top [--url URL] [--once] [--interval S]`: a running sidecar's engines, like `top`.

Each frame is what two scrapes of the sidecar's metrics port say (telemetry/sidecar/scrape.py):
rates and distributions over the window between them, the rest as the newest one has it.

    scrape 0 ---- interval ---- scrape 1 ---- interval ---- scrape 2
    frame 0 (no window)         frame 1: 1 - 0              frame 2: 2 - 1

    iterations/s         increase of iterscope_iterations_total / window
    decoding/iteration   increase of iteration_generation_requests' _sum / its _count
    drafts               increases of spec_decode_{accepted_tokens,draft_tokens,drafts}_total:
                         accepted / draft tokens, 1 + accepted / drafts (vLLM's figures);
                         only for an engine that has scored drafts (speculative decoding)
    TTFT, ITL p50/p99    histogram_quantile over the increase of each _bucket
    status, running, waiting by reason, KV usage, findings: the newest scrape's
    source               engine_info's source and version labels (who reports, which engine)

A frame without a scrape before it (the live view's first, or its first after the sidecar
came back) says "n/a" for the window's figures; a window without a new observation says "–".
``--once`` scrapes twice, ``--interval`` apart, and prints one frame. The live view redraws
over the last frame with ANSI home and clear (no curses) only when stdout is a terminal;
otherwise it prints the frames one after another.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import TextIO

from telemetry.analysis.findings import cost_phrase
from telemetry.analysis.live_findings import RECENT_CLOSED
from telemetry.analysis.words import plural
from telemetry.sidecar.metrics_http import metrics_url
from telemetry.sidecar.scrape import (
    Samples,
    Scrape,
    SidecarUnreachable,
    base_url,
    bucket_increase,
    bucket_quantile,
    by_label,
    cumulative_buckets,
    increase,
    label_sets,
    scrape,
    value,
)
from telemetry.sidecar.sinks.prometheus import DEFAULT_METRICS_HOST, DEFAULT_METRICS_PORT

DEFAULT_URL = metrics_url(DEFAULT_METRICS_HOST, DEFAULT_METRICS_PORT).removesuffix("/metrics")
NO_READ = "n/a"  # no scrape before this one: nothing to take a difference from
NO_DATA = "–"  # a window without a new observation
MAX_CLOSED_SHOWN = 3  # per engine, newest first
# Home, then each line cleared to its end, then the rest of the screen: no flicker, no curses.
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


# --------------------------------------------------------------------------------------------
# A frame


def seconds_text(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def clock_text(unix_s: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s)) if unix_s else "?"


def _status(after: Samples) -> str:
    states = [state for state, on in by_label(after, "engine_state", "state").items() if on]
    return states[0] if states else "unknown"


def _iterations_grown(before: Samples, after: Samples) -> float | None:
    """Iterations between two scrapes (None: no increase to read)."""
    return increase(value(before, "iterations_total"), value(after, "iterations_total"))


def _status_text(status: str, before: Samples | None, after: Samples) -> str:
    """The status, and for a stalled engine whose iterations go on (they schedule nothing:
    the loop spins, explain's "Engine spinning") that it spins, not "stalled" beside a rate."""
    if status != "stalled" or before is None:
        return status
    return (
        "stalled: spinning, its iterations schedule nothing"
        if _iterations_grown(before, after)
        else status
    )


def _source(after: Samples) -> str | None:
    """The engine_info labels of who reports and which engine it is ("vllm-stat-logger,
    vllm 0.34.0"); None before a heartbeat named them."""
    for labels in label_sets(after, "engine_info"):
        said = ", ".join(fact for fact in (labels.get("source"), labels.get("version")) if fact)
        return said or None
    return None


def _rate(before: Samples | None, after: Samples, window_s: float) -> str:
    if before is None:
        return NO_READ
    grown = _iterations_grown(before, after)
    return NO_DATA if grown is None else f"{grown / window_s:.1f}/s"


def _decode_batch(before: Samples | None, after: Samples) -> str:
    if before is None:
        return NO_READ
    name = "iteration_generation_requests"
    total = increase(value(before, f"{name}_sum"), value(after, f"{name}_sum"))
    count = increase(value(before, f"{name}_count"), value(after, f"{name}_count"))
    return f"{total / count:.1f}" if total is not None and count else NO_DATA


def _quantiles(before: Samples | None, after: Samples, histogram: str) -> str:
    if before is None:
        return f"p50 {NO_READ}  p99 {NO_READ}"
    window = bucket_increase(
        cumulative_buckets(before, histogram), cumulative_buckets(after, histogram)
    )
    texts = []
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        estimate = bucket_quantile(q, window) if window else None
        texts.append(f"{name} {NO_DATA if estimate is None else seconds_text(estimate)}")
    return "  ".join(texts)


def _drafts(before: Samples | None, after: Samples) -> str | None:
    """Speculative decoding over the window; None for an engine that never scored a draft
    (the sidecar has its counters from the first draft on: absent before, they were 0)."""
    if value(after, "spec_decode_drafts_total") is None:
        return None
    if before is None:
        return NO_READ
    drafts, draft_tokens, accepted = (
        increase(value(before, name) or 0.0, value(after, name))
        for name in (
            "spec_decode_drafts_total",
            "spec_decode_draft_tokens_total",
            "spec_decode_accepted_tokens_total",
        )
    )
    if not drafts or not draft_tokens or accepted is None:
        return NO_DATA
    return (
        f"{accepted / draft_tokens:.1%} of draft tokens accepted, mean acceptance length "
        f"{1 + accepted / drafts:.2f}"
    )


def _waiting(after: Samples) -> str:
    total = value(after, "requests_waiting")
    reasons = by_label(after, "requests_waiting_by_reason", "reason")
    named = ", ".join(f"{reason} {count:.0f}" for reason, count in reasons.items() if count)
    head = NO_DATA if total is None else f"{total:.0f}"
    return f"{head} ({named})" if named else head


def _kv_usage(after: Samples) -> str:
    ratio = value(after, "kv_cache_usage_ratio")
    return NO_DATA if ratio is None else f"{ratio * 100:.1f}%"


def _running(after: Samples) -> str:
    running = value(after, "requests_running")
    return NO_DATA if running is None else f"{running:.0f}"


def _cost(finding: dict) -> str:
    """As `explain` and the log line print a finding's cost."""
    return cost_phrase(finding.get("cost_request_seconds") or 0.0, finding.get("cost_label", ""))


def _wrapped(indent: str, text: str, width: int | None) -> list[str]:
    """``text`` after ``indent``, wrapped to ``width`` with 2 more spaces on the lines it
    continues on (None: one line, however long)."""
    if width is None:
        return [indent + text]
    return textwrap.wrap(
        text,
        max(width, 40),
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,  # nor flags at their hyphens: --max-num-batched-tokens
        break_on_hyphens=False,
    )


def closed_groups(findings: list[dict]) -> list[list[dict]]:
    """The closed findings (newest first, as /findings gives them) by title, the group of
    the newest first: a condition that came and went is one line, as in the log."""
    groups: dict[str, list[dict]] = {}
    for finding in findings:
        if finding.get("state") == "closed":
            groups.setdefault(str(finding.get("title")), []).append(finding)
    return list(groups.values())[:MAX_CLOSED_SHOWN]


def _closed_line(group: list[dict], all_kept: bool) -> str:
    """One title's closed findings; ``all_kept``: the sidecar still holds every closed one
    (it keeps the newest RECENT_CLOSED), so their count is not a lower bound."""
    newest = group[0]
    since = clock_text(newest.get("since_unix"))
    lasted = f"lasted {newest.get('duration_s', 0):.1f} s"
    if len(group) == 1 and all_kept:
        return f"- {newest.get('title')}  {since}, {lasted}, {_cost(newest)}"
    cost = sum(f.get("cost_request_seconds") or 0 for f in group)
    times = plural(len(group), "time") + ("" if all_kept else " or more")
    return (
        f"- {newest.get('title')}  {times}, the last {since} ({lasted}), "
        f"{_cost({**newest, 'cost_request_seconds': cost})} in all"
    )


def finding_lines(findings: list[dict], width: int | None) -> list[str]:
    """One engine's open findings (title, since, cost, evidence, action), then its newest
    closed ones briefly (title, since, length, cost), those of one title in one line."""
    open_findings = [f for f in findings if f.get("state") == "open"]
    closed = closed_groups(findings)
    lines = [f"  open findings: {len(open_findings) or 'none'}"]
    for finding in open_findings:
        since = clock_text(finding.get("since_unix"))
        head = f"! {finding.get('title')}  since {since} ({finding.get('duration_s', 0):.1f} s)"
        lines += _wrapped("    ", f"{head}, {_cost(finding)}", width)
        lines += _wrapped("      ", f"evidence: {finding.get('evidence', '')}", width)
        lines += _wrapped("      ", f"action: {finding.get('action', '')}", width)
    if closed:
        lines.append("  recently closed:")
    all_kept = sum(f.get("state") == "closed" for f in findings) < RECENT_CLOSED
    for group in closed:
        lines += _wrapped("    ", _closed_line(group, all_kept), width)
    return lines


def engine_lines(index: int, before: Scrape | None, after: Scrape, width: int | None) -> list[str]:
    """One engine's block of a frame (``before``: the scrape before, None if none)."""
    samples = after.engines[index]
    previous = before.engines.get(index) if before is not None else None
    window_s = after.time_s - before.time_s if before is not None else 0.0
    status = _status(samples)
    # A dead or closed engine's gauges hold what it last reported, not what it holds now.
    stale = "  (last reported, before it went silent)" if status in ("dead", "closed") else ""
    status_text = _status_text(status, previous, samples)
    lines = [f"engine {index:03d}  {after.model_names.get(index) or '?'}  {status_text}"]
    source = _source(samples)
    if source is not None:
        lines.append(f"  source      {source}")
    lines += [
        f"  iterations  {_rate(previous, samples, window_s)}",
        f"  batch       {_running(samples)} running, "
        f"{_decode_batch(previous, samples)} decoding per iteration{stale}",
        f"  waiting     {_waiting(samples)}{stale}",
        f"  KV cache    {_kv_usage(samples)} used{stale}",
        f"  TTFT        {_quantiles(previous, samples, 'time_to_first_token_seconds')}",
        f"  ITL         {_quantiles(previous, samples, 'inter_token_latency_seconds')}",
    ]
    drafts = _drafts(previous, samples)
    if drafts is not None:
        lines.append(f"  drafts      {drafts}")
    engines = {engine.get("engine"): engine for engine in after.findings.get("engines", [])}
    if engines.get(index, {}).get("live_findings") is False:
        return [*lines, "  findings    off (the sidecar runs --no-live-findings)"]
    findings = [f for f in after.findings.get("findings", []) if f.get("engine") == index]
    return lines + finding_lines(findings, width)


def frame(url: str, before: Scrape | None, after: Scrape, width: int | None) -> str:
    """The whole view: a header, then each engine's block."""
    window = NO_READ if before is None else f"{after.time_s - before.time_s:.1f} s"
    lines = [f"iterscope top  {url}  {clock_text(time.time())}  window {window}", ""]
    if not after.engines:
        lines.append("no engine yet: none has sent this sidecar a heartbeat")
    for index in sorted(after.engines):
        lines += [*engine_lines(index, before, after, width), ""]
    return "\n".join(lines).rstrip("\n")


# --------------------------------------------------------------------------------------------
# The command


def write_frame(out: TextIO, text: str, redraw: bool) -> None:
    """Print a frame; ``redraw`` (a terminal): over the last one, with ANSI home and clear,
    cut to the terminal's size (a line the terminal wrapped, or a frame that scrolled, would
    not be drawn over whole)."""
    if redraw:
        columns, rows = shutil.get_terminal_size()
        lines = [line[:columns] for line in text.split("\n")[: max(rows - 1, 1)]]
        text = HOME + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW
    else:
        text += "\n\n"
    out.write(text)
    out.flush()


def terminal_width(out: TextIO) -> int | None:
    """The columns to wrap long lines to: a terminal's, or None (one line each) otherwise."""
    return shutil.get_terminal_size().columns if out.isatty() else None


def show_once(url: str, interval_s: float, out: TextIO) -> int:
    """Two scrapes ``interval_s`` apart, one frame, no terminal codes."""
    before = scrape(url)
    time.sleep(interval_s)
    write_frame(out, frame(url, before, scrape(url), terminal_width(out)), redraw=False)
    return 0


def watch(url: str, interval_s: float, out: TextIO) -> int:
    """A frame every ``interval_s`` until Ctrl-C. The first scrape must succeed; a later one
    that fails is shown and retried, and the frame after it has no window."""
    redraw = out.isatty()
    before: Scrape | None = None
    after: Scrape | None = scrape(url)
    problem: SidecarUnreachable | None = None
    while True:
        if after is None:
            write_frame(out, f"iterscope top  {url}: {problem}; retrying", redraw)
        else:
            write_frame(out, frame(url, before, after, terminal_width(out)), redraw)
        time.sleep(interval_s)
        before = after
        try:
            after = scrape(url)
        except SidecarUnreachable as error:
            after, problem = None, error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope top",
        description="a live view of a running sidecar's engines: status, iteration rate, "
        "batch, waiting, KV usage, TTFT and ITL, open findings and their actions",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the sidecar's metrics address (its --metrics-host/--metrics-port; "
        "default %(default)s)",
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between scrapes: the refresh, and the window that rates and latencies "
        "are taken over (default %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    url = base_url(args.url)
    try:
        if args.once:
            return show_once(url, args.interval, sys.stdout)
        return watch(url, args.interval, sys.stdout)
    except SidecarUnreachable as error:
        print(
            f"iterscope top: cannot read the sidecar: {error}\n"
            "Is `iterscope sidecar` (or `iterscope serve`, which starts one) running, and "
            f"is --url its metrics address (--metrics-port, {DEFAULT_METRICS_PORT} by default)?",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
