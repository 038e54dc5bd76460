"""The OpenTelemetry spans a record makes: which iterations are sampled, and each span's
name, parent, times, attributes and events.

A finished request becomes one trace (or joins the caller's, through its W3C ``traceparent``)
placed at its true times, converted from the engine's monotonic clock to wall time with the
engine view's clock anchor (telemetry/sidecar/engine_view.py):

    llm_request (SERVER)  arrival ................................................ finish
      queued              arrival .. first scheduled
      prefill             chunk 0 [start, end]  chunk 1 [start, end]  (one span per chunk)
      decode                                             first token ........... finish
      events: first_token, preempted (one per preemption)

An iteration becomes one ``iteration`` span only when IterationSampling picks it. A live finding
(telemetry/analysis/live_findings.py) becomes one ``finding <kind>`` span over its episode
when it closes, or when the sidecar stops while it is still open (``iterscope.finding.state``
says which): a root span of its own, beside the requests it slowed. No prompt or
output text is ever put in a span (records carry none). Invariant: request_span_count is the
number of spans emit_request_spans makes, so spans dropped before export count exactly.
Span, event and attribute names are user-facing (dashboards, queries): never rename them.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from telemetry.analysis.live_findings import LiveFinding
from telemetry.lane.record import (
    FINISH_REASONS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
)
from telemetry.sidecar.engine_view import EngineView, record_kv_usage_ratio

DEFAULT_SERVICE_NAME = "iterscope"
TRACER_NAME = "iterscope.sidecar"
NS_PER_S = 1e9


@dataclass(frozen=True)
class IterationSampling:
    """Which iterations become spans. ``one_in_n`` = 0 turns the periodic sample off."""

    slow_ns: int = 100_000_000
    kv_saturation: float = 0.95
    one_in_n: int = 0

    def __post_init__(self) -> None:
        if self.slow_ns <= 0:
            raise ValueError(f"slow iteration threshold must be > 0 ns, got {self.slow_ns}")
        if not 0 < self.kv_saturation <= 1:
            raise ValueError(f"KV saturation must be in (0, 1], got {self.kv_saturation}")
        if self.one_in_n < 0:
            raise ValueError(f"one-in-N must be >= 0 (0 = off), got {self.one_in_n}")

    def reason(self, record: IterationRecord) -> str | None:
        """Why this iteration is sampled, or None when it is not."""
        if record.num_preemptions:
            return "preempting"
        if record.elapsed_ns >= self.slow_ns:
            return "slow"
        if record_kv_usage_ratio(record) >= self.kv_saturation:
            return "kv_saturated"
        if self.one_in_n and record.iteration % self.one_in_n == 0:
            return "one_in_n"
        return None


def parent_context(traceparent: str) -> Context | None:
    """The caller's span context from a W3C traceparent; None when absent or malformed."""
    if not traceparent:
        return None
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return context if span_context.is_valid else None


def request_attributes(milestone: RequestMilestone, engine_index: int, model: str) -> dict:
    """GenAI attributes of a finished request. Latencies in seconds, as in vLLM's spans."""
    attributes = {
        "gen_ai.request.id": milestone.request_id,
        "gen_ai.usage.input_tokens": milestone.num_prompt_tokens,
        "gen_ai.usage.output_tokens": milestone.num_output_tokens,
        "gen_ai.usage.cache_read.input_tokens": milestone.num_cached_tokens,
        "gen_ai.latency.e2e": (milestone.finished_ns - milestone.arrival_ns) / NS_PER_S,
        "iterscope.engine_index": engine_index,
        "iterscope.num_preemptions": milestone.num_preemptions,
    }
    if model:
        attributes["gen_ai.request.model"] = model
    if 0 <= milestone.finish_reason < len(FINISH_REASONS):
        attributes["gen_ai.response.finish_reasons"] = (FINISH_REASONS[milestone.finish_reason],)
    if milestone.first_scheduled_ns:
        queue_ns = milestone.first_scheduled_ns - milestone.arrival_ns
        attributes["gen_ai.latency.time_in_queue"] = queue_ns / NS_PER_S
    if milestone.first_token_ns:
        ttft_ns = milestone.first_token_ns - milestone.arrival_ns
        decode_ns = milestone.finished_ns - milestone.first_token_ns
        attributes["gen_ai.latency.time_to_first_token"] = ttft_ns / NS_PER_S
        attributes["gen_ai.latency.time_in_model_decode"] = decode_ns / NS_PER_S
        if milestone.first_scheduled_ns:
            prefill_ns = milestone.first_token_ns - milestone.first_scheduled_ns
            attributes["gen_ai.latency.time_in_model_prefill"] = prefill_ns / NS_PER_S
    return attributes


