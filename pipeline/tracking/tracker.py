"""Experiment tracking behind one small interface, so the engine never branches on "is it on".

`get_tracker(config)` returns an `MlflowTracker` or, when `mlflow.enabled` is false, a
`NullTracker` with the same methods doing nothing. The tracker is called by the orchestrating
process only (never by DeepSpeed ranks), after a stage has committed, from its committed JSON.

Every call may come from a different process (each Airflow task is one), so the tracker keeps no
state in memory: the runs it logs into are found again through MLflow tags. Each run carries two
bookkeeping tags under `mlflow.` (which the MLflow UI does not list): `mlflow.dipaco.run_key` (a
hash of the run root) and `mlflow.dipaco.key` (its place in the run: `prepare`, `round=0`,
`round=0/path=p0-1`, `round=0/merge`, ...). The tags a user filters on stay visible: `dipaco.kind`,
`dipaco.round`, `dipaco.path`. Finding or creating a run is idempotent: a finished leaf run means
"already logged" (a rerun logs nothing twice), and two processes that create the same container
run at once both keep the oldest and the loser deletes its own. `tracking.json` in the run root
records the experiment and parent run for people and tools.

Layout in MLflow, with one numbering (that of the run root, the CLI summary and the registry):
one parent run per run root, named after it, with a nested `prepare` run and one container run
per round, `round R`. `round R` holds the perplexity of the modules round R starts from (the
summary table's row R), the paths trained from them (`round R · path p0-1`), their merge into
round R+1's modules (`round R · merge`) and the registration of round R's modules
(`round R · register`). Runs carry their real start and end times, taken from the committed
records of the work (a path's inner loop, the merge, the Beam job), not from when they were logged.
Losses are logged at the global inner step, so one path's curve continues across rounds. The
parent holds what spans rounds: perplexity by round, and totals over every merge. Credentials in
a tracking URI (user:password@) are redacted from everything written: logs, params, artifacts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.config import Config, flatten, parse_yaml, resolve_ds_config
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.tracking.uris import CHAMPION, NEWEST, redact, redact_data, tracking_uri  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

STATE_FILE = "tracking.json"  # under the run root: where this run's MLflow records live
KIND = "dipaco.kind"  # pipeline | prepare | round | path | merge | register: what a run holds
KEY, RUN_KEY = "mlflow.dipaco.key", "mlflow.dipaco.run_key"  # bookkeeping, hidden by the MLflow UI
PARENT_TAG = "mlflow.parentRunId"
DESCRIPTION_TAG = "mlflow.note.content"  # the run page's description
EVAL_SERIES = {"bytes": "eval_bytes"}  # eval result key -> metric name on the parent and round runs
EARLY_STOPPED = "dipaco.early_stopped"  # on a version holding the early-stopped model (eval.early_stopping)
EXPORT_TAG = "dipaco.export"  # on a version whose paths `dipaco export` wrote: where the export's artifacts are
PATH_ROUNDS = "dipaco.path_rounds_sha"  # which rounds it assembles its paths from, hashed (a tag is short)
_BAD_NAME_CHARS = re.compile(r"[^\w./\- :]")


# -- helpers shared by the implementations --------------------------------------------------------
def metric_name(text: str) -> str:
    """MLflow names allow [/\\w.- :] only: 'level=0/module=1' -> 'level_0/module_1'."""
    return _BAD_NAME_CHARS.sub("_", text)


def run_key(config: Config) -> str:
    """The identity of a run root in MLflow tags: stable across processes and machines."""
    return hashlib.sha256(config.run_root.rstrip("/").encode()).hexdigest()[:16]


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _ms(seconds: float | None) -> int | None:
    """Epoch seconds -> MLflow's epoch milliseconds."""
    return None if seconds is None else int(seconds * 1000)


def round_description(round_index: int) -> str:
    """What a round's container run holds, in the numbering the whole project uses."""
    start = "the initial modules" if round_index == 0 else f"the modules written by round {round_index - 1}'s merge"
    return (
        f"Round {round_index}. Its perplexity is that of the modules round {round_index} starts from "
        f"({start}), row {round_index} of the `dipaco run` summary and registered versions tagged "
        f"dipaco.round={round_index}. Its paths train from these modules; its merge writes round "
        f"{round_index + 1}'s."
    )


