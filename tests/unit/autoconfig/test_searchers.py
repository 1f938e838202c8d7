"""Searchers on synthetic surfaces: no repeats, exhaustion, determinism, meta-weights, likeness of models."""

import itertools

import numpy as np
import pytest

from autoconfig.bank import Repeats
from autoconfig.searchers import (
    BestOnAverageSearcher,
    GPSearcher,
    GridSearcher,
    MetaParams,
    MetaSearcher,
    Observation,
    RandomSearcher,
    RGPESearcher,
    Searcher,
    SpaceExhausted,
    TPESearcher,
    WarmTPESearcher,
)
from autoconfig.searchers.context import context_weights, description_distance
from autoconfig.searchers.meta import bank_surfaces
from autoconfig.searchers.rgpe import _GP, _kernel
from autoconfig.space import Configuration, SearchSpace, SpaceError
from tests.helpers.surfaces import shortcuts, synthetic_bank

FAST_META = MetaParams(meta_iterations=20, meta_batch=4, adapt_steps=5)


@pytest.fixture(scope="module")
def space() -> SearchSpace:
    return SearchSpace.parse(
        {
            "knobs": {
                "max_batch_size": {"values": [1, 4, 16, 64]},
                "batch_wait_timeout_s": {"values": [0.0, 0.005]},
                "device_share": {"values": [0.5, 1.0]},
                "num_replicas": {"values": [1, 2]},
            }
        }
    )


@pytest.fixture(scope="module")
def bank(space):
    return synthetic_bank(4, space, seed=3)


def build(name: str, space: SearchSpace, bank, seed: int = 0) -> Searcher:
    if name in ("meta", "prior-only"):
        return MetaSearcher.meta_train(space, bank_surfaces(bank[1:]), seed=seed, params=FAST_META,
                                       adapt=name == "meta")
    return {
        "grid": lambda: GridSearcher(space),
        "random": lambda: RandomSearcher(space, seed),
        "tpe": lambda: TPESearcher(space, seed),
        "gp": lambda: GPSearcher(space, seed),
        "best-on-average": lambda: BestOnAverageSearcher(space, bank[1:]),
        "tpe-warm": lambda: WarmTPESearcher(space, seed, bank[1:]),
        "rgpe": lambda: RGPESearcher(space, seed, bank[1:]),
    }[name]()


def run(searcher: Searcher, values: np.ndarray, trials: int) -> list[Observation]:
    history: list[Observation] = []
    for _ in range(trials):
        config = searcher.suggest(history)
        value = values[searcher.space.index(config)]
        history.append(Observation(config, None if np.isnan(value) else float(value)))
    return history


@pytest.mark.parametrize(
    "name", ["grid", "random", "tpe", "gp", "meta", "prior-only", "best-on-average", "tpe-warm", "rgpe"]
)
def test_searcher_covers_the_space_without_repeats_then_exhausts(name, space, bank):
    searcher = build(name, space, bank)
    _, values = bank[0].surface()
    assert np.isnan(values).any()  # failed trials (value None) are part of the history
    history = run(searcher, values, space.size)
    configs = [o.config for o in history]
    assert len(set(configs)) == space.size  # no repeats, so the optimum was found within the space's size
    with pytest.raises(SpaceExhausted):
        searcher.suggest(history)


def test_grid_follows_the_enumeration_and_skips_observed(space):
    configs = space.configurations()
    history = [Observation(configs[0], 1.0), Observation(configs[2], None)]
    assert GridSearcher(space).suggest(history) == configs[1]
    assert GridSearcher(space).suggest([*history, Observation(configs[1], 2.0)]) == configs[3]


def test_history_outside_the_space_is_refused(space):
    with pytest.raises(SpaceError, match="not in the search space"):
        RandomSearcher(space).suggest([Observation(shortcuts(2, 0.0, 0.5, 1), 1.0)])


