"""Where a disk and an object store differ, in one place: the few operations pipeline state needs
from its storage, each implemented for a local filesystem, S3 (and S3-compatible stores: MinIO,
Ceph RGW, R2), GCS, and fsspec's in-memory store for tests.

Callers (RunRoot, and through it the leases, publishing, the run lock and retention) ask for an
operation and never branch on the kind of store:

- `write`: replace a file atomically. A disk writes a temporary name and renames it; an object
  store has no rename (s3fs's `mv` is a copy and a delete, neither atomic nor cheap), but a PUT is
  atomic by itself: a reader sees the old object or the new one. Large files go up multipart and
  appear only when the upload completes.
- `create`: create a file only if it is absent (a claim, a publish token, the run lock): link(2)
  on a disk, `If-None-Match: *` on S3, `ifGenerationMatch=0` on GCS.
- `read`: a file's bytes and the version they are, from one request. s3fs's file objects read in
  ranges pinned to the ETag they first saw, so a lease rewritten while it was read failed with
  "At least one of the pre-conditions you specified did not hold" (EINVAL) and killed an island;
  one GET returns one whole version, and a read that still races is read again.
- `read_range`: bytes [begin, end) of a file no writer replaces (a committed directory's file):
  one ranged GET. A merge reads of a path's weights only the modules it merges (state/module_store.py).
- `replace_if` / `delete_if`: compare-and-swap on the version last read or written (`If-Match` on
  the ETag, the GCS generation, or a lock on the file's inode on a disk). A lease
  heartbeat is one: a holder whose record someone else ended learns it from the store.

Transient errors (5xx, throttling, timeouts, dropped connections) are retried with exponential
backoff for at most RETRY_S seconds; what still fails is a StorageError naming the file.

What a process wrote to an object store or read from it stays in its memory a while (RecentFiles,
at the end), so that reading it again costs no transfer; RunRoot.read_committed takes it only when
the directory's `_SUCCESS`, read from the store, certifies the bytes.

Options (`storage.options`: endpoint_url, region, ...) reach the filesystems through fsspec's own
config (`fsspec.config.conf`, and `FSSPEC_<PROTOCOL>` in the environment for child processes), so
every RunRoot, island, rank and Beam worker of a process tree opens the store the same way.
Credentials never go there: they come from the standard places (AWS_* variables, ~/.aws, the GCS
application-default credentials).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import inspect
import json
import logging
import os
import posixpath
import random
import threading
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.core.errors import ConfigError, StorageError

log = logging.getLogger("dipaco.store")
# botocore's "Found credentials in environment variables." at INFO: one line from every client of
# every island and rank, and the only line besides the refusal when a preflight refuses a store
# (a bad input gets one line). Where the credentials came from is still said at DEBUG.
for _name in ("botocore.credentials", "aiobotocore.credentials"):
    logging.getLogger(_name).setLevel(logging.WARNING)
T = TypeVar("T")

RETRY_S = 60.0  # how long a transient error is retried before it is a StorageError
LOCK_WAIT_S = 2.0  # a disk's compare-and-swap waits this long at most for another writer's lock
TMP_TAG = ".tmp-"  # a file being written (a disk only): never listed, never read
# Object-store options a run may set: everything the filesystem's constructor takes, except what
# belongs in the standard credential places (never in run.yaml, which is logged and shared).
SECRET_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "username", "session", "credentials", "access_key", "secret_key"}
)
# fsspec defaults that object-store run roots need: a listing is always fresh (s3fs and gcsfs
# cache directory listings for the life of a process, and an island lives for a whole run).
OBJECT_DEFAULTS = {"use_listings_cache": False}
# Codes of transient object-store errors (AWS, GCS and their S3-compatible peers).
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",  # S3: a conditional write raced another; try again
        "500",
        "502",
        "503",
        "504",
        "429",
    }
)


@dataclass(frozen=True)
class Versioned:
    """A file's bytes and the version they are (an ETag, a GCS generation, an inode and mtime)."""

    data: bytes
    version: str


def protocol_of(url: str) -> str:
    """'s3', 'gs', 'memory', ... or 'file' for a local path."""
    proto = url.split("://", 1)[0] if "://" in url else "file"
    return {"gcs": "gs", "s3a": "s3", "local": "file"}.get(proto, proto)


