"""`dipaco sweep`: the sweep file is checked before anything runs, its points are normal runs that
resume after a crash without retraining what was committed, and the fits recover known laws."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from conftest import REPO, TINY_VOCAB, write_synthetic_shards
from pipeline import stages
from pipeline import sweep as sweeps
from pipeline.core.errors import ConfigError
from pipeline.run import Run
from pipeline.scaling import laws, point_queue, spec
from pipeline.scaling.report import format_report
from pipeline.state import layout
from pipeline.state.storage import RunRoot

# configs/tiny.yaml as one dense path on synthetic shards (no Beam job), trained in this process
TINY = {
    "model.grid": [1],
    "model.blocks_per_level": [2],
    "model.tokenizer": "gpt2",
    "model.vocab_size": TINY_VOCAB,
    "train.launcher": "inprocess",
    "train.inner_steps": 2,
    "train.lr": 0.01,
}


def sweep_file(tmp_path, axes: dict, budget: dict | None = None, **extra) -> str:
    settings = {k: v for k, v in TINY.items() if k not in axes}
    doc = {
        "base": "configs/tiny.yaml",
        "sweep_root": str(tmp_path / "sweep"),
        "set": settings,
        "axes": axes,
        "budget": budget or {"steps": 4},
        "mlflow": {"enabled": False},
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def with_shards(path: str) -> tuple[spec.Sweep, list[spec.Point]]:
    """The sweep's shared data as synthetic shards (what its prepare would commit)."""
    sweep, points = sweeps.plan(path)
    for point in points:
        root = RunRoot(sweeps.prepared_root(sweep, point.config))
        if not root.is_committed(layout.SHARDS_DIR):
            write_synthetic_shards(root, point.config.model.grid)
    return sweep, points


def files(root: RunRoot, rel: str) -> dict[str, tuple[int, int]]:
    base = root.local_path(rel)
    return {str(p.relative_to(base)): (p.stat().st_mtime_ns, p.stat().st_size) for p in base.rglob("*") if p.is_file()}


def module_bytes(root: RunRoot, round_index: int) -> dict[str, bytes]:
    rel = layout.modules_dir(round_index)
    return {name: root.read_committed(rel, name) for name in root.marker(rel)["files"]}


# -- the sweep file -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "axes, budget, message",
    [
        (
            {"model.hidden_sise": [16, 32]},
            None,
            r"axes\.model\.hidden_sise: not a config key \(did you mean model\.hidden_size",
        ),
        ({"outer.lr": []}, None, r"axes\.outer\.lr is empty: give at least one value"),
        ({"outer.lr": 0.7}, None, r"axes\.outer\.lr must be a list of values"),
        ({"algorithm": ["sync", "fedavg"]}, None, r"axes\.algorithm: 'fedavg' is not an algorithm"),
        (
            {"train.rounds": [1, 2]},
            None,
            r"axes\.train\.rounds: a sweep cannot set it: the budget decides train\.rounds",
        ),
        ({"outer.lr": [0.5]}, {"tokens_per_param": -1}, r"budget\.tokens_per_param must be a positive number"),
        ({"outer.lr": [0.5]}, {"flops": 10}, r"budget must be one of"),
    ],
)
def test_a_wrong_sweep_file_is_refused_naming_the_key(tmp_path, axes, budget, message):
    path = sweep_file(tmp_path, axes, budget)
    with pytest.raises(ConfigError, match=message) as caught:
        spec.load_sweep(path)
    assert str(caught.value).startswith(path)
    assert not (tmp_path / "sweep").exists()


