"""dartree.cost_model: measured round costs, the best tree size, when the drafter runs."""

import random

import pytest

from dartree.cost_model import RoundCosts, RoundPlanner, best_size


def costs_with(verify: dict[int, float], draft=None, other=0.0) -> RoundCosts:
    costs = RoundCosts(window=3)
    for rows, seconds in verify.items():
        costs.record(rows, seconds, draft, other)
    return costs


def test_verify_cost_interpolates_and_never_decreases():
    costs = costs_with({1: 10.0, 5: 18.0, 9: 17.0})  # a noisy 9-row figure below the 5-row one
    assert costs.verify(1) == 10.0 and costs.verify(5) == 18.0
    assert costs.verify(3) == pytest.approx(14.0)
    assert costs.verify(9) == 18.0 and costs.verify(7) == 18.0  # running maximum
    # past the last measured size: its cost plus the prior slope's share of one row per row
    assert costs.verify(13) == pytest.approx(18.0 + 4 * 18.0 / (1 + 0.05 * 8) * 0.05)
    assert costs_with({}).verify(5) == pytest.approx(1.2)  # before any measurement: units of a row


def test_verify_cost_is_the_median_of_recent_rounds():
    costs = costs_with({1: 10.0})
    costs.record(1, 90.0, None, 0.0)  # a burst of noise
    assert costs.verify(1) == pytest.approx(50.0)  # two rounds: their mean
    costs.record(1, 11.0, None, 0.0)
    assert costs.verify(1) == 11.0
    for seconds in (20.0, 21.0, 22.0):  # the window moves on: the cost changed
        costs.record(1, seconds, None, 0.0)
    assert costs.verify(1) == 21.0


def test_predictions_follow_each_record():
    """Predictions are kept between records (the planner reads ~100 a round), never past one."""
    costs = costs_with({1: 10.0, 5: 18.0}, draft=4.0, other=1.0)
    assert costs.round_seconds(4, True) == pytest.approx(18.0 + 1.0 + 4.0)
    assert costs.round_seconds(2, False) == pytest.approx(14.0 + 1.0)
    for _ in range(3):  # the window of 3 now holds 30.0 only
        costs.record(5, 30.0, 7.0, 2.0)
    assert costs.verify(5) == 30.0 and costs.verify(3) == pytest.approx(20.0)
    assert costs.round_seconds(4, True) == pytest.approx(30.0 + 2.0 + 7.0)
    assert costs.round_seconds(2, False) == pytest.approx(20.0 + 2.0)


def test_a_size_left_alone_after_one_slow_round_is_predicted_from_its_neighbours_again():
    """One slow 5-row verify (a cold first round) must not keep 5 rows from ever being chosen,
    hence measured, again: once stale between sizes measured since, it is interpolated."""
    costs = RoundCosts(window=3, stale=5)
    costs.record(5, 40.0, None, 0.0)
    for _ in range(2):
        costs.record(1, 10.0, None, 0.0)
        costs.record(9, 26.0, None, 0.0)
    assert costs.verify(5) == 40.0  # 4 rounds ago: still its own figure
    costs.record(1, 10.0, None, 0.0)
    assert costs.verify(5) == pytest.approx(18.0) and costs.verify(7) == pytest.approx(22.0)
    assert best_size([1.0, 2.0, 2.8, 3.2, 3.8, 4.1, 4.3, 4.5, 4.6], costs, False, 8)[0] == 4
    costs.record(5, 19.0, None, 0.0)  # measured again: its old figure is forgotten, not averaged
    assert costs.verify(5) == 19.0
    # stale past the last fresh size (nothing to interpolate from): its own figure still holds
    for _ in range(4):
        costs.record(1, 10.0, None, 0.0)
    assert costs.verify(9) == 26.0 and costs.verify(5) == 19.0


def test_a_drafted_rounds_own_work_is_charged_to_drafted_plans_only():
    """Building and merging the drafter's tree is part of a drafted round's other work: a round of
    the lookup's candidates alone is predicted without it."""
    costs = RoundCosts(window=3)
    for _ in range(3):
        costs.record(1, 10.0, None, 0.5)
        costs.record(5, 18.0, None, 1.0)
    costs.record(5, 18.0, 4.0, 3.0)  # one drafted round: tree building on top of the pass
    assert costs.round_seconds(4, False) == pytest.approx(18.0 + 1.0)
    assert costs.round_seconds(4, True) == pytest.approx(18.0 + 3.0 + 4.0)
    assert costs.round_seconds(0, False) == pytest.approx(10.0 + 0.5)
    # a plan of a kind not measured yet takes the other kind's figure
    assert costs.round_seconds(0, True) == pytest.approx(10.0 + 0.5 + 4.0)


