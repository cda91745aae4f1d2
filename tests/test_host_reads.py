"""A decoding round reads the device once: the committed tokens (for EOS and streaming); with
lookup branches (ngram=True) a drafter's tree is read too, to merge them on the host.

Every Tensor -> Python conversion (item, tolist, int(), bool(), float(), index, nonzero, numpy) is
a host synchronisation on a GPU; on the CPU they are counted here through a TorchFunctionMode.
What a call reads once (argument checks, the prefill's token) is measured with a 1-token call (no
rounds) and taken off. The GPU check counts real CUDA syncs with torch.cuda.set_sync_debug_mode
(bench/gpu_e2e.py); kernels' internal syncs are invisible here."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dartree import SpeculativeDecoder
from dartree.decoding import METHODS
from dartree.methods import TREE_METHODS

from helpers import make_drafter, tiny_target

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__bool__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.Tensor.numpy,
         torch.nonzero, torch.Tensor.unique, torch.unique, torch.masked_select,
         torch.Tensor.masked_select}
pytestmark = pytest.mark.usefixtures("one_thread")


class ReadCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in READS
        # a bool-mask index is a nonzero inside
        if func is torch.Tensor.__getitem__ and _bool_index(args[1]):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _bool_index(index):
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def reads_of(dec, prompt, new, **kw):
    counter = ReadCounter()
    with counter:
        res = dec.generate(prompt, new, **kw)
    return counter.reads, len(res.acceptance_lengths)


def test_counter_sees_reads():
    counter = ReadCounter()
    x = torch.arange(5)
    with counter:
        int(x[0]), x.tolist(), x[x > 2], bool(x.any())
    assert counter.reads == 4


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=7),
                                      dict(temperature=0.8, generator="cpu")])
def test_one_host_read_per_round(kind, sampling):
    target = tiny_target(kind, torch.float32)
    drafter = make_drafter(target, block_size=6)
    prompt = [5, 17, 99, 3, 8]
    for method, ngram in [(m, False) for m in METHODS if m != "ngram"] + [(m, True) for m in METHODS]:
        # eager (also under pytest --compiled): dynamo would trace the counting mode; a compiled
        # graph holds no host read anyway (fullgraph=True refuses the graph break one needs)
        dec = SpeculativeDecoder(target, drafter, method=method, budget=10, width=4, candidates=8,
                                 compile=False, ngram=ngram)
        kw = dict(sampling)
        if kw.get("generator"):
            kw["generator"] = torch.Generator().manual_seed(1)
        setup, none = reads_of(dec, prompt, 1, **kw)
        assert none == 0
        if "generator" in kw:
            kw["generator"] = torch.Generator().manual_seed(1)
        reads, rounds = reads_of(dec, prompt, 30, **kw)
        assert rounds > 1
        if ngram and method in TREE_METHODS:  # lookup branches merge with the drafter's tree on
            # the host: its read, in rounds where the lookup found something
            assert rounds <= reads - setup <= 2 * rounds, (method, reads, setup, rounds)
        else:
            assert reads - setup == rounds, (method, ngram, reads, setup, rounds)
