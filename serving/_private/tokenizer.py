"""A CLIP tokenizer whose vocabulary is generated here, deterministically, with no hub download.

The vocabulary is CLIP's byte-level alphabet (every byte, alone and as a word end ``x</w>``), plus
whole-word tokens for a fixed word list learned by a small greedy BPE, plus CLIP's two special
tokens placed last (as in CLIP, so ``argmax(input_ids)`` is the end-of-text position). Any text
tokenizes; words from the list become single tokens.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 77

#: Words of the demo "shapes" world and the glue words of prompts about it.
WORDS: tuple[str, ...] = (
    # colours
    "red", "green", "blue", "yellow", "orange", "purple", "pink", "brown", "black", "white", "gray",
    "grey", "cyan", "magenta", "teal", "navy", "gold", "silver", "dark", "light", "bright", "pale",
    # shapes
    "circle", "circles", "square", "squares", "triangle", "triangles", "rectangle", "rectangles",
    "star", "stars", "ellipse", "oval", "diamond", "hexagon", "cross", "ring", "line", "lines",
    "dot", "dots", "shape", "shapes", "disk", "box",
    # sizes and positions
    "small", "large", "big", "tiny", "huge", "medium", "left", "right", "top", "bottom", "center",
    "centre", "middle", "corner", "upper", "lower", "above", "below", "near", "far",
    # styles and scene words
    "background", "foreground", "outlined", "outline", "filled", "solid", "striped", "sketch",
    "drawing", "painting", "photo", "image", "picture", "style", "border", "edge", "edges", "shadow",
    "blurry", "sharp", "simple", "plain", "flat", "colorful", "colourful", "empty",
    # glue words
    "a", "an", "the", "of", "on", "in", "at", "with", "and", "or", "no", "not", "to", "by", "is",
    "are", "two", "three", "one", "many", "some", "very", "over", "under", "next", "behind",
)


def _byte_alphabet() -> list[str]:
    return sorted(ByteLevel.alphabet())


def train_merges(words: tuple[str, ...] = WORDS) -> list[tuple[str, str]]:
    """Greedy BPE until every word is one token; ties broken lexicographically (deterministic)."""
    corpus = [[*word[:-1], word[-1] + "</w>"] for word in sorted(set(words))]
    merges: list[tuple[str, str]] = []
    while any(len(symbols) > 1 for symbols in corpus):
        counts = Counter(pair for symbols in corpus for pair in pairwise(symbols))
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        corpus = [_merge(symbols, best) for symbols in corpus]
    return merges


def _merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    merged: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def build_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary (token -> id) and the BPE merges, in rank order."""
    alphabet = _byte_alphabet()
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet]
    merges = train_merges()
    seen = set(tokens)
    for left, right in merges:
        if left + right not in seen:
            tokens.append(left + right)
            seen.add(left + right)
    tokens += [BOS_TOKEN, EOS_TOKEN]
    return {token: index for index, token in enumerate(tokens)}, merges


def build_tokenizer() -> CLIPTokenizer:
    """The generated CLIP tokenizer (``model_max_length`` 77, padding with end-of-text, as SD does)."""
    vocab, merges = build_vocabulary()
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=MODEL_MAX_LENGTH,
    )
