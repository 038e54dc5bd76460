"""Write every dashboard as deterministic JSON: ``python -m dashboards.build [--check]``.

``--check`` writes nothing and exits 1 when a checked-in JSON file differs from what the
code generates (a stale dashboard).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dashboards import iterations, overview, pipeline
from dashboards.common import to_json

JSON_DIR = Path(__file__).parent / "json"
DASHBOARDS = {
    "overview": overview.build,
    "iterations": iterations.build,
    "pipeline": pipeline.build,
}


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{name}.json": to_json(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    parser.add_argument("--out", type=Path, default=JSON_DIR, help="output directory")
    args = parser.parse_args(argv)
    stale = []
    for file_name, text in render_all().items():
        path = args.out / file_name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("stale dashboards (run `make dashboards`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