def test_best_size_maximises_tokens_per_second():
    # a 5-row verify costs 1.7 rows: 4 candidates pay only when they bring > 0.7 tokens
    costs = costs_with({1: 1.0, 5: 1.7})
    assert best_size([1.0, 1.1, 1.15, 1.2, 1.22], costs, False, 4)[0] == 0
    n, rate = best_size([1.0, 1.9, 2.7, 3.4, 3.9], costs, False, 4)
    assert n == 4 and rate == pytest.approx(3.9 / 1.7)
    assert best_size([1.0, 1.9, 2.7, 3.4, 3.9], costs, False, 2)[0] == 2  # the limit holds
    # a drafter pass of 0.5 rows on top: the same tree is worth less
    drafted = costs_with({1: 1.0, 5: 1.7}, draft=0.5)
    assert best_size([1.0, 1.9, 2.7, 3.4, 3.9], drafted, True, 4)[1] == pytest.approx(3.9 / 2.2)


def test_planner_runs_the_drafter_only_where_its_gain_pays():
    planner = RoundPlanner(max_nodes=4, has_drafter=True, first_gap=4, max_gap=16, probe=2)
    for _ in range(3):
        planner.record(5, 1.7, None, 0.0)
        planner.record(1, 1.0, None, 0.0)
    lookup = [1.0, 1.1, 1.15, 1.2, 1.2]
    # the first `probe` rounds run it to measure it
    for _ in range(2):
        assert planner.wants_drafter(lookup)
        planner.record(5, 1.7, 3.0, 0.0)  # a costly pass ...
        planner.record_gain(lookup, [1.0, 1.2, 1.3, 1.35, 1.4], 4, 0)  # ... that adds little
    runs = []
    for _ in range(40):
        runs.append(planner.wants_drafter(lookup))
        planner.record(1, 1.0, 3.0 if runs[-1] else None, 0.0)
        if runs[-1]:
            planner.record_gain(lookup, [1.0, 1.2, 1.3, 1.35, 1.4], 0, 0)
    tries = [i for i, r in enumerate(runs) if r]
    # tried again after 4, then 8, then 16 rounds without it
    assert tries == [4, 13, 30]
    # a drafter whose trees bring whole blocks runs every round
    good = RoundPlanner(max_nodes=4, has_drafter=True, probe=1)
    good.record(5, 1.7, 0.3, 0.0)
    good.record(1, 1.0, None, 0.0)
    good.record_gain(lookup, [1.0, 2.0, 3.0, 4.0, 4.9], 4, 4)
    assert all(good.wants_drafter(lookup) for _ in range(5))
    assert good.size([1.0, 2.0, 3.0, 4.0, 4.9], True) == 4


def test_sizes_whose_rounds_commit_less_than_predicted_are_scaled_down():
    """The N best nodes are chosen for the highest estimates: a size class whose rounds commit
    fewer tokens than predicted has its predictions scaled by what they committed."""
    planner = RoundPlanner(max_nodes=16, has_drafter=False)
    for _ in range(3):
        for rows, seconds in ((1, 10.0), (5, 14.0), (17, 30.0)):
            planner.record(rows, seconds, None, 0.0)
    curve = [1.0] + [1.0 + 0.8 * n for n in range(1, 17)]  # 0.8 a node: E(16) = 13.8
    assert planner.size(curve, False) == 16
    for _ in range(40):
        planner.record_tokens(16, curve[16], 5)  # 4 extra tokens of the 12.8 predicted
    assert planner._ratio(16) == pytest.approx(4 / 12.8, rel=0.1) and planner._ratio(4) == 1.0
    assert planner.size(curve, False).bit_length() < 5  # below the 16-31 class
    for _ in range(40):
        planner.record_tokens(16, curve[16], 15)  # the text changed: they commit again
    assert planner.size(curve, False) == 16


def test_merged_trees_that_fall_short_leave_the_lookups_sizes_alone():
    """Rounds that ran the drafter keep their own size-class ratios: merged trees that commit a
    third of their prediction scale down merged trees of that class, not the lookup's own trees."""
    planner = RoundPlanner(max_nodes=16, has_drafter=True)
    for _ in range(3):
        for rows, seconds in ((1, 10.0), (5, 14.0), (17, 30.0)):
            planner.record(rows, seconds, None, 0.0)
    curve = [1.0] + [1.0 + 0.8 * n for n in range(1, 17)]
    for _ in range(40):
        planner.record_tokens(16, curve[16], 5, drafted=True)
    assert planner._ratio(16, drafted=True) < 0.5 and planner.size(curve, True).bit_length() < 5
    assert planner._ratio(16) == 1.0 and planner.size(curve, False) == 16
    for _ in range(40):
        planner.record_tokens(16, curve[16], 5)
    assert planner._ratio(16) < 0.5 and planner.size(curve, False).bit_length() < 5


