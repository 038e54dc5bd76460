"""One benchmark on two versions of the code, side by side in one run: before vs after a change.

    .venv/bin/python bench/before_after.py BEFORE_REF [AFTER_REF] [--rounds 3] \\
        -- bench/sidecar_ingest.py --records 200000

Checks both commits out into temporary git worktrees (AFTER_REF defaults to the working tree
itself, uncommitted changes included), then runs the benchmark command in each, alternating
before/after ``--rounds`` times, so both see the same machine load. Each run's last output
line is the benchmark's JSON object; every numeric figure is printed per run with the ratio
of the means (after / before). The last line is one JSON object: {figure: {"before": [...],
"after": [...], "ratio": r}}. The machine is shared and noisy: read "no systematic change",
not small differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(tree: Path, command: list[str]) -> dict:
    """The benchmark's JSON figures, run with this repository's venv from ``tree``."""
    done = subprocess.run(
        [sys.executable, *command], cwd=tree, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def numeric(figures: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in figures.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: before_after.py BEFORE_REF [AFTER_REF] [--rounds N] -- BENCH")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": Path(tmp) / "before", "after": ROOT}
        refs = {"before": args.before}
        if args.after:
            trees["after"], refs["after"] = Path(tmp) / "after", args.after
        for name, ref in refs.items():
            subprocess.run(
                ["git", "worktree", "add", "--detach", "-q", str(trees[name]), ref],
                cwd=ROOT,
                check=True,
            )
        try:
            runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for round_index in range(args.rounds):
                for name in ("before", "after"):
                    figures = numeric(run_bench(trees[name], command))
                    runs[name].append(figures)
                    print(
                        f"round {round_index} {name}: "
                        + ", ".join(f"{k}={v:.4g}" for k, v in figures.items()),
                        flush=True,
                    )
        finally:
            for name in refs:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(trees[name])],
                    cwd=ROOT,
                    check=False,
                )
    result = {}
    for key in runs["after"][0]:
        before = [run[key] for run in runs["before"] if key in run]
        after = [run[key] for run in runs["after"]]
        if not before:
            continue
        ratio = statistics.mean(after) / statistics.mean(before) if statistics.mean(before) else 0
        result[key] = {"before": before, "after": after, "ratio": ratio}
        print(
            f"{key}: before {statistics.mean(before):.4g}, after {statistics.mean(after):.4g}, "
            f"after / before {ratio:.3f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
