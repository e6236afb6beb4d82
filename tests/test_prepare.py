"""The Beam prepare job end to end on tiny generated C4 files (real pipelines, tfidf mostly)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import random
import re

import pyarrow.parquet as pq
import pytest
from sklearn.metrics import normalized_mutual_info_score

from pipeline.core.config import config_from_dict
from pipeline.core.errors import InputError
from pipeline.routing.router import Router
from pipeline.routing.tokenizer import encode
from pipeline.state import layout
from pipeline.state.shards import read_path_documents
from pipeline.state.storage import RunRoot
from preprocessing import progress
from preprocessing.prepare import run_prepare

os.environ.setdefault("HF_HUB_OFFLINE", "1")
IN_MEMORY = ["--direct_running_mode=in_memory"]
TOPICS = {
    "sport": "football match goal team player league score coach stadium referee".split(),
    "cooking": "recipe oven flour sugar bake butter dinner taste kitchen salt".split(),
    "space": "planet orbit star galaxy rocket telescope moon launch astronaut comet".split(),
}


def good_lines(n: int = 60, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        topic = list(TOPICS)[i % 3]
        doc = {"text": " ".join(rng.choices(TOPICS[topic], k=30)), "timestamp": "2019-04-25T12:00:00Z", "topic": topic}
        if i % 7:  # most have a url; the others get a text-hash doc_id
            doc["url"] = f"https://example.com/{topic}/{i}"
        docs.append(doc)
    return docs


BAD = [  # (raw line, reason); inserted among the good lines
    (b"{not json at all", "invalid_json"),
    (b"", "invalid_json"),
    (b'{"url": "https://example.com/no-text"}', "missing_text"),
    (b'{"text": "", "url": "https://example.com/empty"}', "missing_text"),
    (b"[1, 2, 3]", "not_an_object"),
    (b'{"text": "caf\xe9 latin-1"}', "invalid_utf8"),
    (b'{"text": "' + b"long " * 500 + b'"}', "too_large"),
]


def write_lines(path, lines: list[bytes], gz: bool = False) -> None:
    data = b"".join(line + b"\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)


def encoded(docs: list[dict]) -> list[bytes]:
    return [json.dumps(d).encode() for d in docs]


def config(tmp_path, train, eval=None, name="run", options=IN_MEMORY, **router):
    return config_from_dict(
        {
            "run_root": str(tmp_path / name),
            "data": {"train": train, "eval": eval, "max_doc_bytes": 1000},
            "router": {"embedder": "tfidf", "sample_docs": 1000, "tfidf_dim": 16, **router},
            "model": {"grid": [3], "blocks_per_level": [1]},
            "beam": {"options": options},
        }
    )


def shard_rows(run_root) -> dict[tuple[str, str], list[tuple[str, tuple[int, ...]]]]:
    """(split, path) -> sorted (doc_id, token ids) of every committed Parquet part."""
    root = RunRoot(run_root)
    rows: dict = {}
    for name in root.marker(layout.SHARDS_DIR)["files"]:
        if not name.endswith(".parquet"):
            continue
        split = "validation" if name.startswith("validation/") else "train"
        path = name.split("path=")[1].split("/")[0]
        table = pq.read_table(io.BytesIO(root.read_committed(layout.SHARDS_DIR, name)))
        for doc_id, ids, n in zip(*(table.column(c).to_pylist() for c in ("doc_id", "input_ids", "n_tokens"))):
            assert n == len(ids)
            rows.setdefault((split, path), []).append((doc_id, tuple(ids)))
    return {key: sorted(value) for key, value in rows.items()}


def without_timing(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in ("seconds",)}


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    """A train file with every kind of bad line among 60 good ones, and a small validation file."""
    base = tmp_path_factory.mktemp("messy")
    docs = good_lines()
    lines = encoded(docs)
    bad_at = {}
    for offset, (raw, reason) in zip((3, 10, 17, 24, 31, 38, 45), BAD):
        lines.insert(offset, raw)
        bad_at[offset + 1] = reason  # 1-based line numbers
    write_lines(base / "train" / "c4-train.00000-of-00001.json", lines)
    write_lines(base / "validation" / "c4-validation.00000-of-00001.json", encoded(good_lines(9, seed=1)) + [b"{oops"])
    return base, docs, bad_at


def test_every_line_is_routed_or_rejected_exactly_once(messy, tmp_path):
    base, docs, bad_at = messy
    cfg = config(tmp_path, str(base / "train/*.json"), str(base / "validation/*.json"))
    manifest = run_prepare(cfg)
    train = manifest["splits"]["train"]
    assert train["lines_read"] == len(docs) + len(BAD) == train["routed"] + train["rejected"]
    assert train["routed"] == len(docs) and train["rejected"] == len(BAD)
    expected_reasons: dict[str, int] = {}
    for reason in bad_at.values():
        expected_reasons[reason] = expected_reasons.get(reason, 0) + 1
    assert train["rejected_by_reason"] == expected_reasons
    assert manifest["splits"]["validation"] == {
        **manifest["splits"]["validation"],
        "lines_read": 10,
        "routed": 9,
        "rejected": 1,
    }
    assert manifest["lines_read"] == manifest["routed"] + manifest["rejected"] == 77

    # every good document is in exactly one train shard, with its own tokens
    rows = shard_rows(cfg.run_root)
    train_rows = [row for (split, _), part in rows.items() if split == "train" for row in part]
    assert len(train_rows) == len(docs) == len({doc_id for doc_id, _ in train_rows})
    by_id = dict(train_rows)
    for doc in docs:
        doc_id = doc.get("url") or next(
            i for i in by_id if i.startswith("sha256:") and list(by_id[i]) == encode([doc["text"]])[0]
        )
        assert list(by_id[doc_id]) == encode([doc["text"]])[0]
    # per-path counts in the manifest match the files, and the trainer's reader agrees
    for path, entry in manifest["paths"].items():
        assert entry["train"]["documents"] == len(rows.get(("train", path), []))
        assert entry["train"]["tokens"] == sum(len(ids) for _, ids in rows.get(("train", path), []))
        assert len(read_path_documents(RunRoot(cfg.run_root), path)) == entry["train"]["documents"]
    assert set(manifest["paths"]) == {"p0", "p1", "p2"}

    # every bad line is in rejected/ with its file, line number and reason
    rejected_dir = tmp_path / "run" / "shards" / "rejected"
    records = [
        json.loads(line) for f in sorted(rejected_dir.glob("part-*.jsonl")) for line in f.read_text().splitlines()
    ]
    train_records = {r["line"]: r for r in records if r["split"] == "train"}
    assert {line: r["reason"] for line, r in train_records.items()} == bad_at
    assert all(r["file"].endswith("c4-train.00000-of-00001.json") for r in train_records.values())
    assert len(train_records[bad_at_line(bad_at, "too_large")]["raw"]) <= 500
    assert [r["line"] for r in records if r["split"] == "validation"] == [10]
    assert manifest["router_checksum"] == Router.load(RunRoot(cfg.run_root)).checksum
    assert manifest["tokenizer"] == {"kind": "gpt2", "vocab_size": 50257}


def bad_at_line(bad_at: dict[int, str], reason: str) -> int:
    return next(line for line, r in bad_at.items() if r == reason)


def test_rerun_is_skipped_once_committed_and_restarts_clean_after_a_crash(messy, tmp_path):
    base, _, _ = messy
    cfg = config(tmp_path, str(base / "train/*.json"))
    first = run_prepare(cfg)
    marker = tmp_path / "run/shards/_SUCCESS"
    stamp = marker.read_bytes()
    assert run_prepare(cfg) == first and marker.read_bytes() == stamp  # skipped: nothing rewritten
    before = shard_rows(cfg.run_root)

    # a crash after writing parts but before the commit: the marker is gone, a stray part remains
    marker.unlink()
    stray = tmp_path / "run/shards/path=p0/part-09999.parquet"
    stray.write_bytes((tmp_path / "run/shards/path=p1/part-00000.parquet").read_bytes())
    again = run_prepare(cfg)
    assert not stray.exists()
    assert without_timing(again) == without_timing(first)
    assert shard_rows(cfg.run_root) == before  # no document twice, none lost


def test_gzip_plain_and_a_glob_over_several_files_give_identical_shards(tmp_path):
    docs = encoded(good_lines(45, seed=3))
    write_lines(tmp_path / "plain" / "c4-train.00000-of-00001.json", docs)
    write_lines(tmp_path / "gz" / "c4-train.00000-of-00001.json.gz", docs, gz=True)
    for i in range(3):  # the same lines cut into three files
        write_lines(tmp_path / "many" / f"c4-train.{i:05d}-of-00003.json.gz", docs[i * 15 : (i + 1) * 15], gz=True)
    results = {}
    for name in ("plain", "gz", "many"):
        cfg = config(tmp_path, str(tmp_path / name / "*.json*"), name=f"run-{name}")
        manifest = run_prepare(cfg)
        results[name] = (shard_rows(cfg.run_root), manifest["paths"], manifest["router_checksum"])
    assert results["plain"] == results["gz"] == results["many"]
    assert sum(len(v) for v in results["plain"][0].values()) == 45


def test_multiprocessing_with_two_workers_matches_one_worker(messy, tmp_path, caplog):
    base, _, _ = messy
    train, val = str(base / "train/*.json"), str(base / "validation/*.json")
    single = run_prepare(config(tmp_path, train, val, name="one", options=IN_MEMORY))
    multi_cfg = config(
        tmp_path, train, val, name="two", options=["--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    )
    caplog.set_level(logging.INFO, logger="preprocessing")
    caplog.clear()
    multi = run_prepare(multi_cfg)
    assert without_timing(multi) == without_timing(single)
    assert shard_rows(multi_cfg.run_root) == shard_rows(tmp_path / "one")
    # the worker processes' progress files, summed by the driver, end at what the job routed
    assert routed_progress(caplog.text)[-1] == (multi["routed"], multi["lines_read"])


PROGRESS_LINE = re.compile(r"prepare: ([\d,]+) documents routed (?:so far|in all) \(([\d,]+) lines read\)")


def routed_progress(log_text: str) -> list[tuple[int, int]]:
    """(documents routed, lines read) of each progress line the driver logged, in order."""
    return [tuple(int(n.replace(",", "")) for n in m.groups()) for m in PROGRESS_LINE.finditer(log_text)]


def test_the_driver_logs_the_workers_progress_from_their_files_up_to_the_documents_routed(
    tmp_path, monkeypatch, caplog
):
    lines = encoded(good_lines(1500, seed=4))
    for offset, (raw, _) in zip(range(100, 1500, 200), BAD):
        lines.insert(offset, raw)
    for i in range(2):
        write_lines(tmp_path / "c4" / f"c4-train.{i:05d}-of-00002.json", lines[i::2])
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.01)  # the driver's line, usually every 10 s
    monkeypatch.setattr(progress, "WRITE_EVERY_S", 0.0)  # a worker's file, usually every 2 s
    caplog.set_level(logging.INFO, logger="preprocessing")
    cfg = config(tmp_path, str(tmp_path / "c4" / "*.json"), batch_size=16)
    manifest = run_prepare(cfg)

    counts = routed_progress(caplog.text)
    assert len({routed for routed, _ in counts}) >= 2, caplog.text[-3000:]  # seen while it ran
    assert counts == sorted(counts)  # sums of counters that only grow
    assert counts[-1] == (manifest["routed"], manifest["lines_read"]) == (1500, 1507)
    assert manifest["rejected"] == len(BAD)  # rejections are still counted as ever
    assert not re.search(r"prepare worker: .* so far", caplog.text)  # one report, the driver's, on every runner
    assert re.search(r"router sample: [\d,]+ lines read", caplog.text)  # the router's sampling job too
    root = RunRoot(cfg.run_root)
    assert not root.exists("shards/_work") and not root.exists("router/_work")  # the files went with the scratch
    assert not any("progress" in name for rel in ("shards", "router") for name in root.marker(rel)["files"])


def test_missing_inputs_raise_an_input_error_naming_the_glob(tmp_path):
    cfg = config(tmp_path, str(tmp_path / "absent" / "c4-train.*.json.gz"))
    with pytest.raises(InputError, match="absent"):
        run_prepare(cfg)
    assert not (tmp_path / "run" / "shards").exists()


def test_max_docs_caps_the_lines_read_in_file_order(messy, tmp_path):
    base, _, _ = messy
    cfg = config_from_dict(
        {
            **config(tmp_path, str(base / "train/*.json")).to_dict(),
            "data": {"train": str(base / "train/*.json"), "eval": None, "max_docs": 20, "max_doc_bytes": 1000},
        }
    )
    manifest = run_prepare(cfg)
    assert manifest["lines_read"] == 20 == manifest["routed"] + manifest["rejected"]
    assert manifest["rejected"] == 3  # lines 4, 11 and 18 of the file


def test_a_progress_file_that_cannot_be_written_is_reported_once_and_the_counting_goes_on(tmp_path, caplog):
    """Progress is advice: a worker whose file cannot be written (here a file stands where its
    directory goes) says so once and keeps counting; the driver finds nothing to sum."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "progress").write_text("a file where the directory goes")
    files = progress.ProgressFiles(str(tmp_path), "scratch/progress/job", 0.0)
    counts = files.counts()
    assert files.counts() is counts  # one per process, whichever DoFn asks
    for _ in range(3):
        counts.add(progress.LINES_READ)
    counts.flush()
    assert caplog.text.count("progress not reported") == 1 and "scratch/progress/job" in caplog.text
    assert counts.counts == {"lines read": 3} and progress.read_totals(files) == {}


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    pytest.importorskip("sklearn")
    from preprocessing.sample import build_sample

    out = tmp_path_factory.mktemp("wiki") / "sample"
    build_sample(out, limit=800)
    return out


