"""The run configuration: one YAML file loaded into dataclasses and validated before any work starts.

The dataclasses below are the one description of every key: a field's help is its trailing comment
and the comment lines right below it, a section's its class docstring, and docs/config.md is
generated from them (`python -m pipeline.core.configdoc`; tests/test_docs.py fails when it is stale).
Every value is type-checked, unknown keys are errors, and every error names the key and the file so
a user can fix it without reading code.

Config text comes from users and, through the DAG's `overrides` param, from anyone allowed to
trigger a run. What such a trigger may set is the allow-list of pipeline.core.trust (`load_config(...,
trusted=False)`); whoever wrote it, YAML is read with bounds: anchors and aliases are refused (nine nested aliases
in 2 KB expand to 10^9 items: a "billion laughs"), nesting is capped, a file is read up to
MAX_CONFIG_BYTES and a `--set` item up to MAX_SET_CHARS, and a value is shown in a message cut to
pipeline.core.bounds.SHOWN_CHARS characters, so every error is one short line naming key and file.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.bounds import SHOWN_CHARS, one_line, shown
from pipeline.core.errors import ConfigError
from pipeline.core.trust import (
    check_beam_options,
    check_run_root,
    check_run_root_config,
    check_runner,
    check_trigger_override,
    check_trigger_run_root,
    check_trigger_sizes,
)

MAX_CONFIG_BYTES = 256 * 1024  # a real config is ~2 KB; PyYAML constructs ~250 KB/s
MAX_SET_CHARS = 64 * 1024  # one --set item (or DAG override)
MAX_YAML_DEPTH = 32  # a config nests 3 deep (section, key, list)
MAX_PATH_CHARS = 4096  # PATH_MAX: a config file or project directory named in DAG params
MAX_OVERRIDES = 256
MAX_LEVELS, MAX_PATHS = 64, 65536  # a grid is listed path by path; 10^12 paths would never list


@dataclass
class DataConfig:
    """Where the documents come from: C4-format JSON lines (`text`, `url`, `timestamp`), gzipped or not."""

    train: str | list[str] = "data/sample/train/*.json.gz"  # globs of C4-format `*.json` / `*.json.gz` files (real C4
    #                                                          file names work as is); relative ones resolve against the
    #                                                          current directory
    eval: str | list[str] | None = "data/sample/validation/*.json.gz"  # the held-out split, globbed alike; null: none
    max_docs: int | None = None  # cap per split, for quick runs
    max_doc_bytes: int = 1_000_000  # a line is read at most this much at a time; longer documents are rejected
    #                                 `too_large` (kept in shards/rejected/), never silently truncated
    parts_per_path: int = 1  # Parquet parts per path shard; raise it so no worker holds a whole shard


@dataclass
class RouterConfig:
    """How prepare routes each document to a path by its prefix (docs/algorithm.md, routing)."""

    embedder: str = "minilm"  # minilm: all-MiniLM-L6-v2 through Beam's RunInference, offline; tfidf: tf-idf and
    #                           truncated SVD (c-BTM style); model: a path model's mean last hidden state (the paper's)
    prefix_tokens: int = 32  # DiPaCo routes on the first 32 tokens; evaluation scores only the tokens after them
    sample_docs: int = (
        20000  # documents of the seeded sample the k-means is fitted on (and discriminative_after labels)
    )
    balanced: bool = True  # cap shard sizes (capacity_factor) so that no path starves
    seed: int = 0  # the seeded sample and the k-means initialisation
    kmeans_iters: int = 50  # Lloyd iterations of each k-means
    batch_size: int = 64  # embedder batch size inside RunInference
    capacity_factor: float = 1.5  # balanced: a path holds between 1/f and f times an equal share
    tfidf_dim: int = 64  # tfidf embedder: truncated-SVD dimensions (c-BTM style)
    model_round: int = 0  # model embedder: the committed round whose path model embeds
    model_path: str | None = None  # model embedder: that path's id; default the first path
    model_layer: int = -1  # model embedder: which hidden state is averaged over the prefix, as transformers numbers
    #                        them (output_hidden_states): 0 the embeddings, k the output of block k, -1 the last
    #                        (after the final norm); with model.init_from and model_round 0: the checkpoint's own
    discriminative_after: int | None = None  # R: after round R's merge, label a sample by its lowest-loss path, fit a
    #                                          linear router on the same features and re-shard; rounds > R train
    #                                          there (DiPaCo 2.4.2); null: k-means for the whole run


@dataclass
class ModelConfig:
    """The module grid and the Llama shape of one path; a run root refuses a config that changes it."""

    grid: list[int] = field(default_factory=lambda: [4, 4])  # modules per level; paths = their product ([1]: dense)
    blocks_per_level: list[int] = field(default_factory=lambda: [2, 2])  # Llama decoder blocks per level
    hidden_size: int = 256  # a path model's width
    num_heads: int = 4  # attention heads; divides hidden_size
    intermediate_size: int | None = None  # default: the Llama ratio, 8/3 * hidden rounded to 64
    seq_len: int = 256  # tokens a training row predicts (documents packed with EOS); more than router.prefix_tokens
    tokenizer: str = "gpt2"  # gpt2: GPT-2's 50,257-id BPE, shipped offline; bpe: a byte-level BPE of vocab_size ids
    #                          that prepare trains on the run's own text, since a small model learns more per second
    #                          with a small LM head (docs/algorithm.md, tokenizer); hf: init_from's checkpoint's own
    vocab_size: int = 50257  # GPT-2's; with bpe the size to train (>= 512; the demo: 4,096)
    tokenizer_sample_docs: int = 10000  # bpe: training documents (a seeded sample) it is trained on
    init_seed: int = 0  # round 0 modules: every path starts from the same shared weights
    path_specific_blocks: int = 0  # DiPaCo: N decoder blocks per path after the grid's, its own: trained on its shard
    #                                only, never averaged (needs train.workers_per_path 1)
    init_from: str | None = None  # round 0 from a dense model instead of init_seed: a Hugging Face checkpoint directory
    #                               (Llama, Mistral, Qwen2; safetensors only), `models:/NAME@ALIAS` or
    #                               `models:/NAME/VERSION` (a version this project registered, in mlflow.tracking_uri's
    #                               registry) or a dense run root; every module of a level starts from its weights.
    #                               Shape and tokenizer are the checkpoint's (docs/operations.md); its layers must
    #                               split as blocks_per_level (+ path_specific_blocks) asks
    init_round: int | None = None  # init_from a run root: the round whose modules start this run; null: its newest
    init_config: dict | None = field(default=None, compare=False)  # written by dipaco, never by hand: the
    #                                config.json init_from resolved to (run.yaml records it for every later stage)


@dataclass
class TrainConfig:
    """The inner loop on DeepSpeed ZeRO, and the islands that run it."""

    rounds: int = 4  # outer rounds; raise it to continue a run root whose rounds are all committed
    inner_steps: int = 50  # H: inner AdamW steps per outer round (paper: 150 DiPaCo, 500 DiLoCo)
    micro_batch_size: int = 8  # sequences per rank per micro step; DeepSpeed's "auto" batch keys come from it
    gradient_accumulation_steps: int = 1  # micro steps per optimizer step
    lr: float = 4.0e-4  # inner AdamW peak lr: linear warmup, then a cosine decay over all rounds' steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warmup at the run's first steps
    weight_decay: float = 0.1  # AdamW weight decay, on matrices only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 1.0  # gradient clipping by global norm
    ds_config: str = "ds_configs/zero2.json"  # ZeRO only (zero1, zero2, zero3, zero2_offload or your own): the
    #                                           precision blocks come from train.precision, and its "auto" keys are
    #                                           filled per model and island (pipeline/train/zero.py): buckets from
    #                                           the hidden size; on one rank ZeRO-1/2 keep one gradient bucket as
    #                                           large as the path (one flush a step), and ZeRO-3 all-reduces one as
    #                                           large as the largest tensor instead of reduce-scattering and keeps
    #                                           torch's linear. Relative names are also looked up in the repository
    precision: str = "auto"  # DeepSpeed's precision blocks; auto: bf16 on a GPU that has it (else fp16 with loss
    #                          scaling), on a CPU fp32 unless it computes bfloat16 natively and a few timed steps find
    #                          bf16 faster (cached per host and shape in ~/.cache/dipaco; pipeline/train/precision.py)
    compile: bool | str = False  # torch.compile the path model's forward (ZeRO-1/2): faster steps after a one-off
    #                              compile per host (docs/algorithm.md, inner loop); auto: where it measured faster,
    #                              on CUDA and AVX-512 CPUs with AMX (pipeline/train/zero.py); the demo: auto
    procs_per_path: int = 1  # DeepSpeed ranks per node of an island (GPUs per node on GPU hosts)
    num_nodes: int = 1  # nodes per island; more than 1 needs a hostfile
    hostfile: str | None = None  # DeepSpeed hostfile ("host slots=N" lines) for multi-node islands
    workers_per_path: int = (
        1  # DiLoCo workers per path, each on an iid part of the shard (grid [1] + M workers: DiLoCo)
    )
    worker_data: str = "iid"  # iid: worker k of M reads every M-th document of its path's shard; clustered: its own
    #                           k-means cluster of the shard (the router's embedder), the DiLoCo paper's non-iid workers
    workers_schedule: list[int] | None = None  # DiLoCo workers per round (one entry a round, the largest is
    #                                            workers_per_path): a compute pool that changes size; null: constant
    parallel_paths: int = 2  # path jobs at once on this machine (one-shot launches) and the default of islands;
    #                          OMP threads per rank are the cores shared by the ranks running at once
    islands: int | None = None  # long-lived island launches `dipaco run` and the DAG start (default: parallel_paths)
    #                             and, on any host, the islands there: each rank's share of its cores
    lease_seconds: float = 60.0  # an island's claim on a task expires when its beats stop this long (reader's clock)
    backup_after: float | None = None  # backup attempt of a train task running this x its round's median, or
    #                                    projected to by its heartbeated pace when a backup from its newest checkpoint
    #                                    would beat it by this factor (LATE); first to publish wins
    #                                    (docs/design.md, faults and stragglers); null: off
    checkpoint_every: int | None = None  # mid-task checkpoint every N inner steps (a new attempt resumes); null: off
    threads_per_proc: int | None = None  # OMP threads per rank; default: cores / busy ranks
    max_attempts: int = 2  # failed or expired attempts of a path's train task before its round merges without it
    #                        (a config or input error is not retried); once the path is published, as many
    #                        more (its inner state is still to keep, and its next round resumes it)
    seed: int = 0  # the inner loop's data order and torch seed (offset by the round and the worker)
    launcher: str = "deepspeed"  # inprocess: this process is a one-rank island, no launch (tests and debugging only)
    lr_decay_steps: int | None = None  # the cosine runs over the run's last N steps only, the lr constant before it
    #                                    (warmup-stable-decay; the demo: its last round); null: all after warmup
    keep_rounds: int | None = None  # module and path weight files of the N newest rounds are kept (and the rounds
    #                                 early stopping or a pending re-routing reads); null: all

    def workers_in_round(self, round_index: int) -> int:
        """DiLoCo workers of each path in round r: train.workers_schedule's entry, else workers_per_path."""
        if self.workers_schedule is None or round_index >= len(self.workers_schedule):
            return self.workers_per_path
        return self.workers_schedule[round_index]


