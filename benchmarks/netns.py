"""Hosts as Linux network namespaces, for `python -m benchmarks.hosts` and tests/test_hosts.py.

A `Lab` makes, as root:

- a switch namespace holding one bridge, and one veth pair per host or store, whose switch end is
  on the bridge and whose other end is `eth0` inside that namespace (nothing is added to the
  namespace this process runs in: deleting the lab's namespaces deletes every link it made);
- a store namespace and N host namespaces, addresses in SUBNET (a /24 that exists only inside them).

Each host's link is shaped on both ends: upload on the host's `eth0`, download on its switch end.
With `sch_netem` in the kernel, netem gives the rate and half the round trip on each end. Kernels
without it (the Firecracker VMs this project's machines are) get the rate from `tbf` and the round
trip from a delaying TCP relay inside the host (benchmarks/linkdelay.py): the store's address is
also an address of the host's own loopback, where the relay listens on the store's ports and
forwards, each chunk held back half the round trip in each direction, to the store's second
address over `eth0`. Either way every byte crosses the shaped veth and its counters, and every
host uses the same endpoint URL.

Cleanup on every exit path: `close()` (also from `with`, atexit, and SIGINT/SIGTERM/SIGHUP, which
`Lab` turns into exceptions while it is open) kills every process in the lab's namespaces and
deletes them. Names carry PREFIX and the creating process's pid, so `sweep_leftovers()` removes
what an earlier run that died without cleaning (SIGKILL, a power cut) left behind.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dipaco.bench.netns")
PREFIX = "dipaco-hosts-"  # every namespace of a lab: dipaco-hosts-<pid>-<role>
SUBNET = "10.213.43"  # a /24 that exists only inside the lab's namespaces; never routed anywhere else
STORE_IP = f"{SUBNET}.1"  # the store's address every host uses (its URL)
STORE_BACKEND_IP = f"{SUBNET}.2"  # the store's second address: where a host's delay relay forwards to
REPO = Path(__file__).resolve().parent.parent
CMD_TIMEOUT_S = 20  # any one `ip`/`tc` call
STOP_GRACE_S = 3.0  # SIGTERM before SIGKILL at cleanup


class NoNamespaces(RuntimeError):
    """This machine or user cannot make network namespaces (not root, no CAP_NET_ADMIN, a kernel without them)."""


@dataclass(frozen=True)
class LinkShape:
    """A host's link: `rate_mbit` each way, `rtt_ms` round trip; None for either means no limit."""

    rate_mbit: float | None = 50.0
    rtt_ms: float | None = 40.0

    @property
    def shaped(self) -> bool:
        return bool(self.rate_mbit) or bool(self.rtt_ms)

    def describe(self) -> str:
        if not self.shaped:
            return "unshaped"
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "no rate limit"
        return f"{rate}, {self.rtt_ms or 0:g} ms RTT"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(["ip", *args], check=check)


def sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """One bounded call of `ip`/`tc`; a failure names the command and its message."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def can_make_namespaces() -> str | None:
    """None when this process can make a lab; else why not, in one line."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc): run it as root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        done = ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add` ({exc})"
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def netem_available(ns: str, dev: str) -> bool:
    """Whether the kernel has sch_netem (tried on a real device; removed again)."""
    done = sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"], check=False)
    if done.returncode == 0:
        sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return done.returncode == 0


