"""The "shapes" world: small seeded images of one coloured geometric shape, their captions and maps.

Each sample is one shape in a named colour, filled or outlined, on a white or dark background, with its silhouette
``mask`` and the canny ``edges`` the serving path would compute; captions follow one grammar (``caption`` /
``parse_caption``: "an outlined blue square on a dark background"). Sample ``i`` of stream ``seed`` has its own
generator ``(seed, i)``: reproducible, order-independent, randomly accessible. numpy + OpenCV only (no torch).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import cv2
import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
#: Named palette (RGB). Hues are well apart, and every colour contrasts with both backgrounds.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 20),
    "yellow": (240, 220, 30),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "purple": (150, 60, 200),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (255, 255, 255), "dark": (20, 20, 20)}
STYLES: tuple[str, ...] = ("filled", "outlined")

#: Canny thresholds of ``serving.controlnet.conditioning.preprocess`` (kept equal; a unit test checks).
CANNY_THRESHOLDS: tuple[int, int] = (100, 200)
ControlKind = Literal["canny", "mask"]
CONTROL_KINDS: tuple[str, ...] = ("canny", "mask")


@dataclass(frozen=True, kw_only=True)
class Description:
    """What a caption says about a sample."""

    shape: str
    colour: str
    background: str = "white"
    style: str = "filled"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("colour", self.colour, COLOURS),
            ("background", self.background, tuple(BACKGROUNDS)),
            ("style", self.style, STYLES),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


@dataclass(frozen=True, kw_only=True)
class ShapeAttributes(Description):
    """A full sample description: the caption's attributes plus geometry (pixels, (x, y) centre)."""

    centre: tuple[int, int]
    size: int  # half of the shape's bounding-box side

    @property
    def description(self) -> Description:
        return Description(shape=self.shape, colour=self.colour, background=self.background, style=self.style)


def caption(description: Description) -> str:
    """The caption of a description (geometry is not captioned)."""
    words = ["outlined"] if description.style == "outlined" else []
    words += [description.colour, description.shape, "on", "a", description.background, "background"]
    return _with_article(words)


def short_caption(description: Description) -> str:
    """Colour and shape only ("a red circle"): the prompt a style LoRA is trained on and applied to."""
    return _with_article([description.colour, description.shape])


def _with_article(words: list[str]) -> str:
    article = "an" if words[0][0] in "aeiou" else "a"
    return " ".join([article, *words])


_CAPTION = re.compile(
    rf"^an? (?:(?P<style>outlined|filled) )?(?P<colour>{'|'.join(COLOURS)}) (?P<shape>{'|'.join(SHAPES)})"
    rf"(?: on an? (?P<background>{'|'.join(BACKGROUNDS)}) background)?$"
)


def parse_caption(text: str) -> Description:
    """Inverse of ``caption`` and ``short_caption`` (a short caption means white background, filled);
    case and surrounding whitespace ignored; ``ValueError`` off the grammar."""
    match = _CAPTION.match(" ".join(text.lower().split()).rstrip("."))
    if match is None:
        raise ValueError(f"not a shapes caption: {text!r}")
    return Description(
        shape=match["shape"],
        colour=match["colour"],
        background=match["background"] or "white",
        style=match["style"] or "filled",
    )


@dataclass(frozen=True)
class ShapeSample:
    """One image with its attributes; ``mask`` is the silhouette (bool), ``edges`` canny of the image (0/255)."""

    attributes: ShapeAttributes
    image: np.ndarray  # [H, W, 3] uint8 RGB
    mask: np.ndarray  # [H, W] bool
    edges: np.ndarray  # [H, W] uint8, 255 on edges

    @property
    def caption(self) -> str:
        return caption(self.attributes)

    def control(self, kind: ControlKind) -> np.ndarray:
        """The ``canny`` or ``mask`` map as a ControlNet conditioning image: [H, W, 3] uint8, white on black."""
        if kind == "canny":
            plane = self.edges
        elif kind == "mask":
            plane = self.mask.astype(np.uint8) * 255
        else:
            raise ValueError(f"unknown control kind {kind!r}; expected one of {', '.join(CONTROL_KINDS)}")
        return np.repeat(plane[:, :, None], 3, axis=2)


def _polygon(shape: str, cx: int, cy: int, s: int) -> np.ndarray:
    """Vertices (int32 [N, 2], x/y) of a polygonal shape of half-extent ``s``."""
    if shape == "square":
        points = [(-s, -s), (s, -s), (s, s), (-s, s)]
    elif shape == "triangle":
        points = [(0, -s), (s, s), (-s, s)]
    elif shape == "star":
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, s, 0.45 * s)
        points = list(zip(radii * np.cos(angles), radii * np.sin(angles), strict=True))
    elif shape == "cross":
        a = s / 3
        points = [(-a, -s), (a, -s), (a, -a), (s, -a), (s, a), (a, a), (a, s), (-a, s), (-a, a), (-s, a), (-s, -a),
                  (-a, -a)]  # fmt: skip
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return np.round(np.asarray(points, np.float64) + np.array([cx, cy])).astype(np.int32)


def draw_mask(shape: str, centre: tuple[int, int], size: int, image_size: int) -> np.ndarray:
    """The silhouette of a shape as a bool [image_size, image_size] array (no anti-aliasing)."""
    canvas = np.zeros((image_size, image_size), np.uint8)
    if shape == "circle":
        cv2.circle(canvas, centre, size, 1, thickness=-1, lineType=cv2.LINE_8)
    else:
        cv2.fillPoly(canvas, [_polygon(shape, *centre, size)], 1, lineType=cv2.LINE_8)
    return canvas.astype(bool)


