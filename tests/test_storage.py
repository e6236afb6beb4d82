"""The run-root contract: atomic writes, commit markers with checksums, clear write failures."""

import subprocess
import sys
import zlib

import pytest

from conftest import REPO
from pipeline.core.errors import CorruptStateError, InputError
from pipeline.state.storage import RunRoot


def test_commit_records_checksums_and_reads_are_verified(tmp_path):
    root = RunRoot(tmp_path)
    root.write_bytes("d/a.bin", b"hello")
    root.write_json("d/sub/b.json", {"x": 1})
    assert not root.is_committed("d")
    with pytest.raises(InputError, match="not committed"):
        root.read_committed("d", "a.bin")
    record = root.commit("d")
    assert sorted(record["files"]) == ["a.bin", "sub/b.json"] and record["files"]["a.bin"]["bytes"] == 5
    assert root.read_committed("d", "a.bin") == b"hello"
    (tmp_path / "d" / "a.bin").write_bytes(b"hellO")
    with pytest.raises(CorruptStateError, match="a.bin: checksum does not match"):
        root.read_committed("d", "a.bin")
    with pytest.raises(CorruptStateError, match="not listed"):
        root.read_committed("d", "unlisted.bin")


def test_markers_with_sha256_records_are_still_verified(tmp_path):
    """Run roots committed before the switch to CRC-32 keep loading, and keep being checked."""
    import hashlib
    import json

    root = RunRoot(tmp_path)
    root.write_bytes("d/a.bin", b"weights")
    record = {"files": {"a.bin": {"sha256": hashlib.sha256(b"weights").hexdigest(), "bytes": 7}}}
    (tmp_path / "d" / "_SUCCESS").write_text(json.dumps(record))
    assert root.read_committed("d", "a.bin") == b"weights"
    (tmp_path / "d" / "a.bin").write_bytes(b"weightz")
    with pytest.raises(CorruptStateError, match="a.bin: checksum does not match"):
        root.read_committed("d", "a.bin")


def test_memory_filesystem_roots_follow_the_same_contract():
    root = RunRoot("memory://dipaco-test/run")
    root.write_bytes("d/a.bin", b"abc")
    root.commit("d")
    assert root.read_committed("d", "a.bin") == b"abc" and root.listdir("d") == ["_SUCCESS", "a.bin"]


