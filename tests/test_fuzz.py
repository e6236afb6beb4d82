"""Property-based fuzzing (Hypothesis) of every parser hostile input reaches: the C4 line parser
and file reader, the config loader (files, --set values, DAG params) and the run-root readers.

Each input must end accepted, rejected with a reason, or refused with a DipacoError of one line
under 500 characters, within the example deadline. The normal suite runs a few hundred derandomized
examples per target (seconds); `DIPACO_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py` runs a long,
randomized campaign (Hypothesis prints the failing input, shrunk, when one breaks a property).
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import uuid
from datetime import timedelta
from unittest import mock

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import REPO
from pipeline.core.bounds import MAX_JSON_DEPTH, too_deep
from pipeline.core.config import Config, check_dag_params, flatten, load_config
from pipeline.core.errors import DipacoError
from pipeline.core.trust import TRIGGER_KEYS
from pipeline.islands.launch import read_metrics
from pipeline.routing.router import Router
from pipeline.state import layout
from pipeline.state import lock as lock_module
from pipeline.state.lock import _heartbeat_lock
from pipeline.state.module_store import decode, encode
from pipeline.state.storage import RunRoot
from pipeline.tracking.report import read_eval
from preprocessing import c4

LONG_RUN = int(os.environ.get("DIPACO_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """Bounded and reproducible in the suite; long and random with DIPACO_FUZZ_EXAMPLES."""
    return settings(
        max_examples=LONG_RUN or examples,
        deadline=timedelta(seconds=5),
        derandomize=not LONG_RUN,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.function_scoped_fixture,
        ],
    )


def refused_in_one_line(error: BaseException) -> None:
    """What every refusal must look like: ours, one line, short."""
    assert isinstance(error, DipacoError), f"{type(error).__name__}: {str(error)[:300]}"
    text = str(error)
    assert "\n" not in text and len(text) < 500, text[:600]


# -- strategies ----------------------------------------------------------------------------------
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# text full of what trips up a scanner of JSON: brackets, quotes, backslashes, escapes, surrogates
TRICKY_TEXT = st.text(
    alphabet=st.sampled_from(list('[]{}"\\/abc \n\t\u00e9\u2028') + ["\ud800", "\udfff"]), max_size=60
)


@st.composite
def nested(draw, leaf=JSON_SCALARS | TRICKY_TEXT):
    """A JSON value nested a known number of levels deep (up to ~1.5x MAX_JSON_DEPTH)."""
    depth = draw(st.integers(0, MAX_JSON_DEPTH + 50))
    value = draw(leaf)
    for _ in range(depth):
        if draw(st.booleans()):
            value = [draw(TRICKY_TEXT), value] if draw(st.booleans()) else [value]
        else:
            value = {draw(TRICKY_TEXT): value}
    return depth, value


@st.composite
def c4_lines(draw) -> bytes:
    """Raw lines: random bytes, documents (valid or not, any field types), mutated documents,
    nesting bombs, huge numbers, BOMs and line endings."""
    kind = draw(st.sampled_from(["bytes", "document", "mutated", "bomb", "number", "nested"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=300))
    elif kind in ("document", "mutated"):
        doc = draw(
            st.fixed_dictionaries(
                {"text": TRICKY_TEXT | JSON_VALUES},
                optional={"url": TRICKY_TEXT | JSON_VALUES, "timestamp": JSON_VALUES},
            )
        )
        raw = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
        if kind == "mutated":
            for _ in range(draw(st.integers(1, 4))):
                at = draw(st.integers(0, len(raw)))
                raw = raw[:at] + draw(st.binary(max_size=3)) + raw[at + draw(st.integers(0, 3)) :]
    elif kind == "bomb":
        depth = draw(st.sampled_from([MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 1000, 5000, 200_000]))
        opener = draw(st.sampled_from([b"[", b'{"a":', b'[{"b":']))
        raw = opener * depth + (draw(st.sampled_from([b"", b"1", b'"x"'])))
    elif kind == "number":
        raw = b'{"text": "n", "n": ' + b"9" * draw(st.integers(1, 10_000)) + b"}"
    else:
        raw = json.dumps({"text": "deep", "meta": draw(nested())[1]}).encode("utf-8", "surrogatepass")
    prefix = draw(st.sampled_from([b"", b"", codecs.BOM_UTF8]))
    return prefix + raw + draw(st.sampled_from([b"", b"\n", b"\r\n"]))


# -- C4 lines and files --------------------------------------------------------------------------
@fuzz(200)
@given(raw=c4_lines(), max_doc_bytes=st.sampled_from([64, 1000, 1_000_000]))
def test_every_c4_line_ends_as_a_document_or_a_rejection_with_a_reason(raw, max_doc_bytes):
    record = c4.parse_line(raw, "train", "f.json", 3, max_doc_bytes)
    if isinstance(record, c4.Document):
        body = raw.rstrip(b"\r\n").removeprefix(codecs.BOM_UTF8)
        assert len(body) <= max_doc_bytes
        assert json.loads(body)["text"] == record.text and record.text.strip()
        record.text.encode("utf-8")  # both go into Parquet, which takes only text
        record.doc_id.encode("utf-8")
    else:
        assert isinstance(record, c4.Rejection) and record.reason in c4.REASONS and record.reason != c4.UNPARSABLE
        assert (record.file, record.line) == ("f.json", 3) and len(record.raw) <= c4.RAW_CHARS


@fuzz(100)
@given(case=nested())
def test_the_depth_guard_agrees_with_the_real_nesting_depth(case):
    depth, value = case
    text = json.dumps(value, ensure_ascii=False)
    assert too_deep(text.encode("utf-8", "surrogatepass")) == (depth > MAX_JSON_DEPTH)


@fuzz(50)
@given(
    lines=st.lists(c4_lines(), max_size=8),
    damage=st.sampled_from(["none", "gzip", "truncated gzip", "garbled gzip"]),
    cut=st.floats(0, 1),
    data=st.data(),
)
def test_every_line_of_a_file_is_read_once_whatever_the_file_holds(tmp_path_factory, lines, damage, cut, data):
    content = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines) + data.draw(
        st.binary(max_size=50)
    )
    expected_lines = content.count(b"\n") + (0 if content.endswith(b"\n") or not content else 1)
    folder = tmp_path_factory.mktemp("c4")
    name = folder / ("f.json" if damage == "none" else "f.json.gz")
    blob = content if damage == "none" else gzip.compress(content, mtime=0)
    if damage == "truncated gzip":
        blob = blob[: int(len(blob) * cut)]
    elif damage == "garbled gzip":
        blob = bytes(b ^ 0x5A if 10 < i < len(blob) - 8 and i % 3 == 0 else b for i, b in enumerate(blob))
    name.write_bytes(blob)
    read = list(c4.read_lines(str(name), max_line_bytes=128))
    assert [n for n, _ in read] == list(range(1, len(read) + 1))  # one record per line, in order
    records = [c4.line_to_record("train", str(name), n, raw, 128) for n, raw in read]
    assert all(isinstance(r, c4.Document) or r.reason in c4.REASONS for r in records)
    if damage in ("none", "gzip"):
        assert len(read) == expected_lines and not any(isinstance(r, c4.Broken) for _, r in read)
    else:  # lines before the damage, then at most one unreadable_file for the rest
        assert not any(isinstance(r, c4.Broken) for _, r in read[:-1])


# -- config --------------------------------------------------------------------------------------
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
KEYS = sorted(
    f"{section}.{key}" for section, fields in Config().to_dict().items() if isinstance(fields, dict) for key in fields
)
YAML_BOMBS = [
    "a: &a [x, x]\nb: [*a, *a]\n",
    "model: &m {grid: [2]}\nrouter: *m\n",
    "<<: *undefined\n",
    "run_root: !!python/object/apply:os.system [true]\n",
    "run_root: !!binary not-base64\n",
    "train: {lr: 2001-13-45}\n",
    "train: {rounds: " + "9" * 5000 + "}\n",
    "model: {grid: " + "[" * 100 + "]" * 100 + "}\n",
    "---\nrun_root: a\n---\nrun_root: b\n",
    "run_root: 'unterminated\n",
    "\t- tab\n",
]


@st.composite
def config_texts(draw) -> str | bytes:
    """tiny.yaml with random values at random keys, random YAML text, or a known YAML attack."""
    kind = draw(st.sampled_from(["values", "text", "bytes", "bomb"]))
    if kind == "values":
        raw = json.loads(json.dumps(TINY))
        for key in draw(st.lists(st.sampled_from(KEYS + ["nowhere.key", "model", "run_root"]), max_size=4)):
            section, _, name = key.partition(".")
            value = draw(JSON_VALUES | TRICKY_TEXT | st.lists(st.integers(-3, 10**6), max_size=70))
            if name and isinstance(raw.get(section), dict):
                raw[section][name] = value
            else:
                raw[section] = value
        return yaml.safe_dump(raw, allow_unicode=draw(st.booleans()))
    if kind == "text":
        return draw(st.text(alphabet=st.sampled_from(list("ab:-[]{}&*!|>'\"#%@` \n\t,?.0123456789")), max_size=200))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return draw(st.sampled_from(YAML_BOMBS))


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("configs")


@fuzz(200)
@given(
    text=config_texts(),
    overrides=st.lists(
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(KEYS + ["x.y", "model.grid.z"]),
            st.sampled_from(YAML_BOMBS) | TRICKY_TEXT,
        )
        | TRICKY_TEXT,
        max_size=3,
    ),
)
@example(text="", overrides=["airflow.pool=\t"])  # found by CI: blanks only were scanned as YAML
def test_every_config_loads_or_is_refused_in_one_short_line(config_dir, text, overrides):
    file = config_dir / f"{uuid.uuid4().hex}.yaml"
    file.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        config = load_config(file, overrides)
    except Exception as error:  # noqa: BLE001 - the property is about what was raised
        refused_in_one_line(error)
        assert str(file) in str(error) or "--set" in str(error)
    else:
        assert isinstance(config, Config) and config.n_paths >= 1


@fuzz(150)
@given(
    params=st.dictionaries(
        st.sampled_from(["config", "overrides", "project_dir", "extra"]),
        JSON_VALUES | TRICKY_TEXT | st.just(str(REPO)) | st.lists(TRICKY_TEXT, max_size=3),
    )
)
def test_dag_params_are_accepted_or_refused_in_one_short_line(params):
    try:
        ref = check_dag_params(params)
    except Exception as error:  # noqa: BLE001
        refused_in_one_line(error)
    else:
        assert set(ref) == {"config", "overrides", "project_dir"} and all(isinstance(o, str) for o in ref["overrides"])


ALL_KEYS = sorted(flatten(Config().to_dict()))
TRIGGER_OVERRIDES = st.builds(
    lambda k, v: f"{k}={v}",
    st.sampled_from(sorted(TRIGGER_KEYS))
    | st.sampled_from(ALL_KEYS)
    | st.text(alphabet="abcdefghij_.", min_size=1, max_size=12),
    st.sampled_from(
        ["1", "0.5", "true", "null", "[0.9, 0.95]", "os.getcwd", "tokens", "/tmp/x", "'--environment_type=PROCESS'"]
    )
    | TRICKY_TEXT,
)


@fuzz(200)
@given(overrides=st.lists(TRIGGER_OVERRIDES, max_size=4))
def test_a_trigger_sets_only_keys_of_the_allow_list(overrides):
    """Random keys and values from a DAG trigger: accepted only when every key is in TRIGGER_KEYS,
    and then the keys a trigger may not set keep the config file's values."""
    params = {"config": "configs/tiny.yaml", "overrides": overrides, "project_dir": str(REPO)}
    try:
        check_dag_params(params, [REPO])
        config = load_config(REPO / "configs" / "tiny.yaml", overrides, trusted=False)
    except Exception as error:  # noqa: BLE001
        refused_in_one_line(error)
    else:
        assert all(o.split("=", 1)[0] in TRIGGER_KEYS for o in overrides)
        base = flatten(load_config(REPO / "configs" / "tiny.yaml").to_dict())
        assert {k: v for k, v in flatten(config.to_dict()).items() if k not in TRIGGER_KEYS} == {
            k: v for k, v in base.items() if k not in TRIGGER_KEYS
        }