@dataclass
class OuterConfig:
    """The DiLoCo outer step of the merge (docs/algorithm.md, outer merge)."""

    lr: float = 0.7  # outer SGD lr (1 with momentum 0: plain averaging, as the demo does)
    momentum: float = 0.9  # outer momentum; its buffers are kept per module across rounds
    nesterov: bool = True  # Nesterov momentum, DiLoCo's outer optimizer
    weighting: str = "tokens"  # tokens: each path's share of the tokens that trained the module; uniform: equal
    sqrt_paths_rescale: bool = False  # DiPaCo 2.7: rescale by sqrt(paths through the module)
    compression: str = "none"  # outer gradients as islands send them (Streaming DiLoCo): the merge reads those
    #                            instead of the trained weights (docs/algorithm.md, compressed outer gradients)


@dataclass
class EvalConfig:
    """Held-out evaluation: routed perplexity and bits per byte of each round's modules."""

    max_docs: int | None = None  # cap on held-out documents scored per path
    batch_size: int = 8  # documents per forward pass
    sample_prompt: str | None = None  # `dipaco run` ends by showing the champion's continuation of it
    early_stopping: bool = False  # each path keeps its round of lowest validation perplexity (eval/best.json, champion)
    reroute_every: int | None = (
        None  # re-route every N scored tokens by the N before (DiPaCo: 64); null: route once by the prefix
    )


