"""No code from data: weights, state and routers load without pickle."""

import ast
import shlex
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
        if (
            name in PICKLE_LOADS
            or name == "torch.load"
            and keywords.get("weights_only") != "True"
            or name in ("np.load", "numpy.load")
            and keywords.get("allow_pickle") != "False"
        ):
            found.append(f"{source.name}:{node.lineno}: {name}")
    return found


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=REPO).stdout.split()
    return [
        REPO / name
        for name in listed
        if name.split("/")[0] in ("pipeline", "models", "preprocessing", "airflow", "benchmarks")
    ]


def test_no_pickle_loads_in_the_code():
    files = tracked_python_files()
    assert len(files) > 20  # the scan really sees the project
    assert [hit for f in files for hit in pickle_loads(f)] == []


@pytest.mark.parametrize(
    "code", ["torch.load('x.pt')", "torch.load('x.pt', weights_only=False)", "np.load('c.npy')", "pickle.loads(blob)"]
)
def test_the_scan_catches_pickle_loads(code, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"import torch, numpy as np, pickle\nvalue = {code}\n")
    assert pickle_loads(bad) != []


# -- trust levels: what a DAG trigger may set ----------------------------------------------------
from pipeline.core.config import check_dag_params, load_config  # noqa: E402
from pipeline.core.errors import ConfigError  # noqa: E402

TINY = REPO / "configs" / "tiny.yaml"
ENV_OPTION = (
    "beam.options=['--environment_type=beam:env:harness_subprocess_python:v1', '--environment_config=id>pwned']"
)


@pytest.mark.parametrize(
    "override, key",
    [
        ("beam.runner=os.getcwd", "beam.runner"),
        (ENV_OPTION, "beam.options"),
        ("mlflow.tracking_uri=http://attacker:5000", "mlflow.tracking_uri"),
        ("train.hostfile=/etc/hosts", "train.hostfile"),
        ("train.ds_config=/tmp/x.json", "train.ds_config"),
        ("router.embedder=model", "router.embedder"),
    ],
)
def test_a_trigger_override_outside_the_allow_list_is_refused_naming_the_key(override, key):
    params = {"config": "configs/tiny.yaml", "overrides": ["train.lr=0.001", override], "project_dir": str(REPO)}
    with pytest.raises(ConfigError, match=rf"overrides\[1\]: a DAG trigger may not set '{key}'") as error:
        check_dag_params(params, [REPO])
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=f"may not set '{key}'"):  # and in the loader the tasks call
        load_config(TINY, [override], trusted=False)


def test_a_trigger_sets_hyper_parameters_and_a_run_root_only_under_the_configured_prefix(tmp_path):
    config = load_config(TINY, ["train.lr=0.001", "train.rounds=3", "eval.max_docs=2"], trusted=False)
    assert (config.train.lr, config.train.rounds, config.eval.max_docs) == (0.001, 3, 2)
    with pytest.raises(ConfigError, match="only under airflow.trigger_run_roots, which the config file does not set"):
        load_config(TINY, [f"run_root={tmp_path}/run"], trusted=False)
    with_prefix = tmp_path / "c.yaml"
    with_prefix.write_text(TINY.read_text() + f"airflow:\n  trigger_run_roots: {tmp_path}/runs\n")
    assert load_config(with_prefix, [f"run_root={tmp_path}/runs/a"], trusted=False).run_root == f"{tmp_path}/runs/a"
    for outside in (f"{tmp_path}/elsewhere", f"{tmp_path}/runs/../x", f"{tmp_path}/runs"):
        with pytest.raises(ConfigError, match="must lie under airflow.trigger_run_roots|must not contain"):
            load_config(with_prefix, [f"run_root={outside}"], trusted=False)
    with pytest.raises(ConfigError, match="may not set 'airflow.trigger_run_roots'"):
        load_config(with_prefix, ["airflow.trigger_run_roots=/", "run_root=/x"], trusted=False)


