"""Threads per rank: each launched rank sizes its own torch/OpenMP pool from the cores it is given.

A rank does not trust the thread count it inherits: the `deepspeed` launcher, torchrun (which
sets OMP_NUM_THREADS=1), an Airflow worker or a user's shell may each have set another, and torch
defaults to every core of the machine (the quality benchmark once trained a row with a leaked
second thread beside another lane: 1,451 s for a row that takes ~500 s, benchmarks/RESULTS.md).
So every rank computes the same share the
launcher does: the cores this process may run on (`os.sched_getaffinity`: a taskset or cpuset
given to the whole run counts, not the machine's core count), divided by the ranks that run at
once on this machine (`procs_per_path` x islands, or x `parallel_paths` for one-shot path
launches). Islands x threads then never exceed the cores, unless `train.threads_per_proc` says so.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("dipaco.threads")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity API
        return os.cpu_count() or 1


def ranks_at_once(train, islands: bool) -> int:
    """Ranks of this run on one machine at the same time."""
    jobs = (train.islands or train.parallel_paths) if islands else train.parallel_paths
    return train.procs_per_path * jobs


def rank_threads(train, islands: bool = False, cores: int | None = None) -> int:
    """Threads per rank: `train.threads_per_proc` when set, else the cores shared by every rank
    running at once (at least 1)."""
    if train.threads_per_proc:
        return train.threads_per_proc
    return max(1, (cores or available_cores()) // ranks_at_once(train, islands))


def apply_rank_threads(train, islands: bool) -> int:
    """Set this rank's torch intra-op threads (and OMP/MKL for anything it starts); returns them."""
    import torch

    cores = available_cores()
    threads = rank_threads(train, islands, cores)
    torch.set_num_threads(threads)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    total = threads * ranks_at_once(train, islands)
    if total > cores:
        why = "train.threads_per_proc" if train.threads_per_proc else "more ranks than cores"
        log.warning("%d ranks x %d threads exceed the %d cores this process may use (%s)",
                    ranks_at_once(train, islands), threads, cores, why)
    return threads
