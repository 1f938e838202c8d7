"""The emphasis syntax of AUTOMATIC1111's UI, parsed into weighted stretches (``serving.engine.emphasis``)."""

import pytest

from serving.engine.emphasis import EmphasisError, WeightedText, is_plain, joined_text, parse_emphasis

ROUND = 1.1
SQUARE = 1 / 1.1


@pytest.mark.parametrize(("prompt", "expected"), [
    ("a photo of a cat", [("a photo of a cat", 1.0)]),
    ("a (cat) sat", [("a ", 1.0), ("cat", ROUND), (" sat", 1.0)]),
    ("a [cat] sat", [("a ", 1.0), ("cat", SQUARE), (" sat", 1.0)]),
    ("((cat))", [("cat", ROUND * ROUND)]),
    ("a (red circle:1.3) on a (white:0.5)", [("a ", 1.0), ("red circle", 1.3), (" on a ", 1.0), ("white", 0.5)]),
    ("((cat:1.5) dog)", [("cat", 1.5 * ROUND), (" dog", ROUND)]),
    ("(a [b) c]", [("a ", ROUND), ("b", ROUND * SQUARE), (" c", SQUARE)]),  # round and square pair apart
    ("(cat: 0.7 )", [("cat", 0.7)]),
    ("(cat:.5)", [("cat", 0.5)]),
], ids=["plain", "round", "square", "nested", "explicit", "explicit-nested", "interleaved", "spaced-weight",
        "leading-dot"])
def test_brackets_weigh_text_as_the_ui_does(prompt, expected):
    assert [(piece.text, pytest.approx(piece.weight)) for piece in parse_emphasis(prompt)] == expected


@pytest.mark.parametrize(("prompt", "text"), [
    ("a (cat", "a (cat"),  # an opening bracket never closed
    ("smile :)", "smile :)"),  # a closing bracket never opened
    ("a ]b[ c", "a ]b[ c"),
    ("cat:1.3)", "cat:1.3)"),  # a weight with no bracket open
    (r"\(literal\) \[too\] \\", "(literal) [too] \\"),
], ids=["unclosed", "unopened", "reversed", "weight-unopened", "escaped"])
def test_what_does_not_pair_is_plain_text(prompt, text):
    pieces = parse_emphasis(prompt)
    assert joined_text(pieces) == text and is_plain(pieces)


@pytest.mark.parametrize("weight", ["abc", "1e3"])
def test_a_weight_that_is_not_a_decimal_is_text_the_brackets_weigh(weight):
    assert parse_emphasis(f"(cat:{weight})") == [WeightedText(f"cat:{weight}", ROUND)]


def test_blank_stretches_join_their_neighbours_and_empty_prompts_have_none():
    assert parse_emphasis("a [ ] b") == [WeightedText("a   b")]
    assert parse_emphasis("") == []


@pytest.mark.parametrize("weight", ["-1", "10.5"])
def test_a_weight_outside_the_range_is_refused_naming_where_it_is(weight):
    with pytest.raises(EmphasisError, match=f"the weight {weight} at character 7 is outside 0-10"):
        parse_emphasis(f"a (cat:{weight})")