def iteration_attributes(record: IterationRecord, reason: str) -> dict:
    """The record's counts; those its source marked unknown are left out, speculative
    decoding's where it scored no draft."""
    attributes = {
        "iterscope.engine_index": record.engine_index,
        "iterscope.iteration": record.iteration,
        "iterscope.sample_reason": reason,
        "iterscope.num_context_reqs": record.num_prefill_reqs,
        "iterscope.num_context_tokens": record.num_prefill_tokens,
        "iterscope.num_generation_reqs": record.num_decode_reqs,
        "iterscope.num_generation_tokens": record.num_decode_tokens,
        "iterscope.num_running_reqs": record.num_running_reqs,
        "iterscope.num_waiting_reqs": record.num_waiting_reqs,
        "iterscope.num_waiting_kv_reqs": record.num_waiting_kv_reqs,
        "iterscope.num_waiting_seq_limit_reqs": record.num_waiting_seq_limit_reqs,
        "iterscope.num_waiting_budget_reqs": record.num_waiting_budget_reqs,
        "iterscope.num_waiting_other_reqs": record.num_waiting_other_reqs,
        "iterscope.num_kv_blocks_used": record.num_kv_blocks_used,
        "iterscope.num_kv_blocks_free": record.num_kv_blocks_free,
        "iterscope.kv_usage_ratio": record_kv_usage_ratio(record),
        "iterscope.num_preemptions": record.num_preemptions,
    }
    if record.unknown & UNKNOWN_PREFILL_REQS:
        del attributes["iterscope.num_context_reqs"]
    if record.unknown & UNKNOWN_WAITING_REASONS:
        for reason_field in ("kv", "seq_limit", "budget", "other"):
            del attributes[f"iterscope.num_waiting_{reason_field}_reqs"]
    if record.model_elapsed_ns:
        attributes["iterscope.model_elapsed_ms"] = record.model_elapsed_ns / 1e6
    if record.spec_decode is not None:
        attributes["iterscope.num_drafts"] = record.spec_decode.num_drafts
        attributes["iterscope.num_draft_tokens"] = record.spec_decode.num_draft_tokens
        attributes["iterscope.num_accepted_tokens"] = record.spec_decode.num_accepted_tokens
    return attributes


def engine_resource(heartbeat: Heartbeat, service_name: str | None) -> Resource:
    """The resource naming the engine and its model; ``service_name`` None defers to
    OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, else iterscope."""
    attributes = {"iterscope.engine_index": heartbeat.engine_index}
    if heartbeat.model_name:
        attributes["iterscope.model"] = heartbeat.model_name
    if heartbeat.device_name:
        attributes["iterscope.device"] = heartbeat.device_name
    if service_name:
        attributes[SERVICE_NAME] = service_name
    resource = Resource.create(attributes)  # adds OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


class EngineTracer:
    """One engine's tracers; their resource names the engine and its model.

    Request spans go through the SDK's sampler (OTEL_TRACES_SAMPLER, parent-based by default,
    so a caller's sampling decision in its traceparent holds). Iteration and finding spans
    have their own provider that records every span it is given: IterationSampling or the
    live findings already chose them (slow, preempting, KV saturated; a finding), and a ratio
    sampler must not drop the one slow iteration or the cause of a slow minute.
    """

    def __init__(
        self, heartbeat: Heartbeat, service_name: str | None, processor: SpanProcessor
    ) -> None:
        resource = engine_resource(heartbeat, service_name)
        self.model = heartbeat.model_name
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        chosen_provider = TracerProvider(
            resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False
        )
        chosen_provider.add_span_processor(processor)
        self.chosen_tracer = chosen_provider.get_tracer(TRACER_NAME)


