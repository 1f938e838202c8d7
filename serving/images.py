"""Decoding client images safely: PNG or JPEG files (raw bytes, or base64 as JSON fields carry them) as arrays.

A file's size is checked from its own header before PIL sees it, as are the counts of its chunks or scans: nothing
over the limits is decoded. Used for ControlNet conditioning images and for the image and mask of an edit.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings

import numpy as np
from PIL import Image

from serving.config import DEFAULT_MAX_SIDE

_FORMATS = ("PNG", "JPEG")
#: PNG chunks (or JPEG segments and fill bytes before the first scan) a file may have: PIL reads each one in
#: Python, so a flood of empty ones costs seconds per request; real files have tens.
MAX_SEGMENTS = 10_000
#: JPEG scans a file may have: libjpeg makes a pass over the whole image per scan, so thousands of tiny scans take
#: minutes to decode; real progressive files have about ten.
MAX_JPEG_SCANS = 100
#: Mask luminance at or above this is white (repaint), below it black (keep): diffusers binarizes masks at 0.5.
MASK_THRESHOLD = 128
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHUNK = struct.Struct(">I4s")  # length, type; then the data and a 4-byte CRC
_PNG_SIZE = struct.Struct(">II")  # IHDR: width, height
_JPEG_SOI = b"\xff\xd8"
_JPEG_SOS = b"\xff\xda"
_JPEG_MARKER = re.compile(rb"\xff+(.)", re.DOTALL)  # fill bytes, then the marker
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn: no length
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (DHT, JPG, DAC are not)
_JPEG_SIZE = struct.Struct(">HBHH")  # segment length, precision, height, width


class ImageDecodeError(ValueError):
    """The image cannot be used; the message says why."""


def decode_image(data: str, *, max_bytes: int, max_pixels: int, max_side: int = DEFAULT_MAX_SIDE) -> np.ndarray:
    """A base64 PNG or JPEG (optionally a ``data:`` URL) as an RGB uint8 array [H, W, 3]."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) > 4 * (max_bytes // 3 + 1):
        raise ImageDecodeError(f"image larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageDecodeError("image is not valid base64") from None
    return decode_image_bytes(raw, max_bytes=max_bytes, max_pixels=max_pixels, max_side=max_side)


def decode_image_bytes(raw: bytes, *, max_bytes: int, max_pixels: int,
                       max_side: int = DEFAULT_MAX_SIDE) -> np.ndarray:
    """A PNG or JPEG file as an RGB uint8 array [H, W, 3]."""
    return np.asarray(_open(raw, max_bytes, max_pixels, max_side).convert("RGB"))


def decode_mask(raw: bytes, *, max_bytes: int, max_pixels: int, max_side: int = DEFAULT_MAX_SIDE) -> np.ndarray:
    """A PNG or JPEG edit mask as uint8 [H, W], 255 where to repaint and 0 where to keep: with an alpha channel (or
    PNG transparency), its fully transparent pixels are repainted (OpenAI); without, its white pixels (diffusers:
    luminance at or above ``MASK_THRESHOLD``)."""
    image = _open(raw, max_bytes, max_pixels, max_side)
    if "A" in image.getbands() or "transparency" in image.info:
        repaint = np.asarray(image.convert("RGBA"))[..., 3] == 0
    else:
        repaint = np.asarray(image.convert("L")) >= MASK_THRESHOLD
    return np.where(repaint, 255, 0).astype(np.uint8)


def _open(raw: bytes, max_bytes: int, max_pixels: int, max_side: int) -> Image.Image:
    """The file's image, loaded, once its header passed the limits."""
    if len(raw) > max_bytes:
        raise ImageDecodeError(f"image larger than {max_bytes} bytes")
    image_format, width, height = _read_header(raw)
    _check_size(width, height, max_pixels, max_side)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=[image_format])
            if image.format not in _FORMATS:
                raise ImageDecodeError(f"image format {image.format} not accepted; send PNG or JPEG")
            _check_size(image.width, image.height, max_pixels, max_side)
            image.load()
            return image
    except ImageDecodeError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageDecodeError(f"image could not be decoded as {image_format} (corrupt or truncated)") from None


