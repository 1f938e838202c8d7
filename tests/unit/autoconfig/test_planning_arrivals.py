"""Arrivals (``autoconfig.planning.arrivals``): services drawn in a seeded order, whole, unit by unit, until the
arrived share of a capacity is reached; and placements' snapshots of their own earlier states."""

import numpy as np
import pytest

from autoconfig.planning.arrivals import arrivals, share, units
from autoconfig.planning.cluster import Cluster, NodeShape
from autoconfig.planning.placement import place
from autoconfig.planning.services import TraceRow


def row(name: str, role: str, app: str, cpus: float, memory: float, gpus: float = 0.0) -> TraceRow:
    return TraceRow(name, role, app, cpus, gpus, memory, None, None, None)  # type: ignore[arg-type]


def service(app: str, hn: int, cn: int, *, hn_shape=(8, 40, 1), cn_shape=(32, 128)) -> list[TraceRow]:
    return ([row(f"{app}-h{i}", "HN", app, hn_shape[0], hn_shape[1], hn_shape[2]) for i in range(hn)]
            + [row(f"{app}-c{i}", "CN", app, *cn_shape) for i in range(cn)])


POOL = [*service("a", 2, 3), *service("b", 1, 0), *service("c", 0, 2, cn_shape=(16, 64)),
        *service("d", 3, 1, hn_shape=(4, 16, 0.5)), *service("e", 1, 4)]
CAPACITY = {"cpus": 400.0, "memory_gib": 2000.0, "gpus": 8.0}


def test_units_keep_each_services_cn_hn_mix_and_the_fusion_rule():
    drawn = units(POOL)
    a = drawn["a"]
    # 2 HN, 3 CN: unit 0 brings HN 0 and CN 0 (floor(0 * 3 / 2) to floor(3 / 2) - 1), unit 1 HN 1 and CN 1, 2.
    assert [[i.name for i in u.disaggregated] for u in a] == [["a-h0", "a-c0"], ["a-h1", "a-c1", "a-c2"]]
    # Monolithic: each HN fused with half of the service's CN CPUs and memory (3 * 32 / 2, 3 * 128 / 2).
    assert [(i.name, i.cpus, i.memory_gib, i.gpus) for u in a for i in u.monolithic] == [
        ("a-h0", 8 + 48, 40 + 192, 1), ("a-h1", 8 + 48, 40 + 192, 1)]
    assert [[i.name for i in u.disaggregated] for u in drawn["b"]] == [["b-h0"]]  # no CN: the HN as it is
    assert drawn["b"][0].monolithic[0].cpus == 8
    c = drawn["c"]  # no HN: one CN instance per unit, the same in both layouts
    assert [u.monolithic for u in c] == [u.disaggregated for u in c] and len(c) == 2
    # A whole service asks the same CPUs, memory and GPUs in both layouts.
    for service_units in drawn.values():
        mono = [i for u in service_units for i in u.monolithic]
        disagg = [i for u in service_units for i in u.disaggregated]
        for attribute in ("cpus", "memory_gib", "gpus"):
            assert sum(getattr(i, attribute) for i in mono) == pytest.approx(sum(getattr(i, attribute) for i in disagg))


def test_the_same_seed_gives_the_same_arrivals_and_services_arrive_whole():
    first, again = arrivals(POOL, 42, CAPACITY, 1.0), arrivals(POOL, 42, CAPACITY, 1.0)
    assert [i.name for i in first.instances("disaggregated")] == [i.name for i in again.instances("disaggregated")]
    assert np.array_equal(first.arrived, again.arrived)
    orders = {tuple(arrivals(POOL, seed, CAPACITY, 1.0).services[:5]) for seed in range(42, 52)}
    assert len(orders) > 1  # other seeds, other orders
    # Each service's units together, in the service's order; the first pass draws every service once.
    served = [u.service for u in first.units]
    assert [s for k, s in enumerate(served) if k == 0 or served[k - 1] != s] == list(first.services)
    assert sorted(first.services[:5]) == ["a", "b", "c", "d", "e"]


