"""C4-format input: finding the files, reading their lines, and turning each line into a document
or a rejection with its reason.

C4 is JSON lines (`text`, `url`, `timestamp`), plain or gzipped (`c4-train.00000-of-01024.json.gz`).
Every line read ends as exactly one `Document` or one `Rejection`, so the manifest can prove
`routed + rejected == lines read`. The parsing is pure (no Beam) so it is tested on its own.
Files are opened through Beam's filesystems when Beam knows the scheme (local, gs://, s3://,
hdfs://) and through fsspec otherwise (memory://, file://, http://, ...); `.gz` is decompressed
by name in both.

Hostile lines are bounded before they are parsed: a line is read at most `max_doc_bytes` (+2) at
a time, so a gigabyte without a newline costs no more memory than a long document; JSON nested
deeper than pipeline.core.bounds.MAX_JSON_DEPTH is rejected `too_deep` before json (whose C decoder
recurses once per level) sees it; and any other parser failure is a rejection with a reason, never
an exception that takes the job down. A UTF-8 byte-order mark at the start of a line (files saved
on Windows start with one) is dropped, as `utf-8-sig` would.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import logging
import zlib
from collections.abc import Iterator
from typing import IO, NamedTuple

import fsspec

from pipeline.core.bounds import MAX_JSON_DEPTH, too_deep
from pipeline.core.errors import InputError

log = logging.getLogger(__name__)

# Why a line was not used; the manifest counts each, rejected/*.jsonl lists each line.
TOO_LARGE = "too_large"  # over data.max_doc_bytes
INVALID_UTF8 = "invalid_utf8"  # bytes (or JSON escapes) that are not valid UTF-8 text
INVALID_JSON = "invalid_json"  # includes blank lines
NOT_AN_OBJECT = "not_an_object"  # valid JSON, but a list/number/string
MISSING_TEXT = "missing_text"  # no `text`, not a string, or only whitespace
UNREADABLE_FILE = "unreadable_file"  # the file broke off mid-way (e.g. a truncated .gz)
TOO_DEEP = "too_deep"  # JSON nested deeper than MAX_JSON_DEPTH (a parser bomb, never a document)
UNPARSABLE = "unparsable"  # the parser failed in a way none of the above names (logged: a bug to fix)
REASONS = (TOO_LARGE, INVALID_UTF8, INVALID_JSON, NOT_AN_OBJECT, MISSING_TEXT, UNREADABLE_FILE, TOO_DEEP, UNPARSABLE)
RAW_CHARS = 500  # how much of a rejected line is kept, for a human to look at


class Document(NamedTuple):
    split: str  # train | validation
    doc_id: str
    text: str


class Rejection(NamedTuple):
    split: str
    file: str
    line: int  # 1-based line number in the (decompressed) file
    reason: str
    raw: str

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "reason": self.reason, "raw": self.raw, "split": self.split}


def doc_id_for(record: dict, text: str) -> str:
    """The document's url when it has one, else a hash of its text (the shards' doc_id, docs/design.md)."""
    url = record.get("url")
    if isinstance(url, str) and url.strip():
        return url
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _is_text(value: str) -> bool:
    """Whether a JSON string is text: "\\ud800" escapes parse, but neither a tokenizer nor a
    Parquet column takes them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_line(raw: bytes, split: str, file: str, line: int, max_doc_bytes: int) -> Document | Rejection:
    """One input line -> a Document, or a Rejection saying why not."""

    def reject(reason: str) -> Rejection:
        return Rejection(split, file, line, reason, raw[: RAW_CHARS * 4].decode("utf-8", "replace")[:RAW_CHARS])

    raw = raw.rstrip(b"\r\n").removeprefix(codecs.BOM_UTF8)
    if len(raw) > max_doc_bytes:  # checked first: a huge line is never decoded or parsed
        return reject(TOO_LARGE)
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError:
        return reject(INVALID_UTF8)
    if too_deep(raw, MAX_JSON_DEPTH):  # before json.loads, which recurses once per level
        return reject(TOO_DEEP)
    try:
        record = json.loads(decoded)
    except RecursionError:  # not reached within MAX_JSON_DEPTH; kept so no parser error escapes
        return reject(TOO_DEEP)
    except ValueError:  # includes integers over Python's 4300-digit conversion limit
        return reject(INVALID_JSON)
    if not isinstance(record, dict):
        return reject(NOT_AN_OBJECT)
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        return reject(MISSING_TEXT)
    if not _is_text(text):
        return reject(INVALID_UTF8)
    doc_id = doc_id_for(record, text)
    if not _is_text(doc_id):  # a url with a lone surrogate would fail the shard's Parquet write
        return reject(INVALID_UTF8)
    return Document(split, doc_id, text)


# -- files ---------------------------------------------------------------------------------------
_BEAM_SCHEMES = ("gs", "s3", "hdfs", "azfs")  # Beam's own filesystems; everything else via fsspec


def _uses_beam(path: str) -> bool:
    return "://" not in path or path.split("://", 1)[0] in _BEAM_SCHEMES


