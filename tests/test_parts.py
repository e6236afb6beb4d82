"""A path's weights read by module level (pipeline/state/module_store.py): a merge of one module, and an
early start's read of a peer, read only the byte runs that hold the module's level, each checked
against the CRC-32 the path's commit recorded, on a local root and on S3 alike; a run that does
not match, or a record that does not serve, falls back to the whole file and its whole record."""

from __future__ import annotations

import posixpath
import zlib

import pytest
import torch

from conftest import tiny_config, write_synthetic_shards
from models.modular import ModelShape
from pipeline import stages
from pipeline.core.errors import CorruptStateError
from pipeline.outer.merge import RoundInputs, read_path_levels
from pipeline.run import Run
from pipeline.state import layout
from pipeline.state.module_store import read_header
from pipeline.state.storage import PARTS, RunRoot, runs_to_read
from pipeline.state.store import RECENT
from pipeline.train.train_path import train_path

SETS = ["model.grid=[2, 1]", "train.inner_steps=2"]
WEIGHTS = "model.safetensors"


@pytest.fixture
def trained(any_root, request):
    """(config, root, shape): round 0 of the tiny [2, 1] grid, both paths trained by the path job,
    seeded by the test's name: this process keeps what it wrote or read by its bytes too
    (RecentFiles.get_same), and another test's identical weights would be read from memory."""
    seed = zlib.crc32(request.node.originalname.encode()) % 100_000
    config = tiny_config(any_root, *SETS, f"train.seed={seed}")
    root = stages.init_run(Run(config))
    write_synthetic_shards(root, config.model.grid)
    for path_id in stages.list_paths(config):
        train_path(config, 0, path_id)
    return config, root, ModelShape.from_config(config.model)


def _as_another_host_wrote_it(root: RunRoot, rel: str) -> str:
    """Forget what this process keeps of a path (its weights, their runs), as on a host that did
    not write it; returns where its files lie (the published attempt, on an object store)."""
    located = root.files_location(rel, root.marker(rel))
    for where in {rel, located}:
        RECENT.forget_under(root.path(where), keep_bytes=False)
    return located


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_commit_records_each_levels_runs_and_a_merge_reads_only_its_modules(trained):
    config, root, shape = trained
    rel = layout.path_dir(0, "p1-0")
    marker = root.marker(rel)
    size = marker["files"][WEIGHTS]["bytes"]
    recorded = marker[PARTS][WEIGHTS]
    assert len(recorded) == shape.n_module_levels == 2
    whole = read_path_levels(root, shape, 0, "p1-0")  # every level: the file in one read
    located = _as_another_host_wrote_it(root, rel)
    data = bytearray(root.read_bytes(posixpath.join(located, WEIGHTS)))
    header_end = 8 + int.from_bytes(data[:8], "little")
    for level in range(2):
        runs = runs_to_read(recorded, size, [level])
        assert runs is not None and runs[0][0] == 0 and runs[0][1] >= header_end  # the header, which every read needs
        assert sum(e - b for b, e, _ in runs) < 0.75 * size  # else the file is read whole

    # Bytes of level 0's tensors changed in the store, its header and level 1 untouched: a read
    # of level 1 gets the trained module bitwise, so it read none of level 0's bytes.
    header, base = read_header(data)
    level0 = [
        (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
        for name, entry in header.items()
        if name == "model.embed_tokens.weight"
    ]
    (begin, end) = level0[0]
    data[begin:end] = bytes(end - begin)
    root.write_bytes(posixpath.join(located, WEIGHTS), bytes(data))
    _as_another_host_wrote_it(root, rel)
    assert _equal(read_path_levels(root, shape, 0, "p1-0", levels=[1])[1], whole[1])
    # the level whose run does not match its record: read whole, which its whole record refuses
    with pytest.raises(CorruptStateError, match=r"p1-0.*model\.safetensors.*checksum"):
        read_path_levels(root, shape, 0, "p1-0", levels=[0])
    with pytest.raises(CorruptStateError, match="checksum"):
        read_path_levels(root, shape, 0, "p1-0")


def test_a_record_that_does_not_serve_falls_back_to_the_whole_file(trained):
    """Runs recorded wrongly (cutting the header, past the file, not a list) or not at all (a path
    committed before the record existed) cost a whole read, never a wrong or failed merge input."""
    config, root, shape = trained
    rel = layout.path_dir(0, "p0-0")
    marker = root.marker(rel)
    whole = read_path_levels(root, shape, 0, "p0-0")
    size = marker["files"][WEIGHTS]["bytes"]
    cut = [[[0, 16, "00000000"]], [[0, 16, "00000000"]]]
    for parts in (None, {WEIGHTS: cut}, {WEIGHTS: [[[0, size + 1, "0"]]] * 2}, {WEIGHTS: "runs"}, "parts"):
        changed = {k: v for k, v in marker.items() if k != PARTS} | ({PARTS: parts} if parts is not None else {})
        _as_another_host_wrote_it(root, rel)
        for level in range(2):
            got = read_path_levels(root, shape, 0, "p0-0", marker=changed, levels=[level])
            assert list(got) == [level] and _equal(got[level], whole[level]), parts


def test_an_early_starts_inputs_read_only_the_module_its_path_shares_of_a_peer(trained):
    """The island whose path p0-0 goes through l0m0 (its own) and l1m0 (shared with p1-0) computes
    both for its next round: of p1-0 it reads level 1 only, of its own path both."""
    from concurrent.futures import ThreadPoolExecutor

    from models.grid import ModuleKey

    config, root, shape = trained
    with ThreadPoolExecutor(4) as pool:
        inputs = RoundInputs(root, config, 0, pool, [ModuleKey(0, 0), ModuleKey(1, 0)])
        assert inputs.levels_of("p0-0") == [0, 1] and inputs.levels_of("p1-0") == [1]
        assert list(inputs.path("p1-0").result()) == [1]
        everything = RoundInputs(root, config, 0, pool)
        assert everything.levels_of("p1-0") == [0, 1]
        assert _equal(inputs.trained(ModuleKey(1, 0))[1], everything.trained(ModuleKey(1, 0))[1])
