"""Relative paths of the run-root layout (DESIGN.md, storage layout): the contract between stages.

Every stage names its inputs and outputs through these functions and nothing else, so the
layout lives in one place.
"""

from __future__ import annotations

from models.grid import ModuleKey

RUN_CONFIG = "run.yaml"
ROUTER_DIR = "router"
TOKENIZER_DIR = "tokenizer"  # model.tokenizer: bpe, trained by prepare
SHARDS_DIR = "shards"
MANIFEST = "shards/manifest.json"
REJECTED_DIR = "shards/rejected"
EVAL_DIR = "eval"
LOCK = ".lock"


def shard_dir(path_id: str, split: str = "train") -> str:
    """shards/path=<id> for training, shards/validation/path=<id> for the held-out split."""
    return f"shards/path={path_id}" if split == "train" else f"shards/{split}/path={path_id}"


def round_dir(round_index: int) -> str:
    return f"rounds/round={round_index}"


def modules_dir(round_index: int) -> str:
    """Module parameters at the start of a round; committed by init (round 0) or the merge."""
    return f"{round_dir(round_index)}/modules"


def module_file(module: ModuleKey) -> str:
    """A module's file name inside modules_dir; a path's private blocks (model.path_specific_blocks)
    are level=<number of grid levels>/module=<the path's index in the grid's path order>."""
    return f"level={module.level}/module={module.index}.safetensors"


def outer_state_dir(round_index: int) -> str:
    """Nesterov momentum buffers at the start of a round (absent for round 0)."""
    return f"{round_dir(round_index)}/outer_state"


def path_dir(round_index: int, path_id: str) -> str:
    """A path's training output in a round: weights, metrics.json, its DeepSpeed checkpoint."""
    return f"{round_dir(round_index)}/paths/path={path_id}"


def attempts_dir(round_index: int, path_id: str) -> str:
    """Failed launch records for a path in a round (kept outside the path's own directory)."""
    return f"{round_dir(round_index)}/attempts/path={path_id}"


def eval_file(round_index: int) -> str:
    return f"{EVAL_DIR}/round={round_index}.json"


def merged_module_dir(round_index: int, module: ModuleKey) -> str:
    """One module merged from round r's paths as soon as they were in (islands): its round r+1
    parameters and momentum, committed on its own; `finish_round` gathers them into round r+1's
    modules/ and outer_state/ and then removes them."""
    return f"{merged_dir(round_index)}/level={module.level}/module={module.index}"


def merged_dir(round_index: int) -> str:
    return f"{round_dir(round_index)}/merged"


MERGED_MODULE = "module.safetensors"
MERGED_MOMENTUM = "momentum.safetensors"


def eval_part(round_index: int, path_id: str) -> str:
    """One path's evaluation of round r's modules (an island's eval task); eval/round=<r>.json
    combines them once every path is in."""
    return f"{EVAL_DIR}/parts/round={round_index}/path={path_id}.json"


def outer_grad_file(level: int) -> str:
    """A path's compressed outer gradient (start - end) of its module at one level, inside its
    path_dir (outer.compression other than none): what the merge reads instead of its weights."""
    return f"outer_grad/level={level}.safetensors"


def eval_routes_dir(every: int) -> str:
    """eval.reroute_every: the path of every N-token chunk of every held-out document, routed once
    (the router never changes within a run) and read by every round's evaluation."""
    return f"{EVAL_DIR}/reroute/every={every}"
