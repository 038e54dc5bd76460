"""The metric names the dashboards and alerts read: the contract with the Prometheus sink.

Generated from the sink's own tables (telemetry/sidecar/sinks/prometheus.py: GAUGES, COUNTERS,
HISTOGRAMS, SIDECAR_COUNTERS), so a series the sink stops serving leaves this set, and a
dashboard panel or alert rule that still queries it fails its test (tests/test_dashboards.py,
tests/test_alerts.py). Every series carries the labels ``engine`` (engine index as a string)
and ``model_name``; sidecar-level series (``iterscope_frames_undecodable_total`` and the like)
have both empty.
"""

from __future__ import annotations

from telemetry.sidecar.sinks.prometheus import series_names

# Names as they appear in PromQL: histograms as their _bucket, _sum and _count series.
SERIES_NAMES = frozenset(series_names())
