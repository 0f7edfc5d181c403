"""Radix prefix cache over KV pages (page granularity, as SGLang's radix cache with page_size > 1).

Each tree edge is one full page of token ids; its node holds the page that stores their K/V. A new request
walks the tree with its prompt and reuses every matching page (its `cached_tokens`), so a shared system prompt
or the prompt of `n` samples is computed once. The cache holds one reference on each cached page; eviction
drops least-recently-used leaves whose page nobody else holds, so pages in use are never evicted.

K/V computed under a LoRA adapter belongs to that adapter: every adapter (by its id, served_loras.py) has a tree of
its own, the base model's the `None` one, so requests of different adapters never share a page (SGLang keys its
radix tree by `lora_id` for the same reason).

Eviction does not walk the tree: leaves wait in a heap by last use (SGLang's `evict` over a heap of leaves), with
stale entries skipped when they come up (a leaf touched since, grown children, or gone) and a parent pushed when its
last child goes. The admission's question, whether enough pages could be evicted, walks only until the answer is
known (`num_evictable(at_least=...)`): a full walk costs time in proportion to the cache, and a full cache would
pay it at every page it hands out and every admission.
"""

from __future__ import annotations

import heapq
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
        # eviction candidates: (last use, push order, node); an entry whose node was touched since, has children or
        # left the tree is stale and skipped when popped
        self._heap: list[tuple[int, int, _Node]] = []
        self._pushes = itertools.count()

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
        self._push_leaf(node)
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
        self._push_leaf(node)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages held only by the cache, least recently used leaves first (a parent whose last
        child goes is a leaf, and a candidate, from then on)."""
        freed, held = 0, []
        while freed < num_pages and self._heap:
            entry = heapq.heappop(self._heap)
            used, _, node = entry
            if used != node.last_used or node.children or not self._is_cached(node):
                continue  # stale: touched since (a newer entry exists), grown children, or gone
            if self.allocator.refs(node.page) != 1:
                held.append(entry)  # a sequence holds it: a candidate again once it lets go
                continue
            self._remove(node)
            freed += 1
        for entry in held:
            heapq.heappush(self._heap, entry)
        return freed

    def num_evictable(self, at_least: int | None = None) -> int:
        """Pages `evict` can free now: nodes whose whole subtree is held by the cache alone. With `at_least`, the
        count stops once it gets there (a lower bound then): what an admission needs to know, without walking a
        full cache."""
        total = 0
        for root in self._roots.values():
            # post-order, iteratively: the path from the root, each node's children left to visit, and whether its
            # subtree is free so far
            path, pending, free = [root], [iter(root.children.values())], [True]
            while path:
                child = next(pending[-1], None)
                if child is not None:
                    path.append(child)
                    pending.append(iter(child.children.values()))
                    free.append(True)
                    continue
                node, is_free = path.pop(), free.pop()
                pending.pop()
                if not path:
                    break  # the root: it holds no page
                is_free = is_free and self.allocator.refs(node.page) == 1
                total += is_free
                if at_least is not None and total >= at_least:
                    return total
                free[-1] = free[-1] and is_free
        return total

    def reset(self) -> None:
        """Drop every cached page (after a weight update, cached K/V are stale)."""
        for node in list(self._nodes()):
            self.allocator.release([node.page])
        self.root.children.clear()
        self._roots = {None: self.root}
        self.num_cached_pages = 0
        self._heap = []

    def forget_adapter(self, adapter: str) -> None:
        """Drop the pages cached under `adapter` (it is no longer served)."""
        root = self._roots.pop(adapter, None)
        for node in self._nodes([root]) if root is not None else []:
            self.allocator.release([node.page])
            self.num_cached_pages -= 1
        self._rebuild_heap()  # its nodes' entries would look cached to `_is_cached` (their parents still hold them)

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        self.allocator.release([node.page])
        self.num_cached_pages -= 1
        self._push_leaf(parent)

    def _push_leaf(self, node: _Node) -> None:
        """`node` is an eviction candidate under its current last use, if it is a leaf (not a root)."""
        if node.children or node.parent is None:
            return
        if len(self._heap) > 2 * self.num_cached_pages + 1024:  # mostly stale entries: start over from the leaves
            self._rebuild_heap()  # `node` among them (it is in its tree)
            return
        heapq.heappush(self._heap, (node.last_used, next(self._pushes), node))

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_used, next(self._pushes), n) for n in self._nodes() if not n.children]
        heapq.heapify(self._heap)

    def _is_cached(self, node: _Node) -> bool:
        """`node` is still in a served tree (its parent's child, up to a root of `_roots`; reset and forget_adapter
        rebuild the heap, so an entry's node can only have left through `_remove`, which unlinks it)."""
        return node.parent is not None and node.parent.children.get(node.key) is node

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
