"""``bench_plan`` on a tiny synthetic trace and node list: its result files, sweeps, rows and summary."""

import json
import statistics

import pytest

from benchmarks import bench_plan

HEADER = ("instance_sn,role,app_name,cpu_request,cpu_limit,gpu_request,gpu_limit,rdma_request,rdma_limit,"
          "memory_request,memory_limit,disk_request,disk_limit,max_instance_per_node,creation_time,scheduled_time,"
          "deletion_time")
LAYOUTS = ("monolithic", "disaggregated")
POLICIES = ("best-fit", "fgd", "fgd-reserve")


def write_inputs(tmp_path):
    rows, k = [], 0
    for app in range(3):  # per service: 2 GPU-node instances (8 CPUs, 40 GiB, 1 GPU), 3 CPU-node (32, 128)
        for role, count, cpus, gpus, memory in (("HN", 2, 8, 1, 40), ("CN", 3, 32, 0, 128)):
            for _ in range(count):
                rows.append(f"i{k},{role},app_{app},{cpus},{cpus},{gpus},{gpus},1,1,{memory},{memory},1,1,-1,,,")
                k += 1
    rows.append(f"i{k},CN,app_0,32,32,0,0,1,1,128,128,1,1,-1,,,5")  # alive only before the busiest moment, 10 s
    rows += [f"late{i},CN,app_3,16,16,0,0,1,1,64,64,1,1,-1,10,10," for i in range(2)]  # a CPU-only service
    (tmp_path / "trace.csv").write_text("\n".join([HEADER, *rows]) + "\n")
    nodes = ["sn,cpu_milli,memory_mib,gpu,model", *(f"g{i},64000,262144,4,G2" for i in range(3)),
             *(f"c{i},96000,524288,0," for i in range(2)), *(f"s{i},16000,65536,0," for i in range(3))]
    (tmp_path / "nodes.csv").write_text("\n".join(nodes) + "\n")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench_plan")
    write_inputs(tmp_path)
    results = bench_plan.main(["--trace", str(tmp_path / "trace.csv"), "--nodes", str(tmp_path / "nodes.csv"),
                               "--seeds", "2", "--results", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "bench_plan.json").read_text())
    assert results["summary"] == data["summary"]
    return data, tmp_path / "out"


def test_the_summary_is_the_median_per_seed_reduction_at_the_summary_point(written):
    data, _ = written
    assert set(data["summary"]) == {"gpu_fragmentation_reduction", "cpu_fragmentation_reduction"}
    assert all(isinstance(value, float) for value in data["summary"].values())
    assert {"commit", "command", "machine", "date", "seconds"} <= set(data)
    rows = data["rows"]["arrivals"]["openb"]["rows"]
    for key, resource in (("gpu_fragmentation_reduction", "gpus"), ("cpu_fragmentation_reduction", "cpus")):
        ours = rows["disaggregated"]["fgd-reserve"]["100"][f"{resource}_fragmented"]
        base = rows["monolithic"]["best-fit"]["100"][f"{resource}_fragmented"]
        per_seed = [1 - a / b if b else 0.0 for a, b in zip(ours, base, strict=True)]
        assert data["summary_spread"][key]["per_seed"] == pytest.approx(per_seed)
        assert data["summary"][key] == pytest.approx(statistics.median(per_seed))
        assert key in data["busiest_summary"]


