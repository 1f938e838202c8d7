"""How reproducible a measured optimum is: agreement among an entry's repeats, and one profile's order on another."""

import numpy as np
import pytest

from autoconfig.bank import BankError, Repeats
from autoconfig.reproducibility import (
    best_agreement,
    configuration_noise,
    hindsight_order_trials,
    noise_floor_trials,
    same_model_trials,
    surface_rank_correlation,
    trials_in_order,
)
from autoconfig.space import SearchSpace
from tests.helpers.surfaces import grid_entry

SPACE = SearchSpace.parse(
    {
        "knobs": {
            "max_batch_size": {"values": [1, 2, 4]},
            "batch_wait_timeout_s": {"values": [0.0]},
            "device_share": {"values": [1.0]},
            "num_replicas": {"values": [1, 2]},
        }
    }
)


def with_repeats(runs: list[list[float | None]]):
    """An entry whose first ``len(runs)`` configurations were measured again with these objectives."""
    base = grid_entry("m", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], SPACE)
    configs = SPACE.configurations()
    repeats = [Repeats(config=configs[i], objectives=objectives) for i, objectives in enumerate(runs)]
    return base.model_copy(update={"repeats": repeats})


def test_repeat_runs_that_name_the_same_best_configuration_agree():
    # The profile's own runs come first and are left out: they picked these configurations for being best.
    # Repeat runs 1-3: the first configuration is best in runs 1 and 3, the second in run 2.
    agreement, chance = best_agreement(with_repeats([[9.0, 5.0, 1.0, 4.0], [1.0, 3.0, 2.0, 3.5]]))
    assert agreement == pytest.approx(1 / 3)  # of the pairs (1,2), (1,3), (2,3) only (1,3) agrees
    assert chance == pytest.approx(1 / 2)


def test_a_run_that_held_no_rate_counts_zero_and_runs_pair_up_to_the_shortest():
    agreement, chance = best_agreement(with_repeats([[1.0, 5.0, None, 9.0], [1.0, 3.0, 2.0], [1.0, 1.0, 1.0, 1.0]]))
    # Runs 1 and 2 only (the second configuration has three): best 0 then 1 (None counts 0 against 2.0 and 1.0).
    assert agreement == 0.0
    assert chance == pytest.approx(1 / 3)


def test_agreement_needs_two_repeated_configurations_with_two_repeat_runs():
    assert best_agreement(with_repeats([[5.0, 4.0, 3.0]])) is None
    assert best_agreement(with_repeats([[5.0, 4.0], [3.0, 2.0]])) is None
    assert best_agreement(grid_entry("m", [1.0] * 6, SPACE)) is None


def test_trials_in_order_counts_to_the_targets_optimum_with_no_rate_last():
    order = np.array([np.nan, 0.9, 0.2, 0.5, 0.8, 0.1])
    target = np.array([7.0, 1.0, 2.0, 3.0, 4.0, np.nan])
    # Profiled 1, 4, 3, 2, 5, then 0 (no rate in the order's profile): the target's optimum (0) is the sixth.
    assert trials_in_order(order, target) == 6
    assert trials_in_order(target, target) == 1
    # A tie with the target's optimum reaches it as well.
    assert trials_in_order(order, np.array([7.0, 1.0, 2.0, 3.0, 7.0, np.nan])) == 2


def test_trials_in_order_refuses_mismatched_or_empty_surfaces():
    with pytest.raises(ValueError, match="surfaces of"):
        trials_in_order(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="no configuration with a positive objective"):
        trials_in_order(np.ones(3), np.array([np.nan, 0.0, np.nan]))


def test_two_profiles_of_one_model():
    first = grid_entry("m", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], SPACE)
    reversed_ = grid_entry("m", [6.0, 5.0, 4.0, 3.0, 2.0, 1.0], SPACE)
    assert same_model_trials(first, first) == 1
    assert same_model_trials(first, reversed_) == 6
    assert surface_rank_correlation(first, first) == pytest.approx(1.0)
    assert surface_rank_correlation(first, reversed_) == pytest.approx(-1.0)