def configure(url: str, options: dict[str, Any] | None, source: str = "storage.options") -> None:
    """Make `options` the defaults of `url`'s filesystem in this process and its children (fsspec's
    config and its FSSPEC_<PROTOCOL> variable). Unknown and secret keys are refused here, naming
    the key, so a typo never becomes a silently ignored keyword."""
    proto = protocol_of(url)
    options = dict(options or {})
    check_options(proto, options, source)
    defaults = {**(OBJECT_DEFAULTS if proto not in ("file", "memory") else {}), **options}
    if not defaults:
        return
    fsspec.config.conf[proto] = {**fsspec.config.conf.get(proto, {}), **defaults}
    os.environ[f"FSSPEC_{proto.upper()}"] = json.dumps(fsspec.config.conf[proto], sort_keys=True)


def configure_storage(config) -> None:
    """configure() for a run's config: its run root's store takes `storage.options`."""
    configure(config.run_root, config.storage.options, f"{config.source}: storage.options")


def check_options(proto: str, options: dict[str, Any], source: str) -> None:
    """Refuse secrets and keys the store's filesystem does not take."""
    for key in options:
        if key.lower() in SECRET_OPTIONS or any(s in key.lower() for s in ("secret", "password", "token")):
            raise ConfigError(
                f"{source}: storage.options.{key} is a credential; give it in the environment "
                f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, or the GCS default credentials), "
                f"never in the config"
            )
    for key, value in options.items():
        if isinstance(value, str) and "://" in value and "@" in value.split("://", 1)[1].split("/", 1)[0]:
            raise ConfigError(
                f"{source}: storage.options.{key} carries credentials in its URL; give them in the environment, "
                f"never in the config"
            )
    if not options:
        return
    try:
        cls = fsspec.get_filesystem_class(proto)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{source}: no filesystem for {proto}:// ({exc})") from None
    known = {
        name
        for klass in cls.__mro__
        if "__init__" in vars(klass)
        for name, p in inspect.signature(klass.__init__).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    } - {"self", "args", "kwargs", "storage_options"}
    for key in options:
        if key not in known:
            raise ConfigError(
                f"{source}: storage.options.{key} is not an option of {cls.__name__} ({proto}://); "
                f"known: {', '.join(sorted(k for k in known if not k.startswith('_')))}"
            )


