"""The import rule that keeps the layers apart (docs/architecture.md, "Layout").

    commands (engine.entrypoints)  -> anything
    engine                         -> engine, telemetry's record and publisher
    telemetry.lane                 -> the lane only
    telemetry.sidecar              -> the lane and the sidecar
    telemetry.analysis             -> the lane and analysis (never the sidecar)
    telemetry.sources              -> the lane and sources

Every import counts, also one inside a function (the commands import lazily).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "telemetry")

LAYERS = ("engine.entrypoints", "engine", "telemetry.lane", "telemetry.sidecar",
          "telemetry.analysis", "telemetry.sources")  # the first prefixing a module is its layer
MAY_IMPORT: dict[str, set[str]] = {  # layer -> the layers it may import
    "engine.entrypoints": set(LAYERS),
    "engine": {"engine"},
    "telemetry.lane": {"telemetry.lane"},
    "telemetry.sidecar": {"telemetry.lane", "telemetry.sidecar"},
    "telemetry.analysis": {"telemetry.lane", "telemetry.analysis"},
    "telemetry.sources": {"telemetry.lane", "telemetry.sources"},
}
ENGINE_MAY_IMPORT_FROM_LANE = ("telemetry.lane.record", "telemetry.lane.publisher")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[str]:
    """Every project module ``path`` imports (``from a import b`` counts as ``a.b``, which
    names the module when b is one and is still inside a's layer when b is not)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] in PACKAGES]


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str:
    for layer in LAYERS:
        if within(module, layer):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def may_import(layer: str, target: str) -> bool:
    if layer == "engine" and any(within(target, m) for m in ENGINE_MAY_IMPORT_FROM_LANE):
        return True
    return layer_of(target) in MAY_IMPORT[layer]


def violations(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            if module in PACKAGES:  # the bare package __init__ files
                continue
            layer = layer_of(module)
            found += [f"{module} ({layer}) imports {target}"
                      for target in imported_modules(path) if not may_import(layer, target)]
    return found


def test_every_import_points_the_allowed_way():
    assert violations(ROOT) == []


def test_the_check_catches_a_layer_that_reaches_up(tmp_path):
    """The checker itself: an engine module importing a command or the lane beyond record and
    publisher, and analysis importing a sink, are all reported."""
    (tmp_path / "engine" / "entrypoints").mkdir(parents=True)
    (tmp_path / "telemetry" / "analysis").mkdir(parents=True)
    (tmp_path / "engine" / "core.py").write_text(
        "from telemetry.lane.record import IterationRecord\nimport telemetry.lane.curve\n"
        "def f():\n    from engine.entrypoints import serve\n")
    (tmp_path / "telemetry" / "analysis" / "plot.py").write_text(
        "from telemetry.sidecar.sinks.prometheus import PrometheusSink\n")
    assert violations(tmp_path) == [
        "engine.core (engine) imports telemetry.lane.curve",
        "engine.core (engine) imports engine.entrypoints.serve",
        "telemetry.analysis.plot (telemetry.analysis) imports "
        "telemetry.sidecar.sinks.prometheus.PrometheusSink",
    ]


def test_no_module_falls_outside_the_layers():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = module_name(path, ROOT)
            if module not in PACKAGES:
                layer_of(module)
