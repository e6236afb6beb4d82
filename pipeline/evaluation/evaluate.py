"""Routed perplexity and bits per byte: each held-out document scored by the path its prefix routes to.

The prepare job already routed the validation split with the training router
(`shards/validation/path=<id>/`), so evaluation reads each path's held-out documents and scores
them with that path's model at the start of round r. As in the DiPaCo paper, the first
`router.prefix_tokens` tokens are context only: every token after them is scored, for every model
(dense baselines included), so all numbers are over the same tokens. Documents longer than
`model.seq_len + 1` tokens are scored on their first `seq_len + 1` tokens.

Token perplexity cannot be compared across tokenizers (a 4k-id BPE cuts the same text into more,
easier tokens than GPT-2's 50k), so every result also reports **bits per UTF-8 byte** over exactly
the scored text: the summed negative log-likelihood in bits divided by the bytes the scored tokens
stand for (`pipeline.routing.tokenizer.token_byte_lengths`).

**Re-routing** (`eval.reroute_every: N`, DiPaCo's test-time routing of 64-token chunks): after the
prefix a document is scored in chunks of N tokens. Chunk 0 is scored by the path its prefix routed
it to (the shard it sits in); chunk k > 0 by the path the router picks for the text of the N tokens
before it. Every token keeps the document's whole context within the window, so each path model
scores the per-token NLL of the documents it has a chunk in and the chunks pick their path's
tokens; the scored text, its bytes and tokens are those of routing once. The chunks' paths are
routed once and committed under `eval/reroute/every=N/` (the router never changes within a run),
so every round and every island's per-path task reads the same routes.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F

from models.grid import all_path_ids
from models.modular import EOS_TOKEN_ID, ModelShape
from pipeline.core.config import Config
from pipeline.core.errors import CorruptStateError
from pipeline.evaluation.early_stopping import write_best
from pipeline.routing.tokenizer import load_tokenizer, token_byte_lengths
from pipeline.state import layout
from pipeline.state.module_store import load_path_model
from pipeline.state.shards import read_path_documents, shard_parts
from pipeline.state.storage import SUCCESS, RunRoot

log = logging.getLogger("dipaco.eval")
ROUTES_FILE = "routes.json"


@torch.no_grad()
def score_documents(
    model: torch.nn.Module,
    docs: list[np.ndarray],
    prefix: int,
    seq_len: int,
    batch_size: int,
    pad_id: int = EOS_TOKEN_ID,
) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens scored) over the tokens after each prefix."""
    model.eval()
    nll, count = 0.0, 0
    for logits, targets in _scored_batches(model, scored_windows(docs, prefix, seq_len), prefix, batch_size, pad_id):
        nll += F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
        ).item()
        count += int((targets != -100).sum())
    return nll, count


@torch.no_grad()
def document_losses(
    model: torch.nn.Module,
    docs: list[np.ndarray],
    prefix: int,
    seq_len: int,
    batch_size: int,
    pad_id: int = EOS_TOKEN_ID,
) -> np.ndarray:
    """(n_docs,) summed nats over the tokens score_documents scores in each document; NaN for a
    document with no token after its prefix (discriminative routing labels documents by this)."""
    model.eval()
    losses = np.full(len(docs), np.nan)
    kept = [i for i, d in enumerate(docs) if len(d) > prefix]
    windows = scored_windows(docs, prefix, seq_len)  # the documents of `kept`, in order
    row = 0
    for logits, targets in _scored_batches(model, windows, prefix, batch_size, pad_id):
        per_token = F.cross_entropy(
            logits.transpose(1, 2).float(), targets, ignore_index=-100, reduction="none"
        )  # (B, T)
        for value in per_token.sum(1).tolist():
            losses[kept[row]] = value
            row += 1
    return losses


def _scored_batches(model: torch.nn.Module, windows: list[np.ndarray], prefix: int, batch_size: int, pad_id: int):
    """(logits (B, T, V), targets (B, T)) per batch of windows; target -100 is not scored."""
    for start in range(0, len(windows), batch_size):
        inputs, mask, targets = _batch(windows[start : start + batch_size], prefix, pad_id)
        yield model(input_ids=inputs, attention_mask=mask).logits, targets  # (B, T, V), (B, T)


