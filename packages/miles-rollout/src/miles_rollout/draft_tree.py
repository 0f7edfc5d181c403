"""A sequence's draft tree for one verify step (SGLang's EAGLE with `speculative_eagle_topk > 1`), and where its rows'
keys live during the verify forward (docs/architecture.md, "Speculative decoding").

Node 0 is the root: the sequence's last sampled token x_n, at position n. Every other node is a draft token at
position n + its depth, child of the token before it. Nodes are kept in depth-first order (children in the draft's
order of preference), so each root-to-leaf path — a *branch* — brings its own nodes as one contiguous run: branch
0 is the first path, branch b the nodes that the b-th leaf's path does not share with an earlier branch. A chain
(topk 1) is the tree with one branch.

Verify with tree attention, bit for bit what plain decoding computes: each branch is a sequence of its own in the
attention batch, its keys at its tokens' true positions. Branch 0 writes into the sequence's own pages; branch b
reads the pages of the branch it leaves, up to the page where it diverges, and writes from there into scratch
pages (the partial page copied from that branch's first). A node's K/V also goes, by copy writes, to every page
that another branch through it reads at its position. So every row attends over exactly the keys, at exactly the
slots, that the same token would see decoding one token at a time: the verify rows are plain decode rows.

Acceptance (`accept_path`) walks down from the root: the target's own sample at a node (drawn with the row's
per-(seed, position) noise, as without a draft) is emitted; if a child of the node holds that token, the walk goes
on from it, else it stops. Every emitted token is the target's sample, so the output equals decoding without a
draft; the draft only decides how many tokens one step emits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Branch:
    """One root-to-leaf path's own rows in the verify forward."""

    first: int  # its first own node (depth-first index); its own nodes are first .. the next branch's first - 1
    prefix: int  # position of that node: the keys before it come from the pages below
    table: list[int]  # page table over its path's positions
    scratch: list[int] = field(default_factory=list)  # its own scratch pages (released after the step)


@dataclass
class DraftTree:
    """Draft tokens as a tree over the root x_n (node 0), nodes in depth-first order."""

    tokens: list[int]
    parents: list[int]  # parents[0] = -1

    def __post_init__(self) -> None:
        self.depths = [0] * len(self.tokens)
        self.children: list[list[int]] = [[] for _ in self.tokens]
        for node in range(1, len(self.tokens)):
            parent = self.parents[node]
            assert 0 <= parent < node, "nodes are in depth-first order: a parent comes before its children"
            self.depths[node] = self.depths[parent] + 1
            self.children[parent].append(node)
        self.branches: list[Branch] = []

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> DraftTree:
        """A chain of drafts (topk 1)."""
        return cls([root, *drafts], [-1, *range(len(drafts))])

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def drafted(self, node: int) -> list[int]:
        """The draft tokens from the root to `node` (the root excluded): what the row at `node` samples after."""
        return [self.tokens[v] for v in self.path_nodes(node)[1:]]

    def leaves(self) -> list[int]:
        return [node for node, kids in enumerate(self.children) if not kids]

    def branch_of(self, node: int) -> int:
        """The branch whose own rows hold `node`."""
        return max(b for b, branch in enumerate(self.branches) if branch.first <= node)

    def lay_out(self, n: int, pages: list[int], page_size: int, take: Callable[[int], list[int]]) -> None:
        """The verify forward's branches for the root at position n on the sequence's `pages` (which cover every
        branch-0 position): branch 0 on `pages`, each other branch on the pages it shares below its divergence and
        `take(count)` scratch pages from there to its leaf."""
        self.branches = []
        first = 0
        for leaf in self.leaves():
            if self.branches:
                parent_branch = self.branches[self.branch_of(self.parents[first])]
                prefix = n + self.depths[first]
                shared = prefix // page_size
                count = (n + self.depths[leaf]) // page_size + 1 - shared
                scratch = take(count)
                self.branches.append(Branch(first, prefix, parent_branch.table[:shared] + scratch, scratch))
            else:
                self.branches.append(Branch(0, n, pages))
            first = leaf + 1

    def page_copies(self, page_size: int) -> list[tuple[int, int]]:
        """(source, target) pages to copy before the forward: a branch's first scratch page starts as the page it
        replaces (the prefix's keys at the positions before the branch, the ancestors' rewritten by copy writes)."""
        out = []
        for branch in self.branches[1:]:
            index = branch.prefix // page_size
            if branch.prefix % page_size:
                source = self.branches[self.branch_of(self.parents[branch.first])].table[index]
                out.append((source, branch.table[index]))
        return out

    def copy_writes(self, n: int, page_size: int) -> list[tuple[int, int, int]]:
        """(node, page, offset): each node's K/V written also where another branch through it reads its position."""
        if len(self.branches) < 2:  # a chain writes its rows where it reads them
            return []
        paths = [(branch.table, set(self.path_nodes(leaf))) for branch, leaf in zip(self.branches, self.leaves(),
                                                                                      strict=True)]  # fmt: skip
        out = []
        for node in range(len(self.tokens)):
            position = n + self.depths[node]
            index, offset = position // page_size, position % page_size
            own = self.branches[self.branch_of(node)].table[index]
            readers = {table[index] for table, nodes in paths if node in nodes}
            out += [(node, page, offset) for page in sorted(readers - {own})]
        return out

    def path_nodes(self, node: int) -> list[int]:
        """The nodes from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def own_lengths(self) -> list[int]:
        """Rows of each branch (its own nodes)."""
        starts = [branch.first for branch in self.branches] + [len(self.tokens)]
        return [end - start for start, end in itertools.pairwise(starts)]

    def accept_path(self, targets: list[int]) -> list[int]:
        """The nodes the verify step keeps, root first: from the root, go to the child that holds the target's
        sample at the current node while there is one (`targets[node]`: the target's sample at each node's row)."""
        path = [0]
        while True:
            node = path[-1]
            nxt = next((c for c in self.children[node] if self.tokens[c] == targets[node]), None)
            if nxt is None:
                return path
            path.append(nxt)

    def pages_to_keep(self, path: list[int], page_size: int, n: int, pages: list[int]) -> list[tuple[int, int]]:
        """(source, target) page copies that put the accepted path's keys into the sequence's own pages: the pages of
        the branch that holds its last node, where they differ from `pages`."""
        table = self.branches[self.branch_of(path[-1])].table
        last = (n + self.depths[path[-1]]) // page_size
        return [(table[i], pages[i]) for i in range(n // page_size, last + 1) if table[i] != pages[i]]

    def scratch_pages(self) -> list[int]:
        return [page for branch in self.branches for page in branch.scratch]
