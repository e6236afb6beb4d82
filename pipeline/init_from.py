"""`model.init_from`: round 0 from a dense model instead of random weights (the papers warm-start).

Every source becomes a local Hugging Face directory first, so there is one way in (models/hf.py):

    /a/checkpoint             a save_pretrained directory: read where it lies
    models:/NAME@ALIAS        a version this project registered (its bundle is a miniature run root:
    models:/NAME/VERSION      pipeline.tracking.registry), downloaded, then read as a run root
    runs/dense                a dense run root (grid [1]): the path of model.init_round (default: its
                              newest modules) written out as pipeline.export does

`check` resolves the source and checks its config.json, the split of its layers, its safetensors
headers and its tokenizer without reading a weight; the CLI calls it before anything is written.
`init_modules` (stages.init_run) then writes round 0: every module of a level gets the same dense
weights, the tokenizer is the checkpoint's (committed under tokenizer/), and the outer momentum
starts at zero (the merge finds no buffers at round 0). `apply` copies the checkpoint's shape into
the config's model section; run.yaml records it, so no later stage resolves the source again.
"""

from __future__ import annotations

import atexit
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from models.grid import all_modules
from pipeline.core.config import MAX_CONFIG_BYTES, Config, ModelConfig, config_from_dict, parse_yaml
from pipeline.core.errors import ConfigError, InputError
from pipeline.state import layout
from pipeline.state.storage import RunRoot

if TYPE_CHECKING:  # models.modular and models.hf load torch and transformers: only what reads a checkpoint imports them
    from models.modular import ModelShape

log = logging.getLogger("dipaco")
_REGISTRY = re.compile(r"^models:/([^/@]+)(?:@([\w.-]+)|/(\d+))$")
_MATERIALISED: dict[tuple, Path] = {}  # source -> its local checkpoint, once per process


@dataclass(frozen=True)
class Source:
    """A resolved init_from: the local checkpoint directory and its config.json."""

    text: str
    directory: Path
    config: dict


def _temp_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def resolve(config: Config) -> Source:
    """init_from -> a local checkpoint directory with a supported config.json (InputError naming it otherwise)."""
    from models.hf import CheckpointError, read_config

    m = config.model
    text, where = m.init_from, f"{config.source}: model.init_from {m.init_from!r}"
    key = (text, m.init_round, config.mlflow.tracking_uri)
    try:
        if key not in _MATERIALISED:
            if text.startswith("models:/"):
                _MATERIALISED[key] = _from_run_root(_download_version(config, text, where), None, where)
            elif Path(text).is_dir() and (Path(text) / "config.json").is_file():
                _MATERIALISED[key] = Path(text)
            elif RunRoot(text).exists(layout.RUN_CONFIG):
                _MATERIALISED[key] = _from_run_root(RunRoot(text), m.init_round, where)
            else:
                raise InputError(f"{where}: neither a Hugging Face checkpoint (config.json) nor a run root (run.yaml)")
        directory = _MATERIALISED[key]
        return Source(text, directory, read_config(directory))
    except CheckpointError as exc:
        raise InputError(f"{where}: {exc}") from None


