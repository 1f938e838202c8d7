"""CLIP and T5 tokenizers whose vocabularies are generated here, deterministically, with no hub download.

CLIP: the byte-level alphabet (every byte, alone and as a word end ``x</w>``), plus whole-word tokens for a fixed word
list learned by a small greedy BPE, plus CLIP's two special tokens placed last (as in CLIP, so ``argmax(input_ids)`` is
the end-of-text position). Any text tokenizes; words from the list become single tokens.

T5 (SD3's third text encoder): ids as in T5, ``<pad>`` = 0, ``</s>`` = 1 (appended to every sequence), ``<unk>`` = 2;
no bos, and none of T5's 100 ``<extra_id_*>`` sentinels (SD3 never uses them). Then the pieces: the word-start marker
``▁``, one ``▁word`` per word of the same list, and every printable ASCII character alone. The model is T5's own: a
Unigram after a whitespace split and a sentencepiece-style ``Metaspace`` pre-tokenizer, with no byte fallback
(``T5TokenizerFast`` rebuilds its model without one in ``from_pretrained``). The scores make a known word one piece;
any other word splits into single characters after a known ``▁word`` prefix if it has one (else ``▁`` alone), and a
character outside printable ASCII becomes ``<unk>``. ``model_max_length`` is 512, T5's and SD3's ``tokenizer_3`` value
and the largest ``max_sequence_length`` the pipeline accepts (its default is 256).
"""

from __future__ import annotations

import string
from collections import Counter
from itertools import pairwise

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, T5TokenizerFast

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 77

T5_PAD_TOKEN = "<pad>"
T5_EOS_TOKEN = "</s>"
T5_UNK_TOKEN = "<unk>"
T5_WORD_START = "▁"
T5_MODEL_MAX_LENGTH = 512

#: T5 Unigram log-probabilities: one word piece beats the word-start marker plus two characters or more.
_T5_WORD_SCORE = -5.0
_T5_WORD_START_SCORE = -8.0
_T5_CHARACTER_SCORE = -10.0

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


def build_t5_vocabulary() -> list[tuple[str, float]]:
    """The T5 Unigram vocabulary, ``(piece, score)`` in id order."""
    specials = [(T5_PAD_TOKEN, 0.0), (T5_EOS_TOKEN, 0.0), (T5_UNK_TOKEN, 0.0)]
    words = [(T5_WORD_START + word, _T5_WORD_SCORE) for word in dict.fromkeys(WORDS)]
    characters = [(character, _T5_CHARACTER_SCORE) for character in string.printable if not character.isspace()]
    return [*specials, (T5_WORD_START, _T5_WORD_START_SCORE), *words, *characters]


def build_t5_tokenizer() -> T5TokenizerFast:
    """The generated T5 tokenizer: appends ``</s>``, pads with ``<pad>`` (id 0), unknown characters are ``<unk>``."""
    return T5TokenizerFast(
        vocab=build_t5_vocabulary(),
        eos_token=T5_EOS_TOKEN,
        unk_token=T5_UNK_TOKEN,
        pad_token=T5_PAD_TOKEN,
        extra_ids=0,
        model_max_length=T5_MODEL_MAX_LENGTH,
    )
