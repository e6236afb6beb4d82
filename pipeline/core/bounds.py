"""What hostile input may cost: the bounds every reader of user input or run-root state applies.

An input line, a config file or a stored JSON file decides how much work its parser does. The
bounds below make that work (and every error message about it) proportional to a small, fixed
size, so one bad line or file ends as a rejection or a one-line error, never as a RecursionError
from deep inside `json`, a hang, or a gigabyte-long message.

- JSON nesting: MAX_JSON_DEPTH levels. C's json decoder recurses once per level and raises
  RecursionError at the interpreter's limit (1000), shared with the caller's own frames; dipaco
  writes and reads nothing deeper than 5, C4 lines are flat, so 100 refuses only the hostile.
- Stored JSON (router.json, manifest.json, _SUCCESS, merge/metrics/eval files, the lock):
  MAX_STATE_JSON_BYTES, checked before the file is read. The largest dipaco writes is the
  shards' _SUCCESS marker (~80 bytes per Parquet part) or tfidf.json (a vocabulary).
- Messages: a value is shown as at most SHOWN_CHARS characters of its repr, computed with
  reprlib so that showing a huge nested value costs no more than showing a small one.
"""

from __future__ import annotations

import json
import reprlib
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 100
MAX_STATE_JSON_BYTES = 64 * 1024 * 1024
SHOWN_CHARS = 200
MESSAGE_CHARS = 480  # a whole one-line error, key and file included

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxdict, _repr.maxlist, _repr.maxtuple, _repr.maxset = 3, 6, 6, 6, 6
_repr.maxstring, _repr.maxother, _repr.maxlong = SHOWN_CHARS, SHOWN_CHARS, 60


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """repr(value) for a message: nested containers elided, at most `limit` characters, one line."""
    text = _repr.repr(value)
    return one_line(text, limit)


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """Newlines folded into spaces and the end cut with '...' past `limit` characters."""
    text = " ".join(str(text)[: limit * 4].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def too_deep(data: bytes | bytearray | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `[` and `{` nest more than `limit` deep outside JSON strings; linear time, no recursion.

    Escaped backslashes and quotes are removed first (left to right, as JSON reads escapes), so
    the quotes left delimit strings and every other piece lies outside one. Exact for valid JSON;
    for invalid JSON an estimate, which is all a guard in front of the parser needs. Text with
    fewer brackets than the limit (every normal document) is passed after two counts.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    outside = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets), initial=0)) > limit


def load_json(data: bytes | bytearray | str, where: str, expect: type | tuple[type, ...] | None = dict) -> Any:
    """Stored JSON, parsed within the depth bound; CorruptStateError naming `where` when the bytes
    are not JSON, nest too deep, or the top level is not `expect` (callers index into it)."""
    from pipeline.core.errors import CorruptStateError

    if too_deep(data):
        raise CorruptStateError(f"{where}: JSON nests deeper than {MAX_JSON_DEPTH} levels; refusing to parse it")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptStateError(f"{where}: not valid JSON ({one_line(str(exc), SHOWN_CHARS)})") from None
    if expect is not None and not isinstance(value, expect):
        names = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise CorruptStateError(f"{where}: expected a JSON {_JSON_NAMES.get(names, names)}, got {type(value).__name__}")
    return value


_JSON_NAMES = {"dict": "object", "list": "array"}


def load_npy(data: bytes | bytearray, where: str, shape: tuple[int, ...] | None = None, ndim: int = 2):
    """A float64 .npy array, its header checked before any memory is allocated for it: numpy's
    own loader allocates the shape the header claims, then fails reading it. No pickle, ever."""
    import io

    import numpy as np
    from numpy.lib import format as npy

    from pipeline.core.errors import CorruptStateError

    stream = io.BytesIO(data)
    try:
        version = npy.read_magic(stream)
        read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"unsupported .npy version {version}")
        found, fortran, dtype = read_header(stream)  # numpy bounds the header at 10,000 bytes
    except (ValueError, SyntaxError, TypeError, EOFError) as exc:
        raise CorruptStateError(f"{where}: not a valid .npy array ({one_line(str(exc), SHOWN_CHARS)})") from None
    count = 1
    for n in found:
        count *= n
    if dtype != np.float64 or len(found) != ndim or (shape is not None and tuple(found) != tuple(shape)):
        raise CorruptStateError(
            f"{where}: expected a float64 array of shape {shape or f'{ndim} dimensions'}, "
            f"got {shown(dtype)} {shown(found)}"
        )
    if len(data) - stream.tell() != count * dtype.itemsize:
        raise CorruptStateError(f"{where}: holds {len(data) - stream.tell():,} bytes of data for a {found} array")
    array = np.frombuffer(bytes(data), dtype=dtype, count=count, offset=stream.tell())
    return array.reshape(found, order="F" if fortran else "C").copy()
