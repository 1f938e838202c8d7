"""Knob values written into deploy/serve_config.yaml: both applications, CPU and GPU, validated like a real deploy."""

import copy

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from autoconfig import trial
from autoconfig.cli import main as autoconfig_main
from autoconfig.knobs import apply_knobs, configure_serve_config, write_serve_config
from autoconfig.serve_config import load_serve_config, validate_app_args, validate_user_configs
from disagg.config import BatchingConfig, DLRMAppConfig
from serving.config import DiffusionAppConfig, EngineTuning, ImagesAppConfig
from tests.helpers import REPO

SERVE_CONFIG = REPO / "deploy" / "serve_config.yaml"
BANK_CONFIG = REPO / "benchmarks" / "autoconfig_bank" / "serve_config.yaml"
CONFIGURATION = {"max_batch_size": 32, "batch_wait_timeout_s": 0.02, "device_share": 1.6, "num_replicas": 3}
#: The diffusion app reads no batching timer: its configurations have no batch_wait_timeout_s.
DIFFUSION = {name: value for name, value in CONFIGURATION.items() if name != "batch_wait_timeout_s"}
CONFIGURATIONS = {"dlrm": CONFIGURATION, "diffusion": DIFFUSION}


@pytest.fixture(scope="module")
def template() -> ServeDeploySchema:
    return load_serve_config(SERVE_CONFIG)


def _app(config: ServeDeploySchema, name: str) -> dict:
    return next(app for app in config.model_dump(exclude_unset=True)["applications"] if app["name"] == name)


def _deployments(app: dict) -> dict[str, dict]:
    return {deployment["name"]: deployment for deployment in app["deployments"]}


CPU_SHARE_1_6 = {"num_cpus": 1.6, "runtime_env": {"env_vars": {"SWIFTSERVE_CPU_SHARE": "1.6"}}}


def test_dlrm_on_cpu_sets_live_batching_replicas_cpus_and_torch_threads(template):
    configured = configure_serve_config(template, "dlrm", CONFIGURATION)
    app = _app(configured, "dlrm")
    args = validate_app_args(next(a for a in configured.applications if a.name == "dlrm"))
    assert isinstance(args, DLRMAppConfig)
    assert args.model.torch_threads == 2  # round(1.6)
    dense = _deployments(app)["DisaggregatedDLRM"]
    assert dense["num_replicas"] == 3
    # Ray reserves the share; the replica enforces it (a CFS quota of 1.6 CPUs, two cores pinned).
    assert dense["ray_actor_options"] == CPU_SHARE_1_6
    # Batching goes to the replica's live user_config (what its reconfigure validates), room for two batches.
    assert dense["user_config"] == {"max_batch_size": 32, "batch_wait_timeout_s": 0.02}
    assert BatchingConfig.model_validate(dense["user_config"]) == BatchingConfig(
        max_batch_size=32, batch_wait_timeout_s=0.02
    )
    assert dense["max_ongoing_requests"] == 64
    # args keep the template's batching: only model.torch_threads changed there.
    template_args = _app(template, "dlrm")["args"]
    assert app["args"]["batching"] == template_args["batching"] == {"max_batch_size": 64, "batch_wait_timeout_s": 0.005}
    assert app["args"] == template_args | {"model": template_args["model"] | {"torch_threads": 2}}
    # The embedding shards keep the template's resources; the other application is untouched.
    assert {name: d for name, d in _deployments(app).items() if name != "DisaggregatedDLRM"} == {
        name: d for name, d in _deployments(_app(template, "dlrm")).items() if name != "DisaggregatedDLRM"
    }
    assert _app(configured, "diffusion") == _app(template, "diffusion")


def test_monolithic_dlrm_targets_the_monolithic_deployment(template):
    raw = template.model_dump(exclude_unset=True)
    next(app for app in raw["applications"] if app["name"] == "dlrm")["args"]["serving"] = "monolithic"
    configured = configure_serve_config(ServeDeploySchema.model_validate(raw), "dlrm", CONFIGURATION)
    mono = _deployments(_app(configured, "dlrm"))["MonolithicDLRM"]
    assert mono == {
        "name": "MonolithicDLRM",
        "num_replicas": 3,
        "user_config": {"max_batch_size": 32, "batch_wait_timeout_s": 0.02},
        "max_ongoing_requests": 64,
        "ray_actor_options": CPU_SHARE_1_6,
    }