def test_unknown_keys_and_bad_point_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key axis \(known: base, sweep_root"):
        spec.load_sweep(sweep_file(tmp_path, {"outer.lr": [0.5]}, axis={"outer.lr": [1]}))
    with pytest.raises(ConfigError, match=r"unknown key quick\.axis"):
        spec.load_sweep(sweep_file(tmp_path, {"outer.lr": [0.5]}, quick={"axis": {}}))
    with pytest.raises(ConfigError, match=r"quick\.axes\.train\.lr is empty"):  # checked without --quick too
        spec.load_sweep(sweep_file(tmp_path, {"outer.lr": [0.5]}, quick={"axes": {"train.lr": []}}))
    with pytest.raises(ConfigError, match=r"point h33: .*model.num_heads must divide model.hidden_size \(33\)"):
        spec.expand(spec.load_sweep(sweep_file(tmp_path, {"model.hidden_size": [32, 33]})))


def test_the_cli_refuses_a_wrong_sweep_file_in_one_line_before_torch_loads(tmp_path):
    path = sweep_file(tmp_path, {"model.hidden_sise": [16]})
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline.cli", "sweep", "--config", path],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and len(errors) == 1 and "axes.model.hidden_sise: not a config key" in errors[0]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "deepspeed", "mlflow", "apache_beam"} & imported


# -- the points -----------------------------------------------------------------------------------
def test_sync_and_diloco_points_train_the_same_tokens_and_sync_ignores_the_outer_step(tmp_path):
    sweep = spec.load_sweep(
        sweep_file(
            tmp_path,
            {
                "algorithm": ["sync", "diloco"],
                "model.hidden_size": [16, 32],
                "train.workers_per_path": [1, 2],
                "outer.lr": [0.4, 0.7],
                "train.inner_steps": [2, 3],
            },
            {"tokens_per_param": 0.5},
        )
    )
    points = spec.expand(sweep)
    sync = [p for p in points if p.algorithm == "sync"]
    assert len(sync) == 4 and len(points) == 4 + 16  # sync: one point per size and M, whatever the outer lr and H
    assert {p.id for p in sync} == {"sync_h16_m1", "sync_h16_m2", "sync_h32_m1", "sync_h32_m2"}
    by_id = {p.id: p for p in points}
    s, d = by_id["sync_h32_m2"].config, by_id["diloco_h32_m2_olr0.4_H3"].config
    assert (
        s.train.workers_per_path,
        s.train.gradient_accumulation_steps,
        s.outer.lr,
        s.outer.momentum,
        s.outer.nesterov,
        s.train.inner_steps,
    ) == (1, 2, 1.0, 0.0, False, 3)
    assert (d.train.workers_per_path, d.train.gradient_accumulation_steps, d.outer.lr) == (2, 1, 0.4)
    assert d.run_root == f"{sweep.sweep_root}/runs/diloco_h32_m2_olr0.4_H3" and not d.mlflow.enabled
    for size in (16, 32):  # every point of one size: the same tokens at any M, in whole rounds of its H
        same = [p for p in points if p.values["model.hidden_size"] == size]
        assert len({p.tokens for p in same}) == 1 and len({p.steps * p.M for p in same}) == 1
        assert all(p.steps % 6 == 0 and p.config.train.rounds * p.config.train.inner_steps == p.steps for p in same)
    n, per_step = by_id["sync_h32_m1"].N, s.train.micro_batch_size * s.model.seq_len
    assert by_id["sync_h32_m1"].steps == 12 * max(1, round(0.5 * n / per_step / 12))  # lcm(H) x lcm(M) = 12


def test_non_embedding_params_count_the_decoder_blocks_of_the_real_model():
    from models.modular import ModelShape, build_path_model
    from pipeline.core.config import load_config

    config = load_config(REPO / "configs" / "tiny.yaml", ["model.hidden_size=48", "model.path_specific_blocks=1"])
    model = build_path_model(ModelShape.from_config(config.model))
    blocks = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    assert spec.non_embedding_params(config) == blocks


# -- runs -----------------------------------------------------------------------------------------
def test_a_sweep_point_is_the_same_run_as_its_config_alone(tmp_path):
    sweep, points = with_shards(sweep_file(tmp_path, {"algorithm": ["diloco"], "train.workers_per_path": [2]}))
    (point,) = points
    result = sweeps.command(sweep.source)
    assert result["trained"] == 1

    alone = dataclasses.replace(point.config, run_root=str(tmp_path / "alone"))
    write_synthetic_shards(stages.init_run(Run(alone)), alone.model.grid)
    summary = stages.run(Run(alone))
    last = alone.train.rounds
    a, b = RunRoot(point.config.run_root), RunRoot(alone.run_root)
    assert a.read_json(layout.eval_file(last)) == b.read_json(layout.eval_file(last))
    assert module_bytes(a, last) == module_bytes(b, last)  # bitwise
    committed = RunRoot(sweep.sweep_root).read_json(f"points/{point.id}/result.json")
    assert committed["bits_per_byte"] == summary["eval"][last]["bits_per_byte"]
    shared = RunRoot(sweeps.prepared_root(sweep, point.config)).local_path(layout.SHARDS_DIR)
    for shard in (p for p in shared.rglob("*") if p.is_file()):  # the point's shards are the shared files
        linked = a.local_path(layout.SHARDS_DIR) / shard.relative_to(shared)
        assert linked.stat().st_ino == shard.stat().st_ino, f"{linked} is a copy, not a link"


def test_a_sweep_that_crashed_mid_point_resumes_without_retraining_committed_points(tmp_path, monkeypatch):
    path = sweep_file(tmp_path, {"algorithm": ["sync", "diloco"]}, mlflow={"enabled": True})
    sweep, points = with_shards(path)
    first, second = points
    real_run, calls = stages.run, []

    def crash_once(run, rounds=None):
        calls.append(run.config.run_root)
        if run.config.run_root == second.config.run_root and len(calls) == 2:
            real_run(run, rounds=1)  # round 0 trains and commits, then the process "dies"
            raise RuntimeError("injected crash after round 0")
        return real_run(run, rounds)

    monkeypatch.setattr(stages, "run", crash_once)
    with pytest.raises(RuntimeError, match="injected crash"):
        sweeps.command(path)
    root = RunRoot(sweep.sweep_root)
    assert root.is_committed(f"points/{first.id}") and not root.is_committed(f"points/{second.id}")
    assert layout.next_round(RunRoot(second.config.run_root)) == 1  # the crashed point kept its committed round
    before = {rel: files(root, rel) for rel in (f"runs/{first.id}", f"points/{first.id}")}

    calls.clear()
    report = sweeps.command(path)
    assert calls == [second.config.run_root]  # the committed point was not trained again
    assert (report["trained"], report["reused"]) == (1, 1)
    assert {rel: files(root, rel) for rel in before} == before  # its files untouched
    fit = json.loads(root.local_path("fit.json").read_text())
    assert fit["sweep"]["committed"] == 2 and set(fit["groups"]) == {"sync M=1", "diloco M=1"}
    finding = fit["findings"]["diloco_m1_not_worse_than_sync"]
    assert finding["verdict"] in ("reproduced", "not reproduced", "unresolved") and len(finding["difference_by_N"]) == 1

    from mlflow.tracking import MlflowClient  # one parent run, one nested run per point, logged once

    client = MlflowClient(f"sqlite:///{root.local_path('mlflow.db')}")
    runs = client.search_runs([client.get_experiment_by_name("dipaco-sweep").experiment_id])
    (parent,) = [r for r in runs if r.data.tags["dipaco.kind"] == "sweep"]
    nested = sorted(r.data.tags["dipaco.point"] for r in runs if r.data.tags["dipaco.kind"] == "sweep_point")
    assert nested == sorted([first.id, second.id])
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in runs if r is not parent)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"points_table.json", "fit.json", "points.csv", "plots"} <= artifacts


