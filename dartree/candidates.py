"""One candidate tree from both sources: the drafter's tree and the lookup's continuations.

Paths merge where their tokens agree. Every edge (parent -> child) gets one number on one
scale: p, the probability that the target accepts the child given that it accepted the parent,
read from an `AcceptanceCalibrator` that learns, online, how often edges of each kind were
accepted:
  - a drafter edge by its step probability q = exp(score_child - score_parent) and depth;
  - a lookup edge by its effective match length (the suffix matched + the depth: a copy that has
    held for longer holds on), the share of the parent's continuations that take this child,
    whether more than one continuation does, and whether they all come from the store (earlier
    requests' outputs: a match there says less about this text than one in its own context, and
    sharing the context's kinds had them verified at the context's rates);
  - an edge both propose: 1 - (1 - p_drafter)(1 - p_lookup).
A node's estimate P is the product of p along its path, so P never grows with depth and the N
nodes of largest P form a tree; the target is expected to accept 1 + (their sum) tokens (the
bonus counted). `CandidateTree.select(n)` is the round's `DraftTree` (parents first).
"""

from __future__ import annotations

import bisect
import functools
import math

import torch

from .lookup import Continuation
from .tree import DraftTree

DRAFTER, LOOKUP = 1, 2  # source bits of a node
SOURCE_NAMES = {DRAFTER: "drafter", LOOKUP: "lookup", DRAFTER | LOOKUP: "both"}

_Q_EDGES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # drafter step probability bins
_MAX_DEPTH_BIN = 4
_MATCH_EDGES = (12, 20)  # effective match lengths past 8 binned 9-12, 13-20, 21 and more
_SHARE_EDGES = (0.5, 0.999)


class AcceptanceCalibrator:
    """Beta estimates of edge acceptance, one per kind of edge, learned from verified rounds.

    prior: pseudo-observations behind each kind's initial guess; max_count: a kind's counts are
    halved past this many observations, so the estimates follow the text (a window of a few
    hundred edges of that kind).
    """

    def __init__(self, prior: float = 2.0, max_count: float = 256.0):
        self.prior, self.max_count = prior, max_count
        self._cells: dict[tuple, list[float]] = {}  # kind -> [accepted, observed]
        self._p: dict[tuple, float] = {}  # kind -> p, until the next observation

    @staticmethod
    def drafter_kind(q: float, depth: int) -> tuple:
        return ("d", bisect.bisect_right(_Q_EDGES, q), min(depth, _MAX_DEPTH_BIN))

    @staticmethod
    def lookup_kind(match: int, depth: int, share: float, support: int, stored: bool = False) -> tuple:
        effective = match + depth - 1
        length = effective if effective <= 8 else 9 + bisect.bisect_left(_MATCH_EDGES, effective)
        return ("l", length, bisect.bisect_left(_SHARE_EDGES, share), min(support, 2), bool(stored))

    def _guess(self, kind: tuple) -> float:
        """The estimate before any observation of `kind`."""
        if kind[0] == "d":
            q_bin = kind[1]
            low = ((0.0,) + _Q_EDGES)[q_bin]
            high = (_Q_EDGES + (1.0,))[q_bin]
            return 0.8 * (low + high) / 2
        # a copy that has held for n tokens holds on: SmolLM2's answers accept an edge 0.1-0.35
        # of the time after a 1-token match and 0.8-1.0 after 5 or more (measured per kind);
        # the bins past 8 (longer copies) start from the same 0.9; the store's at half that, as it
        # is seldom verified and so learns slowly (`python -m bench.plan_replay`, float32 SmolLM2,
        # edit / mtbench2 / humaneval, modelled speedups: kinds shared with the context's 2.20x /
        # 2.27x / 1.83x, kinds of their own from the context's guess 2.22x / 2.29x / 1.86x, from
        # half of it 2.26x / 2.30x / 1.86x)
        _, match, share, _, stored = kind
        return min(0.9, 0.15 * match) * (0.5, 0.8, 1.0)[share] * (0.5 if stored else 1.0)

    def p(self, kind: tuple) -> float:
        p = self._p.get(kind)
        if p is None:
            accepted, observed = self._cells.get(kind, (0.0, 0.0))
            p = self._p[kind] = (accepted + self.prior * self._guess(kind)) / (observed + self.prior)
        return p

    def observe(self, kind: tuple, accepted: bool) -> None:
        self._p.pop(kind, None)
        cell = self._cells.setdefault(kind, [0.0, 0.0])
        cell[0] += accepted
        cell[1] += 1
        if cell[1] > self.max_count:
            cell[0] /= 2
            cell[1] /= 2


