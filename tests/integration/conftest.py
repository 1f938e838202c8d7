"""One Ray cluster per test session, with both applications of deploy/serve_config.yaml deployed.

The config is the one `make serve` uses, deployed through the same Serve controller path as `serve run`; the HTTP and
gRPC ports are swapped for free ones. Its processes authenticate with a token (``tests/integration/__init__.py``), as on
a cluster started with `ray start --head`. The cluster is `ray.cluster_utils.Cluster`: the head (2 CPUs) plus two
simulated nodes without CPUs, a "CPU pool" node offering the custom resource `embedding_pool` and a "GPU pool" node
offering `dense_pool`; the DLRM app's embedding shards and dense replicas are placed on them by those resources, as on a
real cluster. The diffusion app serves `tiny` (the default model, `DEFAULT_MODEL`, which most tests use) and
`sdxl-tiny`, whose deployments take a sliver of CPU here so autoconfig trials fit beside the session's apps. Variants
added for the tests: `diffusion-cfg` (/cfg), `diffusion-shared` (/shared: `tiny` and `sdxl-tiny` in one
`DiffusionModelGroup`), `dlrm-mono` (/mono/v2, the same DLRM served monolithically) and `dlrm-secure` (/secure/v2, the
same DLRM with its shards on every interface behind mutual TLS and a shared token, and a hot-embedding cache).
"""

import copy
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve.schema import ServeDeploySchema

from autoconfig.serve_config import deploy_serve_config, load_serve_config
from serving.common.net import free_port
from serving.preset_catalog import preset_weights
from tests.helpers import REPO
from tests.helpers.pki import PKI, SERVER_NAME, make_pki

POOLS = {"embedding": "embedding_pool", "dense": "dense_pool"}  # custom resources of the simulated pool nodes
DLRM_LOOKUP_TIMEOUT_S = 2.0
#: The shared token of `dlrm-secure`'s embedding service, fresh each session; only that app's processes get it.
SECURE_TOKEN = f"it-{secrets.token_hex(16)}"
#: The diffusion app's first model, where requests naming no `model` go, and the other one; each model's deployments
#: carry its name: `DiffusionModel_<model>`, `ControlNet_<name>_<model>`, `CFGWorker_<model>`.
DEFAULT_MODEL, SDXL_MODEL, FLUX_MODEL = "tiny", "sdxl-tiny", "flux-tiny"


@pytest.fixture(scope="session")
def lora_dir(tmp_path_factory) -> Path:
    """The diffusion app's LoRA directory: the tiny preset's trained LoRAs and one corrupt file."""
    directory = tmp_path_factory.mktemp("serve-loras")
    for path in (preset_weights("tiny") / "loras").glob("*.safetensors"):
        shutil.copyfile(path, directory / path.name)
    (directory / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    return directory


@pytest.fixture(scope="session")
def embedding_pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """Certificates of `dlrm-secure`'s embedding service (absolute paths every replica on this machine reads)."""
    return make_pki(tmp_path_factory.mktemp("embedding-pki"))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The session's cluster; it authenticates with the token ``tests.integration`` put in the environment."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "object_store_memory": 128 * 2**20,
    })
    for pool in POOLS.values():
        cluster.add_node(num_cpus=0, resources={pool: 100}, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def pool_nodes(cluster: Cluster) -> dict[str, str]:
    """Node id of each simulated pool node, by pool resource name."""
    return {pool: next(node["NodeID"] for node in ray.nodes() if node["Alive"] and pool in node["Resources"])
            for pool in POOLS.values()}


@pytest.fixture(scope="session")
def grpc_port() -> int:
    """Serve's gRPC port this session (OIP v2 over gRPC); the apps answer on it once ``base_url`` is up."""
    return free_port()


@pytest.fixture(scope="session")
def base_url(cluster: Cluster, lora_dir: Path, embedding_pki: PKI, grpc_port: int) -> Iterator[str]:
    config = load_serve_config(REPO / "deploy" / "serve_config.yaml")
    config.http_options.host = "127.0.0.1"
    config.http_options.port = free_port()
    config.grpc_options.port = grpc_port
    diffusion = next(app for app in config.applications if app.name == "diffusion")
    models = {entry["model"]["name"]: entry for entry in diffusion.args["models"]}
    assert list(models) == [DEFAULT_MODEL, SDXL_MODEL, FLUX_MODEL], list(models)
    models[DEFAULT_MODEL].setdefault("lora", {})["directory"] = str(lora_dir)
    for entry in models.values():
        entry.setdefault("engine", {})["remote_timeout_s"] = 10.0  # fault tests wait less
    config = _with_shared_replicas_variant(_with_parallel_cfg_variant(_with_other_model_slivers(config)))
    config = _with_dlrm_pools_and_monolithic_variant(config)
    config = _with_secured_dlrm_variant(config, embedding_pki)
    try:
        deploy_serve_config(config, timeout_s=600)
        yield f"http://127.0.0.1:{config.http_options.port}"
    finally:
        serve.shutdown()


def _with_other_model_slivers(config: ServeDeploySchema) -> ServeDeploySchema:
    """`sdxl-tiny`'s and `flux-tiny`'s deployments in the diffusion app at 0.02 CPU each, so autoconfig trials fit
    beside."""
    raw = config.model_dump(exclude_unset=True)
    diffusion = next(app for app in raw["applications"] if app["name"] == "diffusion")
    for deployment in diffusion["deployments"]:
        if deployment["name"].endswith((f"_{SDXL_MODEL}", f"_{FLUX_MODEL}")):
            deployment.setdefault("ray_actor_options", {})["num_cpus"] = 0.02
    return ServeDeploySchema.model_validate(raw)


def _with_parallel_cfg_variant(config: ServeDeploySchema) -> ServeDeploySchema:
    """Adds `diffusion-cfg` at /cfg: the diffusion app's `tiny` model alone with `engine.cfg_parallel` (a
    `CFGWorker_tiny` deployment), two `DiffusionModel_tiny` replicas sharing one ControlNet deployment, each given a
    sliver of CPU so the 2-CPU cluster can place them."""
    raw = config.model_dump(exclude_unset=True)
    diffusion = next(app for app in raw["applications"] if app["name"] == "diffusion")
    variant = copy.deepcopy(diffusion)
    variant.update(name="diffusion-cfg", route_prefix="/cfg")
    variant["args"]["models"] = [next(entry for entry in variant["args"]["models"]
                                      if entry["model"]["name"] == DEFAULT_MODEL)]
    variant["args"]["models"][0].setdefault("engine", {})["cfg_parallel"] = True
    variant["deployments"] = [
        {"name": name, "num_replicas": replicas, "ray_actor_options": {"num_cpus": 0.02}}
        for name, replicas in (("ImagesIngress", 1), (f"DiffusionModel_{DEFAULT_MODEL}", 2),
                               (f"CFGWorker_{DEFAULT_MODEL}", 1), (f"ControlNet_edges_{DEFAULT_MODEL}", 1))
    ]
    raw["applications"].append(variant)
    return ServeDeploySchema.model_validate(raw)


def _with_shared_replicas_variant(config: ServeDeploySchema) -> ServeDeploySchema:
    """Adds `diffusion-shared` at /shared: the diffusion app's `tiny` and `sdxl-tiny` with `shared_replicas`, one
    `DiffusionModelGroup` replica holding both, each model with its own ControlNet deployment; slivers of CPU."""
    raw = config.model_dump(exclude_unset=True)
    diffusion = next(app for app in raw["applications"] if app["name"] == "diffusion")
    variant = copy.deepcopy(diffusion)
    variant.update(name="diffusion-shared", route_prefix="/shared")
    variant["args"]["models"] = [entry for entry in variant["args"]["models"]
                                 if entry["model"]["name"] in (DEFAULT_MODEL, SDXL_MODEL)]
    variant["args"]["shared_replicas"] = True
    controlnets = [f"ControlNet_{controlnet['name']}_{entry['model']['name']}" for entry in variant["args"]["models"]
                   for controlnet in entry.get("controlnets", [])]
    variant["deployments"] = [{"name": name, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.02}}
                              for name in ("ImagesIngress", "DiffusionModelGroup", *controlnets)]
    raw["applications"].append(variant)
    return ServeDeploySchema.model_validate(raw)


