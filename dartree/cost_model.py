"""The per-round budget: how many nodes to verify, and whether the drafter runs at all.

A round that verifies the N best candidates costs
    overhead + [draft] + verify(N + 1 rows)
and commits E(N) tokens on average (`CandidateTree.expected_tokens`: 1 + the nodes' acceptance
estimates). The round runs the plan of most tokens per second:
  - N = 0: one row, plain decoding (what the fallback chose before this);
  - the lookup's candidates alone (no drafter pass: its cost is skipped);
  - the drafter's tree merged with the lookup's (its pass paid), N chosen after it ran.
Every cost is measured as the decoder runs (`RoundCosts`, medians of recent rounds): the verify
of each row count, the drafter's pass, the rest of a round (apart for rounds that drafted); a row
count not measured yet is interpolated between the measured ones, or extrapolated from the
nearest with an optimistic slope, so that a cheaper-than-assumed size gets tried and measured.
A row count not verified for `stale` rounds between two that were is interpolated again: one
slow round (a cold first request, a burst of another process) would otherwise keep its size
from ever being chosen, and so from ever being measured again. (Past the last fresh row count a
stale figure holds: extrapolating optimistically there would try every larger size in turn each
time they went stale, a few rounds in 64 even where nothing pays.)
The nodes' estimates are calibrated edge by edge; the N best of them are chosen for being the
highest, so the planner also scales each size's predicted extra tokens, E(N) - 1, by what rounds of
that size (per power of two; rounds that ran the drafter apart) delivered against their prediction
(float32 SmolLM2, `ngram` on edit requests: 33-row trees committed 0.52 of their predicted extra
tokens, 3-5-row ones 1.2-1.4x).
A class that has not run for `stale` rounds is taken at its word again until it runs: a stretch
of unlucky rounds would otherwise keep its sizes from ever being chosen, and so from ever
delivering again (a class that still falls short costs one round in `stale` to find out).
What the drafter adds is known only after its pass: the planner keeps, per N, the recent gain of
merged trees over the lookup's alone, scaled by what the drafter's own nodes delivered against
it, and runs the drafter when that gain pays for its pass, trying it again after 32 rounds
without (then 64, up to 128), so that a change of text is seen at a bounded cost.

Costs are the machine's and the model's: a decoder keeps its planner from call to call.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque


class _Mean:
    """A mean over recent observations (each older one weighted `decay` times less)."""

    def __init__(self, decay: float):
        self.decay, self.total, self.weight = decay, 0.0, 0.0

    def add(self, value: float) -> None:
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + 1

    @property
    def known(self) -> bool:
        return self.weight > 0

    @property
    def value(self) -> float:
        return self.total / self.weight


class _Recent:
    """The median of the last `window` observations: a time on a shared CPU is its true cost
    plus noise that comes in bursts (another process, a page fault), which a mean follows and a
    median of recent rounds does not."""

    def __init__(self, window: int):
        self._values: deque[float] = deque(maxlen=window)
        self._median: float | None = None  # kept until the next add: the planner reads it often

    def add(self, value: float) -> None:
        self._values.append(value)
        self._median = None

    @property
    def known(self) -> bool:
        return bool(self._values)

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self._values)
        return self._median


class RoundCosts:
    """Measured seconds: the verify of T rows, the drafter's pass, and a round's other work, each
    the median of its last `window` rounds.

    prior_slope: extra cost of a row, as a share of one row's verify, assumed where no two row
    counts have been measured (optimistic: a GPU or AMX verifies 16 rows for about one).
    stale: rounds after which a row count's figure gives way to its neighbours' where both sides
    were measured since (float32 SmolLM2 on edit requests: sizes 4-11 avoided for 600 rounds
    after a warm-up's slow 5-row verify, the rounds verifying 3 or 16-17 rows instead).
    """

    def __init__(self, window: int = 9, prior_slope: float = 0.05, stale: int = 64):
        self.window, self.prior_slope, self.stale = window, prior_slope, stale
        self._verify: dict[int, _Recent] = {}
        self._last: dict[int, int] = {}  # row count -> the round that last verified it
        self._round = 0
        self.draft = _Recent(window)
        # by (speculated, drafted): a drafted round also builds the drafter's tree and merges it
        # (2.4 ms a round in float32, about a 4-row verify's extra cost), which a round of the
        # lookup's candidates alone does not pay; shared, it made every speculation look dearer
        self.other = {(s, d): _Recent(window) for s in (False, True) for d in (False, True)}
        # derived from the above until the next record: a round asks for ~100 predictions
        self._points: tuple[list[int], list[float]] | None = None
        self._rounds: dict[tuple[int, bool], float] = {}
        self._tables: dict[bool, list[float]] = {}  # drafted -> round_table

    def record(self, rows: int, verify: float, draft: float | None, other: float) -> None:
        if self._round - self._last.get(rows, self._round) >= self.stale:
            del self._verify[rows]  # its old figures are of another time: they start again
        self._verify.setdefault(rows, _Recent(self.window)).add(verify)
        self._round += 1
        self._last[rows] = self._round
        if draft is not None:
            self.draft.add(draft)
        self.other[rows > 1, draft is not None].add(other)
        self._points, self._rounds, self._tables = None, {}, {}

    @property
    def rounds(self) -> int:
        """Rounds recorded so far."""
        return self._round

    def _measured(self) -> tuple[list[int], list[float]]:
        """The measured row counts, ascending, but for the stale ones between two fresh ones, and
        the running maximum of their medians (more rows never cost less)."""
        if self._points is None:
            fresh = {r for r in self._verify if self._round - self._last[r] < self.stale}
            low, high = min(fresh, default=0), max(fresh, default=0)
            measured = sorted(r for r in self._verify if r in fresh or not low < r < high)
            seconds, top = [], 0.0
            for r in measured:
                top = max(top, self._verify[r].value)
                seconds.append(top)
            self._points = measured, seconds
        return self._points

    def verify(self, rows: int) -> float:
        """Predicted seconds of a verify of `rows` rows; never decreasing in rows."""
        measured, seconds = self._measured()
        if not measured:
            return 1.0 + self.prior_slope * (rows - 1)  # in units of one row, until measured
        i = bisect.bisect_left(measured, rows)
        if i < len(measured) and measured[i] == rows:
            return seconds[i]
        if 0 < i < len(measured):
            x0, x1, y0, y1 = measured[i - 1], measured[i], seconds[i - 1], seconds[i]
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        return self._extrapolated(measured, seconds, 0 if i == 0 else -1, rows)

    def _extrapolated(self, measured: list[int], seconds: list[float], at: int, rows: int) -> float:
        """verify(rows) outside the measured range, from measured[at] with the optimistic slope."""
        near, base = measured[at], seconds[at]
        per_row = base / (1 + self.prior_slope * (near - 1)) * self.prior_slope
        return max(0.0, base + per_row * (rows - near))

    def round_table(self, limit: int, drafted: bool) -> list[float]:
        """round_seconds(N, drafted) for N = 0 .. limit, kept until the next record (a round asks
        for it two or three times)."""
        table = self._tables.get(drafted)
        if table is None or len(table) <= limit:
            rest = [self._rest(False, drafted), self._rest(True, drafted)]
            table = self._tables[drafted] = [v + rest[n > 0] for n, v in enumerate(self._verify_rows(limit + 1))]
        return table if len(table) == limit + 1 else table[:limit + 1]

    def _verify_rows(self, count: int) -> list[float]:
        """[verify(1), ..., verify(count)] in one walk over the measured row counts."""
        measured, seconds = self._measured()
        if not measured:
            return [self.verify(rows) for rows in range(1, count + 1)]
        out, i, last = [], 0, len(measured) - 1
        for rows in range(1, count + 1):
            while i <= last and measured[i] < rows:
                i += 1
            if i <= last and measured[i] == rows:
                out.append(seconds[i])
            elif 0 < i <= last:
                x0, x1, y0, y1 = measured[i - 1], measured[i], seconds[i - 1], seconds[i]
                out.append(y0 + (y1 - y0) * (rows - x0) / (x1 - x0))
            else:  # outside the measured range: verify's extrapolation
                out.append(self._extrapolated(measured, seconds, 0 if i == 0 else -1, rows))
        return out

    def round_seconds(self, nodes: int, drafted: bool) -> float:
        """Predicted seconds of a round verifying `nodes` candidates (+ the root)."""
        seconds = self._rounds.get((nodes, drafted))
        if seconds is None:
            seconds = self._rounds[nodes, drafted] = self.verify(nodes + 1) + self._rest(nodes > 0, drafted)
        return seconds

    def _rest(self, speculated: bool, drafted: bool) -> float:
        """Predicted seconds of a round besides its verify: its other work, and the drafter's pass."""
        one = self.verify(1)
        # a plan of a kind not measured yet: the other kind's figure, then a guess
        known = [o for o in (self.other[speculated, drafted], self.other[speculated, not drafted]) if o.known]
        seconds = known[0].value if known else 0.05 * one
        if drafted:
            seconds += self.draft.value if self.draft.known else 0.5 * one
        return seconds


def best_size(curve: list[float], costs: RoundCosts, drafted: bool, limit: int) -> tuple[int, float]:
    """(N, tokens per second) of the best size N <= limit for a round whose E(N) is `curve`."""
    best, rate = 0, -1.0
    for nodes, seconds in enumerate(costs.round_table(min(limit, len(curve) - 1), drafted)):
        r = curve[nodes] / seconds
        if r > rate:
            best, rate = nodes, r
    return best, rate


class RoundPlanner:
    """Chooses each round's plan from measured costs and the candidates' estimates.

    max_nodes: the largest tree (candidates, root excluded) a round may verify
    first_gap, max_gap: rounds without the drafter before it is tried again (doubling while it
                        keeps losing)

    >>> planner = RoundPlanner(max_nodes=32)
    >>> if planner.wants_drafter(lookup_curve): ...    # before the drafter's pass
    >>> n = planner.size(curve, drafted)               # the round's tree size
    >>> planner.record(rows, verify_s, draft_s, other_s)
    >>> planner.record_tokens(n, curve[n], committed, drafted)     # after a round that speculated
    >>> planner.record_gain(lookup_curve, merged_curve, n, drafter_tokens)  # after a drafted round
    """

    def __init__(self, max_nodes: int, has_drafter: bool, first_gap: int = 32,
                 max_gap: int = 128, probe: int = 3, decay: float = 0.8):
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
        self.max_nodes, self.has_drafter = max_nodes, has_drafter
        self.first_gap, self.max_gap, self.probe = first_gap, max_gap, probe
        self.costs = RoundCosts()
        self._gain = [_Mean(decay) for _ in range(max_nodes + 1)]
        # the gain at the verified size as predicted, and the tokens the drafter alone proposed
        # that the target took: the estimates of its nodes can promise what the text never gives
        self._promised, self._delivered = _Mean(decay), _Mean(decay)
        # per (drafted, size class N.bit_length()): the extra tokens rounds predicted and committed,
        # each class starting from one pseudo-round that delivered its prediction. Merged trees are
        # kept apart from the lookup's alone: their extra tokens rest on the drafter's estimates
        # too, and their few rounds of a class (tries; float32 edit requests) had set the lookup's
        # rounds of that class at 0.3-0.4 of their word
        self._extra: dict[tuple[bool, int], tuple[_Mean, _Mean]] = {}
        self._extra_round: dict[tuple[bool, int], int] = {}  # (drafted, class) -> the round it last ran
        self._drafted = 0       # rounds that ran the drafter
        self.gap = first_gap
        self._without = 0       # rounds since the drafter last ran
        self._forced = False    # the drafter runs this round as a try, not on merit
        self._answer = None     # (curve, drafted, its best_size) since the last record: _best

    def wants_drafter(self, lookup_curve: list[float]) -> bool:
        """Whether this round runs the drafter, given the lookup's E(N)."""
        self._forced = False
        if not self.has_drafter:
            return False
        if self._drafted < self.probe or self._without >= self.gap:
            self._forced = self._drafted >= self.probe
            return True
        if self._share() * max((g.value for g in self._gain if g.known), default=1.0) <= 0:
            return False  # it adds nothing the lookup's tree lacks: no need to price it (~0.2 ms)
        _, alone = self._best(lookup_curve, False)
        with_drafter = self._calibrated(self._with_drafter(lookup_curve), True)
        _, rate = best_size(with_drafter, self.costs, True, self.max_nodes)
        return rate > alone

    def _best(self, curve: list[float], drafted: bool) -> tuple[int, float]:
        """best_size of `curve` calibrated; the last answer is kept for the same curve object (a
        round that skips the drafter asks twice: wants_drafter, then size)."""
        if self._answer is None or self._answer[0] is not curve or self._answer[1] != drafted:
            self._answer = (curve, drafted, best_size(self._calibrated(curve, drafted), self.costs, drafted,
                                                    self.max_nodes))
        return self._answer[2]

    def _share(self) -> float:
        """What the drafter's own nodes delivered against the gain predicted for them (<= 1)."""
        if self._promised.known and self._promised.value > 0:
            return min(1.0, self._delivered.value / self._promised.value)
        return 1.0

    def _ratio(self, nodes: int, drafted: bool = False) -> float:
        """Committed over predicted extra tokens of recent rounds of `nodes`' size class (those that
        ran the drafter, or those that did not)."""
        key = (drafted, nodes.bit_length())
        means = self._extra.get(key)
        if means is None or self.costs.rounds - self._extra_round[key] >= self.costs.stale:
            return 1.0  # never run, or not for long: taken at its word until it runs again
        predicted, got = means
        return min(4.0, max(0.1, got.value / predicted.value))

    def _calibrated(self, curve: list[float], drafted: bool) -> list[float]:
        """E(N), N <= max_nodes, with each size's extra tokens scaled by its class's ratio."""
        curve = curve[:self.max_nodes + 1]  # (a lookup's tree holds up to 128 nodes)
        ratios = [self._ratio(1 << c, drafted) for c in range(len(curve).bit_length())]  # one per class
        return curve[:1] + [1 + (e - 1) * ratios[n.bit_length() - 1] for n, e in enumerate(curve[1:], 1)]

    def _with_drafter(self, lookup_curve: list[float]) -> list[float]:
        """Predicted E(N) of a merged tree: the lookup's plus the drafter's recent gain, scaled
        down where the drafter's own accepted tokens fell short of it."""
        share = self._share()
        curve, last = [], 1.0
        for nodes in range(self.max_nodes + 1):
            base = lookup_curve[min(nodes, len(lookup_curve) - 1)]
            gain = self._gain[nodes]
            last = max(last, base + (share * gain.value if gain.known else 0.0))
            curve.append(last)
        return curve

    def size(self, curve: list[float], drafted: bool) -> int:
        """This round's number of candidates to verify."""
        return self._best(curve, drafted)[0]

    def record_tokens(self, nodes: int, predicted: float, committed: int, drafted: bool = False) -> None:
        """A round verified `nodes` >= 1 candidates of E(nodes) = `predicted` (uncalibrated), a
        merged tree where `drafted`, and committed `committed` tokens (the bonus counted)."""
        self._answer = None
        key = (drafted, nodes.bit_length())
        means = self._extra.get(key)
        if means is None:
            # a round's tokens vary from 1 to the tree's depth: a memory of ~20 rounds a class
            means = self._extra[key] = (_Mean(0.95), _Mean(0.95))
            for mean in means:  # the pseudo-round
                mean.add(max(predicted - 1, 1e-3))
        means[0].add(max(predicted - 1, 1e-3))
        means[1].add(committed - 1)
        self._extra_round[key] = self.costs.rounds

    def record(self, rows: int, verify: float, draft: float | None, other: float) -> None:
        """A round ran: its verified rows and seconds of verify, draft (None: not run), rest."""
        self._answer = None
        self.costs.record(rows, verify, draft, other)
        if draft is None:
            self._without += 1
            return
        self._drafted += 1
        self._without = 0
        # a try after a gap waits twice as long next time if it loses; a win on merit resets it
        self.gap = min(2 * self.gap, self.max_gap) if self._forced else self.first_gap

    def record_gain(self, lookup_curve: list[float], merged_curve: list[float], nodes: int,
                    delivered: int) -> None:
        """After a drafted round that verified `nodes` candidates: E(N) with the drafter against
        the lookup's alone, and the accepted tokens only the drafter had proposed (at most what it
        added: the lookup's tree of that size might have held others)."""
        gains = []
        for n in range(self.max_nodes + 1):
            merged = merged_curve[min(n, len(merged_curve) - 1)]
            alone = lookup_curve[min(n, len(lookup_curve) - 1)]
            self._gain[n].add(merged - alone)
            gains.append(merged - alone)
        self._promised.add(max(0.0, gains[min(nodes, self.max_nodes)]))
        self._delivered.add(delivered)
