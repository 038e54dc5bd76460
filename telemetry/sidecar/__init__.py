"""The live sidecar: ingest (per-engine liveness and loss accounting) and its sinks (log,
Prometheus, OpenTelemetry, NVTX, JSONL recording), its CLI and the helper that starts it from
a command.
"""
