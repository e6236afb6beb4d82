"""The run's tokenizer and the tokenizer-free metric: a BPE trained by prepare (deterministic, its
vocabulary size honoured, fixed for the run root) and bits per byte over exactly the scored text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, tiny_config
from pipeline import stages
from pipeline.core.errors import ConfigError
from pipeline.evaluation.evaluate import bits_per_byte, score_documents, scored_bytes
from pipeline.routing.tokenizer import commit_bpe, encode, gpt2_tokenizer, load_tokenizer, token_byte_lengths, train_bpe
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.storage import RunRoot

TRAIN_FILES = sorted(str(p) for p in (REPO / "tests" / "data" / "c4" / "train").iterdir())
MULTIBYTE = "Café au lait, naïve façade — 東京 🚀 ünïcödé text."


def sample_texts() -> list[str]:
    """The texts of the test C4 training files (the tokenizer's training sample)."""
    import gzip

    texts = []
    for file in TRAIN_FILES:
        opener = gzip.open if file.endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8") as handle:
            texts += [json.loads(line)["text"] for line in handle if line.strip()]
    return texts


def bpe_config(run_root: Path, *overrides: str):
    return tiny_config(run_root, "model.tokenizer=bpe", "model.vocab_size=600", *overrides)


def test_bpe_trained_twice_on_the_same_sample_is_identical_and_honours_the_vocabulary_size():
    texts = sample_texts()
    first, second = train_bpe(texts, 600), train_bpe(texts, 600)
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 600
    assert first.token_to_id("<|endoftext|>") == 0
    smaller = train_bpe(texts, 520)
    assert smaller.get_vocab_size() == 520 and smaller.to_str() != first.to_str()


def test_bpe_round_trips_text_and_counts_its_bytes_exactly(tmp_path):
    root = RunRoot(str(tmp_path / "run"))
    commit_bpe(root, train_bpe(sample_texts(), 600), sample_docs=3)
    tokenizer = load_tokenizer(root, "bpe")
    assert len(tokenizer) == 600 and tokenizer.eos_token_id == 0
    for tok in (tokenizer, gpt2_tokenizer()):
        lengths = token_byte_lengths(tok, len(tok))
        for text in [MULTIBYTE, *sample_texts()[:5]]:
            ids = encode([text], tok)[0]
            assert tok.decode(ids) == text
            assert int(lengths[ids].sum()) == len(text.encode("utf-8"))  # even when a token splits a character
    assert lengths[gpt2_tokenizer().eos_token_id] == 0  # special tokens stand for no text


def test_bits_per_byte_on_a_hand_computed_example():
    """A model with uniform logits costs ln(V) nats per token; 'Hello world' with a one-token
    prefix scores ' world' only: log2(V) bits over its 6 bytes."""
    vocab = 50257

    class Uniform(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, vocab)})()

    ids = encode(["Hello world"])[0]
    assert len(ids) == 2  # 'Hello', ' world'
    docs = [np.asarray(ids)]
    nll, tokens = score_documents(Uniform(), docs, prefix=1, seq_len=16, batch_size=1)
    n_bytes = scored_bytes(docs, 1, 16, token_byte_lengths(gpt2_tokenizer(), vocab))
    assert tokens == 1 and n_bytes == 6
    assert nll == pytest.approx(math.log(vocab))
    assert bits_per_byte(nll, n_bytes) == pytest.approx(math.log2(vocab) / 6)
    # only the window a model sees counts: seq_len 1 keeps 'Hello world' whole (2 tokens = seq_len + 1)
    assert (
        scored_bytes([np.asarray(encode(["Hello world again"])[0])], 1, 1, token_byte_lengths(gpt2_tokenizer(), vocab))
        == 6
    )


def test_a_run_root_refuses_a_changed_tokenizer(run_root):
    stages.init_run(Run(bpe_config(run_root)))
    with pytest.raises(ConfigError, match="model differs"):
        stages.init_run(Run(tiny_config(run_root)))
    with pytest.raises(ConfigError, match="model differs"):
        stages.init_run(Run(bpe_config(run_root, "model.vocab_size=700")))
    stages.init_run(Run(bpe_config(run_root)))  # the same config is welcome


def test_bpe_config_is_validated():
    with pytest.raises(ConfigError, match="model.vocab_size must be >= 512"):
        tiny_config(Path("/tmp/x"), "model.tokenizer=bpe", "model.vocab_size=300")
    with pytest.raises(ConfigError, match="model.tokenizer must be one of gpt2, bpe"):
        tiny_config(Path("/tmp/x"), "model.tokenizer=sentencepiece")


@pytest.mark.slow
def test_prepare_trains_commits_and_uses_the_bpe_then_eval_reports_bits_per_byte(run_root):
    config = bpe_config(run_root)
    run = Run(config)
    stages.init_run(run)
    manifest = stages.prepare(run)
    root = RunRoot(config.run_root)
    assert root.is_committed(layout.TOKENIZER_DIR)
    marker = root.marker(layout.TOKENIZER_DIR)
    assert marker["vocab_size"] == 600 and manifest["tokenizer"]["kind"] == "bpe"
    assert manifest["tokenizer"]["sha256"] == marker["sha256"]
    tokenizer = load_tokenizer(root, "bpe")

    from pipeline.state.shards import read_path_documents

    # every shard holds the ids of the trained tokenizer, not GPT-2's
    docs = [d for p in ("p0-0", "p0-1", "p1-0", "p1-1") for d in read_path_documents(root, p)]
    assert max(int(d.max()) for d in docs) < 600
    texts = set(sample_texts())
    assert any(tokenizer.decode(d.tolist()) in texts for d in docs)
    assert json.loads(root.read_bytes(f"{layout.ROUTER_DIR}/router.json"))["tokenizer"] == "bpe"

    result = stages.evaluate(Run(config), 0)
    assert result["tokenizer"] == "bpe" and result["bytes"] > result["tokens"] > 0
    # an untrained model spreads its probability: about log2(600) bits per token
    bits_per_token = result["bits_per_byte"] * result["bytes"] / result["tokens"]
    assert bits_per_token == pytest.approx(math.log2(result["perplexity"]))
    assert 8.0 < bits_per_token < 10.5
    for scores in result["paths"].values():
        assert scores["bits_per_byte"] > 0 and scores["bytes"] > 0
    assert sum(s["bytes"] for s in result["paths"].values()) == result["bytes"]
    # rerunning prepare reuses the committed tokenizer
    before = root.read_bytes(f"{layout.TOKENIZER_DIR}/tokenizer.json")
    stages.prepare(Run(config))
    assert root.read_bytes(f"{layout.TOKENIZER_DIR}/tokenizer.json") == before


@pytest.mark.parametrize(
    "content", [b"{}", b'{"model": {"type": "BPE", "vocab": 3}}', b"[" * 100_000, b"\xff\xfe not json"]
)
def test_a_corrupt_tokenizer_file_is_one_line_naming_it(tmp_path, content):
    from pipeline.core.errors import CorruptStateError

    root = RunRoot(str(tmp_path / "run"))
    root.write_bytes(f"{layout.TOKENIZER_DIR}/tokenizer.json", content)
    root.commit(layout.TOKENIZER_DIR)  # checksums match: the content itself is hostile
    with pytest.raises(CorruptStateError) as info:
        load_tokenizer(root, "bpe")
    message = str(info.value)
    assert "tokenizer/tokenizer.json" in message and "\n" not in message and len(message) < 500
