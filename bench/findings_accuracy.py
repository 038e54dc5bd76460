"""How often finding 1 is the scenario's true top cause, for `explain` and for the live
sidecar (its replay of the same recording: the Ingest a live sidecar runs, on record time).

    .venv/bin/python bench/findings_accuracy.py [--real]

Each scenario states its true top cause: a finding kind as the live sidecar names it
(telemetry/analysis/live_findings.py finding_kind: waiting with its reason, e.g.
"waiting_kv"), or None for a run with no problem (then no problem finding may rank first).
The synthetic scenarios (tests/scenarios/synthetic.py) run in a simulator with a known
cost; the real vLLM recordings of tests/data whose cause was measured side by side (VLLM: the
same load served again without the cause) come next; ``--real`` adds the real-engine stories
(tests/scenarios/real_engine.py: the engine core on a tiny model, recorded through a real
sidecar, about a minute and a half). All rank by
the same rule (telemetry/analysis/findings.py rank_key). Prints one line per scenario and
the shares; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from scenarios.synthetic import SCENARIOS as SYNTHETIC  # noqa: E402

from telemetry.analysis.episodes import detect_episodes  # noqa: E402
from telemetry.analysis.findings import build_findings  # noqa: E402
from telemetry.analysis.live_findings import finding_kind, rank_kinds  # noqa: E402
from telemetry.analysis.timeline import read_timelines  # noqa: E402
from telemetry.sidecar.replay import replay  # noqa: E402
from telemetry.sidecar.sink import Sink  # noqa: E402

REAL = {  # tests/scenarios/real_engine.py SCENARIOS -> true top cause
    "story1": "kv_cliff",
    "story2": "kv_leak",
    "stall": "stall",
    "story3-batched": None,
    "story3-queued": "waiting_seq_limit",
    "healthy-but-slow": None,
}

# tests/data recordings of vLLM 0.32's CPU build -> true top cause, as bench/drafts_payoff_vllm.py
# measured it: the same load without --speculative-config, 2.46x and 1.45x faster per output
# token (docs/diagnosis.md, "Speculative decoding").
VLLM = {
    "vllm_costly_drafts.jsonl": "costly_drafts",
    "vllm_futile_speculation.jsonl": "futile_speculation",
}


def explain_top_cause(path: Path) -> str | None:
    """explain's finding 1 as a kind; None when it found no problem."""
    (timeline,) = read_timelines([path])[0].values()
    findings = build_findings(timeline, detect_episodes(timeline))
    return finding_kind(findings[0].worst) if findings else None


class LiveFindings(Sink):
    def __init__(self) -> None:
        self.findings: dict[int, object] = {}

    def on_finding(self, event, engine) -> None:
        self.findings[id(event.finding)] = event.finding


def live_top_cause(path: Path) -> str | None:
    """The live sidecar's finding 1 over the run (its replay), ranked as explain ranks."""
    sink = LiveFindings()
    replay(path, [sink])
    ranked = rank_kinds(list(sink.findings.values()))
    return ranked[0] if ranked else None


def recordings(tmp: Path, real: bool) -> list[tuple[str, str | None, Path]]:
    runs = []
    for name, (make, truth) in SYNTHETIC.items():
        runs.append((f"synthetic {name}", truth, make().write(tmp / f"{len(runs)}.jsonl")))
    for name, truth in VLLM.items():
        runs.append((f"vllm {name.removesuffix('.jsonl')}", truth, ROOT / "tests" / "data" / name))
    if real:
        from scenarios import real_engine

        for name, truth in REAL.items():
            out = tmp / name
            out.mkdir()
            runs.append((f"real {name}", truth, real_engine.SCENARIOS[name](out)))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="add the real-engine stories")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            (name, truth, explain_top_cause(path), live_top_cause(path))
            for name, truth, path in recordings(Path(tmp), args.real)
        ]
    for name, truth, explain, live in results:
        mark = "ok " if truth == explain == live else "NO "
        print(
            f"{mark} {name:32s} true: {truth or 'no problem':20s} explain: "
            f"{explain or 'no problem':20s} live: {live or 'no problem'}"
        )
    num = len(results)
    explain_right = sum(truth == explain for _, truth, explain, _ in results)
    live_right = sum(truth == live for _, truth, _, live in results)
    num_agree = sum(explain == live for _, _, explain, live in results)
    print(
        f"finding 1 is the true top cause: explain {explain_right} of {num}, the live sidecar "
        f"{live_right} of {num}; they agree in {num_agree} of {num}"
    )
    print(
        json.dumps(
            {
                "num_scenarios": num,
                "explain_share": explain_right / num,
                "live_share": live_right / num,
                "agree_share": num_agree / num,
                "wrong": [name for name, truth, e, live in results if not truth == e == live],
            }
        )
    )


if __name__ == "__main__":
    main()
