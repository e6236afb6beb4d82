"""Where a run's MLflow records live, and what of a URI may be shown: shared by the tracker and
the registry, which import it and never each other in this direction (tracker -> registry -> here).
"""

from __future__ import annotations

import os
import re
from typing import Any

from pipeline.core.config import Config
from pipeline.core.errors import ConfigError
from pipeline.state.storage import RunRoot

NEWEST, CHAMPION = "newest", "champion"  # registry aliases (MLflow reserves "latest")
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][\w+.-]*://)[^/@\s]+@")


def redact(text: str) -> str:
    """'https://user:pw@host/x' -> 'https://***@host/x': a tracking URI may carry a password."""
    return _CREDENTIALS.sub(r"\g<scheme>***@", text)


def redact_data(obj: Any) -> Any:
    """redact() applied to every string inside nested dicts and lists."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_data(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_data(v) for v in obj]
    return obj


def tracking_uri(config: Config) -> str:
    """mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else SQLite in the run root."""
    if config.mlflow.tracking_uri:
        return config.mlflow.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = RunRoot(config.run_root)
    if not root.is_local:
        raise ConfigError(
            f"{config.source}: mlflow.tracking_uri must be set when run_root is not local "
            f"({redact(config.run_root)}): the embedded SQLite store needs a local file"
        )
    db = root.local_path("mlflow.db").resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"
