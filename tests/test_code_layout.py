"""The pipeline's packages import one way only (pipeline/__init__.py): a package imports only the
packages before it, and no module imports one that imports it back, lazily or not."""

import ast
from pathlib import Path

from conftest import REPO

ORDER = ["core", "state", "outer", "train", "evaluation", "islands", "tracking"]
# Packages that do not depend on each other although one comes first in ORDER. The path job
# (train) writes its outer gradient in the merge's format (outer.compression), so outer comes first.
INDEPENDENT = {("evaluation", "train"), ("evaluation", "outer")}


def _imports() -> dict[str, set[str]]:
    """Module -> pipeline modules it imports (at the top or inside a function)."""
    found = {}
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
                for alias in node.names:  # `from pipeline.state import layout` imports a module
                    candidate = f"{node.module}.{alias.name}"
                    exists = (REPO / Path(*candidate.split("."))).with_suffix(".py").exists()
                    targets.add(candidate if exists else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("pipeline")}
        found[name] = targets - {name}
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ORDER else None


def test_each_package_imports_only_the_packages_before_it():
    wrong = []
    for module, targets in _imports().items():
        here = _package(module)
        if here is None:
            continue  # the top: stages, preflight, cli may import anything
        for target in targets:
            there = _package(target)
            if there is None and target != "pipeline":
                wrong.append(f"{module} imports the top-level {target}")
            elif there and there != here and (ORDER.index(there) > ORDER.index(here) or (here, there) in INDEPENDENT):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports()
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        for target in graph.get(module, ()):
            if target in trail:
                cycles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target in graph and len(trail) < 30:
                visit(target, trail + [target])

    for module in graph:
        visit(module, [module])
    assert not cycles, "\n".join(sorted(set(cycles))[:10])


def test_the_layout_is_what_the_package_docstring_says():
    packages = sorted(p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(ORDER)
    assert max(len(list((REPO / "pipeline" / p).glob("*.py"))) for p in packages) <= 8
