"""The ``DARTREE`` speculative algorithm for SGLang, registered through its plug-in entry point.

    pip install dartree sglang        # the entry point below makes SGLang load it in each process
    python -m sglang.launch_server --model-path MODEL --speculative-algorithm DARTREE \\
        --speculative-num-draft-tokens 16 --disable-overlap-schedule --disable-radix-cache
    # drafter folder: $DARTREE_DRAFTER (default: the shipped SmolLM2-135M-Instruct drafter)

SGLang verifies trees: each step its worker (`sglang_worker.DartreeWorker`, imported only when
SGLang creates the worker) builds one DARTree of ``speculative_num_draft_tokens`` nodes per request
with dartree's own drafter and tree ops, hands SGLang the tree as its verify arrays
(`sglang_tree.to_sglang`) and accepts and commits through SGLang's own functions, as SGLang's
n-gram worker does. To SGLang the algorithm looks like its n-gram one (`DartreeSpecAlgo.is_ngram`):
a tree that lives only in the verify mask, no draft KV in SGLang's pools (the drafter keeps its
own context cache per request). It runs where SGLang serves, on a GPU: SGLang's CPU engine needs a
kernel package that is not published for CPUs. Registering needs none of that.
"""

from __future__ import annotations

import logging

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

logger = logging.getLogger(__name__)

NAME = "DARTREE"


class DartreeSpecAlgo(CustomSpecAlgo):
    """DARTREE as SGLang's scheduler and model runner see it: an n-gram-shaped tree verify."""

    def is_ngram(self) -> bool:
        # SGLang's verify plumbing (dummy inputs for graph capture, tree-mask attention, KV
        # sizing) has one branch for trees that live only in the verify mask: the n-gram one
        return True

    def has_draft_kv(self) -> bool:
        return False


def _worker_class(server_args):
    from .sglang_worker import DartreeWorker

    return DartreeWorker


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register ``DARTREE`` (once per process)."""
    try:
        SpeculativeAlgorithm.from_string(NAME)
        return  # registered already (SGLang loads plug-ins once per process; tests may call again)
    except ValueError:
        pass
    SpeculativeAlgorithm.register(NAME, supports_overlap=False,
                                  spec_class=DartreeSpecAlgo)(_worker_class)
    logger.info("dartree: speculative algorithm %s registered", NAME)
