"""Malformed C4 input, table-driven: every line ends routed or in rejected/ with its file, line
number and reason, and routed + rejected == lines read; files that cannot be used are named."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys

import pytest

from conftest import REPO
from pipeline.core.config import config_from_dict
from pipeline.core.errors import InputError
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.train.distributed import child_env
from preprocessing.prepare import run_prepare

GOOD = REPO / "tests" / "data" / "c4" / "train" / "c4-train.00000-of-00002.json"
FIFTY_MB = 50 * 1024 * 1024

# (file name, line bytes, expected reason per line) — each file holds one kind of damage.
LINE_CASES = [
    ("invalid-json.json", [b'{"text": "unterminated', b"{'single': 'quotes'}"], ["invalid_json"] * 2),
    (
        "wrong-types.json",
        [b'{"text": 5}', b'{"text": ["a", "list"]}', b'{"text": null}', b"42"],
        ["missing_text", "missing_text", "missing_text", "not_an_object"],
    ),
    (
        "empty-text.json",
        [b'{"text": ""}', b'{"text": "   \\n  "}', b'{"url": "https://x.org/a"}'],
        ["missing_text"] * 3,
    ),
    ("bad-utf8.json", [b'{"text": "\xff\xfe broken"}', b'{"text": "\\udc80 lone surrogate"}'], ["invalid_utf8"] * 2),
    ("huge-line.json", [b'{"text": "' + b"a" * FIFTY_MB + b'"}'], ["too_large"]),
]


def _write_cases(folder):
    for name, lines, _ in LINE_CASES:
        (folder / name).write_bytes(b"\n".join(lines) + b"\n")
    rng = random.Random(0)
    binary = bytes(rng.randrange(256) for _ in range(20_000))
    (folder / "binary.json").write_bytes(binary)
    (folder / "empty.json").write_bytes(b"")
    renamed = [
        json.dumps({**json.loads(line), "url": f"https://truncated.example/{i}"})
        for i, line in enumerate(GOOD.read_text().splitlines())
    ]
    whole = gzip.compress(("\n".join(renamed) + "\n").encode(), mtime=0)
    (folder / "truncated.json.gz").write_bytes(whole[: len(whole) // 2])  # breaks off mid-stream
    return binary.count(b"\n") + (0 if binary.endswith(b"\n") else 1)


def _config(tmp_path, train):
    return config_from_dict(
        {
            "run_root": str(tmp_path / "run"),
            "data": {"train": train, "eval": None},
            "router": {"embedder": "tfidf", "sample_docs": 500, "tfidf_dim": 16, "prefix_tokens": 8},
            "model": {"grid": [2], "blocks_per_level": [1], "seq_len": 32},
            "beam": {"options": ["--direct_running_mode=in_memory"]},
        }
    )


@pytest.mark.slow
def test_every_malformed_line_is_kept_with_its_reason_and_the_accounting_holds(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    binary_lines = _write_cases(bad)
    manifest = run_prepare(_config(tmp_path, [str(GOOD), str(bad / "*.json"), str(bad / "*.json.gz")]))
    good_lines = len(GOOD.read_bytes().splitlines())

    assert manifest["routed"] + manifest["rejected"] == manifest["lines_read"]
    root = RunRoot(tmp_path / "run")
    routed_ids = {doc_id for docs in _shard_rows(root).values() for doc_id, _ in docs}
    good_ids = {json.loads(line)["url"] for line in GOOD.read_text().splitlines()}
    recovered = {i for i in routed_ids if i.startswith("https://truncated.example/")}
    assert good_ids <= routed_ids  # every good document routed, none lost
    assert 0 < len(recovered) < good_lines  # the lines before the break in the truncated file
    assert manifest["routed"] == good_lines + len(recovered) == len(routed_ids)
    rejected = [
        json.loads(line)
        for name in root.marker(layout.SHARDS_DIR)["files"]
        if name.startswith("rejected/")
        for line in root.read_committed(layout.SHARDS_DIR, name).decode().splitlines()
    ]
    assert len(rejected) == manifest["rejected"]
    by_file: dict[str, list] = {}
    for row in rejected:
        assert set(row) >= {"file", "line", "reason", "raw"} and len(row["raw"]) <= 1000
        by_file.setdefault(os.path.basename(row["file"]), []).append((row["line"], row["reason"]))
    for name, lines, reasons in LINE_CASES:
        assert sorted(by_file[name]) == [(i + 1, r) for i, r in enumerate(reasons)], name
    assert len(by_file["binary.json"]) == binary_lines  # every line of a binary file, each counted
    assert {r for _, r in by_file["binary.json"]} <= {"invalid_utf8", "invalid_json", "not_an_object"}
    assert "empty.json" not in by_file  # an empty file has no lines: nothing to route or reject
    assert [r for _, r in by_file["truncated.json.gz"]][-1] == "unreadable_file"


def test_a_missing_input_file_is_named_before_any_work(tmp_path):
    missing = tmp_path / "c4-train.00007-of-01024.json.gz"
    with pytest.raises(InputError, match="c4-train.00007-of-01024.json.gz"):
        run_prepare(_config(tmp_path, [str(GOOD), str(missing)]))
    assert not (tmp_path / "run" / "shards").exists()


@pytest.mark.slow
def test_prepare_killed_mid_way_reruns_to_the_same_manifest_and_no_document_twice(tmp_path):
    overrides = ["--set", "router.embedder=tfidf"]
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "prepare",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        *overrides,
    ]
    reference = tmp_path / "reference"
    subprocess.run([*command, "--set", f"run_root={reference}"], check=True, capture_output=True, cwd=REPO)
    expected = json.loads((reference / "shards" / "manifest.json").read_text())
    expected_rows = _shard_rows(RunRoot(reference))

    for point in (3, 8, 14):
        crashed = tmp_path / f"crash{point}"
        result = subprocess.run(
            [*command, "--set", f"run_root={crashed}"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=child_env({"DIPACO_FAULT_KILL_BEFORE_WRITE": str(point)}),
        )
        assert result.returncode == -signal.SIGKILL, result.stderr[-400:]
        assert not RunRoot(crashed).is_committed(layout.SHARDS_DIR)
        subprocess.run([*command, "--set", f"run_root={crashed}"], check=True, capture_output=True, cwd=REPO)
        manifest = json.loads((crashed / "shards" / "manifest.json").read_text())
        assert {k: v for k, v in manifest.items() if k != "seconds"} == {
            k: v for k, v in expected.items() if k != "seconds"
        }
        rows = _shard_rows(RunRoot(crashed))
        assert rows == expected_rows
        ids = [doc_id for docs in rows.values() for doc_id, _ in docs]
        assert len(ids) == len(set(ids))  # no document twice


def _shard_rows(root: RunRoot) -> dict[str, list]:
    import io

    import pyarrow.parquet as pq

    rows: dict[str, list] = {}
    for name in root.marker(layout.SHARDS_DIR)["files"]:
        if name.endswith(".parquet"):
            table = pq.read_table(io.BytesIO(root.read_committed(layout.SHARDS_DIR, name)))
            key = name.rsplit("/", 1)[0]
            rows.setdefault(key, []).extend(
                zip(table.column("doc_id").to_pylist(), table.column("input_ids").to_pylist())
            )
    return {k: sorted(v) for k, v in rows.items()}


def test_the_trainer_benchmark_names_a_missing_sample(tmp_path, monkeypatch):
    """Launched on a device without `make sample` run, the worker died in a division by zero."""
    from benchmarks.perf_worker import load_rows

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"--data data/sample/train/\*\.json\.gz: no file matches.*make sample"):
        load_rows("data/sample/train/*.json.gz", 400, 256)
