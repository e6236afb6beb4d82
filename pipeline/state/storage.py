"""The run root: every read and write of pipeline state goes through here.

Two rules make every stage crash-safe and rerunnable (docs/design.md, storage layout):
- a file is written under a temporary name and renamed into place, so a reader sees the old
  file or the new one, never half of one;
- a directory counts only once its `_SUCCESS` marker exists. The marker is written last and
  records each file's length and CRC-32, and a committed file is checked against it when read,
  so a corrupted or truncated file is refused with its name rather than loaded.

Why CRC-32 and not a cryptographic hash: the checksum guards against accidents (a torn write, a
flipped bit, a truncated copy), not against someone who can rewrite files, since they could
rewrite the marker too; CRC-32 plus the length is what GCS, HDFS and Parquet use for exactly
this, and it runs at ~3 GB/s where SHA-256 runs at ~1.2 GB/s on our CPUs, which decides whether a
merge is bound by I/O or by hashing. Markers written with "sha256" records are still verified.

The root is a local path or any fsspec URL (`file://`, `s3://`, `gs://`, `memory://`). What differs
between a disk and an object store (no rename, conditional creates, compare-and-swap, reads of
objects replaced meanwhile, retries) lives in pipeline.state.store; RunRoot asks it for operations.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import posixpath
import shutil
import signal
import time
import uuid
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.bounds import MAX_STATE_JSON_BYTES, load_json
from pipeline.core.errors import CorruptStateError, InputError, StorageError
from pipeline.state.store import RECENT, Store, Versioned, retrying, store_for
from pipeline.state.store import TMP_TAG as _TMP_TAG

SUCCESS = "_SUCCESS"
# In a published directory's `_SUCCESS` on an object store: the staged attempt whose files it
# certifies (publish_dir publishes by creating the marker alone: no byte is copied, no token).
FILES_AT = "files_at"
T, R = TypeVar("T"), TypeVar("R")
# Fault injection for the crash tests: the process kills itself (SIGKILL, like `kill -9`) right
# before its N-th file write, so a test can crash a stage at an exact point. Unset: no effect.
_KILL_BEFORE_WRITE = int(os.environ.get("DIPACO_FAULT_KILL_BEFORE_WRITE", "0"))
_writes = 0


def _parse_write_errors(spec: str) -> list:
    """DIPACO_FAULT_WRITE_ERRORS="<count>:<substring>": the next <count> writes whose path contains
    <substring> fail like a flaky object store would (tests and benchmarks.chaos only)."""
    if not spec:
        return [0, ""]
    count, _, match = spec.partition(":")
    return [int(count), match]


_write_errors = _parse_write_errors(os.environ.get("DIPACO_FAULT_WRITE_ERRORS", ""))


def inject_write_errors(count: int, match: str = "") -> None:
    """Make the next `count` writes of this process whose path contains `match` raise StorageError."""
    _write_errors[:] = [count, match]


def _fault_point(path: str = "") -> None:
    global _writes
    _writes += 1
    if _KILL_BEFORE_WRITE and _writes >= _KILL_BEFORE_WRITE:
        os.kill(os.getpid(), signal.SIGKILL)
    if _write_errors[0] > 0 and _write_errors[1] in path:
        _write_errors[0] -= 1
        raise StorageError(f"{path}: cannot write (injected transient storage error); the previous state is intact")


def safe_relative(name: str, where: str) -> str:
    """Refuse a stored name that could leave its directory ('..', absolute, backslashes)."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise CorruptStateError(f"{where}: refusing unsafe file name {name!r}")
    return name


# Threads for reading and writing many files at once: file I/O, fsync and hashing release the
# GIL, so a merge reading 16 paths overlaps them across the cores instead of one at a time.
IO_THREADS = max(1, min(8, os.cpu_count() or 1))


# An object store's requests wait on the network, not on a core: many at once.
OBJECT_IO_THREADS = 16


def map_io(fn: Callable[[T], R], items: Iterable[T], threads: int = IO_THREADS) -> list[R]:
    """[fn(item) for item in items] on `threads` threads, in order; the first error is raised."""
    items = list(items)
    if threads == 1 or len(items) < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def _record(crc: int, size: int) -> dict[str, Any]:
    """The record `_SUCCESS` keeps of a file: its length and CRC-32 (zlib, IEEE polynomial)."""
    return {"crc32": f"{crc:08x}", "bytes": size}


def checksum_bytes(data: bytes) -> dict[str, Any]:
    return _record(zlib.crc32(data), len(data))


def checksum_file(path: str | Path) -> dict[str, Any]:
    crc, size = 0, 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return _record(crc, size)


