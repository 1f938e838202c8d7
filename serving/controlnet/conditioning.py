"""Conditioning images: decoded and preprocessed once per request, then prepared as diffusers does.

The HTTP layer decodes the base64 PNG/JPEG (bounded in bytes and pixels) and applies the optional
``canny`` edge detector (OpenCV); the engine turns the RGB array into the ControlNet input with
diffusers' own ``VaeImageProcessor`` (resized to the output size, values in [0, 1]), exactly as
``StableDiffusionControlNetPipeline.prepare_image`` does. An image of another size is resized.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Literal

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

Preprocess = Literal["canny"]
_FORMATS = ("PNG", "JPEG")


class ConditioningImageError(ValueError):
    """The conditioning image cannot be used; the message says why."""


def decode_image(data: str, *, max_bytes: int, max_pixels: int) -> np.ndarray:
    """A base64 PNG or JPEG (optionally a ``data:`` URL) as an RGB uint8 array [H, W, 3]."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) > 4 * (max_bytes // 3 + 1):
        raise ConditioningImageError(f"image larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ConditioningImageError("image is not valid base64") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            if image.format not in _FORMATS:
                raise ConditioningImageError(f"image format {image.format} not accepted; send PNG or JPEG")
            if image.width * image.height > max_pixels:
                raise ConditioningImageError(f"image has more than {max_pixels} pixels")
            return np.asarray(image.convert("RGB"))
    except ConditioningImageError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ConditioningImageError("image could not be decoded as PNG or JPEG") from None


def preprocess(image: np.ndarray, kind: Preprocess | None) -> np.ndarray:
    """Apply the requested detector; ``canny`` gives white edges on black, as ControlNet canny expects."""
    if kind is None:
        return image
    import cv2

    edges = cv2.Canny(image, 100, 200)
    return np.repeat(edges[:, :, None], 3, axis=2)


_PROCESSOR = VaeImageProcessor(do_convert_rgb=True, do_normalize=False)


def to_controlnet_input(image: np.ndarray, width: int, height: int) -> torch.Tensor:
    """[1, 3, height, width] float32 in [0, 1]: diffusers' ControlNet image preparation."""
    return _PROCESSOR.preprocess(Image.fromarray(image), height=height, width=width).to(torch.float32)
