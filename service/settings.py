"""The service's settings: typed, validated, read from ``KDEQ_*`` environment variables.

Every field ``name`` is set by the variable ``KDEQ_<NAME>``; an unknown ``KDEQ_``
variable is an error (a typo must not be silently ignored). Lists are
comma-separated. ``Settings.describe()`` is the table of docs/configuration.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kdeq.images.imageio import MAX_PIXELS, MAX_UNTILED_PIXELS, PIXEL_LIMITS
from kdeq.models.repository import default_models_dir
from kdeq.predictors.base import resolve_device
from kdeq.serving.tiling import TILE_SIZE
from service.devices import choose_devices

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
        description="`auto` (every CUDA device, else the CPU; the log says which and why), `cpu`, "
        "`cuda` (the current CUDA device, named `cuda:N`: `cuda:0`, the first of "
        "`CUDA_VISIBLE_DEVICES`, at startup), `cuda:N`, or a comma-separated list of CUDA devices, "
        "each once; one inference worker per device. A CUDA device that is not usable stops "
        "startup with the reason",
    )
    host: str = Field("127.0.0.1", description="address to listen on (`0.0.0.0` in containers)")
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    max_upload_bytes: int = Field(
        128 * 2**20,
        ge=1024,
        description="largest request body, enforced while reading (413 above): a 24-megapixel photo's "
        "PNG is up to ~75 MB",
    )
    # the limits' defaults and range are kdeq.images.imageio's, which `kdeq TASK` applies too
    max_pixels: int = Field(
        MAX_PIXELS,
        ge=PIXEL_LIMITS[0],
        le=PIXEL_LIMITS[1],
        description="largest image, width × height, checked before decoding (413 above); a model that "
        "does not solve in tiles takes at most `KDEQ_MAX_UNTILED_PIXELS`. The default is also "
        "`kdeq TASK --max-pixels`'s (`kdeq.images.imageio.MAX_PIXELS`)",
    )
    max_untiled_pixels: int = Field(
        MAX_UNTILED_PIXELS,
        ge=PIXEL_LIMITS[0],
        le=PIXEL_LIMITS[1],
        description="largest image a model that does not solve in tiles (deblur's) takes (413 above): "
        "its solve's memory grows with the image. The default is also `kdeq TASK "
        "--max-untiled-pixels`'s (`kdeq.images.imageio.MAX_UNTILED_PIXELS`)",
    )
    tile_size: int = Field(
        TILE_SIZE,
        ge=0,
        le=2**14,
        description="images of more than `KDEQ_TILE_SIZE`² pixels are solved in tiles of about this side "
        "where the model can (`kdeq.serving.tiling`: every task but deblur; a super-resolver's tiles are "
        "this side in output pixels), so that memory stays a tile's; 0: never (then "
        "`KDEQ_MAX_UNTILED_PIXELS` bounds every model)",
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
        description="when set, the inference routes, `/tasks` and `/models` (and the routes under it) "
        "need `Authorization: Bearer` or `X-API-Key` (401 otherwise)",
    )
    model_control: bool = Field(
        False,
        description="allow `POST /models/{name}/load` and `/unload`: a model's version loaded, warmed "
        "and swapped in (or taken out) without a restart; off: they answer 403",
    )
    warmup: bool = Field(
        True, description="run warm-up predictions per model on each device's worker before ready"
    )
    warmup_sizes: tuple[Annotated[int, Field(ge=8, le=4096)], ...] | None = Field(
        None,
        description="square image sizes (pixels per side, comma-separated, each once, at most "
        "√`KDEQ_MAX_PIXELS`) of the warm-up predictions: one per model and size, on each worker's "
        "own thread, so that its cuBLAS/cuDNN handles, OpenMP pool and allocator pools exist before "
        "the first request; unset: `32,256` on CUDA, `32` on the CPU. Cost: on a 2-core CPU about "
        "0.3 s per model at 32 and 1–7 s per model at 256 (20 s for the four default models)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`text` (a line for a person) or `json` (an object a line: time, level, logger, message, "
        "request_id, and each access line's fields)",
    )
    conv_backend: Literal["auto", "padded", "prepadded", "fft"] = Field(
        "auto",
        description="how the models' zero-border convolutions run on the CPU (`kdeq.runtime.backends`): "
        "`auto` times `padded`, `prepadded` and (for large filters) `fft` on the first input of each shape "
        "class (the warm-up's included), keeps the fastest and logs it; a name pins that one",
    )
    network_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the arithmetic of the models' guide networks on the CPU (`kdeq.runtime.netprecision`; "
        "the kernel solves stay IEEE float32): `auto` times a hidden layer in `float32` and `bfloat16` on "
        "the first input of each shape class (the warm-up's included) and keeps `bfloat16` where it is 1.2× "
        "faster (CPUs with bf16 dot products), logging the choice; a name pins that one",
    )
    guided_backend: Literal["auto", "native", "triton", "loop"] = Field(
        "auto",
        description="how the guided kernel's offset loops (its weight maps, `K x`, the non-local means) run: "
        "on a CPU `auto` compiles `kdeq/runtime/native.c` at the first solve (the warm-up's) "
        "with the C compiler `CC` (default `cc`) for this CPU, keeps it in `KDEQ_NATIVE_CACHE` (default "
        "`~/.cache/kdeq/native`, else a private folder of the temporary directory) and uses it, or "
        "torch's loops where it does not build, logging which; on a CUDA device `auto` runs Triton's fused "
        "kernels (`kdeq.maths.fused`, the `gpu` extra), or torch's loops without Triton; `native`, `triton` "
        "or `loop` pins one",
    )

    cuda_graphs: bool = Field(
        False,
        description="on a CUDA device, run each solve's steps as CUDA graph replays, a chunk of steps a "
        "launch, captured once per model, batch and size class (`kdeq.maths.graphs`), for batches of at most "
        "512 Ki pixels (`kdeq.maths.adaptive.GATHER_PIXELS`); off (the default until replay is measured on a "
        "GPU): one step at a time",
    )

    native_cache: Path | None = Field(
        None,
        description="the folder the guided kernel's compiled loops are kept in (`KDEQ_GUIDED_BACKEND`; "
        "unset: `~/.cache/kdeq/native`, else a private folder of the temporary directory): a volume where "
        "the container's filesystem is read-only",
    )
    threads: str = Field(
        "auto",
        pattern=r"^(auto|[1-9][0-9]{0,3})$",
        description="torch's CPU threads for a batch (`kdeq.runtime.threads`): `auto` gives each batch the "
        "cores that were free since the last one (idle, or this process's), at most the cores the process "
        "has (its CPU affinity and cgroup quota, not the host's CPUs) — one thread while a neighbour holds "
        "every core, where the threads' barriers would each wait out a scheduler slice; a number fixes it",
    )
    malloc: Literal["keep", "system"] = Field(
        "keep",
        description="the C heap's settings (`kdeq.runtime.heap`, glibc only): `keep` reuses freed blocks up "
        "to 32 MiB (a guide network's activations) from the heap instead of mapping fresh memory for each, "
        "which the kernel faults in page by page, keeps up to 256 MiB free before handing it back (after "
        "a batch of 1 megapixel or more it is handed back at once) and gives the worker threads the main "
        "heap rather than arenas of their own; `system` leaves glibc's own adaptive settings",
    )

    @field_validator("models", "device", "warmup_sizes", mode="before")
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
        if value == ("auto",):
            return value
        # one name per device (`cuda` is `cuda:N`), so that two workers never share a device
        named: dict[str, str] = {}
        for device in value:
            name = str(resolve_device(device))
            if name in named:
                same = f"`{named[name]}` and `{device}` are the same device ({name})"
                raise ValueError(f"{same}; list each device once")
            named[name] = device
        return tuple(named)

    @field_validator("warmup_sizes")
    @classmethod
    def _sizes(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("at least one size (turn warm-up off with KDEQ_WARMUP=false)")
        if len(set(value)) != len(value):
            raise ValueError("a size is listed twice")
        return value

    @field_validator("tile_size")
    @classmethod
    def _tile_size(cls, value: int) -> int:
        if value and (value < 64 or value % 2):
            raise ValueError("a tile side is an even number of pixels, at least 64, or 0 (no tiles)")
        return value

    @model_validator(mode="after")
    def _warmup_fits(self) -> Settings:
        # warm-ups are solved whole, by every model: no larger than a request any model solves whole
        for limit, name in ((self.max_pixels, "MAX_PIXELS"), (self.max_untiled_pixels, "MAX_UNTILED_PIXELS")):
            too_large = [n for n in self.warmup_sizes or () if n * n > limit]
            if too_large:
                raise ValueError(
                    f"KDEQ_WARMUP_SIZES: {too_large} exceed KDEQ_{name}={limit} "
                    "(no request is solved whole at that size)"
                )
        return self

    @model_validator(mode="after")
    def _tiles_fit(self) -> Settings:
        # an image of up to tile_size² pixels is solved whole
        if self.tile_size**2 > self.max_untiled_pixels:
            raise ValueError(
                f"KDEQ_TILE_SIZE={self.tile_size}: a tile of {self.tile_size}² pixels exceeds "
                f"KDEQ_MAX_UNTILED_PIXELS={self.max_untiled_pixels}, the most pixels solved whole"
            )
        return self

    def devices(self) -> list[str]:
        """The concrete devices: ``auto`` becomes every CUDA device, or ``cpu`` without a usable one
        (``service.devices.choose_devices`` says why)."""
        return choose_devices(self.device).devices

    def batch_size(self, devices: list[str] | None = None) -> int:
        """``max_batch_size``, or its default for ``devices`` (default: ``devices()``): 8 when they are
        CUDA devices, else 1."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        return 8 if all(d.startswith("cuda") for d in devices or self.devices()) else 1

    def warmup_sizes_for(self, devices: list[str]) -> tuple[int, ...]:
        """``warmup_sizes``, or its default for ``devices``: 32 and 256 on CUDA devices (a few ms each,
        and a typical request's size), 32 alone on the CPU (where 256 costs seconds per model)."""
        if self.warmup_sizes is not None:
            return self.warmup_sizes
        return (32, 256) if all(d.startswith("cuda") for d in devices) else (32,)

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
                # an error of several settings together names them in its message
                f"{PREFIX}{'.'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" if e["loc"] else e["msg"]
                for e in err.errors()
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
                default = f"`{','.join(map(str, field.default))}`" if field.default else "(all)"
            else:
                default = "(unset)" if field.default is None else f"`{field.default}`"
            rows.append((PREFIX + name.upper(), default, field.description or ""))
        return rows
