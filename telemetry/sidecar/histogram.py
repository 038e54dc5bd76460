"""A cheap histogram for the sidecar's ingest thread: one bisect and two adds per observation.

Unlike prometheus_client's Histogram it takes no lock and keeps per-bucket (not cumulative)
counts, so an observation touches one list slot. Cumulative counts are built only when asked
(at scrape time):

    bounds        [0.01, 0.1, 1.0]                  upper bounds, strictly increasing
    bucket_counts [  n0,  n1,  n2,  n_inf]          n_i = observations with
                                                    bounds[i-1] < v <= bounds[i]
    cumulative    [("0.01", n0), ("0.1", n0+n1), ("1.0", n0+n1+n2), ("+Inf", total)]

Invariant: len(bucket_counts) == len(bounds) + 1 (the last slot is the +Inf bucket), and the
total count is always sum(bucket_counts), so `_count` equals the `+Inf` bucket in every scrape.
One thread observes; another may read. A reader copies the list in one step (atomic under the
GIL), so it sees a consistent set of counts; `sum` may lag that copy by one observation.

Histograms of small non-negative integers (tokens or requests per iteration) can skip the
bisect: ``count_index[n] == bisect_left(bounds, n)`` for every int ``0 <= n < MAX_COUNT_INDEX``,
a tuple lookup that costs a third of a bisect of an int among float bounds.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

MAX_COUNT_INDEX = 1 << 14  # count_index entries: built once per distinct bounds, ~2 ms, 128 KiB


def check_bounds(bounds: Sequence[float]) -> tuple[float, ...]:
    """Return bounds as a tuple of floats; raise ValueError unless finite and increasing."""
    values = tuple(float(bound) for bound in bounds)
    if not values:
        raise ValueError("a histogram needs at least one bucket bound")
    for bound in values:
        if not math.isfinite(bound):
            raise ValueError(f"bucket bounds must be finite (+Inf is implied), got {bound}")
    for lower, upper in zip(values[:-1], values[1:], strict=True):
        if upper <= lower:
            raise ValueError(f"bucket bounds must increase strictly, got {lower} then {upper}")
    return values


class Histogram:
    """Counts of observations per bucket, and their sum."""

    __slots__ = ("bounds", "bucket_counts", "sum", "count_index")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = check_bounds(bounds)
        self.bucket_counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count_index = build_count_index(self.bounds)

    def observe(self, value: float, weight: int = 1) -> None:
        """Record ``weight`` observations of ``value`` (weight > 0)."""
        self.bucket_counts[bisect_left(self.bounds, value)] += weight
        self.sum += value * weight

    def observe_count(self, count: int) -> None:
        """``observe(count)`` for an int ``count >= 0`` (a record's Count field), by lookup."""
        index = self.count_index
        self.bucket_counts[
            index[count] if count < MAX_COUNT_INDEX else bisect_left(self.bounds, count)
        ] += 1
        self.sum += count

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    def cumulative_buckets(self) -> tuple[list[tuple[str, int]], float]:
        """(``[(le, cumulative count), ...]`` ending with ``+Inf``, sum) for exposition."""
        counts = list(self.bucket_counts)
        total_sum = self.sum
        buckets = []
        running = 0
        for bound, count in zip(self.bounds, counts[:-1], strict=True):
            running += count
            buckets.append((format_bound(bound), running))
        buckets.append(("+Inf", running + counts[-1]))
        return buckets, total_sum


@functools.cache
def build_count_index(bounds: tuple[float, ...]) -> tuple[int, ...]:
    """``bisect_left(bounds, n)`` for n = 0 .. MAX_COUNT_INDEX - 1; larger counts are bisected.

    Shared (read-only) by every histogram with these bounds.
    """
    return tuple(bisect_left(bounds, count) for count in range(MAX_COUNT_INDEX))


@functools.cache
def format_bound(bound: float) -> str:
    """The `le` label text, the way prometheus_client (and so vLLM) writes it: 1.0, 0.005,
    2560.0, 1e+06. One spelling across a fleet keeps the buckets of one bound one series."""
    return floatToGoString(float(bound))
