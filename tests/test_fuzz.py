"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis), CI-sized: no
5xx, and every response conforms to the schema (status codes, content types, bodies, headers)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_helpers import missing_tool, run_server
from tests.test_hostile import SUMMARY

pytestmark = pytest.mark.slow

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_the_api_survives_schema_driven_fuzzing(tmp_path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        missing_tool("schemathesis is not installed (pip install -e '.[dev]')")
    # model control on: the load and unload routes are fuzzed past the switch
    with run_server(tmp_path, max_pixels=65536, model_control="true") as server:
        done = subprocess.run(
            [
                st,
                "run",
                server.url + "/openapi.json",
                "--max-examples",
                "50",
                "--seed",
                "1",
                "--checks",
                CHECKS,
                "--request-timeout",
                "30",
                "--report",
                "junit",
                "--report-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        log = server.log.read_text()
        assert "Traceback" not in log
    summary = next(line for line in done.stdout.splitlines() if re.match(r"\s*\d+ generated", line))
    SUMMARY.mkdir(parents=True, exist_ok=True)
    (SUMMARY / "fuzz.json").write_text(json.dumps({"max_examples": 50, "seed": 1, "result": summary.strip()}))
    assert " passed" in summary and "failed" not in summary, summary
