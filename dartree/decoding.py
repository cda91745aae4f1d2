"""The speculative decoding engine: one loop for every method.

A round, as in DESIGN.md:
  1. draft    the drafter proposes hidden states for a block of positions after the bonus token
  2. head     (Domino methods) base logits + the head's projection z, bundled as a `DraftBlock`
  3. tree     the method's builder turns the block into a `DraftTree` (root = bonus token)
  4. verify   one target forward over the tree with the ancestor mask
  5. accept   the target's own token at every node; the longest agreeing root path + a bonus
  6. commit   the accepted K/V rows compacted in place; their features feed the next draft

`ar` runs the same loop with a one-node tree (the bonus alone), so its time per token is the
baseline speedups are measured against. With `fallback=True` a speculative method runs such
one-token rounds itself wherever they measure cheaper per token (`dartree.fallback`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import compilation, methods, ops
from .candidates import SOURCE_NAMES, AcceptanceCalibrator, CandidateTree
from .cost_model import RoundPlanner
from .fallback import FallbackGate
from .hardware import auto_max_nodes, default_budget
from .linear_routing import gemv_linears
from .lookup import Lookup, LookupStore
from .methods import METHODS  # noqa: F401  (dartree.METHODS and dartree.decoding.METHODS)
from .sampling import Sampling
from .target import TargetModel
from .tree import DraftBlock, DraftTree


@dataclass
class GenerationResult:
    """What `SpeculativeDecoder.generate` returns.

    tokens:             the new tokens only (EOS included when hit), list[int]
    acceptance_lengths: tokens committed per round, the bonus token counted (τ of each round)
    speculated:         per round, whether it verified a draft tree (False: a one-token round:
                        method ar, the fallback's, or the per-round budget's)
    accepted_by_source: accepted draft tokens (bonus tokens excluded) by the source that proposed
                        them: "drafter", "lookup" or "both"
    timings:            seconds per stage over the whole call: prefill, draft, tree, verify,
                        accept, commit, and decode (every round, prefill excluded); compile
                        when this call compiled a graph (inside decode, not in verify or draft)
    """

    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    speculated: list[bool] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(
        default_factory=lambda: {name: 0 for name in SOURCE_NAMES.values()})
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def mean_acceptance(self) -> float:
        """τ of this response: mean tokens per round, bonus included."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0


