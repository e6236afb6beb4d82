"""eval.reroute_every: held-out documents scored in chunks of N tokens, each chunk by the path the
router picks for the N tokens before it (DiPaCo's test-time re-routing), in one process and in the
islands' per-path eval tasks; and the pyfunc re-routing while it generates."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch

from conftest import tiny_config
from models.grid import all_modules, all_path_ids
from pipeline import stages
from pipeline.core.config import dump_yaml
from pipeline.core.errors import ConfigError
from pipeline.evaluation import evaluate
from pipeline.evaluation.evaluate import evaluate_round
from pipeline.islands.island import run_task
from pipeline.islands.task_queue import Task, TaskQueue
from pipeline.routing.router import Router
from pipeline.routing.tokenizer import load_tokenizer, token_byte_lengths
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import load_path_model, read_module, write_states
from pipeline.state.storage import RunRoot

PROMPTS = ["The football team scored a goal in the cup match", "Bake the bread in a hot oven with butter"]
EVERY = 4  # tiny.yaml: prefix 8, seq_len 32, so 25 scored tokens a document: 7 chunks


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """tests/data/c4 prepared by the real Beam job (tfidf router, a 512-id BPE), and round 1's
    modules: round 0's, each with noise of its own, so that the paths score tokens differently."""
    base = tmp_path_factory.mktemp("reroute")
    config = tiny_config(base / "run", "model.tokenizer=bpe", "model.vocab_size=512")
    run = Run(config)
    stages.init_run(run)
    stages.prepare(run)
    root = RunRoot(config.run_root)
    states = {}
    for key in all_modules(config.model.grid):
        noise = torch.Generator().manual_seed(1 + 10 * key.level + key.index)
        states[key] = {
            name: t + 0.5 * torch.randn(t.shape, generator=noise).to(t.dtype)
            for name, t in read_module(root, 0, key).items()
        }
    write_states(root, layout.modules_dir(1), states, {"round": 1})
    return config


def with_reroute(config, every: int | None):
    config = copy.deepcopy(config)
    config.eval.reroute_every = every
    return config


def clear_eval(config) -> None:
    RunRoot(config.run_root).remove(layout.EVAL_DIR)


def nll_of(result: dict) -> float:
    return math.log(result["perplexity"]) * result["tokens"]


def test_config_refuses_a_chunk_below_one_token(tmp_path):
    with pytest.raises(ConfigError, match="eval.reroute_every must be >= 1"):
        tiny_config(tmp_path / "run", "eval.reroute_every=0")
    assert tiny_config(tmp_path / "run").eval.reroute_every is None
    assert tiny_config(tmp_path / "run", "eval.reroute_every=64").eval.reroute_every == 64


def test_chunks_longer_than_the_window_score_as_routing_once(prepared):
    clear_eval(prepared)
    once = evaluate_round(prepared, 1)
    long = evaluate_round(with_reroute(prepared, 1000), 1)
    assert once["reroute_every"] is None and long["reroute_every"] == 1000
    assert RunRoot(prepared.run_root).read_json(layout.eval_file(1))["reroute_every"] == 1000
    assert long["tokens"] == once["tokens"] > 0 and long["bytes"] == once["bytes"]
    assert long["perplexity"] == pytest.approx(once["perplexity"], rel=1e-6)
    assert long["bits_per_byte"] == pytest.approx(once["bits_per_byte"], rel=1e-6)
    assert long["paths"].keys() == once["paths"].keys()
    for path_id, part in once["paths"].items():
        assert {k: long["paths"][path_id][k] for k in ("tokens", "bytes", "docs")} == {
            k: part[k] for k in ("tokens", "bytes", "docs")
        }
        assert long["paths"][path_id]["perplexity"] == pytest.approx(part["perplexity"], rel=1e-6)


