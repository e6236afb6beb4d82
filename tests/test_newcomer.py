"""A newcomer's first hour: what the README and docs/ show runs as written, in a fresh process, on a
fresh clone (no file outside the repository, no path of the machine the docs were written on)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.run import Run
from pipeline.tracking.report import format_summary

README = (REPO / "README.md").read_text()
DOCS = {
    path: path.read_text()
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
}


def code_blocks(language: str) -> list[str]:
    """The fenced blocks of one language in the README and every doc it maps."""
    return [block for text in DOCS.values() for block in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as -."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_docs_link_only_to_files_and_headings_in_the_repository():
    for path, text in DOCS.items():
        links = re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", text)
        local = [(link, anchor) for link, anchor in links if "://" not in link]
        for link, anchor in local:
            target = (path.parent / link).resolve() if link else path
            assert target.is_relative_to(REPO) and target.exists(), f"{path.name}: {link}"
            if anchor and target.suffix == ".md":
                assert anchor in heading_anchors(target.read_text()), f"{path.name}: {link}#{anchor}"
        assert "../shared" not in text, path.name
    assert "docs/design.md" in README


def test_the_docs_show_no_machine_path_and_commands_that_need_no_activated_venv():
    for path, text in DOCS.items():
        assert not re.search(r"/(work|home|Users|tmp)/\w", text), f"{path.name}: an absolute path of some machine"
        for line in text.splitlines():
            if re.search(r"\bmlflow ui\b", line):
                assert ".venv/bin/mlflow ui" in line, f"{path.name}: {line}"
    assert "sqlite:///runs/demo/mlflow.db" in README


def test_the_summary_prints_commands_that_run_from_where_it_was_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = {
        "run_root": str(tmp_path / "runs" / "demo"),
        "rounds_committed": 2,
        "train_rounds": 2,
        "eval": {0: {"perplexity": 9.0, "paths": {}}},
        "registered_model": "dipaco-demo",
        "model_version": "2",
        "tracking_uri": f"sqlite:///{tmp_path}/runs/demo/mlflow.db",
    }
    text = format_summary(summary)
    assert text.splitlines()[0] == "dipaco run: runs/demo: 2 round(s) of train.rounds=2 committed"
    assert "--backend-store-uri sqlite:///runs/demo/mlflow.db --port " in text
    command = text.split("MLflow UI: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false ", 1)[1].split()[0]  # found from here
    assert Path(command).name == "mlflow" and (tmp_path / command).is_file()
    assert "raise train.rounds" in text.splitlines()[-1]


def test_the_mlflow_hint_fits_each_kind_of_tracking_uri_and_names_the_page(monkeypatch):
    import socket

    from pipeline.tracking.report import mlflow_hint

    page = "(experiment dipaco, Model training → Training runs)"
    with socket.socket() as busy:  # a tracking server (or anything) on 5000: the UI gets another port
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 5000))
            busy.listen()
        except OSError:
            pass  # 5000 is taken already, which is the case under test too
        local = mlflow_hint("sqlite:///runs/demo/mlflow.db", "dipaco", "1", "abc")
    assert local[0].startswith("MLflow UI: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false ")
    command = local[0].split("false ", 1)[1]
    assert re.fullmatch(r"\S*mlflow ui --backend-store-uri sqlite:///runs/demo/mlflow\.db --port \d+", command), command
    port = int(command.rsplit(" ", 1)[1])
    assert port != 5000
    assert local[1] == f"  then open http://127.0.0.1:{port}/#/experiments/1/runs/abc {page}"

    server = mlflow_hint("http://127.0.0.1:5000", "dipaco", "1", "abc")
    assert server == [f"MLflow UI: http://127.0.0.1:5000/#/experiments/1/runs/abc (the tracking server; {page[1:]}"]

    monkeypatch.setenv("DATABRICKS_HOST", "https://adb-1.azuredatabricks.net/")
    remote = mlflow_hint("databricks", "dipaco", "1", "abc")
    assert remote == [f"MLflow UI: https://adb-1.azuredatabricks.net/ml/experiments/1/runs/abc {page}"]
    assert not any("mlflow ui" in line or "--port" in line for line in server + remote)


@pytest.fixture(scope="module")
def demo_clone(tmp_path_factory):
    """A directory laid out like a clone after `make demo`: runs/demo with a registered
    `dipaco-demo` (tiny model, real Beam prepare on a little text)."""
    from test_registry import real_text_config, write_c4

    from pipeline import stages
    from pipeline.tracking.tracker import get_tracker

    os.environ.pop("MLFLOW_TRACKING_URI", None)
    clone = tmp_path_factory.mktemp("clone")
    data = write_c4(tmp_path_factory.mktemp("c4"))
    config = real_text_config(
        clone / "runs" / "demo", data, "mlflow.experiment=dipaco-demo", "mlflow.registered_model=dipaco-demo"
    )
    run = Run(config)
    stages.init_run(run)
    stages.prepare(run)
    get_tracker(config).register(0, {"round": 0, "perplexity": 100.0, "tokens": 10})
    return clone


@pytest.mark.slow  # ~30 s: a Beam prepare, a registration and a fresh process loading the model
def test_the_documented_pyfunc_snippet_runs_as_written_in_a_fresh_process(demo_clone):
    (snippet,) = [block for block in code_blocks("python") if "pyfunc.load_model" in block]
    before = sorted(p.name for p in demo_clone.iterdir())
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run(
        [sys.executable, "-c", snippet], cwd=demo_clone, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (continuation,) = ast.literal_eval(done.stdout.strip().splitlines()[-1])  # print() of a list of str
    assert isinstance(continuation, str)
    assert sorted(p.name for p in demo_clone.iterdir()) == before  # no stray ./mlflow.db or ./mlruns


def test_the_registered_model_describes_itself(demo_clone):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{demo_clone / 'runs' / 'demo' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    model = client.get_registered_model("dipaco-demo")
    assert "[2, 2] grid" in model.description and "tokenizer bpe (vocabulary 512)" in model.description
    assert "train.rounds=2" in model.description
    version = client.get_model_version("dipaco-demo", "1")
    assert "round 0" in version.description and "routed perplexity 100.00" in version.description
    import mlflow

    mlflow.set_registry_uri(uri)
    source = mlflow.artifacts.download_artifacts(
        "models:/dipaco-demo/1", dst_path=str(demo_clone.parent / "dl"), tracking_uri=uri
    )
    example = json.loads((Path(source) / "serving_input_example.json").read_text())
    assert example["params"] == {"max_new_tokens": 8}  # MLflow predicted this before registering