def _download_version(config: Config, text: str, where: str) -> RunRoot:
    """A registered version's bundle (a miniature run root), downloaded from the registry."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.uris import redact, tracking_uri

    match = _REGISTRY.match(text)
    if not match:
        raise ConfigError(f"{where}: a registry source is models:/NAME@ALIAS or models:/NAME/VERSION")
    name, alias, number = match.groups()
    uri = tracking_uri(config)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        # MLflow would create an empty store there (and say so on stderr) only to find nothing in it
        raise InputError(f"{where}: does not resolve in the registry at {redact(uri)} (no such store)")
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store's INFO lines are not the user's
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        version = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
        # the version's own storage location: a `models:/` URI would be looked up in the process's
        # default registry, not in this config's
        location = client.get_model_version_download_uri(name, version.version)
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=location, dst_path=str(_temp_dir("dipaco-init-")), tracking_uri=uri
        )
    except MlflowException as exc:
        raise InputError(
            f"{where}: does not resolve in the registry at {redact(uri)} ({str(exc).splitlines()[0][:200]})"
        ) from None
    bundles = sorted(Path(local).rglob("bundle.json"))
    if not bundles:
        raise InputError(f"{where}: version {version.version} holds no dipaco bundle (not registered by dipaco)")
    return RunRoot(str(bundles[0].parent))


def _from_run_root(root: RunRoot, round_index: int | None, where: str) -> Path:
    """A dense run root's path at a round, written out as a checkpoint directory (pipeline.export)."""
    from pipeline.export import export_path, newest_modules
    from pipeline.routing.tokenizer import load_tokenizer

    text = root.read_bytes(layout.RUN_CONFIG, max_bytes=MAX_CONFIG_BYTES)
    raw = parse_yaml(text, root.path(layout.RUN_CONFIG))
    if not isinstance(raw, dict):
        raise InputError(f"{root.path(layout.RUN_CONFIG)}: the top level must be a mapping of sections")
    raw["run_root"] = root.url
    raw.setdefault("train", {}).pop("ds_config", None)  # a bundle's template lies elsewhere; not needed here
    source = config_from_dict(raw, root.path(layout.RUN_CONFIG))
    if source.n_paths != 1:
        raise InputError(
            f"{where}: a run of {source.n_paths} paths; init_from takes a dense one (grid [1]): export it "
            f"(dipaco export) and start from one path's directory"
        )
    if round_index is None:  # a registered bundle: its round; a run root: its newest modules
        round_index = root.read_json("bundle.json")["round"] if root.exists("bundle.json") else newest_modules(root)
    if not root.is_committed(layout.modules_dir(round_index)):
        raise InputError(f"{where}: round {round_index}'s modules are not committed in {root.path()}")
    out = _temp_dir("dipaco-init-") / "p0"
    export_path(root, source, round_index, "p0", out, load_tokenizer(root, source.model.tokenizer))
    return out


def check(config: Config) -> ModelShape:
    """Everything init_from can refuse, before anything is loaded or written: the source, its
    architecture, the split of its layers, its safetensors headers, its tokenizer."""
    from models.hf import CheckpointError, check_checkpoint, checkpoint_shape

    source = resolve(config)
    where = f"{config.source}: model.init_from {source.directory}"
    try:
        shape = checkpoint_shape(
            source.config, config.model.blocks_per_level, config.model.path_specific_blocks, config.model.seq_len, where
        )
        check_checkpoint(source.directory, shape)
    except CheckpointError as exc:
        raise InputError(str(exc) if str(exc).startswith(config.source) else f"{where}: {exc}") from None
    if not (source.directory / "tokenizer.json").is_file():
        raise InputError(f"{where}: no tokenizer.json: the checkpoint's own (fast) tokenizer is needed")
    return shape


def apply(model: ModelConfig, checkpoint: dict) -> None:
    """The model section as the checkpoint shapes it (what run.yaml records): its config.json, its
    tokenizer, its dimensions in the fields the rest of the pipeline reads."""
    model.init_config = checkpoint
    model.tokenizer = "hf"
    model.hidden_size = checkpoint["hidden_size"]
    model.num_heads = checkpoint["num_attention_heads"]
    model.intermediate_size = checkpoint["intermediate_size"]
    model.vocab_size = checkpoint["vocab_size"]


def adopt_recorded(config: Config, root: RunRoot) -> None:
    """A run already initialised from a checkpoint: take the shape its run.yaml records (the source
    need not be reachable any more)."""
    if config.model.init_from and config.model.init_config is None and root.exists(layout.RUN_CONFIG):
        recorded = layout.read_run_config(root).model
        if recorded.init_from == config.model.init_from and recorded.init_config:
            apply(config.model, recorded.init_config)


def init_modules(config: Config, root: RunRoot) -> bool:
    """Round 0 from the checkpoint, unless committed: the tokenizer, then every module of every
    level from the same dense weights (private modules from the checkpoint's last layers). True when it wrote."""
    from models.hf import checkpoint_to_modules, load_checkpoint
    from pipeline.routing.tokenizer import commit_hf
    from pipeline.state.module_store import write_states

    if root.is_committed(layout.modules_dir(0)):
        return False
    shape = check(config)
    source = resolve(config)
    if not root.is_committed(layout.TOKENIZER_DIR):
        root.remove(layout.TOKENIZER_DIR)
        commit_hf(root, source.directory)
    levels = checkpoint_to_modules(shape, load_checkpoint(source.directory, shape))
    keys = all_modules(config.model.grid, private=shape.path_blocks > 0)
    states = {key: {k: v.clone() for k, v in levels[key.level].items()} for key in keys}
    info = {"round": 0, "grid": list(config.model.grid), "init_from": config.model.init_from}
    write_states(root, layout.modules_dir(0), states, info)
    log.info("initialised round 0 from %s: %d modules", config.model.init_from, len(keys))
    return True