def test_profiles_of_two_models_or_two_spaces_are_refused():
    first = grid_entry("m", [1.0] * 6, SPACE)
    with pytest.raises(BankError, match="profiles of two models"):
        same_model_trials(first, grid_entry("other", [1.0] * 6, SPACE))
    smaller = SearchSpace.parse({"knobs": {**SPACE.model_dump()["knobs"], "max_batch_size": {"values": [1, 2]}}})
    with pytest.raises(BankError, match="different search spaces"):
        surface_rank_correlation(first, grid_entry("m", [1.0] * 4, smaller))


def test_the_hindsight_order_puts_the_most_shared_optima_first():
    peaks = [0, 3, 3, 5, 3, 0]  # the optimum's configuration of each model
    entries = [grid_entry(f"m{i}", [2.0 if c == peak else 1.0 for c in range(6)], SPACE)
               for i, peak in enumerate(peaks)]
    # Order: configuration 3 (three optima), 0 (two), 5 (one).
    assert hindsight_order_trials(entries) == [2, 1, 1, 3, 1, 2]
    smaller = SearchSpace.parse({"knobs": {**SPACE.model_dump()["knobs"], "max_batch_size": {"values": [1, 2]}}})
    with pytest.raises(BankError, match="one search space"):
        hindsight_order_trials([entries[0], grid_entry("x", [1.0, 2.0, 1.0, 1.0], smaller)])


def noisy_entry(values: list[float], runs: list[float]):
    """An entry over ``values`` whose first configuration was measured again with ``runs`` (its noise)."""
    entry = grid_entry("m", values, SPACE)
    return entry.model_copy(update={"repeats": [Repeats(config=SPACE.configurations()[0], objectives=runs)]})


def test_a_repeated_configuration_is_as_noisy_as_one_run_over_the_root_of_its_runs():
    entry = with_repeats([[1.0, 1.2, 0.8], [2.0, 2.4, 1.6, 2.0]])  # spreads 0.2 and 0.163: median 0.182
    noise = configuration_noise(entry)
    spread = entry.noise()
    assert spread == pytest.approx(0.1816, abs=1e-3)
    np.testing.assert_allclose(noise, [spread / np.sqrt(3), spread / 2, spread, spread, spread, spread])
    assert configuration_noise(grid_entry("m", [1.0] * 6, SPACE)) is None


def test_the_noise_floor_is_one_trial_when_the_optimum_stands_far_above_the_noise():
    trials = noise_floor_trials(noisy_entry([1.0, 1.0, 1.0, 1.0, 1.0, 100.0], [1.0, 1.02, 0.98]))
    assert trials.shape == (2000,)
    assert (trials == 1).all()


def test_two_configurations_tied_at_the_top_each_hold_the_simulated_optimum_about_half_the_time():
    # Configurations 4 and 5 tie: the entry's order profiles 4 first, so a draw whose optimum is 5 costs 2 trials.
    trials = noise_floor_trials(noisy_entry([1.0, 1.0, 1.0, 1.0, 5.0, 5.0], [1.0, 1.2, 0.8]))
    assert set(np.unique(trials)) == {1, 2}
    assert 0.45 < np.mean(trials == 2) < 0.55
    # Seeded: the same draws again, other draws with another seed.
    entry = noisy_entry([1.0, 1.0, 1.0, 1.0, 5.0, 5.0], [1.0, 1.2, 0.8])
    np.testing.assert_array_equal(noise_floor_trials(entry), noise_floor_trials(entry))
    assert not np.array_equal(noise_floor_trials(entry, seed=1), noise_floor_trials(entry))


def test_a_configuration_without_a_rate_is_never_the_simulated_optimum():
    trials = noise_floor_trials(noisy_entry([1.0, np.nan, 1.1, 1.0, 1.0, 1.0], [1.0, 1.5, 0.5]), draws=500)
    # Configuration 1 held no rate: it is last in the order and never anyone's optimum, however loud the noise.
    assert trials.max() < 6


def test_the_noise_floor_needs_repeats():
    assert noise_floor_trials(grid_entry("m", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], SPACE)) is None
