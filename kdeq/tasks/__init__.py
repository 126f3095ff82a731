"""The tasks: every kind of request kdeq answers, one module each, independent of HTTP.

A task module defines one ``kdeq.tasks.base.Task`` subclass: its name, its predictor
(``kdeq.predictors``, which holds the rules its models obey), its strict options, how a batch of its
requests is solved, cut into tiles and warmed up, and its posterior map's refusals.
``kdeq.registry`` imports every module here and registers its task; no task module imports the
registry.

May import: ``kdeq.predictors`` and everything below it; a task module may import ``kdeq.tasks.base``
and its host task's module (a variant's).
"""
