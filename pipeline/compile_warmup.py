"""A host's first torch.compile, done while the host would wait anyway.

`train.compile` compiles the path model's forward at a task's first step: ~40 s the first time on a
host (one core of a 2-core Xeon with AMX: 41.4 s), ~3.4 s in a later process that finds inductor's
kernels on disk (its cache in the host's TMPDIR). A run's first round waits for that first compile
on every host, and on the hosts benchmark it was most of what round 0 lost against one host: two
islands on one machine share one cache, separate hosts do not.

So a process that will launch islands compiles the path model once beforehand, beside the time
it spends waiting: `dipaco run` beside prepare (the Beam job), `dipaco island --wait` beside its
wait for the plan. It builds a fresh path model as a train task does (the same builder, precision,
ds_config, ZeRO engine and compiled forward) and runs one forward and backward on random tokens:
inductor keys its kernels by the graph, not the weights, so the island's first step finds them.
Nothing is read from or written to the run root; what it leaves is the host's own compile cache.

The DAG does the same on each host's Celery queue: its `warm_up` task runs beside prepare and
waits for the process (`compile_now`), on the worker whose island tasks read that cache.

Only where the run will compile (`will_compile`, decided without importing torch: the islands'
launcher never loads it); the warm-up itself asks compile_choice again and exits at once when it
would not compile. It never holds anything up: the islands start when they are ready, beside it if
it still runs, and it is stopped when its launcher is done. A warm-up that cannot start or fails
costs the run nothing but the compile it would have saved: one line says so.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.core.config import Config, config_from_yaml, dump_yaml

log = logging.getLogger("dipaco.warmup")
STOP_GRACE_S = 5.0
WAIT_S = 1800.0  # compile_now's bound: a large model's first compile on a GPU takes minutes


def will_compile(train, cpuinfo: str | None = None, cuda: bool | None = None) -> bool:
    """Whether this host's islands will compile (zero.compile_choice's answer), told without torch:
    `auto` compiles on CUDA and on a CPU with AMX (`amx_tile` among /proc/cpuinfo's flags).
    `cpuinfo` and `cuda` stand in for the machine in tests."""
    if train.compile is True or train.compile is False:
        return train.compile
    if train.compile != "auto":
        return False  # the config check names it; nothing to warm
    if cuda is None:  # as precision.accelerator: DS_ACCELERATOR when set, else whether a GPU is there
        named = os.environ.get("DS_ACCELERATOR")
        cuda = named == "cuda" if named else Path("/dev/nvidia0").exists()
    if cuda:
        return True
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return "amx_tile" in flags.split()


def warm(config: Config) -> float | None:
    """One forward and backward of a fresh path model, built and compiled as a train task builds
    it (pipeline.train.train_path), on random tokens; seconds, or None where it would not compile."""
    import numpy as np

    from models.modular import ModelShape, build_path_model
    from pipeline.train.data import RowStream
    from pipeline.train.distributed import apply_rank_threads, init_distributed
    from pipeline.train.precision import resolve as resolve_precision
    from pipeline.train.train_path import adamw_for, path_loss
    from pipeline.train.zero import compile_forward, load_ds_config, release_engine, wrap_with_zero

    train = config.train
    init_distributed()  # a one-rank job of its own
    apply_rank_threads(train, islands=True)  # the threads an island's rank takes on this host
    shape = ModelShape.from_config(config.model)
    model = build_path_model(shape, None, seed=train.seed)
    ds_config = load_ds_config(train, shape, 1, resolve_precision(train, shape))
    if not compile_forward(model, train, ds_config):
        return None
    engine = wrap_with_zero(model, adamw_for(model, train), ds_config)
    began = time.perf_counter()
    rows = np.random.default_rng(0).integers(0, shape.vocab_size, (train.micro_batch_size, config.model.seq_len + 1))
    batch = RowStream(rows, seed=0).micro_batch(0, train.micro_batch_size)  # the dtype and layout a task feeds
    inputs, labels = (t.to(engine.device) for t in batch)
    engine.backward(path_loss(engine, inputs, labels))  # the compiled forward, then its backward graph
    seconds = time.perf_counter() - began
    release_engine(engine)
    return seconds


def nothing_to_warm(config: Config) -> bool:
    """The islands train eagerly, or the model's shape is not known yet: a checkpoint's is known
    once init_run read it (model.init_from without model.init_config)."""
    model = config.model
    return not will_compile(config.train) or bool(model.init_from and model.init_config is None)


class Warming:
    """The warm-up's process (`python -m pipeline.compile_warmup`), started on this host, and the
    scratch directory holding the config it reads."""

    @classmethod
    def start(cls, config: Config) -> "Warming | str":
        """The warm-up started, or the line (logged) saying why it could not be: an optimisation,
        so the islands compile at their first step instead."""
        try:
            return cls(config)
        except OSError as exc:
            said = f"warm-up: could not start ({exc}); the islands compile at their first step"
            log.warning("%s", said)
            return said

    def __init__(self, config: Config):
        from pipeline.islands.launch import Launch, rank_threads

        self.scratch = Path(tempfile.mkdtemp(prefix="dipaco-warmup-"))
        try:
            config_file = self.scratch / "config.yaml"
            config_file.write_text(dump_yaml(config))
            command = [sys.executable, "-u", "-m", "pipeline.compile_warmup", "--config-yaml", str(config_file)]
            self.launch = Launch(command, "warm-up", rank_threads(config.train, islands=True))
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise

    def said(self) -> str:
        """The process's last line of its own (dipaco.warmup's), or its last line."""
        lines = [line for line in self.launch.tail if "warm-up:" in line] or self.launch.tail or ["(no output)"]
        return lines[-1].split("dipaco.warmup ")[-1]

    def end(self) -> None:
        """Stop the process if it still runs; remove the scratch directory."""
        if self.launch.poll() is None:
            log.info("warm-up: still compiling when its launcher was done; stopped")
        self.launch.stop(STOP_GRACE_S)
        shutil.rmtree(self.scratch, ignore_errors=True)


@contextmanager
def beside(config: Config) -> Iterator[None]:
    """Run the warm-up in a process of its own while the body runs (where will_compile), and stop
    it, if it still runs, when the body is done. Its output goes to this process's log, prefixed."""
    if nothing_to_warm(config):
        yield
        return
    warming = Warming.start(config)
    try:
        yield
    finally:
        if isinstance(warming, Warming):
            warming.end()


