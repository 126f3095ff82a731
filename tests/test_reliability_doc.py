"""docs/RELIABILITY.md names the tests that prove each promise; every one of them must exist."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_named_in_the_reliability_page_exists() -> None:
    text = (ROOT / "docs" / "RELIABILITY.md").read_text()
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(named) >= 15
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in functions, f"{path}::{name}"
    bare = set(re.findall(r"`(test_\w+)`", text))
    everything = {
        n.name
        for p in (ROOT / "tests").glob("test_*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef)
    }
    assert bare <= everything, bare - everything


def test_the_hostile_corpus_is_as_the_page_lists_it() -> None:
    from tests.test_hostile import corpus

    text = (ROOT / "docs" / "RELIABILITY.md").read_text()
    section = text.split("## Hostile and broken inputs", 1)[1].split("\n## ", 1)[0]
    cases = corpus()
    listed = re.search(r"Cases \((\d+), plus one chunked upload\)", section)
    assert listed and int(listed[1]) == len(cases), (listed and listed[1], len(cases))
    # one row per answer the corpus expects (413 also the chunked upload's), and no other
    rows = {int(code) for code in re.findall(r"^\| (\d{3}) \|", section, re.M)}
    assert rows == {c.status for c in cases} | {413}, rows
