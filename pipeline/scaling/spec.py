"""A sweep file and the points it names: the grid of sizes x replicas x hyper-parameters.

    base: configs/demo.yaml            # the run config every point starts from
    sweep_root: runs/sweep             # <sweep_root>/runs/<point id>/ is each point's run root
    set: {model.grid: [1]}             # config keys set for every point (flat, dotted)
    axes:                              # config keys (dotted) or `algorithm`, each a non-empty list
      algorithm: [sync, diloco]
      model.hidden_size: [32, 64]
      train.workers_per_path: [1, 2]   # M
      outer.lr: [0.4, 0.7]
    budget: {tokens_per_param: 20}     # or {steps: 200}: inner steps per worker
    quick: {axes: {...}, budget: {...}}  # --quick: replaces axes / budget / ..., merges `set`

`algorithm` turns M (the `train.workers_per_path` value) into a run of the pipeline:
- sync: data-parallel training at the same tokens per step: one worker accumulating M micro
  batches (train.gradient_accumulation_steps = M x the base's) and the identity outer step
  (lr 1, momentum 0, no Nesterov), so a merge hands the trained weights on unchanged;
- diloco: M workers (train.workers_per_path = M), each on its own part of the shard, merged by the
  outer optimizer of the point's `outer` section every H = train.inner_steps steps.
A sync point does not depend on the outer keys or H, so the sync points that differ only there are
one point (trained once, at the largest H of the sweep).

The budget fixes train.rounds. tokens_per_param: D = tokens_per_param x N tokens per path, N the
non-embedding parameters of one path (its decoder blocks: what a scaling law counts), as
D / tokens per step (micro batch x seq_len x accumulation x workers x ranks) inner steps per worker,
rounded so that the M workers' steps together are a multiple of lcm(H values) x lcm(M values) (each
lcm when it is at most 8 x the largest value, else the point's own): every point of one size trains
the same tokens whatever its algorithm, M and H, in whole rounds. steps: that many inner steps per
worker, rounded to a multiple of lcm(H values). rounds = steps / H. A point whose budget is less
than one round of its H (before rounding) is refused, naming its size and the budget.

Everything here is checked before torch loads: an unknown key or an empty axis is refused with one
line naming the key and the file, and every point's config is built and validated up front.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.bounds import SHOWN_CHARS, one_line, shown
from pipeline.core.config import Config, flatten, load_config, parse_yaml, read_config_text
from pipeline.core.errors import ConfigError

ALGORITHMS = ("sync", "diloco")
TOP_KEYS = ("base", "sweep_root", "set", "axes", "budget", "lanes", "fit", "mlflow", "quick")
QUICK_KEYS = ("sweep_root", "set", "axes", "budget", "lanes", "fit")
BUDGET_KEYS = ("tokens_per_param", "steps")
# keys a sweep decides itself: each point's run root, its rounds (the budget) and its tracking
DECIDED = {
    "run_root": "each point's run root is <sweep_root>/runs/<point id>",
    "train.rounds": "the budget decides train.rounds",
    "mlflow.enabled": "the sweep tracks its points itself (its own `mlflow` section)",
}
# keys the algorithm axis sets; a sync point ignores them (they are the identity outer step)
SYNC_IGNORES = ("outer.lr", "outer.momentum", "outer.nesterov", "train.inner_steps")
# short names in point ids; any other key is shown by its last part, without underscores
SHORT = {
    "model.hidden_size": "h",
    "train.workers_per_path": "m",
    "outer.lr": "olr",
    "train.lr": "lr",
    "train.inner_steps": "H",
    "model.blocks_per_level": "b",
    "model.num_heads": "nh",
    "train.seed": "s",
    "model.init_seed": "is",
    "outer.momentum": "mom",
    "train.micro_batch_size": "mb",
    "model.grid": "g",
}
MAX_ID_CHARS = 64
LCM_LIMIT = 8  # steps round to the lcm of the sweep's H (and M) values when it is at most this x the largest


@dataclass(frozen=True)
class FitOptions:
    bootstrap: int = 500  # bootstrap draws of each fit (confidence intervals)
    seed: int = 0  # the bootstrap's random draws
    tolerance: float = 0.02  # bits per byte: differences below it are noise (the sample's seed spread, 3.5-5%
    #                          perplexity in benchmarks/RESULTS.md, is 0.015-0.02 bits per byte)


@dataclass(frozen=True)
class TrackingOptions:
    enabled: bool = True
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<sweep_root>/mlflow.db
    experiment: str = "dipaco-sweep"


@dataclass(frozen=True)
class Sweep:
    source: str  # the sweep file
    base: str  # the base run config
    sweep_root: str
    settings: dict[str, Any]  # `set`: flat config key -> value, for every point
    axes: dict[str, list]  # axis -> values, in the file's order
    budget: dict[str, float]  # {"tokens_per_param": x} or {"steps": n}
    lanes: int = 1  # points trained at once (each its own islands); 1 with train.launcher: inprocess
    fit: FitOptions = field(default_factory=FitOptions)
    mlflow: TrackingOptions = field(default_factory=TrackingOptions)
    quick: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Point:
    id: str
    values: dict[str, Any]  # the axis values that name it (a sync point: without the keys it ignores)
    settings: dict[str, Any]  # every config key the sweep sets for it (rounds and run_root included)
    algorithm: str  # sync | diloco | run (no algorithm axis: the config as it is)
    M: int  # workers per path (diloco) or micro batches accumulated (sync)
    N: int  # non-embedding parameters of one path
    steps: int  # inner steps per worker, all rounds
    tokens: int  # tokens per path, all rounds
    config: Config = field(repr=False, compare=False)

    def hyper(self) -> dict[str, Any]:
        """The axis values a law minimises over: all but the algorithm, M and the model's shape."""
        return {
            k: v
            for k, v in self.values.items()
            if k not in ("algorithm", "train.workers_per_path") and not k.startswith("model.")
        }

    def summary(self) -> dict:
        return {
            "id": self.id,
            "algorithm": self.algorithm,
            "M": self.M,
            "N": self.N,
            "steps": self.steps,
            "tokens": self.tokens,
            "rounds": self.config.train.rounds,
            "inner_steps": self.config.train.inner_steps,
            "values": self.values,
            "settings": self.settings,
        }