def test_a_write_the_kernel_refuses_leaves_the_old_file_and_names_the_file(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse large writes (EFBIG) for real, without privileges."""
    script = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from pipeline.state.storage import RunRoot
from pipeline.core.errors import StorageError
root = RunRoot({str(tmp_path)!r})
root.write_bytes("state.bin", b"old")
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
try:
    root.write_bytes("state.bin", b"x" * 5000)
except StorageError as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert "state.bin: cannot write (File too large); the previous state is intact" in result.stdout, result.stderr
    assert (tmp_path / "state.bin").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]  # no temporary left behind


def test_a_note_is_renamed_into_place_and_is_no_fault_injection_point(tmp_path):
    """Notes (Beam workers' progress counters) come and go with the clock: the crash tests count
    state writes only, so a note neither counts nor fails where state writes are made to."""
    from pipeline.core.errors import StorageError
    from pipeline.state import storage

    root = RunRoot(tmp_path)
    storage.inject_write_errors(1, "notes/")
    try:
        root.write_note("notes/a.json", b'{"lines read": 1}')
        root.write_note("notes/a.json", b'{"lines read": 2}')
        with pytest.raises(StorageError, match="notes/b.bin: cannot write"):
            root.write_bytes("notes/b.bin", b"state")  # the injected error was still there for it
    finally:
        storage.inject_write_errors(0)
    assert root.read_json("notes/a.json") == {"lines read": 2}
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["a.json"]  # no temporary left behind
    memory = RunRoot("memory://dipaco-test/notes")
    memory.write_note("n.json", b"{}")
    assert memory.read_json("n.json") == {}


def test_module_files_decode_in_place_and_malformed_ones_are_refused():
    """The merge views verified bytes without a copy; the views must equal safetensors' own
    loader bit for bit, and a header that lies about sizes must be refused, not read past."""
    import torch
    from safetensors.torch import load, save

    from pipeline.state.module_store import decode

    state = {
        "w": torch.randn(3, 4),
        "ids": torch.arange(5),
        "empty": torch.zeros(0, 2),
        "half": torch.randn(2).bfloat16(),
    }
    data = save(state, metadata={"k": "v"})
    viewed, loaded = decode(bytearray(data), "m.safetensors"), load(data)
    assert set(viewed) == set(state)
    for name in state:
        assert viewed[name].dtype == loaded[name].dtype and torch.equal(viewed[name], loaded[name])
    for broken in (data[:6], data[:40], data[:-2]):
        with pytest.raises(CorruptStateError, match="m.safetensors: not a valid safetensors file"):
            decode(bytearray(broken), "m.safetensors")


def test_commit_checksums_the_bytes_on_disk_not_the_writers_own(tmp_path):
    """Two writers of one directory (a paused island and its successor): the marker describes the
    files as they are, so the directory stays readable (it used to fail every read for good)."""
    a, b = RunRoot(tmp_path), RunRoot(tmp_path)
    a.write_json("d/metrics.json", {"attempt": 1})
    b.write_json("d/metrics.json", {"attempt": 2, "longer": True})
    a.commit("d")
    assert a.read_committed_json("d", "metrics.json") == {"attempt": 2, "longer": True}


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_committed_file_under_a_second_name_keeps_its_bytes_and_stays_checked(tmp_path, where, request):
    """finish_round gathers staged modules this way: linked on a local root, copied on the server
    by an object store (no byte crosses the host's link), the record carried over in both. Rewriting
    one name never changes the other, and a later change to the bytes is refused when read, as for
    any file."""
    if where == "s3":
        from pipeline.state.store import configure

        url, _ = request.getfixturevalue("s3_root")
        configure(url, {"endpoint_url": request.getfixturevalue("s3_server").endpoint})
    else:
        url = tmp_path if where == "local" else f"memory://dipaco-copy-{tmp_path.name}/run"
    root = RunRoot(url)
    root.write_bytes("staged/m.bin", b"module")
    root.commit("staged")
    read = []
    root.read_bytes = lambda rel, *a, **k: read.append(rel) or RunRoot.read_bytes(root, rel, *a, **k)
    record = root.copy_committed("staged", "m.bin", "final/m.bin")
    assert record == root.marker("staged")["files"]["m.bin"]
    assert "staged/m.bin" not in read  # not downloaded to be copied
    root.write_bytes("staged/m.bin", b"rewritten")  # a write renames a new file over the name
    root.commit("final", linked={"m.bin": record})
    assert root.read_committed("final", "m.bin") == b"module"
    assert root.marker("final")["files"]["m.bin"] == {"crc32": f"{zlib.crc32(b'module'):08x}", "bytes": 6}
    if where == "local":
        (tmp_path / "final" / "m.bin").write_bytes(b"moduLe")  # changed in place, behind the root's back
        with pytest.raises(CorruptStateError, match="final/m.bin: checksum does not match"):
            root.read_committed("final", "m.bin")


def test_publishing_a_directory_is_first_wins(tmp_path):
    root = RunRoot(tmp_path)
    for attempt in ("a1", "a2"):
        root.write_json(f"staging/{attempt}/metrics.json", {"attempt": attempt})
        root.commit(f"staging/{attempt}")
    assert root.publish_dir("staging/a1", "final")
    assert not root.publish_dir("staging/a2", "final")  # a late attempt never mixes in
    assert root.read_committed_json("final", "metrics.json") == {"attempt": "a1"}
    assert root.exists("staging/a2/metrics.json") and not root.exists("staging/a1")


# -- a path's decoded shard, kept in memory ----------------------------------------------------------
def test_a_paths_shard_is_decoded_once_until_its_part_is_committed_again(tmp_path, monkeypatch):
    """An island trains the same path round after round: the second read neither reads nor decodes
    the part again, and a part re-committed with other bytes is read again, never served stale."""
    import numpy as np

    from pipeline.state.shards import read_path_rows, shard_table, write_shard_file

    root = RunRoot(tmp_path)
    part = "shards/path=0-1/part-00000.parquet"
    write_shard_file(root, part, shard_table(["b", "a", "c"], [[1, 2, 3], [4, 5], [70000]]))
    root.commit("shards")
    reads: list[str] = []
    read_committed = RunRoot.read_committed
    monkeypatch.setattr(
        RunRoot, "read_committed", lambda self, d, n, **k: reads.append(n) or read_committed(self, d, n, **k)
    )
    first = read_path_rows(root, "0-1")
    assert [(d, t.tolist()) for d, t in first] == [("a", [4, 5]), ("b", [1, 2, 3]), ("c", [70000])]
    assert all(t.dtype == np.int64 and not t.flags.writeable for _, t in first)  # shared: nobody writes them
    again = read_path_rows(root, "0-1")
    assert len(reads) == 1 and all(x[1] is y[1] for x, y in zip(first, again))
    write_shard_file(root, part, shard_table(["a"], [[9, 9]]))
    root.commit("shards")
    assert [(d, t.tolist()) for d, t in read_path_rows(root, "0-1")] == [("a", [9, 9])] and len(reads) == 2


def test_decoded_parts_keep_within_their_budget_least_recently_used_first():
    import numpy as np

    from pipeline.state.shards import DecodedParts

    kept = DecodedParts(budget=400)
    rows = [("d", np.zeros(10, dtype=np.int64))]
    kept.keep(("big", 1, "x"), rows, 101)  # over a quarter of the budget: never kept
    for name in "abcd":
        kept.keep((name, 1, "x"), rows, 100)
    assert kept.get(("big", 1, "x")) is None and kept.get(("a", 1, "x")) is rows
    kept.keep(("e", 1, "x"), rows, 100)  # 500 > 400: b, the least recently used, goes
    assert kept.get(("b", 1, "x")) is None and all(kept.get((n, 1, "x")) is rows for n in "acde")


def test_a_part_with_documents_without_tokens_is_refused_naming_it(tmp_path):
    import pyarrow as pa

    from pipeline.state.shards import SCHEMA, read_path_rows, write_shard_file

    root = RunRoot(tmp_path)
    table = pa.table(
        {"doc_id": ["a"], "input_ids": pa.array([None], pa.list_(pa.int32())), "n_tokens": [0]}, schema=SCHEMA
    )
    write_shard_file(root, "shards/path=0/part-00000.parquet", table)
    root.commit("shards")
    with pytest.raises(InputError, match=r"path=0/part-00000\.parquet: 1 document\(s\) with no input_ids"):
        read_path_rows(root, "0")
