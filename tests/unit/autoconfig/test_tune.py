"""Tuning loop over Optuna storage (no Ray): budget, persistence, resume without repeats, refusals.

Kills at many points (SIGKILL, SIGTERM, Ctrl-C of the CLI): test_durability.py.
"""

import json
from pathlib import Path

import pytest
import yaml

from autoconfig.bank import BankEntry, BankError
from autoconfig.searchers import GridSearcher, RandomSearcher
from autoconfig.space import Configuration, SearchSpace
from autoconfig.study import StudyError, TuningStudy, sqlite_url
from autoconfig.trial import TrialRecord
from autoconfig.tuner import confirmed_best, repeat_best, tune, unconfirmed
from tests.helpers import REPO

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
        violated = config["max_batch_size"] == 16 and config["num_replicas"] == 1
        rate = 0.0 if violated else float(config["max_batch_size"] * config["num_replicas"])
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
    assert all(type(o.config["max_batch_size"]) is int for o in reopened.history())
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
    assert outcome.best.config["max_batch_size"] == 16 and outcome.best.config["num_replicas"] == 2


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
        violated = config["max_batch_size"] == 16 and config["num_replicas"] == 1
        assert (value != value) if violated else value == config["max_batch_size"] * config["num_replicas"]  # NaN


def test_profile_refuses_a_bad_model_name_before_any_trial(tmp_path, capsys):
    from autoconfig.cli import main

    argv = ["profile", "--app", "dlrm", "--slo-p99-ms", "50", "--bank", str(tmp_path), "--model-name", "../x",
            "--storage", sqlite_url(tmp_path / "s.db")]
    assert main(argv) == 2
    assert "name" in capsys.readouterr().out and not list(tmp_path.glob("*.json"))



def test_the_confirmed_best_has_the_best_mean_a_run_without_a_rate_counting_zero():
    lucky, steady, tied = SPACE.configurations()[:3]
    best = confirmed_best({lucky: [10.0, None], steady: [9.0, 8.0], tied: [8.5, 8.5]})
    assert best.config == steady and best.value == pytest.approx(8.5)
    assert confirmed_best({steady: [4.0, 4.0], tied: [4.0, 4.0]}).config == steady  # the earlier on a tie
    assert confirmed_best({}) is None


#: What the fake cluster measures for the application as its Serve config has it (no knob applied).
AS_CONFIGURED = TrialRecord(app_name="dlrm", configuration={}, status="ok", objective_name="max_rate", objective=5.0,
                            sustainable_rps=5.0, p99_ms=20.0, resources=1.3, duration_s=60.0)


def _cli_trials(monkeypatch, tmp_path, profile, seen: list[tuple[dict, dict]] | None = None) -> Path:
    """The CLI runs ``profile`` as its trials (``AS_CONFIGURED`` for the app as configured), as if connected to a
    cluster (it starts none), each call's configuration and options into ``seen``; returns a space file of
    ``SPACE``."""
    import ray

    import autoconfig.trial

    def run_trial(template, app, config, *args, **options):
        if seen is not None:
            seen.append((dict(config), options))
        return profile(SPACE.configuration(config)) if config else AS_CONFIGURED

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(autoconfig.trial, "run_trial", run_trial)
    monkeypatch.setattr(autoconfig.trial, "delete_trial_app", lambda name: None)
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE.to_dict()))
    return space


