"""Placement policies and fragmentation on tiny hand-made clusters whose answers are worked out by hand."""

import numpy as np
import pytest

from autoconfig.planning.cluster import Cluster, NodeShape
from autoconfig.planning.fragmentation import NodeState, node_fragmentation, node_stranded, report, shapes_of
from autoconfig.planning.placement import place
from autoconfig.planning.services import Instance


def cluster(*shapes: tuple[float, float, int]) -> Cluster:
    return Cluster.from_shapes([f"n{i}" for i in range(len(shapes))], [NodeShape(c, m, g) for c, m, g in shapes])


def instance(name: str, cpus: float, memory: float, gpus: float = 0.0, *, group: str = "app",
             max_per_node: int | None = None) -> Instance:
    return Instance(name, "svc", "pool", cpus, memory, gpus, group=group, max_per_node=max_per_node)


# --- fragmentation ------------------------------------------------------------------------------------------------

def test_fragmentation_of_one_node_worked_out_by_hand():
    # One node with 10 CPUs, 100 GiB and two GPUs, one of them half used.
    state = NodeState(np.array([10.0]), np.array([100.0]), np.array([[0.5, 1.0]]))
    workload = [instance("a1", 4, 10, 1), instance("a2", 4, 10, 1),  # fits; p = 0.5 of all, 2/3 of the GPU shapes
                instance("b", 20, 10, 0.5),                           # too many CPUs; p = 0.25, 1/3 of GPU shapes
                instance("c", 4, 10)]                                 # CPU only; p = 0.25
    shapes = shapes_of(workload, cluster((32, 256, 2)))
    fragmented = node_fragmentation(state, shapes)
    # GPUs: a fits but cannot use the half-free GPU (0.5 < min(1, 1)); b fits nowhere here: all 1.5 free GPUs.
    assert fragmented["gpus"][0] == pytest.approx(2 / 3 * 0.5 + 1 / 3 * 1.5)
    # CPUs and memory: only b (p = 0.25 of every shape) cannot use them.
    assert fragmented["cpus"][0] == pytest.approx(0.25 * 10)
    assert fragmented["memory_gib"][0] == pytest.approx(0.25 * 100)
    stranded = node_stranded(state, shapes)  # some shape of each resource fits: nothing stranded
    assert [stranded[r][0] for r in ("gpus", "cpus", "memory_gib")] == [0.0, 0.0, 0.0]


def test_a_node_no_shape_fits_strands_all_it_has_free():
    # 4 CPUs left beside 3 free GPUs: neither the GPU shape (8 CPUs) nor the CPU shape (16) fits.
    state = NodeState(np.array([4.0]), np.array([64.0]), np.array([[0.0, 1.0, 1.0, 1.0]]))
    shapes = shapes_of([instance("g", 8, 16, 1), instance("c", 16, 32)], cluster((32, 128, 4)))
    stranded, fragmented = node_stranded(state, shapes), node_fragmentation(state, shapes)
    assert (stranded["gpus"][0], stranded["cpus"][0], stranded["memory_gib"][0]) == (3.0, 4.0, 64.0)
    assert (fragmented["gpus"][0], fragmented["cpus"][0]) == (3.0, 4.0)


def test_shapes_that_fit_no_node_are_left_out_of_the_target_workload():
    shapes = shapes_of([instance("small", 4, 8), instance("small2", 4, 8), instance("huge", 400, 8)],
                       cluster((32, 64, 0)))
    assert list(shapes.cpus) == [4.0] and list(shapes.popularity) == [1.0]


def test_report_gives_fractions_of_the_cluster_capacity():
    nodes = cluster((10, 100, 2), (10, 100, 0))
    state = NodeState.empty(nodes)
    state.cpus[0], state.gpus[0] = 2.0, np.array([1.0, 1.0])  # 8 CPUs used on the GPU node
    shapes = shapes_of([instance("g", 4, 10, 1)], nodes)  # needs 4 CPUs: the GPU node's 2 GPUs are stranded
    result = report(state, nodes, shapes)
    assert result["gpus"]["fragmented"] == 2.0 and result["gpus"]["fragmented_fraction"] == 1.0
    assert result["cpus"]["allocated"] == 8.0
    # The CPU-only node's 10 CPUs: the one (GPU) shape cannot use them; the GPU node's 2 neither.
    assert result["cpus"]["fragmented_fraction"] == pytest.approx(12 / 20)


# --- policies -----------------------------------------------------------------------------------------------------

