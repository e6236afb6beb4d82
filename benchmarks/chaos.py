"""`python -m benchmarks.chaos`: faults change the time a run takes, never the model it trains.

Two runs of the same config and seed on the tiny model, each on 4 real island processes
(`python -m pipeline.island_rank`, one rank each) pulling from one run root's queue:

- **fault-free**: the 4 islands, nothing else;
- **chaos**: the same, with faults on a schedule (`--fault-every` seconds apart, from the first
  train task on; a fault on one island waits, up to half an interval, until it holds a train
  task): SIGKILL of island-0 (started again, as `dipaco run` does); SIGSTOP of island-1 for
  3x `train.lease_seconds`, then SIGCONT (the zombie holder); island-3 leaves (SIGTERM) and
  island-4 joins; island-2 throttled to a quarter of the speed (SIGSTOP/SIGCONT in 0.3 s / 0.1 s
  cycles: a straggler) for one interval. Throughout: island-1's wall clock 120 s ahead
  (DIPACO_TEST_CLOCK_OFFSET, test-only), island-3's and island-4's first three lease writes failing
  (DIPACO_FAULT_WRITE_ERRORS). `train.backup_after` and `train.checkpoint_every` are on in both runs.
  With `--straggler-throughout`, island-2 is throttled for the whole chaos run instead: a quarter of
  an island lost for good, which caps goodput near (3 + 1/4) / 4 = 0.81 on machines whose islands
  do not share cores (the measure of "one fault every 60 s" is the scheduled window).

Reported: goodput (committed inner-loop tokens per wall second, the chaos run against the
fault-free one), the work each fault cost (seconds of attempts that published nothing, and the step
their successor resumed from), backup attempts, and whether the final modules and momentum
buffers are bitwise identical. Written to benchmarks/out/chaos/results.json and .md; with
`--commit`, the table is put into benchmarks/RESULTS.md between its `chaos` markers (the notes
around them stay).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.results import commit_block
from models.grid import all_path_ids
from pipeline import stages
from pipeline.core.config import Config, load_config
from pipeline.islands.task_queue import LEASES, TaskQueue, write_plan
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.shards import shard_table, write_shard_file
from pipeline.state.storage import RunRoot
from pipeline.tracking.utilisation import island_seconds
from pipeline.train.distributed import child_env

log = logging.getLogger("dipaco.bench.chaos")
OUT = Path("benchmarks/out/chaos")
REPO = Path(__file__).resolve().parent.parent
VOCAB = 256
STRAGGLER = "island-2"  # the island throttled to a quarter of the speed


def synthetic_shards(root: RunRoot, grid: list[int], docs_per_path: int, seed: int = 0) -> None:
    """Learnable documents, a token band and motif per path (as the tests' shards), committed."""
    for index, path_id in enumerate(all_path_ids(grid)):
        rng = np.random.default_rng([seed, index])
        band = max(8, (VOCAB - 1) // 8)
        low = (index * band) % (VOCAB - 1 - band)
        docs = []
        for _ in range(docs_per_path + 6):
            motif = rng.integers(low, low + band, size=4)
            length = int(rng.integers(24, 72))
            docs.append(
                [int(motif[i % 4]) if rng.random() < 0.8 else int(rng.integers(0, VOCAB - 1)) for i in range(length)]
            )
        ids = [f"doc-{index}-{i}" for i in range(len(docs))]
        write_shard_file(root, f"shards/path={path_id}/part-00000.parquet", shard_table(ids[:-6], docs[:-6]))
        write_shard_file(root, f"shards/validation/path={path_id}/part-00000.parquet", shard_table(ids[-6:], docs[-6:]))
    root.write_json("shards/manifest.json", {"synthetic": True})
    root.commit("shards")


def checkpoint_every(args: argparse.Namespace) -> int:
    """train.checkpoint_every: 4 checkpoints a task (the config and both tables print it)."""
    return max(1, args.inner_steps // 4)


def chaos_config(run_root: Path, args: argparse.Namespace) -> Config:
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"run_root={run_root}",
            "model.tokenizer=gpt2",
            f"model.vocab_size={VOCAB}",
            "mlflow.enabled=false",
            "train.launcher=deepspeed",
            f"train.rounds={args.rounds}",
            f"train.inner_steps={args.inner_steps}",
            "train.warmup_steps=5",
            f"train.lease_seconds={args.lease_seconds}",
            "train.max_attempts=8",
            f"model.grid=[{args.grid}]",
            f"model.blocks_per_level=[{', '.join('1' for _ in args.grid.split(','))}]",
            f"train.backup_after={'null' if args.backup_after is None else args.backup_after}",
            f"train.checkpoint_every={checkpoint_every(args)}",
            "train.islands=4",
        ],
    )


class Islands:
    """The run's island processes, started again when one crashes (as `dipaco run` does)."""

    def __init__(self, run_root: Path, logs: Path):
        self.run_root, self.logs = run_root, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, dict[str, str]] = {}
        self.left: set[str] = set()
        self.starts: dict[str, int] = {}

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        self.env.setdefault(name, env or {})
        self.starts[name] = self.starts.get(name, 0) + 1
        out = open(self.logs / f"{name}.{self.starts[name]}.log", "w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pipeline.island_rank", "--run-root", str(self.run_root), "--island", name],
            cwd=REPO,
            env=child_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env[name]}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def signal(self, name: str, sig: int) -> None:
        try:
            os.killpg(self.procs[name].pid, sig)
        except ProcessLookupError:
            pass

    def restart_crashed(self) -> None:
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code not in (None, 0) and name not in self.left:
                log.info("%s exited with %s: starting it again", name, code)
                self.start(name)

    def stop(self) -> None:
        for name in self.procs:
            self.signal(name, signal.SIGCONT)
            self.signal(name, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def throttle(islands: Islands, name: str, stop: threading.Event, on: float = 0.1, off: float = 0.3) -> None:
    """A quarter of the speed: the island runs `on` seconds of every `on + off`."""
    while not stop.is_set():
        islands.signal(name, signal.SIGSTOP)
        stop.wait(off)
        islands.signal(name, signal.SIGCONT)
        stop.wait(on)


def first_train_started(root: RunRoot) -> bool:
    return any(name.startswith("train.") for name in root.listdir(LEASES))


class Throttle:
    """The STRAGGLER island at a quarter of the speed, from start() to stop()."""

    def __init__(self, islands: Islands):
        self.islands, self.halt, self.thread = islands, threading.Event(), None

    def start(self) -> None:
        self.halt = threading.Event()  # a fresh one: stop() set the last
        self.thread = threading.Thread(target=throttle, args=(self.islands, STRAGGLER, self.halt), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        if self.thread is not None:
            self.thread.join()
            self.islands.signal(STRAGGLER, signal.SIGCONT)
            self.thread = None


STRAGGLER_FAULT = f"{STRAGGLER} at a quarter of the speed for one interval"


def fault_schedule(straggler_window: bool) -> list[tuple[int, str]]:
    """(interval number, fault): one fault per `--fault-every` seconds."""
    schedule = [(1, "SIGKILL island-0"), (2, "SIGSTOP island-1"), (3, "island-3 leaves, island-4 joins")]
    return schedule + ([(4, STRAGGLER_FAULT)] if straggler_window else [])


def run_once(
    args: argparse.Namespace, name: str, faults: bool, straggler: bool, straggler_window: bool = False
) -> dict:
    """One run on 4 islands: `faults` the scheduled faults, the clock offset and the failing writes
    (module docstring); `straggler` the STRAGGLER island at a quarter of the speed throughout;
    `straggler_window` (with `faults`) the same for one interval, as the fourth scheduled fault."""
    run_root = (OUT / name).resolve()
    if run_root.exists():
        import shutil

        shutil.rmtree(run_root)
    logs = OUT / f"{name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = chaos_config(run_root, args)
    root = stages.init_run(Run(config))
    synthetic_shards(root, config.model.grid, args.docs_per_path)
    write_plan(root, config.train.rounds)
    queue = TaskQueue(root, config)
    islands, events = Islands(run_root, logs), []
    lease = config.train.lease_seconds
    started = time.monotonic()
    for k in range(4):
        env = {}
        if faults and k == 1:
            env["DIPACO_TEST_CLOCK_OFFSET"] = "120"
        if faults and k == 3:
            env["DIPACO_FAULT_WRITE_ERRORS"] = "3:queue/leases"
        islands.start(f"island-{k}", env)
    throttler = Throttle(islands)
    if straggler:
        throttler.start()
    while not first_train_started(root):
        time.sleep(0.2)
    train_began = time.monotonic()
    schedule = fault_schedule(straggler_window) if faults else []
    stopped_at = throttled_at = None
    try:
        while not queue.finished(config.train.rounds):
            now = time.monotonic() - train_began
            due = schedule and now >= schedule[0][0] * args.fault_every
            if due and schedule[0][1].split()[0] in ("SIGKILL", "SIGSTOP"):  # hit it while it trains, up to
                target = schedule[0][1].split()[1]  # half an interval late
                due = (
                    any(t.startswith("train.") for t in held_by(root, target))
                    or now >= (schedule[0][0] + 0.5) * args.fault_every
                )
            if due:
                _, what = schedule.pop(0)
                hit = STRAGGLER if what == STRAGGLER_FAULT else what.split()[0 if "leaves" in what else 1]
                events.append({"fault": what, "at_s": round(now, 1), "held": held_by(root, hit)})
                log.info("t=%.0f s: %s", now, what)
                if what.startswith("SIGKILL"):
                    islands.signal("island-0", signal.SIGKILL)
                elif what.startswith("SIGSTOP"):
                    islands.signal("island-1", signal.SIGSTOP)
                    stopped_at = time.monotonic()
                elif what == STRAGGLER_FAULT:
                    throttler.start()
                    throttled_at = time.monotonic()
                else:
                    islands.left.add("island-3")
                    islands.signal("island-3", signal.SIGTERM)
                    islands.start("island-4", {"DIPACO_FAULT_WRITE_ERRORS": "3:queue/leases"})
            if stopped_at is not None and time.monotonic() - stopped_at >= 3 * lease:
                islands.signal("island-1", signal.SIGCONT)
                stopped_at = None
            if throttled_at is not None and time.monotonic() - throttled_at >= args.fault_every:
                throttler.stop()
                throttled_at = None
            islands.restart_crashed()
            if time.monotonic() - started > args.timeout:
                raise TimeoutError(f"{name}: not finished after {args.timeout} s")
            time.sleep(0.2)
        wall = time.monotonic() - started
    finally:
        throttler.stop()
        islands.stop()
    return summarize(root, config, name, wall, time.monotonic() - train_began, events)


def island_utilisation(root: RunRoot, config: Config) -> dict[str, dict]:
    """Per island, over its running time from the first train claim to the last round's commit:
    the share spent in inner-loop steps of train attempts that published (the pipeline's own
    utilisation, island by island), and the seconds of attempts that published nothing (cancelled
    backups, lost leases). Wall-clock records: only for runs without a clock offset."""
    claims, busy, wasted = [], {}, {}
    for task in root.listdir(LEASES):
        if not task.startswith("train."):
            continue
        for attempt in root.listdir(f"{LEASES}/{task}"):
            record = root.read_json(f"{LEASES}/{task}/{attempt}")
            island = record.get("island")
            claims.append(float(record["claimed_at"]))
            if record.get("state") == "done":
                busy[island] = busy.get(island, 0.0) + float(record.get("inner_seconds") or 0.0)
            else:
                end = float(record.get("finished_at", record.get("heartbeat")))
                wasted[island] = wasted.get(island, 0.0) + end - float(record["claimed_at"])
    end = float(root.marker(layout.round_dir(config.train.rounds - 1))["committed_at"])
    running = island_seconds(root, end, since=min(claims))
    return {
        name: {
            "utilisation": busy.get(name, 0.0) / seconds,
            "running_s": round(seconds, 1),
            "inner_s": round(busy.get(name, 0.0), 1),
            "wasted_s": round(wasted.get(name, 0.0), 1),
        }
        for name, seconds in sorted(running.items())
        if seconds > 0
    }


def held_by(root: RunRoot, island: str) -> list[str]:
    """The tasks `island` held when a fault hit it."""
    held = []
    for task in root.listdir(LEASES):
        for attempt in root.listdir(f"{LEASES}/{task}"):
            try:
                record = root.read_json(f"{LEASES}/{task}/{attempt}")
            except Exception:
                continue
            if record.get("island") == island and record.get("state") == "running":
                held.append(f"{task}/{attempt.removesuffix('.json')}")
    return held


def summarize(root: RunRoot, config: Config, name: str, wall: float, train_wall: float, events: list[dict]) -> dict:
    tokens, inner, resumed = 0, 0.0, {}
    for r in range(config.train.rounds):
        for job in stages.list_paths(config):
            metrics = root.read_committed_json(layout.path_dir(r, job), "metrics.json")
            tokens += metrics["tokens"]
            inner += metrics["seconds"]
            if metrics.get("resumed_from_step"):
                resumed[f"train.r{r}.{job}"] = metrics["resumed_from_step"]
    attempts: dict[str, list[dict]] = {}
    for task in root.listdir(LEASES):
        for attempt in root.listdir(f"{LEASES}/{task}"):
            record = root.read_json(f"{LEASES}/{task}/{attempt}")
            end = record.get("finished_at", record.get("heartbeat"))
            attempts.setdefault(task, []).append(
                {
                    "attempt": attempt.removesuffix(".json"),
                    "island": record.get("island"),
                    "state": record.get("state"),
                    "backup": bool(record.get("backup")),
                    "seconds": round(float(end) - float(record["claimed_at"]), 1),
                }
            )
    for event in events:  # what each fault cost: the attempts it hit that published nothing
        lost = [
            a
            for task, items in attempts.items()
            for a in items
            if f"{task}/{a['attempt']}" in event["held"] and a["state"] != "done"
        ]
        event["lost_seconds"] = round(sum(a["seconds"] for a in lost), 1)
        event["resumed_from_step"] = {
            h.split("/")[0]: resumed.get(h.split("/")[0], 0) for h in event["held"] if h.startswith("train.")
        }
    final = config.train.rounds
    digests = {}
    for rel in (layout.modules_dir(final), layout.outer_state_dir(final)):
        for file in sorted(Path(root.path(rel)).rglob("*.safetensors")):
            digests[str(file.relative_to(root.path()))] = hashlib.sha256(file.read_bytes()).hexdigest()
    backups = [dict(a, task=t) for t, items in attempts.items() for a in items if a["backup"]]
    return {
        "run": name,
        "wall_s": round(wall, 1),
        "train_wall_s": round(train_wall, 1),
        "tokens": tokens,
        "goodput_tokens_per_s": tokens / wall,
        "inner_seconds": round(inner, 1),
        "faults": events,
        "backups": backups,
        "resumed": resumed,
        "attempts_not_done": sum(a["state"] != "done" for items in attempts.values() for a in items),
        "modules": digests,
        "islands": island_utilisation(root, config),
    }


def render(free: dict, chaos: dict, args: argparse.Namespace) -> str:
    same = free["modules"] == chaos["modules"] and bool(free["modules"])
    ratio = chaos["goodput_tokens_per_s"] / free["goodput_tokens_per_s"]
    lines = [
        f"Chaos benchmark (`python -m benchmarks.chaos`, {os.cpu_count()} CPU cores, "
        f"{time.strftime('%Y-%m-%d')}): tiny model, grid [2, 2], "
        f"{args.rounds} rounds x {args.inner_steps} inner steps, "
        f"4 islands of 1 rank, lease {args.lease_seconds} s, backup_after {args.backup_after}, "
        f"checkpoint_every {checkpoint_every(args)}.",
        "",
        "| run | wall s | committed tokens | goodput tokens/s | vs fault-free |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| fault-free | {free['wall_s']} | {free['tokens']:,} | {free['goodput_tokens_per_s']:.0f} | 1.00 |",
        f"| chaos | {chaos['wall_s']} | {chaos['tokens']:,} | {chaos['goodput_tokens_per_s']:.0f} | {ratio:.2f} |",
        "",
        f"Fault schedule (seconds after the first train task; one every {args.fault_every} s), and what each cost:",
        "",
        "| at s | fault | tasks it held | seconds of attempts lost | successor resumed from step |",
        "| ---: | --- | --- | ---: | --- |",
    ]
    for e in chaos["faults"]:
        lines.append(
            f"| {e['at_s']} | {e['fault']} | {', '.join(e['held']) or 'none'} | {e['lost_seconds']} | "
            f"{', '.join(f'{t}: {s}' for t, s in e['resumed_from_step'].items()) or '-'} |"
        )
    lines += [
        "",
        "Throughout the chaos run: "
        + ("island-2 at a quarter of the speed, " if args.straggler_throughout else "")
        + "island-1's clock +120 s, 3 failed lease writes on island-3 and on island-4. Backup attempts: "
        + (", ".join(f"{b['task']} {b['attempt']} on {b['island']} ({b['state']})" for b in chaos["backups"]) or "none")
        + f". Attempts that did not end done: {chaos['attempts_not_done']} (fault-free: {free['attempts_not_done']}).",
        "",
        f"Final modules and momentum buffers ({len(chaos['modules'])} files) "
        "bitwise identical to the fault-free run's: "
        f"**{'yes' if same else 'NO'}**.",
    ]
    return "\n".join(lines)


def others(run: dict) -> list[dict]:
    return [v for k, v in run["islands"].items() if k != STRAGGLER]


def render_straggler(runs: list[dict], args: argparse.Namespace) -> str:
    """The straggler table: each island's utilisation beside a quarter-speed island-2, with
    backups on and off, against the same run without the straggler."""
    lines = [
        f"Straggler benchmark (`python -m benchmarks.chaos --straggler`, {os.cpu_count()} CPU cores, "
        f"{time.strftime('%Y-%m-%d')}): tiny model, grid [{args.grid}], {args.rounds} rounds x "
        f"{args.inner_steps} inner steps, 4 islands of 1 rank, lease {args.lease_seconds} s, "
        f"checkpoint_every {checkpoint_every(args)}; island-2 at a quarter of the speed, no other fault. "
        "Utilisation: the share of an island's running time (first train claim to the last round's commit) "
        "spent in inner-loop steps of attempts that published.",
        "",
        "| run | wall s | goodput vs no straggler | others' utilisation (min, mean) | island-2's | "
        "backup attempts (done / cancelled) | seconds of attempts that published nothing |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    base = runs[0]["goodput_tokens_per_s"]
    for run in runs:
        rest = [v["utilisation"] for v in others(run)]
        slow = run["islands"].get(STRAGGLER, {}).get("utilisation")
        done = sum(b["state"] == "done" for b in run["backups"])
        lines.append(
            f"| {run['run']} | {run['wall_s']} | {run['goodput_tokens_per_s'] / base:.2f} | "
            f"{min(rest):.2f}, {sum(rest) / len(rest):.2f} | {'-' if slow is None else f'{slow:.2f}'} | "
            f"{done} / {len(run['backups']) - done} | "
            f"{sum(v['wasted_s'] for v in run['islands'].values()):.1f} |"
        )
    return "\n".join(lines)


def straggler_main(args: argparse.Namespace) -> int:
    """Three runs: no straggler, island-2 at a quarter speed with backups (args.backup_after),
    and the same without backups."""
    without = argparse.Namespace(**{**vars(args), "backup_after": None})
    runs = [
        run_once(args, "no-straggler", faults=False, straggler=False),
        run_once(args, f"straggler-backup-{args.backup_after}", faults=False, straggler=True),
        run_once(without, "straggler-no-backups", faults=False, straggler=True),
    ]
    (OUT / "straggler.json").write_text(json.dumps(runs, indent=2) + "\n")
    table = render_straggler(runs, args)
    (OUT / "straggler.md").write_text(table + "\n")
    print(table)
    if args.commit:
        commit_block("straggler", table, heading="## Faults and stragglers")
    same = all(run["modules"] == runs[0]["modules"] for run in runs)
    return 0 if same and runs[0]["modules"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=1500)
    parser.add_argument("--docs-per-path", type=int, default=60)
    parser.add_argument("--lease-seconds", type=float, default=4.0)
    parser.add_argument("--backup-after", type=float, default=1.2, help="train.backup_after of both runs")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between scheduled faults")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--grid", default="2,2", help="model.grid, comma-separated")
    parser.add_argument(
        "--straggler",
        action="store_true",
        help="instead: island-2 at a quarter of the speed and no other fault, backups on and off, against no straggler",
    )
    parser.add_argument(
        "--straggler-throughout",
        action="store_true",
        help="the chaos run's island-2 at a quarter of the speed from start to end, not for one interval",
    )
    parser.add_argument("--commit", action="store_true", help="put the table into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.straggler:
        return straggler_main(args)
    free = run_once(args, "fault-free", faults=False, straggler=False)
    throughout = args.straggler_throughout
    chaos = run_once(args, "chaos", faults=True, straggler=throughout, straggler_window=not throughout)
    (OUT / "results.json").write_text(json.dumps({"fault_free": free, "chaos": chaos}, indent=2) + "\n")
    table = render(free, chaos, args)
    (OUT / "results.md").write_text(table + "\n")
    print(table)
    if args.commit:
        commit_block("chaos", table, heading="## Faults and stragglers")
    return 0 if free["modules"] == chaos["modules"] else 1


if __name__ == "__main__":
    sys.exit(main())
