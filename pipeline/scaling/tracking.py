"""A sweep in MLflow: one parent run per sweep root (dipaco.kind = sweep), one nested run per point
(params: its axis values and every config key the sweep set; metrics: bits per byte and perplexity
by inner step, so the last is the final one), and on the parent the points table (a table artifact
and points.csv), the laws' numbers as metrics, fit.json and the plots.

It is the run tracker of pipeline.tracking with the sweep root as its run root, so the conventions
are that tracker's: runs found again by tags (a rerun logs no point twice), the real start and end
of each point's training, credentials redacted, tracking.json in the sweep root. The store defaults
to sqlite:///<sweep_root>/mlflow.db. Point runs themselves train with mlflow.enabled false: the
sweep is their record (a point's run root still holds every committed file of a normal run).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from pipeline.core.config import Config
from pipeline.tracking.tracker import MlflowTracker, _param, metric_name
from pipeline.tracking.uris import redact, redact_data

log = logging.getLogger(__name__)


class NullSweepTracker:
    """Tracking off (the sweep file's mlflow.enabled: false): the same methods, doing nothing."""

    def start_sweep(self, sweep, points: list) -> None:
        """The sweep's settings on the parent run, which runs until finish_sweep."""

    def log_point(self, summary: dict, result: dict, kind: str = "sweep_point") -> None:
        """One committed point, from its result."""

    def log_fit(self, fit: dict, files: list[Path], table: dict[str, list]) -> None:
        """The laws' numbers, fit.json, the plots and the points table, on the parent."""

    def finish_sweep(self) -> None:
        """The parent run finished."""


class MlflowSweepTracker(MlflowTracker):
    PARENT_KIND = "sweep"

    def __init__(self, sweep, base: Config):
        mlflow = dataclasses.replace(
            base.mlflow, enabled=True, tracking_uri=sweep.mlflow.tracking_uri, experiment=sweep.mlflow.experiment
        )
        super().__init__(dataclasses.replace(base, run_root=sweep.sweep_root, mlflow=mlflow))

    def start_sweep(self, sweep, points: list) -> None:
        parent = self._parent()
        self.client.update_run(parent, status="RUNNING")
        params = {
            "sweep.file": sweep.source,
            "sweep.base": sweep.base,
            "sweep.quick": str(sweep.quick),
            "sweep.points": str(len(points)),
            "sweep.lanes": str(sweep.lanes),
            **{f"sweep.budget.{k}": str(v) for k, v in sweep.budget.items()},
            **{f"sweep.axis.{k}": _param(v) for k, v in sweep.axes.items()},
            **{f"sweep.set.{k}": _param(v) for k, v in sweep.settings.items()},
        }
        self._log_params(parent, redact_data(params))
        self.client.log_dict(parent, redact_data(sweep.to_dict()), "sweep.json")
        log.info("MLflow: sweep run %s in experiment %s at %s", parent, self.config.mlflow.experiment, redact(self.uri))

    def log_point(self, summary: dict, result: dict, kind: str = "sweep_point") -> None:
        run = self._leaf(
            kind,
            f"point={summary['id']}",
            summary["id"],
            self._parent(),
            {"dipaco.point": summary["id"], "dipaco.algorithm": summary["algorithm"], "dipaco.M": str(summary["M"])},
            start=result.get("started_at"),
        )
        if run is None:
            return
        params = {
            **{f"axis.{k}": v for k, v in summary["values"].items()},
            **summary["settings"],
            **{k: summary[k] for k in ("algorithm", "M", "N", "steps", "tokens", "rounds", "inner_steps")},
        }
        self._log_params(run, {k: _param(v) for k, v in redact_data(params).items()})
        series: dict[str, list[tuple[int, float]]] = {"bits_per_byte": [], "perplexity": []}
        for row in result.get("curve", []):
            for name in series:
                series[name].append((row["steps"], row[name]))
        once = {"N": summary["N"], "tokens": summary["tokens"], "seconds": result.get("seconds")}
        self._log_metrics(run, {**series, **{k: [(0, v)] for k, v in once.items()}}, at=result.get("finished_at"))
        self._end(run, result.get("finished_at"))

    def log_fit(self, fit: dict, files: list[Path], table: dict[str, list]) -> None:
        parent = self._parent()
        metrics = {}
        for name, group in fit.get("groups", {}).items():
            law = group["law"]
            if law.get("fitted"):
                metrics.update({metric_name(f"{key}/{name}"): [(0, law[key])] for key in ("alpha", "E", "A", "rmse")})
        for name, finding in fit.get("findings", {}).items():
            verdicts = {"reproduced": 1.0, "unresolved": 0.0, "not reproduced": -1.0}
            metrics[metric_name(f"finding/{name}")] = [(0, verdicts[finding["verdict"]])]
        holdout = fit.get("holdout")
        if holdout:
            metrics.update({f"holdout_{k}": [(0, holdout[k])] for k in ("predicted", "measured", "error")})
        self._log_metrics(parent, metrics)
        self.client.log_table(parent, data=table, artifact_file="points_table.json")
        for file in files:
            self.client.log_artifact(parent, str(file), "plots" if file.suffix == ".png" else None)
        log.info(
            "MLflow: fit, %d file(s) and the table of %d point(s) logged to run %s",
            len(files),
            len(next(iter(table.values()), [])),
            parent,
        )

    def finish_sweep(self) -> None:
        self.client.set_terminated(self._parent(), "FINISHED")


def get_sweep_tracker(sweep, base: Config):
    return MlflowSweepTracker(sweep, base) if sweep.mlflow.enabled else NullSweepTracker()


def table(rows: list[dict]) -> dict[str, list]:
    """Rows of flat values as MLflow's table (column -> values), every row with every column."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return {c: [_cell(row.get(c)) for row in rows] for c in columns}


def _cell(value):
    return json.dumps(value) if isinstance(value, (list, dict)) else value
