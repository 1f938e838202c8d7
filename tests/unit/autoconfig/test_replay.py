"""Profile bank format, synthetic surfaces and the leave-one-model-out replay evaluator."""

import json

import numpy as np
import pytest

from autoconfig.bank import BankEntry, BankError, Repeats, load_bank, save_bank
from autoconfig.replay import replay
from autoconfig.searchers import SEARCHERS, GridSearcher, MetaParams, meta_factory
from autoconfig.space import SearchSpace
from tests.helpers.surfaces import grid_entry, synthetic_bank

TINY = SearchSpace.parse(
    {
        "knobs": {
            "max_batch_size": {"values": [1, 2]},
            "batch_wait_timeout_s": {"values": [0.0]},
            "device_share": {"values": [1.0]},
            "num_replicas": {"values": [1, 2]},
        }
    }
)


def entry(name: str, values: list[float], space: SearchSpace = TINY) -> BankEntry:
    return grid_entry(name, values, space)


def test_bank_round_trip_and_surface(tmp_path):
    entries = [entry("b-model", [1.0, np.nan, 3.0, 2.0]), entry("a-model", [4.0, 3.0, 2.0, 1.0])]
    save_bank(entries, tmp_path)
    loaded = load_bank(tmp_path)
    assert [e.name for e in loaded] == ["a-model", "b-model"]  # ordered by file name
    assert loaded[1] == entries[0]
    configs, values = loaded[1].surface()
    assert configs == TINY.configurations()
    np.testing.assert_array_equal(values, [1.0, np.nan, 3.0, 2.0])
    saved = json.loads((tmp_path / "b-model.json").read_text())
    assert saved["objective"] == "rps_per_share"
    assert saved["trials"][1] == {
        "config": {"max_batch_size": 1, "batch_wait_timeout_s": 0.0, "device_share": 1.0, "num_replicas": 2},
        "status": "slo_violated",
    }


def test_a_repeated_configuration_is_on_the_surface_at_the_mean_of_its_runs():
    """One lucky run made configuration 0 the optimum; its runs average below configuration 2's single one."""
    base = entry("m", [4.0, np.nan, 3.0, 2.0])
    configs = TINY.configurations()
    repeated = base.model_copy(update={"repeats": [Repeats(config=configs[0], objectives=[4.0, None, 2.0]),
                                                   Repeats(config=configs[3], objectives=[2.0, None])]})
    _, values = repeated.surface()
    assert values[0] == 2.0 and np.isnan(values[1]) and values[2] == 3.0  # (4 + 0 + 2) / 3
    assert values[3] == 1.0  # a run that held no rate counts 0
    assert np.nanargmax(values) == 2 and np.nanargmax(base.surface()[1]) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["trials"][2]["config"].update(max_batch_size=3), r"trials\[2\]\.config: configuration"),
        (
            lambda d: d["trials"][3].update(config=d["trials"][0]["config"]),
            r"trials\[3\]\.config: duplicate of trials\[0\]",
        ),
        (lambda d: d["trials"][0]["config"].update(cpus=2), r"trials\[0\]\.config: .*unknown knob 'cpus'"),
        (lambda d: d["trials"][0].update(status="failed"), r"trials\[0\]: objective: must be null"),
        (lambda d: d["trials"][1].update(status="ok"), r"trials\[1\]: objective: must be set"),
        (lambda d: d["trials"][0].update(error_rate=2), r"trials\[0\]\.error_rate: "),
        (lambda d: d["space"]["knobs"]["num_replicas"].update(values=[0]), r"space\.knobs\.num_replicas\.values\[0\]"),
        (lambda d: d["model"].update(name="../escape"), r"model\.name: "),
    ],
)
def test_invalid_bank_file_names_the_field(tmp_path, change, message):
    data = entry("m", [1.0, np.nan, 3.0, 2.0]).model_dump(mode="json", exclude_none=True)
    change(data)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BankError, match=rf"m\.json: {message}"):
        BankEntry.load(path)


def test_bank_refuses_repeated_names_and_incomplete_grids(tmp_path):
    entry("same", [1.0, 2.0, 3.0, 4.0]).save(tmp_path / "one.json")
    entry("same", [1.0, 2.0, 3.0, 4.0]).save(tmp_path / "two.json")
    with pytest.raises(BankError, match="model names repeat"):
        load_bank(tmp_path)
    partial = entry("m", [1.0, 2.0, 3.0, 4.0])
    partial.trials.pop()
    with pytest.raises(BankError, match="3 trials, the space has 4"):
        partial.surface()


def test_synthetic_bank_is_reproducible_and_optima_move():
    space = SearchSpace.default("dlrm")
    first, again = synthetic_bank(6, space, seed=4), synthetic_bank(6, space, seed=4)
    assert first == again
    optima = {e.surface()[0][int(np.nanargmax(e.surface()[1]))] for e in first}
    assert len(optima) > 1
    for e in first:
        assert {t.status for t in e.trials} >= {"ok", "slo_violated"}


