"""The training registry: how each trainable task's models train, by task name (``TRAININGS``).

The registry sits above the trainings: it imports every module of ``kdeq.train.tasks`` (each
defines one ``kdeq.train.tasks.base.Training`` subclass) and registers an instance of each, so
that training a new task is a new module there and nothing else changes. A registered task
(``kdeq.registry.TASKS``) without a training is refused by ``kdeq train``. The knobs of every
training, one field per name (``RunKnobs``), are ``TrainConfig``'s corruption fields and
``kdeq train``'s corruption options.

May import: ``kdeq.train.tasks``, ``kdeq.registry`` and everything below them.
"""

from __future__ import annotations

from pydantic import create_model
from pydantic.fields import FieldInfo

import kdeq.train.tasks
from kdeq.registry import TASKS, same_field
from kdeq.runtime.plugins import defined_in
from kdeq.train.tasks.base import Knobs, Training


def training_classes() -> list[type[Training]]:
    """The ``Training`` subclasses defined in the modules of ``kdeq.train.tasks`` (each module
    imported), in the order of their tasks in ``TASKS``; ``ValueError`` for one whose task is not
    registered."""
    found = defined_in(kdeq.train.tasks, Training)
    order = {name: i for i, name in enumerate(TASKS)}
    unknown = sorted(cls.name for cls in found if cls.name not in order)
    if unknown:
        raise ValueError(f"trainings of tasks that are not registered: {unknown}")
    return sorted(found, key=lambda cls: order[cls.name])


def _registry(classes: list[type[Training]]) -> dict[str, Training]:
    """An instance of each of ``classes`` by its task's name; ``ValueError`` for a task trained twice."""
    out: dict[str, Training] = {}
    for cls in classes:
        if cls.name in out:
            raise ValueError(f"task {cls.name!r} has two trainings")
        out[cls.name] = cls()
    return out


#: every trainable task's training by name, in ``TASKS``' order (the knobs' order in ``RunKnobs``)
TRAININGS: dict[str, Training] = _registry(training_classes())


def knob_fields(trainings: list[Training]) -> dict[str, FieldInfo]:
    """The union of ``trainings``' knob fields by name, in first-declared order; ``ValueError`` where
    two trainings declare one name differently."""
    out: dict[str, FieldInfo] = {}
    for training in trainings:
        for name, info in training.knobs.model_fields.items():
            if name in out and not same_field(out[name], info):
                raise ValueError(f"the {training.name} training's knob {name!r} differs from another's")
            out.setdefault(name, info)
    return out


#: every training's knobs, one field per name: the base of ``kdeq.train.config.TrainConfig``
RunKnobs: type[Knobs] = create_model(
    "RunKnobs",
    __base__=Knobs,
    __doc__="Every training's corruption knobs, one field per name (``TRAININGS``' ``knobs``).",
    **{name: (info.annotation, info) for name, info in knob_fields(list(TRAININGS.values())).items()},
)
