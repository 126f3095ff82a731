"""``inpaint``: fill the pixels a mask (or a zero alpha) marks missing (``kdeq.inpaint``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kdeq.checkpoint import ModelSpec
from kdeq.inpaint import Inpainter
from kdeq.predictor import SolverOverride, pad_images
from kdeq.tasks import register_task
from kdeq.tasks.base import FileInput, InputError, Options, Request, Task, check_index_level, tile_level
from kdeq.train.data import Corruption, make_mask
from kdeq.train.objectives import psnr


@register_task
class Inpaint(Task):
    """Fill the missing pixels of `image` (given by `mask`, or by a zero alpha channel); known pixels
    are kept."""

    name = "inpaint"
    summary = "Fill missing pixels"
    sample = "holey"
    predictor = Inpainter
    files = (
        FileInput(
            "mask",
            "same size as `image`, non-zero = missing; when absent, the image's alpha channel is 0 where "
            "missing",
            "mask",
        ),
    )
    network = "mask"

    def check_spec(self, spec: ModelSpec) -> None:
        super().check_spec(spec)
        if spec.architecture.net is not None and spec.mean != "normalized_convolution":
            raise ValueError("the inpainter's network adds to the normalized_convolution mean")

    def prepare(
        self,
        image: np.ndarray,
        alpha: np.ndarray | None,
        options: Options,
        files: Mapping[str, np.ndarray],
        solver: SolverOverride | None = None,
    ) -> Request:
        if "mask" in files:
            missing = files["mask"]
        elif alpha is not None:
            missing = (alpha == 0)[None]
        else:
            raise InputError(
                "missing_mask",
                "send a `mask`, or an image with an alpha channel 0 where missing",
                absent=True,
            )
        if bool(missing.all()):
            raise InputError("nothing_observed", "every pixel is marked missing; nothing to inpaint from")
        if not bool(missing.any()):
            raise InputError(
                "nothing_missing", "no pixel is marked missing (mask: non-zero = missing); nothing to fill"
            )
        return Request(image, options, {"missing": missing}, solver)

    def output_alpha(
        self, request: Request, alpha: np.ndarray | None, files: Sequence[str]
    ) -> np.ndarray | None:
        if "mask" in files or alpha is None:
            return alpha
        # holes given by the alpha channel are filled, so they become opaque; the rest keeps its alpha
        return np.where(alpha == 0, np.float32(1), alpha)

    def batch_key(self, request: Request) -> tuple:
        return (request.solver,)

    def tile_halo(self, predictor: Inpainter) -> int:
        """The model's ``solve_reach`` (``kdeq.inpaint``)."""
        return predictor.solve_reach

    def whole_image(self, predictor: Inpainter, request: Request) -> Request:
        """The observed pixels' channel means (``level``: the mean where no observed pixel is near, and
        what the network centres on) fixed from the whole image."""
        observed = request.inputs["missing"].reshape(request.image.shape[-2:]) == 0
        # numpy accumulates in float64 without a float64 copy of the image
        level = (request.image * observed).sum(axis=(1, 2), dtype=np.float64) / observed.sum()
        return replace(request, inputs={**request.inputs, "level": level.astype(np.float32)})

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        missing, _ = pad_images([torch.from_numpy(r.inputs["missing"]) for r in requests])
        extra = ({} if sizes is None else {"sizes": sizes}) | tile_level(requests)
        return (images, missing), {"solver": requests[0].solver, **extra}

    def warmup(self, size: int) -> Request:
        rng = np.random.default_rng(0)
        image = rng.random((1, size, size), dtype=np.float32)
        return Request(image, self.options(), {"missing": rng.random((1, size, size)) < 0.3})

    def corrupt(
        self,
        clean: torch.Tensor,
        gen: torch.Generator,
        settings: Corruption,
        level: float | None = None,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """A mask ``missing`` ``(1, H, W)`` of a kind drawn from ``settings.mask_kinds`` (``pixels``
        masks miss a fraction drawn from ``settings.missing``), or of the kind the validation
        ``level`` indexes (with the middle of ``missing``); ``image`` is ``clean``, whose missing
        pixels the predictor never reads."""
        if level is None:
            kinds, fraction = settings.mask_kinds, settings.missing
        else:
            mid = sum(settings.missing) / 2
            kinds, fraction = (settings.mask_kinds[int(level)],), (mid, mid)
        # a kind is drawn even from one kind: validation examples are seeded like training ones
        kind = kinds[int(torch.randint(len(kinds), (), generator=gen))]
        miss = make_mask(kind, tuple(clean.shape[-2:]), fraction, gen)
        # a patch with nothing observed carries no information; keep one pixel
        miss.view(-1)[int(torch.randint(miss.numel(), (), generator=gen))] = False
        return {"target": clean, "image": clean, "missing": miss[None]}

    def predictor_inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(image, missing)``: the images ``(B, c, H, W)`` and their masks ``(B, 1, H, W)``."""
        return batch["image"], batch["missing"]

    def score(self, out: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """PSNR on the missing pixels, the ones the model fills."""
        return psnr(out, batch["target"], batch["missing"])

    def val_levels(self, settings: Corruption) -> tuple[float, ...]:
        """Every mask kind of the run."""
        return tuple(float(i) for i in range(len(settings.mask_kinds)))

    def check_level(self, level: float, settings: Corruption) -> None:
        check_index_level(level, "inpaint", "mask_kinds", settings.mask_kinds)

    def shown_input(self, example: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The image with its missing pixels black."""
        return torch.where(example["missing"], torch.zeros_like(example["image"]), example["image"])
