"""The Prometheus sink's metric families as data: names, help texts, labels, bucket bounds.

The sink (telemetry/sidecar/sinks/prometheus.py) keeps one value per COUNTERS entry and one
Histogram per HISTOGRAMS entry; the exposition (prometheus_exposition.py) renders them in the
order of these tables. The gauges and the sidecar-level series are named where they are
built, in the exposition, since each reads a value of its own. Every series carries LABELS:
``engine`` (engine index) and ``model_name`` (from the engine's heartbeats, "" until the
first one); sidecar-level series use ``engine=""``. The names are a contract: dashboards and
alerts read them (dashboards/metric_names.py), and docs/metrics.md lists every series with
the record fields it comes from.
"""

from __future__ import annotations

PREFIX = "iterscope_"
LABELS = ("engine", "model_name")
WAITING_REASONS = (  # (reason label, IterationRecord field)
    ("kv_capacity", "num_waiting_kv_reqs"),
    ("seq_limit", "num_waiting_seq_limit_reqs"),
    ("token_budget", "num_waiting_budget_reqs"),
    ("other", "num_waiting_other_reqs"),  # held back by the source (a vLLM grammar, remote KV)
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5,
                         5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                         960.0, 1920.0, 7680.0)
_BATCH_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                        65536)
_REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                          50000, 100000, 200000, 500000, 1000000)
# Histogram name (after the prefix) -> (help, default bucket bounds). Order = exposition order.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "iteration_duration_seconds": ("Engine-core iteration time.", _ITL_BUCKETS),
    "iteration_tokens": ("Prefill + decode tokens per iteration.", _BATCH_TOKEN_BUCKETS),
    "iteration_context_tokens": ("Prefill tokens per iteration.",
                                 (0, *_BATCH_TOKEN_BUCKETS)),
    "iteration_generation_requests": ("Decode requests per iteration.",
                                      (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    "time_to_first_token_seconds": ("Arrival to first token.",
                                    (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                                     640.0, 2560.0)),
    "inter_token_latency_seconds": ("Time between the ends of consecutive iterations, once per "
                                    "generated token.", _ITL_BUCKETS),
    "time_per_output_token_seconds": ("Decode time / (output tokens - 1), per request.",
                                      _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to finish.", _REQUEST_TIME_BUCKETS),
    "request_queue_time_seconds": ("Arrival to first scheduled.", _REQUEST_TIME_BUCKETS),
    "request_prefill_time_seconds": ("First scheduled to first token.", _REQUEST_TIME_BUCKETS),
    "request_decode_time_seconds": ("First token to finish.", _REQUEST_TIME_BUCKETS),
    "request_prompt_tokens": ("Prompt length of finished requests.", _REQUEST_TOKEN_BUCKETS),
    "request_generation_tokens": ("Output length of finished requests.",
                                  _REQUEST_TOKEN_BUCKETS),
    "request_preemptions": ("Preemptions per finished request.", (0, 1, 2, 3, 5, 10, 20, 50)),
}
# Counters: name (after the prefix, without _total) -> (help, EngineMetrics attribute).
COUNTERS: dict[str, tuple[str, str]] = {
    "iterations": ("Iteration records received.", "num_iterations"),
    "prompt_tokens": ("Prefill tokens computed (prefix-cache hits are not).", "num_prefill_tokens"),
    "prompt_tokens_cached": ("Prompt tokens served from the prefix cache.",
                             "num_prompt_tokens_cached"),
    "generation_tokens": ("Decode tokens computed.", "num_decode_tokens"),
    "preemptions": ("Requests preempted.", "num_preemptions"),
    "kv_blocked_iterations": ("Iterations after which requests waited for a free KV block.",
                              "num_kv_blocked_iterations"),
    "prefix_cache_queries": ("Prefix-cache lookups, in tokens.", "num_prefix_query_tokens"),
    "prefix_cache_hits": ("Prefix-cache hits, in tokens.", "num_prefix_hit_tokens"),
    "records_received": ("Telemetry messages received (iterations + heartbeats).",
                         "num_received"),
    "records_dropped": ("Telemetry messages lost (sequence gaps).", "num_dropped"),
    "engine_index_conflicts": (
        "Times two live engine processes were seen publishing under this engine index.",
        "num_engine_conflicts",
    ),
}
# --vllm-compatible-names: vLLM name -> (our name, label renames). Counters without _total.
VLLM_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "vllm:num_requests_running": ("iterscope_requests_running", {}),
    "vllm:num_requests_waiting": ("iterscope_requests_waiting", {}),
    "vllm:kv_cache_usage_perc": ("iterscope_kv_cache_usage_ratio", {}),
    "vllm:num_preemptions": ("iterscope_preemptions", {}),
    "vllm:prompt_tokens": ("iterscope_prompt_tokens", {}),
    "vllm:generation_tokens": ("iterscope_generation_tokens", {}),
    "vllm:prefix_cache_queries": ("iterscope_prefix_cache_queries", {}),
    "vllm:prefix_cache_hits": ("iterscope_prefix_cache_hits", {}),
    "vllm:request_success": ("iterscope_requests_finished", {"finish_reason": "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("iterscope_time_to_first_token_seconds", {}),
    "vllm:inter_token_latency_seconds": ("iterscope_inter_token_latency_seconds", {}),
    "vllm:request_time_per_output_token_seconds": ("iterscope_time_per_output_token_seconds",
                                                   {}),
    "vllm:e2e_request_latency_seconds": ("iterscope_e2e_request_latency_seconds", {}),
    "vllm:request_queue_time_seconds": ("iterscope_request_queue_time_seconds", {}),
    "vllm:request_prefill_time_seconds": ("iterscope_request_prefill_time_seconds", {}),
    "vllm:request_decode_time_seconds": ("iterscope_request_decode_time_seconds", {}),
    "vllm:request_prompt_tokens": ("iterscope_request_prompt_tokens", {}),
    "vllm:request_generation_tokens": ("iterscope_request_generation_tokens", {}),
    # vLLM's is the most tokens any of a request's n samples generated; a request here is
    # one sample (serve takes n=1 only), so it is the request's own output length.
    "vllm:request_max_num_generation_tokens": ("iterscope_request_generation_tokens", {}),
    "vllm:iteration_tokens_total": ("iterscope_iteration_tokens", {}),
}
