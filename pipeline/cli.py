"""`dipaco <command> --config FILE [--set key.path=value ...]`: parse, check, build, run, close.

Exit status 0 on success, 2 on a config or input error (one line on stderr, no traceback), 1 on
any other failure. Every command is a thin call into pipeline.stages, which the DAG calls too.
The config and the command's arguments are checked (pipeline.preflight) before torch is imported
and before anything is written, so a mistake costs a fraction of a second and changes nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sys
import textwrap
import threading
from contextlib import ExitStack

from pipeline import compile_warmup, preflight
from pipeline.core.bounds import one_line
from pipeline.core.config import Config, load_config
from pipeline.core.errors import DipacoError, IslandError, StorageError
from pipeline.islands import processes
from pipeline.state import layout
from pipeline.state.store import configure_storage
from pipeline.tracking.report import format_summary

ROUNDS = """\
rounds: round R trains every path from the modules of round R, and `merge --round R` turns the
trained paths into the modules of round R+1 (round 0's modules are the initial ones). Evaluation,
the summary table and the registered model versions are numbered by the modules they use:
`eval --round R` scores the modules round R starts from."""

EXIT_STATUS = "exit status: 0 success, 2 config or input error (one line on stderr), 1 any other failure."

# name: (one-line help, description, examples run from the repository root)
COMMANDS = {
    "prepare": (
        "route and tokenize the documents into one shard per path (Beam)",
        "Fit the router on data.train, route every document of data.train and data.eval to its path and "
        "write one shard per path (router/, shards/). Skipped when shards/ is committed.",
        ["dipaco prepare --config configs/demo.yaml"],
    ),
    "train-path": (
        "train one path for one round (one DeepSpeed launch, retried)",
        "Run train.inner_steps steps of one path on its shard, starting from the modules of round R, and "
        "commit it under rounds/round=R/paths/path=ID. A launch that crashes is retried up to "
        "train.max_attempts times; a config or input error is reported at once and not retried.",
        ["dipaco train-path --config configs/demo.yaml --round 0 --path p1-0"],
    ),
    "merge": (
        "outer merge of one round: writes the next round's modules",
        "Average the trained paths of round R per module and take the outer Nesterov step: writes the "
        "modules round R+1 starts from. Paths that did not train are left out and named.",
        ["dipaco merge --config configs/demo.yaml --round 0     # writes round 1's modules"],
    ),
    "eval": (
        "routed perplexity of one round's modules on the held-out documents",
        "Score every held-out document with the path its prefix routes to, using the modules round R "
        "starts from; writes eval/round=R.json.",
        [
            "dipaco eval --config configs/demo.yaml --round 1      # after `merge --round 0`",
            "dipaco eval --config configs/demo.yaml                # the newest committed modules",
        ],
    ),
    "island": (
        "join a running run as one more island (elastic: from any shell or host)",
        "Start one island (a long-lived `deepspeed` launch of pipeline.island_rank) on the run root of the config: "
        "it takes tasks of the rounds the run planned (queue/plan.json) until they are done, or until SIGTERM, "
        "which releases its task and leaves. Its train section may differ from the run's (procs_per_path, "
        "num_nodes, hostfile, ds_config): islands may be heterogeneous; the model is the run's. On a run not "
        "planned yet it exits 2, or with --wait waits for the plan: hosts may start in any order.",
        [
            "dipaco island --config configs/demo.yaml              # while `make demo` runs in another shell",
            "dipaco island --config configs/demo.yaml --wait 600   # started before `make demo`: waits for its plan",
            "dipaco island --config configs/demo.yaml --set train.ds_config=ds_configs/zero3.json --name big",
        ],
    ),
    "export": (
        "every path of a round as a Hugging Face checkpoint, with the router and a model card",
        "Write each path of the modules round R starts from as a save_pretrained directory (DIR/paths/<id>/: "
        "config.json, model.safetensors, tokenizer and generation config), the router (DIR/router/) and a model "
        "card (DIR/README.md); attached to round R's registered version when there is one. A dense run exports "
        "one checkpoint. Any later run can start from one with model.init_from.",
        ["dipaco export --config configs/demo.yaml --round 2 --out exports/demo"],
    ),
    "clean": (
        "remove this config's run root (keep its MLflow registry with --keep-registry)",
        "Remove the run root of the config: shards, rounds, evaluations, the queue and, unless --keep-registry, "
        "the MLflow store in it (mlflow.db, mlartifacts/) with the registered versions. Refused while a run holds "
        "the run root, or when it holds no run.yaml. A tracking server's records are left alone.",
        [
            "dipaco clean --config configs/tiny.yaml",
            "dipaco clean --config configs/demo.yaml --keep-registry   # the champion still loads",
        ],
    ),
    "run": (
        "every stage not yet committed, all rounds, evaluation and registration",
        "Prepare, evaluate round 0, then for each round up to train.rounds: train every path, merge, "
        "evaluate and register the new modules; ends with a summary table. Resumes where a previous run "
        "stopped; once every round is committed it trains nothing (raise train.rounds to continue).",
        [
            "dipaco run --config configs/demo.yaml                 # make demo",
            "dipaco run --config configs/tiny.yaml --set train.rounds=3 --set 'model.grid=[2, 1]'",
        ],
    ),
    "sweep": (
        "scaling-law sweep: train a grid of runs, fit the laws, predict a larger run (docs/sweep.md)",
        "Train every point of a sweep file (sizes x replicas x hyper-parameters, sync or DiLoCo) as a normal run "
        "under <sweep_root>/runs/, skipping committed points, then fit loss against size per algorithm and M and "
        "write <sweep_root>/fit.json, plots and points.csv (MLflow: one run per sweep, one nested run per point). "
        "--predict KEY=VALUE gives the predicted loss and best hyper-parameters at a size outside the sweep; "
        "--verify trains that point and records the prediction's error (fit.json's holdout). "
        "--set applies to every point.",
        [
            "dipaco sweep --config configs/sweep.yaml --quick",
            "dipaco sweep --config configs/sweep.yaml --quick --predict model.hidden_size=64 --verify",
        ],
    ),
}


def _epilog(examples: list[str], rounds: bool) -> str:
    lines = ["examples (from the repository root):", *("  " + e for e in examples), ""]
    return "\n".join(lines + ([ROUNDS, ""] if rounds else []) + [EXIT_STATUS])


def round_number(text: str) -> int:
    """argparse type for --round: a round is a non-negative integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a round number (0, 1, ...), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"rounds are numbered from 0, got {value}")
    return value


