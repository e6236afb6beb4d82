"""The path trainer on a real DeepSpeed engine: agreement with plain PyTorch, ZeRO stages, launch,
inner-state resume where the merged modules must win over the checkpoint's weights."""

import math
import os
import posixpath
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import REPO, tiny_config, write_synthetic_shards
from models.grid import ModuleKey
from models.modular import ModelShape, build_path_model, eos_token_id
from pipeline import stages
from pipeline.islands.launch import train_path_job
from pipeline.outer.merge import OuterOptimizer, merge_round
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import load_modules, load_path_modules
from pipeline.state.shards import read_path_documents
from pipeline.train.data import RowStream, micro_batch_start, pack_documents
from pipeline.train.distributed import child_env
from pipeline.train.train_path import adamw_for, inner_state_of, lr_at, train_path
from pipeline.train.zero import full_state, load_ds_config, set_full_state, wrap_with_zero


def reference_inner_loop(
    config, root, round_index: int, worker: int, workers: int, carried: dict | None = None
) -> dict:
    """The same inner loop in plain PyTorch (no DeepSpeed): AdamW, warmup+cosine, clipping. With
    `carried` (an earlier round's result), its model takes the round's merged modules and its
    optimizer goes on: what a path keeps between rounds."""
    shape = ModelShape.from_config(config.model)
    merged = build_path_model(shape, load_path_modules(root, round_index, (0,)))
    if carried is None:
        model, optimizer = merged, adamw_for(merged, config.train)
    else:
        model, optimizer = carried["model"], carried["optimizer"]
        model.load_state_dict(merged.state_dict())
    docs = read_path_documents(root, "p0")[worker::workers]
    stream = RowStream(
        pack_documents(docs, config.model.seq_len, config.train.seed + worker, eos_token_id(shape.vocab_size)),
        config.train.seed + worker,
    )
    train, losses = config.train, []
    for step in range(train.inner_steps):
        global_step = round_index * train.inner_steps + step
        for group in optimizer.param_groups:
            group["lr"] = lr_at(global_step, train.rounds * train.inner_steps, train)
        inputs, labels = stream.micro_batch(
            micro_batch_start(global_step, 0, 0, train.micro_batch_size, 1, 1), train.micro_batch_size
        )
        loss = F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"state": state, "loss": losses, "model": model, "optimizer": optimizer}


