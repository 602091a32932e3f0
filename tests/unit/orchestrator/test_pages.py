import pytest

from orchestrator.pages import PageAllocator


def test_allocate_grants_distinct_pages_until_the_pool_is_empty():
    alloc = PageAllocator(8, "kv_pool")
    first = alloc.allocate(3)
    second = alloc.allocate(5)
    assert sorted(first + second) == list(range(8))
    assert alloc.num_free == 0 and alloc.num_total == 8
    assert alloc.allocate(0) == []


def test_allocate_is_all_or_nothing():
    alloc = PageAllocator(4, "kv_pool")
    alloc.allocate(3)
    assert alloc.allocate(2) is None
    assert alloc.num_free == 1
    assert len(alloc.allocate(1)) == 1


def test_freed_pages_are_granted_again():
    alloc = PageAllocator(4, "patch_pool")
    pages = alloc.allocate(4)
    alloc.free(pages[:2])
    assert alloc.num_free == 2
    assert sorted(alloc.allocate(2)) == sorted(pages[:2])


@pytest.mark.parametrize("bad", [[0], [7], [-1], [1, 1]])
def test_free_rejects_double_free_and_unknown_pages_and_frees_nothing(bad):
    alloc = PageAllocator(4, "kv_pool")
    alloc.allocate(2)  # pages 0 and 1
    alloc.free([0])
    with pytest.raises(ValueError, match="kv_pool"):
        alloc.free(bad)
    assert alloc.num_free == 3


def test_failed_free_leaves_the_valid_pages_granted():
    alloc = PageAllocator(4, "kv_pool")
    pages = alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.free([pages[0], 99])
    assert alloc.num_free == 2
    alloc.free(pages)
    assert alloc.num_free == 4


@pytest.mark.parametrize("num_pages", [0, -3, 2.5, True, "4"])
def test_pool_size_must_be_a_positive_integer(num_pages):
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages, "kv_pool")


@pytest.mark.parametrize("n", [-1, 1.5, None])
def test_allocate_rejects_bad_counts(n):
    with pytest.raises(ValueError):
        PageAllocator(4, "kv_pool").allocate(n)