# -- errors ----------------------------------------------------------------------------------------
def error_code(exc: BaseException) -> str | None:
    """The store's error code behind an exception (botocore's, an HTTP status), or None."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return str(status)
        code = getattr(err, "code", None)  # gcsfs's HttpError
        if isinstance(code, int):
            return str(code)
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth another try: throttling, a 5xx, a timeout, a dropped connection, a body that failed
    its checksum on the way (botocore's FlexibleChecksumError: S3 checks a PUT's checksum, so
    what it stored is whole, and the next read brings it)."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if error_code(exc) in TRANSIENT_CODES:
        return True
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    if names & {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "TimeoutError",
        "FSTimeoutError",
        "IncompleteRead",
        "FlexibleChecksumError",
    }:
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EBUSY)


def retrying(op: Callable[[], T], what: str, deadline_s: float = RETRY_S) -> T:
    """op(), again after a transient error with backoff (0.1 s doubling to 4 s, jittered) until
    `deadline_s` has passed; a permanent error is raised at once."""
    start, tries = time.monotonic(), 0
    while True:
        try:
            return op()
        except Exception as exc:  # noqa: BLE001 - classified right below
            tries += 1
            if not is_transient(exc) or time.monotonic() - start > deadline_s:
                raise
            delay = min(4.0, 0.1 * 2 ** (tries - 1)) * (0.5 + random.random() / 2)
            log.warning("%s: transient storage error (%s); retry %d in %.2f s", what, exc, tries, delay)
            time.sleep(delay)


def _precondition_failed(exc: BaseException) -> bool:
    return (
        isinstance(exc, FileExistsError)
        or error_code(exc) in ("PreconditionFailed", "412", "304")
        or (isinstance(exc, OSError) and exc.errno == errno.EINVAL and "pre-condition" in str(exc))
    )


# -- stores ----------------------------------------------------------------------------------------
class Store(ABC):
    """The operations that differ between stores (module docstring). Paths are full fsspec paths."""

    kind = "fsspec"

    def __init__(self, fs: fsspec.AbstractFileSystem, retry_s: float = RETRY_S):
        self.fs = fs
        self.retry_s = retry_s  # how long transient errors are retried (0: a preflight's one try)

    def retrying(self, op: Callable[[], T], what: str) -> T:
        return retrying(op, what, self.retry_s)

    @abstractmethod
    def write(self, path: str, data: bytes) -> str:
        """Replace the file atomically; returns its new version."""

    def upload(self, local: str, path: str) -> str | None:
        """A local file into the store, atomically (multipart on object stores); its version."""
        with open(local, "rb") as handle:
            return self.write(path, handle.read())

    @abstractmethod
    def read(self, path: str, max_bytes: int | None = None) -> Versioned:
        """One whole version of the file (at most max_bytes + 1 bytes of it); FileNotFoundError if absent."""

    def read_range(self, path: str, begin: int, end: int) -> bytes:
        """Bytes [begin, end) of a file no writer replaces (shorter where the file is); the caller
        checks them against their record. FileNotFoundError if absent."""
        return self.retrying(lambda: self.fs.cat_file(path, start=begin, end=end), path)

    @abstractmethod
    def create(self, path: str, data: bytes) -> str | None:
        """Create the file only if it is absent: its version, or None when it existed."""

    @abstractmethod
    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        """Replace the file only if it is still `version`: the new version, or None."""

    @abstractmethod
    def delete_if(self, path: str, version: str) -> bool:
        """Delete the file only if it is still `version`."""

    @staticmethod
    def _unless_refused(op: Callable[[], T], gone_refuses: bool = True) -> T | None:
        """op()'s result, or None when the store refused its condition (the version changed, the
        file exists already, or, with `gone_refuses`, the file is gone). A missing bucket is never
        a refusal: it is raised, and the preflight names it."""
        try:
            return op()
        except Exception as exc:  # noqa: BLE001 - a refused condition is an answer, anything else is raised
            if error_code(exc) == "NoSuchBucket":
                raise
            if _precondition_failed(exc):
                return None
            if gone_refuses and (isinstance(exc, FileNotFoundError) or error_code(exc) in ("NoSuchKey", "404")):
                return None
            raise

    def version(self, path: str, metadata_only: bool = False) -> str | None:
        """The file's current version, or None when absent; `metadata_only`: without its bytes
        where the store can (a HEAD), at the cost of a listing-level view on stores that cannot."""
        try:
            return self.read(path).version
        except FileNotFoundError:
            return None

    def is_file(self, path: str) -> bool:
        return self.retrying(lambda: self.fs.isfile(path), path)

    def find(self, path: str) -> list[str]:
        """Every file at `path` or below it (fsspec's paths, without the protocol); [] when none.
        Not retried here: RunRoot.remove retries the listing together with the delete it feeds."""
        return self.fs.find(path)

    def names(self, path: str) -> list[str]:
        """The names of the files and directories right below `path`; [] when there are none.
        Not retried here: RunRoot.listdir retries it."""
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]
        except (FileNotFoundError, NotADirectoryError):  # an object store has no empty directories
            return []

    def copy(self, src: str, dst: str) -> None:
        """`src`'s bytes at `dst`, copied inside the store where it can (no byte through this host)."""
        self.retrying(lambda: self.fs.cp_file(src, dst), dst)


class LocalStore(Store):
    """A disk: temporary name + fsync + rename; link(2) for exclusive creates; compare-and-swap
    under an flock of the file's directory, the version being the inode, mtime and size (every
    write renames a new inode into place, so a replaced file never keeps its version)."""

    kind = "local"

    def write(self, path: str, data: bytes) -> str:
        tmp = self._tmp(path)
        try:
            self._fill(tmp, data)
            os.replace(tmp, path)
        finally:
            _unlink(tmp)
        return self._version_of(os.stat(path))

    def upload(self, local: str, path: str) -> None:
        import shutil

        tmp = self._tmp(path)
        try:
            with open(local, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, path)
        finally:
            _unlink(tmp)

    def read(self, path: str, max_bytes: int | None = None) -> Versioned:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
            return Versioned(data, self._version_of(os.fstat(handle.fileno())))

    def read_range(self, path: str, begin: int, end: int) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return os.pread(fd, max(end - begin, 0), begin)
        finally:
            os.close(fd)

    def create(self, path: str, data: bytes) -> str | None:
        tmp = self._tmp(path)
        try:
            self._fill(tmp, data)
            try:
                os.link(tmp, path)  # fails when the name exists: the claim is exclusive
            except FileExistsError:
                return None
        finally:
            _unlink(tmp)
        return self._version_of(os.stat(path))

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        with self._inode_lock(path) as present:
            if not present or self._current(path) != version:
                return None
            return self.write(path, data)

    def delete_if(self, path: str, version: str) -> bool:
        with self._inode_lock(path) as present:
            if not present or self._current(path) != version:
                return False
            os.unlink(path)
            return True

    def version(self, path: str, metadata_only: bool = False) -> str | None:
        return self._current(path)

    def _current(self, path: str) -> str | None:
        try:
            return self._version_of(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            return None

    @staticmethod
    def _version_of(st: os.stat_result) -> str:
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    @staticmethod
    def _tmp(path: str) -> str:
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        return f"{path}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @staticmethod
    def _fill(tmp: str, data: bytes) -> None:
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    @staticmethod
    @contextmanager
    def _inode_lock(path: str) -> Iterator[bool]:
        """Lock the file now at `path` (False: there is none) for a compare-and-swap.

        The lock is on the file's inode, not its directory: every write renames a new inode into
        place, and each rename is made by the holder of its predecessor's lock, so a holder that
        sees `path` still at the inode it locked knows nobody can replace it before it does. A
        lock on the directory serialised every attempt of a task, and an island stopped (SIGSTOP,
        a paused VM) inside its heartbeat's few milliseconds of lock blocked its successor's
        heartbeat for good. A lock still held after LOCK_WAIT_S is an error (a StorageError to the
        caller, which retries or gives the lease up), never a wait without end."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            yield False
            return
        try:
            deadline, delay = time.monotonic() + LOCK_WAIT_S, 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            errno.ETIMEDOUT, f"another writer has held its lock for over {LOCK_WAIT_S:g} s"
                        ) from None
                    time.sleep(delay)
                    delay = min(2 * delay, 0.05)
            yield True
        finally:
            os.close(fd)  # closing releases the flock


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class S3Store(Store):
    """S3 and S3-compatible stores through s3fs's client (its endpoint, region and credentials)."""

    kind = "s3"
    MULTIPART_ABOVE = 64 << 20  # s3fs uploads larger files in parts; the object appears when they complete
    PART_BYTES = 50 << 20  # s3fs's default part size (a file under two parts goes up in one PUT)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def _put(self, path: str, data: bytes, **condition: str) -> str:
        bucket, key = self._split(path)
        response = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        return str(response.get("ETag", ""))

    def write(self, path: str, data: bytes) -> str:
        if len(data) > self.MULTIPART_ABOVE:
            self.fs.pipe_file(path, data)
            return ""
        return self.retrying(lambda: self._put(path, data), path)

    def upload(self, local: str, path: str) -> str | None:
        if os.path.getsize(local) <= self.PART_BYTES:  # one PUT, whose answer is the version: no HEAD after
            with open(local, "rb") as handle:
                return self.write(path, handle.read())
        self.retrying(lambda: self.fs.put_file(local, path, chunksize=self.PART_BYTES), path)
        return self.version(path, metadata_only=True)

    def version(self, path: str, metadata_only: bool = False) -> str | None:
        if not metadata_only:
            return super().version(path)
        bucket, key = self._split(path)
        try:
            return str(self.retrying(lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=key), path)["ETag"])
        except FileNotFoundError:
            return None

    def is_file(self, path: str) -> bool:
        return self.version(path, metadata_only=True) is not None  # one HEAD; isfile lists too when it fails

    def find(self, path: str) -> list[str]:
        """One listing (a page per 1,000 keys): s3fs's find lists, then HEADs and lists again when
        nothing is there, three round trips for every removal of a directory that is already gone."""
        bucket, key = self._split(path.rstrip("/"))
        # the prefix also matches siblings (attempt-1 lists attempt-10/...): keep the file and its tree
        return [
            f"{bucket}/{item['Key']}"
            for page in self._pages(bucket, Prefix=key)
            for item in page.get("Contents", [])
            if item["Key"] == key or item["Key"].startswith(key + "/")
        ]

    def _pages(self, bucket: str, **params: str) -> Iterator[dict]:
        """ListObjectsV2's pages for `params` (a page per 1,000 keys), following the continuation token."""
        token: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, **params, **token)
            yield page
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def names(self, path: str) -> list[str]:
        """One delimited listing (a page per 1,000 names): s3fs's ls of a prefix with nothing under
        it lists the parent as well before it answers, a second round trip for every claim of a
        task that has no attempt yet."""
        bucket, key = self._split(path.rstrip("/"))
        found: list[str] = []
        for page in self._pages(bucket, Prefix=key + "/", Delimiter="/"):
            found += [item["Key"][len(key) + 1 :] for item in page.get("Contents", [])]
            found += [item["Prefix"][len(key) + 1 :].rstrip("/") for item in page.get("CommonPrefixes", [])]
        return [name for name in found if name]

    def copy(self, src: str, dst: str) -> None:
        """CopyObject, without the HEAD s3fs's cp_file sends first to choose a multipart copy; an
        object past CopyObject's 5 GB (refused) is copied by cp_file in parts."""
        (src_bucket, src_key), (bucket, key) = self._split(src), self._split(dst)
        try:
            self.retrying(
                lambda: self.fs.call_s3(
                    "copy_object", Bucket=bucket, Key=key, CopySource={"Bucket": src_bucket, "Key": src_key}
                ),
                dst,
            )
        except OSError as exc:
            if error_code(exc) not in ("InvalidRequest", "EntityTooLarge"):
                raise
            super().copy(src, dst)

    def read(self, path: str, max_bytes: int | None = None) -> Versioned:
        bucket, key = self._split(path)

        async def get() -> Versioned:
            extra = {} if max_bytes is None else {"Range": f"bytes=0-{max_bytes}"}
            try:
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
            except OSError as exc:
                if error_code(exc) != "InvalidRange":  # Range on an empty object: read it whole
                    raise
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = response["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return Versioned(data, str(response.get("ETag", "")))

        return self.retrying(lambda: fsspec.asyn.sync(self.fs.loop, get), path)

    def read_range(self, path: str, begin: int, end: int) -> bytes:
        if end <= begin:
            return b""
        bucket, key = self._split(path)

        async def get() -> bytes:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={begin}-{end - 1}")
            body = response["Body"]
            try:
                return await body.read()
            finally:
                body.close()

        return self.retrying(lambda: fsspec.asyn.sync(self.fs.loop, get), path)

    def create(self, path: str, data: bytes) -> str | None:
        return self._unless_refused(
            lambda: self.retrying(lambda: self._put(path, data, IfNoneMatch="*"), path), gone_refuses=False
        )

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        return self._unless_refused(lambda: self.retrying(lambda: self._put(path, data, IfMatch=version), path))

    def delete_if(self, path: str, version: str) -> bool:
        bucket, key = self._split(path)

        def delete() -> bool:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
            return True

        return bool(self._unless_refused(lambda: self.retrying(delete, path)))


class GCSStore(Store):
    """GCS through gcsfs's client: generations are the versions, `ifGenerationMatch` the condition
    (0: only if absent). Written to the JSON API as gcsfs's own uploads are; not run against a live
    GCS here (no emulator installs from the registries), unlike S3, which the tests run against."""

    kind = "gcs"

    def _upload(self, path: str, data: bytes, generation: str | None) -> str:
        bucket, key, _ = self.fs.split_path(path)
        condition = {} if generation is None else {"ifGenerationMatch": generation}

        async def post() -> str:
            from urllib.parse import quote

            meta = json.dumps({"name": key})
            body = (
                (
                    f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
                    "Content-Type: application/octet-stream\n\n"
                ).encode()
                + data
                + b"\n--==0==--"
            )
            out = await self.fs._call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                uploadType="multipart",
                headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                data=body,
                json_out=True,
                **condition,
            )
            return str(out.get("generation", ""))

        return self.retrying(lambda: fsspec.asyn.sync(self.fs.loop, post), path)

    def write(self, path: str, data: bytes) -> str:
        return self._upload(path, data, None)

    def upload(self, local: str, path: str) -> None:
        self.retrying(lambda: self.fs.put_file(local, path), path)

    def read(self, path: str, max_bytes: int | None = None) -> Versioned:
        async def get() -> Versioned:
            headers = {} if max_bytes is None else {"Range": f"bytes=0-{max_bytes}"}
            response_headers, data = await self.fs._call("GET", self.fs.url(path), headers=headers)
            return Versioned(data, str(response_headers.get("x-goog-generation", "")))

        return self.retrying(lambda: fsspec.asyn.sync(self.fs.loop, get), path)

    def read_range(self, path: str, begin: int, end: int) -> bytes:
        if end <= begin:
            return b""

        async def get() -> bytes:
            headers = {"Range": f"bytes={begin}-{end - 1}"}
            return (await self.fs._call("GET", self.fs.url(path), headers=headers))[1]

        return self.retrying(lambda: fsspec.asyn.sync(self.fs.loop, get), path)

    def create(self, path: str, data: bytes) -> str | None:
        return self._unless_refused(lambda: self._upload(path, data, "0"), gone_refuses=False)

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        return self._unless_refused(lambda: self._upload(path, data, version))

    def delete_if(self, path: str, version: str) -> bool:
        bucket, key, _ = self.fs.split_path(path)

        def delete() -> bool:
            fsspec.asyn.sync(self.fs.loop, self.fs._call, "DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
            return True

        return bool(self._unless_refused(lambda: self.retrying(delete, path)))


class MemoryStore(Store):
    """fsspec's in-process store (tests): every conditional operation under one process-wide lock,
    the version a digest of the bytes and a write counter."""

    kind = "memory"
    _lock = threading.Lock()
    _counter = 0

    def _version(self, data: bytes) -> str:
        MemoryStore._counter += 1
        return f"{hashlib.sha1(data).hexdigest()[:16]}-{MemoryStore._counter}"

    def _versions(self) -> dict[str, str]:
        store = getattr(self.fs, "_dipaco_versions", None)
        if store is None:
            store = self.fs._dipaco_versions = {}
        return store

    def write(self, path: str, data: bytes) -> str:
        with self._lock:
            self.fs.pipe_file(path, data)
            version = self._versions()[path] = self._version(data)
            return version

    def read(self, path: str, max_bytes: int | None = None) -> Versioned:
        with self._lock:
            data = self.fs.cat_file(path)
            version = self._versions().get(path) or self._versions().setdefault(path, self._version(data))
        return Versioned(data if max_bytes is None else data[: max_bytes + 1], version)

    def read_range(self, path: str, begin: int, end: int) -> bytes:
        with self._lock:
            return self.fs.cat_file(path)[begin:end]

    def create(self, path: str, data: bytes) -> str | None:
        with self._lock:
            if self.fs.exists(path):
                return None
            self.fs.pipe_file(path, data)
            version = self._versions()[path] = self._version(data)
            return version

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        with self._lock:
            if not self.fs.exists(path) or self._versions().get(path) != version:
                return None
            self.fs.pipe_file(path, data)
            new = self._versions()[path] = self._version(data)
            return new

    def delete_if(self, path: str, version: str) -> bool:
        with self._lock:
            if not self.fs.exists(path) or self._versions().get(path) != version:
                return False
            self.fs.rm(path)
            self._versions().pop(path, None)
            return True


def store_for(fs: fsspec.AbstractFileSystem, retry_s: float = RETRY_S) -> Store:
    """The Store of an fsspec filesystem, by its protocol."""
    if isinstance(fs, LocalFileSystem):
        return LocalStore(fs, retry_s)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocols or "s3a" in protocols:
        return S3Store(fs, retry_s)
    if "gs" in protocols or "gcs" in protocols:
        return GCSStore(fs, retry_s)
    if "memory" in protocols:
        return MemoryStore(fs, retry_s)
    raise ConfigError(
        f"{protocols[0]}://: not a supported run root (a local path, file://, s3://, gs:// or memory://): "
        f"a run root needs conditional writes"
    )


def probe_conditional_writes(store: Store, prefix: str) -> None:
    """Create a probe object twice, then remove it: a store that lets the second create through does
    not honour conditional writes, and two islands could then hold one lease (StorageError)."""
    probe = posixpath.join(prefix, f".dipaco-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    first = store.create(probe, b"probe\n")
    if first is None:
        raise StorageError(f"{probe}: a fresh probe object already existed; the store's listing is not consistent")
    try:
        again = store.create(probe, b"probe again\n")
        if again is not None:
            raise StorageError(
                f"{prefix}: the store ignores conditional writes (a second If-None-Match create of a probe "
                f"object succeeded); islands need them to hold leases exclusively"
            )
    finally:
        version = store.version(probe)
        if version is not None:
            store.delete_if(probe, version) or store.fs.rm(probe)


# -- preflight -------------------------------------------------------------------------------------
PROBE_TIMEOUT_S = 3.0  # a preflight's connect and read timeouts: an unreachable endpoint is named in seconds


def probe_store(url: str) -> Store:
    """The store of `url` opened for a preflight: this process's options, short timeouts, one try."""
    proto = protocol_of(url)
    options = dict(fsspec.config.conf.get(proto, {}))
    if proto == "s3":
        options["config_kwargs"] = {
            **options.get("config_kwargs", {}),
            "connect_timeout": PROBE_TIMEOUT_S,
            "read_timeout": PROBE_TIMEOUT_S,
            "retries": {"max_attempts": 1},
        }
    elif proto == "gs":
        options["timeout"] = PROBE_TIMEOUT_S
    fs, _ = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    return store_for(fs, retry_s=0.0)


def why_unusable(exc: BaseException, url: str) -> str:
    """One line for what a failed probe of an object store means."""
    code = error_code(exc)
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    if code in ("NoSuchBucket", "404") or (isinstance(exc, FileNotFoundError) and "bucket" in str(exc).lower()):
        return f"{url}: the bucket does not exist (create it first, or fix run_root)"
    if names & {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}:
        return f"{url}: no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws, or GCS defaults)"
    if code in ("AccessDenied", "403", "401", "InvalidAccessKeyId", "SignatureDoesNotMatch") or isinstance(
        exc, PermissionError
    ):
        return f"{url}: the credentials cannot write there ({code or type(exc).__name__})"
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionRefusedError"} or (
        isinstance(exc, (ConnectionError, TimeoutError))
    ):
        return (
            f"{url}: the store's endpoint cannot be reached ({type(exc).__name__}); check storage.options.endpoint_url"
        )
    return f"{url}: cannot write to the store ({type(exc).__name__}: {str(exc)[:200]})"


def check_writable(url: str, root: str) -> None:
    """Before a run writes anything to an object store: the bucket exists, the credentials write,
    and conditional writes are honoured. A StorageError with one line naming what is wrong."""
    store = probe_store(url)
    try:
        probe_conditional_writes(store, root)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of the probe becomes one line
        raise StorageError(why_unusable(exc, url)) from None


# -- what this process wrote or read lately ---------------------------------------------------------
BUDGET_BYTES = 512 << 20  # the demo's island keeps ~40 MB a round; a paper-scale path's state is not kept
SMALLEST_BYTES = 64 << 10  # records, markers and metrics are read in one short request: not worth a slot


UNNAMED = "\0removed:"  # the key of bytes kept after their name was removed (RecentFiles.forget_under)


class RecentFiles:
    """Full object path -> the bytes this process last wrote or read there, least recently used first.

    What this process wrote to an object store, or read from it, lately: kept in memory so that
    reading it again costs no transfer.

    Across hosts, a path's task reads back mostly what its own island wrote a moment before: the
    inner optimizer state it saved last round (2x the weights, the largest object of a task), the
    weights it trained (read again by the merge of a module only its paths pass through), the modules
    it merged. Over a 50 Mbit/s link the inner state alone took 2.4 s a task to come down again. And it
    reads the same committed files round after round: its path's shard, a module shared by the paths
    it trains.

    A read is served from here only through RunRoot.read_committed, after the directory's `_SUCCESS`
    has been read from the store as always, and only when the kept bytes match the record it keeps of
    the file (length and CRC-32): the store stays the authority, this is a copy of bytes it certifies.
    A local root keeps nothing (its reads are the page cache's). The budget bounds the memory: the
    least recently used files go first; a file larger than a quarter of it is not kept, nor one under
    64 KiB (records and metrics: a transfer of one is a short request, and a long run writes thousands).
    """

    def __init__(self, budget: int = BUDGET_BYTES):
        self.budget = budget
        self._files: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._readers: dict[str, list] = {}  # full path -> [its lock, the threads using it, their levels]
        self._contents: dict[str, tuple[int, str]] = {}  # full path -> its record's (bytes, crc32)
        self._by_content: dict[tuple[int, str], str] = {}  # (bytes, crc32) -> a full path holding them
        # name -> the levels of a path's weights its bytes hold (a run read by level); absent: whole
        self._levels: dict[str, set[int]] = {}

    def worth_keeping(self, size: int) -> bool:
        return SMALLEST_BYTES <= size <= self.budget // 4

    def keep(self, full: str, data: bytes, crc32: str | None = None, levels: Iterable[int] | None = None) -> None:
        """Remember what was just written to `full`, or read from it (a write that failed must not
        call this); `crc32`: the bytes' CRC-32 as a record writes it, when the caller has it;
        `levels`: a run of a path's weights, read for those levels (holds_level)."""
        if not self.worth_keeping(len(data)):
            with self._lock:
                self._drop(full)
            return
        content = (len(data), crc32 or f"{zlib.crc32(data):08x}")
        with self._lock:
            self._drop(full)
            self._add(full, bytes(data), content)  # the same object when it is bytes already (an alias)
            if levels is not None:
                self._levels[full] = set(levels)

    def serves_levels(self, full: str, levels: Iterable[int]) -> None:
        """A kept run of a path's weights (`full`) read again for `levels`: it holds those too."""
        with self._lock:
            if full in self._levels:
                self._levels[full].update(levels)

    def _add(self, full: str, data: bytes, content: tuple[int, str]) -> None:
        """Keep `data` under `full` (absent) and its content, within the budget; under the lock."""
        self._files[full], self._contents[full] = data, content
        self._by_content[content] = full
        self._held += len(data)
        while self._held > self.budget:
            self._drop(next(iter(self._files)))

    def get_same(self, record: dict) -> bytes | None:
        """Kept bytes of the length and CRC-32 a `_SUCCESS` record gives, under whatever name: a
        server-side copy another process made (a round's commit copies each merged module into
        modules/) holds the bytes this one merged, and it read them again over the link. The
        caller checks them against the record, as every kept file."""
        with self._lock:
            full = self._by_content.get((record.get("bytes"), record.get("crc32")))
            return None if full is None else self._files.get(full)

    @contextmanager
    def one_reader(self, full: str, levels: Iterable[int] | None = None) -> Iterator[None]:
        """One thread at a time reads `full` from the store: a second waits for the first, then
        finds its bytes here (an island's read of its peers' weights, and the merge that needs them).
        `levels`: a run of a path's weights, read for those levels (holds_level)."""
        with self._lock:
            entry = self._readers.setdefault(full, [threading.Lock(), 0, set()])
            entry[1] += 1
            entry[2].update(levels or ())
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._readers[full]

    def alias(self, src: str, dst: str) -> None:
        """A server-side copy from `src` to `dst`: the same bytes under a second name."""
        with self._lock:
            data, content = self._files.get(src), self._contents.get(src)
        if data is not None and content is not None:
            self.keep(dst, data, content[1])

    def get(self, full: str) -> bytes | None:
        """The bytes last written to `full`, or None; the caller checks them against their record."""
        with self._lock:
            data = self._files.get(full)
            if data is not None:
                self._files.move_to_end(full)
            return data

    def holds_under(self, prefix: str) -> bool:
        """Whether any kept file lies below the directory `prefix` (full path), or one is being
        read there (one_reader: a reader of it waits for those bytes instead of reading them)."""
        below = prefix.rstrip("/") + "/"
        with self._lock:
            return any(name.startswith(below) for name in [*self._files, *self._readers])

    def holds_level(self, full: str, level: int) -> bool:
        """Whether the file `full` is kept whole or being read whole, or a run of it read for
        `level` of a path's weights is kept or being read. An island's watch reads of a peer's path
        only the level they share: taken for the whole path, the merge of that path's own module
        was claimed by the watching island, which then downloaded the path's other level (7.6 MB
        over its link; benchmarks/RESULTS.md, "Islands on separate hosts")."""
        run_of = full + "#"
        with self._lock:
            held = [(name, self._levels.get(name, ())) for name in self._files]
            held += [(name, entry[2]) for name, entry in self._readers.items()]
            return any(name == full or (name.startswith(run_of) and level in levels) for name, levels in held)

    def forget_under(self, full: str, keep_bytes: bool = True) -> None:
        """A removal: the file `full` and everything below it as a directory. Their bytes stay,
        under no name, for get_same, until the budget needs their room (unless not `keep_bytes`):
        a round's commit removes the merged modules it copied into modules/, the same bytes."""
        below = full.rstrip("/") + "/"
        with self._lock:
            for name in [n for n in self._files if n == full or n.startswith(below)]:
                data, content = self._files.get(name), self._contents.get(name)
                self._drop(name)
                if keep_bytes and data is not None and content is not None and content not in self._by_content:
                    self._add(f"{UNNAMED}{content[0]}:{content[1]}", data, content)  # no path a read asks for

    def _drop(self, full: str) -> None:
        data = self._files.pop(full, None)
        if data is not None:
            self._held -= len(data)
        self._levels.pop(full, None)
        content = self._contents.pop(full, None)
        if content is not None and self._by_content.get(content) == full:
            del self._by_content[content]
            other = next((name for name, kept in self._contents.items() if kept == content), None)
            if other is not None:  # the same bytes under another name
                self._by_content[content] = other


RECENT = RecentFiles()  # one per process: every RunRoot of a run root shares it
