import json

import pytest

from backends.ipc.protocol import SamplingParams
from flashcodec.families import MediaOptions
from orchestrator.sampling_params import InvalidInput, RequestParams, parse_sampling_parameters


@pytest.mark.parametrize("text", [None, "", "  ", "{}", "null", " null "])
def test_missing_or_empty_gives_defaults(text):
    assert parse_sampling_parameters(text) == RequestParams()


def test_all_keys():
    params = parse_sampling_parameters(json.dumps({
        "max_tokens": 64, "min_tokens": 8, "ignore_eos": True, "temperature": 0.7, "top_p": 0.9,
        "top_k": 40, "seed": 1234, "stop": ["</s>", "\n\n"], "fps": 1.5, "max_pixels": 360 * 420,
        "stop_token_ids": [7, 9], "repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 2,
    }))
    assert params == RequestParams(max_tokens=64, min_tokens=8, ignore_eos=True, temperature=0.7, top_p=0.9,
                                   top_k=40, seed=1234, stop=("</s>", "\n\n"), fps=1.5, max_pixels=360 * 420,
                                   stop_token_ids=(7, 9), repetition_penalty=1.2, presence_penalty=-0.5,
                                   frequency_penalty=2.0)


def test_the_stages_sampling_carries_every_sampling_key():
    params = parse_sampling_parameters(json.dumps({
        "min_tokens": 2, "ignore_eos": True, "temperature": 0.5, "top_p": 0.8, "top_k": 3, "seed": 9,
        "stop_token_ids": [4], "repetition_penalty": 1.5, "presence_penalty": 0.25, "frequency_penalty": -1,
        "logprobs": 2, "logit_bias": {"7": 5, "11": -100}, "min_p": 0.05}))
    assert params.sampling() == SamplingParams(temperature=0.5, top_p=0.8, top_k=3, seed=9, min_tokens=2,
                                               ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.25,
                                               frequency_penalty=-1.0, stop_token_ids=(4,), logprobs=2,
                                               logit_bias=((7, 5.0), (11, -100.0)), min_p=0.05)


def test_logit_bias_values_beyond_100_are_clamped_as_vllm_does():
    params = parse_sampling_parameters(json.dumps({"logit_bias": {"5": 500, "6": -1e9, "7": 2.5}}))
    assert params.logit_bias == ((5, 100.0), (6, -100.0), (7, 2.5))
    assert parse_sampling_parameters(json.dumps({"logit_bias": None})).logit_bias == ()


def test_stop_token_ids_repeats_are_dropped_as_vllm_does():
    assert parse_sampling_parameters('{"stop_token_ids": [5, "3", 5.0, 3]}').stop_token_ids == (5, 3)
    assert parse_sampling_parameters('{"stop_token_ids": null}').stop_token_ids == ()


def test_a_null_stop_is_no_stop_string_as_the_openai_api_takes_it():
    assert parse_sampling_parameters('{"stop": null}').stop == ()


def test_genai_perf_sends_numbers_as_strings():
    params = parse_sampling_parameters('{"max_tokens": "256", "min_tokens": "256"}')
    assert params.max_tokens == 256 and params.min_tokens == 256


def test_a_stop_string_holding_a_lone_surrogate_is_refused_as_no_text():
    """A JSON escape "\\ud800" decodes to a code point no output can hold: refused as in messages, not left to
    never match."""
    with pytest.raises(InvalidInput) as info:
        parse_sampling_parameters('{"stop": ["y", "\\ud800x"]}')
    assert str(info.value) == ("sampling_parameters: stop[1]: not valid Unicode text (a lone surrogate '\\ud800' at "
                               "character 0)")


def test_too_many_stop_strings_are_counted_in_the_message_unquoted():
    with pytest.raises(InvalidInput) as info:
        parse_sampling_parameters(json.dumps({"stop": ["a"] * 17}))
    assert str(info.value) == ("sampling_parameters: stop must hold at most 16 strings of at most 256 characters, "
                               "got 17 strings, the longest 1 characters")


