"""What every ``kdeq experiment`` command shares: the summary over seeds (``mean_std``), where the
numbers were measured (``machine``), and, once its setup is parsed, the run that writes
``results.json``, ``table.md`` and its plots into the output folder and prints the table."""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from kdeq.runtime.atomic import write_files
from kdeq.train.preflight import check_writable, pyplot

Plot = Callable[[Path, dict], None]


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return mean, math.sqrt(var)


def machine() -> dict[str, str | int]:
    """Where the numbers were measured: platform, Python, torch and its thread count."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


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
    ``OSError``). What the writing needs (a writable ``out``, matplotlib for ``plots``) is checked
    before ``compute`` runs, and nothing is written before it has finished."""
    try:
        check_writable(out)
        if plots:
            pyplot()
        result = compute()
        text = table(result)
        write_files(
            out, {"results.json": (json.dumps(result, indent=1) + "\n").encode(), "table.md": text.encode()}
        )
        for file_name, plot in plots.items():
            plot(out / file_name, result)
    except (ValueError, OSError) as err:
        print(f"kdeq experiment {name}: error: {err}", file=sys.stderr)
        return 2
    print(text)
    print("wrote " + ", ".join(str(out / n) for n in ("results.json", "table.md", *plots)))
    return 0
