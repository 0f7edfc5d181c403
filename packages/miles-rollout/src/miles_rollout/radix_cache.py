"""Radix prefix cache over KV pages (page granularity, as SGLang's radix cache with page_size > 1).

Each tree edge is one full page of token ids; its node holds the page that stores their K/V. A new request
walks the tree with its prompt and reuses every matching page (its `cached_tokens`), so a shared system prompt
or the prompt of `n` samples is computed once. The cache holds one reference on each cached page; eviction
drops least-recently-used leaves whose page nobody else holds, so pages in use are never evicted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from miles_rollout.page_allocator import PageAllocator


@dataclass
class _Node:
    page: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class RadixCache:
    """Maps page-aligned token prefixes to the KV pages that hold them."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node(page=-1, parent=None, key=())
        self._clock = itertools.count(1)
        self.num_cached_pages = 0

    def _chunks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        size = self.page_size
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens) - size + 1, size)]

    def match(self, tokens: list[int]) -> list[int]:
        """Pages of the longest cached page-aligned prefix of `tokens` (a reference is added for the caller)."""
        node, pages = self.root, []
        now = next(self._clock)
        for chunk in self._chunks(tokens):
            child = node.children.get(chunk)
            if child is None:
                break
            child.last_used = now
            pages.append(child.page)
            node = child
        self.allocator.retain(pages)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Cache the full pages of `tokens` (pages[i] holds tokens[i*P:(i+1)*P]); the cache takes a reference."""
        node = self.root
        now = next(self._clock)
        for chunk, page in zip(self._chunks(tokens), pages, strict=False):
            child = node.children.get(chunk)
            if child is None:
                child = _Node(page=page, parent=node, key=chunk)
                node.children[chunk] = child
                self.allocator.retain([page])
                self.num_cached_pages += 1
            child.last_used = now
            node = child

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages held only by the cache, least recently used leaves first."""
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self._nodes() if not n.children and self.allocator.refs(n.page) == 1]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_used):
                if freed >= num_pages:
                    break
                self._remove(leaf)
                freed += 1
        return freed

    def num_evictable(self) -> int:
        """Pages `evict` can free now: nodes whose whole subtree is held by the cache alone."""

        def count(node: _Node) -> tuple[int, bool]:
            total, is_free = 0, True
            for child in node.children.values():
                child_total, child_free = count(child)
                total += child_total
                is_free &= child_free
            is_free &= node is self.root or self.allocator.refs(node.page) == 1
            return total + (1 if is_free and node is not self.root else 0), is_free

        return count(self.root)[0]

    def reset(self) -> None:
        """Drop every cached page (after a weight update, cached K/V are stale)."""
        for node in list(self._nodes()):
            self.allocator.release([node.page])
        self.root.children.clear()
        self.num_cached_pages = 0

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key]
        self.allocator.release([node.page])
        self.num_cached_pages -= 1

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
