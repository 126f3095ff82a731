"""``kdeq.images.png``: the files Pillow reads back bit for bit, and the Average filter undone
independently."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from kdeq.images import png

# channels → the mode Pillow reads (16-bit grey is read as I;16)
MODES = {(1, np.uint8): "L", (2, np.uint8): "LA", (3, np.uint8): "RGB", (4, np.uint8): "RGBA"}


def _pixels(shape: tuple[int, ...], dtype: type, seed: int) -> np.ndarray:
    """Random samples over the whole range, with both extremes present (one where there is one sample)."""
    top = np.iinfo(dtype).max
    out = np.random.default_rng(seed).integers(0, top + 1, size=shape).astype(dtype)
    flat = out.reshape(-1)
    flat[0], flat[-1] = 0, top
    return out


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """``(type, data)`` of each chunk, checking each length and CRC-32."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body)
        out.append((kind, body))
        at += 12 + length
    return out


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (33, 18)])
def test_pillow_reads_eight_bit_files_back_exactly(channels: int, shape: tuple[int, int]) -> None:
    pixels = _pixels((*shape, channels) if channels > 1 else shape, np.uint8, seed=channels)
    im = Image.open(io.BytesIO(png.encode(pixels)))
    assert im.mode == MODES[(channels, np.uint8)]
    np.testing.assert_array_equal(np.asarray(im), pixels)


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (33, 18)])
def test_pillow_reads_sixteen_bit_grey_back_exactly(shape: tuple[int, int]) -> None:
    pixels = _pixels(shape, np.uint16, seed=3)
    im = Image.open(io.BytesIO(png.encode(pixels)))
    assert im.mode == "I;16"
    np.testing.assert_array_equal(np.asarray(im), pixels)


@pytest.mark.parametrize(("channels", "dtype"), [(3, np.uint8), (2, np.uint16)])
def test_each_row_is_average_filtered_and_the_standards_decoding_undoes_it(
    channels: int, dtype: type
) -> None:
    """Raw(x) = Average(x) + ⌊(Raw(x − bpp) + Prior(x))/2⌋ mod 256 (§ 9.2), undone byte by byte as a
    decoder does, in integers."""
    pixels = _pixels((6, 9, channels), dtype, seed=4)
    chunks = dict(_chunks(png.encode(pixels)))
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (width, height, depth, colour) == (9, 6, 8 * np.dtype(dtype).itemsize, {2: 4, 3: 2}[channels])
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(6, -1)
    assert (rows[:, 0] == 3).all()
    bpp = channels * np.dtype(dtype).itemsize
    raw = [[0] * (rows.shape[1] - 1) for _ in range(6)]
    for i in range(6):
        for j in range(rows.shape[1] - 1):
            left = raw[i][j - bpp] if j >= bpp else 0
            above = raw[i - 1][j] if i > 0 else 0
            raw[i][j] = (int(rows[i, j + 1]) + (left + above) // 2) % 256
    expected = pixels.astype(np.dtype(dtype).newbyteorder(">")).view(np.uint8).reshape(6, -1)
    np.testing.assert_array_equal(np.array(raw, dtype=np.uint8), expected)


@pytest.mark.parametrize(
    "pixels",
    [np.zeros((4, 4), np.float32), np.zeros((4, 4, 5), np.uint8), np.zeros((0, 4), np.uint8)],
    ids=["float", "five-channels", "empty"],
)
def test_what_a_png_cannot_hold_is_refused(pixels: np.ndarray) -> None:
    with pytest.raises(ValueError, match="PNG"):
        png.encode(pixels)