def matches_record(data: bytes, record: dict[str, Any]) -> bool:
    """Whether bytes are the file a `_SUCCESS` record describes (CRC-32, or SHA-256 in old markers)."""
    if len(data) != record.get("bytes"):
        return False
    if "crc32" in record:
        return checksum_bytes(data)["crc32"] == record["crc32"]
    if "sha256" in record:
        return hashlib.sha256(data).hexdigest() == record["sha256"]
    return False


PARTS = "parts"  # a `_SUCCESS` key: {file name: each level's byte runs} (module_store.level_runs)
WHOLE_ABOVE = 0.75  # runs that are more of the file than this: it is read whole, in one request
Run = tuple[int, int, str]  # [begin, end) of a file and the CRC-32 of those bytes


def runs_to_read(record: Any, size: int, levels: Iterable[int]) -> list[Run] | None:
    """The distinct runs of a file of `size` bytes that hold `levels`, by its `parts` record; None
    where the file is better read whole: no record, a malformed one, or runs that are most of it."""
    if not isinstance(record, list):
        return None
    runs: set[Run] = set()
    for level in levels:
        if not (0 <= level < len(record)) or not isinstance(record[level], list):
            return None
        for run in record[level]:
            if not (
                isinstance(run, list)
                and len(run) == 3
                and type(run[0]) is int
                and type(run[1]) is int
                and isinstance(run[2], str)
                and 0 <= run[0] < run[1] <= size
            ):
                return None
            runs.add((run[0], run[1], run[2]))
    if not any(begin == 0 for begin, _, _ in runs) or sum(e - b for b, e, _ in runs) > WHOLE_ABOVE * size:
        return None
    return sorted(runs)


def recorded_runs(marker: dict, name: str, levels: Iterable[int] | None) -> list[Run] | None:
    """runs_to_read for file `name` of a committed directory, by its `_SUCCESS` (`marker`)."""
    record, parts = marker["files"].get(name), marker.get(PARTS)
    if levels is None or not isinstance(record, dict) or not isinstance(parts, dict):
        return None
    return runs_to_read(parts.get(name), record["bytes"], levels)


def _is_file_record(record: Any) -> bool:
    """A `_SUCCESS` entry: a non-negative int length and a CRC-32 (or an old marker's SHA-256) string."""
    return (
        isinstance(record, dict)
        and type(record.get("bytes")) is int
        and record["bytes"] >= 0
        and any(isinstance(record.get(k), str) for k in ("crc32", "sha256"))
    )