def test_max_tokens_absent_is_16_and_null_is_the_rest_of_the_context():
    """vLLM's SamplingParams: 16 by default, None (null) up to the context (orchestrator.reply_limit resolves it);
    min_tokens then has no max_tokens to stay under until the prompt is built."""
    assert parse_sampling_parameters("{}").max_tokens == 16
    params = parse_sampling_parameters('{"max_tokens": null, "min_tokens": 300}')
    assert params.max_tokens is None and params.min_tokens == 300


def test_lenient_but_exact_conversions():
    params = parse_sampling_parameters(
        '{"temperature": 0, "top_p": "0.5", "max_tokens": 32.0, "ignore_eos": "false", "seed": null, '
        '"max_pixels": null, "fps": 2}')
    assert params.temperature == 0.0 and params.top_p == 0.5 and params.max_tokens == 32
    assert params.ignore_eos is False and params.seed is None and params.max_pixels is None
    assert isinstance(params.temperature, float) and isinstance(params.max_tokens, int)


def test_top_k_minus_one_means_off():
    assert parse_sampling_parameters('{"top_k": -1}').top_k == 0
    assert RequestParams(top_k=-1).top_k == 0


def test_stop_may_be_one_string():
    assert parse_sampling_parameters('{"stop": "END"}').stop == ("END",)


@pytest.mark.parametrize("raw, key", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": "\u0663"}, "max_tokens"),  # an Arabic-Indic 3: int() takes it, a client means no number
    ({"temperature": "\u0660.\u0665"}, "temperature"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": [4]}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1, "max_tokens": None}, "min_tokens"),
    ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": "nan"}, "temperature"),
    ({"temperature": "inf"}, "temperature"),
    ({"temperature": False}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": "nan"}, "min_p"),
    ({"min_p": True}, "min_p"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"fps": 0}, "fps"),
    ({"fps": 61}, "fps"),
    ({"fps": -2}, "fps"),
    ({"max_pixels": 100}, r"max_pixels must be in \[3136, 12845056\] \(a Qwen2.5-VL setting\), got 100"),
    ({"max_pixels": 16384 * 28 * 28 + 1}, "max_pixels"),
    ({"num_frames": 0}, r"num_frames must be in \[1, 1024\], got 0"),
    ({"num_frames": 2.5}, "num_frames must be an integer"),
    ({"max_tiles": 0}, r"max_tiles must be in \[1, 64\] \(an InternVL3 setting\), got 0"),
    ({"max_tiles": "many"}, "max_tiles must be an integer"),
    ({"min_tiles": 0}, r"min_tiles must be in \[1, 64\] \(an InternVL3 setting\), got 0"),
    ({"min_patches": 65}, r"min_tiles must be in \[1, 64\] \(an InternVL3 setting\), got 65"),
    ({"min_dynamic_patch": 1.5}, "min_dynamic_patch must be an integer"),
    ({"dynamic_image_size": 0}, "dynamic_image_size must be a boolean, got 0"),
    ({"crop_to_patches": "no"}, "crop_to_patches must be a boolean, got 'no'"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": "inf"}, "repetition_penalty"),
    ({"presence_penalty": 2.01}, r"presence_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": "much"}, "frequency_penalty"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers"),
    ({"stop_token_ids": [1, "a"]}, "stop_token_ids must be a list of integers"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must be a list of integers"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must hold at most 256 token ids >= 0"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids must hold at most 256"),
    ({"best_of": 2}, "best_of"),
    ({"max_new_tokens": 2}, "max_new_tokens"),
    ({"logit_bias": [1, 2]}, "logit_bias must be an object of token ids to biases"),
    ({"logit_bias": {"x": 1}}, "logit_bias\\['x'\\]'s key must be an integer, got 'x'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias\\['-1'\\]'s key must be a token id, in \\[0, 2\\*\\*31\\)"),
    ({"logit_bias": {"5": "nan"}}, "logit_bias\\['5'\\] must be a finite number"),
    ({"logit_bias": {"5": True}}, "logit_bias\\['5'\\] must be a number, got True"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias names token 5 twice \\('5' and '05'\\)"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias has 301 entries, at most 300"),
])
def test_bad_values_are_rejected_naming_the_key(raw, key):
    with pytest.raises(InvalidInput, match=f"sampling_parameters: .*{key}"):
        parse_sampling_parameters(json.dumps(raw))


def test_message_states_rule_and_value():
    with pytest.raises(InvalidInput) as info:
        parse_sampling_parameters('{"max_tokens": 0}')
    assert str(info.value) == "sampling_parameters: max_tokens must be a positive integer below 2**31, got 0"



@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("42", "must be a JSON object"),
    ('"max_tokens"', "must be a JSON object"),
    ("[" * 100000, "nested thousands deep"),
    ('{"max_tokens": ' + "9" * 5000 + "}", "(4300 digits)"),  # past Python's 4300-digit conversion limit
    ('{"seed": ' + "1" * 5000 + "}", "(4300 digits)"),
])
def test_malformed_json_is_rejected(text, words):
    with pytest.raises(InvalidInput, match=words) as info:
        parse_sampling_parameters(text)
    assert "sys." not in str(info.value)  # our words, not Python's hint to raise its limit