def expected_mixed_nll(config, round_index: int, every: int) -> tuple[float, int, int, int]:
    """The reference, written out: each chunk's path routed from the decoded N tokens before it,
    each path model's per-token NLL of the whole window, summed over the chunks it scores.
    Returns (nats, tokens, bytes, chunks off their document's path)."""
    root = RunRoot(config.run_root)
    router, tokenizer = Router.load(root, config), load_tokenizer(root, "bpe")
    prefix, seq_len = config.router.prefix_tokens, config.model.seq_len
    lengths = token_byte_lengths(tokenizer, config.model.vocab_size)
    models = {p: load_path_model(root, config, round_index, p).eval() for p in all_path_ids(config.model.grid)}
    docs = [
        (home, doc[: seq_len + 1])
        for home in all_path_ids(config.model.grid)
        for doc in evaluate.held_out_documents(root, config, home)
        if len(doc) > prefix
    ]
    # every window, end-padded (causal: padding after a token never changes its score), by every model
    inputs = torch.zeros((len(docs), seq_len + 1), dtype=torch.long)
    for row, (_, window) in enumerate(docs):
        inputs[row, : len(window)] = torch.tensor(window)
    with torch.no_grad():
        per_token = {
            p: -torch.log_softmax(m(input_ids=inputs[:, :-1]).logits.double(), -1).gather(2, inputs[:, 1:, None])[
                ..., 0
            ]
            for p, m in models.items()
        }  # (docs, seq_len)
    nll, tokens, n_bytes, switched = 0.0, 0, 0, 0
    for row, (home, window) in enumerate(docs):
        per_path = {p: scores[row, prefix - 1 :].numpy() for p, scores in per_token.items()}  # tokens prefix..
        for begin in range(0, len(window) - prefix, every):
            end = min(begin + every, len(window) - prefix)
            if begin == 0:
                path_id = home
            else:
                text = tokenizer.decode(window[prefix + begin - every : prefix + begin].tolist())
                path_id = router.route_features(router.embed_prefixes([text]))[0]
            switched += path_id != home
            nll += per_path[path_id][begin:end].sum()
            tokens += end - begin
            n_bytes += int(lengths[window[prefix + begin : prefix + end]].sum())
    return nll, tokens, n_bytes, switched


def test_chunks_switching_paths_give_the_nll_of_the_mixed_scoring(prepared):
    clear_eval(prepared)
    config = with_reroute(prepared, EVERY)
    once = evaluate_round(prepared, 1)
    mixed = evaluate_round(config, 1)
    nll, tokens, n_bytes, switched = expected_mixed_nll(config, 1, EVERY)
    assert switched > 0  # the case is real: some chunks leave their document's path
    assert mixed["tokens"] == tokens == once["tokens"] and mixed["bytes"] == n_bytes == once["bytes"]
    assert nll_of(mixed) == pytest.approx(nll, rel=1e-5)
    assert mixed["bits_per_byte"] * mixed["bytes"] * math.log(2) == pytest.approx(nll, rel=1e-5)
    assert abs(nll_of(mixed) - nll_of(once)) > 1e-3 * nll  # and it is not routing once
    assert sum(p["tokens"] for p in mixed["paths"].values()) == tokens
    assert math.fsum(math.log(p["perplexity"]) * p["tokens"] for p in mixed["paths"].values()) == pytest.approx(
        nll, rel=1e-5
    )
    # the routes were committed once under eval/ with what they depend on
    root = RunRoot(prepared.run_root)
    routes = root.read_committed_json(layout.eval_routes_dir(EVERY), evaluate.ROUTES_FILE)
    assert routes["reroute_every"] == EVERY and routes["router"] == Router.load(root, prepared).checksum
    assert sum(p != home for home, docs in routes["paths"].items() for c in docs for p in c) == switched


def test_islands_eval_parts_combine_to_the_single_process_result(prepared, monkeypatch):
    config = with_reroute(prepared, EVERY)
    clear_eval(prepared)
    single = evaluate_round(config, 1)
    root = RunRoot(prepared.run_root)
    root.remove(layout.eval_file(1))
    # every round reuses the committed routes: routing again would fail here
    monkeypatch.setattr(evaluate, "route_chunks", lambda *a: pytest.fail("chunks routed twice"))
    queue = TaskQueue(root, config)
    assert queue.eval_paths(1) == all_path_ids(prepared.model.grid)  # a chunk may reach any path
    ready = {t.name for t in queue.ready(1)}
    assert {f"eval.r1.{p}" for p in queue.eval_paths(1)} <= ready
    for path_id in queue.eval_paths(1):
        run_task(config, Task.of("eval", 1, path_id), 0)
    run_task(config, Task.of("evalsum", 1), 0)
    assert root.read_json(layout.eval_file(1)) == single
    assert single["reroute_every"] == EVERY


def test_routes_committed_for_other_settings_are_routed_again(prepared):
    config = with_reroute(prepared, EVERY)
    root = RunRoot(prepared.run_root)
    evaluate.chunk_routes(config, root)
    config.eval.max_docs = 2
    result = evaluate_round(config, 1)
    routes = root.read_committed_json(layout.eval_routes_dir(EVERY), evaluate.ROUTES_FILE)
    assert routes["max_docs"] == 2 and all(len(docs) <= 2 for docs in routes["paths"].values())
    window, prefix = config.model.seq_len + 1, config.router.prefix_tokens
    scored = sum(
        max(0, min(len(d), window) - prefix)
        for home in routes["paths"]
        for d in evaluate.held_out_documents(root, config, home)
    )
    assert sum(p["tokens"] for p in result["paths"].values()) == result["tokens"] == scored > 0


