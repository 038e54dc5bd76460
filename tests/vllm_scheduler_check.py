"""Drive vLLM's real scheduler, subclassed by iterscope, without a model: run in `.vllm-venv`
(and, for another vLLM version, with `make vllm`'s directory of it on the PYTHONPATH) by
tests/test_vllm_scheduler_live.py (`.vllm-venv/bin/python tests/vllm_scheduler_check.py
CASE...`), it prints one JSON line: for each case, what it needs checked.

The scheduler is vLLM's own, subclassed by iterscope, without a model
(bench/vllm_scheduler_harness.py): every decision the waiting rule reads is vLLM's. The
publisher is swapped for a list, so the records are those the lane would carry.

Cases:
    reasons     one scheduler per admission limit: which reason each step's waiting got
    async       the KV case with async scheduling on (vLLM's default on a GPU), each step
                scheduled before the last one's output is back, as vLLM's engine core runs it:
                IterscopeScheduler must become vLLM's async scheduler
    guard       an untested vLLM version, and a missing scheduler attribute: plain vLLM
                scheduling, nothing reported, a warning in vLLM's log (changes this module's
                state: run it last)
    cadence     prefills held for vLLM's prefill cadence: asked by a data-parallel engine core
                (``throttle_prefills`` on three steps of four), and kept by the scheduler
                itself (``prefill_schedule_interval=4``; vLLM 0.33 and later): which reason
                the requests waiting meanwhile got
    spec        speculative decoding (ngram config, drafts of 3, 0-3 of them accepted in
                turn): each step's drafts as the records count them, as vLLM's own
                SpecDecodingStats of the same step does, and as the stat-logger plugin maps
                those SpecDecodingStats (the scheduler stats vLLM hands its stat loggers)
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vllm_scheduler_harness import (  # noqa: E402
    add_requests,
    make_scheduler,
    run_pipelined,
    run_step,
)
from telemetry.sources import vllm_scheduler  # noqa: E402
from telemetry.sources.vllm_records import engine_facts, spec_decode_counts  # noqa: E402
from telemetry.sources.vllm_scheduler import (  # noqa: E402
    IterscopeScheduler,
)

REASON_FIELDS = {
    "kv": "num_waiting_kv_reqs",
    "seq_limit": "num_waiting_seq_limit_reqs",
    "budget": "num_waiting_budget_reqs",
    "other": "num_waiting_other_reqs",
}


class ListPublisher:
    def __init__(self) -> None:
        self.records: list = []

    def publish(self, record) -> None:
        self.records.append(record)

    def note_queues(self, num_waiting: int, num_running: int, step_tokens: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


CASES = {  # limit -> (num_blocks, max_num_seqs, max_num_batched_tokens, prompt, output)
    "seq_limit": (64, 2, 512, 16, 8),  # 6 requests, 2 run at a time
    "budget": (64, 8, 64, 48, 8),  # 64 tokens a step: one 48-token prompt at a time
    "kv": (9, 8, 512, 40, 40),  # 8 usable blocks, 5 per request at their peak
}


def reasons_case() -> dict:
    """Per limit: the waiting counts by reason of the steps, summed, and the preemptions."""
    return {limit: run_case(limit, IterscopeScheduler, run_until_done) for limit in CASES}


def async_case() -> dict:
    """The KV case scheduled asynchronously, from the one class the docs give: which class
    vLLM's async config makes of it, and its records."""
    result = run_case("kv", IterscopeScheduler, run_pipelined, async_scheduling=True)
    return {"kv": result}


def run_until_done(scheduler, max_steps: int) -> int:
    for step in range(max_steps):
        if not scheduler.has_requests():
            return step
        run_step(scheduler)
    return max_steps


def run_case(limit: str, scheduler_class: type, run, async_scheduling: bool = False) -> dict:
    num_blocks, max_num_seqs, budget, prompt, output_len = CASES[limit]
    scheduler = make_scheduler(num_blocks, max_num_seqs, budget, scheduler_class, async_scheduling)
    publisher = ListPublisher()
    scheduler._iterscope.publisher = publisher
    add_requests(scheduler, 6, prompt, output_len)
    num_steps = run(scheduler, 400)
    records = publisher.records
    return {
        "scheduler_class": type(scheduler).__name__,
        "num_steps": num_steps,
        "iterations": [r.iteration for r in records],
        "all_timed": all(r.elapsed_ns > 0 for r in records),
        "waiting": {
            name: sum(getattr(r, field) for r in records) for name, field in REASON_FIELDS.items()
        },
        "num_waiting": sum(r.num_waiting_reqs for r in records),
        "num_preemptions": sum(r.num_preemptions for r in records),
        "num_finished": sum(1 for r in records for m in r.milestones if m.event & 2),
        "num_first_tokens": sum(1 for r in records for m in r.milestones if m.event & 1),
        "num_output_tokens": sum(r.num_decode_tokens for r in records),
        "max_blocks_used": max(r.num_kv_blocks_used for r in records),
        "num_kv_blocks_total": records[0].num_kv_blocks_used + records[0].num_kv_blocks_free,
    }


