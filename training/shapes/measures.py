"""Explainable measures of a shapes-world image: colour, silhouette, shape class, style, background.

Every measure starts from one rule: the background is the median colour of the image border, and a pixel is
foreground ("ink") when its RGB distance to the background exceeds a threshold. ``describe`` measures every
attribute a caption names; ``ShapeClassifier`` is a small random forest on silhouette features.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import cv2
import numpy as np
from sklearn.ensemble import RandomForestClassifier

from training.shapes.world import BACKGROUNDS, PALETTE, Description, ShapeSample, ShapesWorld

INK_THRESHOLD = 60.0  # RGB distance from the background colour
MIN_SATURATION = 64  # of 255: less saturated ink pixels are grey and vote for no colour
DARK_THRESHOLD = 0.5  # darkness above this: a dark background
OUTLINE_THRESHOLD = 0.15  # outline_score above this: an outlined shape
_BORDER = 2
_CROP = 12

Background = str | Sequence[int] | np.ndarray | None


def _rgb_hsv(rgb: np.ndarray) -> np.ndarray:
    """[N, 3] uint8 RGB -> [N, 3] OpenCV HSV (hue 0..179)."""
    return cv2.cvtColor(rgb.reshape(-1, 1, 3).astype(np.uint8), cv2.COLOR_RGB2HSV).reshape(-1, 3)


_PALETTE_NAMES = tuple(PALETTE)
_PALETTE_HUES = _rgb_hsv(np.array(list(PALETTE.values()), np.uint8))[:, 0].astype(np.int32)


def _border(image: np.ndarray) -> np.ndarray:
    """The pixels of the ``_BORDER``-wide frame, [N, 3]."""
    h, w = image.shape[:2]
    frame = np.zeros((h, w), bool)
    frame[:_BORDER], frame[-_BORDER:], frame[:, :_BORDER], frame[:, -_BORDER:] = True, True, True, True
    return image[frame]


def background_colour(image: np.ndarray, background: Background = None) -> np.ndarray:
    """The background RGB (float [3]): a named background, an RGB triple, or (None) the border's median."""
    if background is None:
        return np.median(_border(image), axis=0).astype(np.float64)
    if isinstance(background, str):
        return np.array(BACKGROUNDS[background], np.float64)
    return np.asarray(background, np.float64).reshape(3)


def ink(image: np.ndarray, background: Background = None, threshold: float = INK_THRESHOLD) -> np.ndarray:
    """Foreground pixels (bool [H, W]): RGB distance to the background above ``threshold``."""
    distance = np.linalg.norm(image.astype(np.float64) - background_colour(image, background), axis=-1)
    return distance > threshold