@pytest.mark.parametrize("cls", [RandomSearcher, TPESearcher, GPSearcher])
def test_seeded_searchers_are_deterministic(cls, space, bank):
    _, values = bank[0].surface()
    trials = 14  # past the samplers' 10 random start-up trials
    first = [o.config for o in run(cls(space, seed=5), values, trials)]
    again = [o.config for o in run(cls(space, seed=5), values, trials)]
    other = [o.config for o in run(cls(space, seed=6), values, trials)]
    assert first == again
    assert first != other


def test_optuna_searcher_rebuilds_on_a_history_that_is_not_an_extension(space, bank):
    _, values = bank[0].surface()
    searcher = TPESearcher(space, seed=0)
    run(searcher, values, 12)
    other = run(TPESearcher(space, seed=1), values, 12)
    suggestion = searcher.suggest(other)
    assert suggestion not in {o.config for o in other}


def test_meta_training_is_deterministic_and_weights_round_trip(tmp_path, space, bank):
    first = MetaSearcher.meta_train(space, bank_surfaces(bank), seed=2, params=FAST_META)
    again = MetaSearcher.meta_train(space, bank_surfaces(bank), seed=2, params=FAST_META)
    other = MetaSearcher.meta_train(space, bank_surfaces(bank), seed=3, params=FAST_META)
    assert all(np.array_equal(first.weights[k], again.weights[k]) for k in first.weights)
    assert not np.array_equal(first.weights["w1"], other.weights["w1"])
    first.save(tmp_path / "meta")
    loaded = MetaSearcher.load(space, tmp_path / "meta")
    assert loaded.params == FAST_META
    assert loaded.opening == first.opening is not None
    _, values = bank[0].surface()
    assert [o.config for o in run(loaded, values, 6)] == [o.config for o in run(first, values, 6)]


def test_meta_refuses_mismatched_weights_and_surfaces(tmp_path, space, bank):
    MetaSearcher.meta_train(space, bank_surfaces(bank), params=FAST_META).save(tmp_path / "meta")
    threaded = SearchSpace.parse({"knobs": {**space.to_dict()["knobs"], "torch_threads": {"values": [1, 2]}}})
    with pytest.raises(ValueError, match="meta-weights are for knobs"):
        MetaSearcher.load(threaded, tmp_path / "meta")
    with pytest.raises(ValueError, match=r"surfaces\[0\]: shapes"):
        MetaSearcher.meta_train(threaded, bank_surfaces(bank), params=FAST_META)
    features, values = bank_surfaces(bank)[0]
    with pytest.raises(ValueError, match=r"surfaces\[0\]: objective values must be finite"):
        MetaSearcher.meta_train(space, [(features, np.where(values > 0, values, np.nan))], params=FAST_META)


def test_meta_prior_alone_points_at_the_learned_optimum(space):
    """Surfaces of different scales sharing one peak: the meta-model alone, with no opening, should point at it."""
    features = np.asarray(space.encode_all())
    peak = space.index(shortcuts(16, 0.005, 0.5, 2))
    shape = 1.0 - np.linalg.norm(features - features[peak], axis=1) / 2
    surfaces = [(features, scale * shape) for scale in (1.0, 30.0, 500.0)]
    searcher = MetaSearcher.meta_train(space, surfaces, seed=0, params=MetaParams(meta_iterations=60, opening=False))
    assert searcher.opening is None
    assert searcher.suggest([]) == space.configurations()[peak]


