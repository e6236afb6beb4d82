"""Hugging Face checkpoints in and out (models/hf.py, pipeline/init_from.py, pipeline/export.py).

A tiny random Llama, Mistral and Qwen2, each written with save_pretrained here, start a [2, 2] run:
at round 0 every path gives exactly the checkpoint's logits. A dense run is exported, a DiPaCo run
starts from that export, trains, is exported again, and transformers loads and generates from it.
Every bad checkpoint exits 2 with one line and leaves no run root behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY_YAML, set_args, tiny_config, write_synthetic_shards

VOCAB = 320  # the model's; the tokenizer below has fewer ids (as Qwen2's padded vocabularies do)
TEXTS = [
    "The French Revolution was a period of political and societal change in France.",
    "A recipe for bread: flour, water, salt and yeast, kneaded and left to rise overnight.",
    "The match ended in a draw after the home side scored late in the second half.",
] * 4


def tiny_tokenizer():
    """A byte-level BPE of ~300 ids with <|endoftext|> = 0, as a checkpoint ships it."""
    from pipeline.routing.tokenizer import _wrap, train_bpe

    return _wrap(train_bpe(TEXTS, 300))


def write_checkpoint(directory: Path, family: str, layers: int = 2, tokenizer: bool = True) -> Path:
    """A random checkpoint of the family with a few of its own traits: GQA, RoPE scaling, a tied
    head, Qwen2's q/k/v biases, Mistral's sliding window."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers)
    common.update(num_attention_heads=4, eos_token_id=0, bos_token_id=0, max_position_embeddings=128)
    config = {
        "llama": lambda: LlamaConfig(
            **common,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        "mistral": lambda: MistralConfig(**common, num_key_value_heads=1, sliding_window=8),
        "qwen2": lambda: Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True),
    }[family]()
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases are zero at init: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    model.save_pretrained(directory)
    if tokenizer:
        tiny_tokenizer().save_pretrained(directory)
    return directory


def hf_config(run_root: Path, checkpoint: Path, *overrides: str):
    return tiny_config(run_root, f"model.init_from={checkpoint}", *overrides)


@pytest.mark.parametrize(
    "family, layers, private",
    [("llama", 2, 0), ("mistral", 2, 0), ("qwen2", 2, 0), ("llama", 3, 1)],
    ids=["llama", "mistral", "qwen2", "llama-private-block"],
)
def test_round_0_paths_give_the_checkpoints_own_logits(tmp_path, family, layers, private):
    from transformers import AutoModelForCausalLM

    from models.grid import all_path_ids
    from pipeline import stages
    from pipeline.routing.tokenizer import load_tokenizer
    from pipeline.run import Run
    from pipeline.state.module_store import load_path_model

    checkpoint = write_checkpoint(tmp_path / family, family, layers)
    sets = [f"model.path_specific_blocks={private}"] if private else []  # the last layer: each path's own
    run = Run(hf_config(tmp_path / "run", checkpoint, *sets))
    root = stages.init_run(run)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    batch = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(batch).logits
        for path_id in all_path_ids([2, 2]):
            model = load_path_model(root, run.config, 0, path_id).eval()
            assert type(model) is type(reference)
            assert torch.equal(model(batch).logits, expected), path_id
    # the key map's way out gives the checkpoint back, tensor for tensor (a tied head as its own copy)
    from safetensors.torch import load_file

    from models.hf import path_to_hf
    from models.modular import ModelShape
    from pipeline.state.module_store import load_path_modules

    shape = ModelShape.from_config(run.config.model)
    state, config = path_to_hf(shape, load_path_modules(root, 0, (1, 0), shape, [2, 2]))
    saved = load_file(str(checkpoint / "model.safetensors"))
    saved.setdefault("lm_head.weight", saved["model.embed_tokens.weight"])
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert config.architectures == [type(reference).__name__] and config.num_hidden_layers == layers
    # the checkpoint's tokenizer, not a trained one, and its EOS
    assert run.config.model.tokenizer == "hf" and run.config.model.vocab_size == VOCAB
    assert load_tokenizer(root, "hf").eos_token_id == 0
    # a later process reads the shape from run.yaml, with no need of the source
    again = Run(hf_config(tmp_path / "run", tmp_path / family, *sets))
    assert again.config.model.init_config == run.config.model.init_config


def _dipaco(capsys, *args: str) -> str:
    """`dipaco ARGS` in this process (a fresh one would spend longer importing than working); its stdout."""
    from pipeline.cli import main

    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    return out