# -- the interface --------------------------------------------------------------------------------
class Tracker:
    """What the engine may tell the tracker. The base class is the null tracker: every method a
    no-op, so call sites never test whether tracking is on."""

    def log_run_config(self) -> None:
        """Params (the flattened config), run.yaml and the DeepSpeed config as artifacts."""

    def log_precision(self, name: str, reason: str) -> None:
        """The precision train.precision resolved to on this machine, and why (params)."""

    def log_prepare(self, manifest: dict) -> None:
        """The shard manifest, the router and shard sizes, after prepare committed."""

    def log_path(self, round_index: int, path_id: str, metrics: dict) -> None:
        """One path's training in a round, from its committed metrics.json."""

    def log_merge(self, round_index: int, report: dict) -> None:
        """One outer step: grad norms per module, paths left out, bytes communicated."""

    def log_eval(self, round_index: int, result: dict, started_at: float | None = None) -> None:
        """Routed perplexity of the modules at the start of round_index (evaluated from started_at)."""

    def log_utilisation(self, round_index: int, figures: dict) -> None:
        """Islands' compute utilisation up to round_index, and their per-task overhead."""

    def log_reroute(self, after_round: int, report: dict) -> None:
        """router.discriminative_after: the re-routing after round R (accuracy, changed documents,
        perplexity before and after), from its committed report.json."""

    def newest_version(self) -> str | None:
        """The newest model version this run root registered, or None."""
        return None

    def register(self, round_index: int, result: dict) -> str | None:
        """Register round_index's modules as a model version; returns the version or None."""
        return None

    def attach_export(self, round_index: int, out: str) -> str | None:
        """`dipaco export`'s directory, as artifacts of round_index's registered version; its URI or None."""
        return None

    def log_early_stopping(self, round_index: int, best: dict) -> None:
        """The early-stopped model over rounds <= round_index: its figures and each path's round."""

    def register_early_stopped(self, round_index: int, best: dict) -> str | None:
        """Register the early-stopped model (each path from its best round) as the champion."""
        return None

    def finish(self, summary: dict) -> None:
        """Plots of the whole run, then close the parent run."""


class NullTracker(Tracker):
    """Tracking switched off (mlflow.enabled: false)."""


def get_tracker(config: Config) -> Tracker:
    if not config.mlflow.enabled:
        return NullTracker()
    return MlflowTracker(config)