# -- points as leased tasks -------------------------------------------------------------------------
def lease_records(sweep: spec.Sweep, point_id: str) -> list[dict]:
    folder = RunRoot(sweep.sweep_root).local_path(f"queue/leases/point.r0.{point_id}")
    return [
        json.loads((folder / f"attempt-{n}.json").read_text()) for n in range(1, len(list(folder.glob("*.json"))) + 1)
    ]


def hand_made_attempt(sweep: spec.Sweep, point_id: str, number: int, **fields) -> None:
    """An attempt another process wrote: a holder that died (running, beats that never change) or
    one that failed."""
    folder = RunRoot(sweep.sweep_root).local_path(f"queue/leases/point.r0.{point_id}")
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    record = {"task": {"round": 0, "kind": "point", "target": point_id}, "island": "gone", "island_id": "gone-1"}
    record |= {"claimed_at": now, "heartbeat": now, "beats": 0, "state": "running", **fields}
    (folder / f"attempt-{number}.json").write_text(json.dumps(record))


@pytest.mark.usefixtures("no_collector_pauses")  # lease timing: conftest says why
def test_a_dead_holders_point_is_taken_over_after_its_lease_and_a_live_one_is_waited_for(tmp_path):
    # 2 s: above the longest collector pause measured in this process (1.4 s; conftest's no_collector_pauses)
    path = sweep_file(tmp_path, {"algorithm": ["sync", "diloco"]}, set={**TINY, "train.lease_seconds": 2.0})
    sweep, points = with_shards(path)
    dead, live = points
    hand_made_attempt(sweep, dead.id, 1)  # its holder was killed: the beats never change again
    other = sweeps.point_queue_of(sweep, points)  # a second host training this sweep's points
    held = other.claim(point_queue.point_task(live.id), "other-host")
    assert held is not None
    threading.Timer(3.0, held.finish, args=("released",), kwargs={"reason": "the other host stopped"}).start()

    report = sweeps.command(path)
    assert report["trained"] == 2
    first, second = lease_records(sweep, dead.id)
    assert (first["state"], first["beats"]) == ("running", 0) and second["state"] == "done"  # expired, then redone
    assert second["island"] == "sweep-lane-0" and second["island_id"].startswith("sweep-lane-0-")
    theirs, ours = lease_records(sweep, live.id)
    assert theirs["state"] == "released" and theirs["beats"] >= 4  # it was alive: its beats went on
    assert ours["state"] == "done" and ours["claimed_at"] >= theirs["finished_at"]  # never two holders at once
    assert RunRoot(sweep.sweep_root).is_committed(f"points/{dead.id}")
    lanes = report["lanes"]
    assert lanes["lanes"] == 1 and lanes["busy_seconds"] == pytest.approx(second["seconds"] + ours["seconds"])
    assert 0 < lanes["utilisation"] < 1  # it waited for the other host
    assert "1 lane(s) busy" in format_report(report)


