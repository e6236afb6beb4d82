"""The pipeline's stages as plain functions: the CLI and the Airflow DAG call exactly these.

Each takes the Run (pipeline.run: the config, its run root and its tracker, built once per
process), reads committed state from the run root, does its work, commits its output and
reports to the tracker; each can be rerun and resumes where it stopped (a committed stage
returns its recorded result at once). The islands `run` trains on are supervised by
pipeline.islands.supervisor; the summary it ends with is read by pipeline.tracking.report.
"""

from __future__ import annotations

import logging
import time

from models.grid import all_job_ids
from pipeline import compile_warmup, init_from, preflight
from pipeline.core.config import Config, dump_yaml
from pipeline.core.errors import ConfigError, InputError
from pipeline.evaluation.early_stopping import best_up_to, write_best
from pipeline.island_rank import reshard  # the Beam app's re-sharding, handed to the layers below
from pipeline.islands import supervisor
from pipeline.islands.launch import island_names, read_metrics, train_path_job
from pipeline.islands.task_queue import TaskQueue, write_plan
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.lock import run_lock
from pipeline.state.retention import prune_round, rounds_to_prune, run_root_size
from pipeline.state.storage import RunRoot
from pipeline.tracking.report import read_eval, read_reroute, read_summary
from pipeline.tracking.utilisation import round_utilisation

log = logging.getLogger("dipaco")
# Sections that fix what the committed state means; a run root refuses a config that changes them.
_FIXED = ("model", "router")


def init_run(run: Run) -> RunRoot:
    """Write run.yaml and the round-0 modules, unless the run root already holds them (with
    model.init_from: the checkpoint's shape in run.yaml, its weights and tokenizer: pipeline.init_from).
    A resumed run root from before kept.json has its paths' inner-state records adopted
    (train_path.adopt_legacy_inner_states)."""
    from pipeline.state.module_store import init_modules  # torch: the stages that need it load it

    resumed = check_same_run(run)
    model = run.config.model
    if model.init_from and model.init_config is None:
        init_from.check(run.config)  # refuses before run.yaml is written
        init_from.apply(model, init_from.resolve(run.config).config)
    run.root.write_text(layout.RUN_CONFIG, dump_yaml(run.config))
    if model.init_from:
        init_from.init_modules(run.config, run.root)
    elif init_modules(run.root, run.config.model, run.config.model.grid):
        log.info("initialised round 0: %d modules for %d paths", sum(run.config.model.grid), run.config.n_paths)
    if resumed:
        from pipeline.train.train_path import adopt_legacy_inner_states

        adopt_legacy_inner_states(run.root)
    return run.root


def check_same_run(run: Run) -> bool:
    """A config may change how a run trains, never what it trains: `model` and `router` must be
    those of the run root's run.yaml, if it has one. Whether it has one (a resumed run)."""
    if run.root.exists(layout.RUN_CONFIG):
        previous = layout.read_run_config(run.root, uses_code=False)  # model and router only
        for section in _FIXED:
            if getattr(previous, section) != getattr(run.config, section):
                raise ConfigError(
                    f"{run.config.source}: {section} differs from the run in {run.root.path()} "
                    f"(its run.yaml); use a new run_root to change it"
                )
        return True
    return False


def prepare(run: Run) -> dict:
    """The Beam job: router and shards (skipped when shards/ is committed)."""
    from preprocessing.prepare import run_prepare

    manifest = run_prepare(run.config)
    run.tracker.log_prepare(manifest)
    return manifest


def list_paths(config: Config) -> list[str]:
    """The training jobs of a round: path ids (`p0-1`), with `.w<k>` when a path has several
    DiLoCo workers. The DAG maps its path tasks over this list."""
    return all_job_ids(config.model.grid, config.train.workers_per_path)


def train_path(run: Run, round_index: int, path_id: str) -> dict | None:
    """One path's DeepSpeed job with retries; its metrics, or None when every attempt failed."""
    metrics = train_path_job(run.config, round_index, path_id)
    if metrics is not None:
        run.tracker.log_path(round_index, path_id, metrics)
    return metrics


def merge(run: Run, round_index: int) -> dict:
    """The outer step of round r: round r+1's modules and momentum (pipeline.outer.merge)."""
    from pipeline.outer.merge import merge_round

    report = merge_round(run.config, round_index)
    run.tracker.log_merge(round_index, report)
    return report


def evaluate(run: Run, round_index: int) -> dict:
    """Routed perplexity of the modules at the start of a round (round r+1 after merge r)."""
    from pipeline.evaluation.evaluate import evaluate_round

    started = time.time()
    result = evaluate_round(run.config, round_index)
    run.tracker.log_eval(round_index, result, started_at=started)
    return result


def evaluate_initial(run: Run) -> dict | None:
    """Round 0's modules, before any training: the first row of the summary, evaluated once
    (None when training has begun, or round 0 is evaluated already)."""
    if layout.next_round(run.root) > 0 or run.root.exists(layout.eval_file(0)):
        return None
    return evaluate(run, 0)