def test_tune_writes_the_configuration_whose_repeats_hold_up_not_the_luckiest_run(tmp_path, monkeypatch, capsys):
    """Two best single runs are measured again (``--repeat-best 2 --repeats 2``): the luckiest then holds no rate,
    so the Serve config written is the runner-up's, and the table shows both configurations' runs."""
    from autoconfig.cli import main
    from autoconfig.knobs import configure_serve_config, write_serve_config
    from autoconfig.serve_config import load_serve_config

    configs = SPACE.configurations()
    runs = {configs[0]: [2.0], configs[1]: [10.0, None], configs[2]: [9.0, 9.0], configs[3]: [1.0]}
    calls: list[Configuration] = []
    space = _cli_trials(monkeypatch, tmp_path, _scripted(runs, calls))
    template = REPO / "deploy/serve_config.yaml"
    argv = ["tune", "--config", str(template), "--app", "dlrm", "--slo-p99-ms", "50", "--space", str(space),
            "--storage", sqlite_url(tmp_path / "s.db"), "--budget", "4", "--searcher", "grid",
            "--repeat-best", "2", "--repeats", "2", "--out", str(tmp_path / "tuned.yaml")]
    assert main(argv) == 0
    assert calls == [*configs[:4], configs[1], configs[2]]
    out = capsys.readouterr().out
    assert "10.00, -" in out and "9.00, 9.00" in out and "did not hold up" in out
    assert "(mean objective over 2 runs 9.00)" in " ".join(out.split())  # rich may wrap the line
    write_serve_config(configure_serve_config(load_serve_config(template), "dlrm", configs[2].as_dict(),
                                              accelerator="cpu"), tmp_path / "expected.yaml")
    assert (tmp_path / "tuned.yaml").read_text() == (tmp_path / "expected.yaml").read_text()
    assert main([*argv[:-2], "--repeats", "0", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "--repeats" in capsys.readouterr().out and not (tmp_path / "x.yaml").exists()


def test_tune_warns_when_the_repeat_limit_leaves_one_of_the_best_on_one_run(tmp_path, monkeypatch, capsys):
    from autoconfig.cli import main

    calls: list[Configuration] = []
    space = _cli_trials(monkeypatch, tmp_path, _scripted(RACE, calls))
    argv = ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--budget", str(len(RACE)),
            "--searcher", "grid", "--repeat-best", "2", "--repeats", "3", "--repeat-limit", "2",
            "--out", str(tmp_path / "tuned.yaml")]
    assert main(argv) == 0
    assert calls == [*RACE, LUCKY, LUCKY, STEADY, STEADY]
    out = " ".join(capsys.readouterr().out.split())
    assert f"warning: {NEXT.as_dict()} ranks among the 2 best on fewer than 3 runs" in out
    assert out.count("warning:") == 1  # LUCKY's mean (6) fell below NEXT's one run


def _noisy(calls: list[Configuration]):
    """``fake_profile``'s objective times 1.0, 1.1, 0.9, ... on the configuration's 1st, 2nd, 3rd measurement."""
    base, seen = fake_profile([]), {}

    def profile(config: Configuration) -> TrialRecord:
        calls.append(config)
        record = base(config)
        factor = (1.0, 1.1, 0.9, 1.2)[seen.get(config, 0)]
        seen[config] = seen.get(config, 0) + 1
        return record.model_copy(update={"objective": record.objective * factor})

    return profile


def test_the_best_configurations_are_measured_again_and_the_spread_is_the_entrys_noise(tmp_path):
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "grid", SPACE)
    calls: list[Configuration] = []
    profile = _noisy(calls)
    tune(study, GridSearcher(SPACE), profile, budget=SPACE.size)
    seen = []
    measured = repeat_best(study, profile, configs=2, runs=3, limit=4,
                           on_repeat=lambda c, run, r: seen.append((c, run)))
    best = [config for config, _ in measured.items()]
    assert [(c["max_batch_size"], c["num_replicas"]) for c in best] == [(16, 2), (16, 2)]  # 32 rps, two of them
    assert len(set(best)) == 2
    assert all(values == pytest.approx([32.0, 35.2, 28.8]) for values in measured.values())
    assert [run for _, run in seen] == [2, 3, 2, 3] and len(calls) == SPACE.size + 4
    assert len(study.history()) == SPACE.size  # the searchers' history keeps one trial per configuration
    entry = study.to_bank_entry({"name": "noisy"}, {}, "max_rate")
    assert [repeat.objectives for repeat in entry.repeats] == [pytest.approx([32.0, 35.2, 28.8])] * 2
    assert entry.noise() == pytest.approx(0.1)  # std [1.0, 1.1, 0.9] = 0.1 over a mean of 1.0
    again = BankEntry.load(_saved(entry, tmp_path / "noisy.json"))
    assert again.repeats == entry.repeats


