"""Every code example in the README and docs/ runs, and the generated reference pages are current.

Python blocks are executed. Shell blocks are run line by line in a scratch folder holding the files
they name, against a real server for the `curl` lines (its URL substituted for the docs' 8000). The
exceptions are the Quick start, which CI runs itself, and blocks whose first line says why they are
not run here (Docker, a Kubernetes cluster, hours-long benchmarks). Those are checked to hold nothing else.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_helpers import run_server

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/models/ too
NOT_RUN = re.compile(r"^# not run by the test suite: (needs Docker|needs a Kubernetes cluster|a benchmark)")
VENV_BIN = Path(sys.executable).parent


def blocks(lang: str) -> list[tuple[str, str]]:
    """``(page, code)`` of every fenced ``lang`` block; the README's Quick start is CI's own job."""
    found = []
    for page in PAGES:
        text = page.read_text()
        if page.name == "README.md":
            quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
            text = text.replace(quick, "")
        found += [(page.name, code) for code in re.findall(rf"```{lang}\n(.*?)```", text, re.S)]
    return found


def test_generated_reference_pages_are_current() -> None:
    generator = runpy.run_path(str(ROOT / "docs" / "generate.py"))
    for name, build in generator["PAGES"].items():
        assert (ROOT / "docs" / name).read_text() == build(), f"docs/{name} is stale: run docs/generate.py"
    assert (ROOT / "README.md").read_text() == generator["readme"](), (
        "README.md's model table is stale: run docs/generate.py"
    )


@pytest.mark.parametrize(("page", "code"), blocks("python"), ids=lambda v: v if v.endswith(".md") else "")
def test_python_examples_run(page: str, code: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, page, "exec"), {"__name__": "__docs__"})


def outputs(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-o", "--out")]


def test_shell_examples_run(tmp_path) -> None:
    # no files prepared: the README's own `kdeq samples` line writes the images the examples use
    work = tmp_path / "work"
    work.mkdir()
    ran, skipped = 0, 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDEQ_")}
    # model control on: docs/service.md loads a version and the latest back
    with run_server(tmp_path, model_control="true") as server:
        for page, code in blocks("bash"):
            first = code.splitlines()[0]
            if NOT_RUN.match(first):
                skipped += 1
                commands = [ln for ln in code.splitlines()[1:] if ln.strip()]
                allowed = (
                    "docker ",
                    "kubectl ",
                    "(cd deploy/k8s/overlays/",
                    ".venv-bench/",
                    "python3 -m venv .venv-bench",
                    ".venv/bin/kdeq train ",
                    ".venv/bin/kdeq prune ",
                    ".venv/bin/kdeq calibrate ",
                    ".venv/bin/kdeq experiment ",
                    ".venv/bin/python bench/",
                    "mkdir -p t400/",
                    "ls ../shared/data/Train400 ",
                    "mkdir -p cbsd432/",
                    "ls ../shared/data/CBSD432 ",
                    'C="--train t400/',
                    'C="--train cbsd432/',
                    # a GPU machine's image, with the service's packages carried as wheels
                    "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/",
                    "PYTHONPATH=/tmp/site PYTHON=python3 bench/gpu.sh",
                )
                assert all(ln.startswith(allowed) for ln in commands), (page, commands)
                continue
            script = code.replace("http://127.0.0.1:8000", server.url).replace(".venv/bin/", f"{VENV_BIN}/")
            done = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", script],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, (page, code, done.stdout[-2000:], done.stderr[-2000:])
            ran += 1
            for line in code.splitlines():
                for out in outputs(line):
                    if (work / out).is_dir():  # a checkpoint folder, or a task's folder of PNGs
                        found = list((work / out).iterdir())
                        assert found, (page, line)
                        assert (work / out / "config.json").is_file() or all(
                            f.read_bytes().startswith(b"\x89PNG") for f in found
                        ), (page, line)
                        continue
                    data = (work / out).read_bytes()
                    if out.endswith(".png"):
                        assert data.startswith(b"\x89PNG"), (page, line, data[:200])
                    elif out.endswith(".json"):
                        body = json.loads(data)
                        # not an error body (a model's state has an "error" field of its own)
                        assert not (isinstance(body, dict) and {"error", "detail"} <= set(body)), (
                            page,
                            line,
                            body,
                        )
                    else:
                        assert data and not data.startswith(b'{"error"'), (page, line, data[:200])
    assert ran >= 3 and skipped >= 3
