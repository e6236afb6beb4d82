"""Discriminative re-routing (`router.discriminative_after: R`; DiPaCo §2.4.2), not to be confused
with evaluation's test-time `eval.reroute_every`.

k-means pre-shards by the prefix embedding alone; DiPaCo then refines the routing with what the
paths learned: after round R's merge, each document of a sample of the training set is scored by
every path (the modules round R+1 starts from), labelled with its lowest-loss path, and a linear
classifier from the same prefix embedding to that label becomes the router. The Beam job re-shards
the training and validation splits with it, and the rounds after R train (and are evaluated) on
the new shards:

    reroute/round=<R+1>/router/     router.json ("kind": "discriminative"), classifier.npy, the
                                    embedder's files; _SUCCESS
    reroute/round=<R+1>/shards/     as shards/ (path=<id>/, validation/, rejected/, manifest.json)
    reroute/round=<R+1>/report.json held-out accuracy, documents that changed path, perplexity of
                                    round R+1's modules on the old and the new validation shards

Each piece is committed on its own and reused by a rerun; report.json, written last, marks the
re-routing done. The classifier is pipeline.routing.discriminative. The re-sharding is the
Beam job's (preprocessing.prepare.reshard), which this layer may not import: the callers at the
top (pipeline.stages, pipeline.island_rank) pass it in as `reshard`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from models.grid import all_path_ids
from models.modular import ModelShape
from pipeline.core.config import Config
from pipeline.core.errors import InputError
from pipeline.evaluation.evaluate import bits_per_byte, document_losses, evaluate_path
from pipeline.routing.discriminative import balancing_biases, fit_classifier, lowest_loss_labels
from pipeline.routing.router import FORMAT_VERSION, DiscriminativeRouter, Router
from pipeline.routing.tokenizer import load_tokenizer, prefix_texts
from pipeline.state import layout
from pipeline.state.module_store import load_path_model
from pipeline.state.shards import read_path_doc_ids, read_path_rows
from pipeline.state.storage import RunRoot

log = logging.getLogger(__name__)
HELDOUT_FRACTION = 0.2  # of the sample: scored for the report, never fitted
# The Beam job that routes both splits with a router into routing.shards and commits them;
# preprocessing.prepare.reshard, passed in from the top of the pipeline.
Reshard = Callable[[Config, RunRoot, Router, layout.Routing], dict]


# -- the sample and its labels ---------------------------------------------------------------------
def sample_documents(root: RunRoot, config: Config) -> list[tuple[str, str, np.ndarray]]:
    """(k-means path, doc_id, tokens) of a seeded uniform sample of `router.sample_docs` training
    documents, read from the committed k-means shards (every document there was accepted and
    tokenized), ordered by sample key; memory holds the sample, its tokens copied out of the parts
    that shards.DECODED shares (a view would keep a whole part alive)."""
    n, seed = config.router.sample_docs, config.router.seed
    kept: list[tuple[str, str, int, str, np.ndarray]] = []
    for path_id in all_path_ids(config.model.grid):
        for i, (doc_id, tokens) in enumerate(read_path_rows(root, path_id, "train", layout.SHARDS_DIR)):
            key = hashlib.sha256(f"{seed}\0{doc_id}".encode("utf-8", "surrogatepass")).hexdigest()
            kept.append((key, path_id, i, doc_id, tokens.copy()))
        kept = sorted(kept, key=lambda k: k[:3])[:n]
    return [(path_id, doc_id, tokens) for _, path_id, _, doc_id, tokens in kept]


def path_losses(root: RunRoot, config: Config, round_index: int, docs: list[np.ndarray]) -> np.ndarray:
    """(n_docs, n_paths) summed nats of each document under each path of round r's modules, over
    the tokens evaluation scores (after the prefix, within seq_len + 1)."""
    m = config.model
    columns = []
    for path_id in all_path_ids(m.grid):
        model = load_path_model(root, config, round_index, path_id)
        columns.append(
            document_losses(
                model,
                docs,
                config.router.prefix_tokens,
                m.seq_len,
                config.eval.batch_size,
                pad_id=ModelShape.from_config(m).eos_id,
            )
        )
    return np.stack(columns, axis=1)


def prefix_features(root: RunRoot, config: Config, kmeans_router: Router, docs: list[np.ndarray]) -> np.ndarray:
    """The k-means router's features of each document: its embedder on the text of the first
    prefix_tokens tokens, exactly as TokenizeDocs and EmbedPrefix compute them in the Beam job."""
    tokenizer = load_tokenizer(root, config.model.tokenizer)
    prefixes = prefix_texts([d.tolist() for d in docs], config.router.prefix_tokens, tokenizer)
    return kmeans_router.embed_prefixes(prefixes)


# -- fit and commit ----------------------------------------------------------------------------------
def fit_router(config: Config, root: RunRoot, after_round: int) -> DiscriminativeRouter:
    """Sample, score under every path of round R+1, label, fit on part of the sample, measure on
    the rest, balance; commits reroute/round=<R+1>/router/."""
    r, grid = config.router, config.model.grid
    routing = layout.reroute_routing(after_round + 1)
    start = time.time()
    kmeans_router = Router.load(root, config)
    sample = sample_documents(root, config)
    losses = path_losses(root, config, after_round + 1, [tokens for _, _, tokens in sample])
    scored = np.flatnonzero(~np.isnan(losses).any(1))  # documents with a token after the prefix
    if len(scored) < 2:
        raise InputError(
            f"{root.path(layout.SHARDS_DIR)}: discriminative routing needs at least 2 sampled training "
            f"documents longer than router.prefix_tokens, found {len(scored)}"
        )
    sample = [sample[i] for i in scored]
    labels = lowest_loss_labels(losses[scored])
    features = prefix_features(root, config, kmeans_router, [tokens for _, _, tokens in sample])
    order = np.random.default_rng(r.seed).permutation(len(sample))
    n_held = int(len(sample) * HELDOUT_FRACTION)
    held, fit = order[:n_held], order[n_held:]
    weights = fit_classifier(features[fit], labels[fit], len(kmeans_router.path_ids), r.seed)
    logits = features @ weights[:, :-1].T + weights[:, -1][None, :]
    bias = balancing_biases(logits, r.balanced, r.capacity_factor)
    routed = (bias[None, :] - logits).argmin(1)
    path_ids = kmeans_router.path_ids
    kmeans_paths = np.array([path_ids.index(p) for p, _, _ in sample])
    header = {
        "format": FORMAT_VERSION,
        "kind": "discriminative",
        **{
            k: kmeans_router.header[k]
            for k in ("embedder", "dim", "prefix_tokens", "tokenizer", "model_round", "model_path", "model_layer")
            if k in kmeans_router.header
        },
        "grid": list(grid),
        "path_ids": path_ids,
        "path_bias": bias.tolist(),
        "balanced": bool(r.balanced),
        "capacity_factor": r.capacity_factor,
        "seed": r.seed,
        "after_round": after_round,
        "modules_round": after_round + 1,
        "features_router": kmeans_router.checksum,  # the k-means router whose embedder gives the features
        "sample_docs": len(sample),
        "fit_docs": len(fit),
        "heldout_docs": len(held),
        # routed = with the balancing biases (what the shards get); classifier = its argmax alone
        "heldout_accuracy": _accuracy(routed[held], labels[held]),
        "classifier_heldout_accuracy": _accuracy(logits[held].argmax(1), labels[held]),
        "fit_accuracy": _accuracy(routed[fit], labels[fit]),
        "label_counts": {p: int(n) for p, n in zip(path_ids, np.bincount(labels, minlength=len(path_ids)))},
        "kmeans_agreement": _accuracy(kmeans_paths, labels),  # sampled documents whose best path is their k-means one
    }
    router = DiscriminativeRouter(header, weights, root=root, config=config, directory=routing.router)
    root.remove(routing.router)  # a crashed fit's leftovers
    router.save(root, kmeans_router.embedder if hasattr(kmeans_router.embedder, "save") else None, routing.router)
    log.info(
        "reroute: %d sampled documents labelled by %d paths of round %d; classifier held-out accuracy %s "
        "(%s with balancing); committed %s in %.1fs",
        len(sample),
        len(path_ids),
        after_round + 1,
        header["classifier_heldout_accuracy"],
        header["heldout_accuracy"],
        root.path(routing.router),
        time.time() - start,
    )
    return Router.load(root, config, directory=routing.router)


def _accuracy(predicted: np.ndarray, labels: np.ndarray) -> float | None:
    return float(np.mean(predicted == labels)) if len(labels) else None


# -- re-shard and report -----------------------------------------------------------------------------
def reroute(config: Config, after_round: int, reshard: Reshard) -> dict:
    """Fit the discriminative router after round R, re-shard both splits with it (`reshard`, the
    Beam job), write the report; what is committed already is reused, and a written report
    returns at once."""
    root = RunRoot(config.run_root)
    routing, report_rel = layout.reroute_routing(after_round + 1), layout.reroute_report(after_round + 1)
    if root.exists(report_rel):
        return root.read_json(report_rel)
    if not root.is_committed(layout.round_dir(after_round)):
        raise InputError(
            f"{root.path(layout.round_dir(after_round))}: round {after_round} has not merged; "
            f"router.discriminative_after={after_round} re-routes after it"
        )
    start = time.time()
    router = (
        Router.load(root, config, directory=routing.router)
        if root.is_committed(routing.router)
        else fit_router(config, root, after_round)
    )
    if not root.is_committed(routing.shards):
        reshard(config, root, router, routing)
    report = build_report(config, root, after_round, router)
    report["seconds"] = round(time.time() - start, 3)
    root.write_json(report_rel, report)  # last: the re-routing is done
    log.info(
        "reroute after round %d: %d of %d training documents changed path; perplexity of round %d's modules "
        "%.3f on the k-means validation shards, %.3f on the new ones",
        after_round,
        report["changed"],
        report["documents"],
        after_round + 1,
        report["perplexity_before"] or math.nan,
        report["perplexity_after"] or math.nan,
    )
    return report


def build_report(config: Config, root: RunRoot, after_round: int, router: Router) -> dict:
    """Accuracy, documents that changed path (by split) and routed perplexity before and after."""
    routing = layout.reroute_routing(after_round + 1)
    header = router.header
    changed = {
        split: changed_documents(root, config, layout.SHARDS_DIR, routing.shards, split)
        for split in ("train", "validation")
    }
    before = routed_score(config, after_round + 1, layout.SHARDS_DIR)
    after = routed_score(config, after_round + 1, routing.shards)
    return {
        "after_round": after_round,
        "round": after_round + 1,
        "router": routing.router,
        "shards": routing.shards,
        "accuracy": header["heldout_accuracy"],
        "classifier_accuracy": header["classifier_heldout_accuracy"],
        "fit_accuracy": header["fit_accuracy"],
        "sample_docs": header["sample_docs"],
        "heldout_docs": header["heldout_docs"],
        "kmeans_agreement": header["kmeans_agreement"],
        "label_counts": header["label_counts"],
        "changed": changed["train"]["changed"],
        "documents": changed["train"]["documents"],
        "changed_fraction": changed["train"]["fraction"],
        "changed_by_split": changed,
        "perplexity_before": before["perplexity"],
        "perplexity_after": after["perplexity"],
        "bits_per_byte_before": before["bits_per_byte"],
        "bits_per_byte_after": after["bits_per_byte"],
        "eval_tokens_before": before["tokens"],
        "eval_tokens_after": after["tokens"],
    }


def changed_documents(root: RunRoot, config: Config, old: str, new: str, split: str) -> dict:
    """Documents of a split whose path differs between two routings (a document id counted as
    often as it occurs, so duplicates are neither lost nor doubled)."""
    paths = all_path_ids(config.model.grid)
    before = Counter((d, p) for p in paths for d in read_path_doc_ids(root, p, split, old))
    after = Counter((d, p) for p in paths for d in read_path_doc_ids(root, p, split, new))
    total = sum(before.values())
    same = sum(min(n, after[key]) for key, n in before.items())
    return {"documents": total, "changed": total - same, "fraction": (total - same) / total if total else None}


def routed_score(config: Config, round_index: int, shards: str) -> dict:
    """Routed perplexity and bits per byte of round r's modules on the validation shards under
    `shards` (every path scoring the held-out documents routed to it)."""
    nll, tokens, n_bytes = 0.0, 0, 0
    for path_id in all_path_ids(config.model.grid):
        part = evaluate_path(config, round_index, path_id, shards=shards)
        if part:
            nll, tokens, n_bytes = nll + part["nll"], tokens + part["tokens"], n_bytes + part["bytes"]
    return {
        "perplexity": math.exp(nll / tokens) if tokens else None,
        "bits_per_byte": bits_per_byte(nll, n_bytes),
        "tokens": tokens,
    }
