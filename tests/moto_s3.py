"""`python tests/moto_s3.py -H HOST -p PORT`: moto's server for S3 alone, the stand-in store of the
tests and benchmarks (tests/s3_endpoint.py; benchmarks/hosts.py runs it in the store's namespace).

moto's own server (`python -m moto.server`) serves every AWS service. For each request it works out which one:
it lists moto's package directory and stats every entry in it (~200 system calls), then matches the host
against the services' URL patterns; and it logs the request. Profiled during a 4-round demo run on an S3 root,
those two took about a fifth of its samples; without them it used 5.1 CPU s for such a run instead of 7.0. The
store runs on the cores the islands train on, so its CPU is taken from their tasks, which a real store's never
is. Every request here goes straight to moto's S3 application, the one the dispatcher picked for each of them
anyway, with the same request handler and the same backend.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args()
    try:
        from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
        from werkzeug.serving import run_simple
    except ImportError:  # a moto whose server is laid out otherwise: its own, every service
        from moto.server import main as serve_every_service

        serve_every_service(["-H", args.host, "-p", str(args.port)])
        return

    class Unlogged(MotoRequestHandler):
        def log_request(self, code: Any = "-", size: Any = "-") -> None:
            """No line per request (moto's server writes one to stderr, which nobody reads here)."""

    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto's server sets it (its presigned URLs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple(args.host, args.port, create_backend_app("s3"), threaded=True, request_handler=Unlogged)


if __name__ == "__main__":
    main()
