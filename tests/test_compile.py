"""compile=True: the verify forward through torch.compile(fullgraph=True) decodes the same tokens.

A graph break fails these tests (fullgraph); rounds must not recompile (the prefix length is a
SymInt in the op schemas); a second generate call reuses the graphs. Compiling takes seconds per
graph on a CPU, so the models are two-layer ones."""

import pytest
import torch

from dartree import SpeculativeDecoder
from dartree.compilation import graphs_compiled, resolve_compile
from dartree.target import TargetModel
from dartree.tree import DraftTree

from helpers import greedy_reference, make_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 99, 3, 8, 41, 200]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param, torch.float32, layers=2, seed=3)


def test_resolve_compile_choices():
    assert resolve_compile(True, exact=False) is True
    assert resolve_compile(False, exact=False) is False
    assert resolve_compile("auto", exact=False) is False  # measured: does not pay back in a call
    assert resolve_compile("auto", exact=True) is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
            resolve_compile(bad, exact=False)
    with pytest.raises(ValueError, match="exact=True"):
        resolve_compile(True, exact=True)


def test_compile_argument_reaches_the_target(target, request):
    drafter = make_drafter(target)
    assert SpeculativeDecoder(target, drafter, compile=True).target.compiled
    assert not SpeculativeDecoder(target, drafter, compile=False).target.compiled
    # the default, "auto", is eager (pytest --compiled makes it compile)
    assert SpeculativeDecoder(target, drafter).target.compiled == request.config.getoption("--compiled")
    with pytest.raises(ValueError, match="compile must be"):
        SpeculativeDecoder(target, drafter, compile="always")


@pytest.mark.parametrize("method", ["ar", "dartree"])
def test_compiled_greedy_equals_the_target(target, method):
    drafter = make_drafter(target, block_size=6)
    expected = greedy_reference(target, PROMPT, 40)
    compiled = SpeculativeDecoder(target, drafter, method=method, budget=9, compile=True)
    first = compiled.generate(PROMPT, 40)
    assert first.tokens == expected
    assert first.timings["compile"] > 0
    assert len(first.acceptance_lengths) > 3
    # a second call, new prefix lengths every round: no graph is compiled again
    graphs = graphs_compiled()
    again = compiled.generate(PROMPT[:4], 40)
    assert graphs_compiled() == graphs
    assert "compile" not in again.timings
    assert again.tokens == greedy_reference(target, PROMPT[:4], 40)


def test_compiled_sampling_equals_eager(target):
    drafter = make_drafter(target, block_size=6)
    runs = [SpeculativeDecoder(target, drafter, budget=9, compile=c).generate(
                PROMPT, 40, temperature=0.9, seed=11).tokens for c in (False, True)]
    assert runs[0] == runs[1]
    ar = SpeculativeDecoder(target, None, method="ar").generate(PROMPT, 40, temperature=0.9, seed=11)
    assert runs[1] == ar.tokens


def test_compiled_features_and_cache_equal_eager(target):
    """The verify's logits, features and K/V rows from the compiled forward, against eager."""
    runs = []
    for compile in (False, True):
        model = TargetModel(target, feature_layers=[0, 1], compile=compile)
        model.allocate(64)
        model.prefill(torch.tensor(PROMPT))
        tree = DraftTree.chain(torch.tensor([7, 9, 11, 13]))
        logits, features = model.verify(tree)
        runs.append((logits, features, model.kv.clone()))
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_compiled_draft_equals_eager(target):
    """The drafter's block pass compiled, against eager, over rounds of changing context rows."""
    drafter = make_drafter(target, block_size=6)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    torch.manual_seed(0)
    features = [torch.randn(n, width) for n in (7, 1, 3, 2)]
    runs = []
    for compiled in (False, True):
        drafter.reset(64)
        position, hidden = 0, []
        for rows in features:
            position += rows.shape[0]
            hidden.append(drafter.draft(rows, 5, position, compiled=compiled))
        runs.append((hidden, drafter.cache.tensor[:, :, :, :position].clone()))
    for eager, compiled in zip(runs[0][0] + [runs[0][1]], runs[1][0] + [runs[1][1]]):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
