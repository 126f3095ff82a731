"""Non-negative maps as 16-bit grey PNGs with a scale: the file format of uncertainty maps.

A map ``v`` ``(H, W)`` (``v ≥ 0``, e.g. a posterior standard deviation on an image's [0, 1] scale) is
stored as ``q = rint(v / S)`` in 16 bits with ``S = max(v)/65535`` (so the largest value is full
scale and every value is within ``S/2`` of ``q·S``; ``S = 1/65535`` for a map of zeros). ``S`` travels
beside the file where a format has room for it (the service's JSON ``scale``) and inside it as the
PNG text chunk ``kdeq:scale`` (``repr`` of the float), so that a file alone reads back to values.
Numpy and PIL only, like the service's encoders.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin

#: the PNG text chunk that holds the scale
SCALE_KEY = "kdeq:scale"
FULL = 65535


def encode(values: np.ndarray) -> tuple[bytes, float]:
    """The PNG of ``values`` ``(H, W)`` (finite, ``≥ 0``) and its scale ``S`` (module docstring)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2 or not np.isfinite(v).all() or (v < 0).any():
        raise ValueError(f"a scaled map is (H, W), finite and non-negative; got {v.shape}")
    top = float(v.max()) if v.size else 0.0
    scale = top / FULL if top > 0 else 1.0 / FULL
    q = np.rint(v / scale).clip(0, FULL).astype(np.uint16)
    info = PngImagePlugin.PngInfo()
    info.add_text(SCALE_KEY, repr(scale))
    out = io.BytesIO()
    Image.fromarray(q).save(out, format="PNG", pnginfo=info, compress_level=1)
    return out.getvalue(), scale


def decode(data: bytes | str | Path, scale: float | None = None) -> np.ndarray:
    """``q·S`` ``(H, W)`` float64 from a PNG written by ``encode`` (bytes or a path), with ``scale``
    or else the one in its text chunk (``ValueError`` when it has none)."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    with Image.open(source) as im:
        if scale is None:
            text = im.info.get(SCALE_KEY)
            if text is None:
                raise ValueError(f"the PNG has no {SCALE_KEY} text chunk: give its scale")
            scale = float(text)
        q = np.asarray(im, dtype=np.float64)
    return q * scale


def write(path: str | Path, values: np.ndarray) -> float:
    """Write ``encode(values)`` to ``path``; its scale."""
    data, scale = encode(values)
    Path(path).write_bytes(data)
    return scale
