"""The offline trainer: fine-tune a checkpoint from the kGLM start (or a random one) on images.

``kdeq train …`` and ``torchrun --nproc_per_node N -m kdeq.train …`` (``kdeq.train.cli``) run
``kdeq.train.loop.train`` on a ``TrainConfig``; the data, the constrained trainable model, the
loop and the report each have their own module.

``TrainConfig``, ``TrainingError`` and ``train`` are imported on first use: each task
(``kdeq.tasks``) imports this package's draws, losses and scores (``kdeq.train.data``,
``kdeq.train.objectives``) while the registry fills, and the loop's modules need it filled (the
default specs, validated against it, are built when ``kdeq.initialize`` is imported).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdeq.train.config import TrainConfig
    from kdeq.train.loop import TrainingError, train

_MODULES = {
    "TrainConfig": "kdeq.train.config",
    "TrainingError": "kdeq.train.loop",
    "train": "kdeq.train.loop",
}

__all__ = ["TrainConfig", "TrainingError", "train"]


def __getattr__(name: str) -> object:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)
