"""The README's model table and the pages under docs/models/ say what the repository serves.

The served set is the service's own (``ModelRegistry`` with no ``KDEQ_MODELS``: the highest version of
every model folder), so a version added to ``models/`` fails here until the model's page says so and
``docs/generate.py`` has rebuilt the table from the pages (tests/test_docs.py checks it is current).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kdeq.models.repository import VERSION
from service.registry import ModelRegistry

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = ROOT / "docs" / "models"
ROW = re.compile(r"^\| \[`([^`]+)`\]\(([^)]+)\) \| ([\w-]+)( \(default\))? \| ([^|]+) \| (\d+) \|$")


def served() -> dict[str, tuple[str, int]]:
    """``name: (task, version)`` of every model the service serves by default."""
    registry = ModelRegistry(ROOT / "models", ())
    out = {}
    for slot in registry.slots.values():
        assert slot.config is not None, (slot.id, slot.error)
        name, _, version = slot.id.partition(":")
        out[name] = (slot.config.task, int(version))
    return out


def defaults() -> dict[str, str]:
    """``task: name`` of the model each route answers with when no ``model`` is given: the first
    configured slot of the task (``ModelRegistry.default``, every slot taken as ready)."""
    out: dict[str, str] = {}
    for slot in ModelRegistry(ROOT / "models", ()).slots.values():
        out.setdefault(slot.config.task, slot.name)
    return out


def table() -> list[re.Match]:
    """The rows of the README's model table, each matched by ``ROW`` (a row that does not match fails)."""
    section = README.split("## Models and the offline CLI", 1)[1]
    lines = section.split("| model | task | what it is | served |", 1)[1].strip().splitlines()[1:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"README model table row not in the form `[name](page) | task | what | version`: {line}"
        rows.append(match)
    return rows


def test_the_readme_table_lists_every_served_model_with_its_task_and_version() -> None:
    expected = served()
    rows = table()
    names = [row[1] for row in rows]
    assert len(names) == len(set(names)), names
    assert set(names) == set(expected)
    several = {task for task, _ in expected.values() if sum(t == task for t, _ in expected.values()) > 1}
    default = defaults()
    for row in rows:
        name, link, task, marked, what, version = row.groups()
        assert (task, int(version)) == expected[name], (name, task, version)
        assert link == f"docs/models/{name}.md" and (ROOT / link).is_file(), link
        # "(default)" where a task has several models: on the one its route answers with, and only there
        assert bool(marked) == (task in several and default[task] == name), (name, marked)
        assert len(what) <= 120, (name, what)  # one line: the history is the page's
    # the command line's default, `TASK-kglm` (kdeq.cli), is the service's for every task
    assert all(name == f"{task}-kglm" for task, name in default.items()), default


def test_every_model_has_a_page_with_each_version_and_the_served_one_marked() -> None:
    expected = served()
    pages = {p.stem: p.read_text() for p in PAGES.glob("*.md")}
    assert set(pages) == set(expected)
    for name, text in pages.items():
        task, version = expected[name]
        on_disk = sorted(int(p.name) for p in (ROOT / "models" / name).iterdir() if VERSION.match(p.name))
        headings = re.findall(r"^## Version (\d+)( \(served\))?$", text, re.M)
        assert [int(v) for v, _ in headings] == on_disk, (name, headings, on_disk)
        assert [int(v) for v, mark in headings if mark] == [version], (name, headings)
        assert text.startswith(f"# `{name}`\n"), name
        words = " ".join(text.split())  # the page's lines wrap anywhere
        assert f"**Task:** `{task}`" in words, name
        assert f"**Served:** version {version}, the highest in `models/{name}/`" in words, name


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(PAGES.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), (page.name, target)
