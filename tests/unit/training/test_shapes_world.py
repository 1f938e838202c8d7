"""The shapes world (generator, captions, maps) and the explainable measures that judge images of it."""

import itertools

import numpy as np
import pytest

from training.shapes import (
    BACKGROUNDS,
    BASE_WORLD,
    COLOURS,
    DARK_THRESHOLD,
    DARK_WORLD,
    OUTLINE_THRESHOLD,
    OUTLINED_WORLD,
    SHAPES,
    STYLES,
    Description,
    ShapeClassifier,
    ShapesDataset,
    ShapesWorld,
    caption,
    clarity,
    colour_votes,
    darkness,
    describe,
    dominant_colour,
    generate,
    mask_iou,
    matches,
    outline_score,
    parse_caption,
    shape_mask,
)

N = 600


@pytest.fixture(scope="module")
def clean():
    return generate(N, seed=11)


@pytest.fixture(scope="module")
def noisy():
    """Mild Gaussian pixel noise (std 20): the measures must still work."""
    return ShapesWorld(noise_std=20).generate(N, seed=12)


@pytest.fixture(scope="module")
def classifier():
    return ShapeClassifier.trained(n=2000, seed=0)


@pytest.fixture(scope="module")
def noise_images():
    """Pure uniform noise, paired with the attributes of fresh samples it is judged against."""
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(300)]
    return images, generate(300, seed=13)


def _same(a, b) -> bool:
    return (
        a.attributes == b.attributes
        and np.array_equal(a.image, b.image)
        and np.array_equal(a.mask, b.mask)
        and np.array_equal(a.edges, b.edges)
    )


# --- generator --------------------------------------------------------------------------------------


def test_same_seed_same_samples_and_different_seeds_differ():
    for world in (ShapesWorld(), ShapesWorld(noise_std=10)):
        first, again, other = world.generate(50, seed=3), world.generate(50, seed=3), world.generate(50, seed=4)
        assert all(_same(a, b) for a, b in zip(first, again, strict=True))
        assert sum(np.array_equal(a.image, b.image) for a, b in zip(first, other, strict=True)) <= 1
        assert len({a.caption for a in first}) > 20


def test_dataset_is_random_access_and_order_independent():
    world = ShapesWorld()
    dataset = ShapesDataset(world, 40, seed=7)
    listed = world.generate(40, seed=7)
    assert len(dataset) == 40
    assert _same(dataset[25], listed[25]) and _same(dataset[-1], listed[39])
    assert all(_same(a, b) for a, b in zip(dataset, listed, strict=True))
    assert all(_same(a, b) for a, b in zip(dataset[10:13], listed[10:13], strict=True))
    with pytest.raises(IndexError):
        dataset[40]


def test_samples_cover_every_attribute_and_fit_in_the_image(clean):
    for name, values in (("shape", SHAPES), ("colour", COLOURS), ("background", BACKGROUNDS), ("style", STYLES)):
        assert {getattr(s.attributes, name) for s in clean} == set(values)
    for s in clean:
        assert s.image.shape == (64, 64, 3) and s.image.dtype == np.uint8
        assert s.mask.shape == (64, 64) and s.mask.dtype == bool and s.mask.any()
        assert not (s.mask[0].any() or s.mask[-1].any() or s.mask[:, 0].any() or s.mask[:, -1].any())
        assert 0.2 * 64 - 1 <= s.attributes.size <= 0.4 * 64 + 1


def test_restricted_worlds_draw_only_their_attributes():
    assert {(s.attributes.background, s.attributes.style) for s in generate(100, world=BASE_WORLD)} == {
        ("white", "filled")
    }
    assert {s.attributes.style for s in generate(100, world=OUTLINED_WORLD)} == {"outlined"}
    assert {s.attributes.background for s in generate(100, world=DARK_WORLD)} == {"dark"}
    reds = generate(50, seed=1, colours=("red",), shapes=("star", "cross"), image_size=96)
    assert {s.attributes.colour for s in reds} == {"red"} and {s.attributes.shape for s in reds} == {"star", "cross"}
    assert reds[0].image.shape == (96, 96, 3)
    with pytest.raises(ValueError, match="subset"):
        ShapesWorld(colours=("mauve",))
    with pytest.raises(ValueError, match="subset"):
        ShapesWorld(styles=())


def test_maps_match_the_drawing_and_the_controlnet_input_format(clean):
    import cv2

    from serving.controlnet.conditioning import preprocess, to_controlnet_input

    for s in clean[:100]:
        painted = np.any(s.image != s.image[0, 0], axis=-1)
        if s.attributes.style == "filled":
            assert np.array_equal(painted, s.mask)
        else:
            assert not (painted & ~s.mask).any() and painted.sum() < s.mask.sum()
        # the edge map is what the serving path computes for ``preprocess: "canny"``
        assert np.array_equal(s.control("canny"), preprocess(s.image, "canny"))
        assert np.array_equal(s.edges, cv2.Canny(s.image, 100, 200))
        mask_image = s.control("mask")
        assert mask_image.shape == (64, 64, 3) and mask_image.dtype == np.uint8
        assert set(np.unique(mask_image)) == {0, 255} and np.array_equal(mask_image[:, :, 1] == 255, s.mask)
    tensor = to_controlnet_input(clean[0].control("mask"), 64, 64)
    assert tuple(tensor.shape) == (1, 3, 64, 64) and tensor.min() == 0 and tensor.max() == 1
    with pytest.raises(ValueError, match="control kind"):
        clean[0].control("depth")


