"""No code from data: weights, state and routers load without pickle."""

import ast
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

PICKLE_LOADS = {"pickle.load", "pickle.loads", "cloudpickle.load", "cloudpickle.loads", "dill.load", "joblib.load"}


def pickle_loads(source: Path) -> list[str]:
    """Calls in a file that could unpickle: pickle-family loads, torch.load without
    weights_only=True, np.load without allow_pickle=False."""
    found = []
    for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if (name in PICKLE_LOADS
                or name == "torch.load" and keywords.get("weights_only") != "True"
                or name in ("np.load", "numpy.load") and keywords.get("allow_pickle") != "False"):
            found.append(f"{source.name}:{node.lineno}: {name}")
    return found


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=REPO).stdout.split()
    return [REPO / name for name in listed if name.split("/")[0] in ("pipeline", "models", "preprocessing", "airflow", "benchmarks")]


def test_no_pickle_loads_in_the_code():
    files = tracked_python_files()
    assert len(files) > 20  # the scan really sees the project
    assert [hit for f in files for hit in pickle_loads(f)] == []


@pytest.mark.parametrize("code", ["torch.load('x.pt')", "torch.load('x.pt', weights_only=False)", "np.load('c.npy')",
                                  "pickle.loads(blob)"])
def test_the_scan_catches_pickle_loads(code, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"import torch, numpy as np, pickle\nvalue = {code}\n")
    assert pickle_loads(bad) != []

