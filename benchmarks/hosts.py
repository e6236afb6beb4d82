"""`python -m benchmarks.hosts`: islands on separate hosts over slow links, with faults.

Root only (without root, or where `ip netns add` fails, it says so in one line and exits 2). It
makes a lab (benchmarks/netns.py): a store namespace and `--hosts` host namespaces on a bridge,
each host's link shaped to `--rate-mbit` each way and `--rtt-ms` round trip (50 Mbit/s and 40 ms
by default; `--unshaped` for neither). The store namespace runs moto's S3 server behind a proxy
that can answer 503 SlowDown (benchmarks/throttleproxy.py) and an MLflow server; every host has
its own directory (working directory, TMPDIR, HOME, caches) and runs in a mount namespace where the
other hosts' and the store's directories are empty, and the benchmark checks, while the run goes,
that no process of a host has a working directory, an open file or a TMPDIR in anything but its
own (`/proc/<pid>/cwd`, `/proc/<pid>/fd`, `/proc/<pid>/environ`). Nor the cores: a host's
processes run on its own share of this machine's (netns.Lab.host_cores), and its islands size their
ranks' threads to that share, as on a machine of their own.

The run: host 0 runs `dipaco run --config C` (prepare, plan, its islands, the rounds' reports to
MLflow), every other host `dipaco island --config C --name h<i>-<k> --wait S` at the same time,
all on one `s3://` run root (`storage.options.endpoint_url` = the store, AWS_* variables for the
credentials). `benchmarks.hosts_watch`, in the store's namespace, follows the queue. A host's
island process that exits with an error is started again, as a service manager would (counted).

Runs, in order: the same config on one host with a local root (`dipaco run`, as many islands as
the hosts have together: the goodput reference and the bitwise reference), then across the hosts
without faults, then (unless `--no-faults`) with faults: the first host but host 0 (which runs
`dipaco run`) seen holding a train task partitioned (link down) for `--partition-leases` x the
lease, then reconnected; the store throttled (503 SlowDown) for `--throttle-s` seconds; another
host but host 0 (of three or more) killed for good once it holds a train task. Per round it
prints each host's bytes up and down (its link's interface counters), the islands' training
seconds against their load/commit seconds (what the transfers cost them), utilisation, the CPU
seconds of the lab's store, relays and hosts (which share this machine's cores), and goodput
against the one-host run (whole, and past round 0); the store's proxy keeps every request
(benchmarks/out/hosts/requests.jsonl); last, whether each run's final modules and momentum are
bitwise equal to the one-host run's. With `--bracket` the one-host run runs again last, and goodput
is against both: this machine's speed drifts by up to 10 % within an hour, more than the target's margin.

`--store local` is a stand-in for machines whose pipeline has no object-store run roots yet: the
run root is a directory every host sees (so not "no shared filesystem"), a partition also freezes
the host's processes, and there is no throttling. Written to benchmarks/out/hosts/ (results.json,
results.md); `--commit` puts the table into benchmarks/RESULTS.md between its `hosts` markers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from benchmarks import netns
from benchmarks.netns import STORE_IP, Lab, LinkShape

log = logging.getLogger("dipaco.bench.hosts")
REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out" / "hosts"
S3_PORT, MOTO_PORT, MLFLOW_PORT = 9000, 9001, 5000  # the proxy hosts use, moto behind it, MLflow
BUCKET = "dipaco-hosts"
# moto's documented dummy credentials: the benchmark's store is moto, nothing else ever sees them
DUMMY_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
POLL_S = 1.0  # how often the watcher looks at the store and the counters are read
PARTITION_MAX_S = 180.0  # a partition ends by then even when no island was free to take the host's tasks over
MAX_RESTARTS = 6  # a host's island process started again at most this many times in a run
# The store's processes (moto, its proxy, MLflow) and the watcher run at this nice value: they stand
# for machines that are not the hosts', yet take their CPU from the same cores as the hosts'
# training (6.5-10 CPU s a round on 2 cores, and the hosts' inner loops ran up to 28 % longer than
# the one-host run's). Lowered, the hosts' training comes first, as on machines of their own, and
# the store still has the cores whenever the hosts wait on it (a round's hand-over). `--store-nice 0`
# puts them level again. The links' delay relays keep the hosts' priority: they are the wire, and a
# relay that waits for a core adds to the link's delay.
STORE_NICE = 10
ONE_HOST, ONE_HOST_AFTER = "one-host", "one-host-after"  # the reference run's names (and directories)


@dataclass
class Spec:
    """One benchmark's settings (the flags)."""

    config: str = "configs/tiny.yaml"
    overrides: list[str] = field(default_factory=list)
    hosts: int = 3
    islands_per_host: int = 1
    shape: LinkShape = field(default_factory=LinkShape)
    store: str = "s3"  # or "local" (module docstring)
    lease_seconds: float = 6.0
    partition_leases: float = 3.0
    throttle_s: float = 10.0
    timeout_s: float = 1200.0
    store_python: str = sys.executable  # moto's interpreter (it need not be the pipeline's)
    mlflow: bool = True  # an MLflow server in the store namespace, which host 0's `dipaco run` reports to
    store_nice: int = STORE_NICE  # the store's processes' and the watcher's nice value
    compile_cache: Path | None = None  # one inductor cache per host under it, kept: compile_env
    bracket: bool = False  # the one-host run again after the runs across the hosts (ONE_HOST_AFTER)


# -- the configs ------------------------------------------------------------------------------------


