"""What every ``kdeq experiment`` command does once its setup is parsed: run, then write
``results.json``, ``table.md`` and its plots into the output folder, and print the table."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

Plot = Callable[[Path, dict], None]


def run_and_write(
    name: str,
    out: Path,
    compute: Callable[[], dict],
    table: Callable[[dict], str],
    plots: Mapping[str, Plot],
) -> int:
    """``compute()``'s result written to ``out/results.json``, ``table(result)`` to ``out/table.md``
    (and printed) and each of ``plots`` drawn to ``out/<file name>``; 0, or 2 with the error on
    standard error where the run refuses its setup or a file cannot be written (``ValueError``,
    ``OSError``)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        result = compute()
    except (ValueError, OSError) as err:
        print(f"kdeq experiment {name}: error: {err}", file=sys.stderr)
        return 2
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (out / "table.md").write_text(text)
    for file_name, plot in plots.items():
        plot(out / file_name, result)
    print(text)
    print("wrote " + ", ".join(str(out / n) for n in ("results.json", "table.md", *plots)))
    return 0