def test_meta_opens_with_the_most_frequent_optimum_not_the_best_on_average(space):
    """Three surfaces peak at A, two at B; a third configuration N is near-best on all five, so it is best on
    average (0.92 against A's 0.64), but A is the likeliest optimum."""
    features = np.asarray(space.encode_all())
    a, b, n = (space.index(shortcuts(*knobs)) for knobs in ((64, 0.0, 1.0, 1), (4, 0.005, 0.5, 2), (16, 0.0, 1.0, 1)))

    def surface(peak: int, near: float) -> np.ndarray:
        values = np.full(space.size, 0.1)
        values[peak], values[n] = 1.0, near
        return values

    surfaces = [(features, surface(a, 0.9))] * 3 + [(features, surface(b, 0.95))] * 2
    assert np.mean([values for _, values in surfaces], axis=0).argmax() == n
    searcher = MetaSearcher.meta_train(space, surfaces, seed=0, params=FAST_META)
    configs = space.configurations()
    assert searcher.opening == configs[a] and searcher.suggest([]) == configs[a]
    assert searcher.suggest([Observation(configs[a], 1.0)]) != configs[a]  # then the surrogate takes over
    # Tied counts go to the configuration the meta-learned prior rates higher.
    tied = MetaSearcher.meta_train(space, surfaces[1:], seed=0, params=FAST_META)
    prior = tied._prior_scores()
    assert tied.opening == configs[a if prior[a] > prior[b] else b]
    # Surfaces with no positive value name no optimum: the prior's best opens.
    empty = MetaSearcher.meta_train(space, [(features, np.zeros(space.size))], seed=0, params=FAST_META)
    assert empty.opening is None and empty.suggest([]) == configs[int(np.argmax(empty._prior_scores()))]


DEPLOYMENT_SPACE = SearchSpace.parse(
    {
        "knobs": {
            "max_batch_size": {"values": [1, 4, 16]},
            "batch_wait_timeout_s": {"values": [0.0, 0.005]},
            "device_share": {"values": [2.0, 0.5, 1.0]},
            "num_replicas": {"values": [1, 2, 3]},
            "torch_threads": {"values": [1, 2]},
        },
        "max_total_share": 3.0,
    }
)


def _walk(searcher: Searcher) -> list[Configuration]:
    history: list[Observation] = []
    while True:
        try:
            history.append(Observation(searcher.suggest(history), 1.0))
        except SpaceExhausted:
            return [o.config for o in history]


def test_grid_in_deployment_order_changes_the_costly_knobs_least_often():
    space = DEPLOYMENT_SPACE
    sequence = _walk(GridSearcher(space, order="deployment"))
    assert len(sequence) == len(set(sequence)) == space.size and set(sequence) == set(space.configurations())
    assert sequence != list(space.configurations())  # not the enumeration, whose last knob varies fastest
    shares = [c["device_share"] for c in sequence]
    assert shares == sorted(shares)  # each device share once: replicas restart only when it changes...
    restarts = sum(
        (a["device_share"], a["torch_threads"]) != (b["device_share"], b["torch_threads"])
        for a, b in itertools.pairwise(sequence)
    )
    assert restarts == len({(c["device_share"], c["torch_threads"]) for c in sequence}) - 1  # ...or the threads do
    # Batching varies fastest: a block of every (batch size, wait) per deployment shape, batch size outermost.
    batching = [(b, w) for b in (1, 4, 16) for w in (0.0, 0.005)]
    for start in range(0, len(sequence), len(batching)):
        block = sequence[start : start + len(batching)]
        assert [(c["max_batch_size"], c["batch_wait_timeout_s"]) for c in block] == batching
        assert len({(c["device_share"], c["torch_threads"], c["num_replicas"]) for c in block}) == 1
    assert sequence[0] == shortcuts(1, 0.0, 0.5, 1, 1)
    assert sequence[-1] == shortcuts(16, 0.005, 2.0, 1, 2)  # 2 x 2.0 CPUs exceeds max_total_share


def test_grid_in_deployment_order_skips_observed_and_enumeration_stays_the_default(space):
    deployment = _walk(GridSearcher(space, order="deployment"))
    history = [Observation(deployment[0], 1.0), Observation(deployment[2], None)]
    assert GridSearcher(space, order="deployment").suggest(history) == deployment[1]
    assert _walk(GridSearcher(space)) == list(space.configurations())
    assert _walk(GridSearcher(space, order="enumeration")) == list(space.configurations())