# --- captions ---------------------------------------------------------------------------------------


def test_caption_grammar():
    assert caption(Description(shape="circle", colour="red")) == "a red circle on a white background"
    outlined = Description(shape="square", colour="blue", background="dark", style="outlined")
    assert caption(outlined) == "an outlined blue square on a dark background"
    assert caption(Description(shape="star", colour="orange")) == "an orange star on a white background"


def test_captions_round_trip_for_every_attribute_combination():
    combinations = list(itertools.product(SHAPES, COLOURS, BACKGROUNDS, STYLES))
    assert len(combinations) == 5 * 6 * 2 * 2
    texts = set()
    for shape, colour, background, style in combinations:
        description = Description(shape=shape, colour=colour, background=background, style=style)
        text = caption(description)
        texts.add(text)
        assert parse_caption(text) == description
    assert len(texts) == len(combinations)


def test_sample_captions_parse_back_to_their_attributes(clean):
    for s in clean[:200]:
        assert parse_caption(s.caption) == s.attributes.description


def test_parse_caption_tolerates_case_and_rejects_other_text():
    assert parse_caption("  A Filled RED circle on a  white background. ") == Description(shape="circle", colour="red")
    for text in ("a red circle on a", "a mauve circle on a white background", "a red hexagon on a white background",
                 ""):
        with pytest.raises(ValueError, match="not a shapes caption"):
            parse_caption(text)
    with pytest.raises(ValueError, match="unknown colour"):
        Description(shape="circle", colour="mauve")


# --- measures on clean and mildly noisy samples -----------------------------------------------------


def test_mask_iou():
    a = np.zeros((8, 8), bool)
    b = a.copy()
    assert mask_iou(a, b) == 1.0
    a[:4], b[2:6] = True, True
    assert mask_iou(a, b) == pytest.approx(1 / 3)
    assert mask_iou(a, ~a) == 0.0


@pytest.mark.parametrize("samples", ["clean", "noisy"])
def test_shape_mask_recovers_the_drawn_silhouette(samples, request):
    ious = [mask_iou(shape_mask(s.image), s.mask) for s in request.getfixturevalue(samples)]
    assert min(ious) >= 0.9


@pytest.mark.parametrize("samples", ["clean", "noisy"])
def test_dominant_colour_recovers_the_colour(samples, request):
    samples = request.getfixturevalue(samples)
    assert np.mean([dominant_colour(s.image) == s.attributes.colour for s in samples]) >= 0.95
    assert np.mean([max(colour_votes(s.image).values()) for s in samples]) > 0.9


def test_classifier_is_accurate_on_fresh_samples(classifier, noisy):
    assert set(classifier.classes) == set(SHAPES)
    assert classifier.accuracy(generate(500, seed=1000)) >= 0.9
    assert classifier.accuracy(noisy[:300]) >= 0.9
    assert classifier.predict_proba([noisy[0].image]).shape == (1, len(SHAPES))


@pytest.mark.parametrize("samples", ["clean", "noisy"])
def test_outline_and_darkness_separate_the_styles(samples, request):
    samples = request.getfixturevalue(samples)
    outline = {style: [outline_score(s.image) for s in samples if s.attributes.style == style] for style in STYLES}
    assert max(outline["filled"]) < 0.05 < 0.3 < min(outline["outlined"])
    assert max(outline["filled"]) < OUTLINE_THRESHOLD < min(outline["outlined"])
    dark = {bg: [darkness(s.image) for s in samples if s.attributes.background == bg] for bg in BACKGROUNDS}
    assert max(dark["white"]) < 0.1 < 0.8 < min(dark["dark"])
    assert max(dark["white"]) < DARK_THRESHOLD < min(dark["dark"])


def test_describe_matches_the_caption(clean, classifier):
    results = [matches(s.image, parse_caption(s.caption), classifier) for s in clean[:200]]
    assert np.mean([all(r.values()) for r in results]) >= 0.95
    assert min(clarity(s.image) for s in clean) == 1.0
    red = next(s for s in clean if s.attributes.colour == "red")
    wrong = Description(shape=red.attributes.shape, colour="blue", background=red.attributes.background)
    assert matches(red.image, wrong, classifier)["colour"] is False


# --- measures on pure noise: the checks can fail --------------------------------------------------------


def test_measures_on_noise_are_unconfident_or_wrong(noise_images, classifier):
    images, references = noise_images
    # colour: no better than chance against the attributes the image should have had, and unconfident
    assert np.mean([dominant_colour(x) == r.attributes.colour for x, r in zip(images, references, strict=True)]) < 0.35
    assert max(max(colour_votes(x).values()) for x in images) < 0.5
    # silhouettes: noise does not reproduce a control mask
    assert np.mean([mask_iou(shape_mask(x), r.mask) for x, r in zip(images, references, strict=True)]) < 0.5
    # shape: no better than chance (the forest sees the noise's blob as one shape, whatever was asked)
    predicted = classifier.predict(images)
    assert np.mean([p == r.attributes.shape for p, r in zip(predicted, references, strict=True)]) < 0.4
    # the clarity gate flags every noise image; the border is mid-grey (neither white nor dark)
    assert max(clarity(x) for x in images) < 0.3
    assert all(0.3 < darkness(x) < 0.7 for x in images)
    # whole captions essentially never match
    described = [describe(x, classifier) for x in images[:100]]
    hits = [d == vars(r.attributes.description) for d, r in zip(described, references, strict=False)]
    assert np.mean(hits) < 0.05
