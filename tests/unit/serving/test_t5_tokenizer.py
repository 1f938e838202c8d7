"""Contract of the generated T5 tokenizer (SD3's ``tokenizer_3``): T5's special ids (``<pad>`` 0, ``</s>`` 1,
``<unk>`` 2), ``</s>`` appended and kept last under truncation, padding with id 0, known words as single pieces, any
text tokenized within the vocabulary, identical across builds and through ``save_pretrained``/``from_pretrained``."""

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer, T5TokenizerFast

from serving._private.tokenizer import WORDS, build_t5_tokenizer, build_t5_vocabulary

PROMPT = "two small blue squares in the upper left corner"
ODD_TEXT = "Ünïcode ✓ 123 zebra-striped, redx!"


def test_special_ids_are_t5s() -> None:
    tokenizer = build_t5_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert tokenizer.bos_token_id is None


def test_eos_is_appended() -> None:
    tokenizer = build_t5_tokenizer()
    ids = tokenizer("a red circle").input_ids
    assert ids == [*tokenizer("a red circle", add_special_tokens=False).input_ids, 1]
    batch = tokenizer(["a red circle", "a"], padding="longest").input_ids
    assert batch == [ids, [*tokenizer("a", add_special_tokens=False).input_ids, 1, 0, 0]]


def test_padding_and_truncation_to_max_length_as_sd3_calls_it() -> None:
    tokenizer = build_t5_tokenizer()
    kwargs = {"padding": "max_length", "truncation": True, "add_special_tokens": True, "return_tensors": "pt"}
    padded = tokenizer(["a red circle"], max_length=8, **kwargs)
    assert padded.input_ids[0, 3:].tolist() == [1, 0, 0, 0, 0]
    assert padded.attention_mask[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    truncated = tokenizer([PROMPT], max_length=4, **kwargs).input_ids[0].tolist()
    assert truncated == [*tokenizer(PROMPT, add_special_tokens=False).input_ids[:3], 1]


def test_every_listed_word_is_one_piece() -> None:
    tokenizer = build_t5_tokenizer()
    split = [word for word in WORDS if tokenizer.tokenize(word) != ["▁" + word]]
    assert split == []


def test_any_text_tokenizes_within_the_vocabulary() -> None:
    tokenizer = build_t5_tokenizer()
    ids = tokenizer(ODD_TEXT).input_ids
    assert 2 in ids and ids[-1] == 1
    assert all(0 <= token_id < len(tokenizer) for token_id in ids)
    assert tokenizer.tokenize("redx") == ["▁red", "x"]
    assert tokenizer.decode(tokenizer(PROMPT).input_ids, skip_special_tokens=True) == PROMPT


def test_vocabulary_is_small_and_deterministic() -> None:
    first, second = build_t5_tokenizer(), build_t5_tokenizer()
    script = "import json; from serving._private.tokenizer import build_t5_vocabulary as b; print(json.dumps(b()))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other_process = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=True, text=True)
    assert [tuple(entry) for entry in json.loads(other_process.stdout)] == build_t5_vocabulary()
    assert first.get_vocab() == second.get_vocab()
    assert first(ODD_TEXT).input_ids == second(ODD_TEXT).input_ids
    assert 100 <= len(first) <= 4000


def test_saved_tokenizer_reloads_identically(tmp_path: Path) -> None:
    tokenizer = build_t5_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    for loader in (T5TokenizerFast, AutoTokenizer):
        reloaded = loader.from_pretrained(tmp_path, local_files_only=True)
        assert reloaded.get_vocab() == tokenizer.get_vocab()
        assert reloaded.model_max_length == tokenizer.model_max_length
        for text in (PROMPT, ODD_TEXT):
            assert reloaded(text).input_ids == tokenizer(text).input_ids