def outline_of(mask: np.ndarray, thickness: int) -> np.ndarray:
    """The band of ``mask`` within ``thickness`` pixels of its boundary (drawn inside the silhouette)."""
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * thickness + 1, 2 * thickness + 1))
    inner = cv2.erode(mask.astype(np.uint8), kernel, borderType=cv2.BORDER_CONSTANT, borderValue=0)
    return mask & ~inner.astype(bool)


@dataclass(frozen=True)
class ShapesWorld:
    """Which attributes to draw from (uniformly) and how images look; restrict fields for subsets."""

    image_size: int = 64
    shapes: tuple[str, ...] = SHAPES
    colours: tuple[str, ...] = COLOURS
    backgrounds: tuple[str, ...] = tuple(BACKGROUNDS)
    styles: tuple[str, ...] = STYLES
    size_range: tuple[float, float] = (0.2, 0.4)  # half-extent as a fraction of the image side
    noise_std: float = 0.0  # Gaussian pixel noise added to images (0: clean)
    outline_thickness: int = 0  # 0: max(2, image_size // 32)

    def __post_init__(self) -> None:
        for values, allowed in (
            (self.shapes, SHAPES),
            (self.colours, COLOURS),
            (self.backgrounds, tuple(BACKGROUNDS)),
            (self.styles, STYLES),
        ):
            if not values or any(value not in allowed for value in values):
                raise ValueError(f"attributes {values!r} must be a non-empty subset of {allowed}")
        low, high = self.size_range
        if not 0 < low <= high <= 0.45 or self.image_size < 16:
            raise ValueError("need image_size >= 16 and 0 < size_range[0] <= size_range[1] <= 0.45")

    @property
    def thickness(self) -> int:
        return self.outline_thickness or max(2, self.image_size // 32)

    def sample_attributes(self, rng: np.random.Generator) -> ShapeAttributes:
        """Uniform over the allowed attributes, size in ``size_range``, centre so the shape fits (1 px margin)."""
        side = self.image_size
        low, high = self.size_range
        size = int(rng.integers(max(3, round(low * side)), round(high * side) + 1))
        cx, cy = (int(v) for v in rng.integers(size + 1, side - size - 2, size=2, endpoint=True))
        return ShapeAttributes(
            shape=self.shapes[rng.integers(len(self.shapes))],
            colour=self.colours[rng.integers(len(self.colours))],
            background=self.backgrounds[rng.integers(len(self.backgrounds))],
            style=self.styles[rng.integers(len(self.styles))],
            centre=(cx, cy),
            size=size,
        )

    def render(self, attributes: ShapeAttributes, rng: np.random.Generator | None = None) -> ShapeSample:
        """Draw a sample; ``rng`` is needed only when ``noise_std`` > 0."""
        side = self.image_size
        mask = draw_mask(attributes.shape, attributes.centre, attributes.size, side)
        ink = mask if attributes.style == "filled" else outline_of(mask, self.thickness)
        image = np.empty((side, side, 3), np.uint8)
        image[:] = BACKGROUNDS[attributes.background]
        image[ink] = PALETTE[attributes.colour]
        if self.noise_std > 0:
            rng = rng if rng is not None else np.random.default_rng()
            noisy = image + rng.normal(0.0, self.noise_std, image.shape)
            image = np.clip(np.rint(noisy), 0, 255).astype(np.uint8)
        edges = cv2.Canny(image, *CANNY_THRESHOLDS)
        return ShapeSample(attributes=attributes, image=image, mask=mask, edges=edges)

    def sample(self, seed: int, index: int) -> ShapeSample:
        """Sample ``index`` of the stream ``seed`` (its own generator: order-independent)."""
        rng = np.random.default_rng((seed, index))
        return self.render(self.sample_attributes(rng), rng)

    def generate(self, n: int, seed: int = 0) -> list[ShapeSample]:
        """Samples 0..n-1 of stream ``seed``."""
        return [self.sample(seed, i) for i in range(n)]


class ShapesDataset(Sequence[ShapeSample]):
    """``n`` samples of a world and seed, drawn on access (``len`` + indexing, as a torch Dataset wants)."""

    def __init__(self, world: ShapesWorld, n: int, seed: int = 0) -> None:
        self.world, self.n, self.seed = world, n, seed

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, index: int) -> ShapeSample: ...
    @overload
    def __getitem__(self, index: slice) -> list[ShapeSample]: ...
    def __getitem__(self, index: int | slice) -> ShapeSample | list[ShapeSample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.n))]
        if not -self.n <= index < self.n:
            raise IndexError(index)
        return self.world.sample(self.seed, index % self.n)

    def __iter__(self) -> Iterator[ShapeSample]:
        return (self.world.sample(self.seed, i) for i in range(self.n))


#: Subsets used by training: the base model sees filled shapes on white; each LoRA style one change.
BASE_WORLD = ShapesWorld(backgrounds=("white",), styles=("filled",))
OUTLINED_WORLD = ShapesWorld(backgrounds=("white",), styles=("outlined",))
DARK_WORLD = ShapesWorld(backgrounds=("dark",), styles=("filled",))
#: The style LoRAs of the trained ``tiny`` preset: name -> the world its training images come from.
STYLE_WORLDS: dict[str, ShapesWorld] = {"outlined": OUTLINED_WORLD, "dark": DARK_WORLD}


def generate(n: int, seed: int = 0, world: ShapesWorld | None = None, **restrict: object) -> list[ShapeSample]:
    """``n`` samples; ``restrict`` overrides ``ShapesWorld`` fields, e.g. ``styles=("filled",)``."""
    base = world or ShapesWorld()
    if restrict:
        base = dataclasses.replace(base, **restrict)  # type: ignore[arg-type]
    return base.generate(n, seed)
