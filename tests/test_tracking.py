"""Tracking against a real MLflow SQLite store: run layout, idempotent reruns, plots, redaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_config
from pipeline.core.errors import ConfigError
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.tracking.tracker import MlflowTracker, NullTracker, get_tracker, metric_name, redact, tracking_uri

PATHS = ["p0-0", "p0-1", "p1-0", "p1-1"]
STEPS = 4


def path_metrics(round_index: int, path_id: str) -> dict:
    idx = PATHS.index(path_id)
    return {
        "round": round_index,
        "path": path_id,
        "modules": [[0, idx // 2], [1, idx % 2]],
        "loss": [5.0 - 0.25 * s - 0.01 * idx for s in range(STEPS)],
        "lr": [1e-4 * (s + 1) for s in range(STEPS)],
        "tokens": 256,
        "tokens_per_s": 100.0 + idx,
        "seconds": 2.5,
        "shard_docs": 10 + idx,
        "shard_tokens": 400,
        "ds_config": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}},
        "world_size": 1,
    }


MERGE = {
    "round": 0,
    "paths_merged": ["p0-0", "p0-1", "p1-0"],
    "paths_left_out": ["p1-1"],
    "module_grad_norms": {
        "level=0/module=0": 0.5,
        "level=0/module=1": 0.25,
        "level=1/module=0": 1.5,
        "level=1/module=1": 0.75,
    },
    "bytes_outer": 1000,
    "bytes_data_parallel": 8000,
}
EVAL = {
    "round": 1,
    "perplexity": 42.0,
    "bits_per_byte": 1.25,
    "tokens": 300,
    "bytes": 1200,
    "paths": {p: {"perplexity": 40.0 + i, "bits_per_byte": 1.2 + i / 100, "tokens": 75} for i, p in enumerate(PATHS)},
}


@pytest.fixture
def config(run_root, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tiny_config(
        run_root,
        "mlflow.enabled=true",
        "mlflow.experiment=test-tracking",
        "data.train=https://reader:s3cr3t@data.example.com/c4/*.json",
    )


def client_for(config):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(config))


def runs(config, query: str = "") -> list:
    client = client_for(config)
    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    return client.search_runs([experiment.experiment_id], query, max_results=1000)


def test_disabled_tracking_is_a_null_tracker_that_writes_nothing(run_root):
    config = tiny_config(run_root)  # tiny.yaml: mlflow.enabled false
    tracker = get_tracker(config)
    assert isinstance(tracker, NullTracker)
    tracker.log_run_config()
    tracker.log_path(0, "p0-0", path_metrics(0, "p0-0"))
    tracker.log_merge(0, MERGE)
    assert tracker.register(1, EVAL) is None
    tracker.finish({})
    assert not run_root.exists()


def test_tracking_uri_precedence_and_redaction(run_root, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = tiny_config(run_root, "mlflow.enabled=true")
    assert tracking_uri(config) == f"sqlite:///{run_root.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert tracking_uri(config) == "http://tracker:5000"
    config.mlflow.tracking_uri = "https://alice:pw@tracker.example.com/mlflow"
    assert tracking_uri(config) == "https://alice:pw@tracker.example.com/mlflow"
    assert redact(tracking_uri(config)) == "https://***@tracker.example.com/mlflow"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    remote = tiny_config(run_root, "mlflow.enabled=true", "run_root=memory://bucket/run")
    with pytest.raises(ConfigError, match="mlflow.tracking_uri"):
        tracking_uri(remote)
    assert metric_name("level=0/module=1") == "level_0/module_1"


def commit_merge(run_root: Path, report: dict) -> float:
    """rounds/round=<r>/merge.json committed as the merge commits it; returns its commit time."""
    root = RunRoot(str(run_root))
    rel = layout.round_dir(report["round"])
    root.write_json(f"{rel}/merge.json", report)
    return root.commit(rel, info={"round": report["round"], "next_round": report["round"] + 1}, files=["merge.json"])[
        "committed_at"
    ]


def by_round(config, kind: str) -> dict[int, object]:
    return {int(r.data.tags["dipaco.round"]): r for r in runs(config, f"tags.`dipaco.kind` = '{kind}'")}


def test_a_round_logs_nested_runs_metrics_and_artifacts(config, run_root):
    tracker = get_tracker(config)
    assert isinstance(tracker, MlflowTracker)
    tracker.log_run_config()
    tracker.log_prepare({"paths": {p: {"docs": 10 + i} for i, p in enumerate(PATHS)}, "rejected": 3})
    tracker.log_eval(0, {**EVAL, "round": 0, "perplexity": 99.0})
    for pid in PATHS:
        tracker.log_path(0, pid, path_metrics(0, pid))
    commit_merge(run_root, MERGE)
    tracker.log_merge(0, MERGE)
    tracker.log_eval(1, EVAL)
    tracker.finish({"rounds_committed": 1})

    client = client_for(config)
    (parent,) = runs(config, "tags.`dipaco.kind` = 'pipeline'")
    state = json.loads((run_root / "tracking.json").read_text())
    assert state["parent_run_id"] == parent.info.run_id and parent.info.status == "FINISHED"
    assert parent.data.params["train.inner_steps"] == str(STEPS)
    assert parent.data.params["model.grid"] == "[2, 2]"
    rounds = by_round(config, "round")
    assert sorted(rounds) == [0, 1]  # round 1: the modules round 0's merge wrote, evaluated
    round_run = rounds[0]
    assert {r.data.tags["mlflow.parentRunId"] for r in rounds.values()} == {parent.info.run_id}
    # one numbering: the perplexity on `round R` is that of the modules round R starts from
    assert {r.info.run_name: r.data.metrics["perplexity"] for r in rounds.values()} == {
        "round 0": 99.0,
        "round 1": 42.0,
    }
    assert rounds[1].data.metrics["perplexity/p1-0"] == 42.0 and rounds[1].data.metrics["eval_tokens"] == 300
    assert "modules round 1 starts from" in rounds[1].data.tags["mlflow.note.content"]
    (prepare,) = runs(config, "tags.`dipaco.kind` = 'prepare'")
    assert prepare.data.metrics["rejected"] == 3 and prepare.data.metrics["paths.p1-1.docs"] == 13

    path_runs = {r.data.tags["dipaco.path"]: r for r in runs(config, "tags.`dipaco.kind` = 'path'")}
    assert sorted(path_runs) == PATHS
    p01 = path_runs["p0-1"]
    assert p01.data.tags["mlflow.parentRunId"] == round_run.info.run_id
    assert p01.info.run_name == "round 0 · path p0-1"
    assert p01.data.params["path.modules"] == "[[0, 0], [1, 1]]"
    assert p01.data.params["ds.zero_optimization.stage"] == "2"
    assert p01.data.params["train.lr"] == str(config.train.lr)
    assert p01.data.metrics["tokens_per_s"] == 101.0 and p01.data.metrics["shard_docs"] == 11
    loss = sorted(client.get_metric_history(p01.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in loss] == [(s, 5.0 - 0.25 * s - 0.01) for s in range(STEPS)]

    (merge,) = runs(config, "tags.`dipaco.kind` = 'merge'")
    assert merge.data.tags["mlflow.parentRunId"] == round_run.info.run_id and merge.info.run_name == "round 0 · merge"
    assert merge.data.metrics["outer_grad_norm/level_1/module_0"] == 1.5
    assert merge.data.metrics["paths_left_out"] == 1 and merge.data.params["paths_left_out"] == "p1-1"
    assert merge.data.metrics["communication_saving"] == 8.0
    assert "perplexity" not in merge.data.metrics  # that is round 1's, on `round 1`
    history = client.get_metric_history(parent.info.run_id, "perplexity")
    assert sorted((m.step, m.value) for m in history) == [(0, 99.0), (1, 42.0)]
    assert parent.data.metrics["bits_per_byte"] == 1.25 and parent.data.metrics["bits_per_byte/p0-1"] == 1.21
    assert parent.data.metrics["eval_bytes"] == 1200

    artifacts = Path(client.download_artifacts(parent.info.run_id, "", str(run_root / "dl")))
    for name in (
        "loss_curves",
        "docs_per_path",
        "perplexity_by_round",
        "bits_per_byte_by_round",
        "outer_grad_norm_heatmap",
    ):
        png = artifacts / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert (artifacts / "ds_configs" / "zero2.json").is_file()
    assert json.loads((artifacts / "eval" / "round=1.json").read_text())["perplexity"] == 42.0
    assert json.loads((artifacts / "shard_manifest.json").read_text())["rejected"] == 3
    assert "inner_steps: 4" in (artifacts / "run.yaml").read_text()
    # artifacts stay in the run root, not in the working directory
    assert (run_root / "mlartifacts").is_dir() and not (REPO / "mlruns").exists()


def test_credentials_never_reach_params_or_artifacts(config, run_root):
    tracker = get_tracker(config)
    tracker.log_run_config()
    tracker.log_path(0, "p0-0", path_metrics(0, "p0-0"))
    client = client_for(config)
    for run in runs(config):
        assert not any("s3cr3t" in v for v in run.data.params.values())
        if run.data.tags["dipaco.kind"] in ("pipeline", "path"):  # the runs that carry the config
            assert run.data.params["data.train"] == "https://***@data.example.com/c4/*.json"
        local = Path(client.download_artifacts(run.info.run_id, "", str(run_root / "dl" / run.info.run_id)))
        for file in local.rglob("*"):
            if file.is_file():
                assert b"s3cr3t" not in file.read_bytes(), file


def test_reruns_and_new_processes_reuse_the_same_runs(config, run_root):
    tracker = get_tracker(config)
    tracker.log_run_config()
    tracker.log_path(0, "p0-0", path_metrics(0, "p0-0"))
    tracker.log_path(0, "p0-0", path_metrics(0, "p0-0"))  # a retried task logs again
    tracker.log_eval(0, {**EVAL, "round": 0})
    tracker.log_eval(0, {**EVAL, "round": 0})  # a retried task: logged once
    # another process (an Airflow task) logs the next path of the same round
    script = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from conftest import tiny_config\n"
        "from pipeline.tracking.tracker import get_tracker\n"
        "from test_tracking import path_metrics\n"
        f"config = tiny_config({str(run_root)!r}, 'mlflow.enabled=true', 'mlflow.experiment=test-tracking',"
        " 'data.train=https://reader:s3cr3t@data.example.com/c4/*.json')\n"
        "get_tracker(config).log_path(0, 'p0-1', path_metrics(0, 'p0-1'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, check=True, timeout=120)

    assert len(runs(config, "tags.`dipaco.kind` = 'pipeline'")) == 1
    (round_run,) = runs(config, "tags.`dipaco.kind` = 'round'")
    assert len(client_for(config).get_metric_history(round_run.info.run_id, "perplexity")) == 1
    path_runs = runs(config, "tags.`dipaco.kind` = 'path'")
    assert sorted(r.data.tags["dipaco.path"] for r in path_runs) == ["p0-0", "p0-1"]
    assert {r.data.tags["mlflow.parentRunId"] for r in path_runs} == {round_run.info.run_id}
    client = client_for(config)
    p00 = next(r for r in path_runs if r.data.tags["dipaco.path"] == "p0-0")
    assert len(client.get_metric_history(p00.info.run_id, "loss")) == STEPS
    (parent,) = runs(config, "tags.`dipaco.kind` = 'pipeline'")
    assert len(client.get_metric_history(parent.info.run_id, "perplexity")) == 1


def test_racing_creators_converge_on_the_oldest_round_run(config):
    tracker = get_tracker(config)
    parent = tracker._parent()
    first = tracker._create("round=3", parent, "round 3", {"dipaco.kind": "round", "dipaco.round": "3"})
    tracker._create("round=3", parent, "round 3", {"dipaco.kind": "round", "dipaco.round": "3"})
    assert tracker._round(3) == first.info.run_id
    # a half-logged leaf (its logger died) is replaced, a finished one is kept
    stale = tracker._create("round=3/merge", first.info.run_id, "merge", {"dipaco.kind": "merge"})
    tracker.log_merge(3, {**MERGE, "round": 3})
    (merge,) = runs(config, "tags.`mlflow.dipaco.key` = 'round=3/merge'")
    assert merge.info.run_id != stale.info.run_id and merge.info.status == "FINISHED"


def test_runs_carry_the_real_start_and_end_of_their_work(config, run_root):
    """A path run spans its inner loop and a merge run its merge, not the moment they were logged."""
    tracker = get_tracker(config)
    now = time.time()
    metrics = {**path_metrics(0, "p0-0"), "started_at": now - 100.0, "finished_at": now - 92.0, "seconds": 8.0}
    tracker.log_path(0, "p0-0", metrics)
    committed_at = commit_merge(run_root, {**MERGE, "seconds": 3.0})
    tracker.log_merge(0, {**MERGE, "seconds": 3.0})

    (path,) = runs(config, "tags.`dipaco.kind` = 'path'")
    assert (path.info.start_time, path.info.end_time) == (int((now - 100) * 1000), int((now - 92) * 1000))
    (merge,) = runs(config, "tags.`dipaco.kind` = 'merge'")
    assert merge.info.end_time == int(committed_at * 1000)
    assert merge.info.end_time - merge.info.start_time == 3000
    (round_run,) = runs(config, "tags.`dipaco.kind` = 'round'")
    assert round_run.info.start_time == path.info.start_time  # the round began with its first path
    assert round_run.info.end_time == merge.info.end_time and round_run.info.status == "FINISHED"


def test_loss_is_logged_at_global_steps_so_a_path_curve_joins_across_rounds(config):
    tracker = get_tracker(config)
    tracker.log_path(0, "p0-0", {**path_metrics(0, "p0-0"), "first_step": 0})
    tracker.log_path(1, "p0-0", {**path_metrics(1, "p0-0"), "first_step": STEPS})
    old = path_metrics(2, "p0-0")  # a metrics.json written before first_step existed
    tracker.log_path(2, "p0-0", old)
    client = client_for(config)
    steps = {}
    for run in runs(config, "tags.`dipaco.kind` = 'path'"):
        history = client.get_metric_history(run.info.run_id, "loss")
        steps[run.info.run_name] = sorted(m.step for m in history)
    assert steps == {f"round {r} · path p0-0": list(range(r * STEPS, (r + 1) * STEPS)) for r in (0, 1, 2)}
    # the run's plots still see one curve per path and round
    assert sorted(tracker._path_series("loss")["p0-0"]) == [0, 1, 2]


def test_the_parent_holds_totals_over_merges_and_no_bookkeeping_in_sight(config, run_root):
    tracker = get_tracker(config)
    tracker.log_run_config()
    first = {**MERGE, "seconds": 2.0}
    second = {**MERGE, "round": 1, "seconds": 3.0, "paths_left_out": [], "paths_merged": PATHS}
    for report in (first, second):
        commit_merge(run_root, report)
        tracker.log_merge(report["round"], report)
        tracker.log_eval(report["round"] + 1, {**EVAL, "round": report["round"] + 1})
    tracker.log_eval(1, {**EVAL, "round": 1})  # logged once

    (parent,) = runs(config, "tags.`dipaco.kind` = 'pipeline'")
    metrics = parent.data.metrics
    assert metrics["rounds_merged"] == 2 and metrics["merge_seconds_total"] == 5.0
    assert metrics["paths_left_out_total"] == 1 and metrics["communication_saving"] == 8.0
    assert not {"seconds", "paths_merged", "paths_left_out"} & set(metrics)  # not one merge's figures
    # what the run page lists: tags a user filters on; the tracker's own keys stay under mlflow.
    visible = {k for run in runs(config) for k in run.data.tags if not k.startswith("mlflow.")}
    assert visible <= {"dipaco.kind", "dipaco.round", "dipaco.path", "dipaco.run_root"}, visible
