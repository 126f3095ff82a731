"""The task registry: every kind of request kdeq answers, by name (``TASKS``).

A task is one module here defining a ``kdeq.tasks.base.Task`` subclass decorated
with ``register_task``, plus its line in the imports at the end of this file.
Everything that lists tasks (the service's routes and admitted routes, the
command line's subcommands, the checkpoint rules, the generated docs and
dashboards) iterates over ``TASKS``.
"""

from __future__ import annotations

from kdeq.tasks.base import (
    FileInput,
    InputError,
    Options,
    Request,
    ResultField,
    Solved,
    Task,
    UncertaintyMap,
    solve_batch,
)

#: every registered task by name, in registration order
TASKS: dict[str, Task] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: register an instance of ``cls`` under ``cls.name``."""
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} is registered twice")
    TASKS[cls.name] = cls()
    return cls


def get_task(name: str) -> Task:
    """The task called ``name``; ``KeyError`` naming the registered ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; the tasks are {sorted(TASKS)}") from None


__all__ = [
    "TASKS",
    "FileInput",
    "InputError",
    "Options",
    "Request",
    "ResultField",
    "Solved",
    "Task",
    "UncertaintyMap",
    "get_task",
    "register_task",
    "solve_batch",
]

# the registry lines: importing a task module registers it, in this order (routes, subcommands, the page)
# isort: off
from kdeq.tasks import denoise  # noqa: E402, F401
from kdeq.tasks import inpaint  # noqa: E402, F401
from kdeq.tasks import segment  # noqa: E402, F401
from kdeq.tasks import deblur  # noqa: E402, F401
from kdeq.tasks import super_resolve  # noqa: E402, F401
from kdeq.tasks import denoise_poisson  # noqa: E402, F401
# isort: on