@pytest.mark.usefixtures("no_collector_pauses")  # lease timing: conftest says why
def test_the_dags_train_point_waits_for_the_live_holder_and_returns_what_it_committed(tmp_path):
    """A retried or duplicate DAG task for a point that another live process trains: it trains
    nothing beside it, and returns the result that process commits."""
    # Nothing here may expire: a lease far longer than any pause of this process (conftest's
    # no_collector_pauses), which would stall the holder's beats while the waiter's clock runs on.
    path = sweep_file(tmp_path, {"algorithm": ["diloco"]}, set={**TINY, "train.lease_seconds": 10.0})
    sweep, points = with_shards(path)
    (point,) = points
    held = sweeps.point_queue_of(sweep, points).claim(point_queue.point_task(point.id), "cli-lane")
    returned = []
    waiter = threading.Thread(target=lambda: returned.append(sweeps.train_point(sweep, points, point.id)))
    waiter.start()
    result = sweeps.run_point(sweep, point, lease=held)  # the holder trains (this thread: in-process islands)
    assert result is not None, "the holder lost its lease while training"
    held.finish("done", seconds=result["seconds"])
    waiter.join(timeout=30)
    assert returned == [result]
    assert [r["island"] for r in lease_records(sweep, point.id)] == ["cli-lane"]  # the waiter claimed nothing


@pytest.mark.usefixtures("no_collector_pauses")  # lease timing: conftest says why
def test_a_holder_that_lost_its_lease_while_paused_commits_nothing_and_its_successor_does(tmp_path, monkeypatch):
    settings = {**TINY, "train.lease_seconds": 1.0, "train.max_attempts": 5}
    path = sweep_file(tmp_path, {"algorithm": ["diloco"]}, set=settings)
    sweep, (point,) = with_shards(path)
    real_run, calls = stages.run, []

    def paused_past_its_lease(run, rounds=None):
        summary = real_run(run, rounds)
        if run.config.run_root.startswith(str(tmp_path)):  # this sweep's runs only, whatever else runs
            calls.append(run.config.run_root)
        if len(calls) == 1:  # while it "slept", a reader expired it and another host claimed attempt 2
            hand_made_attempt(sweep, point.id, 2, island="successor")
        return summary

    monkeypatch.setattr(stages, "run", paused_past_its_lease)
    report = sweeps.command(path)
    records = lease_records(sweep, point.id)
    assert [r["island"] for r in records] == ["sweep-lane-0", "successor", "sweep-lane-0"]
    assert records[0]["state"] == "running" and records[2]["state"] == "done"  # the zombie wrote no outcome
    assert len(calls) == 2 and report["trained"] == 1
    committed = RunRoot(sweep.sweep_root).read_committed_json(f"points/{point.id}", "result.json")
    assert committed["started_at"] >= records[2]["claimed_at"]  # the result is the successor's


