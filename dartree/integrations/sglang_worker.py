"""SGLang's DARTREE worker: a DARTree per request each step, verified and committed by SGLang.

Imported by SGLang when it creates the worker (`sglang.register`'s factory), never by dartree
itself: it needs a full SGLang install on a GPU. One step of a decode batch:

  1. tree     per request, the drafter's pass over the context features it has not seen yet, then
              `tree.build_dartree` (budget = ``speculative_num_draft_tokens`` - 1)
  2. arrays   `sglang_tree.to_sglang`: tokens, ancestor mask, positions, retrieve_* (SGLang's
              ``NgramVerifyInput`` carries them, as for its n-gram worker)
  3. verify   SGLang's target forward in TARGET_VERIFY mode, the drafter's feature layers
              captured (``set_dflash_layers_to_capture``, ``CaptureHiddenMode.FULL``)
  4. accept   SGLang's ``eagle_sample`` (its greedy tree walk, or its tree rejection sampling)
  5. commit   ``move_accept_tokens_to_target_kvcache``; the accepted rows' features go to each
              request's drafter state

Prefill batches run the target alone with the features captured, which become the requests'
first context. A request whose prefix came from the radix cache has no features for it and is
verified with the root alone (pass --disable-radix-cache). Greedy outputs are SGLang's own
decoding whatever the tree: SGLang's walk accepts a node only where the target agrees.
Status: written against SGLang 0.5.23's n-gram worker; it has not run yet (no GPU was lent).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.runtime_context import get_device, get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from ..defaults import SMOLLM2_DRAFTER_DIR
from ..drafter import load_drafter
from ..kv_cache import StaticKVCache
from ..tree import DraftBlock, DraftTree, build_dartree
from .sglang_tree import to_sglang
from .target_io import EngineTargetIO

logger = logging.getLogger(__name__)

DRAFTER_ENV = "DARTREE_DRAFTER"


@dataclass
class _Context:
    """One request's drafter state: its context cache, and the features of the positions after
    it that the drafter has not taken yet."""

    cache: StaticKVCache
    pending: torch.Tensor
    last_step: int


class DartreeWorker(BaseSpecWorker):
    """The worker SGLang's scheduler drives for ``--speculative-algorithm DARTREE``."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__()
        if get_schedule().page_size != 1:
            raise ValueError("DARTREE needs --page-size 1 (tree verify writes one KV slot per node)")
        if not get_schedule().disable_overlap_schedule:
            raise ValueError("DARTREE needs --disable-overlap-schedule")
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = get_device().device
        self.num_nodes = get_spec().speculative_num_draft_tokens
        self.speculative_num_draft_tokens = self.num_nodes
        if self.num_nodes < 2:
            raise ValueError("DARTREE needs --speculative-num-draft-tokens >= 2 (root + drafts)")
        model = self.model_runner.model
        path = Path(os.environ.get(DRAFTER_ENV) or SMOLLM2_DRAFTER_DIR)
        self.drafter = load_drafter(path, EngineTargetIO(model, self.model_runner.model_config.hf_config))
        num_layers = self.model_runner.model_config.hf_config.get_text_config().num_hidden_layers
        if num_layers - 1 in self.drafter.target_layer_ids:
            raise ValueError("DARTREE: SGLang captures a layer's output before the next layer, "
                             "so a drafter reading the last layer is not supported")
        model.set_dflash_layers_to_capture(self.drafter.target_layer_ids)
        self.cache_len = self.model_runner.model_config.context_len + self.drafter.block_size
        self._contexts: dict[str, _Context] = {}
        self._step = 0
        logger.info("dartree: DARTREE worker, drafter %s, %d nodes a tree", path, self.num_nodes)

    # -------------------------------------------------------------- what the scheduler calls

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = (
            self._target_worker.get_memory_pool())

    @property
    def draft_worker(self):
        return None  # no draft model runner: the drafter runs inside this worker

    def clear_cache_pool(self):
        self._contexts.clear()

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        pass

    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        self._step += 1
        for req in batch.reqs:
            if req.rid in self._contexts:
                self._contexts[req.rid].last_step = self._step
        self._forget_departed()
        if not batch.forward_mode.is_decode():
            return self._prefill(batch, on_publish, pp_proxy_tensors)
        return self._decode(batch, on_publish, pp_proxy_tensors)

    # ------------------------------------------------------------------------------ prefill

    def _prefill(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        result = self.target_worker.forward_batch_generation(
            batch, pp_proxy_tensors=pp_proxy_tensors, capture_hidden_mode=CaptureHiddenMode.FULL)
        features = result.logits_output.hidden_states
        if features is None:
            raise RuntimeError("DARTREE: the target returned no captured hidden states")
        offset = 0
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            rows = features[offset:offset + extend]
            offset += extend
            context = self._contexts.get(req.rid)
            if prefix == 0:
                context = self._new_context()
            elif context is None or self._known(context) != prefix:
                self._contexts.pop(req.rid, None)  # no features for the cached prefix
                continue
            context.pending = torch.cat([context.pending, rows.to(self.drafter.dtype)])
            self._contexts[req.rid] = context
        result.logits_output.hidden_states = None
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        bs = len(batch.reqs)
        accept_tokens = torch.zeros(bs, self.num_nodes, dtype=torch.int32, device=self.device)
        accept_tokens[:, 0] = result.next_token_ids
        result.next_draft_input = NgramVerifyInput(
            draft_token_num=self.num_nodes, new_seq_lens=batch.seq_lens,
            accept_tokens=accept_tokens.flatten(),
            accept_lens=torch.ones(bs, dtype=torch.int32, device=self.device))
        result.accept_lens = result.next_draft_input.accept_lens
        result.speculative_num_draft_tokens = self.num_nodes
        return result

    # ------------------------------------------------------------------------------- decode

    def _decode(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        bs, n = len(batch.reqs), self.num_nodes
        seq_lens = batch.seq_lens_cpu.tolist()
        trees = [self._tree(req, s) for req, s in zip(batch.reqs, seq_lens)]   # 1. tree
        arrays = to_sglang(trees, batch.seq_lens, n)                            # 2. arrays
        verify = NgramVerifyInput(
            draft_token=arrays.draft_tokens, custom_mask=self._full_mask(arrays, seq_lens),
            positions=arrays.positions, retrieve_index=arrays.retrieve_index,
            retrieve_next_token=arrays.retrieve_next_token,
            retrieve_next_sibling=arrays.retrieve_next_sibling, draft_token_num=n)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = arrays.draft_tokens
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens, end_offset=batch.seq_lens + n, batch_size=bs,
            draft_token_num=n, device=self.device)
        batch.spec_info = verify
        result = self.target_worker.forward_batch_generation(                  # 3. verify
            batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True,
            capture_hidden_mode=CaptureHiddenMode.FULL)
        logits_output = result.logits_output
        predict, accept_lens, accept_index = eagle_sample(                      # 4. accept
            verify, batch, logits_output, None, watermark_state=self.model_runner.watermark_state)
        move_accept_tokens_to_target_kvcache(                                   # 5. commit
            batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator)
        self._take_accepted(batch, logits_output.hidden_states, accept_index, accept_lens)
        logits_output.hidden_states = None
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = predict[accept_index].flatten()
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=accept_tokens,
            can_run_cuda_graph=result.can_run_cuda_graph, accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(draft_token_num=n, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens, accept_lens=accept_lens),
            speculative_num_draft_tokens=n)

    def _tree(self, req, seq_len: int) -> DraftTree:
        """The request's DARTree after its last committed token (at position seq_len); the root
        alone when its drafter state cannot follow it."""
        root = int(req.output_ids[-1]) if req.output_ids else int(req.origin_input_ids[-1])
        context = self._contexts.get(req.rid)
        if context is None or self._known(context) != seq_len:
            return DraftTree.chain(torch.tensor([root], device=self.device))
        drafter = self.drafter
        drafter.cache = context.cache
        if context.cache.tensor is None:
            drafter.reset(self.cache_len)
        budget = self.num_nodes - 1
        hidden = drafter.draft(context.pending, root, seq_len)[:budget]
        context.pending = context.pending[:0]
        head = drafter.head
        block = DraftBlock(root=root, base_logits=drafter.draft_logits(hidden), head=head,
                           z=None if head is None else head.project(hidden),
                           prefix_len=drafter.prefix_len)
        return build_dartree(block, budget=budget)

    def _full_mask(self, arrays, seq_lens: list[int]) -> torch.Tensor:
        """SGLang's flat custom mask of a tree verify: per request, its n rows over the prefix
        (all visible) and the tree (the ancestor mask)."""
        n = self.num_nodes
        tree = arrays.tree_mask.view(-1, n, n)
        return torch.cat([torch.cat([torch.ones(n, s, dtype=torch.bool, device=self.device),
                                     tree[b]], dim=1).flatten()
                          for b, s in enumerate(seq_lens)])

    def _take_accepted(self, batch, features, accept_index, accept_lens) -> None:
        """The accepted rows' features (the root and the accepted drafts) into each request's
        drafter state."""
        if features is None:
            raise RuntimeError("DARTREE: the verify pass returned no captured hidden states")
        for b, (req, count) in enumerate(zip(batch.reqs, accept_lens.tolist())):
            context = self._contexts.get(req.rid)
            if context is not None:
                rows = features[accept_index[b, :count].long()]
                context.pending = torch.cat([context.pending, rows.to(self.drafter.dtype)])

    def _new_context(self) -> _Context:
        config = self.drafter.config
        width = len(config.target_layer_ids) * config.hidden_size
        return _Context(StaticKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                      zeros=False),
                        torch.empty(0, width, dtype=self.drafter.dtype, device=self.drafter.device),
                        self._step)

    @staticmethod
    def _known(context: _Context) -> int:
        """Positions whose features the state holds (in the cache or pending)."""
        return context.cache.length + context.pending.shape[0]

    def _forget_departed(self, keep_steps: int = 8) -> None:
        """Drop the state of requests in no batch for `keep_steps` steps (finished, aborted,
        preempted; a request between prefill chunks or waiting for a decode batch keeps its)."""
        for rid in [rid for rid, c in self._contexts.items()
                    if self._step - c.last_step >= keep_steps]:
            del self._contexts[rid]