def _normalised_mean(space: SearchSpace, entries) -> np.ndarray:
    surfaces = []
    for entry in entries:
        _, values = entry.surface()
        values = np.nan_to_num(values, nan=0.0)
        surfaces.append(values / values.max())
    return np.mean(surfaces, axis=0)


def test_best_on_average_walks_the_mean_normalised_prior_and_ignores_the_trials(space, bank):
    prior = bank[1:]
    mean = _normalised_mean(space, prior)
    searcher = BestOnAverageSearcher(space, prior)
    _, values = bank[0].surface()
    walked = [space.index(o.config) for o in run(searcher, values, 6)]
    assert walked == list(np.argsort(-mean, kind="stable")[:6])
    configs = space.configurations()
    good = [Observation(configs[walked[0]], 1e9)]
    bad = [Observation(configs[walked[0]], None)]
    assert searcher.suggest(good) == searcher.suggest(bad) == configs[walked[1]]  # no learning


def test_prior_only_ranks_by_the_meta_learned_prior_whatever_the_trials_say(space, bank):
    prior_only = build("prior-only", space, bank)
    adapting = build("meta", space, bank)
    configs = space.configurations()
    first = prior_only.suggest([])
    assert first == adapting.suggest([])  # the same weights: the same first pick
    outcomes = [[Observation(first, value)] for value in (None, 1.0, 1e6)]
    assert len({prior_only.suggest(history) for history in outcomes}) == 1
    assert len({adapting.suggest(history) for history in outcomes}) > 1  # the adapting one reads the outcome
    assert first in configs


def test_warm_tpe_starts_with_each_prior_models_best_then_runs_tpe(space, bank):
    prior = bank[1:]
    bests = {entry.surface()[0][int(np.nanargmax(entry.surface()[1]))] for entry in prior}
    searcher = WarmTPESearcher(space, seed=0, prior=prior)
    assert set(searcher.warm_start) == bests and len(searcher.warm_start) == len(bests)
    mean = _normalised_mean(space, prior)
    assert [mean[space.index(c)] for c in searcher.warm_start] == sorted(
        (mean[space.index(c)] for c in searcher.warm_start), reverse=True)  # better on average first
    _, values = bank[0].surface()
    history = run(searcher, values, len(bests) + 3)
    assert [o.config for o in history[: len(bests)]] == searcher.warm_start
    cold = [o.config for o in run(TPESearcher(space, seed=0), values, len(bests))]
    assert cold != searcher.warm_start


def test_bank_searchers_refuse_a_bank_without_the_spaces_knobs(space, bank):
    knobs = {"max_batch_size": [1, 2], "batch_wait_timeout_s": [0.0], "device_share": [1.0], "num_replicas": [1],
             "torch_threads": [1, 2]}
    other = SearchSpace.parse({"knobs": {name: {"values": values} for name, values in knobs.items()}})
    for searcher in (BestOnAverageSearcher, lambda s, p: WarmTPESearcher(s, 0, p)):
        with pytest.raises(ValueError, match="no profile in the bank is over the knobs"):
            searcher(other, bank)


@pytest.mark.parametrize("relative_noise", [None, 0.25])
def test_gp_leave_one_out_equals_refitting_without_the_point(relative_noise):
    rng = np.random.default_rng(0)
    points, values = rng.uniform(size=(12, 3)), rng.uniform(size=12)
    gp = _GP(points, values, relative_noise)
    loo_mean, loo_sd = gp.loo()
    for i in range(12):
        keep = np.arange(12) != i
        kernel = gp.amplitude * _kernel(points[keep], points[keep], gp.lengthscale) + gp.noise * np.eye(11)
        cross = gp.amplitude * _kernel(points[i : i + 1], points[keep], gp.lengthscale)
        weights = np.linalg.solve(kernel, cross.T)
        mean = gp.mean_value + (weights.T @ (values[keep] - gp.mean_value)).item()
        variance = gp.amplitude + gp.noise - (cross @ weights).item()  # the held-out point's noise included
        assert loo_mean[i] == pytest.approx(mean, abs=1e-6)
        assert loo_sd[i] == pytest.approx(np.sqrt(variance), rel=1e-4)


