"""What the NVTX and OTel pieces cost per iteration, measured side by side in one run.

Engine side (the only cost that lands between two forward passes): the optional
``--nvtx-markers`` range (engine/nvtx_markers.py), off and on, with no NVTX tool and with a
tool attached (tests/nvtx_capture, writing to /dev/null: an upper bound for a real
profiler's per-event work), next to what the engine already pays per iteration to encode
its record. Sidecar side (off the engine's path): NvtxSink.on_iteration (it only queues the
record), the pacer thread's drawing of one range with its counters, and
OtelSink.on_iteration (unsampled record; record with one finished request = 5 spans).

    .venv/bin/python bench/nvtx_cost.py

Each figure is the best of 5 repeats of a timed loop, in ns per call. The last line is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CAPTURE_SOURCE = REPO / "tests" / "nvtx_capture" / "nvtx_capture.c"
NUM_REPEATS = 5


def build_capture_tool(out_dir: Path) -> Path:
    """Compile the NVTX capture tool with gcc against the nvidia-nvtx-cu12 headers."""
    import importlib.util

    gcc = shutil.which("gcc")
    spec = importlib.util.find_spec("nvidia")
    includes = [Path(p) / "nvtx" / "include" for p in (spec.submodule_search_locations or [])]
    include = next((p for p in includes if (p / "nvtx3" / "nvToolsExt.h").exists()), None)
    if gcc is None or include is None:
        raise SystemExit("needs gcc and the NVTX headers (pip install nvidia-nvtx-cu12)")
    library = out_dir / "libnvtx_capture.so"
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O2",
            f"-I{include}",
            str(CAPTURE_SOURCE),
            "-o",
            str(library),
            "-lpthread",
        ],
        check=True,
    )
    return library


def best_ns_per_call(body, num_calls: int) -> float:
    """Run ``body(num_calls)`` NUM_REPEATS times; the fastest, per call."""
    best = float("inf")
    for _ in range(NUM_REPEATS):
        start_ns = time.perf_counter_ns()
        body(num_calls)
        best = min(best, (time.perf_counter_ns() - start_ns) / num_calls)
    return best


def decode_record(iteration: int = 1000, milestones=()):
    from telemetry.lane.record import iteration_record

    return iteration_record(
        0,
        iteration,
        iteration,
        start_ns=time.monotonic_ns(),
        elapsed_ns=10_250_000,
        num_decode_reqs=50,
        num_decode_tokens=50,
        num_running_reqs=50,
        num_kv_blocks_used=3500,
        num_kv_blocks_free=65459,
        num_kv_tokens=56000,
        milestones=list(milestones),
    )


def measure_nvtx_in_this_process() -> dict:
    """Engine markers and the NVTX sink, with whatever NVTX tool this process has."""
    from engine.nvtx_markers import NullMarkers, make_markers
    from telemetry.lane.record import make_encoder
    from telemetry.sidecar.engine_view import EngineView
    from telemetry.sidecar.sinks.nvtx_ranges import NvtxSink

    def markers_loop(markers):
        def body(num_calls):
            begin, end = markers.begin, markers.end
            for iteration in range(num_calls):
                begin(iteration)
                end()

        return body

    record, encoder = decode_record(), make_encoder()

    def encode_loop(num_calls):
        encode = encoder.encode
        for _ in range(num_calls):
            encode(record)

    markers = make_markers(True)
    figures = {
        "markers_off_ns": best_ns_per_call(markers_loop(NullMarkers()), 200_000),
        "markers_on_ns": best_ns_per_call(markers_loop(markers), 100_000),
        "markers_on_class": type(markers).__name__,
        "record_encode_ns": best_ns_per_call(encode_loop, 200_000),
    }
    sink = NvtxSink(delay_ms=3_600_000)  # the pacer sleeps through the timed loops
    if sink.enabled:
        records = [decode_record(i) for i in range(20_000)]
        engine = EngineView(0)

        def queue_loop(num_calls):
            for i in range(num_calls):
                sink.on_iteration(records[i], engine)

        def draw_loop(num_calls):  # what the pacer thread does per record: open, then close
            for i in range(num_calls):
                sink._open(records[i])
                sink._close_range(records[i])

        figures["nvtx_sink_on_iteration_ns"] = best_ns_per_call(queue_loop, len(records))
        figures["nvtx_sink_draw_ns"] = best_ns_per_call(draw_loop, len(records))
        # Not closed: close() would draw the queued ranges at their times, an hour from now.
    return figures


def measure_otel_sink() -> dict:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from telemetry.lane.record import EVENT_FINISHED, RequestMilestone, heartbeat
    from telemetry.sidecar.engine_view import EngineView
    from telemetry.sidecar.sinks.otel import OtelSink

    class DiscardingExporter:
        def export(self, spans):
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    sink = OtelSink(DiscardingExporter(), max_queue_size=1_000_000)
    now_ns = time.monotonic_ns()
    engine, first_heartbeat = EngineView(0), heartbeat(0, 1, now_ns, time.time_ns())
    engine.take_anchor(first_heartbeat)  # as Ingest hands a heartbeat to its sinks
    sink.on_heartbeat(first_heartbeat, engine)
    engine.apply_heartbeat(first_heartbeat)
    plain = decode_record()
    finished = decode_record(
        milestones=[
            RequestMilestone(
                request_id="r",
                event=EVENT_FINISHED,
                arrival_ns=now_ns,
                first_scheduled_ns=now_ns + 1,
                first_token_ns=now_ns + 3,
                finished_ns=now_ns + 9,
                num_prompt_tokens=100,
                num_cached_tokens=0,
                num_output_tokens=50,
                num_preemptions=0,
                finish_reason=0,
                prefill_chunks=[(now_ns + 1, now_ns + 2, 64), (now_ns + 2, now_ns + 3, 36)],
            )
        ]
    )

    def loop(record):
        def body(num_calls):
            for _ in range(num_calls):
                sink.on_iteration(record, engine)

        return body

    figures = {
        "otel_unsampled_record_ns": best_ns_per_call(loop(plain), 200_000),
        "otel_finished_request_ns": best_ns_per_call(loop(finished), 2_000),
    }
    sink.close()
    return figures


def run_child(env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    output = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(measure_nvtx_in_this_process()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tool = build_capture_tool(Path(tmp))
        no_tool = run_child({})
        with_tool = run_child({"NVTX_INJECTION64_PATH": str(tool), "NVTX_CAPTURE_PATH": os.devnull})
    otel = measure_otel_sink()
    iteration_ns = 10_000_000  # a 10 ms decode iteration, for scale
    figures = {
        "record_encode_ns": round(no_tool["record_encode_ns"], 1),
        "markers_off_ns": round(no_tool["markers_off_ns"], 1),
        "markers_on_no_tool_ns": round(no_tool["markers_on_ns"], 1),
        "markers_on_no_tool_class": no_tool["markers_on_class"],
        "markers_on_with_tool_ns": round(with_tool["markers_on_ns"], 1),
        "markers_on_with_tool_vs_record_encode": round(
            with_tool["markers_on_ns"] / no_tool["record_encode_ns"], 2
        ),
        "markers_on_with_tool_pct_of_10ms_iteration": round(
            100 * with_tool["markers_on_ns"] / iteration_ns, 4
        ),
        "sidecar_nvtx_on_iteration_with_tool_ns": round(with_tool["nvtx_sink_on_iteration_ns"]),
        "sidecar_nvtx_pacer_draw_with_tool_ns": round(with_tool["nvtx_sink_draw_ns"]),
        "sidecar_otel_unsampled_record_ns": round(otel["otel_unsampled_record_ns"], 1),
        "sidecar_otel_finished_request_ns": round(otel["otel_finished_request_ns"]),
    }
    print(
        f"engine, per iteration: record encode {figures['record_encode_ns']} ns (already "
        f"paid); markers off {figures['markers_off_ns']} ns; markers on, no tool "
        f"{figures['markers_on_no_tool_ns']} ns ({figures['markers_on_no_tool_class']}); "
        f"markers on, tool attached {figures['markers_on_with_tool_ns']} ns = "
        f"{figures['markers_on_with_tool_vs_record_encode']}x the record encode, "
        f"{figures['markers_on_with_tool_pct_of_10ms_iteration']}% of a 10 ms iteration"
    )
    print(
        f"sidecar, per record: NVTX sink on_iteration (queued for the pacer) "
        f"{figures['sidecar_nvtx_on_iteration_with_tool_ns']} ns, then on the pacer thread "
        f"range + 3 counters (tool attached) "
        f"{figures['sidecar_nvtx_pacer_draw_with_tool_ns']} ns; OTel unsampled record "
        f"{figures['sidecar_otel_unsampled_record_ns']} ns; OTel record with one finished "
        f"request (5 spans) {figures['sidecar_otel_finished_request_ns']} ns"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
