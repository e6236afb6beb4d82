"""Who may set what: the trust levels of configuration.

The config file and the CLI's `--set` are the operator's and are trusted. The DAG's trigger params
are not: anyone allowed to trigger a run sends them. Three keys of a config start processes or
import code (`beam.runner` names a class Beam imports; some `beam.options` choose a command Beam
runs with `Popen(shell=True)` for its SDK workers; `train.ds_config` can ask DeepSpeed for a
pickle load), others choose where results go or whom the pipeline trusts (`mlflow.tracking_uri`,
`train.hostfile`, the embedder). So a trigger may set only TRIGGER_KEYS: training and evaluation
hyper-parameters, rounds, and a run root under the prefix the config file names
(`airflow.trigger_run_roots`). Everything else is refused with one line naming the key.

Whoever sets it, a runner must be one of BEAM_RUNNERS (or listed in `beam.extra_runners`), and
an option in ENVIRONMENT_OPTIONS must come from the config file itself, never from an override.
A trigger's size keys are bounded (TRIGGER_SIZE_CAPS). And a config read back from a run root
(run.yaml, which whoever can write the run root wrote) chooses no code: its RUN_ROOT_CODE_KEYS
come from the reader's own command line, or must pass check_run_root_config (docs/security.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from pipeline.core.bounds import shown
from pipeline.core.errors import ConfigError

# The runners Beam ships, plus the names dipaco has always taken for the direct runner and Dask.
BEAM_RUNNERS = ("DirectRunner", "DaskRunner", "DataflowRunner", "FlinkRunner", "SparkRunner", "PortableRunner")
RUNNER_ALIASES = ("direct", "FnApiRunner", "dask")

# Beam pipeline options that choose a command, a container or a package its workers run. Beam's
# parser takes exact names only (an abbreviation is discarded as unparseable, checked on 2.77).
ENVIRONMENT_OPTIONS = frozenset(
    {
        "runner",
        "environment_type",
        "environment_config",
        "environment_option",
        "environment_options",
        "beam_services",
        "job_server_java_launcher",
        "job_server_jvm_properties",
        "job_server_jvm_property",
        "sdk_location",
        "setup_file",
        "requirements_file",
        "extra_package",
        "extra_packages",
        "sdk_container_image",
        "worker_harness_container_image",
        "sdk_harness_container_image_overrides",
        "prebuild_sdk_container_base_image",
        "prebuild_sdk_container_engine",
        "docker_registry_push_url",
    }
)

# What a DAG trigger may override: hyper-parameters of training and evaluation, rounds, a run root.
TRIGGER_KEYS = frozenset(
    {
        "run_root",
        "data.max_docs",
        "train.rounds",
        "train.inner_steps",
        "train.micro_batch_size",
        "train.gradient_accumulation_steps",
        "train.lr",
        "train.min_lr_ratio",
        "train.warmup_steps",
        "train.weight_decay",
        "train.betas",
        "train.grad_clip",
        "train.seed",
        "train.lr_decay_steps",
        "outer.lr",
        "outer.momentum",
        "outer.nesterov",
        "outer.weighting",
        "outer.sqrt_paths_rescale",
        "outer.compression",
        "eval.max_docs",
        "eval.batch_size",
        "eval.early_stopping",
        "eval.reroute_every",
        "eval.sample_prompt",
        "airflow.rounds_per_run",
    }
)

# A run root reaches launcher command lines (DeepSpeed's multi-node runners join them into one
# `sh -c` string): letters, digits and `_ . / : + = @ , ~ -` only, which covers local paths and
# fsspec URLs (s3://bucket/x, memory://name) and leaves a shell nothing to interpret.
RUN_ROOT_RE = re.compile(r"[A-Za-z0-9_./:+=@,~-]+")


def check_run_root(run_root: str, source: str) -> None:
    """Refuse a run root outside the restricted character set (it reaches shell command lines)."""
    if not RUN_ROOT_RE.fullmatch(run_root):
        bad = next((c for c in run_root if not RUN_ROOT_RE.fullmatch(c)), "")
        raise ConfigError(
            f"{source}: run_root may hold only letters, digits and _ . / : + = @ , ~ -; "
            f"got {shown(bad)} in {shown(run_root)}"
        )


def check_runner(name: str, extra: Iterable[str], source: str) -> None:
    """Refuse a beam.runner that is neither a Beam runner nor listed in beam.extra_runners."""
    allowed = (*BEAM_RUNNERS, *RUNNER_ALIASES, *extra)
    if name not in allowed:
        raise ConfigError(
            f"{source}: beam.runner must be one of {', '.join(BEAM_RUNNERS)} or a runner "
            f"listed in beam.extra_runners of the config file, got {shown(name)}"
        )


def option_name(flag: str) -> str:
    """'--environment_type=PROCESS' -> 'environment_type' (a bare value gives '')."""
    return flag[2:].split("=", 1)[0] if flag.startswith("--") else ""


def check_beam_options(options: Iterable[str], from_file: Iterable[str], source: str) -> None:
    """Refuse an ENVIRONMENT_OPTIONS flag that the config file itself does not set."""
    trusted = set(from_file)
    for flag in options:
        if option_name(flag) in ENVIRONMENT_OPTIONS and flag not in trusted:
            raise ConfigError(
                f"{source}: beam.options {shown(flag)} chooses what Beam's workers run: "
                f"only the config file itself may set --{option_name(flag)}"
            )


def check_trigger_override(item: str, where: str) -> str:
    """The key of one `key.path=value` override from a DAG trigger, refused unless in TRIGGER_KEYS."""
    key = item.split("=", 1)[0]
    if key not in TRIGGER_KEYS:
        raise ConfigError(
            f"{where}: a DAG trigger may not set {shown(key)}, only the config file or "
            f"`dipaco --set` may (what a trigger may set: docs/security.md)"
        )
    return key


def check_trigger_run_root(run_root: str, prefix: str | None, source: str) -> None:
    """A run root set by a trigger must lie under airflow.trigger_run_roots of the config file."""
    if prefix is None:
        raise ConfigError(
            f"{source}: a DAG trigger may set run_root only under airflow.trigger_run_roots, "
            f"which the config file does not set"
        )
    base = prefix.rstrip("/") + "/"
    rest = run_root[len(base) :] if run_root.startswith(base) else ""
    if not rest or any(part in ("", ".", "..") for part in rest.rstrip("/").split("/")):
        raise ConfigError(
            f"{source}: run_root {shown(run_root)} from a DAG trigger must lie under "
            f"airflow.trigger_run_roots {shown(base)}"
        )


# The keys of a config that choose code, a command, an environment or a file outside the run root.
# run.yaml is read back from the run root, which anyone who can write the bucket (or the shared
# directory) can rewrite: a reader of it takes these from its own command line (`--config`,
# `--ds-config`), or accepts only what nobody needs to trust (check_run_root_config).
RUN_ROOT_CODE_KEYS = (
    "beam.runner",
    "beam.extra_runners",
    "beam.options",
    "train.launcher",
    "train.hostfile",
    "train.ds_config",
)


def check_run_root_config(config, source: str, shipped_ds_config: Callable[[str], bool]) -> None:
    """Refuse a config read from a run root (run.yaml) that chooses code itself: a runner other than
    Beam's own, any beam.extra_runners, an ENVIRONMENT_OPTIONS flag, a hostfile, or a ds_config
    other than one the project ships (`shipped_ds_config`). One line naming the key."""

    def refuse(key: str, value: object) -> None:
        raise ConfigError(
            f"{source}: {key} {shown(value)} chooses code, and a run root's run.yaml may not: "
            f"give the island or rank the operator's config on its own command line (--config)"
        )

    beam, train = config.beam, config.train
    if beam.extra_runners:
        refuse("beam.extra_runners", beam.extra_runners)
    if beam.runner not in (*BEAM_RUNNERS, *RUNNER_ALIASES):
        refuse("beam.runner", beam.runner)
    chosen = [flag for flag in beam.options if option_name(flag) in ENVIRONMENT_OPTIONS]
    if chosen:
        refuse("beam.options", chosen[0])
    if train.hostfile is not None:
        refuse("train.hostfile", train.hostfile)
    if not shipped_ds_config(train.ds_config):
        refuse("train.ds_config", train.ds_config)


# Upper bounds of the size keys a trigger may set (TRIGGER_KEYS holds them all): a trigger chooses
# how long a run trains, never that it cannot fit the machine. The memory keys (a micro-batch, an
# evaluation batch) may grow to TRIGGER_SCALE times the config file's own value, the value its
# operator sized for the machine the file describes; every size key has an absolute cap.
TRIGGER_SCALE = 4
TRIGGER_SIZE_CAPS = {
    "train.micro_batch_size": 1024,
    "train.gradient_accumulation_steps": 1024,
    "eval.batch_size": 4096,
    "train.inner_steps": 1_000_000,
    "train.rounds": 10_000,
    "train.warmup_steps": 1_000_000,
    "train.lr_decay_steps": 10_000_000,
    "data.max_docs": 1_000_000_000,
    "eval.max_docs": 1_000_000_000,
    "eval.reroute_every": 1_000_000,
    "airflow.rounds_per_run": 10_000,
}
TRIGGER_MEMORY_KEYS = ("train.micro_batch_size", "eval.batch_size")


def _value(config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def check_trigger_sizes(config, file_config, keys: Iterable[str], source: str) -> None:
    """Refuse a size key set by a trigger above its bound (TRIGGER_SIZE_CAPS, and TRIGGER_SCALE x the
    config file's own value for TRIGGER_MEMORY_KEYS); a cap the file sets (data.max_docs: 1000)
    may not be lifted to null (everything) by a trigger either."""
    for key in keys:
        if key not in TRIGGER_SIZE_CAPS:
            continue
        value, own = _value(config, key), _value(file_config, key)
        limit = TRIGGER_SIZE_CAPS[key]
        if key in TRIGGER_MEMORY_KEYS and isinstance(own, int):
            limit = min(limit, TRIGGER_SCALE * own)
        if value is None and own is not None:
            raise ConfigError(
                f"{source}: a DAG trigger may not lift {key} (the config file's {own}) to null; at most {limit:,}"
            )
        if isinstance(value, (int, float)) and value > limit:
            raise ConfigError(
                f"{source}: a DAG trigger may set {key} to at most {limit:,} "
                f"(the config file sizes the run for its machine), got {shown(value)}"
            )