@torch.no_grad()
def token_nlls(
    model: torch.nn.Module, windows: list[np.ndarray], prefix: int, batch_size: int, pad_id: int = EOS_TOKEN_ID
) -> list[np.ndarray]:
    """Per-token negative log-likelihood (nats, float64) of tokens prefix.. of each window (each
    longer than the prefix): what re-routing picks its chunks' scores from."""
    model.eval()
    out = []
    for index, (logits, targets) in enumerate(_scored_batches(model, windows, prefix, batch_size, pad_id)):
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none")
        nll = nll.view(targets.shape).double()  # (B, T); target j is token j+1
        batch = windows[index * batch_size : (index + 1) * batch_size]
        out += [nll[row, prefix - 1 : len(window) - 1].numpy() for row, window in enumerate(batch)]
    return out


def _batch(batch: list[np.ndarray], prefix: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, attention mask, targets) of right-padded windows; targets -100 where not scored."""
    width = max(len(d) for d in batch) - 1
    inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
    targets = torch.full((len(batch), width), -100, dtype=torch.long)  # -100: not scored
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, doc in enumerate(batch):
        tokens = torch.tensor(doc, dtype=torch.long)  # a copy: the shard's arrays are shared, read-only
        n = len(tokens) - 1
        inputs[row, :n], mask[row, :n] = tokens[:-1], 1
        targets[row, prefix - 1 : n] = tokens[prefix:]  # target j is token j+1: score tokens >= prefix
    return inputs, mask, targets


def scored_windows(docs: list[np.ndarray], prefix: int, seq_len: int) -> list[np.ndarray]:
    """The part of each document a model sees: its first seq_len + 1 tokens, if any follow the prefix."""
    return [d[: seq_len + 1] for d in docs if len(d) > prefix]


def scored_bytes(docs: list[np.ndarray], prefix: int, seq_len: int, byte_lengths: np.ndarray) -> int:
    """UTF-8 bytes of exactly the text score_documents scores: tokens prefix..seq_len of each window."""
    return int(
        sum(byte_lengths[np.asarray(d[prefix:], dtype=np.int64)].sum() for d in scored_windows(docs, prefix, seq_len))
    )


def bits_per_byte(nll_nats: float, n_bytes: int) -> float | None:
    return nll_nats / math.log(2) / n_bytes if n_bytes else None


def evaluate_path(config: Config, round_index: int, path_id: str, shards: str | None = None) -> dict | None:
    """One path's held-out score with the modules at the start of round r (an island's eval task):
    summed nats, tokens and bytes as well as the rates, so paths combine exactly; None when the
    path has no held-out document long enough to score. The held-out documents are those routed
    to the path by round r's routing (layout.routing), or by the one whose shards are `shards`
    (scored route-once); with eval.reroute_every, round r's routing re-routes their chunks."""
    if config.eval.reroute_every is not None and shards is None:
        return evaluate_rerouted_path(config, round_index, path_id)
    root = RunRoot(config.run_root)
    prefix, seq_len, m = config.router.prefix_tokens, config.model.seq_len, config.model
    shards = shards or layout.routing(config.router.discriminative_after, round_index).shards
    if not shard_parts(root, path_id, split="validation", shards=shards):
        return None
    docs = held_out_documents(root, config, path_id, shards)
    model = load_path_model(root, config, round_index, path_id)
    nll, tokens = score_documents(
        model, docs, prefix, seq_len, config.eval.batch_size, pad_id=ModelShape.from_config(m).eos_id
    )
    if not tokens:
        return None
    n_bytes = scored_bytes(docs, prefix, seq_len, _byte_lengths(root, m.tokenizer, m.vocab_size))
    return {
        "perplexity": math.exp(nll / tokens),
        "bits_per_byte": bits_per_byte(nll, n_bytes),
        "tokens": tokens,
        "bytes": n_bytes,
        "docs": len(docs),
        "nll": nll,
    }


def held_out_documents(
    root: RunRoot, config: Config, path_id: str, shards: str = layout.SHARDS_DIR
) -> list[np.ndarray]:
    """The held-out documents a path's prefix routed to it (in `shards`), up to eval.max_docs, in a fixed order."""
    return read_path_documents(root, path_id, split="validation", shards=shards)[: config.eval.max_docs]


