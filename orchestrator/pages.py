"""Free-list allocator for the pages of one pool, and what the scheduler needs of any pool (`PagePool`).

KV pages: the orchestrator owns their page tables (docs/design.md, "Ownership and start-up") and grants them with a
`PageAllocator`. Patch pages are taken by flashcodec when a group has been decoded, from a free list
shared between processes (backends/ipc/shared_pages.py), which is a `PagePool` too: the scheduler returns
them. `PageAllocator` is not thread-safe: the orchestrator runs one asyncio loop.
"""

from collections.abc import Iterable
from typing import Protocol


class PagePool(Protocol):
    """A pool's free list as the scheduler uses it: counts (pages) and `free` (ValueError on a double free)."""

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...

    def free(self, pages: Iterable[int]) -> None: ...


class PageAllocator:
    """Grants page indices `0 .. num_pages - 1` of one pool, all or nothing.

    Args:
        num_pages: pages in the pool (>= 1).
        name: pool name used in error messages and stats (e.g. "kv_pool", "patch_pool").

    Raises:
        ValueError: `num_pages` is not a positive integer.
    """

    def __init__(self, num_pages: int, name: str) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"{name}: num_pages must be a positive integer, got {num_pages!r}")
        self.name = name
        self._num_total = num_pages
        # Popped from the end, so the first grants are pages 0, 1, 2, ... and freed pages are reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages not granted (pages)."""
        return len(self._free)

    @property
    def num_total(self) -> int:
        """Pages in the pool (pages)."""
        return self._num_total

    def allocate(self, n: int) -> list[int] | None:
        """Grants `n` pages.

        Returns:
            `n` distinct page indices, or None (and nothing granted) when fewer than `n` are free.

        Raises:
            ValueError: `n` is negative or not an integer.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n!r} pages")
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        pages.reverse()
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Returns granted pages to the pool; all of them or, on error, none.

        Raises:
            ValueError: a page is not currently granted (double free, unknown page, or listed twice).
        """
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if page not in self._used or page in seen:
                raise ValueError(f"{self.name}: page {page!r} is not allocated (double free or unknown page)")
            seen.add(page)
        self._used.difference_update(pages)
        self._free.extend(pages)

    def __repr__(self) -> str:
        return f"PageAllocator({self.name!r}, free={self.num_free}/{self.num_total})"
