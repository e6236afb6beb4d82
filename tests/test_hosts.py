"""Islands on two hosts (network namespaces) survive a partition longer than the lease: the
small version of `python -m benchmarks.hosts` (benchmarks/netns.py, benchmarks/hosts.py).

Root only: it skips, in one line, where network namespaces cannot be made. On an `s3://` run root
against moto in the store's namespace when this checkout has object-store run roots, else on the
benchmark's local stand-in (a directory both hosts see; the partition also freezes the host).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


@pytest.mark.slow
def test_two_hosts_survive_a_partition_with_bitwise_equal_modules(tmp_path):
    why = netns.can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces: {why}")
    spec = hosts.Spec(
        # Host 1's island waits for the plan (`--wait`), then starts its ranks (torch, DeepSpeed): on a
        # loaded 2-core machine seconds after host 0's first claim. With the tiny config's 4 steps host
        # 0's island trained all 8 tasks in 9 s, host 1 never trained, and no partition cut a task off.
        overrides=["train.inner_steps=300"],
        hosts=2,
        shape=netns.LinkShape(None, None),
        lease_seconds=4.0,
        partition_leases=2.5,
        throttle_s=0,  # one fault: the partition
        timeout_s=600.0,
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
    assert list(events) == ["partition", "reconnect"]  # the reconnect may come after the run ended
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


LAB_UNTIL_SIGNALLED = """
import sys, time
from pathlib import Path
from benchmarks import netns
with netns.Lab(2, netns.LinkShape(50, 40), Path(sys.argv[1]), store_ports=(9000,)) as lab:
    lab.spawn(lab.hosts[1], ["sleep", "600"], Path(sys.argv[1]) / "sleep.log")
    time.sleep(0.5)
    print(lab.tag, *[pid for ns in lab.made for pid in lab.pids(ns)], flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_removes_the_labs_namespaces_links_and_processes(tmp_path, signum):
    why = netns.can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces: {why}")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAB_UNTIL_SIGNALLED, str(tmp_path / "lab")],
        cwd=netns.REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    tag, *pids = proc.stdout.readline().split()
    assert tag.startswith(netns.PREFIX) and any(ns.startswith(tag) for ns in netns.lab_namespaces())
    assert len(pids) >= 3  # the host's sleep and the two hosts' delay relays
    proc.send_signal(signum)
    assert proc.wait(timeout=60) != 0
    assert [ns for ns in netns.lab_namespaces() if ns.startswith(tag + "-")] == []
    assert [pid for pid in pids if netns.pid_alive(int(pid))] == []


def test_each_host_runs_on_its_own_cores_and_the_links_relays_on_any(tmp_path):
    """Separate machines do not share cores: a host's processes run on its share of this machine's
    (taskset), so its ranks size their threads to that share (pipeline.train.distributed's
    available_cores) and never oversubscribe the cores another host trains on."""
    why = netns.can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces: {why}")
    every = os.sched_getaffinity(0)
    with netns.Lab(2, netns.LinkShape(50, 40), tmp_path / "lab", store_ports=(9000,)) as lab:
        shares = [lab.host_cores(i) for i in range(2)]
        sleeps = [lab.spawn(lab.hosts[i], ["sleep", "60"], tmp_path / f"sleep-{i}.log") for i in range(2)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep" for p in sleeps
        ):
            time.sleep(0.05)  # until `ip netns exec`, unshare, sh and taskset have exec'd into sleep
        seen = [os.sched_getaffinity(p.pid) for p in sleeps]
        relays = [os.sched_getaffinity(p.pid) for p in lab.relays.values()]  # none where sch_netem delays
    assert seen == [set(share) for share in shares]
    if len(every) >= 2:
        assert not seen[0] & seen[1]  # no core of host 0's is host 1's
    assert all(found == every for found in relays)


def test_hosts_share_the_cores_out_in_turn(monkeypatch, tmp_path):
    lab = netns.Lab(3, netns.LinkShape(None, None), tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert [lab.host_cores(i) for i in range(3)] == [[0], [1], [0]]  # more hosts than cores: 0 and 2 share
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert [lab.host_cores(i) for i in range(3)] == [[0], [1], [2]]
    lab = netns.Lab(2, netns.LinkShape(None, None), tmp_path)
    assert [lab.host_cores(i) for i in range(2)] == [[0, 1], [2, 3]]


def test_without_root_it_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert hosts.main(["--hosts", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "root" in err


def test_the_predicted_bytes_count_no_download_of_what_the_island_wrote_or_read_before():
    """What a host's link should carry: an island that trains its path again reads neither the inner
    state it wrote nor the shard it read (pipeline.state.store.RecentFiles); another island reads both."""
    mb = 1 << 20
    sizes = {
        "shards/path=p0/part-0.parquet": 2 * mb,
        "rounds/round=0/modules/level=0/module=0.safetensors": 4 * mb,
        "rounds/round=1/modules/level=0/module=0.safetensors": 4 * mb,
        "rounds/round=0/paths/path=p0/model.safetensors": 4 * mb,
        "rounds/round=1/paths/path=p0/model.safetensors": 4 * mb,
        "rounds/round=1/inner/path=p0/attempt-1/optimizer-rank-00000.safetensors": 8 * mb,
    }

    def summary(second: str) -> dict:
        attempts = [
            {"task": "train.r0.p0", "island": "h1-island-0", "state": "done", "claimed_at": 1.0},
            {"task": "commit.r0", "island": "h1-island-0", "state": "done", "claimed_at": 1.5, "seconds": 0.1},
            {"task": "train.r1.p0", "island": second, "state": "done", "claimed_at": 2.0},
        ]
        return {"sizes": sizes, "attempts": attempts, "rounds": {}}

    same = hosts.predicted_bytes(summary("h1-island-0"), [1], 2)
    other = hosts.predicted_bytes(summary("island-0"), [1], 2)
    assert same[0][1] == {"up": 12 * mb, "down": 6 * mb}  # weights and inner state up; shard and modules down
    assert same[1][1] == {"up": 12 * mb, "down": 4 * mb}  # the new modules only
    assert other[1][0] == {"up": 12 * mb, "down": 14 * mb}  # modules, shard and the inner state, on host 0


def test_the_predicted_bytes_of_a_merge_are_the_runs_of_its_modules_level_of_a_peers_weights():
    """A merge of the module two paths share reads of the other island's path only that level's
    byte runs (pipeline/state/module_store.py); of its own path, held whole, nothing; and a peer read
    named by its runs counts their bytes."""
    mb = 1 << 20
    weights = {job: f"rounds/round=0/paths/path={job}/model.safetensors" for job in ("p0-0", "p1-0")}
    sizes = {name: 8 * mb for name in weights.values()}
    runs = {
        name: [[f"{name}#0-{4 * mb}"], [f"{name}#0-{1 * mb}", f"{name}#{5 * mb}-{8 * mb}"]] for name in weights.values()
    }

    def summary(by_level: bool, peer_reads: list[str] | None = None) -> dict:
        attempts = [
            {"task": "train.r0.p0-0", "island": "island-0", "state": "done", "claimed_at": 1.0},
            {"task": "train.r0.p1-0", "island": "h1-island-0", "state": "done", "claimed_at": 1.0},
            {"task": "merge.r0.l1m0", "island": "island-0", "state": "done", "claimed_at": 2.0},
        ]
        if peer_reads is not None:
            attempts[0]["peer_reads"] = peer_reads
        return {"sizes": sizes, "attempts": attempts, "rounds": {}, **({"level_runs": runs} if by_level else {})}

    whole, by_level = (hosts.predicted_bytes(summary(flag), [2, 1], 2)[0][0] for flag in (False, True))
    assert by_level["up"] == whole["up"] == 8 * mb  # its weights go up once, whole (runs are no objects)
    whole, by_level = whole["down"], by_level["down"]
    assert whole - by_level == 4 * mb  # 8 MB of p1-0's weights, against its level-1 runs' 1 + 3 MB
    read_first = hosts.predicted_bytes(summary(True, runs[weights["p1-0"]][1]), [2, 1], 2)[0][0]["down"]
    assert read_first == by_level  # the peer read brought them down once; the merge reads them from memory


def test_the_cpu_meter_counts_a_groups_processes_and_keeps_what_an_exited_one_used():
    """The lab's store, relays and hosts share this machine's cores: the benchmark's per-round CPU
    seconds tell whether the store slowed the islands' training. A process that exits keeps what it
    used up to its last reading."""
    burner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\ntime.sleep(30)",
        ]
    )
    meter = netns.CpuMeter()
    try:
        deadline = time.monotonic() + 20
        used = 0.0
        while used < 0.35 and time.monotonic() < deadline:
            used = meter.read({"store": [burner.pid], "relays": []})["store"]
            time.sleep(0.1)
        assert 0.35 <= used < 2.0, used
    finally:
        burner.kill()
        burner.wait()
    after = meter.read({"store": [burner.pid], "relays": [], "h0": [burner.pid + 10**7]})
    assert after == {"store": used, "relays": 0, "h0": 0}


def test_the_labs_store_proxy_never_forwards_a_put_whose_client_went_away_mid_body():
    """A host killed mid-upload left its PUT cut off; the proxy forwarded the part it had read as a
    whole request, and moto stored an empty lease record under the client's checksum header: every
    later read of it failed (FlexibleChecksumError), which S3 itself never does. A whole PUT still
    goes through."""
    import http.server
    import socket
    import threading

    received: list[tuple[str, bytes]] = []

    class Upstream(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.throttleproxy", "--listen", f"127.0.0.1:{port}"]
        + ["--upstream", f"127.0.0.1:{upstream.server_address[1]}"],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as cut:
            cut.sendall(b"PUT /bucket/cut HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as whole:
            whole.sendall(b"PUT /bucket/whole HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            assert whole.recv(100).startswith(b"HTTP/1.1 200")
        assert received == [("/bucket/whole", b"hello")]
    finally:
        proxy.terminate()
        proxy.wait(10)
        upstream.shutdown()


def test_a_bracketed_reference_pools_both_one_host_runs_so_the_machines_drift_cancels():
    """With --bracket the one-host run runs before and after the runs across the hosts, and goodput
    is against both together: a hosts run exactly as long as their mean reads 1.00, where against
    the first alone (the machine 10 % slower by the second) it read 0.95."""

    def run(name: str, span: float, round_0_end: float, tokens: int = 1000) -> dict:
        attempts = [{"task": "train.r0.p0", "claimed_at": 100.0}]
        rounds = {"0": {"ended_at": 100.0 + round_0_end, "committed_at": 101.0 + round_0_end}}
        rounds["1"] = {"committed_at": 100.0 + span}
        return {"run": name, "summary": {"tokens": tokens, "attempts": attempts, "rounds": rounds}}

    before, after = run(hosts.ONE_HOST, 100.0, 20.0), run(hosts.ONE_HOST_AFTER, 110.0, 22.0)
    across = run("fault-free", 105.0, 21.0)
    assert hosts.goodput(across) / hosts.reference_goodput([before, across]) == pytest.approx(100 / 105)
    assert hosts.goodput(across) / hosts.reference_goodput([before, across, after]) == pytest.approx(1.0)
    assert hosts.goodput_past_round_0(across, [before, after]) == "1.00"  # (80 + 88) / 2 over 84
    assert hosts.goodput_past_round_0(across, [before]) == "0.95"
    fewer = run("faults", 105.0, 21.0, tokens=900)  # a run that committed less: no comparison past round 0
    assert hosts.goodput_past_round_0(fewer, [before, after]) == "-"
    references = [r["run"] for r in [before, across, after] if hosts.is_reference(r)]
    assert references == [hosts.ONE_HOST, hosts.ONE_HOST_AFTER]
