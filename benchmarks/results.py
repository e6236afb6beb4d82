"""benchmarks/RESULTS.md holds each benchmark's latest tables between its own markers; the notes
written by hand around them stay when a rerun replaces a table."""

from __future__ import annotations

from pathlib import Path

COMMITTED = Path("benchmarks/RESULTS.md")


def commit_block(name: str, text: str, heading: str = "", path: Path = COMMITTED) -> None:
    """Put text between `<!-- name -->` and `<!-- /name -->` in path; a file without them gets the
    block appended under heading."""
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in old and end in old.split(begin, 1)[1]:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + (f"{heading}\n\n" if heading else "") + block + "\n"
    path.write_text(new)


def table_head(header: str) -> list[str]:
    """A markdown table's header row (`| a | b |`: its cells hold no `|`) and the separator row under it."""
    return [header, "|" + "---|" * (header.count("|") - 1)]
