import json
import os
import subprocess
import sys

from transformers import CLIPTokenizer

from serving._private.tokenizer import BOS_TOKEN, EOS_TOKEN, WORDS, build_tokenizer, build_vocabulary

_PRINT_VOCABULARY = ("import json; from serving._private.tokenizer import build_vocabulary; "
                     "print(json.dumps(build_vocabulary()))")


def test_vocabulary_is_the_same_in_every_process_whatever_its_hash_seed():
    """Token ids must not depend on the process (string hashes order sets and dicts of sets): the shipped weights
    were trained on them and every replica must agree."""
    here = json.dumps(build_vocabulary())
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        there = subprocess.run([sys.executable, "-c", _PRINT_VOCABULARY], env=env, capture_output=True, text=True,
                               check=True).stdout.strip()
        assert there == here, f"PYTHONHASHSEED={seed}"


def test_every_listed_word_is_one_token():
    tokenizer = build_tokenizer()
    split = [word for word in WORDS if len(tokenizer(word, add_special_tokens=False).input_ids) != 1]
    assert split == []


def test_special_tokens_are_last_so_argmax_finds_end_of_text():
    tokenizer = build_tokenizer()
    assert tokenizer.convert_tokens_to_ids([BOS_TOKEN, EOS_TOKEN]) == [len(tokenizer) - 2, len(tokenizer) - 1]
    ids = tokenizer("a red circle", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id


def test_unknown_words_fall_back_to_bytes_and_round_trip():
    tokenizer = build_tokenizer()
    text = "a zebra-striped circle, 42!"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids).replace(" ", "") == text.replace(" ", "")


def test_saved_tokenizer_reloads_identically(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = CLIPTokenizer.from_pretrained(tmp_path, local_files_only=True)
    prompt = "two small blue squares in the upper left corner"
    assert reloaded(prompt).input_ids == tokenizer(prompt).input_ids
