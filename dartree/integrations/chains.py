"""One draft chain per request of an engine's batch, with per-request drafter state.

An engine that verifies chains (vLLM) tells its proposer, after each verify pass, only what each
batch row now holds: the row's committed tokens, and (through hooks) the target's hidden states of
the rows the pass computed. It does not say which request a row is, nor when a request finished
or was preempted, and rows move between steps. A DFlash drafter, though, keeps state per request:
the K/V of every committed position's target features in its context cache.

`ChainDrafter` therefore keys each request's state by what identifies it: the committed tokens
whose features it holds. A row continues the state whose tokens are the row's tokens up to the
position where the pass started; a row that starts at position 0 (a new request, or a preempted
one recomputed from scratch) gets a new state; states no row continued for `keep_steps` steps
(finished, or preempted and restarted) are dropped. Two requests with the same tokens share
nothing but are interchangeable (their states are the same function of the same tokens).

A row the state cannot follow (its pass started past position 0 with no state ending there, e.g.
a prefix served from a prefix cache, whose features were never computed) gets no drafts: the
engine then decodes it one token a step, still exactly.

    chains = ChainDrafter(drafter, num_tokens=4, max_model_len=2048)
    drafts = chains.step([RowStep(tokens, start, features, sampled), ...])   # list[list[int]]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..drafter import Drafter
from ..kv_cache import StaticKVCache
from ..linear_routing import gemv_linears
from ..reference import compute_dtype

logger = logging.getLogger(__name__)


@dataclass
class RowStep:
    """What the engine's last pass did for one batch row.

    tokens:   int [n]: the row's tokens at positions [0, n). With `sampled`, the committed tokens
              after this step, the new bonus token (not yet run through the target) last; else
              (a prefill chunk that sampled nothing) the tokens known so far
    start:    position of the first token the pass computed for this row
    features: [m, nF*H]: the target features (drafter.target_layer_ids' outputs, concatenated) of
              the pass's rows for this request, positions [start, start + m); rows past the
              committed ones (rejected drafts) may be included and are ignored
    sampled:  the pass sampled a token for this row (False: a partial prefill chunk)
    """

    tokens: np.ndarray
    start: int
    features: torch.Tensor
    sampled: bool


@dataclass
class _Request:
    """One request's drafter state: its context cache holds positions [0, cache.length); the
    features of [cache.length, known) wait in `pending` for the next draft; `tokens` are the
    committed tokens of [0, known)."""

    cache: StaticKVCache
    tokens: np.ndarray
    pending: torch.Tensor
    last_step: int

    @property
    def known(self) -> int:
        return self.tokens.shape[0]


class ChainDrafter:
    """Per-request DFlash (Domino where the drafter has a head) chains for an engine's batch.

    drafter:       a `dartree.Drafter` bound to the engine's target (its embedding and LM head)
    num_tokens:    k, draft tokens per request and step (<= drafter.num_slots)
    max_model_len: the engine's longest sequence; no draft reaches past it
    keep_steps:    a state no row continued for this many steps is dropped
    """

    def __init__(self, drafter: Drafter, num_tokens: int, max_model_len: int, keep_steps: int = 4):
        for name, value in (("num_tokens", num_tokens), ("max_model_len", max_model_len),
                            ("keep_steps", keep_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if num_tokens > drafter.num_slots:
            raise ValueError(f"num_tokens {num_tokens} exceeds the drafter's {drafter.num_slots} "
                             f"slots (block size {drafter.block_size})")
        self.drafter, self.num_tokens, self.max_model_len = drafter, num_tokens, max_model_len
        self.keep_steps = keep_steps
        self.cache_len = max_model_len + drafter.block_size  # the last block fits
        self._width = len(drafter.target_layer_ids) * drafter.config.hidden_size
        self._states: dict[int, list[_Request]] = {}  # by `known`
        self._step = 0
        self._unfollowed = 0

    @property
    def num_states(self) -> int:
        """Requests whose drafter state is kept."""
        return sum(len(group) for group in self._states.values())

    @torch.inference_mode()
    def step(self, rows: list[RowStep]) -> list[list[int]]:
        """The draft chain of every row (an empty list where the row gets none), in row order."""
        self._step += 1
        matched = [self._match(row) for row in rows]  # every match before any state moves on
        jobs = [self._advance(row, state) for row, state in zip(rows, matched)
                if state is not None]
        drafts: list[list[int]] = [[] for _ in rows]
        wanted = [(i, job) for i, job in zip([i for i, s in enumerate(matched) if s is not None],
                                             jobs) if job is not None]
        if wanted:
            chains = self._draft([job for _, job in wanted])
            for (i, job), chain in zip(wanted, chains):
                drafts[i] = chain[:job[3]]
        self._drop_stale()
        return drafts

    # --------------------------------------------------------------------------------------

    def _check(self, row: RowStep) -> None:
        if row.features.dim() != 2 or row.features.shape[1] != self._width:
            raise ValueError(f"features must be [m, {self._width}] (the drafter's "
                             f"{len(self.drafter.target_layer_ids)} target layers), got "
                             f"{list(row.features.shape)}")
        n, m = len(row.tokens), row.features.shape[0]
        if row.sampled:  # committed and computed: [start, n - 1); the bonus at n - 1 is not
            end, bad = n - 1, not 0 <= row.start <= n - 1 or row.start + m < n - 1
        else:  # a prefill chunk: every row is a prompt token
            end, bad = row.start + m, row.start < 0 or row.start + m > n
        if bad:
            raise ValueError(f"a row of {n} tokens ({'sampled' if row.sampled else 'prefill chunk'})"
                             f" needs the features of positions [{row.start}, {end}), got {m} rows "
                             f"from position {row.start}")

    def _match(self, row: RowStep) -> _Request | None:
        """The state this row continues (taken out of the index), a new one for a row that
        starts at 0, or None (no drafts for this row)."""
        self._check(row)
        if row.start == 0:
            return self._new_state()
        group = self._states.get(row.start, [])
        for i, state in enumerate(group):
            if np.array_equal(state.tokens, row.tokens[:row.start]):
                return group.pop(i)
        self._unfollowed += 1
        if self._unfollowed == 1:
            logger.warning("dartree: a request's pass started at position %d with no drafter "
                           "state ending there (prefix caching?); it gets no drafts", row.start)
        return None

    def _new_state(self) -> _Request:
        cache = StaticKVCache(self.drafter.config.num_layers, self.drafter.config.num_kv_heads,
                              self.drafter.config.head_dim, zeros=False)
        empty = torch.empty(0, self._width, dtype=self.drafter.dtype, device=self.drafter.device)
        return _Request(cache, np.empty(0, dtype=np.int64), empty, self._step)

    def _advance(self, row: RowStep, state: _Request):
        """Take the row's committed features into the state. Returns the draft job of a row
        that sampled a token, (state, bonus, its position, tokens wanted), else None."""
        n = len(row.tokens)
        # positions < end are committed and computed
        end = n - 1 if row.sampled else row.start + row.features.shape[0]
        new = row.features[:end - row.start].to(self.drafter.dtype)
        state.pending = torch.cat([state.pending, new])  # the state ended at row.start
        state.tokens = np.asarray(row.tokens[:end], dtype=np.int64).copy()
        state.last_step = self._step
        self._states.setdefault(state.known, []).append(state)
        count = min(self.num_tokens, self.max_model_len - n)
        if row.sampled and count > 0 and end + self.drafter.block_size <= self.cache_len:
            return state, int(row.tokens[end]), end, count
        return None

    def _draft(self, jobs: list[tuple[_Request, int, int, int]]) -> list[list[int]]:
        """The chain of each job: the drafter's pass per request (its own context cache), then
        the chains of all of them at once (`greedy_chains`: the LM head and the Domino head's
        vocabulary projection read once a step, not once a request)."""
        drafter = self.drafter
        hidden = []
        with gemv_linears(drafter.dtype, drafter.device):
            for state, bonus, position, _ in jobs:
                drafter.cache = state.cache  # this request's context cache
                if state.cache.tensor is None:
                    drafter.reset(self.cache_len)
                hidden.append(drafter.draft(state.pending, bonus, position)[:self.num_tokens])
                state.pending = state.pending[:0]
            roots = torch.tensor([job[1] for job in jobs], device=drafter.device)
            return greedy_chains(drafter, torch.stack(hidden), roots).tolist()

    def _drop_stale(self) -> None:
        for known in list(self._states):
            kept = [s for s in self._states[known] if self._step - s.last_step < self.keep_steps]
            if kept:
                self._states[known] = kept
            else:
                del self._states[known]


def greedy_chains(drafter: Drafter, hidden: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """`tree.build_chain`'s greedy chains for R requests at once: hidden [R, k, H] (the drafter's
    slots after each request's root), roots int64 [R] -> draft tokens int64 [R, k]. Slot i takes
    the argmax of the base logits (over the draft vocabulary, `Drafter.draft_logits`), plus for i >= P (drafter.prefix_len) the Domino correction of
    the GRU state over the root and the tokens taken so far, where the drafter has a head."""
    logits = drafter.draft_logits(hidden)
    logits = logits.to(compute_dtype(logits.dtype))
    head = drafter.head
    if head is None:
        return logits.argmax(-1)
    z = head.project(hidden)  # [R, k, r]
    state = head.gru_step(roots, head.W_hh.new_zeros(roots.shape[0], head.gru_hidden_dim))
    picked = []
    for slot in range(hidden.shape[1]):
        row = logits[:, slot]
        if slot >= drafter.prefix_len:
            row = row + head.correction(z[:, slot], state, None).to(row.dtype)
        picked.append(row.argmax(-1))
        if slot + 1 < hidden.shape[1]:
            state = head.gru_step(picked[-1], state)
    return torch.stack(picked, dim=1)
