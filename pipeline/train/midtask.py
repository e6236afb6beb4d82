"""Mid-task checkpoints (`train.checkpoint_every`): a crashed attempt's successor resumes from the
newest committed one instead of step 0.

Every N inner steps the attempt saves DeepSpeed's own checkpoint (fp32 master weights and the
AdamW moments, as the per-round inner state is saved) and a JSON of the steps done and their
losses, under its own staging place:

    rounds/round=<r>/staging/path=<job>/checkpoints/<attempt>/step=<k>/   ds files, progress.json, _SUCCESS

Each attempt writes only its own directory (two attempts never mix files), and keeps only its
newest two steps. A new attempt of the task takes the newest step that any attempt committed and that
verifies against its `_SUCCESS`. The data loader needs no state of its own: sample s of the run is
a pure function of s (pipeline.train.data), so restoring the step restores its position exactly,
and the resumed attempt computes the same losses and weights as an uninterrupted one. Publishing
the path removes the whole staging place, checkpoints included.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

import torch

from pipeline.core.bounds import load_json
from pipeline.core.errors import CorruptStateError, DipacoError
from pipeline.state import layout
from pipeline.state.storage import RunRoot

log = logging.getLogger("dipaco.train")
PROGRESS = "progress.json"
_STEP = re.compile(r"step=(\d{1,9})")


def checkpoints_dir(round_index: int, path_id: str, attempt: str | None = None) -> str:
    base = f"{layout.staging_dir(round_index, path_id)}/checkpoints"
    return f"{base}/{attempt}" if attempt else base


def save(
    engine,
    root: RunRoot,
    round_index: int,
    path_id: str,
    attempt: str,
    step: int,
    losses: torch.Tensor,
    lrs: list[float],
    rank: int,
    world: int,
) -> None:
    """Collective: every rank saves its ZeRO partition; rank 0 records the island's mean loss of
    steps < `step`, commits, and drops the attempt's steps before the last two."""
    import torch.distributed as dist

    done = losses[:step].clone()
    dist.all_reduce(done)  # the island's summed loss per step so far (the loop reduces the rest at its end)
    rel = f"{checkpoints_dir(round_index, path_id, attempt)}/step={step}"
    with tempfile.TemporaryDirectory(prefix="dipaco-midtask-") as scratch:
        local = root.local_path(rel) if root.is_local else Path(scratch)
        engine.save_checkpoint(str(local), tag="inner", save_latest=False)  # collective
        dist.barrier()
        if rank == 0:
            if not root.is_local:
                root.put_dir(local, rel)
            root.write_json(f"{rel}/{PROGRESS}", {"step": step, "loss": (done / world).tolist(), "lr": lrs[:step]})
            root.commit(
                rel,
                info={
                    "round": round_index,
                    "path": path_id,
                    "step": step,
                    "world_size": world,
                    "zero_stage": engine.zero_optimization_stage(),
                },
            )
            mine = checkpoints_dir(round_index, path_id, attempt)
            steps = sorted(int(m.group(1)) for m in map(_STEP.fullmatch, root.listdir(mine)) if m)
            for older in steps[:-2]:  # keep two: another attempt may be copying the older one
                root.remove(f"{mine}/step={older}/_SUCCESS")  # the marker first: a half-removed step never counts
                root.remove(f"{mine}/step={older}")
    dist.barrier()


def newest(root: RunRoot, round_index: int, path_id: str, world: int, zero_stage: int) -> tuple[str, int] | None:
    """(directory, step) of the newest committed checkpoint of any attempt of the task
    saved by an island of this layout (a ZeRO partition loads only into the layout that saved it)."""
    found = []
    base = checkpoints_dir(round_index, path_id)
    for attempt in root.listdir(base):
        for name in root.listdir(f"{base}/{attempt}"):
            match = _STEP.fullmatch(name)
            if match and root.is_committed(f"{base}/{attempt}/{name}"):
                found.append((int(match.group(1)), f"{base}/{attempt}/{name}"))
    for step, rel in sorted(found, reverse=True):
        try:  # the files are verified as resume() copies them out
            marker = root.marker(rel)
            progress_ok(root.read_committed_json(rel, PROGRESS), step, root.path(rel, PROGRESS))
        except DipacoError as exc:
            log.warning("ignoring mid-task checkpoint: %s", exc)
            continue
        if marker.get("world_size") == world and marker.get("zero_stage") == zero_stage:
            return rel, step
    return None


def progress_ok(progress: dict, step: int, where: str) -> None:
    """A progress record is the step its directory names and one loss and lr per step done."""

    def numbers(value) -> bool:
        return (
            isinstance(value, list)
            and len(value) == step
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        )

    if progress.get("step") != step or not numbers(progress.get("loss")) or not numbers(progress.get("lr")):
        raise CorruptStateError(f"{where}: not the progress of step {step} (step, and a loss and lr per step done)")


def resume(engine, root: RunRoot, rel: str) -> dict:
    """Load a mid-task checkpoint into the engine (its weights win: they are this task's own
    progress, unlike a previous round's inner state); returns its progress record.

    Every file is copied out and verified first, so a checkpoint that its attempt drops meanwhile
    (a live straggler keeps only its newest steps) raises before the engine is touched."""
    with tempfile.TemporaryDirectory(prefix="dipaco-midtask-") as scratch:
        for name in root.marker(rel)["files"]:
            target = Path(scratch) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(root.read_committed(rel, name))
        progress = load_json((Path(scratch) / PROGRESS).read_bytes(), root.path(rel, PROGRESS))
        engine.load_checkpoint(
            scratch, tag="inner", load_optimizer_states=True, load_lr_scheduler_states=False, load_module_strict=True
        )
    return progress
