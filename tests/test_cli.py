"""Config validation and the CLI contract: exit 2 with one line naming the key, nothing written."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, tiny_config
from pipeline import layout, stages
from pipeline.cli import main
from pipeline.config import config_from_dict
from pipeline.errors import ConfigError

TINY = str(REPO / "configs" / "tiny.yaml")

BAD_VALUES = [
    ("train.inner_stepz=3", "train.inner_stepz"),  # unknown key
    ("train.inner_steps=abc", "train.inner_steps"),  # wrong type
    ("train.inner_steps=0", "train.inner_steps"),
    ("model.grid=[2, 2, 2]", "model.blocks_per_level"),  # grid does not match the levels
    ("model.grid=[0]", "model.grid"),
    ("model.num_heads=3", "model.num_heads"),
    ("model.seq_len=4", "model.seq_len"),
    ("train.ds_config=ds_configs/missing.json", "train.ds_config"),
    ("outer.weighting=size", "outer.weighting"),
    ("outer.momentum=1.5", "outer.momentum"),
    ("router.embedder=bert", "router.embedder"),
    ("train.betas=[0.9]", "train.betas"),
    ("run_root=../escape", "run_root"),
    ("mlflow=7", "mlflow"),
    ("router.model_path=../../etc", "router.model_path"),
    ("router.model_path=p7-0", "router.model_path"),
]


@pytest.mark.parametrize("override,key", BAD_VALUES)
def test_bad_config_values_exit_2_naming_the_key_and_write_nothing(override, key, tmp_path, capsys):
    run_root = tmp_path / "run"
    code = main(["merge", "--round", "0", "--config", TINY, "--set", f"run_root={run_root}", "--set", override])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert key in err and "tiny.yaml" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not run_root.exists()


def test_missing_or_broken_config_files_are_named(tmp_path, capsys):
    assert main(["eval", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert main(["eval", "--config", str(broken)]) == 2
    assert "broken.yaml" in capsys.readouterr().err


def test_a_path_id_outside_the_grid_is_refused(tmp_path, capsys):
    code = main(["train-path", "--round", "0", "--path", "p9-9", "--config", TINY, "--set", f"run_root={tmp_path / 'r'}"])
    assert code == 2 and "--path" in capsys.readouterr().err


def test_overrides_parse_as_yaml_and_run_yaml_round_trips(run_root):
    config = tiny_config(run_root, "model.grid=[2, 3]", "model.blocks_per_level=[1, 2]", "outer.nesterov=false")
    assert config.model.grid == [2, 3] and config.outer.nesterov is False and config.n_paths == 6
    root = stages.init_run(config)
    again = config_from_dict(yaml.safe_load(root.read_bytes(layout.RUN_CONFIG)))
    assert again.to_dict() == config.to_dict()
    assert root.is_committed(layout.modules_dir(0))
    assert len(root.marker(layout.modules_dir(0))["files"]) == 5


def test_a_run_root_refuses_a_config_that_changes_the_model(run_root):
    stages.init_run(tiny_config(run_root))
    with pytest.raises(ConfigError, match="model differs"):
        stages.init_run(tiny_config(run_root, "model.hidden_size=64"))


def test_the_installed_console_script_exits_2_without_a_traceback(tmp_path):
    dipaco = Path(sys.executable).with_name("dipaco")
    result = subprocess.run([str(dipaco), "eval", "--config", TINY, "--set", "train.rounds=-1"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "train.rounds" in result.stderr and "Traceback" not in result.stderr


def test_multi_node_islands_launch_through_a_hostfile(tmp_path, run_root):
    from pipeline.launch import launcher_command

    with pytest.raises(ConfigError, match="train.hostfile"):
        tiny_config(run_root, "train.num_nodes=2")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    config = tiny_config(run_root, "train.num_nodes=2", f"train.hostfile={hostfile}", "train.procs_per_path=8")
    command = launcher_command("s3://bucket/run", 3, "p1-0", config.train, 29500)
    assert Path(command[0]).name == "deepspeed"
    assert command[1:9] == ["--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "8", "--master_port", "29500"]
    assert command[-6:] == ["--run-root", "s3://bucket/run", "--round", "3", "--path", "p1-0"]
