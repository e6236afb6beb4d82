"""Islands on two hosts (network namespaces) survive a partition longer than the lease: the
small version of `python -m benchmarks.hosts` (benchmarks/netns.py, benchmarks/hosts.py).

Root only: it skips, in one line, where network namespaces cannot be made. On an `s3://` run root
against moto in the store's namespace when this checkout has object-store run roots, else on the
benchmark's local stand-in (a directory both hosts see; the partition also freezes the host).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import hosts, netns

pytestmark = pytest.mark.timeout(600)


def processes_mentioning(marker: str) -> list[str]:
    """Every process whose command line or environment names `marker` (the lab's temp dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            blob = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in blob:
            found.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
    return found


def test_two_hosts_survive_a_partition_with_bitwise_equal_modules(tmp_path):
    why = netns.can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces: {why}")
    spec = hosts.Spec(
        hosts=2,
        shape=netns.LinkShape(None, None),
        lease_seconds=4.0,
        partition_leases=2.5,
        throttle_s=0,  # one fault: the partition
        timeout_s=600.0,
        overrides=["train.rounds=3"],
        mlflow=False,  # the benchmark's MLflow server costs a 2-core machine half a minute; the run is the same
    )
    spec.store = "s3" if hosts.s3_ready(spec) is None else "local"
    base = tmp_path / "lab-base"
    try:
        found = hosts.benchmark(spec, base, runs=("faults",))
    finally:
        # nothing of the lab is left: no namespace, no process
        assert [ns for ns in netns.lab_namespaces() if ns.startswith(f"{netns.PREFIX}{os.getpid()}-")] == []
        assert processes_mentioning(str(base)) == []
    reference, faulted = found["results"]
    events = {e["fault"]: e for e in faulted["events"]}
    assert list(events) == ["partition", "reconnect"]
    partitioned = [
        task for island, tasks in events["partition"]["held"].items() if island.startswith("h1-") for task in tasks
    ]
    assert partitioned, f"host 1 held no train task when it was partitioned: {events['partition']}"
    attempts = faulted["summary"]["attempts"]
    for task in partitioned:  # taken over: done by an attempt of another island; host 1's never done
        mine = [a for a in attempts if a["task"] == task and a["island"].startswith("h1-")]
        assert mine and all(a["state"] != "done" for a in mine), mine
        assert any(a["state"] == "done" and not a["island"].startswith("h1-") for a in attempts if a["task"] == task)
    assert faulted["violations"] == []  # no host process touched the other host's or the store's directory
    assert faulted["summary"]["tokens"] == reference["summary"]["tokens"]
    assert faulted["summary"]["modules"] and faulted["summary"]["modules"] == reference["summary"]["modules"]
