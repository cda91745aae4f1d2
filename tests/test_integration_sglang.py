"""SGLang: DARTREE registers through the plug-in function, and SGLang resolves it by name. Needs
the ``sglang`` package (its registry only: ``pip install --no-deps sglang==0.5.23`` and the few
modules that imports), skipped without; the worker itself needs SGLang serving on a GPU
(bench/gpu_check.sh)."""

import pytest

pytest.importorskip("sglang.srt.speculative.spec_info")

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from dartree.integrations import sglang as plugin  # noqa: E402


def test_dartree_registers_and_resolves_by_name():
    plugin.register()
    plugin.register()  # a second load in the same process is a no-op, not an error
    algo = SpeculativeAlgorithm.from_string("dartree")
    assert isinstance(algo, plugin.DartreeSpecAlgo) and algo.name == "DARTREE"
    assert algo.is_speculative() and algo.is_ngram() and not algo.has_draft_kv()
    assert not algo.is_eagle() and not algo.is_dflash()
    assert SpeculativeAlgorithm.from_string("DARTREE") is algo


def test_dartree_refuses_overlap_scheduling():
    plugin.register()
    algo = SpeculativeAlgorithm.from_string("DARTREE")

    class Args:  # the fields create_worker reads of ServerArgs
        disable_overlap_schedule = False

    with pytest.raises(ValueError, match="does not support overlap scheduling"):
        algo.create_worker(Args())
