"""Train one path for one round on its island: the process every DeepSpeed rank runs.

Launched as `deepspeed --num_gpus N --no_local_rank --module pipeline.train.train_path --run-root URL
--round R --path ID` (N CPU ranks with gloo here, N GPUs with NCCL elsewhere), or called in
process with one rank. Reads the round's modules and the path's shard, runs `inner_steps` AdamW
steps under ZeRO, writes the trained path and its metrics, and commits the path's directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import posixpath
import re
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from models.grid import parse_job_id
from models.modular import ModelShape, ModuleState, build_path_model, split_path_state, to_module_key
from pipeline.core.config import Config, add_own_config_args, own_config
from pipeline.core.errors import ConfigError, CorruptStateError, DipacoError, InputError
from pipeline.outer import compression
from pipeline.state import layout
from pipeline.state.module_store import encode, level_runs, load_path_modules
from pipeline.state.shards import read_path_rows
from pipeline.state.storage import FILES_AT, PARTS, RunRoot, map_io, safe_relative
from pipeline.train import midtask
from pipeline.train.data import RowStream, micro_batch_start, pack_documents
from pipeline.train.distributed import apply_rank_threads, init_distributed, run_rank
from pipeline.train.precision import agree
from pipeline.train.precision import resolve as resolve_precision
from pipeline.train.zero import (
    OPTIMIZER_STATE_FORMAT,
    compile_forward,
    full_state,
    load_ds_config,
    load_optimizer_state,
    optimizer_state_bytes,
    optimizer_state_file,
    optimizer_state_files,
    read_optimizer_state,
    release_engine,
    wrap_with_zero,
)

log = logging.getLogger("dipaco.train")


def lr_at(step: int, total_steps: int, train) -> float:
    """Linear warmup, constant lr, then cosine decay to lr * min_lr_ratio over the run's last
    `train.lr_decay_steps` steps (all rounds; null: every step after warmup, a plain cosine).

    A short decay at the end (warmup-stable-decay) lets a run far from convergence keep its full lr
    while it learns and still anneal (the demo's tuning, benchmarks/RESULTS.md)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    after_warmup = max(1, total_steps - train.warmup_steps)
    decay = after_warmup if train.lr_decay_steps is None else min(train.lr_decay_steps, after_warmup)
    progress = min(1.0, max(0, step - (total_steps - decay)) / max(1, decay))
    floor = train.lr * train.min_lr_ratio
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * progress))


