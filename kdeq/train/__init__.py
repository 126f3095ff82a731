"""The offline trainer: fine-tune a checkpoint from the kGLM start (or a random one) on images.

``kdeq train …`` and ``torchrun --nproc_per_node N -m kdeq.train …`` (``kdeq.train.cli``) run
``kdeq.train.loop.train`` on a ``TrainConfig``; the data, the constrained trainable model, the
loop and the report each have their own module.
"""

from kdeq.train.config import TrainConfig
from kdeq.train.loop import TrainingError, train

__all__ = ["TrainConfig", "TrainingError", "train"]
