"""Prompt emphasis in the syntax of the established UIs (AUTOMATIC1111's, which ComfyUI and InvokeAI's A1111 mode
read too): ``(text)`` weighs text 1.1x, ``[text]`` 1/1.1x, ``(text:1.3)`` 1.3x; brackets nest and multiply;
``\\(``, ``\\)``, ``\\[``, ``\\]`` and ``\\\\`` are the characters themselves. A bracket without its partner is text,
as the UIs treat it, never an error. A1111's prompt editing (``[a:b:0.5]``) and ``BREAK`` are not supported: they
stay text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

#: How a request's prompts are read: ``weighted`` parses emphasis (the default), ``plain`` takes every character
#: literally.
PromptSyntax = Literal["weighted", "plain"]

#: The factor of a pair of round brackets (square: its inverse), as in AUTOMATIC1111.
BRACKET_FACTOR = 1.1
#: Explicit weights ``(text:w)`` must lie in [0, MAX_WEIGHT]: past a few, images degrade into noise.
MAX_WEIGHT = 10.0

_TOKENS = re.compile(r"\\[()\[\]\\]|\(|\[|\]|:\s*([+-]?(?:\d+\.?\d*|\.\d+))\s*\)|\)|[^\\()\[\]:]+|[\\:]")


class EmphasisError(ValueError):
    """A weight the syntax reads but cannot serve (negative, or over ``MAX_WEIGHT``), with its position."""


@dataclass(frozen=True)
class WeightedText:
    """A stretch of prompt text and the weight its tokens get (1.0: as written)."""

    text: str
    weight: float = 1.0


@dataclass
class _Token:
    text: str
    kind: Literal["text", "open_round", "open_square", "close_round", "close_square", "close_weight"]
    weight: float | None = None  # ``close_weight``: the explicit weight
    factor: float = 1.0  # an opener: the factor its pair applies
    partner: _Token | None = None  # the bracket it pairs with; None: text
    start: int = 0


def parse_emphasis(prompt: str) -> list[WeightedText]:
    """``prompt`` as weighted stretches in order, adjacent stretches of one weight joined (blanks weigh 1.0);
    raises ``EmphasisError`` for an explicit weight outside [0, ``MAX_WEIGHT``]."""
    tokens = _tokenize(prompt)
    _match_brackets(tokens)
    pieces: list[WeightedText] = []
    open_pairs: dict[int, float] = {}  # the matched openers enclosing this point (by id), with their factors
    for token in tokens:
        if token.partner is None:
            weight = 1.0
            if token.text.strip():  # blanks have no tokens to weigh: they join their neighbours
                for factor in open_pairs.values():
                    weight *= factor
            _append(pieces, WeightedText(token.text, weight))
        elif token.kind.startswith("open"):
            open_pairs[id(token)] = token.factor
        else:
            del open_pairs[id(token.partner)]
    return pieces


def is_plain(pieces: list[WeightedText]) -> bool:
    """Whether every stretch keeps its written weight."""
    return all(piece.weight == 1.0 for piece in pieces)


def joined_text(pieces: list[WeightedText]) -> str:
    """The prompt's text without its emphasis markup."""
    return "".join(piece.text for piece in pieces)


def _tokenize(prompt: str) -> list[_Token]:
    tokens = []
    for match in _TOKENS.finditer(prompt):
        text, start = match.group(0), match.start()
        if match.group(1) is not None:
            tokens.append(_Token(text, "close_weight", weight=float(match.group(1)), start=start))
        elif text == "(":
            tokens.append(_Token(text, "open_round", start=start))
        elif text == ")":
            tokens.append(_Token(text, "close_round", start=start))
        elif text == "[":
            tokens.append(_Token(text, "open_square", start=start))
        elif text == "]":
            tokens.append(_Token(text, "close_square", start=start))
        elif len(text) == 2 and text[0] == "\\":
            tokens.append(_Token(text[1], "text", start=start))
        else:
            tokens.append(_Token(text, "text", start=start))
    return tokens


def _match_brackets(tokens: list[_Token]) -> None:
    """Pairs each closer with the nearest open bracket of its kind; what stays unpaired becomes text. An explicit
    weight without an open round bracket is text too (its colon, number and parenthesis)."""
    rounds: list[_Token] = []
    squares: list[_Token] = []
    for token in tokens:
        if token.kind == "open_round":
            rounds.append(token)
        elif token.kind == "open_square":
            squares.append(token)
        elif token.kind in ("close_round", "close_weight") and rounds:
            opener = rounds.pop()
            if token.weight is not None:
                if not 0.0 <= token.weight <= MAX_WEIGHT:
                    raise EmphasisError(f"the weight {token.text.lstrip(':').rstrip(')').strip()} at character "
                                        f"{token.start + 1} is outside 0-{MAX_WEIGHT:g}")
                opener.factor = token.weight
            else:
                opener.factor = BRACKET_FACTOR
            opener.partner, token.partner = token, opener
        elif token.kind == "close_square" and squares:
            opener = squares.pop()
            opener.factor = 1.0 / BRACKET_FACTOR
            opener.partner, token.partner = token, opener
    for token in tokens:
        if token.partner is None:
            token.kind = "text"


def _append(pieces: list[WeightedText], piece: WeightedText) -> None:
    if pieces and pieces[-1].weight == piece.weight:
        pieces[-1] = WeightedText(pieces[-1].text + piece.text, piece.weight)
    else:
        pieces.append(piece)
