"""What several test files share, one module per concept; import as `tests.helpers.<module>`.

    net           free_port()
    wait          wait_until(condition, timeout_s, what): poll instead of sleeping
    processes     log-line waits, stopping a process, `iterscope sidecar` with /metrics
    prom          scrape(port) a /metrics page; a real Prometheus (and Alertmanager) process
    serve         `iterscope serve` in a subprocess, the tiny engine core, scripted clients
    fake_engine   the synthetic engine process (a ZmqPublisher at a fixed pace)
    lane          lane messages made by hand (records, heartbeats) and a sink that records calls
    sink_feed     feeding a sink by hand the way Ingest does
    otel          an OTLP/HTTP receiver that decodes the spans it is sent
    perfetto_reader  a Perfetto trace read back with perfetto's protos (tracks, slices, counters)
    fake_runner   a deterministic fake model for the engine core
    faults        faults injected from outside the engine (a stall, a block leak)
    parity        our decoder against transformers on tiny random models
    sampling_reference  what sampling parameters mean, computed from the model's logits
    vllm          a real vLLM's counters against the sidecar's, the status it serves

Nothing here is collected as tests. Keep this file light (no imports beyond pathlib): the
synthetic engine runs as a process of its own and imports from this package.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
