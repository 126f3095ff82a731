"""What a training run or an experiment checks before its first step, so that one that cannot finish
stops at once, with one line and nothing written, instead of after its first epoch.

Everything a run needs only when it writes (the ``train`` extra's plotting, a folder it may write
into, room on the disk, what ``--out`` already holds) is checked here, through the same functions
the writing uses where there is one (``pyplot``), so that the check and the use cannot drift apart.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path
from types import ModuleType

#: the file whose presence makes a folder a checkpoint (``kdeq.models.checkpoint.CONFIG_FILE``)
CHECKPOINT_FILE = "config.json"
#: the trainer's resume state inside ``out`` and the file that marks it complete
STATE_DIR = "train-state"
STATE_FILE = "state.json"
REPORT_DIR = "report"


class MissingExtraError(ValueError):
    """A module of the ``train`` extra (pyproject.toml) is not installed; the message says what needs
    it and how to install it."""


def require(module: str, purpose: str, instead: str = "") -> ModuleType:
    """Import ``module``, a module of the ``train`` extra; ``MissingExtraError`` naming ``purpose`` (what
    needs it) and how to install it, or do ``instead``, when it is not installed or does not import."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        found = "is not installed" if isinstance(err, ModuleNotFoundError) else f"does not import ({err})"
        top = module.partition(".")[0]
        fix = "pip install 'kdeq[train]'" + (f", or {instead}" if instead else "")
        raise MissingExtraError(f"{purpose} need {top}, which {found}: {fix}") from None


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` drawing to files (the Agg backend), for the reports' and experiments' plots."""
    require("matplotlib", "plots").use("Agg")
    return require("matplotlib.pyplot", "plots")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path) -> None:
    """``ValueError`` unless ``path`` is a folder this process may write into, or one it may create
    (its nearest existing ancestor is a writable folder); nothing is written."""
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"{path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: cannot write into {existing} (permission denied); choose another folder")


def check_space(path: Path, needed: int) -> None:
    """``ValueError`` when the file system ``path`` would be on has less than ``needed`` bytes free."""
    free = shutil.disk_usage(_nearest_existing(path)).free
    if free < needed:
        raise ValueError(
            f"{path}: {free / 2**20:.1f} MiB free on its disk, and the run writes about "
            f"{needed / 2**20:.1f} MiB there; free some space or choose another --out"
        )


def state_history(out: Path) -> tuple[str, dict] | None:
    """The fingerprint and history ``out``'s resume state records (``kdeq.train.loop``), or ``None``
    when it has none; ``ValueError`` when the state cannot be read."""
    path = out / STATE_DIR / STATE_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        return meta["fingerprint"], meta["history"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a readable resume state ({err}); choose another version") from None


def check_out(out: Path, epochs: int, resume: bool, fingerprint: str, writes: bool) -> None:
    """``ValueError`` saying what to do unless ``out`` can take the run: a new run needs a folder
    holding neither a checkpoint nor a resume state; ``resume`` needs the state of a run with the
    same settings (``fingerprint``). ``writes`` (the rank that writes): the folder must be writable."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if writes:
        check_writable(out)
        for sub in (out / STATE_DIR, out / REPORT_DIR):
            if sub.exists():
                check_writable(sub)
    state = state_history(out)
    checkpoint = (out / CHECKPOINT_FILE).is_file()
    if resume:
        if state is None:
            hint = (
                "it holds a checkpoint without the state to continue it; train into another version "
                f"(--spec {out} --warm-start {out} starts from that checkpoint)"
                if checkpoint
                else "run the command without --resume to start"
            )
            raise ValueError(f"nothing to resume: {out / STATE_DIR / STATE_FILE} does not exist; {hint}")
        if state[0] != fingerprint:
            raise ValueError(
                f"{out / STATE_DIR}: these settings or the number of ranks differ from the run being "
                "resumed (only --stop-after, --workers, --device and --dist-timeout may change)"
            )
        return
    if state is None:
        if checkpoint:
            raise ValueError(f"{out} already holds a checkpoint; choose another version")
        return
    done = state[1]["epoch"]
    if state[0] != fingerprint:
        raise ValueError(
            f"{out} holds the state of another run (other settings) at its epoch {done}; choose another "
            "version, or continue that run with its own settings and --resume"
        )
    if done >= epochs:
        what = "already holds a checkpoint of" if checkpoint else "holds, without a checkpoint,"
        raise ValueError(f"{out} {what} this finished run; choose another version")
    raise ValueError(
        f"{out} holds this run's state after epoch {done} of {epochs}: add --resume to continue it, "
        "or choose another version"
    )
