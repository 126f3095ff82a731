"""The model repository: ``<root>/<name>/<version>/`` checkpoint folders, listed and loaded by name."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kdeq.models.checkpoint import CheckpointError, ModelConfig, load_checkpoint, read_config
from kdeq.predictors.base import Predictor
from kdeq.registry import TASKS

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
VERSION = re.compile(r"^[0-9]{1,9}$")  # ASCII digits only: str.isdigit() also accepts "²"


def default_models_dir() -> Path:
    """``$KDEQ_MODELS_DIR`` if set, else the ``models/`` folder beside the ``kdeq`` package."""
    env = os.environ.get("KDEQ_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


@dataclass(frozen=True)
class ModelEntry:
    """One ``<name>/<version>`` folder: its config, or why it cannot be read."""

    name: str
    version: int
    path: Path
    config: ModelConfig | None
    error: str | None


def list_models(root: Path) -> list[ModelEntry]:
    """Every ``<root>/<name>/<version>`` folder (``version`` a positive integer), sorted."""
    entries = []
    if not root.is_dir():
        return entries
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and NAME.match(p.name)):
        for vdir in sorted(
            (p for p in model_dir.iterdir() if p.is_dir() and VERSION.match(p.name)),
            key=lambda p: int(p.name),
        ):
            try:
                config, error = read_config(vdir), None
            except CheckpointError as err:
                config, error = None, str(err)
            entries.append(ModelEntry(model_dir.name, int(vdir.name), vdir, config, error))
    return entries


def find_model(root: Path, name: str, version: int | None = None) -> Path:
    """The folder of ``name`` at ``version`` (default the highest); ``LookupError`` if absent."""
    if not NAME.match(name):
        raise LookupError(f"invalid model name {name!r}")
    versions = sorted(int(p.name) for p in (root / name).glob("*") if p.is_dir() and VERSION.match(p.name))
    if not versions:
        raise LookupError(f"no model {name!r} in {root}")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise LookupError(f"model {name!r} has no version {version} (has {versions})")
    return root / name / str(version)


def find_reference(root: Path, ref: str) -> Path:
    """The folder of ``ref``, ``NAME`` (the highest version) or ``NAME:VERSION`` (``find_model``;
    ``ValueError`` when ``VERSION`` is not an integer)."""
    name, _, version = ref.partition(":")
    return find_model(root, name, int(version) if version else None)


def load_predictor(path: str | Path, device: str | torch.device = "cpu") -> Predictor:
    """Load the checkpoint at ``path`` onto ``device`` as its task's predictor."""
    checkpoint = load_checkpoint(path)
    return TASKS[checkpoint.config.task].predictor(checkpoint, device)
