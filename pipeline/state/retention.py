"""What a run root may forget: the weights of old rounds (`train.keep_rounds`) and, on request,
the whole run root (`dipaco clean`).

A round's weights are its modules and Nesterov momentum (rounds/round=<r>/modules, outer_state)
and its paths' trained weights and compressed outer gradients. Once round r is merged, evaluated
and registered, nothing reads round r's weights again, except: resuming (the newest round's
modules and momentum, each path's newest inner optimizer state, which train_path already keeps
alone), early stopping (the rounds eval/best.json picks, which a later champion bundles again)
and a pending re-routing. The caller names those rounds; everything here is layout and files.

Nothing here deletes through a symbolic link: every removal goes through RunRoot.remove, which
refuses a path that resolves outside a local root (a round directory that is a link, a committed
file listed under a linked subdirectory) and unlinks a link itself, never its target; sizes are
counted without following links.

Pruning keeps every directory honest: a directory loses its `_SUCCESS` before its files (modules,
momentum), or its marker is rewritten to list only what stays before the rest goes (a path keeps
metrics.json and its inner state), so a crash never leaves a marker that names a missing file.
"""

from __future__ import annotations

import os
import posixpath

from pipeline.state import layout
from pipeline.state.storage import SUCCESS, RunRoot

PATH_KEEPS = ("metrics.json",)  # what a pruned path directory still holds (utilisation, the summary)


def rounds_to_prune(newest: int, keep: int, protected: set[int]) -> list[int]:
    """The rounds whose weights go: all but the `keep` newest up to round `newest`, and the protected."""
    return [r for r in range(0, newest - keep + 1) if r not in protected]


def prune_round(root: RunRoot, round_index: int, jobs: list[str]) -> int:
    """Remove round r's modules, momentum and path weights; returns the bytes freed."""
    freed = 0
    for rel in (layout.modules_dir(round_index), layout.outer_state_dir(round_index)):
        if root.exists(rel):
            root.check_inside(rel, follow_last=True)  # a linked round directory is refused, naming it
            freed += _size(root, rel)
            root.remove(posixpath.join(rel, SUCCESS))  # no longer committed, then gone
            root.remove(rel)
    for job in jobs:
        rel = layout.path_dir(round_index, job)
        if not root.is_committed(rel):
            continue
        marker = root.marker(rel)
        gone = [name for name in marker["files"] if name not in PATH_KEEPS]
        if not gone:
            continue
        at = root.files_location(rel, marker)  # on an object store, the published attempt's directory
        for name in gone:  # refused before the marker changes or anything goes, naming the file
            root.check_inside(posixpath.join(at, name))
        info = {k: v for k, v in marker.items() if k != "files"}
        keeps = {n: r for n, r in marker["files"].items() if n in PATH_KEEPS}
        root.commit(rel, info={**info, "pruned": True}, files=list(keeps), linked=keeps)  # files_at stays
        for name in gone:
            full = posixpath.join(at, name)
            if root.exists(full):
                freed += _size(root, full)
                root.remove(full)
        root.remove(posixpath.join(at, "outer_grad"))
    return freed


def _size(root: RunRoot, rel: str) -> int:
    """Bytes below `rel` (a file's own size): on a local root the files really there, links
    counted as links and never followed (a link to `/` or to the root itself must not make this
    walk the machine or loop)."""
    if not root.is_local:
        if root.fs.isfile(root.path(rel)):
            return root.fs.size(root.path(rel))
        return sum(root.fs.size(root.path(rel, name)) for name in root.files_under(rel))
    top = root.path(rel) if rel else root.path()
    try:
        info = os.lstat(top)
    except OSError:
        return 0
    if not os.path.isdir(top) or os.path.islink(top):
        return info.st_size
    total = 0
    for base, _dirs, files in os.walk(top):  # followlinks=False: a linked directory is not entered
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def run_root_size(root: RunRoot) -> int:
    return _size(root, "") if root.exists("") else 0