def test_when_a_point_fails_no_lane_claims_another(tmp_path, monkeypatch):
    """Two lanes: the first point claimed fails; the lane beside it finishes its own point and
    claims nothing more, so the error surfaces instead of the sweep running on. (stages.run is
    replaced: this is the error path of the lanes, not training.)"""
    settings = {**TINY, "train.launcher": "deepspeed"}  # not in-process: two lanes
    path = sweep_file(tmp_path, {"model.hidden_size": [16, 24, 32]}, set=settings, lanes=2)
    sweep, points = with_shards(path)
    first_claimed = max(points, key=lambda p: p.steps * p.N)  # the lanes take the longest first

    def failing_run(run, rounds=None):
        if run.config.run_root == first_claimed.config.run_root:
            time.sleep(0.5)  # the other lane has claimed its own point by now
            raise RuntimeError("injected: out of memory")
        time.sleep(2.0)  # the other lane's point, still running when the first fails, then done
        return {"eval": {1: {"bits_per_byte": 3.0, "perplexity": 8.0}}}

    monkeypatch.setattr(stages, "run", failing_run)
    with pytest.raises(RuntimeError, match="injected"):
        sweeps.command(path)
    leases = RunRoot(sweep.sweep_root).local_path("queue/leases")
    claimed = sorted(d.name.removeprefix("point.r0.") for d in leases.iterdir())
    assert len(claimed) == 2 and first_claimed.id in claimed  # the third point was never claimed
    (other,) = [c for c in claimed if c != first_claimed.id]
    assert lease_records(sweep, other)[0]["state"] == "done"  # the point in flight ended as it should
    (failed,) = lease_records(sweep, first_claimed.id)  # one attempt: not tried again beside the error
    assert failed["state"] == "failed" and failed["error"] == "RuntimeError: injected: out of memory"


def test_a_point_given_up_is_named_the_fit_goes_on_and_clearing_its_leases_retries_it(tmp_path):
    path = sweep_file(tmp_path, {"algorithm": ["sync", "diloco"]})
    sweep, (broken, fine) = with_shards(path)
    for n in (1, 2):  # train.max_attempts (2) failures elsewhere
        hand_made_attempt(sweep, broken.id, n, state="failed", error="RuntimeError: out of memory")
    report = sweeps.command(path)
    root = RunRoot(sweep.sweep_root)
    assert not root.is_committed(f"points/{broken.id}") and root.is_committed(f"points/{fine.id}")
    (given_up,) = report["given_up"]
    assert given_up["point"] == broken.id and given_up["error"] == "RuntimeError: out of memory"
    assert report["fit"]["sweep"]["committed"] == 1
    assert f"point {broken.id} given up after 2 attempts" in format_report(report)

    subprocess.run(given_up["retry"], shell=True, check=True)  # the command the report prints
    report = sweeps.command(path)
    assert report["trained"] == 1 and report["given_up"] == [] and root.is_committed(f"points/{broken.id}")


def test_predict_gives_an_interval_and_verify_records_the_holdout_error(tmp_path):
    path = sweep_file(tmp_path, {"model.hidden_size": [16, 24, 32], "train.lr": [0.005, 0.01]})
    sweep, _ = with_shards(path)
    report = sweeps.command(path, predict_items=["model.hidden_size=40"], verify_point=True)
    fit = json.loads(RunRoot(sweep.sweep_root).local_path("fit.json").read_text())
    (group,) = fit["prediction"]["groups"].values()
    lr = group["hyper"]["train.lr"]["value"]
    assert not fit["prediction"]["inside_sweep"] and group["bits_per_byte"]["interval"][0] is not None
    holdout = fit["holdout"]
    assert holdout["values"] == {"model.hidden_size": 40, "train.lr": float(f"{lr:.3g}")}
    assert holdout["point"] == spec.point_name(holdout["values"]).join(["holdout_", ""])
    assert holdout["error"] == pytest.approx(holdout["measured"] - holdout["predicted"])
    assert holdout["predicted"] == group["bits_per_byte"]["value"]
    assert RunRoot(sweep.sweep_root).is_committed(f"holdout/{holdout['point']}")
    assert report["fit"]["holdout"] == holdout


