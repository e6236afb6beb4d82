"""The one-screen summary every `dipaco run` (and every DAG run) ends with: perplexity and bits per
byte by round and path, the registered model version, one continuation written by the champion,
and how to open the MLflow UI on the result. read_summary gathers it from the committed records
(eval files, merges, island records, the re-routing's report); format_summary prints it.

Paths are shown relative to the current directory when they lie under it, and the MLflow command
is the one installed beside `dipaco`, so every line can be copied and run as printed.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError
from pipeline.evaluation.early_stopping import best_up_to, evaluated_rounds
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.tracking.tracker import STATE_FILE, Tracker, redact, tracking_uri
from pipeline.tracking.utilisation import round_utilisation


def read_summary(config: Config, root: RunRoot, tracker: Tracker) -> dict:
    """Perplexity per path and overall by round, from the committed eval files, and where the
    registered model and the tracking store are."""
    rounds, committed = evaluated_rounds(root), layout.next_round(root)
    summary = {
        "run_root": root.path() if root.is_local else root.url,
        "rounds_committed": committed,
        "train_rounds": config.train.rounds,
        "eval": {r: read_eval(root, r) for r in rounds},
    }
    figures = round_utilisation(config, committed - 1) if committed > 0 else None
    if figures:
        summary["utilisation"] = {"round": committed - 1, **figures}
    if config.eval.early_stopping and rounds:
        summary["early_stopping"] = best_up_to(root)
    rerouted = read_reroute(config, root)
    if rerouted:
        summary["reroute"] = rerouted
    if config.mlflow.enabled:
        summary.update(
            tracking_uri=redact(tracking_uri(config)),
            registered_model=config.mlflow.registered_model,
            model_version=tracker.newest_version(),
            experiment=config.mlflow.experiment,
        )
        if root.exists(STATE_FILE):  # where the MLflow UI shows this run
            state = root.read_json(STATE_FILE)
            summary.update({k: state[k] for k in ("experiment_id", "parent_run_id") if isinstance(state.get(k), str)})
    return summary


def read_eval(root: RunRoot, round_index: int) -> dict:
    """eval/round=<r>.json with the numbers the run summary prints (perplexity and bits per byte,
    overall and per path)."""
    result = root.read_json(layout.eval_file(round_index))
    paths = result.get("paths", {})
    entries = [result] + [
        p if isinstance(p, dict) else {"perplexity": "?"}
        for p in (paths.values() if isinstance(paths, dict) else ["?"])
    ]
    numbers = [entry.get(key) for entry in entries for key in ("perplexity", "bits_per_byte")]
    if not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        raise CorruptStateError(
            f"{root.path(layout.eval_file(round_index))}: perplexity and bits_per_byte (overall "
            f'and per path under "paths") must be numbers'
        )
    return result


def read_reroute(config: Config, root: RunRoot) -> dict | None:
    """The re-routing's report (reroute/round=<R+1>/report.json), once written."""
    after = config.router.discriminative_after
    if after is None or not root.exists(layout.reroute_report(after + 1)):
        return None
    return root.read_json(layout.reroute_report(after + 1))


def format_summary(summary: dict) -> str:
    evals = summary.get("eval", {})
    paths = sorted({p for result in evals.values() for p in result.get("paths", {})})
    header = ["round", "perplexity", "bits/byte", *paths]
    rows = [header]
    for round_index in sorted(evals, key=int):
        result = evals[round_index]
        cells = [str(round_index), _num(result.get("perplexity"), 2), _num(result.get("bits_per_byte"), 3)]
        cells += [_num(result.get("paths", {}).get(p, {}).get("bits_per_byte"), 3) for p in paths]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    committed, planned = summary.get("rounds_committed"), summary.get("train_rounds")
    of = f" of train.rounds={planned}" if planned is not None else ""
    rerouted = sorted({r["reroute_every"] for r in evals.values() if r.get("reroute_every")})
    routing = f", re-routed every {'/'.join(map(str, rerouted))} tokens" if rerouted else ""
    lines = [
        f"dipaco run: {display_path(str(summary.get('run_root')))}: {committed} round(s){of} committed",
        f"held-out documents (tokens after the routing prefix{routing}), by the modules each round starts from "
        "(round 0: initial; round R+1: after round R's merge); overall perplexity and bits per byte, "
        "then bits per byte per path:",
    ]
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    use = summary.get("utilisation")
    if use and use.get("utilisation") is not None:
        overhead = use.get("task_overhead_seconds")
        lines.append(
            f"islands: {use['islands']}, compute utilisation {use['utilisation']:.2f} through round {use['round']} "
            f"({use['inner_seconds']:.0f} s of inner loops / {use['islands']} x {use['wall_seconds']:.0f} s wall)"
            + (f", {overhead:.1f} s overhead per path task" if overhead is not None else "")
            + (
                " (load {task_load_seconds:.1f}, engine {task_engine_seconds:.1f}, "
                "commit {task_commit_seconds:.1f})".format(**use)
                if "task_commit_seconds" in use
                else ""
            )
        )
    best = summary.get("early_stopping")
    if best and best.get("perplexity") is not None:
        lines.append(early_stopping_line(best))
    if summary.get("model_version"):
        lines.append(
            f"registered model: models:/{summary['registered_model']}/{summary['model_version']} "
            f"(alias champion: models:/{summary['registered_model']}@champion)"
        )
    sample = summary.get("sample")
    if sample:
        lines.append(f"champion continues {sample['prompt']!r}: {sample['continuation']!r}")
    if summary.get("tracking_uri"):
        lines += mlflow_hint(
            summary["tracking_uri"],
            summary.get("experiment"),
            summary.get("experiment_id"),
            summary.get("parent_run_id"),
        )
    if planned is not None and committed == planned:
        lines.append(f"every round of train.rounds={planned} is committed: raise train.rounds to train further")
    return "\n".join(lines)


