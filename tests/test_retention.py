"""What a run root may forget: train.keep_rounds prunes old rounds' weights, `dipaco clean`
removes a run root (keeping the registry on request); the champion stays loadable throughout."""

import os

from test_registry import PROMPTS, real_text_config, write_c4

from conftest import REPO
from pipeline import stages
from pipeline.cli import main
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.retention import run_root_size
from pipeline.state.storage import RunRoot
from pipeline.train.train_path import inner_state_of

TINY = str(REPO / "configs" / "tiny.yaml")


def test_keep_rounds_1_keeps_the_champion_loadable_and_the_run_resumable_and_clean_keeps_the_registry(tmp_path):
    from pipeline.tracking.registry import champion_continuation

    os.environ.pop("MLFLOW_TRACKING_URI", None)
    data = write_c4(tmp_path / "c4")
    sets = (
        "train.keep_rounds=1",
        "eval.early_stopping=true",
        "mlflow.experiment=test-retention",
        "mlflow.registered_model=dipaco-retention",
    )
    config = real_text_config(tmp_path / "run", data, "train.rounds=2", *sets)
    summary = stages.run(Run(config))
    root = RunRoot(config.run_root)
    assert summary["rounds_committed"] == 2
    best_rounds = {entry["round"] for entry in root.read_json("eval/best.json")["paths"].values()}
    for r in (0, 1, 2):  # round 2's modules resume the run; the early-stopped paths' rounds stay for later champions
        kept = r == 2 or r in best_rounds
        assert root.is_committed(layout.modules_dir(r)) == kept, (r, best_rounds)
        assert root.exists(layout.modules_dir(r)) == kept
    for job in stages.list_paths(config):
        for r in (0, 1):
            rel = layout.path_dir(r, job)
            assert root.exists(f"{rel}/model.safetensors") == (r in best_rounds)
            assert root.exists(f"{rel}/metrics.json")  # utilisation and the summary read it
            root.verify(rel)  # every marker names only files that are there
        assert inner_state_of(root, 1, job) is not None  # the newest inner state: resumes
    continuation = champion_continuation(config, PROMPTS[0])
    assert isinstance(continuation, str)

    resumed = stages.run(Run(real_text_config(tmp_path / "run", data, "train.rounds=3", *sets)))
    assert resumed["rounds_committed"] == 3 and not root.exists(layout.modules_dir(0))

    before = run_root_size(root)
    assert stages.clean(Run(config), keep_registry=True)["removed"]
    assert set(os.listdir(root.path())) <= {".lock", "mlartifacts", "mlflow.db", "tracking.json"}
    assert run_root_size(root) < before
    assert isinstance(champion_continuation(config, PROMPTS[0]), str)  # loads from the registry alone


def test_clean_removes_one_run_root_and_refuses_a_directory_that_is_not_one(tmp_path, capsys):
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    assert main(["clean", "--config", TINY, "--set", f"run_root={other}"]) == 2
    assert "not a dipaco run root" in capsys.readouterr().err and (other / "precious.txt").exists()

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.yaml").write_text("{}\n")
    (run / "rounds").mkdir()
    (tmp_path / "sibling").mkdir()
    assert main(["clean", "--config", TINY, "--set", f"run_root={run}"]) == 0
    assert not run.exists() and (tmp_path / "sibling").exists()
    assert main(["clean", "--config", TINY, "--set", f"run_root={run}"]) == 0  # nothing there: nothing to do