def list_input_files(globs: str | list[str], key: str = "data.train") -> list[str]:
    """Every file matched by the globs, sorted and de-duplicated; InputError when one matches none."""
    patterns = [globs] if isinstance(globs, str) else list(globs)
    files: set[str] = set()
    for pattern in patterns:
        matched = _match(pattern)
        if not matched:
            raise InputError(f"{pattern}: no input files match ({key})")
        files.update(matched)
    return sorted(files)


def _match(pattern: str) -> list[str]:
    try:
        if _uses_beam(pattern):
            from apache_beam.io.filesystems import FileSystems

            return [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
        fs, _ = fsspec.core.url_to_fs(pattern)
        return [fs.unstrip_protocol(p) for p in fs.glob(pattern) if fs.isfile(p)]
    except (OSError, ValueError, ImportError) as exc:  # BeamIOError is an OSError
        raise InputError(f"{pattern}: cannot list input files ({exc})") from None


def open_input(path: str) -> IO[bytes]:
    """A binary stream of the file's decompressed bytes (`.gz` by name).

    Decompression is Python's gzip over the raw stream on every filesystem: Beam's
    CompressedFile ends a truncated .gz silently, where gzip raises EOFError, which read_lines
    turns into an `unreadable_file` rejection instead of losing the rest of the file unnoticed.
    """
    if _uses_beam(path):
        from apache_beam.io.filesystems import CompressionTypes, FileSystems

        raw = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    else:
        raw = fsspec.open(path, "rb").open()
    if not path.endswith(".gz"):
        return raw
    stream = gzip.GzipFile(fileobj=raw, mode="rb")
    stream.myfileobj = raw  # GzipFile closes the raw stream too, as gzip.open does
    return stream


class Broken(NamedTuple):
    """Stands for the rest of a file that could not be read (a truncated .gz, a vanished object)."""

    message: str


class Oversized(NamedTuple):
    """A line longer than the reader's bound: its first bytes (for rejected/) and its length."""

    head: bytes
    size: int


DEFAULT_MAX_LINE_BYTES = 1_000_000  # data.max_doc_bytes' default
_DRAIN_BYTES = 1 << 20  # the rest of an oversized line is skipped in blocks of this size


def read_lines(
    path: str, limit: int | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[tuple[int, bytes | Broken | Oversized]]:
    """(1-based line number, raw bytes) of each line, at most `limit` of them.

    A line longer than `max_line_bytes` (its newline aside) is never held whole: it yields an
    `Oversized` with its first bytes and the rest is skipped block by block. A file that breaks
    off mid-way yields one `Broken` at the next line number and stops, so the caller records a
    rejection instead of failing the whole job.
    """
    number, cap = 0, max_line_bytes + 2  # room for "\r\n"
    try:
        with open_input(path) as handle:
            while limit is None or number < limit:
                raw = handle.readline(cap)
                if not raw:
                    return
                if len(raw) == cap and not raw.endswith(b"\n"):
                    raw = Oversized(raw[: RAW_CHARS * 4], len(raw) + _skip_line(handle))
                number += 1  # only once the whole line is read: a break mid-line is that line's Broken
                yield number, raw
    except (OSError, EOFError, ValueError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        kind = "corrupt gzip data" if isinstance(exc, zlib.error) else type(exc).__name__
        yield number + 1, Broken(f"{kind}: {exc}")


def _skip_line(handle: IO[bytes]) -> int:
    """Read past the rest of a line in bounded blocks; the number of bytes skipped."""
    skipped = 0
    for block in iter(lambda: handle.readline(_DRAIN_BYTES), b""):
        skipped += len(block)
        if block.endswith(b"\n"):
            break
    return skipped


def line_to_record(
    split: str, file: str, line: int, raw: bytes | Broken | Oversized, max_doc_bytes: int
) -> Document | Rejection:
    """What one read line becomes: parse_line, or the rejection of an oversized line or of a broken
    file's remainder. Never raises: one bad line must not take the whole job down."""
    if isinstance(raw, Broken):
        return Rejection(split, file, line, UNREADABLE_FILE, raw.message[:RAW_CHARS])
    if isinstance(raw, Oversized):
        return Rejection(split, file, line, TOO_LARGE, raw.head.decode("utf-8", "replace")[:RAW_CHARS])
    try:
        return parse_line(raw, split, file, line, max_doc_bytes)
    except Exception as exc:  # every known failure has its reason above; this one is a bug to report
        log.warning("%s:%d: unexpected %s while parsing; rejected as %s", file, line, type(exc).__name__, UNPARSABLE)
        return Rejection(split, file, line, UNPARSABLE, raw[: RAW_CHARS * 4].decode("utf-8", "replace")[:RAW_CHARS])


def plan_reads(
    files: list[str], max_docs: int | None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> list[tuple[str, int | None]]:
    """(file, line limit) per file: everything, or the first `max_docs` lines in file order.

    The cap is counted here, in the driver, reading only as far as the cap, so that the Beam job
    reads the same lines however it splits the work.
    """
    if max_docs is None:
        return [(f, None) for f in files]
    plan, left = [], max_docs
    for file in files:
        if left <= 0:
            break
        count = sum(1 for _ in zip(range(left), read_lines(file, max_line_bytes=max_line_bytes)))
        plan.append((file, count))
        left -= count
    return plan
