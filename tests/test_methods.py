"""dartree.methods: the table of what each decoding method needs, and its builders."""

import pytest

import dartree
from dartree import decoding, methods
from dartree.sampling import Sampling
from dartree.tree import build_chain, build_dartree, build_ddtree
from test_tree import assert_same_tree, make_block


def test_the_table_holds_every_method_in_order():
    assert methods.METHODS == ("ar", "dflash", "domino", "ddtree", "dartree-fixed", "dartree", "ngram")
    assert dartree.METHODS == decoding.METHODS == methods.METHODS
    assert methods.TREE_METHODS == ("ddtree", "dartree-fixed", "dartree")
    assert [n for n, m in methods.TABLE.items() if not m.budget] == ["ar", "dflash", "domino"]
    assert methods.lookup(methods.BASELINE).build is None


def test_what_each_method_needs():
    needs = {name: (m.drafter, m.head, m.budget, m.width) for name, m in methods.TABLE.items()}
    assert needs == {"ar": (False, False, False, False), "dflash": (True, False, False, False),
                     "domino": (True, True, False, False), "ddtree": (True, False, True, False),
                     "dartree-fixed": (True, True, True, False), "dartree": (True, True, True, True),
                     "ngram": (False, False, True, False)}


@pytest.mark.parametrize("name", ["DARTree", "", 5, None, "hf-generate"])
def test_lookup_names_the_methods(name):
    with pytest.raises(ValueError, match="method must be one of ar, dflash, domino, ddtree, "
                                         "dartree-fixed, dartree, ngram, got"):
        methods.lookup(name)


def test_tree_rows():
    rows = {name: m.tree_rows(budget=9, slots=15) for name, m in methods.TABLE.items()}
    assert rows == {"ar": 1, "dflash": 16, "domino": 16, "ddtree": 10, "dartree-fixed": 10, "dartree": 10,
                    "ngram": 10}


class _Settings:
    budget, width, candidates, depth_bonus = 9, 3, 5, -0.5


@pytest.mark.parametrize("name", [n for n, m in methods.TABLE.items() if m.build is not None])
def test_each_method_builds_with_its_builder_and_settings(name):
    method = methods.lookup(name)
    block = make_block(3, slots=4, vocab=11, head=method.head)
    sampling, position = Sampling(temperature=1.0, seed=7), 20
    expected = {
        "dflash": lambda: build_chain(block),
        "domino": lambda: build_chain(block, 1.0, None, corrected=True, seed=7, position=20),
        "ddtree": lambda: build_ddtree(block, 9),
        "dartree-fixed": lambda: build_dartree(block, width=3, candidates=5, budget=9,
                                               depth_bonus=0.0, fixed=True),
        "dartree": lambda: build_dartree(block, width=3, candidates=5, budget=9, depth_bonus=-0.5),
    }[name]()
    tree = method.build(block, _Settings(), sampling, position)
    assert_same_tree(tree, expected, exact_scores=True)
    rows = method.tree_rows(_Settings.budget, block.num_slots)  # a chain fills its rows, a tree at most
    assert (tree.num_nodes <= rows) if method.budget else (tree.num_nodes == rows)
