"""Shard files: one Parquet row per document (doc_id, input_ids list<int32>, n_tokens).

The prepare job writes them under `shards/path=<id>/` (Hive-style partitions) and commits the
whole `shards/` directory with one `_SUCCESS`; the trainer and evaluation read them back here,
each file checked against that marker.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import InputError
from pipeline.state import layout
from pipeline.state.storage import RunRoot

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
    """Every document of a path's shard as an int32 token array, in a fixed order."""
    return [tokens for _, tokens in read_path_rows(root, path_id, split, shards)]


def read_path_rows(
    root: RunRoot, path_id: str, split: str = "train", shards: str = layout.SHARDS_DIR
) -> list[tuple[str, np.ndarray]]:
    """(doc_id, tokens) of every document of a path's shard, sorted by doc_id."""
    marker = root.marker_if_committed(shards)  # read once, no existence check before it: each part checked against it
    if marker is None:
        what = "run `dipaco prepare` first" if shards == layout.SHARDS_DIR else "the re-routing has not committed yet"
        raise InputError(f"{root.path(shards)}: shards are not committed; {what}")
    docs: list[tuple[str, np.ndarray]] = []
    for name in shard_parts(root, path_id, split, shards, marker):
        data = root.read_committed(shards, name, marker=marker)
        try:
            table = pq.read_table(io.BytesIO(data), columns=["doc_id", "input_ids"])
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"{root.path(shards, name)}: not a readable Parquet file ({exc})") from None
        ids = table.column("doc_id").to_pylist()
        tokens = table.column("input_ids").to_pylist()
        docs.extend((doc_id, np.asarray(t, dtype=np.int64)) for doc_id, t in zip(ids, tokens))
    docs.sort(key=lambda item: item[0])  # part order and Beam's bundling must not change training
    return docs


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
