"""Throughput of the Beam prepare job against the bare embedder on the same documents.

`python -m benchmarks.bench_prepare [--n-docs N] [--multi-processing]`. The documents are the
first N Wikipedia leads of the bundled sample's source (10,033 in all), written as one C4 file;
the job runs with the config's default Beam options. Three numbers, all documents/second:
- `raw_embedder`: `SentenceTransformer.encode` of the documents' 32-token prefixes (model load
  excluded): the ceiling, since embedding is the job's dominant cost;
- `beam_route`: the routing pipeline (read, tokenize, embed via RunInference, assign, write
  Parquet) with the router already committed, end to end including pipeline start-up;
- `beam_full`: the whole `run_prepare`, router fit (sample pipeline + embedding the sample) included.
The ratios against `raw_embedder` are what the issue's 0.85 target refers to.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)
MULTI_PROCESSING = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


def _write_docs(directory: Path, n_docs: int) -> list[str]:
    from preprocessing.sample import load_articles, write_c4_file

    articles = load_articles()[:n_docs]
    rows = [{"text": a["text"], "url": a["url"], "timestamp": a["timestamp"]} for a in articles]
    write_c4_file(directory / "c4-train.00000-of-00001.json.gz", rows)
    return [a["text"] for a in articles]


def bench_prepare(
    n_docs: int = 10000,
    options: list[str] | None = None,
    sample_docs: int = 200,
    other_options: dict[str, list[str]] | None = None,
) -> dict:
    """Documents/s of the raw embedder, the routing pipeline and the whole job; and their ratios.

    `options`: the Beam options of the measured job (default: the config's default, i.e. what
    `dipaco prepare` runs); `other_options`: more option sets whose routing pipeline is timed
    too, against the same raw figure (e.g. the DirectRunner's multi-processing mode)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pipeline.core.config import BeamConfig, config_from_dict
    from pipeline.routing.embedders import MiniLMEmbedder
    from pipeline.routing.tokenizer import encode, prefix_texts
    from pipeline.state import layout
    from pipeline.state.storage import RunRoot
    from preprocessing.prepare import run_prepare

    options = options or BeamConfig().options
    with tempfile.TemporaryDirectory() as tmp:
        texts = _write_docs(Path(tmp) / "in", n_docs)
        prefixes = prefix_texts(encode(texts), 32)
        embedder = MiniLMEmbedder(batch_size=64)
        embedder.embed(prefixes[:64])  # warm-up
        start = time.perf_counter()
        embedder.embed(prefixes)
        raw_s = time.perf_counter() - start
        del embedder

        config = config_from_dict(
            {
                "run_root": f"{tmp}/run",
                "data": {"train": f"{tmp}/in/*.json.gz", "eval": None},
                "router": {"embedder": "minilm", "sample_docs": sample_docs},
                "model": {"grid": [4, 4], "blocks_per_level": [1, 1]},
                "beam": {"options": options},
            }
        )
        start = time.perf_counter()
        manifest = run_prepare(config)
        full_s = time.perf_counter() - start
        assert manifest["routed"] == n_docs, manifest["routed"]
        RunRoot(config.run_root).remove(layout.SHARDS_DIR)  # keep the committed router: route only
        start = time.perf_counter()
        run_prepare(config)
        route_s = time.perf_counter() - start
        other = {}
        for name, flags in (other_options or {}).items():
            RunRoot(config.run_root).remove(layout.SHARDS_DIR)
            config.beam.options = flags
            start = time.perf_counter()
            run_prepare(config)
            seconds = time.perf_counter() - start
            other[name] = {
                "options": flags,
                "route_docs_per_s": n_docs / seconds,
                "route_ratio": raw_s / seconds,
                "seconds": seconds,
            }

    result = {
        "n_docs": n_docs,
        "options": options,
        "raw_embedder_docs_per_s": n_docs / raw_s,
        "beam_route_docs_per_s": n_docs / route_s,
        "beam_full_docs_per_s": n_docs / full_s,
        "route_ratio": raw_s / route_s,
        "full_ratio": raw_s / full_s,
        "seconds": {"raw": raw_s, "route": route_s, "full": full_s},
        "sample_docs": sample_docs,
        "other_options": other,
    }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-docs", type=int, default=10000)
    parser.add_argument("--sample-docs", type=int, default=200)
    parser.add_argument("--multi-processing", action="store_true", help="also time the 2-worker multi-processing mode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    other = {"multi_processing_2": MULTI_PROCESSING} if args.multi_processing else None
    result = bench_prepare(args.n_docs, None, args.sample_docs, other)
    logging.getLogger().setLevel(logging.INFO)
    log.info("%s", json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