def test_repeats_resume_where_they_stopped(tmp_path):
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "grid", SPACE)
    tune(study, GridSearcher(SPACE), fake_profile([]), budget=SPACE.size)
    repeat_best(study, fake_profile([]), configs=1, runs=2, limit=2)
    calls: list[Configuration] = []
    measured = repeat_best(TuningStudy.open(sqlite_url(tmp_path / "s.db"), "grid", SPACE), fake_profile(calls),
                           configs=2, runs=3, limit=4)
    assert len(calls) == 1 + 2  # the first configuration's third run, the second one's second and third
    assert all(len(values) == 3 for values in measured.values())


def _scripted(runs: dict[Configuration, list[float | None]], calls: list[Configuration]):
    """Each configuration's objectives in the order measured (None: no rate held); counts its calls."""

    def profile(config: Configuration) -> TrialRecord:
        value = runs[config][sum(call == config for call in calls)]
        calls.append(config)
        return TrialRecord(app_name="dlrm", configuration=config.as_dict(),
                           status="ok" if value else "slo_violated", objective_name="max_rate",
                           objective=value or 0.0, sustainable_rps=value or 0.0, p99_ms=12.5, duration_s=0.1)

    return profile


#: A lucky first run (10, then 4 and 4), then three steady configurations, then a slow one.
LUCKY, STEADY, NEXT, FOURTH, SLOW = SPACE.configurations()[:5]
RACE = {LUCKY: [10.0, 4.0, 4.0], STEADY: [9.0, 8.5, 8.5], NEXT: [8.0, 8.0, 8.0], FOURTH: [7.5, 7.5, 7.5],
        SLOW: [5.0]}


def _graded(tmp_path) -> TuningStudy:
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "race", SPACE)
    calls: list[Configuration] = []
    tune(study, GridSearcher(SPACE), _scripted(RACE, calls), budget=len(RACE))
    return study


def test_racing_lets_the_next_best_in_when_a_lucky_run_does_not_hold_up(tmp_path):
    """The two best single runs are LUCKY and STEADY; LUCKY's repeats bring its mean to 6, below NEXT's 8, so NEXT
    is measured three times too and the two best by mean (STEADY, NEXT) rest on three runs each."""
    study, calls = _graded(tmp_path), []
    measured = repeat_best(study, _scripted({c: v[1:] for c, v in RACE.items()}, calls), configs=2, runs=3, limit=4)
    assert calls == [LUCKY, LUCKY, STEADY, STEADY, NEXT, NEXT]
    assert list(measured) == [STEADY, NEXT, LUCKY]  # best mean first
    assert measured[LUCKY] == pytest.approx([10.0, 4.0, 4.0])
    assert confirmed_best(measured).config == STEADY
    assert unconfirmed(study, configs=2, runs=3) == []


def test_racing_stops_at_the_limit_and_names_what_rests_on_one_run(tmp_path):
    study, calls = _graded(tmp_path), []
    measured = repeat_best(study, _scripted({c: v[1:] for c, v in RACE.items()}, calls), configs=2, runs=3,
                           limit=2)
    assert calls == [LUCKY, LUCKY, STEADY, STEADY] and set(measured) == {LUCKY, STEADY}
    assert unconfirmed(study, configs=2, runs=3) == [NEXT]  # 8.0 on one run beats LUCKY's mean of 6


def test_a_bank_entry_added_to_a_study_comes_back_whole_and_its_racing_resumes(tmp_path):
    study = _graded(tmp_path)
    repeat_best(study, _scripted({c: v[1:] for c, v in RACE.items()}, []), configs=2, runs=3, limit=2)
    entry = study.to_bank_entry({"name": "m"}, {}, "max_rate")
    copy = TuningStudy.open(sqlite_url(tmp_path / "copy.db"), "m", SPACE)
    copy.add_bank_entry(entry)
    assert copy.to_bank_entry({"name": "m"}, {}, "max_rate") == entry
    calls: list[Configuration] = []
    repeat_best(copy, _scripted({NEXT: [8.0, 8.0]}, calls), configs=2, runs=3, limit=4)
    assert calls == [NEXT, NEXT]  # only what the limit left
    with pytest.raises(StudyError, match="already holds trials"):
        copy.add_bank_entry(entry)
    other = SearchSpace.parse({"knobs": {**SPACE.to_dict()["knobs"], "max_batch_size": {"values": [1, 4]}}})
    with pytest.raises(StudyError, match="another search space"):
        TuningStudy.open(sqlite_url(tmp_path / "other.db"), "m", other).add_bank_entry(entry)