def test_gp_scales_to_its_values_and_smooths_by_the_measurement_noise():
    """Signal variance from the values (values in [0, 1] are not given a prior sd of 1), and a noisy GP no longer
    passes through each measurement: one high outlier among alike neighbours is pulled towards them."""
    points = np.linspace(0, 1, 9)[:, None]
    values = np.full(9, 0.5)
    values[4] = 0.8
    exact, smooth = _GP(points, values), _GP(points, values, relative_noise=0.3)
    assert exact.amplitude == pytest.approx(values.var())
    far_mean, far_sd = exact.predict(np.array([[10.0]]))
    assert far_mean[0] == pytest.approx(values.mean()) and far_sd[0] == pytest.approx(values.std(), rel=1e-3)
    assert exact.predict(points[4:5])[0][0] == pytest.approx(0.8, abs=0.01)
    assert smooth.noise == pytest.approx((0.3 * values.mean()) ** 2)
    assert smooth.predict(points[4:5])[0][0] < 0.7


def test_rgpe_follows_the_prior_model_that_ranks_the_trials_like_this_one(space):
    """With a twin of the target among the prior models, the ranking weights move to it: fewer trials than
    without it, and fewer than the average of the prior models gives."""
    with_twin = without_twin = on_average = 0
    for seed in range(5):
        bank = synthetic_bank(6, space, seed=seed)
        target = bank[0]
        twin = target.model_copy(update={"model": target.model.model_copy(update={"name": "twin"})})
        _, values = target.surface()
        with_twin += _trials_to_optimum(RGPESearcher(space, 0, [*bank[1:], twin]), values)
        without_twin += _trials_to_optimum(RGPESearcher(space, 0, bank[1:]), values)
        on_average += _trials_to_optimum(BestOnAverageSearcher(space, [*bank[1:], twin]), values)
    assert with_twin < on_average and with_twin < without_twin


def _trials_to_optimum(searcher: Searcher, values: np.ndarray) -> int:
    optimum = np.nanmax(values)
    for trials, observation in enumerate(run(searcher, values, searcher.space.size), start=1):
        if observation.value == optimum:
            return trials
    raise AssertionError("the optimum was never observed")


def test_grid_in_deployment_order_changes_a_dotted_resource_knob_least_often():
    space = SearchSpace.parse({"knobs": {
        "M.user_config.rows": {"values": [1, 4]},
        "M.num_replicas": {"values": [1, 2]},
        "M.ray_actor_options.num_cpus": {"values": [0.5, 1.0]},
    }})
    searcher, history = GridSearcher(space, order="deployment"), []
    for _ in range(space.size):
        history.append(Observation(searcher.suggest(history), 1.0))
    sequence = [o.config for o in history]
    changes = {name: sum(a[name] != b[name] for a, b in itertools.pairwise(sequence)) for name in space.knob_names}
    assert changes == {"M.ray_actor_options.num_cpus": 1, "M.num_replicas": 3, "M.user_config.rows": 7}