# -- run-root readers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_router_files() -> dict[str, bytes]:
    """The files of a real committed tfidf router, to mutate one at a time."""
    from pipeline.routing.embedders import TfidfEmbedder

    texts = [
        json.loads(line)["text"]
        for line in (REPO / "tests/data/c4/train/c4-train.00000-of-00002.json").read_text().splitlines()
    ]
    embedder = TfidfEmbedder.fit(texts, 8, 0)
    root = RunRoot(f"memory://fuzz-template-{uuid.uuid4().hex}")
    Router.fit(embedder.embed(texts), [2, 2], embedder="tfidf", prefix_tokens=8, seed=0).save(root, embedder)
    return {name: bytes(root.read_bytes(f"router/{name}")) for name in [*root.files_under("router"), "_SUCCESS"]}


@st.composite
def hostile_json(draw, good: dict | None = None) -> bytes:
    """Bytes for a stored JSON file: a valid record with fields replaced or removed, any JSON
    value, random bytes, a nesting bomb, or NaN/Infinity where numbers go."""
    kind = draw(
        st.sampled_from(["mutated", "mutated", "value", "bytes", "bomb"] if good else ["value", "bytes", "bomb"])
    )
    if kind == "mutated":
        record = dict(good)
        for key in draw(st.lists(st.sampled_from(sorted(record)), min_size=1, max_size=3)):
            if draw(st.booleans()):
                record[key] = draw(JSON_VALUES | st.just(float("inf")) | st.just(float("nan")))
            else:
                record.pop(key, None)
        return json.dumps(record).encode()
    if kind == "value":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    return b"[" * draw(st.sampled_from([MAX_JSON_DEPTH + 1, 5000, 200_000]))