class RunRoot:
    """One run's storage. Paths given to its methods are relative to the root, '/'-separated."""

    def __init__(self, url: str | Path):
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)  # options: fsspec's config (store.configure)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.store: Store = store_for(self.fs)
        self._written: dict[str, tuple[str, dict[str, Any]]] = {}  # object stores: full path -> (version, record)
        self.io_threads = IO_THREADS if self.is_local else OBJECT_IO_THREADS

    def __repr__(self) -> str:
        return f"RunRoot({self.url!r})"

    def path(self, *parts: str) -> str:
        """The full path of a file under the root (a filesystem path when local)."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def local_path(self, *parts: str) -> Path:
        """A path usable with plain open(); only for local roots (DeepSpeed, SQLite need one). What
        DeepSpeed or SQLite then write there follows links, so a path that resolves outside the
        root (itself or a directory on the way a symbolic link) is refused (check_inside)."""
        if not self.is_local:
            raise InputError(f"{self.url}: this operation needs a local run root")
        if parts:
            self.check_inside(posixpath.join(*parts), follow_last=True)
        return Path(self.path(*parts))

    def check_inside(self, rel: str, follow_last: bool = False) -> str:
        """The full path of `rel`, refused (CorruptStateError naming it) on a local root when the
        directory holding it resolves outside the root: no write or delete inside a run root
        follows a symbolic link out of it (docs/security.md). The name itself is not followed (a
        rename replaces a link, a removal unlinks it) unless `follow_last`. Object stores have no
        links: the path is returned as is."""
        full = self.path(rel)
        if not self.is_local or not rel.strip("/"):
            return full
        top = os.path.normpath(self.root)
        if not os.path.normpath(full).startswith(top + os.sep):
            raise CorruptStateError(f"{full}: lies outside the run root {self.root}; refusing to write or remove it")
        probe = os.path.normpath(full) if follow_last else os.path.dirname(os.path.normpath(full))
        while probe.startswith(top + os.sep) and not os.path.lexists(probe):
            probe = os.path.dirname(probe)  # a missing part holds no link; a dangling link exists
        if not probe.startswith(top + os.sep):
            return full  # nothing below the root on the way exists yet (or `rel` is the root)
        base, real = os.path.realpath(top), os.path.realpath(probe)
        if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
            raise CorruptStateError(
                f"{full}: resolves outside the run root {self.root} (through a symbolic link); "
                f"refusing to write or remove it"
            )
        return full

    # -- reading -------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self._io(lambda: self.fs.exists(self.path(rel)), rel)

    def has_file(self, rel: str) -> bool:
        """Whether a file (not a directory) is there: on an object store one HEAD, where exists()
        lists the name as a directory too when the HEAD finds nothing (an idle island's poll asks
        this of every evaluation it waits for)."""
        return self.store.is_file(self.path(rel))  # the store retries

    def _io(self, op: Callable[[], T], rel: str) -> T:
        """A filesystem call, retried through transient store errors (pipeline.state.store.retrying)."""
        return op() if self.is_local else retrying(op, self.path(rel))

    def read_bytes(self, rel: str, writable: bool = False, max_bytes: int | None = None) -> bytes | bytearray:
        """A file's bytes; `writable` gives a bytearray that tensors can view without a copy
        (read straight into it on local roots). A file longer than `max_bytes` is refused after
        reading no more than that, so a hostile file costs bounded memory."""
        with self._reading(rel):
            return self._read(rel, writable, max_bytes)

    def _read(self, rel: str, writable: bool = False, max_bytes: int | None = None) -> bytes | bytearray:
        """read_bytes without its meaning of a missing file (FileNotFoundError is raised)."""
        if writable and self.is_local and max_bytes is None:
            with open(self.path(rel), "rb") as handle:
                buffer = bytearray(os.fstat(handle.fileno()).st_size)
                del buffer[handle.readinto(buffer) :]  # a file that shrank meanwhile fails its checksum
                return buffer
        if self.is_local:
            with self.fs.open(self.path(rel), "rb") as handle:
                data = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
        else:  # one GET, one whole version: never a read torn by a writer replacing the object
            data = self.store.read(self.path(rel), max_bytes).data
        self._within(rel, data, max_bytes)
        return bytearray(data) if writable else data

    def read_versioned(self, rel: str, max_bytes: int = MAX_STATE_JSON_BYTES) -> Versioned:
        """A small file's bytes and the version they are, for a later replace_if or delete_if."""
        with self._reading(rel):
            found = self.store.read(self.path(rel), max_bytes)
        self._within(rel, found.data, max_bytes)
        return found

    @contextmanager
    def _reading(self, rel: str, missing_ok: bool = False) -> Iterator[None]:
        """What a missing file (unless `missing_ok`: raised as it is) or a directory in its place
        means to every reader: one line naming it."""
        try:
            yield
        except FileNotFoundError:
            if missing_ok:
                raise
            raise InputError(f"{self.path(rel)}: file not found") from None
        except IsADirectoryError:
            raise CorruptStateError(f"{self.path(rel)}: is a directory, expected a file") from None

    def _within(self, rel: str, data: bytes, max_bytes: int | None) -> None:
        if max_bytes is not None and len(data) > max_bytes:
            raise CorruptStateError(f"{self.path(rel)}: larger than {max_bytes:,} bytes; refusing to read it")

    def create(self, rel: str, data: bytes) -> str | None:
        """Create a file only if nobody has (a claim, a token, a lock): its version, or None."""
        return self._conditional(rel, lambda path: self.store.create(path, data))

    def replace_if(self, rel: str, data: bytes, version: str) -> str | None:
        """Replace a file only if it is still `version` (compare-and-swap): the new version, or None."""
        return self._conditional(rel, lambda path: self.store.replace_if(path, data, version))

    def delete_if(self, rel: str, version: str) -> bool:
        return bool(self._conditional(rel, lambda path: self.store.delete_if(path, version)))

    def _conditional(self, rel: str, op: Callable[[str], R]) -> R:
        full = self.check_inside(rel)  # a local root: never through a link out of it
        _fault_point(full)
        try:
            return op(full)
        except OSError as exc:
            raise StorageError(f"{full}: cannot write ({exc.strerror or exc}); the previous state is intact") from None

    def read_json(self, rel: str, expect: type | tuple[type, ...] | None = dict) -> Any:
        """A stored JSON file (its top level an `expect`), within pipeline.core.bounds' size and depth
        bounds; anything else is a CorruptStateError naming the file."""
        return load_json(self.read_bytes(rel, max_bytes=MAX_STATE_JSON_BYTES), self.path(rel), expect)

    def read_json_if_exists(self, rel: str, expect: type | tuple[type, ...] | None = dict) -> Any:
        """read_json, or None where the file is not there: one GET on an object store, where an
        existence check first is a second round trip (an idle island reads the plan every poll)."""
        try:
            with self._reading(rel, missing_ok=True):
                data = self._read(rel, max_bytes=MAX_STATE_JSON_BYTES)
        except FileNotFoundError:
            return None
        return load_json(data, self.path(rel), expect)

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) in a directory, sorted; empty when it does not exist."""
        full = self.path(rel)

        found = self._io(lambda: [] if self.is_local and not self.fs.isdir(full) else self.store.names(full), rel)
        if not self.is_local:  # some stores list a "directory" placeholder object under its own name
            found = [n for n in found if n != posixpath.basename(full.rstrip("/"))]
        return sorted(n for n in found if _TMP_TAG not in n)

    def glob(self, pattern: str) -> list[str]:
        """Relative paths matching a glob under the root, sorted, temporaries excluded."""
        base = self.root.rstrip("/") + "/"
        globbed = self._io(lambda: self.fs.glob(self.path(pattern)), pattern)
        found = [p[len(base) :] if p.startswith(base) else p for p in globbed]
        return sorted(p for p in found if _TMP_TAG not in p)

    # -- writing -------------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write through a temporary name and rename into place (see _replace)."""
        self._replace(rel, lambda handle: handle.write(data))

    def _replace(self, rel: str, fill: Callable[[IO[bytes]], Any]) -> str:
        """Fill a temporary file, make it durable and rename it over `rel`; returns the full path.
        An object store has no rename, and needs none: the filled bytes go up in one PUT."""

        def make(tmp: str) -> None:
            with open(tmp, "xb") as handle:  # a fresh file, never one a link points at
                fill(handle)
                handle.flush()
                os.fsync(handle.fileno())

        if not self.is_local:
            buffer = io.BytesIO()
            fill(buffer)
            data = buffer.getvalue()
            record = checksum_bytes(data)
            full = self._put_object(rel, lambda full: self._remember(full, self.store.write(full, data), record))
            RECENT.keep(full, data, record["crc32"])
            return full
        return self._put(rel, make)

    def _put_object(self, rel: str, put: Callable[[str], Any], state: bool = True) -> str:
        """An object store's atomic write (see _put, whose contract it keeps)."""
        final = self.path(rel)
        if state:
            _fault_point(final)
        try:
            put(final)
        except OSError as exc:
            raise StorageError(f"{final}: cannot write ({exc.strerror or exc}); the previous state is intact") from None
        return final

    def _put(self, rel: str, make: Callable[[str], Any], state: bool = True) -> str:
        """`make` a file at a temporary name, then rename it over `rel`; returns the full path.
        A failure leaves the old file (or none) and raises StorageError naming the file, never a
        half-written one. Only `state` writes are fault-injection points (see write_note)."""
        final = self.check_inside(rel)
        if state:
            _fault_point(final)
        tmp = f"{final}{_TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
            make(tmp)
            if self.is_local:
                os.replace(tmp, final)
            else:
                self.fs.mv(tmp, final)
        except OSError as exc:
            self._discard(tmp)
            raise StorageError(f"{final}: cannot write ({exc.strerror or exc}); the previous state is intact") from None
        return final

    def _discard(self, tmp: str) -> None:
        try:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
        except OSError:
            pass

    def write_note(self, rel: str, data: bytes) -> None:
        """A file no stage depends on (a Beam worker's progress counters), rewritten every few
        seconds: through a temporary name and a rename like every write, so a reader never sees
        half of one, but not made durable (no fsync) and not a fault-injection point, since the
        crash tests count state writes and these come and go with the clock."""
        if not self.is_local:
            self._put_object(rel, lambda full: self.store.write(full, data), state=False)
            return
        self._put(rel, lambda tmp: self.fs.pipe_file(tmp, data), state=False)

    def write_json(self, rel: str, data: Any) -> None:
        self.write_bytes(rel, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def put_file(self, local: str | Path, rel: str) -> None:
        """Upload (or copy) a local file into the root, atomically, streaming it in blocks (in parts
        to an object store, where the object appears only once every part is in)."""
        if not self.is_local:
            data = Path(local).read_bytes() if RECENT.worth_keeping(os.path.getsize(local)) else None
            record = checksum_bytes(data) if data is not None else checksum_file(local)  # one pass over the bytes
            full = self._put_object(rel, lambda full: self._remember(full, self.store.upload(str(local), full), record))
            if data is not None:
                RECENT.keep(full, data, record["crc32"])
            return
        with open(local, "rb") as src:
            self._replace(rel, lambda handle: shutil.copyfileobj(src, handle, 1 << 22))

    def put_dir(self, local_dir: str | Path, rel: str) -> None:
        files = [file for file in sorted(Path(local_dir).rglob("*")) if file.is_file()]
        map_io(
            lambda file: self.put_file(file, posixpath.join(rel, file.relative_to(local_dir).as_posix())),
            files,
            self.io_threads,
        )

    def get_dir(self, rel: str, local_dir: str | Path) -> None:
        """Copy a committed directory to a local one: only the files its `_SUCCESS` lists, each
        through read_committed (its checksum checked, a symbolic link refused). Model bundles and
        MLflow artifacts are built with it, so a file slipped in beside the committed ones, or a
        link to one outside the root (`router/extra.txt -> ~/.ssh/id_ed25519`), never ships."""
        record = self.marker(rel)  # read once: each file is checked against it as it is read

        def fetch(name: str) -> None:
            target = Path(local_dir) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.read_committed(rel, name, marker=record))

        map_io(fetch, sorted(record["files"]), self.io_threads)  # several at once, as put_dir writes them

    def remove(self, rel: str) -> None:
        """Remove a file or a directory tree; on a local root only what is really inside it: a
        path reached through a symbolic link is refused, a link itself is unlinked (its target
        stays), and the tree's removal (shutil.rmtree) unlinks the links it meets."""
        full = self.check_inside(rel)
        if self.is_local and os.path.islink(full):
            os.unlink(full)
            return

        def rm() -> None:
            try:  # no existence check first: on an object store that is two more requests
                if self.is_local:
                    self.fs.rm(full, recursive=True)
                else:  # one listing, then one bulk delete of exactly what it found (a recursive rm lists twice)
                    RECENT.forget_under(full)
                    found = self.store.find(full)
                    if found:
                        self.fs.rm(found)
            except (FileNotFoundError, NotADirectoryError):  # not there (a parent may be a file), or removed meanwhile
                pass

        self._io(rm, rel)

    def files_under(self, rel: str) -> list[str]:
        """Every file below a directory, relative to it, sorted; temporaries and marker excluded."""
        full = self.path(rel).rstrip("/")
        if self.is_local and not self.fs.isdir(full):
            return []
        names = []
        for path in self._io(lambda: self.fs.find(full), rel):
            name = path[len(full) + 1 :] if path.startswith(full + "/") else posixpath.relpath(path, full)
            if _TMP_TAG not in name and posixpath.basename(name) != SUCCESS:
                names.append(name)
        return sorted(names)

    # -- commit markers ------------------------------------------------------------------------
    def commit(
        self,
        rel: str,
        info: dict[str, Any] | None = None,
        files: list[str] | None = None,
        linked: dict[str, dict[str, Any]] | None = None,
        write: bool = True,
    ) -> dict:
        """Mark a directory complete: `_SUCCESS` with the checksum of each file, written last.
        `linked` holds the records of files that are committed files under a second name
        (copy_committed's links): the same bytes on disk, so their records are taken, not read again.
        Not `write`: the record only, for a publish to write under its final name (publish_dir)."""
        names = self.files_under(rel) if files is None else sorted(files)
        linked = {n: r for n, r in (linked or {}).items() if r is not None}
        found = map_io(
            lambda n: linked[n] if n in linked else self._file_record(posixpath.join(rel, n)), names, self.io_threads
        )
        records = dict(zip(names, found))
        record = {"committed_at": time.time(), "files": records, **(info or {})}
        if write:
            self.write_json(posixpath.join(rel, SUCCESS), record)
        return record

    def is_committed(self, rel: str) -> bool:
        marker = posixpath.join(rel, SUCCESS)
        if self.is_local:
            return self.exists(marker)
        return self.store.version(self.path(marker), metadata_only=True) is not None  # one HEAD, no listing

    def marker(self, rel: str) -> dict[str, Any]:
        """The _SUCCESS record of a committed directory (refused when it is missing or malformed)."""
        record = self.marker_if_committed(rel)
        if record is None:
            raise InputError(f"{self.path(rel)}: not committed (no {SUCCESS})")
        return record

    def marker_if_committed(self, rel: str) -> dict[str, Any] | None:
        """The _SUCCESS record of a directory, or None while it is not committed; a malformed one is
        refused. One read, not asked for first: a reader that would check is_committed and then
        read the marker makes one request on an object store instead of two (three when absent)."""
        marker = posixpath.join(rel, SUCCESS)
        record = self.read_json_if_exists(marker)
        if record is None:
            return None
        files = record.get("files")
        if not isinstance(files, dict) or not all(_is_file_record(r) for r in files.values()):
            raise CorruptStateError(
                f"{self.path(marker)}: not a valid commit marker (no files with bytes and a checksum)"
            )
        for name in files:
            safe_relative(name, self.path(marker))
        at = record.get(FILES_AT)
        if at is not None and not (isinstance(at, str) and at and safe_relative(at, self.path(marker))):
            raise CorruptStateError(f"{self.path(marker)}: {FILES_AT} must name a directory of the run root")
        return record

    def files_location(self, rel_dir: str, marker: dict[str, Any]) -> str:
        """Where the files a committed directory's `_SUCCESS` lists lie: the directory itself, or
        the staged attempt a publish on an object store named (`files_at`, checked to lie inside
        the root by marker_if_committed: a marker can point only where its writer could write)."""
        return marker.get(FILES_AT) or rel_dir

    def read_committed(
        self,
        rel_dir: str,
        name: str,
        writable: bool = False,
        max_bytes: int | None = None,
        marker: dict[str, Any] | None = None,
    ) -> bytes | bytearray:
        """Read a file of a committed directory, refusing it unless it matches its checksum (and,
        with `max_bytes`, when its record or the file is longer than that). `marker`: the
        directory's record, when the caller has just read it (get_dir: once for all its files)."""
        record = marker or self.marker(rel_dir)
        expected, located = record["files"].get(name), self.files_location(rel_dir, record)
        full, named = self.path(located, name), self.path(rel_dir, name)
        if not isinstance(expected, dict):
            raise CorruptStateError(f"{named}: not listed in its directory's {SUCCESS}")
        self._refuse_link(located, name)
        if max_bytes is not None and expected["bytes"] > max_bytes:
            raise CorruptStateError(
                f"{full}: its {SUCCESS} record says {expected['bytes']:,} bytes, more than the "
                f"{max_bytes:,} this file may have; refusing to read it"
            )
        if self.is_local:
            return self._read_checked(located, name, expected, writable, max_bytes)
        # what this process wrote or read there (kept by the name it is read by): no transfer; a
        # read of it under way in another thread (an island's peers' reads) is waited for, not repeated
        with RECENT.one_reader(named):
            kept = RECENT.get(named)
            if kept is not None and matches_record(kept, expected):
                return bytearray(kept) if writable else kept
            kept = RECENT.get_same(expected)  # the same bytes under another name (a server-side copy)
            if kept is not None and matches_record(kept, expected):
                RECENT.keep(named, kept, expected.get("crc32"))
                return bytearray(kept) if writable else kept
            data = self._read_checked(located, name, expected, writable, max_bytes)
            # the shard of a path, a shared module: read again next task, next round
            RECENT.keep(named, data, expected.get("crc32"))
            return data

    def read_committed_runs(
        self,
        rel_dir: str,
        name: str,
        runs: list[Run],
        marker: dict[str, Any] | None = None,
        *,
        levels: Iterable[int],
    ) -> dict[tuple[int, int], bytearray] | None:
        """Byte runs [begin, end) of a committed file, each checked against its CRC-32 (a path's
        `parts` record: pipeline/state/module_store.py), read at once with ranged GETs; None when one does
        not match (the caller reads the file whole, against its whole record). A file this process
        holds whole is sliced, a run it read before is taken from memory (RecentFiles), which
        keeps each run with the `levels` it was read for (the runs hold those levels' tensors)."""
        levels = sorted(levels)
        record = marker or self.marker(rel_dir)
        expected, located = record["files"].get(name), self.files_location(rel_dir, record)
        if not isinstance(expected, dict):
            raise CorruptStateError(f"{self.path(rel_dir, name)}: not listed in its directory's {SUCCESS}")
        self._refuse_link(located, name)
        named, full = self.path(rel_dir, name), self.path(located, name)
        whole = None if self.is_local else (RECENT.get(named) or RECENT.get_same(expected))
        if whole is not None and not matches_record(whole, expected):
            whole = None

        def read(run: tuple[int, int, str]) -> bytearray | None:
            begin, end, crc = run
            if whole is not None:
                data = whole[begin:end]
                return bytearray(data) if checksum_bytes(data)["crc32"] == crc else None
            kept_as = f"{named}#{begin}-{end}"
            with RECENT.one_reader(kept_as, levels):
                data = None if self.is_local else RECENT.get(kept_as)
                if data is None or checksum_bytes(data)["crc32"] != crc:
                    with self._reading(posixpath.join(located, name)):
                        data = self.store.read_range(full, begin, end)
                    if len(data) != end - begin or checksum_bytes(data)["crc32"] != crc:
                        return None
                    if not self.is_local:
                        RECENT.keep(kept_as, data, crc, levels)
                else:
                    RECENT.serves_levels(kept_as, levels)
            return bytearray(data)

        found = map_io(read, runs, self.io_threads)
        return None if any(data is None for data in found) else {(b, e): d for (b, e, _), d in zip(runs, found)}

    def _read_checked(
        self, located: str, name: str, expected: dict[str, Any], writable: bool, max_bytes: int | None
    ) -> bytes | bytearray:
        """A listed file's bytes from where its marker says they lie, refused unless they match its record."""
        full = self.path(located, name)
        data = self.read_bytes(posixpath.join(located, name), writable, max_bytes)
        if not matches_record(data, expected):
            raise CorruptStateError(
                f"{full}: checksum does not match its {SUCCESS} record "
                f"({len(data)} bytes, expected {expected.get('bytes')}); refusing to load it"
            )
        return data

    def copy_committed(self, rel_dir: str, name: str, rel: str) -> dict[str, Any] | None:
        """A committed file at a second name, atomically. A local root links it, copying no byte,
        and returns the record its `_SUCCESS` keeps of it (for commit's `linked`): no write ever
        changes a file in place (each renames a new file over its name), so the two names hold
        the bytes that record was read from. An object store copies it on the server (CopyObject:
        no byte crosses this host's link, where a round's commit once moved every module down and up
        again) and returns the record too: a copy is byte for byte, and a reader checks it against
        the record as always. Where links fail, the file is copied through this host, checked
        against its record as it is read, and None is returned (commit reads the copy)."""
        marker = self.marker(rel_dir)
        record = marker["files"].get(name)
        if not self.is_local and isinstance(record, dict):
            self._copy(posixpath.join(self.files_location(rel_dir, marker), name), rel)
            RECENT.alias(self.path(rel_dir, name), self.path(rel))  # kept by the name it is read by
            return record
        if self.is_local and isinstance(record, dict):
            self._refuse_link(rel_dir, name)
            try:
                self._put(rel, lambda tmp: os.link(self.path(rel_dir, name), tmp))
                return record
            except StorageError:  # a filesystem without hard links: copy it (a real failure recurs there)
                pass
        self.write_bytes(rel, self.read_committed(rel_dir, name))
        return None

    def _clear_debris(self, final: str) -> bool:
        """Local publish_dir: move aside what sits uncommitted at `final` (a crashed writer's leftovers,
        which made every attempt's rename fail) and remove it; False when it turned out to be a
        publisher's committed output after all (put back: the first publisher won)."""
        aside = f"{final}{_TMP_TAG}debris-{uuid.uuid4().hex[:8]}"  # a temporary name: no listing shows it
        try:
            os.rename(self.check_inside(final), self.check_inside(aside))  # atomic: no publisher's rename interleaves
        except FileNotFoundError:
            return True
        except OSError as exc:
            raise StorageError(f"{self.path(final)}: cannot clear what is in the way ({exc.strerror})") from None
        if not os.path.islink(self.path(aside)) and self.is_committed(aside):
            os.rename(self.path(aside), self.path(final))
            return False
        self.remove(aside)
        return True

    def refuse_link(self, rel: str) -> None:
        """Refuse a file of a local root that is, or lies under, a symbolic link (run.yaml's read)."""
        self._refuse_link("", rel)

    def _refuse_link(self, rel_dir: str, name: str) -> None:
        """Refuse a committed file reached through a symbolic link anywhere below the root: pipeline
        state is plain files, and a link would read (and ship) whatever it points at."""
        if not self.is_local:
            return
        full = self.path(rel_dir, name)
        if os.path.realpath(full) != os.path.join(
            os.path.realpath(self.root), os.path.normpath(posixpath.join(rel_dir, name))
        ):
            raise CorruptStateError(
                f"{full}: is or lies under a symbolic link; committed state is plain files, refusing it"
            )

    def read_committed_json(
        self,
        rel_dir: str,
        name: str,
        expect: type | tuple[type, ...] | None = dict,
        marker: dict[str, Any] | None = None,
    ) -> Any:
        """A committed JSON file (router.json, manifest.json, a path's metrics.json, ...), checked
        and parsed within bounds; `marker` as read_committed's."""
        data = self.read_committed(rel_dir, name, max_bytes=MAX_STATE_JSON_BYTES, marker=marker)
        return load_json(data, self.path(rel_dir, name), expect)

    def verify(self, rel: str) -> None:
        """Check every file of a committed directory against its marker."""
        for name in self.marker(rel)["files"]:
            self.read_committed(rel, name)

    def _remember(self, full: str, version: str | None, record: dict[str, Any]) -> None:
        """An object store: the record of what this process just wrote (`record`: its checksum),
        with the version the store gave it, so a commit need not download the file again to
        checksum it (see _file_record)."""
        if version:
            self._written[full] = (version, record)

    def _file_record(self, rel: str) -> dict[str, Any]:
        """From the bytes on disk, never from what this process believes it wrote: two writers of
        one directory (a paused island that lost its lease, and its successor) once committed a
        marker that matched neither file, and every later read of the directory failed."""
        if self.is_local:
            return checksum_file(self.path(rel))
        full = self.path(rel)
        written = self._written.pop(full, None)
        if written is not None and self.store.version(full, metadata_only=True) == written[0]:
            return written[1]  # the store still holds the very version we wrote: its bytes are the ones we summed
        return checksum_bytes(self.read_bytes(rel))

    # -- publishing ----------------------------------------------------------------------------
    def publish_dir(self, staged: str, final: str, staged_record: dict[str, Any] | None = None) -> bool:
        """Make the committed directory `staged` the directory `final` unless `final` is committed
        already; True when this call published it. The first publisher wins, like a lease claim.
        A local root renames the directory (rename(2) of a directory fails onto a non-empty one,
        and is atomic). An object store has no rename: it creates `final`'s `_SUCCESS`
        exclusively (If-None-Match: *), a copy of the staged record that names the staged attempt
        (`files_at`), where the files stay and are read from (files_location). One request, no
        byte copied: a publish once took a token, a server-side copy of each file and a marker.
        `staged_record`: the `_SUCCESS` record its caller just made for `staged` (commit): one
        request fewer. On an object store the caller need not write it there (commit's `write`):
        this create is then the record's only write, and until it the attempt counts for nothing."""
        if self.is_local:
            if self.is_committed(final):
                return False
            if staged_record is None and not self.is_committed(staged):
                raise CorruptStateError(f"{self.path(staged)}: refusing to publish a directory that is not committed")
            target = Path(self.check_inside(final))  # a link there is debris like any other: renamed, not followed
            target.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(2):
                try:
                    os.rename(self.local_path(staged), target)
                    return True
                except OSError as exc:
                    if self.is_committed(final):
                        return False
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                        raise StorageError(f"{target}: cannot publish {self.path(staged)} ({exc.strerror})") from None
                    if not self._clear_debris(final):
                        return False
            return False
        record = staged_record if staged_record is not None else self.marker_if_committed(staged)
        if record is None:
            raise CorruptStateError(f"{self.path(staged)}: refusing to publish a directory that is not committed")
        published = {**record, FILES_AT: staged}
        data = (json.dumps(published, indent=2, sort_keys=True) + "\n").encode()  # as write_json
        if self.create(posixpath.join(final, SUCCESS), data) is None:
            # Refused; but a create whose answer was lost (a timeout, a dropped link) and was tried
            # again is refused by its own first try: the marker that is there says whose it is.
            there = self.marker_if_committed(final)
            if there is None or there.get(FILES_AT) != staged:
                return False
        for name in record["files"]:  # what this process holds of the attempt, by the name it is read by
            RECENT.alias(self.path(staged, name), self.path(final, name))
        return True

    def published_files_at(self, staged: str) -> str | None:
        """Where a directory published from `staged` keeps its files when they stay there (an
        object store: `staged`, its marker's files_at); None where publishing moved them (a local root)."""
        return None if self.is_local else staged

    def _copy(self, src_rel: str, dst_rel: str) -> None:
        """A server-side copy on an object store (CopyObject: no byte passes through this host)."""
        self._put_object(dst_rel, lambda full: self.store.copy(self.path(src_rel), full))


