"""`autoconfig plan` end to end on tiny files: the plan, the Serve config that `autoconfig check` accepts, the
KubeRay worker groups whose offers match the plan; bad input refused (exit 2) before any placement."""

import json
import re

import pytest
import yaml

from autoconfig.cli import main
from autoconfig.planning.command import stderr_progress

TEMPLATE = {"applications": [{
    "name": "dlrm", "route_prefix": "/v2", "import_path": "disagg.app:build_app",
    "args": {"model_name": "dlrm", "model": {"preset": "tiny"}, "serving": "disaggregated",
             "embedding": {"num_shards": 2, "replicas_per_shard": 1}},
    "deployments": [{"name": "DisaggregatedDLRM", "num_replicas": 1}, {"name": "EmbeddingShard_0"},
                    {"name": "EmbeddingShard_1"}, {"name": "ShardDirectory", "ray_actor_options": {"num_cpus": 0}}],
}]}
SERVICES = {"services": [{"name": "recsys", "app": "dlrm", "target_rps": 900, "layouts": {
    "disaggregated": [
        {"deployment": "DisaggregatedDLRM", "cpus": 2, "gpus": 0.25, "memory_gib": 4, "rate_per_replica": 400},
        {"deployment": "EmbeddingShard", "shards": 3, "cpus": 4, "memory_gib": 24, "replicas": 2}],
    "monolithic": [{"deployment": "MonolithicDLRM", "cpus": 8, "gpus": 0.5, "memory_gib": 32,
                    "rate_per_replica": 300}]}}]}
NODES = {"nodes": [{"name": "gpu", "cpus": 16, "memory_gib": 64, "gpus": 1, "count": 2},
                   {"name": "cpu", "cpus": 16, "memory_gib": 64, "count": 3}]}


@pytest.fixture
def files(tmp_path):
    paths = {name: tmp_path / f"{name}.yaml" for name in ("template", "services", "nodes")}
    for name, content in (("template", TEMPLATE), ("services", SERVICES), ("nodes", NODES)):
        paths[name].write_text(yaml.safe_dump(content))
    return paths


def plan_argv(files, tmp_path, layout: str, *extra: str) -> list[str]:
    return ["plan", "--services", str(files["services"]), "--nodes", str(files["nodes"]), "--layout", layout,
            "--template", str(files["template"]), "--out", str(tmp_path / "plan.json"),
            "--serve-config", str(tmp_path / "serve.yaml"), "--worker-groups", str(tmp_path / "groups.yaml"), *extra]


def test_disaggregated_plan_writes_a_serve_config_that_check_accepts(files, tmp_path, capsys):
    assert main(plan_argv(files, tmp_path, "disaggregated")) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["placed"] == 3 + 3 * 2 and plan["unplaced"] == 0
    used: dict[str, list[float]] = {}
    for assignment in plan["assignments"]:
        dense = assignment["pool"] == "DisaggregatedDLRM"
        cpus, gpus = used.setdefault(assignment["node"], [0.0, 0.0])
        used[assignment["node"]] = [cpus + (2 if dense else 4), gpus + (0.25 if dense else 0)]
    assert {node for node, (_, gpus) in used.items() if gpus} <= {"gpu-0", "gpu-1"}
    # fgd-reserve: a GPU node keeps 8 CPUs (2 per 0.25 GPU of a dense replica) per free GPU.
    for node in ("gpu-0", "gpu-1"):
        cpus, gpus = used.get(node, [0.0, 0.0])
        assert 16 - cpus >= (1 - gpus) * 8
    app = yaml.safe_load((tmp_path / "serve.yaml").read_text())["applications"][0]
    deployments = {d["name"]: d for d in app["deployments"]}
    assert set(deployments) == {"DisaggregatedDLRM", "EmbeddingShard_0", "EmbeddingShard_1", "EmbeddingShard_2",
                                "ShardDirectory"}
    dense = deployments["DisaggregatedDLRM"]
    assert dense["num_replicas"] == 3
    assert dense["ray_actor_options"]["num_gpus"] == 0.25 and dense["ray_actor_options"]["resources"] == {
        "dense_pool": 1}
    assert dense["ray_actor_options"]["memory"] == 4 * 2**30
    shard = deployments["EmbeddingShard_2"]["ray_actor_options"]
    assert shard["num_cpus"] == 4 and shard["resources"] == {"embedding_pool": 1}
    assert shard["runtime_env"]["env_vars"]["SWIFTSERVE_CPU_SHARE"] == "4.0"
    assert app["args"]["embedding"]["num_shards"] == 3 and app["args"]["embedding"]["replicas_per_shard"] == 2
    # The worker groups offer exactly one unit per planned replica.
    groups = yaml.safe_load((tmp_path / "groups.yaml").read_text())["workerGroupSpecs"]
    offered: dict[str, int] = {}
    for group in groups:
        for resource, units in json.loads(json.loads(group["rayStartParams"]["resources"])).items():
            offered[resource] = offered.get(resource, 0) + units * group["replicas"]
    assert offered == {"dense_pool": 3, "embedding_pool": 6}
    capsys.readouterr()
    assert main(["check", str(tmp_path / "serve.yaml")]) == 0
    assert "ok: 1 application(s) valid" in capsys.readouterr().out


