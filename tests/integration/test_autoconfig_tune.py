"""`autoconfig tune` on the session's Ray cluster: real trials of the tiny DLRM app, the Serve config it
writes, and a second run that resumes the study without repeating a trial."""

import pytest
import yaml

from autoconfig.cli import main
from autoconfig.serve_config import load_serve_config, validate_app_args
from autoconfig.space import SearchSpace
from autoconfig.study import TuningStudy
from disagg.config import BatchingConfig
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

SPACE = {"knobs": {
    "max_batch_size": {"values": [4, 16]},
    "batch_wait_timeout_s": {"values": [0.002]},
    "device_share": {"values": [0.25]},
    "num_replicas": {"values": [1]},
}}


def test_tune_writes_a_deployable_config_and_resumes_its_study(base_url, tmp_path):
    space_file = tmp_path / "space.yaml"
    space_file.write_text(yaml.safe_dump(SPACE))
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    out = tmp_path / "tuned.yaml"
    argv = ["tune", "--config", str(REPO / "deploy" / "serve_config.yaml"), "--app", "dlrm", "--slo-p99-ms", "500",
            "--budget", "2", "--searcher", "grid", "--space", str(space_file), "--storage", storage,
            "--study", "it", "--probe-s", "1", "--min-requests", "10", "--warmup-s", "1", "--start-rps", "5",
            "--max-probes", "3", "--tolerance", "0.5", "--out", str(out)]
    assert main(argv) == 0

    study = TuningStudy.open(storage, "it", SearchSpace.parse(SPACE))
    records = study.records()
    assert [r["config"]["max_batch_size"] for r in records] == [4, 16]  # grid order
    best = max(records, key=lambda r: r["objective"])
    assert best["status"] == "ok" and best["sustainable_rps"] > 0

    tuned = load_serve_config(out)  # validated like any Serve config, application args included
    dlrm = next(app for app in tuned.applications if app.name == "dlrm")
    args = validate_app_args(dlrm)
    assert args.model.torch_threads == 1  # max(1, round(0.25 CPUs))
    dense = next(d for d in dlrm.deployments if d.name == "DisaggregatedDLRM")
    assert dense.ray_actor_options.num_cpus == 0.25 and dense.num_replicas == 1
    # Batching is the dense replica's live user_config (a BatchingConfig), sized for two batches in flight.
    assert BatchingConfig.model_validate(dense.user_config).max_batch_size == best["config"]["max_batch_size"]
    assert dense.max_ongoing_requests == 2 * best["config"]["max_batch_size"]

    assert main(argv) == 0  # resumed: the study already holds its budget, nothing is profiled again
    assert TuningStudy.open(storage, "it", SearchSpace.parse(SPACE)).records() == records