@functools.lru_cache(maxsize=4096)
def _lookup_kind(match: int, depth: int, count: int, total: int, stored: bool) -> tuple:
    """lookup_kind of a node `count` of whose parent's `total` continuations go through (all of
    them from the store where `stored`): a round asks for ~80, of a few hundred distinct ones."""
    return AcceptanceCalibrator.lookup_kind(match, depth, count / total, count, stored)


class _Node:
    """A trie node; a round builds ~80 of them (slots: no per-node dict)."""

    __slots__ = ("token", "parent", "depth", "drafter", "lookup", "children")

    def __init__(self, token: int, parent: int, depth: int):
        self.token, self.parent, self.depth = token, parent, depth
        self.drafter: tuple | None = None  # the kind of its edge as a drafter edge
        self.lookup: tuple | None = None   # ... as a lookup edge
        self.children: dict[int, int] = {}  # token -> node

    @property
    def sources(self) -> int:
        return (DRAFTER if self.drafter is not None else 0) | (LOOKUP if self.lookup is not None else 0)

    @property
    def kinds(self) -> tuple:
        return tuple(k for k in (self.drafter, self.lookup) if k is not None)


class CandidateTree:
    """The round's candidates: a trie rooted at the bonus token, built from the sources, scored
    by a calibrator.

    >>> cands = CandidateTree(root_token)
    >>> cands.add_continuations(lookup.continuations(8, 8))
    >>> cands.add_draft(drafter_tree)
    >>> curve = cands.expected_tokens(calibrator)   # E(N) for N = 0 .. size
    >>> tree = cands.select(n, device)             # the N best nodes, as a DraftTree
    """

    def __init__(self, root: int):
        self.nodes = [_Node(int(root), -1, 0)]
        self._order: list[int] | None = None
        self._estimates: list[float] | None = None

    @property
    def size(self) -> int:
        """Candidate nodes, the root excluded."""
        return len(self.nodes) - 1

    def _child(self, parent: int, token: int) -> int:
        node = self.nodes[parent].children.get(token)
        if node is None:
            node = len(self.nodes)
            self.nodes.append(_Node(token, parent, self.nodes[parent].depth + 1))
            self.nodes[parent].children[token] = node
        return node

    def add_continuations(self, continuations: list[Continuation]) -> None:
        """The lookup's branches: each continuation a path from the root."""
        # node -> [longest match, continuations, all stored] of the continuations through it (the
        # trie walk inlined: a round walks ~90 tokens)
        nodes, through = self.nodes, {}
        for cont in continuations:
            node, match, stored = 0, cont.match, bool(cont.stored)
            for token in cont.tokens:
                children = nodes[node].children
                child = children.get(token)
                if child is None:
                    child = children[token] = len(nodes)
                    nodes.append(_Node(token, node, nodes[node].depth + 1))
                node = child
                seen = through.get(node)
                if seen is None:
                    through[node] = [match, 1, stored]
                else:
                    seen[0], seen[1], seen[2] = max(seen[0], match), seen[1] + 1, seen[2] and stored
        total = {0: len(continuations)}
        for node, (_, count, _) in through.items():
            total[node] = count
        for node, (match, count, stored) in through.items():
            n = nodes[node]
            n.lookup = _lookup_kind(match, n.depth, count, total[n.parent], stored)
        self._order = None

    def add_draft(self, tree: DraftTree) -> None:
        """The drafter's tree (its root is this tree's root)."""
        # one host read: token ids and depths are exact in float64
        size = tree.num_nodes
        read = torch.cat([tree.tokens, tree.parents, tree.depths]).double()
        read = torch.cat([read, tree.scores.double()]).tolist()
        tokens, parents = [int(t) for t in read[:size]], [int(p) for p in read[size:2 * size]]
        depths, scores = [int(d) for d in read[2 * size:3 * size]], read[3 * size:]
        mine = [0] * len(tokens)
        for i in range(1, len(tokens)):
            mine[i] = node = self._child(mine[parents[i]], tokens[i])
            q = min(1.0, math.exp(scores[i] - scores[parents[i]]))
            self.nodes[node].drafter = AcceptanceCalibrator.drafter_kind(q, depths[i])
        self._order = None

    def edge_p(self, node: int, calibrator: AcceptanceCalibrator) -> float:
        """p of the edge into `node`: accepted given that its parent is."""
        n = self.nodes[node]
        if n.lookup is None or n.drafter is None:
            return calibrator.p(n.lookup or n.drafter)
        return 1 - (1 - calibrator.p(n.drafter)) * (1 - calibrator.p(n.lookup))

    def _rank(self, calibrator: AcceptanceCalibrator) -> None:
        """Every node's P, and the nodes by P descending (ties: shallower, then older first)."""
        nodes, estimates, p = self.nodes, [1.0] * len(self.nodes), calibrator.p
        for i in range(1, len(nodes)):  # parents before children by construction (edge_p inlined)
            n = nodes[i]
            if n.lookup is None or n.drafter is None:
                edge = p(n.lookup or n.drafter)
            else:
                edge = 1 - (1 - p(n.drafter)) * (1 - p(n.lookup))
            estimates[i] = estimates[n.parent] * edge
        self._estimates = estimates
        # two stable sorts, keys read by C: by depth (then index), then by P descending
        order = sorted(range(1, len(nodes)), key=[n.depth for n in nodes].__getitem__)
        order.sort(key=estimates.__getitem__, reverse=True)
        self._order = order

    def expected_tokens(self, calibrator: AcceptanceCalibrator) -> list[float]:
        """E(N), N = 0 .. size: tokens a round is expected to commit when it verifies the N best
        nodes (1 + their estimates' sum)."""
        self._rank(calibrator)
        curve = [1.0]
        for i in self._order:
            curve.append(curve[-1] + self._estimates[i])
        return curve

    def select(self, count: int, device) -> tuple[DraftTree, list[int]]:
        """The `count` best nodes as a DraftTree (parents first; scores log P) on `device`, and
        the candidate node of each of its rows. Call `expected_tokens` first."""
        if self._order is None:
            raise RuntimeError("CandidateTree.select needs expected_tokens() first (the ranking)")
        nodes = self.nodes
        chosen = sorted(self._order[:count])
        chosen.sort(key=lambda i: nodes[i].depth)  # by depth, then index: parents first
        rows = [0] + chosen
        row_of = {node: row for row, node in enumerate(rows)}
        tokens = [nodes[i].token for i in rows]
        parents = [-1] + [row_of[nodes[i].parent] for i in chosen]
        depths = [nodes[i].depth for i in rows]
        scores = [0.0] + [math.log(max(self._estimates[i], 1e-30)) for i in chosen]
        size = len(rows)
        mask = bytearray(size * size)  # row r: its parent's row (zeros from column r on), and r
        mask[0] = 1
        for row in range(1, size):
            start, parent = row * size, parents[row] * size
            mask[start:start + row] = mask[parent:parent + row]
            mask[start + row] = 1
        ints = torch.tensor([tokens, parents, depths], dtype=torch.int64, device=device)  # one copy
        tree = DraftTree(ints[0], ints[1], ints[2], torch.tensor(scores, dtype=torch.float32, device=device),
                         torch.frombuffer(mask, dtype=torch.bool).view(size, size).to(device))
        return tree, rows

    def observe(self, rows: list[int], accepted_rows: list[int],
                calibrator: AcceptanceCalibrator) -> dict[str, int]:
        """A verified round: teach the calibrator every edge whose parent was accepted; returns
        the accepted nodes (root excluded) counted by source ("drafter", "lookup", "both")."""
        accepted = {rows[r] for r in accepted_rows}
        counts = {name: 0 for name in SOURCE_NAMES.values()}
        for node in rows[1:]:
            n = self.nodes[node]
            if n.parent not in accepted:
                continue
            hit = node in accepted
            for kind in n.kinds:
                calibrator.observe(kind, hit)
            if hit:
                counts[SOURCE_NAMES[n.sources]] += 1
        return counts
