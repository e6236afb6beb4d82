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
stand for (`preprocessing.tokenizer.token_byte_lengths`).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F

from models.grid import all_path_ids
from models.modular import EOS_TOKEN_ID, eos_token_id
from preprocessing.tokenizer import load_tokenizer, token_byte_lengths
from pipeline.state import layout
from pipeline.state.module_store import load_path_model
from pipeline.state.shards import read_path_documents, shard_parts
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.eval")


@torch.no_grad()
def score_documents(model: torch.nn.Module, docs: list[np.ndarray], prefix: int, seq_len: int, batch_size: int,
                    pad_id: int = EOS_TOKEN_ID) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens scored) over the tokens after each prefix."""
    model.eval()
    nll, count = 0.0, 0
    for logits, targets in _scored_batches(model, scored_windows(docs, prefix, seq_len), prefix, batch_size, pad_id):
        nll += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    return nll, count


@torch.no_grad()
def document_losses(model: torch.nn.Module, docs: list[np.ndarray], prefix: int, seq_len: int, batch_size: int,
                    pad_id: int = EOS_TOKEN_ID) -> np.ndarray:
    """(n_docs,) summed nats over the tokens score_documents scores in each document; NaN for a
    document with no token after its prefix (discriminative routing labels documents by this)."""
    model.eval()
    losses = np.full(len(docs), np.nan)
    kept = [i for i, d in enumerate(docs) if len(d) > prefix]
    windows = scored_windows(docs, prefix, seq_len)  # the documents of `kept`, in order
    row = 0
    for logits, targets in _scored_batches(model, windows, prefix, batch_size, pad_id):
        per_token = F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=-100, reduction="none")  # (B, T)
        for value in per_token.sum(1).tolist():
            losses[kept[row]] = value
            row += 1
    return losses


def _scored_batches(model: torch.nn.Module, windows: list[np.ndarray], prefix: int, batch_size: int, pad_id: int):
    """(logits (B, T, V), targets (B, T)) per batch of windows; target -100 is not scored."""
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        width = max(len(d) for d in batch) - 1
        inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)  # -100: not scored
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, doc in enumerate(batch):
            tokens = torch.as_tensor(doc, dtype=torch.long)
            n = len(tokens) - 1
            inputs[row, :n], mask[row, :n] = tokens[:-1], 1
            targets[row, prefix - 1:n] = tokens[prefix:]  # target j is token j+1: score tokens >= prefix
        yield model(input_ids=inputs, attention_mask=mask).logits, targets  # (B, T, V), (B, T)


def scored_windows(docs: list[np.ndarray], prefix: int, seq_len: int) -> list[np.ndarray]:
    """The part of each document a model sees: its first seq_len + 1 tokens, if any follow the prefix."""
    return [d[: seq_len + 1] for d in docs if len(d) > prefix]


def scored_bytes(docs: list[np.ndarray], prefix: int, seq_len: int, byte_lengths: np.ndarray) -> int:
    """UTF-8 bytes of exactly the text score_documents scores: tokens prefix..seq_len of each window."""
    return int(sum(byte_lengths[np.asarray(d[prefix:], dtype=np.int64)].sum() for d in scored_windows(docs, prefix, seq_len)))


def bits_per_byte(nll_nats: float, n_bytes: int) -> float | None:
    return nll_nats / math.log(2) / n_bytes if n_bytes else None


def evaluate_path(config, round_index: int, path_id: str, shards: str | None = None) -> dict | None:
    """One path's held-out score with the modules at the start of round r (an island's eval task):
    summed nats, tokens and bytes as well as the rates, so paths combine exactly; None when the
    path has no held-out document long enough to score. The held-out documents are those routed
    to the path by round r's routing (layout.routing), or by the one whose shards are `shards`."""
    root = RunRoot(config.run_root)
    prefix, seq_len, m = config.router.prefix_tokens, config.model.seq_len, config.model
    shards = shards or layout.routing(config.router.discriminative_after, round_index).shards
    if not shard_parts(root, path_id, split="validation", shards=shards):
        return None
    docs = read_path_documents(root, path_id, split="validation", shards=shards)[: config.eval.max_docs]
    model = load_path_model(root, config, round_index, path_id)
    nll, tokens = score_documents(model, docs, prefix, seq_len, config.eval.batch_size,
                                  pad_id=eos_token_id(m.vocab_size, m.tokenizer))
    if not tokens:
        return None
    n_bytes = scored_bytes(docs, prefix, seq_len, _byte_lengths(root, m.tokenizer, m.vocab_size))
    return {"perplexity": math.exp(nll / tokens), "bits_per_byte": bits_per_byte(nll, n_bytes),
            "tokens": tokens, "bytes": n_bytes, "docs": len(docs), "nll": nll}


def _byte_lengths(root: RunRoot, tokenizer: str, vocab_size: int) -> np.ndarray:
    return token_byte_lengths(load_tokenizer(root, tokenizer), vocab_size)


def combine_paths(config, round_index: int, parts: dict[str, dict | None]) -> dict:
    """eval/round=<r>.json from the paths' own scores, summed in path order (so a round scored by
    islands, path by path, gives the same file as one process scoring every path)."""
    root = RunRoot(config.run_root)
    paths, total_nll, total_tokens, total_bytes = {}, 0.0, 0, 0
    for path_id in all_path_ids(config.model.grid):
        part = parts.get(path_id)
        if not part:
            continue
        paths[path_id] = {k: part[k] for k in ("perplexity", "bits_per_byte", "tokens", "bytes", "docs")}
        total_nll, total_tokens, total_bytes = total_nll + part["nll"], total_tokens + part["tokens"], total_bytes + part["bytes"]
    result = {
        "round": round_index,
        "perplexity": math.exp(total_nll / total_tokens) if total_tokens else None,
        "bits_per_byte": bits_per_byte(total_nll, total_bytes),
        "tokens": total_tokens,
        "bytes": total_bytes,
        "tokenizer": config.model.tokenizer,
        "paths": paths,
    }
    root.write_json(layout.eval_file(round_index), result)
    if total_tokens:
        log.info("round %d: routed perplexity %.2f, %.3f bits per byte over %d tokens (%d bytes)",
                 round_index, result["perplexity"], result["bits_per_byte"] or float("nan"), total_tokens, total_bytes)
    return result


def evaluate_round(config, round_index: int) -> dict:
    """Perplexity per path and overall of the modules at the start of round r; eval/round=<r>.json."""
    parts = {path_id: evaluate_path(config, round_index, path_id) for path_id in all_path_ids(config.model.grid)}
    return combine_paths(config, round_index, parts)
