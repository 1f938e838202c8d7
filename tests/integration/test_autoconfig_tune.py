"""`autoconfig tune` on the session's Ray cluster: real trials of the tiny DLRM app with its dense pool and shard
pool tuned together, the Serve config it writes, and a second run that resumes the study without repeating a
trial."""

import pytest
import yaml

from autoconfig.cli import main
from autoconfig.knobs import CPU_SHARE_ENV
from autoconfig.serve_config import load_serve_config, validate_app_args
from autoconfig.space import SearchSpace
from autoconfig.study import TuningStudy
from disagg.config import BatchingConfig
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

DENSE_CPUS, SHARD_CPUS = 0.25, 0.05  # what the 2-CPU test cluster has left beside the session's apps
SPACE = {"knobs": {
    "max_batch_size": {"values": [16]},
    "batch_wait_timeout_s": {"values": [0.002]},
    "device_share": {"values": [DENSE_CPUS]},
    "num_replicas": {"values": [1]},
    "args.embedding.replicas_per_shard": {"values": [1, 2]},
    "EmbeddingShard_*.ray_actor_options.num_cpus": {"values": [SHARD_CPUS]},
}}


def _template_that_fits(directory) -> str:
    """The shipped Serve config with its DLRM app at the CPUs the test cluster has left, so that the app as
    configured, which tune measures first, can be placed."""
    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    dlrm = next(app for app in config["applications"] if app["name"] == "dlrm")
    for deployment in dlrm["deployments"]:
        cpus = {"DisaggregatedDLRM": DENSE_CPUS, "EmbeddingShard_0": SHARD_CPUS, "EmbeddingShard_1": SHARD_CPUS}
        if deployment["name"] in cpus:
            deployment["ray_actor_options"]["num_cpus"] = cpus[deployment["name"]]
    path = directory / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_tune_sizes_both_pools_counts_every_cpu_writes_a_deployable_config_and_resumes(base_url, tmp_path, capsys):
    space_file = tmp_path / "space.yaml"
    space_file.write_text(yaml.safe_dump(SPACE))
    storage, out = f"sqlite:///{tmp_path / 'studies.db'}", tmp_path / "tuned.yaml"
    argv = ["tune", "--config", _template_that_fits(tmp_path), "--app", "dlrm", "--slo-p99-ms", "1000",
            "--budget", "2", "--searcher", "grid", "--space", str(space_file), "--storage", storage,
            "--study", "it", "--probe-s", "1", "--min-requests", "10", "--warmup-s", "1", "--start-rps", "4",
            "--max-probes", "3", "--tolerance", "0.5", "--repeats", "1", "--out", str(out)]
    code = main(argv)

    study = TuningStudy.open(storage, "it", SearchSpace.parse(SPACE))
    records = study.records()
    # The app as configured was measured first, on the same cluster and probes: the gain is stated against it.
    starting = study.starting_point()
    assert starting["status"] == "ok", starting
    assert starting["resources"] == pytest.approx(DENSE_CPUS + 2 * SHARD_CPUS)
    assert starting["objective"] == pytest.approx(starting["sustainable_rps"] / starting["resources"])
    out_text = " ".join(capsys.readouterr().out.split())
    assert "the app as configured -> ok" in out_text
    assert f"against {starting['objective']:.2f} for the app as configured" in out_text
    assert [r["config"]["args.embedding.replicas_per_shard"] for r in records] == [1, 2]  # grid order
    assert code == 0 and [r["status"] for r in records] == ["ok", "ok"], [(r["status"], r.get("error"))
                                                                        for r in records]
    for record in records:
        shards = record["config"]["args.embedding.replicas_per_shard"]
        # Serve's own account of what each deployment held: the shard knobs reached both shards' deployments.
        assert record["deployment_resources"] == pytest.approx({
            "DisaggregatedDLRM": DENSE_CPUS, "EmbeddingShard_0": SHARD_CPUS * shards,
            "EmbeddingShard_1": SHARD_CPUS * shards, "ShardDirectory": 0.0})
        assert record["resources"] == pytest.approx(DENSE_CPUS + 2 * SHARD_CPUS * shards)
        assert record["objective"] == pytest.approx(record["sustainable_rps"] / record["resources"])
    best = max(records, key=lambda r: r["objective"])

    tuned = next(app for app in load_serve_config(out).applications if app.name == "dlrm")  # validated, args too
    args = validate_app_args(tuned)
    assert args.model.torch_threads == 1  # max(1, round(0.25 CPUs))
    assert args.embedding.replicas_per_shard == best["config"]["args.embedding.replicas_per_shard"]
    dense = next(d for d in tuned.deployments if d.name == "DisaggregatedDLRM")
    assert dense.ray_actor_options.num_cpus == DENSE_CPUS and dense.num_replicas == 1
    # Batching is the dense replica's live user_config (a BatchingConfig), sized for two batches in flight.
    assert BatchingConfig.model_validate(dense.user_config).max_batch_size == 16
    assert dense.max_ongoing_requests == 2 * 16
    for name in ("EmbeddingShard_0", "EmbeddingShard_1"):
        shard = next(d for d in tuned.deployments if d.name == name)
        assert shard.ray_actor_options.num_cpus == SHARD_CPUS
        assert shard.ray_actor_options.runtime_env["env_vars"][CPU_SHARE_ENV] == str(SHARD_CPUS)  # enforced

    assert main(argv) == 0  # resumed: the study already holds its budget, nothing is profiled again
    resumed = TuningStudy.open(storage, "it", SearchSpace.parse(SPACE))
    assert resumed.records() == records and resumed.starting_point() == starting