def test_a_trigger_cannot_choose_a_config_file_or_project_outside_the_trusted_directories(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("beam:\n  runner: PortableRunner\n")
    with pytest.raises(ConfigError, match="lies outside the directories this DAG trusts"):
        check_dag_params({"config": str(evil), "overrides": [], "project_dir": str(REPO)}, [REPO])
    with pytest.raises(ConfigError, match="lies outside the directories this DAG trusts"):
        check_dag_params({"config": "configs/../../x.yaml", "overrides": [], "project_dir": str(REPO)}, [REPO])
    with pytest.raises(ConfigError, match="project_dir .* is not one this DAG trusts"):
        check_dag_params({"config": "configs/tiny.yaml", "overrides": [], "project_dir": str(tmp_path)}, [REPO])


def test_runners_come_from_an_allow_list_whoever_names_them(tmp_path):
    with pytest.raises(ConfigError, match="beam.runner must be one of DirectRunner.*got 'os.getcwd'"):
        load_config(TINY, ["beam.runner=os.getcwd"])  # even from the operator's --set
    listed = tmp_path / "c.yaml"
    listed.write_text(
        TINY.read_text().replace("runner: DirectRunner", "runner: PrismRunner\n  extra_runners: [PrismRunner]")
    )
    assert load_config(listed).beam.runner == "PrismRunner"  # the config file may list one more


def test_environment_options_must_come_from_the_config_file_itself(tmp_path):
    with pytest.raises(ConfigError, match="only the config file itself may set --environment_type"):
        load_config(TINY, [ENV_OPTION])
    own = tmp_path / "c.yaml"
    own.write_text(
        TINY.read_text().replace('options: ["--direct_num_workers=1"', 'options: ["--environment_type=LOOPBACK"')
    )
    assert "--environment_type=LOOPBACK" in load_config(own).beam.options


# -- quoting: what reaches a shell ---------------------------------------------------------------
def pdsh_remote_line(command: list[str]) -> str:
    """The line DeepSpeed's pdsh runner has every node's shell run for this `deepspeed` command."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import parse_args

    args = parse_args(command[1:])
    args.master_addr = "10.0.0.1"
    cmd, _, _ = PDSHRunner(args, "e30=").get_cmd({}, {"node-a": [0], "node-b": [0]})
    return " ".join(cmd[cmd.index("node-a,node-b") + 1 :])


def test_a_multi_node_launch_line_quotes_its_values_and_refuses_shell_syntax(tmp_path):
    from pipeline.islands.launch import island_command, launcher_command

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    train = load_config(TINY, ["train.num_nodes=2", f"train.hostfile={hostfile}"]).train
    hostile = "/tmp/x;touch${IFS}pwned;#"
    with pytest.raises(ConfigError, match="run_root may hold only"):  # the config refuses it first
        load_config(TINY, [f"run_root={hostile}"])
    with pytest.raises(ConfigError, match="would reach the nodes' shell"):  # and so does the launcher
        launcher_command(hostile, 0, "p0-1", train, 29500)
    with pytest.raises(ConfigError, match="would reach the nodes' shell"):
        island_command("/tmp/run", "island-0", train, 29500, ds_config="/x/$(id).json")
    root = "/tmp/runs/~a,b=c@d+e"  # within the character set, with characters a shell reads: quoted
    line = pdsh_remote_line(launcher_command(root, 3, "p0-1", train, 29500))
    words = shlex.split(line)
    assert words[words.index("--run-root") + 1] == root and words[words.index("--path") + 1] == "p0-1"
    assert f"'{root}'" in line


def test_a_single_node_launch_passes_values_as_they_are():
    from pipeline.islands.launch import launcher_command

    train = load_config(TINY).train
    command = launcher_command("/tmp/runs/~a", 0, "p0-1", train, 29500)
    assert command[command.index("--run-root") + 1] == "/tmp/runs/~a"  # an argv list, no shell


# -- no leaks: only committed files, never through a link ----------------------------------------
def test_get_dir_copies_only_the_listed_files_and_refuses_a_symbolic_link(tmp_path):
    from pipeline.core.errors import CorruptStateError
    from pipeline.state.storage import RunRoot

    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY")
    root = RunRoot(tmp_path / "run")
    root.write_bytes("router/a.bin", b"centroids")
    root.commit("router")
    (tmp_path / "run" / "router" / "extra.txt").symlink_to(secret)  # slipped in after the commit
    (tmp_path / "run" / "router" / "more.txt").write_text("unlisted")
    root.get_dir("router", tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").rglob("*")) == ["a.bin"]
    root.commit("router")  # a marker that lists the link (its checksum is the target's)
    with pytest.raises(CorruptStateError, match="extra.txt: is or lies under a symbolic link"):
        root.get_dir("router", tmp_path / "copy2")
    with pytest.raises(CorruptStateError, match="symbolic link"):
        root.read_committed("router", "extra.txt")


def test_a_link_in_a_committed_router_never_reaches_mlflow(tmp_path, monkeypatch):
    from conftest import tiny_config
    from pipeline.core.errors import CorruptStateError
    from pipeline.state.storage import RunRoot
    from pipeline.tracking.tracker import get_tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY 6d8f")

    def prepared_with_a_link(name: str, listed: bool):
        """A run root whose committed router holds a link to the key (listed in _SUCCESS or not)."""
        config = tiny_config(tmp_path / name, "mlflow.enabled=true", f"mlflow.experiment=test-{name}")
        root = RunRoot(config.run_root)
        root.write_json("router/router.json", {"kind": "kmeans"})
        root.commit("router")
        root.write_json("shards/manifest.json", {"seconds": 1.0})
        root.commit("shards")
        (tmp_path / name / "router" / "extra.txt").symlink_to(secret)
        if listed:
            root.commit("router")
        return get_tracker(config)

    tracker = prepared_with_a_link("unlisted", listed=False)
    tracker.log_prepare({"seconds": 1.0})  # the router goes to MLflow: its listed file only
    assert [a.path for a in tracker.client.list_artifacts(tracker._parent(), "router")] == ["router/router.json"]
    with pytest.raises(CorruptStateError, match="symbolic link"):
        prepared_with_a_link("listed", listed=True).log_prepare({"seconds": 1.0})
    shipped = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and p != secret]
    assert shipped and not [p for p in shipped if b"PRIVATE KEY" in p.read_bytes()]


# -- generation caps -----------------------------------------------------------------------------
def test_generation_params_are_capped_with_a_message_naming_the_param():
    from pipeline.tracking.registry import generation_options

    assert generation_options({"max_new_tokens": 256, "reroute_every": 8}, None, 256, 512)["max_new_tokens"] == 256
    assert generation_options({"reroute_every": 0}, 64, 256)["reroute_every"] is None  # 0: route once
    assert generation_options({"reroute_every": 4}, 4, 256)["reroute_every"] == 4  # the run's own, smaller
    for params, expected in [
        ({"max_new_tokens": 10**9}, r"max_new_tokens=1000000000 must be within \[1, 256\]"),
        ({"reroute_every": 1}, r"reroute_every=1 must be within \[8, "),
        ({"top_k": 10**6}, r"top_k=1000000 must be within \[0, 512\]"),
        ({"temperature": float("inf")}, "temperature=inf"),
        ({"max_new_tokens": float("inf")}, "must be numbers"),
    ]:
        with pytest.raises(ValueError, match=expected):
            generation_options(params, None, 256, 512)


def test_a_ds_config_with_a_checkpoint_section_is_refused(tmp_path):
    import json

    from models.modular import ModelShape
    from pipeline.train.zero import load_ds_config

    raw = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    raw["checkpoint"] = {"load_universal": True}
    bad = tmp_path / "zero2_universal.json"
    bad.write_text(json.dumps(raw))
    config = load_config(TINY, [f"train.ds_config={bad}"])
    shape = ModelShape.from_config(config.model)
    with pytest.raises(ConfigError, match="zero2_universal.json: remove the checkpoint section"):
        load_ds_config(config.train, shape, 1)


# -- redaction -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("https://user:p@ss@host/x", "https://***@host/x"),  # '@' inside the password
        ("https://h/x?token=abc&n=1", "https://h/x?token=***&n=1"),
        (
            "s3://b/k?X-Amz-Signature=ff&X-Amz-Credential=AK&X-Amz-Date=1",
            "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***&X-Amz-Date=1",
        ),
        (
            "--set data.train=https://r:s3cr3t@d.example.com/c4/*.json?api_key=k#f",
            "--set data.train=https://***@d.example.com/c4/*.json?api_key=***#f",
        ),
        ("['--dask_client_address=tcp://u:pw@h:8786']", "['--dask_client_address=tcp://***@h:8786']"),
        ("sqlite:////tmp/run/mlflow.db", "sqlite:////tmp/run/mlflow.db"),
        ("runs/a b=c", "runs/a b=c"),
    ],
)
def test_redact_hides_userinfo_and_secret_query_params(text, expected):
    from urllib.parse import urlsplit

    from pipeline.tracking.uris import redact

    assert redact(text) == expected
    if text.startswith("https://user"):
        assert redact(text).split("://")[1].split("/")[0] == "***@" + urlsplit(text).hostname  # urlsplit's split


@pytest.mark.timeout(20)  # the regex before took 18 s on 64 KB: quadratic
def test_redact_takes_linear_time_on_a_megabyte():
    import time

    from pipeline.tracking.uris import redact

    url = "https://user:p@ss@host.example.com/p?token=t0k3n&n=1 "
    texts = {
        "urls": "x=" + url * ((1 << 20) // len(url)),
        "scheme run": "a" * (1 << 20) + "://u:p@h",
        "one authority": "x=https://" + "a" * (1 << 20),
        "at signs": "a@" * (1 << 19) + "://",
    }
    for name, text in texts.items():
        seconds = min(_timed(redact, text, time) for _ in range(3))
        assert seconds < 0.05, f"{name}: {seconds * 1000:.0f} ms for 1 MB"
    assert "p@ss" not in redact(texts["urls"]) and "t0k3n" not in redact(texts["urls"])


def _timed(fn, arg, time) -> float:
    start = time.perf_counter()
    fn(arg)
    return time.perf_counter() - start