def lab_namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def ns_pids(ns: str) -> list[int]:
    done = ip("netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every process in namespace `ns`; how many there were."""
    pids = ns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ns_pids(ns):
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while ns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not ns_pids(ns):
            break
    return len(pids)


def delete_namespace(ns: str) -> None:
    kill_namespace_processes(ns)
    ip("netns", "del", ns, check=False)


def sweep_leftovers() -> list[str]:
    """Delete the namespaces (and their processes) of labs whose creating process is gone."""
    removed = []
    for ns in lab_namespaces():
        owner = ns[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            delete_namespace(ns)
            removed.append(ns)
    if removed:
        log.info("removed %d namespaces an earlier run left: %s", len(removed), ", ".join(removed))
    return removed


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used so far (its own, not its waited children's:
    a parent would count a child the meter also sees), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat


class CpuMeter:
    """CPU seconds by group of processes (the store's, the relays', each host's), summed over
    every process ever seen in the group at its last reading: a process that exits keeps what it
    used up to the sample before (at most one poll's worth lost). What tells whether the lab's
    own processes, which share this machine's cores with the islands, slowed their training."""

    def __init__(self):
        self.last: dict[str, dict[int, float]] = {}

    def read(self, groups: dict[str, list[int]]) -> dict[str, float]:
        for group, pids in groups.items():
            seen = self.last.setdefault(group, {})
            for pid in pids:
                used = cpu_seconds(pid)
                if used is not None:
                    seen[pid] = used
        return {group: round(sum(seen.values()), 2) for group, seen in self.last.items()}


def pid_alive(pid: int) -> bool:
    """A running process (a zombie waiting for its parent counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP while a lab is open: unwinds like Ctrl-C, through every finally."""


def unwind(signum: int, frame) -> None:
    """A signal handler: raise Interrupted, once (a second signal must not cut the cleanup short)."""
    signal.signal(signum, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


class Lab:
    """A store namespace and `hosts` host namespaces on one shaped bridge (module docstring)."""

    def __init__(self, hosts: int, shape: LinkShape, base: Path, store_ports: tuple[int, ...] = ()):
        if hosts < 1:
            raise ValueError("a lab needs at least one host")
        self.n_hosts, self.shape, self.base = hosts, shape, Path(base)
        self.store_ports = store_ports  # the ports a delay relay forwards (the store's services)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch, self.store = f"{self.tag}-sw", f"{self.tag}-store"
        self.hosts = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.made: list[str] = []
        self.netem = False
        self.relays: dict[str, subprocess.Popen] = {}
        self.observers: set[int] = set()  # the benchmark's own processes in the store's namespace (its watcher)
        self._previous: dict[int, object] = {}
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        self._catch_signals()
        atexit.register(self.close)
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        why = can_make_namespaces()
        if why:
            raise NoNamespaces(why)
        sweep_leftovers()
        for d in [self.store_dir(), *(self.host_dir(i) for i in range(self.n_hosts))]:
            (d / "tmp").mkdir(parents=True, exist_ok=True)
        self._add_ns(self.switch)
        ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        self._add_ns(self.store)
        self._wire(self.store, "store", [f"{STORE_IP}/24", f"{STORE_BACKEND_IP}/24"])
        for i, ns in enumerate(self.hosts):
            self._add_ns(ns)
            self._wire(ns, f"h{i}", [f"{self.host_ip(i)}/24"])
        self.netem = netem_available(self.hosts[0], "eth0")
        for i in range(self.n_hosts):
            self._shape(i)
        log.info(
            "lab %s: store %s, %d hosts, links %s%s",
            self.tag,
            STORE_IP,
            self.n_hosts,
            self.shape.describe(),
            "" if not self.shape.shaped else (" (netem)" if self.netem else " (tbf + delay relay: no sch_netem)"),
        )

    def close(self) -> None:
        """Kill every process in the lab's namespaces and delete them; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            for ns in reversed(self.made):  # hosts first, the switch last
                delete_namespace(ns)
            for ns in lab_namespaces():  # anything of ours the list missed (a crash mid-open)
                if ns.startswith(self.tag + "-"):
                    delete_namespace(ns)
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            atexit.unregister(self.close)

    def _catch_signals(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, unwind)

    # -- building ----------------------------------------------------------------------------------

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.made.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")  # DeepSpeed's launcher rendezvous on 127.0.0.1

    def _wire(self, ns: str, port: str, addresses: list[str]) -> None:
        """A veth pair: `port` on the switch's bridge, `eth0` in `ns` with `addresses`."""
        ip("-n", self.switch, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        for address in addresses:
            ip("-n", ns, "addr", "add", address, "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")

    def _shape(self, i: int) -> None:
        """Upload on the host's eth0, download on its switch port; the delay as module docstring."""
        rate, rtt = self.shape.rate_mbit, self.shape.rtt_ms
        ends = [(self.hosts[i], "eth0"), (self.switch, f"h{i}")]
        for ns, dev in ends:
            if self.netem and self.shape.shaped:
                spec = ["netem", "limit", "100000"]
                spec += ["delay", f"{(rtt or 0) / 2:g}ms"] if rtt else []
                spec += ["rate", f"{rate:g}mbit"] if rate else []
                sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *spec])
            elif rate:
                # burst: 64 kB, at least one GSO frame; the queue holds 200 ms at the rate
                sh(
                    ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate:g}mbit"]
                    + ["burst", "64kb", "latency", "200ms"]
                )
        if rtt and not self.netem:
            ip("-n", self.hosts[i], "addr", "add", f"{STORE_IP}/32", "dev", "lo")
            self.relays[self.hosts[i]] = self.spawn(
                self.hosts[i],
                [
                    sys.executable,
                    "-m",
                    "benchmarks.linkdelay",
                    "--listen",
                    STORE_IP,
                    "--upstream",
                    STORE_BACKEND_IP,
                    "--ports",
                    ",".join(str(p) for p in self.store_ports),
                    "--one-way-ms",
                    f"{rtt / 2:g}",
                    "--counters",
                    str(self.relay_counters_file(i)),
                ],
                log_path=self.host_dir(i) / "linkdelay.log",
                isolate=False,
                pin=False,
            )

    # -- names and places --------------------------------------------------------------------------

    def host_ip(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def host_dir(self, i: int) -> Path:
        """Host i's own local disk: its working directory, TMPDIR, caches, logs."""
        return self.base / "hosts" / f"h{i}"

    def relay_counters_file(self, i: int) -> Path:
        return self.host_dir(i) / "linkdelay-counters.json"

    def port_counters(self, i: int) -> dict[int, tuple[int, int]]:
        """Host i's payload bytes (up, down) to each of the store's ports so far, as its delay relay
        counted them; empty without a relay (an unshaped link, or sch_netem)."""
        try:
            found = json.loads(self.relay_counters_file(i).read_text())
        except (OSError, ValueError):
            return {}
        return {int(port): (int(up), int(down)) for port, (up, down) in found.items()}

    def store_dir(self) -> Path:
        return self.base / "store"

    def host_cores(self, i: int) -> list[int]:
        """The cores host i's processes run on: this machine's cores (the benchmark's affinity) dealt
        out to the hosts in turn, as separate machines would each have their own. Shared, the hosts
        sized their ranks' threads as if each had every core: host 0's `dipaco run --set
        train.islands=1` took 2 threads, host 1's island 1, three threads on 2 cores, and the
        hosts' inner loops ran 7 % longer than the one-host run's on a Xeon (RESULTS.md). With
        more hosts than cores, hosts i and i + cores share one."""
        cores = sorted(os.sched_getaffinity(0))
        if self.n_hosts >= len(cores):
            return [cores[i % len(cores)]]
        share = len(cores) // self.n_hosts
        return cores[i * share : (i + 1) * share]

    def private_dirs(self) -> dict[str, Path]:
        return {self.store: self.store_dir(), **{ns: self.host_dir(i) for i, ns in enumerate(self.hosts)}}

    # -- processes ---------------------------------------------------------------------------------

    def spawn(
        self,
        ns: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        isolate: bool = True,
        nice: int = 0,
        pin: bool = True,
    ) -> subprocess.Popen:
        """`argv` in namespace `ns`, in a mount namespace where every other lab member's directory
        is an empty read-only tmpfs (`isolate`): a host sees its own disk, the code and nothing of
        the others'. In a host's namespace it runs on that host's cores (`host_cores`, taskset(1);
        `pin` False for the lab's own link relays, which stand for the wire). stdout and stderr go
        to `log_path`; `nice` lowers its priority (nice(1))."""
        hide = [str(d) for other, d in self.private_dirs().items() if other != ns] if isolate else []
        if pin and ns in self.hosts:
            cores = ",".join(str(c) for c in self.host_cores(self.hosts.index(ns)))
            argv = ["taskset", "-c", cores, *argv]
        script = 'for d in "$@"; do [ "$d" = -- ] && break; mount -t tmpfs -o ro,size=4k,mode=0 none "$d"; shift; done'
        script += '; shift; exec "$@"'
        wrapped = ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "--"]
        wrapped += ["sh", "-c", script, "sh", *hide, "--", *(["nice", "-n", str(nice)] if nice else []), *argv]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                wrapped,
                cwd=cwd or REPO,
                env=env if env is not None else os.environ.copy(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def run_in(self, ns: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 120.0):
        """`argv` in `ns` to completion (bounded): its CompletedProcess."""
        return subprocess.run(
            ["ip", "netns", "exec", ns, *argv],
            cwd=REPO,
            env=env if env is not None else os.environ.copy(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pids(self, ns: str) -> list[int]:
        return ns_pids(ns)

    def kill_host(self, i: int) -> int:
        """Every process on host i, SIGKILL at once (a host that dies); how many."""
        pids = ns_pids(self.hosts[i])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    # -- the links ---------------------------------------------------------------------------------

    def partition(self, i: int) -> None:
        """Host i's link down (its switch port): no packet in or out until reconnect()."""
        ip("-n", self.switch, "link", "set", f"h{i}", "down")

    def reconnect(self, i: int) -> None:
        ip("-n", self.switch, "link", "set", f"h{i}", "up")

    def cpu_groups(self) -> dict[str, list[int]]:
        """The lab's processes by what they stand for: "store" (the S3 server, its proxy, MLflow),
        "watcher" (the benchmark's `observers`, which look at the store), "relays" (the links'
        delay relays, which a real link would not run on the hosts' cores), and "h<i>" (host i's
        own: its islands and, on host 0, `dipaco run`)."""
        relays = {proc.pid for proc in self.relays.values()}
        store = ns_pids(self.store)
        groups = {
            "store": [pid for pid in store if pid not in self.observers],
            "watcher": [pid for pid in store if pid in self.observers],
            "relays": sorted(relays),
        }
        for i, ns in enumerate(self.hosts):
            groups[f"h{i}"] = [pid for pid in ns_pids(ns) if pid not in relays]
        return groups

    def counters(self, i: int) -> tuple[int, int]:
        """(bytes up, bytes down) on host i's link so far: its eth0's tx and rx counters."""
        out = ip("-j", "-s", "-n", self.hosts[i], "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])