def base_overrides(spec: Spec) -> list[str]:
    """What every run of the benchmark sets: absolute data paths (hosts work in their own
    directories), the lease, threads, and the flags' overrides. The threads: each island would
    take all of its host's cores (pipeline.train.distributed.rank_threads), but the lab's hosts
    share this machine's, and OpenMP threads oversubscribed on a small machine made every step
    10-100x slower; so every island, on a host or in the one-host run, gets its share."""
    threads = max(1, (os.cpu_count() or 1) // (spec.hosts * spec.islands_per_host))
    return [
        *absolute_data(spec),
        "train.launcher=deepspeed",
        f"train.lease_seconds={spec.lease_seconds}",
        f"train.threads_per_proc={threads}",
        *spec.overrides,
    ]


def absolute_data(spec: Spec) -> list[str]:
    """The config's own corpus (the tiny config's test C4, the demo's Wikipedia sample), its
    relative patterns made absolute: hosts work in their own directories, not the checkout."""
    data = (yaml.safe_load((REPO / spec.config).read_text()) or {}).get("data", {})
    return [
        f"data.{key}={pattern if os.path.isabs(pattern) else REPO / pattern}"
        for key in ("train", "eval")
        if isinstance(pattern := data.get(key), str)
    ]


def s3_overrides(run: str, endpoint: str, mlflow: bool = True) -> list[str]:
    tracking = [f"mlflow.tracking_uri=http://{STORE_IP}:{MLFLOW_PORT}", f"mlflow.experiment=hosts-{run}"]
    return [
        f"run_root=s3://{BUCKET}/{run}",
        f"storage.options.endpoint_url={endpoint}",
        f"mlflow.enabled={str(mlflow).lower()}",
        *(tracking if mlflow else []),
    ]


def set_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def dipaco(command: str, spec: Spec, overrides: list[str], *extra: str) -> list[str]:
    head = [sys.executable, "-m", "pipeline.cli", command, "--config", str(REPO / spec.config)]
    return head + set_args(overrides) + list(extra)


def host_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A host's environment: its own HOME, TMPDIR and caches; the code and the venv are the
    installed software every host has."""
    keep = ("PATH", "LANG", "LC_ALL", "TORCH_EXTENSIONS_DIR", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env | {
        "PYTHONPATH": str(REPO),
        "HOME": str(home),
        "TMPDIR": str(home / "tmp"),
        "DIPACO_CACHE_DIR": str(home / "cache"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "MPLCONFIGDIR": str(home / "cache" / "matplotlib"),
        "HF_HOME": str(home / "cache" / "huggingface"),
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "TOKENIZERS_PARALLELISM": "false",
        **(extra or {}),
    }


# -- the store ----------------------------------------------------------------------------------------


class Store:
    """moto's S3 server (MOTO_PORT) behind the throttling proxy (S3_PORT) and an MLflow server,
    in the lab's store namespace."""

    def __init__(self, lab: Lab, spec: Spec):
        self.lab, self.spec = lab, spec
        self.dir = lab.store_dir()
        self.proxy: subprocess.Popen | None = None

    def start(self) -> None:
        lab, env = self.lab, host_env(self.dir)
        sys.path.insert(0, str(REPO / "tests"))  # moto's server and settings as the tests have them
        from s3_endpoint import MOTO_S3, MOTO_SETTINGS

        moto = [self.spec.store_python, str(MOTO_S3), "-H", "0.0.0.0", "-p", str(MOTO_PORT)]
        nice = self.spec.store_nice

        lab.spawn(lab.store, moto, self.dir / "moto.log", env=env | MOTO_SETTINGS, cwd=self.dir, nice=nice)
        self.proxy = lab.spawn(
            lab.store,
            [sys.executable, "-m", "benchmarks.throttleproxy", "--listen", f"0.0.0.0:{S3_PORT}"]
            + ["--upstream", f"127.0.0.1:{MOTO_PORT}", "--trace", str(self.dir / "requests.jsonl")],
            self.dir / "proxy.log",
            env=env,
            cwd=self.dir,
            nice=nice,
        )
        self.wait_http(f"http://127.0.0.1:{MOTO_PORT}/", "moto")
        self.make_bucket()
        if not self.spec.mlflow:
            return
        mlflow = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "0.0.0.0", "--port"]
        mlflow += [str(MLFLOW_PORT), "--workers", "1", "--backend-store-uri", f"sqlite:///{self.dir}/mlflow.db"]
        mlflow += ["--serve-artifacts", "--artifacts-destination", str(self.dir / "mlartifacts")]
        mlflow += ["--allowed-hosts", f"{STORE_IP}:{MLFLOW_PORT},{STORE_IP},localhost:{MLFLOW_PORT}"]
        env |= {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        lab.spawn(lab.store, mlflow, self.dir / "mlflow.log", env=env, nice=nice)
        self.wait_http(f"http://127.0.0.1:{MLFLOW_PORT}/health", "MLflow", timeout_s=120)

    def make_bucket(self) -> None:
        lab = self.lab
        done = lab.run_in(lab.store, ["curl", "-sf", "-X", "PUT", f"http://127.0.0.1:{MOTO_PORT}/{BUCKET}"], timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"cannot create bucket {BUCKET} on moto: {done.stderr.strip()}")

    def wait_http(self, url: str, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.lab.run_in(self.lab.store, ["curl", "-sf", "-o", "/dev/null", url], timeout=10).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{what} did not answer {url} in {timeout_s:.0f} s (logs in {self.dir})")

    def throttle(self, on: bool) -> None:
        if self.proxy is not None:
            os.kill(self.proxy.pid, signal.SIGUSR1 if on else signal.SIGUSR2)


# -- one run across the hosts ------------------------------------------------------------------------


@dataclass
class HostRun:
    """One run across the lab's hosts: what it needs to know while it goes."""

    name: str
    overrides: list[str]
    watch_overrides: list[str]  # the same config, the store reached over the store's loopback
    faults: bool
    events: list[dict] = field(default_factory=list)
    samples: list[tuple[float, list[tuple[int, int]]]] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    cpu: netns.CpuMeter = field(default_factory=netns.CpuMeter)


class Faults:
    """The fault schedule of a run, one step at a time: partition the first host but host 0 seen
    training, then reconnect; throttle the store; kill another host but host 0 once it trains a
    task the partition did not cut off (three or more hosts). Whichever trains first is cut off:
    with three hosts and two paths a round, a fixed host could wait minutes for a task (a
    demo-size run cut host 1 off on the fallback timer while it held none, so nothing was taken
    over)."""

    def __init__(self, lab: Lab, store: Store | None, spec: Spec, run: HostRun, procs: dict):
        self.lab, self.store, self.spec, self.run, self.procs = lab, store, spec, run, procs
        self.steps = ["partition", "reconnect"]
        if store is not None and spec.store == "s3" and spec.throttle_s > 0:
            self.steps += ["throttle", "unthrottle"]
        if lab.n_hosts >= 3:
            self.steps += ["kill"]
        self.since = time.monotonic()
        self.killed: set[int] = set()
        self.frozen: set[int] = set()
        self.cut = 1  # the host partitioned (or to be): the first of hosts 1.. seen training

    def trains(self, host: int, line: dict, spared: frozenset[str] = frozenset()) -> bool:
        """Whether `host` holds a train task now (one not in `spared`)."""
        held = line.get("held", {}).items()
        return any(island_host(name) == host and set(tasks) - spared for name, tasks in held)

    def training(self, line: dict, hosts: list[int], spared: frozenset[str] = frozenset()) -> int | None:
        """The first of `hosts` that holds a train task now (one not in `spared`), or None."""
        return next((host for host in hosts if self.trains(host, line, spared)), None)

    def cut_off_tasks(self) -> frozenset[str]:
        """The train tasks the partition cut off: the kill spares a host while it holds one of them
        (their takeover), since two faults on one task spend train.max_attempts (2 by default) and
        the round then merges without that path, by design (a demo-size run did just that)."""
        partition = next((e for e in self.run.events if e["fault"] == "partition"), None)
        held = partition["held"].items() if partition else ()
        return frozenset(t for island, tasks in held if island_host(island) == self.cut for t in tasks)

    def kill_candidates(self) -> list[int]:
        return [host for host in range(1, self.lab.n_hosts) if host != self.cut]

    def step(self, line: dict, elapsed: float) -> None:
        if not self.steps:
            return
        what, waited = self.steps[0], time.monotonic() - self.since
        if what in ("partition", "kill") and not line.get("held"):  # they hit a host while islands train
            return
        lease, host = self.spec.lease_seconds, None
        training = self.training(line, list(range(1, self.lab.n_hosts))) if what == "partition" else None
        if what == "partition" and (training is not None or waited > 120):
            self.cut = host = 1 if training is None else training
            self.lab.partition(self.cut)
            if self.spec.store == "local":  # a shared directory is no network: freeze the host too
                self._signal_host(self.cut, signal.SIGSTOP)
                self.frozen.add(self.cut)
        elif what == "reconnect" and waited >= self.spec.partition_leases * lease and self.taken_over(self.cut, line):
            self.lab.reconnect(host := self.cut)
            if self.cut in self.frozen:
                self._signal_host(self.cut, signal.SIGCONT)
                self.frozen.discard(self.cut)
        elif what == "throttle" and waited >= 2 * lease:
            self.store.throttle(True)
        elif what == "unthrottle" and waited >= self.spec.throttle_s:
            self.store.throttle(False)
        elif what == "kill" and (
            (chosen := self.training(line, self.kill_candidates(), self.cut_off_tasks())) is not None or waited > 120
        ):
            host = chosen or self.kill_candidates()[-1]
            self.killed.add(host)
            self.lab.kill_host(host)
            self.lab.partition(host)  # its link goes with it: nothing of it comes back
        else:
            return
        self.steps.pop(0)
        self.since = time.monotonic()
        self.run.events.append(
            {"fault": what, "at_s": round(elapsed, 1), "held": line.get("held", {}), **({"host": host} if host else {})}
        )
        log.info("%s: t=%.0f s: %s%s", self.run.name, elapsed, what, f" host {host}" if host else "")

    def taken_over(self, host: int, line: dict) -> bool:
        """Every train task `host` held when it was cut off has a newer attempt by another island
        (or its round committed); or the partition has lasted PARTITION_MAX_S, which ends it anyway."""
        if time.monotonic() - self.since >= PARTITION_MAX_S:
            return True
        cut_off = [
            t for island, tasks in self.run.events[-1]["held"].items() if island_host(island) == host for t in tasks
        ]
        newest = line.get("newest", {})
        return all(task not in newest or island_host(newest[task][0]) != host for task in cut_off)

    def _signal_host(self, host: int, sig: int) -> None:
        for pid in self.lab.pids(self.lab.hosts[host]):
            if pid not in {p.pid for p in self.lab.relays.values()}:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        """Undo what is still in force (a run that ended or failed mid-fault)."""
        if self.steps[:1] == ["reconnect"]:  # the run finished while a host was cut off
            self.lab.reconnect(self.cut)
            self.run.events.append({"fault": "reconnect", "at_s": None, "held": {}, "after_the_run": True})
        for host in list(self.frozen):
            self._signal_host(host, signal.SIGCONT)
        if self.store is not None:
            self.store.throttle(False)


def fault_name(event: dict) -> str:
    """`partition host 2`: a fault event and the host it hit, where it names one."""
    return f"{event['fault']} host {event['host']}" if "host" in event else event["fault"]


def island_host(name: str) -> int:
    """The host an island runs on: `h<i>-<k>` joiners; host 0's `dipaco run` names its `island-<k>`."""
    head = name.split("-")[0]
    return int(head[1:]) if head.startswith("h") and head[1:].isdigit() else 0


def watch(
    lab: Lab, spec: Spec, overrides: list[str], timeout_s: float, faults: bool = True
) -> tuple[subprocess.Popen, queue.Queue]:
    """benchmarks.hosts_watch in the store's namespace; its JSON lines arrive on the queue. Without
    `faults` nothing needs the leases past the first claim, so it stops reading them then."""
    argv = ["ip", "netns", "exec", lab.store, "nice", "-n", str(spec.store_nice), sys.executable]
    argv += ["-m", "benchmarks.hosts_watch"]
    argv += ["--config", str(REPO / spec.config), *set_args(overrides), "--interval", str(POLL_S)]
    argv += ["--timeout", str(timeout_s), "--leases", "always" if faults else "until-held"]
    env = host_env(lab.store_dir() / "watch", DUMMY_AWS)
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(lab.store_dir() / "watch.log", "ab"), text=True
    )
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for text in proc.stdout:
            try:
                lines.put(json.loads(text))
            except json.JSONDecodeError:
                pass
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def isolation_violations(lab: Lab) -> list[str]:
    """Each process of a host whose working directory, open files or TMPDIR lie in another lab
    member's directory (another host's disk, the store's)."""
    found = []
    private = lab.private_dirs()
    relays = {p.pid for p in lab.relays.values()}
    for ns in lab.hosts:
        others = [str(d) + "/" for member, d in private.items() if member != ns]
        own = str(private[ns]) + "/"
        for pid in lab.pids(ns):
            if pid in relays:
                continue
            try:
                paths = [os.readlink(f"/proc/{pid}/cwd")]
                paths += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # it exited while we looked
                continue
            tmp = [e.decode(errors="replace")[7:] for e in environ if e.startswith(b"TMPDIR=")]
            for path in paths:
                if any((path + "/").startswith(o) for o in others):
                    found.append(f"{ns} pid {pid}: {path}")
            if tmp and not (tmp[0] + "/").startswith(own):
                found.append(f"{ns} pid {pid}: TMPDIR={tmp[0]}")
    return found


def run_across_hosts(lab: Lab, store: Store | None, spec: Spec, run: HostRun) -> dict:
    """One run on the lab's hosts (module docstring); its summary (hosts_watch's) and timings."""
    procs: dict[str, tuple[int, subprocess.Popen, list[str]]] = {}
    logs = lab.base / "logs" / run.name

    def start(host: int, key: str, argv: list[str]) -> None:
        home = lab.host_dir(host)
        env = lab_host_env(lab, spec, host)
        procs[key] = (host, lab.spawn(lab.hosts[host], argv, logs / f"{key}.log", env=env, cwd=home), argv)

    watcher, lines = watch(lab, spec, run.watch_overrides, spec.timeout_s, run.faults)
    lab.observers.add(watcher.pid)  # its CPU is counted apart from the store's
    started = time.monotonic()
    # train.islands: the islands on each host, whose ranks share its cores (docs/operations.md)
    host_overrides = [*run.overrides, f"train.islands={spec.islands_per_host}"]
    start(0, "h0-driver", dipaco("run", spec, host_overrides))
    # every other host's islands start with it and wait for the plan (`dipaco island --wait`), as a
    # host's service would: their ranks start within a poll of the plan. Started once the lab saw
    # the plan, they began compiling 7 s after host 0's island (3 s with the wait), and round 0
    # waited for them.
    for host in range(1, lab.n_hosts):
        for k in range(spec.islands_per_host):
            wait = ("--wait", f"{spec.timeout_s:g}")
            start(host, f"h{host}-{k}", dipaco("island", spec, host_overrides, "--name", f"h{host}-{k}", *wait))
    faults = Faults(lab, store, spec, run, procs) if run.faults else None
    finished, first_claim = None, None
    try:
        while True:
            try:
                line = lines.get(timeout=30)
            except queue.Empty:
                line = {}
            if line is None:
                raise RuntimeError(f"{run.name}: the store watcher stopped (log: {lab.store_dir() / 'watch.log'})")
            if "summary" in line:
                break
            now = time.monotonic() - started
            if now > spec.timeout_s:
                raise TimeoutError(f"{run.name}: not finished after {spec.timeout_s:.0f} s (logs in {logs})")
            run.samples.append(sample(lab, run.cpu))
            if "error" in line:
                continue
            if line.get("held") and first_claim is None:
                first_claim = time.time()
            if faults is not None:
                faults.step(line, now)
            restart_failed(lab, spec, procs, run, faults)
            if len(run.samples) % 5 == 0:
                run.violations += isolation_violations(lab)
            if line.get("finished") and finished is None:
                finished = time.monotonic() - started
        driver = procs["h0-driver"][1]
        driver.wait(timeout=180)  # it reports the last round and prints the summary
        wall = time.monotonic() - started
        run.samples.append(sample(lab, run.cpu))  # the last rounds' registrations (host 0) count too
    finally:
        if faults is not None:
            faults.close()
        for host, proc, _ in procs.values():
            stop_process(proc)
        stop_process(watcher)
    if driver.returncode != 0:
        raise RuntimeError(
            f"{run.name}: `dipaco run` on host 0 exited {driver.returncode} (log: {logs / 'h0-driver.log'})"
        )
    return {
        "run": run.name,
        "wall_s": round(wall, 1),
        "finished_s": round(finished or wall, 1),
        "first_claim": first_claim,
        "summary": line["summary"],
        "samples": run.samples,
        "events": run.events,
        "restarts": run.restarts,
        "violations": sorted(set(run.violations)),
        "killed": sorted(faults.killed) if faults else [],
        "faults_not_reached": list(faults.steps) if faults else [],
    }


def sample(lab: Lab, cpu: netns.CpuMeter) -> tuple:
    """Now, each host's link counters (up, down), each host's relay's {port: [up, down]}, and the
    CPU seconds used so far by each group of the lab's processes (Lab.cpu_groups)."""
    return (
        time.time(),
        [lab.counters(i) for i in range(lab.n_hosts)],
        [{str(port): list(c) for port, c in lab.port_counters(i).items()} for i in range(lab.n_hosts)],
        cpu.read(lab.cpu_groups()),
    )


def restart_failed(lab: Lab, spec: Spec, procs: dict, run: HostRun, faults: Faults | None) -> None:
    """A host's island process that exited with an error starts again (a service manager's
    restart), unless its host was killed for good, is partitioned now, or has restarted too often."""
    for key, (host, proc, argv) in list(procs.items()):
        code = proc.poll()
        if code in (None, 0) or key == "h0-driver":
            continue
        if faults is not None and (host in faults.killed or (faults.steps[:1] == ["reconnect"] and host == faults.cut)):
            continue
        if run.restarts.get(key, 0) >= MAX_RESTARTS:
            continue
        run.restarts[key] = run.restarts.get(key, 0) + 1
        log.info("%s: %s exited %s: starting it again (%d)", run.name, key, code, run.restarts[key])
        home = lab.host_dir(host)
        env = lab_host_env(lab, spec, host)
        logs = lab.base / "logs" / run.name
        procs[key] = (
            host,
            lab.spawn(lab.hosts[host], argv, logs / f"{key}.{run.restarts[key]}.log", env=env, cwd=home),
            argv,
        )


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


# -- the one-host reference ---------------------------------------------------------------------------


def resolved_choices(summary: dict) -> list[str]:
    """`train.precision` and `train.compile` as the one-host run resolved them, as overrides. Both
    are measured on each host when `auto` (a few timed steps, cached per host), and on this busy
    machine the lab's hosts can measure differently from the one-host run (bf16 0.42 against fp32
    0.48 s a step once): a host that picked otherwise trains other numbers, and the bitwise
    comparison would compare those choices, not the runs. A real deployment's hosts may choose
    differently; its islands then agree on nothing bitwise either."""
    paths = [p for r in summary["rounds"].values() for p in r.get("paths", {}).values() if p.get("precision")]
    if not paths:
        return []
    return [f"train.precision={paths[0]['precision']}", f"train.compile={str(bool(paths[0]['compiled'])).lower()}"]


def compile_env(spec: Spec, member: str) -> dict[str, str]:
    """Where a host (`h<i>`, or ONE_HOST and ONE_HOST_AFTER) keeps torch.compile's kernels. By default inductor's
    own place, the host's TMPDIR, new each invocation: every host compiles the path's forward for
    the first time. Then the one-host run's islands share one cache and one host compiles less
    (two cold compiles at once on 2 cores: 25.7 s sharing one, 34.9 s each on its own; 2.9 s warm).
    With `--compile-cache DIR` each host has its own cache under DIR, kept between invocations,
    as a fleet's hosts that trained this model before have: fill it once, then measure."""
    if spec.compile_cache is None:
        return {}
    cache = spec.compile_cache / member
    cache.mkdir(parents=True, exist_ok=True)
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache)}


