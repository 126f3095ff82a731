"""The trainer's settings: one typed, frozen object; unknown keys are an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kdeq.maths.implicit import Backward
from kdeq.models.checkpoint import ModelSpec, read_config
from kdeq.models.initialize import DEFAULT_SPECS, GROWN_SPECS
from kdeq.registry import TASKS
from kdeq.train.objectives import SquaredError
from kdeq.train.tasks.base import Knobs
from kdeq.train.trainings import TRAININGS, RunKnobs


class TrainConfig(RunKnobs):
    """What ``kdeq train`` does: each field's description says what it means (``kdeq train --help``
    shows them with the defaults; ``kdeq.train.cli`` makes its options from them).

    The corruption knobs (``sigma``, ``mask_kinds``, …) are the fields of ``RunKnobs``: every
    training's (``kdeq.train.trainings.TRAININGS``) declared once, there. The task's training reads
    its own (``task_knobs()``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: str = Field(
        description="a registered task (kdeq.registry.TASKS) that has a training "
        "(kdeq.train.trainings.TRAININGS); must match the spec's"
    )
    spec: str = Field(
        description="a shipped default's name (denoise-kglm, …), a ModelSpec JSON file or a checkpoint "
        "folder (its spec, learned λ included): the architecture, kernel, λ rule and solver the model "
        "starts from"
    )
    init: Literal["kglm", "random"] = Field(
        "kglm",
        description="the start: kglm, the closed form from the spec's kernel, or random, the same "
        "architecture at random",
    )
    warm_start: Path | None = Field(
        None,
        description="a checkpoint folder whose tensors replace the start's where the spec has one of the "
        "same name (and must then have its shape), e.g. a Gaussian denoiser's guide network as the "
        "photon-count model's start; at least one must be shared",
    )
    train_only: tuple[str, ...] = Field(
        (),
        description="train only the tensors whose names start with one of these (net_refine_: the "
        "denoiser's non-local refinement, kdeq.maths.refine); every other tensor and the λ factor stay as "
        "they start; none: the whole model",
    )
    colour_net: int | None = Field(
        None,
        ge=4,
        le=256,
        description="grow the spec's σ-conditioned guide network a joint colour network of this many "
        "features (kdeq.maths.guidenet), from init's start: with warm_start on a trained denoiser and 3 "
        "channels, training moves only what colour images reach",
    )
    train: tuple[Path, ...] = Field(min_length=1, description="training image folders (PNG, JPEG, TIFF)")
    val: tuple[Path, ...] = Field(min_length=1, description="validation image folders (PNG, JPEG, TIFF)")
    out: Path = Field(
        description="models/<name>/<version>, a version not taken: the best checkpoint by validation, "
        "with report/ and train-state/ (for resume) inside"
    )
    epochs: int = Field(10, ge=1, description="epochs to train")
    samples_per_epoch: int = Field(512, ge=1, description="training patches drawn per epoch")
    batch_size: int = Field(8, ge=1, description="patches per step, per rank")
    patch_size: int = Field(64, ge=8, description="side of the square training patches, in pixels")
    loss: SquaredError = Field(
        "log_mse",
        description="the Gaussian tasks' loss: log_mse (the mean over samples of ln MSE, i.e. of −PSNR: "
        "high-noise samples do not drown low-noise ones) or mse; a task may have its own "
        "(segment: cross-entropy)",
    )
    lr: float = Field(2e-3, gt=0, description="Adam's step size")
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="the step size after the warm-up: a cosine decay to 0, or constant"
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up of the step size")
    clip_grad: float = Field(1.0, gt=0, description="bound on the gradient's norm")
    train_tol: float | None = Field(
        None, gt=0, description="the forward solver's tolerance while training; unset: the model's"
    )
    train_max_iter: int | None = Field(
        None, ge=1, description="the forward solver's iteration limit while training; unset: the model's"
    )
    eval_tol: float | None = Field(
        None, gt=0, description="the solver's tolerance for validation; unset: the model's"
    )
    eval_max_iter: int | None = Field(
        None, ge=1, description="the solver's iteration limit for validation; unset: the model's"
    )
    backward: Backward = Field(
        "implicit", description="gradients by implicit differentiation, or jacobian_free (cheaper, JFB)"
    )
    pilot_loss: float = Field(
        1.0,
        ge=0,
        description="weight w of a guide network's pilot in the loss, loss(output) + w·loss(pilot) "
        "(models with a guide network)",
    )
    pilot_epochs: int = Field(
        0,
        ge=0,
        description="the first epochs train the guide network on its pilot alone, without the solve "
        "(several times cheaper a step); later epochs train the whole model",
    )
    min_converged: float = Field(
        0.5,
        ge=0,
        le=1,
        description="fraction of a batch's solves that must converge; below it (or with a non-finite "
        "loss or gradient) the step is rolled back to the last good state and the step size halved",
    )
    max_rollbacks: int = Field(20, ge=0, description="stop with an error after this many rollbacks")
    val_levels: tuple[float, ...] = Field(
        (),
        description="validation levels, what the task's corruption takes as its level (denoise: noise "
        "levels, inpaint: mask-kind indices, segment: flip fractions); none: the task's defaults",
    )
    val_limit: int = Field(8, ge=1, description="at most this many validation images")
    val_crop: int = Field(0, ge=0, description="centre-crop the validation images to this side (0: whole)")
    channels: Literal[1, 3] = Field(1, description="1 (grey; colour files become luminance) or 3")
    seed: int = Field(0, description="the seed of every sample, the validation inputs and a random start")
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    workers: int = Field(1, ge=0, description="data-loading processes (0: the training process loads)")
    dist_timeout: float = Field(
        3600.0,
        gt=0,
        description="under torchrun, seconds a rank waits in a collective before the run fails; every "
        "other rank waits while rank 0 validates and writes an epoch's results, so this must exceed that "
        "(the backends' own defaults, 10 minutes for nccl, may not)",
    )
    resume: bool = Field(
        False,
        description="continue from out/train-state (same settings; stop_after, workers, device and "
        "dist_timeout may differ)",
    )
    stop_after: int | None = Field(
        None,
        ge=1,
        description="end this process after that epoch, its state saved to resume later (time-limited "
        "jobs); unset: after the last",
    )

    @field_validator("task")
    @classmethod
    def _trainable(cls, task: str) -> str:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; the tasks are {sorted(TASKS)}")
        if task not in TRAININGS:
            raise ValueError(
                f"the {task} task cannot be trained yet: it has no training defining corrupt, "
                "predictor_inputs, val_levels and check_level (kdeq.train.trainings.TRAININGS)"
            )
        return task

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        settings = self.task_knobs()
        for level in self.val_levels:
            TRAININGS[self.task].check_level(level, settings)
        spec = self.model_spec()
        if spec.task != self.task:
            raise ValueError(f"spec {self.spec!r} is a {spec.task} model, not {self.task}")
        if spec.architecture.kind == "pnp":
            raise ValueError(
                f"spec {self.spec!r} is a plug-and-play model, composed around a denoiser rather than "
                "trained: fine-tune its prior with --task denoise, then kdeq init --prior DIR"
            )
        if self.pilot_epochs and spec.architecture.net is None:
            raise ValueError(f"pilot_epochs needs a model with a network; spec {self.spec!r} has none")
        return self

    def model_spec(self) -> ModelSpec:
        """The ``ModelSpec`` named by ``spec``, renamed to ``out``'s ``<name>/<version>``."""
        defaults = {s.name: s for s in DEFAULT_SPECS + GROWN_SPECS}
        if self.spec in defaults:
            base = defaults[self.spec]
        else:
            path = Path(self.spec)
            if path.is_dir():
                # A checkpoint's spec, its learned λ included: with --warm-start on the same folder
                # a run continues training that checkpoint.
                base = read_config(path).spec()
            elif path.is_file():
                base = ModelSpec.model_validate(json.loads(path.read_text()))
            else:
                raise ValueError(
                    f"spec {self.spec!r} is neither a default model {sorted(defaults)}, "
                    "a checkpoint folder nor a file"
                )
        if not self.out.name.isdigit() or not self.out.name.isascii():
            raise ValueError(f"out must be a <models>/<name>/<version> folder, got {self.out}")
        data = base.model_dump()
        data.update(name=self.out.parent.name, version=int(self.out.name))
        if self.colour_net is not None:
            net = data["architecture"].get("net")
            if net is None or net["condition"] != "sigma" or net.get("colour_channels") is not None:
                raise ValueError(
                    f"colour_net grows a σ-conditioned guide network without a colour network; spec "
                    f"{self.spec!r} has {'none' if net is None else 'another'}"
                )
            net["colour_channels"] = self.colour_net
        return ModelSpec.model_validate(data)

    def task_knobs(self) -> Knobs:
        """The run's values of its task's knobs (``Training.knobs``), which the training's hooks
        read: the settings its examples are drawn within."""
        model = TRAININGS[self.task].knobs
        return model.model_validate({name: getattr(self, name) for name in model.model_fields})

    def levels(self) -> tuple[float, ...]:
        """``val_levels``, or the task's defaults (``Training.val_levels``)."""
        return self.val_levels or TRAININGS[self.task].val_levels(self.task_knobs())