def test_diffusion_on_cpu_sets_live_engine_rows_torch_threads_and_room_for_full_batches(template):
    """The default config's diffusion app serves three models: the shortcuts tune the first, `tiny`, where requests
    naming no model go; `sdxl-tiny` and `flux-tiny` keep the template's deployments and args."""
    configured = configure_serve_config(template, "diffusion", DIFFUSION | {"torch_threads": 4})
    app = _app(configured, "diffusion")
    args = validate_app_args(next(a for a in configured.applications if a.name == "diffusion"))
    assert isinstance(args, ImagesAppConfig)
    tiny, *others = args.models
    assert [model.model.name for model in args.models] == ["tiny", "sdxl-tiny", "flux-tiny"]
    assert tiny.model.torch_threads == 4  # given explicitly, so not round(1.6)
    assert all(other.model.torch_threads is None for other in others)
    deployments = _deployments(app)
    model = deployments["DiffusionModel_tiny"]
    assert model["num_replicas"] == 3
    assert model["ray_actor_options"] == CPU_SHARE_1_6  # threads via args
    # Rows per step go to the replica's live user_config; the wait timeout has no diffusion counterpart.
    assert model["user_config"] == {"max_batch_rows": 32}
    assert EngineTuning.model_validate(model["user_config"]).apply(tiny.engine).max_batch_rows == 32
    assert model["max_ongoing_requests"] == 64
    assert deployments["ImagesIngress"]["max_ongoing_requests"] == 192
    assert "user_config" not in deployments["ImagesIngress"]
    untouched = _deployments(_app(template, "diffusion"))
    for name in ("ControlNet_edges_tiny", "DiffusionModel_sdxl-tiny", "ControlNet_edges-xl_sdxl-tiny",
                 "DiffusionModel_flux-tiny"):
        assert deployments[name] == untouched[name]
    # args keep the template's engine (rows 16): only models[0].model.torch_threads changed there.
    template_args = _app(template, "diffusion")["args"]
    first = template_args["models"][0]
    assert tiny.engine.max_batch_rows == first["engine"]["max_batch_rows"] == 16
    assert app["args"] == {"models": [first | {"model": first["model"] | {"torch_threads": 4}},
                                      *template_args["models"][1:]]}


def test_diffusion_with_shared_replicas_tunes_the_one_group_deployment(template):
    raw = template.model_dump(exclude_unset=True)
    diffusion = next(app for app in raw["applications"] if app["name"] == "diffusion")
    diffusion["args"]["shared_replicas"] = True
    configured = configure_serve_config(ServeDeploySchema.model_validate(raw), "diffusion",
                                        DIFFUSION | {"torch_threads": 4})
    group = _deployments(_app(configured, "diffusion"))["DiffusionModelGroup"]
    assert (group["num_replicas"], group["user_config"], group["max_ongoing_requests"]) == (3, {"max_batch_rows": 32},
                                                                                           64)
    app = _app(configured, "diffusion")
    _deployments(app)["DiffusionModelGroup"]["user_config"] = {"batch_wait_timeout_s": 0.1}
    with pytest.raises(ValueError, match=r"user_config\.batch_wait_timeout_s: the deployment does not read it "
                                         r"\(DiffusionModelGroup's"):
        validate_user_configs(ServeDeploySchema.model_validate({"applications": [app]}).applications[0])
    assert _app(configured, "dlrm") == _app(template, "dlrm")