def compile_now(config: Config, wait_s: float = WAIT_S) -> str | None:
    """The warm-up on this host, waited for (at most `wait_s`): the DAG's `warm_up` task, beside
    prepare on the queue of the host whose island tasks will read the cache. None where the
    islands train eagerly; else one line saying what it did. Its own failure is that line, never
    an exception: the islands then compile at their first step, as without it."""
    if nothing_to_warm(config):
        return None
    warming = Warming.start(config)
    if not isinstance(warming, Warming):
        return warming  # why it could not start
    code = None
    try:
        code = warming.launch.wait(wait_s)
    except subprocess.TimeoutExpired:
        said = f"warm-up: still compiling after {wait_s:g} s; stopped, the islands compile at their first step"
    else:
        said = warming.said()  # what it did: compiled, or found the islands train eagerly here
        if code != 0:
            said = f"warm-up: exited {code} ({said}); the islands compile at their first step"
    finally:
        warming.end()
    (log.info if code == 0 else log.warning)("%s", said)
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.compile_warmup", description=__doc__.split("\n")[0])
    parser.add_argument("--config-yaml", required=True, help="the whole config, as its launcher dumped it")
    args = parser.parse_args(argv)
    from pipeline.train.distributed import run_rank

    def body() -> None:
        config = config_from_yaml(Path(args.config_yaml).read_text(), args.config_yaml)
        seconds = warm(config)
        if seconds is None:
            log.info("warm-up: this host's islands train eagerly; nothing to compile")
        else:
            log.info("warm-up: compiled the path model's forward and backward in %.1f s", seconds)

    return run_rank("warm-up", body)


if __name__ == "__main__":
    sys.exit(main())