def test_a_size_class_left_alone_is_taken_at_its_word_until_it_runs_again():
    """A class scaled down by a bad stretch is not avoided for ever: after `stale` rounds without
    it, its predictions count in full again (one round tries it); what it delivered is still
    remembered once it runs."""
    planner = RoundPlanner(max_nodes=16, has_drafter=False)
    for _ in range(3):
        for rows, seconds in ((1, 10.0), (5, 14.0), (17, 30.0)):
            planner.record(rows, seconds, None, 0.0)
    curve = [1.0] + [1.0 + 0.8 * n for n in range(1, 17)]
    for _ in range(40):
        planner.record(17, 30.0, None, 0.0)
        planner.record_tokens(16, curve[16], 5)
    assert planner.size(curve, False).bit_length() < 5
    for _ in range(planner.costs.stale - 2):  # rounds of 4 candidates only
        planner.record(5, 14.0, None, 0.0)
        planner.record_tokens(4, curve[4], 3)
    planner.record(17, 30.0, None, 0.0)  # (its verify cost kept fresh)
    assert planner._ratio(16) < 0.5 and planner.size(curve, False).bit_length() < 5
    planner.record(5, 14.0, None, 0.0)
    assert planner._ratio(16) == 1.0 and planner.size(curve, False) == 16
    planner.record(17, 30.0, None, 0.0)
    planner.record_tokens(16, curve[16], 5)  # it ran, and fell short again
    assert planner._ratio(16) < 0.5 and planner.size(curve, False).bit_length() < 5


def test_a_drafter_whose_nodes_promise_what_the_target_never_takes_stops_running():
    """The same estimates as a drafter that pays, but the target takes none of its own tokens:
    its predicted gain is scaled by what it delivered, and it runs only on the gap's tries."""
    lookup, merged = [1.0, 1.1, 1.15, 1.2, 1.2], [1.0, 2.0, 3.0, 4.0, 4.9]
    runs = {}
    for delivered in (0, 3):
        planner = RoundPlanner(max_nodes=4, has_drafter=True, first_gap=4, max_gap=16, probe=2)
        for _ in range(3):
            planner.record(5, 1.7, None, 0.0)
            planner.record(1, 1.0, None, 0.0)
        ran = runs[delivered] = []
        for _ in range(30):
            ran.append(planner.wants_drafter(lookup))
            planner.record(5, 1.7, 0.3 if ran[-1] else None, 0.0)
            if ran[-1]:
                planner.record_gain(lookup, merged, 4, delivered)
    assert all(runs[3])
    assert [i for i, r in enumerate(runs[0]) if r] == [0, 1, 6, 15]


def test_planner_without_a_drafter_and_bad_settings():
    assert not RoundPlanner(4, has_drafter=False).wants_drafter([1.0])
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_nodes must be an int >= 1"):
            RoundPlanner(bad, has_drafter=True)


def test_a_drafter_that_adds_nothing_never_runs_on_merit():
    """Merged trees no better than the lookup's: the drafter runs on the gap's tries alone, even
    where drafted rounds happened to measure cheaper than the others."""
    lookup = [1.0, 1.5, 1.8, 2.0, 2.1]
    planner = RoundPlanner(max_nodes=4, has_drafter=True, first_gap=8, max_gap=8, probe=1)
    ran = []
    for _ in range(30):
        ran.append(planner.wants_drafter(lookup))
        # a drafted round's rest measured far below the others': priced, it would win
        planner.record(5, 1.7, 0.01 if ran[-1] else None, 0.0 if ran[-1] else 1.0)
        if ran[-1]:
            planner.record_gain(lookup, lookup, 4, 0)
    assert [i for i, r in enumerate(ran) if r] == [0, 9, 18, 27]


@pytest.mark.parametrize("seed", range(30))
def test_round_table_is_round_seconds_for_every_size(seed):
    """The table a round reads (one walk over the measured row counts) holds round_seconds' figure
    for every size, before and after measurements, drafted or not, stale sizes included."""
    rng = random.Random(seed)
    costs = RoundCosts(window=3, stale=rng.choice([4, 64]))
    for _ in range(rng.randrange(0, 40)):
        rows = rng.choice([1, 2, 3, 5, 8, 9, 17, 33, rng.randrange(1, 40)])
        costs.record(rows, rng.uniform(0.5, 3.0) * (1 + 0.1 * rows), rng.choice([None, 0.4]), rng.uniform(0, 0.2))
        for drafted in (False, True):
            limit = rng.randrange(0, 40)
            table = costs.round_table(limit, drafted)
            assert len(table) == limit + 1
            for n, seconds in enumerate(table):
                assert seconds == costs.round_seconds(n, drafted)
