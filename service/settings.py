"""The service's settings: typed, validated, read from ``KDEQ_*`` environment variables.

Every field ``name`` is set by the variable ``KDEQ_<NAME>``; an unknown ``KDEQ_``
variable is an error (a typo must not be silently ignored). Lists are
comma-separated. ``Settings.describe()`` is the table of docs/configuration.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from kdeq.predictor import resolve_device
from kdeq.repository import default_models_dir

PREFIX = "KDEQ_"


class SettingsError(ValueError):
    """The environment does not describe a valid configuration."""


class Settings(BaseModel):
    """Service configuration; see ``describe()`` for each field's meaning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models_dir: Path = Field(
        default_factory=default_models_dir, description="model repository (`<name>/<version>/` folders)"
    )
    models: tuple[str, ...] = Field(
        (),
        description="models to load, `NAME` or `NAME:VERSION`, comma-separated; empty: the latest "
        "version of every model. The first of each task is that endpoint's default",
    )
    device: tuple[str, ...] = Field(
        ("auto",),
        description="`auto` (every CUDA device, else the CPU), `cpu`, `cuda`, `cuda:N`, or a "
        "comma-separated list of CUDA devices; one inference worker per device",
    )
    host: str = Field("127.0.0.1", description="address to listen on (`0.0.0.0` in containers)")
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    max_upload_bytes: int = Field(
        32 * 2**20, ge=1024, description="largest request body, enforced while reading (413 above)"
    )
    max_pixels: int = Field(
        4 * 2**20,
        ge=64,
        le=2**27,
        description="largest image, width × height, checked before decoding (413 above)",
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        le=256,
        description="most requests solved together in one batch; unset: 8 on CUDA, 1 on the CPU "
        "(on a CPU a batch is slower per image than single solves; docs/BENCHMARKS.md)",
    )
    max_batch_pixels: int = Field(
        8 * 2**20, ge=64, description="most pixels in one batch (an image larger than this is solved alone)"
    )
    batch_wait_seconds: float = Field(
        0.005, ge=0, le=1, description="how long a batch waits for compatible requests to join it"
    )
    queue_size: int = Field(
        64, ge=1, description="requests waiting for a worker; beyond it 503 with `Retry-After`"
    )
    request_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="deadline from the start of the request's handling (its upload read) to its result; "
        "past it 504",
    )
    drain_seconds: float = Field(
        3.0, ge=0, description="after SIGTERM: time `/readyz` answers 503 while requests are still served"
    )
    api_key: SecretStr | None = Field(
        None,
        min_length=1,
        description="when set, the inference routes and `/models` need `Authorization: Bearer` or "
        "`X-API-Key` (401 otherwise)",
    )
    warmup: bool = Field(True, description="run one prediction per model and device before ready")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")

    @field_validator("models", "device", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("device")
    @classmethod
    def _devices(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one device")
        if len(value) > 1 and "auto" in value:
            raise ValueError("`auto` cannot be combined with other devices")
        for device in value:
            if device != "auto":
                resolve_device(device)
        if len(set(value)) != len(value):
            raise ValueError("devices are listed twice")
        return value

    def devices(self) -> list[str]:
        """The concrete devices: ``auto`` becomes every CUDA device, or ``cpu`` without one."""
        if self.device == ("auto",):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            return [f"cuda:{i}" for i in range(count)] or ["cpu"]
        return [str(resolve_device(d)) for d in self.device]

    def batch_size(self) -> int:
        """``max_batch_size``, or its default for the devices: 8 when they are CUDA devices, else 1."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        return 8 if all(d.startswith("cuda") for d in self.devices()) else 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: object) -> Settings:
        """Settings from the ``KDEQ_*`` variables of ``environ``, then ``overrides`` (e.g. CLI flags)."""
        values: dict[str, object] = {}
        for key, value in environ.items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX) :].lower()
            if name not in cls.model_fields:
                known = ", ".join(PREFIX + f.upper() for f in cls.model_fields)
                raise SettingsError(f"unknown setting {key}; the settings are {known}")
            values[name] = value
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValidationError as err:
            problems = "; ".join(
                f"{PREFIX}{'.'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in err.errors()
            )
            raise SettingsError(f"invalid settings: {problems}") from None

    @classmethod
    def describe(cls) -> list[tuple[str, str, str]]:
        """``(variable, default, meaning)`` for every setting."""
        rows = []
        for name, field in cls.model_fields.items():
            if field.default_factory is not None:
                default = "`models/` beside the package"
            elif isinstance(field.default, tuple):
                default = f"`{','.join(field.default)}`" if field.default else "(all)"
            else:
                default = "(unset)" if field.default is None else f"`{field.default}`"
            rows.append((PREFIX + name.upper(), default, field.description or ""))
        return rows