def test_every_cluster_layout_policy_and_point_is_measured_for_every_seed(written):
    data, _ = written
    assert data["inputs"]["seeds"] == [42, 43]
    for axis, points in (("arrivals", list(range(10, 131, 10))), ("gpu_axis", [50, 90, 100, 110])):
        for cluster in ("openb", "homogeneous"):
            result = data["rows"][axis][cluster]
            assert result["points"] == points
            for layout in LAYOUTS:
                assert set(result["rows"][layout]) == set(POLICIES)
                for policy in POLICIES:
                    at = result["rows"][layout][policy]
                    assert set(at) == {str(p) for p in points}
                    assert all(len(values) == 2 for values in at[str(points[-1])].values())
    # The same arrivals in both layouts: the same shares of the capacity arrived at every point, and the share the
    # point names reached (on the dominant resource; on GPUs for ATC'23's literal axis).
    sweep = data["rows"]["arrivals"]["openb"]["rows"]
    for percent in range(10, 131, 10):
        mono, disagg = sweep["monolithic"]["best-fit"][str(percent)], sweep["disaggregated"]["fgd"][str(percent)]
        assert mono["arrived_gpus_share"] == disagg["arrived_gpus_share"]
        for seed in range(2):
            reached = max(mono[f"arrived_{r}_share"][seed] for r in ("cpus", "memory", "gpus"))
            assert reached >= percent / 100 - 1e-9
    gpu_axis = data["rows"]["gpu_axis"]["openb"]["rows"]["monolithic"]["best-fit"]
    assert all(share >= 1.1 - 1e-9 for share in gpu_axis["110"]["arrived_gpus_share"])
    # More arrives at each point than at the one before; placed + unplaced = arrived.
    counts = [sweep["disaggregated"]["fgd-reserve"][str(p)]["arrived_instances"][0] for p in range(10, 131, 10)]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    at = sweep["disaggregated"]["fgd-reserve"]["130"]
    assert [p + u for p, u in zip(at["placed"], at["unplaced"], strict=True)] == at["arrived_instances"]


def test_nodes_needed_at_the_summary_point_and_the_busiest_moment_rows(written):
    data, _ = written
    needed = data["nodes_needed"]
    assert (needed["point"], needed["seed"]) == (100, 42)
    for cluster in ("openb", "homogeneous"):
        for layout in LAYOUTS:
            assert set(needed[cluster][layout]) == {"best-fit", "fgd-reserve"}
            assert needed[cluster][layout]["best-fit"]["instances"] >= 1
    assert needed["homogeneous"]["disaggregated"]["fgd-reserve"]["nodes"] >= 1
    busiest = data["rows"]["busiest"]
    assert data["inputs"]["pool"]["instances"] == 17  # the early-deleted instance left out
    assert data["inputs"]["pool"]["moment"] == 10.0
    for cluster in ("openb", "homogeneous"):
        for layout in LAYOUTS:
            assert set(busiest[cluster][layout]) == set(POLICIES)
    # Monolithic: 6 fused instances of 8 + 3 * 32 / 2 = 56 CPUs and 40 + 3 * 128 / 2 = 232 GiB (a G2 node of 64
    # CPUs and 256 GiB holds one, a CPU node none), and the CPU-only service's 2 CN instances as they are.
    monolithic = busiest["openb"]["monolithic"]["best-fit"]
    assert monolithic["workload"]["instances"] == 8
    assert monolithic["by_pool"] == {"fused": {"instances": 6, "placed": 3}, "CN": {"instances": 2, "placed": 2}}
    # The homogeneous cluster: 3 GPU and 5 CPU-only nodes, those of the most common CPU-only shape that hosts the
    # most common CN instance (32 CPUs, 128 GiB), as the most common (16 CPUs, 64 GiB) does not.
    homogeneous = data["inputs"]["clusters"]["homogeneous"]
    assert (homogeneous["gpu_nodes"], homogeneous["cpu_nodes"]) == (3, 5)
    assert homogeneous["cpu_shape"] == "96 CPUs, 512 GiB, no GPU" and "cannot host" in homogeneous["why"]


def test_the_table_and_the_figure(written):
    data, out = written
    table = (out / "bench_plan.md").read_text()
    assert "gpu_fragmentation_reduction" in table and "busiest moment" in table
    assert "| 100% |" in table and "ATC'23's axis taken literally" in table
    assert data["figure"] == "bench_plan.png"
    assert (out / "bench_plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
