"""Pure logic: KV page accounting and the radix prefix cache (sharing, LRU eviction, pages in use are safe)."""

from __future__ import annotations

import pytest

from miles_rollout.page_allocator import OutOfPages, PageAllocator
from miles_rollout.radix_cache import RadixCache


def test_allocator_counts_and_refuses_overallocation() -> None:
    allocator = PageAllocator(5)
    pages = allocator.allocate(3)
    assert pages == [1, 2, 3] and allocator.num_free == 1  # page 0 is the null page, never handed out
    with pytest.raises(OutOfPages, match="need 2 KV pages, 1 free"):
        allocator.allocate(2)
    allocator.retain([2])
    allocator.release(pages)
    assert allocator.num_free == 3 and allocator.refs(2) == 1
    allocator.release([2])
    assert allocator.num_free == 4
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(1)


def test_radix_match_insert_and_sharing() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(allocator, page_size=2)
    pages = allocator.allocate(3)
    tokens = [1, 2, 3, 4, 5, 6, 7]  # 3 full pages + 1 token
    cache.insert(tokens, pages)
    allocator.release(pages)  # the sequence finished: only the cache holds them now
    assert cache.num_cached_pages == 3 and all(allocator.refs(p) == 1 for p in pages)
    hit = cache.match([1, 2, 3, 4, 9, 9])
    assert hit == pages[:2] and all(allocator.refs(p) == 2 for p in hit)  # the caller holds a reference
    assert cache.match([2, 1]) == []
    assert cache.match([1]) == []  # only whole pages are shared
    allocator.release(hit)


def test_eviction_is_lru_and_never_touches_pages_in_use() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(allocator, page_size=2)
    a, b = allocator.allocate(2), allocator.allocate(2)
    cache.insert([1, 1, 2, 2], a)
    cache.insert([3, 3, 4, 4], b)
    allocator.release(a + b)
    in_use = cache.match([3, 3, 4, 4])  # a running request holds b
    allocator.release(cache.match([1, 1]))  # touch a's first page; a is still the only evictable branch
    assert cache.num_evictable() == 2
    assert cache.evict(10) == 2  # a's two pages (leaf first, then its parent), never b's
    assert cache.num_cached_pages == 2 and cache.match([3, 3, 4, 4]) == b
    allocator.release(b)
    allocator.release(in_use)
    assert cache.evict(10) == 2 and allocator.num_free == 15


def test_evictable_count_respects_descendants_in_use() -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(allocator, page_size=1)
    pages = allocator.allocate(3)
    cache.insert([1, 2, 3], pages)
    allocator.release(pages[:2])  # the deepest page is still held by its sequence
    assert cache.num_evictable() == 0  # its ancestors cannot go before it
    assert cache.evict(3) == 0
    allocator.release(pages[2:])
    assert cache.num_evictable() == 3
    cache.reset()
    assert allocator.num_free == 7
