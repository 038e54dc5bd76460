"""Moved to tests/helpers/ (prom.py, processes.py, net.py); this module only re-exports them
for the files that still import it from here: bench/prometheus_ingest.py and
tests/test_vllm_scheduler_live.py. Import from tests.helpers instead; delete this file when
nothing imports it."""

from tests.helpers.net import free_port
from tests.helpers.processes import METRICS_URL_LINE, start_metrics_sidecar, stop_process
from tests.helpers.prom import (
    PrometheusHandle,
    ReadyServer,
    find_prometheus,
    http_get_json,
    start_prometheus,
    start_server,
    write_config,
)

ServerProcess = ReadyServer  # its name here before the move

__all__ = [
    "METRICS_URL_LINE", "PrometheusHandle", "ReadyServer", "ServerProcess", "find_prometheus",
    "free_port", "http_get_json", "start_metrics_sidecar", "start_prometheus", "start_server",
    "stop_process", "write_config",
]
