"""What a trial records from its rate search (no Ray: the search results are built here)."""

import pytest

from autoconfig.stress import LoadResult, Probe, RateSearchResult
from autoconfig.trial import deployment_resources, search_fields


def _load(rate: float, planned: int, p99_ms: float) -> LoadResult:
    return LoadResult(rate=rate, duration_s=planned / rate, planned=planned, completed=planned, errors=0,
                      p50_ms=p99_ms / 2, p99_ms=p99_ms, achieved_rps=0.98 * rate)


def _search(best: LoadResult | None, stop_reason: str, probes: list[Probe]) -> RateSearchResult:
    return RateSearchResult(slo_p99_ms=100, sustainable_rps=best.rate if best else 0.0, best=best, probes=probes,
                            stop_reason=stop_reason, duration_s=1.0)


def test_a_held_rate_is_ok_with_the_deciding_probes_measurements_and_achieved_rate():
    best = _load(40, 200, 80)
    fields = search_fields(_search(best, "converged", [Probe(result=best, sustainable=True)]), min_requests=200)
    assert fields["status"] == "ok" and fields["sustainable_rps"] == 40
    assert fields["achieved_rps"] == pytest.approx(39.2) and fields["p99_ms"] == 80 and "error" not in fields


def test_no_rate_holding_is_an_slo_violation_with_the_latency_of_the_lowest_rate_probed():
    broken = [Probe(result=_load(rate, 200, p99), sustainable=False) for rate, p99 in ((5, 500), (2.5, 300))]
    fields = search_fields(_search(None, "unsustainable", broken), min_requests=200)
    assert fields["status"] == "slo_violated" and fields["sustainable_rps"] == 0 and "error" not in fields
    assert (fields["p99_ms"], fields["p50_ms"], fields["achieved_rps"]) == (300, 150, pytest.approx(2.45))


def test_an_slo_violation_reports_the_deciding_probe_that_broke_not_the_scout_at_the_same_rate():
    scout = Probe(result=_load(8, 8, 40), sustainable=True, deciding=False)
    deciding = LoadResult(rate=8, duration_s=25, planned=200, completed=190, errors=10, p50_ms=90, p99_ms=220,
                          achieved_rps=7.6)
    fields = search_fields(_search(None, "unsustainable", [scout, Probe(result=deciding, sustainable=False)]),
                           min_requests=200)
    assert fields["status"] == "slo_violated"
    assert (fields["p99_ms"], fields["achieved_rps"], fields["error_rate"]) == (220, 7.6, pytest.approx(0.05))


@pytest.mark.parametrize("cap", ["max_probes", "max_time"])
def test_caps_reached_before_any_deciding_probe_held_fail_the_trial_and_say_why(cap):
    scouts = [Probe(result=_load(rate, 5, 10), sustainable=True, deciding=False) for rate in (5, 10)]
    fields = search_fields(_search(None, cap, scouts), min_requests=200)
    assert fields["status"] == "failed" and fields["sustainable_rps"] == 0
    assert cap in fields["error"] and "200 requests" in fields["error"]


def test_an_apps_resources_count_every_deployment_with_serves_default_of_one_cpu():
    details = {"deployments": {
        "DisaggregatedDLRM": {"deployment_config": {"ray_actor_options": {"num_cpus": 0.5}}, "target_num_replicas": 3},
        "EmbeddingShard_0": {"deployment_config": {"ray_actor_options": {"num_cpus": 0.25}}, "target_num_replicas": 2},
        "ShardDirectory": {"deployment_config": {"ray_actor_options": {"num_cpus": 0}}, "target_num_replicas": 1},
        "Ingress": {"deployment_config": {}, "replicas": [{}, {}]},  # no options: Serve reserves one CPU each
        "Model": {"deployment_config": {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0.5}},
                  "target_num_replicas": 2},
    }}
    assert deployment_resources(details, "cpu") == {"DisaggregatedDLRM": 1.5, "EmbeddingShard_0": 0.5,
                                                    "ShardDirectory": 0.0, "Ingress": 2.0, "Model": 2.0}
    assert deployment_resources(details, "gpu") == {"DisaggregatedDLRM": 0.0, "EmbeddingShard_0": 0.0,
                                                    "ShardDirectory": 0.0, "Ingress": 0.0, "Model": 1.0}
