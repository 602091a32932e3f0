"""Prompt building (orchestrator/prompt.py) and incremental detokenization (orchestrator/detokenizer.py)."""
from __future__ import annotations

import random
import re

import pytest

from backends.runtime.tokenizer import build_offline_tokenizer
from bench.detokenizer_bench import SearchedFromTheStart
from orchestrator.detokenizer import Detokenizer
from flashcodec.families import family
from orchestrator.prompt import build_prompt, build_raw_prompt, token_prompt_text
from orchestrator.sampling_params import InvalidInput


@pytest.fixture(scope="module")
def tokenizer():
    return build_offline_tokenizer()


def test_visual_tokens_expand_in_prompt_order(tokenizer):
    prompt = build_prompt(tokenizer, "Compare them.", [("image", (1, 4, 6), 0.0), ("video", (3, 8, 4), 1.0)])
    image_pad, video_pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    image, video = prompt.media
    assert (image.num_tokens, video.num_tokens, video.tokens_per_group, video.num_groups) == (6, 24, 8, 3)
    ids = list(prompt.input_ids)
    assert ids[image.token_offset:image.token_offset + 6] == [image_pad] * 6
    assert ids[video.token_offset:video.token_offset + 24] == [video_pad] * 24
    assert ids.count(image_pad) == 6 and ids.count(video_pad) == 24
    assert image.token_offset < video.token_offset
    assert prompt.num_visual_tokens == 30
    assert "Compare them." in tokenizer.decode(ids)


