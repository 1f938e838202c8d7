"""Limits and Pareto fronts (no Ray): what counts as over a limit, which trials the front keeps, the pareto
searcher's view of the trials, tune with a memory limit, and the CLI's front."""

import json
import os

import psutil
import pytest
import yaml

from autoconfig import trial as trial_module
from autoconfig.cli import main
from autoconfig.pareto import Limits, dominates, front_metrics, pareto_front
from autoconfig.searchers import GridSearcher, ParetoSearcher
from autoconfig.searchers.base import Observation
from autoconfig.space import Configuration, SearchSpace
from autoconfig.study import TuningStudy, sqlite_url
from autoconfig.trial import TrialRecord, replica_memory_mib
from autoconfig.tuner import tune
from tests.helpers import REPO

SPACE = SearchSpace.parse({"knobs": {
    "max_batch_size": {"values": [1, 4, 16, 64]},
    "batch_wait_timeout_s": {"values": [0.0]},
    "device_share": {"values": [1.0]},
    "num_replicas": {"values": [1, 2]},
}})


def _record(objective: float, p99: float | None, memory: float | None = None, status: str = "ok") -> dict:
    return {"status": status, "objective": objective, "p99_ms": p99, "memory_mib": memory}


def test_limits_measure_how_far_over_and_say_why():
    limits = Limits(max_memory_mib=500)
    assert limits.violation({"memory_mib": 400}) == (0.0, None)
    over, why = limits.violation({"memory_mib": 750})
    assert over == pytest.approx(0.5) and why == "memory 750 MiB over the limit of 500 MiB"
    assert limits.violation({"memory_mib": None}) == (1.0, "memory not measured")  # cannot be shown within
    assert Limits().violation({"memory_mib": 10_000}) == (0.0, None)


def test_the_front_keeps_what_nothing_beats_on_objective_p99_and_memory():
    records = [
        _record(100, 50, 300),   # best objective
        _record(80, 20, 300),    # lower latency
        _record(70, 30, 300),    # dominated by #1 (lower objective, higher p99, same memory)
        _record(60, 25, 100),    # least memory: kept
        _record(90, 10, 900, status="slo_violated"),  # not ok: never on the front
    ]
    assert front_metrics(records) == ("objective", "p99_ms", "memory_mib")
    assert pareto_front(records) == [0, 1, 3]
    assert pareto_front(records, Limits(max_memory_mib=200)) == [3]  # the limit leaves one
    assert pareto_front([{**records[0], "violation": 0.5}, *records[1:]]) == [1, 3]  # over the study's limit
    records[3]["memory_mib"] = None  # memory unmeasured somewhere: the front is over objective and p99
    assert front_metrics(records) == ("objective", "p99_ms") and pareto_front(records) == [0, 1]
    assert dominates((2, -1), (1, -1)) and not dominates((1, -1), (1, -1))


def test_the_pareto_searcher_gives_optuna_both_objectives_and_the_limits():
    configs = SPACE.configurations()
    history = [Observation(configs[0], 10.0, {"p99_ms": 5.0, "violation": 0.0}),
               Observation(configs[1], 30.0, {"p99_ms": 9.0, "violation": 0.0}),
               Observation(configs[2], 40.0, {"p99_ms": 4.0, "violation": 0.3}),  # over a limit
               Observation(configs[3], None, {})]  # failed: no latency
    searcher = ParetoSearcher(SPACE, seed=0)
    study = searcher._sync(history)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "COMPLETE", "FAIL"]
    assert study.trials[2].constraints == {"limits": 0.3}
    # Optuna's own front (feasible trials first) is ours: the over-limit trial that beats both is left out.
    assert sorted(t.number for t in study.best_trials) == [0, 1]
    assert searcher.suggest(history) not in configs[:4]


