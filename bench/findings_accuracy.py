"""How often `explain`'s finding 1 is the scenario's true top cause.

    .venv/bin/python bench/findings_accuracy.py [--real]

Each scenario states its true top cause: a finding kind (with the waiting reason for
"waiting"), or None for a run with no problem (its finding 1, if any, must be information
only). The synthetic scenarios (tests/scenarios/synthetic.py) run in a simulator with a known
cost; ``--real`` adds the real-engine stories (tests/scenarios/real_engine.py: the engine core
on a tiny model, recorded through a real sidecar, about a minute). Prints one line per
scenario and the share right; the last line is one JSON object.

The live sidecar does not compute findings yet (only its engine status); when it does, this
script is where the two are compared.
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
from telemetry.analysis.timeline import build_timelines, read_timelines  # noqa: E402

REAL = {  # tests/scenarios/real_engine.py SCENARIOS -> true top cause
    "story1": "kv_cliff",
    "story2": "kv_leak",
    "stall": "stall",
    "story3-batched": None,
    "story3-queued": "waiting:waiting_seq_limit",
}


def top_cause(timeline) -> str | None:
    """Finding 1 as a cause: its kind (and waiting reason), None when it is no problem."""
    findings = build_findings(timeline, detect_episodes(timeline))
    problems = [f for f in findings if f.worst.severity == "problem"]
    if not problems:
        return None
    first = problems[0]
    reason = first.worst.numbers.get("reason")
    return f"{first.kind}:{reason}" if first.kind == "waiting" else first.kind


def real_scenarios(tmp: Path) -> dict[str, object]:
    from scenarios import real_engine

    timelines = {}
    for name in REAL:
        out = tmp / name
        out.mkdir()
        recording = real_engine.SCENARIOS[name](out)
        (timelines[name],) = read_timelines([recording])[0].values()
    return timelines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="add the real-engine stories")
    args = parser.parse_args()
    results = []
    for name, (make, truth) in SYNTHETIC.items():
        (timeline,) = build_timelines(make().messages).values()
        results.append((f"synthetic {name}", truth, top_cause(timeline)))
    if args.real:
        with tempfile.TemporaryDirectory() as tmp:
            for name, timeline in real_scenarios(Path(tmp)).items():
                results.append((f"real {name}", REAL[name], top_cause(timeline)))
    for name, truth, got in results:
        mark = "ok " if truth == got else "NO "
        print(f"{mark} {name:32s} true: {truth or 'no problem':28s} explain: {got or 'no problem'}")
    num_right = sum(truth == got for _, truth, got in results)
    share = num_right / len(results)
    print(
        f"explain's finding 1 is the true top cause in {num_right} of {len(results)} "
        f"scenarios ({100 * share:.0f}%); the live sidecar computes no findings yet"
    )
    print(
        json.dumps(
            {
                "num_scenarios": len(results),
                "explain_share": share,
                "wrong": [name for name, truth, got in results if truth != got],
            }
        )
    )


if __name__ == "__main__":
    main()
