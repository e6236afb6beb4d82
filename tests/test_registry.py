"""The registered pyfunc: versions and aliases per round, and a model that loads in a fresh process
and generates exactly what its routed path model generates."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from conftest import REPO, run_script_json, tiny_config
from pipeline import stages
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.storage import RunRoot
from pipeline.tracking.tracker import get_tracker, tracking_uri

TOPICS = {
    "sport": "football match team goal player season league coach stadium score win cup",
    "food": "recipe cook kitchen bread butter flour oven sugar taste dinner soup garlic",
    "space": "planet star orbit galaxy rocket telescope moon astronaut solar comet light",
    "music": "song guitar band album concert piano melody singer rhythm drum stage tour",
}
PROMPTS = ["The football team scored a goal in the cup match", "Bake the bread in a hot oven with butter"]


def write_c4(out: Path, train_per_topic: int = 12, eval_per_topic: int = 3) -> dict[str, str]:
    """Tiny C4-format splits (JSON lines with text/url/timestamp), four separable topics."""
    rng = random.Random(0)
    for split, n in (("train", train_per_topic), ("validation", eval_per_topic)):
        (out / split).mkdir(parents=True, exist_ok=True)
        with open(out / split / "c4-00000.json", "w") as handle:
            for topic, words in TOPICS.items():
                for i in range(n):
                    text = " ".join(" ".join(rng.choices(words.split(), k=8)) + "." for _ in range(10))
                    record = {
                        "text": f"A {topic} story. {text}",
                        "url": f"https://example.com/{split}/{topic}/{i}",
                        "timestamp": "2019-04-25T00:00:00Z",
                    }
                    handle.write(json.dumps(record) + "\n")
    return {"train": str(out / "train" / "*.json"), "eval": str(out / "validation" / "*.json")}


def real_text_config(run_root: Path, data: dict[str, str], *overrides: str):
    """tiny.yaml on real text: a BPE trained by prepare, tracking on, an experiment of the test's own."""
    return tiny_config(
        run_root,
        "model.tokenizer=bpe",
        "model.vocab_size=512",
        f"data.train={data['train']}",
        f"data.eval={data['eval']}",
        "mlflow.enabled=true",
        *overrides,
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A run root with a fitted router and shards (the real Beam job) and round 0's modules."""
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    base = tmp_path_factory.mktemp("registry")
    config = real_text_config(
        base / "run", write_c4(base / "c4"), "mlflow.experiment=test-registry", "mlflow.registered_model=dipaco-test"
    )
    run = Run(config)
    stages.init_run(run)
    stages.prepare(run)
    root = RunRoot(config.run_root)
    for r in (1, 2):  # later rounds' modules, as merges would commit them
        root.put_dir(root.local_path(layout.modules_dir(0)), layout.modules_dir(r))
    return config


def test_versions_aliases_and_idempotent_registration(prepared):
    from mlflow.tracking import MlflowClient

    tracker = get_tracker(prepared)
    name = prepared.mlflow.registered_model
    client = MlflowClient(tracking_uri=tracking_uri(prepared), registry_uri=tracking_uri(prepared))
    assert tracker.register(0, {"round": 0, "perplexity": 100.0, "tokens": 10}) == "1"
    assert tracker.register(0, {"round": 0, "perplexity": 100.0, "tokens": 10}) == "1"  # a retried task
    assert tracker.register(1, {"round": 1, "perplexity": 50.0, "tokens": 10}) == "2"
    assert tracker.register(2, {"round": 2, "perplexity": 70.0, "tokens": 10}) == "3"

    model = client.get_registered_model(name)
    assert {k: str(v) for k, v in model.aliases.items()} == {"champion": "2", "newest": "3"}
    assert len(client.search_model_versions(f"name = '{name}'")) == 3
    v2 = client.get_model_version(name, "2")
    assert v2.tags["dipaco.round"] == "1" and float(v2.tags["perplexity"]) == 50.0
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"
    # MLflow reserves the alias "latest"; its own models:/<name>/latest is the newest version
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    assert get_model_name_and_version(client, f"models:/{name}/latest") == (name, "3")
    # each registration is a nested run of the pipeline's parent run
    experiment = client.get_experiment_by_name(prepared.mlflow.experiment)
    registered = client.search_runs([experiment.experiment_id], "tags.`dipaco.kind` = 'register'")
    assert sorted(r.data.tags["dipaco.round"] for r in registered) == ["0", "1", "2"]


def test_champion_loads_in_a_fresh_process_with_its_tokenizer_and_generates_like_its_path(prepared, tmp_path):
    import torch

    from pipeline.routing.router import Router
    from pipeline.routing.tokenizer import load_tokenizer
    from pipeline.state.module_store import load_path_model

    name = prepared.mlflow.registered_model
    get_tracker(prepared).register(1, {"round": 1, "perplexity": 50.0, "tokens": 10})
    script = (
        "import json, pathlib, sys, mlflow\n"
        f"mlflow.set_tracking_uri({tracking_uri(prepared)!r})\n"
        f"model = mlflow.pyfunc.load_model('models:/{name}@champion')\n"
        "texts = json.loads(sys.argv[1])\n"
        "inner = model.unwrap_python_model()\n"
        "print(json.dumps({'greedy': model.predict(texts, params={'temperature': 0.0, 'max_new_tokens': 16}),\n"
        " 'short': model.predict(texts, params={'max_new_tokens': 4, 'temperature': 0.0}),\n"
        " 'seeded': [model.predict(texts, params={'seed': 7}) for _ in range(2)],\n"
        " 'other_seed': model.predict(texts, params={'seed': 8}),\n"
        " 'vocab': len(inner.tokenizer),"
        " 'bundled': (inner.root.local_path('tokenizer') / 'tokenizer.json').is_file()}))\n"
    )
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    out = run_script_json(script, PROMPTS, tmp_path, env)
    # the run's trained tokenizer travelled inside the model: no run root, no GPT-2 files needed
    assert out["bundled"] and out["vocab"] == len(load_tokenizer(RunRoot(prepared.run_root), "bpe"))
    assert [type(t) for t in out["greedy"]] == [str, str]
    assert out["seeded"][0] == out["seeded"][1]  # the same seed writes the same text
    assert out["seeded"][0] != out["other_seed"]

    # the reference: route with the run's router, greedy-decode with the path's model of round 1,
    # the prompt after EOS as documents start in the packed training rows
    root = RunRoot(prepared.run_root)
    tokenizer = load_tokenizer(root, "bpe")
    seq_len = prepared.model.seq_len
    for text, got_greedy, got_short in zip(PROMPTS, out["greedy"], out["short"]):
        path_id = Router.load(root, prepared).route_texts([text])[0]
        model = load_path_model(root, prepared, 1, path_id).eval()
        for new_tokens, got in ((16, got_greedy), (4, got_short)):
            ids = ([tokenizer.eos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"])[
                -(seq_len - new_tokens) :
            ]
            with torch.no_grad():
                gen = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.eos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            assert got == tokenizer.decode(gen[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert not (REPO / "mlruns").exists()


def test_run_summary_shows_the_champions_continuation(prepared):
    from pipeline.tracking.registry import champion_continuation
    from pipeline.tracking.report import format_summary

    get_tracker(prepared).register(1, {"round": 1, "perplexity": 50.0, "tokens": 10})
    text = champion_continuation(prepared, PROMPTS[0])
    assert isinstance(text, str) and text == champion_continuation(prepared, PROMPTS[0])  # seeded: reproducible
    summary = {
        "run_root": "runs/x",
        "rounds_committed": 1,
        "sample": {"prompt": PROMPTS[0], "continuation": text},
        "eval": {
            0: {"perplexity": 600.0, "bits_per_byte": 2.5, "paths": {"p0-0": {"bits_per_byte": 2.25}}},
            1: {"perplexity": 300.0, "bits_per_byte": 2.0, "paths": {"p0-0": {"bits_per_byte": 1.875}}},
        },
    }
    lines = format_summary(summary).splitlines()
    assert lines[2].split() == ["round", "perplexity", "bits/byte", "p0-0"]
    assert lines[3].split() == ["0", "600.00", "2.500", "2.250"] and lines[4].split() == [
        "1",
        "300.00",
        "2.000",
        "1.875",
    ]
    assert lines[-1] == f"champion continues {PROMPTS[0]!r}: {text!r}"
