"""The deployment files in deploy/: Serve configs, the KubeRay RayService manifest, the Dockerfile.

Nothing is deployed or built: Serve configs go through ``load_serve_config`` / ``parse_serve_config`` (Ray's
``ServeDeploySchema`` plus each builder's ``args`` model) and Serve's own application builder (which only binds
deployments); the manifest through the RayService CRD's OpenAPI v3 schema (vendored in deploy/kuberay/), made
strict about unknown fields as the API server's strict field validation is; the Dockerfile and Makefile as text.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from ray.serve._private.build_app import build_app as serve_build_app
from ray.serve.schema import ServeDeploySchema

from autoconfig.serve_config import (
    ServeConfigError,
    import_builder,
    load_serve_config,
    parse_serve_config,
)
from serving.common.allocator import TUNED_MALLOC_ENV, untuned_settings
from tests.helpers import REPO

DEPLOY = REPO / "deploy"
SERVE_CONFIGS = sorted(DEPLOY.glob("*.yaml"))
GPU_CONFIG = DEPLOY / "serve_config.gpu.yaml"
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
CONSTRAINTS = REPO / "constraints.txt"
CRD_SCHEMA = DEPLOY / "kuberay" / "rayservice-crd-v1.schema.json"  # the CRD's v1 schema, vendored
SHARED_CRD = REPO.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"  # the full CRD, where present
IMAGE_NAME = "swiftserve"


# --- helpers -------------------------------------------------------------------------------------------------

def _manifest() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE.read_text())


def _strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that lists its properties and does not
    keep unknown fields: what the API server's strict field validation (kubectl's default) rejects."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        schema["additionalProperties"] = False
    return schema


@pytest.fixture(scope="module")
def rayservice_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(json.loads(CRD_SCHEMA.read_text())))


@pytest.mark.skipif(not SHARED_CRD.is_file(), reason="no full CRD beside the repository to compare the copy with")
def test_the_vendored_crd_schema_is_the_published_v1_schema():
    crd = yaml.safe_load(SHARED_CRD.read_text())
    version = next(version for version in crd["spec"]["versions"] if version["name"] == "v1")
    assert json.loads(CRD_SCHEMA.read_text()) == version["schema"]["openAPIV3Schema"]


def _schema_errors(validator: jsonschema.Draft7Validator, manifest: dict[str, Any]) -> list[str]:
    """Every violation as ``field.path[index]: message``, sorted by field."""
    def where(error: jsonschema.ValidationError) -> str:
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path)
        return path.lstrip(".") or "<root>"
    def short(message: str) -> str:  # messages quote the offending value, which may be a whole Serve config
        return message if len(message) <= 240 else f"{message[:100]} ... {message[-100:]}"
    return sorted(f"{where(error)}: {short(error.message)}" for error in validator.iter_errors(manifest))


def _quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as a number (``500m`` -> 0.5, ``8`` -> 8, ``16Gi`` -> bytes)."""
    text = str(value)
    for suffix, factor in (("m", 1e-3), ("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _pod_capacity(group: dict[str, Any]) -> dict[str, float]:
    """What Ray sees on one pod of a group: CPUs and GPUs from rayStartParams or the Ray container's limits
    (CPUs rounded up, as KubeRay does), custom resources from ``rayStartParams.resources``."""
    params = group.get("rayStartParams", {})
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    capacity = {
        "CPU": float(params["num-cpus"]) if "num-cpus" in params else math.ceil(_quantity(limits.get("cpu", 0))),
        "GPU": float(params["num-gpus"]) if "num-gpus" in params else _quantity(limits.get("nvidia.com/gpu", 0)),
    }
    if "resources" in params:
        # KubeRay puts the value on the `ray start` shell command line: the shell strips the outer quotes and
        # the backslashes, and Ray parses what is left as JSON.
        (json_text,) = shlex.split(params["resources"])
        custom = yaml.safe_load(json_text)
        assert isinstance(custom, dict), f"rayStartParams.resources is not a JSON object: {params['resources']!r}"
        capacity.update({name: float(amount) for name, amount in custom.items()})
    return capacity


def _groups(manifest: dict[str, Any]) -> Iterator[tuple[str, int, dict[str, float]]]:
    """(group name, pods, capacity of one pod) for the head and every worker group."""
    cluster = manifest["spec"]["rayClusterConfig"]
    yield "head", 1, _pod_capacity(cluster["headGroupSpec"])
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], int(group.get("replicas", group["minReplicas"])), _pod_capacity(group)


def _replica_demands(config: ServeDeploySchema) -> dict[str, tuple[int, dict[str, float]]]:
    """``app/deployment`` -> (replicas, what one replica asks of a node), as Serve resolves them: the config's
    ``ray_actor_options`` replace the code's whole, with ``num_cpus`` 1 when left out."""
    demands = {}
    for app in config.applications:
        built = serve_build_app(import_builder(app.import_path)(app.args), name=app.name)
        overrides = {deployment.name: deployment.model_dump(exclude_unset=True) for deployment in app.deployments}
        for deployment in built.deployments:
            override = overrides.get(deployment.name, {})
            options = dict(override.get("ray_actor_options", deployment.ray_actor_options or {}))
            replicas = override.get("num_replicas", deployment.num_replicas) or 1
            demand = {"CPU": 1.0 if options.get("num_cpus") is None else float(options["num_cpus"]),
                      "GPU": float(options.get("num_gpus") or 0)}
            demand.update({name: float(amount) for name, amount in (options.get("resources") or {}).items()})
            demands[f"{app.name}/{deployment.name}"] = (int(replicas), demand)
    return demands


def _pip_installs(commands: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in shell text, in order, without output and index options
    (``--quiet``, shell expansions such as an optional ``--index-url``)."""
    installs = []
    for segment in re.split(r"&&|;|\n", commands.replace("\\\n", " ")):
        match = re.search(r"-m pip install (.*)", segment)
        if match:
            words = [word for word in shlex.split(match.group(1)) if word not in ("--quiet", "-q") and "$" not in word]
            installs.append(words)
    return installs


def _makefile_install_recipe() -> str:
    """The Makefile's install recipe, its ``$(TORCH_PIN)`` replaced by the pin."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^\$\(INSTALLED\):.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "Makefile has no $(INSTALLED) recipe"
    torch_pin = re.search(r"^TORCH_PIN := (\S+)$", makefile, re.MULTILINE)
    assert torch_pin, "Makefile sets no TORCH_PIN"
    return recipe.group(1).replace("$(TORCH_PIN)", torch_pin.group(1))


def _dockerfile_instructions(name: str) -> list[str]:
    """Arguments of every Dockerfile instruction ``name`` (continuation lines joined, comments dropped)."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [match.group(1).strip() for match in re.finditer(rf"^{name}\s+(.*)$", joined, re.MULTILINE)]


# --- Serve configs ---------------------------------------------------------------------------------------------

def test_deploy_holds_the_local_and_gpu_configs():
    assert {path.name for path in SERVE_CONFIGS} >= {"serve_config.yaml", "serve_config.gpu.yaml"}


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda path: path.name)
def test_serve_config_is_valid_and_names_only_real_deployments(path: Path):
    config = load_serve_config(path)
    for app in config.applications:
        built = serve_build_app(import_builder(app.import_path)(app.args), name=app.name)
        unknown = {deployment.name for deployment in app.deployments} - {d.name for d in built.deployments}
        assert not unknown, f"{path.name}: {app.name} has no deployment(s) {sorted(unknown)}"


_EVERY_APP_CONFIG = [*SERVE_CONFIGS, *sorted((DEPLOY / "examples").glob("*.yaml")),
                     REPO / "benchmarks" / "autoconfig_bank" / "serve_config.yaml"]


@pytest.mark.parametrize("path", _EVERY_APP_CONFIG, ids=lambda path: path.name)
def test_every_application_starts_its_replicas_with_the_tuned_malloc_settings(path: Path):
    # at the application's level, since a deployment's ray_actor_options in the config replace the code's
    config = load_serve_config(path)
    assert all(untuned_settings((app.runtime_env or {}).get("env_vars", {})) == {}
               for app in config.applications), path.name


def test_every_replica_deployment_asks_for_the_tuned_malloc_settings_in_code():
    from disagg.deployments import disaggregated, monolithic, shards
    from serving.deployments import cfg_worker, controlnet, model, model_group

    replicas = [model.DiffusionModel, model_group.DiffusionModelGroup, cfg_worker.CFGWorkerDeployment,
                controlnet.ControlNetService,
                monolithic.MonolithicDLRM, shards.EmbeddingShardServer, disaggregated.DisaggregatedDLRM]
    assert all(replica.ray_actor_options["runtime_env"]["env_vars"] == TUNED_MALLOC_ENV for replica in replicas)


def test_gpu_example_loads_local_weights_and_places_by_resources():
    config = load_serve_config(GPU_CONFIG)
    apps = {app.name: app for app in config.applications}
    diffusion, dlrm = apps["diffusion"].args, apps["dlrm"].args
    assert diffusion["model"]["preset"] is None and diffusion["model"]["path"].startswith("/")
    assert all(c["preset"] is None and c["path"].startswith("/") for c in diffusion["controlnets"])
    assert dlrm["embedding"]["bind_host"] == "node"
    demands = _replica_demands(config)
    for name in ("diffusion/DiffusionModel", "dlrm/DisaggregatedDLRM"):
        assert 0 < demands[name][1]["GPU"] < 1, f"{name} should hold a fractional GPU"
    # parallel CFG pays only on a GPU of its own: a whole GPU, and the whole dense-pool unit of its node
    assert diffusion["engine"]["cfg_parallel"] is True
    assert demands["diffusion/CFGWorker"][1]["GPU"] == 1 and demands["diffusion/CFGWorker"][1]["dense_pool"] == 1
    custom = {name: set(demand) - {"CPU", "GPU"} for name, (_, demand) in demands.items()}
    placed = [name for name in demands if name.split("/")[1].startswith(("ControlNet_", "EmbeddingShard_"))]
    assert len(placed) == len(diffusion["controlnets"]) + dlrm["embedding"]["num_shards"]
    assert all(custom[name] for name in placed), {name: custom[name] for name in placed}


# --- KubeRay RayService ---------------------------------------------------------------------------------------

def test_rayservice_matches_the_crd_schema(rayservice_validator):
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert _schema_errors(rayservice_validator, manifest) == []


def test_rayservice_serve_config_is_valid_and_is_the_gpu_example():
    serve_config = _manifest()["spec"]["serveConfigV2"]
    assert isinstance(serve_config, str)
    parse_serve_config(serve_config, source="serveConfigV2")
    assert yaml.safe_load(serve_config) == yaml.safe_load(GPU_CONFIG.read_text())


def test_worker_groups_offer_what_every_deployment_asks():
    manifest = _manifest()
    config = parse_serve_config(manifest["spec"]["serveConfigV2"], source="serveConfigV2")
    demands = _replica_demands(config)
    groups = list(_groups(manifest))
    workers = [capacity for name, _, capacity in groups if name != "head"]
    for name, (_, demand) in demands.items():
        for resource, amount in demand.items():
            if resource != "CPU" and amount > 0:
                assert any(capacity.get(resource, 0) > 0 for capacity in workers), \
                    f"{name} asks for {resource}, which no worker group offers"
        fits = [group for group, _, capacity in groups
                if all(amount <= capacity.get(resource, 0) for resource, amount in demand.items())]
        assert fits, f"one replica of {name} ({demand}) fits no pod of any group"
    needed: dict[str, float] = {}
    for replicas, demand in demands.values():
        for resource, amount in demand.items():
            needed[resource] = needed.get(resource, 0) + replicas * amount
    offered: dict[str, float] = {}
    for _, pods, capacity in groups:
        for resource, amount in capacity.items():
            offered[resource] = offered.get(resource, 0) + pods * amount
    short = {resource: (amount, offered.get(resource, 0)) for resource, amount in needed.items()
             if amount > offered.get(resource, 0) + 1e-9}
    assert not short, f"the cluster offers less than the deployments need (needed, offered): {short}"


def test_worker_group_sizes_are_consistent():
    for group in _manifest()["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        requests = group["template"]["spec"]["containers"][0]["resources"]["requests"]
        assert requests == limits, f"{group['groupName']}: Ray sees limits only; requests should match them"


def test_rayservice_uses_the_project_image_and_a_supported_ray_version():
    manifest = _manifest()
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {container["image"] for pod in pods for container in pod["template"]["spec"]["containers"]}
    assert len(images) == 1 and next(iter(images)).split(":")[0] == IMAGE_NAME, images
    assert f"-t {next(iter(images))}" in DOCKERFILE.read_text(), "the Dockerfile's build line should tag this image"
    pyproject = (REPO / "pyproject.toml").read_text()
    ray_pin = re.search(r'"ray\[serve\]([^"]*)"', pyproject).group(1)
    assert Version(cluster["rayVersion"]) in SpecifierSet(ray_pin)


@pytest.mark.parametrize(("break_it", "field", "message"), [
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].update(
        rayStartParam=m["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].pop("rayStartParams")),
     "spec.rayClusterConfig.workerGroupSpecs[1]", "'rayStartParam' was unexpected"),
    (lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
     "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus", "is not of type 'string'"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="four"),
     "spec.rayClusterConfig.workerGroupSpecs[0].replicas", "is not of type 'integer'"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"),
     "spec.rayClusterConfig.workerGroupSpecs[0]", "'groupName' is a required property"),
    (lambda m: m["spec"].update(serveConfigV2=yaml.safe_load(m["spec"]["serveConfigV2"])),
     "spec.serveConfigV2", "is not of type 'string'"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
        imagePullPolicy=["Always"]),
     "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].imagePullPolicy",
     "is not of type 'string'"),
], ids=["misspelled-field", "number-for-string", "string-for-integer", "missing-required", "serve-config-not-string",
        "pod-template-field"])
def test_broken_manifest_is_caught_naming_the_field(rayservice_validator, break_it, field, message):
    manifest = copy.deepcopy(_manifest())
    break_it(manifest)
    errors = _schema_errors(rayservice_validator, manifest)
    assert any(error.startswith(f"{field}: ") and message in error for error in errors), errors


def test_broken_serve_config_v2_is_caught_naming_the_field():
    raw = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])
    raw["applications"][1]["args"]["embedding"]["bind_host"] = "every node"
    named = r"^serveConfigV2: applications\[1\] \(dlrm\): args\.embedding\.bind_host"
    with pytest.raises(ServeConfigError, match=named):
        parse_serve_config(yaml.safe_dump(raw), source="serveConfigV2")
    raw = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])
    raw["applications"][0]["deployments"][1]["ray_actor_options"]["num_gpus"] = "half"
    with pytest.raises(ServeConfigError, match=r"^serveConfigV2: .*num_gpus"):
        parse_serve_config(raw, source="serveConfigV2")


# --- Dockerfile -----------------------------------------------------------------------------------------------

def test_dockerfile_installs_like_the_makefile():
    make = _pip_installs(_makefile_install_recipe())
    docker = _pip_installs("\n".join(_dockerfile_instructions("RUN")))
    assert docker == make, f"Dockerfile pip installs {docker} differ from the Makefile's {make}"
    torch_pins = [word for words in make for word in words if word.startswith("torch==")]
    editable = [words for words in make if "-e" in words]
    assert len(torch_pins) == 1 and len(editable) == 1, make
    assert make.index([torch_pins[0]]) < make.index(editable[0]), "torch must be installed before the project"
    assert editable[0][:2] == ["-c", CONSTRAINTS.name], "the project must install at the pinned versions"


# --- constraints.txt ------------------------------------------------------------------------------------------

def _constraint_lines() -> list[tuple[Requirement, str]]:
    """Every pin of constraints.txt as a requirement, with its line."""
    lines = [line.strip() for line in CONSTRAINTS.read_text().splitlines()]
    return [(Requirement(line), line) for line in lines if line and not line.startswith("#")]


def test_constraints_pin_exact_versions_and_leave_torch_to_its_pin():
    text = CONSTRAINTS.read_text()
    assert "#    make constraints" in text, "constraints.txt should say which command refreshes it"
    pins = _constraint_lines()
    assert len(pins) > 100, "constraints.txt should pin the whole environment, not only the direct dependencies"
    for requirement, line in pins:
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==", f"not an exact pin: {line}"
        assert requirement.name != "torch", "torch is installed first at the Makefile's TORCH_PIN"


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12"])
def test_constraints_satisfy_every_bound_of_pyproject(python: str):
    """Each dependency pyproject.toml names (runtime and every extra) is pinned, for this Python, to a version
    its bounds admit: a bound raised without `make constraints` fails here."""
    environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                   "platform_machine": "x86_64"}
    pinned: dict[str, Version] = {}
    for requirement, _ in _constraint_lines():
        if requirement.marker is None or requirement.marker.evaluate(environment):
            pinned[canonicalize_name(requirement.name)] = Version(next(iter(requirement.specifier)).version)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(item for extra in project["optional-dependencies"].values()
                                            for item in extra)]
    checked = 0
    for text in declared:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name in ("torch", "swiftserve") or not (requirement.marker is None
                                                   or requirement.marker.evaluate(environment)):
            continue
        assert name in pinned, f"{name} is declared in pyproject.toml but constraints.txt does not pin it"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside pyproject's {requirement}: run `make constraints`")
        checked += 1
    assert checked > 30


def test_dockerfile_base_image_ports_and_command():
    assert "BASE_IMAGE=python:3.11-slim" in _dockerfile_instructions("ARG")
    assert _dockerfile_instructions("FROM") == ["${BASE_IMAGE}"]
    assert "nvidia/cuda:" in DOCKERFILE.read_text(), "the CUDA base image should be documented"
    exposed = {port for ports in _dockerfile_instructions("EXPOSE") for port in ports.split()}
    assert {"8000", "9000", "8265", "6379"} <= exposed
    assert _dockerfile_instructions("CMD") == ['["serve", "run", "deploy/serve_config.yaml"]']
    assert "COPY . /app" in [f"COPY {args}" for args in _dockerfile_instructions("COPY")]


def test_dockerfile_host_override_applies_to_the_local_config():
    """The image's copy of deploy/serve_config.yaml must listen on all interfaces: the Dockerfile's sed has to
    match the config's host line (the build also checks it with grep)."""
    sed = next(re.search(r"sed -i '([^']*)' deploy/serve_config\.yaml", run)
               for run in _dockerfile_instructions("RUN") if "sed -i" in run)
    assert sed, "no host override of deploy/serve_config.yaml in the Dockerfile"
    _, pattern, replacement, _ = sed.group(1).split("/")  # s/PATTERN/REPLACEMENT/ in basic regex syntax
    original = (DEPLOY / "serve_config.yaml").read_text()
    overridden, count = re.subn(pattern, replacement, original, flags=re.MULTILINE)
    assert count == 1
    assert parse_serve_config(overridden, source="image config").http_options.host == "0.0.0.0"


def test_dockerignore_keeps_local_environments_out():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    assert not ignored & {"serving", "disagg", "autoconfig", "deploy", "pyproject.toml", "constraints.txt", "README.md"}


def test_the_default_config_serves_both_base_models_each_with_its_own_named_deployments():
    """`make serve`: `tiny` (the default: first), `sdxl-tiny` and `flux-tiny` behind one ingress, and the DLRM
    app."""
    config = load_serve_config(DEPLOY / "serve_config.yaml")
    apps = {app.name: app for app in config.applications}
    assert [(entry["model"]["name"], entry["model"]["preset"]) for entry in apps["diffusion"].args["models"]] == [
        ("tiny", "tiny"), ("sdxl-tiny", "sdxl-tiny"), ("flux-tiny", "flux-tiny")]
    built = {name: {deployment.name for deployment in serve_build_app(
        import_builder(app.import_path)(app.args), name=name).deployments} for name, app in apps.items()}
    assert built == {
        "diffusion": {"ImagesIngress", "DiffusionModel_tiny", "ControlNet_edges_tiny", "DiffusionModel_sdxl-tiny",
                      "ControlNet_edges-xl_sdxl-tiny", "DiffusionModel_flux-tiny"},
        "dlrm": {"DisaggregatedDLRM", "EmbeddingShard_0", "EmbeddingShard_1", "ShardDirectory"},
    }
    # Every deployment is listed, so its CPUs are the config's, not the code's default.
    assert {name: {d.name for d in app.deployments} for name, app in apps.items()} == built


def test_the_default_config_fits_two_cpus():
    """`make serve` and CI run on 2 cores: Ray must place every replica of both apps."""
    demands = _replica_demands(load_serve_config(DEPLOY / "serve_config.yaml"))
    cpus = sum(replicas * demand["CPU"] for replicas, demand in demands.values())
    assert cpus <= 2.0 + 1e-9, demands
    assert {resource for _, demand in demands.values() for resource, amount in demand.items() if amount} == {"CPU"}


@pytest.mark.parametrize(("engine", "device_map", "deployed"), [
    ({}, None, False),
    ({}, {"model": [[0]], "cfg_worker": [[1]]}, True),
    ({}, {"model": [[0]], "cfg_worker": [[0]]}, False),
    ({"cfg_parallel": True}, None, True),
])
def test_the_app_deploys_a_cfg_worker_only_where_it_is_chosen(engine, device_map, deployed):
    from serving.app import build_app

    args = {"model": {"preset": "tiny"}, "engine": engine, "device_map": device_map}
    names = {deployment.name for deployment in serve_build_app(build_app(args), name="diffusion").deployments}
    assert ("CFGWorker" in names) is deployed
    assert {"ImagesIngress", "DiffusionModel"} <= names


class _AnyServicer:
    """Has every method a servicer function looks up (Serve's proxy registers such a stand-in)."""

    def __getattr__(self, name: str) -> Any:
        return lambda request, context: None


class _CapturingServer:
    """What a servicer function registers on a gRPC server: service name -> method names."""

    def __init__(self) -> None:
        self.services: dict[str, set[str]] = {}

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.services.setdefault(service, set()).update(handlers)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:  # grpcio's older registration path
        for handler in handlers:
            for path in getattr(handler, "_method_handlers", {}):
                service, method = path.strip("/").split("/")
                self.services.setdefault(service, set()).add(method)


@pytest.mark.parametrize("path", [DEPLOY / "serve_config.yaml", GPU_CONFIG], ids=lambda path: path.name)
def test_configs_with_a_dlrm_app_serve_oip_over_grpc_on_the_exposed_port(path):
    config = load_serve_config(path)
    [function] = config.grpc_options.grpc_servicer_functions
    module, _, name = function.rpartition(".")
    server = _CapturingServer()
    getattr(importlib.import_module(module), name)(_AnyServicer(), server)
    assert server.services == {"inference.GRPCInferenceService": {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"}}
    exposed = {port for ports in _dockerfile_instructions("EXPOSE") for port in ports.split()}
    assert str(config.grpc_options.port) in exposed
