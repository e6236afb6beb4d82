"""Process-group bootstrap shared by launched ranks and in-process runs: one code path for both.

The `deepspeed` launcher sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR and MASTER_PORT; an
in-process run (tests, debugging, the warm-up) gets the single-rank equivalent here.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path


def set_runtime_env() -> None:
    """Defaults every rank needs before deepspeed is imported (all overridable by the user)."""
    if "DS_ACCELERATOR" not in os.environ:  # decided once, here; launched ranks inherit it
        os.environ["DS_ACCELERATOR"] = "cuda" if _has_cuda() else "cpu"
        if os.environ["DS_ACCELERATOR"] == "cpu":
            logging.getLogger("dipaco").info("training on the CPU: %s", _why_no_cuda())
    # The CPU accelerator JIT-compiles a shared-memory op on first start (35-63 s); keep the
    # build inside the virtual environment so `make install` pays for it once.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ["DS_ACCELERATOR"] == "cpu":
        os.environ.setdefault("GLIBC_TUNABLES", CPU_MALLOC_TUNABLES)


# For the processes this one starts (glibc reads it at start-up). By default glibc serves every
# block over 32 MB (a step's logits, ZeRO's flat buffers) with a fresh mmap and unmaps it when
# freed, so each training step page-faults its largest tensors back in: on 2 CPU cores that was
# 40% of a path trainer's time (42 s of system time in a 61 s benchmark). Keeping freed memory in
# the heap for reuse made the same trainer 1.8x faster for ~30% more resident memory.
CPU_MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296:glibc.malloc.top_pad=268435456"


# Set by a process that made itself a one-rank job: a child that inherits it with the variables
# above (a subprocess started with this environment, an Airflow worker's task) is not a launched
# rank and takes a port of its own, instead of colliding with the store this process listens on.
ONE_RANK_MARK = "DIPACO_ONE_RANK_JOB"
RENDEZVOUS_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "LOCAL_SIZE",
    ONE_RANK_MARK,
)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without torch.distributed's rendezvous variables: a process that
    trained in process has them set, and a child that inherits them would think it was launched
    as that rank and collide on its port."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    return {**env, **(extra or {})}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Start (or reuse) the process group; returns (rank, world_size)."""
    set_runtime_env()
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        inherited = os.environ.get(ONE_RANK_MARK) == "1"
        one_rank = "RANK" not in os.environ or inherited
        if one_rank:  # not launched: become a one-rank job
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ[ONE_RANK_MARK] = "1"
            if inherited or "MASTER_PORT" not in os.environ:
                os.environ["MASTER_PORT"] = str(free_port())
        # DeepSpeed's CPU accelerator answers device_count() from LOCAL_SIZE, which its launcher
        # sets; without it, it runs `numactl --hardware` in a subprocess on every call, and ZeRO-3
        # calls it once per gradient bucket: ~35 process starts per optimizer step (8 ms on the
        # default path). torchrun names the same number LOCAL_WORLD_SIZE.
        if "LOCAL_WORLD_SIZE" in os.environ:
            os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])
        backend = "nccl" if os.environ["DS_ACCELERATOR"] == "cuda" else "gloo"
        for attempt in range(5):
            try:
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
                break
            except dist.DistNetworkError:
                # A one-rank job's port is only probed free: between the probe and the store's bind
                # another socket can take it (seen: an HTTP keep-alive connection to an MLflow
                # server, whose ephemeral local port was the probed one). Any free port will do.
                if not one_rank or attempt == 4:
                    raise
                os.environ["MASTER_PORT"] = str(free_port())
        unlink_shm_workspace(dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def run_rank(command: str, body: Callable[[], None]) -> int:
    """A launched rank's whole life: logs at INFO on rank 0 only, a config or input error as one
    line `dipaco <command>: ...` on stderr and exit status 2 (the launcher's caller does not retry
    it), and the process group closed before the process exits."""
    from pipeline.core.errors import DipacoError

    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
    )
    try:
        body()
        return 0
    except DipacoError as exc:
        print(f"dipaco {command}: {exc}", file=sys.stderr)
        return 2
    finally:
        close_distributed()


def close_distributed() -> None:
    """End this rank's process group before the process exits, as a launched rank's last act.

    A rank that exits with its gloo group alive can abort at exit ("terminate called without an
    active exception", exit -6): 2 of 16 two-rank launches of a minimal script did; with the group
    destroyed first, 0 of 10."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        forget_deepspeed_groups()


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the world group it first saw (deepspeed.utils.groups._WORLD_GROUP and the
    groups cloned from it). Once that group is destroyed, the next engine of this process (a rank's
    main run in-process, then an in-process train task, as a test suite does) broadcast on the dead
    group and failed with "Group ... is not registered"; forgetting them makes DeepSpeed clone the
    new world group instead."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)


def shm_workspace_path(rank: int) -> Path:
    """The shared-memory workspace DeepSpeed's CPU comm op creates for `rank` (ops/csrc/cpu/comm/
    shm.cpp: named by uid, MASTER_ADDR, MASTER_PORT and rank)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_shm_workspace(rank: int, world_size: int) -> None:
    """Remove this rank's DeepSpeed shared-memory workspace name once every rank has mapped it.

    When all ranks share a host (WORLD_SIZE == LOCAL_SIZE, one-rank jobs included), DeepSpeed's CPU
    accelerator creates a 69 MB workspace per rank in /dev/shm, which is RAM, and never removes
    it: every path job left one per rank behind, and 192 of them (13 GB) pushed a benchmark run on
    this 24 GB machine out of memory. Peers open a workspace by name only inside
    `deepspeed.init_distributed`, so after the barrier the name is no longer needed; the mappings
    stay valid and the kernel frees the memory when the last rank exits, even when it is killed.
    """
    import torch.distributed as dist

    if world_size > 1:
        dist.barrier()  # every rank has mapped every peer's workspace
    shm_workspace_path(rank).unlink(missing_ok=True)


def _why_no_cuda() -> str:
    """One line: why this machine trains without CUDA."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False


# -- threads per rank ------------------------------------------------------------------------------
# Each launched rank sizes its own torch/OpenMP pool from the cores it is given. It does not trust
# the thread count it inherits: the `deepspeed` launcher, torchrun (which sets OMP_NUM_THREADS=1),
# an Airflow worker or a user's shell may each have set another, and torch defaults to every core
# of the machine (the quality benchmark once trained a row with a leaked second thread beside
# another lane: 1,451 s for a row that takes ~500 s, benchmarks/RESULTS.md). So every rank computes
# the share the launcher does: the cores this process may run on (`os.sched_getaffinity`: a taskset
# or cpuset given to the whole run counts, not the machine's core count), divided by the ranks that
# run at once on this machine (`procs_per_path` x islands, or x `parallel_paths` for one-shot path
# launches). Islands x threads then never exceed the cores, unless `train.threads_per_proc` says so.
_threads_log = logging.getLogger("dipaco.threads")


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
        _threads_log.warning(
            "%d ranks x %d threads exceed the %d cores this process may use (%s)",
            ranks_at_once(train, islands),
            threads,
            cores,
            why,
        )
    return threads
