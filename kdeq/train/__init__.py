"""The offline trainer: fine-tune a checkpoint from the kGLM start (or a random one) on images.

``kdeq train …`` and ``torchrun --nproc_per_node N -m kdeq.train …`` (``kdeq.train.cli``) run
``kdeq.train.loop.train`` on a ``kdeq.train.config.TrainConfig``; the data, each task's training
(``kdeq.train.tasks``, registered in ``kdeq.train.trainings``), the constrained trainable model,
the loop and the report each have their own module.

May import: ``kdeq.serving``, ``kdeq.models``, ``kdeq.registry`` and everything below them.
"""
