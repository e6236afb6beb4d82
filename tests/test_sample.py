"""The bundled Wikipedia sample: C4 format, seeded, topic labels kept."""

from __future__ import annotations

import gzip
import json
from collections import Counter

from preprocessing.c4 import Document, list_input_files, parse_line, read_lines
from preprocessing.sample import build_sample, load_articles


def test_source_has_the_twelve_vital_article_topics():
    articles = load_articles()
    assert len(articles) > 9000
    assert len({a["topic"] for a in articles}) == 12


def test_sample_is_c4_format_with_topics_and_reproducible(tmp_path):
    info = build_sample(tmp_path / "a", limit=300)
    build_sample(tmp_path / "b", limit=300)
    assert (tmp_path / "a/_SUCCESS").exists() and info["train"] + info["validation"] == 300
    train = list_input_files(str(tmp_path / "a/train/*.json.gz"))
    assert [f.rsplit("/", 1)[1] for f in train] == [f"c4-train.{i:05d}-of-00004.json.gz" for i in range(4)]
    assert list_input_files(str(tmp_path / "a/validation/*.json.gz"))[0].endswith(
        "c4-validation.00000-of-00001.json.gz"
    )
    lines = 0
    for file in train + list_input_files(str(tmp_path / "a/validation/*.json.gz")):
        for number, raw in read_lines(file):
            doc = json.loads(raw)
            assert {"text", "url", "timestamp", "topic"} <= set(doc)
            assert isinstance(parse_line(raw, "train", file, number, 1_000_000), Document)
            lines += 1
        twin = file.replace(str(tmp_path / "a"), str(tmp_path / "b"))
        assert gzip.decompress(open(file, "rb").read()) == gzip.decompress(open(twin, "rb").read())
    assert lines == 300
    assert build_sample(tmp_path / "a") == info  # complete: not rebuilt


def test_mixed_corpus_has_four_sources_each_kept_on_its_lines_and_is_reproducible(tmp_path):
    from preprocessing.mixed import build_mixed

    info = build_mixed(tmp_path / "a", per_source=60)
    build_mixed(tmp_path / "b", per_source=60)
    assert info["sources"] == {"licenses": 60, "python_code": 60, "python_docs": 60, "wikipedia": 60}
    assert info["train"] + info["validation"] == 240 and sum(info["validation_sources"].values()) == info["validation"]
    seen = Counter()
    for file in list_input_files(str(tmp_path / "a/*/*.json.gz")):
        for number, raw in read_lines(file):
            doc = json.loads(raw)
            seen[doc["source"]] += 1
            assert isinstance(parse_line(raw, "train", file, number, 1_000_000), Document)
            if doc["source"] == "python_code":  # a function without its docstring: that is python_docs' text
                assert doc["text"].startswith(("def ", "async def ")) and '"""' not in doc["text"].split("\n")[1]
        twin = file.replace(str(tmp_path / "a"), str(tmp_path / "b"))
        assert gzip.decompress(open(file, "rb").read()) == gzip.decompress(open(twin, "rb").read())
    assert seen == info["sources"]
