"""The classes a package's modules define: how a registry finds its entries without a list of them.

``kdeq.registry`` finds the tasks in ``kdeq.tasks`` and ``kdeq.train.trainings`` the trainings in
``kdeq.train.tasks`` this way, so that a new entry is a new module and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import TypeVar

T = TypeVar("T", bound=type)


def defined_in(package: ModuleType, base: T) -> list[T]:
    """The subclasses of ``base`` that the modules of ``package`` define (not import) with a ``name``
    of their own, each module imported, in the order of the modules' names and then of definition."""
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type)
            and issubclass(cls, base)
            and cls.__module__ == module.__name__
            and "name" in vars(cls)
        ]
    return found