def _byte_lengths(root: RunRoot, tokenizer: str, vocab_size: int) -> np.ndarray:
    return token_byte_lengths(load_tokenizer(root, tokenizer), vocab_size)


def chunk_spans(n_scored: int, every: int) -> list[tuple[int, int]]:
    """[begin, end) offsets, into a window's scored tokens, of its chunks of `every` tokens."""
    return [(begin, min(begin + every, n_scored)) for begin in range(0, n_scored, every)]


def chunk_routes(config: Config, root: RunRoot, routing: layout.Routing = layout.KMEANS) -> dict[str, list[list[str]]]:
    """{home path: [the path of each chunk of each held-out document]}, documents in
    held_out_documents' order; read from eval/reroute/every=N/ when committed for this router and
    these settings, else routed and committed (deterministic, so islands racing to commit it
    write the same bytes)."""
    from pipeline.routing.router import Router

    every = config.eval.reroute_every
    rel = layout.eval_routes_dir(every, routing)
    router = Router.load(root, config, directory=routing.router)
    settings = {
        "reroute_every": every,
        "router": router.checksum,
        "prefix_tokens": config.router.prefix_tokens,
        "seq_len": config.model.seq_len,
        "max_docs": config.eval.max_docs,
    }
    if root.is_committed(rel):
        stored = root.read_committed_json(rel, ROUTES_FILE)
        if all(stored.get(k) == v for k, v in settings.items()):
            return _checked_routes(stored.get("paths"), config.model.grid, root.path(rel, ROUTES_FILE))
        root.remove(f"{rel}/{SUCCESS}")  # routed for other settings: uncommitted before it is replaced
    routes = route_chunks(config, root, router, routing.shards)
    root.write_json(f"{rel}/{ROUTES_FILE}", {**settings, "paths": routes})
    root.commit(rel, info={"reroute_every": every, "chunks": sum(len(c) for docs in routes.values() for c in docs)})
    return routes


def route_chunks(config: Config, root: RunRoot, router, shards: str = layout.SHARDS_DIR) -> dict[str, list[list[str]]]:
    """Chunk 0 of a document stays on its home path (its prefix's route, so route-once and
    re-routing agree on it); chunk k > 0 goes where the router sends the N tokens before it."""
    every, prefix, seq_len = config.eval.reroute_every, config.router.prefix_tokens, config.model.seq_len
    routes: dict[str, list[list[str]]] = {}
    pending: list[tuple[str, int, int]] = []  # (home, document, chunk) of each chunk to route
    runs: list[np.ndarray] = []
    for home in all_path_ids(config.model.grid):
        if not shard_parts(root, home, split="validation", shards=shards):
            continue
        routes[home] = []
        for index, doc in enumerate(held_out_documents(root, config, home, shards)):
            window = doc[: seq_len + 1]
            spans = chunk_spans(max(0, len(window) - prefix), every)
            routes[home].append([home] * len(spans))
            for k, (begin, _) in enumerate(spans[1:], start=1):
                pending.append((home, index, k))
                runs.append(window[prefix + begin - every : prefix + begin])
    for (home, index, k), path_id in zip(pending, router.route_tokens(runs) if runs else []):
        routes[home][index][k] = path_id
    log.info(
        "re-routing every %d tokens: %d held-out chunks routed, %d off their document's path",
        every,
        sum(len(c) for docs in routes.values() for c in docs),
        sum(p != home for home, docs in routes.items() for c in docs for p in c),
    )
    return routes


def _checked_routes(paths, grid: list[int], where: str) -> dict[str, list[list[str]]]:
    """A committed routes file as route_chunks writes it, or CorruptStateError naming the file."""
    known = set(all_path_ids(grid))
    if not (
        isinstance(paths, dict)
        and set(paths) <= known
        and all(
            isinstance(docs, list) and all(isinstance(c, list) and all(p in known for p in c) for c in docs)
            for docs in paths.values()
        )
    ):
        raise CorruptStateError(f"{where}: paths must map path ids to lists of chunk path ids per document")
    return paths


