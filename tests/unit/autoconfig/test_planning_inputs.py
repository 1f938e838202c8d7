"""The planner's inputs: node lists, Prism-format traces, service files; the monolithic fusion rule; bad files
refused with their file, line and column."""

import json

import pytest

from autoconfig.planning.cluster import read_nodes
from autoconfig.planning.inputs import PlanInputError
from autoconfig.planning.services import busiest_moment, fuse, read_services, read_trace, select, trace_workload
from autoconfig.space import SearchSpace
from tests.helpers.surfaces import grid_entry

TRACE_HEADER = ("instance_sn,role,app_name,cpu_request,cpu_limit,gpu_request,gpu_limit,rdma_request,rdma_limit,"
                "memory_request,memory_limit,disk_request,disk_limit,max_instance_per_node,creation_time,"
                "scheduled_time,deletion_time")


def trace_file(tmp_path, *rows: str):
    path = tmp_path / "trace.csv"
    path.write_text("\n".join([TRACE_HEADER, *rows]) + "\n")
    return path


def row(name: str, role: str, app: str, cpus: float, gpus: float, memory: float, limit: int = -1,
        created: str = "", deleted: str = "") -> str:
    return (f"{name},{role},{app},{cpus},{cpus},{gpus},{gpus},1,1,{memory},{memory},10,10,{limit},{created},{created},"
            f"{deleted}")


# --- node lists ---------------------------------------------------------------------------------------------------

def test_openb_csv_is_read_in_cpus_and_gib(tmp_path):
    path = tmp_path / "nodes.csv"
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\nn1,32000,262144,0,\n")
    nodes = read_nodes(path)
    assert nodes.names == ("n0", "n1")
    assert nodes.cpus.tolist() == [96.0, 32.0] and nodes.memory_gib.tolist() == [384.0, 256.0]
    assert nodes.gpus.tolist() == [8, 0] and nodes.gpu_models == ("G2", "")


