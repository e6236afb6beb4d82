"""The run as the store sees it, for `python -m benchmarks.hosts` (run in the store's namespace).

`python -m benchmarks.hosts_watch --config C [--set K=V ...] --interval 0.5 --timeout S` prints
one JSON line every interval: wall time, whether shards/ and the plan are committed, the
committed rounds with their commit times, and the train tasks each island holds (with `--leases
until-held`, only until one is first held). It reads the
store over the store's own loopback (its config points at the S3 server directly, not at the
throttling proxy the hosts use), so it never crosses a host's link, never counts in its bytes and
is never throttled. When the plan is finished (or at --timeout) it prints a last line
`{"summary": ...}`: every attempt's record, each round's utilisation and overhead breakdown
(pipeline.tracking.utilisation), the merges' outer bytes, the sizes of what each task committed,
the committed tokens, and a SHA-256 of every final module and momentum file; then it exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from pipeline.core.config import Config, load_config
from pipeline.islands.task_queue import LEASES, PLAN, TaskQueue, read_plan
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.storage import FILES_AT, PARTS, SUCCESS, RunRoot


def newest_attempts(root: RunRoot, committed_rounds: set[int]) -> dict[str, list[str]]:
    """Train task -> [island, state] of its newest attempt, for the rounds not yet committed. Only
    that attempt is read: a handful of requests a look, so the watcher's load on the store (and on
    a small machine's CPU) stays small."""
    found: dict[str, list[str]] = {}
    for task in root.listdir(LEASES):
        parts = task.split(".")
        if parts[0] != "train" or int(parts[1].lstrip("r")) in committed_rounds:
            continue
        attempts = sorted((a for a in root.listdir(f"{LEASES}/{task}") if a.endswith(".json")), key=attempt_number)
        if not attempts:
            continue
        try:
            record = root.read_json(f"{LEASES}/{task}/{attempts[-1]}")
        except Exception:  # rewritten while listed: the next look sees it
            continue
        found[task] = [str(record.get("island")), str(record.get("state"))]
    return found


def held(newest: dict[str, list[str]]) -> dict[str, list[str]]:
    """Island name -> the train tasks it holds a running attempt of."""
    found: dict[str, list[str]] = {}
    for task, (island, state) in newest.items():
        if state == "running":
            found.setdefault(island, []).append(task)
    return found


def attempt_number(name: str) -> int:
    digits = "".join(c for c in name if c.isdigit())
    return int(digits or 0)


def snapshot(root: RunRoot, rounds: int, committed: dict[int, float], known: dict, leases: str = "always") -> dict:
    """What the store holds now; `committed` (round -> commit time) and `known` (what stays true
    once seen: shards/ and the plan committed, a train task held) are kept between looks. With
    `leases` "until-held" the leases are read only until a train task is first seen held: a run
    without faults needs no more of them, and each look is a handful of requests to the store,
    whose CPU is the hosts' (this lab shares one machine's cores)."""
    for r in range(len(committed), rounds):  # rounds commit in order
        if not root.is_committed(layout.round_dir(r)):
            break
        committed[r] = float(root.marker(layout.round_dir(r))["committed_at"])
    known["prepared"] = known.get("prepared") or root.is_committed("shards")
    known["planned"] = known.get("planned") or (known["prepared"] and root.exists(PLAN))
    follow = known["planned"] and (leases == "always" or not known.get("held"))
    newest = newest_attempts(root, set(committed)) if follow else {}
    holding = held(newest)
    known["held"] = known.get("held") or bool(holding)
    return {
        "t": time.time(),
        "prepared": known["prepared"],
        "planned": known["planned"],
        "rounds": dict(committed),
        "held": holding,
        "newest": newest,
    }


def tree_bytes(root: RunRoot, rel: str) -> int:
    return sum(root.fs.size(root.path(rel, name)) for name in root.files_under(rel))


