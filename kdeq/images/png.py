"""PNG files written by numpy and zlib: the service's responses and the CLI's outputs.

A PNG is the signature, an ``IHDR`` chunk (size, bit depth, colour type), the ``IDAT`` chunk holding
the zlib stream of the filtered rows, and ``IEND``; each chunk is its length, type, data and the
CRC-32 of type and data (ISO/IEC 15948, §§ 5, 9, 11). Each row is written with the *Average* filter
(type 3): every byte less the floor of the mean of the byte one pixel to its left and the byte
above it, modulo 256 (either is 0 past the image's first column or row),

    Average(x) = Raw(x) − ⌊(Raw(x − bpp) + Prior(x)) / 2⌋,    bpp = bytes per pixel,

a few vectorised byte operations over the whole image. Pillow, at the same zlib level, tries every
filter on every row: on the default denoiser's outputs it took 2× the time (colour 256²: 4.5 against
2.3 ms) for files 1–3 % smaller (``bench/speed.py --sections png``, docs/BENCHMARKS.md). In a session
script the *Sub* filter alone was as fast at 6–12 % larger, and *Paeth* matched Pillow's sizes at
0.7× its time.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: zlib's fastest level that compresses: responses and outputs are encoded once, per request
COMPRESS_LEVEL = 1
#: PNG colour type by channels: grey, grey + alpha, RGB, RGBA
_COLOUR_TYPE = {1: 0, 2: 4, 3: 2, 4: 6}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode(pixels: np.ndarray, level: int = COMPRESS_LEVEL) -> bytes:
    """The PNG of ``pixels`` ``(H, W)`` or ``(H, W, c)``, ``c`` 1 (grey), 2 (grey + alpha), 3 (RGB)
    or 4 (RGBA), of dtype uint8 (8 bits a sample) or uint16 (16), rows Average-filtered, zlib at
    ``level``."""
    if pixels.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"PNG samples are uint8 or uint16, got {pixels.dtype}")
    planes = pixels[..., None] if pixels.ndim == 2 else pixels
    if planes.ndim != 3 or planes.shape[-1] not in _COLOUR_TYPE or 0 in planes.shape:
        raise ValueError(f"cannot write pixels of shape {tuple(pixels.shape)} as a PNG")
    height, width, channels = planes.shape
    # samples are big-endian (§ 7.1); the filter works on bytes whatever their bit depth
    raw = np.ascontiguousarray(planes, dtype=planes.dtype.newbyteorder(">")).view(np.uint8)
    raw = raw.reshape(height, -1)
    bpp = channels * planes.dtype.itemsize
    rows = np.zeros((height, raw.shape[1] + 1), dtype=np.uint8)
    rows[:, 0] = 3
    # the predictor ⌊(a + b)/2⌋ in bytes, without overflow: (a & b) + ((a ^ b) >> 1); a = 0 in the
    # first pixel's bytes and b = 0 in the first row, where the mean is the other's half
    pred = rows[:, 1:]
    left, up = raw[:, :-bpp], raw[:-1]
    np.bitwise_and(left[1:], up[:, bpp:], out=pred[1:, bpp:])
    half = np.bitwise_xor(left[1:], up[:, bpp:])
    np.add(pred[1:, bpp:], np.right_shift(half, 1, out=half), out=pred[1:, bpp:])
    np.right_shift(left[:1], 1, out=pred[:1, bpp:])
    np.right_shift(up[:, :bpp], 1, out=pred[1:, :bpp])
    np.subtract(raw, pred, out=pred)
    header = struct.pack(
        ">IIBBBBB", width, height, 8 * planes.dtype.itemsize, _COLOUR_TYPE[channels], 0, 0, 0
    )
    return (
        SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.data, level))
        + _chunk(b"IEND", b"")
    )