def evaluate_rerouted_path(config: Config, round_index: int, path_id: str) -> dict | None:
    """One path's part of a re-routed evaluation: the chunks routed to it, over every held-out
    document, each token scored with the document's whole context before it (within the window);
    None when no chunk is routed to it."""
    root = RunRoot(config.run_root)
    prefix, seq_len, every, m = (
        config.router.prefix_tokens,
        config.model.seq_len,
        config.eval.reroute_every,
        config.model,
    )
    routing = layout.routing(config.router.discriminative_after, round_index)
    windows, picks = [], []  # the documents with a chunk here (cut after its last one), and those chunks
    for home, doc_routes in chunk_routes(config, root, routing).items():
        docs = held_out_documents(root, config, home, routing.shards)
        if len(docs) != len(doc_routes):
            raise CorruptStateError(
                f"{root.path(layout.eval_routes_dir(every, routing), ROUTES_FILE)}: {len(doc_routes)} documents "
                f"routed for {home}, its held-out shard has {len(docs)}; delete the directory to re-route"
            )
        for doc, chunks in zip(docs, doc_routes):
            window = doc[: seq_len + 1]
            spans = [span for span, p in zip(chunk_spans(max(0, len(window) - prefix), every), chunks) if p == path_id]
            if spans:
                windows.append(window[: prefix + spans[-1][1]])
                picks.append(spans)
    if not windows:
        return None
    model = load_path_model(root, config, round_index, path_id)
    nlls = token_nlls(model, windows, prefix, config.eval.batch_size, pad_id=ModelShape.from_config(m).eos_id)
    byte_lengths = _byte_lengths(root, m.tokenizer, m.vocab_size)
    nll, tokens, n_bytes = 0.0, 0, 0
    for window, doc_nll, spans in zip(windows, nlls, picks):
        for begin, end in spans:
            nll += float(doc_nll[begin:end].sum())
            tokens += end - begin
            n_bytes += int(byte_lengths[np.asarray(window[prefix + begin : prefix + end], dtype=np.int64)].sum())
    return {
        "perplexity": math.exp(nll / tokens),
        "bits_per_byte": bits_per_byte(nll, n_bytes),
        "tokens": tokens,
        "bytes": n_bytes,
        "docs": len(windows),
        "nll": nll,
    }


def combine_paths(config: Config, round_index: int, parts: dict[str, dict | None]) -> dict:
    """eval/round=<r>.json from the paths' own scores, summed in path order (so a round scored by
    islands, path by path, gives the same file as one process scoring every path)."""
    root = RunRoot(config.run_root)
    paths, total_nll, total_tokens, total_bytes = {}, 0.0, 0, 0
    for path_id in all_path_ids(config.model.grid):
        part = parts.get(path_id)
        if not part:
            continue
        paths[path_id] = {k: part[k] for k in ("perplexity", "bits_per_byte", "tokens", "bytes", "docs")}
        total_nll, total_tokens, total_bytes = (
            total_nll + part["nll"],
            total_tokens + part["tokens"],
            total_bytes + part["bytes"],
        )
    result = {
        "round": round_index,
        "perplexity": math.exp(total_nll / total_tokens) if total_tokens else None,
        "bits_per_byte": bits_per_byte(total_nll, total_bytes),
        "tokens": total_tokens,
        "bytes": total_bytes,
        "tokenizer": config.model.tokenizer,
        "reroute_every": config.eval.reroute_every,  # null: every document scored by its prefix's path
        "paths": paths,
    }
    root.write_json(layout.eval_file(round_index), result)
    if config.eval.early_stopping:
        write_best(root)  # after each round's evaluation: each path's best round so far
    if total_tokens:
        log.info(
            "round %d: routed perplexity %.2f, %.3f bits per byte over %d tokens (%d bytes)%s",
            round_index,
            result["perplexity"],
            result["bits_per_byte"] or float("nan"),
            total_tokens,
            total_bytes,
            f", re-routed every {config.eval.reroute_every} tokens" if config.eval.reroute_every else "",
        )
    return result


def evaluate_round(config: Config, round_index: int) -> dict:
    """Perplexity per path and overall of the modules at the start of round r; eval/round=<r>.json."""
    parts = {path_id: evaluate_path(config, round_index, path_id) for path_id in all_path_ids(config.model.grid)}
    return combine_paths(config, round_index, parts)