class ListedRoot:
    """An object-store RunRoot seen through one listing of each of a few directories, taken at once: is_committed,
    has_file and listdir below them answer from it; everything else (reads, writes, questions
    about other paths) goes to the root.

    For one look at the queue on an object store (TaskQueue.ready): its few dozen existence checks
    went out in ~20 waves of HEADs, each a round trip, 1.2-1.5 s a poll over a 40 ms link between
    every task and the next (benchmarks/RESULTS.md, "Islands on separate hosts"). A listing may
    miss what is committed while it is taken; the next poll sees it. Nothing it answers is acted on
    unchecked: a claim is a conditional create, and a train task checks its output afterwards."""

    def __init__(self, root: RunRoot, directories: Iterable[str]):
        self.run_root = root  # not `root`: that is the RunRoot's own path, which callers may ask for
        self.directories = sorted({d.strip("/") + "/" for d in directories})
        base = root.root.rstrip("/") + "/"

        def listing(rel: str) -> list[str]:
            full = root.path(rel).rstrip("/")
            found = root._io(lambda: root.store.find(full), rel)
            return [path[len(base) :] for path in found if path.startswith(base)]

        self.keys = {key for keys in map_io(listing, self.directories, root.io_threads) for key in keys}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run_root, name)

    def _listed(self, rel: str) -> bool:
        return any(rel.startswith(d) for d in self.directories)

    def has_file(self, rel: str) -> bool:
        return rel in self.keys if self._listed(rel) else self.run_root.has_file(rel)

    def is_committed(self, rel: str) -> bool:
        marker = posixpath.join(rel, SUCCESS)
        return marker in self.keys if self._listed(marker) else self.run_root.is_committed(rel)

    def listdir(self, rel: str) -> list[str]:
        inside = rel.strip("/") + "/"
        if not self._listed(inside):
            return self.run_root.listdir(rel)
        names = {key[len(inside) :].split("/", 1)[0] for key in self.keys if key.startswith(inside)}
        return sorted(n for n in names if _TMP_TAG not in n)
