"""Tuning loop over Optuna storage (no Ray): budget, persistence, resume without repeats, refusals.

Kills at many points (SIGKILL, SIGTERM, Ctrl-C of the CLI): test_durability.py.
"""

import pytest

from autoconfig.searchers import GridSearcher, RandomSearcher
from autoconfig.space import Configuration, SearchSpace
from autoconfig.study import StudyError, TuningStudy, sqlite_url
from autoconfig.trial import TrialRecord
from autoconfig.tuner import tune

SPACE = SearchSpace.parse({"knobs": {
    "max_batch_size": {"values": [1, 4, 16]},
    "batch_wait_timeout_s": {"values": [0.0, 0.01]},
    "device_share": {"values": [0.5, 1.0]},
    "num_replicas": {"values": [1, 2]},
}})


def fake_profile(calls: list[Configuration], *, interrupt_at: int | None = None):
    """Objective = batch size x replicas; batch 16 on one replica breaks the SLO; counts its calls."""

    def profile(config: Configuration) -> TrialRecord:
        if interrupt_at is not None and len(calls) == interrupt_at:
            raise KeyboardInterrupt  # the process is stopped in the middle of a trial
        calls.append(config)
        violated = config.max_batch_size == 16 and config.num_replicas == 1
        rate = 0.0 if violated else float(config.max_batch_size * config.num_replicas)
        return TrialRecord(app_name="dlrm", configuration=config.as_dict(),
                           status="slo_violated" if violated else "ok", objective_name="max_rate",
                           objective=rate, sustainable_rps=rate, p99_ms=12.5, duration_s=0.1)

    return profile


def test_tune_spends_the_budget_and_persists_every_trial(tmp_path):
    url = sqlite_url(tmp_path / "studies.db")
    calls: list[Configuration] = []
    outcome = tune(TuningStudy.open(url, "dlrm", SPACE), GridSearcher(SPACE), fake_profile(calls), budget=5)
    assert outcome.ran == 5 and len(calls) == 5
    reopened = TuningStudy.open(url, "dlrm", SPACE)
    assert [o.config for o in reopened.history()] == calls
    assert all(type(o.config.max_batch_size) is int for o in reopened.history())
    assert reopened.records()[0]["p99_ms"] == 12.5 and reopened.records()[0]["status"] == "ok"
    assert outcome.best.value == max(o.value for o in outcome.history if o.value is not None)


def test_interrupted_tune_resumes_with_finished_trials_intact_and_no_repeats(tmp_path):
    url = sqlite_url(tmp_path / "studies.db")
    calls: list[Configuration] = []
    with pytest.raises(KeyboardInterrupt):
        tune(TuningStudy.open(url, "s", SPACE), RandomSearcher(SPACE, seed=1), fake_profile(calls, interrupt_at=3),
             budget=10)
    assert len(TuningStudy.open(url, "s", SPACE).history()) == 3  # the interrupted trial left nothing behind
    more: list[Configuration] = []
    outcome = tune(TuningStudy.open(url, "s", SPACE), RandomSearcher(SPACE, seed=2), fake_profile(more), budget=10)
    assert outcome.ran == 7
    assert len(set(calls + more)) == 10  # no finished configuration profiled twice


def test_slo_violations_are_failed_trials_and_best_is_the_feasible_maximum(tmp_path):
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "all", SPACE)
    outcome = tune(study, GridSearcher(SPACE), fake_profile([]), budget=SPACE.size + 5)
    assert outcome.exhausted and outcome.ran == SPACE.size
    assert sum(o.value is None for o in outcome.history) == 4  # batch 16 on one replica, x2 waits x2 shares
    assert outcome.best.config.max_batch_size == 16 and outcome.best.config.num_replicas == 2


def test_unreachable_storage_and_another_space_are_refused_before_any_trial(tmp_path):
    with pytest.raises(StudyError, match="cannot open study"):
        TuningStudy.open(f"sqlite:///{tmp_path}/missing-dir/s.db", "s", SPACE)
    url = sqlite_url(tmp_path / "s.db")
    TuningStudy.open(url, "s", SPACE)
    other = SearchSpace.parse({"knobs": {**SPACE.to_dict()["knobs"], "num_replicas": {"values": [1, 2, 3]}}})
    with pytest.raises(StudyError, match="another search space"):
        TuningStudy.open(url, "s", other)


def test_a_full_grid_study_becomes_a_bank_entry_with_every_status(tmp_path):
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "grid", SPACE)
    tune(study, GridSearcher(SPACE), fake_profile([]), budget=SPACE.size)
    entry = study.to_bank_entry({"name": "tiny-dlrm", "app": "dlrm"}, {"cpus": 2}, "max_rate")
    configs, values = entry.surface()  # refuses an entry that does not cover the space
    assert entry.objective == "rps" and entry.name == "tiny-dlrm"
    assert sum(trial.status == "slo_violated" for trial in entry.trials) == 4
    for config, value in zip(configs, values, strict=True):
        violated = config.max_batch_size == 16 and config.num_replicas == 1
        assert (value != value) if violated else value == config.max_batch_size * config.num_replicas  # NaN


def test_profile_refuses_a_bad_model_name_before_any_trial(tmp_path, capsys):
    from autoconfig.cli import main

    argv = ["profile", "--app", "dlrm", "--slo-p99-ms", "50", "--bank", str(tmp_path), "--model-name", "../x",
            "--storage", sqlite_url(tmp_path / "s.db")]
    assert main(argv) == 2
    assert "name" in capsys.readouterr().out and not list(tmp_path.glob("*.json"))

