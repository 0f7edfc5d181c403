"""Radix prefix cache over KV pages (page granularity, as SGLang's radix cache with page_size > 1).

Each tree edge is one full page of token ids; its node holds the page that stores their K/V. A new request
walks the tree with its prompt and reuses every matching page (its `cached_tokens`), so a shared system prompt
or the prompt of `n` samples is computed once. The cache holds one reference on each cached page; eviction
drops least-recently-used leaves whose page nobody else holds, so pages in use are never evicted.

K/V computed under a LoRA adapter belongs to that adapter: every adapter (by its id, served_loras.py) has a tree of
its own, the base model's the `None` one, so requests of different adapters never share a page (SGLang keys its
radix tree by `lora_id` for the same reason).
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
        self._roots: dict[str | None, _Node] = {None: self.root}  # a tree per LoRA adapter id, None: the base model
        self._clock = itertools.count(1)
        self.num_cached_pages = 0

    def _chunks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        size = self.page_size
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens) - size + 1, size)]

    def match(self, tokens: list[int], adapter: str | None = None) -> list[int]:
        """Pages of the longest cached page-aligned prefix of `tokens` computed under `adapter` (None: the base
        model); a reference is added for the caller."""
        node, pages = self._roots.get(adapter) or _Node(page=-1, parent=None, key=()), []
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

    def insert(self, tokens: list[int], pages: list[int], adapter: str | None = None) -> None:
        """Cache the full pages of `tokens` (pages[i] holds tokens[i*P:(i+1)*P]) computed under `adapter`; the cache
        takes a reference."""
        node = self._roots.setdefault(adapter, _Node(page=-1, parent=None, key=()))
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
            is_root = node.parent is None
            is_free &= is_root or self.allocator.refs(node.page) == 1
            return total + (1 if is_free and not is_root else 0), is_free

        return sum(count(root)[0] for root in self._roots.values())

    def reset(self) -> None:
        """Drop every cached page (after a weight update, cached K/V are stale)."""
        for node in list(self._nodes()):
            self.allocator.release([node.page])
        self.root.children.clear()
        self._roots = {None: self.root}
        self.num_cached_pages = 0

    def forget_adapter(self, adapter: str) -> None:
        """Drop the pages cached under `adapter` (it is no longer served)."""
        root = self._roots.pop(adapter, None)
        for node in self._nodes([root]) if root is not None else []:
            self.allocator.release([node.page])
            self.num_cached_pages -= 1

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key]
        self.allocator.release([node.page])
        self.num_cached_pages -= 1

    def _nodes(self, roots: list[_Node] | None = None) -> list[_Node]:
        """Every node under `roots` (default: every tree's), roots excluded."""
        out: list[_Node] = []
        trees = list(self._roots.values()) if roots is None else roots
        stack = [child for root in trees for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
