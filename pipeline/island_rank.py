"""The entry point of each rank of an island launch (pipeline.islands.island):

    deepspeed [--hostfile H --num_nodes N] --num_gpus G --no_local_rank \
        --module pipeline.island_rank --run-root URL --island NAME [--ds-config FILE] [--config FILE --set K=V]

It sits at the top of pipeline/, beside the stages, because an island runs every kind of task and
one of them, the re-routing of `router.discriminative_after`, re-shards with the Beam app
(preprocessing.prepare.reshard), which only the top may import (tests/test_code_layout.py). Here
the island is given that job, as pipeline.stages gives it to an in-process island.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from pipeline.core.config import Config, add_own_config_args, own_config
from pipeline.islands.island import Island, island_config
from pipeline.state.layout import Routing
from pipeline.state.storage import RunRoot

if TYPE_CHECKING:  # the router's module is not needed to start a rank
    from pipeline.routing.router import Router


def reshard(config: Config, root: RunRoot, router: Router, routing: Routing) -> dict:
    """preprocessing.prepare.reshard, imported only when a reroute task runs: importing the Beam
    job takes seconds, and most islands never re-route."""
    from preprocessing.prepare import reshard as beam_reshard

    return beam_reshard(config, root, router, routing)


def main(argv: list[str] | None = None) -> int:
    """Parse, then run the island on this rank until the plan is done (or SIGTERM)."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.island_rank")
    parser.add_argument("--run-root", required=True)
    parser.add_argument("--island", required=True)
    parser.add_argument("--island-id", default=None, help="this process's unique identity (default: name + random)")
    parser.add_argument("--ds-config", default=None)
    add_own_config_args(parser)
    args = parser.parse_args(argv)
    from pipeline.train.distributed import apply_rank_threads, run_rank

    def body() -> None:
        config = island_config(args.run_root, args.ds_config, own_config(args))
        apply_rank_threads(config.train, islands=True)  # whatever the launcher's environment says
        island = Island(config, args.island, args.island_id, reshard=reshard)
        signal.signal(signal.SIGTERM, island.on_sigterm)
        island.run()

    return run_rank("island", body)


if __name__ == "__main__":
    sys.exit(main())