def test_invalid_input_is_a_value_error():
    assert issubclass(InvalidInput, ValueError)


def test_request_params_are_frozen():
    with pytest.raises(AttributeError):
        RequestParams().max_tokens = 3


def test_stop_strings_are_bounded():
    with pytest.raises(InvalidInput, match="stop"):
        parse_sampling_parameters('{"stop": ["%s"]}' % ("y" * 300000))
    with pytest.raises(InvalidInput, match="stop"):
        parse_sampling_parameters('{"stop": %s}' % str(["s%d" % i for i in range(17)]).replace("'", '"'))


@pytest.mark.parametrize("text, words", [
    ('{"temperature": 1' + "0" * 400 + "}",  # beyond float
     "temperature must be a finite number, got 1.000e400 (an integer of 401 digits)"),
    ('{"top_p": 1' + "0" * 400 + "}", "top_p must be a finite number"),
    ('{"max_tokens": 1e300}', "max_tokens must be a positive integer below 2**31, got 1.000e300 (an integer of 301"),
    ('{"max_tokens": "1_000"}', "max_tokens must be an integer, got '1_000'"),  # Python's int() takes it
    ('{"temperature": "1_0"}', "temperature must be a finite number, got '1_0'"),
    ('{"min_tokens": "4.5"}', "min_tokens must be an integer, got '4.5'"),
])
def test_numbers_python_would_take_or_overflow_on_are_named(text, words):
    with pytest.raises(InvalidInput) as info:
        parse_sampling_parameters(text)
    assert words in str(info.value) and len(str(info.value)) < 120


def test_an_integer_valued_string_counts_as_an_integer():
    assert parse_sampling_parameters('{"max_tokens": "4.0", "min_tokens": "2"}').max_tokens == 4


def test_media_settings_reach_the_families_as_media_options():
    params = parse_sampling_parameters('{"num_frames": "4", "max_tiles": 2, "fps": null}')
    assert (params.fps, params.num_frames, params.max_tiles) == (None, 4, 2)  # fps unset: the family's default
    assert params.media == MediaOptions(num_frames=4, max_tiles=2)
    tiles = parse_sampling_parameters('{"min_tiles": 3, "max_tiles": "8", "dynamic_image_size": "false"}')
    assert tiles.media == MediaOptions(min_tiles=3, max_tiles=8, dynamic_image_size=False)
    pixels = parse_sampling_parameters('{"min_pixels": 200704, "max_pixels": "401408"}')
    assert pixels.media == MediaOptions(max_pixels=401408, min_pixels=200704)


