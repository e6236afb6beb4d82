"""The pipeline's stages as plain functions: the CLI and the Airflow DAG call exactly these.

Each stage reads committed state from the run root, does its work, commits its output and
reports to the tracker; each can be rerun and resumes where it stopped (a committed stage
returns its recorded result at once).
"""

from __future__ import annotations

import logging
import re
import time

from models.grid import all_job_ids
from pipeline import layout, preflight
from pipeline.config import Config, config_from_yaml, dump_yaml
from pipeline.errors import ConfigError, CorruptStateError
from pipeline.evaluate import evaluate_round
from pipeline.launch import train_path_job, train_paths
from pipeline.lock import run_lock
from pipeline.merge import merge_round
from pipeline.module_store import init_modules
from pipeline.storage import RunRoot

log = logging.getLogger("dipaco")
# Sections that fix what the committed state means; a run root refuses a config that changes them.
_FIXED = ("model", "router")
_EVAL_FILE = re.compile(r"round=(\d{1,9})\.json")


def init_run(config: Config) -> RunRoot:
    """Write run.yaml and the round-0 modules, unless the run root already holds them."""
    root = RunRoot(config.run_root)
    if root.exists(layout.RUN_CONFIG):
        previous = config_from_yaml(root.read_bytes(layout.RUN_CONFIG), root.path(layout.RUN_CONFIG))
        for section in _FIXED:
            if getattr(previous, section) != getattr(config, section):
                raise ConfigError(f"{config.source}: {section} differs from the run in {root.path()} "
                                  f"(its run.yaml); use a new run_root to change it")
    root.write_text(layout.RUN_CONFIG, dump_yaml(config))
    if init_modules(root, config.model, config.model.grid):
        log.info("initialised round 0: %d modules for %d paths", sum(config.model.grid), config.n_paths)
    return root


def prepare(config: Config) -> dict:
    """The Beam job: router and shards (skipped when shards/ is committed)."""
    from preprocessing.prepare import run_prepare
    from pipeline.tracking import get_tracker

    manifest = run_prepare(config)
    get_tracker(config).log_prepare(manifest)
    return manifest


def list_paths(config: Config) -> list[str]:
    """The training jobs of a round: path ids (`p0-1`), with `.w<k>` when a path has several
    DiLoCo workers. The DAG maps its path tasks over this list."""
    return all_job_ids(config.model.grid, config.train.workers_per_path)


def next_round(config: Config) -> int:
    """The first round whose merge has not committed."""
    root = RunRoot(config.run_root)
    r = 0
    while root.is_committed(layout.round_dir(r)):
        r += 1
    return r


def train_path(config: Config, round_index: int, path_id: str) -> dict | None:
    """One path's DeepSpeed job with retries; its metrics, or None when every attempt failed."""
    from pipeline.tracking import get_tracker

    metrics = train_path_job(config, round_index, path_id)
    if metrics is not None:
        get_tracker(config).log_path(round_index, path_id, metrics)
    return metrics


def merge(config: Config, round_index: int) -> dict:
    from pipeline.tracking import get_tracker

    report = merge_round(config, round_index)
    get_tracker(config).log_merge(round_index, report)
    return report


def evaluate(config: Config, round_index: int) -> dict:
    """Routed perplexity of the modules at the start of a round (round r+1 after merge r)."""
    from pipeline.tracking import get_tracker

    started = time.time()
    result = evaluate_round(config, round_index)
    get_tracker(config).log_eval(round_index, result, started_at=started)
    return result


def evaluate_initial(config: Config) -> dict | None:
    """Round 0's modules, before any training: the first row of the summary, evaluated once
    (None when training has begun, or round 0 is evaluated already)."""
    root = RunRoot(config.run_root)
    if next_round(config) > 0 or root.exists(layout.eval_file(0)):
        return None
    return evaluate(config, 0)


def begin_round(config: Config, round_index: int) -> list[str]:
    """The round's path jobs, once the tracker shows the round as running."""
    from pipeline.tracking import get_tracker

    get_tracker(config).begin_round(round_index)
    return list_paths(config)


