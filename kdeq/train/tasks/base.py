"""What training a task is: its corruption knobs and the hooks the trainer calls (``Training``).

A ``Training`` declares how one task's models train: the corruption that makes an example from a
clean patch (``corrupt``), within the run's settings of the knobs it declares (its ``knobs``
model: each field's type, default, bounds and description), the predictor's arguments from a
batch of examples, the loss, the validation score and levels, and the input the report shows.
The trainer's settings (``kdeq.train.config.TrainConfig``) and command line (``kdeq.train.cli``)
are built from the knobs' declarations (``kdeq.train.trainings.RunKnobs``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

from kdeq.train.objectives import SquaredError, psnr, squared_error


class Knobs(BaseModel):
    """Base of the trainings' knob models: a run's corruption settings, frozen, unknown keys refused.
    Each field is a ``kdeq train`` option and a ``TrainConfig`` field of its name: its
    ``description`` is the help, and ``json_schema_extra``'s ``metavar`` names the option's value.
    A knob that two tasks read is declared once and shared (same type, default and description)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def closed_range(top: float) -> AfterValidator:
    """A validator of a range ``(lo, hi)`` with ``0 ≤ lo ≤ hi ≤ top``, its message naming the field."""

    def check(value: tuple[float, float], info: ValidationInfo) -> tuple[float, float]:
        lo, hi = value
        if not 0 <= lo <= hi <= top:
            name = info.field_name
            raise ValueError(f"{name} must be a range lo ≤ hi within [0, {top:g}], got ({lo}, {hi})")
        return value

    return AfterValidator(check)


#: the Gaussian noise levels the noisy tasks draw, 0–255
NoiseRange = Annotated[
    tuple[float, float],
    closed_range(255.0),
    Field(
        description="noise levels (0–255), a range drawn uniformly", json_schema_extra={"metavar": "LO,HI"}
    ),
]


class NoiseKnobs(Knobs):
    """The knob of the tasks that add Gaussian noise of a drawn level."""

    sigma: NoiseRange = (0.0, 55.0)


class ClippedNoiseKnobs(NoiseKnobs):
    """The knobs of the tasks whose noisy inputs may be clipped to [0, 1] (the paper's experiment
    clips them)."""

    clip_noise: bool = Field(False, description="clip noisy inputs to [0, 1]")


def shared_value(batch: Mapping[str, torch.Tensor], key: str, task: str, what: str) -> torch.Tensor:
    """``batch[key][0]``: the value every example of the batch shares (``Training.corrupt``'s
    ``shared`` draw); ``ValueError`` when they differ."""
    values = batch[key]
    if not bool((values == values[:1]).all()):
        raise ValueError(f"a {task} batch shares one {what} (Training.corrupt's shared draw)")
    return values[0]


def check_index_level(level: float, task: str, field: str, choices: Sequence[object]) -> None:
    """``ValueError`` unless the validation ``level`` indexes ``choices`` (the run's ``field``)."""
    if not (float(level).is_integer() and 0 <= level < len(choices)):
        raise ValueError(
            f"val level {level:g}: a {task} level is an index into {field} {list(choices)}, "
            f"0 to {len(choices) - 1}"
        )


class Training(ABC):
    """How one task's models train; subclasses declare the class attributes and define the hooks
    (``corrupt``, ``predictor_inputs``, ``val_levels`` and ``check_level``; the loss, score and shown
    input have defaults).

    Attributes:
        name: the task's name (``kdeq.registry.TASKS``), the key in ``kdeq.train.tasks.TRAININGS``.
        knobs: the model of its corruption knobs, which its hooks' ``settings`` are.
        score_name, score_label: the validation score's name in the trainer's metrics
            (``val_<score_name>``) and its axis label in the report; higher is better.
    """

    name: ClassVar[str]
    knobs: ClassVar[type[Knobs]] = Knobs
    score_name: ClassVar[str] = "psnr"
    score_label: ClassVar[str] = "PSNR (dB)"

    @abstractmethod
    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: Knobs,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """One example from the clean patch ``clean`` ``(c, H, W)`` in [0, 1]: ``target`` and the
        predictor's inputs (``predictor_inputs`` reads them, collated), drawn from ``gen`` within the
        run's ``settings``, or at the validation ``level`` (``val_levels``) when given. ``shared``
        (training only) gives the same draws to every sample of a step: what the predictor takes
        once per call (a PSF, a scale) is drawn from it.

        A run's samples, and so its resumption, are these draws in this order: a change to either
        makes runs that were saved resume differently."""

    @abstractmethod
    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The predictor's leading arguments (of ``forward`` and ``pilot_only``) from a batch of
        ``corrupt``'s examples, each entry collated to ``(B, …)``."""

    def loss(self, out: torch.Tensor, target: torch.Tensor, kind: SquaredError) -> torch.Tensor:
        """The training loss, a scalar, of the output ``out`` ``(B, c, H, W)`` against ``target``; this
        default (the Gaussian tasks') is the run's squared error ``kind``
        (``kdeq.train.objectives.squared_error``)."""
        return squared_error(out, target, kind)

    def score(self, out: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The score ``score_name`` per sample ``(B,)`` of the output ``out`` ``(B, c, H, W)`` on
        ``batch``; this default is the PSNR of ``out`` clipped to [0, 1] against ``target``."""
        return psnr(out, batch["target"])

    @abstractmethod
    def val_levels(self, settings: Knobs) -> tuple[float, ...]:
        """The validation levels (``corrupt``'s ``level``) of a run that names none."""

    @abstractmethod
    def check_level(self, level: float, settings: Knobs) -> None:
        """``ValueError``, saying what a level is for this task, where ``level`` is not one."""

    def shown_input(self, example: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The input ``(c, H, W)`` the training report shows for one of ``corrupt``'s examples: by
        default the predictor's first argument."""
        return self.predictor_inputs({k: v[None] for k, v in example.items()})[0][0]