# A backstop: our own messages are bounded where they are made; one from a library need not be.
CLI_MESSAGE_CHARS = 1000


def build_parser() -> argparse.ArgumentParser:
    every_example = [
        e
        for name in ("run", "island", "prepare", "train-path", "merge", "eval", "export", "clean")
        for e in COMMANDS[name][2]
    ]
    parser = argparse.ArgumentParser(
        prog="dipaco",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DiPaCo training pipeline: Beam routing, DeepSpeed ZeRO path trainers, DiLoCo outer merges,\n"
        "MLflow tracking and registry. `dipaco COMMAND --help` describes each command.",
        epilog=_epilog(every_example, rounds=True),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, round_help: str = "", round_required: bool = True) -> argparse.ArgumentParser:
        """A subcommand with --config and --set; with round_help, also --round R (and the epilog
        explains rounds)."""
        help_text, description, examples = COMMANDS[name]
        sub = commands.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(description, 100),
            epilog=_epilog(examples, rounds=bool(round_help)),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument("--config", required=True, metavar="FILE", help="YAML run config, e.g. configs/demo.yaml")
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, value parsed as YAML (repeatable): --set 'model.grid=[2, 2]'",
        )
        if round_help:
            sub.add_argument("--round", type=round_number, required=round_required, metavar="R", help=round_help)
        return sub

    command("prepare")
    sub = command("train-path", round_help="the round to train: its paths start from round R's modules")
    sub.add_argument(
        "--path",
        required=True,
        metavar="ID",
        help="path id, one module index per level: p1-0 on the demo's [2, 1] grid (p<k0>-<k1>-...; "
        "p1-0.w1 for DiLoCo worker 1 when train.workers_per_path > 1)",
    )
    command("merge", round_help="the round whose trained paths are merged into the modules of round R+1")
    command(
        "eval",
        round_help="score the modules round R starts from (0: the initial ones; default: the newest committed)",
        round_required=False,
    )
    command("export", round_help="export the modules round R starts from (after `merge --round R-1`)").add_argument(
        "--out", required=True, metavar="DIR", help="a new directory: paths/<id>/, router/, README.md"
    )
    island = command("island")
    island.add_argument(
        "--name", default=None, metavar="NAME", help="the island's name in the queue's records (default: host-pid)"
    )
    island.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for the run to be planned (default 0: exit 2 at once if it is not)",
    )
    command("run")
    command("clean").add_argument(
        "--keep-registry", action="store_true", help="keep mlflow.db and mlartifacts/ (the registered model versions)"
    )
    sub = command("sweep")
    sub.add_argument("--quick", action="store_true", help="the sweep file's quick section: tiny sizes, minutes")
    sub.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a point outside the sweep (repeatable): model.hidden_size=128 [algorithm=diloco]",
    )
    sub.add_argument("--verify", action="store_true", help="train the --predict point; fit.json records the error")
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("dipaco")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def check(args: argparse.Namespace, config: Config, beside: ExitStack) -> None:
    """Every refusal this command can know of before it writes (pipeline.preflight). A waiting
    `dipaco island` compiles the path model meanwhile (pipeline/compile_warmup.py), in a
    process that `beside` stops when the command is done."""
    if args.command != "clean":
        preflight.check_object_store(config)
    if args.command == "island" and args.wait:
        beside.enter_context(compile_warmup.beside(config))
        preflight.wait_for_plan(config, args.wait)  # before the checks that need the run prepared
    if args.command in ("prepare", "run"):
        preflight.check_data(config)
    if args.command == "train-path":
        preflight.check_job_id(config, args.path)
    if args.command in ("train-path", "merge", "eval", "island", "export"):
        preflight.require_prepared(config)
    if args.command in ("train-path", "merge", "export") or (args.command == "eval" and args.round is not None):
        preflight.require_modules(config, args.round)
    if args.command == "merge":
        preflight.require_trained_path(config, args.round)
    if config.model.init_from and args.command not in ("clean", "island", "export"):
        preflight.check_init_from(config)
    if args.command != "clean":
        preflight.check_run_root(config)  # last: it creates the run root, which a refusal above must not