@st.composite
def hostile_npy(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    shape = tuple(draw(st.lists(st.integers(0, 10**7), max_size=3)))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header,
        {
            "descr": draw(st.sampled_from(["<f8", "<f4", "|O", "<i8"])),
            "fortran_order": draw(st.booleans()),
            "shape": shape,
        },
    )
    return header.getvalue() + draw(st.binary(max_size=300))


def _fresh_root(files: dict[str, bytes]) -> RunRoot:
    root = RunRoot(f"memory://fuzz-{uuid.uuid4().hex}")
    for name, data in files.items():
        root.write_bytes(f"router/{name}", data)
    return root


@fuzz(120)
@given(
    data=st.data(), target=st.sampled_from(["router.json", "centroids.npy", "tfidf.json", "tfidf_svd.npy", "_SUCCESS"])
)
def test_a_hostile_router_artifact_loads_and_routes_or_is_refused(good_router_files, data, target):
    files = dict(good_router_files)
    if target.endswith(".npy"):
        files[target] = data.draw(hostile_npy())
    else:
        good = json.loads(files[target]) if target != "_SUCCESS" else None
        files[target] = data.draw(hostile_json(good))
    files.pop("_SUCCESS")
    root = _fresh_root(files)
    root.commit("router")
    if target == "_SUCCESS":
        root.write_bytes("router/_SUCCESS", data.draw(hostile_json(json.loads(good_router_files["_SUCCESS"]))))
    try:
        router = Router.load(root)
        features = router.embed_prefixes(["the router must route what it loads", "x"])
        paths = router.route_features(features)
    except Exception as error:  # noqa: BLE001
        refused_in_one_line(error)
    else:
        assert set(paths) <= set(router.path_ids)
    finally:
        root.remove("")  # the memory filesystem is one store: keep it small, or every glob slows


