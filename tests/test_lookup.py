"""dartree.lookup: continuations of the context's last tokens, from the context and a store."""

import random
import tracemalloc

import pytest

from dartree.lookup import Continuation, Lookup, LookupStore


def brute_force(tokens, max_n, min_n, depth, keep, max_match):
    """Every earlier occurrence of the last n tokens (n from max_n down), latest first, each end
    once, at most `keep` per n-gram counted over all its occurrences, its match then measured
    back to max_match tokens and the longest first: the index's answer."""
    out, seen = [], set()
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        ends = [end for end in range(n, len(tokens) + 1) if tokens[end - n:end] == suffix]
        for end in reversed(ends[-keep:]):
            if end not in seen:
                seen.add(end)
                if end < len(tokens):
                    match = max(m for m in range(n, min(max_match, end) + 1)
                                if tokens[end - m:end] == tokens[len(tokens) - m:])
                    out.append(Continuation(tuple(tokens[end:end + depth]), match, False))
    return sorted(out, key=lambda c: -c.match)


@pytest.mark.parametrize("seed", range(30))
def test_incremental_index_equals_brute_force(seed):
    rng = random.Random(seed)
    vocab, keep = rng.choice([2, 3, 5, 20]), rng.choice([1, 2, 8])
    lk = Lookup(max_n=4, min_n=rng.choice([1, 2]), keep=keep, max_match=rng.choice([4, 6, 16]))
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
    lk.start(tokens)
    for _ in range(15):  # rounds commit 1-5 tokens
        new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        lk.extend(new)
        tokens += new
        assert lk.tokens == tokens
        got = lk.continuations(depth=6, limit=1000)
        assert got == brute_force(tokens, 4, lk.min_n, 6, keep, lk.max_match)


def test_longest_match_and_latest_first():
    lk = Lookup(max_n=3)
    lk.start([1, 2, 3, 9, 5, 2, 3, 7, 8, 2, 3])
    got = lk.continuations(depth=2, limit=10)
    # "2 3" follows "1" once and "5" once: both 2-token matches, latest first; the 3-gram "8 2 3"
    # never occurred before; then the 1-token matches of "3" not already found (none new)
    assert got == [Continuation((7, 8), 2, False), Continuation((9, 5), 2, False)]
    assert lk.continuations(depth=2, limit=1) == got[:1]


def test_a_long_copy_is_measured_past_max_n_and_comes_first():
    """In the middle of a copy the context's last 8 tokens match its source; a later occurrence
    of the last 4 alone matches 4: the copy's continuation comes first, with its length."""
    source, noise, copy = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [50, 14, 15, 16, 17, 60], \
        [10, 11, 12, 13, 14, 15, 16, 17]
    lk = Lookup(max_n=4)
    lk.start(source + noise + copy)
    assert lk.continuations(depth=2, limit=2) == [Continuation((18, 19), 8, False),
                                                  Continuation((60, 10), 4, False)]
    capped = Lookup(max_n=4, max_match=6)  # measured no further than max_match
    capped.start(source + noise + copy)
    assert capped.continuations(depth=2, limit=1) == [Continuation((18, 19), 6, False)]
    short = Lookup(max_n=4, max_match=4)  # max_match = max_n: the index's order, latest first
    short.start(source + noise + copy)
    assert short.continuations(depth=2, limit=1) == [Continuation((60, 10), 4, False)]


def test_store_continuations_after_the_context_and_lru_eviction():
    store = LookupStore(max_mb=1.0)
    lk = Lookup(store=store)
    lk.start([4, 5, 6])
    lk.finish([40, 41, 42, 43, 44])
    lk.start([1, 40, 41])
    assert lk.continuations(depth=3, limit=5) == [Continuation((42, 43, 44), 2, True)]
    lk.extend([7, 40])  # the context now has its own "40 41" continuation too, found first
    assert lk.continuations(depth=2, limit=5) == [Continuation((41, 7), 1, False),
                                                  Continuation((41, 42), 1, True)]
    # the least recently used output goes first once the store is full
    small = LookupStore(max_mb=0.03)  # ~30 kB: a few short outputs
    for doc in range(10):
        small.add(list(range(doc * 100, doc * 100 + 6)))
    kept = len(small)
    assert 1 <= kept < 10 and small.num_bytes <= small.max_bytes
    newest = list(small.find([900, 901], 1))
    assert newest and newest[0][0][:2] == [900, 901]
    assert not list(small.find([0, 1], 1))  # the oldest was evicted
    small.add(list(range(5000, 10000)))  # larger than the whole store: not kept, store emptied
    assert small.num_bytes <= small.max_bytes


def test_store_stays_within_its_bound_over_500_requests():
    """The byte estimate bounds what the store really holds (tracemalloc), request after
    request, and the store keeps the most recent outputs."""
    rng = random.Random(0)
    store = LookupStore(max_mb=2.0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak_ratio = 0.0
        for _ in range(500):
            store.add([rng.randrange(2000) for _ in range(rng.randrange(20, 300))])
            assert store.num_bytes <= store.max_bytes
            held = tracemalloc.get_traced_memory()[0] - base
            peak_ratio = max(peak_ratio, held / store.max_bytes)
        assert peak_ratio <= 1.0, f"the store held {peak_ratio:.2f}x its bound"
        assert len(store) >= 5
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_n=0), "lookup max_n must be an int >= 1, got 0"),
    (dict(min_n=3, max_n=2), "min_n \\(3\\) must be <= max_n \\(2\\)"),
    (dict(keep=1.5), "lookup keep must be an int >= 1"),
    (dict(max_match=True), "lookup max_match must be an int >= 1, got True"),
    (dict(max_n=5, max_match=4), "max_match \\(4\\) must be >= max_n \\(5\\)"),
])
def test_bad_lookup_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lookup(**kwargs)


@pytest.mark.parametrize("size", [0, -1, float("nan"), "8", True])
def test_bad_store_size(size):
    with pytest.raises(ValueError, match="lookup store size must be a number of megabytes > 0"):
        LookupStore(size)