def rounds_to_train(config: Config, rounds: int | None = None) -> range:
    """The rounds a run trains: from the first uncommitted one up to `train.rounds`, at most `rounds`
    of them (a scheduled DAG run's `airflow.rounds_per_run`); empty once every round is committed."""
    first = next_round(config)
    last = config.train.rounds if rounds is None else min(config.train.rounds, first + rounds)
    return range(first, max(first, last))


def nothing_to_train(config: Config) -> str:
    """Why a run trained nothing: the message a DAG run and `dipaco run` give."""
    return (f"nothing to train: all train.rounds={config.train.rounds} rounds are committed in "
            f"{RunRoot(config.run_root).path()}; raise train.rounds to continue")


def register(config: Config, round_index: int, result: dict) -> str | None:
    from pipeline.tracking import get_tracker

    return get_tracker(config).register(round_index, result)


def train_round(config: Config, round_index: int) -> dict:
    """Train every path (parallel launches), merge, evaluate, register: one outer round."""
    from pipeline.tracking import get_tracker

    jobs, root = begin_round(config, round_index), RunRoot(config.run_root)
    pending = [job for job in jobs if not root.is_committed(layout.path_dir(round_index, job))]
    log.info("round %d: training %d of %d path jobs", round_index, len(pending), len(jobs))
    for path_id, metrics in train_paths(config, round_index, jobs).items():
        if metrics is not None:
            get_tracker(config).log_path(round_index, path_id, metrics)
    report = merge(config, round_index)
    result = evaluate(config, round_index + 1)
    version = register(config, round_index + 1, result)
    return {"merge": report, "eval": result, "model_version": version}


def run(config: Config, rounds: int | None = None) -> dict:
    """Every stage that has not committed: prepare, then rounds up to `train.rounds` (or `rounds`
    more, as a scheduled DAG run does), evaluation and registration after each merge."""
    from pipeline.tracking import get_tracker

    root = RunRoot(config.run_root)
    preflight.check_data(config)  # before the lock and init_run write anything
    with run_lock(root):
        init_run(config)
        tracker = get_tracker(config)
        tracker.log_run_config()
        prepare(config)
        evaluate_initial(config)
        todo = rounds_to_train(config, rounds)
        if not todo:
            log.info("%s", nothing_to_train(config))
        for r in todo:
            train_round(config, r)
        summary = summarize(config)
        if config.eval.sample_prompt and summary.get("model_version"):
            from pipeline.registry import champion_continuation

            prompt = config.eval.sample_prompt
            summary["sample"] = {"prompt": prompt, "continuation": champion_continuation(config, prompt)}
        tracker.finish(summary)
        return summary


def summarize(config: Config) -> dict:
    """Perplexity per path and overall by round, from the committed eval files, and where the
    registered model and the tracking store are."""
    from pipeline.tracking import get_tracker, redact, tracking_uri

    root = RunRoot(config.run_root)
    rounds = sorted(int(m.group(1)) for n in root.listdir(layout.EVAL_DIR) if (m := _EVAL_FILE.fullmatch(n)))
    summary = {"run_root": root.path() if root.is_local else root.url,
               "rounds_committed": next_round(config), "train_rounds": config.train.rounds,
               "eval": {r: read_eval(root, r) for r in rounds}}
    if config.mlflow.enabled:
        summary.update(tracking_uri=redact(tracking_uri(config)), registered_model=config.mlflow.registered_model,
                       model_version=get_tracker(config).newest_version())
    return summary


def read_eval(root: RunRoot, round_index: int) -> dict:
    """eval/round=<r>.json with the numbers the run summary prints (perplexity and bits per byte,
    overall and per path)."""
    result = root.read_json(layout.eval_file(round_index))
    paths = result.get("paths", {})
    entries = [result] + [p if isinstance(p, dict) else {"perplexity": "?"} for p in
                          (paths.values() if isinstance(paths, dict) else ["?"])]
    numbers = [entry.get(key) for entry in entries for key in ("perplexity", "bits_per_byte")]
    if not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        raise CorruptStateError(f"{root.path(layout.eval_file(round_index))}: perplexity and bits_per_byte (overall "
                                f"and per path under \"paths\") must be numbers")
    return result
