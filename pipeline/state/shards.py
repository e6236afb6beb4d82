"""Shard files: one Parquet row per document (doc_id, input_ids list<int32>, n_tokens).

The prepare job writes them under `shards/path=<id>/` (Hive-style partitions) and commits the
whole `shards/` directory with one `_SUCCESS`; the trainer and evaluation read them back here,
each file checked against that marker.

An island trains the same path round after round, from the same committed shard: its decoded
documents stay in the process's memory (DecodedParts), keyed by the record the marker keeps of each
part, so a task's load neither reads nor decodes them again. Decoding a demo path's 1.2 MB part
with to_pylist took 0.06-0.08 s on an idle core and 0.15-0.27 s beside a training island, most of
a task's load past round 0, and on an object store it held the GIL while the task's modules were read.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import InputError
from pipeline.state import layout
from pipeline.state.storage import RunRoot

Rows = list[tuple[str, np.ndarray]]  # (doc_id, its tokens as read-only int64) of one Parquet part
DECODED_BUDGET = 256 << 20  # tokens' bytes kept; the demo's path is 5.8 MB, a part over a quarter is not kept


class DecodedParts:
    """A committed part's full path and record (bytes, CRC-32 or SHA-256) -> its decoded rows, least recently
    used first, within a budget of token bytes. The marker is read from the store on every read,
    as always: a part is served from here only while the record it names is the one decoded, so a
    shard re-committed with other bytes is read again. The token arrays are read-only: callers
    share them."""

    def __init__(self, budget: int = DECODED_BUDGET):
        self.budget = budget
        self._parts: OrderedDict[tuple[str, int, str], tuple[Rows, int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int, str]) -> Rows | None:
        with self._lock:
            found = self._parts.get(key)
            if found is None:
                return None
            self._parts.move_to_end(key)
            return found[0]

    def keep(self, key: tuple[str, int, str], rows: Rows, nbytes: int) -> None:
        if nbytes > self.budget // 4:
            return
        with self._lock:
            if key in self._parts:
                return
            self._parts[key] = (rows, nbytes)
            self._held += nbytes
            while self._held > self.budget:
                _, (_, dropped) = self._parts.popitem(last=False)
                self._held -= dropped


DECODED = DecodedParts()

SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string()),
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("n_tokens", pa.int32()),
    ]
)


def shard_table(doc_ids: list[str], token_lists: list[list[int]]) -> pa.Table:
    return pa.table(
        {
            "doc_id": doc_ids,
            "input_ids": [np.asarray(t, dtype=np.int32) for t in token_lists],
            "n_tokens": [len(t) for t in token_lists],
        },
        schema=SCHEMA,
    )


def write_shard_file(root: RunRoot, rel: str, table: pa.Table) -> None:
    """Write one Parquet part atomically (the caller commits the directory afterwards)."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    root.write_bytes(rel, buffer.getvalue())


def shard_parts(
    root: RunRoot, path_id: str, split: str = "train", shards: str = layout.SHARDS_DIR, marker: dict | None = None
) -> list[str]:
    """Names, relative to `shards` (a Routing's shards dir), of a path's committed Parquet parts;
    `marker`: the shards' `_SUCCESS` record, when the caller has just read it."""
    prefix = layout.shard_dir(path_id, split, shards)[len(shards) + 1 :] + "/"
    files = (marker or root.marker(shards))["files"]
    return sorted(n for n in files if n.startswith(prefix) and n.endswith(".parquet"))


def read_path_documents(
    root: RunRoot, path_id: str, split: str = "train", shards: str = layout.SHARDS_DIR
) -> list[np.ndarray]:
    """Every document of a path's shard as a read-only int64 token array, in a fixed order."""
    return [tokens for _, tokens in read_path_rows(root, path_id, split, shards)]


def read_path_rows(
    root: RunRoot, path_id: str, split: str = "train", shards: str = layout.SHARDS_DIR
) -> list[tuple[str, np.ndarray]]:
    """(doc_id, tokens) of every document of a path's shard, sorted by doc_id."""
    marker = root.marker_if_committed(shards)  # read once, no existence check before it: each part checked against it
    if marker is None:
        what = "run `dipaco prepare` first" if shards == layout.SHARDS_DIR else "the re-routing has not committed yet"
        raise InputError(f"{root.path(shards)}: shards are not committed; {what}")
    docs: Rows = []
    for name in shard_parts(root, path_id, split, shards, marker):
        record = marker["files"][name]
        key = (root.path(shards, name), int(record["bytes"]), str(record.get("crc32") or record.get("sha256")))
        rows = DECODED.get(key)
        if rows is None:
            rows, nbytes = decode_part(root.read_committed(shards, name, marker=marker), root.path(shards, name))
            DECODED.keep(key, rows, nbytes)
        docs.extend(rows)
    docs.sort(key=lambda item: item[0])  # part order and Beam's bundling must not change training
    return docs


def decode_part(data: bytes | bytearray, where: str) -> tuple[Rows, int]:
    """One Parquet part's (doc_id, tokens) and the tokens' bytes: the token lists flattened into one
    int64 array and sliced by their offsets (0.01-0.03 s for the demo's part, where a Python int per
    token, as to_pylist made, took 0.06-0.27 s), read-only, since DecodedParts shares them."""
    try:
        table = pq.read_table(io.BytesIO(data), columns=["doc_id", "input_ids"])
        lists = table.column("input_ids").combine_chunks()
        if lists.null_count:
            raise InputError(f"{where}: {lists.null_count} document(s) with no input_ids")
        offsets = lists.offsets.to_numpy()
        tokens = np.array(lists.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        ids = table.column("doc_id").to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{where}: not a readable Parquet file ({exc})") from None
    tokens.flags.writeable = False
    offsets = offsets - offsets[0]
    return [(doc_id, tokens[offsets[i] : offsets[i + 1]]) for i, doc_id in enumerate(ids)], tokens.nbytes


def read_path_doc_ids(root: RunRoot, path_id: str, split: str = "train", shards: str = layout.SHARDS_DIR) -> list[str]:
    """The doc_id of every document of a path's shard (the doc_id column only: cheap to compare routings)."""
    ids: list[str] = []
    for name in shard_parts(root, path_id, split, shards):
        try:
            table = pq.read_table(io.BytesIO(root.read_committed(shards, name)), columns=["doc_id"])
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{root.path(shards, name)}: not a readable Parquet file ({exc})") from None
        ids.extend(table.column("doc_id").to_pylist())
    return ids