def quick_sweep_copy(tmp_path) -> str:
    """configs/sweep.yaml as a new user copies it: its roots under tmp_path; MLflow off, 20 bootstrap
    draws (not 200: the fits, not the points, would be most of the test) and the tests' documents
    instead of the sample (the points below never train on them)."""
    doc = yaml.safe_load((REPO / "configs" / "sweep.yaml").read_text())
    doc["sweep_root"], doc["quick"]["sweep_root"] = str(tmp_path / "sweep"), str(tmp_path / "sweep-quick")
    doc["mlflow"], doc["quick"]["fit"] = {"enabled": False}, {"bootstrap": 20}
    doc["set"] |= {"data.train": "tests/data/c4/train/*.json", "data.eval": "tests/data/c4/validation/*.json"}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def fake_training(monkeypatch, sweep: spec.Sweep, points: list[spec.Point]) -> list:
    """stages.run replaced by a smooth made-up loss (a law in N, a best outer lr near 0.6), so the
    quick sweep's 24 points and its holdout cost a fraction of a second each; the configs each run
    was handed, in order. The shared data is synthetic shards (nothing reads them)."""
    for point in points:
        root = RunRoot(sweeps.prepared_root(sweep, point.config))
        if not root.is_committed(layout.SHARDS_DIR):
            write_synthetic_shards(root, point.config.model.grid)
    handed = []

    def run(run, rounds=None):
        config = run.config
        handed.append(config)
        loss = 40 * spec.non_embedding_params(config) ** -0.2 + 0.05 * abs(math.log(config.outer.lr / 0.6))
        return {"eval": {config.train.rounds: {"bits_per_byte": loss, "perplexity": 2**loss}}}

    monkeypatch.setattr(stages, "run", run)
    return handed


def test_the_quick_holdout_trains_at_the_swept_h_in_whole_rounds_of_it(tmp_path, monkeypatch):
    """The quick sweep's only H (16) has no fitted optimum: the holdout must still train at it, not
    at the base config's 200, and at 48 as at 64 (48 crashed: its budget is under 200 steps)."""
    path = quick_sweep_copy(tmp_path)
    sweep, points = sweeps.plan(path, quick=True)
    (swept_h,) = sweep.axes["train.inner_steps"]
    handed = fake_training(monkeypatch, sweep, points)
    for size in (48, 64):
        report = sweeps.command(path, quick=True, predict_items=[f"model.hidden_size={size}"], verify_point=True)
        holdout = report["fit"]["holdout"]
        (config,) = [c for c in handed if c.run_root.endswith("/runs/" + holdout["point"])]
        trained = yaml.safe_load((tmp_path / "sweep-quick" / "runs" / holdout["point"] / "run.yaml").read_text())
        assert config.train.inner_steps == trained["train"]["inner_steps"] == swept_h == holdout["H"]
        assert holdout["steps"] == config.train.rounds * swept_h and config.train.rounds >= 1
        assert holdout["values"]["train.inner_steps"] == swept_h
        assert holdout["sources"]["train.inner_steps"] == "only value"
        assert (holdout["M"], holdout["outer_lr"]) == (config.train.workers_per_path, config.outer.lr)
        assert holdout["tokens"] == holdout["steps"] * spec.tokens_per_step(config)
        unit = swept_h * 2 * spec.tokens_per_step(config)  # lcm(H) x lcm(M) worker steps: one unit of rounding
        assert abs(holdout["tokens"] - 2 * holdout["N"]) <= unit / 2  # the budget: 2 tokens per parameter
        assert f"H {swept_h}, M {holdout['M']}" in format_report(report)
    assert sum("/holdout_" in c.run_root for c in handed) == 2 and len(handed) == len(points) + 2


