"""Config validation and the CLI contract: exit 2 with one line naming the key, nothing written."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, tiny_cli_args, tiny_config, write_synthetic_shards
from pipeline import stages
from pipeline.cli import main
from pipeline.core.config import config_from_dict, load_config
from pipeline.core.errors import ConfigError
from pipeline.run import Run
from pipeline.state import layout

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


@pytest.mark.parametrize("word", ["yes", "no", "on", "Off"])
def test_yaml_1_1_booleans_are_refused_in_set_and_dag_overrides_with_a_hint(word, capsys):
    assert main(["eval", "--config", TINY, "--set", f"mlflow.enabled={word}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--set mlflow.enabled" in err and "write true or false" in err
    with pytest.raises(ConfigError, match="write true or false"):  # the DAG's overrides param takes this path
        load_config(TINY, [f"model.grid=[{word}]"])
    assert load_config(TINY, ["mlflow.enabled=true"]).mlflow.enabled is True
    assert load_config(TINY, [f"run_root='{word}'"]).run_root == word  # quoted, it is the word


@pytest.mark.parametrize("where", ["/proc/x", "under a file"])
def test_an_unwritable_run_root_exits_2_in_one_line_in_under_2_s(where, tmp_path):
    root = where
    if where == "under a file":
        (tmp_path / "file").write_text("")
        root = str(tmp_path / "file" / "run")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--config", TINY, "--set", f"run_root={root}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith(f"dipaco run: {TINY}: run_root {root}: cannot create and write files there")
    assert len(result.stderr.strip().splitlines()) == 1 and elapsed < 2, (elapsed, result.stderr)


def test_missing_or_broken_config_files_are_named(tmp_path, capsys):
    assert main(["eval", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert main(["eval", "--config", str(broken)]) == 2
    assert "broken.yaml" in capsys.readouterr().err


def test_a_path_id_outside_the_grid_is_refused(tmp_path, capsys):
    code = main(
        ["train-path", "--round", "0", "--path", "p9-9", "--config", TINY, "--set", f"run_root={tmp_path / 'r'}"]
    )
    assert code == 2 and "--path" in capsys.readouterr().err


def test_overrides_parse_as_yaml_and_run_yaml_round_trips(run_root):
    config = tiny_config(run_root, "model.grid=[2, 3]", "model.blocks_per_level=[1, 2]", "outer.nesterov=false")
    assert config.model.grid == [2, 3] and config.outer.nesterov is False and config.n_paths == 6
    root = stages.init_run(Run(config))
    again = config_from_dict(yaml.safe_load(root.read_bytes(layout.RUN_CONFIG)))
    assert again.to_dict() == config.to_dict()
    assert root.is_committed(layout.modules_dir(0))
    assert len(root.marker(layout.modules_dir(0))["files"]) == 5


def test_a_run_root_refuses_a_config_that_changes_the_model(run_root):
    stages.init_run(Run(tiny_config(run_root)))
    with pytest.raises(ConfigError, match="model differs"):
        stages.init_run(Run(tiny_config(run_root, "model.hidden_size=64")))


def test_the_installed_console_script_exits_2_without_a_traceback(tmp_path):
    dipaco = Path(sys.executable).with_name("dipaco")
    result = subprocess.run(
        [str(dipaco), "eval", "--config", TINY, "--set", "train.rounds=-1"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 2
    assert "train.rounds" in result.stderr and "Traceback" not in result.stderr


def test_multi_node_islands_launch_through_a_hostfile(tmp_path, run_root):
    from pipeline.islands.launch import launcher_command

    with pytest.raises(ConfigError, match="train.hostfile"):
        tiny_config(run_root, "train.num_nodes=2")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    config = tiny_config(run_root, "train.num_nodes=2", f"train.hostfile={hostfile}", "train.procs_per_path=8")
    command = launcher_command("s3://bucket/run", 3, "p1-0", config.train, 29500)
    assert Path(command[0]).name == "deepspeed"
    assert command[1:9] == [
        "--hostfile",
        str(hostfile),
        "--num_nodes",
        "2",
        "--num_gpus",
        "8",
        "--master_port",
        "29500",
    ]
    assert command[-6:] == ["--run-root", "s3://bucket/run", "--round", "3", "--path", "p1-0"]


def dipaco(args: list[str], cwd=REPO, **kwargs) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("dipaco")), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        **kwargs,
    )


def files_under(path: Path) -> dict[str, bytes]:
    return (
        {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        if path.exists()
        else {}
    )


REFUSED = {
    "path outside the grid": (["train-path", "--round", "0", "--path", "p9-9"], "--path"),
    "train-path unprepared": (["train-path", "--round", "0", "--path", "p0-1"], "prepare` first"),
    "prepare bad glob": (
        ["prepare", "--set", "data.train=nowhere/*.json"],
        "nowhere/*.json: no input files match (data.train); relative globs resolve against",
    ),
    "run bad glob": (["run", "--set", "data.eval=nowhere/*.json"], "nowhere/*.json: no input files match (data.eval)"),
    "eval unprepared": (["eval", "--round", "3"], "prepare` first"),
    "merge unprepared": (["merge", "--round", "0"], "prepare` first"),
}


@pytest.mark.parametrize("args,why", REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_command_writes_nothing(args, why, tmp_path, capsys):
    """Checked before run.yaml, round 0, a lock or a launch: nothing on disk changes."""
    run_root = tmp_path / "run"
    assert main([*args, "--config", TINY, "--set", f"run_root={run_root}"]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1
    assert not run_root.exists()


def test_a_refused_argument_leaves_an_existing_run_root_unchanged(run_root, capsys):
    config = tiny_config(run_root)
    write_synthetic_shards(stages.init_run(Run(config)), config.model.grid)
    before = files_under(run_root)
    base = tiny_cli_args(run_root, "train.inner_steps=9")  # would rewrite run.yaml
    assert main(["train-path", "--round", "0", "--path", "p9-9", *base]) == 2
    assert main(["merge", "--round", "0", *base]) == 2  # no path of round 0 trained yet
    assert "dipaco train-path --round 0" in capsys.readouterr().err
    assert main(["eval", "--round", "2", *base]) == 2
    assert "round 2's modules are not committed (the latest are round 0's)" in capsys.readouterr().err
    assert files_under(run_root) == before


def test_round_numbers_are_checked_by_the_parser(capsys):
    for bad in ("-1", "one"):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "--config", TINY, "--round", bad])
        assert exit_info.value.code == 2 and "--round" in capsys.readouterr().err


def test_an_island_started_before_its_run_is_planned_waits_for_the_plan_within_its_bound(tmp_path, capsys):
    """`dipaco island --wait S`: hosts start in any order. Unplanned for the whole bound, it exits
    2 in one line naming the plan file and writes nothing; a plan written meanwhile ends the wait
    within a poll."""
    import threading

    from pipeline import preflight
    from pipeline.islands.task_queue import write_plan
    from pipeline.state.storage import RunRoot

    run_root = tmp_path / "run"
    began = time.monotonic()
    assert main(["island", "--wait", "1.5", *tiny_cli_args(run_root)]) == 2
    assert 1.5 <= time.monotonic() - began < 10
    err = capsys.readouterr().err.strip()
    assert f"{run_root}/queue/plan.json: no run planned here after waiting 1.5 s" in err
    assert len(err.splitlines()) == 1 and not run_root.exists()

    for bad in ("-1", "nan"):
        assert main(["island", "--wait", bad, *tiny_cli_args(run_root)]) == 2
        assert f"--wait: {bad} seconds" in capsys.readouterr().err

    planned = threading.Timer(0.6, write_plan, args=(RunRoot(str(run_root)), 2))
    planned.start()
    began = time.monotonic()
    preflight.wait_for_plan(tiny_config(run_root), 60)
    assert 0.6 <= time.monotonic() - began < 0.6 + preflight.PLAN_POLL_S + 2  # not the 60 s bound
    planned.join()


def test_an_island_that_joins_a_run_loads_no_model_stack_before_it_launches_its_ranks():
    """`dipaco island` (a host joining a run, or the DAG's island task) supervises ranks it
    launches; it never trains, so it must not import torch and transformers first. It did, through
    the stages module's imports: 5-7 s of a 2-core host's CPU after the plan was seen, and across
    hosts round 0 waited for the joining host's path (benchmarks/RESULTS.md, "Islands on separate
    hosts"). A run from a checkpoint reads its recorded shape through pipeline.init_from (Run), which
    loads the model stack only to read a checkpoint. What the CLI and the island loop import before
    a launch is checked in a fresh process."""
    probe = (
        "import sys\n"
        "from pipeline import cli, init_from, stages\n"
        "from pipeline.islands import supervisor, island\n"
        "heavy = ('torch', 'transformers', 'deepspeed', 'mlflow', 'apache_beam')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"loaded before any launch: {result.stdout.strip()}"


def test_train_path_on_an_unprepared_root_exits_2_saying_prepare_and_launches_nothing(tmp_path):
    run_root = tmp_path / "run"
    result = dipaco(["train-path", "--config", TINY, "--set", f"run_root={run_root}", "--round", "0", "--path", "p0-1"])
    assert result.returncode == 2
    assert result.stderr.strip().endswith("shards are not committed; run `dipaco prepare` first")
    assert "Traceback" not in result.stderr and "attempt" not in result.stderr + result.stdout
    assert not run_root.exists()  # no run.yaml, no round 0: nothing a launched trainer could have read


@pytest.mark.parametrize("launcher", ["inprocess", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_a_path_jobs_input_error_is_not_retried_and_reaches_the_caller(launcher, run_root):
    """An input error inside the trainer (here: a shard too small for one row) fails the first
    attempt with the trainer's own message (exit status 2 from a launched rank); another attempt
    could only fail the same way."""
    from pipeline.core.errors import InputError
    from pipeline.islands.launch import train_path_job

    config = tiny_config(run_root, "train.max_attempts=3", f"train.launcher={launcher}")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid, docs_per_path={"p0-0": 0, "p0-1": 8, "p1-0": 8, "p1-1": 8})
    with pytest.raises(InputError, match=r"path p0-0 round 0: .*path=p0-0: too few tokens for one row"):
        train_path_job(config, 0, "p0-0")
    assert root.listdir(layout.attempts_dir(0, "p0-0")) == ["attempt-1.json"]
    assert root.read_json(f"{layout.attempts_dir(0, 'p0-0')}/attempt-1.json")["returncode"] == 2


def test_config_errors_are_reported_before_torch_is_imported(tmp_path):
    """A wrong key costs a fraction of a second: the config is checked before torch loads."""
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "pipeline.cli",
            "train-path",
            "--config",
            TINY,
            "--set",
            "train.inner_stepz=3",
            "--round",
            "0",
            "--path",
            "p0-1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2 and "train.inner_stepz" in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "pipeline.core.config" in imported
    assert not {"torch", "deepspeed", "mlflow", "apache_beam"} & imported


def test_help_describes_each_command_with_examples_and_a_version():
    top = dipaco(["--help"])
    assert top.returncode == 0
    for text in ("examples", "dipaco run --config configs/demo.yaml", "rounds: round R trains", "exit status"):
        assert text in top.stdout
    version = dipaco(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("dipaco ")
    for command in ("prepare", "train-path", "merge", "eval", "run"):
        page = dipaco([command, "--help"]).stdout
        assert f"dipaco {command} --config" in page and "examples" in page, command
    train = dipaco(["train-path", "--help"]).stdout
    assert "--path p1-0" in train and "round R's modules" in train
    assert "modules round R starts from" in dipaco(["eval", "--help"]).stdout


def test_every_path_example_in_the_help_is_a_path_of_the_demo_grid():
    from pipeline.preflight import check_job_id

    demo = load_config(REPO / "configs" / "demo.yaml")
    text = dipaco(["--help"]).stdout + dipaco(["train-path", "--help"]).stdout
    examples = set(re.findall(r"--path (p[\w.-]+)", text)) | set(re.findall(r"\b(p\d+-\d+)\b", text))
    assert examples
    for path_id in examples:
        check_job_id(demo, path_id)
