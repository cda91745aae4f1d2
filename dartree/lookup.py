"""Candidates that cost nothing: continuations of the text's last tokens found earlier.

A small model copies: from its prompt (a function it is asked to edit, an earlier answer in a
chat), from what it already wrote, and from what it wrote for earlier requests. `Lookup` finds,
for the last n tokens of the context (n = max_n down to min_n), the places where those n tokens
occurred before and returns what followed them: `Continuation`s, the longest matches and the
latest occurrences first. A match is measured past max_n, back to `max_match` tokens: in the middle
of a copy the context's last 12 tokens match where a fresh 4-gram hit matches 4, and the first
copy holds on far more often (the candidate tree's calibrator reads the length). The candidate
tree (`dartree.candidates`) turns them into branches.

Two indexes answer a query:
  - the context's: the prompt and the tokens committed so far, grown as rounds commit (work
    proportional to the new tokens, never a rescan);
  - the store's (`LookupStore`): the outputs of earlier requests on the same decoder, bounded in
    bytes, least recently used evicted first.

An index maps each n-gram (n = 1..max_n) to the positions right after its latest occurrences
(`keep` of them per n-gram), so a query is max_n dictionary reads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Bytes one index entry and one stored token take in CPython, at worst (every n-gram new: a dict
# slot and its share of the table, which never shrinks between resizes, the tuple key and position
# list, the (document, position) pair; a list slot and an int object): 280-300 and 36 measured
# with tracemalloc on 64-bit CPython 3.11, rounded up (tests/test_lookup.py holds the store's
# accounting to tracemalloc's figure).
_ENTRY_BYTES = 360
_TOKEN_BYTES = 40


@dataclass(frozen=True)
class Continuation:
    """Tokens that followed an earlier occurrence of the context's last `match` tokens (at most
    the lookup's max_match: a longer match counts as that)."""

    tokens: tuple[int, ...]
    match: int
    stored: bool  # found in the cross-request store (else in this context)


class _Index:
    """n-gram -> (document, position after it) of its latest `keep` occurrences."""

    def __init__(self, max_n: int, keep: int):
        self.max_n, self.keep = max_n, keep
        self.ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def add(self, doc: int, tokens: list[int], start: int) -> int:
        """Index the n-grams of `tokens` ending at positions start+1 .. len(tokens); returns the
        number of entries added."""
        added = 0
        for end in range(max(start, 0) + 1, len(tokens) + 1):
            for n in range(1, min(self.max_n, end) + 1):
                spots = self.ends.setdefault(tuple(tokens[end - n:end]), [])
                spots.append((doc, end))
                added += 1
                if len(spots) > 2 * self.keep:  # amortised trim to the latest `keep`
                    added -= len(spots) - self.keep
                    del spots[:-self.keep]
        return added

    def remove(self, doc: int, tokens: list[int]) -> int:
        """Drop every entry of document `doc`; returns how many were dropped."""
        dropped = 0
        for end in range(1, len(tokens) + 1):
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                spots = self.ends.get(key)
                if not spots:
                    continue
                kept = [s for s in spots if s[0] != doc]
                dropped += len(spots) - len(kept)
                if kept:
                    self.ends[key] = kept
                else:
                    del self.ends[key]
        return dropped

    def find(self, suffix: list[int], min_n: int):
        """(doc, position after the match, match length) of the occurrences of the suffix's last
        n tokens, n from the longest down, latest first; each (doc, position) once."""
        seen = set()
        for n in range(min(self.max_n, len(suffix)), min_n - 1, -1):
            for spot in reversed(self.ends.get(tuple(suffix[-n:]), [])[-self.keep:]):
                if spot not in seen:
                    seen.add(spot)
                    yield spot[0], spot[1], n


