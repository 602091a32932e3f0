"""A reply's max_tokens once its prompt is built (orchestrator.reply_limit)."""
import pytest

from orchestrator.reply_limit import reply_limit
from orchestrator.sampling_params import InvalidInput

LIMITS = dict(default_max_tokens=4096, max_model_len=32768, pool_tokens=65536)


def test_a_sent_max_tokens_is_kept_even_beyond_the_limits_the_length_checks_refuse():
    assert reply_limit(64, 0, 100, **LIMITS) == 64
    assert reply_limit(10**6, 0, 100, **LIMITS) == 10**6


def test_null_is_the_default_max_tokens_where_the_context_has_room():
    assert reply_limit(None, 0, 100, **LIMITS) == 4096


def test_null_is_the_rest_of_the_context_near_its_end():
    assert reply_limit(None, 0, 30000, **LIMITS) == 2768


def test_null_is_what_the_largest_pool_holds_beside_the_prompt():
    assert reply_limit(None, 0, 1000, default_max_tokens=10**6, max_model_len=10**6, pool_tokens=4096) == 3096


def test_a_prompt_that_fills_the_context_gets_one_token_for_the_length_checks_to_refuse():
    assert reply_limit(None, 0, 32768, **LIMITS) == 1
    assert reply_limit(None, 0, 40000, **LIMITS) == 1


def test_min_tokens_above_the_chosen_limit_is_refused_naming_the_limit_that_chose_it():
    assert reply_limit(None, 2768, 30000, **LIMITS) == 2768
    with pytest.raises(InvalidInput) as info:
        reply_limit(None, 2769, 30000, **LIMITS)
    assert str(info.value) == (
        "sampling_parameters: min_tokens 2769 is more than this reply may have without max_tokens: 2768 tokens, the "
        "rest of max_model_len 32768 after the prompt's 30000 tokens; send max_tokens")
    with pytest.raises(InvalidInput, match="5000 is more .*: 4096 tokens, the server's default_max_tokens 4096;"):
        reply_limit(None, 5000, 100, **LIMITS)
    with pytest.raises(InvalidInput, match="137 tokens, what the largest KV pool \\(192 tokens\\) holds beside the "
                                           "prompt's 55 tokens"):
        reply_limit(None, 150, 55, default_max_tokens=4096, max_model_len=300, pool_tokens=192)


def test_a_prompt_that_leaves_no_room_is_left_to_the_length_checks_whatever_min_tokens_asks():
    assert reply_limit(None, 80, 550, default_max_tokens=4096, max_model_len=300, pool_tokens=192) == 1
