"""The Beam steps of the prepare job, each a PTransform (config in __init__, wiring in expand, logic
in plain functions elsewhere), as in Beam's own examples.

    ReadC4 -> TokenizeDocs -> EmbedPrefix (RunInference) -> AssignPath -> WriteShards
           \\-> rejected -> WriteRejected                                     |
           \\-> line counts ----------------------------------------------> Summarize

Writers name their parts after a deterministic key (split, path, bucket) and sort rows, so a
retried bundle rewrites the same file with the same bytes and the shards do not depend on how
Beam split the work. Counts come back as data (the Summarize combine), not as Metrics, because
only committed bundle outputs are exact on every runner; Metrics feed the closing log line, and
progress is reported through files in the run root (preprocessing.progress), which every runner
passes on.

Every step also runs on Beam's DaskRunner (a Dask cluster), which executes only plain ParDos,
GroupByKey and Flatten and, measured on 2.77, silently loses what a DoFn emits in finish_bundle
(BatchElements' last batch, Top's per-bundle heaps) and sends every tagged output of a
multi-output ParDo to all its consumers. Hence, for both runners alike: documents are batched
where a file is read (no BatchElements; RunInference gets the batches as they are), the reader's
three outputs are one stream of (kind, value) pairs split by kind, and both global combines are
CombineGlobally(...).without_defaults() (no side input, no finish_bundle output). That runner also
computes only the last transform's graph, so every branch of a pipeline ends in its one sink.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, ModelHandler, PredictionResult, RunInference
from apache_beam.transforms.combiners import TopCombineFn

from pipeline.state import layout
from pipeline.state.shards import shard_table, write_shard_file
from pipeline.state.storage import RunRoot
from preprocessing import c4
from preprocessing.progress import DOCUMENTS_ROUTED, LINES_READ, ProgressFiles, counts_of

log = logging.getLogger(__name__)
# Beam logs every string annotation (from __future__ import annotations) at INFO; nothing to act on.
logging.getLogger("apache_beam.typehints.native_type_compatibility").setLevel(logging.WARNING)
NAMESPACE = "dipaco.prepare"
WORK_DIR = f"{layout.SHARDS_DIR}/_work"  # scratch of one attempt; removed before the commit
SUMMARY = f"{WORK_DIR}/summary.json"


def work_dir(shards: str) -> str:
    """The scratch of one routing attempt under a shards dir (`shards/_work` for prepare's)."""
    return f"{shards}/_work"


def summary_file(shards: str) -> str:
    return f"{work_dir(shards)}/summary.json"


def stable_bucket(key: str, buckets: int) -> int:
    """Same bucket in every process and run (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") % buckets


# -- ReadC4 --------------------------------------------------------------------------------------
DOCUMENTS, REJECTED, LINES = "documents", "rejected", "lines"  # the kinds ReadC4's reader emits


# What rejected/ keeps of a split's rejected lines: each line's first c4.RAW_CHARS characters, and
# records up to REJECTED_BYTES_PER_SPLIT in all, shared by the split's files (each file at least
# REJECTED_BYTES_PER_FILE_MIN). Every rejection is counted, kept or not: the manifest's counts stay
# exact while the records that travel to WriteRejected (and its GroupByKey, which holds a part in
# memory) are bounded. A record costs its text plus REJECTION_OVERHEAD (the Python objects of a
# Rejection, measured: lines of one "x" held ~220 times their size as whole records).
REJECTED_BYTES_PER_SPLIT = 16 << 20
REJECTED_BYTES_PER_FILE_MIN = 256 << 10
REJECTION_OVERHEAD = 256


def rejected_budgets(plan: list[tuple[str, str, int | None]]) -> dict[str, int]:
    """Bytes of rejection records each file of a split may keep: the split's cap shared by its files."""
    files = Counter(split for split, _, _ in plan)
    return {split: max(REJECTED_BYTES_PER_FILE_MIN, REJECTED_BYTES_PER_SPLIT // n) for split, n in files.items()}


def rejection_cost(record: c4.Rejection) -> int:
    return len(record.raw) + len(record.file) + REJECTION_OVERHEAD


class _ReadFileFn(beam.DoFn):
    """(split, file, line limit) -> (kind, value): batches of Documents, Rejections (up to the
    file's byte budget), line counts and exact rejection counts by reason."""

    def __init__(
        self,
        max_doc_bytes: int,
        batch_size: int,
        budgets: dict[str, int] | None = None,
        progress: ProgressFiles | None = None,
    ):
        self.max_doc_bytes, self.batch_size = max_doc_bytes, batch_size
        self.budgets, self.progress_files = budgets or {}, progress
        self.lines = Metrics.counter(NAMESPACE, "lines_read")
        self.documents = Metrics.counter(NAMESPACE, "documents_read")
        self.rejected = Metrics.counter(NAMESPACE, "rejected")

    def setup(self) -> None:
        self.progress = counts_of(self.progress_files)

    def process(self, element: tuple[str, str, int | None]) -> Iterator[tuple[str, Any]]:
        split, file, limit = element
        count, batch, reasons, budget, unlisted = 0, [], Counter(), self.budgets.get(split, REJECTED_BYTES_PER_SPLIT), 0
        for number, raw in c4.read_lines(file, limit, self.max_doc_bytes):
            count += 1
            record = c4.line_to_record(split, file, number, raw, self.max_doc_bytes)
            if isinstance(record, c4.Document):
                self.documents.inc()
                batch.append(record)
                if len(batch) == self.batch_size:
                    yield DOCUMENTS, batch
                    batch = []
            else:
                self.rejected.inc()
                reasons[record.reason] += 1
                budget -= rejection_cost(record)
                if budget >= 0:
                    yield REJECTED, record
                else:
                    unlisted += 1
            self.progress.add(LINES_READ)
        if batch:
            yield DOCUMENTS, batch
        self.lines.inc(count)
        yield LINES, ("lines", split, count)
        for reason, n in sorted(reasons.items()):  # the exact counts, kept in rejected/ or not
            yield LINES, ("rejected", split, reason, n)
        if unlisted:
            log.warning(
                "%s: %d rejected lines counted but not listed in rejected/ (over its %d-byte share)",
                file,
                unlisted,
                self.budgets.get(split, REJECTED_BYTES_PER_SPLIT),
            )
            yield LINES, ("unlisted", split, unlisted)

    def finish_bundle(self) -> None:
        self.progress.flush()


def _of_kind(record: tuple[str, Any], kind: str) -> Iterator[Any]:
    if record[0] == kind:
        yield record[1]


class ReadC4Outputs(NamedTuple):
    batches: beam.PCollection  # lists of up to batch_size Documents, in file order
    rejected: beam.PCollection  # Rejections
    lines: beam.PCollection  # ("lines", split, count) per file


class ReadC4(beam.PTransform):
    """The read plan [(split, file, limit)] -> ReadC4Outputs (batches, rejected, lines)."""

    def __init__(
        self,
        plan: list[tuple[str, str, int | None]],
        max_doc_bytes: int,
        batch_size: int = 64,
        progress: ProgressFiles | None = None,
    ):
        super().__init__()
        self.plan, self.max_doc_bytes, self.batch_size, self.progress = plan, max_doc_bytes, batch_size, progress

    def expand(self, pbegin) -> ReadC4Outputs:
        records = (
            pbegin
            | "ListFiles" >> beam.Create(self.plan)
            | "SpreadFiles" >> beam.Reshuffle()  # one file per element: files read in parallel
            | "ParseLines"
            >> beam.ParDo(_ReadFileFn(self.max_doc_bytes, self.batch_size, rejected_budgets(self.plan), self.progress))
        )
        return ReadC4Outputs(
            *(
                records | f"Select{kind.title()}" >> beam.FlatMap(_of_kind, kind)
                for kind in (DOCUMENTS, REJECTED, LINES)
            )
        )


# -- TokenizeDocs --------------------------------------------------------------------------------
class _TokenizeFn(beam.DoFn):
    """A batch of Documents -> one batch of ((split, doc_id, input_ids), prefix text)."""

    def __init__(self, prefix_tokens: int, root_url: str, kind: str):
        self.prefix_tokens, self.root_url, self.kind = prefix_tokens, root_url, kind
        self.tokens = Metrics.counter(NAMESPACE, "tokens")

    def setup(self) -> None:
        from pipeline.routing.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(RunRoot(self.root_url), self.kind)  # the committed one, on every worker

    def process(self, batch: list[c4.Document]) -> Iterator[list[tuple[tuple[str, str, list[int]], str]]]:
        from pipeline.routing.tokenizer import encode, prefix_texts

        ids = encode([d.text for d in batch], self.tokenizer)
        self.tokens.inc(sum(len(i) for i in ids))
        yield [
            ((doc.split, doc.doc_id, doc_ids), prefix)
            for doc, doc_ids, prefix in zip(batch, ids, prefix_texts(ids, self.prefix_tokens, self.tokenizer))
        ]


class TokenizeDocs(beam.PTransform):
    """Batches of Documents -> batches of (key, prefix text) cut by the run's tokenizer, the batches
    RunInference embeds."""

    def __init__(self, prefix_tokens: int, root_url: str, kind: str = "gpt2"):
        super().__init__()
        self.prefix_tokens, self.root_url, self.kind = prefix_tokens, root_url, kind

    def expand(self, batches):
        return batches | "Tokenize" >> beam.ParDo(_TokenizeFn(self.prefix_tokens, self.root_url, self.kind))


# -- EmbedPrefix ---------------------------------------------------------------------------------
class RouterEmbedderHandler(ModelHandler[str, PredictionResult, Any]):
    """Beam ML's view of the router's embedder: loaded once per worker, fed batches of prefixes."""

    def __init__(
        self, root_url: str, config_dict: dict | None, threads: int | None, router_dir: str = layout.ROUTER_DIR
    ):
        super().__init__()
        self.root_url, self.config_dict, self.threads, self.router_dir = root_url, config_dict, threads, router_dir

    def load_model(self):
        from pipeline.routing.router import Router

        if self.threads:
            import torch

            torch.set_num_threads(self.threads)  # N workers x threads = the cores, no oversubscription
        config = None
        if self.config_dict is not None:
            from pipeline.core.config import config_from_dict

            config = config_from_dict(self.config_dict, "<prepare>")
        embedder = Router.load(RunRoot(self.root_url), config, directory=self.router_dir).embedder
        log.info("prepare worker: %s embedder loaded", embedder.name)
        return embedder

    def run_inference(self, batch, model, inference_args=None) -> Iterable[PredictionResult]:
        vectors = model.embed(list(batch))
        return [PredictionResult(text, vector) for text, vector in zip(batch, vectors)]

    def get_metrics_namespace(self) -> str:
        return NAMESPACE + ".embed"


class EmbedPrefix(beam.PTransform):
    """Batches of (key, prefix text) -> (key, PredictionResult(prefix, feature)) through
    RunInference, which takes the reader's batches as they are (`with_no_batching`)."""

    def __init__(self, handler: RouterEmbedderHandler):
        super().__init__()
        self.handler = handler

    def expand(self, keyed_batches):
        return keyed_batches | "RunEmbedder" >> RunInference(KeyedModelHandler(self.handler).with_no_batching())


# -- AssignPath ----------------------------------------------------------------------------------
class _AssignFn(beam.DoFn):
    """(key, PredictionResult) -> ((split, path_id, bucket), (doc_id, input_ids))."""

    def __init__(
        self,
        root_url: str,
        parts_per_path: int,
        router_dir: str = layout.ROUTER_DIR,
        progress: ProgressFiles | None = None,
    ):
        self.root_url, self.parts, self.router_dir, self.progress_files = root_url, parts_per_path, router_dir, progress
        self.routed = Metrics.counter(NAMESPACE, "documents_routed")

    def setup(self) -> None:
        from pipeline.routing.router import Router

        # centroids (or classifier weights) only; no embedder loaded here
        self.router = Router.load(RunRoot(self.root_url), directory=self.router_dir)
        self.progress = counts_of(self.progress_files)

    def process(self, element):
        (split, doc_id, ids), result = element
        path = self.router.route_features(np.asarray(result.inference)[None, :])[0]
        self.routed.inc()
        self.progress.add(DOCUMENTS_ROUTED)
        yield (split, path, stable_bucket(doc_id, self.parts)), (doc_id, ids)

    def finish_bundle(self) -> None:
        self.progress.flush()


class AssignPath(beam.PTransform):
    def __init__(
        self,
        root_url: str,
        parts_per_path: int,
        router_dir: str = layout.ROUTER_DIR,
        progress: ProgressFiles | None = None,
    ):
        super().__init__()
        self.root_url, self.parts, self.router_dir, self.progress = root_url, parts_per_path, router_dir, progress

    def expand(self, embedded):
        return embedded | "Route" >> beam.ParDo(_AssignFn(self.root_url, self.parts, self.router_dir, self.progress))


# -- WriteShards / WriteRejected -----------------------------------------------------------------
class _WriteShardFn(beam.DoFn):
    def __init__(self, root_url: str, shards: str = layout.SHARDS_DIR):
        self.root_url, self.shards = root_url, shards

    def process(self, element) -> Iterator[tuple]:
        (split, path, bucket), rows = element
        rows = sorted(rows, key=lambda r: (r[0], r[1]))  # fixed order, whatever the bundling
        table = shard_table([r[0] for r in rows], [r[1] for r in rows])
        write_shard_file(
            RunRoot(self.root_url), f"{layout.shard_dir(path, split, self.shards)}/part-{bucket:05d}.parquet", table
        )
        yield ("shard", split, path, len(rows), sum(len(r[1]) for r in rows))


class WriteShards(beam.PTransform):
    """Routed documents -> one Parquet part per (split, path, bucket); emits shard stats."""

    def __init__(self, root_url: str, shards: str = layout.SHARDS_DIR):
        super().__init__()
        self.root_url, self.shards = root_url, shards

    def expand(self, routed):
        return (
            routed
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteParts" >> beam.ParDo(_WriteShardFn(self.root_url, self.shards))
        )


class _WriteRejectedFn(beam.DoFn):
    def __init__(self, root_url: str, rejected_dir: str = layout.REJECTED_DIR):
        self.root_url, self.rejected_dir = root_url, rejected_dir

    def process(self, element) -> Iterator[tuple]:
        """Write one part, sorted by file and line. Yields nothing: the reader counts rejections
        (all of them; this part holds those within the split's byte budget)."""
        (split, bucket), records = element
        records = sorted(records, key=lambda r: (r.file, r.line))
        text = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records)
        RunRoot(self.root_url).write_text(f"{self.rejected_dir}/part-{split}-{bucket:05d}.jsonl", text)
        return iter(())


class WriteRejected(beam.PTransform):
    """Rejections -> shards/rejected/part-<split>-<bucket>.jsonl; emits nothing (ReadC4 counts)."""

    def __init__(self, root_url: str, parts: int, rejected_dir: str = layout.REJECTED_DIR):
        super().__init__()
        self.root_url, self.parts, self.rejected_dir = root_url, parts, rejected_dir

    def expand(self, rejected):
        return (
            rejected
            | "KeyRejected" >> beam.Map(lambda r, n: ((r.split, stable_bucket(f"{r.file}:{r.line}", n)), r), self.parts)
            | "GroupRejected" >> beam.GroupByKey()
            | "WriteRejectedParts" >> beam.ParDo(_WriteRejectedFn(self.root_url, self.rejected_dir))
        )


# -- Summarize -----------------------------------------------------------------------------------
class SummaryFn(beam.CombineFn):
    """Stats tuples -> {split: {lines, paths: {id: [docs, tokens]}, rejected: {reason: n}}}."""

    def create_accumulator(self) -> dict:
        return {}

    def add_input(self, acc: dict, stat: tuple) -> dict:
        kind, split = stat[0], stat[1]
        entry = acc.setdefault(split, {"lines": 0, "paths": {}, "rejected": {}})
        if kind == "lines":
            entry["lines"] += stat[2]
        elif kind == "unlisted":
            entry["unlisted"] = entry.get("unlisted", 0) + stat[2]
        elif kind == "shard":
            docs_tokens = entry["paths"].setdefault(stat[2], [0, 0])
            docs_tokens[0] += stat[3]
            docs_tokens[1] += stat[4]
        else:
            entry["rejected"][stat[2]] = entry["rejected"].get(stat[2], 0) + stat[3]
        return acc

    def merge_accumulators(self, accumulators: Iterable[dict]) -> dict:
        merged: dict = {}
        for acc in accumulators:
            for split, entry in acc.items():
                into = merged.setdefault(split, {"lines": 0, "paths": {}, "rejected": {}})
                into["lines"] += entry["lines"]
                if entry.get("unlisted"):
                    into["unlisted"] = into.get("unlisted", 0) + entry["unlisted"]
                for path, (docs, tokens) in entry["paths"].items():
                    pair = into["paths"].setdefault(path, [0, 0])
                    pair[0] += docs
                    pair[1] += tokens
                for reason, n in entry["rejected"].items():
                    into["rejected"][reason] = into["rejected"].get(reason, 0) + n
        return merged

    def extract_output(self, acc: dict) -> dict:
        return acc


class Summarize(beam.PTransform):
    """All stats -> one summary.json under the shards' scratch dir, for the driver's manifest."""

    def __init__(self, root_url: str, summary: str = SUMMARY):
        super().__init__()
        self.root_url, self.summary = root_url, summary

    def expand(self, stats):
        return (
            stats
            | "CombineStats" >> beam.CombineGlobally(SummaryFn()).without_defaults()  # never empty: lines
            | "WriteSummary"
            >> beam.Map(lambda s, url, rel: RunRoot(url).write_json(rel, s), self.root_url, self.summary)
        )


# -- the router's sample -------------------------------------------------------------------------
def sample_key(seed: int, doc: c4.Document) -> str:
    """Content-based, so the sample is the same whatever the file names, compression or order."""
    return hashlib.sha256(f"{seed}\0{doc.doc_id}\0{doc.text}".encode("utf-8")).hexdigest()


def sample_text_chars(prefix_tokens: int) -> int:
    """How much of each sampled document the router's sample keeps: its start, far more than the
    embedder reads (prefix_tokens tokens) and what the bpe tokenizer trains on. The sample held
    up to router.sample_docs whole documents (data.max_doc_bytes each: 20 GB at the defaults)."""
    return max(SAMPLE_TEXT_CHARS, 64 * prefix_tokens)


SAMPLE_TEXT_CHARS = 4096  # the bundled sample's documents are shorter: the same sample as whole texts


class SampleDocs(beam.PTransform):
    """Batches of Documents -> one list of the `n` with the smallest sample keys (a seeded uniform
    sample, keyed on the whole text), each text cut to `chars`; nothing when there are no documents."""

    def __init__(self, n: int, seed: int, chars: int = SAMPLE_TEXT_CHARS):
        super().__init__()
        self.n, self.seed, self.chars = n, seed, chars

    def expand(self, batches):
        return (
            batches
            | "KeyBySample"
            >> beam.FlatMap(
                lambda b, seed, chars: [(sample_key(seed, d), d.doc_id, d.text[:chars]) for d in b],
                self.seed,
                self.chars,
            )
            | "SmallestKeys" >> beam.CombineGlobally(TopCombineFn(self.n, reverse=True)).without_defaults()
        )