GOOD_METRICS = {
    "loss": [3.2, 2.9],
    "lr": [1e-4, 2e-4],
    "tokens": 640,
    "tokens_per_s": 100.0,
    "seconds": 6.4,
    "round": 0,
    "path": "p0-0",
}
GOOD_EVAL = {"round": 1, "perplexity": 12.5, "tokens": 300, "paths": {"p0-0": {"perplexity": 12.0, "tokens": 150}}}
GOOD_LOCK = {"pid": 1, "host": "h", "heartbeat": 0.0}


@fuzz(120)
@given(data=st.data(), target=st.sampled_from(["metrics", "eval", "lock", "manifest"]))
def test_a_hostile_run_root_json_file_is_read_or_refused(data, target):
    root = RunRoot(f"memory://fuzz-{uuid.uuid4().hex}")
    rel = layout.path_dir(0, "p0-0")
    good = {"metrics": GOOD_METRICS, "eval": GOOD_EVAL, "lock": GOOD_LOCK, "manifest": {"routed": 1}}[target]
    content = data.draw(hostile_json(good))
    name = {
        "metrics": f"{rel}/metrics.json",
        "eval": layout.eval_file(0),
        "lock": layout.LOCK,
        "manifest": layout.MANIFEST,
    }[target]
    root.write_bytes(name, content)
    root.commit(rel)
    root.commit(layout.SHARDS_DIR)
    try:
        if target == "metrics":
            metrics = read_metrics(root, rel)  # then what `dipaco train-path` prints from it
            json.dumps(
                {k: metrics[k] for k in ("round", "path", "tokens", "tokens_per_s", "seconds")}
                | {"final_loss": metrics["loss"][-1]}
            )
        elif target == "eval":
            from pipeline.tracking.report import format_summary

            format_summary({"eval": {0: read_eval(root, 0)}, "run_root": "r", "rounds_committed": 1})
        elif target == "lock":  # a holder is watched STALE_AFTER_S on this reader's clock: 20 s, here 0.05
            with mock.patch.object(lock_module, "STALE_AFTER_S", 0.05), mock.patch.object(lock_module, "POLL_S", 0.01):
                with _heartbeat_lock(root):
                    pass
        else:
            root.read_committed_json(layout.SHARDS_DIR, "manifest.json")
    except Exception as error:  # noqa: BLE001
        refused_in_one_line(error)
    finally:
        root.remove("")