def lab_host_env(lab: Lab, spec: Spec, host: int) -> dict[str, str]:
    """The environment of a process on lab host `host` (started, or started again): its own
    directories, the store's credentials, its compile cache."""
    return host_env(lab.host_dir(host), (DUMMY_AWS if spec.store == "s3" else {}) | compile_env(spec, f"h{host}"))


def compile_caches_warm(spec: Spec) -> dict[str, bool] | None:
    """Which hosts' kept compile caches hold kernels already (None: none are kept)."""
    if spec.compile_cache is None:
        return None
    if not spec.compile_cache.is_dir():
        return {}
    return {d.name: any(d.iterdir()) for d in sorted(spec.compile_cache.iterdir()) if d.is_dir()}


def compile_caches_said(caches: dict | None) -> str:
    """The report's words for where the runs found torch.compile's kernels."""
    if not caches:
        return "Compile caches: each host's TMPDIR, new (every host compiles for the first time)."
    warm = [name for name, full in caches["warm"].items() if full]
    return (
        f"Compile caches: one per host in {caches['dir']}, kept between invocations; "
        f"{'warm for ' + ', '.join(warm) if warm else 'all new'} at the start."
    )


def run_one_host(spec: Spec, base: Path, islands: int, name: str = ONE_HOST) -> dict:
    """The same config on this machine with a local root and `islands` islands: the reference
    (`name`: ONE_HOST, or ONE_HOST_AFTER for its second run with --bracket)."""
    root = base / name / "root"
    overrides = [*base_overrides(spec), f"run_root={root}", f"train.islands={islands}"]
    overrides.append(f"mlflow.enabled={str(spec.store == 's3' and spec.mlflow).lower()}")
    home = base / name / "home"
    env = host_env(home, compile_env(spec, name))
    log_path = base / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "wb") as out:  # its own session: an interrupt here stops its islands too
        proc = subprocess.Popen(
            dipaco("run", spec, overrides),
            cwd=home,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=spec.timeout_s)
    finally:
        stop_process(proc, grace_s=30.0)  # SIGTERM: `dipaco run` stops the islands it started
    wall = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"{name} run: `dipaco run` exited {code} (log: {log_path})")
    argv = [sys.executable, "-m", "benchmarks.hosts_watch", "--config", str(REPO / spec.config), *set_args(overrides)]
    out = subprocess.run([*argv, "--summary-only"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    return {"run": name, "wall_s": round(wall, 1), "finished_s": round(wall, 1), "summary": summary}


# -- figures -------------------------------------------------------------------------------------------


def train_span(result: dict) -> float:
    """Seconds from the first train claim to the last round's commit: the training phase."""
    s = result["summary"]
    claims = [a["claimed_at"] for a in s["attempts"] if a["task"].startswith("train.") and a.get("claimed_at")]
    end = max(r["committed_at"] for r in s["rounds"].values())
    return end - min(claims)


def goodput(result: dict) -> float:
    return result["summary"]["tokens"] / train_span(result)


def is_reference(result: dict) -> bool:
    return result["run"] in (ONE_HOST, ONE_HOST_AFTER)


def reference_goodput(results: list[dict]) -> float:
    """Tokens a second of the one-host runs, pooled: the first one's alone, or with --bracket the
    first's and the second's together, which take the machine's drift between them out of the
    comparison (the same code and caches read 0.80 and 0.86 an hour apart, the one-host run's train
    seconds 155.6 and 171.1)."""
    refs = [r for r in results if is_reference(r)]
    return sum(r["summary"]["tokens"] for r in refs) / sum(train_span(r) for r in refs)


def span_past_round_0(result: dict) -> float | None:
    """Seconds from round 0's end (its last merge) to the last round's commit: the training phase
    without round 0, whose first compile (train.compile) every host pays with its own cache, and
    which the lab's hosts pay on one machine's shared cores at once (none with a single round)."""
    rounds = result["summary"]["rounds"]
    if len(rounds) < 2:
        return None
    first = rounds[min(rounds, key=int)]
    return max(r["committed_at"] for r in rounds.values()) - first.get("ended_at", first["committed_at"])


def goodput_past_round_0(result: dict, refs: list[dict]) -> str:
    """The one-host runs' mean seconds past round 0 over this run's, where they committed the same
    tokens (a fault-free run); "-" otherwise."""
    mine, theirs = span_past_round_0(result), [span_past_round_0(ref) for ref in refs]
    if mine is None or None in theirs or any(result["summary"]["tokens"] != r["summary"]["tokens"] for r in refs):
        return "-"
    return f"{sum(theirs) / len(theirs) / mine:.2f}"


def counters_at(samples: list, t: float, which: int = 1) -> list:
    """The counters of the sample nearest before t (the first one when t precedes them all):
    `which` 1, each host's link (up, down); 2, each host's relay's {port: [up, down]}; 3, the CPU
    seconds of each group of the lab's processes."""
    best = samples[0][which] if len(samples[0]) > which else []
    for sample in samples:
        if sample[0] > t:
            break
        best = sample[which] if len(sample) > which else []
    return best


def port_bytes(samples: list, begin: float, end: float, host: int, port: int) -> dict[str, int] | None:
    """Payload bytes host's relay carried to and from the store's `port` between two times; None
    without relay counters (an unshaped link)."""
    a, b = counters_at(samples, begin, 2), counters_at(samples, end, 2)
    if len(b) <= host or str(port) not in b[host]:
        return None
    before = a[host].get(str(port), [0, 0]) if len(a) > host else [0, 0]
    after = b[host][str(port)]
    return {"up": after[0] - before[0], "down": after[1] - before[1]}


def cpu_between(samples: list, begin: float, end: float) -> dict[str, float]:
    """CPU seconds each group of the lab's processes used between two times ({} for samples taken
    before the meter existed)."""
    a, b = counters_at(samples, begin, 3), counters_at(samples, end, 3)
    return {group: used - (a or {}).get(group, 0.0) for group, used in (b or {}).items()}


def per_round(result: dict, n_hosts: int) -> list[dict]:
    """Each round: its span, each host's bytes up/down in it, and its tasks' time split."""
    s = result["summary"]
    rounds = sorted(s["rounds"].items(), key=lambda kv: int(kv[0]))
    claims = [a["claimed_at"] for a in s["attempts"] if a["task"].startswith("train.") and a.get("claimed_at")]
    begin, rows = min(claims), []
    for r, info in rounds:
        end = info.get("ended_at", info["committed_at"])  # its last merge
        row = {"round": int(r), "wall_s": end - begin, "utilisation": (info["utilisation"] or {}).get("utilisation")}
        for phase in ("load", "engine", "commit"):
            row[f"{phase}_s"] = (info["utilisation"] or {}).get(f"task_{phase}_seconds")
        row["inner_s"] = sum(p["inner_seconds"] for p in info["paths"].values()) / max(1, len(info["paths"]))
        row["bytes_outer"] = info["bytes_outer"]
        if result.get("samples"):
            a, b = counters_at(result["samples"], begin), counters_at(result["samples"], end)
            row["hosts"] = [{"up": b[i][0] - a[i][0], "down": b[i][1] - a[i][1]} for i in range(n_hosts)]
            row["cpu_s"] = cpu_between(result["samples"], begin, end)
        rows.append(row)
        begin = end
    return rows


def predicted_bytes(
    summary: dict, grid: list[int], n_hosts: int, tracking: bool = False
) -> dict[int, list[dict[str, int]]]:
    """Round -> each host's payload bytes (up, down) that the objects its islands' finished tasks
    read and wrote predict, from their sizes in the store: a train task reads its path's modules,
    the path's inner state of the round before (its rank's optimizer file) and its shard, and
    writes its path directory (weights, metrics) and its inner state, and reads what it names of its
    peers' published files (`peer_reads`: pipeline.islands.peers); a merge reads the trained weights of
    every path through its module (their compressed outer gradients at its level, with
    outer.compression), the module and its momentum, and writes the merged pair; the
    round's commit copies the merged pairs into modules/ and outer_state/ on the server (no bytes);
    an evaluation reads its path's modules and validation shard; with `tracking`, host 0 reads each
    committed round's bundle (modules, router, tokenizer) to register it in MLflow. Attempts that did not finish
    moved bytes no record tells: they count on the measured side only.

    A read of what the same island process wrote or read before (files of 64 KiB and more, copies
    on the server included, whoever made them: pipeline.state.store.RecentFiles) moves no byte; each island's tasks are
    played in claim order to tell. The demo's islands never fill the memory's budget."""
    from models.grid import ModuleKey, parse_path_id, path_id, path_modules, paths_through
    from pipeline.state.layout import outer_grad_file
    from pipeline.state.storage import WHOLE_ABOVE
    from pipeline.state.store import SMALLEST_BYTES

    sizes = dict(summary["sizes"])
    by_level = summary.get("level_runs") or {}  # a path's weights -> each level's byte runs (state/module_store.py)
    for runs in (run for levels in by_level.values() for level in levels for run in level):
        begin, end = runs.rpartition("#")[2].split("-")
        sizes[runs] = int(end) - int(begin)

    def under(prefix: str, suffix: str = "") -> list[str]:
        """The objects under `prefix` (not a file's byte runs: `<file>#<begin>-<end>`, part of it)."""
        return [
            k for k in sizes if k.startswith(prefix) and k.endswith(suffix) and "_SUCCESS" not in k and "#" not in k
        ]

    def modules(r: int, path: str, at: float) -> list[str]:
        """Round r's modules of a path as a task claimed at `at` reads them: from modules/ once round
        r-1's commit is done, before that from where each was merged (module_location)."""
        keys = path_modules(parse_path_id(path, grid))
        return [module(r, k, at) for k in keys]

    def module(r: int, key, at: float) -> str:
        name = f"rounds/round={r}/modules/{key}.safetensors"
        return name if r == 0 or committed.get(r - 1, float("inf")) <= at else f"merged:{name}"

    def inner(target: str, r: int) -> str:
        """A job's inner state of round r (its ranks' optimizer files) under one name: the same size
        every round, and only the newest round's is kept (prune_inner_state), so its size stands
        for the pruned rounds' too."""
        kept: dict[str, int] = {}
        for key, size in summary["sizes"].items():
            head, sep, tail = key.partition(f"/inner/path={target}/")
            if sep and tail.endswith(".safetensors"):
                kept[head] = kept.get(head, 0) + size
        name = f"inner:{target}:{r}"
        sizes[name] = max(kept.values(), default=0)
        return name

    held: dict[str, set[str]] = {}  # island process -> the files it keeps in memory

    def content(name: str) -> str:
        """A module merged in merged/ and its copy in modules/ are the same bytes: held by either
        name, read by the other from memory (RecentFiles.get_same)."""
        return name.removeprefix("merged:")

    def read(island: str, names: list[str]) -> int:
        mine, moved = held.setdefault(island, set()), 0
        for name in names:  # a run of a file held whole is sliced from it
            if content(name) not in mine and content(name).partition("#")[0] not in mine:
                moved += sizes.get(name, 0)
                if sizes.get(name, 0) >= SMALLEST_BYTES:
                    mine.add(content(name))
        return moved

    def wrote(island: str, names: list[str]) -> int:
        held.setdefault(island, set()).update(content(n) for n in names if sizes.get(n, 0) >= SMALLEST_BYTES)
        return sum(sizes.get(n, 0) for n in names)

    def level_read(weights: str, key) -> list[str]:
        """What a merge of module `key` reads of a path's weights: its level's runs, or the file
        whole where they are most of it or none are recorded (pipeline.state.storage.runs_to_read)."""
        levels = by_level.get(weights)
        if not levels or len(levels) < 2 or sum(sizes[n] for n in levels[key.level]) > WHOLE_ABOVE * sizes[weights]:
            return [weights]
        return levels[key.level]

    def merge_inputs(r: int, key, at: float) -> list[str]:
        """What module `key`'s merge of round r reads (and an early start of round r+1 with it):
        each path's compressed outer gradient at the module's level (outer.compression), else its
        weights, then the module and its momentum."""
        through = [path_id(p) for p in paths_through(key, grid)]
        grads = [f"rounds/round={r}/paths/path={p}/{outer_grad_file(key.level)}" for p in through]
        paths = [f"rounds/round={r}/paths/path={p}/model.safetensors" for p in through]
        weights = [run for path in paths for run in level_read(path, key)]
        before = [module(r, key, at), f"rounds/round={r}/outer_state/{key}.safetensors"]
        return (grads if all(f in sizes for f in grads) else weights) + before

    out: dict[int, list[dict[str, int]]] = {}
    done = sorted((a for a in summary["attempts"] if a.get("state") == "done"), key=lambda a: a.get("claimed_at") or 0)
    committed = {  # round -> when its commit task was done
        int(a["task"].split(".")[1].lstrip("r")): a["claimed_at"] + (a.get("seconds") or 0)
        for a in done
        if a["task"].startswith("commit.")
    }
    for a in done:
        kind, rnd, *rest = a["task"].split(".", 2)
        r, target, island = int(rnd.lstrip("r")), rest[0] if rest else "", str(a["island"])
        row = out.setdefault(r, [{"up": 0, "down": 0} for _ in range(n_hosts)])[island_host(island)]
        if kind == "train":
            path = target.split(".w")[0]
            early = set(a.get("early_start") or [])  # computed here from round r-1's inputs (outer/early.py)
            keys = path_modules(parse_path_id(path, grid))
            later = [module(r, k, a["claimed_at"]) for k in keys if f"l{k.level}m{k.index}" not in early]
            row["down"] += read(island, later + under(f"shards/path={path}/"))
            for key in (k for k in keys if f"l{k.level}m{k.index}" in early):
                row["down"] += read(island, merge_inputs(r - 1, key, a["claimed_at"]))
                held.setdefault(island, set()).add(f"rounds/round={r}/modules/{key}.safetensors")  # computed: kept
            row["down"] += read(island, [inner(target, r - 1)]) if r else 0
            row["down"] += read(island, a.get("peer_reads") or [])  # its peers' files, read while it published
            row["up"] += wrote(island, under(f"rounds/round={r}/paths/path={target}/") + [inner(target, r)])
        elif kind == "merge":
            level, index = (int(x) for x in target.lstrip("l").split("m"))
            key = ModuleKey(level, index)
            row["down"] += read(island, merge_inputs(r, key, a["claimed_at"]))
            # what it commits in merged/ (pruned once the round is gathered): round r+1's copies of it
            merged = [
                f"rounds/round={r + 1}/modules/{key}.safetensors",
                f"rounds/round={r + 1}/outer_state/{key}.safetensors",
            ]
            sizes.update({f"merged:{name}": sizes.get(name, 0) for name in merged})
            row["up"] += wrote(island, [f"merged:{name}" for name in merged])
        elif kind == "commit":  # the merged modules are copied on the server (RunRoot.copy_committed)
            row["up"] += sizes.get(f"rounds/round={r}/merge.json", 0)
        elif kind == "eval":
            row["down"] += read(
                island, modules(r, target, a["claimed_at"]) + under(f"shards/validation/path={target}/")
            )
    if tracking:  # host 0's `dipaco run` registers each committed round: its bundle is read from the store
        for r in range(len(summary["rounds"])):
            row = out.setdefault(r, [{"up": 0, "down": 0} for _ in range(n_hosts)])[0]
            row["down"] += read(
                "dipaco run", under(f"rounds/round={r + 1}/modules/") + under("router/") + under("tokenizer/")
            )
    return out


def cpu_cell(cpu: dict[str, float], hosts: int) -> str:
    """A round's CPU seconds as "store / watcher / relays / h0 + h1 + ...", or "-" where none were sampled."""
    if not cpu:
        return "-"
    own = " + ".join(f"{cpu.get(f'h{i}', 0.0):.0f}" for i in range(hosts))
    watcher = f"{cpu['watcher']:.1f}" if "watcher" in cpu else "-"  # counted in the store's before
    return f"{cpu.get('store', 0.0):.1f} / {watcher} / {cpu.get('relays', 0.0):.1f} / {own}"


def rest(row: dict) -> float | None:
    """A round's wall time past its mean train task (inner loop, load, engine, commit): the merges,
    the round's commit, the evaluations and the queue's hand-overs between them."""
    parts = [row.get(k) for k in ("inner_s", "load_s", "engine_s", "commit_s")]
    return None if any(p is None for p in parts) else row["wall_s"] - sum(parts)


def whole_run_bytes(res: dict, grid: list[int], spec: Spec) -> list[str]:
    """The run's bytes on each host's link from its first train claim to its end: all of them
    (interface counters), the object store's and MLflow's payload (the delay relay's counters;
    shaped links only), and the object-store payload the objects' sizes predict (predicted_bytes)."""
    if "sizes" not in res["summary"] or not res.get("samples"):
        return []
    mb, samples = 1e6, res["samples"]
    begin, end = res.get("first_claim") or samples[0][0], samples[-1][0]
    tracking = spec.mlflow and spec.store == "s3"
    predicted = predicted_bytes(res["summary"], grid, spec.hosts, tracking)
    a, b = counters_at(samples, begin), counters_at(samples, end)
    lines = [
        "",
        f"Whole run, {res['run']}, from the first train claim (MB; payload: what the delay relay carried, without "
        "TCP/IP headers):",
        "",
        "| host | link up / down | S3 payload up / down | predicted up / down | S3 / predicted | "
        "MLflow payload up / down |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    pair = lambda x: "-" if x is None else f"{x['up'] / mb:.2f} / {x['down'] / mb:.2f}"  # noqa: E731
    for i in range(spec.hosts):
        want = {d: sum(p[i][d] for p in predicted.values()) for d in ("up", "down")}
        s3, ml = port_bytes(samples, begin, end, i, S3_PORT), port_bytes(samples, begin, end, i, MLFLOW_PORT)
        ratio = (
            "-" if s3 is None else " / ".join("-" if not want[d] else f"{s3[d] / want[d]:.3f}" for d in ("up", "down"))
        )
        link = {"up": b[i][0] - a[i][0], "down": b[i][1] - a[i][1]}
        lines.append(f"| h{i} | {pair(link)} | {pair(s3)} | {pair(want)} | {ratio} | {pair(ml)} |")
    return lines


def render(spec: Spec, results: list[dict], lab_info: dict, grid: list[int]) -> str:
    ref, refs, pooled = results[0], [r for r in results if is_reference(r)], reference_goodput(results)
    mb = 1e6
    lines = [
        f"Hosts benchmark (`python -m benchmarks.hosts`, {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}): "
        f"{spec.config} {' '.join(spec.overrides)}, {spec.hosts} hosts x {spec.islands_per_host} island, "
        f"links {lab_info['links']}, store {spec.store} (nice {spec.store_nice}), lease {spec.lease_seconds:g} s."
        + (
            f" The runs across the hosts pin what the one-host run resolved: {', '.join(lab_info['pinned'])}."
            if lab_info.get("pinned")
            else ""
        )
        + (
            " Each host's processes run on its own cores ("
            + ", ".join(f"{h}: {','.join(map(str, c))}" for h, c in lab_info["cores"].items())
            + "), the one-host run's on all of them."
            if lab_info.get("cores")
            else ""
        )
        + f" {compile_caches_said(lab_info.get('compile_caches'))}"
        + (
            " Goodput is against the two one-host runs together, one before and one after the runs across the"
            " hosts (`--bracket`); their own rows show how far the machine drifted between them."
            if len(refs) > 1
            else ""
        ),
        "",
        "| run | wall s | train s | committed tokens | goodput vs one host | past round 0 | "
        "final modules = one host's | island restarts | isolation breaches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for res in results:
        same = res["summary"]["modules"] == ref["summary"]["modules"] and bool(ref["summary"]["modules"])
        lines.append(
            f"| {res['run']} | {res['wall_s']} | {train_span(res):.1f} | {res['summary']['tokens']:,} | "
            f"{goodput(res) / pooled:.2f} | {goodput_past_round_0(res, refs)} | "
            f"{'yes' if same else 'NO'} | "
            f"{sum(res.get('restarts', {}).values())} | {len(res.get('violations', []))} |"
        )
    for res in [r for r in results if not is_reference(r)]:
        lines += ["", f"Per round, {res['run']} (bytes from each host's link counters; seconds per train task):", ""]
        hosts = " | ".join(f"h{i} up / down MB" for i in range(spec.hosts))
        lines += [
            f"| round | wall s | {hosts} | inner s | load s | engine s | commit s | rest s | utilisation "
            "| CPU s: store / watcher / relays / hosts |",
            "| ---: | ---: |" + " ---: |" * spec.hosts + " ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in per_round(res, spec.hosts):
            cells = " | ".join(f"{h['up'] / mb:.2f} / {h['down'] / mb:.2f}" for h in row["hosts"])
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            lines.append(
                f"| {row['round']} | {row['wall_s']:.1f} | {cells} | {fmt(row['inner_s'])} | {fmt(row['load_s'])} | "
                f"{fmt(row['engine_s'])} | {fmt(row['commit_s'])} | {fmt(rest(row))} | {fmt(row['utilisation'])} | "
                f"{cpu_cell(row.get('cpu_s') or {}, spec.hosts)} |"
            )
        lines += whole_run_bytes(res, grid, spec)
        if res.get("events"):
            lines += [
                "",
                "Faults: "
                + "; ".join(
                    fault_name(e) + (" after the run ended" if e["at_s"] is None else f" at {e['at_s']} s")
                    for e in res["events"]
                )
                + ".",
            ]
        if res.get("faults_not_reached"):
            lines += ["", f"Not reached before the run ended: {', '.join(res['faults_not_reached'])}."]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------


def s3_ready(spec: Spec) -> str | None:
    """None when this checkout can run on an s3:// root against moto; else why not."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return "s3fs is not installed (object-store run roots, issue 41)"
    from pipeline.core.config import load_config
    from pipeline.core.errors import DipacoError

    try:
        load_config(REPO / spec.config, [*s3_overrides("probe", "http://127.0.0.1:1")])
    except DipacoError as exc:
        return f"this pipeline cannot take an s3:// run root with storage.options: {exc}"
    done = subprocess.run([spec.store_python, "-c", "import moto.server"], capture_output=True, timeout=60)
    if done.returncode != 0:
        return f"{spec.store_python} cannot import moto.server (moto[server])"
    return None


def benchmark(spec: Spec, base: Path, runs: tuple[str, ...] = ("fault-free", "faults"), reference: bool = True) -> dict:
    """The runs of the module docstring in a lab under `base` (`runs`: which of the two across the
    hosts); every figure."""
    results, pinned, warm = [], [], compile_caches_warm(spec)  # as the first run found them
    if reference:
        results.append(run_one_host(spec, base, spec.hosts * spec.islands_per_host))
        pinned = resolved_choices(results[0]["summary"])
        spec = replace(spec, overrides=[*spec.overrides, *pinned])
    with Lab(spec.hosts, spec.shape, base / "lab", store_ports=(S3_PORT, MLFLOW_PORT)) as lab:
        store = None
        if spec.store == "s3":
            store = Store(lab, spec)
            store.start()
        for name in runs:
            if spec.store == "s3":
                overrides = [*base_overrides(spec), *s3_overrides(name, f"http://{STORE_IP}:{S3_PORT}", spec.mlflow)]
                watch_overrides = [*base_overrides(spec), *s3_overrides(name, f"http://127.0.0.1:{MOTO_PORT}", False)]
            else:
                root = base / "shared-root" / name
                overrides = [*base_overrides(spec), f"run_root={root}", "mlflow.enabled=false"]
                watch_overrides = overrides
            run = HostRun(name, overrides, watch_overrides, faults=name == "faults")
            results.append(run_across_hosts(lab, store, spec, run))
        if store is not None and (store.dir / "requests.jsonl").exists():
            OUT.mkdir(parents=True, exist_ok=True)  # every request to the store, for a breakdown by hand
            shutil.copyfile(store.dir / "requests.jsonl", OUT / "requests.jsonl")
        info = {
            "links": spec.shape.describe()
            + (" (netem)" if lab.netem else " (tbf + relay)" if spec.shape.shaped else ""),
            "pinned": pinned,
            "cores": {f"h{i}": lab.host_cores(i) for i in range(lab.n_hosts)},
            "compile_caches": None if warm is None else {"dir": str(spec.compile_cache), "warm": warm},
        }
    if reference and spec.bracket:  # once the lab is gone, as the first one-host run found the machine
        results.append(run_one_host(spec, base, spec.hosts * spec.islands_per_host, ONE_HOST_AFTER))
    return {"results": results, "lab": info}


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Spec]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hosts", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--islands-per-host", type=int, default=1)
    parser.add_argument("--rate-mbit", type=float, default=50.0, help="each host's link, each way")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="each host's round trip to the store")
    parser.add_argument("--unshaped", action="store_true", help="links at veth speed, no delay")
    parser.add_argument("--store", choices=("s3", "local"), default="s3")
    parser.add_argument("--store-python", default=sys.executable, help="the interpreter moto's server runs on")
    parser.add_argument("--lease-seconds", type=float, default=6.0)
    parser.add_argument("--partition-leases", type=float, default=3.0, help="the partition lasts this many leases")
    parser.add_argument("--throttle-s", type=float, default=10.0, help="seconds of 503 SlowDown (0: none)")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--faults-only", action="store_true", help="no fault-free run across the hosts")
    parser.add_argument("--no-mlflow", action="store_true", help="no MLflow server; host 0 tracks nothing")
    parser.add_argument(
        "--store-nice", type=int, default=STORE_NICE, help="the store's processes' nice value (0: the hosts' own)"
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="one torch.compile cache per host under DIR, kept between invocations (default: a first compile)",
    )
    parser.add_argument(
        "--bracket",
        action="store_true",
        help="run the one-host reference again after the runs across the hosts; goodput is against both",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="each run's limit, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the lab's directories (logs) after the run")
    parser.add_argument("--commit", action="store_true", help="put the table into benchmarks/RESULTS.md")
    parser.add_argument("--render-only", action="store_true", help="the tables again from out/hosts/results.json")
    args = parser.parse_args(argv)
    shape = LinkShape(None, None) if args.unshaped else LinkShape(args.rate_mbit or None, args.rtt_ms or None)
    spec = Spec(
        config=args.config,
        overrides=args.overrides,
        hosts=args.hosts,
        islands_per_host=args.islands_per_host,
        shape=shape,
        store=args.store,
        lease_seconds=args.lease_seconds,
        partition_leases=args.partition_leases,
        throttle_s=args.throttle_s,
        timeout_s=args.timeout,
        store_python=args.store_python,
        mlflow=not args.no_mlflow,
        store_nice=args.store_nice,
        compile_cache=args.compile_cache.resolve() if args.compile_cache else None,
        bracket=args.bracket,
    )
    return args, spec


def main(argv: list[str] | None = None) -> int:
    args, spec = parse(argv)
    if args.render_only:
        return report(args, spec, json.loads((OUT / "results.json").read_text()))
    why = netns.can_make_namespaces()
    if why:
        print(f"benchmarks.hosts: {why}", file=sys.stderr)
        return 2
    if spec.hosts < 2:
        print("benchmarks.hosts: --hosts must be at least 2", file=sys.stderr)
        return 2
    if spec.store == "s3":
        why = s3_ready(spec)
        if why:
            print(f"benchmarks.hosts: {why}; `--store local` runs the stand-in", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    unwind_on_signals()
    base = Path(tempfile.mkdtemp(prefix="dipaco-hosts-"))
    try:
        runs = ("fault-free",) if args.no_faults else ("faults",) if args.faults_only else ("fault-free", "faults")
        found = benchmark(spec, base, runs=runs)
    except KeyboardInterrupt:
        print("benchmarks.hosts: interrupted; every namespace and process it made is gone", file=sys.stderr)
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"benchmarks.hosts: kept {base}", file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(found, indent=2) + "\n")
    return report(args, spec, found)


def unwind_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C for the whole benchmark, as they do while a lab is open
    (netns.Lab): the one-host reference run comes before any lab, and a SIGTERM then killed this
    process and left that run's `dipaco run` and islands behind."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, netns.unwind)


def report(args: argparse.Namespace, spec: Spec, found: dict) -> int:
    """Print (and with --commit, put in RESULTS.md) the tables; 0 when every run's final modules
    are the one-host run's."""
    from pipeline.core.config import load_config

    grid = load_config(REPO / spec.config, base_overrides(spec)).model.grid
    table = render(spec, found["results"], found["lab"], grid)
    (OUT / "results.md").write_text(table + "\n")
    print(table)
    if args.commit:
        from benchmarks.results import commit_block

        commit_block("hosts", table, heading="## Islands on separate hosts")
    ref = found["results"][0]["summary"]["modules"]
    return 0 if ref and all(r["summary"]["modules"] == ref for r in found["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