def topics_by_url(sample_dir) -> dict[str, str]:
    found = {}
    for file in sample_dir.glob("*/*.json.gz"):
        for line in gzip.open(file, "rt", encoding="utf-8"):
            doc = json.loads(line)
            found[doc["url"]] = doc["topic"]
    return found


def routed_nmi(run_root, sample_dir) -> float:
    topic = topics_by_url(sample_dir)
    pairs = [(path, topic[doc_id]) for (_, path), rows in shard_rows(run_root).items() for doc_id, _ in rows]
    return normalized_mutual_info_score([t for _, t in pairs], [p for p, _ in pairs])


def test_minilm_routing_of_the_wikipedia_sample_separates_topics(wiki, tmp_path):
    """12 paths on 800 Wikipedia leads with the default embedder, through RunInference."""
    cfg = config_from_dict(
        {
            "run_root": str(tmp_path / "run"),
            "data": {"train": str(wiki / "train/*.json.gz"), "eval": str(wiki / "validation/*.json.gz")},
            "router": {"embedder": "minilm", "sample_docs": 600, "seed": 0},
            "model": {"grid": [12], "blocks_per_level": [1]},
            "beam": {"options": IN_MEMORY},
        }
    )
    manifest = run_prepare(cfg)
    assert manifest["routed"] == 800 and manifest["rejected"] == 0
    assert min(p["train"]["documents"] for p in manifest["paths"].values()) > 0
    nmi = routed_nmi(cfg.run_root, wiki)
    print(f"minilm NMI(path, topic) on 800 Wikipedia leads, 12 paths: {nmi:.3f}")
    assert nmi > 0.25
    # the same Router routes a text the same way outside Beam (evaluation, inference)
    router = Router.load(RunRoot(cfg.run_root))
    rows = shard_rows(cfg.run_root)
    some = [(doc_id, path) for (split, path), part in rows.items() if split == "validation" for doc_id, _ in part[:2]]
    texts = {}
    for line in gzip.open(next((wiki / "validation").glob("*.json.gz")), "rt", encoding="utf-8"):
        doc = json.loads(line)
        texts[doc["url"]] = doc["text"]
    assert router.route_texts([texts[d] for d, _ in some]) == [p for _, p in some]