def test_replay_metrics_on_a_hand_made_bank():
    # Grid order is the enumeration: trial k observes configuration k - 1.
    entries = [entry("a", [1.0, 9.6, 3.0, 10.0]), entry("b", [5.0, np.nan, 2.0, 1.0]), entry("c", [np.nan, 2, 4, 8])]
    calls = []

    def grid(space, seed, prior, target=None):
        calls.append((seed, sorted(e.name for e in prior), target["name"]))
        return GridSearcher(space)

    result = replay({"grid": grid}, entries, seeds=[0, 1])
    report = result.searchers["grid"]
    assert calls[:2] == [(0, ["b", "c"], "a"), (1, ["b", "c"], "a")]  # leave-one-model-out, told which model
    assert sorted(calls[2][1]) == ["a", "c"] and calls[2][2] == "b"
    np.testing.assert_array_equal(report.trials_to_optimum, [[4, 4], [1, 1], [4, 4]])
    np.testing.assert_array_equal(report.trials_to_within, [[2, 2], [1, 1], [4, 4]])
    np.testing.assert_allclose(report.best_so_far[0, 0], [0.1, 0.96, 0.96, 1.0])
    np.testing.assert_allclose(report.best_so_far[1, 1], [1.0, 1.0, 1.0, 1.0])  # padded after the optimum
    np.testing.assert_allclose(report.best_so_far[2, 0], [0.0, 0.25, 0.5, 1.0])  # a failed first trial counts 0
    summary = report.summary()
    assert summary["within_median"] == 2.0
    assert summary["optimum_mean"] == pytest.approx(3.0)
    assert result.models == ("a", "b", "c") and result.space_sizes == (4, 4, 4)
    # Within each model's own tolerance (its measurement noise, say): a 5%, b exact, c within half.
    np.testing.assert_array_equal(result.trials_to_within("grid", [0.05, 0.0, 0.5]), [[2, 2], [1, 1], [3, 3]])


def test_replay_budget_caps_runs_at_the_space_size():
    entries = [entry("a", [1.0, 9.6, 3.0, 10.0]), entry("b", [5.0, 4.0, 2.0, 1.0])]
    runs = []
    result = replay({"grid": SEARCHERS["grid"]}, entries, seeds=[0], budget=2, on_run=lambda *a: runs.append(a))
    report = result.searchers["grid"]
    np.testing.assert_array_equal(report.trials_to_optimum[:, 0], [4, 1])  # "a" never reached: the space size
    np.testing.assert_array_equal(report.trials_to_within[:, 0], [2, 1])
    np.testing.assert_array_equal(result.trials_to_within("grid", [0.0, 0.0])[:, 0], [4, 1])  # capped as above
    assert report.best_so_far.shape == (2, 1, 2)
    assert runs == [("grid", "a", 0), ("grid", "b", 0)]


def test_replay_refuses_unusable_banks():
    with pytest.raises(ValueError, match="at least two"):
        replay(SEARCHERS, [entry("a", [1.0, 2.0, 3.0, 4.0])], seeds=[0])
    with pytest.raises(ValueError, match="b: no configuration has a positive objective"):
        replay(SEARCHERS, [entry("a", [1.0, 2.0, 3.0, 4.0]), entry("b", [np.nan, 0.0, 0.0, np.nan])], seeds=[0])


@pytest.mark.slow
def test_meta_searcher_beats_random_on_held_out_synthetic_surfaces():
    # 140 configurations: batching (size and timer), shares and replicas on one device.
    space = SearchSpace.parse({"knobs": {
        "max_batch_size": {"values": [1, 2, 4, 8, 16]}, "batch_wait_timeout_s": {"values": [0.0, 0.01, 0.05, 0.1]},
        "device_share": {"values": [0.25, 0.5, 1.0]}, "num_replicas": {"values": [1, 2, 3, 4]}},
        "max_total_share": 1.0})
    bank = synthetic_bank(6, space, seed=11)
    adapt = {"meta_batch": 4, "adapt_steps": 10}
    factories = {
        "random": SEARCHERS["random"],
        "meta": meta_factory(MetaParams(meta_iterations=40, **adapt)),
        "untrained": meta_factory(MetaParams(meta_iterations=1, **adapt)),  # the same surrogate, barely meta-trained
    }
    result = replay(factories, bank, seeds=[0, 1], budget=40)
    medians = {name: report.summary()["within_median"] for name, report in result.searchers.items()}
    assert medians["meta"] < medians["random"]
    assert medians["meta"] < medians["untrained"]


def _timed(base: BankEntry, seconds: list[float | None]) -> BankEntry:
    trials = [trial.model_copy(update={"duration_s": s}) for trial, s in zip(base.trials, seconds, strict=True)]
    return base.model_copy(update={"trials": trials})


def test_the_replay_adds_up_each_runs_recorded_trial_time_to_within_the_tolerance():
    """Grid order: the optimum (configuration 2) is reached at the third trial, after 60 + 120 + 30 s."""
    timed = _timed(entry("timed", [1.0, 2.0, 4.0, 3.0]), [60.0, 120.0, 30.0, 90.0])
    untimed = entry("untimed", [4.0, 3.0, 2.0, 1.0])
    result = replay({"grid": lambda space, seed, prior, target=None: GridSearcher(space)}, [timed, untimed],
                    seeds=[0])
    report = result.searchers["grid"]
    assert report.trials_to_within.tolist() == [[3], [1]]
    minutes = report.minutes_to_within()
    assert minutes[0, 0] == pytest.approx(3.5) and np.isnan(minutes[1, 0])  # no durations recorded: not a figure
    np.testing.assert_array_equal(timed.durations(), [60.0, 120.0, 30.0, 90.0])
    assert np.isnan(untimed.durations()).all()


def test_a_bank_entry_states_its_optimum_over_the_app_as_shipped_only_where_measured():
    from autoconfig.bank import StartingPoint

    base = entry("m", [1.0, 2.0, 6.0, 3.0])
    assert base.gain_over_starting() is None
    shipped = base.model_copy(update={"starting": StartingPoint(status="ok", rps=2.0, objective=2.0, resources=1.0)})
    assert shipped.gain_over_starting() == 3.0
    failed = base.model_copy(update={"starting": StartingPoint(status="slo_violated")})
    assert failed.gain_over_starting() is None
    assert BankEntry.model_validate(json.loads(json.dumps(shipped.model_dump(mode="json")))) == shipped
