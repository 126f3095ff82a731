"""Uploaded bytes → pixels, refusing what the service must not decode.

Only PNG, JPEG, WebP and TIFF decoders are ever consulted. The pixel limit is
checked from the header, before any pixel is decoded, so a small file that
claims a huge image (a decompression bomb) costs nothing. EXIF orientation is
applied; a multi-frame file (animated WebP, multi-page TIFF) is refused. These
checks are ``kdeq.images.imageio.load_image``'s, the ones ``kdeq TASK`` makes on its
files: each refusal's status, code and detail are its ``ImageRefusedError``'s.

Decoding is numpy-only: torch runs on the inference workers alone, so its
OpenMP pool has a single master thread (each extra thread that calls torch
gets a pool of its own, and on a small machine the pools' threads throttle
each other — measured 2× slower solves).

The decoded image remembers its colour mode so the response can be encoded in
the same one: ``L`` (grey, also from ``1``), ``I;16`` (16-bit grey, also from
``I``/``F``), ``RGB`` (also from ``P``, ``CMYK``, ``YCbCr``, …), ``LA``/``RGBA``
(the alpha channel, or a PNG ``tRNS`` transparent colour, is kept aside, not
denoised). Pillow reads 16-bit colour PNGs as 8-bit, so those come back 8-bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from kdeq.images.imageio import ImageRefusedError, check_mask_size, load_image
from service.errors import ApiError

SIXTEEN_BIT = {"I;16", "I;16B", "I;16L", "I;16N", "I", "F"}


@dataclass(frozen=True)
class DecodedImage:
    """An upload's pixels.

    Attributes:
        pixels: ``(c, H, W)`` float32 array in [0, 1], ``c`` 1 (grey) or 3 (colour).
        alpha: ``(1, H, W)`` float32 array in [0, 1] when the file had transparency, else ``None``.
        mode: the PNG mode a response uses: ``L``, ``I;16``, ``RGB``, ``LA`` or ``RGBA``.
        full_scale: the stored integer that ``pixels`` maps to 1 (255, or 65535 for 16-bit files), so
            that ``pixels · full_scale`` are the values as stored; ``None`` for a floating-point file.
    """

    pixels: np.ndarray
    alpha: np.ndarray | None
    mode: str
    full_scale: int | None = 255

    @property
    def size(self) -> tuple[int, int]:
        """``(H, W)``."""
        return self.pixels.shape[-2], self.pixels.shape[-1]


def _planes(arr: np.ndarray) -> np.ndarray:
    """``(H, W)`` or ``(H, W, c)`` → contiguous float32 ``(c, H, W)``."""
    planes = arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)
    return np.ascontiguousarray(planes, dtype=np.float32)


def _unit(im: Image.Image) -> np.ndarray:
    """8-bit pixels as float32 in [0, 1], without a float64 temporary."""
    return np.asarray(im, dtype=np.float32) / np.float32(255)


def decode_image(data: bytes, field: str, max_pixels: int) -> DecodedImage:
    """Decode an upload; ``ApiError`` 400 (empty), 413 (pixels), 415 (format, or undecodable) or 422
    (too small, several frames): ``kdeq.images.imageio.load_image``'s refusals, the header checked before
    any pixel is decoded."""
    try:
        im = load_image(data, f"`{field}`", max_pixels)
    except ImageRefusedError as err:
        raise ApiError(err.status, err.code, err.detail) from None
    alpha, full_scale = None, 255
    if im.mode in SIXTEEN_BIT:
        arr = np.asarray(im, dtype=np.float32)
        full_scale = None if im.mode == "F" else 65535
        arr = arr if full_scale is None else arr / 65535.0
        pixels, mode = _planes(np.clip(np.nan_to_num(arr), 0.0, 1.0)), "I;16"
    elif im.mode in {"1", "L"} and not im.has_transparency_data:
        pixels, mode = _planes(_unit(im.convert("L"))), "L"
    elif im.mode in {"1", "L", "LA", "La"}:
        arr = _unit(im.convert("LA"))
        pixels, alpha, mode = _planes(arr[..., 0]), _planes(arr[..., 1]), "LA"
    elif im.mode in {"RGBA", "RGBa", "PA"} or im.has_transparency_data:
        arr = _unit(im.convert("RGBA"))
        pixels, alpha, mode = _planes(arr[..., :3]), _planes(arr[..., 3]), "RGBA"
    else:
        pixels, mode = _planes(_unit(im.convert("RGB"))), "RGB"
    return DecodedImage(pixels, alpha, mode, full_scale)


def decode_mask(data: bytes, field: str, size: tuple[int, int], max_pixels: int) -> np.ndarray:
    """A mask file → ``(1, H, W)`` bool array, True where any channel is non-zero (a missing pixel);
    ``ApiError`` 422 when its size is not the image's ``size`` ``(H, W)``."""
    mask = decode_image(data, field, max_pixels)
    try:
        check_mask_size(mask.size, size, f"`{field}`")
    except ImageRefusedError as err:
        raise ApiError(err.status, err.code, err.detail) from None
    return mask.pixels.max(axis=0, keepdims=True) > 0
