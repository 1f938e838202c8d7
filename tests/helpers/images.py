"""Test images: encoding arrays as base64 PNG/JPEG, a white square on black, and hand-built hostile files."""

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encode_png(image: np.ndarray, fmt: str = "PNG") -> bytes:
    """``image`` (HxW, HxWx3 or HxWx4 uint8) as the bytes of a ``fmt`` file."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt)
    return buffer.getvalue()


def encode_b64(image: np.ndarray, fmt: str = "PNG") -> str:
    """``image`` (HxW or HxWx3 uint8) as base64 of a ``fmt`` file."""
    return base64.b64encode(encode_png(image, fmt)).decode()


def square(size: int = 64) -> np.ndarray:
    """A white square covering the middle half of a black RGB image."""
    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    return image


def decode_png(data: bytes) -> np.ndarray:
    """PNG (or JPEG) bytes as an RGB uint8 array [H, W, 3]."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def png_chunk(kind: bytes, data: bytes = b"") -> bytes:
    """One PNG chunk: length, type, data and its CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def grey_png(width: int, height: int, *, idat: bytes | None = None, before_idat: bytes = b"",
             after_idat: bytes = b"") -> bytes:
    """A hand-built 8-bit greyscale PNG; its IDAT holds black rows unless ``idat`` (raw chunk data) is given, so a
    tiny file can declare any size. ``before_idat`` / ``after_idat`` are extra chunks."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    if idat is None:
        idat = zlib.compress(b"\0" * (height * (width + 1)))
    return (b"\x89PNG\r\n\x1a\n" + header + before_idat + png_chunk(b"IDAT", idat) + after_idat
            + png_chunk(b"IEND"))


def progressive_jpeg(size: int = 64, *, scans: int | None = None) -> bytes:
    """A black progressive JPEG; with ``scans``, its last scan repeated until it has that many (a scan bomb:
    libjpeg makes a pass over the image per scan)."""
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(buffer, format="JPEG", progressive=True)
    data = buffer.getvalue()
    if scans is None:
        return data
    last = data.rindex(b"\xff\xda")
    body, end = data[:-2], data[-2:]  # EOI
    return body + data[last:-2] * (scans - data.count(b"\xff\xda")) + end


def shape_image(kind: str, size: int = 64) -> np.ndarray:
    """A white shape on black (``square``: off-centre; else a disk): an edge- or mask-like conditioning image."""
    image = np.zeros((size, size, 3), np.uint8)
    if kind == "square":
        image[16:48, 12:40] = 255
    else:
        yy, xx = np.mgrid[:size, :size]
        image[(yy - 30) ** 2 + (xx - 36) ** 2 < 15**2] = 255
    return image
