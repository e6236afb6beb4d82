"""The trainer's data: a path's documents packed into fixed-length rows, streamed across rounds.

Documents are joined with EOS and cut into `seq_len + 1` token rows (inputs and shifted labels),
in an order fixed by the seed. The stream continues across rounds (round r starts where round
r-1 stopped, reshuffling each epoch), so a path sees new data every round and a rerun of a round
sees exactly the same batches. Each rank of an island takes its own slice of every global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def pack_documents(docs: list[np.ndarray], seq_len: int, seed: int, eos: int) -> np.ndarray:
    """(n_rows, seq_len + 1) int64 rows: documents in a seeded order, each followed by EOS."""
    order = np.random.default_rng(seed).permutation(len(docs))
    pieces = []
    for index in order:
        pieces.append(np.asarray(docs[index], dtype=np.int64))
        pieces.append(np.array([eos], dtype=np.int64))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    n_rows = len(stream) // (seq_len + 1)
    return stream[: n_rows * (seq_len + 1)].reshape(n_rows, seq_len + 1)


@dataclass
class RowStream:
    """Global sample s of the whole run is row perm_{s // n}[s % n]: a pure function of s."""

    rows: np.ndarray  # (n_rows, seq_len + 1)
    seed: int

    def __post_init__(self) -> None:
        self._perms: dict[int, np.ndarray] = {}

    def row(self, sample: int) -> np.ndarray:
        epoch, offset = divmod(sample, len(self.rows))
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self.rows[self._perms[epoch][offset]]

    def micro_batch(self, first_sample: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = np.stack([self.row(first_sample + i) for i in range(size)])
        tokens = torch.from_numpy(block)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) inputs, labels


def micro_batch_start(step: int, micro_step: int, rank: int, micro: int, accum: int, world: int) -> int:
    """First global sample of a rank's micro batch: a global batch is accum x world x micro rows,
    laid out so that the same global batch is seen whatever the ZeRO stage."""
    global_batch = micro * accum * world
    return step * global_batch + (micro_step * world + rank) * micro