@st.composite
def hostile_safetensors(draw) -> bytes:
    """A real module file with its header replaced or its fields changed, or random bytes."""
    good = encode({"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float16)})
    size = int.from_bytes(good[:8], "little")
    header, body = json.loads(good[8 : 8 + size]), good[8 + size :]
    kind = draw(st.sampled_from(["fields", "header", "length", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "length":
        return draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + good[8:]
    if kind == "header":
        new_header = draw(hostile_json())
    else:
        tensor = header[draw(st.sampled_from(["w", "b"]))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        tensor[field] = draw(
            JSON_VALUES
            | st.lists(st.integers(-2, 2**40), max_size=3)
            | st.sampled_from(["F32", "F64", "BF16", "F8_E4M3", "BOOL", "U64"])
        )
        new_header = json.dumps(header).encode()
    return len(new_header).to_bytes(8, "little") + new_header + body[: draw(st.integers(0, len(body)))]


@fuzz(300)
@given(blob=hostile_safetensors(), writable=st.booleans())
def test_a_hostile_safetensors_file_decodes_or_is_refused(blob, writable):
    try:
        state = decode(
            bytearray(blob) if writable else bytes(blob), "rounds/round=0/modules/level=0/module=0.safetensors"
        )
    except Exception as error:  # noqa: BLE001
        refused_in_one_line(error)
    else:
        assert all(isinstance(t, torch.Tensor) for t in state.values())