def test_grid_1_with_diloco_workers_equals_plain_diloco(run_root):
    """[1] trained on 2 iid shards = DiLoCo: two plain-PyTorch workers, then one Nesterov outer
    step of the averaged pseudo-gradient; the pipeline's merged module must match it."""
    config = tiny_config(
        run_root,
        "model.grid=[1]",
        "model.blocks_per_level=[2]",
        "train.workers_per_path=2",
        "train.inner_steps=3",
        "train.lr=0.003",
        "outer.weighting=uniform",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid, docs_per_path=60)
    assert stages.list_paths(config) == ["p0.w0", "p0.w1"]
    ours = {job: train_path(config, 0, job) for job in stages.list_paths(config)}
    merge_round(config, 0)

    shape = ModelShape.from_config(config.model)
    from models.modular import split_path_state

    refs = [reference_inner_loop(config, root, 0, w, 2) for w in range(2)]
    for worker, ref in enumerate(refs):
        assert ours[f"p0.w{worker}"]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    before = load_modules(root, 0, [ModuleKey(0, 0)])[ModuleKey(0, 0)]
    afters = [split_path_state(shape, ref["state"])[0] for ref in refs]
    outer = OuterOptimizer(config.outer.lr, config.outer.momentum, config.outer.nesterov)
    expected, _ = outer.outer_step(before, outer.outer_gradient(before, afters, [1.0, 1.0]), None)
    merged = load_modules(root, 1, [ModuleKey(0, 0)])[ModuleKey(0, 0)]
    for name in expected:
        torch.testing.assert_close(merged[name], expected[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_zero_stages_give_the_same_loss_curve_on_a_two_process_gloo_launch(run_root):
    workspaces_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    curves = {}
    for stage in (1, 2, 3):
        config = tiny_config(
            run_root / f"zero{stage}",
            "model.grid=[1]",
            "model.blocks_per_level=[1]",
            "train.launcher=deepspeed",
            "train.procs_per_path=2",
            "train.inner_steps=4",
            "train.lr=0.003",
            f"train.ds_config=ds_configs/zero{stage}.json",
        )
        root = stages.init_run(Run(config))
        write_synthetic_shards(root, config.model.grid)
        metrics = train_path_job(config, 0, "p0")
        assert metrics is not None, f"ZeRO-{stage} launch failed: {root.path(layout.attempts_dir(0, 'p0'))}"
        assert metrics["world_size"] == 2 and metrics["ds_config"]["zero_optimization"]["stage"] == stage
        assert metrics["ds_config"]["train_batch_size"] == 2 * config.train.micro_batch_size
        if stage == 3:  # partitioned over two ranks: DeepSpeed's memory-efficient linear, its default
            assert metrics["ds_config"]["zero_optimization"]["memory_efficient_linear"] is True
            assert metrics["ds_config"]["zero_optimization"]["reduce_scatter"] is True
            assert metrics["ds_config"]["zero_optimization"]["reduce_bucket_size"] == config.model.hidden_size**2
        # Round 1 resumes each rank's optimizer partition (its own file) on the merged modules.
        merge_round(config, 0)
        again = train_path_job(config, 1, "p0")
        assert again is not None and again["resumed_inner_state_from"] == 0, f"ZeRO-{stage} did not resume"
        inner = inner_state_of(root, 1, "p0")
        assert root.files_under(inner) == ["optimizer-rank-00000.safetensors", "optimizer-rank-00001.safetensors"]
        curves[stage] = metrics["loss"] + again["loss"]
    assert curves[1][3] < curves[1][0]  # it learns
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= workspaces_before  # both ranks unlinked theirs
    assert curves[2] == pytest.approx(curves[1], rel=1e-5)
    assert curves[3] == pytest.approx(curves[1], rel=1e-5)


@pytest.mark.slow  # ~20 s: a two-rank gloo launch and a one-rank one
def test_sync_by_gradient_accumulation_on_one_rank_equals_two_ranks_all_reducing_every_step(run_root):
    """The benchmark's `sync` row (M x the batch, gradients averaged every step) runs as
    train.gradient_accumulation_steps = M on one rank: the same global batches, the same update."""
    curves, states = {}, {}
    for name, ranks, accum in (("ranks", 2, 1), ("accumulation", 1, 2)):
        config = tiny_config(
            run_root / name,
            "model.grid=[1]",
            "model.blocks_per_level=[1]",
            "train.launcher=deepspeed",
            f"train.procs_per_path={ranks}",
            f"train.gradient_accumulation_steps={accum}",
            "train.inner_steps=5",
            "train.lr=0.003",
            "train.ds_config=ds_configs/zero1.json",
        )
        root = stages.init_run(Run(config))
        write_synthetic_shards(root, config.model.grid)
        metrics = train_path_job(config, 0, "p0")
        assert metrics is not None and metrics["world_size"] == ranks
        assert metrics["ds_config"]["train_batch_size"] == 2 * config.train.micro_batch_size
        assert metrics["tokens"] == 5 * 2 * config.train.micro_batch_size * config.model.seq_len
        curves[name] = metrics["loss"]
        states[name] = load_file(root.path(f"{layout.path_dir(0, 'p0')}/model.safetensors"))
    assert curves["ranks"][-1] < curves["ranks"][0]  # it learns
    assert curves["accumulation"] == pytest.approx(curves["ranks"], rel=1e-5)
    for name, tensor in states["ranks"].items():  # the same update, step after step
        torch.testing.assert_close(states["accumulation"][name], tensor, rtol=1e-4, atol=1e-6)


def one_rank_engine(run_root, ds_config: str, blocks: int = 1):
    """A path model wrapped by DeepSpeed in this process (one rank), as train_path wraps it."""
    config = tiny_config(
        run_root, "model.grid=[1]", f"model.blocks_per_level=[{blocks}]", f"train.ds_config=ds_configs/{ds_config}.json"
    )
    shape = ModelShape.from_config(config.model)
    engine = wrap_with_zero(
        model := build_path_model(shape, seed=0), adamw_for(model, config.train), load_ds_config(config.train, shape, 1)
    )
    return engine, shape, config


def next_token_steps(engine, inputs: torch.Tensor, steps: int) -> list[float]:
    """`steps` optimizer steps on `inputs`; returns each step's loss."""
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(engine(input_ids=inputs).logits.flatten(0, 1), inputs.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def plain_pytorch_steps(shape: ModelShape, config, inputs: torch.Tensor, steps: int) -> list[float]:
    """The reference for `next_token_steps`: the same path from the same seed, stepped by plain
    PyTorch AdamW with the trainer's clipping; returns each step's loss."""
    model = build_path_model(shape, seed=0)
    optimizer, losses = adamw_for(model, config.train), []
    for _ in range(steps):
        loss = F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), inputs.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("ds_config", ["zero1", "zero2", "zero3", "zero2_offload"])
def test_written_parameters_survive_a_step_in_every_zero_stage(ds_config, run_root):
    """The trap: DeepSpeed restores its fp32 master copy at step(); our writer must persist."""
    engine, shape, _ = one_rank_engine(run_root, ds_config)
    inputs = torch.randint(0, shape.vocab_size, (2, 8))
    engine.backward(engine(input_ids=inputs).logits.mean())
    engine.step()  # optimizer state now exists
    target = {k: v + 0.5 for k, v in full_state(engine).items()}
    set_full_state(engine, target)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0  # a step that must not move anything
    engine.backward(engine(input_ids=inputs).logits.mean())
    engine.step()
    for name, value in full_state(engine).items():
        torch.testing.assert_close(value, target[name], rtol=0, atol=1e-6)
    reference = build_path_model(shape)
    reference.load_state_dict(target, strict=False)
    torch.testing.assert_close(
        engine(input_ids=inputs).logits, reference(input_ids=inputs).logits, rtol=1e-5, atol=1e-5
    )


def test_zero3_gathers_each_transformer_block_as_one_unit(run_root):
    """ds_configs/zero3.json names the decoder layer a ZeRO-3 leaf module: one parameter fetch
    and release per block instead of one per linear and norm (benchmarks/RESULTS.md: ZeRO-3's cost
    per optimizer step on the default path is now close to ZeRO-2's)."""
    from deepspeed.utils import z3_leaf_module

    engine, _, _ = one_rank_engine(run_root, "zero3", blocks=2)
    blocks = list(engine.module.model.layers)
    assert len(blocks) == 2 and all(z3_leaf_module(block) for block in blocks)
    assert not any(z3_leaf_module(child) for block in blocks for child in block.modules() if child is not block)


def record_calls(monkeypatch, owner, name: str) -> list[tuple]:
    """Replace `owner.name` by a wrapper that records each call's positional arguments and still
    calls the real thing; returns the record."""
    calls: list[tuple] = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def test_one_rank_zero3_leaves_torch_linear_in_place(run_root):
    """On one rank ZeRO-3 partitions nothing, so its memory-efficient linear would save nothing;
    "auto" turns it off there, and the process keeps torch's own linear (DeepSpeed's replaces it
    for every model the process builds afterwards, the benchmark's plain loop included)."""
    engine, shape, config = one_rank_engine(run_root, "zero3")
    assert load_ds_config(config.train, shape, 1)["zero_optimization"]["memory_efficient_linear"] is False
    assert torch.nn.functional.linear is torch._C._nn.linear
    losses = next_token_steps(engine, torch.randint(0, shape.vocab_size, (2, config.model.seq_len)), 3)
    assert losses[2] < losses[0]


def test_one_rank_zero3_all_reduces_instead_of_scattering_and_steps_like_plain_pytorch(run_root, monkeypatch):
    """On one rank ZeRO-3's reduce-scatter scatters to itself, yet gloo copies every gradient
    through it (13 ms for the default path's embedding). "auto" turns reduce_scatter off there and
    sizes the bucket for the largest tensor, so every gradient takes ZeRO-3's all-reduce, a no-op
    on one rank; the steps must still be plain PyTorch's AdamW steps with clipping."""
    import deepspeed.comm

    engine, shape, config = one_rank_engine(run_root, "zero3", blocks=2)
    zero = load_ds_config(config.train, shape, 1)["zero_optimization"]
    assert zero["reduce_scatter"] is False and zero["reduce_bucket_size"] >= shape.largest_parameter
    scattered = record_calls(monkeypatch, deepspeed.comm, "reduce_scatter_fn")
    inputs = torch.randint(0, shape.vocab_size, (2, config.model.seq_len), generator=torch.Generator().manual_seed(0))
    ours = next_token_steps(engine, inputs, 3)
    assert scattered == []
    assert ours == pytest.approx(plain_pytorch_steps(shape, config, inputs, 3), rel=1e-5)
    assert ours[2] < ours[0]


def test_one_rank_zero2_flushes_its_gradient_bucket_once_a_step(run_root, monkeypatch):
    """On one rank ZeRO-2 has nothing to reduce, yet it flushes its gradient bucket through its
    bookkeeping and a gloo call every time the bucket fills (~50 times a step on the default path
    with a hidden² bucket). "auto" sizes the bucket for the whole path there: one flush a step, and
    the steps are still plain PyTorch's."""
    engine, shape, config = one_rank_engine(run_root, "zero2", blocks=2)
    zero = load_ds_config(config.train, shape, 1)["zero_optimization"]
    assert zero["reduce_bucket_size"] == shape.parameter_count == sum(p.numel() for p in engine.module.parameters())
    flushes = record_calls(monkeypatch, engine.optimizer, "reduce_ipg_grads")
    inputs = torch.randint(0, shape.vocab_size, (2, config.model.seq_len), generator=torch.Generator().manual_seed(0))
    ours = next_token_steps(engine, inputs, 3)
    assert len(flushes) == 3
    assert ours == pytest.approx(plain_pytorch_steps(shape, config, inputs, 3), rel=1e-5)


def test_zero3_step_starts_no_processes(run_root, monkeypatch):
    """An in-process rank carries the LOCAL_SIZE the deepspeed launcher gives launched ranks;
    without it DeepSpeed's CPU accelerator runs `numactl --hardware` each time ZeRO-3 reduces a
    gradient bucket, about 35 process starts per optimizer step on the default path."""
    engine, shape, config = one_rank_engine(run_root, "zero3", blocks=2)
    started = record_calls(monkeypatch, subprocess, "Popen")
    next_token_steps(engine, torch.randint(0, shape.vocab_size, (2, config.model.seq_len)), 2)
    assert started == []


def test_a_rank_leaves_no_shared_memory_behind():
    """DeepSpeed's CPU comm op creates a 69 MB workspace per rank in /dev/shm (RAM) and never
    removes it; init_distributed unlinks it once every rank has mapped it, so a finished or killed
    job leaves nothing behind (192 leftovers, 13 GB, once pushed a benchmark out of memory)."""
    code = (
        "import os, deepspeed.comm.comm as c; from pipeline.train.distributed import init_distributed; "
        "init_distributed(); print(c.cdb.shm_comm_op is not None, os.environ['MASTER_PORT'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    has_shm_op, port = done.stdout.split()[-2:]
    assert has_shm_op == "True"  # the workspace was created: the check below is not vacuous
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_resumed_inner_state_starts_from_the_merged_modules_not_the_checkpoint(run_root):
    """Between rounds a path keeps its optimizer (AdamW's step and moments, in safetensors) and takes
    the merged modules as its weights: plain PyTorch doing exactly that, one optimizer across the
    merge, gives round 1 the same losses and trained weights."""
    config = tiny_config(
        run_root, "model.grid=[1]", "model.blocks_per_level=[1]", "train.inner_steps=3", "train.lr=0.01", "outer.lr=0.5"
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    train_path(config, 0, "p0")
    merge_round(config, 0)
    kept = inner_state_of(root, 0, "p0")
    assert kept is not None and root.is_committed(kept)
    assert root.files_under(kept) == ["optimizer-rank-00000.safetensors"]  # data, not a pickle; no weights
    assert not any(name.startswith("optimizer-") for name in root.marker(layout.path_dir(0, "p0"))["files"])
    resumed = train_path(config, 1, "p0")
    assert resumed["resumed_inner_state_from"] == 0
    carried = reference_inner_loop(config, root, 1, 0, 1, carried=reference_inner_loop(config, root, 0, 0, 1))
    assert resumed["loss"] == pytest.approx(carried["loss"], rel=1e-5)
    trained = load_file(root.path(f"{layout.path_dir(1, 'p0')}/model.safetensors"))
    for name, tensor in carried["state"].items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-4, atol=1e-6)

    # The first loss of round 1 is the merged model's loss on round 1's first batch; the
    # checkpoint's (round-0 trained) weights give a different one.
    shape = ModelShape.from_config(config.model)
    docs = read_path_documents(root, "p0")
    stream = RowStream(
        pack_documents(docs, config.model.seq_len, config.train.seed, eos_token_id(shape.vocab_size)), config.train.seed
    )
    inputs, labels = stream.micro_batch(
        micro_batch_start(config.train.inner_steps, 0, 0, config.train.micro_batch_size, 1, 1),
        config.train.micro_batch_size,
    )

    def loss_of(model):
        with torch.no_grad():
            return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten()).item()

    merged_loss = loss_of(build_path_model(shape, load_path_modules(root, 1, (0,))))
    from models.modular import split_path_state
    from pipeline.state.module_store import decode

    trained = split_path_state(shape, decode(root.read_committed(layout.path_dir(0, "p0"), "model.safetensors"), "p0"))
    checkpoint_loss = loss_of(build_path_model(shape, trained))
    assert resumed["loss"][0] == pytest.approx(merged_loss, rel=1e-5)
    assert abs(checkpoint_loss - merged_loss) > 1e-3

    # A second step from the merged weights plus the resumed Adam moments must also differ from
    # a fresh-optimizer run: the state really was restored.
    root.remove(layout.path_dir(1, "p0"))
    root.remove(f"{kept}/_SUCCESS")  # the state is lost: restart cleanly
    fresh = train_path(config, 1, "p0")
    assert fresh["resumed_inner_state_from"] is None
    assert fresh["loss"][0] == pytest.approx(merged_loss, rel=1e-5)
    assert fresh["loss"][1:] != pytest.approx(resumed["loss"][1:], rel=1e-6)


def test_shards_with_ids_past_the_vocabulary_are_named_before_training(run_root):
    """Shards tokenized with more ids than model.vocab_size (GPT-2's 50,257 into a 512-row table)
    failed at the first step with torch's "index out of range in self"; the shard is named instead."""
    from pipeline.core.errors import InputError

    config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[1]")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid, vocab=1024)
    with pytest.raises(InputError, match=r"shards/path=p0: token id \d+ is past model.vocab_size 256 .*at least"):
        train_path(config, 0, "p0")
    assert not root.exists(layout.path_dir(0, "p0"))


def test_only_the_newest_inner_state_is_kept(run_root):
    config = tiny_config(run_root, "model.grid=[1]", "model.blocks_per_level=[1]", "train.inner_steps=1")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    for round_index in range(2):
        train_path(config, round_index, "p0")
        merge_round(config, round_index)
    assert root.listdir(layout.inner_state_dir(0, "p0")) == ["kept.json"]  # it was kept; round 1's is resumed
    assert inner_state_of(root, 1, "p0") is not None
    kept = posixpath.basename(inner_state_of(root, 1, "p0"))
    assert root.listdir(layout.inner_state_dir(1, "p0")) == sorted([kept, "kept.json"])
    assert root.is_committed(layout.path_dir(0, "p0"))  # the trained weights stay


@pytest.mark.parametrize("ds_config", ["zero2", "zero3"])
def test_a_process_that_trains_path_after_path_keeps_no_engine(ds_config, run_root):
    """The in-process launcher, the quality benchmark and the tests train path after path in one
    process: each finished engine must be freed (DeepSpeed kept every ZeRO-2 engine until
    `destroy()`, and every ZeRO-3 engine in a method's lru_cache and a module-level stack)."""
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    def live_engines() -> int:
        gc.collect()
        return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())

    config = tiny_config(
        run_root,
        "model.grid=[2]",
        "model.blocks_per_level=[1]",
        "train.inner_steps=2",
        f"train.ds_config=ds_configs/{ds_config}.json",
    )
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    before = live_engines()
    for path_id in ("p0", "p1"):
        assert train_path(config, 0, path_id)["tokens"] > 0
    assert live_engines() == before


def test_a_one_rank_job_whose_probed_port_was_taken_picks_another(tmp_path):
    """A one-rank job only probes its MASTER_PORT free; when another socket holds it by the time
    the store binds (an MLflow keep-alive connection did, in a run tracked over HTTP), the job takes
    a fresh port instead of failing every attempt."""
    import socket
    import subprocess
    import sys

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    script = (
        "import os\nfrom pipeline.train.distributed import close_distributed, init_distributed\n"
        "print(init_distributed(), os.environ['MASTER_PORT'])\nclose_distributed()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, "MASTER_PORT": str(taken)},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    finally:
        holder.close()
    assert done.returncode == 0, done.stderr[-2000:]
    ranks, port = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert ranks == "(0, 1)" and int(port) != taken


def test_plots_of_a_run_where_no_module_was_merged_still_render(tmp_path):
    """Every path of a round can fail (the merge then keeps every module): the run's plots must
    still be drawn, not end the run with a matplotlib error."""
    from pipeline.tracking import plots

    for name, fig in {
        "heatmap": plots.grad_norm_heatmap({}),
        "loss": plots.loss_curves({}, 4),
        "docs": plots.docs_per_path({}),
        "ppl": plots.perplexity_by_round({}, {}),
        "bpb": plots.perplexity_by_round({}, {}, metric="bits_per_byte"),
    }.items():
        fig.savefig(tmp_path / f"{name}.png")
        plots.close(fig)
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_lr_decays_only_over_the_last_lr_decay_steps(tmp_path):
    """train.lr_decay_steps: warmup, a constant lr, then a cosine to lr * min_lr_ratio over the run's
    last N steps (warmup-stable-decay); null keeps the plain cosine over every step after warmup."""
    train = tiny_config(
        tmp_path, "train.lr=0.01", "train.warmup_steps=2", "train.min_lr_ratio=0.0", "train.lr_decay_steps=4"
    ).train
    lrs = [lr_at(step, 10, train) for step in range(10)]
    assert lrs[:2] == [0.005, 0.01] and lrs[2:7] == [0.01] * 5  # warmup, then constant until step 6
    assert lrs[6:] == pytest.approx(
        [0.01, 0.01 * 0.5 * (1 + math.cos(math.pi / 4)), 0.005, 0.01 * 0.5 * (1 + math.cos(3 * math.pi / 4))]
    )
    plain = tiny_config(tmp_path, "train.lr=0.01", "train.warmup_steps=2", "train.min_lr_ratio=0.0").train
    assert [lr_at(s, 10, plain) for s in range(2, 10)] == pytest.approx(
        [0.005 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)]
    )
