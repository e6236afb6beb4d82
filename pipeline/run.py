"""The Run every stage takes: one run's validated config, its run root and its tracker.

Built once per process (by the CLI, each DAG task, a test) and handed to the stages
(pipeline.stages), so no stage builds its own run root or looks up its own tracker.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from pipeline.core.config import Config
from pipeline.state.storage import RunRoot
from pipeline.state.store import configure_storage
from pipeline.tracking.tracker import Tracker, get_tracker


@dataclass
class Run:
    """A run as the stages see it. The tracker is built on first use: an MLflow tracker imports
    MLflow and opens its store, which `dipaco clean`, a DAG sensor and `dipaco island` never need."""

    config: Config
    root: RunRoot = field(init=False)

    def __post_init__(self) -> None:
        configure_storage(self.config)  # storage.options, for this process and those it starts
        self.root = RunRoot(self.config.run_root)
        if self.config.model.init_from:  # the checkpoint's shape, as run.yaml recorded it
            from pipeline.init_from import adopt_recorded

            adopt_recorded(self.config, self.root)

    @functools.cached_property
    def tracker(self) -> Tracker:
        return get_tracker(self.config)
