"""Image files ↔ tensors for the offline CLI: PNG/JPEG/WebP/TIFF in, 8-bit (or 16-bit grey) PNG out.

EXIF orientation is applied on reading; grey stays grey (``L``, 16-bit ``I;16``
scaled to [0, 1]), everything else becomes RGB (alpha is dropped). Photon counts are read unscaled
(``read_counts``) and written back in their file's bit depth.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from kdeq import png

GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


def read_image(path: str | Path) -> torch.Tensor:
    """``(1, c, H, W)`` float32 in [0, 1]; ``c = 1`` for grey files, 3 otherwise."""
    return _read(path)[0]


def read_counts(path: str | Path) -> tuple[torch.Tensor, int]:
    """The pixel values as stored, ``(1, c, H, W)`` float32 (photon counts: 0–255 in an 8-bit file,
    0–65535 in a 16-bit one), and that full scale; ``ValueError`` for a floating-point file."""
    image, scale = _read(path, unit=False)
    if scale == 1.0:
        raise ValueError(f"{path}: photon counts are integer pixels, not floating point")
    return image, int(scale)


def _read(path: str | Path, unit: bool = True) -> tuple[torch.Tensor, float]:
    """The file's pixels ``(1, c, H, W)`` float32, divided by their full scale where ``unit``, and that
    full scale (255, 65535, or 1 for a floating-point file)."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in {"I", "I;16", "I;16B", "I;16L"}:
            arr, scale = np.asarray(im, dtype=np.int32), 65535.0
        elif im.mode == "F":
            arr, scale = np.asarray(im, dtype=np.float32), 1.0
        else:
            arr, scale = np.asarray(im.convert("L" if im.mode in GREY_MODES else "RGB")), 255.0
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    # one float32 (c, H, W) array, filled and scaled in place: a 24-megapixel photo holds its 8-bit
    # pixels and this, not the three float copies that converting and dividing out of place make
    out = torch.empty(arr.shape, dtype=torch.float32)
    view = out.numpy()
    np.copyto(view, arr)
    if unit:
        view /= np.float32(scale)
    return out[None], scale


def read_mask(path: str | Path) -> torch.Tensor:
    """``(1, 1, H, W)`` bool: True where any channel of the file is non-zero (a missing pixel)."""
    return read_image(path).amax(dim=1, keepdim=True) > 0


def write_png(path: str | Path, image: torch.Tensor, bits: int = 8) -> None:
    """Write ``image`` ``(c, H, W)`` (``c`` 1 or 3, values clipped to [0, 1]) as an 8-bit PNG, or with
    ``bits = 16`` a 16-bit one where ``c = 1`` (``round(65535·v)``; PNG readers take no 16-bit colour
    from PIL, so colour stays 8-bit)."""
    if bits not in (8, 16):
        raise ValueError(f"a PNG here has 8 or 16 bits, not {bits}")
    if bits == 16 and image.shape[0] == 1:
        grey = image[0].detach().float().cpu().clamp(0, 1).mul(65535.0).round().numpy()
        Path(path).write_bytes(png.encode(grey.astype(np.uint16)))
        return
    Path(path).write_bytes(png.encode(to_bytes(image)))


def to_bytes(image: torch.Tensor, rows: int = 256) -> np.ndarray:
    """``round(255·clip(image, 0, 1))`` as ``(H, W)`` (grey) or ``(H, W, c)`` uint8 for ``image``
    ``(c, H, W)``, converted ``rows`` rows at a time: the float temporaries are a band's, not the
    image's."""
    c, height, width = image.shape
    out = torch.empty((height, width, c), dtype=torch.uint8)
    for top in range(0, height, rows):
        band = image[:, top : top + rows].detach().float().cpu().clamp(0, 1).mul_(255.0).round_()
        out[top : top + rows] = band.permute(1, 2, 0)
    return out[..., 0].numpy() if c == 1 else out.numpy()
