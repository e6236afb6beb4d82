"""Relative paths of the run-root layout (docs/design.md, storage layout): the contract between stages.

Every stage names its inputs and outputs through these functions and nothing else, so the
layout lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.grid import ModuleKey

RUN_CONFIG = "run.yaml"


def read_run_config(root, own=None, ds_config: str | None = None, uses_code: bool = True):
    """The run's validated config (run.yaml), read with the config file's size bound: every stage,
    island and rank that starts from a run root reads it this one way.

    The run root is a trust boundary (docs/security.md): whoever can write it wrote run.yaml. So a
    run.yaml reached through a symbolic link is refused, and its code-choosing keys (Beam runner
    and options, extra runners, launcher, hostfile, ds_config) come from the reader's own command
    line: `own` (its --config, a Config) and `ds_config` (its --ds-config), or must be what nobody
    needs to trust (pipeline.core.config.from_run_root)."""
    from pipeline.core.config import from_run_root

    return from_run_root(_run_config_as_written(root), own, ds_config, uses_code)


def read_run_yaml(root) -> bytes:
    """run.yaml's bytes, bounded, refused when it is (or lies under) a symbolic link: its text is
    logged to MLflow and bundled with the registered model, and a link would ship its target."""
    from pipeline.core.config import MAX_CONFIG_BYTES

    root.refuse_link(RUN_CONFIG)
    return root.read_bytes(RUN_CONFIG, max_bytes=MAX_CONFIG_BYTES)


def _run_config_as_written(root):
    """run.yaml parsed and validated, its code-choosing keys as written: read_run_config's input."""
    from pipeline.core.config import config_from_yaml

    return config_from_yaml(read_run_yaml(root), root.path(RUN_CONFIG))


ROUTER_DIR = "router"
TOKENIZER_DIR = "tokenizer"  # model.tokenizer: bpe, trained by prepare
SHARDS_DIR = "shards"
MANIFEST = "shards/manifest.json"
REJECTED_DIR = "shards/rejected"
EVAL_DIR = "eval"
LOCK = ".lock"
REROUTE_DIR = "reroute"  # router.discriminative_after: the re-routing committed after round R


@dataclass(frozen=True)
class Routing:
    """One routing of the documents: the router that chose each path and the shards it wrote."""

    router: str
    shards: str

    @property
    def manifest(self) -> str:
        return f"{self.shards}/manifest.json"

    @property
    def rejected(self) -> str:
        return f"{self.shards}/rejected"


KMEANS = Routing(ROUTER_DIR, SHARDS_DIR)  # what prepare fits and writes


def reroute_dir(round_index: int) -> str:
    """reroute/round=<R+1>: the discriminative router fitted after round R's merge, its shards and report."""
    return f"{REROUTE_DIR}/round={round_index}"


def reroute_routing(round_index: int) -> Routing:
    return Routing(f"{reroute_dir(round_index)}/router", f"{reroute_dir(round_index)}/shards")


def reroute_report(round_index: int) -> str:
    return f"{reroute_dir(round_index)}/report.json"


def routing(discriminative_after: int | None, round_index: int) -> Routing:
    """The one answer to "which router and shards does round r use" (training round r, evaluating
    the modules round r starts from, generating with them): the k-means routing up to round R =
    `router.discriminative_after`, the discriminative one committed after round R's merge from
    round R+1 on."""
    if discriminative_after is None or round_index <= discriminative_after:
        return KMEANS
    return reroute_routing(discriminative_after + 1)


def shard_dir(path_id: str, split: str = "train", shards: str = SHARDS_DIR) -> str:
    """shards/path=<id> for training, shards/validation/path=<id> for the held-out split."""
    return f"{shards}/path={path_id}" if split == "train" else f"{shards}/{split}/path={path_id}"


def round_dir(round_index: int) -> str:
    return f"rounds/round={round_index}"


def next_round(root) -> int:
    """The first round whose merge has not committed (the number of rounds a run has done)."""
    r = 0
    while root.is_committed(round_dir(r)):
        r += 1
    return r


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
    """A path's training output in a round: weights, metrics.json (its inner optimizer state lies
    in inner_state_dir)."""
    return f"{round_dir(round_index)}/paths/path={path_id}"


def staging_dir(round_index: int, path_id: str, attempt: str | None = None) -> str:
    """Where one attempt of a path's train task writes (and checkpoints) before it publishes:
    each attempt its own directory, so a late or duplicate attempt never mixes files into
    another's; publishing makes it path_dir's, first attempt wins (RunRoot.publish_dir: a local
    root renames it there, an object store's path_dir marker names it as `files_at`)."""
    base = f"{round_dir(round_index)}/staging/path={path_id}"
    return f"{base}/{attempt}" if attempt else base


def inner_state_dir(round_index: int, path_id: str, attempt: str | None = None) -> str:
    """Where one attempt of a path's train task writes its inner optimizer state (what the path's
    next round resumes: AdamW's moments, pipeline.train.zero): beside the path, never inside what
    is published. Which attempt's state the path keeps, inner_state_kept names; on an object store
    the state (2x the weights) is uploaded once, never copied, and after the path is published,
    off the task's critical path."""
    base = f"{round_dir(round_index)}/inner/path={path_id}"
    return f"{base}/{attempt}" if attempt else base


def inner_state_kept(round_index: int, path_id: str) -> str:
    """{"attempt": name}: the attempt whose committed inner state the path's next round resumes,
    created exclusively (the first attempt to keep one wins, as a publish does)."""
    return f"{inner_state_dir(round_index, path_id)}/kept.json"


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


PATH_WEIGHTS = "model.safetensors"  # a trained path's weights, as Hugging Face saves them
MERGED_MODULE = "module.safetensors"
MERGED_MOMENTUM = "momentum.safetensors"


def eval_parts_dir(round_index: int) -> str:
    """Every path's evaluation of round r's modules, one file each (eval_part)."""
    return f"{EVAL_DIR}/parts/round={round_index}"


def eval_part(round_index: int, path_id: str) -> str:
    """One path's evaluation of round r's modules (an island's eval task); eval/round=<r>.json
    combines them once every path is in."""
    return f"{eval_parts_dir(round_index)}/path={path_id}.json"


def outer_grad_file(level: int) -> str:
    """A path's compressed outer gradient (start - end) of its module at one level, inside its
    path_dir (outer.compression other than none): what the merge reads instead of its weights."""
    return f"outer_grad/level={level}.safetensors"


def eval_routes_dir(every: int, routing: Routing = KMEANS) -> str:
    """eval.reroute_every: the path of every N-token chunk of every held-out document, routed once
    per routing (k-means, or a discriminative router from round R+1 on: eval/reroute/every=N.round=R+1)
    and read by every round's evaluation that uses it."""
    suffix = "" if routing == KMEANS else "." + routing.router.split("/")[1]
    return f"{EVAL_DIR}/reroute/every={every}{suffix}"
