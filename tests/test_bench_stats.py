"""The quality table's seed statistics: intervals and verdicts a sceptical reader can check by hand."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.stats import estimate, evaluation_noise, verdict


def test_the_interval_of_three_seeds_is_the_student_t_one():
    e = estimate([1.0, 2.0, 3.0])
    assert e.mean == 2.0 and e.n == 3
    assert e.half_width == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)  # t(0.975, 2) x sd / sqrt(n)
    assert estimate([1.5]).text() == "1.5000 (1 seed)"


def test_a_target_is_met_missed_or_unresolved_by_where_the_interval_lies():
    base = {0: 2.00, 1: 2.02, 2: 1.98}
    assert verdict({s: v - 0.10 for s, v in base.items()}, base)[0] == "met"  # paired: the same shift every seed
    assert verdict({s: v + 0.10 for s, v in base.items()}, base)[0] == "missed"
    noisy = {0: 1.90, 1: 2.10, 2: 2.01}
    assert verdict(noisy, base)[0] == "unresolved"  # seed by seed it is better, worse, worse
    assert verdict({0: 2.05}, {0: 2.00}, factor=1.02)[0] == "missed (1 seed)"  # 2.05 > 2.00 x 1.02
    assert verdict({0: 2.05}, {0: 2.00}, factor=1.02)[1].mean == pytest.approx(2.05 - 2.04)


def test_unpaired_rows_use_welchs_interval():
    rng = random.Random(0)
    a = {s: 2.0 + rng.gauss(0, 0.01) for s in range(5)}
    b = {s + 10: 2.2 + rng.gauss(0, 0.01) for s in range(5)}
    state, diff = verdict(a, b)
    assert state == "met" and diff.mean == pytest.approx(-0.2, abs=0.03) and 0 < diff.half_width < 0.05


def test_the_evaluation_noise_shrinks_with_more_documents():
    rng = random.Random(1)

    def noise(n):
        sizes = [rng.randint(200, 800) for _ in range(n)]
        return evaluation_noise([s * rng.uniform(1.5, 2.5) for s in sizes], sizes)

    small, large = noise(50), noise(5000)
    assert 0 < large < small / 5


def test_the_trainer_figure_over_launches_keeps_each_launch_and_judges_only_where_they_agree():
    """benchmarks.perf spreads the default path's blocks over three launches (two launches minutes
    apart gave ZeRO-3 0.910 and 0.984): the ratio is the median of the launches', every launch's is
    kept, and 0.95 is met or missed only if all agree."""
    from benchmarks.perf import merge_launches
    from benchmarks.run import launches_verdict

    def launch(plain, zero, ratio, flops):
        seconds = {"plain": plain, "zero2": zero}
        return {
            "world_size": 1, "threads": 2, "cpu_count": 2, "device": "cpu", "tokens_per_block": 2048,
            "steps_per_block": 1, "reps": 2, "model_flops_per_token": 1e6, "args": {"modes": "plain,zero2"},
            "seconds": seconds, "tokens_per_s": {m: 2048 / sorted(s)[len(s) // 2] for m, s in seconds.items()},
            "ratio_to_plain": {"plain": 1.0, "zero2": ratio},
            "extra_seconds_per_step": {"plain": 0.0, "zero2": 1 / ratio - 1},
            "plain_seconds_per_step": plain[0], "matmul_flops": flops, "launch_seconds": 30.0,
        }  # fmt: skip

    runs = [launch([1.0, 1.0], [1.1, 1.1], 0.91, 5e9), launch([3.0, 3.0], [3.1, 3.1], 0.98, 6e9)]
    runs.append(launch([2.0, 2.0], [2.1, 2.1], 0.95, 4e9))
    merged = merge_launches(runs)
    assert merged["ratio_by_launch"]["zero2"] == [0.91, 0.98, 0.95] and merged["ratio_to_plain"]["zero2"] == 0.95
    assert merged["extra_seconds_per_step"]["zero2"] == pytest.approx(1 / 0.95 - 1)
    assert merged["seconds"]["plain"] == [1.0, 1.0, 3.0, 3.0, 2.0, 2.0] and merged["plain_seconds_per_step"] == 2.0
    assert merged["launches"] == 3 and merged["reps"] == 6 and merged["matmul_flops"] == 6e9
    assert merged["mfu"]["plain"] == pytest.approx(1024 * 1e6 / 6e9)  # 2,048 tokens in the median 2 s
    assert launches_verdict(merged["ratio_by_launch"]["zero2"], 0.95) == "unresolved (launches 0.910-0.980)"
    assert launches_verdict([0.95, 0.97, 0.99], 0.95) == "meets"
    assert launches_verdict([0.90, 0.93, 0.949], 0.95) == "**misses**"


def test_the_object_store_benchmarks_repeats_alternate_roots_and_pool_before_the_ratio():
    """`benchmarks.object_store --repeat N`: local, S3, S3, local (a machine slowing down through the
    invocation favours neither root), and the ratio is of the pooled means, with each pair's shown."""
    import argparse

    from benchmarks.object_store import pooled, render, run_order

    assert run_order(1) == ["local", "s3"] and run_order(2) == ["local", "s3", "s3", "local"]

    def fig(steady: float, utilisation: float = 0.95) -> dict:
        phases = {"load": steady / 2, "engine": 0.02, "commit": steady / 2 - 0.02}
        return {
            "seconds": 200.0,
            "task_overhead_seconds": 2 * steady,
            "steady_task_overhead_seconds": steady,
            "steady_phases": phases,
            "task_commit_seconds": 0.1,
            "utilisation": utilisation,
        }

    locals_, s3s = [fig(0.20), fig(0.30)], [fig(0.40, 0.94), fig(0.35, 0.96)]
    assert pooled(locals_)["steady_task_overhead_seconds"] == pytest.approx(0.25)
    assert pooled(s3s)["utilisation"] == pytest.approx(0.95)
    args = argparse.Namespace(config="configs/demo.yaml", rounds=4, repeat=2, store_cpu=None, set=[])
    table = render(locals_, s3s, args)
    assert "1.50x past round 0" in table and ": met." in table  # 0.375 / 0.25, not the mean of 2.00x and 1.17x
    assert "run by run, past round 0: 2.00x, 1.17x" in table
    assert "| s3 (moto, loopback), pooled |" in table and "| local, run 2 |" in table
    # the store on a core of its own and the overrides are part of the command the table names
    pinned = render(locals_, s3s, argparse.Namespace(**{**vars(args), "store_cpu": 1, "set": ["train.islands=1"]}))
    assert "--rounds 4 --repeat 2 --store-cpu 1 --set train.islands=1`" in pinned


def test_the_object_store_benchmarks_store_runs_on_the_core_it_is_given():
    """`--store-cpu`: moto's server and every thread it starts stay on that core, as a store on its
    own machine would leave the islands' cores alone (the figure it gives means nothing otherwise)."""
    import os
    from pathlib import Path

    from s3_endpoint import start_moto

    core = min(os.sched_getaffinity(0))
    server = start_moto(cpus={core})
    try:
        server.new_bucket()  # a request or two: the threads that answer exist now
        tasks = Path(f"/proc/{server.process.pid}/task")
        allowed = {
            line.split(":", 1)[1].strip()
            for task in tasks.iterdir()
            for line in (task / "status").read_text().splitlines()
            if line.startswith("Cpus_allowed_list:")
        }
        assert allowed == {str(core)}
    finally:
        server.stop()