def adamw_for(model: torch.nn.Module, train) -> torch.optim.AdamW:
    """Torch AdamW (DeepSpeed's config-declared optimizers JIT-compile for ~95 s on the CPU).
    Weight decay on matrices only, as in nanoGPT and Llama: not on norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas))


def worker_documents(
    root: RunRoot, config: Config, routing: layout.Routing, shard_path: str, worker: int, workers: int
) -> list[np.ndarray]:
    """Worker k of the round's M workers: every M-th document of the path's shard (train.worker_data
    iid), or its own k-means cluster of it (clustered: the DiLoCo paper's non-iid workers)."""
    rows = read_path_rows(root, shard_path, shards=routing.shards)
    if worker >= workers:
        raise ConfigError(
            f"--path: worker {worker} does not train in a round of {workers} worker(s) (train.workers_schedule)"
        )
    if workers == 1 or config.train.worker_data == "iid":
        return [tokens for _, tokens in rows[worker::workers]]
    from pipeline.routing.worker_split import worker_labels

    labels = worker_labels(root, config, routing, shard_path, [i for i, _ in rows], [t for _, t in rows], workers)
    return [tokens for (_, tokens), label in zip(rows, labels) if label == worker]


# (steps done, the step this attempt started from, seconds of its inner loop so far): what a lease
# heartbeats so that an idle island can tell a straggler from a long task (TaskQueue.claim_backup).
StepReport = Callable[[int, int, float], None]


class AttemptCancelled(Exception):
    """This attempt stopped early: another attempt's output is committed, or its lease was lost."""


def train_path(
    config: Config,
    round_index: int,
    path_id: str,
    attempt: str | None = None,
    may_publish: Callable[[], bool] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_step: StepReport | None = None,
    keep_inner_state_later: bool = False,
    held_inner_state: InnerState | None = None,
    start_modules: Callable[[], list[ModuleState]] | None = None,
) -> dict:
    """Run on every rank of the island; returns the job's metrics (committed by rank 0), with
    `published` (rank 0: whether this attempt's output is the one committed) and `inner_state`:
    whether this attempt's inner optimizer state is the one the path keeps (keep_inner_state), or,
    with `keep_inner_state_later` on a one-rank island, the InnerState still to keep, which the
    caller keeps while it holds the lease: the task is published without waiting for its largest
    upload, and the island goes on to its next task meanwhile.

    `path_id` is a job id: the path, or `<path>.w<k>` for DiLoCo worker k of the path. `attempt`
    names this attempt's staging directory (an island's lease number; default: one per launch),
    `may_publish` re-checks on rank 0, right before publishing, that the lease is still held;
    `should_stop` (given on every rank or none) ends the attempt early with AttemptCancelled;
    `on_step` (rank 0's lease) hears of every step done, for the backup estimate;
    `held_inner_state`: the path's inner state of round r-1 as this process kept it, resumed from
    memory while it is still going up (Island.keep_later); `start_modules`: the path's modules at
    the round's start as the caller has them (an early start, pipeline/outer/early.py: its
    `may_publish` checks them against the committed merges), instead of reading them committed."""
    root = RunRoot(config.run_root)
    workers = config.train.workers_per_path
    try:
        shard_path, modules, worker = parse_job_id(path_id, config.model.grid, workers)
    except ValueError as exc:
        raise ConfigError(f"--path: {exc}") from None
    shape = ModelShape.from_config(config.model)
    # Input first, the process group after: a missing or unreadable shard fails the job in seconds.
    began = time.perf_counter()
    # The modules on a thread meanwhile: on an object store they are round trips (each module's
    # marker, an early start's merge inputs), which the shard's reading and packing overlap.
    reading = ThreadPoolExecutor(1, thread_name_prefix="modules")
    start = start_modules or (lambda: load_path_modules(root, round_index, modules, shape, config.model.grid))
    modules_read = reading.submit(start)
    reading.shutdown(wait=False)
    routing = layout.routing(config.router.discriminative_after, round_index)  # k-means or re-routed
    shards = routing.shards
    docs = worker_documents(root, config, routing, shard_path, worker, config.train.workers_in_round(round_index))
    rank, world = init_distributed()
    train = config.train
    torch.manual_seed(train.seed + round_index)

    top = max((int(doc.max()) for doc in docs if len(doc)), default=-1)
    if top >= shape.vocab_size:  # past the embedding table: torch's "index out of range in self" at the first step
        raise InputError(
            f"{root.path(layout.shard_dir(shard_path, shards=shards))}: token id {top} is past model.vocab_size "
            f"{shape.vocab_size} (the shards were tokenized with more ids); set model.vocab_size to at least {top + 1}"
        )
    rows = pack_documents(docs, config.model.seq_len, seed=train.seed + worker, eos=shape.eos_id)
    if len(rows) == 0:
        raise InputError(
            f"{root.path(layout.shard_dir(shard_path, shards=shards))}: "
            f"too few tokens for one row of {config.model.seq_len + 1}"
        )
    stream = RowStream(rows, seed=train.seed + worker)

    model = build_path_model(shape, modules_read.result(), seed=train.seed)
    start_state = {k: v.detach().clone() for k, v in model.named_parameters()}
    precision = agree(resolve_precision(train, shape) if rank == 0 else None, rank, world)  # cached per host
    ds_config = load_ds_config(train, shape, world, precision)
    compiled = compile_forward(model, train, ds_config)  # train.compile; lazily, at the first step
    loaded = time.perf_counter()
    engine = wrap_with_zero(model, adamw_for(model, train), ds_config)
    attempt = attempt or _launch_attempt(world)
    try:
        progress = resume_midtask(engine, root, round_index, path_id, world) if train.checkpoint_every else None
        resumed_from = None if progress else resume_inner_state(engine, root, round_index, path_id, held_inner_state)
        built = time.perf_counter()

        def checkpoint(step: int, losses: torch.Tensor, lrs: list[float]) -> None:
            midtask.save(engine, root, round_index, path_id, attempt, step, losses, lrs, rank, world)

        metrics = run_inner_loop(
            engine,
            stream,
            config,
            round_index,
            rank,
            world,
            should_stop,
            progress,
            checkpoint if train.checkpoint_every else None,
            on_step,
        )
        # What a task spends besides its inner loop (the island's lease adds the commit after it).
        metrics["setup_seconds"] = {"load": loaded - began, "engine": built - loaded}
        metrics.update(
            round=round_index,
            path=path_id,
            shard_path=shard_path,
            worker=worker,
            modules=[[lvl, k] for lvl, k in enumerate(modules)],
            world_size=world,
            ds_config=ds_config,
            precision=precision.name,
            precision_reason=precision.reason,
            threads=torch.get_num_threads(),
            compiled=compiled,
            resumed_inner_state_from=resumed_from,
            shards=shards,
            shard_docs=len(docs),
            shard_tokens=int(sum(len(d) for d in docs)),
            shard_rows=len(rows),
        )
        metrics["resumed_from_step"] = progress["step"] if progress else 0
        staging = layout.staging_dir(round_index, path_id, attempt)
        staged, inner = commit_path(
            engine,
            root,
            round_index,
            path_id,
            shape,
            metrics,
            rank,
            start_state=start_state,
            compression_kind=config.outer.compression,
            staging=staging,
        )
        if rank == 0:
            metrics["published"] = publish_path(root, round_index, path_id, staging, may_publish, staged)
        # Kept after publishing, which is all the merges wait for; a round's commit waits for both.
        later = keep_inner_state_later and world == 1  # more ranks meet at a barrier: not beside the next task
        metrics["inner_state"] = inner if later else keep_inner_state(inner, may_publish)
    except AttemptCancelled:
        if rank == 0:  # once the path is committed, what this attempt checkpointed is moot
            drop_unpublished(root, round_index, path_id)
        raise
    finally:
        release_engine(engine)  # an in-process run trains path after path in one process
    return metrics


def _launch_attempt(world: int) -> str:
    """A staging name every rank of one launch agrees on without a collective: the launcher's
    rendezvous port (unique among launches at once on a host), or a fresh id for one rank."""
    if world > 1 and os.environ.get("MASTER_PORT"):
        return f"launch-{os.environ.get('MASTER_ADDR', '')}-{os.environ['MASTER_PORT']}"
    return f"launch-{uuid.uuid4().hex[:12]}"


def publish_path(
    root: RunRoot,
    round_index: int,
    path_id: str,
    staging: str,
    may_publish: Callable[[], bool] | None = None,
    staged: dict | None = None,
) -> bool:
    """Make the committed staging directory the path's output, unless this attempt lost its lease
    or another attempt published first; a discarded output is removed and logged, never mixed in.
    `staged`: the staging directory's `_SUCCESS` as commit_path wrote it."""
    rel = layout.path_dir(round_index, path_id)
    published = (may_publish is None or may_publish()) and root.publish_dir(staging, rel, staged)
    if not published:
        why = "another attempt published first" if root.is_committed(rel) else "it lost its lease"
        log.warning("path %s round %d: %s; %s is discarded", path_id, round_index, why, staging)
        drop_staging(root, staging)
    # Once the path is committed, no other staged attempt is ever read (crashed attempts' leftovers,
    # mid-task checkpoints); on an object store the published one holds the path's files.
    drop_unpublished(root, round_index, path_id, root.published_files_at(staging) if published else None)
    return published


def drop_unpublished(root: RunRoot, round_index: int, path_id: str, published: str | None = None) -> None:
    """Once a path is committed: remove its staged attempts but the one its `_SUCCESS` names, where
    an object store reads the path's files (`published`, when the caller just published it and
    knows; else the marker says, and a local root, which renamed the attempt away, keeps none).
    Nothing while the path is not committed."""
    base = layout.staging_dir(round_index, path_id)
    if published is None:
        marker = root.marker_if_committed(layout.path_dir(round_index, path_id))
        if marker is None:
            return
        published = marker.get(FILES_AT)
    if published is None:  # nothing of the path lies here (a local root renamed it there): all of it at once
        drop_staging(root, base)
        return
    others = [f"{base}/{name}" for name in root.listdir(base) if f"{base}/{name}" != published]
    map_io(lambda rel: drop_staging(root, rel), others, root.io_threads)


def drop_staging(root: RunRoot, rel: str) -> None:
    """Remove staged attempts nobody will read. A backup attempt may still be writing its own
    checkpoint under the same path's staging place (rmtree then fails with "directory not empty":
    it crashed the island that had just published, in the chaos benchmark's fault-free run); what
    it leaves, it removes itself when it is cancelled, so a failed cleanup is only logged."""
    try:
        root.remove(rel)
    except OSError as exc:
        log.info("%s not removed yet (another attempt still writes there): %s", rel, exc)


def path_loss(engine, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro batch's next-token loss through the engine's (compiled) forward: the one graph every
    step runs, and the one the compile warm-up (pipeline/compile_warmup.py) compiles beforehand."""
    logits = engine(input_ids=inputs).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def run_inner_loop(
    engine,
    stream: RowStream,
    config: Config,
    round_index: int,
    rank: int,
    world: int,
    should_stop: Callable[[], bool] | None = None,
    progress: dict | None = None,
    checkpoint: Callable[[int, torch.Tensor, list[float]], None] | None = None,
    on_step: StepReport | None = None,
) -> dict:
    """`inner_steps` optimizer steps (from a mid-task checkpoint's `progress` on); the order of work
    per step is fixed: (stop?) -> lr -> fwd/bwd -> step -> log -> (checkpoint every train.checkpoint_every)."""
    import torch.distributed as dist

    train = config.train
    total_steps = train.rounds * train.inner_steps
    log_every = max(1, train.inner_steps // 5)
    losses = torch.zeros(train.inner_steps, device=engine.device)  # this rank's loss per step; reduced once at the end
    lrs: list[float] = []
    done = 0
    if progress is not None:  # the island's mean loss of the steps done: every rank holds it, the reduction keeps it
        done, lrs = progress["step"], list(progress["lr"])
        losses[:done] = torch.tensor(progress["loss"], dtype=losses.dtype, device=losses.device)
    started_at, start = time.time(), time.perf_counter()  # wall clock for trackers, monotonic for rates
    for step in range(done, train.inner_steps):
        if should_stop is not None and _agreed(should_stop(), world):
            raise AttemptCancelled(
                f"round {round_index}: stopped at step {step} (another attempt published, or the lease was lost)"
            )
        global_step = round_index * train.inner_steps + step
        lr = lr_at(global_step, total_steps, train)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        for micro in range(train.gradient_accumulation_steps):
            first = micro_batch_start(
                global_step, micro, rank, train.micro_batch_size, train.gradient_accumulation_steps, world
            )
            inputs, labels = (
                t.to(engine.device) for t in stream.micro_batch(first, train.micro_batch_size)
            )  # (B, T) each
            loss = path_loss(engine, inputs, labels)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            losses[step] += loss.detach() / train.gradient_accumulation_steps
        lrs.append(lr)
        if on_step is not None:  # no sync: the step's kernels may still run, the estimate is coarse anyway
            on_step(step + 1, done, time.perf_counter() - start)
        if rank == 0 and (step % log_every == 0 or step == train.inner_steps - 1):
            log.info(
                "round %d step %d/%d loss %.4f (rank 0) lr %.2e",
                round_index,
                step + 1,
                train.inner_steps,
                losses[step],
                lr,
            )
        if checkpoint is not None and (step + 1) % train.checkpoint_every == 0 and step + 1 < train.inner_steps:
            checkpoint(step + 1, losses, lrs)  # collective
    if losses.device.type == "cuda":  # kernels run behind the host: the loop's seconds are the kernels'
        torch.cuda.synchronize(losses.device)
    seconds = time.perf_counter() - start
    dist.all_reduce(losses)  # the one sync point of the loop: the island's mean loss per step
    tokens = (
        train.inner_steps * train.micro_batch_size * train.gradient_accumulation_steps * world * config.model.seq_len
    )
    return {
        "loss": (losses / world).tolist(),
        "lr": lrs,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "first_step": round_index * train.inner_steps,  # global step of loss[0]: curves join across rounds
        "started_at": started_at,
        "finished_at": started_at + seconds,
    }


def resume_midtask(engine, root: RunRoot, round_index: int, path_id: str, world: int) -> dict | None:
    """The newest mid-task checkpoint of this task loaded into the engine (its own progress wins
    over the merged modules), and its progress record; None when there is none to use."""
    found = midtask.newest(root, round_index, path_id, world, engine.zero_optimization_stage())
    if found is None:
        return None
    try:
        return midtask.resume(engine, root, found[0])
    except (DipacoError, OSError) as exc:  # dropped or damaged meanwhile: raised before the engine was touched
        log.warning("not resuming from %s: %s", found[0], exc)
        return None


def _agreed(flag: bool, world: int) -> bool:
    """Whether any rank says so: one all-reduce (per step only when an island may cancel the task)."""
    if world == 1:
        return flag
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def resume_inner_state(
    engine, root: RunRoot, round_index: int, path_id: str, held: InnerState | None = None
) -> int | None:
    """Load the path's newest inner optimizer state (AdamW's step and moments, as
    zero.optimizer_state_bytes wrote them) into the engine, whose weights stay the merged modules.

    A path without usable state (new worker, preempted, corrupted or missing file, a state saved by
    another layout of ranks) restarts its optimizer and still trains. Every rank reads and checks
    its file before any rank loads one, so the ranks of an island resume together or not at all.

    `held`: round r-1's state as this one-rank island kept it, still going up (Island.keep_later):
    the bytes it uploads, so the task needs neither wait for them nor read them back."""
    import torch.distributed as dist

    rank = dist.get_rank()
    here = {"world_size": dist.get_world_size(), "zero_stage": engine.zero_optimization_stage()}
    if held is not None and (held.round_index, held.path_id) == (round_index - 1, path_id):
        if (held.world_size, held.zero_stage) == (here["world_size"], here["zero_stage"]):
            where = f"{path_id}'s inner state of round {held.round_index}, held in memory"
            load_optimizer_state(engine, read_optimizer_state(engine, held.data, where))
            return held.round_index
    state, source = None, None
    try:  # whatever is wrong with the state (its pointer, marker or files) restarts the optimizer
        found = latest_inner_state(root, round_index, path_id)
        if found is not None:
            source, rel, saved = found
            if saved.get("format") != OPTIMIZER_STATE_FORMAT:
                log.warning(
                    "inner optimizer state of %s in %s is not in %s (an older dipaco's DeepSpeed checkpoint): "
                    "restarting it",
                    path_id,
                    root.path(rel),
                    OPTIMIZER_STATE_FORMAT,
                )
            elif any(key in saved and saved[key] != value for key, value in here.items()):
                # Islands may differ in ranks and ZeRO stage; a partitioned optimizer state only loads
                # into the layout that saved it, so the path restarts its inner optimizer here.
                log.warning(
                    "inner optimizer state of %s was saved by %s ranks at ZeRO-%s, this island has %s at "
                    "ZeRO-%s: restarting it",
                    path_id,
                    saved.get("world_size"),
                    saved.get("zero_stage"),
                    here["world_size"],
                    here["zero_stage"],
                )
            else:
                name = optimizer_state_file(rank)
                data = root.read_committed(rel, name, marker=saved)  # its checksum checked
                state = read_optimizer_state(engine, data, root.path(rel, name))
    except DipacoError as exc:
        log.warning("ignoring inner optimizer state: %s", exc)
        state = None
    if _agreed(state is None, here["world_size"]):  # one rank without its file: none resumes
        return None
    load_optimizer_state(engine, state)
    return source


def inner_state_of(root: RunRoot, round_index: int, path_id: str) -> str | None:
    """The directory of the inner state a path kept in a round (layout.inner_state_kept names it),
    or None; a name that is not one safe directory name is refused like a marker's file names."""
    found = _kept_inner_state(root, round_index, path_id)
    return None if found is None else found[0]


def _kept_inner_state(root: RunRoot, round_index: int, path_id: str) -> tuple[str, dict] | None:
    """inner_state_of's directory with its `_SUCCESS` record, each read once (no existence check
    first: on an object store every request is a round trip before the task's first step)."""
    token = layout.inner_state_kept(round_index, path_id)
    kept = root.read_json_if_exists(token)
    if kept is None:
        return None
    attempt, where = kept.get("attempt"), root.path(token)
    if not isinstance(attempt, str) or "/" in attempt:
        raise CorruptStateError(f"{where}: attempt must be one attempt's directory name, got {attempt!r}")
    inner = layout.inner_state_dir(round_index, path_id, safe_relative(attempt, where))
    saved = root.marker_if_committed(inner)
    return None if saved is None else (inner, saved)


def adopt_legacy_inner_states(root: RunRoot) -> list[str]:
    """Write layout.inner_state_kept for the paths of a run root written before it existed, whose
    published `_SUCCESS` named their kept attempt (`inner_state`); the paths adopted. Without it a
    resumed run would start their next round from fresh AdamW moments, and a round stopped midway
    would never commit (its commit waits for every path's kept.json). Once, when a run resumes:
    the rounds from the newest back to the newest committed one (an older round's states were
    pruned when the next round published), one listing each and a HEAD a path."""
    rounds = sorted(
        (int(name.split("=", 1)[1]) for name in root.listdir("rounds") if re.fullmatch(r"round=\d+", name)),
        reverse=True,
    )
    adopted = []
    for r in rounds:
        for name in root.listdir(f"{layout.round_dir(r)}/paths"):
            # a publish's token (`path=<id>.published`) lies beside the path's directory
            path_id = name.split("=", 1)[1] if re.fullmatch(r"path=[^/]+", name) else None
            if path_id is None or name.endswith(".published"):
                continue
            if root.has_file(layout.inner_state_kept(r, path_id)):
                continue
            try:
                attempt = (root.marker_if_committed(layout.path_dir(r, path_id)) or {}).get("inner_state")
            except InputError:  # not a marker: nothing to adopt (the merge names it)
                continue
            if not isinstance(attempt, str) or "/" in attempt:
                continue
            if root.is_committed(layout.inner_state_dir(r, path_id, attempt)):
                record = {"round": r, "path": path_id, "attempt": attempt}
                if root.create(layout.inner_state_kept(r, path_id), json.dumps(record).encode()) is not None:
                    adopted.append(f"{layout.round_dir(r)}: {path_id}")
        if root.is_committed(layout.round_dir(r)):
            break
    if adopted:
        log.info("adopted the inner state records of %d paths from an older layout: %s", len(adopted), adopted)
    return adopted


def latest_inner_state(root: RunRoot, round_index: int, path_id: str) -> tuple[int, str, dict] | None:
    """The newest earlier round whose path kept an inner state: the round, where the state lies and
    its `_SUCCESS` record."""
    for earlier in range(round_index - 1, -1, -1):
        found = _kept_inner_state(root, earlier, path_id)
        if found is not None:
            return earlier, *found
    return None


@dataclass
class InnerState:
    """One rank's inner optimizer state at the end of a train attempt (AdamW's step and moments,
    zero.optimizer_state_bytes), in memory until keep_inner_state uploads it: nothing reads it
    before the path's next round, so the path is published without waiting for it (on an object
    store, 2x the weights and a task's largest upload)."""

    root: RunRoot
    round_index: int
    path_id: str
    attempt: str
    rank: int
    world_size: int
    zero_stage: int
    data: bytes


def commit_path(
    engine,
    root: RunRoot,
    round_index: int,
    path_id: str,
    shape: ModelShape,
    metrics: dict,
    rank: int,
    start_state: dict[str, torch.Tensor] | None = None,
    compression_kind: str = "none",
    staging: str | None = None,
) -> tuple[dict | None, InnerState]:
    """Write weights, then metrics, then `_SUCCESS` into `staging` (default: the path's directory
    itself), rank 0 writes, all ranks gather; publish_path moves it into place. Returns that
    `_SUCCESS` record on rank 0 (None on the others) and every rank's inner state, for
    keep_inner_state.

    With `compression_kind` other than none, also the outer gradient start - end of each level's
    module, compressed: what the merge reads (the full-precision weights stay for the registry and
    evaluation). A path's private module (model.path_specific_blocks) gets none: it never leaves
    the island, and the merge carries its trained weights over losslessly."""
    import torch.distributed as dist

    rel = staging or layout.path_dir(round_index, path_id)
    attempt = posixpath.basename(rel) if staging else "direct"
    cleared = None  # a crashed run of this same attempt name left files: never mixed in. Removed while
    if rank == 0:  # the weights are gathered and saved (on an object store, listings: round trips)
        clearing = ThreadPoolExecutor(1, thread_name_prefix="clear-attempt")
        cleared = clearing.submit(map_io, root.remove, [rel, layout.inner_state_dir(round_index, path_id, attempt)])
        clearing.shutdown(wait=False)
    dist.barrier()
    state = full_state(engine)  # collective under ZeRO-3
    inner = InnerState(
        root,
        round_index,
        path_id,
        attempt,
        rank,
        dist.get_world_size(),
        engine.zero_optimization_stage(),
        optimizer_state_bytes(engine),  # this rank's partition
    )
    committed: dict | None = None  # rank 0's staging `_SUCCESS`
    with tempfile.TemporaryDirectory(prefix="dipaco-path-") as scratch:
        if rank == 0:
            model = build_path_model(shape, None)
            model.load_state_dict(state, strict=False)
            out = Path(scratch) / "model"
            model.save_pretrained(out)  # config.json + model.safetensors: loads anywhere
            # and generation_config.json, which no marker lists (nothing reads or ships it): on an
            # object store one more PUT and one more copy at publish, for nothing
            (out / "generation_config.json").unlink(missing_ok=True)
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")  # as write_json
            cleared.result()  # its error, if any, is raised here
            root.put_dir(out, rel)  # the files at once: weights, config and metrics
            info = {"round": round_index, "path": path_id, "tokens": metrics["tokens"]}
            grads = (
                {}
                if compression_kind == "none"
                else write_outer_gradients(root, rel, shape, start_state, state, compression_kind, info)
            )
            # where each level's tensors lie in the weights: a merge reads only its module's bytes
            weights = (out / layout.PATH_WEIGHTS).read_bytes()
            runs = level_runs(weights, lambda name: to_module_key(shape, name)[0], shape.n_module_levels)
            committed = root.commit(
                rel,
                info={**info, **({"outer_grad": grads} if grads else {}), PARTS: {layout.PATH_WEIGHTS: runs}},
                files=[
                    "config.json",
                    layout.PATH_WEIGHTS,
                    "metrics.json",
                    *(layout.outer_grad_file(int(level)) for level in grads),
                ],
                # an object store's publish writes the record once, under the path's own name
                # (publish_dir): a staged `_SUCCESS` as well was one more PUT, a round trip, a task
                write=staging is None or root.is_local,
            )
    dist.barrier()
    return committed, inner


def keep_inner_state(inner: InnerState, may_keep: Callable[[], bool] | None = None) -> bool:
    """Upload every rank's partition of a finished attempt's inner state, commit it, and keep it as
    the path's: rank 0 creates layout.inner_state_kept exclusively, naming the attempt, so the first
    attempt to keep one is the one the next round resumes (the publisher; or, when the publisher
    died before its state was in, an attempt that trained the path again, which the queue starts
    for it: the round commits only once every path's state is kept). Skipped when a state is kept
    already or `may_keep` (the lease) says no. True on rank 0 when this attempt's state is kept.

    Collective when the island has more ranks: every rank calls it, and they meet at a barrier."""
    import torch.distributed as dist

    root, world = inner.root, inner.world_size
    token = layout.inner_state_kept(inner.round_index, inner.path_id)
    rel = layout.inner_state_dir(inner.round_index, inner.path_id, inner.attempt)
    wanted = inner.rank != 0 or (not root.has_file(token) and (may_keep is None or may_keep()))
    if _agreed(not wanted, world):
        if inner.rank == 0:
            drop_staging(root, rel)
        return False
    root.write_bytes(f"{rel}/{optimizer_state_file(inner.rank)}", inner.data)
    if world > 1:
        dist.barrier()
    if inner.rank != 0:
        return False
    info = {"round": inner.round_index, "path": inner.path_id}
    kept = may_keep is None or may_keep()
    if kept:
        root.commit(
            rel,
            files=optimizer_state_files(world),
            info={**info, "format": OPTIMIZER_STATE_FORMAT, "world_size": world, "zero_stage": inner.zero_stage},
        )
        kept = root.create(token, json.dumps({**info, "attempt": inner.attempt}).encode()) is not None
    if not kept:
        log.info("path %s round %d: another attempt's inner state is kept", inner.path_id, inner.round_index)
        drop_staging(root, rel)
        return False
    prune_inner_state(root, inner.round_index, inner.path_id, kept=inner.attempt)
    return True


def write_outer_gradients(
    root: RunRoot,
    rel: str,
    shape: ModelShape,
    start: dict[str, torch.Tensor],
    end: dict[str, torch.Tensor],
    kind: str,
    info: dict,
) -> dict[str, str]:
    """One file per grid level: encode(start - end) of the path's module there (its private module,
    past the grid's levels, has none). Returns {level: encoding}, which the path's `_SUCCESS`
    records for the merge."""
    written = {}
    levels = zip(split_path_state(shape, start)[: shape.n_levels], split_path_state(shape, end)[: shape.n_levels])
    for level, (before, after) in enumerate(levels):
        delta: ModuleState = {k: before[k].float() - after[k].float() for k in before}  # the outer gradient
        meta = {**info, "level": level, "compression": kind}
        root.write_bytes(f"{rel}/{layout.outer_grad_file(level)}", encode(compression.encode(delta, kind), meta))
        written[str(level)] = kind
    return written


def prune_inner_state(root: RunRoot, round_index: int, path_id: str, kept: str) -> None:
    """Only the newest inner state is ever resumed: once round r's path kept attempt `kept`'s
    state, round r-1's go (nothing reads them again: round r's is found first; the rounds before
    were pruned when r-1 kept its own), and so do round r's other attempts' (crashed or cancelled
    ones). Round r-1's kept.json stays: it says the state was kept, which round r-1's commit waits
    for (round r starts as soon as its modules are merged, before round r-1 commits). A few
    requests on an object store, whatever the round: two listings, then the removals, at once."""
    token = posixpath.basename(layout.inner_state_kept(round_index, path_id))

    def stale(r: int, keep: str | None) -> list[str]:
        base = layout.inner_state_dir(r, path_id)
        return [f"{base}/{name}" for name in root.listdir(base) if name not in (keep, token)]

    rounds = [(round_index, kept)] + ([(round_index - 1, None)] if round_index > 0 else [])
    found = map_io(lambda item: stale(*item), rounds, root.io_threads)
    map_io(root.remove, [rel for names in found for rel in names], root.io_threads)


def main(argv: list[str] | None = None) -> int:
    """Entry point of each launched rank."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.train.train_path")
    parser.add_argument("--run-root", required=True)
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--path", required=True)
    add_own_config_args(parser)
    args = parser.parse_args(argv)

    def body() -> None:
        root = RunRoot(args.run_root)
        config = layout.read_run_config(root, own_config(args))
        apply_rank_threads(config.train, islands=False)  # whatever the launcher's environment says
        metrics = train_path(config, args.round, args.path)
        log.info(
            "path %s round %d: %d tokens, %.0f tokens/s",
            args.path,
            args.round,
            metrics["tokens"],
            metrics["tokens_per_s"],
        )

    return run_rank("train-path", body)


if __name__ == "__main__":
    sys.exit(main())