def rounds_to_train(run: Run, rounds: int | None = None) -> range:
    """The rounds a run trains: from the first uncommitted one up to `train.rounds`, at most `rounds`
    of them (a scheduled DAG run's `airflow.rounds_per_run`); empty once every round is committed."""
    first, planned = layout.next_round(run.root), run.config.train.rounds
    last = planned if rounds is None else min(planned, first + rounds)
    return range(first, max(first, last))


def nothing_to_train(run: Run) -> str:
    """Why a run trained nothing: the message a DAG run and `dipaco run` give."""
    return (
        f"nothing to train: all train.rounds={run.config.train.rounds} rounds are committed in "
        f"{run.root.path()}; raise train.rounds to continue"
    )


def export(run: Run, round_index: int, out: str) -> dict:
    """`dipaco export`: round r's paths as Hugging Face checkpoints, the router and a model card
    under `out` (pipeline.export), attached to round r's registered version when there is one.
    A finished export is returned as it is; one cut short is rebuilt."""
    from pipeline.export import export_round

    info = export_round(run.config, run.root, round_index, out)
    attached = run.tracker.attach_export(round_index, str(out))
    return {**info, "out": str(out), **({"attached_to": attached} if attached else {})}


def export_final(run: Run) -> dict | str:
    """The DAG's export after the last round: the modules the final merge wrote, under the run
    root's `exports/round=<train.rounds>/` (stages.export); else a line saying why not (yet)."""
    last = run.config.train.rounds
    if layout.next_round(run.root) < last:
        return f"round {last}'s modules are not committed yet (train.rounds={last})"
    if not run.root.is_local:
        return f"{run.root.url}: a remote run root; export it with `dipaco export --round {last} --out DIR`"
    return export(run, last, run.root.path("exports", f"round={last}"))


def register(run: Run, round_index: int, result: dict) -> str | None:
    return run.tracker.register(round_index, result)


def list_islands(config: Config, queue: str | None = None) -> list[str]:
    """The islands a run starts on this machine (`train.islands`), or on the workers of one of
    airflow.queues (a host); the DAG maps over this list."""
    return island_names(config.train, queue)


def plan_rounds(run: Run, rounds: int | None = None) -> range:
    """The rounds this run trains, written to queue/plan.json for every island (joiners too)."""
    todo = rounds_to_train(run, rounds)
    if todo:
        write_plan(run.root, todo.stop)
    return todo


def run_island(run: Run, island: str, ds_config: str | None = None) -> dict:
    """One island until the plan is done (pipeline.islands.supervisor.run_island); raises when it failed."""
    return supervisor.run_island(run.config, run.root, island, ds_config, reshard=reshard)


def join_run(run: Run, name: str | None = None) -> dict:
    """`dipaco island`: one more island on a run that `dipaco run` (or a DAG run) planned, with
    this config's ranks and ZeRO config; it leaves when the plan is done."""
    check_same_run(run)
    return supervisor.join(run.config, run.root, name, reshard=reshard)


def round_finished(run: Run, round_index: int) -> bool:
    """Round r merged and the modules it produced evaluated (and, after round
    router.discriminative_after, re-routed): ready to log and register."""
    return TaskQueue(run.root, run.config).round_finished(round_index)


def reroute(run: Run, after_round: int) -> dict:
    """`router.discriminative_after`: the discriminative router fitted after round R's merge and
    the splits re-sharded with it (islands run this as their `reroute.r<R>` task); its report.
    Committed pieces are reused, so a rerun recomputes nothing."""
    from pipeline.evaluation.reroute import reroute as run_reroute

    return run_reroute(run.config, after_round, reshard)


def report_round(run: Run, round_index: int) -> dict:
    """After islands finished round r: its paths, merge, evaluation and utilisation to the tracker,
    and round r+1's modules registered. Logging twice logs nothing twice (tracking is idempotent)."""
    config, root, tracker = run.config, run.root, run.tracker
    for job in list_paths(config):
        rel = layout.path_dir(round_index, job)
        if root.is_committed(rel):
            tracker.log_path(round_index, job, read_metrics(root, rel))
    report = root.read_json(f"{layout.round_dir(round_index)}/merge.json")
    tracker.log_merge(round_index, report)
    rerouted = read_reroute(config, root) if round_index == config.router.discriminative_after else None
    if rerouted:
        tracker.log_reroute(round_index, rerouted)
    result = read_eval(root, round_index + 1)
    tracker.log_eval(round_index + 1, result)
    figures = round_utilisation(config, round_index)
    if figures:
        tracker.log_utilisation(round_index, figures)
        log.info(
            "round %d: utilisation %.2f over %d islands (mean overhead %.1f s per task)",
            round_index,
            figures["utilisation"] or 0,
            figures["islands"],
            figures["task_overhead_seconds"] or 0,
        )
    version = register(run, round_index + 1, result)
    best = early_stop(run, round_index + 1) if config.eval.early_stopping else None
    prune_rounds(run, round_index)
    return {
        "merge": report,
        "eval": result,
        "model_version": version,
        "utilisation": figures,
        "reroute": rerouted,
        "early_stopping": best,
    }


