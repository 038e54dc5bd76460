"""Scraping a sidecar's metrics port from outside, as `iterscope top` does, and what two
scrapes say about the time between them.

A scrape is ``GET /metrics`` (the Prometheus text, parsed with prometheus_client's parser) and
``GET /findings`` (the live findings' JSON), both served by the Prometheus sink
(telemetry/sidecar/sinks/prometheus.py). Each engine's samples are kept by sample name and
labels; the sidecar's own series (empty engine label) are left out.

Counters and histograms say something only as differences between two scrapes, which is how
Prometheus reads them too:

    increase(before, after)          after - before; after alone if it went down (a reset:
                                     the engine left the sidecar's view and came back, or the
                                     sidecar restarted), as rate() takes it
    bucket_increase(before, after)   the same per cumulative bucket (still cumulative)
    bucket_quantile(q, buckets)      histogram_quantile: linear within the bucket the rank
                                     falls in; the highest finite bound if it falls in +Inf
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from telemetry.sidecar.sinks.prometheus import PREFIX

READ_TIMEOUT_S = 5.0

# One engine's samples: sample name -> (its labels but engine and model_name, sorted) -> value.
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
Buckets = list[tuple[float, float]]  # cumulative (upper bound, count), ending with +Inf


class SidecarUnreachable(Exception):
    """The sidecar did not answer at the URL, or answered with something else."""


@dataclass
class Scrape:
    """One scrape of a sidecar. ``time_s`` is monotonic, taken when /metrics had answered;
    ``engines`` and ``model_names`` are keyed by engine index; ``findings`` is /findings."""

    time_s: float
    engines: dict[int, Samples]
    model_names: dict[int, str]
    findings: dict


# The sidecar is reached directly, as Prometheus reaches it: an http_proxy meant for the
# internet must not take a request for 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def base_url(url: str) -> str:
    """``--url`` as given, or with /metrics (as the sidecar logs it), or without a scheme."""
    url = url.strip().rstrip("/").removesuffix("/metrics")
    return url if "://" in url else f"http://{url}"


def _get(url: str, timeout_s: float) -> str:
    try:
        with _OPENER.open(url, timeout=timeout_s) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:  # before URLError: it is one
        raise SidecarUnreachable(f"{url} answered HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        raise SidecarUnreachable(f"{url}: {getattr(error, 'reason', error)}") from None


def parse_metrics(text: str) -> tuple[dict[int, Samples], dict[int, str]]:
    """Each engine's samples and model name; the sidecar's own series (engine "") are left
    out. ValueError if ``text`` is not the Prometheus text format."""
    engines: dict[int, Samples] = {}
    model_names: dict[int, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            engine = labels.pop("engine", "")
            if not engine.isdigit():
                continue
            model_names[int(engine)] = labels.pop("model_name", "")
            by_labels = engines.setdefault(int(engine), {}).setdefault(sample.name, {})
            by_labels[tuple(sorted(labels.items()))] = sample.value
    return engines, model_names


def scrape(url: str, timeout_s: float = READ_TIMEOUT_S) -> Scrape:
    """/metrics and /findings of the sidecar at ``url`` (a base_url); SidecarUnreachable if
    either fails or is not what a sidecar serves."""
    metrics_text = _get(f"{url}/metrics", timeout_s)
    time_s = time.monotonic()
    findings_text = _get(f"{url}/findings", timeout_s)
    try:
        engines, model_names = parse_metrics(metrics_text)
        findings = json.loads(findings_text)
        if not isinstance(findings, dict):
            raise ValueError("/findings is not a JSON object")
    except ValueError as error:
        raise SidecarUnreachable(f"{url} does not serve a sidecar's metrics: {error}") from None
    return Scrape(time_s, engines, model_names, findings)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample ``PREFIX + name`` with exactly these labels (besides engine, model_name)."""
    return samples.get(PREFIX + name, {}).get(tuple(sorted(labels.items())))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """The samples of ``PREFIX + name`` by their value of ``label``, in exposition order."""
    found = {}
    for key, number in samples.get(PREFIX + name, {}).items():
        labels = dict(key)
        if label in labels:
            found[labels[label]] = number
    return found


def label_sets(samples: Samples, name: str) -> list[dict[str, str]]:
    """The labels of each sample of ``PREFIX + name`` (besides engine, model_name)."""
    return [dict(key) for key in samples.get(PREFIX + name, {})]


def cumulative_buckets(samples: Samples, histogram: str) -> Buckets:
    """A histogram's cumulative buckets, by upper bound (``+Inf`` last)."""
    return sorted(
        (float(bound), count)
        for bound, count in by_label(samples, f"{histogram}_bucket", "le").items()
    )


def increase(before: float | None, after: float | None) -> float | None:
    """How much a counter grew; its newest value if it went down (a reset); None if either
    scrape lacks it."""
    if before is None or after is None:
        return None
    return after - before if after >= before else after


def bucket_increase(before: Buckets, after: Buckets) -> Buckets | None:
    """Each cumulative bucket's increase (still cumulative); ``after`` whole if any bucket went
    down (a reset); None if either scrape lacks the histogram or their bounds differ."""
    if not before or not after or [b for b, _ in before] != [b for b, _ in after]:
        return None
    pairs = list(zip(before, after, strict=True))
    if any(new < old for (_, old), (_, new) in pairs):
        return after
    return [(bound, new - old) for (bound, old), (_, new) in pairs]


def bucket_quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of cumulative ``buckets`` as Prometheus'
    histogram_quantile estimates it: linear within the bucket the rank falls in (the first
    starting at 0), the highest finite bound if it falls in +Inf. None without observations."""
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for index, (upper_bound, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            if index == 0 and upper_bound <= 0:  # Prometheus: no interval to interpolate in
                return upper_bound
            fraction = (rank - lower_count) / (count - lower_count)
            return lower_bound + (upper_bound - lower_bound) * fraction
        lower_bound, lower_count = upper_bound, count
    return lower_bound  # buckets not cumulative: not from a sidecar
