"""The layers of docs/architecture.md's table, held against the code: every module of ``kdeq/`` and
``service/`` is in exactly one layer and the table names exactly the modules there are; every import
(function-local and ``TYPE_CHECKING`` ones included) goes to the importer's own layer or one below;
the modules import no circle; and every package says in its docstring what it may import."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


@dataclass(frozen=True)
class Layer:
    rank: int
    places: tuple[str, ...]  # folders (ending in /) and files, relative to the repository
    modules: frozenset[str]  # the table's names: a file's stem, or a folder's paths without ".py"
    per_task: bool  # the folder also holds a module per registered task (its task's or its predictor's)


def layers() -> list[Layer]:
    """The table's rows, in order."""
    section = ARCHITECTURE.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ((?:`[^`]+` ?)+) \| [^|]+ \| ([^|]+) \|$", section, re.M)
    assert rows, "docs/architecture.md: the Layers table has no rows"
    out = []
    for rank, where, names in rows:
        named, _, per_task = names.partition(", and each registered task's")
        out.append(
            Layer(int(rank), tuple(re.findall(r"`([^`]+)`", where)), frozenset(named.split()), bool(per_task))
        )
    return out


def task_modules(layer: Layer) -> set[str]:
    """The modules of ``layer``'s folder that a registered task names: its own, its predictor's or its
    training's."""
    from kdeq.registry import TASKS
    from kdeq.train.trainings import TRAININGS

    classes = [type(t) for t in TASKS.values()] + [t.predictor for t in TASKS.values()]
    classes += [type(t) for t in TRAININGS.values()]
    folder = layer.places[0].removesuffix("/").replace("/", ".") + "."
    return {
        c.__module__.removeprefix(folder).replace(".", "/")
        for c in classes
        if c.__module__.startswith(folder)
    }


def module_name(path: Path) -> str:
    """``kdeq/maths/solvers.py`` → ``kdeq.maths.solvers``; a package's ``__init__.py`` → the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = sorted(
    p for folder in ("kdeq", "service") for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts
)
MODULES = {module_name(p): p for p in SOURCES}


def place_of(path: Path, table: list[Layer]) -> tuple[Layer, str]:
    """The layer that holds ``path`` and the name the table gives the module there."""
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for layer in table:
        for place in layer.places:
            if place.endswith("/") and rel.startswith(place):
                found.append((layer, rel[len(place) :].removesuffix(".py")))
            elif rel == place:
                found.append((layer, Path(rel).stem))
    assert len(found) == 1, f"{rel} is in {len(found)} layers of docs/architecture.md's table"
    return found[0]


def imports(path: Path) -> set[str]:
    """The project's modules that ``path`` imports anywhere in it (``from a import b`` names ``a.b``
    where that is a module, else ``a``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    out.add(full)
                elif node.module in MODULES:
                    out.add(node.module)
    return out - ({module_name(path)} if path.is_relative_to(ROOT) else set())


def test_every_module_is_in_one_layer_and_the_table_names_exactly_the_modules() -> None:
    table = layers()
    assert [layer.rank for layer in table] == list(range(1, len(table) + 1))
    named: dict[int, set[str]] = {layer.rank: set() for layer in table}
    for path in SOURCES:
        layer, name = place_of(path, table)
        if not name.endswith("__init__") or any(p == path.relative_to(ROOT).as_posix() for p in layer.places):
            named[layer.rank].add(name)
    for layer in table:
        listed = set(layer.modules) | (task_modules(layer) if layer.per_task else set())
        assert named[layer.rank] == listed, (
            f"layer {layer.rank} ({' '.join(layer.places)}): missing from the table "
            f"{sorted(named[layer.rank] - listed)}, gone from the code {sorted(listed - named[layer.rank])}"
        )


def test_no_import_runs_up_a_layer() -> None:
    table = layers()
    rank = {name: place_of(path, table)[0].rank for name, path in MODULES.items()}
    upward = sorted(
        f"{name} (layer {rank[name]}) imports {target} (layer {rank[target]})"
        for name, path in MODULES.items()
        for target in imports(path)
        if rank[target] > rank[name]
    )
    assert not upward, "\n".join(upward)


def test_the_modules_import_no_circle() -> None:
    graph = {name: imports(path) for name, path in MODULES.items()}
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert not circles, circles


@pytest.mark.parametrize(
    "package", sorted(name for name, path in MODULES.items() if path.name == "__init__.py" and "." in name)
)
def test_every_package_says_what_it_may_import(package: str) -> None:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text()))
    assert doc and "May import" in doc, f"{package}: its docstring says what it is and what it may import"


def test_a_function_local_upward_import_is_caught(tmp_path: Path) -> None:
    """The check sees an import inside a function, as a module of the maths would hold one."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from kdeq.registry import TASKS\n\n    return TASKS\n")
    table = layers()
    maths = place_of(MODULES["kdeq.maths.solvers"], table)[0].rank
    assert imports(planted) == {"kdeq.registry"}
    assert place_of(MODULES["kdeq.registry"], table)[0].rank > maths
