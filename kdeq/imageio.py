"""Image files ↔ tensors for the offline CLI: PNG/JPEG/WebP/TIFF in, 8-bit PNG out.

EXIF orientation is applied on reading; grey stays grey (``L``, 16-bit ``I;16``
scaled to [0, 1]), everything else becomes RGB (alpha is dropped).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


def read_image(path: str | Path) -> torch.Tensor:
    """``(1, c, H, W)`` float32 in [0, 1]; ``c = 1`` for grey files, 3 otherwise."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in {"I", "I;16", "I;16B", "I;16L"}:
            arr = np.asarray(im, dtype=np.float32) / 65535.0
        elif im.mode == "F":
            arr = np.asarray(im, dtype=np.float32)
        elif im.mode in GREY_MODES:
            arr = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
        else:
            arr = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return (t[None] if t.dim() == 2 else t.permute(2, 0, 1))[None]


def read_mask(path: str | Path) -> torch.Tensor:
    """``(1, 1, H, W)`` bool: True where any channel of the file is non-zero (a missing pixel)."""
    return read_image(path).amax(dim=1, keepdim=True) > 0


def write_png(path: str | Path, image: torch.Tensor) -> None:
    """Write ``image`` ``(c, H, W)`` (``c`` 1 or 3, values clipped to [0, 1]) as an 8-bit PNG."""
    arr = (image.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu()
    arr = arr[0].numpy() if arr.shape[0] == 1 else arr.permute(1, 2, 0).numpy()
    Image.fromarray(arr).save(path, format="PNG")
