"""An HTTP proxy in front of the benchmark's S3 server that answers `503 SlowDown` while told to.

moto cannot throttle by itself. `python -m benchmarks.throttleproxy --listen 0.0.0.0:9000 --upstream
127.0.0.1:9001` forwards every request unchanged (HTTP/1.1, kept alive, one upstream connection per
client connection) until it gets SIGUSR1; from then until SIGUSR2 it answers every request with
the error S3 gives a client that sends too fast (503, code SlowDown), as a throttled bucket does.
It counts the requests it refused and prints the count when it stops (SIGTERM). With `--trace
FILE` it appends one JSON line per request: when it came in and was answered, the client's
address, method, path, body bytes each way and status (where a task's seconds go, request by
request; benchmarks.hosts keeps it as benchmarks/out/hosts/requests.jsonl).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class State:
    throttling = threading.Event()
    refused = 0
    lock = threading.Lock()
    trace = None  # the --trace file, open for appending


def traced(handler: BaseHTTPRequestHandler, began: float, up: int, down: int, status: int) -> None:
    if State.trace is None:
        return
    line = {"t0": round(began, 4), "t1": round(time.time(), 4), "client": handler.client_address[0]}
    line |= {"method": handler.command, "path": handler.path, "up": up, "down": down, "status": status}
    with State.lock:
        State.trace.write(json.dumps(line) + "\n")


class Truncated(Exception):
    """The client went away before its request's body was all in."""


def read_exactly(handler: BaseHTTPRequestHandler, size: int) -> bytes:
    data = handler.rfile.read(size)
    if len(data) < size:  # never forwarded as if whole: S3 stores no object from a cut-off PUT
        raise Truncated(f"{len(data)} of {size} bytes")
    return data


def read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body, whether sized or chunked (the chunked framing is hop-by-hop: dropped);
    Truncated when the client's connection ended before it (a host killed mid-upload)."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            line = handler.rfile.readline()
            if not line:
                raise Truncated("the chunked body ended early")
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            parts.append(read_exactly(handler, size))
            handler.rfile.readline()
    return read_exactly(handler, int(handler.headers.get("Content-Length") or 0))


def make_handler(upstream: tuple[str, int]):
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        conn: http.client.HTTPConnection | None = None

        def log_message(self, *args) -> None:  # quiet: one line per request would swamp the logs
            pass

        def forward(self) -> None:
            began = time.time()
            try:
                body = read_body(self)
            except Truncated:  # moto would store the cut-off body under the client's checksum header
                self.close_connection = True
                return
            if State.throttling.is_set():
                with State.lock:
                    State.refused += 1
                self.send_response(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(SLOW_DOWN)
                traced(self, began, len(body), 0, 503)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            for attempt in range(2):  # a kept-alive upstream connection the server closed: once more
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(*upstream, timeout=120)
                try:
                    self.conn.request(self.command, self.path, body=body or None, headers=headers)
                    response = self.conn.getresponse()
                    data = response.read()
                    break
                except (http.client.HTTPException, OSError):
                    self.conn.close()
                    self.conn = None
                    if attempt:
                        raise
            self.send_response(response.status, response.reason)
            head = self.command == "HEAD"  # its Content-Length is the object's, not the (empty) body's
            for key, value in response.getheaders():
                if key.lower() not in HOP_BY_HOP and (head or key.lower() != "content-length"):
                    self.send_header(key, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            traced(self, began, len(body), len(data), response.status)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

    return Proxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throttleproxy", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    parser.add_argument("--trace", help="append one JSON line per request to this file")
    args = parser.parse_args(argv)
    if args.trace:
        State.trace = open(args.trace, "a", buffering=1)  # line-buffered: a killed proxy loses no line
    host, port = args.listen.rsplit(":", 1)
    up_host, up_port = args.upstream.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), make_handler((up_host, int(up_port))))
    server.daemon_threads = True
    signal.signal(signal.SIGUSR1, lambda *_: State.throttling.set())
    signal.signal(signal.SIGUSR2, lambda *_: State.throttling.clear())

    def stop(*_):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"throttleproxy: {args.listen} -> {args.upstream}", flush=True)
    server.serve_forever(poll_interval=0.2)
    print(f"throttleproxy: refused {State.refused} requests with 503 SlowDown", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