@pytest.mark.parametrize("value", [3135, 16384 * 28 * 28 + 1, 2.5])
def test_min_pixels_is_refused_outside_qwens_range_naming_it(value):
    with pytest.raises(InvalidInput, match="sampling_parameters: min_pixels must be"):
        parse_sampling_parameters(json.dumps({"min_pixels": value}))


def test_vllms_internvl_name_max_dynamic_patch_is_max_tiles():
    for text in ('{"max_tiles": 6}', '{"max_dynamic_patch": 6}', '{"max_tiles": 6, "max_dynamic_patch": "6"}',
                 '{"max_tiles": null, "max_dynamic_patch": 6}', '{"max_tiles": 6, "max_dynamic_patch": null}'):
        assert parse_sampling_parameters(text) == RequestParams(max_tiles=6), text  # null: not given
    with pytest.raises(InvalidInput, match=r"^sampling_parameters: max_tiles 2 and max_dynamic_patch 6 are one "
                                           r"setting \(max_dynamic_patch is vLLM's InternVL name for max_tiles\): "
                                           r"send one, or equal values$"):
        parse_sampling_parameters('{"max_tiles": 2, "max_dynamic_patch": 6}')
    with pytest.raises(InvalidInput, match="^sampling_parameters: max_dynamic_patch must be an integer, got 'many'"):
        parse_sampling_parameters('{"max_dynamic_patch": "many"}')
    with pytest.raises(InvalidInput, match=r"unknown key 'max_dynamic_patches' \(known: .*, max_tiles, min_tiles, "
                                           r"dynamic_image_size, .*, max_dynamic_patch, min_dynamic_patch, "
                                           r"max_patches, min_patches, crop_to_patches, guided_decoding\)$"):
        parse_sampling_parameters('{"max_dynamic_patches": 6}')


@pytest.mark.parametrize("key, alias, value, whose", [
    ("max_tiles", "max_patches", 6, "transformers' InternVL"), ("min_tiles", "min_dynamic_patch", 2, "vLLM's InternVL"),
    ("min_tiles", "min_patches", 2, "transformers' InternVL"),
    ("dynamic_image_size", "crop_to_patches", False, "transformers' InternVL")])
def test_vllms_and_transformers_other_internvl_names_are_its_keys(key, alias, value, whose):
    for sent in ({key: value}, {alias: value}, {key: value, alias: value}, {key: None, alias: value},
                 {key: value, alias: None}):
        assert parse_sampling_parameters(json.dumps(sent)) == RequestParams(**{key: value}), sent
    other = not value if isinstance(value, bool) else value + 1
    with pytest.raises(InvalidInput, match=rf"^sampling_parameters: {key} {other!r} and {alias} {value!r} are one "
                                           rf"setting \({alias} is {whose} name for {key}\): send one"):
        parse_sampling_parameters(json.dumps({key: other, alias: value}))


def test_two_other_names_of_one_key_are_one_setting_too():
    both = '{"max_dynamic_patch": 6, "max_patches": 6, "max_tiles": null}'
    assert parse_sampling_parameters(both) == RequestParams(max_tiles=6)
    with pytest.raises(InvalidInput, match=r"^sampling_parameters: max_dynamic_patch 2 and max_patches 6 are one "
                                           r"setting \(max_dynamic_patch is vLLM's InternVL name for max_tiles, "
                                           r"max_patches is transformers' InternVL name for max_tiles\): send one, "
                                           r"or equal values$"):
        parse_sampling_parameters('{"max_patches": 6, "max_dynamic_patch": 2}')
    with pytest.raises(InvalidInput, match=r"^sampling_parameters: min_tiles 2 and min_patches 3 are one setting"):
        parse_sampling_parameters('{"min_dynamic_patch": 2, "min_tiles": 2, "min_patches": 3}')
