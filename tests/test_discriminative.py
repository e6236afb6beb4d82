"""Discriminative routing (router.discriminative_after): the classifier, router.json kinds, and a
tiny run that re-routes after round 0, trains round 1 on the new shards and resumes."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO, tiny_config
from models.grid import all_path_ids
from pipeline import stages
from pipeline.core.errors import ConfigError, CorruptStateError, DipacoError
from pipeline.islands.island import run_task
from pipeline.islands.task_queue import Task, TaskQueue
from pipeline.routing.discriminative import fit_classifier
from pipeline.routing.router import DiscriminativeRouter, Router
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.shards import read_path_doc_ids
from pipeline.state.storage import RunRoot
from pipeline.tracking.registry import DipacoModel, build_bundle
from pipeline.tracking.tracker import get_tracker
from preprocessing.c4 import doc_id_for


def planted(n_per_class: int, centers: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs around well separated centers: features linearly separable by label."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([c + 0.3 * rng.standard_normal((n_per_class, centers.shape[1])) for c in centers])
    return x, np.repeat(np.arange(len(centers)), n_per_class)


def predict(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (x @ weights[:, :-1].T + weights[:, -1]).argmax(1)


def test_the_classifier_reproduces_planted_labels_and_never_predicts_an_absent_path():
    centers = np.random.default_rng(1).standard_normal((4, 8)) * 4 + 10  # far from 0: the intercept matters
    x, y = planted(100, centers)
    weights = fit_classifier(x, y, 4, seed=0)
    assert weights.shape == (4, 9)
    assert np.mean(predict(weights, x) == y) >= 0.99
    two = y < 2  # binary: scikit-learn's one-row form, unfolded to one row per path
    assert np.mean(predict(fit_classifier(x[two], y[two], 4, seed=0), x[two]) == y[two]) >= 0.99
    keep = y != 2  # path 2 never lowest-loss: never predicted
    weights = fit_classifier(x[keep], y[keep], 4, seed=0)
    assert np.mean(predict(weights, x[keep]) == y[keep]) >= 0.99 and 2 not in predict(weights, x)


def _kmeans_router() -> Router:
    x, _ = planted(20, np.eye(4) * 5)
    return Router.fit(x, [2, 2], embedder="tfidf", prefix_tokens=8, seed=0, balanced=False)


def test_router_json_says_its_kind_and_a_header_without_kind_reads_as_kmeans(tmp_path):
    root = RunRoot(str(tmp_path))
    kmeans_router = _kmeans_router()
    kmeans_router.save(root)
    assert json.loads((tmp_path / "router" / "router.json").read_text())["kind"] == "kmeans"
    features = planted(5, np.eye(4) * 5, seed=3)[0]

    legacy = dict(kmeans_router.header)
    del legacy["kind"]
    Router(legacy, kmeans_router.centroids).save(root, directory="old/router")
    loaded = Router.load(root, directory="old/router")
    assert type(loaded) is Router and loaded.kind == "kmeans"
    assert loaded.route_features(features) == kmeans_router.route_features(features)

    x, y = planted(30, np.eye(4) * 5)
    header = {k: v for k, v in kmeans_router.header.items() if k not in ("rows", "splits")}
    header.update(kind="discriminative", path_bias=[0.0, 0.0, 0.0, 0.0])
    DiscriminativeRouter(header, fit_classifier(x, y, 4, seed=0)).save(root, directory="reroute/round=1/router")
    assert json.loads((tmp_path / "reroute/round=1/router/router.json").read_text())["kind"] == "discriminative"
    assert (tmp_path / "reroute/round=1/router/classifier.npy").exists()
    loaded = Router.load(root, directory="reroute/round=1/router")
    assert isinstance(loaded, DiscriminativeRouter) and loaded.kind == "discriminative"
    assert [loaded.path_ids.index(p) for p in loaded.route_features(x)] == y.tolist()  # pure function of x

    header["kind"] = "nearest"
    DiscriminativeRouter(header, fit_classifier(x, y, 4, seed=0)).save(root, directory="bad/router")
    with pytest.raises(CorruptStateError, match="kind must be kmeans or discriminative"):
        Router.load(root, directory="bad/router")


def test_discriminative_after_must_leave_a_round_to_train_on_the_new_shards(tmp_path):
    for bad in (-1, 1, 5):
        with pytest.raises(ConfigError, match="router.discriminative_after"):
            tiny_config(tmp_path, "train.rounds=2", f"router.discriminative_after={bad}")
    assert tiny_config(tmp_path, "train.rounds=2", "router.discriminative_after=0").router.discriminative_after == 0
    assert tiny_config(tmp_path).router.discriminative_after is None


def test_a_reroute_task_without_the_beam_job_says_so(tmp_path):
    """pipeline.islands may not import the Beam app: an island's entry point (pipeline.island_rank)
    or the stages hand it the re-sharding job; a task run without it names what is missing."""
    config = tiny_config(tmp_path, "train.rounds=2", "router.discriminative_after=0")
    with pytest.raises(DipacoError, match=r"reroute.r0: this island was started without the Beam job .*island_rank"):
        run_task(config, Task.of("reroute", 0), 0)


def _stamps(run) -> dict[str, bytes]:
    """Every committed piece of the re-routing: markers and report (rewritten = recomputed)."""
    base = run / "reroute" / "round=1"
    return {rel: (base / rel).read_bytes() for rel in ("router/_SUCCESS", "shards/_SUCCESS", "report.json")}


# A run re-routed after round 0 (and the copy of it that checks round 1 waits for the new shards).
REROUTED_RUN = (
    "router.discriminative_after=0",
    "train.rounds=2",
    "train.inner_steps=2",
    "model.tokenizer=bpe",
    "model.vocab_size=512",
    "data.max_docs=48",
)


def test_a_tiny_run_reroutes_after_round_0_and_round_1_trains_on_the_new_shards(tmp_path):
    run = tmp_path / "run"
    config = tiny_config(run, *REROUTED_RUN)
    torch.set_num_threads(1)  # the in-process island, sized to one core
    stages.run(Run(config), rounds=1)  # round 0, then the re-routing: the plan reaches round R
    assert torch.get_num_threads() == 1  # the re-sharding Beam job's embedder left it as it was
    root = RunRoot(config.run_root)
    new = layout.reroute_routing(1)
    assert root.is_committed(new.router) and root.is_committed(new.shards) and root.exists(layout.reroute_report(1))
    assert not root.is_committed(layout.path_dir(1, "p0-0"))

    # Round 1's train tasks wait for the new shards: without them only the reroute task is ready.
    shutil.copytree(run, tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "reroute")
    copy = tiny_config(tmp_path / "copy", *REROUTED_RUN)
    waiting = {t.name for t in TaskQueue(RunRoot(copy.run_root), copy).ready(2)}
    assert "reroute.r0" in waiting and not any(n.startswith("train.r1") for n in waiting)
    assert {f"train.r1.{p}" for p in all_path_ids([2, 2])} <= {t.name for t in TaskQueue(root, config).ready(2)}

    summary = stages.run(Run(config))
    assert summary["rounds_committed"] == 2
    router = Router.load(root, directory=new.router)
    assert isinstance(router, DiscriminativeRouter) and router.header["after_round"] == 0
    manifest, old = root.read_json(new.manifest), root.read_json(layout.MANIFEST)
    assert manifest["router_checksum"] == router.checksum and manifest["router"]["kind"] == "discriminative"
    assert manifest["routed"] == old["routed"]  # every document re-routed, none lost
    for path_id in all_path_ids([2, 2]):
        for r, (shards, source) in enumerate([(layout.SHARDS_DIR, old), (new.shards, manifest)]):
            metrics = root.read_committed_json(layout.path_dir(r, path_id), "metrics.json")
            assert metrics["shards"] == shards
            assert metrics["shard_docs"] == source["paths"][path_id]["train"]["documents"]

    report = root.read_json(layout.reroute_report(1))
    assert 0.0 <= report["accuracy"] <= 1.0 and report["heldout_docs"] >= 1
    assert 0 <= report["changed"] <= report["documents"] == old["splits"]["train"]["routed"]
    moved = sum(
        abs(manifest["paths"][p]["train"]["documents"] - old["paths"][p]["train"]["documents"])
        for p in all_path_ids([2, 2])
    )
    assert report["changed"] >= moved / 2  # a path's size changes only by documents that moved
    assert report["perplexity_before"] > 1 and report["perplexity_after"] > 1
    assert report["perplexity_after"] == pytest.approx(summary["eval"][1]["perplexity"], rel=1e-9)  # new shards
    assert summary["reroute"] == report

    # The registered model of a round after R routes with the new router, as the Beam job did.
    bundle = build_bundle(root, config, 2, tmp_path / "bundle", (run / "run.yaml").read_text())
    assert (bundle / new.router / "classifier.npy").exists() and not (bundle / "router").exists()
    model = DipacoModel()
    model.load_context(SimpleNamespace(artifacts={"run_root": str(bundle)}))
    assert isinstance(model.router, DiscriminativeRouter) and model.router.checksum == router.checksum
    routed = {d: p for p in all_path_ids([2, 2]) for d in read_path_doc_ids(root, p, "validation", new.shards)}
    records = [json.loads(line) for line in next((REPO / "tests/data/c4/validation").glob("*.json")).open()]
    records = [r for r in records if doc_id_for(r, r["text"]) in routed]
    assert len(records) == len(routed) > 0
    assert model.router.route_texts([r["text"] for r in records]) == [routed[doc_id_for(r, r["text"])] for r in records]

    stamps = _stamps(run)
    attempts = sorted(p.name for p in (run / "queue" / "leases" / "reroute.r0").iterdir())
    stages.run(Run(config))  # nothing left to do
    assert stages.reroute(Run(config), 0) == report
    assert _stamps(run) == stamps  # nothing recomputed once committed
    assert sorted(p.name for p in (run / "queue" / "leases" / "reroute.r0").iterdir()) == attempts == ["attempt-1.json"]


def test_the_report_goes_to_mlflow_as_reroute_metrics(tmp_path):
    config = tiny_config(tmp_path / "run", "router.discriminative_after=0", "mlflow.enabled=true")
    report = {
        "after_round": 0,
        "round": 1,
        "accuracy": 0.75,
        "changed": 12,
        "perplexity_before": 9.5,
        "perplexity_after": 9.25,
        "label_counts": {"p0-0": 3},
    }
    tracker = get_tracker(config)
    tracker.log_reroute(0, report)
    metrics = tracker.client.get_run(tracker._parent()).data.metrics
    assert {k: v for k, v in metrics.items() if k.startswith("reroute/")} == {
        "reroute/accuracy": 0.75,
        "reroute/changed": 12.0,
        "reroute/perplexity_before": 9.5,
        "reroute/perplexity_after": 9.25,
    }
    assert [a.path for a in tracker.client.list_artifacts(tracker._parent(), "reroute/round=1")] == [
        "reroute/round=1/report.json"
    ]
