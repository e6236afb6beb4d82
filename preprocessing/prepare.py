"""`dipaco prepare`: C4-format documents -> the router artifact and one shard per path.

Two Beam pipelines, because routing needs a fitted router:
1. fit: read the training files, keep a seeded uniform sample (`router.sample_docs`), then in the
   driver embed the sample's prefixes, fit (product) k-means and commit `router/`;
2. route: ReadC4 -> TokenizeDocs -> EmbedPrefix -> AssignPath -> WriteShards (+ WriteRejected,
   Summarize) over the train and validation files; then the driver writes `shards/manifest.json`
   and commits `shards/` last.

Rerunnable: a committed `shards/` is returned as is; otherwise the leftovers of a crashed attempt
are removed first, so no document is written twice. A committed router is reused.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

from models.grid import all_path_ids
from pipeline.core.bounds import load_json
from pipeline.core.config import Config, load_config
from pipeline.core.errors import ConfigError, CorruptStateError
from pipeline.core.trust import check_beam_options, check_runner
from pipeline.routing.router import Router
from pipeline.routing.tokenizer import commit_bpe, describe, encode, load_tokenizer, prefix_texts, train_bpe
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from preprocessing import c4
from preprocessing.progress import DOCUMENTS_ROUTED, LINES_READ, ProgressFiles, ProgressMonitor
from preprocessing.transforms import (
    AssignPath,
    EmbedPrefix,
    ReadC4,
    RouterEmbedderHandler,
    SampleDocs,
    Summarize,
    TokenizeDocs,
    WriteRejected,
    WriteShards,
    sample_text_chars,
    summary_file,
    work_dir,
)

log = logging.getLogger(__name__)
SPLITS = {"train": "data.train", "validation": "data.eval"}
ROUTER_WORK = f"{layout.ROUTER_DIR}/_work"


# -- Beam plumbing -------------------------------------------------------------------------------
def pipeline_options(config: Config):
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = list(config.beam.options)
    if not any(f.startswith("--default_sdk_harness_log_level") for f in flags):
        # SDK workers log Beam's harness chatter at INFO to stderr; keep their warnings and our own lines
        flags += [
            "--default_sdk_harness_log_level=WARNING",
            '--sdk_harness_log_level_overrides={"preprocessing": "INFO"}',
        ]
    try:
        return PipelineOptions(flags)
    except (SystemExit, ValueError) as exc:  # argparse inside Beam exits on a bad flag
        raise ConfigError(
            f"{config.source}: beam.options {config.beam.options} are not valid Beam options ({exc})"
        ) from None


DIRECT_NAMES = ("DirectRunner", "direct", "FnApiRunner")
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"  # not in Beam's list of runner names


def make_runner(name: str, options, source: str = "<config>", extra: tuple[str, ...] | list[str] = ()):
    """The runner object for `beam.runner`: one of Beam's runners (trust.BEAM_RUNNERS), or one the
    config file lists in `beam.extra_runners` (`extra`; a fully qualified class may be listed
    there); anything else is refused before Beam imports it, since `create_runner` imports and
    calls whatever dotted name it gets. 'DirectRunner' means the FnApiRunner directly: Beam 2.77's
    DirectRunner tries Prism first, which downloads a binary and fails offline. The options go in
    the provision info as DirectRunner does, so SDK workers see them (log levels)."""
    check_runner(name, extra, source)
    if name in DIRECT_NAMES:
        from apache_beam.portability.api import beam_provision_api_pb2
        from apache_beam.runners.portability.fn_api_runner import fn_runner
        from apache_beam.runners.portability.portable_runner import JobServiceHandle

        encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
        provision = fn_runner.ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded))
        return fn_runner.FnApiRunner(provision_info=provision)
    from apache_beam.runners.runner import create_runner

    if name.lower() in ("dask", "daskrunner"):
        name = DASK_RUNNER
    try:
        return create_runner(name)  # Dataflow, Flink, Spark, Prism, a class path...
    except (ImportError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{source}: beam.runner {name!r} cannot be created ({exc})") from None


def make_pipeline(config: Config):
    import apache_beam as beam

    options = pipeline_options(config)
    runner = make_runner(config.beam.runner, options, config.source, config.beam.extra_runners)
    return beam.Pipeline(runner=runner, options=options)


def run_to_completion(pipeline, progress: ProgressMonitor | None = None):
    """Run and wait, with the job's `progress` logged from the driver all along (the
    DirectRunner's run() returns once the job is done, other runners' wait_until_finish()); then
    let go of what the runner holds: the DaskRunner opens a client to the
    cluster for every pipeline and never closes it (it kept reconnecting to a stopped cluster);
    and this process's torch thread count, which the direct runner's embedder sets to the cores
    in this very process: an island that re-shards (router.discriminative_after) or a run that
    trains in process went on training with that many threads beside its neighbours (measured
    in the quality benchmark: train tasks of 7 s took 75-120 s after an island's re-routing)."""
    import torch

    threads = torch.get_num_threads()
    with progress or contextlib.nullcontext():
        result = pipeline.run()
        try:
            result.wait_until_finish()
        finally:
            torch.set_num_threads(threads)
            client = getattr(result, "client", None)
            if client is not None:
                client.close()
    return result


def worker_threads(config: Config) -> int | None:
    """Torch threads per embedder: the cores shared among the direct runner's workers. Other
    runners size their own workers (a Dask nanny starts each worker with OMP_NUM_THREADS=1)."""
    from apache_beam.options.pipeline_options import DirectOptions

    if config.beam.runner not in DIRECT_NAMES:
        return None
    direct = pipeline_options(config).view_as(DirectOptions)
    workers = direct.direct_num_workers or 1
    if direct.direct_running_mode == "in_memory":
        workers = 1
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def in_process(config: Config) -> Config:
    """The config with the direct runner in memory: the island's rank 0 runs the Beam job itself,
    like its merges and evaluations, without starting worker processes beside the trainer."""
    if config.beam.runner not in DIRECT_NAMES:
        return config
    options = [o for o in config.beam.options if not o.startswith(("--direct_running_mode", "--direct_num_workers"))]
    beam = dataclasses.replace(
        config.beam, options=[*options, "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    )
    return dataclasses.replace(config, beam=beam)


def _read_plan(config: Config) -> list[tuple[str, str, int | None]]:
    """[(split, file, line limit)]: the files of each split (InputError names a glob matching none)."""
    plan = []
    for split, key in SPLITS.items():
        globs = getattr(config.data, key.split(".")[1])
        if globs is None:
            continue
        files = c4.list_input_files(globs, key)
        plan.extend(
            (split, file, limit)
            for file, limit in c4.plan_reads(files, config.data.max_docs, config.data.max_doc_bytes)
        )
    return plan


# -- step 1: the router --------------------------------------------------------------------------
def fit_router(config: Config, root: RunRoot, plan: list[tuple[str, str, int | None]]) -> Router:
    """Sample, train the tokenizer (bpe), embed, k-means; commits `tokenizer/` then `router/`.
    A committed router matching the config is reused."""
    tokenizer_pending = config.model.tokenizer == "bpe" and not root.is_committed(layout.TOKENIZER_DIR)
    if root.is_committed(layout.ROUTER_DIR) and not tokenizer_pending:
        router = Router.load(root, config)
        _check_router(router, config, root)
        log.info("router: reusing the committed router in %s", root.path(layout.ROUTER_DIR))
        return router
    root.remove(layout.ROUTER_DIR)  # leftovers of a crashed fit (or a router cut by another tokenizer)
    r = config.router
    start = time.time()
    texts = sample_training_texts(config, root, plan)
    tokenizer = ensure_tokenizer(config, root, texts)
    texts = texts[: r.sample_docs]  # the sample is sorted by its seeded key: any prefix is uniform too
    log.info("router: sampled %d documents in %.1fs", len(texts), time.time() - start)
    prefixes = prefix_texts(encode(texts, tokenizer), r.prefix_tokens, tokenizer)
    embedder, extra = _new_embedder(config, root, prefixes)
    features = embedder.embed(prefixes)
    router = Router.fit(
        features,
        config.model.grid,
        embedder=r.embedder,
        prefix_tokens=r.prefix_tokens,
        seed=r.seed,
        iters=r.kmeans_iters,
        balanced=r.balanced,
        capacity_factor=r.capacity_factor,
        extra={"tokenizer": config.model.tokenizer, **extra},
    )
    root.remove(ROUTER_WORK)
    router.save(root, embedder)
    log.info(
        "router: %s features (dim %d), grid %s, fitted and committed in %.1fs",
        r.embedder,
        features.shape[1],
        config.model.grid,
        time.time() - start,
    )
    return Router.load(root, config)


def sample_training_texts(config: Config, root: RunRoot, plan) -> list[str]:
    """A seeded uniform sample of the training documents' texts, sorted by sample key: the
    router's `router.sample_docs`, or the tokenizer's `model.tokenizer_sample_docs` if larger."""
    n = config.router.sample_docs
    if config.model.tokenizer == "bpe":
        n = max(n, config.model.tokenizer_sample_docs)
    pipeline = make_pipeline(config)
    train_plan = [p for p in plan if p[0] == "train"]
    progress = ProgressFiles.new(root.url, ROUTER_WORK)
    read = pipeline | "ReadC4" >> ReadC4(train_plan, config.data.max_doc_bytes, config.router.batch_size, progress)
    (
        read.batches
        | "SampleDocs" >> SampleDocs(n, config.router.seed, sample_text_chars(config.router.prefix_tokens))
        | "SaveSample" >> _save_json(root.url, f"{ROUTER_WORK}/sample.json")
    )
    run_to_completion(pipeline, ProgressMonitor(progress, "router sample", (LINES_READ,)))
    sample_file = f"{ROUTER_WORK}/sample.json"  # [[key, doc_id, text]] by key; absent: no documents
    if not root.exists(sample_file):
        return []
    # each text at most sample_text_chars characters, at most 6 bytes each in JSON (\\uXXXX escapes)
    bound = n * (6 * sample_text_chars(config.router.prefix_tokens) + 1024)
    sample = load_json(root.read_bytes(sample_file, max_bytes=bound), root.path(sample_file), list)
    if not all(isinstance(s, list) and len(s) == 3 and isinstance(s[2], str) for s in sample):
        raise CorruptStateError(f"{root.path(sample_file)}: expected [[key, doc_id, text], ...]")
    return [text for _, _, text in sample]


def ensure_tokenizer(config: Config, root: RunRoot, texts: list[str]):
    """The run's tokenizer; for bpe, trained on the sample and committed first if it is not yet."""
    m = config.model
    if m.tokenizer == "bpe" and not root.is_committed(layout.TOKENIZER_DIR):
        start = time.time()
        root.remove(layout.TOKENIZER_DIR)
        sample = texts[: m.tokenizer_sample_docs]
        trained = train_bpe(sample, m.vocab_size)
        marker = commit_bpe(root, trained, len(sample))
        if marker["vocab_size"] < m.vocab_size:
            log.warning(
                "tokenizer: the sample held merges for %d ids only (model.vocab_size %d): ids above stay unused",
                marker["vocab_size"],
                m.vocab_size,
            )
        log.info(
            "tokenizer: byte-level BPE of %d ids trained on %d documents and committed in %.1fs",
            marker["vocab_size"],
            len(sample),
            time.time() - start,
        )
    return load_tokenizer(root, m.tokenizer)


def _save_json(url: str, rel: str):
    import apache_beam as beam

    return beam.Map(lambda data, url, rel: RunRoot(url).write_json(rel, data), url, rel)


def _new_embedder(config: Config, root: RunRoot, prefixes: list[str]):
    from pipeline.routing import embedders

    r = config.router
    if r.embedder == "tfidf":
        return embedders.TfidfEmbedder.fit(prefixes, r.tfidf_dim, r.seed), {}
    if r.embedder == "model":
        path = r.model_path or all_path_ids(config.model.grid)[0]
        try:
            embedder = embedders.PathModelEmbedder.from_run(root, config, r.model_round, path, r.model_layer)
        except ImportError:
            raise ConfigError(f"{config.source}: router.embedder=model needs pipeline.state.module_store") from None
        return embedder, {"model_round": r.model_round, "model_path": path, "model_layer": r.model_layer}
    return embedders.MiniLMEmbedder(batch_size=r.batch_size), {}


def _check_router(router: Router, config: Config, root: RunRoot) -> None:
    header, r = router.header, config.router
    wanted = {
        "embedder": r.embedder,
        "grid": list(config.model.grid),
        "prefix_tokens": r.prefix_tokens,
        "tokenizer": config.model.tokenizer,
    }
    for key, value in wanted.items():
        if header.get(key) != value:
            raise ConfigError(
                f"{config.source}: the committed router in {root.path(layout.ROUTER_DIR)} "
                f"has {key}={header.get(key)!r} "
                f"but the config says {value!r}; use a new run_root (or remove router/) to change it"
            )


# -- step 2: route and write ---------------------------------------------------------------------
def route_documents(
    config: Config, root: RunRoot, plan, router: Router, test_pipeline=None, routing: layout.Routing = layout.KMEANS
):
    """The routing pipeline with the router committed in `routing.router`, writing under
    `routing.shards`; returns the Beam result (for its metrics)."""
    import apache_beam as beam

    pipeline = test_pipeline or make_pipeline(config)
    handler = RouterEmbedderHandler(
        root.url,
        config.to_dict() if config.router.embedder == "model" else None,
        worker_threads(config),
        routing.router,
    )
    progress = ProgressFiles.new(root.url, work_dir(routing.shards))
    read = pipeline | "ReadC4" >> ReadC4(plan, config.data.max_doc_bytes, config.router.batch_size, progress)
    shard_stats = (
        read.batches
        | "SpreadDocs" >> beam.Reshuffle()  # batches of one file would otherwise all embed on one worker
        | "TokenizeDocs" >> TokenizeDocs(config.router.prefix_tokens, root.url, config.model.tokenizer)
        | "EmbedPrefix" >> EmbedPrefix(handler)
        | "AssignPath" >> AssignPath(root.url, config.data.parts_per_path, routing.router, progress)
        | "WriteShards" >> WriteShards(root.url, routing.shards)
    )
    rejected_stats = read.rejected | "WriteRejected" >> WriteRejected(
        root.url, config.data.parts_per_path, routing.rejected
    )
    (  # the one sink every branch ends in (the DaskRunner computes only the last transform's graph)
        (shard_stats, rejected_stats, read.lines)
        | "MergeStats" >> beam.Flatten()
        | "Summarize" >> Summarize(root.url, summary_file(routing.shards))
    )
    return run_to_completion(pipeline, ProgressMonitor(progress, "prepare", (DOCUMENTS_ROUTED, LINES_READ)))


def write_shards(
    config: Config,
    root: RunRoot,
    plan,
    router: Router,
    test_pipeline=None,
    routing: layout.Routing = layout.KMEANS,
    started: float | None = None,
) -> dict:
    """Route every document of the plan with `router` into `routing.shards`, write its manifest
    and commit it last; returns the manifest. A crashed attempt's parts are removed first."""
    start = time.time()
    started = start if started is None else started
    root.remove(routing.shards)  # a crashed attempt's parts: start clean, no document twice
    with quiet_beam():
        result = route_documents(config, root, plan, router, test_pipeline, routing)
    log.info("prepare: routing pipeline done in %.1fs", time.time() - start)
    summary = root.read_json(summary_file(routing.shards))
    root.remove(work_dir(routing.shards))
    manifest = build_manifest(summary, config, router, plan, root)
    manifest["seconds"] = round(time.time() - started, 3)
    root.write_json(routing.manifest, manifest)
    root.commit(
        routing.shards,
        info={"routed": manifest["routed"], "rejected": manifest["rejected"], "router_checksum": router.checksum},
    )
    log_summary(manifest, _counters(result))
    return manifest


def build_manifest(summary: dict, config: Config, router: Router, plan, root: RunRoot) -> dict[str, Any]:
    """Docs and tokens per path and split, and an accounting that must add up exactly."""
    path_ids = all_path_ids(config.model.grid)
    splits_present = sorted({split for split, _, _ in plan}, key=list(SPLITS).index)
    paths: dict[str, dict] = {p: {} for p in path_ids}
    splits: dict[str, dict] = {}
    for split in splits_present:
        entry = summary.get(split, {"lines": 0, "paths": {}, "rejected": {}})
        for p in path_ids:
            docs, tokens = entry["paths"].get(p, [0, 0])
            paths[p][split] = {"documents": docs, "tokens": tokens}
        routed = sum(d for d, _ in entry["paths"].values())
        rejected = sum(entry["rejected"].values())
        if routed + rejected != entry["lines"]:  # a bug, never bad input: refuse to commit
            raise RuntimeError(f"{split}: {entry['lines']} lines read but {routed} routed + {rejected} rejected")
        splits[split] = {
            "files": sorted(f for s, f, _ in plan if s == split),
            "lines_read": entry["lines"],
            "routed": routed,
            "rejected": rejected,
            "rejected_by_reason": dict(sorted(entry["rejected"].items())),
            "tokens": sum(t for _, t in entry["paths"].values()),
        }
        if entry.get("unlisted"):  # counted, but past the split's byte budget for rejected/ (transforms.py)
            splits[split]["rejected_not_listed"] = entry["unlisted"]
    reasons: dict[str, int] = {}
    for s in splits.values():
        for reason, n in s["rejected_by_reason"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        "lines_read": sum(s["lines_read"] for s in splits.values()),
        "routed": sum(s["routed"] for s in splits.values()),
        "rejected": sum(s["rejected"] for s in splits.values()),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "splits": splits,
        "paths": paths,
        "grid": list(config.model.grid),
        "router": {
            "checksum": router.checksum,
            "kind": router.kind,
            "embedder": router.header["embedder"],
            "dim": router.header["dim"],
            "prefix_tokens": router.header["prefix_tokens"],
        },
        "router_checksum": router.checksum,
        "tokenizer": describe(root, config.model.tokenizer),
        "max_docs": config.data.max_docs,
    }


def log_summary(manifest: dict, metrics: dict[str, int]) -> None:
    """The one-screen summary: counters, then documents and tokens per path."""
    if metrics:
        log.info("prepare counters: %s", ", ".join(f"{k}={v}" for k, v in sorted(metrics.items())))
    splits = list(manifest["splits"])
    header = f"{'path':<12}" + "".join(f"{s + ' docs':>18}{s + ' tokens':>18}" for s in splits)
    lines = [header, "-" * len(header)]
    for path, entry in manifest["paths"].items():
        lines.append(f"{path:<12}" + "".join(f"{entry[s]['documents']:>18,}{entry[s]['tokens']:>18,}" for s in splits))
    lines.append(
        f"lines read {manifest['lines_read']:,}, routed {manifest['routed']:,}, "
        f"rejected {manifest['rejected']:,} {manifest['rejected_by_reason'] or ''}"
    )
    log.info("prepare summary\n%s", "\n".join(lines))


def _counters(result) -> dict[str, int]:
    try:
        from apache_beam.metrics.metric import MetricsFilter

        found = result.metrics().query(MetricsFilter().with_namespace("dipaco.prepare"))["counters"]
        return {c.key.metric.name: int(c.committed or 0) for c in found}
    except Exception as exc:  # metrics are for the log only; some runners do not report them
        log.debug("no Beam metrics: %s", exc)
        return {}


class _WorkerLinesOnly(logging.Filter):
    """Keeps our workers' own lines (an embedder loaded) among the messages Beam relays from its SDK
    workers; progress comes through files on every runner (preprocessing.progress)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "prepare worker:" in record.getMessage()


@contextlib.contextmanager
def quiet_beam():
    """Beam's INFO chatter (harness start/stop, gRPC) buries the job's own lines; keep warnings,
    and from the relayed worker logs only our workers' lines."""
    beam_log = logging.getLogger("apache_beam")
    relay = logging.getLogger("apache_beam.runners.portability.local_job_service")
    level, relay_level, relay_filter = beam_log.level, relay.level, _WorkerLinesOnly()
    beam_log.setLevel(logging.WARNING)
    relay.setLevel(logging.INFO)
    relay.addFilter(relay_filter)
    try:
        yield
    finally:
        beam_log.setLevel(level)
        relay.setLevel(relay_level)
        relay.removeFilter(relay_filter)


# -- entry points --------------------------------------------------------------------------------
def run_prepare(config: Config, test_pipeline=None) -> dict:
    """Router and shards for this config's run root; returns the manifest (skips if committed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = RunRoot(config.run_root)
    if root.is_committed(layout.SHARDS_DIR):
        log.info("prepare: %s is committed; skipping", root.path(layout.SHARDS_DIR))
        return root.read_committed_json(layout.SHARDS_DIR, "manifest.json")
    if config.router.prefix_tokens <= 0 or config.data.parts_per_path < 1:
        raise ConfigError(f"{config.source}: router.prefix_tokens and data.parts_per_path must be >= 1")
    plan = _read_plan(config)
    start = time.time()
    with quiet_beam():
        router = fit_router(config, root, plan)
    return write_shards(config, root, plan, router, test_pipeline, started=start)  # seconds: the fit included


def reshard(config: Config, root: RunRoot, router: Router, routing: layout.Routing, test_pipeline=None) -> dict:
    """Both splits routed again with `router` into `routing.shards` and committed (the re-routing
    of router.discriminative_after, pipeline.evaluation.reroute): this job on the run's input
    files, in process (in_process); returns the manifest."""
    beam_config = in_process(config)
    return write_shards(beam_config, root, _read_plan(beam_config), router, test_pipeline, routing=routing)


def run(argv: list[str] | None = None, test_pipeline=None) -> dict:
    """Beam-examples style entry: `python -m preprocessing.prepare --config FILE [--set k=v] [Beam flags]`.

    Flags this parser does not know are Beam pipeline options and replace `beam.options`.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    known, beam_args = parser.parse_known_args(argv)
    config = load_config(known.config, known.set)
    if beam_args:  # the operator's own command line, as trusted as the config file
        check_beam_options(beam_args, beam_args, config.source)
        config.beam.options = beam_args
    return run_prepare(config, test_pipeline=test_pipeline)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run()
