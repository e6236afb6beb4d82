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
# what a query parameter (or a `name=value` anywhere in a text) is named when its value is a secret;
# a name that ends in one of these hides its value: access_token, api_key, X-Amz-Signature, pass=,
# auth=, sslpassword=, ...
SECRET_PARAMS = (
    "token",
    "tokens",
    "key",
    "keys",
    "keyid",
    "pass",
    "password",
    "passwd",
    "passphrase",
    "pwd",
    "secret",
    "secrets",
    "sig",
    "signature",
    "credential",
    "credentials",
    "cred",
    "creds",
    "auth",
    "authorization",
    "bearer",
    "cookie",
    "session",
    "jwt",
    "sas",
    "private",
)
# userinfo, read both ways a URI reaches a reader, and hidden whichever is longer:
# - urllib.parse.urlsplit: from '://' to the authority's last '@' (so a '@' inside a password
#   leaks nothing); the authority ends at the first '/', '?', '#' or space;
# - SQLAlchemy's make_url: a user name without ':' or '/', then ':' and a password that runs to the
#   next '@' whatever it holds ('/', '?', '#', spaces: SQLAlchemy connects with `pa/ss?w#d`, which
#   urlsplit reads as host 'u', port 'pa'). Bounded to 256 characters, one line and the next '://',
#   so the scans of two URIs never overlap and the whole stays linear in the text.
_USERINFO = re.compile(r"://[^/?#\s]*@")
_SQLALCHEMY_USERINFO = re.compile(r"://[^:/@\s]*:(?:[^@\n:]|:(?!//)){0,256}@")
# '=' and the value after a secret name: the literal '=' first lets the engine jump from one '='
# to the next, fixed-width lookbehinds check the name, and the replacement is a plain string (no
# per-match Python callback); one lookbehind of the names' last letters turns most '=' away at once
_LAST_LETTERS = "".join(sorted({name[-1] for name in SECRET_PARAMS}))
_SECRET_VALUE = re.compile(
    f"=(?<=[{_LAST_LETTERS}]=)(?:" + "|".join(f"(?<={name}=)" for name in SECRET_PARAMS) + r")[^&#;\s'\",\]]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """Credentials out of every URI in a text (a tracking URI, a data glob, a message):
    'https://user:p@ss@host/x?token=T&n=1' -> 'https://***@host/x?token=***&n=1',
    'postgresql://u:pa/ss?w#d@h/db' -> 'postgresql://***@h/db'.

    Regexes that never backtrack far, with plain-string replacements, so the time is linear in
    the text (1 MB in a few ms; the regex before took 18 s on a 64 KB override). The userinfo is
    hidden as urllib.parse.urlsplit splits it (up to the authority's last '@') and as SQLAlchemy's
    make_url does (a password up to the next '@'); the tests check the result against both."""
    if "://" in text:
        text = _USERINFO.sub("://***@", text)
        text = _SQLALCHEMY_USERINFO.sub("://***@", text)
    if "=" in text:
        text = _SECRET_VALUE.sub("=***", text)
    return text


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