def _check_size(width: int, height: int, max_pixels: int, max_side: int) -> None:
    if width * height == 0:
        raise ImageDecodeError(f"image is {width}x{height}: it has no pixels")
    if width * height > max_pixels:
        raise ImageDecodeError(f"image has more than {max_pixels} pixels")
    if max(width, height) > max_side:
        raise ImageDecodeError(f"image is {width}x{height}; its sides may be at most {max_side} pixels")


def _read_header(raw: bytes) -> tuple[str, int, int]:
    """The image's format and declared width and height, from its PNG chunks or JPEG segments."""
    if raw.startswith(_PNG_SIGNATURE):
        return "PNG", *_png_size(raw)
    if raw.startswith(_JPEG_SOI + b"\xff"):
        return "JPEG", *_jpeg_size(raw)
    raise ImageDecodeError("image format not accepted: not a PNG or JPEG file; send PNG or JPEG")


def _png_size(raw: bytes) -> tuple[int, int]:
    """IHDR's width and height, once the chunks up to IEND are counted."""
    pos = len(_PNG_SIGNATURE)
    if raw[pos + 4:pos + 8] != b"IHDR" or len(raw) < pos + _PNG_CHUNK.size + _PNG_SIZE.size:
        raise ImageDecodeError("PNG does not start with its IHDR header chunk")
    width, height = _PNG_SIZE.unpack_from(raw, pos + _PNG_CHUNK.size)
    chunks = 0
    while pos + _PNG_CHUNK.size <= len(raw):
        chunks += 1
        if chunks > MAX_SEGMENTS:
            raise ImageDecodeError(f"PNG has more than {MAX_SEGMENTS} chunks")
        length, kind = _PNG_CHUNK.unpack_from(raw, pos)
        if kind == b"IEND":
            break
        pos += _PNG_CHUNK.size + length + 4
    return width, height


def _jpeg_size(raw: bytes) -> tuple[int, int]:
    """The frame header's width and height, walking the segments up to the first scan."""
    pos, steps, size = len(_JPEG_SOI), 0, None
    while True:
        marker = _JPEG_MARKER.match(raw, pos)
        if marker is None:
            raise ImageDecodeError("JPEG is truncated or has stray bytes before its first scan")
        steps += marker.end() - pos - 1  # the marker and its fill bytes: PIL reads each one in Python
        if steps > MAX_SEGMENTS:
            raise ImageDecodeError(f"JPEG has more than {MAX_SEGMENTS} segments before its first scan")
        kind, pos = raw[marker.end() - 1], marker.end()
        if kind == _JPEG_SOS[1]:
            break
        if kind in _JPEG_STANDALONE:
            continue
        if kind in _JPEG_SOF:
            if size is not None:
                raise ImageDecodeError("JPEG has two frame headers")  # libjpeg refuses them too
            if len(raw) < pos + _JPEG_SIZE.size:
                raise ImageDecodeError("JPEG frame header is truncated")
            _, _, height, width = _JPEG_SIZE.unpack_from(raw, pos)
            size = width, height
        pos += int.from_bytes(raw[pos:pos + 2], "big")
    if size is None:
        raise ImageDecodeError("JPEG has no frame header before its first scan")
    if raw.count(_JPEG_SOS) > MAX_JPEG_SCANS:
        raise ImageDecodeError(f"JPEG has more than {MAX_JPEG_SCANS} scans")
    return size


def resize_image(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """An RGB uint8 array at ``width`` x ``height`` (Lanczos, as diffusers' image processor); unchanged if it is."""
    if image.shape[:2] == (height, width):
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))


def resize_mask(mask: np.ndarray, width: int, height: int) -> np.ndarray:
    """A 0/255 mask at ``width`` x ``height``, resized bilinearly and binarized again at ``MASK_THRESHOLD``."""
    if mask.shape == (height, width):
        return mask
    resized = np.asarray(Image.fromarray(mask).resize((width, height), Image.Resampling.BILINEAR))
    return np.where(resized >= MASK_THRESHOLD, 255, 0).astype(np.uint8)