@pytest.mark.parametrize(("field", "per_run", "distinct"), [
    ("code", "codes", BankEntry.code_versions),
    ("machine", "machines", BankEntry.machines),
])
def test_each_trial_and_repeat_run_keeps_what_measured_it_through_the_bank(tmp_path, field, per_run, distinct):
    """A profile taken at commit (or on machine) a and raced after a move to b: the entry says so, run by run."""
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "race", SPACE)
    by = lambda measurer, profile: lambda config: profile(config).model_copy(update={field: measurer})  # noqa: E731
    tune(study, GridSearcher(SPACE), by("a", _scripted(RACE, [])), budget=len(RACE))
    repeat_best(study, by("b", _scripted({c: v[1:] for c, v in RACE.items()}, [])), configs=2, runs=3, limit=2)
    entry = study.to_bank_entry({"name": "m"}, {}, "max_rate")
    assert [getattr(trial, field) for trial in entry.trials] == ["a"] * len(RACE)
    assert [getattr(repeat, per_run) for repeat in entry.repeats] == [["a", "b", "b"]] * 2
    assert distinct(entry) == ["a", "b"]
    assert BankEntry.load(_saved(entry, tmp_path / "m.json")) == entry
    copy = TuningStudy.open(sqlite_url(tmp_path / "copy.db"), "m", SPACE)
    copy.add_bank_entry(entry)
    assert copy.to_bank_entry({"name": "m"}, {}, "max_rate") == entry
    # Measurements from before it was recorded: unknown, and said to be.
    old = entry.model_copy(update={"trials": [entry.trials[0].model_copy(update={field: None}), *entry.trials[1:]]})
    assert distinct(old) == [None, "a", "b"]
    raw = entry.model_dump(mode="json")
    raw["repeats"][0][per_run] = ["a", "b"]
    with pytest.raises(BankError, match=rf"repeats\[0\]: {per_run}: 2 for 3 objectives"):
        BankEntry.load(_saved_raw(raw, tmp_path / "bad.json"))


def _saved_raw(raw: dict, path: Path) -> Path:
    path.write_text(json.dumps(raw))
    return path


def test_a_bank_entry_refuses_a_repeat_outside_its_space(tmp_path):
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "grid", SPACE)
    tune(study, GridSearcher(SPACE), fake_profile([]), budget=SPACE.size)
    raw = study.to_bank_entry({"name": "x"}, {}, "max_rate").model_dump(mode="json")
    raw["repeats"] = [{"config": {**raw["trials"][0]["config"], "max_batch_size": 3}, "objectives": [1.0, 2.0]}]
    path = tmp_path / "x.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(BankError, match=r"repeats\[0\]\.config"):
        BankEntry.load(path)


def _saved(entry: BankEntry, path) -> str:
    entry.save(path)
    return str(path)