@dataclass
class MlflowConfig:
    """Tracking and the Model Registry (docs/operations.md, MLflow)."""

    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<run_root>/mlflow.db
    experiment: str = "dipaco"  # the experiment of the run root's parent run
    registered_model: str = "dipaco"  # each evaluated round's modules become a version of it
    enabled: bool = True  # false: a null tracker, nothing logged or registered


@dataclass
class AirflowConfig:
    """Read when the DAG file is parsed (the DAG's shape), except rounds_per_run (at run time)."""

    schedule: str | None = None  # cron or preset (e.g. "@daily"); null: manual triggers only
    rounds_per_run: int = 1  # further rounds each DAG run trains, from the last committed one
    pool: str = "dipaco_paths"  # caps islands at once: `airflow pools set dipaco_paths 2 ...`
    pool_slots: int = 1  # pool slots one island takes
    retries: int = 2  # Airflow retries of an island task (a path's retries are the queue's lease attempts)
    retry_delay_s: int = 60  # seconds between those retries
    trigger_run_roots: str | None = None  # a DAG trigger may set run_root only under this prefix; null: never
    queues: list[str] | None = None  # Celery queues, one per host: each starts train.islands islands named
    #                                  <queue>-island-<i>, and the host's first compile (warm_up_<queue>), on the
    #                                  workers of its queue; null: the default queue


