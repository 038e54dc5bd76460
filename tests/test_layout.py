"""The import rule that keeps the layers apart (docs/architecture.md, "Layout").

    commands (engine.entrypoints)  -> anything
    engine                         -> engine, telemetry's record and publisher
    telemetry.lane                 -> the lane only
    telemetry.sidecar              -> the lane, the sidecar and analysis (the rules it shares
                                      with `explain`, so live and offline findings agree), and
                                      of the sources only the FPM mapping and numbering (its
                                      own ingest feeds FPM producers in; they import nothing
                                      foreign)
    telemetry.analysis             -> the lane and analysis (never the sidecar), and of the
                                      sources only the FPM mapping and the reader of Dynamo's
                                      FPM recordings (`explain` and `tune` read them; it
                                      shares the mapping and numbering with the live ingest)
    telemetry.sources              -> the lane and sources

Every import counts, also one inside a function (the commands import lazily). And no module
imports itself through others: an import circle (even one behind TYPE_CHECKING) is a seam cut
in the wrong place.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "telemetry")

LAYERS = (
    "engine.entrypoints",
    "engine",
    "telemetry.lane",
    "telemetry.sidecar",
    "telemetry.analysis",
    "telemetry.sources",
)  # the first prefixing a module is its layer
MAY_IMPORT: dict[str, set[str]] = {  # layer -> the layers it may import
    "engine.entrypoints": set(LAYERS),
    "engine": {"engine"},
    "telemetry.lane": {"telemetry.lane"},
    "telemetry.sidecar": {"telemetry.lane", "telemetry.sidecar", "telemetry.analysis"},
    "telemetry.analysis": {"telemetry.lane", "telemetry.analysis"},
    "telemetry.sources": {"telemetry.lane", "telemetry.sources"},
}
ENGINE_MAY_IMPORT_FROM_LANE = ("telemetry.lane.record", "telemetry.lane.publisher")
SIDECAR_MAY_IMPORT_FROM_SOURCES = ("telemetry.sources.fpm", "telemetry.sources.fpm_streams")
ANALYSIS_MAY_IMPORT_FROM_SOURCES = ("telemetry.sources.fpm", "telemetry.sources.fpm_taps")


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
    if layer == "telemetry.sidecar" and any(
        within(target, m) for m in SIDECAR_MAY_IMPORT_FROM_SOURCES
    ):
        return True
    if layer == "telemetry.analysis" and any(
        within(target, m) for m in ANALYSIS_MAY_IMPORT_FROM_SOURCES
    ):
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
            found += [
                f"{module} ({layer}) imports {target}"
                for target in imported_modules(path)
                if not may_import(layer, target)
            ]
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
        "def f():\n    from engine.entrypoints import serve\n"
    )
    (tmp_path / "telemetry" / "analysis" / "plot.py").write_text(
        "from telemetry.sidecar.sinks.prometheus import PrometheusSink\n"
    )
    assert violations(tmp_path) == [
        "engine.core (engine) imports telemetry.lane.curve",
        "engine.core (engine) imports engine.entrypoints.serve",
        "telemetry.analysis.plot (telemetry.analysis) imports "
        "telemetry.sidecar.sinks.prometheus.PrometheusSink",
    ]


def test_the_sidecar_may_import_the_fpm_mapping_and_no_other_source(tmp_path):
    """The one source the sidecar may import is the FPM mapping (no foreign import); a vLLM
    source, which imports vllm, stays out of reach."""
    (tmp_path / "telemetry" / "sidecar").mkdir(parents=True)
    (tmp_path / "telemetry" / "sidecar" / "fpm_engines.py").write_text(
        "from telemetry.sources.fpm import decode_frames\n"
        "from telemetry.sources.vllm_records import RecordMaker\n"
        "import telemetry.sources.fpm_extra\n"
    )
    assert violations(tmp_path) == [
        "telemetry.sidecar.fpm_engines (telemetry.sidecar) imports "
        "telemetry.sources.vllm_records.RecordMaker",
        "telemetry.sidecar.fpm_engines (telemetry.sidecar) imports telemetry.sources.fpm_extra",
    ]


def test_no_module_falls_outside_the_layers():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = module_name(path, ROOT)
            if module not in PACKAGES:
                layer_of(module)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` is ``a.b`` when that is
    a module, else ``a``)."""
    paths = {
        module_name(path, root): path
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
    }
    graph = {}
    for module, path in paths.items():
        targets = set()
        for name in imported_modules(path):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module and name not in PACKAGES:
                targets.add(name)
        graph[module] = targets
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Each import circle once, as the modules along it (depth-first search)."""
    graph, cycles, done = import_graph(root), [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :]
            start = cycle.index(min(cycle))
            rotated = cycle[start:] + cycle[:start]
            if rotated not in cycles:
                cycles.append(rotated)
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_no_module_imports_itself_through_others():
    assert import_cycles(ROOT) == []


def test_the_cycle_check_finds_a_circle_behind_type_checking(tmp_path):
    (tmp_path / "telemetry" / "sidecar").mkdir(parents=True)
    (tmp_path / "telemetry" / "sidecar" / "sink.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from telemetry.sidecar.engine_view import EngineView\n"
    )
    (tmp_path / "telemetry" / "sidecar" / "engine_view.py").write_text(
        "from telemetry.sidecar.sink import EngineStatus\n"
    )
    (tmp_path / "telemetry" / "sidecar" / "ingest.py").write_text(
        "from telemetry.sidecar import sink\n"
    )
    assert import_cycles(tmp_path) == [["telemetry.sidecar.engine_view", "telemetry.sidecar.sink"]]