def test_profile_writes_the_grid_and_the_repeats_with_their_noise(tmp_path, monkeypatch, capsys):
    from autoconfig.cli import main

    space = _cli_trials(monkeypatch, tmp_path, _noisy([]))
    argv = ["profile", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--bank", str(tmp_path / "bank"),
            "--model-name", "m", "--repeat-best", "2", "--repeats", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    entry = BankEntry.load(tmp_path / "bank" / "m.json")
    assert len(entry.trials) == SPACE.size and len(entry.repeats) == 2
    assert entry.model.model_dump()["slo_p99_ms"] == 50.0  # what a searcher may learn from beside the surface
    assert "measurement noise" in out and "10.0%" in out and out.count("repeat 3/3") == 2
    assert main([*argv[:-4], "--repeat-best", "-1", "--repeats", "3"]) == 2
    assert "--repeat-best" in capsys.readouterr().out
    assert main([*argv, "--repeat-limit", "1"]) == 2  # fewer than the 2 best it must confirm
    assert "--repeat-limit" in capsys.readouterr().out
    assert main([*argv, "--min-requests", "0"]) == 2  # refused before any trial, naming the setting
    assert "min_requests" in capsys.readouterr().out


def test_tune_describes_the_model_to_the_bank_searchers_which_start_where_the_alike_model_peaked(
        tmp_path, monkeypatch):
    """``tune --searcher rgpe`` tells the searcher what it tunes (app, arguments, workload, SLO): of two profiled
    models, the one described alike (same app and SLO) outweighs the bank's average for the first trial."""
    from autoconfig.bank import ProfileRecord
    from autoconfig.cli import main

    peak, elsewhere = SPACE.configurations()[3], SPACE.configurations()[20]

    def entry(name: str, description: dict, values: dict) -> BankEntry:
        trials = [ProfileRecord(config=c, status="ok", rps=values.get(c, 0.1), objective=values.get(c, 0.1))
                  for c in SPACE.configurations()]
        return BankEntry(model={"name": name, **description}, machine={}, space=SPACE, trials=trials)

    bank = tmp_path / "bank"
    bank.mkdir()
    # The average of the two (each divided by its best) peaks elsewhere: 0.75 there against 0.5 at the peak.
    entry("alike", {"app": "dlrm", "slo_p99_ms": 50.0}, {peak: 1.0, elsewhere: 0.5}).save(bank / "alike.json")
    entry("unlike", {"app": "diffusion", "slo_p99_ms": 5000.0}, {elsewhere: 1.0}).save(bank / "unlike.json")
    calls: list[Configuration] = []
    space = _cli_trials(monkeypatch, tmp_path, fake_profile(calls))
    argv = ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--budget", "1",
            "--searcher", "rgpe", "--bank", str(bank), "--out", str(tmp_path / "tuned.yaml"), "--repeats", "1"]
    code = main(argv)
    assert calls == [peak] and code == 0


def test_what_each_trial_and_repeat_run_lost_to_other_work_survives_the_bank(tmp_path):
    """Trials measured beside other work, raced on a quiet node: the entry keeps each run's interference and names
    the most any lost."""
    from autoconfig.interference import Interference

    busy, quiet = Interference(steal=0.1, foreign=0.3), Interference(steal=0.0, foreign=0.01)
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "race", SPACE)
    beside = lambda lost, profile: lambda config: profile(config).model_copy(update={"interference": lost})  # noqa: E731
    tune(study, GridSearcher(SPACE), beside(busy, _scripted(RACE, [])), budget=len(RACE))
    repeat_best(study, beside(quiet, _scripted({c: v[1:] for c, v in RACE.items()}, [])), configs=2, runs=3, limit=2)
    entry = study.to_bank_entry({"name": "m"}, {}, "max_rate")
    assert [trial.interference for trial in entry.trials] == [busy] * len(RACE)
    assert [repeat.interference for repeat in entry.repeats] == [[busy, quiet, quiet]] * 2
    assert entry.most_lost() == pytest.approx(0.4)
    assert BankEntry.load(_saved(entry, tmp_path / "m.json")) == entry
    copy = TuningStudy.open(sqlite_url(tmp_path / "copy.db"), "m", SPACE)
    copy.add_bank_entry(entry)
    assert copy.to_bank_entry({"name": "m"}, {}, "max_rate") == entry
    unrecorded = entry.model_copy(update={"trials": [t.model_copy(update={"interference": None})
                                                     for t in entry.trials], "repeats": []})
    assert unrecorded.most_lost() is None
    raw = entry.model_dump(mode="json")
    raw["repeats"][1]["interference"] = raw["repeats"][1]["interference"][:2]
    with pytest.raises(BankError, match=r"repeats\[1\]: interference: 2 for 3 objectives"):
        BankEntry.load(_saved_raw(raw, tmp_path / "bad.json"))