def cadence_case() -> dict:
    """One request decoding, three more arriving while prefills are held: the waiting
    counts by reason, summed over the steps, per way of holding."""
    result = {"local_cadence": hasattr(make_scheduler(64, 8, 512), "local_prefill_interval")}
    for name, options, throttled in (
        ("throttled", {}, lambda step: step % 4 != 0),
        ("interval", {"prefill_schedule_interval": 4}, lambda step: False),
    ):
        scheduler = make_scheduler(64, 8, 512, **options)
        publisher = ListPublisher()
        scheduler._iterscope.publisher = publisher
        add_requests(scheduler, 1, 16, 40)
        for step in range(20):
            if step == 2:
                add_requests(scheduler, 3, 16, 8)
            run_step(scheduler, throttle_prefills=throttled(step))
        records = publisher.records
        result[name] = {
            reason: sum(getattr(r, field) for r in records)
            for reason, field in REASON_FIELDS.items()
        }
        result[name]["num_waiting"] = sum(r.num_waiting_reqs for r in records)
        facts = engine_facts(scheduler.vllm_config, 63, "vllm-scheduler", "0")
        result[name]["interval_fact"] = facts.get("prefill_schedule_interval", 0)
    return result


def guard_case() -> dict:
    """An untested version and a missing attribute: each a plain scheduler that still runs;
    on the untested version the plugin (in vLLM's API server) reports the engine instead."""
    from telemetry.sources.vllm_stat_logger import stats_carry_iteration_details

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vllm.iterscope").addHandler(handler)
    result = {}
    runs_on = vllm_scheduler.scheduler_source_runs_on
    vllm_scheduler.scheduler_source_runs_on = lambda version: False
    scheduler = make_scheduler(64, 4, 512)
    vllm_scheduler.scheduler_source_runs_on = runs_on
    result["untested_reporter"] = scheduler._iterscope is not None
    add_requests(scheduler, 3, 16, 4)
    for _ in range(20):
        run_step(scheduler)
    result["untested_finished"] = not scheduler.has_requests()
    result["plugin_reports"] = plugin_reports(scheduler.vllm_config)
    result["stats_carry_iteration_details"] = stats_carry_iteration_details()
    vllm_scheduler.SCHEDULER_ATTRIBUTES += ("no_such_attribute",)  # as a later vLLM might
    scheduler = make_scheduler(64, 4, 512)
    result["missing_reporter"] = scheduler._iterscope is not None
    result["said"] = said
    return result


def plugin_reports(vllm_config) -> dict[str, bool]:
    """Whether the stat-logger plugin, in a vLLM run with iterscope's scheduler, publishes:
    where the scheduler source runs on this version, and where it does not."""
    from telemetry.sources import vllm_stat_logger

    vllm_config.scheduler_config.scheduler_cls = f"{vllm_scheduler.__name__}.IterscopeScheduler"
    runs_on = vllm_stat_logger.scheduler_source_runs_on
    reports = {}
    for case, scheduler_runs in (("scheduler_runs", True), ("scheduler_refuses", False)):
        vllm_stat_logger.scheduler_source_runs_on = lambda version, runs=scheduler_runs: runs
        plugin = vllm_stat_logger.IterscopeStatLogger(vllm_config, 0)
        reports[case] = plugin._publisher is not None
        if plugin._publisher is not None:
            plugin._publisher.close()
    vllm_stat_logger.scheduler_source_runs_on = runs_on
    return reports


def spec_case() -> dict:
    """Three requests decoding with drafts of 3 tokens, 0-3 accepted in turn: the records'
    spec_decode and vLLM's own counts of each step that scored drafts."""
    scheduler = make_scheduler(64, 4, 512, num_speculative_tokens=3)
    publisher = ListPublisher()
    scheduler._iterscope.publisher = publisher
    add_requests(scheduler, 3, 16, 24)
    vllms, plugins = [], []
    for step in range(40):
        if not scheduler.has_requests():
            break
        for outputs in run_step(scheduler, accept=step % 4).values():
            stats = outputs.scheduler_stats and outputs.scheduler_stats.spec_decoding_stats
            if stats:
                vllms.append(spec_counts(stats))
                plugins.append(spec_counts(spec_decode_counts(stats)))
    records = publisher.records
    return {
        "ours": [spec_counts(r.spec_decode) for r in records if r.spec_decode],
        "vllm": vllms,
        "plugin": plugins,
        "num_decode": [[r.num_decode_reqs, r.num_decode_tokens] for r in records],
        "num_output_tokens": sum(
            m.num_output_tokens for r in records for m in r.milestones if m.event & 2
        ),
    }


def spec_counts(stats) -> list:
    return [
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        list(stats.num_accepted_tokens_per_pos),
    ]


CASES_BY_NAME = {
    "reasons": reasons_case,
    "async": async_case,
    "guard": guard_case,
    "cadence": cadence_case,
    "spec": spec_case,
}

if __name__ == "__main__":
    import vllm

    results = {case: CASES_BY_NAME[case]() for case in sys.argv[1:]}
    print(json.dumps({"version": vllm.__version__, **results}))
