"""Prompt token strings from the vocabulary table (``orchestrator/token_strings.py``): the tokenizer's own
``convert_ids_to_tokens`` for every id, special and added tokens included, as UTF-8 bytes."""
from __future__ import annotations

import random
import threading

from backends.runtime.tokenizer import load_tokenizer
from orchestrator.token_strings import TokenStrings

TOKENIZER = load_tokenizer(None)  # Qwen2.5-VL's offline one


def test_the_table_gives_the_tokenizers_tokens_for_every_kind_of_id():
    strings = TokenStrings(TOKENIZER)
    size = len(TOKENIZER)
    ids = [0, 1, size - 1, *TOKENIZER.convert_tokens_to_ids(["<|im_start|>", "<|image_pad|>"]),
           *(random.Random(7).randrange(size) for _ in range(2000))]
    assert strings.of(ids) == [t.encode() for t in TOKENIZER.convert_ids_to_tokens(ids)]
    assert strings.of(iter(ids[:3])) == strings.of(ids[:3]) and strings.of([]) == []


def test_an_id_beyond_the_table_is_converted_alone():
    assert TokenStrings(TOKENIZER).of([len(TOKENIZER) + 5, 0]) == [b"", TOKENIZER.convert_ids_to_tokens(0).encode()]


def test_threads_asking_at_once_build_one_table():
    built: list[int] = []
    convert = TOKENIZER.convert_ids_to_tokens

    class Counting:
        def __len__(self):
            return len(TOKENIZER)

        def convert_ids_to_tokens(self, ids):
            if isinstance(ids, list) and len(ids) == len(TOKENIZER):
                built.append(1)
            return convert(ids)

    strings = TokenStrings(Counting())
    threads = [threading.Thread(target=strings.of, args=([1, 2, 3],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1]
