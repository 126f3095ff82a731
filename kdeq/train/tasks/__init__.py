"""How each trainable task's models train, one module each (``kdeq.train.tasks.base.Training``).

A module here defines one ``Training`` subclass: the task's corruption knobs, the corruption that
makes examples from clean patches, the predictor's arguments from a batch of them, the loss, the
validation score and levels. ``kdeq.train.trainings`` imports every module here and registers its
training; no module here imports that registry.

May import: ``kdeq.tasks`` and everything below it, ``kdeq.train.data`` and ``kdeq.train.objectives``;
a module here may import ``kdeq.train.tasks.base``.
"""