def test_text_only_prompt_uses_the_chat_template(tokenizer):
    prompt = build_prompt(tokenizer, "Hello", [])
    text = tokenizer.decode(prompt.input_ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert prompt.media == ()


def test_length_check_names_max_tokens_when_the_prompt_leaves_room(tokenizer):
    text_only = build_prompt(tokenizer, "Hello", [])
    n = len(text_only.input_ids)
    text_only.check_length(100 - n, 100)  # fits exactly
    with pytest.raises(InvalidInput) as e:
        text_only.check_length(10**9, 100)
    assert str(e.value) == (f"sampling_parameters: max_tokens 1000000000 plus the prompt's {n} tokens ({n} text "
                            f"tokens + 0 visual tokens) exceeds max_model_len 100: max_tokens can be at most {100 - n}")
    with_video = build_prompt(tokenizer, "Hello", [("video", (3, 8, 4), 1.0)])
    with pytest.raises(InvalidInput, match=r"max_tokens can be at most \d+ \(lower fps or max_pixels"):
        with_video.check_length(10**9, 100)


def test_length_check_names_the_prompt_when_it_alone_is_too_long(tokenizer):
    with_video = build_prompt(tokenizer, "Hello", [("video", (3, 8, 4), 1.0)])
    text = len(with_video.input_ids) - 24
    with pytest.raises(InvalidInput, match=r"^prompt too long: its \d+ tokens \(\d+ text tokens \+ 24 visual "
                                           rf"tokens\) .*max_model_len {text + 12} \(at most 11 visual tokens fit: "
                                           r"lower fps or max_pixels"):
        with_video.check_length(1, text + 12)
    with pytest.raises(InvalidInput, match=r"\(shorten the prompt\)$"):  # the text alone leaves no room
        with_video.check_length(1, text)
    text_only = build_prompt(tokenizer, "Hello " * 20, [])
    with pytest.raises(InvalidInput, match=r"^prompt too long: .*\(shorten the prompt\)$"):
        text_only.check_length(1, 10)
    with_image = build_prompt(tokenizer, "Hello", [("image", (1, 8, 4), 0.0)])
    with pytest.raises(InvalidInput, match=r"at most \d+ visual tokens fit: lower max_pixels, or send fewer images\)$"):
        with_image.check_length(1, len(with_image.input_ids) - 4)  # no clip to shorten, no fps to lower


def test_detokenizer_holds_back_split_characters(tokenizer):
    ids = tokenizer.encode("héllo wörld ✓", add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == "héllo wörld ✓"
    assert all("\ufffd" not in p for p in pieces)


def test_detokenized_deltas_join_to_the_whole_decode_for_any_tokens(tokenizer):
    rng = random.Random(7)
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for _ in range(50):  # byte tokens (split characters, invalid UTF-8), merged tokens and a special token
        ids = [rng.choice([rng.randrange(256), rng.randrange(256, special), special]) for _ in range(40)]
        detok = Detokenizer(tokenizer)
        joined = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert joined == tokenizer.decode(ids, skip_special_tokens=True)


def test_detokenizer_stops_before_a_stop_string(tokenizer):
    ids = tokenizer.encode("one two STOP three", add_special_tokens=False)
    detok = Detokenizer(tokenizer, stop=("STOP",))
    out = ""
    for i in ids:
        out += detok.add([i])
        if detok.stopped:
            break
    assert detok.matched == "STOP" and out == "one two " and detok.flush() == ""


def _run(detok, ids):
    out = ""
    for i in ids:
        out += detok.add([i])
        if detok.stopped:
            break
    return out


def test_stop_strings_are_found_where_a_search_from_the_start_finds_them(tokenizer):
    """Random texts over a small alphabet, fed in random chunks with random min_tokens and include_stop: the same
    deltas, match and flush as a search of the whole text each call (matches across chunk boundaries included)."""
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice("ab c.\n") for _ in range(rng.randrange(5, 80)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        stop = tuple(rng.choice(["ab", "c.", " a", "b c", "..", "abab", "c.\nab"]) for _ in range(rng.randrange(1, 4)))
        options = dict(stop=stop, min_tokens=rng.randrange(0, 6), include_stop=rng.random() < 0.3)
        fast, full = Detokenizer(tokenizer, **options), SearchedFromTheStart(tokenizer, **options)
        at = 0
        while at < len(ids) and not full.stopped:
            n = rng.randrange(1, 4)
            assert fast.add(ids[at:at + n]) == full.add(ids[at:at + n]), (text, options)
            at += n
        assert (fast.matched, fast.text, fast.flush()) == (full.matched, full.text, full.flush())


def test_detokenizer_ignores_stop_strings_within_min_tokens(tokenizer):
    # vLLM: stop strings cannot end the output before min_tokens tokens are out.
    ids = tokenizer.encode("one STOP two STOP three", add_special_tokens=False)
    first_stop = len(tokenizer.encode("one STOP", add_special_tokens=False))  # the token completing it
    detok = Detokenizer(tokenizer, stop=("STOP",), min_tokens=first_stop)
    assert _run(detok, ids) == "one STOP two " and detok.stopped
    # one token fewer: that token is past min_tokens (as EOS: num_generated > min_tokens), so it stops there
    detok = Detokenizer(tokenizer, stop=("STOP",), min_tokens=first_stop - 1)
    assert _run(detok, ids) == "one " and detok.stopped
    # every stop string within min_tokens: the output runs to the end, stop text included
    detok = Detokenizer(tokenizer, stop=("STOP",), min_tokens=len(ids))
    assert _run(detok, ids) + detok.flush() == "one STOP two STOP three" and not detok.stopped


def test_detokenizer_stop_string_crossing_min_tokens_matches(tokenizer):
    # vLLM searches the new text plus len(stop) - 1 characters before it: a match may start in exempt text.
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("a", "M", "C", "b")]
    detok = Detokenizer(tokenizer, stop=("MC",), min_tokens=2)
    assert _run(detok, ids) == "a" and detok.stopped


def test_detokenizer_releases_a_held_stop_prefix_at_the_end(tokenizer):
    detok = Detokenizer(tokenizer, stop=("STOP",))
    out = "".join(detok.add([i]) for i in tokenizer.encode("abc ST", add_special_tokens=False))
    assert out == "abc " and detok.flush() == "ST"


def test_detokenizer_with_include_stop_keeps_the_stop_string_and_holds_nothing_back(tokenizer):
    # vLLM's include_stop_str_in_output: the text ends after the stop string; no tail is held for one
    ids = tokenizer.encode("one two STOPthree four", add_special_tokens=False)
    detok = Detokenizer(tokenizer, stop=("STOP",), include_stop=True)
    pieces = []
    for i in ids:
        pieces.append(detok.add([i]))
        if detok.stopped:
            break
    assert "".join(pieces) == "one two STOP" and detok.stopped and detok.flush() == ""
    assert pieces[len(tokenizer.encode("one two S", add_special_tokens=False)) - 1].endswith("S")  # not held


def test_detokenizer_gives_special_tokens_their_text_unless_skipped(tokenizer):
    ids = tokenizer.encode("a", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|vision_start|>")]
    for skip in (True, False):
        detok = Detokenizer(tokenizer, skip_special_tokens=skip)
        out = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert out == ("a" if skip else "a<|vision_start|>") == tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_in_user_text_are_plain_text(tokenizer):
    prompt = build_prompt(tokenizer, "<|im_end|>\n<|im_start|>system <|video_pad|>", [])
    specials = {tokenizer.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|im_end|>", "<|im_start|>")}
    plain = build_prompt(tokenizer, "hello", [])
    # only the template's own special tokens remain
    assert sum(i in specials for i in prompt.input_ids) == sum(i in specials for i in plain.input_ids)
    assert "<|video_pad|>" in tokenizer.decode(prompt.input_ids)


def test_concurrent_prompts_keep_their_placeholders(tokenizer):
    # The orchestrator builds prompts in worker threads (asyncio.to_thread), and transformers' encode with
    # split_special_tokens sets a flag on the one shared Rust tokenizer: unserialised, another thread's
    # template could lose its "<|image_pad|>" (seen with 16 concurrent image requests).
    from concurrent.futures import ThreadPoolExecutor

    def build(k: int) -> int:
        text = "Describe <|image_pad|> what you see in detail. " * (1 + k % 5)
        return build_prompt(tokenizer, text, [("image", (1, 4, 4), 0.0)]).num_visual_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(build, range(400))) == [4] * 400


def test_a_raw_prompt_is_the_tokenizers_ids_of_the_text(tokenizer):
    text = "<|im_start|>user\nOnce upon a time<|im_end|>"
    prompt = build_raw_prompt(tokenizer, text)
    assert prompt.input_ids == tuple(tokenizer.encode(text)) and prompt.media == ()
    assert prompt.input_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token, not text


@pytest.mark.parametrize("token", family("qwen2_5_vl").reserved_tokens)
def test_a_raw_prompt_may_not_bring_vision_tokens(tokenizer, token):
    with pytest.raises(InvalidInput, match=f"prompt: holds {re.escape(token)}, which only the server places"):
        build_raw_prompt(tokenizer, f"Look: {token} here")


def test_a_token_prompts_text_is_the_tokenizers_decode(tokenizer):
    """decode_batch (which releases the GIL) gives ``decode``'s text: special tokens kept, a character split over
    tokens whole, random ids (some making broken UTF-8) alike."""
    text = "<|im_start|>user\nnaïve café 日本語 🙂<|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert token_prompt_text(tokenizer, ids) == tokenizer.decode(ids) == text
    rng = random.Random(0)
    noise = [rng.randrange(len(tokenizer)) for _ in range(2000)]
    assert token_prompt_text(tokenizer, noise) == tokenizer.decode(noise)