class _Stopwatch:
    """Accumulates seconds per stage; synchronises CUDA so a stage's time is its own."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)

    def __call__(self, stage: str):
        return _Stage(self, stage)


class _Stage:
    def __init__(self, watch: _Stopwatch, stage: str):
        self.watch, self.stage = watch, stage

    def __enter__(self):
        if self.watch.cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.watch.cuda:
            torch.cuda.synchronize()
        self.watch.totals[self.stage] += time.perf_counter() - self.start


# the lookup's branches per round: continuations of up to LOOKUP_DEPTH tokens (or the budget)
LOOKUP_DEPTH, LOOKUP_BRANCHES = 16, 8


@dataclass
class _Plan:
    """One round's plan (step 0) and what the round built from it.

    draft:        the drafter runs this round
    candidates:   the candidate tree (lookup branches, then the drafter's tree merged in), or None:
                  the drafter's tree as built (ngram=False), or the bonus alone
    lookup_curve: E(N) of the lookup's candidates alone
    drafted:      the drafter's tree, once built
    curve, rows:  E(N) of the merged candidates; the candidate node of each verified row
    """

    draft: bool
    candidates: CandidateTree | None = None
    lookup_curve: list[float] | None = None
    drafted: DraftTree | None = None
    curve: list[float] | None = None
    rows: list[int] | None = None


class SpeculativeDecoder:
    """Lossless speculative decoding of a `transformers` causal LM with a DFlash/Domino drafter.

    target:      a transformers causal LM (or a `dartree.target.TargetModel`)
    drafter:     a `dartree.drafter.Drafter` built for this target (None only for method "ar")
    method:      ar | dflash | domino | ddtree | dartree-fixed | dartree | ngram (no drafter: the
                 lookup's continuations alone)
    budget:      draft nodes verified per round (tree methods and ngram), >= 1; None:
                 `hardware.default_budget` of the target's device and dtype (63 on CUDA; on a CPU
                 with AMX 15 in 16-bit, 4 in float32; on other CPUs 4 in 16-bit, 2 in float32);
                 "auto": chosen every round from measured costs and the candidates' acceptance
                 estimates, up to `hardware.auto_max_nodes` (`dartree.cost_model`): one-token
                 rounds where nothing pays, the lookup alone where the drafter's pass does not
    ngram:       tree methods: the lookup's continuations of the text's last tokens (found in the
                 prompt, the answer so far and earlier outputs of this decoder) become branches of
                 the tree beside the drafter's (`dartree.lookup`, `dartree.candidates`); False:
                 the drafter's tree alone, as before. No effect on ar and the chains.
    lookup_store_mb: megabytes of earlier outputs the lookup keeps (least recently used evicted)
    width:       dartree: nodes kept per level of the candidate tree
    candidates:  dartree: candidate tokens per position (the base top-C)
    depth_bonus: dartree: β in the pruning key score + β·depth, <= 0 (dartree-fixed uses 0)
    max_length:  the largest context (prompt + new tokens + one tree) the KV cache may hold;
                 default: the target's max_position_embeddings
    exact:       verify (and prefill) on the batch-invariant kernels: at temperature 0 the tokens
                 equal `with dartree.exact(): target.generate(do_sample=False)` bit for bit in
                 every dtype (bfloat16 and float16 included)
    compile:     True: verify's target forward and the drafter's pass through torch.compile
                 (graphs kept per model object and reused by later decoders and calls; compile
                 time in `timings["compile"]`, not in verify or draft); False: eager;
                 "auto": compiled where that pays back (`dartree.compilation.resolve_compile`:
                 nowhere measured yet, so eager). Not with exact=True.
    fallback:    True: run one-token rounds (the `ar` loop, drafter idle) wherever they measure
                 cheaper per token than this method's rounds, trying the method again after 32,
                 64, then every 128 rounds (`dartree.fallback.FallbackGate`; the decoder keeps
                 its gate from call to call); a FallbackGate: that one (shared, or with other
                 settings). The tokens are the same either way. Which rounds speculate follows
                 measured time, so sampling with a `generator` is refused (use seed=). No effect
                 for method "ar", nor with budget="auto" (which chooses one-token rounds itself).

    >>> dec = SpeculativeDecoder(target, drafter, method="dartree", budget=63)
    >>> res = dec.generate(prompt_ids, max_new_tokens=128)
    >>> res.tokens, res.mean_acceptance
    """

    def __init__(self, target, drafter=None, method: str = "dartree", budget: int | str | None = None,
                 width: int = 12, candidates: int = 64, depth_bonus: float = -0.2,
                 max_length: int | None = None, exact: bool = False, compile="auto",
                 fallback: bool | FallbackGate = False, ngram: bool = True,
                 lookup_store_mb: float = 32.0):
        spec = methods.lookup(method)
        model = target.model if isinstance(target, TargetModel) else target
        param = next(model.parameters())
        self.auto = budget == "auto"
        if budget is None:
            budget = default_budget(param.device, param.dtype)
        elif self.auto:
            budget = auto_max_nodes(param.device)
        for name, value in (("budget", budget), ("width", width), ("candidates", candidates)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                also = " or 'auto'" if name == "budget" else ""
                raise ValueError(f"{name} must be an int >= 1{also}, got {value!r}")
        if not isinstance(fallback, (bool, FallbackGate)):
            raise ValueError(f"fallback must be True, False or a dartree.fallback.FallbackGate, "
                             f"got {fallback!r}")
        if not isinstance(ngram, bool):
            raise ValueError(f"ngram must be True or False, got {ngram!r}")
        if not math.isfinite(depth_bonus) or depth_bonus > 0:
            raise ValueError(f"depth_bonus must be a finite number <= 0, got {depth_bonus}")
        if spec.drafter and drafter is None:
            raise ValueError(f"method {method!r} needs a drafter (ar and ngram run without one)")
        if method == methods.LOOKUP_ONLY and not ngram:
            raise ValueError("method 'ngram' verifies the lookup's candidates: ngram=False leaves "
                             "it nothing to verify")
        if spec.head and drafter.head is None:
            raise ValueError(f"method {method!r} needs a drafter with a Domino head; this drafter "
                             "is plain DFlash (use 'dflash' or 'ddtree')")
        self.method, self.budget, self.width = method, budget, width
        self.candidates, self.depth_bonus = candidates, depth_bonus
        self._spec = spec
        self.drafter = drafter if spec.drafter else None
        # the lookup: tree methods with ngram=True, and method ngram; its store outlives calls
        self.ngram = ngram and spec.budget
        store = LookupStore(lookup_store_mb)  # checked even when unused
        self._lookup = Lookup(store=store) if self.ngram else None
        self._calibrator = AcceptanceCalibrator()  # kept from call to call, like the costs
        self._planner = RoundPlanner(budget, self.drafter is not None) \
            if self.auto and spec.budget else None
        self._gate = None  # the fallback's: one per decoder, kept from call to call
        if fallback is not False and spec.drafter | spec.budget and self._planner is None:
            self._gate = FallbackGate() if fallback is True else fallback
        layers = self.drafter.target_layer_ids if self.drafter is not None else []
        self.target = TargetModel(model, feature_layers=layers, exact=exact, compile=compile)
        if self.drafter is not None:
            _check_drafter_fits(self.drafter, self.target)
        self._draft_compile_seconds = 0.0
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None) or 1 << 20

    # ----------------------------------------------------------------------------------- API

    @property
    def _cache_slack(self) -> int:
        """Cache rows past the committed prefix one round may write: the tree (target) and the
        whole drafted block (drafter), whichever is larger."""
        block = self.drafter.block_size if self.drafter is not None else 1
        return max(self.max_tree_size, block)

    @property
    def fallback_gate(self) -> FallbackGate | None:
        """The gate choosing this decoder's round kinds (None: the fallback is off)."""
        return self._gate

    @property
    def max_tree_size(self) -> int:
        """Rows of the largest tree one round verifies (root included)."""
        slots = self.drafter.num_slots if self.drafter is not None else 0
        return self._spec.tree_rows(self.budget, slots)

    def max_new_tokens_after(self, prompt_len: int) -> int:
        """The most new tokens a call may ask for after a prompt of `prompt_len` tokens:
        max_length less the prompt and one round's draft rows (< 1: the prompt does not fit)."""
        return self.max_length - prompt_len - self._cache_slack

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 256, temperature: float = 0.0,
                 eos_token_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None,
                 streamer: Callable[[list[int]], None] | None = None,
                 seed: int | None = None) -> GenerationResult:
        """Decode up to `max_new_tokens` tokens after `input_ids`, losslessly.

        input_ids:    list[int], LongTensor [n] / [1, n], or a tokenizer's output (its input_ids)
        temperature:  0 = greedy (output equals the target's greedy decoding token for token);
                      > 0 = the target's sampling distribution at that temperature
        eos_token_id: stop after this token (or any of these tokens); it is included in tokens
        generator:    torch.Generator on the target's device for reproducible sampling
        streamer:     called with each round's committed tokens as they are known (the first
                      call has the prefill's token); the calls together give `tokens`
        seed:         position-keyed sampling (int in [0, 2**64), not with generator): the token
                      after absolute position p is drawn with noise keyed by (seed, p) alone
                      (`ops.sample_keyed`), so every method, budget and tree returns the tokens
                      of one-token decoding with this seed (method "ar", or HF `generate` with
                      `dartree.PositionKeyedSampler`); no effect at temperature 0
        """
        ids = self._prepare(input_ids, max_new_tokens, temperature, eos_token_id, generator)
        _check_seed(seed, generator)
        if (self._gate or self._planner) is not None and generator is not None and temperature > 0:
            raise ValueError("fallback=True and budget='auto' pick each round's tree by measured "
                             "time, so a generator's draws would not repeat: pass seed= "
                             "(position-keyed sampling), or build the decoder with fallback=False "
                             "and a fixed budget")
        sampling = Sampling(temperature, generator, seed)
        eos = _eos_set(eos_token_id)
        watch = _Stopwatch(self.target.device)
        compiled_before = self.target.compile_seconds, self._draft_compile_seconds
        result = GenerationResult(tokens=[])
        with watch("prefill"):
            if temperature == 0:  # the greedy rounds' output layer, built once and before any round
                self.target.prepare_greedy()
            logits, features = self._start(ids)
            last = torch.full((1,), ids.shape[0] - 1, device=ids.device)  # the prompt's last position
            bonus = sampling.tokens(logits[-1:], last)[0]
        result.tokens.append(int(bonus))
        stream = _Streamer(streamer, max_new_tokens, eos)
        stream(result.tokens)
        position = ids.shape[0]  # the bonus token's
        gate = self._gate
        if gate is not None:
            gate.begin_call()
        if self._lookup is not None:
            self._lookup.start(ids.tolist() + result.tokens)
        unseen = [features]  # target features of the positions the drafter has not read yet
        decode_start = time.perf_counter()
        while not _finished(result.tokens, max_new_tokens, eos):
            speculate = gate.speculate() if gate is not None else self._spec.budget or \
                self.drafter is not None
            round_start, compiled = time.perf_counter(), self._compile_seconds()
            stages = dict(watch.totals)
            plan = self._plan(result.tokens[-1], speculate, watch)                    # 0. budget
            if plan.draft:
                hidden = self._draft(_joined(unseen), bonus, position, watch)         # 1. draft
                block, unseen = self._head(hidden, bonus, watch), []                  # 2. head
                plan.drafted = self._tree(block, bonus, position, sampling, watch)
            tree = self._choose(plan, bonus, watch)                                   # 3. tree
            out, tree_features = self._verify(tree, sampling, watch)                  # 4. verify
            accepted, path, new, bonus = self._accept(tree, out, position, sampling, watch)  # 5.
            features = self._commit(accepted, tree_features, watch)                   # 6. commit
            if self.drafter is not None:
                unseen.append(features)
            seconds = time.perf_counter() - round_start - (self._compile_seconds() - compiled)
            self._learn(plan, tree, path, new, result, seconds, stages, watch.totals)
            if gate is not None:
                gate.record(tree.num_nodes > 1, seconds, len(new))
            position += len(new)
            result.acceptance_lengths.append(len(new))
            result.speculated.append(tree.num_nodes > 1)
            result.tokens.extend(new)
            stream(new)
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        watch.totals["decode"] = time.perf_counter() - decode_start
        verify_compile = self.target.compile_seconds - compiled_before[0]
        draft_compile = self._draft_compile_seconds - compiled_before[1]
        if verify_compile or draft_compile:  # reported on its own, not as stage time
            watch.totals["compile"] = verify_compile + draft_compile
            watch.totals["verify"] -= verify_compile
            watch.totals["draft"] -= draft_compile
        result.tokens = _truncate(result.tokens, max_new_tokens, eos)
        if self._lookup is not None:
            self._lookup.finish(result.tokens)
        result.timings = dict(watch.totals)
        return result

    @torch.inference_mode()
    def propose(self, input_ids) -> DraftTree:
        """The draft tree this decoder would verify in its first round after `input_ids`
        (greedy bonus token), without verifying it."""
        ids = self._prepare(input_ids, 1, 0.0, None, None)
        logits, features = self._start(ids)
        bonus = logits[-1:].argmax(-1)[0]
        position, watch = ids.shape[0], _Stopwatch(self.target.device)
        if self._lookup is not None:
            self._lookup.start(ids.tolist() + [int(bonus)])
        plan = self._plan(int(bonus), True, watch)
        if plan.draft:
            block = self._head(self._draft(features, bonus, position, watch), bonus, watch)
            plan.drafted = self._tree(block, bonus, position, Sampling(), watch)
        return self._choose(plan, bonus, watch)

    # ------------------------------------------------------------------------------ the round

    def _start(self, ids: torch.Tensor):
        """Allocate both caches for this call and prefill the target (positions 0..n-1)."""
        capacity = ids.shape[0] + self._max_new + self._cache_slack
        self.target.allocate(capacity)
        if self.drafter is not None:
            self.drafter.reset(capacity)
        return self.target.prefill(ids, last_only=True)

    def _plan(self, bonus: int, speculate: bool, watch) -> _Plan:
        """0. What this round verifies: the lookup's candidates after `bonus` and, from them and
        the measured costs (budget="auto"), whether the drafter runs. speculate=False (the
        fallback's choice, or method ar): the bonus token alone."""
        if not speculate:
            return _Plan(draft=False)
        if self._lookup is not None or self._planner is not None:
            with watch("tree"):
                cands = CandidateTree(bonus)
                if self._lookup is not None:
                    cands.add_continuations(self._lookup.continuations(
                        depth=min(self.budget, LOOKUP_DEPTH), limit=LOOKUP_BRANCHES))
                curve = cands.expected_tokens(self._calibrator)
                draft = self.drafter is not None and (
                    self._planner is None or self._planner.wants_drafter(curve))
                return _Plan(draft, cands, curve)
        return _Plan(self.drafter is not None)

    def _draft(self, features, bonus, position, watch) -> torch.Tensor:
        """1. The drafter's pass for the block after `bonus` (at `position`), reading the features
        of the positions it has not seen: hidden [k', H], the slots a tree of this method can
        reach."""
        with watch("draft"):
            if self.target.compiled:  # compiled: its kernels are inductor's, not the GEMV routing's
                hidden = self._draft_compiled(features, bonus, position)
            else:
                with gemv_linears(self.drafter.dtype, self.drafter.device):
                    hidden = self.drafter.draft(features, bonus, position)
            # a tree of T rows is at most T - 1 deep: the builders never read a deeper slot, so
            # its LM-head row (the draft stage's largest product) is skipped (chains: none)
            return hidden[:self.max_tree_size - 1]

    def _head(self, hidden, bonus, watch) -> DraftBlock:
        """2. The block the tree builder reads: base logits of every slot, and for methods with
        the Domino head its projection z. Timed as part of the draft stage."""
        with watch("draft"), gemv_linears(self.drafter.dtype, self.drafter.device):
            head = self.drafter.head if self._spec.head else None
            return DraftBlock(root=bonus, base_logits=self.drafter.draft_logits(hidden), head=head,
                              z=head.project(hidden) if head is not None else None,
                              prefix_len=self.drafter.prefix_len)

    def _tree(self, block, bonus, position, sampling, watch) -> DraftTree:
        """3. This method's draft tree from the drafter's block (root = the bonus token at
        `position`)."""
        with watch("tree"):
            return self._spec.build(block, self, sampling, position)

    def _choose(self, plan: _Plan, bonus, watch) -> DraftTree:
        """3. The tree this round verifies: the drafter's as built where no candidate tree is
        kept (ngram=False, or nothing found with a fixed budget), else the best nodes of the
        candidates (the lookup's, merged with the drafter's tree), as many as the budget (fixed)
        or the planner says; the bonus alone when there is nothing to verify."""
        cands = plan.candidates
        if cands is None or (self._planner is None and cands.size == 0):
            return plan.drafted if plan.drafted is not None else DraftTree.chain(bonus.reshape(1))
        with watch("tree"):
            plan.curve = plan.lookup_curve  # ranked in _plan: nothing changed since, unless ...
            if plan.drafted is not None:     # ... the drafter's tree joins
                cands.add_draft(plan.drafted)
                plan.curve = cands.expected_tokens(self._calibrator)
            size = self._planner.size(plan.curve, plan.draft) if self._planner is not None \
                else min(self.budget, cands.size)
            tree, plan.rows = cands.select(size, self.target.device)
            return tree

    def _learn(self, plan: _Plan, tree, path, new, result, seconds, before, after) -> None:
        """After a round: the calibrator learns which candidates the target took, the planner the
        round's costs, the lookup the committed tokens; accepted tokens counted by source."""
        taken = plan.candidates.observe(plan.rows, path, self._calibrator) if plan.rows is not None else {}
        for source, count in taken.items():
            result.accepted_by_source[source] += count
        if plan.rows is None and tree.num_nodes > 1:
            result.accepted_by_source["drafter"] += len(new) - 1
        if self._planner is not None:
            verify = after.get("verify", 0.0) - before.get("verify", 0.0)
            draft = after.get("draft", 0.0) - before.get("draft", 0.0) if plan.draft else None
            nodes = tree.num_nodes - 1
            self._planner.record(nodes + 1, verify, draft, max(0.0, seconds - verify - (draft or 0.0)))
            if plan.rows is not None and nodes:
                self._planner.record_tokens(nodes, plan.curve[nodes], len(new), plan.draft)
            if plan.draft:
                self._planner.record_gain(plan.lookup_curve, plan.curve, nodes, taken.get("drafter", 0))
        if self._lookup is not None:
            self._lookup.extend(new)

    def _verify(self, tree, sampling, watch):
        """4. The target over the tree: (logits [T, V], or at temperature 0 the argmax tokens [T],
        features [T, nF*H])."""
        with watch("verify"):
            return self.target.verify(tree, check=False, greedy=sampling.temperature == 0)

    def _accept(self, tree, out, position, sampling, watch):
        """5. The target's own token at every node (`_verify`'s tokens, or drawn from its logits);
        the longest root path of the tree that agrees with them. Returns (accepted tree indices:
        int64 [a] and as a list, the committed tokens: the path after the root and the target's
        next token (list[int]), that token (the next bonus, 0-dim))."""
        with watch("accept"):
            target_tokens = out if sampling.temperature == 0 else sampling.tokens(out, position + tree.depths)
            accepted, count, bonus = ops.verify_tree_padded(tree.parents, tree.tokens, target_tokens)
            # the round's one host read: [a, bonus, path tokens (root first), path indices]
            path = accepted.clamp_min(0)
            read = torch.cat([count[None], bonus[None], tree.tokens[path], path]).tolist()
            size, rows = read[0], path.shape[0]
            if size == 0:
                raise RuntimeError(f"verify_tree_padded rejected the {self.method} tree (malformed)")
            new = read[3:2 + size] + [read[1]]
            return accepted[:size], read[2 + rows:2 + rows + size], new, bonus

    def _commit(self, accepted, tree_features, watch) -> torch.Tensor:
        """6. Keep the accepted path's K/V rows; its features [a, nF*H] feed the next draft."""
        with watch("commit"):
            self.target.commit(accepted, check=False)
            return tree_features[accepted]

    def _compile_seconds(self) -> float:
        """Seconds this decoder's graphs have spent compiling (target and drafter)."""
        return self.target.compile_seconds + self._draft_compile_seconds

    def _draft_compiled(self, features, bonus, position):
        """The drafter's pass compiled; a compiling call's time goes to _draft_compile_seconds.
        (compiled= is passed only here: drafter wrappers with draft(features, bonus, s) still
        run eager.)"""
        hidden, seconds = compilation.timed(
            lambda: self.drafter.draft(features, bonus, position, compiled=True))
        self._draft_compile_seconds += seconds
        return hidden

    # --------------------------------------------------------------------------------- checks

    def _prepare(self, input_ids, max_new_tokens, temperature, eos_token_id, generator):
        """Validate a call's arguments; returns input_ids as LongTensor [n] on the target device."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if generator is not None and generator.device.type != self.target.device.type:
            raise ValueError(f"generator is on {generator.device} but the target is on "
                             f"{self.target.device}")
        vocab = self.target.vocab_size
        for token in _eos_set(eos_token_id):
            if not 0 <= token < vocab:
                raise ValueError(f"eos_token_id {token} is outside the vocabulary [0, {vocab})")
        if isinstance(input_ids, Mapping) and "input_ids" in input_ids:  # a tokenizer's BatchEncoding
            input_ids = input_ids["input_ids"]
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"input_ids must be a list of ints, a LongTensor [n] or [1, n], or a "
                             f"tokenizer's output with input_ids; got {type(input_ids).__name__} "
                             f"({err})") from None
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty list of ints or a LongTensor [n] or "
                             f"[1, n] (batch size 1), got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must hold integer token ids, got {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the "
                             f"vocabulary [0, {vocab})")
        needed = ids.numel() + max_new_tokens + self._cache_slack
        if needed > self.max_length:
            raise ValueError(f"context of {ids.numel()} prompt + {max_new_tokens} new tokens + "
                             f"{self._cache_slack} draft rows exceeds max_length {self.max_length}")
        self._max_new = max_new_tokens
        return ids.to(device=self.target.device, dtype=torch.int64)


def _check_drafter_fits(drafter, target: TargetModel) -> None:
    """Refuse a drafter built for another target (hidden size, vocabulary, layer ids)."""
    cfg = drafter.config
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(f"drafter hidden size {cfg.hidden_size} != target hidden size "
                         f"{target.hidden_size}: the drafter was built for another target")
    if drafter.head is not None and drafter.head.W_2.shape[0] != target.vocab_size:
        raise ValueError(f"drafter head vocabulary {drafter.head.W_2.shape[0]} != target "
                         f"vocabulary {target.vocab_size}")


class _Streamer:
    """Passes committed tokens to a user callback, cut where the output ends (EOS, length)."""

    def __init__(self, callback, max_new_tokens: int, eos: set[int]):
        self.callback, self.left, self.eos = callback, max_new_tokens, eos

    def __call__(self, tokens: list[int]) -> None:
        if self.callback is None or self.left <= 0:
            return
        out = _truncate(tokens, self.left, self.eos)
        self.left = 0 if len(out) < len(tokens) or any(t in self.eos for t in out) \
            else self.left - len(out)
        if out:
            self.callback(out)


def _joined(features: list[torch.Tensor]) -> torch.Tensor:
    """One [n, nF*H] tensor of the features of consecutive rounds, oldest first."""
    return features[0] if len(features) == 1 else torch.cat(features)


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _check_seed(seed, generator) -> None:
    if seed is None:
        return
    if generator is not None:
        raise ValueError("pass seed (position-keyed sampling) or generator, not both")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")


def _finished(tokens: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in eos for t in tokens[-64:])


def _truncate(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Cut where the target alone would stop: after the first EOS, or at max_new_tokens."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:min(i + 1, max_new_tokens)]
    return tokens[:max_new_tokens]
