"""The KV pool sized as a share of free GPU memory: the parameter, the arithmetic, and the CPU's refusal."""
import pytest
import torch

from backends.ipc.protocol import RESERVED_KV_PAGES
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.stages.kv_pool_size import memory_fraction, pages_for_memory

CUDA = torch.device("cuda", 0)  # the parameter is only parsed here: nothing touches the GPU


def test_pages_are_the_share_of_free_memory_over_a_page_less_the_reserved_page():
    # 7B in bfloat16: 28 layers x (K, V) x 16 tokens x 4 KV heads x 128 x 2 bytes = 917,504 bytes per page
    page = KVCacheLayout(num_layers=28, num_pages=1, page_size=16, num_kv_heads=4, head_dim=128,
                         dtype=torch.bfloat16).page_bytes
    assert page == 917_504
    free = 120 * 2**30
    pages = pages_for_memory(free, 0.6, page)
    assert pages == int(0.6 * free) // page - RESERVED_KV_PAGES == 84_259
    assert (pages + RESERVED_KV_PAGES) * page <= 0.6 * free < (pages + RESERVED_KV_PAGES + 1) * page


def test_a_share_too_small_for_one_page_is_refused_with_the_figures():
    with pytest.raises(ValueError, match=r"kv_memory_fraction 0.01 of 0.00 GiB free holds no KV page of 0.88 MiB"):
        pages_for_memory(1_000_000, 0.01, 917_504)
    assert pages_for_memory(2 * 917_504, 1.0, 917_504) == 2 - RESERVED_KV_PAGES


@pytest.mark.parametrize("value, fraction", [("", None), ("  ", None), ("0.6", 0.6), (" 0.25 ", 0.25)])
def test_the_parameter_is_a_fraction_or_empty(value, fraction):
    assert memory_fraction({"kv_memory_fraction": value}, CUDA) == fraction
    assert memory_fraction({}, CUDA) is None


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2", "half"])
def test_anything_else_is_refused_naming_the_parameter(value):
    with pytest.raises(ValueError, match="parameter kv_memory_fraction must be"):
        memory_fraction({"kv_memory_fraction": value}, CUDA)


def test_on_the_cpu_a_fraction_is_refused_with_what_to_set_instead():
    with pytest.raises(ValueError, match="decode runs on cpu: set kv_pages instead"):
        memory_fraction({"kv_memory_fraction": "0.5"}, torch.device("cpu"))
    assert memory_fraction({"kv_memory_fraction": ""}, torch.device("cpu")) is None
