"""A checkpoint's generation_config.json as its requests' default sampling (orchestrator.generation_defaults)."""
import json

import pytest
from transformers import GenerationConfig

from orchestrator.generation_defaults import GenerationDefaults, generation_defaults
from orchestrator.sampling_params import parse_sampling_parameters


def test_the_keys_set_apart_from_transformers_defaults_become_the_defaults(tmp_path):
    """An Instruct checkpoint's kind of file: near-greedy sampling and a repetition penalty; its token ids and
    do_sample are not sampling defaults. transformers 5 leaves the sampling keys unset by default, so a value the
    file gives may be taken even where it equals the built-in one (temperature 1.0: no change; transformers 4 left
    it out of the diff)."""
    GenerationConfig(do_sample=True, temperature=0.1, top_p=0.001, top_k=1, repetition_penalty=1.05,
                     bos_token_id=1, eos_token_id=[2, 3]).save_pretrained(tmp_path)
    assert generation_defaults(str(tmp_path)) == GenerationDefaults(
        {"temperature": 0.1, "top_p": 0.001, "top_k": 1, "repetition_penalty": 1.05})
    GenerationConfig(do_sample=True, temperature=1.0, min_p=0.05).save_pretrained(tmp_path)
    defaults = generation_defaults(str(tmp_path)).sampling
    assert defaults.keys() <= {"temperature", "min_p"} and defaults.get("temperature", 1.0) == 1.0
    assert defaults["min_p"] == 0.05


def test_none_no_checkpoint_or_no_file_give_no_defaults(tmp_path):
    GenerationConfig(do_sample=True, temperature=0.1).save_pretrained(tmp_path)
    assert generation_defaults(str(tmp_path), "none") == GenerationDefaults()
    assert generation_defaults(None) == GenerationDefaults()
    assert generation_defaults(str(tmp_path / "elsewhere")) == GenerationDefaults()


def test_max_new_tokens_caps_a_reply_without_max_tokens_as_vllm_takes_it(tmp_path):
    GenerationConfig(do_sample=True, top_k=1, max_new_tokens=7).save_pretrained(tmp_path)
    assert generation_defaults(str(tmp_path)) == GenerationDefaults({"top_k": 1}, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="generation_config.json: cannot be read .*max_new_tokens"):
        generation_defaults(str(tmp_path))  # transformers' check
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2**31}))
    with pytest.raises(ValueError, match="generation_config.json: sampling_parameters: max_new_tokens must be a "
                                         "positive integer below 2\\*\\*31"):
        generation_defaults(str(tmp_path))  # ours


def test_another_setting_or_a_value_no_request_may_send_stops_the_start_naming_it(tmp_path):
    with pytest.raises(ValueError, match="parameter generation_config must be auto or none, got 'vllm'"):
        generation_defaults(str(tmp_path), "vllm")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError) as refused:
        generation_defaults(str(tmp_path))
    assert "generation_config.json: sampling_parameters: top_p must be in (0, 1], got 1.5" in str(refused.value)
    assert "generation_config=none" in str(refused.value)
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "generation_config.json").write_text(text)
        with pytest.raises(ValueError, match="generation_config.json: cannot be read"):
            generation_defaults(str(tmp_path))


def test_a_requests_own_values_win_over_the_defaults():
    defaults = {"temperature": 0.1, "top_k": 1}
    assert parse_sampling_parameters(None, defaults=defaults).temperature == 0.1
    params = parse_sampling_parameters('{"temperature": 0.8, "max_tokens": 5}', defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.8, 1, 5)
