"""`dipaco sweep --config SWEEP.yaml [--quick] [--predict key=value ...] [--verify]`: a grid of sizes x
replicas x hyper-parameters trained as normal runs, the scaling laws fitted to them, and a larger run
predicted before it is trained (pipeline/scaling: the file, the fits, the plots, the MLflow runs).

    <sweep_root>/
      sweep.json                  the sweep as resolved: its settings and every point (id, values, config keys)
      prepared/<key>/             one prepare per data, router and tokenizer config (a run root: tokenizer/,
                                  router/, shards/), copied into each point's run root before it trains
      runs/<point id>/            each point's run root: a normal `dipaco run` (stages.run)
      points/<point id>/          result.json (final bits per byte, perplexity, curve, timings), _SUCCESS:
                                  a committed point is never trained again
      holdout/<point id>/         --verify: the predicted point, trained, committed alike
      queue/leases/point.r0.<id>/ each point's attempts: who trains it, how it ended (pipeline.scaling.point_queue)
      points.csv, fit.json, plots/*.png, mlflow.db, mlartifacts/, tracking.json, .lock

Points are leased tasks (pipeline.scaling.point_queue): `lanes` lanes (threads, each calling
stages.run, whose islands do the training) claim them longest first, with the islands' leases, so
whoever else trains points of this sweep (the DAG's mapped tasks, another host) never trains one
twice, a holder that died is replaced once its lease expires, and a paused holder whose lease
expired cannot commit over its successor. A crash or Ctrl-C loses at most the points in flight,
which resume from their last committed round when the sweep runs again. The points are whole runs,
each on its own islands, not tasks of one set of islands: a point's rounds are tasks there. The
Airflow DAG dipaco_sweep calls the same functions (plan, start, prepare_data, train_point, finish).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline import preflight
from pipeline.core.bounds import one_line
from pipeline.core.config import Config
from pipeline.core.errors import ConfigError, InputError, RunLockedError
from pipeline.islands.task_queue import Lease
from pipeline.run import Run
from pipeline.scaling import laws, point_queue, spec
from pipeline.scaling.point_queue import PointQueue
from pipeline.scaling.spec import Point, Sweep
from pipeline.state import layout
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.sweep")
SWEEP_FILE, FIT_FILE, TABLE_FILE, PLOTS_DIR = "sweep.json", "fit.json", "points.csv", "plots"
POINTS_DIR, HOLDOUT_DIR, PREPARED_DIR, RESULT = "points", "holdout", "prepared", "result.json"
SHARED_DIRS = (layout.TOKENIZER_DIR, layout.ROUTER_DIR, layout.SHARDS_DIR)


# -- the plan -------------------------------------------------------------------------------------
def plan(
    path: str | Path, quick: bool = False, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[Sweep, list[Point]]:
    """The sweep file read, every point built and validated, its data and sweep root checked: all
    before torch loads, so a mistake costs a fraction of a second and writes nothing."""
    sweep = spec.load_sweep(path, quick, overrides)
    points = spec.expand(sweep)
    for config in {prep_key(p.config): p.config for p in points}.values():
        preflight.check_data(config)
    preflight.check_run_root(dataclasses.replace(points[0].config, run_root=sweep.sweep_root))
    return sweep, points


def prep_key(config: Config) -> str:
    """What a prepare's output depends on: the data, the router and the tokenizer (the whole model
    when the router embeds with a path model). Points with the same key share one prepare."""
    model = config.to_dict()["model"]
    if config.router.embedder != "model":
        model = {k: model[k] for k in ("grid", "tokenizer", "vocab_size", "tokenizer_sample_docs")}
    text = json.dumps(
        {"data": config.to_dict()["data"], "router": config.to_dict()["router"], "model": model}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def prepared_root(sweep: Sweep, config: Config) -> str:
    return f"{sweep.sweep_root.rstrip('/')}/{PREPARED_DIR}/{prep_key(config)}"


def prepare_data(sweep: Sweep, points: list[Point]) -> dict[str, str]:
    """One prepare (stages.prepare, the Beam job) per key; committed ones are kept. Key -> its root."""
    from pipeline import stages

    roots = {}
    for point in points:
        key = prep_key(point.config)
        if key in roots:
            continue
        config = dataclasses.replace(point.config, run_root=prepared_root(sweep, point.config))
        roots[key] = config.run_root
        if RunRoot(config.run_root).is_committed(layout.SHARDS_DIR):
            continue
        log.info("sweep: preparing the data of %s and the points like it in %s", point.id, config.run_root)
        run = Run(config)
        stages.init_run(run)
        stages.prepare(run)
    return roots


def copy_committed(root: RunRoot, source_root: str, dirs: tuple[str, ...]) -> None:
    """Committed directories of another local run root into this one (tokenizer, router, shards),
    each copied under a temporary name and renamed into place, so a crash never leaves a copy
    whose _SUCCESS came over before its files. Ones the source has not committed are skipped.
    Files are hard-linked where the file system allows (a committed file is never written in place:
    every write is a new file renamed over the old name), so 56 points cost one copy of the data."""
    source = RunRoot(source_root)
    for rel in dirs:
        if root.is_committed(rel) or not source.is_committed(rel):
            continue
        root.remove(rel)
        target = root.local_path(rel)
        tmp = target.with_name(f"{target.name}.copy-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source.local_path(rel), tmp, copy_function=_link_or_copy)
        os.replace(tmp, target)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another device, or a file system without hard links
        shutil.copy2(source, target)


# -- one point ------------------------------------------------------------------------------------
def run_point(sweep: Sweep, point: Point, kind: str = POINTS_DIR, lease: Lease | None = None) -> dict | None:
    """A point's run (stages.run on its own run root, from the shared data) and its committed
    result; a committed point returns its result without training. Under a `lease`, the lease is
    re-checked right before committing: None when it was lost (another attempt owns the point)."""
    from pipeline import stages

    root, rel = RunRoot(sweep.sweep_root), f"{kind}/{point.id}"
    if root.is_committed(rel):
        return root.read_committed_json(rel, RESULT)
    prepared = prepared_root(sweep, point.config)
    if not RunRoot(prepared).is_committed(layout.SHARDS_DIR):
        prepare_data(sweep, [point])
    run = Run(point.config)
    run_root = stages.init_run(run)
    copy_committed(run_root, prepared, SHARED_DIRS)
    log.info(
        "sweep: point %s (N=%s, %d steps of %d tokens per worker)",
        point.id,
        f"{point.N:,}",
        point.steps,
        spec.tokens_per_step(point.config) // max(1, point.config.train.workers_per_path),
    )
    started = time.time()
    summary = stages.run(run)
    result = point_result(point, summary, started, time.time())
    if lease is not None and not lease.held():
        log.warning("sweep: point %s: lost its lease while training; its successor commits it", point.id)
        return None
    if root.is_committed(rel):  # an attempt whose lease expired under it committed first: same run
        return root.read_committed_json(rel, RESULT)
    root.write_json(f"{rel}/{RESULT}", result)
    root.commit(
        rel, info={"bits_per_byte": result["bits_per_byte"], "perplexity": result["perplexity"]}, files=[RESULT]
    )
    log.info("sweep: point %s: %.4f bits/byte in %.0f s", point.id, result["bits_per_byte"], result["seconds"])
    return result


def point_result(point: Point, summary: dict, started: float, finished: float) -> dict:
    evals = summary["eval"]
    last = evals[max(evals)]
    curve = [
        {
            "round": r,
            "steps": r * point.config.train.inner_steps,
            "bits_per_byte": e["bits_per_byte"],
            "perplexity": e["perplexity"],
        }
        for r, e in sorted(evals.items())
    ]
    use = summary.get("utilisation") or {}
    return {
        **point.summary(),
        "hyper": point.hyper(),
        "run_root": point.config.run_root,
        "bits_per_byte": last["bits_per_byte"],
        "perplexity": last["perplexity"],
        "curve": curve,
        "started_at": started,
        "finished_at": finished,
        "seconds": finished - started,
        "utilisation": use.get("utilisation"),
    }


def committed_results(sweep: Sweep, points: list[Point]) -> list[dict]:
    root = RunRoot(sweep.sweep_root)
    return [
        root.read_committed_json(f"{POINTS_DIR}/{p.id}", RESULT)
        for p in points
        if root.is_committed(f"{POINTS_DIR}/{p.id}")
    ]


def point_queue_of(sweep: Sweep, points: list[Point]) -> PointQueue:
    """The sweep's point leases, timed by its first point's train.lease_seconds and max_attempts."""
    return PointQueue(sweep.sweep_root, points[0].config, POINTS_DIR)


def run_leased(sweep: Sweep, point: Point, lease: Lease) -> dict | None:
    """A claimed point trained and committed, its lease ended with how it went: None when another
    holder still runs it (its lease expired while it was paused) or took it over."""
    try:
        result = run_point(sweep, point, lease=lease)
    except RunLockedError as exc:  # the earlier holder, paused past its lease, runs it still
        lease.finish("released", reason=one_line(str(exc), 300))
        log.warning("sweep: point %s: %s; waiting for it", point.id, one_line(str(exc), 300))
        time.sleep(lease.queue.lease_seconds)
        return None
    except Exception as exc:
        lease.finish("failed", error=one_line(f"{type(exc).__name__}: {exc}", 300))
        raise
    except BaseException:  # Ctrl-C: no failure, the next holder takes it at once
        lease.finish("released", reason="interrupted")
        raise
    if result is None:
        lease.finish("released", reason="lease lost before commit")
        return None
    lease.finish("done", seconds=round(result["seconds"], 3))
    return result


def train_point(sweep: Sweep, points: list[Point], point_id: str, island: str = "airflow") -> dict | None:
    """One point under its lease (the DAG's mapped task): trained here, or the result another
    holder committed while this one waited; None when it was given up (sweep.given_up says why)."""
    queue, point = point_queue_of(sweep, points), next(p for p in points if p.id == point_id)
    island_id = point_queue.new_island_id(island)
    while True:
        lease = point_queue.wait_for(queue, point.id, island, island_id)
        if lease is None:
            root = RunRoot(sweep.sweep_root)
            rel = f"{POINTS_DIR}/{point.id}"
            return root.read_committed_json(rel, RESULT) if root.is_committed(rel) else None
        result = run_leased(sweep, point, lease)
        if result is not None:
            return result


def train_points(sweep: Sweep, points: list[Point], tracker) -> dict:
    """Every point not committed yet, claimed under leases by `lanes` lanes; each logged as it commits."""
    root = RunRoot(sweep.sweep_root)
    queue = point_queue_of(sweep, points)
    ids = [p.id for p in points]
    todo = [p for p in points if not root.is_committed(f"{POINTS_DIR}/{p.id}")]
    lanes = _lanes(sweep, todo)
    log.info(
        "sweep: %d point(s), %d committed before, %d to train%s",
        len(points),
        len(points) - len(todo),
        len(todo),
        f", {lanes} at a time" if todo else "",
    )
    if todo:
        prepare_data(sweep, todo)
    by_id = {p.id: p for p in todo}
    order = [p.id for p in sorted(todo, key=lambda p: -p.steps * p.N)]  # the longest first
    logged, stop = threading.Lock(), threading.Event()
    started = time.time()

    def lane(index: int) -> int:
        try:
            return claim_and_train(index)
        except BaseException:
            stop.set()  # a point failed, or Ctrl-C: no lane claims another; those in flight end
            raise

    def claim_and_train(index: int) -> int:
        name, island_id = point_queue.island_name(index)
        trained = 0
        while not stop.is_set():
            lease, waiting = queue.next_point(order, name, island_id)
            if lease is None:
                if not waiting:
                    return trained
                time.sleep(queue.poll_seconds())  # a holder elsewhere: it commits, or its lease expires
                continue
            point = by_id[lease.task.target]
            result = run_leased(sweep, point, lease)
            if result is not None:
                trained += 1
                with logged:
                    tracker.log_point(point.summary(), result)
        return trained

    if lanes == 1:
        trained = lane(0)
    else:
        import torch

        torch.set_num_threads(1)  # this process's own evaluations beside the points' islands
        with ThreadPoolExecutor(max_workers=lanes) as pool:
            futures = [pool.submit(lane, i) for i in range(lanes)]
            try:
                trained = sum(f.result() for f in futures)
            except BaseException:  # Ctrl-C reaches this thread only: the lanes stop claiming
                stop.set()
                raise
    given_up = queue.given_up_points(ids)
    for entry in given_up:
        log.warning(
            "sweep: point %s given up after %d attempts (%s); to try it again: %s",
            entry["point"],
            entry["attempts"],
            entry["error"],
            entry["retry"],
        )
    return {
        "points": len(points),
        "trained": trained,
        "reused": len(points) - len(todo),
        "given_up": given_up,
        "lanes": point_queue.lane_utilisation(queue, ids, lanes, started, time.time() - started) if todo else None,
    }


def _lanes(sweep: Sweep, todo: list[Point]) -> int:
    """One process holds one in-process island at a time (train.launcher: inprocess)."""
    if any(p.config.train.launcher == "inprocess" for p in todo):
        return 1
    return max(1, min(sweep.lanes, len(todo)))


# -- the fit --------------------------------------------------------------------------------------
def fit_sweep(sweep: Sweep, points: list[Point]) -> dict:
    """The laws of every committed point: fit.json, points.csv and the plots in the sweep root."""
    from pipeline.scaling import plots
    from pipeline.tracking.plots import close

    root = RunRoot(sweep.sweep_root)
    results = committed_results(sweep, points)
    fit = {
        "sweep": {
            "file": sweep.source,
            "quick": sweep.quick,
            "sweep_root": sweep.sweep_root,
            "points": len(points),
            "committed": len(results),
            "budget": sweep.budget,
        },
        **laws.analyse(results, sweep.fit.bootstrap, sweep.fit.seed, sweep.fit.tolerance),
    }
    for name, build in plots.FIGURES.items():
        figure = build(fit)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=110)
        close(figure)
        root.write_bytes(f"{PLOTS_DIR}/{name}", buffer.getvalue())
    fit["plots"] = [f"{PLOTS_DIR}/{name}" for name in plots.FIGURES]
    root.write_text(TABLE_FILE, _csv([table_row(r) for r in results]))
    write_fit(sweep, fit)
    return fit


def log_fit(sweep: Sweep, points: list[Point], fit: dict, tracker) -> None:
    """Every committed point (logged once), fit.json, the plots and the points table on the sweep's
    MLflow run, which ends here."""
    from pipeline.scaling.tracking import table

    root = RunRoot(sweep.sweep_root)
    results = committed_results(sweep, points)
    for result in results:
        tracker.log_point(result, result)
    files = [root.local_path(rel) for rel in (*fit["plots"], FIT_FILE, TABLE_FILE)] if root.is_local else []
    tracker.log_fit(fit, files, table([table_row(r) for r in results]))
    tracker.finish_sweep()


def write_fit(sweep: Sweep, fit: dict) -> None:
    RunRoot(sweep.sweep_root).write_json(FIT_FILE, _finite(fit))


def table_row(result: dict) -> dict:
    return {
        "point": result["id"],
        "algorithm": result["algorithm"],
        "M": result["M"],
        "N": result["N"],
        **{k: v for k, v in result["values"].items() if k != "algorithm"},
        "steps": result["steps"],
        "tokens": result["tokens"],
        "rounds": result["rounds"],
        "H": result["inner_steps"],
        "bits_per_byte": result["bits_per_byte"],
        "perplexity": result["perplexity"],
        "seconds": round(result["seconds"], 1),
    }


def _csv(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, columns)
    writer.writeheader()
    writer.writerows([{k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()} for row in rows])
    return out.getvalue()


def _finite(obj):
    """NaN and infinities as null: fit.json stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# -- prediction -----------------------------------------------------------------------------------
def predict(sweep: Sweep, fit: dict, assignments: dict) -> dict:
    """The loss (with its interval) and the best hyper-parameters of each fitted group at the size
    the assignments give (model keys; `algorithm` and train.workers_per_path narrow the groups)."""
    config = prediction_config(sweep, assignments)
    n = spec.non_embedding_params(config)
    groups = {}
    for name, group in fit["groups"].items():
        if (
            assignments.get("algorithm", group["algorithm"]) != group["algorithm"]
            or assignments.get("train.workers_per_path", group["M"]) != group["M"]
        ):
            continue
        law = group["law"]
        entry = {
            "algorithm": group["algorithm"],
            "M": group["M"],
            "bits_per_byte": laws.predict_with_interval(law, n) if law.get("fitted") else None,
            "why": None if law.get("fitted") else law.get("why"),
            "hyper": {},
        }
        best = best_point(group)
        for key, optimum in group["optima"].items():
            if key in assignments:
                continue
            value = laws.predict_optimum(optimum["trend"], n, optimum["integer"])
            fitted = value is not None
            if fitted:
                how = "power law" if optimum["trend"].get("trend") else "no trend: geometric mean of the optima"
            else:
                value = best["hyper"].get(key) if best else None
                how = f"no law: the value of the group's best point ({best['point'] if best else 'none'})"
            entry["hyper"][key] = {"value": value, "how": how, "fitted": fitted}
        groups[name] = entry
    if not groups:
        raise ConfigError(f"--predict: no group of the sweep matches {json.dumps(assignments)}")
    inside = (
        min(s["N"] for g in fit["groups"].values() for s in g["sizes"])
        <= n
        <= max(s["N"] for g in fit["groups"].values() for s in g["sizes"])
    )
    return {"values": assignments, "N": n, "inside_sweep": inside, "groups": groups}


def prediction_config(sweep: Sweep, assignments: dict) -> Config:
    """The config whose N a prediction is at: the asked keys over the sweep's `set` and the axes
    that have one value (every point of the sweep has it, so the law's N counts it)."""
    only = {k: v[0] for k, v in sweep.axes.items() if len(v) == 1 and k != "algorithm"}
    asked = {k: v for k, v in assignments.items() if k != "algorithm"}
    return spec.build_config(sweep, {**sweep.settings, **only, **asked}, "--predict")


def best_point(group: dict) -> dict | None:
    """A fitted group's best committed point (its lowest loss over every size): its id, hyper and values."""
    return min(group["sizes"], key=lambda s: s["bits_per_byte"]) if group["sizes"] else None


def holdout_point(sweep: Sweep, fit: dict, prediction: dict) -> tuple[Point, str, dict[str, str]]:
    """The point --verify trains, its group, and where each of its values came from. The asked
    values; the group's algorithm and M (the group asked for, else DiLoCo at its largest M); every
    other axis from the predicted optimum where the group's fit has one (grid axes such as H snapped
    to the nearest grid value), else the axis's only value, else the value of the group's best
    committed point. An axis left out would take the base config's value: the quick sweep's one H
    (16, no optimum to fit) became configs/demo.yaml's 200, a point of no law the sweep fitted.
    Its budget is the swept points' (spec.make_point): whole rounds of its own H."""
    fitted = {n: g for n, g in prediction["groups"].items() if g["bits_per_byte"]}
    if not fitted:
        raise InputError(
            f"{sweep.source}: --verify: no law was fitted for {', '.join(prediction['groups'])} "
            f"({'; '.join(str(g['why']) for g in prediction['groups'].values())})"
        )
    name = max(fitted, key=lambda n: (fitted[n]["algorithm"] == "diloco", fitted[n]["M"]))
    group, best = fitted[name], best_point(fit["groups"][name])
    best_values = (best.get("values") or best["hyper"]) if best else {}
    values = dict(prediction["values"])
    sources = dict.fromkeys(values, "asked")
    if "algorithm" in sweep.axes and "algorithm" not in values:
        values["algorithm"], sources["algorithm"] = group["algorithm"], "group"
    if ("train.workers_per_path" in sweep.axes or group["M"] != 1) and "train.workers_per_path" not in values:
        values["train.workers_per_path"], sources["train.workers_per_path"] = group["M"], "group"
    for key, grid in sweep.axes.items():
        if key in values:
            continue
        entry = group["hyper"].get(key)
        if entry and entry.get("fitted") and entry["value"] is not None:
            values[key], sources[key] = _snap(entry["value"], grid), "predicted optimum"
        elif len(grid) == 1:
            values[key], sources[key] = grid[0], "only value"
        elif key in best_values:
            values[key], sources[key] = best_values[key], f"best point {best['point']}"
    values = {k: values[k] for k in [*sweep.axes, *values] if k in values}  # the axes' order, as point ids are
    point = spec.make_point(sweep, values, prefix="holdout_")
    return point, name, {k: sources[k] for k in point.values if k in sources}


def _snap(value, grid: list):
    """An integer axis (H) takes its nearest grid value, so the budget's steps stay whole rounds; a
    float axis (a learning rate) the predicted value, to 3 significant digits."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in grid):
        return min(grid, key=lambda v: abs(math.log(v / value)) if v > 0 and value > 0 else abs(v - value))
    if isinstance(value, float):
        return float(f"{value:.3g}")
    return value


def verify(sweep: Sweep, fit: dict, prediction: dict, tracker) -> dict:
    """Train the predicted point and compare: fit.json["holdout"] = predicted, measured, error, and
    the point's settings (H, M, outer lr, rounds, steps, tokens), to check against the law's points."""
    point, name, sources = holdout_point(sweep, fit, prediction)
    predicted = prediction["groups"][name]["bits_per_byte"]
    if point.N != prediction["N"]:  # a model axis not asked took its best point's value: the law at its N
        predicted = laws.predict_with_interval(fit["groups"][name]["law"], point.N)
    result = run_point(sweep, point, HOLDOUT_DIR)
    tracker.log_point(point.summary(), result, kind="sweep_holdout")
    error = result["bits_per_byte"] - predicted["value"]
    low, high = predicted["interval"]
    return {
        "predicted": predicted["value"],
        "measured": result["bits_per_byte"],
        "error": error,
        "relative_error": error / predicted["value"],
        "interval": [low, high],
        "within_interval": low is not None and low <= result["bits_per_byte"] <= high,
        "group": name,
        "point": point.id,
        "N": point.N,
        "algorithm": point.algorithm,
        "H": point.config.train.inner_steps,
        "M": point.M,
        "outer_lr": point.config.outer.lr,
        "rounds": point.config.train.rounds,
        "steps": point.steps,
        "tokens": point.tokens,
        "values": point.values,
        "sources": sources,
    }


# -- the command ----------------------------------------------------------------------------------
def command(
    path: str | Path,
    quick: bool = False,
    predict_items: list[str] | tuple[str, ...] = (),
    verify_point: bool = False,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict:
    """`dipaco sweep`: train what is not committed, fit, predict, verify; one sweep per sweep root."""
    from pipeline.state.lock import run_lock

    if verify_point and not predict_items:
        raise ConfigError("--verify trains the point --predict names: give --predict key=value too")
    sweep, points = plan(path, quick, overrides)
    assignments = spec.assignments(list(predict_items), sweep)
    if assignments:  # a wrong value is refused before anything trains
        prediction_config(sweep, assignments)
    if verify_point:  # so is a holdout under one round of its H: every point it can be, built now
        spec.expand(sweep, assignments, prefix="holdout_")
    started = time.time()
    with run_lock(RunRoot(sweep.sweep_root)):
        tracker = start(sweep, points)
        counts = train_points(sweep, points, tracker)
        return finish(sweep, points, tracker, assignments, verify_point, {**counts, "started_at": started})


def start(sweep: Sweep, points: list[Point]):
    """sweep.json written and the sweep's MLflow run (re)started; its tracker."""
    from pipeline.scaling.tracking import get_sweep_tracker

    RunRoot(sweep.sweep_root).write_json(
        SWEEP_FILE, {"sweep": sweep.to_dict(), "points": [p.summary() for p in points]}
    )
    tracker = get_sweep_tracker(sweep, points[0].config)
    tracker.start_sweep(sweep, points)
    return tracker


def finish(
    sweep: Sweep,
    points: list[Point],
    tracker=None,
    assignments: dict | None = None,
    verify_point: bool = False,
    counts: dict | None = None,
) -> dict:
    """Fit, predict and verify if asked, log it all (and every committed point, once) to MLflow;
    the report `dipaco sweep` prints (pipeline.scaling.report)."""
    if tracker is None:
        from pipeline.scaling.tracking import get_sweep_tracker

        tracker = get_sweep_tracker(sweep, points[0].config)
    fit = fit_sweep(sweep, points)
    if assignments:
        fit["prediction"] = predict(sweep, fit, assignments)
    if verify_point:
        fit["holdout"] = verify(sweep, fit, fit["prediction"], tracker)
    write_fit(sweep, fit)
    log_fit(sweep, points, fit, tracker)
    counts = counts or {}
    committed = fit["sweep"]["committed"]
    return {
        "sweep_root": sweep.sweep_root,
        "points": len(points),
        "trained": counts.get("trained"),
        "reused": counts.get("reused", committed - (counts.get("trained") or 0)),
        "seconds": time.time() - counts["started_at"] if "started_at" in counts else None,
        "given_up": counts.get("given_up") or [],
        "lanes": counts.get("lanes"),
        "fit": fit,
        "fit_file": RunRoot(sweep.sweep_root).path(FIT_FILE),
    }
