"""Whether iterscope tells the truth about speculative decoding on a real vLLM: the same load
served with drafts and without, side by side in one run.

    .venv/bin/python bench/drafts_payoff_vllm.py [--spec-config JSON] [--out DIR]

vLLM's CPU build (`make vllm`) on the exported SmolLM2, the scheduler source feeding a
recording sidecar, at its fastest CPU flags (bench/vllm_server.py): first with
``--speculative-config`` (by default ngram drafts of up to 5 tokens matched on a single
token, which few are accepted of), then without it, each under `vllm bench serve` (random
128-token prompts, 96 tokens out, 24 prompts, 8 at once, ignore_eos). Printed: vLLM bench's
mean time per output token (TPOT) of each and their ratio, what `iterscope tune` says drafts
do by its fit (the payoff, with its error at two standard errors), and the findings `explain`
and the live sidecar gave on the drafting run (``costly_drafts`` where drafts cost more than
they save, ``futile_speculation`` where next to none is accepted). The last line is one JSON
object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_server import BEST_CPU_FLAGS, bench_serve, start_vllm, stop_server  # noqa: E402
from telemetry.analysis.episodes import detect_episodes  # noqa: E402
from telemetry.analysis.findings import build_findings  # noqa: E402
from telemetry.analysis.timeline import read_timelines  # noqa: E402
from telemetry.analysis.tune import ERROR_SIGMAS, draft_payoff, fit_iteration_time  # noqa: E402
from telemetry.sidecar.process import start_sidecar  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402
from tests.helpers.vllm import VLLM_ENV  # noqa: E402

DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 2,
    "prompt_lookup_min": 1,
}
LOAD = (
    *("--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "96"),
    *("--num-prompts", "24", "--max-concurrency", "8", "--ignore-eos", "--seed", "0"),
)
SCHEDULER_SOURCE = ("--scheduler-cls", "telemetry.sources.vllm_scheduler.IterscopeScheduler")


def serve_and_load(name: str, out: Path, extra_flags: tuple[str, ...]) -> dict:
    """One vLLM serve under the load, recorded; vLLM bench's figures and the live findings
    the sidecar logged (their WARNING lines)."""
    metrics_port, port = free_port(), free_port()
    with open(out / f"sidecar-{name}.log", "w") as log:
        sidecar = start_sidecar(
            ["--metrics-port", str(metrics_port), "--record", str(out / f"{name}.jsonl")],
            stderr=log,
        )
        server = None
        try:
            server = start_vllm(
                port,
                {"ITERSCOPE_TELEMETRY_ADDRESS": sidecar.address, **VLLM_ENV},
                out / f"vllm-{name}.log",
                flags=(*BEST_CPU_FLAGS, *SCHEDULER_SOURCE, *extra_flags),
            )
            result = bench_serve(port, out, name, LOAD)
        finally:
            if server is not None:
                stop_server(server)
            sidecar.stop()
    said_live = list(
        dict.fromkeys(  # each finding's title once, in the order first said
            line.split("Engine 000: ", 1)[1].split(" since ", 1)[0].split(" again: ", 1)[0]
            for line in (out / f"sidecar-{name}.log").read_text().splitlines()
            if line.startswith("WARNING") and " since " in line
        )
    )
    return {
        "mean_tpot_ms": result["mean_tpot_ms"],
        "output_tok_s": result["output_throughput"],
        "completed": result["completed"],
        "live_findings": said_live,
    }


def explained(path: Path) -> dict:
    """explain's findings and tune's payoff on one recording."""
    (timeline,) = read_timelines([path])[0].values()
    findings = build_findings(timeline, detect_episodes(timeline))
    payoff = draft_payoff(timeline, fit_iteration_time(timeline))
    return {
        "findings": [finding.kind for finding in findings],
        "added_share": -payoff.saving if payoff else None,
        "added_share_error": payoff.saving_error if payoff else None,
        "num_decode_reqs": payoff.num_decode_reqs if payoff else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec-config", default=json.dumps(DEFAULT_SPEC))
    parser.add_argument("--out", type=Path, default=None, help="keep the recordings and logs")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="drafts-payoff-"))
    out.mkdir(parents=True, exist_ok=True)
    drafting = serve_and_load("spec", out, ("--speculative-config", args.spec_config))
    plain = serve_and_load("plain", out, ())
    said = explained(out / "spec.jsonl")
    ratio = drafting["mean_tpot_ms"] / plain["mean_tpot_ms"]
    print(f"speculative config: {args.spec_config}; recordings and logs in {out}")
    print(
        f"mean TPOT with drafts / without: {drafting['mean_tpot_ms']:.1f} / "
        f"{plain['mean_tpot_ms']:.1f} ms = {ratio:.2f}x (drafts add {ratio - 1:.0%} measured)"
    )
    if said["added_share"] is None:
        print("tune: whether drafts pay is not known (no cost per draft token fitted)")
    else:
        error = ERROR_SIGMAS * said["added_share_error"]
        print(
            f"tune, by its fit: drafts add {said['added_share']:.0%} (± {error:.0%}) at "
            f"{said['num_decode_reqs']:.1f} decoding requests"
        )
    print(f"explain's findings: {said['findings']}")
    print(f"the live sidecar's: {drafting['live_findings']}")
    print(
        json.dumps(
            {
                "spec_config": json.loads(args.spec_config),
                "tpot_with_drafts_ms": drafting["mean_tpot_ms"],
                "tpot_without_drafts_ms": plain["mean_tpot_ms"],
                "measured_tpot_ratio": ratio,
                "tune_added_share": said["added_share"],
                "tune_added_share_error": said["added_share_error"],
                "explain_findings": said["findings"],
                "live_findings": drafting["live_findings"],
                "completed": [drafting["completed"], plain["completed"]],
            }
        )
    )


if __name__ == "__main__":
    main()