# -- MLflow ---------------------------------------------------------------------------------------
class MlflowTracker(Tracker):
    """Logs through `MlflowClient` (no fluent active-run state, which is per process)."""

    PARENT_KIND = "pipeline"  # dipaco.kind of the parent run (a sweep's: "sweep", pipeline.scaling.tracking)

    def __init__(self, config: Config):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow
        from mlflow.tracking import MlflowClient

        self.config = config
        self.root = RunRoot(config.run_root)
        self.uri = tracking_uri(config)
        self.key = run_key(config)
        self._mlflow = mlflow
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self._experiment_id: str | None = None
        self._parent_id: str | None = None

    # ---- public methods --------------------------------------------------------------------
    def log_run_config(self) -> None:
        parent = self._parent()
        # a new DAG run (or `dipaco run`) continues the run: it is running again until finish()
        self.client.update_run(parent, status="RUNNING")
        config = redact_data(self.config.to_dict())
        self._log_params(parent, {k: _param(v) for k, v in flatten(config).items()})
        self.client.log_text(parent, self._run_yaml(), "run.yaml")
        ds_path = resolve_ds_config(self.config.train.ds_config)
        if ds_path.is_file():
            self.client.log_artifact(parent, str(ds_path), "ds_configs")
        log.info("MLflow: run %s in experiment %s at %s", parent, self.config.mlflow.experiment, redact(self.uri))

    def log_precision(self, name: str, reason: str) -> None:
        # "precision.*", not "train.precision": that param is the config's own value (auto)
        self._log_params(self._parent(), {"precision.resolved": name, "precision.reason": _param(reason)})

    def log_prepare(self, manifest: dict) -> None:
        parent = self._parent()
        finished = self._committed_at(layout.SHARDS_DIR)
        started = finished - manifest["seconds"] if _numeric(manifest.get("seconds")) else finished
        run = self._leaf("prepare", "prepare", "prepare", parent, {}, started)
        if run is None:
            return
        metrics = {metric_name(k): float(v) for k, v in flatten(manifest).items() if _numeric(v)}
        self._log_metrics(run, {k: [(0, v)] for k, v in list(metrics.items())[:5000]})
        self.client.log_dict(run, redact_data(manifest), "shard_manifest.json")
        # The parent holds the run's reference artifacts: the router and the manifest.
        self.client.log_dict(parent, redact_data(manifest), "shard_manifest.json")
        if self.root.is_committed(layout.ROUTER_DIR):
            with tempfile.TemporaryDirectory() as tmp:
                self.root.get_dir(layout.ROUTER_DIR, tmp)
                self.client.log_artifacts(parent, tmp, "router")
        self._end(run, finished)

    def log_path(self, round_index: int, path_id: str, metrics: dict) -> None:
        finished = metrics.get("finished_at") if _numeric(metrics.get("finished_at")) else time.time()
        started = (
            metrics.get("started_at")
            if _numeric(metrics.get("started_at"))
            else finished - float(metrics.get("seconds") or 0)
        )
        round_run = self._round(round_index, started)  # created here: the round began with this path
        run = self._leaf(
            "path",
            f"round={round_index}/path={path_id}",
            f"round {round_index} · path {path_id}",
            round_run,
            {"dipaco.round": str(round_index), "dipaco.path": path_id},
            started,
        )
        if run is None:
            return
        ds_config = metrics.get("ds_config") or {}
        params = {k: _param(v) for k, v in flatten(redact_data(self.config.to_dict())).items()}
        params.update(
            {
                "path.id": path_id,
                "path.modules": json.dumps(metrics.get("modules")),
                "path.world_size": str(metrics.get("world_size")),
                "path.precision": str(metrics.get("precision")),  # what its island's host chose (train.precision)
                **{f"ds.{k}": _param(v) for k, v in flatten(ds_config).items()},
            }
        )
        self._log_params(run, params)
        # Global inner steps (round * inner_steps + step), as the trainer's lr schedule counts them:
        # the loss of one path continues across its rounds' runs instead of restarting at 0.
        first = int(metrics.get("first_step", round_index * len(metrics.get("loss") or [])))
        series = {name: [(first + i, v) for i, v in enumerate(metrics.get(name) or [])] for name in ("loss", "lr")}
        for name in ("tokens", "tokens_per_s", "seconds", "shard_docs", "shard_tokens"):
            if _numeric(metrics.get(name)):
                series[name] = [(round_index, float(metrics[name]))]
        if metrics.get("loss"):
            series["final_loss"] = [(round_index, float(metrics["loss"][-1]))]
        self._log_metrics(run, series, finished)
        self.client.log_dict(run, redact_data(ds_config), "ds_config.json")
        self.client.log_dict(run, redact_data(metrics), "metrics.json")
        self._end(run, finished)

    def log_merge(self, round_index: int, report: dict) -> None:
        finished = self._committed_at(layout.round_dir(round_index))
        started = finished - report["seconds"] if _numeric(report.get("seconds")) else finished
        parent, round_run = self._parent(), self._round(round_index, started)
        run = self._leaf(
            "merge",
            f"round={round_index}/merge",
            f"round {round_index} · merge",
            round_run,
            {"dipaco.round": str(round_index)},
            started,
            f"Outer step of round {round_index}: its trained paths merged into the modules round "
            f"{round_index + 1} starts from.",
        )
        if run is None:
            return
        norms = {
            f"outer_grad_norm/{metric_name(m)}": float(v)
            for m, v in (report.get("module_grad_norms") or {}).items()
            if _numeric(v)
        }
        scalars = {metric_name(k): float(v) for k, v in report.items() if _numeric(v) and k != "round"}
        merged, left_out = report.get("paths_merged") or [], report.get("paths_left_out") or []
        scalars.update({"paths_merged": float(len(merged)), "paths_left_out": float(len(left_out))})
        if report.get("bytes_outer") and _numeric(report.get("bytes_data_parallel")):
            # how many times less than data-parallel training would have sent
            scalars["communication_saving"] = report["bytes_data_parallel"] / report["bytes_outer"]
        self._log_metrics(run, {k: [(round_index, v)] for k, v in {**norms, **scalars}.items()}, finished)
        self._log_params(
            run,
            {
                "paths_merged": ",".join(merged) or "none",
                "paths_left_out": ",".join(left_out) or "none",
            },
        )
        self.client.log_dict(run, redact_data(report), "merge_report.json")
        self._end(run, finished)
        self._log_merge_totals(parent)
        self._end(round_run, finished)

    def log_utilisation(self, round_index: int, figures: dict) -> None:
        """Islands' utilisation up to round r (pipeline.tracking.utilisation) on the parent, by round, and
        on the round's run."""
        series = {
            f"islands_{metric_name(k)}" if k != "utilisation" else "utilisation": [(round_index, float(v))]
            for k, v in figures.items()
            if _numeric(v)
        }
        self._log_metrics(self._parent(), series)
        self._log_metrics(self._round(round_index), series)

    def log_reroute(self, after_round: int, report: dict) -> None:
        """`reroute/<key>` metrics at step R on the parent and on round R's run; the report and the
        discriminative router as artifacts. Logging twice logs the same values again (idempotent)."""
        series = {
            f"reroute/{metric_name(k)}": [(after_round, float(v))]
            for k, v in report.items()
            if _numeric(v) and k not in ("after_round", "round")
        }
        parent = self._parent()
        self._log_metrics(parent, series)
        self._log_metrics(self._round(after_round), series)
        self.client.log_dict(parent, redact_data(report), f"reroute/round={after_round + 1}/report.json")
        router = layout.reroute_routing(after_round + 1).router
        if self.root.is_committed(router):
            with tempfile.TemporaryDirectory() as tmp:
                self.root.get_dir(router, tmp)
                self.client.log_artifacts(parent, tmp, f"reroute/round={after_round + 1}/router")

    def _log_merge_totals(self, parent: str) -> None:
        """The parent's merge figures are totals over every committed merge, never the last one's."""
        reports, r = [], 0
        while self.root.is_committed(layout.round_dir(r)):
            reports.append(self.root.read_json(f"{layout.round_dir(r)}/merge.json"))
            r += 1

        def total(key, of=lambda v: v):
            return float(sum(of(rep.get(key)) for rep in reports if rep.get(key) is not None))

        totals = {
            "rounds_merged": float(len(reports)),
            "merge_seconds_total": total("seconds"),
            "paths_left_out_total": total("paths_left_out", len),
            "bytes_outer_total": total("bytes_outer"),
            "bytes_data_parallel_total": total("bytes_data_parallel"),
        }
        if totals["bytes_outer_total"]:
            totals["communication_saving"] = totals["bytes_data_parallel_total"] / totals["bytes_outer_total"]
        self._log_metrics(parent, {k: [(len(reports), v)] for k, v in totals.items()})

    def log_eval(self, round_index: int, result: dict, started_at: float | None = None) -> None:
        """On `round R` (the modules it starts from) and, by round, on the parent. `eval_tokens` on
        the round's run, logged last, is the mark that a rerun has nothing to add."""
        parent, round_run = self._parent(), self._round(round_index, started_at)
        if "eval_tokens" in self.client.get_run(round_run).data.metrics:
            return
        series = {}
        for key in ("perplexity", "bits_per_byte", "bytes"):
            if _numeric(result.get(key)):
                series[EVAL_SERIES.get(key, key)] = [(round_index, float(result[key]))]
        for pid, scores in (result.get("paths") or {}).items():
            for key in ("perplexity", "bits_per_byte"):
                if _numeric(scores.get(key)):
                    series[f"{key}/{metric_name(pid)}"] = [(round_index, float(scores[key]))]
        series["eval_tokens"] = [(round_index, float(result.get("tokens") or 0))]  # last: the done-mark
        self._log_metrics(parent, series)
        self.client.log_dict(parent, redact_data(result), f"eval/round={round_index}.json")
        self._log_metrics(round_run, series)
        self._end(round_run)

    def register(self, round_index: int, result: dict) -> str | None:
        from pipeline.tracking import registry

        name = self.config.mlflow.registered_model
        existing = self._versions(name, {RUN_KEY: self.key, "dipaco.round": str(round_index)})
        if existing:
            version = existing[0].version
        else:
            version = self._register_new(name, round_index, result, registry)
            # MLflow reserves the alias "latest": `models:/<name>/latest` already means the newest
            # version; "newest" names the same version for alias-only (`@`) consumers.
            self.client.set_registered_model_alias(name, NEWEST, version)
        self._set_champion(name)
        self._end(self._round(round_index))
        log.info("MLflow: %s version %s holds round %d", name, version, round_index)
        return str(version)

    def attach_export(self, round_index: int, out: str) -> str | None:
        """The export (pipeline.export) logged under `export/` of the run that registered round r's
        version, and the version tagged `dipaco.export` with its URI; once (a tagged version is left as is)."""
        name = self.config.mlflow.registered_model
        versions = [
            v
            for v in self._versions(name, {RUN_KEY: self.key, "dipaco.round": str(round_index)})
            if v.tags.get(EARLY_STOPPED) != "true"
        ]
        if not versions:
            return None
        version = versions[0]
        if EXPORT_TAG not in version.tags:
            self.client.log_artifacts(version.run_id, out, "export")
            self.client.set_model_version_tag(name, version.version, EXPORT_TAG, f"runs:/{version.run_id}/export")
        log.info("MLflow: export of round %d attached to %s version %s", round_index, name, version.version)
        return f"models:/{name}/{version.version} ({EXPORT_TAG})"

    def log_early_stopping(self, round_index: int, best: dict) -> None:
        """On the parent, by round: `early_stopped_perplexity`, `early_stopped_bits_per_byte` and
        `early_stopped_round/<path>`, and eval/best.json as an artifact. The perplexity, logged
        last, is the mark that a rerun has nothing to add."""
        parent = self._parent()
        if not _numeric(best.get("perplexity")) or any(
            m.step == round_index for m in self.client.get_metric_history(parent, "early_stopped_perplexity")
        ):
            return
        series = {
            f"early_stopped_round/{metric_name(pid)}": [(round_index, float(entry["round"]))]
            for pid, entry in best.get("paths", {}).items()
        }
        if _numeric(best.get("bits_per_byte")):
            series["early_stopped_bits_per_byte"] = [(round_index, float(best["bits_per_byte"]))]
        self._log_metrics(parent, series)
        self.client.log_dict(parent, redact_data(best), "eval/best.json")
        self._log_metrics(parent, {"early_stopped_perplexity": [(round_index, float(best["perplexity"]))]})

    def register_early_stopped(self, round_index: int, best: dict) -> str | None:
        """A version whose bundle assembles each path from its best round (registry.build_bundle),
        registered once per choice of rounds; `champion` then points at it."""
        from pipeline.evaluation.early_stopping import path_rounds
        from pipeline.tracking import registry

        if not _numeric(best.get("perplexity")):
            return None
        name = self.config.mlflow.registered_model
        rounds = registry.bundle_path_rounds(self.config, round_index, path_rounds(best))
        existing = self._versions(name, {RUN_KEY: self.key, EARLY_STOPPED: "true", PATH_ROUNDS: rounds_tag(rounds)})
        version = (
            str(existing[0].version) if existing else self._register_new(name, round_index, best, registry, rounds)
        )
        self._set_champion(name)
        log.info(
            "MLflow: %s version %s holds the early-stopped model (rounds %s)",
            name,
            version,
            " ".join(f"{p}={r}" for p, r in rounds.items()),
        )
        return version

    def newest_version(self) -> str | None:
        versions = self._versions(self.config.mlflow.registered_model, {RUN_KEY: self.key})
        return str(versions[-1].version) if versions else None

    def finish(self, summary: dict) -> None:
        from pipeline.tracking import plots

        parent = self._parent()
        figures = {
            "loss_curves.png": lambda: plots.loss_curves(self._path_series("loss"), self.config.train.inner_steps),
            "docs_per_path.png": lambda: plots.docs_per_path(self._docs_per_path()),
            "perplexity_by_round.png": lambda: plots.perplexity_by_round(*self._perplexities(parent)),
            "bits_per_byte_by_round.png": lambda: plots.perplexity_by_round(
                *self._perplexities(parent, "bits_per_byte"), metric="bits_per_byte"
            ),
            "outer_grad_norm_heatmap.png": lambda: plots.grad_norm_heatmap(self._grad_norms()),
        }
        for file_name, build in figures.items():
            fig = build()
            self.client.log_figure(parent, fig, f"plots/{file_name}")
            plots.close(fig)
        self.client.log_dict(parent, redact_data(_jsonable(summary)), "summary.json")
        self.client.set_terminated(parent, "FINISHED")
        log.info("MLflow: run %s finished, plots logged", parent)

    # ---- where runs live -------------------------------------------------------------------
    def _experiment(self) -> str:
        if self._experiment_id is None:
            from mlflow.exceptions import MlflowException

            name = self.config.mlflow.experiment
            found = self.client.get_experiment_by_name(name)
            if found is None:
                try:
                    self._experiment_id = self.client.create_experiment(name, artifact_location=self._artifacts())
                except MlflowException:  # another process created it a moment ago
                    found = self.client.get_experiment_by_name(name)
            if found is not None:
                if found.lifecycle_stage == "deleted":
                    self.client.restore_experiment(found.experiment_id)
                self._experiment_id = found.experiment_id
        return self._experiment_id

    def _artifacts(self) -> str | None:
        """A database-backed store keeps artifacts beside the run; a server decides for itself."""
        if self.uri.split(":", 1)[0].split("+", 1)[0] not in ("sqlite", "postgresql", "mysql", "mssql"):
            return None
        if self.root.is_local:
            return self.root.local_path("mlartifacts").resolve().as_uri()
        return self.config.run_root.rstrip("/") + "/mlartifacts"

    def _parent(self) -> str:
        if self._parent_id is None:
            tags = {KIND: self.PARENT_KIND, "dipaco.run_root": redact(self.config.run_root)}
            run = self._find_or_create("pipeline", None, Path(self.config.run_root.rstrip("/")).name, tags)
            self._parent_id = run.info.run_id
            state = {
                "tracking_uri": redact(self.uri),
                "experiment": self.config.mlflow.experiment,
                "experiment_id": self._experiment(),
                "parent_run_id": self._parent_id,
                "run_key": self.key,
            }
            if not self.root.exists(STATE_FILE) or self.root.read_json(STATE_FILE) != state:
                self.root.write_json(STATE_FILE, state)
        return self._parent_id

    def _round(self, round_index: int, start: float | None = None) -> str:
        tags = {KIND: "round", "dipaco.round": str(round_index), DESCRIPTION_TAG: round_description(round_index)}
        run = self._find_or_create(f"round={round_index}", self._parent(), f"round {round_index}", tags, start)
        return run.info.run_id

    def _committed_at(self, rel: str) -> float:
        """When a directory's _SUCCESS was written: the end of the work that produced it."""
        if self.root.is_committed(rel):
            value = self.root.marker(rel).get("committed_at")
            if _numeric(value):
                return float(value)
        return time.time()

    def _end(self, run_id: str, at: float | None = None) -> None:
        """FINISHED at `at` (the work's end), now by default."""
        self.client.set_terminated(run_id, "FINISHED", end_time=_ms(at or time.time()))

    def _search(self, key: str, parent: str | None) -> list:
        query = f"tags.`{RUN_KEY}` = '{self.key}' and tags.`{KEY}` = '{key}'"
        if parent is not None:
            query += f" and tags.`{PARENT_TAG}` = '{parent}'"
        runs = self.client.search_runs([self._experiment()], query, max_results=100)
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def _find(self, key: str, parent: str | None):
        runs = self._search(key, parent)
        return runs[0] if runs else None

    def _create(self, key: str, parent: str | None, name: str, tags: dict[str, str], start: float | None = None):
        tags = {RUN_KEY: self.key, KEY: key, **tags, **({PARENT_TAG: parent} if parent else {})}
        return self.client.create_run(self._experiment(), start_time=_ms(start), run_name=name, tags=tags)

    def _find_or_create(
        self, key: str, parent: str | None, name: str, tags: dict[str, str], start: float | None = None
    ):
        """A container run, created once even when processes race: the oldest one wins."""
        found = self._find(key, parent)
        if found is not None:
            return found
        mine = self._create(key, parent, name, tags, start)
        winner = self._find(key, parent)
        if winner.info.run_id != mine.info.run_id:
            self.client.delete_run(mine.info.run_id)
        return winner

    def _leaf(
        self,
        kind: str,
        key: str,
        name: str,
        parent: str,
        tags: dict[str, str],
        start: float | None = None,
        description: str | None = None,
    ) -> str | None:
        """A fresh run to log into (started at `start`, the work's start), or None when a finished
        one exists (already logged)."""
        runs = self._search(key, parent)
        if any(r.info.status == "FINISHED" for r in runs):
            log.info("MLflow: %s already logged, skipping", key)
            return None
        for stale in runs:  # a logger that died half-way: start over rather than log twice
            self.client.delete_run(stale.info.run_id)
        if description:
            tags = {**tags, DESCRIPTION_TAG: description}
        return self._create(key, parent, name, {KIND: kind, **tags}, start).info.run_id

    # ---- logging in batches ----------------------------------------------------------------
    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        """Params are immutable in MLflow: log the new ones, warn about changed ones."""
        from mlflow.entities import Param

        have = self.client.get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in have and have[k] != v)
        if changed:
            log.warning("MLflow: params changed since first logged, keeping the first: %s", ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in have]
        for start in range(0, len(new), 100):
            self.client.log_batch(run_id, params=new[start : start + 100])

    def _log_metrics(self, run_id: str, series: dict[str, list[tuple[int, float]]], at: float | None = None) -> None:
        from mlflow.entities import Metric

        now = _ms(at or time.time())
        metrics = [
            Metric(name, float(value), now, step)
            for name, points in series.items()
            for step, value in points
            if _numeric(value)
        ]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start : start + 1000])

    def _run_yaml(self) -> str:
        """run.yaml as committed (or the live config before init), credentials redacted; a run.yaml
        that is a symbolic link is refused (layout.read_run_yaml), its target never logged or bundled."""
        if self.root.exists(layout.RUN_CONFIG):
            data = parse_yaml(layout.read_run_yaml(self.root), self.root.path(layout.RUN_CONFIG)) or {}
        else:
            data = self.config.to_dict()
        return yaml.safe_dump(redact_data(data), sort_keys=False)

    # ---- the registry ----------------------------------------------------------------------
    def _versions(self, name: str, tags: dict[str, str]) -> list:
        query = f"name = '{name}'" + "".join(f" and tags.`{k}` = '{v}'" for k, v in tags.items())
        return sorted(self.client.search_model_versions(query), key=lambda v: int(v.version))

    def _register_new(
        self, name: str, round_index: int, result: dict, registry, path_rounds: dict[str, int] | None = None
    ) -> str:
        """Round round_index's modules as a new version or, with `path_rounds`, the early-stopped
        model (each path from its own round) as of round round_index."""
        parent, round_run = self._parent(), self._round(round_index)
        early = "-early-stopped" if path_rounds else ""
        key = f"round={round_index}/register{early}"
        what = (
            f"The early-stopped model as of round {round_index} (each path from its best round)"
            if path_rounds
            else f"The modules round {round_index} starts from"
        )
        run = self._leaf(
            "register",
            key,
            f"round {round_index} · register{early.replace('-', ' ')}",
            round_run,
            {"dipaco.round": str(round_index)},
            description=f"{what}, registered as a version of {name}.",
        )
        if run is None:  # logged once, registration lost: find the run again
            run = self._find(key, round_run).info.run_id
        if path_rounds:  # the chosen round per path, as params of the registering run
            self._log_params(run, {f"early_stopping.round.{metric_name(p)}": str(r) for p, r in path_rounds.items()})
            self._log_metrics(
                run,
                {
                    f"early_stopped_{k}": [(round_index, float(result[k]))]
                    for k in ("perplexity", "bits_per_byte")
                    if _numeric(result.get(k))
                },
            )
        mlflow = self._mlflow
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_registry_uri(self.uri)
        with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=run):
            info = registry.log_pyfunc(
                self.root, self.config, round_index, Path(tmp), self._run_yaml(), name, path_rounds
            )
        version = str(info.registered_model_version)
        tags = {
            RUN_KEY: self.key,
            "dipaco.round": str(round_index),
            "dipaco.run_root": redact(self.config.run_root),
            "dipaco.parent_run_id": parent,
            "perplexity": repr(float(result.get("perplexity", math.nan))),
            "eval_tokens": str(result.get("tokens", "")),
            **({EARLY_STOPPED: "true", PATH_ROUNDS: rounds_tag(path_rounds)} if path_rounds else {}),
        }
        for key, value in tags.items():
            self.client.set_model_version_tag(name, version, key, value)
        description = (
            self._early_stopped_description(round_index, result, path_rounds)
            if path_rounds
            else self._version_description(round_index, result)
        )
        self.client.update_model_version(name, version, description=description)
        self.client.update_registered_model(name, description=self._model_description())
        self._end(run)
        return version

    def _model_description(self) -> str:
        """What every version of the registered model is: grid, tokenizer, routing, how to call it."""
        m, r, t = self.config.model, self.config.router, self.config.train
        return (
            f"DiPaCo: a {m.grid} grid of modules ({self.config.n_paths} paths of "
            f"{sum(m.blocks_per_level) + m.path_specific_blocks} "
            f"Llama blocks, hidden size {m.hidden_size}, seq_len {m.seq_len}), tokenizer {m.tokenizer} "
            f"(vocabulary {m.vocab_size}). Each input text is routed by its first {r.prefix_tokens} tokens "
            f"({r.embedder} router) to one path, whose model generates the continuation. Trained for "
            f"train.rounds={t.rounds} outer rounds of {t.inner_steps} inner steps in "
            f"{redact(self.config.run_root)}; each version holds the modules of one round. Aliases: "
            f"{CHAMPION} (lowest routed perplexity), {NEWEST}. predict([text, ...], "
            f"params={{'max_new_tokens': 32, 'temperature': 0.8, 'top_k': 40, 'seed': 0}}) -> [continuation, ...] "
            f"(temperature 0: greedy)."
            + (
                f" eval.early_stopping: versions tagged {EARLY_STOPPED}=true hold the early-stopped model (each "
                f"path from the round that gave its validation shard the lowest perplexity); {CHAMPION} is one "
                f"of them."
                if self.config.eval.early_stopping
                else ""
            )
        )

    def _version_description(self, round_index: int, result: dict) -> str:
        """One version: which round's modules, after how much training, and how good."""
        m, t = self.config.model, self.config.train
        perplexity = result.get("perplexity")
        score = (
            f"routed perplexity {perplexity:.2f} on {int(result.get('tokens') or 0):,} held-out tokens"
            if _numeric(perplexity)
            else "not evaluated"
        )
        return (
            f"The modules round {round_index} starts from: after {round_index} of train.rounds={t.rounds} "
            f"outer rounds ({round_index * t.inner_steps} inner steps per path); {score}. Grid {m.grid}, "
            f"tokenizer {m.tokenizer}, run root {redact(self.config.run_root)}."
        )

    def _early_stopped_description(self, round_index: int, best: dict, path_rounds: dict[str, int]) -> str:
        """The early-stopped version: which round each path comes from, and how good it is."""
        m = self.config.model
        rounds = ", ".join(f"{p}: round {r}" for p, r in path_rounds.items())
        return (
            f"The early-stopped model as of round {round_index}: each path assembled from the modules of the "
            f"round (0..{round_index}) that gave its own validation shard the lowest perplexity ({rounds}); "
            f"routed perplexity {best['perplexity']:.2f} on {int(best.get('tokens') or 0):,} held-out tokens. "
            f"Grid {m.grid}, tokenizer {m.tokenizer}, run root {redact(self.config.run_root)}."
        )

    def _set_champion(self, name: str) -> None:
        """champion: the version with the lowest routed perplexity among all evaluated ones; with
        eval.early_stopping, among the early-stopped ones once there is one (the newest on a tie:
        it chose from the most rounds)."""
        early = self._versions(name, {EARLY_STOPPED: "true"}) if self.config.eval.early_stopping else []
        scored = []
        for version in early or self._versions(name, {}):
            value = float(version.tags.get("perplexity", "nan"))
            if math.isfinite(value):
                scored.append((value, -int(version.version) if early else int(version.version)))
        if scored:
            self.client.set_registered_model_alias(name, CHAMPION, str(abs(min(scored)[1])))

    # ---- what finish() plots ---------------------------------------------------------------
    def _runs_of_kind(self, kind: str) -> list:
        query = f"tags.`{RUN_KEY}` = '{self.key}' and tags.`{KIND}` = '{kind}'"
        return self.client.search_runs([self._experiment()], query, max_results=10000)

    def _path_series(self, metric: str) -> dict[str, dict[int, list[float]]]:
        out: dict[str, dict[int, list[float]]] = {}
        for run in self._runs_of_kind("path"):
            history = sorted(self.client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
            pid, rnd = run.data.tags["dipaco.path"], int(run.data.tags["dipaco.round"])
            out.setdefault(pid, {})[rnd] = [m.value for m in history]
        return out

    def _docs_per_path(self) -> dict[str, int]:
        """Shard sizes as each path's trainer saw them (the latest round it logged)."""
        latest: dict[str, tuple[int, int]] = {}
        for run in self._runs_of_kind("path"):
            docs = run.data.metrics.get("shard_docs")
            pid, rnd = run.data.tags["dipaco.path"], int(run.data.tags["dipaco.round"])
            if docs is not None and rnd >= latest.get(pid, (-1, 0))[0]:
                latest[pid] = (rnd, int(docs))
        return {pid: docs for pid, (_, docs) in latest.items()}

    def _history(self, run_id: str, metric: str) -> dict[int, float]:
        return {
            m.step: m.value for m in sorted(self.client.get_metric_history(run_id, metric), key=lambda m: m.timestamp)
        }

    def _perplexities(
        self, parent: str, metric: str = "perplexity"
    ) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
        names = self.client.get_run(parent).data.metrics
        per_path = {k.split("/", 1)[1]: self._history(parent, k) for k in names if k.startswith(f"{metric}/")}
        return self._history(parent, metric), per_path

    def _grad_norms(self) -> dict[str, dict[int, float]]:
        """{module: {round: outer-gradient norm}}, from the merge runs."""
        norms: dict[str, dict[int, float]] = {}
        for run in self._runs_of_kind("merge"):
            rnd = int(run.data.tags["dipaco.round"])
            for name, value in run.data.metrics.items():
                if name.startswith("outer_grad_norm/"):
                    norms.setdefault(name.split("/", 1)[1], {})[rnd] = value
        return norms


def rounds_tag(path_rounds: dict[str, int]) -> str:
    """A short, searchable name for one choice of rounds per path (a tag value has a length limit)."""
    return hashlib.sha256(json.dumps(path_rounds, sort_keys=True).encode()).hexdigest()[:16]


def _param(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:6000]  # MLflow's limit on a param value


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))
