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


def _reference_evictable(cache: RadixCache, allocator: PageAllocator) -> tuple[int, list[tuple[int, int]]]:
    """By brute force: the nodes whose whole subtree only the cache holds, and the evictable leaves as (last use,
    page)."""
    count, leaves = 0, []

    def visit(node: object) -> bool:  # whether the subtree is free
        nonlocal count
        children = list(node.children.values())  # type: ignore[attr-defined]
        free = all([visit(child) for child in children])
        free = free and allocator.refs(node.page) == 1  # type: ignore[attr-defined]
        count += free
        if free and not children:
            leaves.append((node.last_used, node.page))  # type: ignore[attr-defined]
        return free

    for root in cache._roots.values():
        for child in root.children.values():
            visit(child)
    return count, leaves


def test_eviction_matches_a_brute_force_lru_under_random_traffic() -> None:
    """Random inserts, matches, holds and releases over two adapters' trees: every count is the brute force's, a
    count with `at_least` is a lower bound that answers the same question, and each eviction frees exactly the least
    recently used evictable leaf (a parent a candidate once its last child is gone), never a page in use."""
    import random

    rng = random.Random(0)
    allocator = PageAllocator(257)
    cache = RadixCache(allocator, page_size=2)
    held: list[list[int]] = []
    evicted = skipped_held = 0
    for step in range(3000):
        adapter = rng.choice([None, None, "a"])
        tokens = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]
        action = rng.random()
        if action < 0.35 and allocator.num_free >= len(tokens) // 2:  # a finished sequence caches its pages
            matched = cache.match(tokens, adapter)
            pages = matched + allocator.allocate(len(tokens) // 2 - len(matched))
            cache.insert(tokens, pages, adapter)
            (held.append(pages) if rng.random() < 0.3 else allocator.release(pages))
        elif action < 0.55:  # a running sequence holds a cached prefix
            held.append(cache.match(tokens, adapter))
        elif action < 0.75 and held:
            allocator.release(held.pop(rng.randrange(len(held))))
        else:
            count, leaves = _reference_evictable(cache, allocator)
            assert cache.num_evictable() == count
            target = rng.randrange(1, 8)
            bounded = cache.num_evictable(at_least=target)
            assert bounded <= count and (bounded >= target) == (count >= target)
            for _ in range(rng.randrange(1, 4)):
                _, leaves = _reference_evictable(cache, allocator)
                free_before = allocator.num_free
                freed = cache.evict(1)
                assert freed == (1 if leaves else 0)
                if leaves:
                    page = min(leaves)[1]
                    assert allocator.refs(page) == 0 and allocator.num_free == free_before + 1
                    evicted += 1
                    skipped_held += any(allocator.refs(p) > 1 for pages in held for p in pages)
        if step % 500 == 499:
            cache.forget_adapter("a")
    assert evicted > 200 and skipped_held > 0  # the traffic filled the cache and evicted under it
    for pages in held:
        allocator.release(pages)
    cached = cache.num_cached_pages
    assert cache.evict(10_000) == cached and cache.num_cached_pages == 0
    assert allocator.num_free == allocator.num_pages - 1  # every page back: nothing leaked, nothing freed twice


def test_eviction_stays_lru_after_many_stale_heap_entries() -> None:
    """Touching one prefix thousands of times leaves stale heap entries behind; the heap is rebuilt from the leaves
    (it stays bounded) and eviction still takes the least recently used leaf first."""
    allocator = PageAllocator(8)
    cache = RadixCache(allocator, page_size=1)
    old, hot = allocator.allocate(1), allocator.allocate(1)
    cache.insert([1], old)
    cache.insert([2], hot)
    allocator.release(old + hot)
    for _ in range(3000):
        allocator.release(cache.match([2, 9]))  # a hit on the hot page
    assert len(cache._heap) <= 2 * cache.num_cached_pages + 1024
    assert cache.evict(1) == 1 and allocator.refs(old[0]) == 0 and allocator.refs(hot[0]) == 1
    assert cache.evict(1) == 1 and cache.num_cached_pages == 0