def test_the_one_model_diffusion_app_keeps_its_shortcuts(template):
    """`serving.app:build_app` (one model, unsuffixed deployment names) takes the same shortcuts."""
    raw = template.model_dump(exclude_unset=True)
    diffusion = next(app for app in raw["applications"] if app["name"] == "diffusion")
    diffusion.update(import_path="serving.app:build_app", args=diffusion["args"]["models"][0], deployments=[])
    configured = configure_serve_config(ServeDeploySchema.model_validate(raw), "diffusion",
                                        DIFFUSION | {"torch_threads": 4})
    args = validate_app_args(next(a for a in configured.applications if a.name == "diffusion"))
    assert isinstance(args, DiffusionAppConfig) and args.model.torch_threads == 4
    model = _deployments(_app(configured, "diffusion"))["DiffusionModel"]
    assert (model["num_replicas"], model["user_config"]) == (3, {"max_batch_rows": 32})


def test_an_args_path_indexes_the_list_of_models(template):
    app = _app(configure_serve_config(template, "diffusion", {"args.models.1.engine.max_batch_rows": 4}), "diffusion")
    assert app["args"]["models"][1]["engine"] == {"max_batch_rows": 4}
    with pytest.raises(ValueError, match=r"^knob args\.models\.3\.engine\.max_batch_rows: args\.models\.3: a list "
                                         r"of 3 item\(s\), no item '3'$"):
        configure_serve_config(template, "diffusion", {"args.models.3.engine.max_batch_rows": 4})


