"""An S3 endpoint for the tests: moto's server (the endpoint s3fs's own tests run against), for S3
alone (tests/moto_s3.py), in a process of its own on a free loopback port, started once per session
like the PostgreSQL fixtures' databases, with a fresh bucket per test that the test removes.

Islands and ranks are processes of their own: they reach the bucket through the same environment
(AWS_* dummy credentials, and FSSPEC_S3 with the endpoint, as `storage.options` sets it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# moto holds an object of up to this size in memory; by default it spools any over 5 MB to a
# temporary file on this machine's disk. A real store's disks are not its clients', yet here the
# spool took a third of moto's CPU per 7.6 MB PUT (45 -> 30 ms, on the cores the islands train on).
MOTO_SETTINGS = {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(128 << 20)}
MOTO_S3 = Path(__file__).with_name("moto_s3.py")  # moto's server for S3 alone: a quarter less of its CPU


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class MotoServer:
    endpoint: str
    process: subprocess.Popen

    def storage_set(self) -> str:
        """The --set override that points a run at this endpoint."""
        return f"storage.options={{endpoint_url: {self.endpoint}}}"

    def new_bucket(self) -> str:
        import boto3

        name = f"dipaco-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials()).create_bucket(Bucket=name)
        return name

    def remove_bucket(self, name: str) -> None:
        import boto3

        bucket = boto3.resource("s3", endpoint_url=self.endpoint, **_boto_credentials()).Bucket(name)
        bucket.objects.all().delete()
        bucket.delete()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _boto_credentials() -> dict:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def start_moto(timeout_s: float = 30.0, cpus: set[int] | None = None) -> MotoServer:
    """moto's server on a free loopback port, once it answers; raises if it does not within timeout_s.
    `cpus`: the cores it may run on (every thread of it: set before it starts), as a store's own
    machine would be (benchmarks.object_store --store-cpu)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(MOTO_S3), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **CREDENTIALS, **MOTO_SETTINGS},
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto's server exited with status {process.returncode}")
        try:
            urllib.request.urlopen(endpoint, timeout=1).read()
            return MotoServer(endpoint, process)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"moto's server did not answer on {endpoint} within {timeout_s:.0f} s")