def _with_dlrm_pools_and_monolithic_variant(config: ServeDeploySchema) -> ServeDeploySchema:
    """The `dlrm` app with two replicas per shard, shards on the CPU-pool node and the dense replica on the
    GPU-pool node (by custom resources); and `dlrm-mono` at /mono/v2: the same model, monolithic."""
    raw = config.model_dump(exclude_unset=True)
    dlrm = next(app for app in raw["applications"] if app["name"] == "dlrm")
    mono = copy.deepcopy(dlrm)
    embedding = dlrm["args"].setdefault("embedding", {})
    embedding.update(replicas_per_shard=2, bind_host="node", lookup_timeout_s=DLRM_LOOKUP_TIMEOUT_S)
    for deployment in dlrm["deployments"]:
        deployment.pop("num_replicas", None)
        pool = POOLS["dense"] if deployment["name"] == "DisaggregatedDLRM" else POOLS["embedding"]
        deployment["ray_actor_options"] = {"num_cpus": 0, "resources": {pool: 1}}
    mono.update(name="dlrm-mono", route_prefix="/mono/v2")
    mono["args"]["serving"] = "monolithic"
    mono["deployments"] = [{"name": "MonolithicDLRM", "ray_actor_options": {"num_cpus": 0.05}}]
    raw["applications"].append(mono)
    return ServeDeploySchema.model_validate(raw)


def _with_secured_dlrm_variant(config: ServeDeploySchema, pki: PKI) -> ServeDeploySchema:
    """Adds `dlrm-secure` at /secure/v2: the `dlrm` app with one replica per shard bound to 0.0.0.0 (an exposed
    address: the shards refuse it without TLS or a token), serving mutual TLS with a certificate naming only
    `embedding.internal` and demanding `SECURE_TOKEN`, which only this app's processes get, by its runtime_env
    (beside the malloc settings), and with a hot-embedding cache in its dense replica. No pool resources: each
    deployment takes a sliver of the head's CPUs."""
    raw = config.model_dump(exclude_unset=True)
    dlrm = next(app for app in raw["applications"] if app["name"] == "dlrm")
    secure = copy.deepcopy(dlrm)
    token = {"SWIFTSERVE_EMBEDDING_TOKEN": SECURE_TOKEN}
    secure.update(name="dlrm-secure", route_prefix="/secure/v2",
                  runtime_env={"env_vars": dlrm["runtime_env"]["env_vars"] | token})
    secure["args"].setdefault("embedding", {}).update(
        replicas_per_shard=1, bind_host="0.0.0.0", tls_cert_file=str(pki.named_cert),
        tls_key_file=str(pki.named_key), tls_ca_file=str(pki.ca), tls_server_name=SERVER_NAME, tls_client_auth=True,
        cache={"max_bytes": 262144},
    )
    secure["deployments"] = [{"name": deployment["name"], "ray_actor_options": {"num_cpus": 0.01}}
                             for deployment in dlrm["deployments"]]
    raw["applications"].append(secure)
    return ServeDeploySchema.model_validate(raw)


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client
