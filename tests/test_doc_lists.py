"""The lists the docs keep of the code — docs/architecture.md's commands and service modules, and
docs/client.md's methods — are read against the code itself, so that a command, module or method
added or removed fails here until the page says so (the Layers table's modules: tests/test_layers.py)."""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from pathlib import Path

import pytest

from kdeq.client import AsyncClient, Client, method_name
from kdeq.registry import TASKS

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
CLIENT = (ROOT / "docs" / "client.md").read_text()


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text``."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def modules(folder: str, suffixes: tuple[str, ...] = (".py",)) -> set[str]:
    """The file names in ``folder`` (relative to the repository) ending in ``suffixes``."""
    return {p.name for p in (ROOT / folder).iterdir() if p.is_file() and p.name.endswith(suffixes)}


def test_the_command_list_is_the_command_lines() -> None:
    from kdeq.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    commands = set(re.search(r"\{([\w,-]+)\}", out.getvalue())[1].split(","))
    listed = re.search(r"`kdeq (\w+(?:\|[\w<>-]+)+)`", section(ARCHITECTURE, "Layers"))[1].split("|")
    plugins = set(re.findall(r"\+ plugins: `(\w+)`", section(ARCHITECTURE, "Layers")))
    tasks = {task.name for task in TASKS.values()}
    assert "<task>" in listed and set(listed) - {"<task>"} | tasks | plugins == commands, (listed, commands)


def test_every_service_module_and_static_file_is_in_the_service_list() -> None:
    flow = section(ARCHITECTURE, "The service and how a request flows")
    named = set(re.findall(r"\bservice/(\w+\.py)\b", flow))
    present = modules("service") - {"__init__.py"}
    assert named == present, f"missing: {present - named}, gone: {named - present}"
    static = flow.split("service/static/", 1)[1].splitlines()[0]
    assert set(re.findall(r"[\w-]+\.\w+", static)) == modules("service/static", ("",))


def test_the_middleware_chain_is_the_apps() -> None:
    flow = section(ARCHITECTURE, "The service and how a request flows")
    chain = re.search(r"service/middleware\.py\s+(\w+(?: → \w+)+)", flow)[1].split(" → ")
    # Starlette wraps each middleware added around those before it: the last added is the outermost
    added = re.findall(r"add_middleware\((\w+)", (ROOT / "service" / "app.py").read_text())
    assert chain == added[::-1]
    counted = re.search(r"passes the (\w+) middlewares", flow)[1]
    assert counted == ["one", "two", "three", "four", "five", "six", "seven", "eight"][len(chain) - 1]


def test_every_path_the_architecture_page_names_exists() -> None:
    # a path with a placeholder (``kdeq/tasks/<task>.py``) names a kind of file, not one
    for path in set(re.findall(r"\b((?:kdeq|service|tests|deploy)/[\w/.-]*\w)(?![\w/.-]*<)", ARCHITECTURE)):
        assert (ROOT / path).exists(), path


# -------------------------------------------------------------------------------------- docs/client.md


def test_the_client_page_lists_every_task_method_with_its_request_and_inputs() -> None:
    table = CLIENT.split("| method | request | options | file inputs |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[1:]]
    expected = [
        [
            f"`{method_name(task)}`",
            f"`POST {task.route}`",
            ", ".join(f"`{n}`" for n in task.options.model_fields),
            ", ".join(f"`{f.name}`" for f in task.files),
        ]
        for task in TASKS.values()
    ]
    assert rows == expected


@pytest.mark.parametrize("cls", [Client, AsyncClient], ids=lambda c: c.__name__)
def test_every_public_client_method_is_documented(cls: type) -> None:
    public = [n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)]
    assert set(public) >= {method_name(t) for t in TASKS.values()}
    for name in public:
        assert re.search(rf"`(?:\w+\.|await \w+\.)?{name}[`(]", CLIENT), f"docs/client.md: no {name}"
