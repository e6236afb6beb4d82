"""The code imports one way only (pipeline/__init__.py): each layer imports only the layers before
it, no two layers import each other (directly or through others), and no module imports one that
imports it back, lazily or not. Imports are read with ast, at the top of a file or inside a
function alike, so a lazy import breaks the rule as surely as a top-level one."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

# pipeline's packages, each importing only those before it (pipeline/__init__.py lists them).
ORDER = ["core", "state", "routing", "outer", "train", "evaluation", "islands", "tracking", "scaling"]
# Every layer of the repository, lowest first. `pipeline` is the top of pipeline/ (stages, cli,
# preflight, island_rank): the only part of it that may import the Beam app (preprocessing).
LAYERS = ["models", *(f"pipeline.{p}" for p in ORDER), "preprocessing", "pipeline", "benchmarks", "airflow", "scripts"]
# Layers that do not depend on each other although one comes first. The path job (train) writes
# its outer gradient in the merge's format (outer.compression), so outer comes first; the Beam app
# routes (pipeline.routing) and writes shards (pipeline.state), and needs nothing that trains.
INDEPENDENT = {
    ("pipeline.evaluation", "pipeline.train"),
    ("pipeline.evaluation", "pipeline.outer"),
    *(("preprocessing", f"pipeline.{p}") for p in ("outer", "train", "evaluation", "islands", "tracking", "scaling")),
}
NOT_CODE = ("tests/",)  # the test suite


def _module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the repository outside the tests: tracked
    or new, never ignored (a run root under runs/ holds copies of the code in its registered models)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        capture_output=True,
        text=True,
        cwd=root,
        check=True,
    ).stdout.split()
    files = {}
    for rel in sorted(listed):
        path = root / rel
        if rel.startswith(NOT_CODE) or not path.is_file():  # not_file: deleted, not yet staged
            continue
        files[".".join(Path(rel).with_suffix("").parts).removesuffix(".__init__")] = path
    return files


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The repository module a dotted import names, or the longest prefix of it that is one;
    None for third-party code (`airflow.sdk` is Airflow's, airflow/ has no __init__.py)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def _imports() -> dict[str, set[str]]:
    """Module -> repository modules it imports (at the top or inside a function)."""
    modules = _module_files(REPO)
    found = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:  # `from pipeline.state import layout` imports a module
                    targets.add(_resolve(f"{node.module}.{alias.name}", modules))
            elif isinstance(node, ast.Import):
                targets |= {_resolve(a.name, modules) for a in node.names}
        found[name] = targets - {name, None}
    return found


def _layer(module: str) -> str | None:
    """The layer a module belongs to: the longest layer name that is a prefix of it."""
    matching = [layer for layer in LAYERS if module == layer or module.startswith(f"{layer}.")]
    return max(matching, key=len) if matching else None


def _layer_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Layer -> the other layers its modules import."""
    layers: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for module, targets in graph.items():
        layers[_layer(module)] |= {_layer(t) for t in targets} - {_layer(module)}
    return layers


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One cycle (`a -> b -> a`) through each group of nodes that reach each other (Tarjan's
    strongly connected components, so a large graph costs one pass, not one per path)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [" -> ".join(_cycle_in(set(group), graph)) for group in groups]


def _cycle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A cycle within one strongly connected group: walk edges inside it until a node repeats."""
    trail = [min(group)]
    while True:
        step = min(t for t in graph[trail[-1]] if t in group)
        if step in trail:
            return trail[trail.index(step) :] + [step]
        trail.append(step)


def _wrong_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        here = _layer(module)
        for target in sorted(targets):
            there = _layer(target)
            if there != here and (LAYERS.index(there) > LAYERS.index(here) or (here, there) in INDEPENDENT):
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    return wrong


def test_every_module_belongs_to_a_layer():
    """A new top-level package cannot slip past the rule: it must be given its place in LAYERS."""
    assert [m for m in _module_files(REPO) if _layer(m) is None] == []


def test_each_layer_imports_only_the_layers_before_it():
    wrong = _wrong_imports(_imports())
    assert not wrong, "\n".join(wrong)


def test_no_layer_imports_one_that_imports_it_back():
    cycles = _cycles(_layer_imports(_imports()))
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_one_that_imports_it_back():
    cycles = _cycles(_imports())
    assert not cycles, "\n".join(cycles[:10])


def test_the_beam_app_is_imported_only_by_the_top_and_above():
    """preprocessing/ is a leaf of pipeline/: below stages, cli, preflight and island_rank,
    nothing imports it (the re-routing is handed its Beam job instead)."""
    allowed = {"preprocessing", "pipeline", "benchmarks", "airflow", "scripts"}
    wrong = sorted(
        m
        for m, targets in _imports().items()
        if _layer(m) not in allowed and any(_layer(t) == "preprocessing" for t in targets)
    )
    assert not wrong, "\n".join(wrong)


def test_the_layout_is_what_the_package_docstring_says():
    packages = sorted(p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(ORDER)
    assert max(len(list((REPO / "pipeline" / p).glob("*.py"))) for p in packages) <= 8
    doc = ast.get_docstring(ast.parse((REPO / "pipeline" / "__init__.py").read_text()))
    listed = re.findall(r"^    ([a-z]+) ", doc, re.MULTILINE)
    assert listed == ORDER  # in the order they may import each other


# The checks themselves, on made-up graphs: each catches what it is for.
@pytest.mark.parametrize(
    "graph, caught",
    [
        (
            {"pipeline.evaluation.evaluate": {"preprocessing.tokenizer"}, "preprocessing.tokenizer": set()},
            ["pipeline.evaluation.evaluate (pipeline.evaluation) imports preprocessing.tokenizer (preprocessing)"],
        ),
        (
            {"pipeline.state.shards": {"pipeline.routing.router"}},
            ["pipeline.state.shards (pipeline.state) imports pipeline.routing.router (pipeline.routing)"],
        ),
        (
            {"models.grid": {"pipeline.core.config"}},
            ["models.grid (models) imports pipeline.core.config (pipeline.core)"],
        ),
        (
            {"pipeline.islands.island": {"pipeline.stages"}},
            ["pipeline.islands.island (pipeline.islands) imports pipeline.stages (pipeline)"],
        ),
        (
            {"preprocessing.prepare": {"pipeline.evaluation.evaluate"}},
            ["preprocessing.prepare (preprocessing) imports pipeline.evaluation.evaluate (pipeline.evaluation)"],
        ),
        (
            {"pipeline.stages": {"airflow.dags.dipaco_train"}},
            ["pipeline.stages (pipeline) imports airflow.dags.dipaco_train (airflow)"],
        ),
        ({"benchmarks.run": {"pipeline.stages", "preprocessing.prepare", "models.grid"}}, []),
    ],
)
def test_an_import_against_the_order_is_caught(graph, caught):
    assert _wrong_imports(graph) == caught


def test_a_cycle_through_three_layers_is_caught_where_no_two_modules_import_each_other():
    # main's cycle before pipeline.routing: islands -> discriminative -> evaluation -> tokenizer
    graph = {
        "pipeline.islands.island": {"preprocessing.discriminative"},
        "preprocessing.discriminative": {"pipeline.evaluation.evaluate"},
        "pipeline.evaluation.evaluate": {"preprocessing.tokenizer"},
        "preprocessing.tokenizer": set(),
    }
    assert _cycles(graph) == []  # no module cycle
    assert _cycles(_layer_imports(graph)) == ["pipeline.evaluation -> preprocessing -> pipeline.evaluation"]
