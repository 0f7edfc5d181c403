"""KV-page accounting for the rollout engine: which pages of the `KVStore` are free, and who holds each one.

Pages are reference-counted: a page is shared by every running sequence that reuses it as a prefix and by the
radix cache while it is cached; it returns to the free list when the last holder lets go. Page 0 is the null
page of miles-kernels' attention and is never handed out.
"""

from __future__ import annotations

from miles_kernels import NULL_PAGE


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_shared_pages(prompt_length: int, page_size: int, has_draft: bool) -> int:
    """Prompt pages a group's samples share; the rest is copied per sample. With a draft model, the page of the last
    prompt position is always copied: each sample writes its own draft row there (speculative.py)."""
    return (prompt_length - has_draft) // page_size


class OutOfPages(RuntimeError):
    """Raised when an allocation needs more free pages than there are (callers evict or wait first)."""


class PageAllocator:
    """Free list + reference counts over pages 1 .. num_pages - 1."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the KV store needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh pages, each with one reference."""
        if count > len(self._free):
            raise OutOfPages(f"need {count} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add a holder to pages that are already in use."""
        for page in pages:
            assert self._refs[page] > 0, f"retain of free page {page}"
            self._refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one holder from each page; pages nobody holds are free again."""
        for page in pages:
            assert self._refs[page] > 0, f"release of free page {page}"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def reset(self) -> None:
        """Everything free (after the KV store was released or flushed with no request running)."""
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))
        self._refs = [0] * self.num_pages