def shape_mask(
    image: np.ndarray, background: Background = None, threshold: float = INK_THRESHOLD, *, fill: bool = True
) -> np.ndarray:
    """The shape's silhouette (bool [H, W]): the largest 8-connected ink component, holes filled if ``fill``."""
    fg = ink(image, background, threshold).astype(np.uint8)
    count, labels, stats, _ = cv2.connectedComponentsWithStats(fg, connectivity=8)
    if count <= 1:
        return np.zeros(fg.shape, bool)
    largest = (labels == 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))).astype(np.uint8)
    if fill:
        contours, _ = cv2.findContours(largest, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
        cv2.drawContours(largest, contours, -1, 1, thickness=-1)
    return largest.astype(bool)


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two boolean masks (1.0 when both are empty)."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def colour_votes(image: np.ndarray, background: Background = None) -> dict[str, float]:
    """Share of ink pixels whose hue is nearest each palette colour (grey ink pixels vote for none)."""
    pixels = image[ink(image, background)]
    votes = dict.fromkeys(_PALETTE_NAMES, 0.0)
    if len(pixels) == 0:
        return votes
    hsv = _rgb_hsv(pixels).astype(np.int32)
    saturated = hsv[hsv[:, 1] >= MIN_SATURATION]
    gap = np.abs(saturated[:, :1] - _PALETTE_HUES[None, :])
    nearest = np.argmin(np.minimum(gap, 180 - gap), axis=1)
    counts = np.bincount(nearest, minlength=len(_PALETTE_NAMES))
    return {name: float(c) / len(pixels) for name, c in zip(_PALETTE_NAMES, counts, strict=True)}


def dominant_colour(image: np.ndarray, background: Background = None) -> str | None:
    """The palette colour with most votes; None when no ink pixel is coloured."""
    votes = colour_votes(image, background)
    best = max(votes, key=votes.__getitem__)
    return best if votes[best] > 0 else None


def clarity(image: np.ndarray, background: Background = None, threshold: float = INK_THRESHOLD) -> float:
    """Fraction of pixels within ``threshold`` of the background or of the ink's median colour: 1 for a
    clean two-colour image, low for noise. A confidence gate for the other measures."""
    pixels = image.reshape(-1, 3).astype(np.float64)
    fg = ink(image, background, threshold).ravel()
    if not fg.any():
        return 1.0
    ink_colour = np.median(pixels[fg], axis=0)
    return float(np.mean(~fg | (np.linalg.norm(pixels - ink_colour, axis=-1) <= threshold)))


def outline_score(image: np.ndarray, background: Background = None) -> float:
    """Fraction of the silhouette not painted: 0 for filled shapes, toward 1 for thin outlines."""
    silhouette = shape_mask(image, background)
    area = silhouette.sum()
    if area == 0:
        return 0.0
    return float(1.0 - np.logical_and(ink(image, background), silhouette).sum() / area)


def darkness(image: np.ndarray) -> float:
    """1 - the border's luma (Rec. 601) in [0, 1]: 0 for white, high for dark backgrounds. The median over
    the border pixels, so a shape touching the edge does not move it."""
    luma = _border(image).astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    return float(1.0 - np.median(luma) / 255.0)


def mask_features(mask: np.ndarray) -> np.ndarray:
    """Position- and scale-free silhouette features: extent, solidity, circularity, aspect, corner count,
    log Hu moments and the bounding-box crop resized to 12x12 (zeros for an empty mask)."""
    features = np.zeros(5 + 7 + _CROP * _CROP, np.float32)
    m = mask.astype(np.uint8)
    contours, _ = cv2.findContours(m, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    if not contours:
        return features
    contour = max(contours, key=cv2.contourArea)
    x, y, w, h = cv2.boundingRect(contour)
    area = float(m.sum())
    perimeter = max(cv2.arcLength(contour, True), 1.0)
    hull = max(cv2.contourArea(cv2.convexHull(contour)), 1.0)
    corners = len(cv2.approxPolyDP(contour, 0.04 * perimeter, True))
    hu = cv2.HuMoments(cv2.moments(m, binaryImage=True)).ravel()
    log_hu = -np.sign(hu) * np.log10(np.abs(hu) + 1e-30)
    crop = cv2.resize(m[y : y + h, x : x + w].astype(np.float32), (_CROP, _CROP), interpolation=cv2.INTER_AREA)
    shape_stats = [area / (w * h), area / hull, 4 * np.pi * area / perimeter**2, w / h, min(corners, 12)]
    features[:5] = shape_stats
    features[5:12] = np.clip(log_hu, -30, 30)
    features[12:] = crop.ravel()
    return features


class ShapeClassifier:
    """Shape name from an image: a random forest on ``mask_features(shape_mask(image))``."""

    def __init__(self, n_estimators: int = 100, seed: int = 0) -> None:
        self.model = RandomForestClassifier(n_estimators=n_estimators, min_samples_leaf=2, random_state=seed, n_jobs=1)

    @staticmethod
    def features(images: Iterable[np.ndarray]) -> np.ndarray:
        return np.stack([mask_features(shape_mask(image)) for image in images])

    def fit(self, samples: Sequence[ShapeSample]) -> ShapeClassifier:
        self.model.fit(self.features(s.image for s in samples), [s.attributes.shape for s in samples])
        return self

    @classmethod
    def trained(cls, n: int = 2000, seed: int = 0, world: ShapesWorld | None = None) -> ShapeClassifier:
        """Fitted on ``n`` samples of ``world`` (default: every attribute) drawn from ``seed``."""
        return cls(seed=seed).fit((world or ShapesWorld()).generate(n, seed))

    @property
    def classes(self) -> list[str]:
        return [str(c) for c in self.model.classes_]

    def predict_proba(self, images: Iterable[np.ndarray]) -> np.ndarray:
        """[N, len(classes)] class probabilities (the forest's vote shares)."""
        return self.model.predict_proba(self.features(images))

    def predict(self, images: Iterable[np.ndarray]) -> list[str]:
        return [self.classes[i] for i in np.argmax(self.predict_proba(images), axis=1)]

    def accuracy(self, samples: Sequence[ShapeSample]) -> float:
        predicted = self.predict(s.image for s in samples)
        return float(np.mean([p == s.attributes.shape for p, s in zip(predicted, samples, strict=True)]))


def describe(image: np.ndarray, classifier: ShapeClassifier) -> dict[str, str | None]:
    """Every attribute a caption names, as measured: shape, colour, background and style."""
    return {
        "shape": classifier.predict([image])[0],
        "colour": dominant_colour(image),
        "background": "dark" if darkness(image) > DARK_THRESHOLD else "white",
        "style": "outlined" if outline_score(image) > OUTLINE_THRESHOLD else "filled",
    }


def matches(image: np.ndarray, description: Description, classifier: ShapeClassifier) -> dict[str, bool]:
    """Per attribute, whether the measured value equals the described one (e.g. from ``parse_caption``)."""
    measured = describe(image, classifier)
    return {name: measured[name] == getattr(description, name) for name in measured}
