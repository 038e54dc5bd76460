"""A Dynamo vLLM scheduler that stops iterating while its publisher thread heartbeats: the
publisher is Dynamo's own ``_FpmPublisherThread`` (the pinned ``ai-dynamo`` wheel, imported in
the vLLM environment its module needs), driven as its InstrumentedScheduler drives it, minus
the scheduler. Its heartbeats come after any second without a message, busy or not, so they
say no iteration came, not that nothing waits (telemetry/sources/fpm_streams.py): requests
left queued and no iteration since is a stall; nothing left queued is idle."""

from __future__ import annotations

import subprocess

from bench.vllm_server import VLLM
from telemetry.sidecar.process import start_sidecar
from tests.helpers import REPO
from tests.helpers.net import free_port
from tests.helpers.prom import scrape, total
from tests.helpers.wait import wait_until
from tests.test_fpm_producers_live import FPM_WHEELS, state_of

# "busy N Q" publishes N iterations leaving Q requests queued, as the scheduler's
# update_from_output() does; between lines the scheduler is silent, the thread heartbeats.
DYNAMO_DRIVER = """
import sys
from dynamo.common import forward_pass_metrics as fpm
from dynamo.vllm.instrumented_scheduler import _FpmPublisherThread
publisher = _FpmPublisherThread(sys.argv[1], worker_id="dynamo-w", dp_rank=0)
scheduled = fpm.ScheduledRequestMetrics(
    num_prefill_requests=1, sum_prefill_tokens=64, num_decode_requests=2,
    sum_decode_kv_tokens=300)
for line in sys.stdin:
    _, count, num_queued = line.split()
    queued = fpm.QueuedRequestMetrics(num_prefill_requests=int(num_queued))
    for _ in range(int(count)):
        publisher.publish(fpm.ForwardPassMetrics(
            worker_id="dynamo-w", wall_time=0.02,
            scheduled_requests=scheduled, queued_requests=queued))
    print("ok", flush=True)
"""


def test_a_scheduler_silent_with_requests_queued_is_stalled_not_idle(tmp_path):
    if not (FPM_WHEELS / "dynamo" / "vllm" / "instrumented_scheduler.py").exists():
        raise AssertionError(f"{FPM_WHEELS} lacks ai-dynamo: `make fpm-wheels` unpacks it")
    port = free_port()
    args = ["--fpm", f"tcp://127.0.0.1:{port}", "--fpm-producer", "dynamo-vllm"]
    args += ["--metrics-port", "0", "--no-log", "--dead-after", "3", "--stall-after", "2"]
    sidecar = start_sidecar(args)
    url = sidecar.metrics_url
    producer = subprocess.Popen(
        [str(VLLM.parent / "python"), "-c", DYNAMO_DRIVER, f"tcp://127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(FPM_WHEELS), "PATH": "/usr/bin:/bin"},
    )

    def publish(count: int, num_queued: int) -> None:
        assert producer.stdin is not None and producer.stdout is not None
        producer.stdin.write(f"busy {count} {num_queued}\n")
        producer.stdin.flush()
        assert producer.stdout.readline() == "ok\n"

    try:
        wait_until(lambda: state_of(url, "idle") == 1, 60, "idle on Dynamo's heartbeats")
        publish(20, 5)  # then silent: 5 requests queued, the scheduler stopped
        wait_until(
            lambda: total(scrape(url), "iterscope_iterations_total") == 20, 10, "20 iterations"
        )
        wait_until(lambda: state_of(url, "stalled") == 1, 10, "stalled on heartbeats")
        samples = scrape(url)
        assert total(samples, "iterscope_requests_waiting", engine="0") == 5
        assert state_of(url, "idle") == state_of(url, "dead") == 0
        publish(3, 0)  # it iterates again and leaves nothing queued: idle on heartbeats
        wait_until(lambda: state_of(url, "idle") == 1, 10, "idle once nothing waits")
        assert total(scrape(url), "iterscope_requests_waiting", engine="0") == 0
    finally:
        producer.kill()
        producer.wait(10)
        assert sidecar.stop() == 0