def test_a_holdout_too_small_for_one_round_is_refused_before_anything_trains(tmp_path, monkeypatch, capsys):
    from pipeline import cli

    path = quick_sweep_copy(tmp_path)
    sweep, points = sweeps.plan(path, quick=True)
    handed = fake_training(monkeypatch, sweep, points)
    code = cli.main(["sweep", "--config", path, "--quick", "--predict", "model.hidden_size=8", "--verify"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(errors) == 1 and handed == []
    assert "model.hidden_size=8" in errors[0] and "N = 7,232" in errors[0]  # the size
    assert "tokens_per_param 2" in errors[0] and "less than one round of H = 16" in errors[0]  # the budget


def test_a_holdout_axis_with_no_fitted_optimum_takes_the_value_of_the_groups_best_point(tmp_path):
    """Seeds have no optimum to fit (not a positive grid): the holdout takes the best point's seed,
    the one H the sweep has, and the fit's predicted lr; planned only, nothing trains."""
    axes = {"model.hidden_size": [16, 24, 32], "train.seed": [0, 1], "train.lr": [0.005, 0.01]}
    axes["train.inner_steps"] = [3]
    sweep = spec.load_sweep(sweep_file(tmp_path, axes, {"steps": 7}))
    results = [
        {**p.summary(), "hyper": p.hyper(), "bits_per_byte": 9 * p.N**-0.1 + 0.01 * (p.values["train.seed"] == 0)}
        for p in spec.expand(sweep)
    ]
    fit = laws.analyse(results, draws=10, seed=0)
    prediction = sweeps.predict(sweep, fit, {"model.hidden_size": 40})
    point, _, sources = sweeps.holdout_point(sweep, fit, prediction)
    assert (point.values["train.seed"], point.values["train.inner_steps"]) == (1, 3)
    assert sources == {
        "model.hidden_size": "asked",
        "train.seed": f"best point {min(results, key=lambda r: r['bits_per_byte'])['id']}",
        "train.lr": "predicted optimum",
        "train.inner_steps": "only value",
    }
    assert (point.config.train.inner_steps, point.config.train.rounds, point.steps) == (3, 2, 6)  # whole rounds


# -- fits -----------------------------------------------------------------------------------------
def test_the_fit_recovers_the_exponent_of_a_known_law_within_5_percent():
    rng = np.random.default_rng(0)
    n = np.geomspace(3e4, 3e6, 7)
    loss = (25.0 * n**-0.3 + 1.1) * (1 + rng.normal(0, 0.002, n.size))  # 0.2% noise
    law = laws.fit_law(list(n), list(loss), draws=200, seed=0)
    assert law["form"] == laws.LAW
    assert law["alpha"] == pytest.approx(0.3, rel=0.05) and law["E"] == pytest.approx(1.1, rel=0.05)
    low, high = law["ci"]["alpha"]
    assert low <= 0.3 <= high and law["bootstrap"]["fitted"] > 150
    big = laws.predict_with_interval(law, 3e7)
    assert big["interval"][0] <= 25.0 * 3e7**-0.3 + 1.1 <= big["interval"][1]


def test_the_joint_law_recovers_the_replica_exponent_and_says_why_when_it_cannot():
    cells = [(float(n), m, 30.0 * n**-0.25 * m**0.04 + 0.9) for n in np.geomspace(1e4, 1e6, 4) for m in (1, 2, 4)]
    joint = laws.fit_joint(cells, draws=50, seed=0)
    assert joint["alpha"] == pytest.approx(0.25, rel=0.05) and joint["beta"] == pytest.approx(0.04, rel=0.05)
    refused = laws.fit_joint([c for c in cells if c[1] == 1], draws=10, seed=0)
    assert not refused["fitted"] and "one value of M (1)" in refused["why"]


def test_findings_compare_the_algorithms_within_the_tolerance():
    def point(algorithm, m, n, loss, olr=None):
        return {
            "id": f"{algorithm}{m}{n}{olr}",
            "algorithm": algorithm,
            "M": m,
            "N": n,
            "bits_per_byte": loss,
            "hyper": {} if olr is None else {"outer.lr": olr},
        }

    points = [point("sync", m, n, 3.0 - 0.1 * i) for i, n in enumerate((1e4, 1e5, 1e6)) for m in (1, 2)]
    for i, n in enumerate((1e4, 1e5, 1e6)):
        for olr, extra in ((0.4, 0.05), (0.7, 0.0), (1.0, 0.06)):  # 0.7 best at every size
            points.append(point("diloco", 1, n, 3.0 - 0.1 * i - 0.01 + extra, olr))
            points.append(point("diloco", 2, n, 3.0 - 0.1 * i + 0.2 / (i + 1) + extra, olr))
    fit = laws.analyse(points, draws=20, seed=0, tolerance=0.02)
    found = fit["findings"]
    assert found["gap_shrinks_with_N"]["verdict"] == "reproduced"  # +0.2 -> +0.067
    assert found["diloco_m1_not_worse_than_sync"]["verdict"] == "reproduced"  # -0.01 everywhere
    assert found["outer_lr_independent_of_N"]["verdict"] == "reproduced"
    assert fit["groups"]["diloco M=2"]["optima"]["outer.lr"]["trend"]["trend"] is False
