"""The task registry: every kind of request kdeq answers, by name (``TASKS``).

The registry sits above the tasks: it imports every module of ``kdeq.tasks`` (each defines one
``kdeq.tasks.base.Task`` subclass) and registers an instance of each, so that a new task is a new
module there and nothing else changes. Everything that lists tasks (the service's routes and admitted
routes, the command line's subcommands, the trainer, the checkpoint rules, the generated docs and
dashboards) iterates over ``TASKS``. A task that declares a ``Variant`` is also asked for on its
host's route and command by a field (``choice_of``).

May import: ``kdeq.tasks`` and everything below it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic.fields import FieldInfo

import kdeq.tasks
from kdeq.runtime.plugins import defined_in
from kdeq.tasks.base import Task

#: the order in which the service's routes and page, the command line and the docs list the tasks; a
#: task not named here follows them, in the order of its module's name
LISTED_FIRST = (
    "denoise",
    "inpaint",
    "segment",
    "deblur",
    "super-resolve",
    "denoise-poisson",
    "denoise-impulse",
)

#: every registered task by name, in registration order
TASKS: dict[str, Task] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Register an instance of ``cls`` under ``cls.name``; ``ValueError`` for a name registered twice
    or a ``Variant`` its host's route could not take (``_check_variant``)."""
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} is registered twice")
    if cls.variant is not None:
        _check_variant(cls)
    TASKS[cls.name] = cls()
    return cls


def _names(task: Task | type[Task]) -> set[str]:
    """The request fields of ``task``'s own: its options and file inputs."""
    return set(task.options.model_fields) | {f.name for f in task.files}


def _check_variant(cls: type[Task]) -> None:
    """``ValueError`` unless ``cls.variant``'s host is registered and is no variant itself, the field
    and default agree with the host's other variants, the value is new, and no field of the host's
    route would mean two things (the choice's field, an option or file input of two of its tasks)."""
    variant = cls.variant
    host = TASKS.get(variant.host)
    if host is None or host.variant is not None:
        raise ValueError(f"task {cls.name!r}: {variant.host!r} is not a registered task without a variant")
    choice = choice_of(host)
    if choice is not None and (choice.field, choice.default) != (variant.field, variant.default):
        raise ValueError(
            f"task {cls.name!r}: {variant.host!r} is chosen by {choice.field}={choice.default!r} already"
        )
    values = {variant.default} if choice is None else set(choice.tasks)
    if variant.value in values:
        raise ValueError(f"task {cls.name!r}: {variant.field}={variant.value!r} is taken")
    tasks = list(choice.tasks.values()) if choice else [host]
    # an option may be shared where it is the same field (the impulse denoiser's `sigma` is the host's)
    fields = {name: info for t in tasks for name, info in t.options.model_fields.items()}
    taken = {variant.field}.union(*(_names(t) for t in tasks))
    clash = sorted(
        name
        for name in _names(cls) & taken
        if name not in fields
        or name not in cls.options.model_fields
        or not same_field(fields[name], cls.options.model_fields[name])
    )
    if clash:
        raise ValueError(f"task {cls.name!r}: the fields {clash} of {host.route} would mean two things")


def same_field(a: FieldInfo, b: FieldInfo) -> bool:
    """Whether two declarations of a field of one name are one field: the same type, default,
    description, constraints and schema extras (two tasks' option read from one form value, or two
    trainings' knob behind one setting and option)."""
    keys = ("annotation", "default", "description", "metadata", "json_schema_extra")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


@dataclass(frozen=True)
class Choice:
    """The tasks asked for on one host's route and command, by the value of ``field``.

    Attributes:
        field: the form field and ``--field`` option.
        default: its default value, which picks the host.
        description: its help.
        tasks: the tasks by the field's value, the host first (under ``default``).
    """

    field: str
    default: str
    description: str
    tasks: dict[str, Task]

    def pick(self, value: str | None) -> Task:
        """The task ``value`` picks (``None``: the host); ``ValueError`` naming the values otherwise."""
        found = self.tasks.get(self.default if value is None else value)
        if found is None:
            raise ValueError(f"{self.field} must be one of {list(self.tasks)}, not {value!r}")
        return found

    def misplaced(self, chosen: Task, given: set[str]) -> list[str]:
        """The names in ``given`` that are other tasks' options or file inputs, not ``chosen``'s."""
        others = set().union(*(_names(t) for t in self.tasks.values() if t is not chosen))
        return sorted((given & others) - _names(chosen))

    def value_of(self, task: Task) -> str:
        """The field's value that picks ``task``."""
        return next(v for v, t in self.tasks.items() if t is task)


def choice_of(host: Task) -> Choice | None:
    """The ``Choice`` on ``host``'s route and command, ``None`` when no task is a variant of it."""
    variants = [t for t in TASKS.values() if t.variant is not None and t.variant.host == host.name]
    if not variants:
        return None
    first = variants[0].variant
    tasks = {first.default: host} | {t.variant.value: t for t in variants}
    description = "; ".join(
        [f"`{first.default}` (default): the {host.name} task"]
        + [f"`{t.variant.value}`: {t.variant.description} (the {t.name} task)" for t in variants]
    )
    return Choice(first.field, first.default, description, tasks)


def get_task(name: str) -> Task:
    """The task called ``name``; ``KeyError`` naming the registered ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; the tasks are {sorted(TASKS)}") from None


def task_classes() -> list[type[Task]]:
    """The ``Task`` subclasses defined in the modules of ``kdeq.tasks`` (each module imported), in
    registration order: the tasks without a ``Variant`` before the variants (``register_task`` checks a
    variant against its registered host), each group in ``LISTED_FIRST``'s order, then by module name."""
    found = defined_in(kdeq.tasks, Task)
    rank = {name: i for i, name in enumerate(LISTED_FIRST)}
    return sorted(found, key=lambda cls: (cls.variant is not None, rank.get(cls.name, len(rank))))


for _cls in task_classes():
    register_task(_cls)