def test_tune_flags_the_trials_measured_while_the_node_was_busy_elsewhere(tmp_path, monkeypatch, capsys):
    """Trials 2 and 4 lost a fifth of the CPUs: their progress lines say how, and the run ends with one warning
    naming them; a trial that lost 2% is not flagged."""
    from autoconfig.cli import main
    from autoconfig.interference import Interference

    configs, calls = SPACE.configurations(), []
    losses = {configs[1]: Interference(steal=0.05, foreign=0.15), configs[3]: Interference(steal=0.2, foreign=0.0)}
    scripted = _scripted({config: [float(i + 1)] for i, config in enumerate(configs[:4])}, calls)
    space = _cli_trials(monkeypatch, tmp_path, lambda config: scripted(config).model_copy(
        update={"interference": losses.get(config, Interference(steal=0.0, foreign=0.02))}))
    argv = ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--budget", "4",
            "--searcher", "grid", "--repeats", "1", "--out", str(tmp_path / "tuned.yaml")]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(20% of the CPUs busy elsewhere (steal 5%, other processes 15%))" in out
    assert "(20% of the CPUs busy elsewhere (steal 20%, other processes 0%))" in out
    assert out.count("of the CPUs busy elsewhere") == 2
    assert "warning: 2 trial(s) (2, 4) and 0 repeat run(s) lost 5% or more of the node's CPUs" in out


def test_a_measurement_that_lost_too_much_is_taken_again_up_to_the_retries_and_the_last_kept():
    from autoconfig.interference import Interference
    from autoconfig.tuner import remeasured_while_interfered

    config, calls, set_aside = SPACE.configurations()[0], [], []
    losses = iter([0.5, 0.3, 0.02, 0.4])  # two spoiled runs, then a quiet one (the fourth is never taken)

    def profile(config):
        calls.append(config)
        lost = next(losses)
        return TrialRecord(app_name="dlrm", configuration=config.as_dict(), status="ok", objective_name="max_rate",
                           objective=10 * (1 - lost), sustainable_rps=10 * (1 - lost), duration_s=0.1,
                           interference=Interference(steal=0.0, foreign=lost))

    measure = remeasured_while_interfered(profile, limit=0.1, retries=2,
                                          on_retry=lambda c, attempt, r: set_aside.append((attempt, r.objective)))
    assert measure(config).objective == pytest.approx(9.8)
    assert len(calls) == 3 and set_aside == [(1, pytest.approx(5.0)), (2, pytest.approx(7.0))]
    losses = iter([0.5, 0.3, 0.2])
    assert measure(config).objective == pytest.approx(8.0)  # retries spent: the last is kept, however spoiled
    unrecorded = remeasured_while_interfered(
        lambda c: profile(c).model_copy(update={"interference": None}), limit=0.1, retries=2)
    losses, calls[:] = iter([0.5]), []
    unrecorded(config)
    assert len(calls) == 1  # nothing recorded: nothing to judge


def test_tune_measures_a_spoiled_trial_again_and_refuses_a_bad_interference_limit(tmp_path, monkeypatch, capsys):
    from autoconfig.cli import main
    from autoconfig.interference import Interference

    configs, calls = SPACE.configurations(), []
    spoiled = iter([Interference(steal=0.0, foreign=0.4), Interference(steal=0.0, foreign=0.01)])
    scripted = _scripted({configs[0]: [5.0, 9.0], configs[1]: [8.0]}, calls)
    space = _cli_trials(monkeypatch, tmp_path, lambda config: scripted(config).model_copy(
        update={"interference": next(spoiled) if config == configs[0] else Interference(steal=0.0, foreign=0.0)}))
    argv = ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--budget", "2",
            "--searcher", "grid", "--repeats", "1", "--out", str(tmp_path / "tuned.yaml")]
    assert main([*argv, "--max-interference", "0.1"]) == 0
    assert calls == [configs[0], configs[0], configs[1]]
    out = " ".join(capsys.readouterr().out.split())
    assert (f"measuring {configs[0].as_dict()} again (1/2): 5.0 rps with 40% of the CPUs busy elsewhere "
            "(steal 0%, other processes 40%)") in out
    assert f"best: {configs[0].as_dict()} (objective 9.00)" in out  # the quiet measurement, not the spoiled one
    for value in ("0", "1.5"):
        assert main([*argv, "--max-interference", value]) == 2
        assert "--max-interference must be in (0, 1]" in capsys.readouterr().out
    assert main([*argv, "--interference-retries", "-1"]) == 2
    assert "--interference-retries must be >= 0" in capsys.readouterr().out


