"""The tasks: every kind of request kdeq answers, one module each, independent of HTTP.

A task module defines one ``kdeq.tasks.base.Task`` subclass: its name and family, its predictor
(``kdeq.predictors``), its strict options, the rules its models obey, how a batch of its requests is
solved and its posterior. ``kdeq.registry`` imports every module here and registers its task; no task
module imports the registry.

May import: ``kdeq.predictors`` and everything below it; a task module may import ``kdeq.tasks.base``
and its host task's module (a variant's).
"""
