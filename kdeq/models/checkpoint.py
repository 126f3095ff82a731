"""Checkpoints: ``<dir>/config.json`` (typed schema) and ``<dir>/weights.safetensors``.

A checkpoint is a model *specification* (``ModelSpec``: task, architecture
with the kernel hyperparameters it was initialised from, the ``λ`` rule, the
mean function, solver defaults) plus the format version, provenance and the
sha256 of the weights file (``ModelConfig``). The tensors a model needs follow
from its architecture (``expected_tensors``).

Loading never unpickles anything (safetensors only) and refuses, naming the
file and the problem: malformed JSON, an unknown format version, an unknown
architecture or task, unknown keys, a sha256 mismatch, missing or extra
tensors, wrong shapes or dtypes, non-finite values, and kernels that are not
symmetric positive semi-definite where the model relies on it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, ValidationError, model_validator
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kdeq.predictors.spec import (
    PRIOR,
    Architecture,
    Checkpoint,
    CheckpointError,
    ConvArchitecture,
    FixedLambda,
    GuidedArchitecture,
    LambdaRule,
    Mean,
    ModelSpecBase,
    NoiseLambda,
    PlugAndPlayArchitecture,
    Provenance,
    check_tensors,
    embed_prior,
    expected_tensors,
    prior_checkpoint,
)
from kdeq.registry import TASKS
from kdeq.runtime.atomic import write_files

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"


def task_family(task: str) -> str:
    """The family of ``task``'s models; ``ValueError`` for a task that is not registered."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {sorted(TASKS)}")
    return TASKS[task].family


def check_task_rules(spec: ModelSpecBase) -> None:
    """``ValueError`` where ``spec`` is not a model its task can run: an unregistered task, its task's
    own rules (``Task.check_spec``: its predictor's, and the noise ``λ`` rule's), CG on a family
    whose equilibrium map is not affine; a plug-and-play model's embedded denoiser is held to its own
    task's rules too."""
    family = task_family(spec.task)
    TASKS[spec.task].check_spec(spec)
    if spec.solver.method == "cg" and family != "gaussian":
        raise ValueError(f"CG needs an affine equilibrium map; the {family} family is not affine")
    if isinstance(spec.architecture, PlugAndPlayArchitecture):
        check_task_rules(spec.architecture.prior)


class ModelSpec(ModelSpecBase):
    """A ``ModelSpecBase`` that its task (``kdeq.registry.TASKS``) can run (``check_task_rules``)."""

    @model_validator(mode="after")
    def _compatible(self) -> ModelSpec:
        check_task_rules(self)
        return self


class ModelConfig(ModelSpec):
    """The contents of ``config.json``."""

    format_version: int
    family: Literal["gaussian", "bernoulli", "poisson"]
    provenance: Provenance = Provenance()
    weights_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _family_matches(self) -> ModelConfig:
        if self.family != task_family(self.task):
            raise ValueError(f"task {self.task} uses the {task_family(self.task)} family, not {self.family}")
        return self

    def spec(self) -> ModelSpec:
        """The ``ModelSpec`` part alone: without the format, family, provenance and weights' hash."""
        return ModelSpec.model_validate(self.model_dump(include=set(ModelSpec.model_fields)))


def checkpoint_files(
    spec: ModelSpec,
    tensors: dict[str, torch.Tensor],
    provenance: Provenance | None = None,
    where: Path = Path("checkpoint"),
) -> tuple[ModelConfig, dict[str, bytes]]:
    """The config of a checkpoint of ``spec`` and ``tensors``, and the bytes of its files by name in
    the order they are written (``config.json``, naming the weights' sha256, last), checked as
    ``load_checkpoint`` checks them (errors name ``where``); nothing is written.

    The bytes depend only on the arguments, so rebuilding a checkpoint reproduces it exactly.
    """
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sorted(tensors.items())}
    check_tensors(spec, tensors, where)
    blob = save_safetensors(tensors)
    config = ModelConfig(
        **spec.model_dump(),
        format_version=FORMAT_VERSION,
        family=task_family(spec.task),
        provenance=provenance or Provenance(),
        weights_sha256=hashlib.sha256(blob).hexdigest(),
    )
    return config, {WEIGHTS_FILE: blob, CONFIG_FILE: (config.model_dump_json(indent=2) + "\n").encode()}


def save_checkpoint(
    directory: Path, spec: ModelSpec, tensors: dict[str, torch.Tensor], provenance: Provenance | None = None
) -> ModelConfig:
    """Write ``checkpoint_files`` (``weights.safetensors``, ``config.json``) into ``directory``.

    Written as one set (``kdeq.runtime.atomic.write_files``): a crash or Ctrl-C leaves the checkpoint the
    folder held before, or none (no ``config.json``), never new weights beside an old config or a
    file cut short.
    """
    config, files = checkpoint_files(spec, tensors, provenance, directory)
    write_files(directory, files)
    return config


def read_config(directory: Path) -> ModelConfig:
    """Parse and validate ``directory/config.json``; raises ``CheckpointError``."""
    path = directory / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as err:  # unreadable: permissions, a directory, an I/O error
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: unknown format version {version!r} (this kdeq reads {FORMAT_VERSION})"
        )
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors())
        raise CheckpointError(f"{path}: {problems}") from None


# the first bytes of a pickle (protocols 2–5) and of torch.save's zip container; a safetensors file
# starts with its 8-byte header length and then the header's "{", which tells the two apart
PICKLE_MAGIC = tuple(bytes([0x80, p]) for p in range(2, 6))


def load_checkpoint(directory: str | Path) -> Checkpoint:
    """Read and validate a checkpoint directory; raises ``CheckpointError`` naming the file and problem."""
    directory = Path(directory)
    config = read_config(directory)
    path = directory / WEIGHTS_FILE
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    if blob[8:9] != b"{" and (blob[:2] in PICKLE_MAGIC or blob[:4] == b"PK\x03\x04"):
        raise CheckpointError(f"{path}: a pickle (torch.save) file, not safetensors; it is never unpickled")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != config.weights_sha256:
        raise CheckpointError(f"{path}: sha256 {digest} does not match config.json's {config.weights_sha256}")
    try:
        tensors = load_safetensors(blob)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
    check_tensors(config, tensors, path)
    return Checkpoint(config, tensors, directory)


__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "PRIOR",
    "WEIGHTS_FILE",
    "Architecture",
    "Checkpoint",
    "CheckpointError",
    "ConvArchitecture",
    "FixedLambda",
    "GuidedArchitecture",
    "LambdaRule",
    "Mean",
    "ModelConfig",
    "ModelSpec",
    "ModelSpecBase",
    "NoiseLambda",
    "PlugAndPlayArchitecture",
    "Provenance",
    "check_task_rules",
    "checkpoint_files",
    "embed_prior",
    "expected_tensors",
    "load_checkpoint",
    "prior_checkpoint",
    "read_config",
    "save_checkpoint",
    "task_family",
]
