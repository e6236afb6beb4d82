"""The claims table's wiring: the pool's equal worker-rounds, bytes against sync, the documents'
noise of a difference, every target's verdict, and every claims row a config the pipeline accepts."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks import claims, quality
from benchmarks.quality_report import quality_lines


@pytest.mark.parametrize("rounds", [1, 2, 3, 5, 8, 24])
def test_the_pool_trains_as_many_worker_rounds_as_a_constant_pool(rounds):
    schedule = claims.pool_schedule(rounds, 4)
    assert len(schedule) == rounds and sum(schedule) == 4 * rounds
    assert all(1 <= m <= 6 for m in schedule)
    assert rounds < 2 or len(set(schedule)) > 1  # it does change size
    assert claims.pool_schedule(8, 4) == [2, 4, 6, 4, 2, 4, 6, 4]


def test_every_claims_row_runs_on_both_corpora_and_is_a_valid_config(tmp_path):
    args = quality.QualityArgs(**{**quality.QUICK, "out": str(tmp_path)})
    rows = quality.variants(args)
    names = {
        "dense",
        "sync_m2",
        "sync_m4",
        "diloco_m1",
        "diloco_m2",
        "diloco_m4",
        "diloco_m4_olr0.4",
        "diloco_m4_olr1",
        "diloco_m4_avg",
        "noniid_m4",
        "pool_m4",
        "dipaco_2x2",
        "dipaco_4x4",
        "warm_sync_m4",
        "warm_diloco_m4",
        "warm_dipaco_2x2",
    }
    for corpus in ("wiki", "mixed"):
        assert {v.name for v in rows if v.corpus == corpus} == names
    for v in rows:
        config = quality.variant_config(args, v, str(tmp_path / v.run_name), "data/x/*.json.gz")  # validated
        assert v.token_multiple(args) == {
            "dense": 1,
            "diloco_m1": 1,
            "sync_m2": 2,
            "diloco_m2": 2,
            "dipaco_4x4": 16,
        }.get(v.name, 4)
        if v.name == "pool_m4":
            assert config.train.workers_per_path == max(config.train.workers_schedule) == 6
        if v.name == "diloco_m4_avg":  # averaging only: no outer optimizer, but it sends what DiLoCo sends
            assert (config.outer.lr, config.outer.momentum, config.train.workers_per_path) == (1.0, 0.0, 4)
            assert v.communication == "outer"
        if v.name.startswith("sync"):
            assert config.train.gradient_accumulation_steps == v.token_multiple(args) and config.outer.lr == 1.0
        if v.name.startswith("warm_"):  # a quarter dense at 4x batch, then the row from its run root: equal tokens
            base = quality.warm_base(v)
            assert (v.warm_rounds, base.grid, base.accum, base.token_multiple(args)) == (1, (1,), 4, 4)
            rest = quality.variant_config(v.rest(args), v, "runs/x", "data/x/*.json.gz", "runs/warm", 1)
            assert (rest.train.rounds, rest.model.init_from, rest.model.init_round) == (1, "runs/warm", 1)
    assert {v.name for v in quality.variants(quality.QualityArgs(**quality.LONG))} >= names
    assert {v.name for v in quality.variants(quality.QualityArgs())} == names - {
        "diloco_m4_olr0.4",
        "diloco_m4_olr1",
        "diloco_m4_avg",
        "dipaco_4x4",
        "warm_sync_m4",
        "warm_diloco_m4",
        "warm_dipaco_2x2",
    }  # make bench: no extras, no warm start (bench-long has them)


def test_bytes_per_round_and_the_ratio_to_sync_at_the_same_tokens():
    merges = [{"bytes_outer": 8, "bytes_data_parallel": 200, "jobs": 4}] * 3  # 4 jobs, 2 x 1 byte each, H = 25
    diloco = claims.communication({"communication": "outer", "merges": merges})
    assert diloco["per_round"] == 8 and diloco["ratio_to_sync"] == pytest.approx(1 / 25)
    assert diloco["cumulative"] == [0, 8, 16, 24]
    sync = claims.communication(
        {
            "communication": "data_parallel",
            "accum": 4,
            "merges": [{"bytes_outer": 2, "bytes_data_parallel": 50, "jobs": 1}] * 3,
        }
    )
    assert sync["per_round"] == 200 and sync["ratio_to_sync"] == 1  # what 4 data-parallel ranks all-reduce
    assert claims.communication({"communication": "none", "merges": merges})["per_round"] == 0


def _run(name: str, seed: int, bpb: float, corpus: str = "wiki", docs: dict | None = None) -> dict:
    return {
        "name": name,
        "run": f"{corpus}_{name}_s{seed}",
        "corpus": corpus,
        "seed": seed,
        "suite": "claims",
        "what": name,
        "bits_per_byte": bpb,
        "perplexity": 2 ** (bpb * 4),
        "token_multiple": 1,
        "tokens": 1000,
        "steps_per_path": 10,
        "jobs": 1,
        "grid": [1],
        "eval_tokens": 50,
        "non_embedding_params": 1,
        "communication": "none",
        "accum": 1,
        "merges": [],
        "seconds": 1.0,
        "docs": docs or {},
        "evals": [
            {
                "round": r,
                "steps_per_path": 5 * r,
                "bits_per_byte": bpb + 1 - r / 2,
                "perplexity": 2 ** ((bpb + 1 - r / 2) * 4),
            }
            for r in range(3)
        ],
    }


def test_the_targets_are_judged_seed_paired_on_each_corpus():
    runs = []
    for corpus in ("wiki", "mixed"):
        for s, base in enumerate((2.00, 2.05, 1.98)):
            runs += [
                _run("dense", s, base, corpus),
                _run("diloco_m1", s, base - 0.02, corpus),
                _run("sync_m4", s, base - 0.2, corpus),
                _run("diloco_m4", s, base - 0.2 + 0.1, corpus),
                _run("pool_m4", s, base - 0.1 + [0.003, -0.004, 0.002][s], corpus),
                _run("dipaco_2x2", s, base - 0.12 + [0.05, -0.05, 0.0][s], corpus),
            ]
    got = {(t["corpus"], t["a"], t["b"]): t["verdict"] for t in claims.evaluate_targets(runs)}
    assert got[("wiki", "diloco_m1", "dense")] == "met"
    assert got[("wiki", "diloco_m4", "sync_m4")] == "missed"  # 0.1 above, far beyond 2 % of ~1.8
    assert got[("wiki", "pool_m4", "diloco_m4")] == "met"  # within 1 % either way on every seed
    assert got[("mixed", "dipaco_2x2", "diloco_m4")] == "unresolved"  # -0.02 ± a lot
    assert ("wiki", "dipaco_2x2", "diloco_m4") not in got  # that target is the mixed corpus's
    assert ("wiki", "diloco_m2", "sync_m2") not in got  # rows not run: no verdict
    trends = {(t["corpus"], t["a"], t["b"]): t["trend"] for t in claims.evaluate_targets(runs)}
    assert all(trends[k] == "" for k, v in got.items() if v == "met")
    assert trends[("wiki", "diloco_m4", "sync_m4")].startswith("gap in bits/byte over the last 3 evaluations +0.")
    assert "perplexity" in trends[("wiki", "dipaco_2x2", "dense")] or got[("wiki", "dipaco_2x2", "dense")] == "met"


def test_the_pool_target_is_two_sided():
    const = {0: 2.0, 1: 2.1, 2: 1.9}
    assert (
        claims.two_sided({s: v * 0.95 for s, v in const.items()}, const, 0.01)[0] == "missed"
    )  # 5 % better is off too
    assert claims.two_sided({s: v * 1.002 for s, v in const.items()}, const, 0.01)[0] == "met"
    assert claims.two_sided({0: 2.0}, {0: 2.0}, 0.01)[0] == "met (1 seed)"


def test_the_documents_noise_of_a_difference_cancels_what_both_rows_find_hard():
    rng = random.Random(0)
    hard = {f"d{i}": rng.uniform(0.5, 3.0) for i in range(300)}  # nats per byte every model shares
    sizes = {k: rng.randint(100, 400) for k in hard}
    a = {k: [hard[k] * sizes[k], sizes[k] // 3, sizes[k]] for k in hard}
    b = {k: [(hard[k] + rng.gauss(0, 0.02)) * sizes[k], sizes[k] // 3, sizes[k]] for k in hard}
    ra, rb = _run("x", 0, 1.0, docs=a), _run("y", 0, 1.0, docs=b)
    alone, paired = claims.run_noise(ra), claims.paired_noise(ra, rb)
    assert 0 < paired < alone / 10
    bits = [v[0] / math.log(2) for v in a.values()]
    assert sum(bits) / sum(v[2] for v in a.values()) == pytest.approx(
        sum(hard[k] * sizes[k] for k in hard) / math.log(2) / sum(sizes.values())
    )


def test_the_report_renders_every_row_a_failed_one_and_the_targets():
    runs = [_run(n, s, 2.0 + 0.01 * s) for n in ("dense", "diloco_m1") for s in range(3)]
    runs.append({**_run("pool_m4", 0, 2.0), "failed": "ConfigError: worker 4 does not train in a round of 2 worker(s)"})
    q = {
        "format": 2,
        "runs": runs,
        "seconds": 1.0,
        "prepare_seconds": 0.5,
        "same_eval_tokens": {"wiki": True},
        "args": {**vars(quality.QualityArgs()), "seeds": 3},
    }
    text = "\n".join(quality_lines(q, ""))
    assert "| dense |" in text and "| diloco_m1 |" in text and "**failed**: wiki_pool_m4_s0: ConfigError" in text
    assert "| wiki | diloco_m1 <= dense (bits/byte) |" in text
    assert "crosses" not in text  # no extrapolation


def test_an_interrupted_quality_run_keeps_only_measured_runs_of_the_same_sizes(tmp_path):
    """bench-long takes about two hours: started again, it reuses what it measured, never a failed
    run, nothing measured at other sizes, and nothing from a record that does not say its sizes."""
    args = quality.QualityArgs(**{**quality.LONG, "out": str(tmp_path)})
    partial = tmp_path / "quality.partial.json"
    done = {"run": "wiki_dense_s0", "bits_per_byte": 2.4}
    failed = {"run": "wiki_sync_m4_s0", "failed": "RuntimeError: killed"}
    quality.write_partial(partial, args, [done, failed, {"run": "wiki_gone_s0", "bits_per_byte": 9.9}])
    assert not list(tmp_path.glob("*.tmp"))
    wanted = {"wiki_dense_s0", "wiki_sync_m4_s0"}

    assert quality.finished_runs(partial, args, wanted) == [done]
    more_lanes = quality.QualityArgs(**{**quality.LONG, "out": str(tmp_path), "lanes": 1})
    assert quality.finished_runs(partial, more_lanes, wanted) == [done]  # lanes change the time only
    bigger = quality.QualityArgs(**{**quality.LONG, "out": str(tmp_path), "hidden": 128})
    assert quality.finished_runs(partial, bigger, wanted) == []
    partial.write_text('[{"run": "wiki_dense_s0", "bits_per_byte": 2.4}]')  # the old format: no sizes
    assert quality.finished_runs(partial, args, wanted) == []
    partial.write_text('{"args": ')  # torn
    assert quality.finished_runs(partial, args, wanted) == []
    assert quality.finished_runs(tmp_path / "missing.json", args, wanted) == []


def test_the_warm_start_gap_is_diloco_minus_sync_from_scratch_and_warm_started_paired_by_seed():
    values = {
        "diloco_m4": [2.10, 2.12, 2.11],
        "sync_m4": [2.00, 2.01, 2.02],
        "warm_diloco_m4": [1.95, 1.96, 1.97],
        "warm_sync_m4": [1.92, 1.93, 1.94],
    }
    runs = [
        {"corpus": "wiki", "name": name, "seed": s, "bits_per_byte": v}
        for name, vals in values.items()
        for s, v in enumerate(vals)
    ]
    (gap,) = claims.warm_start_gaps(runs)
    assert gap["seeds"] == 3 and gap["scratch_gap"].startswith("0.1000") and gap["warm_gap"].startswith("0.0300")
    assert gap["closed"].startswith("0.0700") and gap["closed_share"] == pytest.approx(0.7)
    assert claims.warm_start_gaps([r for r in runs if not r["name"].startswith("warm")]) == []