class LookupStore:
    """The outputs of earlier requests, searchable by n-gram, within `max_mb` megabytes.

    Lives as long as its decoder. Adding an output evicts the least recently used ones (a
    document is used when a query matches it) until the estimate of the store's bytes (tokens and
    index entries, `_TOKEN_BYTES` / `_ENTRY_BYTES` each) fits; an output larger than the whole
    store is not kept.
    """

    def __init__(self, max_mb: float = 32.0, max_n: int = 4, keep: int = 8):
        if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not max_mb > 0:
            raise ValueError(f"lookup store size must be a number of megabytes > 0, got {max_mb!r}")
        self.max_bytes = int(max_mb * 1e6)
        self._index = _Index(max_n, keep)
        self._docs: OrderedDict[int, list[int]] = OrderedDict()  # oldest use first
        self._entries: dict[int, int] = {}
        self._next = 0

    @property
    def num_bytes(self) -> int:
        """The store's size estimate, tokens and index entries."""
        return sum(len(t) for t in self._docs.values()) * _TOKEN_BYTES + \
            sum(self._entries.values()) * _ENTRY_BYTES

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: list[int]) -> None:
        """Keep `tokens` (one request's output) for later queries."""
        tokens = list(tokens)
        if len(tokens) < 2:
            return
        doc, self._next = self._next, self._next + 1
        self._docs[doc] = tokens
        self._entries[doc] = self._index.add(doc, tokens, 0)
        while self.num_bytes > self.max_bytes and self._docs:
            old, old_tokens = self._docs.popitem(last=False)
            self._index.remove(old, old_tokens)
            del self._entries[old]

    def find(self, suffix: list[int], min_n: int):
        for doc, end, n in self._index.find(suffix, min_n):
            self._docs.move_to_end(doc)
            yield self._docs[doc], end, n


class Lookup:
    """Continuations of a growing context, from the context itself and from a store.

    max_n, min_n: longest and shortest suffix looked up (tokens)
    max_match:    how far back a hit's match is measured (>= max_n): the continuations of longer
                  matches come first
    keep:         latest occurrences remembered per n-gram
    store:        a `LookupStore` of earlier outputs, or None

    >>> lk = Lookup(store=LookupStore(32))
    >>> lk.start(prompt_ids)           # a generate call's prompt
    >>> lk.extend(committed)           # after each round
    >>> lk.continuations(depth=8, limit=8)
    >>> lk.finish(output)              # the call's output goes to the store
    """

    def __init__(self, max_n: int = 4, min_n: int = 1, keep: int = 8, max_match: int = 16,
                 store: LookupStore | None = None):
        for name, value in (("max_n", max_n), ("min_n", min_n), ("keep", keep), ("max_match", max_match)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup {name} must be an int >= 1, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"lookup min_n ({min_n}) must be <= max_n ({max_n})")
        if max_match < max_n:
            raise ValueError(f"lookup max_match ({max_match}) must be >= max_n ({max_n})")
        self.max_n, self.min_n, self.keep, self.store = max_n, min_n, keep, store
        self.max_match = max_match
        self.start([])

    def start(self, prompt: list[int]) -> None:
        """A new context: the prompt's tokens."""
        self.tokens: list[int] = []
        self._index = _Index(self.max_n, self.keep)
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        """Tokens committed after the context (work proportional to their number)."""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        self._index.add(0, self.tokens, start)

    def finish(self, output: list[int]) -> None:
        """A call ended with `output`: keep it in the store for later requests."""
        if self.store is not None:
            self.store.add(output)

    def _match(self, tokens: list[int], end: int, n: int) -> int:
        """The length, up to max_match, of the match of the context's last tokens with those
        before `end` in `tokens`, known to be at least n."""
        mine, cap = self.tokens, min(self.max_match, end, len(self.tokens))
        while n < cap and tokens[end - n - 1] == mine[-n - 1]:
            n += 1
        return n

    def continuations(self, depth: int, limit: int) -> list[Continuation]:
        """At most `limit` continuations of up to `depth` tokens each of the context's last
        tokens: the context's matches, then the store's, each by match length (measured up to
        max_match; ties: the longer suffix looked up, then the latest, first)."""
        suffix = self.tokens[-self.max_n:]
        end_now = len(self.tokens)
        found = [Continuation(tuple(self.tokens[end:end + depth]), self._match(self.tokens, end, n), False)
                 for _, end, n in self._index.find(suffix, self.min_n)
                 if end < end_now]  # the suffix itself has nothing after it
        out = sorted(found, key=lambda c: -c.match)[:limit]  # stable: the index's order in a tie
        if self.store is not None and len(out) < limit:
            stored = []
            for tokens, end, n in self.store.find(suffix, self.min_n):
                if end < len(tokens):
                    stored.append(Continuation(tuple(tokens[end:end + depth]), self._match(tokens, end, n), True))
            out += sorted(stored, key=lambda c: -c.match)[:limit - len(out)]
        return out