def _memory_profile(config: Configuration) -> TrialRecord:
    """Objective = batch x replicas; memory 100 MiB per replica per batch-16 block."""
    rate = float(config["max_batch_size"] * config["num_replicas"])
    memory = 100.0 * config["num_replicas"] * max(1, config["max_batch_size"] // 16)
    return TrialRecord(app_name="app", configuration=config.as_dict(), status="ok", objective_name="max_rate",
                       objective=rate, sustainable_rps=rate, p99_ms=10.0 + config["max_batch_size"],
                       memory_mib=memory, duration_s=0.1)


def test_tune_counts_a_trial_over_the_memory_limit_as_not_met(tmp_path):
    study = TuningStudy.open(sqlite_url(tmp_path / "s.db"), "s", SPACE)
    outcome = tune(study, GridSearcher(SPACE), _memory_profile, budget=SPACE.size, limits=Limits(max_memory_mib=250))
    over = [o for o in outcome.history if o.config["max_batch_size"] == 64]  # 400 and 800 MiB
    assert over and all(o.value is None and o.metrics["violation"] > 0 for o in over)
    assert outcome.best.config == {"max_batch_size": 16, "batch_wait_timeout_s": 0.0, "device_share": 1.0,
                                   "num_replicas": 2}  # 200 MiB: the best within the limit
    stored = {r["config"]["max_batch_size"]: r for r in study.records() if r["config"]["num_replicas"] == 1}
    assert stored[64]["limit"] == "memory 400 MiB over the limit of 250 MiB" and "limit" not in stored[16]


def test_tune_cli_writes_the_front_within_the_memory_limit(tmp_path, monkeypatch, capsys):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    # The app as configured (no knob) measures as the space's first configuration does.
    monkeypatch.setattr(trial_module, "run_trial", lambda template, app, config, *a, **k: _memory_profile(
        SPACE.configuration(config or SPACE.configurations()[0].as_dict())))
    monkeypatch.setattr(trial_module, "delete_trial_app", lambda name: None)
    space, front = tmp_path / "space.yaml", tmp_path / "front.json"
    space.write_text(yaml.safe_dump(SPACE.to_dict()))
    argv = ["tune", "--config", str(REPO / "deploy/serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(tmp_path / "s.db"), "--budget", str(SPACE.size),
            "--searcher", "pareto", "--max-memory-mib", "250", "--front-out", str(front),
            "--out", str(tmp_path / "tuned.yaml")]
    assert main(argv) == 0
    assert "Pareto front" in capsys.readouterr().out
    points = json.loads(front.read_text())
    # Within 250 MiB nothing beats batch 16 x 2 replicas on rate, nor 1 x 1 on latency and memory.
    shapes = [(p["config"]["max_batch_size"], p["config"]["num_replicas"]) for p in points]
    assert shapes[0] == (16, 2) and (1, 1) in shapes
    assert all(p["memory_mib"] <= 250 for p in points)
    assert [p["objective"] for p in points] == sorted((p["objective"] for p in points), reverse=True)


def test_replica_memory_is_the_rss_of_this_nodes_replicas_and_unknown_elsewhere(monkeypatch):
    monkeypatch.setattr(trial_module.ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    me = {"state": "RUNNING", "pid": os.getpid(), "node_ip": "10.0.0.1"}
    details = {"deployments": {"A": {"replicas": [me, {**me, "state": "STOPPING", "pid": 1}]}, "B": {"replicas": [me]}}}
    rss = psutil.Process().memory_info().rss / 2**20
    assert replica_memory_mib(details) == pytest.approx(2 * rss, rel=0.05)
    details["deployments"]["B"]["replicas"] = [{**me, "node_ip": "10.0.0.2"}]
    assert replica_memory_mib(details) is None
    assert replica_memory_mib({"deployments": {}}) is None


def test_max_replicas_leaves_out_configurations_with_more_replicas():
    space = SearchSpace.parse({"knobs": {"num_replicas": {"values": [1, 2, 3]}, "max_batch_size": {"values": [1]},
                                         "batch_wait_timeout_s": {"values": [0.0]}, "device_share": {"values": [1.0]},
                                         "ControlNet_*.num_replicas": {"values": [1, 2]}}, "max_replicas": 3})
    assert [(c["num_replicas"], c["ControlNet_*.num_replicas"]) for c in space.configurations()] == [
        (1, 1), (1, 2), (2, 1)]
    with pytest.raises(ValueError, match="max_replicas: needs num_replicas"):
        SearchSpace.parse({"knobs": {"M.user_config.a": {"values": [1]}}, "max_replicas": 2})
