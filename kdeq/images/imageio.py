"""Image files ↔ tensors for the offline CLI: PNG/JPEG/WebP/TIFF in, 8-bit (or 16-bit grey) PNG out;
and what may be read at all, for the CLI and the service alike (``open_image``).

EXIF orientation is applied on reading; grey stays grey (``L``, 16-bit ``I;16``
scaled to [0, 1]), everything else becomes RGB (alpha is dropped). Photon counts are read unscaled
(``read_counts``) and written back in their file's bit depth.

``open_image`` is the one gate in front of the decoders: only the PNG, JPEG, WebP and TIFF decoders
are consulted, the pixel count is checked from the header before any pixel is decoded (a small file
that claims a huge image, a decompression bomb, costs nothing), and an empty, undecodable,
multi-frame or smaller than 2×2 image is refused. Each refusal is an ``ImageRefusedError`` that carries
the HTTP status and error code the service answers with, so that ``kdeq TASK`` and the service refuse
the same files with the same words. ``MAX_PIXELS`` and ``MAX_UNTILED_PIXELS`` are the default limits
of both (``KDEQ_MAX_PIXELS``, ``kdeq TASK --max-pixels``; ``KDEQ_MAX_UNTILED_PIXELS``,
``--max-untiled-pixels``), ``PIXEL_LIMITS`` the range either may be set in, and ``pixel_limit`` the
limit that applies to a model.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from kdeq.images import png

GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}
#: the only decoders ever consulted: a format's decoder is code that every file of it reaches
FORMATS = ("PNG", "JPEG", "WEBP", "TIFF")
#: the default largest image, width × height, that is decoded at all: 32 Mi pixels, room for a
#: 24-megapixel photo (whose float32 colour pixels alone take 12 bytes each, ~290 MiB)
MAX_PIXELS = 32 * 2**20
#: the default largest image that a model which does not solve in tiles (deblur's) takes: its solve's
#: memory grows with the image, where a tiled solve's stays a tile's
MAX_UNTILED_PIXELS = 4 * 2**20
#: the range either limit may be set in: at least an 8×8 image, and at most 2²⁷ pixels, under the
#: 2 × 89 Mi at which Pillow refuses on its own (``Image.MAX_IMAGE_PIXELS``)
PIXEL_LIMITS = (64, 2**27)
# this module's pixel limit is the one that applies: Pillow's warning above its own default (89 Mi
# pixels) would only repeat it. Set once, as warning filters are process-wide and the service decodes
# on several threads
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class ImageRefusedError(ValueError):
    """An image that is not read: ``status`` (the HTTP status the service answers: 400 empty, 413
    too many pixels, 415 not a decodable image of ``FORMATS``, 422 too small or several frames), a
    short ``code`` (the service's ``error``) and a one-line ``detail`` that names the file."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def pixel_limit(tiles: bool, max_pixels: int, max_untiled_pixels: int) -> int:
    """The most pixels an image, and a task's output, may have for a model that solves in tiles
    (``tiles``: ``max_pixels``) or one that does not (the smaller of the two limits)."""
    return max_pixels if tiles else min(max_pixels, max_untiled_pixels)


def open_image(source: bytes | str | Path, name: str, max_pixels: int) -> Image.Image:
    """``source`` (a file's bytes, or its path) opened, its header read and checked, no pixel decoded;
    ``ImageRefusedError`` (its detail starting with ``name``) where it is empty, not a PNG, JPEG, WebP or
    TIFF image, of more than ``max_pixels`` pixels, smaller than 2×2 or of several frames;
    ``FileNotFoundError`` or ``PermissionError`` where a path cannot be opened."""
    if isinstance(source, bytes):
        empty, stream = not source, io.BytesIO(source)
    else:
        empty, stream = Path(source).stat().st_size == 0, source
    if empty:
        raise ImageRefusedError(400, "empty_file", f"{name} is empty")
    try:
        im = Image.open(stream, formats=FORMATS)
    except Image.DecompressionBombError:
        # Pillow's own refusal, past twice its MAX_IMAGE_PIXELS: far over any limit here
        raise ImageRefusedError(
            413, "too_many_pixels", f"{name} declares more than {max_pixels} pixels"
        ) from None
    except UnidentifiedImageError:
        raise ImageRefusedError(
            415, "unsupported_media_type", f"{name} is not a PNG, JPEG, WebP or TIFF image"
        ) from None
    except (FileNotFoundError, PermissionError):
        raise  # the file system's answer, not the file's content
    except IsADirectoryError:
        raise ImageRefusedError(415, "unsupported_media_type", f"{name} is a folder, not an image") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise _undecodable(name, err) from None
    try:
        width, height = im.size
        if width * height > max_pixels:
            raise ImageRefusedError(
                413, "too_many_pixels", f"{name} is {width}×{height}, over the limit of {max_pixels} pixels"
            )
        if width < 2 or height < 2:
            raise ImageRefusedError(
                422, "image_too_small", f"{name} is {width}×{height}; at least 2×2 pixels"
            )
        frames = getattr(im, "n_frames", 1)
        if frames > 1:
            # which frame was meant is not ours to guess, and dropping the others would lose data
            raise ImageRefusedError(
                422, "multi_frame", f"{name} has {frames} frames; send a single-frame image"
            )
    except BaseException:
        im.close()
        raise
    return im


def load_image(source: bytes | str | Path, name: str, max_pixels: int) -> Image.Image:
    """``open_image``, then EXIF orientation applied and the pixels decoded; ``ImageRefusedError`` 415
    where the pixels cannot be decoded (a truncated or corrupt file)."""
    im = open_image(source, name, max_pixels)
    try:
        # in place: a copy would hold the decoded pixels twice
        ImageOps.exif_transpose(im, in_place=True)
        im.load()
    except (OSError, ValueError, SyntaxError) as err:
        im.close()
        raise _undecodable(name, err) from None
    return im


def check_mask_size(mask: tuple[int, int], image: tuple[int, int], name: str, turned: bool = False) -> None:
    """``ImageRefusedError`` 422 ``size_mismatch`` where a mask's size ``(H, W)`` is not its image's,
    nor, where ``turned`` (sizes read from headers, before EXIF orientation turns either a quarter),
    its image's turned."""
    if mask != image and not (turned and mask == image[::-1]):
        (h, w), (mh, mw) = image, mask
        raise ImageRefusedError(422, "size_mismatch", f"{name} is {mw}×{mh} but the image is {w}×{h}")


def _undecodable(name: str, err: Exception) -> ImageRefusedError:
    return ImageRefusedError(415, "unsupported_media_type", f"{name} cannot be decoded: {err}")


def read_image(path: str | Path, max_pixels: int = PIXEL_LIMITS[1]) -> torch.Tensor:
    """``(1, c, H, W)`` float32 in [0, 1]; ``c = 1`` for grey files, 3 otherwise; ``ImageRefusedError``
    where ``open_image`` refuses the file (by default only what no limit admits: the CLI checks its
    own before reading)."""
    return _read(path, max_pixels)[0]


def read_counts(path: str | Path, max_pixels: int = PIXEL_LIMITS[1]) -> tuple[torch.Tensor, int]:
    """The pixel values as stored, ``(1, c, H, W)`` float32 (photon counts: 0–255 in an 8-bit file,
    0–65535 in a 16-bit one), and that full scale; ``ValueError`` for a floating-point file, and as
    ``read_image`` for a refused one."""
    image, scale = _read(path, max_pixels, unit=False)
    if scale == 1.0:
        raise ValueError(f"{path}: photon counts are integer pixels, not floating point")
    return image, int(scale)


def _read(path: str | Path, max_pixels: int, unit: bool = True) -> tuple[torch.Tensor, float]:
    """The file's pixels ``(1, c, H, W)`` float32, divided by their full scale where ``unit``, and that
    full scale (255, 65535, or 1 for a floating-point file)."""
    with load_image(path, str(path), max_pixels) as im:
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


def read_mask(path: str | Path, max_pixels: int = PIXEL_LIMITS[1]) -> torch.Tensor:
    """``(1, 1, H, W)`` bool: True where any channel of the file is non-zero (a missing pixel)."""
    return read_image(path, max_pixels).amax(dim=1, keepdim=True) > 0


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