def summary(config: Config, root: RunRoot) -> dict:
    from pipeline.stages import list_paths
    from pipeline.tracking.utilisation import round_end, round_utilisation

    rounds = read_plan(root) or config.train.rounds
    attempts = []
    for task in root.listdir(LEASES):
        for attempt in root.listdir(f"{LEASES}/{task}"):
            record = root.read_json(f"{LEASES}/{task}/{attempt}")
            keep = (
                "island",
                "state",
                "claimed_at",
                "seconds",
                "inner_seconds",
                "backup",
                "heartbeat",
                "error",
                "peer_reads",
                "early_start",
            )
            attempts.append({"task": task, "attempt": attempt.removesuffix(".json")} | {k: record.get(k) for k in keep})
    per_round, tokens = {}, 0
    for r in range(rounds):
        paths = {}
        for job in list_paths(config):
            rel = layout.path_dir(r, job)
            marker = root.marker_if_committed(rel)
            if marker is not None:  # its files where the marker says (a published attempt's, on a store)
                metrics = root.read_committed_json(rel, "metrics.json", marker=marker)
                tokens += int(metrics["tokens"])
                paths[job] = {
                    "bytes": sum(record["bytes"] for record in marker["files"].values()),
                    "inner_seconds": metrics["seconds"],
                    "precision": metrics.get("precision"),  # what the island that trained it resolved
                    "compiled": metrics.get("compiled"),
                }
        merge = (
            root.read_json(f"{layout.round_dir(r)}/merge.json")
            if root.exists(f"{layout.round_dir(r)}/merge.json")
            else {}
        )
        per_round[r] = {
            "committed_at": float(root.marker(layout.round_dir(r))["committed_at"]),
            "ended_at": round_end(root, r),  # its last merge: islands commit a round in the gaps
            "utilisation": round_utilisation(config, r),
            "bytes_outer": merge.get("bytes_outer"),
            "paths": paths,
            "modules_bytes": tree_bytes(root, layout.modules_dir(r + 1)),
            "modules_read_bytes": tree_bytes(root, layout.modules_dir(r)),
        }
    digests = {}
    for rel in (layout.modules_dir(rounds), layout.outer_state_dir(rounds)):
        for name in root.files_under(rel):
            if name.endswith(".safetensors"):
                digests[f"{rel}/{name}"] = hashlib.sha256(bytes(root.read_bytes(f"{rel}/{name}"))).hexdigest()
    return {
        "rounds": per_round,
        "attempts": attempts,
        "tokens": tokens,
        "modules": digests,
        "sizes": sizes(root),
        "level_runs": level_runs(root),
    }


def sizes(root: RunRoot) -> dict[str, int]:
    """Every object under rounds/ and shards/ and its size: what the bytes on the links are
    predicted from (benchmarks.hosts.predicted_bytes)."""
    found = {}
    prefix = root.fs._strip_protocol(root.path()).rstrip("/") + "/"
    for top in ("rounds", "shards"):
        for path, info in root.fs.find(root.path(top), detail=True).items():
            if path.startswith(prefix):
                found[path[len(prefix) :]] = int(info.get("size") or 0)
    # a published path's files lie in its staged attempt (files_at): listed under the path's name too
    for name in [n for n in found if n.endswith(f"/{SUCCESS}") and "/paths/path=" in n]:
        rel = name.removesuffix(f"/{SUCCESS}")
        marker = root.marker(rel)
        if marker.get(FILES_AT):
            found.update({f"{rel}/{file}": record["bytes"] for file, record in marker["files"].items()})
    return found


def level_runs(root: RunRoot) -> dict[str, list[list[str]]]:
    """Each published path file read by level (pipeline/state/module_store.py) -> each level's byte runs,
    named `<file>#<begin>-<end>` as RecentFiles keeps them: what a merge of one module reads of it."""
    found = {}
    for rel in [f"{layout.round_dir(r)}/paths" for r in range(layout.next_round(root) + 1)]:
        for name in root.listdir(rel):
            marker = root.marker_if_committed(f"{rel}/{name}")
            for file, levels in ((marker or {}).get(PARTS) or {}).items():
                full = f"{rel}/{name}/{file}"
                found[full] = [[f"{full}#{b}-{e}" for b, e, _ in runs] for runs in levels]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hosts_watch", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--summary-only", action="store_true", help="print the summary of a finished run and exit")
    parser.add_argument(
        "--leases",
        choices=("always", "until-held"),
        default="always",
        help="read the leases at every look, or until a train task is held",
    )
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    root = Run(config).root
    deadline = time.monotonic() + args.timeout
    queue, committed, known = TaskQueue(root, config), {}, {}
    while not args.summary_only and time.monotonic() < deadline:
        try:
            line = snapshot(root, config.train.rounds, committed, known, args.leases)
            done = len(committed) == config.train.rounds and queue.finished(read_plan(root) or config.train.rounds)
        except Exception as exc:  # the store restarting, a listing mid-write: say so, look again
            line, done = {"t": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}, False
        print(json.dumps(line | {"finished": done}), flush=True)
        if done:
            break
        time.sleep(args.interval)
    print(json.dumps({"summary": summary(config, root)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
