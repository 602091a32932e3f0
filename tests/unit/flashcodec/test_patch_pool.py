"""Paged patch pool: groups written over any free pages read back unchanged; the PV_* layout of many groups."""
import pytest
import torch

from flashcodec.patch_pool import pages_needed, pv_layout, read_group, write_group


def test_pages_needed():
    assert [pages_needed(n, 256) for n in (0, 1, 256, 257, 920)] == [0, 1, 1, 2, 4]
    with pytest.raises(ValueError):
        pages_needed(-1, 256)


def test_round_trip_on_non_contiguous_pages():
    pool = torch.zeros(10, 16, 1176)
    patches = torch.randn(40, 1176)  # 2.5 pages
    pages = [7, 2, 5]
    write_group(pool, pages, patches)
    torch.testing.assert_close(read_group(pool, pages, 40), patches, atol=0, rtol=0)
    assert torch.equal(pool[2], patches[16:32]) and torch.equal(pool[5, :8], patches[32:])
    untouched = [p for p in range(10) if p not in pages]
    assert not pool[untouched].any() and not pool[5, 8:].any()


def test_two_groups_share_a_pool():
    pool = torch.zeros(8, 4, 1176)
    a, b = torch.randn(6, 1176), torch.randn(3, 1176)
    write_group(pool, [3, 0], a)
    write_group(pool, [6], b)
    assert torch.equal(read_group(pool, [3, 0], 6), a) and torch.equal(read_group(pool, [6], 3), b)


@pytest.mark.parametrize("pages, message", [([1], "need 2 pages"), ([1, 1], "distinct"), ([1, 9], r"in \[0, 8\)")])
def test_pages_that_cannot_hold_the_group(pages, message):
    pool = torch.zeros(8, 4, 1176)
    with pytest.raises(ValueError, match=message):
        write_group(pool, pages, torch.randn(6, 1176))
    with pytest.raises(ValueError, match=message):
        read_group(pool, pages, 6)


def test_wrong_shapes():
    with pytest.raises(ValueError, match="patches must be"):
        write_group(torch.zeros(4, 4, 1176), [0], torch.zeros(4, 100))
    with pytest.raises(ValueError, match="pool must be"):
        read_group(torch.zeros(4, 1176), [0], 1)


def test_pv_layout():
    layout = pv_layout([([4, 1], 5), ([0], 3), ([7, 2, 3], 9)], page_size=4)
    assert layout.PV_indptr.tolist() == [0, 2, 3, 6]
    assert layout.PV_page_indices.tolist() == [4, 1, 0, 7, 2, 3]
    assert layout.PV_cu_page_len.tolist() == [0, 5, 8, 17]
    assert {t.dtype for t in (layout.PV_indptr, layout.PV_page_indices, layout.PV_cu_page_len)} == {torch.int32}
    assert pv_layout([([5, 6, 9], 4)], page_size=4).PV_page_indices.tolist() == [5]  # spare pages not listed
    with pytest.raises(ValueError, match="need 2 pages"):
        pv_layout([([1], 5)], page_size=4)
