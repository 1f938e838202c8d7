"""Test images: encoding arrays as base64 PNG/JPEG, and a white square on black."""

import base64
import io

import numpy as np
from PIL import Image


def encode_b64(image: np.ndarray, fmt: str = "PNG") -> str:
    """``image`` (HxW or HxWx3 uint8) as base64 of a ``fmt`` file."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def square(size: int = 64) -> np.ndarray:
    """A white square covering the middle half of a black RGB image."""
    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    return image


def decode_png(data: bytes) -> np.ndarray:
    """PNG (or JPEG) bytes as an RGB uint8 array [H, W, 3]."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