def test_run_summary_names_the_chunk_length():
    from pipeline.tracking.report import format_summary

    summary = {
        "run_root": "runs/x",
        "rounds_committed": 1,
        "eval": {1: {"perplexity": 300.0, "bits_per_byte": 2.0, "reroute_every": 64, "paths": {}}},
    }
    assert "re-routed every 64 tokens" in format_summary(summary).splitlines()[1]
    summary["eval"][1]["reroute_every"] = None
    assert "re-routed" not in format_summary(summary)


@pytest.fixture(scope="module")
def pyfunc(prepared, tmp_path_factory):
    """The registered model's python object, loaded from a bundle as MLflow would (no registry),
    of a run whose eval.reroute_every is EVERY."""
    from pipeline.tracking.registry import DipacoModel, build_bundle

    config = with_reroute(prepared, EVERY)
    bundle = build_bundle(RunRoot(config.run_root), config, 1, tmp_path_factory.mktemp("bundle"), dump_yaml(config))
    model = DipacoModel()
    model.load_context(types.SimpleNamespace(artifacts={"run_root": str(bundle)}))
    return model


def test_pyfunc_reroutes_while_generating_and_long_chunks_generate_as_routing_once(pyfunc):
    texts = pyfunc.predict(None, PROMPTS, params={"reroute_every": EVERY, "max_new_tokens": 8, "seed": 3})
    assert [type(t) for t in texts] == [str, str] and all(texts)
    once = pyfunc.predict(None, PROMPTS, params={"reroute_every": 0, "max_new_tokens": 8, "seed": 3})
    assert pyfunc.predict(None, PROMPTS, params={"reroute_every": 100, "max_new_tokens": 8, "seed": 3}) == once
    # no param: the run's eval.reroute_every
    assert pyfunc.predict(None, PROMPTS[:1], params={"seed": 5, "max_new_tokens": 8}) == pyfunc.predict(
        None, PROMPTS[:1], params={"seed": 5, "max_new_tokens": 8, "reroute_every": EVERY}
    )


def test_pyfunc_continues_each_chunk_with_the_path_of_the_tokens_before_it(pyfunc, monkeypatch):
    """Greedy, with a router that sends every re-routed chunk to the path after the prompt's: the
    text is the prompt's path for N tokens, then the other path on the whole context."""
    paths = all_path_ids(pyfunc.config.model.grid)
    first = pyfunc.router.route_texts(PROMPTS[:1])[0]
    other = paths[(paths.index(first) + 1) % len(paths)]
    seen = []
    monkeypatch.setattr(pyfunc.router, "route_tokens", lambda runs: seen.extend(runs) or [other] * len(runs))
    got = pyfunc.predict(None, PROMPTS[:1], params={"reroute_every": 4, "max_new_tokens": 12, "temperature": 0.0})[0]

    tokenizer, eos = pyfunc.tokenizer, pyfunc.tokenizer.eos_token_id
    ids = ([eos] + tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"])[-(pyfunc.config.model.seq_len - 12) :]
    context = torch.tensor([ids])
    for path_id in (first, other, other):
        model = load_path_model(pyfunc.root, pyfunc.config, 1, path_id).eval()
        with torch.no_grad():
            context = model.generate(context, max_new_tokens=4, do_sample=False, pad_token_id=eos, eos_token_id=eos)
    assert context.shape[1] == len(ids) + 12  # no end of text on the way: every chunk was generated
    assert got == tokenizer.decode(context[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert [list(r) for r in seen] == [context[0, len(ids) + 4 * k : len(ids) + 4 * k + 4].tolist() for k in (0, 1)]


def test_a_request_asking_for_too_much_is_refused_naming_the_param(pyfunc):
    """One request may not tie up a served model: tokens beyond the window, a re-route every token."""
    for params, expected in [
        ({"max_new_tokens": 10**9}, r"max_new_tokens=1000000000 must be within \[1, 32\]"),
        ({"reroute_every": 1}, r"reroute_every=1 must be within \[4, "),
        ({"temperature": float("nan")}, "temperature=nan"),
    ]:
        with pytest.raises(ValueError, match=expected):
            pyfunc.predict(None, PROMPTS[:1], params=params)
    with pytest.raises(ValueError, match="at most 256 texts"):
        pyfunc.predict(None, ["x"] * 257, params={})