def test_arrivals_stop_at_the_first_unit_that_reaches_the_share_copies_beyond_one_pass():
    pool_share = share(np.array([[sum(r.cpus for r in POOL), sum(r.memory_gib for r in POOL),
                                  sum(r.gpus for r in POOL)]]), CAPACITY)[0]
    until = 2.5 * pool_share  # beyond two passes over the pool
    drawn = arrivals(POOL, 7, CAPACITY, until)
    shares = drawn.shares(CAPACITY)
    assert shares[-1] >= until and shares[-2] < until
    assert np.all(np.diff(shares) > 0)
    # The second and third passes are copies, their services and max_per_node groups apart from the originals.
    assert any(s.endswith("~1") for s in drawn.services) and any(s.endswith("~2") for s in drawn.services)
    copy = next(i for i in drawn.instances("monolithic") if i.name.endswith("~1"))
    assert copy.group.endswith("~1") and copy.service.endswith("~1")
    # reached: the units after which each target is first reached.
    targets = [0.1, pool_share, until]
    reached = drawn.reached(CAPACITY, targets)
    for target, count in zip(targets, reached, strict=True):
        assert shares[count - 1] >= target - 1e-9 and (count == 1 or shares[count - 2] < target - 1e-9)
    assert reached[-1] == len(drawn.units)
    with pytest.raises(ValueError, match="short of"):
        drawn.reached(CAPACITY, [until + 1])
    # The arrived demand is the fused one: equal to the disaggregated layout's once a service is whole.
    ends = drawn.ends("disaggregated")
    assert ends[-1] == len(drawn.instances("disaggregated"))


def test_the_axis_picks_the_resource_the_share_is_measured_on():
    dominant = arrivals(POOL, 3, CAPACITY, 0.5)
    on_gpus = arrivals(POOL, 3, CAPACITY, 0.5, "gpus")
    gpu_share = on_gpus.arrived[-1][2] / CAPACITY["gpus"]
    assert gpu_share >= 0.5 and on_gpus.arrived[-2][2] / CAPACITY["gpus"] < 0.5
    scaled = dominant.arrived[-1] / np.array([CAPACITY["cpus"], CAPACITY["memory_gib"], CAPACITY["gpus"]])
    assert scaled.max() >= 0.5
    with pytest.raises(ValueError, match="axis"):
        arrivals(POOL, 3, CAPACITY, 0.5, "disks")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="requests nothing"):
        arrivals([row("x", "CN", "x", 4, 8)], 3, CAPACITY, 0.5, "gpus")


def test_a_placements_snapshots_are_the_states_of_its_prefixes():
    nodes = Cluster.from_shapes([f"n{i}" for i in range(3)], [NodeShape(64, 256, 4), NodeShape(64, 256, 4),
                                                               NodeShape(96, 512, 0)])
    instances = arrivals(POOL, 5, CAPACITY, 1.0).instances("disaggregated")
    for policy in ("best-fit", "fgd", "fgd-reserve"):
        whole = place(instances, nodes, policy, snapshots=[0, 3, len(instances)])
        assert set(whole.snapshots) == {0, 3, len(instances)}
        prefix = place(instances[:3], nodes, policy, shapes=whole.shapes)
        assert np.array_equal(whole.snapshots[3].cpus, prefix.state.cpus)
        assert np.array_equal(whole.snapshots[3].gpus, prefix.state.gpus)
        assert np.array_equal(whole.snapshots[len(instances)].memory_gib, whole.state.memory_gib)
        assert np.array_equal(whole.snapshots[0].cpus, nodes.cpus)
    with pytest.raises(ValueError, match="snapshots"):
        place(instances, nodes, "best-fit", snapshots=[len(instances) + 1])
