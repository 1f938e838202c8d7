"""``bench_plan`` on a tiny synthetic trace and node list: its result files, rows and summary."""

import json

import pytest

from benchmarks import bench_plan

HEADER = ("instance_sn,role,app_name,cpu_request,cpu_limit,gpu_request,gpu_limit,rdma_request,rdma_limit,"
          "memory_request,memory_limit,disk_request,disk_limit,max_instance_per_node,creation_time,scheduled_time,"
          "deletion_time")


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


def test_bench_plan_writes_both_layouts_under_every_policy_and_the_summary(tmp_path):
    write_inputs(tmp_path)
    results = bench_plan.main(["--trace", str(tmp_path / "trace.csv"), "--nodes", str(tmp_path / "nodes.csv"),
                               "--results", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "bench_plan.json").read_text())
    assert set(written["summary"]) == {"gpu_fragmentation_reduction", "cpu_fragmentation_reduction"}
    assert all(isinstance(value, float) for value in written["summary"].values())
    assert {"commit", "command", "machine", "date"} <= set(written)
    assert written["inputs"]["selection"]["instances"] == 17  # the early-deleted instance left out
    assert written["inputs"]["selection"]["moment"] == 10.0
    for cluster in ("openb", "homogeneous"):
        for layout in ("monolithic", "disaggregated"):
            assert set(written["rows"][cluster][layout]) == {"best-fit", "fgd", "fgd-reserve"}
            for policy in ("best-fit", "fgd-reserve"):
                assert "nodes_needed" in written["rows"][cluster][layout][policy]
    # Monolithic: 6 fused instances of 8 + 3 * 32 / 2 = 56 CPUs and 40 + 3 * 128 / 2 = 232 GiB (a G2 node of 64
    # CPUs and 256 GiB holds one, a CPU node none), and the CPU-only service's 2 CN instances as they are.
    monolithic = written["rows"]["openb"]["monolithic"]["best-fit"]
    assert monolithic["workload"]["instances"] == 8
    assert monolithic["by_pool"] == {"fused": {"instances": 6, "placed": 3}, "CN": {"instances": 2, "placed": 2}}
    # The summary is 1 - ours / baseline of the rows it names.
    ours = written["rows"]["openb"]["disaggregated"]["fgd-reserve"]["fragmentation"]
    base = monolithic["fragmentation"]
    for key, resource in (("gpu_fragmentation_reduction", "gpus"), ("cpu_fragmentation_reduction", "cpus")):
        assert written["summary"][key] == pytest.approx(1 - ours[resource]["fragmented"] / base[resource]["fragmented"])
    # The homogeneous cluster: 3 GPU and 5 CPU-only nodes, those of the most common CPU-only shape that hosts the
    # most common CN instance (32 CPUs, 128 GiB), as the most common (16 CPUs, 64 GiB) does not.
    homogeneous = written["inputs"]["clusters"]["homogeneous"]
    assert (homogeneous["gpu_nodes"], homogeneous["cpu_nodes"]) == (3, 5)
    assert homogeneous["cpu_shape"] == "96 CPUs, 512 GiB, no GPU" and "cannot host" in homogeneous["why"]
    table = (tmp_path / "out" / "bench_plan.md").read_text()
    assert "gpu_fragmentation_reduction" in table and "| disaggregated | fgd-reserve |" in table
    assert results["summary"] == written["summary"]
