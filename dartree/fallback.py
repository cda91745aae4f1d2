"""When speculation does not pay, decode one token a round: the choice made from measured time.

A speculative round costs c_s seconds and commits τ tokens on average; a one-token round (the `ar`
loop: the bonus token alone verified) costs c_a and commits one. Speculating pays while
τ · c_a > c_s. Neither side is known before a call runs: c_s / c_a is the machine's (on a 2-core
AVX-512 CPU a 5-row verify costs 1.7x one row, on a GPU about the same), τ is the drafter's on
this text, and it changes along an answer (prose, then code). So `FallbackGate` measures both:
it speculates for its first rounds, then takes a few one-token rounds, then plays whichever costs
less per token over its recent rounds, trying the other again after 32 of its rounds, then 64,
then every 128 while the choice holds (back to 32 when it flips), so a change of τ is seen at a
bounded cost. A try is 3 speculative rounds or 2 one-token ones. Where speculation loses (the
shipped SmolLM2 drafter on a 2-core EPYC) the tries leave 128-token answers at 0.95-0.96x `ar`
instead of 0.72-0.73x (bench/results/smollm2_fallback_*_epyc; first tries after 16 rounds, and a
fresh gate each call, measured 0.93x).

The tokens never depend on the choice: every round commits the target's own tokens (the round
loop's losslessness); only the time does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Arm:
    """Measured rounds of one kind: their count, and seconds and committed tokens summed with
    each older round weighted `decay` times less (a window of about 1 / (1 - decay) rounds)."""

    rounds: int = 0
    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: int, decay: float) -> None:
        self.rounds += 1
        self.seconds = self.seconds * decay + seconds
        self.tokens = self.tokens * decay + tokens

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens


class FallbackGate:
    """Chooses, round by round, between a speculative round (True) and a one-token round (False).

    speculative_probe / ar_probe: rounds of each kind measured afresh before a choice: at the
                                  start, and each time the kind not chosen is tried again
    first_gap, max_gap:           rounds of the chosen kind between two tries of the other (the
                                  gap doubles each time the other kind loses again)
    decay:                        weight of a kind's older rounds against its newest, in (0, 1]

    One gate serves call after call (a decoder keeps its own): the costs are the machine's, and τ
    moves with the text, which the decayed sums follow. A call's first speculative round is not
    measured: its draft reads the features of every position the drafter has not seen (the
    prompt's at least), a cost the rounds after it do not pay.

    >>> gate = FallbackGate()
    >>> gate.begin_call()                        # a generate call starts
    >>> speculate = gate.speculate()             # before each round
    >>> gate.record(speculate, seconds, tokens)  # after it
    """

    def __init__(self, speculative_probe: int = 3, ar_probe: int = 2, first_gap: int = 32,
                 max_gap: int = 128, decay: float = 0.9):
        for name, value in (("speculative_probe", speculative_probe), ("ar_probe", ar_probe),
                            ("first_gap", first_gap), ("max_gap", max_gap)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"decay must be a number in (0, 1], got {decay!r}")
        if max_gap < first_gap:
            raise ValueError(f"max_gap ({max_gap}) must be >= first_gap ({first_gap})")
        self._arms = {True: _Arm(), False: _Arm()}
        self._probes = {True: speculative_probe, False: ar_probe}
        self.first_gap, self.max_gap, self.decay = first_gap, max_gap, decay
        self.gap = first_gap
        self._catching_up = True  # the next speculative round is a call's first: unmeasured
        self._trying = None       # the kind being measured afresh while the other leads, else None
        self._leader = None       # the kind chosen before that try
        self._since_other = 0     # rounds of the chosen kind since the other kind last ran

    def begin_call(self) -> None:
        """A generate call starts: its first speculative round will not be measured."""
        self._catching_up = True

    def speculate(self) -> bool:
        """Whether the next round speculates."""
        if self._trying is not None:
            return self._trying
        for kind in (True, False):  # the first measurements
            if self._arms[kind].rounds < self._probes[kind]:
                return kind
        leader = self.leader()
        if self._since_other < self.gap:
            return leader
        self._trying, self._leader = not leader, leader  # measure the other kind afresh
        self._arms[not leader] = _Arm()
        return not leader

    def leader(self) -> bool | None:
        """The kind that costs less per token (True: speculation); None until both are measured."""
        spec, ar = self._arms[True], self._arms[False]
        if spec.rounds < self._probes[True] or ar.rounds < self._probes[False]:
            return None
        return spec.seconds_per_token < ar.seconds_per_token

    def record(self, speculated: bool, seconds: float, tokens: int) -> None:
        """A round ran: its kind, wall seconds (compile time excluded) and committed tokens."""
        if tokens < 1:
            raise ValueError(f"a round commits at least one token, got {tokens}")
        if speculated and self._catching_up:
            self._catching_up = False
            return
        before = self.leader()
        self._arms[speculated].add(seconds, tokens, self.decay)
        if self._trying is not None:
            if self._arms[self._trying].rounds < self._probes[self._trying]:
                return
            lost = self.leader() == self._leader  # the tried kind lost again: wait longer
            self.gap = min(2 * self.gap, self.max_gap) if lost else self.first_gap
            self._trying, self._since_other = None, 0
        elif before is not None:
            changed = self.leader() != before  # the chosen kind got dearer than the other
            self._since_other = 0 if changed else self._since_other + 1
            if changed:
                self.gap = self.first_gap
