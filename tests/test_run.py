"""`run`: every stage that has not committed, resuming from the last committed round."""

import pytest

from conftest import tiny_config, write_synthetic_shards
from pipeline import stages
from pipeline.core.errors import RunLockedError
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.lock import run_lock
from pipeline.state.storage import RunRoot


def module_files(root: RunRoot, round_index: int) -> dict[str, bytes]:
    rel = layout.modules_dir(round_index)
    return {name: root.read_committed(rel, name) for name in root.marker(rel)["files"]}


def prepared(run_root, *overrides):
    config = tiny_config(run_root, "train.rounds=3", "train.inner_steps=2", "train.lr=0.01", *overrides)
    write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
    return config


def test_run_stopped_after_round_1_continues_at_round_2_with_identical_modules(tmp_path):
    whole = prepared(tmp_path / "whole")
    stages.run(Run(whole))

    split = prepared(tmp_path / "split")
    stages.run(Run(split), rounds=1)  # stops after round 0's merge: round 1 is next
    assert layout.next_round(RunRoot(split.run_root)) == 1
    summary = stages.run(Run(split))
    assert summary["rounds_committed"] == 3 and sorted(summary["eval"]) == [0, 1, 2, 3]

    a, b = RunRoot(whole.run_root), RunRoot(split.run_root)
    assert module_files(a, 3) == module_files(b, 3)  # bitwise
    assert summary["eval"][3]["perplexity"] < summary["eval"][0]["perplexity"]
    assert set(summary["eval"][3]["paths"]) == set(stages.list_paths(split))
    assert stages.run(Run(split))["rounds_committed"] == 3  # nothing left to do: no new round


def test_a_second_run_on_the_same_root_is_refused_while_the_first_holds_it(run_root):
    config = prepared(run_root)
    with run_lock(RunRoot(config.run_root)):
        with pytest.raises(RunLockedError, match="another dipaco run"):
            stages.run(Run(config))
    with run_lock(RunRoot(config.run_root)):  # released: the next holder gets it
        pass
