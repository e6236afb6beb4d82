"""The docs hold each fact once: docs/config.md is what the config dataclasses generate, the README
stays a first page that maps every doc, and benchmark results live in benchmarks/RESULTS.md."""

from __future__ import annotations

import dataclasses
import re
import typing

from conftest import REPO
from pipeline.core import configdoc
from pipeline.core.config import Config, flatten


def test_config_md_is_what_the_generator_writes_now():
    assert (REPO / "docs" / "config.md").read_text() == configdoc.render(), (
        "docs/config.md is stale: run `python -m pipeline.core.configdoc`"
    )


def test_every_config_key_is_in_config_md_with_its_help():
    text = (REPO / "docs" / "config.md").read_text()
    keys = flatten(Config().to_dict())
    help_text = configdoc.field_comments((REPO / "pipeline" / "core" / "config.py").read_text())
    for key in keys:
        assert f"| `{key}` |" in text, key
    for section, cls in configdoc.sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("internal") and not dataclasses.is_dataclass(hints[f.name]):
                assert help_text.get((cls.__name__, f.name)), f"{section}.{f.name} has no comment in config.py"
    assert len(keys) == len(re.findall(r"^\| `[a-z_.]+` \|", text, flags=re.M))


def test_field_comments_take_the_trailing_comment_and_the_lines_below_it():
    source = "class A:\n    x: int = 1  # first\n    #          second\n    y: str = 'a'  # only\n    z: int = 2\n"
    assert configdoc.field_comments(source) == {("A", "x"): "first second", ("A", "y"): "only", ("A", "z"): ""}


def test_the_readme_is_a_first_page_that_maps_the_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 15_000, "the README is a first page: move detail to docs/"
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()[:2]] == [["make", "demo"], ["make", "test"]]
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in readme, f"the README's map of the docs lacks docs/{doc.name}"
    assert "](benchmarks/RESULTS.md)" in readme


def test_benchmarks_write_results_md_between_markers_and_never_the_readme(tmp_path):
    from benchmarks.results import commit_block

    for path in (REPO / "benchmarks").glob("*.py"):
        assert "README.md" not in path.read_text(), path.name
    results = tmp_path / "RESULTS.md"
    results.write_text("<!-- bench -->\nold table\n<!-- /bench -->\n\nnotes by hand\n")
    commit_block("bench", "new table\n", path=results)
    commit_block("chaos", "chaos table", heading="## Faults", path=results)
    assert results.read_text() == (
        "<!-- bench -->\nnew table\n<!-- /bench -->\n\nnotes by hand\n\n"
        "## Faults\n\n<!-- chaos -->\nchaos table\n<!-- /chaos -->\n"
    )
    committed = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert all(marker in committed for marker in ("<!-- bench -->", "<!-- /bench -->", "<!-- chaos -->"))


def test_docstrings_name_the_design_doc_by_its_path():
    old = "DESIGN" + ".md"  # the design doc is docs/design.md
    stale = [
        str(p.relative_to(REPO))
        for d in ("pipeline", "preprocessing", "models", "benchmarks", "airflow", "tests", "scripts")
        for p in (REPO / d).rglob("*.py")
        if old in p.read_text()
    ]
    assert not stale, stale