# -- the file -------------------------------------------------------------------------------------
def load_sweep(path: str | Path, quick: bool = False, overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Read and check a sweep file; with `quick`, its `quick` section applied; `overrides`
    (`--set key=value`) join its `set`, for every point."""
    source = str(path)
    raw = parse_yaml(read_config_text(path), source)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a sweep file is a mapping (base, axes, budget, ...)")
    _known(raw, TOP_KEYS, "", source)
    if "base" not in raw or not isinstance(raw["base"], str) or not raw["base"].strip():
        raise ConfigError(f"{source}: base must name the run config every point starts from (e.g. configs/demo.yaml)")
    quick_raw = raw.get("quick") or {}
    if not isinstance(quick_raw, dict):
        raise ConfigError(f"{source}: quick must be a mapping of {', '.join(QUICK_KEYS)}")
    _known(quick_raw, QUICK_KEYS, "quick.", source)
    quick_set = _mapping(quick_raw, "set", source, "quick.")
    full = _parse(raw, source, set())
    merged = {**raw, **quick_raw, "set": {**_mapping(raw, "set", source), **quick_set}}
    small = _parse(merged, source, {*quick_raw, *(f"set.{k}" for k in quick_set)})  # checked always: a broken
    chosen = dataclasses.replace(small if quick else full, quick=quick)  # quick section is found before it is used
    extra = assignments(list(overrides), chosen, "--set")
    for key in extra:
        if key == "algorithm" or key in chosen.axes:
            raise ConfigError(f"--set {key}: an axis of the sweep; change its values in {source}")
    return dataclasses.replace(chosen, settings={**chosen.settings, **extra})


def _parse(raw: dict, source: str, from_quick: set[str]) -> Sweep:
    """The sweep of a (merged) mapping; `from_quick` names the keys the quick section gave, so a
    message names where the user wrote them."""

    def name(key: str) -> str:
        return f"quick.{key}" if key in from_quick or key.split(".")[0] in from_quick else key

    settings = _mapping(raw, "set", source)
    for key in settings:
        _config_key(key, name(f"set.{key}"), source)
    axes = _mapping(raw, "axes", source, "quick." if "axes" in from_quick else "")
    if not axes:
        raise ConfigError(f"{source}: {name('axes')}: name at least one axis (a config key and its values)")
    for key, values in axes.items():
        where = name(f"axes.{key}")
        if key != "algorithm":
            _config_key(key, where, source)
        if not isinstance(values, list):
            raise ConfigError(f"{source}: {where} must be a list of values, got {shown(values)}")
        if not values:
            raise ConfigError(f"{source}: {where} is empty: give at least one value")
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise ConfigError(f"{source}: {where} lists a value twice")
        bad = [v for v in values if v not in ALGORITHMS] if key == "algorithm" else []
        if bad:
            raise ConfigError(f"{source}: {where}: {shown(bad[0])} is not an algorithm (sync or diloco)")
        if key in settings:
            raise ConfigError(f"{source}: {key} is both an axis and in `set`: keep one")
    return Sweep(
        source=source,
        base=raw["base"],
        sweep_root=_text(raw.get("sweep_root", "runs/sweep"), name("sweep_root"), source),
        settings=settings,
        axes=axes,
        budget=_budget(raw.get("budget"), name("budget"), source),
        lanes=_count(raw.get("lanes", 1), name("lanes"), source),
        fit=_fit_options(raw.get("fit"), name("fit"), source),
        mlflow=_tracking_options(raw.get("mlflow"), source),
    )


def _known(raw: dict, keys: tuple[str, ...], where: str, source: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in keys)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {one_line(where + unknown[0], SHOWN_CHARS)} (known: {', '.join(keys)})"
        )


def _mapping(raw: dict, key: str, source: str, where: str = "") -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where}{key} must be a mapping of dotted config keys, got {shown(value)}")
    return {str(k): v for k, v in value.items()}


def _config_key(key: str, name: str, source: str) -> None:
    """A dotted key of the run config (docs/config.md) that the sweep lets a point choose."""
    if key not in CONFIG_KEYS:
        close = difflib.get_close_matches(key, sorted(CONFIG_KEYS), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else " (docs/config.md lists the keys)"
        raise ConfigError(f"{source}: {one_line(name, SHOWN_CHARS)}: not a config key{hint}")
    if key in DECIDED:
        raise ConfigError(f"{source}: {name}: a sweep cannot set it: {DECIDED[key]}")


def _budget(value: Any, where: str, source: str) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in BUDGET_KEYS:
        raise ConfigError(
            f"{source}: {where} must be one of {{tokens_per_param: X}} (tokens per "
            f"non-embedding parameter of a path) or {{steps: N}}, got {shown(value)}"
        )
    ((key, amount),) = value.items()
    ok = isinstance(amount, (int, float)) and not isinstance(amount, bool) and math.isfinite(amount) and amount > 0
    if not ok or (key == "steps" and not isinstance(amount, int)):
        raise ConfigError(
            f"{source}: {where}.{key} must be a positive {'integer' if key == 'steps' else 'number'}, "
            f"got {shown(amount)}"
        )
    return {key: amount}


def _count(value: Any, name: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{source}: {name} must be a positive integer, got {shown(value)}")
    return value


def _text(value: Any, name: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: {name} must be a path, got {shown(value)}")
    return value


def _section(value: Any, cls: type, name: str, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} must be a mapping, got {shown(value)}")
    _known(value, tuple(f.name for f in dataclasses.fields(cls)), f"{name}.", source)
    return value


def _fit_options(value: Any, name: str, source: str) -> FitOptions:
    value = _section(value, FitOptions, name, source)
    for key in ("bootstrap", "seed"):
        item = value.get(key, 0)
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ConfigError(f"{source}: {name}.{key} must be an integer >= 0, got {shown(item)}")
    tolerance = value.get("tolerance", 0.0)
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not 0 <= tolerance < math.inf:
        raise ConfigError(f"{source}: {name}.tolerance must be a number >= 0 (bits per byte), got {shown(tolerance)}")
    return FitOptions(**{**value, **({"tolerance": float(tolerance)} if "tolerance" in value else {})})


def _tracking_options(value: Any, source: str) -> TrackingOptions:
    value = _section(value, TrackingOptions, "mlflow", source)
    if not isinstance(value.get("enabled", True), bool):
        raise ConfigError(f"{source}: mlflow.enabled must be true or false, got {shown(value['enabled'])}")
    for key in ("tracking_uri", "experiment"):
        item = value.get(key, "x")
        if not (isinstance(item, str) and item.strip()) and not (key == "tracking_uri" and item is None):
            raise ConfigError(f"{source}: mlflow.{key} must be a non-empty string, got {shown(item)}")
    return TrackingOptions(**value)


CONFIG_KEYS = frozenset(flatten(Config().to_dict()))


# -- the points -----------------------------------------------------------------------------------
def expand(sweep: Sweep, fixed: dict[str, Any] | None = None, prefix: str = "") -> list[Point]:
    """Every point of the grid, in the file's order, each config built and validated; sync points
    that differ only in keys sync ignores are one point. `fixed` values replace their axes (or join
    every point, after the axes): the points a --verify holdout can be, checked before anything trains."""
    fixed = fixed or {}
    axes = {**sweep.axes, **{k: [v] for k, v in fixed.items() if k in sweep.axes}}
    extra = {k: v for k, v in fixed.items() if k not in axes}
    names, units = list(axes), sweep_units(sweep)
    points: dict[str, Point] = {}
    for combo in itertools.product(*(axes[n] for n in names)):
        point = make_point(sweep, {**dict(zip(names, combo)), **extra}, units, prefix)
        points.setdefault(point.id, point)
    return list(points.values())


@dataclass(frozen=True)
class Units:
    """The sweep's values of H and of M, which its budget's steps are whole multiples of."""

    h: tuple[int, ...]
    m: tuple[int, ...]


def sweep_units(sweep: Sweep) -> Units:
    base = build_config(sweep, sweep.settings, "<base>")
    return Units(
        h=tuple(sweep.axes.get("train.inner_steps", [base.train.inner_steps])),
        m=tuple(sweep.axes.get("train.workers_per_path", [base.train.workers_per_path])),
    )


def make_point(sweep: Sweep, values: dict[str, Any], units: Units | None = None, prefix: str = "") -> Point:
    """One point: its axis values turned into config keys (the algorithm's, then the budget's)."""
    units = units or sweep_units(sweep)
    algorithm = values.get("algorithm", "run")
    own = {k: v for k, v in values.items() if k != "algorithm"}
    named = {k: v for k, v in values.items() if algorithm != "sync" or k not in SYNC_IGNORES}
    point_id = prefix + point_name(named)
    first = build_config(sweep, {**sweep.settings, **own}, point_id)
    M = first.train.workers_per_path
    keys = dict(own)
    if algorithm == "sync":
        keys = {k: v for k, v in own.items() if k not in SYNC_IGNORES}
        keys.update(
            {
                "train.workers_per_path": 1,
                "train.gradient_accumulation_steps": M * first.train.gradient_accumulation_steps,
                "outer.lr": 1.0,
                "outer.momentum": 0.0,
                "outer.nesterov": False,
                "train.inner_steps": max(units.h),
            }
        )
    elif algorithm == "diloco":
        keys["train.workers_per_path"] = M
    config = build_config(sweep, {**sweep.settings, **keys}, point_id)
    n = non_embedding_params(config)
    check_one_round(sweep, config, n, named, point_id)
    steps = budget_steps(sweep, config, n, M, units)
    rounds = steps // config.train.inner_steps
    keys.update(
        {"train.rounds": rounds, "run_root": f"{sweep.sweep_root.rstrip('/')}/runs/{point_id}", "mlflow.enabled": False}
    )
    config = build_config(sweep, {**sweep.settings, **keys}, point_id)
    return Point(
        id=point_id,
        values=named,
        settings=keys,
        algorithm=algorithm,
        M=M,
        N=n,
        steps=steps,
        tokens=steps * tokens_per_step(config),
        config=config,
    )


def build_config(sweep: Sweep, keys: dict[str, Any], what: str) -> Config:
    """The base config with these keys set (as `--set` would), validated; errors name the point."""
    overrides = [f"{k}={_yaml(v)}" for k, v in keys.items()]
    try:
        return load_config(sweep.base, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{sweep.source}: point {what}: {exc}") from None


def _yaml(value: Any) -> str:
    """A value as `--set` reads it back: YAML flow style (PyYAML writes 1e-05 as 1.0e-05, which it
    reads as a float; JSON's 1e-05 would read back as a string)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20)
    return text.removesuffix("\n").removesuffix("\n...")


def point_name(values: dict[str, Any]) -> str:
    """A short, stable name from a point's values: `diloco_h64_m2_olr0.7_H25`; a long one keeps
    its first characters and gains a hash of all its values."""
    parts = []
    for key, value in values.items():
        label = "" if key == "algorithm" else SHORT.get(key, key.split(".")[-1].replace("_", ""))
        parts.append(label + _value_text(value))
    name = "_".join(re.sub(r"[^A-Za-z0-9.+-]", "", part) for part in parts) or "point"
    if len(name) > MAX_ID_CHARS:
        digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:8]
        name = f"{name[: MAX_ID_CHARS - 9]}_{digest}"
    return name


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "x".join(_value_text(v) for v in value)
    return str(value)


# -- sizes and budgets ----------------------------------------------------------------------------
def non_embedding_params(config: Config) -> int:
    """A path's parameters without the token embedding, the LM head and the final norm: its decoder
    blocks (attention 4 h^2, SwiGLU 3 h i, two norms 2 h each), the N of Kaplan et al.'s laws."""
    m = config.model
    intermediate = m.intermediate_size or 64 * -(-(8 * m.hidden_size // 3) // 64)  # as models.modular.ModelShape
    per_block = 4 * m.hidden_size**2 + 3 * m.hidden_size * intermediate + 2 * m.hidden_size
    return per_block * (sum(m.blocks_per_level) + m.path_specific_blocks)


def tokens_per_step(config: Config) -> int:
    """Tokens one path consumes per inner step, over its workers and each island's ranks."""
    t = config.train
    return (
        t.micro_batch_size
        * config.model.seq_len
        * t.gradient_accumulation_steps
        * t.workers_per_path
        * t.procs_per_path
        * t.num_nodes
    )


def budget_steps(sweep: Sweep, config: Config, n: int, m: int, units: Units) -> int:
    """Inner steps per worker for the budget, in whole rounds of every H of the sweep and, for a
    tokens budget, the same tokens at every M (module docstring)."""
    if "steps" in sweep.budget:
        unit = _unit(units.h, config.train.inner_steps)
        return unit * max(1, round(sweep.budget["steps"] / unit))
    worker_steps = sweep.budget["tokens_per_param"] * n * m / tokens_per_step(config)  # all M workers' steps
    unit = _unit(units.h, config.train.inner_steps) * _unit(units.m, m)
    return unit * max(1, round(worker_steps / unit)) // m


def _unit(values: tuple[int, ...], own: int) -> int:
    """The lcm of a sweep's values and the point's own (a holdout's asked H need not be one of
    them), unless it is over LCM_LIMIT x the largest: then the point's own."""
    values = (*values, own) if own not in values else values
    unit = math.lcm(*values)
    return own if unit > LCM_LIMIT * max(values) else unit


def steps_per_worker(sweep: Sweep, config: Config, n: int) -> float:
    """The budget's inner steps per worker before rounding to whole rounds."""
    if "steps" in sweep.budget:
        return float(sweep.budget["steps"])
    return sweep.budget["tokens_per_param"] * n / tokens_per_step(config)


def check_one_round(sweep: Sweep, config: Config, n: int, values: dict[str, Any], point_id: str) -> None:
    """A budget under one round of the point's H is refused, naming the size and the budget: rounding
    it up to a round would train a point on more tokens than the law it joins (or checks) assumes."""
    steps, h = steps_per_worker(sweep, config, n), config.train.inner_steps
    if steps >= h:
        return
    size = ", ".join(f"{k}={_value_text(v)}" for k, v in values.items() if k.startswith("model."))
    size = f"{size} (N = {n:,})" if size else f"N = {n:,}"
    budget = (
        f"steps {sweep.budget['steps']}"
        if "steps" in sweep.budget
        else f"tokens_per_param {sweep.budget['tokens_per_param']:g} ({sweep.budget['tokens_per_param'] * n:,.0f} "
        f"tokens per path)"
    )
    raise ConfigError(
        f"{sweep.source}: point {point_id}: {size} is too small for the budget: {budget} gives "
        f"{steps:.1f} inner steps per worker, less than one round of H = {h}; give a larger size or budget, "
        f"or a smaller train.inner_steps"
    )


def assignments(items: list[str], sweep: Sweep, flag: str = "--predict") -> dict[str, Any]:
    """`--predict key=value` (or `--set`) items: config keys (or `algorithm`), values as YAML."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{flag} {shown(item)}: expected key=value (e.g. model.hidden_size=128)")
        if key != "algorithm":
            _config_key(key, f"{flag} {key}", sweep.source)
        value = parse_yaml(text, f"{flag} {key}") if text.strip() else None
        if key == "algorithm" and value not in ALGORITHMS:
            raise ConfigError(f"{flag} algorithm: {shown(value)} is not sync or diloco")
        values[key] = value
    return values