def test_tune_warns_when_it_resumes_a_study_measured_on_other_hardware(tmp_path, monkeypatch, capsys):
    """Two trials measured on machine a, resumed here: the run says how many were measured where, and names this
    machine; resuming on the same machine says nothing."""
    from autoconfig.cli import main
    from autoconfig.provenance import machine_id

    configs, calls = SPACE.configurations(), []
    scripted = _scripted({config: [float(i + 1)] for i, config in enumerate(configs[:3])}, calls)
    on = {"machine": "a"}
    space = _cli_trials(monkeypatch, tmp_path, lambda config: scripted(config).model_copy(update=on))
    argv = ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--searcher", "grid",
            "--repeats", "1", "--out", str(tmp_path / "tuned.yaml")]
    assert main([*argv, "--budget", "2"]) == 0
    assert "other hardware" not in capsys.readouterr().out  # a new study
    on["machine"] = machine_id()
    assert main([*argv, "--budget", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"holds measurements taken on other hardware (2 on a); this machine is {machine_id()}" in out
    assert calls == list(configs[:3])
    capsys.readouterr()
    study = TuningStudy.load(sqlite_url(tmp_path / "s.db"), "dlrm-grid")
    assert [record["machine"] for record in study.records()] == ["a", "a", machine_id()]


def _tune_argv(tmp_path: Path, space: Path, *more: str) -> list[str]:
    return ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--searcher", "grid",
            "--repeat-best", "0", "--out", str(tmp_path / "tuned.yaml"), *more]


def test_tune_measures_the_app_as_configured_first_once_per_study_and_ends_with_the_gain(tmp_path, monkeypatch,
                                                                                         capsys):
    from autoconfig.cli import main

    seen: list[tuple[dict, dict]] = []
    space = _cli_trials(monkeypatch, tmp_path, fake_profile([]), seen)
    assert main(_tune_argv(tmp_path, space, "--budget", "4")) == 0
    assert [config for config, _ in seen][:2] == [{}, SPACE.configurations()[0].as_dict()]  # before any trial
    out = " ".join(capsys.readouterr().out.split())
    assert "the app as configured -> ok, 5.0 rps, objective 5.00" in out
    # The grid's first 4 are batch 1: at best 1 x 2 replicas = 2.0, below the app as configured.
    assert "tuned objective 2.00 against 5.00 for the app as configured: 0.40x; tuning took " in out
    assert "(the study's trials 0.0 min in all)" in out  # 4 trials of 0.1 s
    assert main(_tune_argv(tmp_path, space, "--budget", str(SPACE.size))) == 0  # resumed: not measured again
    assert [config for config, _ in seen].count({}) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "the app as configured ->" not in out
    assert "tuned objective 32.00 against 5.00 for the app as configured: 6.40x" in out
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "dlrm-grid", SPACE)
    assert study.starting_point()["objective"] == 5.0 and study.starting_point()["resources"] == 1.3


def test_profile_keeps_the_app_as_configured_in_the_bank_entry(tmp_path, monkeypatch):
    from autoconfig.cli import main

    space = _cli_trials(monkeypatch, tmp_path, fake_profile([]))
    argv = ["profile", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--bank", str(tmp_path / "bank"),
            "--model-name", "m", "--repeat-best", "0"]
    assert main(argv) == 0
    entry = BankEntry.load(tmp_path / "bank" / "m.json")
    assert entry.starting is not None
    assert (entry.starting.status, entry.starting.objective, entry.starting.rps, entry.starting.resources) == (
        "ok", 5.0, 5.0, 1.3)
    copy = TuningStudy.open(sqlite_url(tmp_path / "copy.db"), "copy", SPACE)
    copy.add_bank_entry(entry)
    assert copy.to_bank_entry(entry.model.model_dump(), entry.machine, "max_rate").starting == entry.starting


