"""DLRM app configuration and the Ray Serve app builder (the builder binds; it starts no Ray)."""

import pytest
from pydantic import ValidationError

from disagg.config import BatchingConfig, DLRMAppConfig
from serving.common.allocator import REPLICA_RUNTIME_ENV


def test_defaults() -> None:
    config = DLRMAppConfig()
    assert (config.model_name, config.model.preset, config.model.seed, config.model.device) == (
        "dlrm", "tiny", 0, "auto"
    )
    assert config.limits.max_rows_per_request == 4096
    assert config.limits.max_body_bytes == 16 * 1024 * 1024
    assert (config.batching.max_batch_size, config.batching.batch_wait_timeout_s) == (64, 0.005)


def test_unknown_preset_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValidationError, match="unknown DLRM preset 'huge'; known presets: criteo-kaggle, small, tiny"):
        DLRMAppConfig.model_validate({"model": {"preset": "huge"}})


@pytest.mark.parametrize("name", ["", "../etc", "a/b", ".hidden", "a b", "x" * 65, "m%2F"])
def test_model_name_must_be_a_safe_url_segment(name: str) -> None:
    with pytest.raises(ValidationError, match="model_name"):
        DLRMAppConfig(model_name=name)


@pytest.mark.parametrize(
    "data",
    [
        {"batching": {"max_batch_size": 0}},
        {"batching": {"batch_wait_timeout_s": -1}},
        {"limits": {"max_rows_per_request": 0}},
        {"model": {"device": "gpu"}},
        {"model": {"seed": -1}},
        {"batching": {"max_batchsize": 8}},  # typo: unknown keys are refused, not ignored
    ],
)
def test_invalid_values_are_refused(data: dict) -> None:
    with pytest.raises(ValidationError):
        DLRMAppConfig.model_validate(data)


def test_build_app_validates_plain_dict_args_and_sizes_the_monolithic_deployment() -> None:
    from disagg.app import build_app

    app = build_app({"model_name": "ctr", "serving": "monolithic", "batching": {"max_batch_size": 8}})
    deployment = app._bound_deployment  # Ray has no public accessor for an Application's deployment
    assert deployment.name == "MonolithicDLRM"
    assert deployment.ray_actor_options == {"num_cpus": 0.5, "runtime_env": REPLICA_RUNTIME_ENV}
    assert deployment.max_ongoing_requests == 16  # one batch running, the next one filling
    assert deployment._deployment_config.max_queued_requests == 8  # one more batch waits in the proxy
    assert deployment._deployment_config.request_router_config.max_backoff_s == 0.05  # a freed slot is seen soon
    [config] = deployment.init_args
    assert config == DLRMAppConfig(model_name="ctr", serving="monolithic", batching=BatchingConfig(max_batch_size=8))
    with pytest.raises(ValidationError, match="model_name"):
        build_app({"model_name": "a/b"})


def test_disaggregated_app_binds_one_deployment_per_shard_and_the_directory() -> None:
    from disagg.app import build_app

    app = build_app({"embedding": {"num_shards": 3, "replicas_per_shard": 2, "discovery_period_s": 0.5}})
    ingress = app._bound_deployment
    assert ingress.name == "DisaggregatedDLRM"
    config, directory, shards = ingress.init_args
    assert config.serving == "disaggregated"
    assert directory._bound_deployment.name == "ShardDirectory"
    shard_deployments = [shard._bound_deployment for shard in shards]
    assert [d.name for d in shard_deployments] == ["EmbeddingShard_0", "EmbeddingShard_1", "EmbeddingShard_2"]
    assert {d.num_replicas for d in shard_deployments} == {2}
    assert [d.init_args[1] for d in shard_deployments] == [0, 1, 2]  # each replica builds its own shard
    assert {d._deployment_config.health_check_period_s for d in shard_deployments} == {0.5}  # the heartbeat


def test_builder_annotation_is_the_config_class_so_serve_configs_are_validated() -> None:
    """Ray validates a builder's YAML ``args`` only when its annotation is a pydantic class, not a string."""
    import inspect

    from disagg.app import build_app

    [parameter] = inspect.signature(build_app).parameters.values()
    assert parameter.annotation is DLRMAppConfig


TWO_INPUTS = [{"name": "user", "datatype": "INT64", "shape": [-1]},
              {"name": "history", "datatype": "INT64", "shape": [-1, -1], "pad_value": 0}]


def test_a_factory_model_carries_its_signature_and_no_preset() -> None:
    config = DLRMAppConfig.model_validate({"model": {
        "factory": "/models/two_tower.py:build", "inputs": TWO_INPUTS,
        "outputs": [{"name": "score", "shape": [-1, 1]}, {"name": "user_vector", "shape": [-1, 8]}]}})
    model = config.model
    assert (model.preset, model.label, model.weights_path()) == (None, "/models/two_tower.py:build", None)
    signature = model.signature()
    assert [(t.name, t.forward_argument, t.pad_value) for t in signature.inputs] == [
        ("user", "user", None), ("history", "history", 0)]
    assert [(t.name, t.datatype, t.shape) for t in signature.outputs] == [
        ("score", "FP32", [-1, 1]), ("user_vector", "FP32", [-1, 8])]
    assert DLRMAppConfig.model_validate(config.model_dump()) == config  # a dumped config loads back


def test_a_preset_has_the_dlrm_signature() -> None:
    signature = DLRMAppConfig().model.signature()
    assert [(t.name, t.forward_argument, t.shape) for t in signature.inputs] == [
        ("dense_features", "dense", [-1, 13]), ("sparse_features", "sparse", [-1, 26, -1])]
    assert [(t.name, t.shape) for t in signature.outputs] == [("probabilities", [-1, 1])]


@pytest.mark.parametrize(("model", "message"), [
    ({"factory": "pkg.models:build", "preset": "tiny", "inputs": TWO_INPUTS}, "give `preset` or `factory`"),
    ({"factory": "pkg.models:build"}, "needs `inputs`"),
    ({"inputs": TWO_INPUTS}, "inputs and outputs describe a `factory` model"),
    ({"factory": "relative/file.py:build", "inputs": TWO_INPUTS}, "factory"),
    ({"factory": "pkg.models", "inputs": TWO_INPUTS}, "factory"),
    ({"factory": "pkg.models:build", "inputs": [{"name": "user", "datatype": "INT64", "shape": [4]}]},
     "must start with -1, the batch dimension"),
    ({"factory": "pkg.models:build", "inputs": [{"name": "user", "datatype": "INT64", "shape": [-1, 0]}]},
     "variable\\) or positive"),
    ({"factory": "pkg.models:build", "inputs": [TWO_INPUTS[0], TWO_INPUTS[0]]}, "duplicate name 'user'"),
    ({"factory": "pkg.models:build", "inputs": [{"name": "x", "datatype": "BYTES", "shape": [-1]}]}, "datatype"),
    ({"factory": "pkg.models:build", "inputs": [{"name": "x", "datatype": "INT64", "shape": [-1, -1],
                                               "pad_value": 0.5}]}, "whole number"),
    ({"factory": "pkg.models:build", "inputs": TWO_INPUTS, "weights": "relative.safetensors"}, "weights"),
])
def test_bad_factory_configs_are_refused_naming_the_problem(model: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DLRMAppConfig.model_validate({"model": model})


def test_table_storage_of_a_factory_model_is_left_to_the_model_check() -> None:
    config = DLRMAppConfig.model_validate({"model": {"factory": "pkg.models:build", "inputs": TWO_INPUTS},
                                           "embedding": {"table_storage": {"items": "int8"}}})
    assert config.embedding.table_storage == {"items": "int8"}