def test_description_distance_counts_decades_mismatches_and_one_sided_subtrees():
    mono = {"name": "a", "app": "dlrm-tiny", "workload": {"rows_per_request": 16}, "slo_p99_ms": 40.0,
            "args": {"serving": "monolithic", "quantized": False}}
    disagg = {"name": "b", "app": "dlrm-tiny", "workload": {"rows_per_request": 160}, "slo_p99_ms": 100.0,
              "args": {"serving": "disaggregated", "quantized": False, "embedding": {"num_shards": 2, "x": 1}}}
    assert description_distance(mono, {**mono, "name": "other"}) == 0.0  # the name is not the model
    # rows: 1 decade; SLO: log10(2.5); serving: 1; the embedding subtree, on one side only: 1
    assert description_distance(mono, disagg) == pytest.approx(1 + np.log10(2.5) + 1 + 1)
    assert description_distance(disagg, mono) == description_distance(mono, disagg)
    assert description_distance({"args": {"quantized": True}}, {"args": {"quantized": False}}) == 1.0
    assert description_distance({"slo_p99_ms": 0}, {"slo_p99_ms": 50}) == 1.0  # no decades from zero


def test_context_weights_sum_to_one_and_favour_the_alike_models():
    target = {"workload": {"rows_per_request": 16}, "slo_p99_ms": 40}
    others = [{"workload": {"rows_per_request": 1600}, "slo_p99_ms": 40},
              {"workload": {"rows_per_request": 16}, "slo_p99_ms": 400},
              {"workload": {"rows_per_request": 16}, "slo_p99_ms": 40}]
    weights = context_weights(target, others)
    assert weights.sum() == pytest.approx(1.0) and list(np.argsort(weights)) == [0, 1, 2]
    assert weights[2] / weights[1] == pytest.approx(np.e)  # one decade apart: 1/e
    with pytest.raises(ValueError, match="at least one"):
        context_weights(target, [])


def test_rgpe_starts_at_the_optimum_of_the_model_whose_description_is_most_alike(space):
    bank = synthetic_bank(4, space, seed=5)
    prior = bank[1:]
    surfaces = [np.nan_to_num(entry.surface()[1], nan=0.0) for entry in prior]
    average = np.mean([s / s.max() for s in surfaces], axis=0)
    alike = 1  # the target is described as prior[1] is (its latent factors), under another name
    assert np.argmax(average) != np.argmax(surfaces[alike])  # the bank's average points elsewhere
    target = {**prior[alike].model.model_dump(), "name": "target"}
    first = RGPESearcher(space, 0, prior, target=target).suggest([])
    assert space.index(first) == np.argmax(surfaces[alike])
    assert space.index(RGPESearcher(space, 0, prior).suggest([])) == np.argmax(average)


def test_rgpe_ranking_from_the_second_trial_finds_a_twins_optimum_sooner_than_from_the_fifth(space):
    """No description to go by: the ranking of the first trials is what finds the twin among the prior models."""
    early = late = 0
    for seed in range(5):
        bank = synthetic_bank(6, space, seed=seed)
        twin = bank[0].model_copy(update={"model": bank[0].model.model_copy(update={"name": "twin"})})
        _, values = bank[0].surface()
        early += _trials_to_optimum(RGPESearcher(space, 0, [*bank[1:], twin], rank_from=2), values)
        late += _trials_to_optimum(RGPESearcher(space, 0, [*bank[1:], twin], rank_from=5), values)
    assert early < late


def test_the_bank_searchers_learn_a_repeated_configuration_at_the_mean_of_its_runs(space, bank):
    """A prior model whose best single run was lucky: averaged with its repeats, another configuration leads."""
    entry = bank[1]
    configs, values = entry.surface()
    lucky, runner_up = np.argsort(-np.nan_to_num(values, nan=0.0))[:2]
    assert BestOnAverageSearcher(space, [entry]).suggest([]) == configs[lucky]
    repeated = entry.model_copy(update={"repeats": [
        Repeats(config=configs[lucky], objectives=[float(values[lucky]), None, float(values[runner_up]) / 2])]})
    assert BestOnAverageSearcher(space, [repeated]).suggest([]) == configs[runner_up]
    assert WarmTPESearcher(space, seed=0, prior=[repeated]).warm_start == [configs[runner_up]]
    assert RGPESearcher(space, seed=0, prior=[repeated]).suggest([]) != configs[lucky]
