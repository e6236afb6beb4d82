"""eval.early_stopping: each path keeps the round whose modules gave its own validation shard the
lowest perplexity; eval/best.json records the choice and the registered champion is that model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_config
from pipeline import stages
from pipeline.evaluation import evaluate
from pipeline.evaluation.early_stopping import BEST_FILE, choose_rounds, early_stopped, write_best
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.storage import RunRoot


def scores(perplexity: float, tokens: int = 100, n_bytes: int = 400) -> dict:
    nll = tokens * math.log(perplexity)
    return {"perplexity": perplexity, "bits_per_byte": nll / math.log(2) / n_bytes, "tokens": tokens, "bytes": n_bytes}


# a: best at round 1, not the last; b: 20.0 at rounds 0 and 2, a tie kept at the earliest;
# c: scored from round 1 only (a path may lack held-out documents in a round's file)
EVALS = {
    0: {"round": 0, "paths": {"a": scores(50.0), "b": scores(20.0, 200, 900)}},
    1: {"round": 1, "paths": {"a": scores(30.0), "b": scores(25.0, 200, 900), "c": scores(70.0, 50, 150)}},
    2: {"round": 2, "paths": {"a": scores(35.0), "b": scores(20.0, 200, 900), "c": scores(60.0, 50, 150)}},
}


def test_each_path_keeps_its_argmin_round_and_a_tie_keeps_the_earliest():
    chosen = choose_rounds(EVALS)
    assert {p: (c["round"], c["perplexity"]) for p, c in chosen.items()} == {
        "a": (1, 30.0),
        "b": (0, 20.0),
        "c": (2, 60.0),
    }
    assert {p: c["round"] for p, c in choose_rounds({r: EVALS[r] for r in (0, 1)}).items()} == {"a": 1, "b": 0, "c": 1}
    assert choose_rounds({}) == {}


def test_best_json_combines_each_paths_best_round_by_summed_nll(tmp_path):
    root = RunRoot(str(tmp_path / "run"))
    for r in (0, 1):
        root.write_json(layout.eval_file(r), EVALS[r])
    assert write_best(root)["paths"]["c"]["round"] == 1
    root.write_json(layout.eval_file(2), EVALS[2])  # a new round: best.json is recomputed from every file
    write_best(root)
    best = json.loads((tmp_path / "run" / BEST_FILE).read_text())

    assert best["paths"] == {
        "a": {"round": 1, "perplexity": 30.0, "bits_per_byte": EVALS[1]["paths"]["a"]["bits_per_byte"]},
        "b": {"round": 0, "perplexity": 20.0, "bits_per_byte": EVALS[0]["paths"]["b"]["bits_per_byte"]},
        "c": {"round": 2, "perplexity": 60.0, "bits_per_byte": EVALS[2]["paths"]["c"]["bits_per_byte"]},
    }
    nll = 100 * math.log(30.0) + 200 * math.log(20.0) + 50 * math.log(60.0)  # nats
    assert best["tokens"] == 350 and best["bytes"] == 400 + 900 + 150
    assert best["perplexity"] == pytest.approx(math.exp(nll / 350), rel=1e-12)
    assert best["perplexity"] == pytest.approx(26.2725, abs=1e-4)  # e^(1143.99 / 350)
    assert best["bits_per_byte"] == pytest.approx(nll / math.log(2) / 1450, rel=1e-12)
    assert best == early_stopped(EVALS) | {"rounds_evaluated": [0, 1, 2]}


def test_combine_paths_writes_best_json_only_with_early_stopping(tmp_path):
    parts = {"p0-0": {**scores(40.0), "docs": 3, "nll": 100 * math.log(40.0)}}
    off = tiny_config(tmp_path / "off")
    evaluate.combine_paths(off, 0, parts)
    assert (tmp_path / "off" / layout.eval_file(0)).is_file() and not (tmp_path / "off" / BEST_FILE).exists()
    on = tiny_config(tmp_path / "on", "eval.early_stopping=true")
    evaluate.combine_paths(on, 0, parts)
    evaluate.combine_paths(on, 1, {"p0-0": {**scores(45.0), "docs": 3, "nll": 100 * math.log(45.0)}})
    best = json.loads((tmp_path / "on" / BEST_FILE).read_text())
    assert best["paths"]["p0-0"]["round"] == 0 and best["perplexity"] == pytest.approx(40.0)


def test_a_bad_value_is_refused_naming_the_key_and_file(tmp_path):
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tiny.yaml: eval.early_stopping must be bool"):
        tiny_config(tmp_path / "run", "eval.early_stopping=maybe")
    assert tiny_config(tmp_path / "run").eval.early_stopping is False  # off by default


LAST = 2
PENALISED = "p0-0"  # made worse at the last round, so its best round is an earlier one


def test_a_run_registers_the_early_stopped_model_as_champion(tmp_path, monkeypatch):
    """A real in-process run (Beam prepare, islands, merges, MLflow on SQLite) on a [2, 1] grid, whose
    paths p0-0 and p1-0 share their level-1 module: p0-0's last-round score is made worse, so it
    keeps an earlier round while p1-0 keeps the last one, and the champion's bundle holds each
    path's modules of its own round (the shared module at two rounds)."""
    import mlflow
    from mlflow.tracking import MlflowClient
    from test_registry import real_text_config, write_c4

    from pipeline.state.module_store import load_path_model
    from pipeline.tracking.report import format_summary
    from pipeline.tracking.uris import tracking_uri

    real = evaluate.evaluate_path

    def penalised(config, round_index, path_id):
        result = real(config, round_index, path_id)
        if result and round_index == LAST and path_id == PENALISED:
            nll = result["nll"] + 3.0 * result["tokens"]  # perplexity x e^3
            result = {
                **result,
                "nll": nll,
                "perplexity": math.exp(nll / result["tokens"]),
                "bits_per_byte": evaluate.bits_per_byte(nll, result["bytes"]),
            }
        return result

    monkeypatch.setattr(evaluate, "evaluate_path", penalised)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = real_text_config(
        tmp_path / "run",
        write_c4(tmp_path / "c4"),
        "model.grid=[2, 1]",
        f"train.rounds={LAST}",
        "train.inner_steps=2",
        "eval.early_stopping=true",
        "mlflow.experiment=test-early-stopping",
        "mlflow.registered_model=dipaco-es",
    )
    summary = stages.run(Run(config))
    root = RunRoot(config.run_root)

    best = root.read_json(BEST_FILE)
    evals = {r: root.read_json(layout.eval_file(r)) for r in range(LAST + 1)}
    assert best == early_stopped(evals) and summary["early_stopping"] == best
    for pid, entry in best["paths"].items():
        assert entry["perplexity"] == min(evals[r]["paths"][pid]["perplexity"] for r in evals)
    rounds = {pid: entry["round"] for pid, entry in best["paths"].items()}
    assert rounds[PENALISED] < LAST and rounds["p1-0"] == LAST  # p1-0 improved (the run is seeded)

    client = MlflowClient(tracking_uri=tracking_uri(config), registry_uri=tracking_uri(config))
    champion = client.get_model_version_by_alias("dipaco-es", "champion")
    assert champion.tags["dipaco.early_stopped"] == "true" and champion.tags["dipaco.round"] == str(LAST)
    assert float(champion.tags["perplexity"]) == best["perplexity"]
    plain = {
        v.tags["dipaco.round"]
        for v in client.search_model_versions("name = 'dipaco-es'")
        if "dipaco.early_stopped" not in v.tags
    }
    assert plain == {"1", "2"}  # each round's own modules are still registered, as without early stopping
    parent = client.get_run(root.read_json("tracking.json")["parent_run_id"])
    assert parent.data.metrics["early_stopped_perplexity"] == pytest.approx(best["perplexity"])
    assert parent.data.metrics["early_stopped_bits_per_byte"] == pytest.approx(best["bits_per_byte"])
    assert {p: parent.data.metrics[f"early_stopped_round/{p}"] for p in rounds} == {
        p: float(r) for p, r in rounds.items()
    }
    line = [ln for ln in format_summary(summary).splitlines() if ln.startswith("early-stopped model")]
    assert line and f"perplexity {best['perplexity']:.2f}" in line[0]
    assert line[0].endswith("rounds " + " ".join(f"{p}={r}" for p, r in sorted(rounds.items())))

    mlflow.set_tracking_uri(tracking_uri(config))
    mlflow.set_registry_uri(tracking_uri(config))
    inner = mlflow.pyfunc.load_model("models:/dipaco-es@champion").unwrap_python_model()
    for pid in stages.list_paths(config):
        want = rounds.get(pid, LAST)  # a path with no held-out documents keeps the newest modules
        got = inner._model(pid).state_dict()
        expected = load_path_model(root, config, want, pid).state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), pid
        if want != LAST:  # and they are not the newest modules
            newest = load_path_model(root, config, LAST, pid).state_dict()
            assert not all(torch.equal(got[k], newest[k]) for k in got), pid