def test_monolithic_plan_replaces_the_disaggregated_deployments(files, tmp_path):
    nodes = {"nodes": [{"name": "gpu", "cpus": 16, "memory_gib": 64, "gpus": 1, "count": 2}]}
    files["nodes"].write_text(yaml.safe_dump(nodes))
    assert main(plan_argv(files, tmp_path, "monolithic", "--policy", "best-fit")) == 0
    app = yaml.safe_load((tmp_path / "serve.yaml").read_text())["applications"][0]
    assert [d["name"] for d in app["deployments"]] == ["MonolithicDLRM"]
    assert app["args"]["serving"] == "monolithic" and app["deployments"][0]["num_replicas"] == 3
    assert main(["check", str(tmp_path / "serve.yaml")]) == 0


def test_what_cannot_be_placed_is_reported_and_exits_1(files, tmp_path, capsys):
    nodes = {"nodes": [{"name": "gpu", "cpus": 16, "memory_gib": 16, "gpus": 1}]}  # 16 GiB: no 32 GiB replica fits
    files["nodes"].write_text(yaml.safe_dump(nodes))
    assert main(plan_argv(files, tmp_path, "monolithic")) == 1
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["placed"] == 0 and len(plan["unplaced_instances"]) == 3
    assert plan["unplaced_instances"][0]["reason"].startswith("fits no node: needs 8 CPUs, 32 GiB, 0.5 GPUs")
    assert "3 of 3 instance(s) not placed" in capsys.readouterr().out


@pytest.mark.parametrize(("which", "text", "expected"), [
    ("nodes", "nodes:\n  - {name: a, cpus: 16, memory_gib: 64, gpus: two}\n",
     r"nodes\.yaml:2:47: nodes\[0\]\.gpus: Input should be a valid integer"),
    ("services", "services:\n  - name: s\n    layouts: [1, 2]\n",
     r"services\.yaml:3:14: services\[0\]\.layouts: Input should be a valid dictionary"),
    ("template", "applications: [{name: dlrm, route_prefix: /v2, import_path: disagg.app:build_app, args: "
                 "{serving: sideways}}]\n", r"template\.yaml: applications\[0\] \(dlrm\): args\.serving"),
])
def test_bad_input_is_refused_with_exit_2_before_any_placement(files, tmp_path, capsys, which, text, expected):
    files[which].write_text(text)
    assert main(plan_argv(files, tmp_path, "disaggregated")) == 2
    assert re.search(expected, " ".join(capsys.readouterr().out.split()))
    assert not (tmp_path / "plan.json").exists()


def test_a_trace_cannot_be_written_as_a_serve_config(files, tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("instance_sn,role,app_name,cpu_request,gpu_request,memory_request,max_instance_per_node,"
                     "creation_time,deletion_time\ni0,HN,a,8,1,40,-1,,\n")
    argv = plan_argv(files, tmp_path, "disaggregated")
    argv[argv.index("--services") + 1] = str(trace)
    assert main(argv) == 2
    assert "a trace describes no Serve application" in " ".join(capsys.readouterr().out.split())
    assert main(argv[: argv.index("--serve-config")]) == 0  # the plan alone is fine


def test_a_pool_that_is_no_deployment_of_the_layout_is_refused(files, tmp_path, capsys):
    services = json.loads(json.dumps(SERVICES))
    services["services"][0]["layouts"]["disaggregated"][1]["deployment"] = "Shards"
    files["services"].write_text(yaml.safe_dump(services))
    assert main(plan_argv(files, tmp_path, "disaggregated")) == 2
    assert "pool 'Shards' is no disaggregated deployment of the DLRM app" in " ".join(capsys.readouterr().out.split())


def test_progress_goes_to_stderr(capsys):
    report = stderr_progress(every_s=0.0)
    report(256, 1000)
    report(1000, 1000)
    captured = capsys.readouterr()
    assert captured.out == "" and "placing: 256/1000 instances" in captured.err and "1000/1000" in captured.err
