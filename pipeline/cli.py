"""`dipaco <command> --config FILE [--set key.path=value ...]`: parse, build, run, close.

Exit status 0 on success, 2 on a config or input error (one line on stderr, no traceback), 1 on
any other failure. Every command is a thin call into pipeline.stages, which the DAG calls too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from models.grid import parse_job_id
from pipeline.bounds import one_line
from pipeline.config import load_config
from pipeline.errors import ConfigError, DipacoError, StorageError
from pipeline.report import format_summary


# A backstop: our own messages are bounded where they are made; one from a library need not be.
CLI_MESSAGE_CHARS = 1000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dipaco", description="DiPaCo training pipeline")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--config", required=True, help="YAML run config")
        sub.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config key, value parsed as YAML (repeatable)")
        return sub

    command("prepare", "Beam job: fit the router, route and tokenize documents into shards")
    sub = command("train-path", "train one path for one round (a DeepSpeed launch, with retries)")
    sub.add_argument("--round", type=int, required=True)
    sub.add_argument("--path", required=True, help="path id, e.g. p3-1")
    command("merge", "outer merge of one round").add_argument("--round", type=int, required=True)
    command("eval", "routed perplexity of a round's modules").add_argument("--round", type=int, default=None)
    command("run", "every stage that has not committed yet, all rounds")
    return parser


def dispatch(args: argparse.Namespace) -> dict | None:
    config = load_config(args.config, args.overrides)  # before the heavy imports: a bad config fails fast
    from pipeline import stages

    if args.command == "run":
        return stages.run(config)
    stages.init_run(config)
    if args.command == "prepare":
        return stages.prepare(config)
    if args.command == "train-path":
        try:
            parse_job_id(args.path, config.model.grid, config.train.workers_per_path)
        except ValueError as exc:
            raise ConfigError(f"--path: {exc}") from None
        metrics = stages.train_path(config, args.round, args.path)
        if metrics is None:
            raise RuntimeError(f"path {args.path} round {args.round}: every attempt failed")
        return {k: metrics[k] for k in ("round", "path", "tokens", "tokens_per_s", "seconds")} | {"final_loss": metrics["loss"][-1]}
    if args.command == "merge":
        return stages.merge(config, args.round)
    round_index = stages.next_round(config) if args.round is None else args.round
    return stages.evaluate(config, round_index)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    try:
        result = dispatch(args)
    except DipacoError as exc:
        print(f"dipaco {args.command}: {one_line(str(exc), CLI_MESSAGE_CHARS)}", file=sys.stderr)
        return 2
    except StorageError as exc:
        print(f"dipaco {args.command}: {one_line(str(exc), CLI_MESSAGE_CHARS)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dipaco {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # anything else is a failure, reported in one line, logged in full
        logging.getLogger("dipaco").debug("failure", exc_info=True)
        print(f"dipaco {args.command}: failed: {type(exc).__name__}: {one_line(str(exc), CLI_MESSAGE_CHARS)}", file=sys.stderr)
        return 1
    if args.command == "run":
        print(format_summary(result))
    elif result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