@pytest.mark.parametrize(
    ("share", "mode", "fraction", "percentage"),
    [(0.25, "mps", "0.25", "25"), (2, "mps", "1.0", "100"), (0.25, "memory", "0.25", None),
     (0.25, "schedule", None, None)],
)
def test_gpu_share_requests_fractional_gpus_and_what_its_mode_divides(template, share, mode, fraction, percentage):
    configured = configure_serve_config(
        template, "dlrm", CONFIGURATION | {"device_share": share}, accelerator="gpu", gpu_share_mode=mode
    )
    actor = _deployments(_app(configured, "dlrm"))["DisaggregatedDLRM"]["ray_actor_options"]
    assert actor["num_gpus"] == share
    assert actor["num_cpus"] == 0.3  # the template's CPUs stay
    env = actor.get("runtime_env", {}).get("env_vars", {})
    assert env.get("SWIFTSERVE_CUDA_MEMORY_FRACTION") == fraction
    assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == percentage
    assert set(env) <= {"SWIFTSERVE_CUDA_MEMORY_FRACTION", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    args = validate_app_args(next(a for a in configured.applications if a.name == "dlrm"))
    assert args.model.torch_threads is None  # threads only when asked for on GPU


def test_gpu_share_above_one_must_be_whole_gpus(template):
    with pytest.raises(ValueError, match="whole number of GPUs"):
        configure_serve_config(template, "dlrm", CONFIGURATION | {"device_share": 1.5}, accelerator="gpu")


@pytest.mark.parametrize(
    ("change", "field"),
    [({"max_batch_size": 0}, "max_batch_size"), ({"cpus": 2}, "knob cpus: not a knob"),
     ({"device_share": -1}, "device_share"), ({"Nope.num_replicas": 2}, "lists no deployment 'Nope'"),
     ({"DisaggregatedDLRM.replicas": 2}, "'replicas' is not a deployment option")],
)
def test_invalid_configurations_name_the_knob(template, change, field):
    with pytest.raises(ValueError, match=field):
        configure_serve_config(template, "dlrm", CONFIGURATION | change)


def test_unknown_application_or_import_path_is_refused(template):
    with pytest.raises(ValueError, match=r"no application 'nope'.*diffusion, dlrm"):
        configure_serve_config(template, "nope", CONFIGURATION)
    with pytest.raises(ValueError, match="has no shortcut knobs"):
        apply_knobs({"name": "x", "import_path": "other.app:build"}, CONFIGURATION)


def test_autoscaling_gives_way_to_num_replicas_and_the_input_is_not_modified(template):
    app = _app(template, "dlrm")
    app["deployments"][0]["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 4}
    app["deployments"][0].pop("num_replicas")
    configured = apply_knobs(app, CONFIGURATION)
    assert "autoscaling_config" not in configured["deployments"][0]
    assert "autoscaling_config" in app["deployments"][0] and "runtime_env" not in app["deployments"][0]
    ServeDeploySchema.model_validate({"applications": [configured]})


@pytest.mark.parametrize(("app_name", "accelerator"), [("dlrm", "gpu"), ("diffusion", "cpu")])
def test_written_yaml_loads_back_and_passes_autoconfig_check(template, tmp_path, app_name, accelerator):
    configured = configure_serve_config(
        template, app_name, CONFIGURATIONS[app_name] | {"device_share": 0.5}, accelerator=accelerator,
        gpu_share_mode="mps"
    )
    path = tmp_path / "tuned.yaml"
    write_serve_config(configured, path)
    assert ServeDeploySchema.model_validate(yaml.safe_load(path.read_text())) == configured
    assert load_serve_config(path).model_dump(exclude_unset=True) == configured.model_dump(exclude_unset=True)
    assert autoconfig_main(["check", str(path)]) == 0


def _trial_schema(template: ServeDeploySchema, app_name: str, configuration: dict, accelerator: str = "cpu"):
    return trial.trial_application(template, app_name, configuration, accelerator=accelerator,
                                   gpu_share_mode="memory",
                                   name="autoconfig-trial", route_prefix="/autoconfig-trial")


def _trial_app(template: ServeDeploySchema, app_name: str, configuration: dict) -> dict:
    return _trial_schema(template, app_name, configuration).model_dump(mode="json", exclude_unset=True)


@pytest.mark.parametrize(
    ("app_name", "change"),
    [
        ("dlrm", {"max_batch_size": 8}),
        ("dlrm", {"batch_wait_timeout_s": 0.0}),
        ("dlrm", {"num_replicas": 1}),
        ("dlrm", {"max_batch_size": 4, "batch_wait_timeout_s": 0.1, "num_replicas": 5}),
        ("diffusion", {"max_batch_size": 8}),
        ("diffusion", {"num_replicas": 1}),
        ("diffusion", {"max_batch_size": 4, "num_replicas": 5}),
    ],
)
def test_batching_and_replica_changes_update_the_trial_app_in_place(template, app_name, change):
    deployed = _trial_app(template, app_name, CONFIGURATIONS[app_name])
    new = _trial_app(template, app_name, CONFIGURATIONS[app_name] | change)
    assert new != deployed  # user_config, max_ongoing_requests or num_replicas differ...
    assert not trial._restarts_replicas(deployed, new)  # ...all of which Serve applies to running replicas
    assert not trial._restarts_replicas(deployed, deployed)


@pytest.mark.parametrize(
    "change",
    [
        {"device_share": 0.8},  # ray_actor_options.num_cpus, and args.model.torch_threads (1, not 2)
        {"device_share": 1.7},  # num_cpus and the enforced share: round(1.7) == round(1.6) == 2 threads
        {"torch_threads": 3},
    ],  # args.model.torch_threads only
)
def test_resource_or_args_changes_restart_replicas(template, change):
    deployed = _trial_app(template, "dlrm", CONFIGURATION)
    assert trial._restarts_replicas(deployed, _trial_app(template, "dlrm", CONFIGURATION | change))


def test_replica_restarts_are_seen_in_any_deployment_and_in_the_app_itself(template):
    deployed = _trial_app(template, "dlrm", CONFIGURATION)
    shard = copy.deepcopy(deployed)
    next(d for d in shard["deployments"] if d["name"] == "EmbeddingShard_0")["ray_actor_options"]["num_cpus"] = 0.2
    assert trial._restarts_replicas(deployed, shard)
    env = copy.deepcopy(deployed)
    env["runtime_env"] = {"env_vars": {"X": "1"}}
    assert trial._restarts_replicas(deployed, env)
    # Deployments are matched by name, not by their position in the list.
    reordered = copy.deepcopy(deployed)
    reordered["deployments"].reverse()
    assert not trial._restarts_replicas(deployed, reordered)


@pytest.fixture
def two_cpus(monkeypatch):
    monkeypatch.setattr(trial.ray, "cluster_resources", lambda: {"CPU": 2.0})


def _fits(template: ServeDeploySchema, app_name: str, configuration: dict, accelerator: str = "cpu") -> None:
    trial._check_cluster_fits(_trial_schema(template, app_name, configuration, accelerator), accelerator)


@pytest.mark.usefixtures("two_cpus")
def test_cluster_fit_counts_every_deployment_of_the_app(template):
    # DLRM: dense 3 x 0.6 + two shards x 0.1 = 2.0 CPUs, exactly the cluster.
    _fits(template, "dlrm", CONFIGURATION | {"device_share": 0.6})
    # 3 x 0.62 = 1.86 alone would fit; with the shards' 0.2 it does not.
    with pytest.raises(ValueError) as error:
        _fits(template, "dlrm", CONFIGURATION | {"device_share": 0.62})
    message = str(error.value)
    assert "needs 2.06 CPU" in message and "the cluster has 2" in message
    assert "DisaggregatedDLRM 1.86" in message
    assert "EmbeddingShard_0 0.1" in message and "EmbeddingShard_1 0.1" in message
    assert "ShardDirectory" not in message  # needs nothing
    # Diffusion: ingress 0.1 + tiny 1 x 1.1 + its ControlNet 0.2 + sdxl-tiny's 0.3 and 0.1 + flux-tiny's 0.2 = 2.0
    # fits; 2 replicas do not.
    _fits(template, "diffusion", DIFFUSION | {"device_share": 1.1, "num_replicas": 1})
    with pytest.raises(
        ValueError,
        match=r"needs 3\.1 CPU \(ImagesIngress 0\.1, DiffusionModel_tiny 2\.2, ControlNet_edges_tiny 0\.2, "
        r"DiffusionModel_sdxl-tiny 0\.3, ControlNet_edges-xl_sdxl-tiny 0\.1, DiffusionModel_flux-tiny 0\.2\); "
        r"the cluster has 2",
    ):
        _fits(template, "diffusion", DIFFUSION | {"device_share": 1.1, "num_replicas": 2})


@pytest.mark.usefixtures("two_cpus")
def test_cluster_fit_on_gpu_counts_gpus_of_which_a_cpu_cluster_has_none(template):
    with pytest.raises(ValueError, match=r"needs 0\.75 GPU \(DisaggregatedDLRM 0\.75\); the cluster has 0"):
        _fits(template, "dlrm", CONFIGURATION | {"device_share": 0.25}, accelerator="gpu")


@pytest.mark.usefixtures("two_cpus")
def test_cluster_fit_of_the_bank_template_which_reserves_cpus_only_for_the_model(template):
    bank = load_serve_config(BANK_CONFIG)
    _fits(bank, "dlrm-tiny-disaggregated", CONFIGURATION | {"device_share": 1.0, "num_replicas": 2})
    _fits(bank, "diffusion-tiny", DIFFUSION | {"device_share": 2.0, "num_replicas": 1})
    with pytest.raises(ValueError, match=r"\(MonolithicDLRM 3\)"):
        _fits(bank, "dlrm-small", CONFIGURATION | {"device_share": 1.0, "num_replicas": 3})


def test_dotted_knobs_set_the_deployment_entries_they_name_after_the_shortcuts(template):
    joint = CONFIGURATION | {"EmbeddingShard_0.num_replicas": 2, "EmbeddingShard_0.ray_actor_options.num_cpus": 0.5,
                             "DisaggregatedDLRM.max_ongoing_requests": 7, "ShardDirectory.user_config.note": "x"}
    app = _app(configure_serve_config(template, "dlrm", joint), "dlrm")
    deployments = _deployments(app)
    shard = deployments["EmbeddingShard_0"]
    assert shard["num_replicas"] == 2 and "autoscaling_config" not in shard
    # A CPU share set through a path is enforced like the shortcut's: the replica reads the variable.
    assert shard["ray_actor_options"]["num_cpus"] == 0.5
    assert shard["ray_actor_options"]["runtime_env"]["env_vars"]["SWIFTSERVE_CPU_SHARE"] == "0.5"
    assert deployments["DisaggregatedDLRM"]["max_ongoing_requests"] == 7  # the path overrides the shortcut's 64
    assert deployments["DisaggregatedDLRM"]["num_replicas"] == 3  # the shortcuts still apply
    assert deployments["ShardDirectory"]["user_config"]["note"] == "x"
    untouched = _deployments(_app(template, "dlrm"))["EmbeddingShard_1"]
    assert deployments["EmbeddingShard_1"] == untouched


@pytest.mark.parametrize(("mode", "env"), [
    ("mps", {"SWIFTSERVE_CUDA_MEMORY_FRACTION": "0.25", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}),
    ("memory", {"SWIFTSERVE_CUDA_MEMORY_FRACTION": "0.25"}), ("schedule", {})])
def test_a_dotted_gpu_count_is_a_share_divided_as_its_mode_says(template, mode, env):
    """The ControlNet services of diffusion-joint on a GPU: each replica's quarter GPU is capped like the model's."""
    knob = {"ControlNet_*.ray_actor_options.num_gpus": 0.25}
    app = _app(configure_serve_config(template, "diffusion", knob, accelerator="gpu", gpu_share_mode=mode), "diffusion")
    for name in ("ControlNet_edges_tiny", "ControlNet_edges-xl_sdxl-tiny"):
        actor = _deployments(app)[name]["ray_actor_options"]
        assert actor["num_gpus"] == 0.25
        assert actor.get("runtime_env", {}).get("env_vars", {}) == env


def test_a_gpu_trial_does_not_turn_a_dotted_cpu_count_into_an_enforced_share(template):
    app = _app(configure_serve_config(template, "dlrm", {"EmbeddingShard_0.ray_actor_options.num_cpus": 0.5},
                                      accelerator="gpu"), "dlrm")
    actor = _deployments(app)["EmbeddingShard_0"]["ray_actor_options"]
    assert actor["num_cpus"] == 0.5 and "SWIFTSERVE_CPU_SHARE" not in actor.get("runtime_env", {}).get("env_vars", {})


def test_check_space_names_the_knob_or_value_the_app_cannot_take(template):
    from autoconfig.knobs import check_space
    from autoconfig.space import SearchSpace, SpaceError

    def space(**knobs) -> SearchSpace:
        return SearchSpace.parse({"knobs": knobs})

    check_space(template, "dlrm", space(**{"EmbeddingShard_0.num_replicas": {"values": [1, 2]}}))
    with pytest.raises(SpaceError, match=r"knobs\.EmbeddingShard_0\.num_replicas\.values\[0\] = 0: Serve refuses"):
        check_space(template, "dlrm", space(**{"EmbeddingShard_0.num_replicas": {"values": [1, 0]}}))
    with pytest.raises(SpaceError, match=r"knobs\.EmbeddingShard_0\.health_check_period_s\.x: "
                                         r"'health_check_period_s' takes a value, not keys"):
        check_space(template, "dlrm", space(**{"EmbeddingShard_0.health_check_period_s.x": {"values": [1]}}))
    with pytest.raises(SpaceError, match=r"knobs\.Dense\.num_replicas: application 'dlrm' lists no deployment"):
        check_space(template, "dlrm", space(**{"Dense.num_replicas": {"values": [1]}}))


@pytest.mark.parametrize(("space_name", "app_name"), [("dlrm-joint", "dlrm"), ("diffusion-joint", "diffusion")])
def test_the_shipped_joint_spaces_fit_the_shipped_apps(template, space_name, app_name):
    from autoconfig.knobs import check_space
    from autoconfig.space import SearchSpace

    space = SearchSpace.default(space_name)
    accelerator = "cpu" if app_name == "dlrm" else "gpu"
    check_space(template, app_name, space, accelerator=accelerator)
    last = space.configurations()[-1]
    configured = configure_serve_config(template, app_name, last, accelerator=accelerator)
    deployments = _deployments(_app(configured, app_name))
    if app_name == "dlrm":  # the shard pool moves with the dense pool
        args = validate_app_args(next(a for a in configured.applications if a.name == "dlrm"))
        assert args.embedding.replicas_per_shard == last["args.embedding.replicas_per_shard"] == 2
        assert args.embedding.torch_threads == last["args.embedding.torch_threads"] == 2
        for shard in ("EmbeddingShard_0", "EmbeddingShard_1"):
            assert deployments[shard]["ray_actor_options"]["num_cpus"] == 0.5
            assert deployments[shard]["ray_actor_options"]["runtime_env"]["env_vars"]["SWIFTSERVE_CPU_SHARE"] == "0.5"
    else:  # the pattern names every model's ControlNets
        for name in ("ControlNet_edges_tiny", "ControlNet_edges-xl_sdxl-tiny"):
            assert deployments[name]["num_replicas"] == last["ControlNet_*.num_replicas"] == 2
    assert deployments[{"dlrm": "DisaggregatedDLRM", "diffusion": "DiffusionModel_tiny"}[app_name]]["num_replicas"] == (
        last["num_replicas"])


def test_an_args_knob_the_builder_refuses_is_named(template):
    from autoconfig.knobs import check_space
    from autoconfig.space import SearchSpace, SpaceError

    space = SearchSpace.parse({"knobs": {"args.embedding.replicas_per_shard": {"values": [1, 100]}}})
    with pytest.raises(SpaceError, match=r"knobs\.args\.embedding\.replicas_per_shard\.values\[1\] = 100: .*"
                                         r"embedding\.replicas_per_shard"):
        check_space(template, "dlrm", space)


@pytest.mark.parametrize("import_path", ["serving.app:build_multi_app", "serving.app:build_app"])
def test_a_shortcut_the_app_does_not_read_is_refused_naming_it(template, import_path):
    """The diffusion engine batches at step boundaries: a batching timer would change nothing, so it is refused."""
    app = _app(template, "diffusion")
    if import_path == "serving.app:build_app":
        app.update(import_path=import_path, args=app["args"]["models"][0], deployments=[])
    with pytest.raises(ValueError, match=rf"^knob batch_wait_timeout_s: no deployment of {import_path} reads it "
                                         r"\(its shortcuts: device_share, max_batch_size, num_replicas, "
                                         r"torch_threads\); drop it from the space$"):
        apply_knobs(app, CONFIGURATION)


def test_check_space_refuses_a_knob_no_deployment_reads_shortcut_or_user_config_key(template):
    from autoconfig.knobs import check_space
    from autoconfig.space import SearchSpace, SpaceError

    timer = SearchSpace.parse({"knobs": {name: {"values": [value]} for name, value in CONFIGURATION.items()}})
    check_space(template, "dlrm", timer)  # the DLRM app reads it
    with pytest.raises(SpaceError, match=r"^knobs\.batch_wait_timeout_s: no deployment of serving\.app:build_multi_app"
                                         r" reads it"):
        check_space(template, "diffusion", timer)
    path = SearchSpace.parse({"knobs": {"DiffusionModel_tiny.user_config.batch_wait_timeout_s": {"values": [0.01]}}})
    with pytest.raises(SpaceError, match=r"^knobs\.DiffusionModel_tiny\.user_config\.batch_wait_timeout_s: "
                                         r"deployments\[\d\]\.user_config\.batch_wait_timeout_s: the deployment "
                                         r"does not read it \(DiffusionModel_tiny's user_config takes "
                                         r"max_batch_rows, continuous_batching"):
        check_space(template, "diffusion", path)
    rows = SearchSpace.parse({"knobs": {"DiffusionModel_tiny.user_config.max_batch_rows": {"values": [2, 4]}}})
    check_space(template, "diffusion", rows)  # a key its reconfigure reads


def test_the_shipped_spaces_hold_only_knobs_their_apps_read(template):
    from autoconfig.knobs import check_space
    from autoconfig.space import SearchSpace

    for name, app_name in (("dlrm", "dlrm"), ("dlrm-joint", "dlrm"), ("diffusion", "diffusion"),
                           ("diffusion-joint", "diffusion")):
        check_space(template, app_name, SearchSpace.default(name))
    assert "batch_wait_timeout_s" not in SearchSpace.default("diffusion").knob_names
    assert SearchSpace.default("diffusion").size == 35  # 5 batch sizes x 7 (share, replicas) pairs on one GPU