@dataclass
class BeamConfig:
    """The Beam runner of prepare (docs/operations.md, scaling out)."""

    runner: str = "DirectRunner"  # a runner Beam ships (DaskRunner, DataflowRunner, ...) or one in extra_runners
    options: list[str] = field(default_factory=lambda: ["--direct_running_mode=in_memory"])  # the runner's pipeline
    #                                  options; the default is one in-process worker, since torch already spreads the
    #                                  embedder over every core while multi-processing loads the model once per worker
    #                                  and ships every element between processes (benchmarks/RESULTS.md)
    extra_runners: list[str] = field(default_factory=list)  # runners beyond Beam's own (trust.BEAM_RUNNERS)


@dataclass
class StorageConfig:
    """How the run root's store is opened (docs/operations.md, Run across hosts): fsspec options, never credentials."""

    options: dict[str, Any] = field(default_factory=dict)  # the store's fsspec options, e.g. s3: {endpoint_url: ...,
    #                                  client_kwargs: {region_name: ...}}; a key the store does not take is refused.
    #                                  Credentials come from AWS_* variables, ~/.aws or the GCS defaults, never here


@dataclass
class Config:
    """One YAML file: run_root at the top level, then one section per part of the pipeline."""

    run_root: str = "runs/demo"  # local path or fsspec URL (s3://, gs://, file://) holding all of the run's state
    storage: StorageConfig = field(default_factory=StorageConfig)
    data: DataConfig = field(default_factory=DataConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    airflow: AirflowConfig = field(default_factory=AirflowConfig)
    beam: BeamConfig = field(default_factory=BeamConfig)
    source: str = field(default="<defaults>", metadata={"internal": True})  # file it came from

    @property
    def n_paths(self) -> int:
        return math.prod(self.model.grid)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, without internal fields (what run.yaml and MLflow get)."""
        return _strip_internal(self)


REPO_ROOT = Path(__file__).resolve().parents[2]  # pipeline/core/config.py -> the repository


def resolve_ds_config(path: str) -> Path:
    """A ds_config path as given, or relative to the project (so DAG tasks can run anywhere)."""
    candidate = Path(path)
    if _is_file(candidate) or candidate.is_absolute():
        return candidate
    return REPO_ROOT / path


def _is_file(path: str | Path) -> bool:
    """Path.is_file, False for a name no filesystem takes (a NUL byte, longer than NAME_MAX)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


ENUMS: dict[str, tuple[str, ...]] = {
    "router.embedder": ("minilm", "model", "tfidf"),
    "model.tokenizer": ("gpt2", "bpe", "hf"),  # hf: a checkpoint's own (model.init_from sets it)
    "outer.weighting": ("tokens", "uniform"),
    "outer.compression": ("none", "bf16", "int8", "int4"),  # pipeline/outer/compression.py KINDS
    "train.launcher": ("deepspeed", "inprocess"),
    "train.precision": ("auto", "fp32", "bf16", "fp16"),  # pipeline/train/precision.py
    "train.worker_data": ("iid", "clustered"),  # pipeline/routing/worker_split.py
}
_SET_RE = re.compile(r"^([A-Za-z_][\w.]*)=(.*)$", re.S)


# libyaml when PyYAML was built with it: the pure-Python parser reads ~35 KB/s on this CPU.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_events(text: str | bytes) -> None:
    """Refuse anchors, aliases and nesting deeper than MAX_YAML_DEPTH from the event stream alone,
    before anything is composed or constructed: nine nested aliases in 2 KB expand to 10^9 items
    (a "billion laughs"), and a deep document would end in a RecursionError in the composer."""
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None, "YAML anchors and aliases (&name, *name) are not allowed", event.start_mark
            )
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nests deeper than {MAX_YAML_DEPTH} levels", event.start_mark
                )
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def parse_yaml(text: str | bytes, where: str) -> Any:
    """YAML text -> plain data within the bounds above; ConfigError naming `where` otherwise."""
    try:
        _check_events(text)
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or ""
        if "maximum nesting depth" in problem:  # libyaml >= 0.2.6 (PyYAML 6.0.4) stops at 1000 levels itself
            problem = f"nests deeper than {MAX_YAML_DEPTH} levels"
        raise ConfigError(f"{where}: not valid YAML{at}: {one_line(problem, SHOWN_CHARS)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({one_line(str(exc), SHOWN_CHARS)})") from None
    except (ValueError, OverflowError, RecursionError) as exc:  # a 5000-digit int, a 13th month
        raise ConfigError(f"{where}: a YAML value cannot be read ({one_line(str(exc), SHOWN_CHARS)})") from None


