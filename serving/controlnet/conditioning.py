"""Conditioning images: decoded and preprocessed once per request, then prepared as diffusers does.

The HTTP layer decodes the base64 PNG/JPEG (``serving.images``: bounded in bytes and pixels) and applies the
optional ``canny`` edge detector (OpenCV); the engine turns the RGB array into the ControlNet input with
diffusers' own ``VaeImageProcessor`` (resized to the output size, values in [0, 1]), exactly as
``StableDiffusionControlNetPipeline.prepare_image`` does. An image of another size is resized.
"""

from __future__ import annotations

import base64
import io
from typing import Literal

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from serving.images import MAX_JPEG_SCANS, MAX_SEGMENTS, decode_image
from serving.images import ImageDecodeError as ConditioningImageError

__all__ = ["MAX_JPEG_SCANS", "MAX_SEGMENTS", "ConditioningImageError", "Preprocess", "decode_image", "encode_image",
           "preprocess", "to_controlnet_input"]

Preprocess = Literal["canny"]


def encode_image(image: np.ndarray) -> str:
    """An RGB uint8 array [H, W, 3] as base64 PNG: what a request's ``image`` field takes (``decode_image``)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


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
