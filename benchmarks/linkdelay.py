"""A TCP relay that adds a link's latency, for kernels without sch_netem (benchmarks/netns.py).

`python -m benchmarks.linkdelay --listen A --upstream B --ports 9000,5000 --one-way-ms 20` runs in a
host's namespace: it listens on A:port for each port (A is the store's address, also on the host's
loopback) and forwards each connection to B:port (the store's second address, over the host's
shaped link), holding every chunk back `--one-way-ms` in each direction, so a request and its
answer take one round trip more, as they would on a slow link. A new connection waits one round
trip before its first byte goes out (the handshake a real link would cost). The link's rate is the
kernel's (tbf on the veth); this relay only delays, in order, chunk by chunk.

With `--counters FILE` it also counts the payload bytes it carries on each port, each way, and
rewrites FILE (JSON, `{"<port>": [up, down]}`) every half second: benchmarks.hosts splits a host's
link traffic into the object store's and MLflow's with it, which the interface counters cannot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys

CHUNK = 256 * 1024
COUNTS: dict[str, list[int]] = {}  # port -> [payload bytes up (host to store), down]


async def pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, count: list[int], way: int
) -> None:
    """Copy reader to writer, each chunk sent `delay_s` after it arrived, in arrival order; each
    chunk's length is added to count[way]."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while True:
            data = await reader.read(CHUNK)
            count[way] += len(data)
            await queue.put((loop.time() + delay_s, data or None))
            if not data:
                break
        await sender
    except (OSError, asyncio.IncompleteReadError):
        sender.cancel()
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def relay(upstream: str, port: int, delay_s: float, client_r, client_w) -> None:
    await asyncio.sleep(2 * delay_s)  # the handshake's round trip
    try:
        server_r, server_w = await asyncio.wait_for(asyncio.open_connection(upstream, port), timeout=30)
    except (OSError, asyncio.TimeoutError):
        client_w.close()
        return
    count = COUNTS.setdefault(str(port), [0, 0])
    await asyncio.gather(pipe(client_r, server_w, delay_s, count, 0), pipe(server_r, client_w, delay_s, count, 1))


async def write_counts(path: str) -> None:
    """COUNTS to `path` every half second, through a temporary name (a reader never sees half)."""
    while True:
        with open(f"{path}.tmp", "w") as out:
            json.dump(COUNTS, out)
        os.replace(f"{path}.tmp", path)
        await asyncio.sleep(0.5)


async def serve(listen: str, upstream: str, ports: list[int], delay_s: float, counters: str | None = None) -> None:
    servers = [
        await asyncio.start_server(lambda r, w, p=port: relay(upstream, p, delay_s, r, w), listen, port)
        for port in ports
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"linkdelay: {listen}:{ports} -> {upstream}, {delay_s * 1000:g} ms each way", flush=True)
    writer = asyncio.create_task(write_counts(counters)) if counters else None
    await stop.wait()
    if writer is not None:
        writer.cancel()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linkdelay", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--ports", required=True, help="comma-separated")
    parser.add_argument("--one-way-ms", type=float, required=True)
    parser.add_argument("--counters", help="where to keep each port's payload bytes (JSON)")
    args = parser.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",") if p]
    asyncio.run(serve(args.listen, args.upstream, ports, args.one_way_ms / 1000, args.counters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