def emit_request_spans(
    engine_tracer: EngineTracer, engine: EngineView, milestone: RequestMilestone
) -> None:
    """The request's spans; request_span_count says how many (keep the two in step)."""
    wall = engine.to_wall_ns
    tracer = engine_tracer.tracer
    root = tracer.start_span(
        "llm_request",
        context=parent_context(milestone.traceparent),
        kind=SpanKind.SERVER,
        start_time=wall(milestone.arrival_ns),
        attributes=request_attributes(milestone, engine.engine_index, engine_tracer.model),
    )
    inside = trace.set_span_in_context(root)
    queue_end_ns = milestone.first_scheduled_ns or milestone.finished_ns
    tracer.start_span("queued", context=inside, start_time=wall(milestone.arrival_ns)).end(
        end_time=wall(queue_end_ns)
    )
    for index, (start_ns, end_ns, num_tokens) in enumerate(milestone.prefill_chunks):
        chunk = {"iterscope.chunk_index": index, "iterscope.num_tokens": num_tokens}
        tracer.start_span(
            "prefill", context=inside, start_time=wall(start_ns), attributes=chunk
        ).end(end_time=wall(end_ns))
    if milestone.first_token_ns:
        root.add_event("first_token", timestamp=wall(milestone.first_token_ns))
        tracer.start_span("decode", context=inside, start_time=wall(milestone.first_token_ns)).end(
            end_time=wall(milestone.finished_ns)
        )
    for preempted_ns in milestone.preempted_ns:
        root.add_event("preempted", timestamp=wall(preempted_ns))
    root.end(end_time=wall(milestone.finished_ns))


def request_span_count(milestone: RequestMilestone) -> int:
    """Spans emit_request_spans makes: the request, queued, each prefill chunk, decode if any."""
    return 2 + len(milestone.prefill_chunks) + (1 if milestone.first_token_ns else 0)


def emit_iteration_span(
    engine_tracer: EngineTracer, engine: EngineView, record: IterationRecord, reason: str
) -> None:
    """One span over the iteration, ``reason`` saying why it was sampled."""
    start_ns = engine.to_wall_ns(record.start_ns)
    engine_tracer.chosen_tracer.start_span(
        "iteration", start_time=start_ns, attributes=iteration_attributes(record, reason)
    ).end(end_time=start_ns + record.elapsed_ns)


def finding_attributes(finding: LiveFinding) -> dict:
    """What /findings says of a finding (LiveFinding.to_json), as ``iterscope.finding.*``."""
    return {
        "iterscope.engine_index": finding.engine_index,
        "iterscope.finding.kind": finding.kind,
        "iterscope.finding.title": finding.title,
        "iterscope.finding.state": "closed" if finding.closed else "open",
        "iterscope.finding.start_iteration": finding.iteration,
        "iterscope.finding.cost_request_seconds": finding.cost,
        "iterscope.finding.cost_label": finding.cost_label,
        "iterscope.finding.evidence": finding.evidence,
        "iterscope.finding.action": finding.action,
        "iterscope.finding.truncated": finding.truncated,
    }


def emit_finding_span(
    engine_tracer: EngineTracer, engine: EngineView, finding: LiveFinding, end_ns: int
) -> None:
    """One span from the finding's start to ``end_ns`` (engine time, converted to wall time
    with the same anchor as the request spans, so the two line up)."""
    start_ns = engine.to_wall_ns(finding.start_ns)
    engine_tracer.chosen_tracer.start_span(
        f"finding {finding.kind}", start_time=start_ns, attributes=finding_attributes(finding)
    ).end(end_time=max(start_ns, engine.to_wall_ns(end_ns)))
