"""Pixels → PNG bytes in the request's colour mode, and the negotiation of the response type."""

from __future__ import annotations

import numpy as np

from kdeq.images import png

PNG = "image/png"
JSON = "application/json"


def _quantise(x: np.ndarray, peak: int, dtype: type, rows: int = 256) -> np.ndarray:
    """``rint(peak·clip(x, 0, 1))`` ``(H, W)`` or ``(H, W, c)`` of ``dtype`` for ``x`` ``(c, H, W)``,
    ``rows`` rows at a time, so that the float temporaries are a band's (a 32-megapixel output's
    would be ~1 GiB)."""
    c, height, width = x.shape
    out = np.empty((height, width, c), dtype=dtype)
    for top in range(0, height, rows):
        band = np.clip(x[:, top : top + rows], 0.0, 1.0) * peak
        out[top : top + rows] = np.rint(band, out=band).transpose(1, 2, 0)
    return out[..., 0] if c == 1 else out


def encode_png(pixels: np.ndarray, mode: str, alpha: np.ndarray | None = None) -> bytes:
    """A PNG of ``pixels`` ``(c, H, W)`` in [0, 1] in ``mode`` (``L``, ``I;16``, ``RGB``, ``LA``,
    ``RGBA``); ``alpha`` ``(1, H, W)`` for the modes with transparency (opaque when ``None``).
    Numpy-only, like decoding (see ``service.decode``); written by ``kdeq.images.png``."""
    channels = {"L": 1, "I;16": 1, "RGB": 3, "LA": 1, "RGBA": 3}.get(mode)
    if channels is None or pixels.shape[0] != channels:
        raise ValueError(f"cannot encode {tuple(pixels.shape)} pixels as {mode}")
    if mode == "I;16":
        return png.encode(_quantise(pixels, 65535, np.uint16))
    samples = _quantise(pixels, 255, np.uint8)
    if mode in {"LA", "RGBA"}:
        shape = pixels.shape[1:]
        a = np.full(shape, 255, np.uint8) if alpha is None else _quantise(alpha, 255, np.uint8)
        samples = np.dstack([samples, a])
    return png.encode(samples)


def wants_json(accept: str | None) -> bool:
    """Whether ``Accept`` prefers ``application/json`` to ``image/png``: higher ``q`` wins, then the
    more specific range (``application/json`` beats ``*/*``); PNG on a tie or without ``Accept``."""
    score = {PNG: (0.0, -1), JSON: (0.0, -1)}
    for item in (accept or "").split(","):
        media, *params = (p.strip().lower() for p in item.split(";"))
        q = 1.0
        for p in params:
            key, _, value = p.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        for target in score:
            ranges = ("*/*", target.split("/")[0] + "/*", target)
            if media in ranges:
                specificity = ranges.index(media)
                if specificity > score[target][1]:
                    score[target] = (q, specificity)
    if score[PNG][0] == 0 and score[PNG][1] >= 0 and score[JSON][1] < 0:
        return True  # PNG explicitly refused (q=0) and JSON not mentioned: JSON is all that is left
    return score[JSON] > score[PNG]
