"""Quality: do dipaco's DiLoCo and DiPaCo rows keep the papers' claims against the right baselines?

`python -m benchmarks.quality [--quick | --long] [--suite claims|options|all] [--plan] [size flags]`
(also run by `make bench` and `make bench-long` through `benchmarks.run`). Every row is a real run of
the pipeline (`pipeline.stages.run`: init_run, prepare, then rounds of training, merging and
evaluation on an island), on each corpus (`--corpora wiki,mixed`): the bundled Wikipedia sample
(`data/sample`, 9,531 training and 502 held-out documents) and the mixed corpus of four sources
(`data/mixed`, 5,646 and 297: Wikipedia, stdlib code, stdlib docstrings, licences). Each corpus has
its own prepares, its own BPE tokenizer (shared by its rows) and its own held-out set; within a
corpus every row scores the same tokens (every token after the 32-token routing prefix).

The claims suite (`--suite claims`, the default), each row on both corpora; M = 4, H = inner steps:

| row | run | tokens (x dense) |
|---|---|---|
| `dense` | grid [1], 1 worker, no outer step: plain training | 1 |
| `sync_m2`, `sync_m4` | grid [1], 1 worker, gradient accumulation M, no outer step (M ranks all-reducing) | M |
| `diloco_m1` | 1 worker + outer Nesterov (lr 0.7, momentum 0.9) | 1 |
| `diloco_m2`, `diloco_m4` | M DiLoCo workers on iid parts of the data, outer Nesterov 0.7 / 0.9 | M |
| `diloco_m4_olr0.4`, `_olr1` | the outer-lr sweep of M = 4 (seed 0; `--extras 1`: bench-long, quick) | 4 |
| `diloco_m4_avg` | 4 workers averaged each round, no outer optimizer (lr 1, momentum 0; seed 0, `--extras 1`) | 4 |
| `noniid_m4` | 4 workers, each on its own k-means cluster (`train.worker_data: clustered`) | 4 |
| `pool_m4` | `train.workers_schedule` cycling 2, 4, 6, 4 workers (claims.pool_schedule: 4 x rounds worker-rounds) | 4 |
| `dipaco_2x2` | [2, 2] grid (4 paths) routed by MiniLM product k-means, outer Nesterov | 4 (1 a path) |
| `dipaco_4x4` | [4, 4] grid (16 paths; seed 0; `--extras 1`) | 16 |
| `warm_sync_m4`, `_diloco_m4`, `_dipaco_2x2` | a quarter of the rounds dense, then the row (`--warm 1`) | 4 |

The warm rows are the papers' regime (issue 44; bench-long and quick): `warm_dense` (grid [1] at 4x
batch: sync_m4's tokens a round), shared by a seed's three rows, trains the first quarter of the
rounds; each row then starts from its run root (`model.init_from`) for the rest. They see the tokens
of `sync_m4`, `diloco_m4` and `dipaco_2x2` from scratch, their comparisons.

Rows the targets compare run `--seeds` seeds (3), paired: seed s is the same initialisation and data
order in every row. benchmarks/claims.py turns the runs into the table: mean ± 95 % interval in bits
per byte, the evaluation noise from each run's per-document scores (`document_scores`: the last
round's modules score every held-out document once more, in this process), bytes per round from
merge.json and their ratio to sync, and the targets' verdicts.

The options suite (`--suite options`, wiki only, one seed, against `dipaco_2x2` seed 0): `dense_x4`
(dense with 4x the steps), `dense_big` (hidden 2x: 4x the non-embedding parameters, the flagship
analogue of `dipaco_4x4`), `pathblocks` ([2, 1] + 1 `model.path_specific_blocks`), `int8` and `int4`
(`outer.compression`), `discriminative` (`router.discriminative_after`, when the config has it),
and, without training, `reroute64` (`eval.reroute_every: 64`) and `early_stop` (`eval/best.json`).

How it runs on 2 cores: every trained row is one real `deepspeed` island (one rank, one OMP thread),
two rows at a time (`--lanes 2`, one per core), the longest first. Rows of the same corpus and grid
share a prepare (router, shards and the corpus's tokenizer are copied between run roots); grid [1]
uses the cheap tf-idf embedder (every document lands in the one path anyway; its features also
cluster the non-iid workers), the DiPaCo grids MiniLM.

Budget (`--plan` prints it from `Variant.cost`, the cost model below, measured on this 2-core box
on 2026-11-25 with two rows at once, bf16 autocast, seq_len 128 x micro batch 6): a train task of 25
steps took 2.0 s at hidden 64 and 3.3 s at hidden 128, an evaluation of the 502 wiki documents 1.7
and 3.1 s, an island ~12 s to start; the model adds ~10 % to each. What dominates at these sizes is
not the steps but the runs: 54 trained runs in `make bench`'s claims suite, each with an island
start and an evaluation every round. `make bench` (the defaults: hidden 64, seq_len 128 x micro
batch 4, 8 rounds x H=25 = 200 steps per worker, 3 seeds, the 9 compared rows on both corpora)
plans ~36 min of quality within its 60 (perf ~8, chaos ~9: `python -m benchmarks.run --plan`);
`make bench-long` (`--long`: the same model and step, 24 rounds x H=25 = 600 steps per worker, plus
the outer-lr sweep, plain averaging and dipaco_4x4 at seed 0: 62 runs) plans ~112 min and took
132 on 2026-11-26 (the model undercounts 24 evaluations a run); the warm rows (`--warm 1`, in
`--long` since issue 44: 18 runs and 6 warm starts) add ~29 planned minutes (~141 in all, not yet
measured); an
interrupted run resumes from `quality.partial.json` when started again with the same sizes;
`--quick` (every row, 2 seeds, tiny) ~8.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import claims
from pipeline import stages
from pipeline.core.config import Config, RouterConfig, config_from_dict
from pipeline.evaluation.evaluate import document_losses, evaluate_round, held_out_documents
from pipeline.run import Run
from pipeline.scaling.spec import non_embedding_params
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.sweep import copy_committed

log = logging.getLogger("dipaco.bench.quality")
OUT = Path("benchmarks/out")
HAS_DISCRIMINATIVE = "discriminative_after" in {f.name for f in dataclasses.fields(RouterConfig)}
M = 4  # DiLoCo workers of the claims' main rows: their names (sync_m4, diloco_m4, ...) are the targets'


@dataclass(frozen=True)
class Corpus:
    """One corpus of the claims table: its files, and what the cost model needs to know of it."""

    train: str
    eval: str
    documents: int  # training + held-out documents (a MiniLM prepare embeds each prefix once)
    eval_weight: float  # tokens its held-out set scores, relative to the wiki sample's 36,270


CORPORA = {
    "wiki": Corpus("data/sample/train/*.json.gz", "data/sample/validation/*.json.gz", 10_033, 1.0),
    "mixed": Corpus("data/mixed/train/*.json.gz", "data/mixed/validation/*.json.gz", 5_943, 0.8),
}

# The cost model (module docstring): seconds on one busy core of this box, with a ~10 % margin.
ISLAND_START = 15.0  # deepspeed launcher, imports, the engine's first build; round 0's evaluation before it
TASK_OVERHEAD = 0.5  # per train task: modules in, the engine wrapped, inner optimizer state in and out, merge
PATH_EVAL_OVERHEAD = 0.3  # per path's evaluation task


def step_seconds(hidden: int, tokens_per_step: int) -> float:
    """One optimizer step of one micro batch: 0.074 s at hidden 64, 0.13 s at 128, 0.36 s at 256 (768 tokens)."""
    return (0.055 + 0.075 * (hidden / 128) ** 2) * tokens_per_step / 768


def eval_seconds(hidden: int, weight: float) -> float:
    """One evaluation of a whole held-out set (the wiki sample's: weight 1)."""
    return (1.2 + 1.9 * (hidden / 128) ** 2) * weight


@dataclass
class QualityArgs:
    """Sizes of the quality benchmark; the defaults are `make bench`'s (module docstring)."""

    suite: str = "claims"  # claims | options | all
    corpora: str = "wiki,mixed"  # comma-separated names of CORPORA
    rounds: int = 8
    inner_steps: int = 25  # H per round; the papers use 150 (DiPaCo) and 500 (DiLoCo)
    hidden: int = 64
    heads: int = 4
    blocks: int = 4  # blocks per path, split evenly over the levels of a 2-level grid
    seq_len: int = 128  # the wiki documents average ~120 tokens: longer windows mostly pack
    micro_batch: int = 4  # 512 tokens a step: the runs' overheads leave the steps little of the hour
    lr: float = 3.0e-3  # the demo's inner lr for this path (tuned there)
    warmup: int = 20
    outer_lr: float = 0.7  # DiLoCo's and DiPaCo's outer Nesterov
    outer_momentum: float = 0.9
    outer_lr_sweep: str = "0.4,1.0"  # the extra rows' diloco_m4 outer lrs (seed 0), comma-separated
    extras: int = 0  # 1: the claims suite also runs the outer-lr sweep and dipaco_4x4 (seed 0): --long, --quick
    seeds: int = 3  # seeds of every row a target compares
    train_docs: int = 0  # 0: every training document
    eval_docs: int = 0  # 0: every held-out document
    embedder: str = "minilm"  # the DiPaCo grids' router; grid [1] always uses tf-idf
    router_docs: int = 2000  # documents the k-means is fitted on
    vocab: int = 4096
    lanes: int = 2  # rows trained at once, one island (one core) each
    launcher: str = "deepspeed"  # deepspeed | inprocess (debugging: one lane, in this process)
    only: str = ""  # comma-separated row names to run (debugging); empty: all
    out: str = str(OUT / "quality")
    keep_rounds: int = 0  # 1: keep each run's rounds/ (modules, DeepSpeed states)
    warm: int = 0  # 1: the warm-start rows (issue 44): a quarter of the rounds dense at 4x batch, then the row


QUICK = {
    "rounds": 2,
    "inner_steps": 3,
    "hidden": 32,
    "blocks": 4,
    "seq_len": 128,
    "micro_batch": 2,
    "warmup": 1,
    "seeds": 2,
    "extras": 1,
    "train_docs": 400,
    "eval_docs": 40,
    "embedder": "tfidf",
    "router_docs": 200,
    "vocab": 512,
    "launcher": "deepspeed",
    "lanes": 2,
    "warm": 1,
}  # every claims row on both corpora through real islands: a smoke check
LONG = {
    "rounds": 24,
    "inner_steps": 25,
    "extras": 1,
    "warm": 1,
}  # `make bench-long`: make bench's model, 3x its rounds: 600 steps a worker (~112 min planned)


@dataclass(frozen=True)
class Variant:
    name: str  # the row; seeds and corpora share it
    grid: tuple[int, ...]
    corpus: str = "wiki"
    seed: int = 0
    suite: str = "claims"
    workers: int = 1  # train.workers_per_path: the largest entry of a schedule
    schedule: tuple[int, ...] | None = None  # train.workers_schedule
    worker_data: str = "iid"
    accum: int = 1  # train.gradient_accumulation_steps
    step_multiple: int = 1
    hidden_multiple: int = 1
    outer_identity: bool = False  # dense and sync rows: outer lr 1, momentum 0 = no outer optimizer
    outer_lr: float | None = None  # None: QualityArgs.outer_lr
    blocks: tuple[int, ...] | None = None  # blocks per level (default: split evenly)
    path_blocks: int = 0
    compression: str = "none"
    discriminative: bool = False
    early_stopping: bool = False
    reroute_after: bool = False  # evaluate the last round re-routed every 64 tokens too
    warm_rounds: int = 0  # rounds of the shared dense warm start (warm_base) before this row, which trains the rest
    what: str = ""  # the table's description

    @property
    def run_name(self) -> str:
        return f"{self.corpus}_{self.name}_s{self.seed}"

    @property
    def prep_key(self) -> str:
        """Runs of the same corpus, grid and router share a prepare."""
        return f"{self.corpus}_" + "x".join(map(str, self.grid))

    @property
    def paths(self) -> int:
        return int(np.prod(self.grid))

    @property
    def communication(self) -> str:
        """What the row sends between workers: sync all-reduces every step, dense nothing, and
        several workers averaged without an outer optimizer (the `_avg` row) what DiLoCo sends."""
        if self.accum > 1:
            return "data_parallel"
        return "none" if self.outer_identity and self.workers == 1 and self.grid == (1,) else "outer"

    def workers_per_round(self, args: QualityArgs) -> list[int]:
        return list(self.schedule) if self.schedule else [self.workers] * args.rounds

    def rest(self, args: QualityArgs) -> QualityArgs:
        """The sizes of the row's own rounds: all of them, or those after its warm start."""
        return dataclasses.replace(args, rounds=args.rounds - self.warm_rounds) if self.warm_rounds else args

    def token_multiple(self, args: QualityArgs) -> float:
        """Training tokens relative to `dense`'s: paths x mean workers x accumulation x step multiple."""
        workers = sum(self.workers_per_round(args)) / args.rounds
        return self.paths * workers * self.accum * self.step_multiple

    def cost(self, args: QualityArgs) -> float:
        """Estimated seconds on one core (the module docstring's model): the longest rows go first."""
        hidden = args.hidden * self.hidden_multiple
        step = step_seconds(hidden, args.micro_batch * args.seq_len) * self.accum
        train = sum(
            self.paths * w * (args.inner_steps * self.step_multiple * step + TASK_OVERHEAD)
            for w in self.workers_per_round(args)
        )
        weight = CORPORA[self.corpus].eval_weight * (min(args.eval_docs, 502) / 502 if args.eval_docs else 1.0)
        # rounds + 1 evaluations, and one more for the per-document scores
        evals = (args.rounds + 2) * (eval_seconds(hidden, weight) + PATH_EVAL_OVERHEAD * self.paths)
        extras = (2 * eval_seconds(hidden, weight) if self.reroute_after else 0) + (120 if self.discriminative else 0)
        if self.warm_rounds:  # its own rounds, and a third of the warm start its seed's three warm rows share
            own = dataclasses.replace(self, warm_rounds=0).cost(self.rest(args))
            return own + warm_base(self).cost(dataclasses.replace(args, rounds=self.warm_rounds)) / 3
        return ISLAND_START + train + evals + extras


def warm_base(v: Variant) -> Variant:
    """The dense warm start of a warm row: grid [1], one worker at M x the batch (sync_m4's tokens a
    round, so a warm row sees the tokens of its from-scratch row), no outer step."""
    return Variant(
        "warm_dense", (1,), corpus=v.corpus, seed=v.seed, accum=M, outer_identity=True, what="the warm start"
    )


# -- the rows ------------------------------------------------------------------------------------
def corpora(args: QualityArgs) -> list[str]:
    names = [c for c in args.corpora.split(",") if c]
    unknown = set(names) - set(CORPORA)
    if unknown:
        raise SystemExit(f"--corpora: unknown {sorted(unknown)}; known: {sorted(CORPORA)}")
    return names


def claims_variants(args: QualityArgs) -> list[Variant]:
    """Every claims row on every corpus: the compared rows with `seeds` seeds, the sweep and 4x4 with seed 0."""
    pool = tuple(claims.pool_schedule(args.rounds, M))
    nesterov = f"outer Nesterov (lr {args.outer_lr:g}, momentum {args.outer_momentum:g})"
    specs: list[tuple[str, dict, bool]] = [  # name, Variant fields, every seed
        ("dense", {"outer_identity": True, "what": "1 worker, no outer step: plain training"}, True),
        (
            "sync_m2",
            {"accum": 2, "outer_identity": True, "what": "1 worker, gradient accumulation 2 = 2 data-parallel ranks"},
            True,
        ),
        (
            f"sync_m{M}",
            {
                "accum": M,
                "outer_identity": True,
                "what": f"1 worker, gradient accumulation {M} = {M} data-parallel ranks",
            },
            True,
        ),
        ("diloco_m1", {"what": f"1 worker + {nesterov}"}, True),
        ("diloco_m2", {"workers": 2, "what": f"2 workers on iid halves, {nesterov}"}, True),
        (f"diloco_m{M}", {"workers": M, "what": f"{M} workers on iid parts, {nesterov}"}, True),
        *(
            (
                f"diloco_m{M}_olr{lr:g}",
                {"workers": M, "outer_lr": lr, "what": f"diloco_m{M} with outer lr {lr:g}"},
                False,
            )
            for lr in (float(x) for x in args.outer_lr_sweep.split(",") if x and args.extras)
        ),
        *(
            [
                (
                    f"diloco_m{M}_avg",
                    {
                        "workers": M,
                        "outer_identity": True,
                        "what": f"{M} workers on iid parts, averaged (outer lr 1, momentum 0: no outer optimizer)",
                    },
                    False,
                )
            ]
            if args.extras
            else []
        ),
        (
            f"noniid_m{M}",
            {"workers": M, "worker_data": "clustered", "what": f"{M} workers, each its own k-means cluster"},
            True,
        ),
        (
            f"pool_m{M}",
            {
                "workers": max(pool),
                "schedule": pool,
                "what": f"workers per round {', '.join(map(str, pool[:4]))}{', ...' if len(pool) > 4 else ''} "
                f"(mean {M})",
            },
            True,
        ),
        (
            "dipaco_2x2",
            {"grid": (2, 2), "what": f"[2, 2] grid routed by {args.embedder} k-means, 1 worker a path"},
            True,
        ),
        *([("dipaco_4x4", {"grid": (4, 4), "what": "[4, 4] grid (16 paths)"}, False)] if args.extras else []),
        *(warm_specs(args) if args.warm else []),
    ]
    rows = []
    for corpus in corpora(args):
        for name, fields, every_seed in specs:
            fields = {"grid": (1,), **fields}
            rows += [Variant(name, corpus=corpus, seed=s, **fields) for s in (range(args.seeds) if every_seed else [0])]
    return rows


def warm_specs(args: QualityArgs) -> list[tuple[str, dict, bool]]:
    """The papers' regime (issue 44): dense for the first quarter of the rounds, then each row for the rest."""
    warm = max(1, args.rounds // 4)
    then = f"dense at {M}x batch for {warm} of {args.rounds} rounds, then"
    return [
        (
            f"warm_sync_m{M}",
            {"accum": M, "outer_identity": True, "warm_rounds": warm, "what": f"{then} sync_m{M}"},
            True,
        ),
        (f"warm_diloco_m{M}", {"workers": M, "warm_rounds": warm, "what": f"{then} diloco_m{M}"}, True),
        ("warm_dipaco_2x2", {"grid": (2, 2), "warm_rounds": warm, "what": f"{then} dipaco_2x2"}, True),
    ]


def options_variants(args: QualityArgs) -> list[Variant]:
    """The option rows on the first corpus, one seed, with the seed-0 rows they are compared with."""
    corpus = corpora(args)[0]
    half = args.blocks // 2
    rows = [
        Variant(
            "dipaco_2x2",
            (2, 2),
            corpus,
            early_stopping=True,
            reroute_after=True,
            what=f"[2, 2] grid routed by {args.embedder} k-means, 1 worker a path",
        ),
        Variant("dipaco_4x4", (4, 4), corpus, what="[4, 4] grid (16 paths)"),
        Variant(
            f"dense_x{M}",
            (1,),
            corpus,
            suite="options",
            step_multiple=M,
            outer_identity=True,
            what=f"dense trained {M}x the steps",
        ),
        Variant(
            "dense_big",
            (1,),
            corpus,
            suite="options",
            hidden_multiple=2,
            outer_identity=True,
            what="dense with hidden 2x: 4x the non-embedding parameters (the 4x4's flagship)",
        ),
        Variant(
            "pathblocks",
            (2, 2),
            corpus,
            suite="options",
            blocks=(half, half - 1),
            path_blocks=1,
            what="dipaco_2x2, one of its blocks path-specific",
        ),
        Variant("int8", (2, 2), corpus, suite="options", compression="int8", what="dipaco_2x2, int8 outer gradients"),
        Variant("int4", (2, 2), corpus, suite="options", compression="int4", what="dipaco_2x2, int4 outer gradients"),
    ]
    if HAS_DISCRIMINATIVE:
        rows.append(
            Variant(
                "discriminative",
                (2, 2),
                corpus,
                suite="options",
                discriminative=True,
                what="dipaco_2x2 re-sharded by a discriminative router halfway",
            )
        )
    return rows


def variants(args: QualityArgs) -> list[Variant]:
    """The suite's rows in the table's order; a run in both suites is kept once (the options' copy,
    which also re-routes and early-stops, neither of which changes its training)."""
    if args.suite not in ("claims", "options", "all"):
        raise SystemExit(f"--suite: claims, options or all, not {args.suite!r}")
    rows = (claims_variants(args) if args.suite != "options" else []) + (
        options_variants(args) if args.suite != "claims" else []
    )
    chosen = {v.run_name: v for v in rows}  # the later copy wins
    ordered = [chosen[name] for name in dict.fromkeys(v.run_name for v in rows)]
    if args.suite == "all":  # the bases keep their place (and their suite) in the claims table
        claimed = {v.run_name for v in claims_variants(args)}
        ordered = [dataclasses.replace(v, suite="claims") if v.run_name in claimed else v for v in ordered]
    wanted = {n for n in args.only.split(",") if n}
    return [v for v in ordered if not wanted or v.name in wanted]


def describe(v: Variant, args: QualityArgs) -> dict:
    """What a run is, as its result records it (beside what it measured)."""
    outer = "none" if v.outer_identity else {"lr": v.outer_lr or args.outer_lr, "momentum": args.outer_momentum}
    return {
        "name": v.name,
        "run": v.run_name,
        "corpus": v.corpus,
        "seed": v.seed,
        "suite": v.suite,
        "what": v.what,
        "grid": list(v.grid),
        "workers": v.workers,
        "schedule": list(v.schedule) if v.schedule else None,
        "worker_data": v.worker_data,
        "accum": v.accum,
        "outer": outer,
        "communication": v.communication,
        "token_multiple": v.token_multiple(args),
    }


def write_eval_docs(args: QualityArgs, corpus: str) -> str:
    """The corpus's held-out documents (the first `eval_docs`, 0: all) as one file: the same for its every row."""
    target = Path(args.out) / f"data-{corpus}" / "validation" / "c4-validation.00000-of-00001.json.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for file in sorted(Path().glob(CORPORA[corpus].eval)):
        with gzip.open(file, "rt", encoding="utf-8") as handle:
            lines.extend(handle)
    if not lines:
        raise SystemExit(f"no held-out documents in {CORPORA[corpus].eval}: run `make sample` first")
    with gzip.open(target, "wt", encoding="utf-8") as handle:
        handle.writelines(lines[: args.eval_docs or None])
    return str(target.parent / "*.json.gz")


def variant_config(
    args: QualityArgs, v: Variant, run_root: str, eval_glob: str, init_from: str | None = None, init_round: int = 0
) -> Config:
    levels = len(v.grid)
    blocks = list(v.blocks) if v.blocks else [args.blocks // levels] * levels
    outer_lr = v.outer_lr or args.outer_lr
    outer = (
        {"lr": 1.0, "momentum": 0.0, "nesterov": False}
        if v.outer_identity
        else {"lr": outer_lr, "momentum": args.outer_momentum, "nesterov": args.outer_momentum > 0}
    )
    # grid [1]: every document lands in the one path, so the cheap tf-idf embedder routes as well as MiniLM.
    router = {
        "embedder": "tfidf" if v.grid == (1,) else args.embedder,
        "prefix_tokens": 32,
        "sample_docs": args.router_docs,
        "balanced": True,
    }
    if v.discriminative:
        router["discriminative_after"] = args.rounds // 2 - 1  # halfway: later rounds train on the new shards
    return config_from_dict(
        {
            "run_root": run_root,
            "data": {"train": CORPORA[v.corpus].train, "eval": eval_glob, "max_docs": args.train_docs or None},
            "router": router,
            "model": {
                "grid": list(v.grid),
                "blocks_per_level": blocks,
                "hidden_size": args.hidden * v.hidden_multiple,
                "num_heads": args.heads * v.hidden_multiple,
                "seq_len": args.seq_len,
                "tokenizer": "bpe",
                "vocab_size": args.vocab,
                "tokenizer_sample_docs": 4000,
                "init_seed": v.seed,
                "path_specific_blocks": v.path_blocks,
                **({"init_from": init_from, "init_round": init_round} if init_from else {}),
            },
            "train": {
                "rounds": args.rounds,
                "inner_steps": args.inner_steps * v.step_multiple,
                "micro_batch_size": args.micro_batch,
                "gradient_accumulation_steps": v.accum,
                "lr": args.lr,
                "warmup_steps": args.warmup,
                "min_lr_ratio": 1.0,  # constant after warmup, as the demo measured best far from convergence
                "ds_config": "ds_configs/zero2.json",
                "precision": "auto",
                "workers_per_path": v.workers,
                "worker_data": v.worker_data,
                "workers_schedule": list(v.schedule) if v.schedule else None,
                "seed": v.seed,
                "launcher": args.launcher,
                "parallel_paths": 1,
                "islands": 1,
                "threads_per_proc": 1,
            },
            "outer": {**outer, "compression": v.compression},
            "eval": {"max_docs": None, "batch_size": 16, "early_stopping": v.early_stopping},
            "mlflow": {"enabled": False},  # run.py logs the benchmark itself to dipaco-bench
        },
        source=f"<benchmark row {v.run_name}>",
    )


# -- prepare: once per corpus and grid, one tokenizer per corpus ---------------------------------
def prepare_all(args: QualityArgs, rows: list[Variant], eval_globs: dict[str, str]) -> dict[str, dict]:
    """One prepare per corpus and grid; a corpus's first trains its BPE tokenizer, its others are
    given it, so every row of a corpus cuts its held-out text into the same tokens."""
    preps: dict[str, dict] = {}
    tokenizer_roots: dict[str, str] = {}
    for v in sorted(rows, key=lambda r: (r.corpus, r.grid != (1,))):  # grid [1] first: its prepare is the cheapest
        if v.prep_key in preps:
            continue
        prep_root = Path(args.out) / f"prep-{v.prep_key}"
        shutil.rmtree(prep_root, ignore_errors=True)  # another run's sizes would not match; and honest timings
        base = dataclasses.replace(v, discriminative=False, schedule=None, workers=1, worker_data="iid")
        config = variant_config(args, base, str(prep_root), eval_globs[v.corpus])
        run = Run(config)
        root = stages.init_run(run)
        if v.corpus in tokenizer_roots:
            copy_committed(root, tokenizer_roots[v.corpus], (layout.TOKENIZER_DIR,))
        start = time.perf_counter()
        manifest = stages.prepare(run)
        tokenizer_roots.setdefault(v.corpus, config.run_root)
        preps[v.prep_key] = {"root": config.run_root, "seconds": time.perf_counter() - start, "manifest": manifest}
        log.info("prepare %s: %.0f s", v.prep_key, preps[v.prep_key]["seconds"])
    return preps


# -- one row -------------------------------------------------------------------------------------
PREPARED = (layout.TOKENIZER_DIR, layout.ROUTER_DIR, layout.SHARDS_DIR)  # what a row copies from its prepare
_WARM_LOCK = threading.Lock()
_WARM: dict[str, dict] = {}  # warm_base run name -> {"root", "seconds"}: run once, shared by its seed's rows


def warm_start(args: QualityArgs, v: Variant, preps: dict[str, dict], eval_glob: str) -> dict:
    """The warm row's dense start (warm_base for v.warm_rounds rounds), trained once per corpus and
    seed whichever of its rows asks first; the others wait for it."""
    base = warm_base(v)
    with _WARM_LOCK:
        if base.run_name not in _WARM:
            run_root = Path(args.out) / base.run_name
            shutil.rmtree(run_root, ignore_errors=True)
            run = Run(variant_config(dataclasses.replace(args, rounds=v.warm_rounds), base, str(run_root), eval_glob))
            root = stages.init_run(run)
            copy_committed(root, preps[base.prep_key]["root"], PREPARED)
            start = time.time()
            stages.run(run)
            _WARM[base.run_name] = {"root": str(run_root), "seconds": time.time() - start}
        return _WARM[base.run_name]


def run_variant(args: QualityArgs, v: Variant, prep: dict, eval_glob: str, preps: dict | None = None) -> dict:
    """One row through `stages.run` on its own island; its evaluations, timings, bytes and per-document
    scores. A warm row (v.warm_rounds) starts from its warm start's run root (model.init_from) and
    trains the remaining rounds; its tokens and steps count both."""
    run_root = Path(args.out) / v.run_name
    shutil.rmtree(run_root, ignore_errors=True)  # timings are only honest from a clean start
    warm = warm_start(args, v, preps or {}, eval_glob) if v.warm_rounds else None
    own = v.rest(args)
    config = variant_config(own, v, str(run_root), eval_glob, *((warm["root"], v.warm_rounds) if warm else ()))
    run = Run(config)
    root = stages.init_run(run)
    # a warm row's tokenizer is its start's (committed by init_run): the same BPE as the corpus's
    copy_committed(root, prep["root"], PREPARED[1:] if warm else PREPARED)
    start = time.time()
    stages.run(run)
    seconds = time.time() - start
    evals = read_curve(root, config, start)
    t = config.train
    step_tokens = t.inner_steps * t.micro_batch_size * config.model.seq_len
    warm_tokens = M * v.warm_rounds * step_tokens  # warm_base: accumulation M
    result = {
        **describe(v, args),
        "jobs": len(stages.list_paths(config)),
        "steps_per_path": (t.rounds + v.warm_rounds) * t.inner_steps,
        "tokens": sum(v.paths * w for w in v.workers_per_round(own)) * step_tokens * t.gradient_accumulation_steps
        + warm_tokens,
        **({"warm_start": {"rounds": v.warm_rounds, "tokens": warm_tokens, **warm}} if warm else {}),
        "tokens_per_step": t.micro_batch_size * t.gradient_accumulation_steps * config.model.seq_len,
        "hidden": config.model.hidden_size,
        "non_embedding_params": non_embedding_params(config),
        "perplexity": evals[-1]["perplexity"],
        "bits_per_byte": evals[-1]["bits_per_byte"],
        "eval_tokens": evals[-1]["tokens"],
        "evals": evals,
        "seconds": seconds,
        "merges": read_merges(root, config),
        "docs": document_scores(config, root),
    }
    if v.early_stopping:
        best = root.read_json("eval/best.json")
        result["early_stopped"] = {k: best[k] for k in ("perplexity", "bits_per_byte", "tokens")} | {
            "rounds": {p: e["round"] for p, e in best["paths"].items()}
        }
    if v.reroute_after:
        result["rerouted"] = rerouted_eval(config, root)
    if not args.keep_rounds:
        shutil.rmtree(run_root / "rounds", ignore_errors=True)  # ~50 MB a path and round; results are in eval/
    log.info(
        "%s: %.2f ppl, %.3f bits/byte in %.0f s", v.run_name, result["perplexity"], result["bits_per_byte"], seconds
    )
    return result


def read_curve(root: RunRoot, config: Config, start: float) -> list[dict]:
    """Each round's evaluation with its steps per worker and the seconds since the run started
    (when its eval file was written)."""
    curve = []
    for r in range(config.train.rounds + 1):
        e = root.read_json(layout.eval_file(r))
        written = Path(root.local_path(layout.eval_file(r))).stat().st_mtime
        curve.append(
            {
                "round": r,
                "steps_per_path": r * config.train.inner_steps,
                "perplexity": e["perplexity"],
                "bits_per_byte": e["bits_per_byte"],
                "tokens": e["tokens"],
                "seconds": max(0.0, written - start),
            }
        )
    return curve


def read_merges(root: RunRoot, config: Config) -> list[dict]:
    """Every round's merge.json bytes: what islands send and receive, and data-parallel's for the same jobs."""
    merges = []
    for r in range(config.train.rounds):
        report = root.read_json(f"{layout.round_dir(r)}/merge.json")
        merges.append(
            {
                "jobs": len(report.get("paths_merged", [])),
                **{k: report.get(k) for k in ("bytes_outer", "bytes_data_parallel", "bytes_outer_uncompressed")},
            }
        )
    return merges


_EVAL_LOCK = threading.Lock()


def document_scores(config: Config, root: RunRoot) -> dict[str, list]:
    """{document key: [nats, scored tokens, scored bytes]} of the last round's modules: the route-once
    evaluation once more, document by document (the eval file keeps only sums), so the table can
    say how much the choice of held-out documents alone moves a figure. Keys hash the tokens: the
    same document has the same key in every row of a corpus, whichever path scored it."""
    from models.grid import all_path_ids
    from models.modular import ModelShape
    from pipeline.routing.tokenizer import load_tokenizer, token_byte_lengths
    from pipeline.state.module_store import load_path_model

    m, prefix, last = config.model, config.router.prefix_tokens, config.train.rounds
    shards = layout.routing(config.router.discriminative_after, last).shards
    byte_lengths = token_byte_lengths(load_tokenizer(root, m.tokenizer), m.vocab_size)
    scores: dict[str, list] = {}
    with _EVAL_LOCK:  # one evaluation at a time in this process, beside the islands
        for path_id in all_path_ids(m.grid):
            docs = [d for d in held_out_documents(root, config, path_id, shards) if len(d) > prefix]
            if not docs:
                continue
            nats = document_losses(
                load_path_model(root, config, last, path_id),
                docs,
                prefix,
                m.seq_len,
                config.eval.batch_size,
                pad_id=ModelShape.from_config(m).eos_id,
            )
            for doc, nll in zip(docs, nats):
                window = np.asarray(doc[: m.seq_len + 1], dtype=np.int64)
                key = hashlib.blake2b(np.asarray(doc, dtype=np.int64).tobytes(), digest_size=8).hexdigest()
                entry = scores.setdefault(
                    key, [0.0, 0, 0]
                )  # a duplicated document: its copies summed, in every row alike
                entry[0] += float(nll)
                entry[1] += len(window) - prefix
                entry[2] += int(byte_lengths[window[prefix:]].sum())
    return scores


def rerouted_eval(config: Config, root: RunRoot) -> dict:
    """The last round's modules scored with `eval.reroute_every: 64`; the route-once eval file is
    put back afterwards (evaluate_round writes the same name)."""
    last = config.train.rounds
    cfg = dataclasses.replace(config, eval=dataclasses.replace(config.eval, reroute_every=64, early_stopping=False))
    original = root.read_json(layout.eval_file(last))
    with _EVAL_LOCK:  # one evaluation at a time in this process, beside the islands
        result = evaluate_round(cfg, last)
    root.write_json(layout.eval_file(last), original)
    return {k: result[k] for k in ("perplexity", "bits_per_byte", "tokens")}


# -- all rows ------------------------------------------------------------------------------------
def run_quality(args: QualityArgs) -> dict:
    """Prepare once per corpus and grid, then every row, `lanes` at a time, longest first. A row
    that fails is recorded as failed with its error and the others go on."""
    start = time.perf_counter()
    rows = variants(args)
    eval_globs = {c: write_eval_docs(args, c) for c in dict.fromkeys(v.corpus for v in rows)}
    preps = prepare_all(args, rows + [warm_base(v) for v in rows if v.warm_rounds], eval_globs)
    prepare_seconds = time.perf_counter() - start
    if args.launcher == "inprocess":
        args.lanes = 1  # one process cannot hold two in-process DeepSpeed ranks
    else:
        import torch

        torch.set_num_threads(1)  # this process's own evaluations (round 0, documents, re-routing) beside two islands
    partial = Path(args.out) / "quality.partial.json"
    results = finished_runs(partial, args, {v.run_name for v in rows})
    if results:
        log.info("resuming: %d runs already measured with these sizes (%s)", len(results), partial)
    done = {r["run"] for r in results}

    def one(v: Variant) -> dict:
        try:
            result = run_variant(args, v, preps[v.prep_key], eval_globs[v.corpus], preps)
        except Exception as exc:  # noqa: BLE001 - one row's failure is a finding, not the end of the table
            log.exception("%s failed", v.run_name)
            result = {**describe(v, args), "failed": f"{type(exc).__name__}: {exc}"[:300]}
        results.append(result)
        write_partial(partial, args, results)  # a run cut short still reports what it measured
        return result

    ordered = sorted((v for v in rows if v.run_name not in done), key=lambda v: -v.cost(args))
    with ThreadPoolExecutor(max_workers=max(1, args.lanes)) as pool:
        for future in [pool.submit(one, v) for v in ordered]:
            future.result()
    order = {v.run_name: i for i, v in enumerate(rows)}
    results.sort(key=lambda r: order[r["run"]])
    tokens = {
        c: sorted({r["eval_tokens"] for r in results if r["corpus"] == c and "eval_tokens" in r}) for c in eval_globs
    }
    return {
        "format": 2,
        "args": dataclasses.asdict(args),
        "runs": results,
        "same_eval_tokens": {c: len(t) == 1 for c, t in tokens.items()},
        "eval_tokens": tokens,
        "seconds": time.perf_counter() - start,  # this invocation's: a resumed one did less
        "resumed_runs": len(done),
        "prepare_seconds": prepare_seconds,
        "prepare": {
            k: {
                "seconds": p["seconds"],
                "routed": p["manifest"].get("routed"),
                "docs_per_path": _docs_per_path(p["manifest"]),
            }
            for k, p in preps.items()
        },
    }


def write_partial(path: Path, args: QualityArgs, results: list[dict]) -> None:
    """The runs measured so far with the sizes that measured them, to a temporary name and renamed:
    a benchmark stopped halfway (hours, for bench-long) resumes from here instead of from nothing."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"args": dataclasses.asdict(args), "runs": results}))
    tmp.replace(path)


def finished_runs(path: Path, args: QualityArgs, wanted: set[str]) -> list[dict]:
    """The runs of an earlier, interrupted invocation worth keeping: only when every size was the
    same (`args`, lanes and launcher aside: they change the time, not the numbers), only rows this
    invocation wants, and never a failed one (it runs again)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(saved, dict) or not isinstance(saved.get("runs"), list):
        return []  # the old format (a bare list) carried no sizes: nothing to trust
    same = ("lanes", "launcher")
    now = {k: v for k, v in dataclasses.asdict(args).items() if k not in same}
    if {k: v for k, v in (saved.get("args") or {}).items() if k not in same} != now:
        return []
    return [r for r in saved["runs"] if isinstance(r, dict) and r.get("run") in wanted and "failed" not in r]


def _docs_per_path(manifest: dict) -> dict:
    return {
        p: {split: entry.get("documents") for split, entry in splits.items()}
        for p, splits in (manifest.get("paths") or {}).items()
    }


# -- plots ---------------------------------------------------------------------------------------
def plot_quality(q: dict, out: Path) -> list[Path]:
    """Per corpus, bits per byte (mean over seeds) against steps per worker and against bytes
    communicated (log scale: dense sends nothing and is left out there); and every row's final
    bits per byte with its 95 % interval."""
    from matplotlib import pyplot as plt

    from pipeline.tracking import plots  # Agg backend set there

    runs = [r for r in q["runs"] if not r.get("failed")]
    shown = [r for r in runs if r["suite"] == "claims"] or runs
    names = list(dict.fromkeys(r["name"] for r in shown))
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    corpora_ = list(dict.fromkeys(r["corpus"] for r in shown))
    fig, axes = plt.subplots(len(corpora_), 2, figsize=(14, 4.8 * len(corpora_)), squeeze=False)
    for (ax_steps, ax_bytes), corpus in zip(axes, corpora_):
        for name in names:
            curve = claims.mean_curve([r for r in shown if r["corpus"] == corpus and r["name"] == name])
            if not curve:
                continue
            style = {
                "marker": "o",
                "markersize": 2.5,
                "label": name,
                "linewidth": 1.1,
                "color": colours[name],
                "linestyle": "--" if name.startswith(("dense", "sync")) else "-",
            }
            ax_steps.plot([c["steps"] for c in curve], [c["bits_per_byte"] for c in curve], **style)
            sent = [(c["bytes"], c["bits_per_byte"]) for c in curve if c["bytes"]]
            if sent:
                ax_bytes.plot(*zip(*sent), **style)
        ax_steps.set(xlabel="inner steps per worker", ylabel=f"{corpus}: held-out bits per byte")
        ax_bytes.set(
            xlabel="bytes communicated (cumulative; sync: its data-parallel all-reduce)",
            xscale="log",
            ylabel=f"{corpus}: held-out bits per byte",
        )
        for ax in (ax_steps, ax_bytes):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    curves = out / "quality_curves.png"
    fig.savefig(curves, dpi=110)
    plots.close(fig)

    rows = [r for r in claims.summarize(runs) if r["seeds"]]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 4.5))
    labels = [f"{r['corpus']}/{r['name']}" for r in rows]
    means = [r["bits_per_byte"].mean for r in rows]
    errors = [0 if np.isnan(r["bits_per_byte"].half_width) else r["bits_per_byte"].half_width for r in rows]
    ax.bar(labels, means, yerr=errors, capsize=2, color=[colours.get(r["name"], "tab:gray") for r in rows])
    low = min(means) - 3 * max(errors + [0.01])
    ax.set(
        ylabel="held-out bits per byte",
        title="Final bits per byte, mean over seeds ± 95 % interval",
        ylim=(max(0, low), max(means) + 3 * max(errors + [0.01])),
    )
    plt.setp(ax.get_xticklabels(), rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    bars = out / "quality_rows.png"
    fig.savefig(bars, dpi=110)
    plots.close(fig)
    return [curves, bars]


# -- command line --------------------------------------------------------------------------------
def prepare_estimate(args: QualityArgs, rows: list[Variant]) -> float:
    """Seconds of the prepares: a tf-idf one (~7 s for the wiki sample), MiniLM ~95 s per 10,000 documents."""
    total = 0.0
    for key in dict.fromkeys(v.prep_key for v in rows):
        v = next(r for r in rows if r.prep_key == key)
        docs = CORPORA[v.corpus].documents if not args.train_docs else min(args.train_docs, CORPORA[v.corpus].documents)
        minilm = v.grid != (1,) and args.embedder == "minilm"
        total += 5 + docs * (0.0095 if minilm else 0.0005)
    return total


def plan(args: QualityArgs) -> dict:
    """The rows' estimated seconds, the lanes they fill (the order run_quality uses) and the total."""
    rows = variants(args)
    lanes = [0.0] * max(1, args.lanes)
    for v in sorted(rows, key=lambda r: -r.cost(args)):
        lanes[lanes.index(min(lanes))] += v.cost(args)
    prepares = prepare_estimate(args, rows)
    return {
        "rows": [(v.run_name, v.cost(args)) for v in rows],
        "lanes": lanes,
        "prepares": prepares,
        "runs": len(rows),
        "seconds": max(lanes) + prepares,
    }


def plan_lines(args: QualityArgs) -> list[str]:
    p = plan(args)
    lines = [f"{name:>28}: {cost:6.0f} core-s" for name, cost in p["rows"]]
    return [
        *lines,
        f"{p['runs']} runs; lanes: {', '.join(f'{s:.0f}' for s in p['lanes'])} s; prepares "
        f"~{p['prepares']:.0f} s; quality total ~{p['seconds'] / 60:.0f} min",
    ]


def build_parser(prog: str = "python -m benchmarks.quality") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, every claims row: a smoke check in minutes")
    parser.add_argument("--long", action="store_true", help="bench-long: make bench's model, 24 rounds x H=25")
    parser.add_argument("--plan", action="store_true", help="print the rows and the estimated time, run nothing")
    for name, value in vars(QualityArgs()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> QualityArgs:
    raw = vars(build_parser().parse_args(argv))
    quick, long, show_plan = raw.pop("quick"), raw.pop("long"), raw.pop("plan")
    preset = QUICK if quick else LONG if long else {}
    values = {**vars(QualityArgs()), **preset, **{k: v for k, v in raw.items() if v is not None}}
    args = QualityArgs(**values)
    if show_plan:
        print("\n".join(plan_lines(args)))
        raise SystemExit(0)
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    result = run_quality(args)
    out = Path(args.out)
    (out / "quality.json").write_text(json.dumps(result))
    plot_quality(result, out)
    for r in claims.summarize(result["runs"]):
        if r["seeds"]:
            log.info("%-6s %-18s %s bits/byte", r["corpus"], r["name"], r["bits_per_byte"].text())


if __name__ == "__main__":
    main()