def test_best_fit_picks_the_node_left_tightest():
    nodes = cluster((16, 64, 0), (8, 32, 0), (32, 128, 0))
    placement = place([instance("a", 6, 24)], nodes, "best-fit")
    assert placement.nodes.tolist() == [1]


def test_equal_choices_go_to_the_first_node_in_the_list():
    nodes = cluster((16, 64, 0), (16, 64, 0), (16, 64, 0))
    for policy in ("best-fit", "fgd", "fgd-reserve"):
        assert place([instance("a", 4, 8)], nodes, policy).nodes.tolist() == [0]


def test_fgd_keeps_a_cpu_instance_off_the_gpu_node_that_best_fit_picks():
    # Best-fit: the small GPU node is the tighter fit for the CPU instance ((8/64 + 48/256 + 1/1) / 3 against
    # (56/64 + 240/256 + 0) / 3). There it would leave 8 CPUs, too few for the GPU instance (12): its GPU stranded.
    nodes = cluster((16, 64, 1), (64, 256, 0))
    workload = [instance("cpu", 8, 16), instance("gpu", 12, 32, 1)]
    best_fit, fgd = place(workload, nodes, "best-fit"), place(workload, nodes, "fgd")
    assert best_fit.nodes.tolist() == [0, -1]
    assert best_fit.reasons[1].startswith("no room left")
    assert fgd.nodes.tolist() == [1, 0]


def test_fgd_reserve_keeps_gpu_nodes_cpus_for_their_gpus_where_fgd_does_not():
    # One GPU node, no CPU node: the GPU shape needs 6 CPUs per GPU, so 2 free GPUs keep 12 of the 16 CPUs.
    nodes = cluster((16, 64, 2))
    workload = [instance("cpu", 8, 16), instance("gpu", 6, 16, 1), instance("gpu2", 6, 16, 1)]
    assert place(workload, nodes, "fgd").nodes.tolist() == [0, 0, -1]  # the CPU instance strands a GPU
    reserved = place(workload, nodes, "fgd-reserve")
    assert reserved.nodes.tolist() == [-1, 0, 0]
    assert reserved.reasons[0] == "no room left outside the CPUs and memory GPU nodes keep for their free GPUs"


def test_an_instance_that_fits_no_node_is_reported_with_why():
    nodes = cluster((32, 128, 0), (16, 512, 0))
    placement = place([instance("huge", 64, 64), instance("wide", 32, 512)], nodes, "best-fit")
    assert placement.unplaced == [0, 1]
    assert placement.reasons[0].startswith("fits no node: needs 64 CPUs, 64 GiB, 0 GPUs; more CPUs than any node")
    assert "no node offers all of it at once" in placement.reasons[1]


def test_max_per_node_spreads_a_group_and_reports_when_it_blocks():
    nodes = cluster((64, 256, 0), (64, 256, 0))
    workload = [instance(f"r{i}", 4, 8, max_per_node=1) for i in range(3)]
    placement = place(workload, nodes, "best-fit")
    assert placement.nodes.tolist() == [0, 1, -1]
    assert "max_per_node 1 instances of app" in placement.reasons[2]


def test_gpu_shares_pack_on_one_gpu_and_whole_gpus_take_free_ones():
    nodes = cluster((32, 128, 2))
    placement = place([instance("half", 1, 1, 0.5), instance("half2", 1, 1, 0.5), instance("whole", 1, 1, 1)],
                      nodes, "best-fit")
    assert placement.nodes.tolist() == [0, 0, 0]
    assert sorted(placement.state.gpus[0].tolist()) == [0.0, 0.0]
    # A whole GPU cannot come from two half-used GPUs.
    split = place([instance("half", 1, 1, 0.5), instance("whole", 1, 1, 1), instance("whole2", 1, 1, 1)],
                  nodes, "best-fit")
    assert split.nodes.tolist() == [0, 0, -1]


def test_the_smallest_cluster_that_places_everything():
    from autoconfig.planning.plan import places_all, smallest
    from autoconfig.planning.services import Workload

    workload = Workload("disaggregated", tuple(instance(f"r{i}", 8, 8) for i in range(5)))

    def nodes(count: int) -> Cluster:
        return Cluster.homogeneous([(NodeShape(16, 64, 0), count)])

    assert smallest(lambda n: places_all(workload, nodes(n), "best-fit"), 0, 10) == 3  # two per node
    assert smallest(lambda n: places_all(workload, nodes(n), "best-fit"), 0, 2) is None
    assert places_all(workload, nodes(2), "best-fit", skip=frozenset({4}))