def test_dense_export_starts_a_dipaco_run_whose_export_loads_in_transformers(tmp_path, capsys):
    """dense run -> export -> init_from into a [2, 1] DiPaCo run -> train -> export -> from_pretrained, generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import stages
    from pipeline.routing.tokenizer import commit_bpe, train_bpe
    from pipeline.run import Run
    from pipeline.state.module_store import load_path_model

    # A dense run of one round on synthetic shards, with a BPE tokenizer of its own.
    dense_sets = ["model.grid=[1]", "model.blocks_per_level=[2]", "model.tokenizer=bpe", "model.vocab_size=512"]
    dense = tiny_config(tmp_path / "dense", *dense_sets, "train.rounds=1", "train.inner_steps=2")
    root = stages.init_run(Run(dense))
    commit_bpe(root, train_bpe(TEXTS, 512), len(TEXTS))
    write_synthetic_shards(root, [1])
    assert stages.train_path(Run(dense), 0, "p0") is not None
    stages.merge(Run(dense), 0)
    dense_args = ["--config", str(TINY_YAML), *set_args([f"run_root={tmp_path / 'dense'}", *dense_sets])]
    first = json.loads(_dipaco(capsys, "export", *dense_args, "--round", "1", "--out", str(tmp_path / "dense-export")))
    assert first["paths"] == ["p0"] and (tmp_path / "dense-export/paths/p0/model.safetensors").is_file()
    # the run root itself is a source too: its newest modules (round 1's), as the export holds them
    from_root = Run(tiny_config(tmp_path / "from-root", f"model.init_from={tmp_path / 'dense'}"))
    stages.init_run(from_root)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "dense-export/paths/p0").eval()
    batch = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        started = load_path_model(from_root.root, from_root.config, 0, "p1-1").eval()
        assert torch.equal(started(batch).logits, exported(batch).logits)

    # A DiPaCo run started from that export, trained by `dipaco run` (real data, its tokenizer).
    dipaco_sets = [
        f"run_root={tmp_path / 'dipaco'}",
        "model.tokenizer=gpt2",
        "mlflow.enabled=false",
        "train.launcher=inprocess",
        f"model.init_from={tmp_path / 'dense-export/paths/p0'}",
        "train.rounds=1",
        "model.grid=[2, 1]",  # 2 paths: DiPaCo at half the training tasks of [2, 2]
        "eval.max_docs=8",
    ]
    dipaco_args = ["--config", str(TINY_YAML), *set_args(dipaco_sets)]
    _dipaco(capsys, "run", *dipaco_args)
    out = str(tmp_path / "dipaco-export")
    second = json.loads(_dipaco(capsys, "export", *dipaco_args, "--round", "1", "--out", out))
    assert second["paths"] == ["p0-0", "p1-0"]
    assert (tmp_path / "dipaco-export/router/_SUCCESS").is_file() and "Routing" in (
        tmp_path / "dipaco-export/README.md"
    ).read_text()

    path = tmp_path / "dipaco-export/paths/p1-0"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer.eos_token_id] + tokenizer("The French Revolution", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        run = Run(tiny_config(tmp_path / "dipaco", *dipaco_sets[1:]))
        ours = load_path_model(run.root, run.config, 1, "p1-0").eval()
        assert torch.equal(ours(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits)
    assert out.shape[1] > len(ids)


def _refused(capsys, tmp_path: Path, checkpoint: str, *overrides: str) -> str:
    """`dipaco prepare` from the checkpoint: exit 2, one line on stderr, no run root written."""
    from pipeline.cli import main

    run_root = tmp_path / "refused"
    args = ["--config", str(TINY_YAML), *set_args([f"run_root={run_root}", "model.tokenizer=gpt2"])]
    args += set_args(["mlflow.enabled=false", f"model.init_from={checkpoint}", *overrides])
    capsys.readouterr()
    status = main(["prepare", *args])
    stderr = capsys.readouterr().err
    assert status == 2, stderr[-2000:]
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert not run_root.exists()
    return stderr


def test_bad_checkpoints_exit_2_with_one_line_and_load_nothing(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    assert "architecture 'GPT2LMHeadModel' is not supported" in _refused(capsys, tmp_path, str(gpt2))

    llama = write_checkpoint(tmp_path / "llama3", "llama", layers=3)
    assert "3 layers do not split as model.blocks_per_level [1, 1]" in _refused(capsys, tmp_path, str(llama))

    bare = write_checkpoint(tmp_path / "bare", "llama", tokenizer=False)
    assert "no tokenizer.json" in _refused(capsys, tmp_path, str(bare))

    lying = write_checkpoint(tmp_path / "lying", "qwen2")
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    stderr = _refused(capsys, tmp_path, str(lying))
    assert "mlp.gate_proj.weight has shape [64, 32], config.json gives [96, 32]" in stderr

    pickled = write_checkpoint(tmp_path / "pickled", "llama")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")  # never opened: the name is enough
    stderr = _refused(capsys, tmp_path, str(pickled))
    assert "pytorch_model.bin: pickle weights are never loaded" in stderr and "convert them to safetensors" in stderr

    store = f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db"
    stderr = _refused(capsys, tmp_path, "models:/nobody@champion", store)
    assert "models:/nobody@champion" in stderr and "does not resolve in the registry" in stderr
    import mlflow

    mlflow.MlflowClient(f"sqlite:///{tmp_path}/m.db").create_registered_model("somebody")  # a store, no version
    assert "does not resolve in the registry" in _refused(capsys, tmp_path, "models:/somebody/3", store)


def test_the_checkpoint_itself_routes_at_the_layer_asked(tmp_path, capsys):
    """router.embedder: model at model_round 0 of an init_from run embeds with the checkpoint: the
    mean of hidden state `router.model_layer` over the prefix, what transformers itself computes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.routing.router import Router
    from pipeline.state.storage import RunRoot

    checkpoint = write_checkpoint(tmp_path / "llama", "llama", layers=2)
    sets = [f"run_root={tmp_path / 'run'}", "mlflow.enabled=false", "train.launcher=inprocess"]
    sets += [f"model.init_from={checkpoint}", "router.embedder=model", "router.model_layer=1", "router.prefix_tokens=8"]
    _dipaco(capsys, "prepare", "--config", str(TINY_YAML), *set_args(sets))
    router = Router.load(RunRoot(str(tmp_path / "run")))
    assert router.header["embedder"] == "model" and router.header["model_layer"] == 1

    texts = [t.split(":")[0] for t in TEXTS[:3]]  # short: each its whole own prefix
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def mean_state(layer: int) -> torch.Tensor:
        rows = []
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:8]
            with torch.no_grad():
                states = reference(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            rows.append(states[layer][0].mean(0))
        return torch.stack(rows)

    ours = torch.from_numpy(router.embed_prefixes(texts))
    assert torch.allclose(ours, mean_state(1), atol=1e-5)
    assert not torch.allclose(ours, mean_state(-1), atol=1e-3)  # the layer asked, not the last

    stderr = _refused(capsys, tmp_path, str(checkpoint), "router.embedder=model", "router.model_layer=3")
    assert "router.model_layer" in stderr and "0..2" in stderr


@pytest.mark.slow  # a dense `dipaco run` with an MLflow store: Beam prepare, a round, eval, register
def test_a_registered_dense_version_starts_a_dipaco_run_by_alias_and_by_number(tmp_path, capsys):
    """init_from models:/NAME@ALIAS and models:/NAME/VERSION: the version `dipaco run` registered
    is downloaded from the registry, and every path of the new run starts from its modules."""
    from mlflow import MlflowClient

    from pipeline import stages
    from pipeline.run import Run
    from pipeline.state.module_store import load_path_model

    store = f"sqlite:///{tmp_path}/mlflow.db"
    tracking = [f"mlflow.tracking_uri={store}", "mlflow.enabled=true"]
    dense_sets = [
        "model.grid=[1]",
        "model.blocks_per_level=[2]",
        "mlflow.registered_model=dense-start",
        "train.launcher=inprocess",
        "train.rounds=1",
        "eval.max_docs=8",
        *tracking,
    ]
    _dipaco(capsys, "run", "--config", str(TINY_YAML), *set_args([f"run_root={tmp_path / 'dense'}", *dense_sets]))
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    champion = client.get_model_version_by_alias("dense-start", "champion")
    registered_round = int(champion.tags["dipaco.round"])
    dense = Run(tiny_config(tmp_path / "dense", *dense_sets, "model.tokenizer=bpe", "model.vocab_size=512"))
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))  # tiny.yaml's trained BPE
    with torch.no_grad():
        expected = load_path_model(dense.root, dense.config, registered_round, "p0").eval()(batch).logits
        for name, source in (
            ("alias", "models:/dense-start@champion"),
            ("number", f"models:/dense-start/{champion.version}"),
        ):
            run = Run(tiny_config(tmp_path / name, f"model.init_from={source}", *tracking))
            stages.init_run(run)
            assert run.config.model.tokenizer == "hf"  # the registered version's own tokenizer
            for path in ("p0-0", "p1-1"):
                started = load_path_model(run.root, run.config, 0, path).eval()
                assert torch.equal(started(batch).logits, expected), (source, path)