def read_config_text(path: str | Path) -> bytes:
    """A config file's bytes, refusing more than MAX_CONFIG_BYTES (read no further than that)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        why = one_line(getattr(exc, "strerror", None) or str(exc), SHOWN_CHARS)
        raise ConfigError(f"{one_line(str(path), SHOWN_CHARS)}: cannot read config file ({why})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: config file is larger than {MAX_CONFIG_BYTES:,} bytes")
    return data


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), trusted: bool = True) -> Config:
    """Load, override and validate a config; raises ConfigError naming the key and the file.

    trusted=False: the overrides come from a DAG trigger and may set only trust.TRIGGER_KEYS (a
    run root only under the file's airflow.trigger_run_roots). Whoever sets them, options that
    choose what Beam's workers run must come from the file itself."""
    source = str(path) if path else "<defaults>"
    raw: dict[str, Any] = {}
    if path:
        raw = parse_yaml(read_config_text(path), source) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    beam_section = raw.get("beam")
    file_options = beam_section.get("options") if isinstance(beam_section, dict) else None
    file_options = [o for o in file_options if isinstance(o, str)] if isinstance(file_options, list) else []
    file_raw = copy.deepcopy(raw) if not trusted else None
    keys = [_apply_override(raw, item, source, trusted) for item in overrides]
    config = _build(Config, raw, "", source)
    config.source = source
    validate(config)
    check_beam_options(config.beam.options, file_options if path else BeamConfig().options, source)
    if not trusted and "run_root" in keys:
        check_trigger_run_root(config.run_root, config.airflow.trigger_run_roots, source)
    if not trusted:
        check_trigger_sizes(config, _build(Config, file_raw, "", source), keys, source)
    return config


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate a config from plain data (run.yaml read back, tests, the DAG's params)."""
    config = _build(Config, dict(raw), "", source)
    config.source = source
    validate(config)
    return config


def config_from_yaml(text: str | bytes, source: str) -> Config:
    """A config from YAML text, validated (run.yaml read back by the trainer, stages, router)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: config file is larger than {MAX_CONFIG_BYTES:,} bytes")
    raw = parse_yaml(text, source) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return config_from_dict(raw, source)


def shipped_ds_config(path: str) -> bool:
    """A ds_config the project ships (ds_configs/*.json of this checkout), whatever the path says."""
    shipped = (REPO_ROOT / "ds_configs").resolve()
    try:
        return resolve_ds_config(path).resolve().parent == shipped
    except (OSError, ValueError, RuntimeError):
        return False


def add_own_config_args(parser) -> None:
    """--config/--set of a launched rank (an island, a one-shot path trainer): the operator's config,
    where its code-choosing keys come from (from_run_root), as the launcher passes them."""
    parser.add_argument("--config", default=None, help="the operator's config file (Beam runner, options, ds_config)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def own_config(args) -> Config | None:
    """The config of a rank's own --config/--set (trusted: its command line), or None."""
    return load_config(args.config, args.set) if args.config else None


def from_run_root(config: Config, own: Config | None = None, ds_config: str | None = None, uses_code: bool = True):
    """A config read back from a run root (run.yaml), made safe to use: whoever can write the run
    root wrote it, so its code-choosing keys (trust.RUN_ROOT_CODE_KEYS) are taken from the reader's
    own command line instead, `own` (its --config) and `ds_config` (its --ds-config); without
    them they must be what nobody needs to trust (trust.check_run_root_config), else ConfigError
    naming the key. A reader that runs none of them (`uses_code=False`: the router's embedder,
    the check that a new config trains the same model) gets the defaults, never run.yaml's."""
    if ds_config is not None:
        config.train.ds_config = ds_config
    if own is None and not uses_code:
        own = Config()
    if own is None:
        check_run_root_config(config, config.source, shipped_ds_config)
        return config
    config.beam = dataclasses.replace(
        config.beam,
        runner=own.beam.runner,
        extra_runners=list(own.beam.extra_runners),
        options=list(own.beam.options),
    )
    config.train.launcher, config.train.hostfile = own.train.launcher, own.train.hostfile
    if ds_config is None:
        config.train.ds_config = own.train.ds_config
    return config


class _NoAliasDumper(yaml.SafeDumper):
    """run.yaml is read back through parse_yaml, which refuses aliases: never write one."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(config: Config) -> str:
    return yaml.dump(config.to_dict(), Dumper=_NoAliasDumper, sort_keys=False)


def check_dag_params(
    params: dict[str, Any], trusted_dirs: list[str | Path] | None = None, config_dirs: list[str | Path] | None = None
) -> dict[str, Any]:
    """The DAG's run params (`config`, `overrides`, `project_dir`) checked before any use, as the
    reference every task loads the config from. The DAG declares the same bounds as a JSON schema
    (Airflow checks it when a run is triggered); this is the check that holds for any caller.

    Params come from whoever triggers the run: an override may set only trust.TRIGGER_KEYS, and
    with `trusted_dirs` (the DAG passes its project and $DIPACO_CONFIG's directory) project_dir
    must be one of them and the config file must lie inside one of `config_dirs` (default: the
    same; the DAG passes its configs/ and $DIPACO_CONFIG's directory, not the whole project, which
    holds data and run roots), since a config file chosen by a trigger, or one whose relative paths
    resolve in a directory it chose, would be its config."""
    where = "DAG params"
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(params).__name__}")
    unknown = sorted(str(k) for k in params if k not in ("config", "overrides", "project_dir"))
    if unknown:
        raise ConfigError(f"{where}: unknown param {shown(unknown[0])} (known: config, overrides, project_dir)")
    for key in ("config", "project_dir"):
        value = params.get(key)
        if not isinstance(value, str) or not value.strip() or len(value) > MAX_PATH_CHARS or "\0" in value:
            raise ConfigError(f"{where}: {key} must be a path of 1 to {MAX_PATH_CHARS} characters, got {shown(value)}")
    overrides = params.get("overrides", [])
    if not isinstance(overrides, list) or len(overrides) > MAX_OVERRIDES:
        raise ConfigError(
            f"{where}: overrides must be a list of at most {MAX_OVERRIDES} strings, got {shown(overrides)}"
        )
    for index, item in enumerate(overrides):
        if not isinstance(item, str) or len(item) > MAX_SET_CHARS or not _SET_RE.match(item):
            raise ConfigError(
                f"{where}: overrides[{index}] must be a key.path=value string of at most "
                f"{MAX_SET_CHARS:,} characters, got {shown(item)}"
            )
        check_trigger_override(item, f"{where}: overrides[{index}]")
    if not Path(params["project_dir"]).is_dir():
        raise ConfigError(f"{where}: project_dir {shown(params['project_dir'])} is not a directory")
    if trusted_dirs is not None:
        _check_trusted_place(
            params["project_dir"],
            params["config"],
            [Path(d).resolve() for d in trusted_dirs],
            [Path(d).resolve() for d in (config_dirs or trusted_dirs)],
            where,
        )
    return {"config": params["config"], "overrides": list(overrides), "project_dir": params["project_dir"]}


def _check_trusted_place(
    project_dir: str, config: str, trusted: list[Path], config_dirs: list[Path], where: str
) -> None:
    """project_dir one of the trusted directories, the config file inside one of config_dirs."""
    project = Path(project_dir).resolve()
    if project not in trusted:
        raise ConfigError(
            f"{where}: project_dir {shown(project_dir)} is not one this DAG trusts ({', '.join(map(str, trusted))})"
        )
    chosen = (project / config).resolve()
    if not any(chosen.is_relative_to(d) for d in config_dirs):
        raise ConfigError(
            f"{where}: config {shown(config)} lies outside the directories this DAG trusts "
            f"({', '.join(map(str, config_dirs))})"
        )


def _apply_override(raw: dict[str, Any], item: str, source: str, trusted: bool = True) -> str:
    """Set one key.path=value in raw; returns the key path. Untrusted: only trust.TRIGGER_KEYS."""
    if len(item) > MAX_SET_CHARS:
        raise ConfigError(f"--set {shown(item)}: longer than {MAX_SET_CHARS:,} characters")
    match = _SET_RE.match(item)
    if not match:
        raise ConfigError(f"--set {shown(item)}: expected key.path=value")
    key_path, value_text = match.group(1), match.group(2)
    if not trusted:
        check_trigger_override(item, f"{source}: DAG trigger override")
    keys, name = key_path.split("."), one_line(key_path, SHOWN_CHARS)
    value = None
    if value_text.strip():  # only blanks (a tab, say) is no value, and not YAML libyaml can scan
        value = parse_yaml(value_text, f"--set {name}")
        _refuse_yaml11_booleans(value_text, name)
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {name}: {one_line(key, SHOWN_CHARS)} is not a section (in {source})")
        node = child
    node[keys[-1]] = value
    return key_path


# Plain scalars YAML 1.1 (and so PyYAML) reads as booleans; YAML 1.2 and a reader of the command
# line see words. `--set mlflow.enabled=yes` was silently true: an override must say true or false.
_YAML11_BOOLEANS = {"yes", "no", "on", "off"}


def _refuse_yaml11_booleans(value_text: str, name: str) -> None:
    for event in yaml.parse(value_text, Loader=_YAML_LOADER):
        if isinstance(event, yaml.ScalarEvent) and not event.style and event.value.lower() in _YAML11_BOOLEANS:
            raise ConfigError(
                f"--set {name}: '{one_line(event.value, SHOWN_CHARS)}' is ambiguous (YAML 1.1 reads it as "
                f"a boolean); write true or false, or quote it for the word"
            )


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = sorted((str(k) for k in set(raw) - set(fields)), key=str)  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {one_line(prefix + unknown[0], SHOWN_CHARS)} (known: {', '.join(fields)})"
        )
    values = {}
    for name, value in raw.items():
        key, hint = prefix + name, hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value if value is not None else {}, key + ".", source)
        else:
            values[name] = _check_type(value, hint, key, source)
    return cls(**values)


def _check_type(value: Any, hint: Any, key: str, source: str) -> Any:
    """Return value coerced to hint (int -> float only), or raise naming the key."""
    if _matches(value, hint):
        return float(value) if hint is float and isinstance(value, int) else value
    raise ConfigError(f"{source}: {key} must be {describe_type(hint)}, got {type(value).__name__} {shown(value)}")


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def describe_type(hint: Any) -> str:
    """int | None -> 'int or null', list[str] -> 'a list of str': the words the errors and docs/config.md use."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arg) for arg in typing.get_args(hint))
    if origin is list:
        return f"a list of {describe_type(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a mapping"
    return {type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def validate(config: Config) -> None:
    """Checks that span fields or bound values; each names the key and the file."""
    src, m, t, o = config.source, config.model, config.train, config.outer

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{src}: {key} {why}")

    for key, allowed in ENUMS.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        need(value in allowed, key, f"must be one of {', '.join(allowed)}, got {shown(value)}")
    need(t.compile in (True, False, "auto"), "train.compile", f"must be true, false or auto, got {shown(t.compile)}")
    need(bool(config.run_root.strip()), "run_root", "must not be empty")
    need(".." not in Path(config.run_root.split("://")[-1]).parts, "run_root", "must not contain '..'")
    check_run_root(config.run_root, src)
    check_runner(config.beam.runner, config.beam.extra_runners, src)
    need(
        len(m.grid) >= 1 and all(k >= 1 for k in m.grid),
        "model.grid",
        "must be a non-empty list of positive module counts",
    )
    need(
        len(m.grid) <= MAX_LEVELS and config.n_paths <= MAX_PATHS,
        "model.grid",
        f"must have at most {MAX_LEVELS} levels and {MAX_PATHS:,} paths (the paper's largest grid has 256)",
    )
    need(
        len(m.blocks_per_level) == len(m.grid),
        "model.blocks_per_level",
        f"has {len(m.blocks_per_level)} levels but model.grid has {len(m.grid)}",
    )
    need(all(b >= 1 for b in m.blocks_per_level), "model.blocks_per_level", "entries must be >= 1")
    need(m.path_specific_blocks >= 0, "model.path_specific_blocks", f"must be >= 0, got {m.path_specific_blocks}")
    need(
        m.path_specific_blocks == 0 or t.workers_per_path == 1,
        "model.path_specific_blocks",
        "needs train.workers_per_path = 1 (a path's private blocks carry over its one trained copy, never averaged)",
    )
    need(m.hidden_size > 0 and m.num_heads > 0, "model.hidden_size", "and model.num_heads must be positive")
    need(m.hidden_size % m.num_heads == 0, "model.num_heads", f"must divide model.hidden_size ({m.hidden_size})")
    need(m.seq_len > config.router.prefix_tokens, "model.seq_len", "must exceed router.prefix_tokens")
    need(m.vocab_size > 0, "model.vocab_size", "must be positive")
    need(m.tokenizer != "hf" or bool(m.init_from), "model.tokenizer", "hf is a checkpoint's own: set model.init_from")
    need(m.init_config is None or bool(m.init_from), "model.init_config", "is written by dipaco for model.init_from")
    need(m.init_from is None or bool(m.init_from.strip()), "model.init_from", "must not be empty")
    need(m.init_round is None or m.init_round >= 0, "model.init_round", "must be >= 0 (or null: the newest round)")
    if m.tokenizer == "bpe":
        need(
            m.vocab_size >= 512,
            "model.vocab_size",
            f"must be >= 512 for a trained bpe tokenizer (256 bytes + merges), got {m.vocab_size}",
        )
        need(m.tokenizer_sample_docs >= 1, "model.tokenizer_sample_docs", "must be >= 1")
    need(config.router.prefix_tokens > 0, "router.prefix_tokens", "must be positive")
    if config.router.model_path is not None:
        from models.grid import parse_path_id

        try:
            parse_path_id(config.router.model_path, m.grid)
        except ValueError as exc:
            raise ConfigError(f"{src}: router.model_path: {one_line(str(exc), SHOWN_CHARS)}") from None
    blocks = sum(m.blocks_per_level) + m.path_specific_blocks
    need(
        -(blocks + 1) <= config.router.model_layer <= blocks,
        "router.model_layer",
        f"must name a hidden state of a path of {blocks} blocks: 0..{blocks} (or -1..-{blocks + 1} from the last), "
        f"got {config.router.model_layer}",
    )
    need(config.router.sample_docs > 0, "router.sample_docs", "must be positive")
    after = config.router.discriminative_after
    need(
        after is None or 0 <= after < t.rounds - 1,
        "router.discriminative_after",
        f"must be a round in [0, train.rounds - 1 = {t.rounds - 1}) so a later round trains on the new shards, "
        f"got {after}",
    )
    need(t.rounds >= 1, "train.rounds", "must be >= 1")
    need(t.inner_steps >= 1, "train.inner_steps", "must be >= 1")
    need(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    need(t.gradient_accumulation_steps >= 1, "train.gradient_accumulation_steps", "must be >= 1")
    need(t.lr > 0, "train.lr", "must be positive")
    need(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "must be within [0, 1]")
    need(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    need(
        t.lr_decay_steps is None or t.lr_decay_steps >= 1,
        "train.lr_decay_steps",
        "must be >= 1 (or null: every step after warmup)",
    )
    need(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", "must be two numbers in [0, 1)")
    need(t.procs_per_path >= 1, "train.procs_per_path", "must be >= 1")
    need(t.workers_per_path >= 1, "train.workers_per_path", "must be >= 1")
    if t.workers_schedule is not None:
        schedule = t.workers_schedule
        need(
            all(m >= 1 for m in schedule),
            "train.workers_schedule",
            f"needs at least 1 worker a round, got {min(schedule, default=1)}",
        )
        need(
            len(schedule) == t.rounds,
            "train.workers_schedule",
            f"has {len(schedule)} entries for {t.rounds} rounds (train.rounds): one a round",
        )
        need(
            max(schedule, default=0) == t.workers_per_path,
            "train.workers_schedule",
            f"its largest entry {max(schedule, default=0)} must "
            f"equal train.workers_per_path ({t.workers_per_path}): job ids are numbered up to it",
        )
    need(t.num_nodes >= 1, "train.num_nodes", "must be >= 1")
    need(t.num_nodes == 1 or t.hostfile is not None, "train.hostfile", "must be set when train.num_nodes > 1")
    need(t.hostfile is None or _is_file(t.hostfile), "train.hostfile", f"names a missing file {shown(t.hostfile)}")
    need(t.parallel_paths >= 1, "train.parallel_paths", "must be >= 1")
    need(t.max_attempts >= 1, "train.max_attempts", "must be >= 1")
    need(t.islands is None or t.islands >= 1, "train.islands", "must be >= 1 (or null: train.parallel_paths)")
    need(t.lease_seconds > 0, "train.lease_seconds", "must be > 0")
    need(
        t.backup_after is None or t.backup_after >= 1,
        "train.backup_after",
        "must be >= 1 (times the round's median task time), or null: no backup attempts",
    )
    need(
        t.checkpoint_every is None or t.checkpoint_every >= 1,
        "train.checkpoint_every",
        "must be >= 1 (inner steps), or null: no mid-task checkpoints",
    )
    need(t.keep_rounds is None or t.keep_rounds >= 1, "train.keep_rounds", "must be >= 1 (or null: keep every round)")
    need(_is_file(resolve_ds_config(t.ds_config)), "train.ds_config", f"names a missing file {shown(t.ds_config)}")
    need(o.lr > 0, "outer.lr", "must be positive")
    need(0 <= o.momentum < 1, "outer.momentum", "must be within [0, 1)")
    need(config.eval.batch_size >= 1, "eval.batch_size", "must be >= 1")
    need(
        config.eval.reroute_every is None or config.eval.reroute_every >= 1,
        "eval.reroute_every",
        "must be >= 1 (or null: route once by the prefix)",
    )
    need(config.airflow.rounds_per_run >= 1, "airflow.rounds_per_run", "must be >= 1")
    need(config.airflow.pool_slots >= 1, "airflow.pool_slots", "must be >= 1")
    need(config.airflow.retries >= 0, "airflow.retries", "must be >= 0")
    queues = config.airflow.queues
    need(
        queues is None or (bool(queues) and all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", q) for q in queues)),
        "airflow.queues",
        f"must be a non-empty list of Celery queue names (letters, digits, '_', '.', '-'), got {queues!r}",
    )
    need(queues is None or len(set(queues)) == len(queues), "airflow.queues", f"names a queue twice: {queues!r}")
    for key in ("train", "eval"):
        globs = getattr(config.data, key)
        need(globs is None or bool(globs), f"data.{key}", "must not be empty")


def _strip_internal(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {
            f.name: _strip_internal(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not f.metadata.get("internal")
        }
    if isinstance(obj, list):
        return [_strip_internal(v) for v in obj]
    return obj


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}: the form MLflow params and --set keys take."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:  # an empty mapping (storage.options: {}) is a value of its own
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