def prune_rounds(run: Run, round_index: int) -> int:
    """`train.keep_rounds: N` once round r is merged, evaluated and registered: the weights of all
    but the N newest rounds go, except those a later champion or the re-routing still reads
    (pipeline.state.retention). Returns the bytes freed (0 with keep_rounds null: keep all)."""
    config, root, keep = run.config, run.root, run.config.train.keep_rounds
    if keep is None:
        return 0
    protected: set[int] = set()
    if config.eval.early_stopping:
        protected |= {entry["round"] for entry in best_up_to(root).get("paths", {}).values()}
    after = config.router.discriminative_after
    if after is not None and not root.exists(layout.reroute_report(after + 1)):
        protected.add(after + 1)
    freed = sum(prune_round(root, r, list_paths(config)) for r in rounds_to_prune(round_index + 1, keep, protected))
    if freed:
        log.info("train.keep_rounds=%d: freed %.1f MB of older rounds' weights", keep, freed / 1e6)
    return freed


def clean(run: Run, keep_registry: bool = False) -> dict:
    """`dipaco clean`: remove this config's run root (refused while a run holds it, and unless it
    holds a run.yaml: a typo must not delete some other directory). With `keep_registry`, the
    MLflow store in it (mlflow.db, mlartifacts/) stays, so the registered versions still load."""
    root = run.root
    where = root.path() if root.is_local else root.url
    if not root.exists(""):
        return {"run_root": where, "removed": False, "why": "nothing there"}
    if not root.exists(layout.RUN_CONFIG):
        raise InputError(f"{where}: not a dipaco run root (no {layout.RUN_CONFIG}); remove it yourself if you mean to")
    keep = ("mlflow.db", "mlartifacts", "tracking.json") if keep_registry else ()
    before = run_root_size(root)
    with run_lock(root):  # refused while a run or an island holds it
        for name in root.listdir(""):
            if name not in keep and name != layout.LOCK:
                root.remove(name)
    if not keep_registry:
        root.remove("")
    return {
        "run_root": where,
        "removed": True,
        "freed_mb": round((before - run_root_size(root)) / 1e6, 1),
        "kept": [name for name in keep if root.exists(name)],
    }


def early_stop(run: Run, round_index: int) -> dict:
    """eval.early_stopping once round r's modules are evaluated: eval/best.json rewritten from every
    eval file (an island may have written it from an older listing), and the early-stopped model
    over rounds <= r logged and registered as the champion. Rerunnable: logged and registered once."""
    write_best(run.root)
    best = best_up_to(run.root, round_index)
    run.tracker.log_early_stopping(round_index, best)
    return {**best, "model_version": run.tracker.register_early_stopped(round_index, best)}


def run(run: Run, rounds: int | None = None) -> dict:
    """Every stage that has not committed: prepare, then rounds up to `train.rounds` (or `rounds`
    more, as a scheduled DAG run does) on islands, evaluation and registration after each merge."""
    preflight.before_a_run(run.config)  # before the lock and init_run write anything
    with run_lock(run.root):
        init_run(run)
        run.tracker.log_run_config()
        precision = choose_precision(run)
        run.tracker.log_precision(precision.name, precision.reason)
        with compile_warmup.beside(run.config):  # this host's first torch.compile while prepare runs
            prepare(run)
            evaluate_initial(run)
            todo = plan_rounds(run, rounds)
            if not todo:
                log.info("%s", nothing_to_train(run))
            else:
                supervisor.Supervisor(run.config, run.root, reshard).run(todo, report=lambda r: report_round(run, r))
        summary = summarize(run)
        if run.config.eval.sample_prompt and summary.get("model_version"):
            from pipeline.tracking.registry import champion_continuation

            prompt = run.config.eval.sample_prompt
            summary["sample"] = {"prompt": prompt, "continuation": champion_continuation(run.config, prompt)}
        run.tracker.finish(summary)
        return summary


def choose_precision(run: Run):
    """train.precision on this machine, said once per run. Measured (when auto needs it) at an
    island's thread count, so the islands this run starts here find the choice in the cache."""
    import torch

    from models.modular import ModelShape
    from pipeline.train.distributed import rank_threads
    from pipeline.train.precision import resolve

    train = run.config.train
    inprocess = train.launcher == "inprocess"  # its island trains in this process, at its threads
    threads = torch.get_num_threads() if inprocess else rank_threads(train, islands=True)
    precision = resolve(train, ModelShape.from_config(run.config.model), threads=threads)
    log.info("precision: %s (%s)", precision.name, precision.reason)
    return precision


def summarize(run: Run) -> dict:
    """The run's summary (pipeline.tracking.report.read_summary): what `dipaco run` and the DAG's
    report task print."""
    return read_summary(run.config, run.root, run.tracker)