@pytest.mark.parametrize(("text", "expected"), [
    ("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\nn1,lots,262144,0,\n",
     "nodes.csv: line 3, column 'cpu_milli': 'lots' is not a number"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,1.5,G2\n",
     "nodes.csv: line 2, column 'gpu': 1.5 is not a whole number of GPUs"),
    ("sn,cpu_milli,memory_mib,model\nn0,96000,393216,G2\n", "nodes.csv: line 1: no column 'gpu'"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216\n", "nodes.csv: line 2: 3 cells, the header has 5"),
    ("sn,cpu_milli,memory_mib,gpu,model\nn0,-5,393216,0,\n", "nodes.csv: line 2, column 'cpu_milli': '-5' must be"),
])
def test_a_bad_node_csv_names_the_line_and_column(tmp_path, text, expected):
    path = tmp_path / "nodes.csv"
    path.write_text(text)
    with pytest.raises(PlanInputError) as refused:
        read_nodes(path)
    assert str(refused.value).startswith(f"{tmp_path}/{expected}")


def test_yaml_and_json_node_lists_name_the_line_and_column_of_a_bad_value(tmp_path):
    good = tmp_path / "nodes.yaml"
    good.write_text("nodes:\n  - {name: gpu, cpus: 16, memory_gib: 64, gpus: 1, count: 2}\n")
    assert read_nodes(good).names == ("gpu-0", "gpu-1")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - name: a\n    cpus: 16\n    memory_gib: 64\n  - name: b\n    cpus: -2\n"
                   "    memory_gib: 64\n")
    with pytest.raises(PlanInputError, match=r"bad\.yaml:6:11: nodes\[1\]\.cpus: Input should be greater than 0"):
        read_nodes(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes:\n  - {name: a, cpus: 16\n")
    with pytest.raises(PlanInputError, match=r"broken\.yaml:3:1: "):
        read_nodes(broken)
    as_json = tmp_path / "nodes.json"
    as_json.write_text('{"nodes": [\n  {"name": "a", "cpus": 16, "memory_gib": 64, "gpu": 1}\n]}\n')
    with pytest.raises(PlanInputError, match=r"nodes\.json:2:54: nodes\[0\]\.gpu: Extra inputs are not permitted"):
        read_nodes(as_json)
    as_json.write_text('{"nodes": [\n  {"name": "a", "cpus": 16,, }\n]}\n')
    with pytest.raises(PlanInputError, match=r"nodes\.json:2:28: Expecting"):
        read_nodes(as_json)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(PlanInputError, match=r"absent\.csv: No such file"):
        read_nodes(tmp_path / "absent.csv")


# --- traces -------------------------------------------------------------------------------------------------------

def test_a_bad_trace_cell_names_its_line_and_column(tmp_path):
    path = trace_file(tmp_path, row("i0", "HN", "a", 8, 1, 40), row("i1", "XN", "a", 8, 1, 40))
    with pytest.raises(PlanInputError, match=r"trace\.csv: line 3, column 'role': 'XN' is not one of CN, HN"):
        read_trace(path)
    path = trace_file(tmp_path, row("i0", "HN", "a", 8, 0, 40))
    with pytest.raises(PlanInputError, match=r"line 2, column 'gpu_request': 0 for an HN"):
        read_trace(path)
    path = trace_file(tmp_path, row("i0", "CN", "a", 8, 0, 40, limit=0))
    with pytest.raises(PlanInputError, match=r"line 2, column 'max_instance_per_node': 0: a whole number >= 1"):
        read_trace(path)


def test_the_busiest_moment_keeps_the_instances_alive_then(tmp_path):
    rows = read_trace(trace_file(
        tmp_path,
        row("before", "CN", "a", 8, 0, 40, deleted="50"),            # alive from the start until 50
        row("always", "CN", "a", 8, 0, 40),                          # alive throughout
        row("late1", "HN", "a", 8, 1, 40, created="60"),              # alive from 60
        row("late2", "HN", "a", 8, 1, 40, created="70", deleted="80"),
        row("late3", "CN", "a", 8, 0, 40, created="75"),
    ))
    assert busiest_moment(rows) == (75.0, 4)  # always, late1, late2, late3
    chosen, note = select(rows)
    assert [r.name for r in chosen] == ["always", "late1", "late2", "late3"]  # creation order
    assert note["moment"] == 75.0 and note["instances"] == 4
    assert [r.name for r in select(rows, "10")[0]] == ["before", "always"]
    assert len(select(rows, "all")[0]) == 5
    with pytest.raises(PlanInputError, match="busiest, all, or a time"):
        select(rows, "noon")


def test_monolithic_fuses_each_gpu_instance_with_an_even_share_of_its_services_cpu_side(tmp_path):
    rows = read_trace(trace_file(
        tmp_path,
        row("h1", "HN", "both", 8, 1, 40, limit=2), row("h2", "HN", "both", 8, 1, 40, limit=2),
        row("c1", "CN", "both", 32, 0, 100), row("c2", "CN", "both", 32, 0, 100), row("c3", "CN", "both", 32, 0, 100),
        row("cpu-only", "CN", "cpu", 48, 0, 200),
        row("gpu-only", "HN", "gpu", 4, 1, 16),
    ))
    fused = {i.name: i for i in fuse(rows)}
    assert set(fused) == {"h1", "h2", "cpu-only", "gpu-only"}
    assert fused["h1"].shape == (8 + 96 / 2, 40 + 300 / 2, 1.0) and fused["h1"].max_per_node == 2
    assert fused["cpu-only"].shape == (48.0, 200.0, 0.0) and fused["cpu-only"].pool == "CN"
    assert fused["gpu-only"].shape == (4.0, 16.0, 1.0)
    monolithic, disaggregated = trace_workload(rows, "monolithic"), trace_workload(rows, "disaggregated")
    assert monolithic.demand() == pytest.approx(disaggregated.demand())  # fusion moves resources, adds none
    assert "fusion_rule" in monolithic.notes and len(disaggregated.instances) == 7


# --- service files ------------------------------------------------------------------------------------------------

SERVICES = """\
services:
  - name: recsys
    app: dlrm
    target_rps: 900
    layouts:
      disaggregated:
        - {deployment: DisaggregatedDLRM, cpus: 2, gpus: 0.25, memory_gib: 4, rate_per_replica: 400}
        - {deployment: EmbeddingShard, shards: 2, cpus: 4, memory_gib: 24, replicas: 2}
      monolithic:
        - {deployment: MonolithicDLRM, cpus: 8, gpus: 0.5, memory_gib: 32, rate_per_replica: 300}
"""


def test_pools_are_sized_from_the_target_rate(tmp_path):
    path = tmp_path / "services.yaml"
    path.write_text(SERVICES)
    disaggregated = read_services(path, "disaggregated")
    dense, shards = disaggregated.pools
    assert dense.replicas == 3  # ceil(900 / 400)
    assert shards.deployments() == ["EmbeddingShard_0", "EmbeddingShard_1"] and shards.replicas == 2
    assert [i.pool for i in disaggregated.instances] == ["DisaggregatedDLRM"] * 3 + ["EmbeddingShard_0"] * 2 + [
        "EmbeddingShard_1"] * 2
    assert read_services(path, "monolithic").pools[0].replicas == 3  # ceil(900 / 300)


def test_a_pool_is_read_from_a_profile_bank_entry(tmp_path):
    space = SearchSpace.model_validate({"knobs": {
        "max_batch_size": {"values": [8]}, "batch_wait_timeout_s": {"values": [0.0]},
        "device_share": {"values": [1.0, 2.0]}, "num_replicas": {"values": [1, 2]}}})
    # (share, replicas): (1, 1) 10, (1, 2) 30, (2, 1) 15, (2, 2) 20: the best is 30 rps on 2 replicas of 1 CPU.
    grid_entry("dense", [10.0, 30.0, 15.0, 20.0], space).save(tmp_path / "dense.json")
    path = tmp_path / "services.yaml"
    path.write_text("services:\n  - name: s\n    target_rps: 100\n    layouts:\n      monolithic:\n"
                    "        - {deployment: MonolithicDLRM, profile: dense.json, memory_gib: 2}\n")
    pool = read_services(path, "monolithic").pools[0]
    assert (pool.cpus, pool.rate_per_replica, pool.replicas) == (1.0, 15.0, 7)  # ceil(100 / 15)


@pytest.mark.parametrize(("text", "expected"), [
    (SERVICES.replace("cpus: 8,", "cpus: -8,"),
     r"services\.yaml:10:46: services\[0\]\.layouts\.monolithic\[0\]\.cpus: Input should be greater than or equal"),
    (SERVICES.replace("    target_rps: 900\n", ""),
     r"services\.yaml:2:5: target_rps: needed to size DisaggregatedDLRM"),
    (SERVICES.replace(", replicas: 2}", "}"), r"services\.yaml:8:11: replicas or rate_per_replica"),
    (SERVICES.replace("      monolithic:\n", "      monolith:\n"),
     r"services\.yaml:10:9: services\[0\]\.layouts\.monolith"),
    (SERVICES.replace("memory_gib: 4,", ""), r"services\.yaml:7:11: memory_gib: needed"),
])
def test_a_bad_service_file_names_the_line_and_column(tmp_path, text, expected):
    path = tmp_path / "services.yaml"
    path.write_text(text)
    with pytest.raises(PlanInputError, match=expected):
        read_services(path, "disaggregated")


def test_a_service_without_the_layout_is_named(tmp_path):
    path = tmp_path / "services.json"
    path.write_text(json.dumps({"services": [{"name": "s", "layouts": {"monolithic": [
        {"deployment": "MonolithicDLRM", "cpus": 1, "memory_gib": 1, "replicas": 1}]}}]}, indent=1))
    with pytest.raises(PlanInputError, match=r"services\.json:5:15: services\[0\]\.layouts: no disaggregated"):
        read_services(path, "disaggregated")