def dispatch(args: argparse.Namespace) -> dict | None:
    if args.command == "sweep":  # a sweep file, not a run config: pipeline.sweep checks it before torch loads
        from pipeline import sweep

        return sweep.command(args.config, args.quick, args.predict, args.verify, args.overrides)
    config = load_config(args.config, args.overrides)
    configure_storage(config)
    with ExitStack() as beside:
        check(args, config, beside)
        return _dispatch_checked(args, config)


def _dispatch_checked(args: argparse.Namespace, config: Config) -> dict | None:
    from pipeline import stages  # once the arguments are known good; torch loads in the stages that need it
    from pipeline.run import Run

    run = Run(config)
    if args.command == "run":
        return stages.run(run)
    if args.command == "island":
        return stages.join_run(run, args.name)
    if args.command == "clean":
        return stages.clean(run, args.keep_registry)
    if args.command != "export":  # an export reads a run; it never starts one
        stages.init_run(run)
    if args.command == "prepare":
        return stages.prepare(run)
    if args.command == "train-path":
        metrics = stages.train_path(run, args.round, args.path)
        if metrics is None:
            attempts = run.root.path(layout.attempts_dir(args.round, args.path))
            raise RuntimeError(f"path {args.path} round {args.round}: every attempt failed (records in {attempts})")
        return {k: metrics[k] for k in ("round", "path", "tokens", "tokens_per_s", "seconds")} | {
            "final_loss": metrics["loss"][-1]
        }
    if args.command == "merge":
        return stages.merge(run, args.round)
    if args.command == "export":
        return stages.export(run, args.round, args.out)
    return stages.evaluate(run, layout.next_round(run.root) if args.round is None else args.round)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: unwinds like Ctrl-C, so every stage stops what it started on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _catch_signals() -> dict:
    """The first SIGINT or SIGTERM raises Interrupted; a second one while the run stops its
    processes (a bounded wait) is only acknowledged, so the stop is never cut short. Returns the
    handlers it replaced (main restores them: a caller in-process keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    stopping = []
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        if stopping:
            print(
                f"dipaco: {signal.Signals(signum).name} again: still stopping the run's processes "
                f"(at most {processes.STOP_GRACE_S + 5:.0f} s)",
                file=sys.stderr,
            )
            return
        stopping.append(signum)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return previous


def _stop_children() -> str:
    """A backstop after an interrupt: whatever this process started and still runs (Beam workers,
    a launch a stage did not stop) is stopped too. What it stopped, for the user."""
    left = processes.tree([os.getpid()], [])
    if not left:
        return ""
    outcome = processes.stop(left)
    return f"; stopped {outcome['processes']} more processes" + (
        f" ({outcome['killed']} killed)" if outcome["killed"] else ""
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    previous = _catch_signals()
    try:
        return _run(args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace) -> int:
    try:
        result = dispatch(args)
    except DipacoError as exc:
        print(f"dipaco {args.command}: {one_line(str(exc), CLI_MESSAGE_CHARS)}", file=sys.stderr)
        return 2
    except (StorageError, IslandError) as exc:
        print(f"dipaco {args.command}: {one_line(str(exc), CLI_MESSAGE_CHARS)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(
            f"dipaco {args.command}: interrupted ({signal.Signals(signum).name}); every process it started has "
            f"stopped{_stop_children()}; rerun the same command to resume",
            file=sys.stderr,
        )
        return 128 + signum
    except Exception as exc:  # anything else is a failure, reported in one line, logged in full
        logging.getLogger("dipaco").debug("failure", exc_info=True)
        print(
            f"dipaco {args.command}: failed: {type(exc).__name__}: {one_line(str(exc), CLI_MESSAGE_CHARS)}",
            file=sys.stderr,
        )
        return 1
    if args.command == "run":
        print(format_summary(result))
    elif args.command == "sweep":
        from pipeline.scaling.report import format_report

        print(format_report(result))
    elif result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