def test_tune_with_the_app_as_configured_holding_no_rate_states_no_gain(tmp_path, monkeypatch, capsys):
    from autoconfig.cli import main
    from autoconfig.tune_command import gain_line

    space = _cli_trials(monkeypatch, tmp_path, fake_profile([]))
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "dlrm-grid", SPACE)
    study.record_starting_point({"status": "failed", "objective": 0.0, "error": "ValueError: needs 9 CPU"})
    assert main(_tune_argv(tmp_path, space, "--budget", "2")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the app as configured held no rate within the SLO (ValueError: needs 9 CPU): no gain to state" in out
    assert gain_line(4.0, None, study, 90.0).startswith("tuning took 1.5 min")


def test_gpu_share_mode_needs_a_gpu_and_mps_a_daemon_on_every_gpu_node(tmp_path, monkeypatch, capsys):
    import autoconfig.tune_command
    from autoconfig.cli import main

    seen: list[tuple[dict, dict]] = []
    space = _cli_trials(monkeypatch, tmp_path, fake_profile([]), seen)
    assert main(_tune_argv(tmp_path, space, "--budget", "2", "--gpu-share-mode", "mps")) == 2
    assert "--gpu-share-mode mps: GPU shares need --accelerator gpu" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setattr(autoconfig.tune_command, "gpu_nodes_without_mps", lambda: {"n1": "no daemon"})
    gpu = ("--budget", "2", "--accelerator", "gpu")
    assert main(_tune_argv(tmp_path, space, *gpu, "--gpu-share-mode", "mps")) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "error: --gpu-share-mode mps: node n1: no daemon" in out and not seen  # before any trial
    assert main(_tune_argv(tmp_path, space, *gpu)) == 0  # the default falls back to memory, warned
    out = " ".join(capsys.readouterr().out.split())
    assert "warning: --gpu-share-mode memory: device_share divides GPU memory, not compute" in out
    assert {options["gpu_share_mode"] for _, options in seen} == {"memory"}
    tuned = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    dense = next(entry for app in tuned["applications"] if app["name"] == "dlrm" for entry in app["deployments"]
                 if entry["name"] == "DisaggregatedDLRM")
    assert set(dense["ray_actor_options"]["runtime_env"]["env_vars"]) == {"SWIFTSERVE_CUDA_MEMORY_FRACTION"}
    monkeypatch.setattr(autoconfig.tune_command, "gpu_nodes_without_mps", lambda: {})
    seen.clear()
    assert main([*_tune_argv(tmp_path, space, *gpu), "--study", "mps"]) == 0  # every node answers: mps
    assert {options["gpu_share_mode"] for _, options in seen} == {"mps"}
    tuned = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    dense = next(entry for app in tuned["applications"] if app["name"] == "dlrm" for entry in app["deployments"]
                 if entry["name"] == "DisaggregatedDLRM")
    share = dense["ray_actor_options"]["num_gpus"]
    assert dense["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "SWIFTSERVE_CUDA_MEMORY_FRACTION": str(share), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(round(100 * share))}


def test_a_study_measured_in_another_session_gets_its_best_measured_again_beside_the_app_as_configured(
        tmp_path, monkeypatch):
    """A top-up of a stored grid: the starting point is measured now, so the grid's best is measured again right
    after it, and the entry's gain compares those two, not one taken in another session."""
    from autoconfig.cli import main

    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "m", SPACE)
    tune(study, GridSearcher(SPACE), fake_profile([]), budget=SPACE.size)  # the grid, earlier
    best = max(study.history(), key=lambda o: o.value or 0.0).config
    seen: list[tuple[dict, dict]] = []
    halved = fake_profile([])  # today the machine runs at half speed: every objective halves

    def today(config: Configuration) -> TrialRecord:
        record = halved(config)
        return record.model_copy(update={"objective": record.objective / 2})

    space = _cli_trials(monkeypatch, tmp_path, today, seen)
    argv = ["profile", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--study", "m",
            "--bank", str(tmp_path / "bank"), "--model-name", "m", "--repeat-best", "0"]
    assert main(argv) == 0
    assert [config for config, _ in seen] == [{}, best.as_dict()]  # nothing else: the grid was complete
    entry = BankEntry.load(tmp_path / "bank" / "m.json")
    assert entry.starting.reference_config == best and entry.starting.reference_objective == 16.0
    assert entry.gain_over_starting() == 16.0 / 5.0  # not the grid's 32 over today's 5
