"""What each decoding method needs, in one table.

Every method runs the same round (decoding.py); they differ in what the round drafts and how it
turns the draft into a tree:

| method        | drafter | Domino head | tree                                     | budget | width |
|---------------|---------|-------------|------------------------------------------|--------|-------|
| ar            | -       | -           | the bonus token alone                    | -      | -     |
| dflash        | yes     | -           | chain: argmax of ℓ_i                     | -      | -     |
| domino        | yes     | yes         | chain: ℓ_i + Δ_i (sampled at T > 0)      | -      | -     |
| ddtree        | yes     | -           | best-first tree from softmax(ℓ_i)        | yes    | -     |
| dartree-fixed | yes     | yes         | DARTree levels, budget split over depths | yes    | -     |
| dartree       | yes     | yes         | DARTree levels, pruned to the budget     | yes    | yes   |
| ngram         | -       | -           | the lookup's continuations alone         | yes    | -     |

The tree methods (a budget) also take the lookup's continuations as branches of their tree
(`SpeculativeDecoder(ngram=True)`, the default; `dartree.candidates`); `ngram` verifies those
branches alone, so it needs no drafter: it is how a model without one is decoded.

`ar` is the baseline: the target alone, one token per round, through the same loop; its output is
every other method's reference and its time per token the denominator of every speedup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from .tree import DraftBlock, DraftTree, build_chain, build_dartree, build_ddtree

if TYPE_CHECKING:
    from .sampling import Sampling

BASELINE = "ar"
LOOKUP_ONLY = "ngram"


class TreeSettings(Protocol):
    """A decoder's tree settings (`SpeculativeDecoder`'s attributes of these names)."""

    budget: int
    width: int
    candidates: int
    depth_bonus: float


# build(block, settings, sampling, position of the root) -> the round's draft tree
Builder = Callable[[DraftBlock, TreeSettings, "Sampling", int], DraftTree]


@dataclass(frozen=True)
class Method:
    """One decoding method.

    name:    as `SpeculativeDecoder(method=...)` takes it
    drafter: drafts a block each round (all but ar, which verifies the bonus token alone)
    head:    needs the drafter's Domino head: the block carries its corrections Δ
    budget:  verifies a tree of `budget` draft nodes; else a chain of the drafter's slots
    width:   takes the dartree width as a setting of its own (benchmarks report and search it)
    build:   the tree builder of the drafter's block (None: no drafter)
    """

    name: str
    drafter: bool
    head: bool
    budget: bool
    width: bool
    build: Builder | None

    def tree_rows(self, budget: int, slots: int) -> int:
        """Rows of the largest tree one round verifies (root included), for a decoder's `budget`
        and a drafter of `slots` slots."""
        if self.budget:
            return 1 + budget
        return 1 + slots if self.drafter else 1


def _dflash(block, settings, sampling, position):
    return build_chain(block)


def _domino(block, settings, sampling, position):
    return build_chain(block, sampling.temperature, sampling.generator, corrected=True,
                       seed=sampling.seed, position=position)


def _ddtree(block, settings, sampling, position):
    return build_ddtree(block, settings.budget)


def _dartree(block, settings, sampling, position):
    return build_dartree(block, width=settings.width, candidates=settings.candidates,
                         budget=settings.budget, depth_bonus=settings.depth_bonus, fixed=False)


def _dartree_fixed(block, settings, sampling, position):
    return build_dartree(block, width=settings.width, candidates=settings.candidates,
                         budget=settings.budget, depth_bonus=0.0, fixed=True)


TABLE: dict[str, Method] = {m.name: m for m in (
    Method(BASELINE, drafter=False, head=False, budget=False, width=False, build=None),
    Method("dflash", drafter=True, head=False, budget=False, width=False, build=_dflash),
    Method("domino", drafter=True, head=True, budget=False, width=False, build=_domino),
    Method("ddtree", drafter=True, head=False, budget=True, width=False, build=_ddtree),
    Method("dartree-fixed", drafter=True, head=True, budget=True, width=False, build=_dartree_fixed),
    Method("dartree", drafter=True, head=True, budget=True, width=True, build=_dartree),
    Method(LOOKUP_ONLY, drafter=False, head=False, budget=True, width=False, build=None),
)}
METHODS = tuple(TABLE)
TREE_METHODS = tuple(name for name, m in TABLE.items() if m.budget and m.drafter)  # drafter trees


def lookup(name: str) -> Method:
    """The table's entry for method `name`; ValueError naming the methods for any other."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {name!r}")
    return TABLE[name]