def early_stopping_line(best: dict) -> str:
    """eval.early_stopping: the early-stopped model's figures and the round each path keeps."""
    rounds = " ".join(f"{pid}={entry['round']}" for pid, entry in sorted(best.get("paths", {}).items()))
    return (
        f"early-stopped model (each path's round of lowest validation perplexity): perplexity "
        f"{_num(best.get('perplexity'), 2)}, {_num(best.get('bits_per_byte'), 3)} bits/byte; rounds {rounds}"
    )


PAGE = "Model training → Training runs"  # MLflow 3 opens an experiment on its GenAI page; ours are training runs
_DATABASE_STORES = ("sqlite", "postgresql", "mysql", "mssql", "file")


def mlflow_hint(uri: str, experiment: str | None, experiment_id: str | None, run_id: str | None) -> list[str]:
    """Where to see the run, for each kind of tracking URI: a database store (SQLite here) needs
    an `mlflow ui` of its own, started with job execution off (by default MLflow 3.17 starts 7 job
    consumers that do nothing here: 10 processes, 2.2 GB, 77 s to the first page) on a free port;
    a tracking server already serves the run at a URL; so does a Databricks workspace."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri or uri == "databricks" else "file"
    page = f"experiment {experiment or '?'}, {PAGE}"
    run = f"#/experiments/{experiment_id}/runs/{run_id}" if experiment_id and run_id else ""
    if scheme in ("http", "https"):
        return [f"MLflow UI: {uri.rstrip('/')}/{run} (the tracking server; {page})"]
    if scheme == "databricks":
        host = os.environ.get("DATABRICKS_HOST", "").rstrip("/")
        where = f"{host}/ml/experiments/{experiment_id}/runs/{run_id}" if host and run else "the Databricks workspace"
        return [f"MLflow UI: {where} ({page})"]
    if scheme in _DATABASE_STORES or os.path.isabs(uri):
        port = free_port()
        return [
            f"MLflow UI: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false {mlflow_command()} ui "
            f"--backend-store-uri {display_uri(uri)} --port {port}",
            f"  then open http://127.0.0.1:{port}/{run} ({page})",
        ]
    return [f"MLflow UI: the tracking store {uri} ({page})"]


def free_port(preferred: int = 5000) -> int:
    """`preferred` when nothing listens there (a tracking server often does), else a free one."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return probe.getsockname()[1]
            except OSError:
                continue
    return preferred


def mlflow_command() -> str:
    """The `mlflow` installed beside the running command (`.venv/bin/dipaco` -> `.venv/bin/mlflow`),
    else beside this Python: a command that works without an activated venv."""
    for beside in (Path(sys.argv[0]), Path(sys.executable)):
        candidate = beside.with_name("mlflow")
        if candidate.is_file():
            return display_path(str(candidate))
    return "mlflow"


def display_path(path: str) -> str:
    """A local path relative to the current directory when it lies under it, else unchanged."""
    if "://" in path or not os.path.isabs(path):
        return path
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def display_uri(uri: str) -> str:
    """sqlite:////abs/cwd/runs/demo/mlflow.db -> sqlite:///runs/demo/mlflow.db (relative to here)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and os.path.isabs(uri[len(prefix) :]):
        return prefix + display_path(uri[len(prefix) :])
    return uri


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
